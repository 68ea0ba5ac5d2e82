"""``pipeload bench --save --via dcp.save``: DCP's save API under ``pipeload.dcp.install()``, side by side.

One local gloo world (TP x DP over :mod:`pipeload.tools.synth`'s state dict) runs, in turns, one of
each per round for ``repeats`` rounds (medians reported; the first round of each background kind is
its warm-up and is left out):

- ``memcpy floor``: every rank copies the bytes its file holds once, all ranks at once, into a buffer
  allocated and touched before (what a snapshot must at least pay);
- ``pipeload.save`` (blocking, pipeload's own format) and ``pipeload background``
  (``pipeload.save(background=True)``: blocked, and until ``wait()`` returned);
- ``dcp.save (engine)``: ``dcp.save(sd, checkpoint_id=...)`` under ``install()`` (pipeload's planner,
  DCP's layout), and ``dcp.save (stock)``: the same call, switch off;
- ``dcp.async_save (engine)`` and ``dcp.async_save (stock)``: the time the caller is blocked, and
  the time until the returned future's result (the commit) on every rank.

Then the check: the engine's checkpoint is loaded by stock ``dcp.load`` (switch off) into a zeroed
state dict of the same layout and compared with the saved values, every tensor bit for bit and every
Python value. Times of a collective step are from a barrier before to a barrier after (the slowest
rank); the time blocked is each rank's own.
"""

from __future__ import annotations

import os
import statistics
import time
from typing import Any

from .save import MiB, SaveBenchConfig, _settled, _timed, run_ranks


def _exact(saved: dict, loaded: dict) -> int:
    """Bit-for-bit comparison of two state dicts of :mod:`pipeload.tools.synth` (DTensors by local shard);
    the number of tensors compared. Raises on the first difference."""
    import torch
    from torch.distributed.checkpoint._nested_dict import flatten_state_dict
    from torch.distributed.tensor import DTensor

    a, b = flatten_state_dict(saved)[0], flatten_state_dict(loaded)[0]
    if a.keys() != b.keys():
        raise AssertionError(f"keys differ: {sorted(a.keys() ^ b.keys())[:5]}")
    n = 0
    for k, x in a.items():
        y = b[k]
        if isinstance(x, torch.Tensor):
            x, y = (t.to_local() if isinstance(t, DTensor) else t for t in (x, y))
            if x.dtype != y.dtype or x.shape != y.shape or not torch.equal(x.reshape(-1).view(torch.uint8), y.reshape(-1).view(torch.uint8)):
                raise AssertionError(f"{k}: stock dcp.load read other values than were saved")
            n += 1
        elif x != y:
            raise AssertionError(f"{k}: {y!r} read, {x!r} saved")
    return n


def _async(sd: dict, path: str) -> tuple[float, Any]:
    import torch.distributed.checkpoint as dcp

    t0 = time.perf_counter()
    fut = dcp.async_save(sd, checkpoint_id=path)
    return time.perf_counter() - t0, fut


def _round(sd: dict, here, runs: dict, src, dst, warm: bool) -> None:
    """One of each step, in turns."""
    import torch.distributed.checkpoint as dcp

    import pipeload
    import pipeload.dcp as pd

    def record(name: str, seconds: float, **extra: Any) -> None:
        if not warm:
            runs.setdefault(name, []).append({"seconds": seconds, **extra})

    _settled()
    t0 = time.perf_counter()
    dst.copy_(src)
    record("memcpy floor", time.perf_counter() - t0)
    record("pipeload.save", _timed(lambda: pipeload.save(sd, here("pipeload")))[0])
    got: dict = {}

    def background() -> None:
        t0 = time.perf_counter()
        handle = pipeload.save(sd, here("background"), background=True)
        got["blocked"] = time.perf_counter() - t0
        handle.wait()

    record("pipeload background", _timed(background)[0], blocked=got["blocked"])
    with pd.installed():
        took, _, _ = _timed(lambda: dcp.save(sd, checkpoint_id=here("engine")))
        assert pd.last_save_stats().path == "engine", pd.last_save_stats()
        record("dcp.save (engine)", took)
    record("dcp.save (stock)", _timed(lambda: dcp.save(sd, checkpoint_id=here("stock")))[0])
    for label, on in (("dcp.async_save (engine)", True), ("dcp.async_save (stock)", False)):
        got: dict = {}

        def step() -> None:
            got["blocked"], fut = _async(sd, here(label.split()[-1].strip("()") + "-async"))
            fut.result()

        if on:
            with pd.installed():
                took, _, _ = _timed(step)
        else:
            took, _, _ = _timed(step)
        record(label, took, blocked=got["blocked"])


def _rank_main(rank: int, world: int, cfg: SaveBenchConfig) -> dict[str, Any]:
    import warnings

    import torch
    import torch.distributed.checkpoint as dcp

    import pipeload.dcp as pd
    from .. import synth

    warnings.filterwarnings("ignore")  # dcp's overwrite notice, no_dist notices
    torch.set_num_threads(1)
    mesh = synth.make_mesh(world, cfg.tp, cfg.dp)
    sd = synth.build_state_dict(mesh, cfg.seed, cfg.size_mb)
    here = lambda name: os.path.join(cfg.dir, name)  # noqa: E731
    with pd.installed():
        dcp.save(sd, checkpoint_id=here("engine"))
    owned = os.path.getsize(here(f"engine/__{rank}_0.distcp")) if os.path.exists(here(f"engine/__{rank}_0.distcp")) \
        else 0
    src = torch.empty(owned, dtype=torch.uint8).fill_(1)
    dst = torch.empty(owned, dtype=torch.uint8).fill_(0)
    runs: dict[str, list[dict[str, Any]]] = {}
    for i in range(cfg.repeats + 1):
        _round(sd, here, runs, src, dst, warm=i == 0)
    del src, dst
    dest = synth.build_state_dict(mesh, cfg.seed, cfg.size_mb, fill=False)
    dcp.load(dest, checkpoint_id=here("engine"))  # switch off: DCP's own reader
    return {"rank": rank, "owned": owned, "runs": runs, "exact_tensors": _exact(sd, dest)}


def summarize(values: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per step: median seconds (slowest rank's view), max over ranks of the median blocked time."""
    rows = []
    for name in values[0]["runs"]:
        per_rank = [v["runs"][name] for v in values]
        row: dict[str, Any] = {"method": name, "runs": len(per_rank[0]),
                               "seconds": max(statistics.median(r["seconds"] for r in runs) for runs in per_rank)}
        if "blocked" in per_rank[0][0]:
            row["blocked"] = max(statistics.median(r["blocked"] for r in runs) for runs in per_rank)
        rows.append(row)
    return rows


def check_targets(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    by = {r["method"]: r for r in rows}
    mem, eng, ref = by["memcpy floor"]["seconds"], by["dcp.async_save (engine)"], by["pipeload.save"]["seconds"]
    out = [{"target": "dcp.async_save (engine) blocked (s)", "value": round(eng["blocked"], 3),
            "ok": eng["blocked"] <= 1.2 * mem + 0.020, "want": f"<= 1.2 x memcpy floor + 20 ms = {1.2 * mem + 0.020:.3f}"},
           {"target": "dcp.save (engine) / pipeload.save", "value": round(by["dcp.save (engine)"]["seconds"] / ref, 3),
            "ok": by["dcp.save (engine)"]["seconds"] <= 1.2 * ref, "want": "<= 1.2"}]
    stock = by["dcp.async_save (stock)"]["blocked"]
    out.append({"target": "dcp.async_save blocked: stock / engine", "value": round(stock / max(eng["blocked"], 1e-9), 1),
                "ok": True, "want": "(for reference)"})
    out.append({"target": "dcp.save: stock / engine", "value": round(by["dcp.save (stock)"]["seconds"]
                                                                     / by["dcp.save (engine)"]["seconds"], 2),
                "ok": True, "want": "(for reference)"})
    return out


def format_table(result: dict[str, Any]) -> str:
    lines = [f"{'method':<26} {'seconds':>8} {'blocked':>8}  runs"]
    for r in result["rows"]:
        blocked = f"{r['blocked']:.3f}" if "blocked" in r else "-"
        lines.append(f"{r['method']:<26} {r['seconds']:8.3f} {blocked:>8}  {r['runs']}")
    lines.append("")
    for t in result["targets"]:
        lines.append(f"{'ok  ' if t['ok'] else 'MISS'} {t['target']}: {t['value']} (want {t['want']})")
    lines.append(f"stock dcp.load read the engine's checkpoint exactly: {result['exact_tensors']} tensors per rank, "
                 f"and every Python value")
    return "\n".join(lines)


def run(cfg: SaveBenchConfig) -> dict[str, Any]:
    """Run the DCP save benchmark on a local world; the result (rows, targets, config)."""
    values, when = run_ranks(cfg, _rank_main, "pipeload-bench-dcpsave-")
    rows = summarize(values)
    return {"config": dict(vars(cfg)), "owned_mib": [round(v["owned"] / MiB, 1) for v in values], "rows": rows,
            "targets": check_targets(rows), "exact_tensors": min(v["exact_tensors"] for v in values), **when}
