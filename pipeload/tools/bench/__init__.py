"""``pipeload bench``: pipeload against ``torch.distributed.checkpoint`` on a local multi-process world.

One spawned gloo world runs the whole benchmark (spawn, imports and the state dict are paid once):

1. every rank builds its part of the synthetic MoE state dict (:mod:`pipeload.tools.synth`) on a
   ``("dp", "tp")`` mesh and saves it with pipeload and with DCP (same tensors, same layout); rank 0
   converts the pipeload checkpoint to the Hugging Face layout when the plain safetensors reader runs;
2. for each mode, repeats x {floor, loaders} runs, the order rotated every repeat; every load goes into
   zeroed destinations and is compared bitwise with the reference afterwards (a mismatch stops the
   benchmark on every rank) — :mod:`.ranks`;
3. rank 0 gathers one record per run; the parent prints the headline and the table and writes JSON / a
   chart — :mod:`.report`. Page cache, I/O counters and the throttle: :mod:`.system`.

By default two modes and two loaders run (pipeload and DCP, on shared storage and on one host hot);
``--full`` runs every mode and loader. Modes (see docs/BENCH.md):

- ``warm``: page cache hot, all ranks read one shared copy (a single node).
- ``cold1``: one node, cold: all ranks read one shared copy, dropped from the page cache before every
  run; ``PIPELOAD_HOST_ID`` unset, so pipeload sees one host.
- ``cold``: separate nodes emulated: each rank reads its own copy of both checkpoints (same bytes,
  separate page cache), dropped from the cache (``posix_fadvise(DONTNEED)``) before every run, the
  residency checked with ``mincore``.
- ``throttled``: cold, plus all ranks' reads limited together to ``--read-mbps`` MiB/s by a cgroup
  (v1 ``blkio.throttle.read_bps_device`` or v2 ``io.max``) the ranks join: one shared file system.

The floor of a mode is the time to read the unique checkpoint bytes once: the ranks read disjoint
contiguous slices of the pipeload checkpoint's files in parallel, with plain ``read`` calls, in the
same mode. Bytes read from storage come from ``/proc/self/io`` ``read_bytes`` (what the block layer
fetched, readahead included); requested bytes from ``LoadStats.bytes_read`` (pipeload only: DCP does
not count what it asks for). In the separate-nodes modes the parent also samples the disk's own count
of bytes read (:class:`.system.DiskReads`): when each load's first MiB and last byte came from storage,
so a loader's time over the floor splits into before the first byte, bytes beyond the floor's, and
after the last byte.
"""

from __future__ import annotations

import contextlib
import json
import os
import platform
import shutil
import sys
import tempfile
import time
from dataclasses import asdict
from typing import Any

# the names below are the benchmark's API (the CLI and the tests use them from here)
from .config import (DCP_LOADERS, VIA_DCP_LOADERS, DEFAULT_SIZE_MB, FLOOR, FORMATS, HF_LOADERS, LOADER_LABELS, LOADERS, MODES,
                     QUICK_BASELINE_MODES, QUICK_LOADERS, QUICK_MODES, SEPARATE, TIMING_KEYS, BenchConfig, MiB,
                     layout_dims)
from .ranks import _all_ok, _Failure, experts_for, tensor_count
from .report import check_targets, describe, format_table, headline, plot, summarize
from .system import (DiskReads, _floor_read, _join_cgroup, block_device, data_files, drop_cache, residency,
                     resident_bytes, setup_throttle, teardown_throttle, warm_files)

__all__ = ["BenchConfig", "run_bench", "headline", "describe", "format_table", "summarize", "check_targets",
           "plot", "LOADERS", "MODES", "QUICK_MODES", "QUICK_LOADERS", "LOADER_LABELS", "FLOOR", "SEPARATE",
           "TIMING_KEYS", "DEFAULT_SIZE_MB", "MiB", "tensor_count", "experts_for", "setup_throttle",
           "teardown_throttle", "block_device", "data_files", "drop_cache", "residency", "resident_bytes",
           "warm_files", "_floor_read", "_join_cgroup", "_all_ok", "_Failure", "DiskReads"]


def _run_ranks(cfg: BenchConfig) -> list[Any]:
    """The world's results, each separate-nodes run with the disk's timeline of it (``run["disk"]``)."""
    from .._world import run_world
    from .ranks import _rank_main

    device = block_device(cfg.dir) if any(m in SEPARATE for m in cfg.modes) else None
    disk = DiskReads(device) if device else None
    with disk or contextlib.nullcontext():
        values = run_world(_rank_main, cfg.world, cfg, timeout=cfg.timeout)
    for run in values[0]["runs"]:  # separate nodes read from the disk: when did it serve them
        span = run.pop("span", None)
        if disk is not None and span is not None and run["mode"] in SEPARATE:
            run["disk"] = disk.span(*span)
    return values


def run_bench(cfg: BenchConfig, *, out: str | None = None, plot_path: str | None = None) -> dict[str, Any]:
    """Run the benchmark; return the result dict (also written to ``out`` as JSON when given)."""
    for m in cfg.modes:
        if m not in MODES:
            raise ValueError(f"unknown mode {m!r}: choose from {', '.join(MODES)}")
    if cfg.format not in FORMATS:
        raise ValueError(f"unknown format {cfg.format!r}: choose from {', '.join(FORMATS)}")
    allowed = {"hf": HF_LOADERS, "dcp": DCP_LOADERS}.get(cfg.format, LOADERS)
    if cfg.via == "dcp.load":  # DCP's load against itself under the switch, in every mode asked for
        if cfg.format != "dcp":
            raise ValueError("--via dcp.load needs --format dcp")
        cfg.loaders, cfg.baseline_modes = tuple(cfg.loaders or VIA_DCP_LOADERS), None
    elif cfg.via != "pipeload":
        raise ValueError(f"unknown --via {cfg.via!r}: pipeload or dcp.load")
    if cfg.loaders is None:
        cfg.loaders = QUICK_LOADERS[cfg.format]
        cfg.baseline_modes = QUICK_BASELINE_MODES
    elif tuple(cfg.loaders) == LOADERS:
        cfg.loaders = allowed
    for l in cfg.loaders:
        if l not in allowed:
            raise ValueError(f"unknown loader {l!r} for --format {cfg.format}: choose from {', '.join(allowed)}")
    if cfg.tp * cfg.dp != cfg.world:
        raise ValueError(f"--tp {cfg.tp} x --dp {cfg.dp} must equal --world {cfg.world}")
    if cfg.save_layout:
        layout_dims(cfg.save_layout, cfg.world)  # a ValueError names what is wrong with it
    if cfg.repeats < 1:
        raise ValueError("--repeats must be at least 1")
    if cfg.tensors is not None:
        if cfg.tensors < tensor_count(cfg.layers, 1):
            raise ValueError(f"--tensors {cfg.tensors}: at least {tensor_count(cfg.layers, 1)} with "
                             f"{cfg.layers} layers (fewer --layers for fewer tensors)")
        cfg.experts = experts_for(cfg.tensors, cfg.layers)
    own_dir = cfg.dir is None
    cfg.dir = tempfile.mkdtemp(prefix="pipeload-bench-") if own_dir else os.path.abspath(cfg.dir)
    os.makedirs(cfg.dir, exist_ok=True)
    cfg.throttle = {"ok": False, "reason": "mode not requested"}
    if "throttled" in cfg.modes:
        cfg.throttle = setup_throttle(cfg.dir, cfg.read_mbps)
        if not cfg.throttle["ok"] and not cfg.quiet:
            print(f"[bench] throttled mode SKIPPED: {cfg.throttle['reason']}", file=sys.stderr, flush=True)
    t0 = time.perf_counter()
    load_before = os.getloadavg()[0]
    try:
        values = _run_ranks(cfg)
    finally:
        teardown_throttle(cfg.throttle)
        if own_dir:
            shutil.rmtree(cfg.dir, ignore_errors=True)
        else:
            shutil.rmtree(os.path.join(cfg.dir, "nodes"), ignore_errors=True)
    data = values[0]
    result = {
        "config": {k: v for k, v in asdict(cfg).items() if k not in ("throttle", "quiet")},
        "environment": _environment(cfg.dir if not own_dir else tempfile.gettempdir()),
        "throttle": {k: v for k, v in cfg.throttle.items() if k in ("ok", "mechanism", "reason", "device")},
        "checkpoint": {k: data[k] for k in ("unique_bytes", "file_bytes", "tensors", "leaves", "local_bytes",
                                            "save_seconds", "build_seconds")},
        "runs": data["runs"],
        "plan_reuse": data.get("plan_reuse"),
        "total_seconds": time.perf_counter() - t0,
    }
    # The 1-minute load average before and after: other work on the machine makes timings noisy.
    result["environment"]["loadavg"] = [round(load_before, 2), round(os.getloadavg()[0], 2)]
    result["config"]["modes"] = list(cfg.modes)
    result["config"]["loaders"] = list(cfg.loaders)
    result["summary"] = summarize(data["runs"], data["unique_bytes"])
    default_size = (cfg.size_mb == DEFAULT_SIZE_MB and cfg.tensors is None and cfg.layers == 8
                    and cfg.experts == 128)
    result["targets"] = check_targets(result["summary"], cfg.dp, cfg.format, default_size)
    if out:
        with open(out, "w") as f:
            json.dump(result, f, indent=1)
    if plot_path:
        plot(result, plot_path)
    return result


def _environment(directory: str) -> dict[str, Any]:
    import torch

    env: dict[str, Any] = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "kernel": platform.release(),
        "cpus": os.cpu_count(),
    }
    try:
        from ... import __version__

        env["pipeload"] = __version__
    except ImportError:
        pass
    dev = block_device(directory)
    if dev:
        env["device"] = f"{dev[0]}:{dev[1]}"
        for key, name in (("read_ahead_kb", "read_ahead_kb"), ("scheduler", "scheduler")):
            try:
                with open(f"/sys/dev/block/{dev[0]}:{dev[1]}/queue/{name}") as f:
                    env[key] = f.read().strip()
            except OSError:
                pass
    try:
        import psutil

        env["memory_gib"] = round(psutil.virtual_memory().total / 2**30, 1)
    except ImportError:
        pass
    return env
