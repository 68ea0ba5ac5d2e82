"""``pipeload bench --tier``: the memory tier against the persistent checkpoint, side by side in one run.

One local gloo world over the synthetic MoE state dict of :mod:`pipeload.tools.synth` (TP x DP); every
rank is an emulated host (``PIPELOAD_HOST_ID``) with a tier root of its own under ``/dev/shm`` (a
tmpfs; ``--dir`` otherwise) and its own copy of the persistent checkpoint (separate page caches, as
``pipeload bench``'s ``throttled`` mode). Measured, ``repeats`` times each (medians):

- **snapshot**: ``pipeload.save(sd, tier, step=N, background=True)`` — the time the caller is blocked
  and the time until its ``wait()`` returned — against ``pipeload.save(sd, dir, background=True)`` of
  the same state (blocked, and until committed), in turns, after one warm-up round
  (:func:`pipeload.tier.measure.snapshot_against_save`);
- **restore**: one host's root wiped (a replaced node), then ``pipeload.load(dest, tier, fallback=ckpt)``
  against ``pipeload.load(dest, ckpt)`` from each rank's copy of the persistent checkpoint, dropped from
  the page cache, all ranks' reads limited together to ``--read-mbps`` (200 MiB/s) by the cgroup of
  ``pipeload bench`` (emulated shared storage); unless TP already spans the world, also a **resharding
  restore** (``tier reshard``): the same snapshot into the state with every tensor sharded over the
  whole world (TP = world), planned by the owners of :mod:`pipeload.move.plan`. Every load goes into zeroed destinations and is compared
  bitwise with the state afterwards. Bytes read from storage (``/proc/self/io`` ``read_bytes``), bytes
  read from the tier and received from peers (``LoadStats``) are reported per load.

Times of a collective step run from a barrier before to a barrier after (the slowest rank); the time
blocked is each rank's own, the largest reported.
"""

from __future__ import annotations

import os
import shutil
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass
from typing import Any

MiB = 1 << 20


@dataclass
class TierBenchConfig:
    world: int = 4
    tp: int = 2
    dp: int = 2
    size_mb: float = 512.0
    seed: int = 0
    repeats: int = 3
    read_mbps: float = 200.0
    dir: str | None = None
    lost: int = 1  # the rank whose host's tier is wiped before each restore
    timeout: float = 1800.0
    quiet: bool = False
    throttle: dict | None = None  # filled by the parent
    tier_root: str | None = None  # filled by the parent: the emulated hosts' roots go under it


def _barrier_timed(step) -> tuple[float, Any]:
    import torch.distributed as dist

    dist.barrier()
    t0 = time.perf_counter()
    value = step()
    dist.barrier()
    return time.perf_counter() - t0, value


def _log(cfg: TierBenchConfig, rank: int, msg: str) -> None:
    if not cfg.quiet and rank == 0:
        print(f"[bench --tier] {msg}", flush=True)


def _restores(r, cfg: TierBenchConfig, step: int) -> dict[str, list]:
    """Persistent (throttled, cold) and tier (one host lost) loads in turns, each verified; with
    ``r["other"]`` (the state in another layout: TP over the whole world) also a resharding restore."""
    import pipeload

    from .. import synth
    from .system import _join_cgroup, data_files, drop_cache, proc_io

    names = ("persistent load", "tier restore") + (("tier reshard",) if "other" in r else ())
    runs: dict[str, list] = {name: [] for name in names}
    throttle = cfg.throttle or {}
    for i in range(cfg.repeats):
        # in the background (replicated shards staged by one rank each): the restores check its values
        pipeload.save(r["sd"], r["tier"], step=step + i, background=True).wait()
        _wipe(r["tier"].root, r["rank"] == cfg.lost)
        for name in names:
            ref, dest = r["other"] if name == "tier reshard" else (r["sd"], r["dest"])
            _zero(dest)
            if name == "persistent load":
                drop_cache(data_files(r["node"]))
                if throttle.get("ok"):
                    _join_cgroup(throttle["procs"])
            io0 = proc_io()
            try:
                took, stats = _barrier_timed(
                    lambda: pipeload.load(dest, r["node"], reuse_plan=False) if name == "persistent load"
                    else pipeload.load(dest, r["tier"], fallback=r["node"]))
            finally:
                if name == "persistent load" and throttle.get("ok"):
                    _join_cgroup(throttle["leave"])
            storage = proc_io()["read_bytes"] - io0["read_bytes"]
            bad = synth.same_tensors(ref, dest)
            if bad:
                raise AssertionError(f"rank {r['rank']}: {name} loaded wrong values: {bad[:3]}")
            runs[name].append({"seconds": took, "storage_bytes": storage, "bytes_read": stats.bytes_read,
                               "bytes_received": stats.bytes_received, "source": stats.source,
                               "timings": dict(stats.timings)})
    return runs


def _wipe(root: str, mine: bool) -> None:
    import torch.distributed as dist

    dist.barrier()
    if mine:
        shutil.rmtree(root, ignore_errors=True)
        os.makedirs(root)
    dist.barrier()


def _zero(sd) -> None:
    import torch

    from .. import synth

    for v in synth.flatten(sd).values():
        if isinstance(v, torch.Tensor):
            (v.to_local() if hasattr(v, "to_local") else v).zero_()


def _rank_main(rank: int, world: int, cfg: TierBenchConfig) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    import pipeload
    from pipeload.tier import MemoryTier
    from pipeload.tier.measure import snapshot_against_save

    from .. import synth
    from .system import data_files, drop_cache

    torch.set_num_threads(1)
    os.environ["PIPELOAD_HOST_ID"] = f"emulated-node-{rank}"
    mesh = synth.make_mesh(world, cfg.tp, cfg.dp)
    sd = synth.build_state_dict(mesh, cfg.seed, cfg.size_mb)
    dest = synth.build_state_dict(mesh, cfg.seed, cfg.size_mb, fill=False)
    here = lambda name: os.path.join(cfg.dir, name)  # noqa: E731
    tier = MemoryTier(os.path.join(cfg.tier_root, f"host{rank}"), replicas=2, job="bench")
    os.makedirs(tier.root, exist_ok=True)
    pipeload.save(sd, here("pipeload"))
    node = here(f"nodes/rank{rank}")
    shutil.rmtree(node, ignore_errors=True)
    shutil.copytree(here("pipeload"), node)
    drop_cache(data_files(node))
    dist.barrier()
    _log(cfg, rank, f"state built and saved: {synth.unique_bytes(sd) / MiB:.0f} MiB unique, "
                    f"{synth.local_bytes(sd) / MiB:.0f} MiB per rank")
    snapshot_against_save(sd, tier, here("background"), step=1, repeats=1)  # warm-up: groups, staging, plans
    snap = snapshot_against_save(sd, tier, here("background"), step=10, repeats=cfg.repeats)
    _log(cfg, rank, "snapshots done")
    runs: dict[str, list] = {}
    r = {"rank": rank, "sd": sd, "dest": dest, "tier": tier, "node": node}
    if cfg.tp != world:  # the same values with every tensor sharded over the whole world: a resharding restore
        other = synth.make_mesh(world, world, 1)
        r["other"] = (synth.build_state_dict(other, cfg.seed, cfg.size_mb),
                      synth.build_state_dict(other, cfg.seed, cfg.size_mb, fill=False))
    runs.update(_restores(r, cfg, 100))
    dist.barrier()
    shutil.rmtree(tier.root, ignore_errors=True)
    shutil.rmtree(node, ignore_errors=True)
    return {"rank": rank, "local": synth.local_bytes(sd), "unique": synth.unique_bytes(sd), "runs": runs,
            "snapshot": snap}


def summarize(values: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per method: the median seconds (loads: rank 0's, a barrier to a barrier; snapshot and save:
    the largest rank's median until its ``wait()`` returned), the largest rank's median blocked time, and
    the bytes of the ranks summed (median over repeats)."""
    rows = []
    for name, kind in (("background save", "save"), ("tier snapshot", "snapshot")):
        snaps = [v["snapshot"] for v in values]
        row = {"method": name, "seconds": max(x[f"{kind}_done_s"] for x in snaps),
               "blocked": max(x[f"{kind}_blocked_s"] for x in snaps)}
        if kind == "snapshot":
            row["bytes_sent"] = sum(x["bytes_sent"] for x in snaps)
        rows.append(row)
    for name in values[0]["runs"]:
        per_rank = [v["runs"][name] for v in values]
        row: dict[str, Any] = {"method": name, "seconds": statistics.median(x["seconds"] for x in per_rank[0])}
        if "blocked" in per_rank[0][0]:
            row["blocked"] = max(statistics.median(x["blocked"] for x in runs) for runs in per_rank)
        for k in ("storage_bytes", "bytes_read", "bytes_received"):
            if k in per_rank[0][0]:
                row[k] = statistics.median(sum(runs[i][k] for runs in per_rank) for i in range(len(per_rank[0])))
        if "source" in per_rank[0][0]:
            row["source"] = sorted({x["source"] for runs in per_rank for x in runs})
            phases = per_rank[0][0]["timings"]
            row["timings"] = {k: round(max(statistics.median(x["timings"].get(k, 0.0) for x in runs)
                                           for runs in per_rank), 3) for k in phases}
        rows.append(row)
    return rows


def check_targets(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Issue 31's targets: restore <= 0.25 x the persistent load; snapshot blocked <= 1.5 x a background save's."""
    by = {r["method"]: r for r in rows}
    out = []
    ratio = by["tier restore"]["seconds"] / by["persistent load"]["seconds"]
    out.append({"target": "tier restore / persistent load", "value": round(ratio, 3), "ok": ratio <= 0.25,
                "want": "<= 0.25"})
    ratio = by["tier snapshot"]["blocked"] / by["background save"]["blocked"]
    out.append({"target": "snapshot blocked / background save blocked", "value": round(ratio, 3),
                "ok": ratio <= 1.5, "want": "<= 1.5"})
    storage = by["tier restore"]["storage_bytes"]
    out.append({"target": "tier restore: bytes read from storage (MiB)", "value": round(storage / MiB, 1),
                "ok": storage <= 16 * MiB, "want": "~0 (<= 16 MiB of page-ins)"})
    return out


def format_table(result: dict[str, Any]) -> str:
    lines = [f"{'method':<18} {'seconds':>8} {'blocked':>8}  {'storage MiB':>11} {'tier MiB':>9} "
             f"{'peers MiB':>9}  source"]
    for r in result["rows"]:
        blocked = f"{r['blocked']:.3f}" if "blocked" in r else "-"
        mib = lambda k: f"{r[k] / MiB:.1f}" if k in r else "-"  # noqa: E731
        tier_read = mib("bytes_read") if r["method"] in ("tier restore", "tier reshard") else "-"
        lines.append(f"{r['method']:<18} {r['seconds']:8.3f} {blocked:>8}  {mib('storage_bytes'):>11} "
                     f"{tier_read:>9} {mib('bytes_received'):>9}  {','.join(r.get('source', []))}")
        if "timings" in r:
            lines.append(f"{'':<18} phases (s, max over ranks): " + ", ".join(f"{k} {v:.3f}" for k, v in r["timings"].items()))
    lines.append("")
    for t in result["targets"]:
        lines.append(f"{'ok  ' if t['ok'] else 'MISS'} {t['target']}: {t['value']} (want {t['want']})")
    return "\n".join(lines)


def run(cfg: TierBenchConfig) -> dict[str, Any]:
    """Run the tier benchmark on a local world; the result (rows, targets, config)."""
    from .._world import run_world
    from .system import setup_throttle, teardown_throttle

    if cfg.tp * cfg.dp != cfg.world:
        raise ValueError(f"--tp {cfg.tp} x --dp {cfg.dp} must equal --world {cfg.world}")
    if not 0 <= cfg.lost < cfg.world:
        raise ValueError(f"the lost host's rank must be in [0, {cfg.world})")
    own_dir = cfg.dir is None
    cfg.dir = tempfile.mkdtemp(prefix="pipeload-bench-tier-") if own_dir else os.path.abspath(cfg.dir)
    shm = "/dev/shm" if os.path.isdir("/dev/shm") else cfg.dir
    cfg.tier_root = tempfile.mkdtemp(prefix="pipeload-bench-tier-", dir=shm)
    cfg.throttle = setup_throttle(cfg.dir, cfg.read_mbps)
    t0 = time.perf_counter()
    load_before = os.getloadavg()[0]
    try:
        values = run_world(_rank_main, cfg.world, cfg, timeout=cfg.timeout)
    finally:
        teardown_throttle(cfg.throttle)
        shutil.rmtree(cfg.tier_root, ignore_errors=True)
        if own_dir:
            shutil.rmtree(cfg.dir, ignore_errors=True)
    rows = summarize(values)
    config = {k: v for k, v in asdict(cfg).items() if k != "throttle"}
    return {"config": config, "throttle": {k: v for k, v in cfg.throttle.items() if k in ("ok", "mechanism", "reason")},
            "tier_root": shm, "local_mib": [round(v["local"] / MiB, 1) for v in values],
            "unique_mib": round(values[0]["unique"] / MiB, 1), "rows": rows, "targets": check_targets(rows),
            "total_seconds": time.perf_counter() - t0,
            "loadavg": [round(load_before, 2), round(os.getloadavg()[0], 2)]}
