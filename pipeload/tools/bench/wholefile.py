"""``pipeload bench --whole-file``: one ``torch.save`` file every rank loads (a Lightning DDP checkpoint, an
Accelerate ``optimizer.bin``) — ``pipeload.load_file`` against ``torch.load`` on every rank.

One gloo world of ``--world`` ranks, each its own emulated node (its own copy of the file, its own host
identity, the copy dropped from the page cache before every run) on one shared file system emulated by
the cgroup read throttle of the main bench (``--read-mbps``, all ranks together). Rank 0 writes the file:
a nested dict of float32 tensors (``--size`` MiB, 64 tensors) and Python objects. Rows, in an order
rotated every repeat, medians reported:

- ``read alone``: rank 0 reads its copy with plain ``read`` calls, the other ranks idle (the floor);
- ``torch.load alone``: rank 0 calls ``torch.load`` on its copy, the other ranks idle;
- ``torch.load on every rank``: what trainers do today;
- ``pipeload.load_file``: every rank calls it (default policy: the ranks are on separate hosts).

Time: from a barrier before to the slowest rank's end. Bytes read from storage: ``/proc/self/io``
``read_bytes`` summed over the ranks. Memory: the peak RSS over the RSS before, taken after every
tensor of the result was read once (``load_file``'s tensors map shared memory, which counts in RSS
once touched). Every ``load_file`` result is compared with the file's tensors
(a digest of each, computed once) and objects on every rank.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass
from typing import Any

MiB = 1 << 20
ROWS = ("read alone", "torch.load alone", "torch.load on every rank", "pipeload.load_file")
TENSORS = 64


@dataclass
class FileBenchConfig:
    world: int = 4
    size_mb: float = 256.0
    repeats: int = 3
    read_mbps: float = 200.0
    dir: str | None = None
    timeout: float = 1800.0
    quiet: bool = False
    rows: tuple[str, ...] = ROWS  # which rows run ("read alone" always: the others are compared with it)


def run(cfg: FileBenchConfig) -> dict[str, Any]:
    """Run the bench; the result dict (config, throttle, per row the median wall and bytes, targets)."""
    from .._world import run_world
    from .system import setup_throttle, teardown_throttle

    if cfg.world < 2 or cfg.repeats < 1 or cfg.size_mb <= 0:
        raise ValueError("--whole-file needs --world >= 2, --repeats >= 1 and a positive --size")
    own = cfg.dir is None
    directory = tempfile.mkdtemp(prefix="pipeload-bench-file-") if own else os.path.abspath(cfg.dir)
    os.makedirs(directory, exist_ok=True)
    throttle = setup_throttle(directory, cfg.read_mbps)
    t0, load_before = time.perf_counter(), os.getloadavg()[0]
    try:
        values = run_world(_rank_main, cfg.world, cfg, directory, throttle, timeout=cfg.timeout, separate_hosts=True)
    finally:
        teardown_throttle(throttle)
        shutil.rmtree(directory if own else os.path.join(directory, "file-bench"), ignore_errors=True)
    runs, size = values[0]["runs"], values[0]["size"]
    rows = {}
    for row in ROWS:
        mine = [r for r in runs if r["row"] == row]
        if not mine:
            continue
        rows[row] = {"wall": statistics.median(r["wall"] for r in mine),
                     "read_bytes": statistics.median(r["read_bytes"] for r in mine),
                     "peak_rss_delta_mib": max(r["peak_rss_delta_mib"] for r in mine)}
    floor, ours = rows["read alone"]["wall"], rows.get("pipeload.load_file")
    targets = [] if ours is None else [{"what": "load_file bytes read / file", "value": ours["read_bytes"] / size, "limit": 1.02},
               {"what": "load_file time / read alone", "value": ours["wall"] / floor, "limit": 1.3}]
    for t in targets:
        t["ok"] = t["value"] <= t["limit"]
    return {"config": asdict(cfg), "size": size, "throttle": {k: throttle.get(k) for k in ("ok", "mechanism", "reason")},
            "rows": rows, "runs": runs, "targets": targets, "total_seconds": time.perf_counter() - t0,
            "loadavg": [round(load_before, 2), round(os.getloadavg()[0], 2)]}  # other work makes timings noisy


def _content(size: int) -> dict[str, Any]:
    import torch

    n = max(1, size // (4 * TENSORS))
    g = torch.Generator().manual_seed(0)
    return {"state_dict": {f"layer.{i}.weight": torch.randn(n, generator=g) for i in range(TENSORS)},
            "optimizer": {"param_groups": [{"lr": 1e-3, "betas": (0.9, 0.95)}]}, "epoch": 7, "global_step": 1000}


def _digest(obj: dict[str, Any]) -> dict[str, str]:
    return {k: hashlib.blake2b(t.numpy().tobytes(), digest_size=16).hexdigest() for k, t in obj["state_dict"].items()}


def _rank_main(rank: int, world: int, cfg: FileBenchConfig, directory: str, throttle: dict) -> dict | None:
    """Write the file (rank 0), copy it per node, run every row ``repeats`` times, verified."""
    import torch
    import torch.distributed as dist

    from .system import _join_cgroup, drop_cache

    root = os.path.join(directory, "file-bench")
    shared = os.path.join(root, "shared", "last.ckpt")
    if rank == 0:
        os.makedirs(os.path.dirname(shared), exist_ok=True)
        content = _content(int(cfg.size_mb * MiB))
        torch.save(content, shared)
        box = [_digest(content)]
        del content
    else:
        box = [None]
    dist.broadcast_object_list(box)
    digest = box[0]
    mine = os.path.join(root, "nodes", f"rank{rank}", "last.ckpt")
    os.makedirs(os.path.dirname(mine), exist_ok=True)
    shutil.copyfile(shared, mine)
    drop_cache([mine, shared])
    dist.barrier()
    if throttle.get("ok"):
        _join_cgroup(throttle["procs"])
    runs = []
    try:
        order = [r for r in ROWS if r in cfg.rows or r == "read alone"]
        for repeat in range(cfg.repeats):
            k = repeat % len(order)
            for row in order[k:] + order[:k]:
                runs.append(_one(row, rank, mine, digest, drop_cache))
                _log(cfg, rank, f"{row:26s} repeat {repeat + 1}: {runs[-1]['wall']:6.2f} s, "
                                f"read {runs[-1]['read_bytes'] / MiB:7.1f} MiB")
    finally:
        if throttle.get("ok"):
            _join_cgroup(throttle["leave"])
    return {"runs": runs, "size": os.path.getsize(mine)} if rank == 0 else None


def _log(cfg: FileBenchConfig, rank: int, msg: str) -> None:
    import sys

    if rank == 0 and not cfg.quiet:
        print(f"[bench --whole-file] {msg}", file=sys.stderr, flush=True)


def _one(row: str, rank: int, path: str, digest: dict, drop_cache) -> dict[str, Any]:
    """One timed run of ``row`` on every rank; rank 0 gets the run (slowest wall, bytes summed)."""
    import torch
    import torch.distributed as dist

    import pipeload

    from .system import proc_io, reset_peak_rss, status_kib

    drop_cache([path])
    dist.barrier()
    io0, rss0, _ = proc_io()["read_bytes"], status_kib("VmRSS"), reset_peak_rss()
    t0 = time.perf_counter()
    got, stats = None, pipeload.FileStats()
    if row == "read alone" and rank == 0:
        _read(path)
    elif row == "torch.load alone" and rank == 0:
        got = torch.load(path)
    elif row == "torch.load on every rank":
        got = torch.load(path)
    elif row == "pipeload.load_file":
        got = pipeload.load_file(path, stats=stats)
    wall = time.perf_counter() - t0
    read_bytes = proc_io()["read_bytes"] - io0
    ok = got is None or _digest(got) == digest  # touches every tensor: a mapped result now counts in RSS
    rec = {"wall": wall, "read_bytes": read_bytes, "peak_rss_delta_mib": (status_kib("VmHWM") - rss0) / 1024,
           "ok": ok, "timings": stats.timings}
    del got
    every: list = [None] * dist.get_world_size()
    dist.all_gather_object(every, rec)
    if not all(r["ok"] for r in every):
        raise RuntimeError(f"{row}: loaded tensors differ from the file's on rank(s) "
                           f"{[i for i, r in enumerate(every) if not r['ok']]}")
    return {"row": row, "wall": max(r["wall"] for r in every), "read_bytes": sum(r["read_bytes"] for r in every),
            "peak_rss_delta_mib": max(r["peak_rss_delta_mib"] for r in every), "ranks": every}


def _read(path: str) -> int:
    buf = bytearray(8 * MiB)
    done = 0
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buf):
            done += n
    return done


def format_table(result: dict[str, Any]) -> str:
    size = result["size"]
    floor = result["rows"]["read alone"]["wall"]
    lines = [f"{'':28s} {'time':>8s} {'x read alone':>13s} {'bytes read / file':>18s} {'peak RSS +MiB':>14s}"]
    for row, r in result["rows"].items():
        lines.append(f"{row:28s} {r['wall']:7.2f}s {r['wall'] / floor:12.2f}x {r['read_bytes'] / size:17.2f}x "
                     f"{r['peak_rss_delta_mib']:14.0f}")
    for t in result["targets"]:
        lines.append(f"target: {t['what']} {t['value']:.3f} <= {t['limit']}: {'ok' if t['ok'] else 'MISSED'}")
    return "\n".join(lines)
