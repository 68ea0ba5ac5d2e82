"""The rank side of the benchmark: build, save, copy per node, then every timed load, verified.

Runs in each process of the world :func:`pipeload.tools.bench.run_bench` spawns; rank 0 returns the runs.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import time
from dataclasses import dataclass, field
from typing import Any

from .report import _median
from .config import FLOOR, LOADER_LABELS, SEPARATE, TIMING_KEYS, BenchConfig, MiB, layout_dims
from .system import (_floor_read, _join_cgroup, status_kib, data_files, drop_cache, proc_io, reset_peak_rss,
                     residency, resident_bytes, warm_files)

_T0 = time.perf_counter()


def _log(cfg: BenchConfig, rank: int, msg: str) -> None:
    if rank == 0 and not cfg.quiet:
        print(f"[bench {time.perf_counter() - _T0:6.1f}s] {msg}", file=sys.stderr, flush=True)


class _Failure(RuntimeError):
    pass


def _all_ok(problems: list[str], what: str) -> None:
    """Raise on every rank if any rank has problems (collective: keeps the ranks in step)."""
    import torch.distributed as dist

    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, problems)
    bad = {r: p for r, p in enumerate(gathered) if p}
    if bad:
        lines = [f"{what}: loaded values do not match on rank(s) {sorted(bad)}"]
        for r, ps in sorted(bad.items()):
            lines += [f"  [rank {r}] {p}" for p in ps[:10]]
            if len(ps) > 10:
                lines.append(f"  [rank {r}] ... and {len(ps) - 10} more")
        raise _Failure("\n".join(lines))


def _gather(obj: Any) -> list[Any]:
    import torch.distributed as dist

    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def _stats_dict(stats: Any) -> dict[str, Any]:
    keys = ("bytes_read", "bytes_received", "broadcasts", "shared_shards", "private_shards", "files_opened",
            "groups_created", "wall")
    d = {k: getattr(stats, k) for k in keys if hasattr(stats, k)}
    d["timings"] = dict(getattr(stats, "timings", {}) or {})
    return d


def _tensor_tree(sd: Any) -> Any:
    """``sd`` without its Python objects (the HF layout holds tensors only); same tensor objects."""
    import torch

    if isinstance(sd, dict):
        out = {k: _tensor_tree(v) for k, v in sd.items()}
        return {k: v for k, v in out.items() if v is not None and not (isinstance(v, dict) and not v)}
    return sd if isinstance(sd, torch.Tensor) else None


def _plain_safetensors_load(dest: Any, directory: str) -> int:
    """The baseline HF loader: each rank mmaps the files (``safe_open``) and copies the rows it needs.

    No collective: every replica reads its rows itself. Returns the bytes copied."""
    from safetensors import safe_open
    import torch

    from ...plan.statedict import flatten as flatten_leaves
    from ...plan.statedict import tensor_box

    with open(os.path.join(directory, "model.safetensors.index.json")) as f:
        weight_map = json.load(f)["weight_map"]
    handles: dict[str, Any] = {}
    boxes: dict = {}
    copied = 0
    for fqn, leaf in flatten_leaves(dest).items():
        if not isinstance(leaf.value, torch.Tensor):  # Python objects: not in the HF layout
            continue
        box = tensor_box(fqn, leaf.value, boxes)
        if box.local is None or box.numel == 0:
            continue
        name = weight_map[fqn]
        f = handles.get(name)
        if f is None:
            f = handles[name] = safe_open(os.path.join(directory, name), framework="pt")
        if not box.lengths:
            src = f.get_tensor(fqn)
        else:
            src = f.get_slice(fqn)[tuple(slice(o, o + n) for o, n in zip(box.offsets, box.lengths))]
        box.local.detach().copy_(src)
        copied += src.numel() * src.element_size()
    return copied


def tensor_count(layers: int, experts: int) -> int:
    """Tensors of the synthetic state dict: model tensors plus one optimizer ``step`` per non-expert one."""
    non_expert = 3 + 9 * layers
    return 2 * non_expert + 3 * layers * experts


def experts_for(tensors: int, layers: int) -> int:
    """The expert count whose state dict (``layers`` layers) holds the closest number to ``tensors``."""
    return max(1, round((tensors - tensor_count(layers, 0)) / (3 * layers)))


@dataclass
class _Rank:
    """What every timed run of one rank uses: the reference and destination state dicts and where each
    checkpoint lies (``shared``: one copy for the host; ``nodes``: this rank's own copy)."""

    cfg: BenchConfig
    rank: int
    world: int
    ref: Any
    dest: Any
    unique: int
    t_build: float
    saved: Any = None  # what the checkpoints are saved from: ``ref`` unless saved in another layout
    shared: dict[str, str] = field(default_factory=dict)
    nodes: dict[str, str] = field(default_factory=dict)
    save_times: dict[str, float] = field(default_factory=dict)
    checked: set[str] = field(default_factory=set)  # loaders whose values were regenerated once

    @property
    def shape(self) -> dict[str, int]:
        return dict(layers=self.cfg.layers, experts=self.cfg.experts)

    def paths_for(self, mode: str) -> dict[str, str]:
        return self.nodes if mode in SEPARATE else self.shared


def _rank_main(rank: int, world: int, cfg: BenchConfig) -> dict[str, Any] | None:
    """One rank of the benchmark world: build, save, copy per node, every timed run, plan reuse."""
    global _T0
    _T0 = time.perf_counter()
    import torch
    import torch.distributed as dist

    from pipeload.tools import synth

    torch.set_num_threads(1)
    r = _build(rank, world, cfg)
    _save_checkpoints(r)
    r.saved = None  # (the save's layout, when another: not needed past the save)
    file_bytes = {k: sum(os.path.getsize(p) for p in data_files(v)) for k, v in r.shared.items()
                  if k in r.save_times}
    _copy_per_node(r)
    runs = _all_runs(r)
    reuse = _plan_reuse(cfg, r.dest, r.ref, r.shared[cfg.format]) if "pipeload" in cfg.loaders else None
    dist.barrier()
    shutil.rmtree(os.path.join(cfg.dir, "nodes", f"rank{rank}"), ignore_errors=True)
    if rank != 0:
        return None
    flat = synth.flatten(r.ref)
    return {"unique_bytes": r.unique, "file_bytes": file_bytes,
            "tensors": sum(1 for v in flat.values() if isinstance(v, torch.Tensor)), "leaves": len(flat),
            "local_bytes": synth.local_bytes(r.ref), "save_seconds": r.save_times, "build_seconds": r.t_build,
            "runs": runs, "plan_reuse": reuse}


def _build(rank: int, world: int, cfg: BenchConfig) -> _Rank:
    """The synthetic state dict on a (dp, tp) mesh, and a zeroed destination of the same layout."""
    from pipeload.tools import synth

    t0 = time.perf_counter()
    mesh = synth.make_mesh(world, cfg.tp, cfg.dp)
    kw = dict(layers=cfg.layers, experts=cfg.experts)
    ref = synth.build_state_dict(mesh, cfg.seed, cfg.size_mb, **kw)
    dest = synth.build_state_dict(mesh, cfg.seed, cfg.size_mb, fill=False, **kw)
    saved = ref
    if cfg.save_layout:  # the same values in the save's layout (every element a function of its index)
        dp, tp = layout_dims(cfg.save_layout, world)
        saved = synth.build_state_dict(synth.make_mesh(world, tp, dp), cfg.seed, cfg.size_mb, **kw)
    r = _Rank(cfg, rank, world, ref, dest, synth.unique_bytes(ref), time.perf_counter() - t0, saved)
    _log(cfg, rank, f"state dict built: {len(synth.flatten(ref))} leaves, {r.unique / MiB:.1f} MiB unique, "
                    f"{synth.local_bytes(ref) / MiB:.1f} MiB on each rank ({r.t_build:.1f} s)")
    root = cfg.dir
    r.shared = {"pipeload": os.path.join(root, "pipeload"), "dcp": os.path.join(root, "dcp")}
    if cfg.format == "hf" or "safetensors" in cfg.loaders:
        r.shared["hf"] = os.path.join(root, "hf")
    if cfg.format == "hf":
        r.ref, r.dest = _tensor_tree(ref), _tensor_tree(dest)
    return r


def _save_checkpoints(r: _Rank) -> None:
    """pipeload's checkpoint (also what the floor reads), DCP's when a loader reads it, and an HF-layout
    copy (whole tensors, sharded, with the index: what a model hub holds) when one does."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    import pipeload

    if r.rank == 0:
        for p in r.shared.values():
            shutil.rmtree(p, ignore_errors=True)
    dist.barrier()
    t0 = time.perf_counter()
    pipeload.save(r.saved, r.shared["pipeload"])
    dist.barrier()
    r.save_times["pipeload"] = time.perf_counter() - t0
    if "dcp" in r.cfg.loaders or r.cfg.format == "dcp":
        t0 = time.perf_counter()
        dcp.save(r.saved, checkpoint_id=r.shared["dcp"])
        dist.barrier()
        r.save_times["dcp"] = time.perf_counter() - t0
    if "hf" in r.shared:
        t0 = time.perf_counter()
        if r.rank == 0:
            from ..convert import convert

            convert(r.shared["pipeload"], r.shared["hf"], to="hf", file_bytes=max(64 * MiB, r.unique // 4))
        dist.barrier()
        r.save_times["hf"] = time.perf_counter() - t0
    _log(r.cfg, r.rank, "saved: " + ", ".join(f"{k} {v:.1f} s" for k, v in r.save_times.items()))


def _copy_per_node(r: _Rank) -> None:
    """Separate nodes emulated: each rank its own copy of every checkpoint, out of the page cache."""
    import torch.distributed as dist

    if not any(m in SEPARATE for m in r.cfg.modes):
        return
    t0 = time.perf_counter()
    mine = os.path.join(r.cfg.dir, "nodes", f"rank{r.rank}")
    shutil.rmtree(mine, ignore_errors=True)
    for k in r.save_times:
        shutil.copytree(r.shared[k], os.path.join(mine, k))
    r.nodes = {k: os.path.join(mine, k) for k in r.save_times}
    drop_cache([p for d in r.nodes.values() for p in data_files(d)])
    dist.barrier()
    _log(r.cfg, r.rank, f"per-rank copies written ({time.perf_counter() - t0:.1f} s)")


def _all_runs(r: _Rank) -> list[dict[str, Any]]:
    """Every mode x repeat x (floor + loaders), the order rotated every repeat; throttled runs inside the
    cgroup that limits all ranks together."""
    runs: list[dict[str, Any]] = []
    throttle = r.cfg.throttle
    for mode in r.cfg.modes:
        if mode == "throttled":
            if not throttle.get("ok"):
                continue
            _join_cgroup(throttle["procs"])
        try:
            order = [FLOOR, *(l for l in r.cfg.loaders if _runs_in(r.cfg, l, mode))]
            for repeat in range(r.cfg.repeats):
                k = repeat % len(order)
                for loader in order[k:] + order[:k]:
                    runs.append(_run_one(r, mode, loader, repeat))
        finally:
            if mode == "throttled":
                _join_cgroup(throttle["leave"])
    return runs


def _runs_in(cfg: BenchConfig, loader: str, mode: str) -> bool:
    """Whether ``loader`` runs in ``mode``: pipeload's always, a baseline where ``baseline_modes`` says."""
    return loader.startswith("pipeload") or cfg.baseline_modes is None or mode in cfg.baseline_modes


def _emulate_hosts(rank: int, mode: str) -> None:
    """Separate nodes (cold, throttled): each rank tells pipeload it runs on a host of its own.

    warm and cold1 are one host: the variable is unset, so every rank reports this machine."""
    if mode in SEPARATE:
        os.environ["PIPELOAD_HOST_ID"] = f"emulated-node-{rank}"
    else:
        os.environ.pop("PIPELOAD_HOST_ID", None)


def _source(cfg: BenchConfig, loader: str) -> str:
    """Which checkpoint a loader reads: with --format pipeload DCP reads its own and the plain reader the HF
    copy; with a foreign format every loader (and the floor) reads the foreign checkpoint."""
    if cfg.format == "pipeload":
        return {"dcp": "dcp", "safetensors": "hf"}.get(loader, "pipeload")
    return cfg.format


def _run_one(r: _Rank, mode: str, loader: str, repeat: int) -> dict[str, Any]:
    """One timed load on every rank (cache prepared, ranks aligned), verified, gathered into one run."""
    where = r.paths_for(mode)
    _emulate_hosts(r.rank, mode)
    directory = where[_source(r.cfg, loader)]
    my_files = data_files(directory)
    if loader != FLOOR:
        _zero(r.dest, tensors_only=r.cfg.format == "hf")
    if mode == "warm":
        warm_files(my_files)
    else:
        drop_cache([p for d in where.values() if os.path.isdir(d) for p in data_files(d)])  # only those saved
    rec = _timed_load(r, mode, loader, directory, my_files)
    _verify(r, mode, loader, repeat)
    run = _aggregate(mode, loader, repeat, _gather(rec))
    _log(r.cfg, r.rank, f"{mode:9s} {LOADER_LABELS[loader]:24s} repeat {repeat + 1}/{r.cfg.repeats}: "
                        f"{run['wall']:7.2f} s  read {run['read_bytes'] / MiB:8.1f} MiB  "
                        f"cache before {run['resident_before'] * 100:5.1f}%")
    return run


def _timed_load(r: _Rank, mode: str, loader: str, directory: str, my_files: list[str]) -> dict[str, Any]:
    """This rank's record of one load: wall time, bytes from storage and requested, memory, stats."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    import pipeload

    resident = residency(my_files)
    stats, requested = None, None
    dist.barrier()
    io0, rss0, peak_ok = proc_io(), status_kib("VmRSS"), reset_peak_rss()
    t0 = time.perf_counter()
    if loader == FLOOR:
        requested = _floor_read(my_files, r.rank, r.world)
    elif loader == "pipeload":  # the default policy ("auto"): what a user gets
        stats = pipeload.load(r.dest, directory, reuse_plan=False)
    elif loader == "pipeload-nobcast":
        stats = pipeload.load(r.dest, directory, broadcast_replicated_tensors=False, reuse_plan=False)
    elif loader == "dcp":
        dcp.load(r.dest, checkpoint_id=directory)
    elif loader == "dcp-install":
        stats, requested = _dcp_installed(r.dest, directory)
    elif loader == "safetensors":
        requested = _plain_safetensors_load(r.dest, directory)
    wall = time.perf_counter() - t0
    io1 = proc_io()
    dist.barrier()  # nobody verifies (and takes a core) while another rank still loads
    rec = {"wall": wall, "t0": t0, "read_bytes": io1["read_bytes"] - io0["read_bytes"],
           "requested_bytes": stats.bytes_read if stats is not None else requested, "resident_before": resident,
           "rss_mib": rss0 / 1024, "peak_rss_mib": status_kib("VmHWM") / 1024,  # the peak so far, no reset
           "peak_rss_reset": peak_ok, "stats": _stats_dict(stats) if stats is not None else None}
    if mode != "warm":
        # This rank's copy was dropped before the run: what is cached now is what it read.
        rec["read_by_file_mib"] = {os.path.basename(p): round(resident_bytes(p)[0] / MiB, 2) for p in my_files}
    return rec


def _dcp_installed(dest: dict, directory: str):
    """``dcp.load`` under the switch, a first load as the pipeload row's (no plan kept from a repeat):
    (the engine's LoadStats, None) or, where it took DCP's path, (None, the bytes its reader read)."""
    import torch.distributed.checkpoint as dcp

    import pipeload

    pipeload.clear_plan_cache()
    with pipeload.dcp.installed():
        dcp.load(dest, checkpoint_id=directory)
    last = pipeload.dcp.last_load()
    return (last.load, None) if last.path == "engine" else (None, last.read.bytes_read)


def _verify(r: _Rank, mode: str, loader: str, repeat: int) -> None:
    """Every load compared bitwise with the reference on every rank (a mismatch stops every rank); once
    per loader, every value regenerated from (seed, fqn, index), which checks the reference itself."""
    from pipeload.tools import synth

    problems: list[str] = []
    if loader == "safetensors":  # the HF layout holds no Python objects: compare the tensors
        problems = synth.same_tensors(_tensor_tree(r.ref), _tensor_tree(r.dest))
    elif loader != FLOOR:
        problems = synth.same_tensors(r.ref, r.dest)
        if not problems and not r.checked and r.cfg.format != "hf":
            r.checked.add(loader)
            problems = synth.verify_state_dict(r.dest, r.cfg.seed, r.cfg.size_mb, **r.shape)
    _all_ok(problems, f"{LOADER_LABELS[loader]} ({mode}, repeat {repeat + 1})")


def _aggregate(mode: str, loader: str, repeat: int, per_rank: list[dict[str, Any]]) -> dict[str, Any]:
    """One run from every rank's record: the slowest rank's wall, bytes summed, the worst memory."""
    run = {
        "mode": mode, "loader": loader, "repeat": repeat,
        "wall": max(x["wall"] for x in per_rank),
        "span": (min(x["t0"] for x in per_rank), max(x["t0"] + x["wall"] for x in per_rank)),  # (perf_counter)
        "read_bytes": sum(x["read_bytes"] for x in per_rank),
        "requested_bytes": None if loader == "dcp" else sum(x["requested_bytes"] or 0 for x in per_rank),
        "resident_before": min(x["resident_before"] for x in per_rank),
        "peak_rss_mib": max(x["peak_rss_mib"] for x in per_rank),
        "peak_rss_delta_mib": max(x["peak_rss_mib"] - x["rss_mib"] for x in per_rank),
        "ranks": per_rank,
    }
    if any(x["stats"] for x in per_rank):
        timings = [x["stats"]["timings"] for x in per_rank]
        run["broadcasts"] = max(x["stats"]["broadcasts"] for x in per_rank)
        run["bytes_received"] = sum(x["stats"]["bytes_received"] for x in per_rank)
        run["timings"] = {k: max(t.get(k, 0.0) for t in timings) for k in TIMING_KEYS}
        # the fixed cost before any data moves, per rank, then the slowest rank
        run["plan_exchange"] = max(t.get("plan", 0.0) + t.get("exchange", 0.0) for t in timings)
        run["plan_by_rank"] = [t.get("plan", 0.0) for t in timings]
    return run


def _zero(dest, *, tensors_only: bool) -> None:
    """Reset a destination before a load (``tensors_only``: the HF layout's tree, which holds no objects)."""
    from pipeload.tools import synth

    if tensors_only:
        for v in synth.flatten(dest).values():
            (v.to_local() if hasattr(v, "to_local") else v).detach().zero_()
    else:
        synth.zero_(dest)


REUSE_REPEATS = 7  # plan-reuse pairs at least: a pair takes well under a second, and the ratio of a ~20 ms
# and a ~200 ms wall time on shared cores needs more samples than the timed loads


def _plan_reuse(cfg: BenchConfig, dest, ref, directory: str) -> dict[str, Any]:
    """Plan + exchange of a first load of the checkpoint pipeload reads in this bench, and of a second one
    that reuses its plan (median of at least :data:`REUSE_REPEATS` pairs).

    Page cache warm, separate hosts emulated (so the plan has broadcasts to reuse).

    Two measures per load, ranks aligned by a barrier before every load: ``first``/``reused``, the max over
    ranks of each rank's plan + exchange (a rank that starts early also waits for the last one: the
    barrier releases the ranks within ~0.2 ms, but 4 ranks share 2 cores, and the last two start when
    the first two wait in their first collective, 3-5 ms later in a reused load); ``first_span``/
    ``reused_span``, from the last rank's entry into ``load()`` to the last rank's end of exchange (the
    load's own critical path, the start skew left out; one clock, as every rank runs on this machine).
    """
    import torch.distributed as dist

    import pipeload
    from pipeload.tools import synth

    os.environ["PIPELOAD_HOST_ID"] = f"emulated-node-{dist.get_rank()}"  # plan the broadcasts too
    per_load: list[list[float]] = [[], [], [], []]  # first, reused; first span, reused span
    for repeat in range(max(cfg.repeats, REUSE_REPEATS)):
        pipeload.clear_plan_cache()
        got = []
        for _ in range(2):
            _zero(dest, tensors_only=cfg.format == "hf")
            dist.barrier()
            start = time.time()
            st = pipeload.load(dest, directory)
            _all_ok(synth.same_tensors(ref, dest), f"pipeload plan reuse (repeat {repeat + 1})")
            took = st.timings.get("plan", 0.0) + st.timings.get("exchange", 0.0)
            got.append((took, start, start + took, st.plan_reused))
        per_rank = _gather(got)
        if not all(r[1][3] and not r[0][3] for r in per_rank):
            raise _Failure("pipeload plan reuse: the second load did not reuse the first one's plan on every rank")
        for i in (0, 1):
            per_load[i].append(max(r[i][0] for r in per_rank))
            per_load[2 + i].append(max(r[i][2] for r in per_rank) - max(r[i][1] for r in per_rank))
    pipeload.clear_plan_cache()
    first, again, first_span, again_span = (_median(xs) for xs in per_load)
    return {"first": first, "reused": again, "first_span": first_span, "reused_span": again_span}


# ----------------------------------------------------------------------------------------------------
# Parent side: orchestration, summary, table, chart
