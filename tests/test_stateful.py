"""``Stateful`` values (torch.distributed.checkpoint's protocol) in pipeload.load / load_async / save.

The wrappers are the ones torch's DCP tutorial writes: a model wrapper and an optimizer wrapper whose
``state_dict()`` / ``load_state_dict()`` go through ``torch.distributed.checkpoint.state_dict``. They
must load the values ``dcp.load`` gives them, at any depth of the dict, and ``load_state_dict`` must
not run when the load fails.
"""

from __future__ import annotations

import asyncio

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (get_model_state_dict, get_optimizer_state_dict,
                                                     set_model_state_dict, set_optimizer_state_dict)
from torch.distributed.checkpoint.stateful import Stateful

import pipeload
from pipeload.engine.stateful import expand, is_stateful

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")


class ModelState(Stateful):
    def __init__(self, model: nn.Module):
        self.model, self.loads = model, 0

    def state_dict(self):
        return get_model_state_dict(self.model)

    def load_state_dict(self, state_dict):
        self.loads += 1
        set_model_state_dict(self.model, state_dict)


class OptimState(Stateful):
    def __init__(self, model: nn.Module, optim: torch.optim.Optimizer):
        self.model, self.optim, self.loads = model, optim, 0

    def state_dict(self):
        return get_optimizer_state_dict(self.model, self.optim)

    def load_state_dict(self, state_dict):
        self.loads += 1
        set_optimizer_state_dict(self.model, self.optim, state_dict)


def _trained(seed: int, steps: int):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 3))
    optim = torch.optim.AdamW(model.parameters(), lr=0.01)
    for _ in range(steps):
        model(torch.randn(4, 6)).square().sum().backward()
        optim.step()
        optim.zero_grad()
    return model, optim


def _values(model, optim) -> dict:
    return {"model": {k: v.clone() for k, v in model.state_dict().items()},
            "optim": {k: {n: (t.clone() if isinstance(t, torch.Tensor) else t) for n, t in s.items()}
                      for k, s in optim.state_dict()["state"].items()},
            "groups": optim.state_dict()["param_groups"]}


def _assert_same(a, b) -> None:
    assert a.keys() == b.keys()
    for k in a:
        if isinstance(a[k], dict):
            _assert_same(a[k], b[k])
        elif isinstance(a[k], torch.Tensor):
            assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k
        else:
            assert a[k] == b[k], k


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    model, optim = _trained(0, 3)
    root = tmp_path_factory.mktemp("stateful")
    dcp.save({"model": ModelState(model), "optim": OptimState(model, optim)}, checkpoint_id=str(root / "dcp"))
    # pipeload's own save, the wrappers one level down
    pipeload.save({"app": {"model": ModelState(model), "optim": OptimState(model, optim)}, "step": 3},
                  root / "native")
    return root, _values(model, optim)


def _fresh():
    model, optim = _trained(1, 1)  # other values, the optimizer state already allocated
    return model, optim, ModelState(model), OptimState(model, optim)


def test_wrappers_load_what_dcp_load_gives(saved):
    root, expect = saved
    m1, o1, ms1, os1 = _fresh()
    dcp.load({"model": ms1, "optim": os1}, checkpoint_id=str(root / "dcp"))
    m2, o2, ms2, os2 = _fresh()
    sd = {"model": ms2, "optim": os2}
    pipeload.load(sd, root / "dcp")
    assert sd["model"] is ms2 and sd["optim"] is os2  # the caller's dict keeps its values
    assert (ms2.loads, os2.loads) == (1, 1)
    _assert_same(_values(m1, o1), _values(m2, o2))
    _assert_same(expect, _values(m2, o2))


def test_nested_wrappers_and_objects_async(saved):
    root, expect = saved
    m, o, ms, os_ = _fresh()
    sd = {"app": {"model": ms, "optim": os_}, "step": 0}
    asyncio.run(pipeload.load_async(sd, root / "native"))
    assert sd["step"] == 3 and sd["app"]["model"] is ms  # a Python leaf written back beside the wrappers
    assert (ms.loads, os_.loads) == (1, 1)
    _assert_same(expect, _values(m, o))


def test_failed_load_calls_no_load_state_dict(saved, tmp_path):
    root, _ = saved
    m, o, ms, os_ = _fresh()
    before = _values(m, o)
    with pytest.raises(pipeload.PipeloadError):
        pipeload.load({"model": ms, "optim": os_, "missing": torch.zeros(2)}, root / "dcp")
    assert (ms.loads, os_.loads) == (0, 0)
    with pytest.raises(pipeload.PipeloadError):
        pipeload.load({"model": ms}, tmp_path / "nothing-here")
    assert ms.loads == 0
    _assert_same(before["optim"], _values(m, o)["optim"])


def test_expand_leaves_plain_state_dicts_alone():
    sd = {"a": torch.zeros(2), "b": {"c": [1, 2], "d": torch.ones(1)}, "e": nn.Linear}
    assert expand(sd) == (sd, None)
    assert not is_stateful(nn.Linear) and is_stateful(nn.Linear(2, 2))
    inner = {"m": nn.Linear(2, 2)}
    outer = {"x": inner, "y": torch.zeros(1)}
    out, done = expand(outer)
    assert out is not outer and out["x"] is not inner and out["y"] is outer["y"]
    assert set(out["x"]["m"]) == {"weight", "bias"} and inner["m"] is done.found[0][0]
