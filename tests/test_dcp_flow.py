"""A torchtitan-shaped run under ``pipeload.dcp.install()``, in one real gloo world of 4 ranks (each its
own emulated host, so replicated boxes are read once and broadcast).

The trainer's checkpointing is DCP's API only: an ``AppState``-style ``Stateful`` holding an FSDP2-over-TP
model (dp 2 x tp 2) and its AdamW state through ``get_state_dict`` / ``set_state_dict``, plus the step;
``dcp.async_save`` every few steps (on pipeload's save, in DCP's layout); then a restart in another layout (FSDP2 over all 4 ranks) that resumes
with ``dcp.load(checkpoint_id=...)``. The resumed weights, optimizer state and step equal the run that
did not restart (as full tensors, bit for bit), and so does stock DCP's load of the same checkpoint; the
switch's loads ran on pipeload's engine.
"""

from __future__ import annotations

import os
import warnings

import torch
import torch.distributed as dist
from torch import nn

from pipeload.tools._world import run_world

WORLD_TIMEOUT = 150
SAVE_EVERY, STEPS = 2, 4


class _MLP(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.w1, self.norm, self.w2 = nn.Linear(16, 32), nn.LayerNorm(32), nn.Linear(32, 16)


class _AppState:
    """DCP's ``Stateful`` protocol over a model, its optimizer and the step, as torchtitan's checkpointer."""

    def __init__(self, model, optim):
        self.model, self.optim, self.step = model, optim, 0

    def state_dict(self):
        from torch.distributed.checkpoint.state_dict import get_state_dict

        model, optim = get_state_dict(self.model, self.optim)
        return {"model": model, "optim": optim, "step": self.step}

    def load_state_dict(self, sd):
        from torch.distributed.checkpoint.state_dict import set_state_dict

        set_state_dict(self.model, self.optim, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
        self.step = sd["step"]


def _build(two_d: bool) -> _AppState:
    """The model in a layout: FSDP2 over TP on a 2 x 2 mesh, or FSDP2 over the 4 ranks."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    model = _MLP()
    if two_d:
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        model = parallelize_module(model, mesh["tp"], {"w1": ColwiseParallel(), "w2": RowwiseParallel()})
        model = fully_shard(model, mesh=mesh["dp"])
    else:
        model = fully_shard(model, mesh=init_device_mesh("cpu", (4,)))
    return _AppState(model, torch.optim.AdamW(model.parameters(), lr=0.05))


def _train_step(app: _AppState) -> None:
    """A deterministic update, the same in every layout (gradients set, not computed: no forward)."""
    app.step += 1
    for i, p in enumerate(app.model.parameters()):
        p.grad = torch.full_like(p, 0.01 * app.step + 0.001 * i)
    app.optim.step()
    app.optim.zero_grad()


def _full(sd) -> dict:
    """Every leaf of a (nested) state dict as a full tensor or a plain value, by dotted key."""
    out = {}
    for k, v in (sd.items() if isinstance(sd, dict) else enumerate(sd)):
        if isinstance(v, (dict, list)):
            out.update({f"{k}.{kk}": vv for kk, vv in _full(v).items()})
        else:
            out[str(k)] = v.full_tensor() if hasattr(v, "full_tensor") else v
    return out


def _equal(a: dict, b: dict, what: str) -> int:
    a, b = _full(a), _full(b)
    assert a.keys() == b.keys(), f"rank {dist.get_rank()} {what}: keys {sorted(a.keys() ^ b.keys())}"
    for k, x in a.items():
        same = torch.equal(x, b[k]) if isinstance(x, torch.Tensor) else x == b[k]
        assert same, f"rank {dist.get_rank()} {what}: {k} differs"
    return len(a)


def _first_run(root: str) -> dict:
    """Train 2-D, ``dcp.async_save`` under the switch every SAVE_EVERY steps; the state at the last save."""
    import torch.distributed.checkpoint as dcp

    import pipeload.dcp as pd

    app = _build(two_d=True)
    futures, at_save = [], None
    with pd.installed():
        for _ in range(STEPS):
            _train_step(app)
            if app.step % SAVE_EVERY == 0:
                for f in futures:
                    f.result()
                futures = [dcp.async_save({"app": app}, checkpoint_id=os.path.join(root, f"step-{app.step}"))]
                at_save = _full(app.state_dict())  # (the snapshot was taken in the call)
                saved = pd.last_save_stats()
                assert saved.path == "engine", saved
        for f in futures:
            f.result()
    return at_save


def world(rank: int, size: int, root: str) -> dict:
    import torch.distributed.checkpoint as dcp

    import pipeload.dcp as pd

    warnings.filterwarnings("ignore")
    expect = _first_run(root)
    dist.barrier()
    path = os.path.join(root, f"step-{STEPS}")
    resumed = _build(two_d=False)
    with pd.installed():
        dcp.load({"app": resumed}, checkpoint_id=path)
        last = pd.last_load()
    out = {"path": last.path, "received": last.load.bytes_received if last.load else 0,
           "step": resumed.step, "leaves": _equal(resumed.state_dict(), expect, "resumed under the switch")}
    stock = _build(two_d=False)
    dcp.load({"app": stock}, checkpoint_id=path)
    _equal(stock.state_dict(), expect, "stock dcp.load")
    _train_step(resumed)  # and it trains on
    return out


def test_a_torchtitan_shaped_run_resumes_in_another_layout_through_the_switch(tmp_path):
    results = run_world(world, 4, str(tmp_path), timeout=WORLD_TIMEOUT, separate_hosts=True)
    for r in results:
        assert r["path"] == "engine" and r["step"] == STEPS and r["leaves"] >= 13, r
    assert sum(r["received"] for r in results) > 0, results  # replicated boxes (the steps) read once
