"""A state dict of 100,000 small tensors (the leaf count of a large MoE model's optimizer state) saves and
loads in a 2-rank world on separate (emulated) hosts, every value checked; the plan time per rank is
printed and bounded loosely (the bench's ``--tensors`` knob measures it properly).

``PIPELOAD_TEST_TENSORS`` changes the count (default 100000)."""

from __future__ import annotations

import os
import time

import pytest
import torch

N = int(os.environ.get("PIPELOAD_TEST_TENSORS", "100000"))
WIDTHS = (1, 3, 8, 16)  # elements per tensor, cycled: small and of several sizes


def _values(n: int) -> tuple[torch.Tensor, list[int]]:
    """All tensors' values concatenated (distinct everywhere), and each tensor's length."""
    lengths = [WIDTHS[i % len(WIDTHS)] for i in range(n)]
    flat = torch.arange(sum(lengths), dtype=torch.float32) * 0.5 + 1.0
    return flat, lengths


def _state(n: int, fill: bool) -> dict:
    flat, lengths = _values(n)
    parts = torch.split(flat if fill else torch.zeros_like(flat), lengths)
    # Three levels of nesting, like an optimizer state: state.<param>.<kind>
    state: dict = {}
    for i, t in enumerate(parts):
        state.setdefault(f"p{i // 2}", {})["exp_avg" if i % 2 == 0 else "exp_avg_sq"] = t.clone()
    return {"optim": {"state": state}, "step": 7}


def _flat(sd: dict) -> torch.Tensor:
    st = sd["optim"]["state"]
    return torch.cat([st[f"p{i // 2}"]["exp_avg" if i % 2 == 0 else "exp_avg_sq"] for i in range(N)])


def _world(rank: int, world: int, directory: str) -> dict:
    import torch.distributed as dist

    import pipeload

    src = _state(N, fill=True)
    t0 = time.perf_counter()
    pipeload.save(src, directory)
    dist.barrier()
    save_s = time.perf_counter() - t0
    dest = _state(N, fill=False)
    dest["step"] = None
    t0 = time.perf_counter()
    stats = pipeload.load(dest, directory, reuse_plan=False)
    load_s = time.perf_counter() - t0
    expected, _ = _values(N)
    got = _flat(dest)
    bad = int((got != expected).sum())
    return {
        "save_s": save_s,
        "load_s": load_s,
        "plan_s": stats.timings.get("plan", 0.0),
        "exchange_s": stats.timings.get("exchange", 0.0),
        "mismatched": bad,
        "step": dest["step"],
        "broadcasts": stats.broadcasts,
        "bytes_read": stats.bytes_read,
    }


@pytest.mark.timeout(240)
def test_hundred_thousand_small_tensors_round_trip(tmp_path):
    from pipeload.tools._world import run_world

    out = run_world(_world, 2, str(tmp_path / "ck"), timeout=180, separate_hosts=True)
    for rank, r in enumerate(out):
        print(f"[{N} tensors] rank {rank}: save {r['save_s']:.2f} s, load {r['load_s']:.2f} s, "
              f"plan {r['plan_s']:.3f} s, exchange {r['exchange_s']:.3f} s, broadcasts {r['broadcasts']}")
        assert r["mismatched"] == 0, (rank, r)
        assert r["step"] == 7
        # loose: planning is linear in the leaves, a few seconds at most even on a busy 2-core machine
        assert r["plan_s"] < 15.0, (rank, r)
    # separate hosts: every replicated byte read once in all, the other rank gets it by broadcast
    _, lengths = _values(N)
    tensor_bytes = sum(lengths) * 4
    assert tensor_bytes <= sum(r["bytes_read"] for r in out) <= tensor_bytes + 64 * 1024  # + the objects
