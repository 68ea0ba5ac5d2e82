"""What trainers pass: ``nn.Module.state_dict()`` (an ``OrderedDict``), modules parallelised with
``parallelize_module`` and ``fully_shard`` (each, and FSDP2 over TP), ``get_state_dict(model, optimizer)``, and nested state dicts
mixing ``dict`` subclasses at every depth — saved and loaded (first and reused plan) on a real world.

One world of 4 gloo ranks (separate hosts emulated, so replicated shards are broadcast) runs every
sub-case; a failing assertion comes back as that rank's traceback.
"""

from __future__ import annotations

import asyncio
import os
import random
from collections import OrderedDict, defaultdict

import pytest
import torch
import torch.distributed as dist
from torch import nn

import pipeload
from pipeload.tools._world import run_world

import layouts as L

WORLD_TIMEOUT = 180


class UserDict(dict):
    """A user's own dict subclass, iterating in reverse insertion order (its own order, not storage's)."""

    def __iter__(self):
        return iter(list(super().__iter__())[::-1])

    def keys(self):
        return list(self)

    def items(self):
        return [(k, self[k]) for k in self]

    def values(self):
        return [self[k] for k in self]


def _rewrap(node, rng: random.Random):
    """``node`` with every dict replaced by a random choice of dict, OrderedDict, defaultdict, UserDict."""
    if isinstance(node, dict):
        kind = rng.choice([dict, OrderedDict, "defaultdict", UserDict])
        out = defaultdict(list) if kind == "defaultdict" else kind()
        for k, v in node.items():
            out[k] = _rewrap(v, rng)
        return out
    if isinstance(node, list):
        return [_rewrap(v, rng) for v in node]
    return node


class MLP(nn.Module):
    def __init__(self, seed: int):
        super().__init__()
        torch.manual_seed(seed)
        self.w1 = nn.Linear(16, 32)
        self.norm = nn.LayerNorm(32)
        self.w2 = nn.Linear(32, 16)

    def forward(self, x):
        return self.w2(self.norm(self.w1(x)).relu())


def _full(t):
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _same(a: dict, b: dict, what: str) -> None:
    assert list(a) == list(b), f"rank {dist.get_rank()} {what}: keys {list(a)} != {list(b)}"
    for k in a:
        assert torch.equal(_full(a[k]), _full(b[k])), f"rank {dist.get_rank()} {what}: {k} differs"


def _load_twice(sd, path, what):
    """A first load and a reused one (after zeroing every tensor); both must give the saved values."""
    first = pipeload.load(sd, path)
    assert not first.plan_reused
    snapshot = {k: _full(v).clone() for k, v in sd.items()}
    for v in sd.values():
        if isinstance(v, torch.Tensor):
            (v.to_local() if hasattr(v, "to_local") else v).zero_()
    second = pipeload.load(sd, path)
    assert second.plan_reused, f"rank {dist.get_rank()} {what}: the second load did not reuse its plan"
    _same(snapshot, sd, what + " (reused plan)")
    return first


def _plain_module(root: str) -> dict:
    src = MLP(0)
    path = os.path.join(root, "plain")
    pipeload.save(src.state_dict(), path)
    dst = MLP(1)
    sd = dst.state_dict()
    assert type(sd) is OrderedDict
    _load_twice(sd, path, "plain module")
    _same(src.state_dict(), dst.state_dict(), "plain module")
    return {}


def _tp_module(root: str, mesh) -> dict:
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    plan = {"w1": ColwiseParallel(), "w2": RowwiseParallel()}
    src = parallelize_module(MLP(0), mesh["tp"], plan)
    path = os.path.join(root, "tp")
    pipeload.save(src.state_dict(), path)
    dst = parallelize_module(MLP(1), mesh["tp"], plan)
    stats = _load_twice(dst.state_dict(), path, "tp module")
    _same(src.state_dict(), dst.state_dict(), "tp module")
    plain = MLP(2)  # resharded into whole tensors on every rank
    pipeload.load(plain.state_dict(), path)
    _same(src.state_dict(), plain.state_dict(), "tp -> plain")
    return {"tp_received": stats.bytes_received}


def _fsdp_module(root: str) -> dict:
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))

    def trained(seed: int):
        model = fully_shard(MLP(seed), mesh=mesh)
        optim = torch.optim.AdamW(model.parameters(), lr=0.1)
        torch.manual_seed(100 + seed)
        model(torch.randn(4, 16)).sum().backward()
        optim.step()
        return model, optim

    src, src_optim = trained(0)
    path = os.path.join(root, "fsdp")
    pipeload.save(src.state_dict(), path)
    dst, _ = trained(1)
    _load_twice(dst.state_dict(), path, "fsdp module")
    _same(src.state_dict(), dst.state_dict(), "fsdp module")

    msd, osd = get_state_dict(src, src_optim)
    both = os.path.join(root, "fsdp-optim")
    pipeload.save({"model": msd, "optim": osd}, both)
    dst2, dst2_optim = trained(2)
    msd2, osd2 = get_state_dict(dst2, dst2_optim)
    target = {"model": msd2, "optim": osd2}
    pipeload.load(target, both)
    _same(msd, msd2, "get_state_dict model")
    for fqn, state in osd["state"].items():
        _same(state, osd2["state"][fqn], f"get_state_dict optim {fqn}")
    assert osd2["param_groups"] == osd["param_groups"]
    return {}


def _two_d_module(root: str, mesh) -> dict:
    """FSDP2 over TP (``fully_shard`` on a ``parallelize_module``d model): the column-parallel weights are
    ``(_StridedShard(0, sf=2), Shard(0))``, optimizer state alike. Saved and loaded 2D, resharded to whole
    tensors, loaded from the TP-only checkpoint of :func:`_tp_module` and from a torch DCP checkpoint."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    def trained(seed: int):
        model = parallelize_module(MLP(seed), mesh["tp"], {"w1": ColwiseParallel(), "w2": RowwiseParallel()})
        model = fully_shard(model, mesh=mesh["dp"])
        optim = torch.optim.AdamW(model.parameters(), lr=0.1)
        for p in model.parameters():  # (the column-parallel output is sharded: no plain forward here)
            p.grad = torch.full_like(p, 0.01 * (seed + 1))
        optim.step()
        return model, optim

    src, src_optim = trained(0)
    strided = [k for k, v in src.state_dict().items()
               if any(type(p).__name__ == "_StridedShard" for p in getattr(v, "placements", ()))]
    assert strided, f"rank {dist.get_rank()}: no strided placement in {src.state_dict()}"
    path = os.path.join(root, "2d")
    pipeload.save(src.state_dict(), path)
    dst, _ = trained(1)
    _load_twice(dst.state_dict(), path, "2d module")
    _same(src.state_dict(), dst.state_dict(), "2d module")
    plain = MLP(2)
    pipeload.load(plain.state_dict(), path)
    _same(src.state_dict(), plain.state_dict(), "2d -> plain")
    from_tp, _ = trained(3)
    pipeload.load(from_tp.state_dict(), os.path.join(root, "tp"))
    _same(MLP(0).state_dict(), from_tp.state_dict(), "tp -> 2d")

    msd, osd = get_state_dict(src, src_optim)
    both = os.path.join(root, "2d-optim")
    pipeload.save({"model": msd, "optim": osd}, both)
    dst2, dst2_optim = trained(4)
    msd2, osd2 = get_state_dict(dst2, dst2_optim)
    pipeload.load({"model": msd2, "optim": osd2}, both)
    _same(msd, msd2, "2d get_state_dict model")
    for fqn, state in osd["state"].items():
        _same(state, osd2["state"][fqn], f"2d get_state_dict optim {fqn}")

    dcp_path = os.path.join(root, "2d-dcp")
    dcp.save(src.state_dict(), checkpoint_id=dcp_path)
    dst3, _ = trained(5)
    pipeload.load(dst3.state_dict(), dcp_path)
    _same(src.state_dict(), dst3.state_dict(), "dcp 2d -> 2d")
    return {"strided": len(strided)}


def _mixed_containers(root: str, meshes) -> dict:
    """Random layouts, every dict a random subclass on save and another on load (same seed per rank)."""
    reused = 0
    for case in range(4):
        rng = random.Random(case)
        sd, layout = L.random_build(rng, meshes, fill=True)
        path = os.path.join(root, f"mixed-{case}")
        pipeload.save(_rewrap(sd, rng), path)
        dst = _rewrap(L.random_build(rng, meshes, fill=False, layout=layout)[0], rng)
        pipeload.load(dst, path)
        L.check_values(dst)
        for _, v in L.flat_items(dst):
            if isinstance(v, torch.Tensor):
                (v.to_local() if hasattr(v, "to_local") else v).zero_()
        stats = asyncio.run(pipeload.load_async(dst, path))
        reused += stats.plan_reused
        L.check_values(dst)
    return {"mixed_reused": reused}


def _refusals(root: str) -> dict:
    msgs = {}
    for what, call in [("load", lambda x: pipeload.load(x, os.path.join(root, "plain"))),
                       ("save", lambda x: pipeload.save(x, os.path.join(root, "never")))]:
        for bad in ([torch.zeros(1)], None, (("w", torch.zeros(1)),)):
            with pytest.raises(TypeError) as e:
                call(bad)
            msgs[f"{what}-{type(bad).__name__}"] = str(e.value)
    assert not os.path.exists(os.path.join(root, "never"))
    return msgs


def user_world(rank: int, world: int, root: str) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    meshes = L.Meshes(world)
    out: dict = {}
    out.update(_plain_module(root))
    mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("dp", "tp"))
    out.update(_tp_module(root, mesh))
    out.update(_two_d_module(root, mesh))
    out.update(_fsdp_module(root))
    out.update(_mixed_containers(root, meshes))
    out.update(_refusals(root))
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("user"))
    return run_world(user_world, 4, root, timeout=WORLD_TIMEOUT, separate_hosts=True)


def test_module_state_dicts_load_on_every_rank(results):
    # every sub-case asserted inside the ranks; the TP load broadcast its replicated shards
    assert sum(r["tp_received"] for r in results) > 0


def test_fsdp_over_tp_strided_placements(results):
    # asserted inside the ranks: saved, loaded 2D (first and reused plan), into whole tensors, from TP only,
    # with the optimizer's state, from torch DCP
    assert all(r["strided"] >= 2 for r in results)


def test_mixed_dict_subclasses_reuse_plans(results):
    assert all(r["mixed_reused"] == 4 for r in results)


def test_non_mappings_are_refused_with_a_type_error(results):
    for r in results:
        assert "list" in r["load-list"] and "OrderedDict" in r["load-list"]
        assert "NoneType" in r["save-NoneType"] and "tuple" in r["save-tuple"]
