"""``pipeload bench``: pipeload against ``torch.distributed.checkpoint`` on a local multi-process world.

One spawned gloo world runs the whole benchmark (spawn, imports and the state dict are paid once):

1. every rank builds its part of the synthetic MoE state dict (:mod:`pipeload.synth`) on a
   ``("dp", "tp")`` mesh and saves it with pipeload and with DCP (same tensors, same layout); rank 0
   converts the pipeload checkpoint to the Hugging Face layout for the plain safetensors reader;
2. for each mode, repeats x {floor, pipeload (default policy), pipeload broadcast off, plain
   safetensors reader, DCP} runs, the order rotated every repeat; every load goes into zeroed
   destinations and is compared bitwise with the reference afterwards (a mismatch stops the benchmark
   on every rank);
3. rank 0 gathers one record per run; the parent prints the table and writes JSON / a chart.

Modes (see docs/BENCH.md):

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
not count what it asks for).
"""

from __future__ import annotations

import ctypes
import json
import mmap
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from typing import Any

MiB = 2**20
LOADERS = ("pipeload", "pipeload-nobcast", "safetensors", "dcp")
FORMATS = ("pipeload", "dcp", "hf")
HF_LOADERS = ("pipeload", "pipeload-nobcast", "safetensors")
DCP_LOADERS = ("pipeload", "pipeload-nobcast", "dcp")  # --format dcp: every loader reads DCP's files
FLOOR = "floor"
MODES = ("warm", "cold1", "cold", "throttled")
# separate nodes emulated: each rank its own copy of every checkpoint and a host identity of its own
SEPARATE = ("cold", "throttled")
TIMING_KEYS = ("plan", "exchange", "groups", "shared", "private", "teardown")
LOADER_LABELS = {
    FLOOR: "floor (raw read, once)",
    "pipeload": "pipeload",
    "pipeload-nobcast": "pipeload broadcast off",
    "dcp": "torch DCP",
    "safetensors": "plain safetensors reader",
}
DEFAULT_SIZE_MB = 256


@dataclass
class BenchConfig:
    world: int = 4
    tp: int = 2
    dp: int = 2
    size_mb: float = DEFAULT_SIZE_MB
    seed: int = 0
    repeats: int = 3
    modes: tuple[str, ...] = MODES
    loaders: tuple[str, ...] = LOADERS
    read_mbps: float = 200.0
    dir: str | None = None
    layers: int = 8
    experts: int = 128
    timeout: float = 1800.0
    quiet: bool = False
    # which checkpoint pipeload loads: its own ("pipeload"), the one dcp.save wrote ("dcp"), or an HF
    # layout copy ("hf", compared with a plain per-rank safetensors reader instead of DCP)
    format: str = "pipeload"
    # many small tensors: the expert count is chosen so the state dict holds about this many tensors
    # (model + optimizer steps); None: the --experts given
    tensors: int | None = None
    # filled by the parent before the world starts
    throttle: dict[str, Any] = field(default_factory=dict)


# ----------------------------------------------------------------------------------------------------
# Page cache, residency, I/O counters


def data_files(directory: str) -> list[str]:
    """Every regular file of a checkpoint directory (data and metadata), sorted, as paths."""
    out = []
    for name in sorted(os.listdir(directory)):
        p = os.path.join(directory, name)
        if os.path.isfile(p):
            out.append(p)
    return out


def drop_cache(paths: list[str]) -> None:
    """Evict the files from the page cache (written back first, so no dirty page stays behind)."""
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fdatasync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


_libc = None


def _c():
    global _libc
    if _libc is None:
        _libc = ctypes.CDLL(None, use_errno=True)
        _libc.mmap.restype = ctypes.c_void_p
        _libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
        _libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        _libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    return _libc


def resident_bytes(path: str) -> tuple[int, int]:
    """``(resident, total)`` bytes of a file in the page cache, by ``mincore`` over a fresh mapping."""
    size = os.path.getsize(path)
    if size == 0:
        return 0, 0
    libc = _c()
    page = mmap.PAGESIZE
    fd = os.open(path, os.O_RDONLY)
    try:
        addr = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        if addr in (None, ctypes.c_void_p(-1).value):
            raise OSError(ctypes.get_errno(), f"mmap of {path} failed")
        try:
            npages = (size + page - 1) // page
            vec = (ctypes.c_ubyte * npages)()
            if libc.mincore(ctypes.c_void_p(addr), size, vec) != 0:
                raise OSError(ctypes.get_errno(), f"mincore of {path} failed")
            resident = sum(1 for b in bytes(vec) if b & 1)
        finally:
            libc.munmap(ctypes.c_void_p(addr), size)
    finally:
        os.close(fd)
    return min(resident * page, size), size


def residency(paths: list[str]) -> float:
    """Fraction of the files' bytes in the page cache (1.0 for no bytes)."""
    res = tot = 0
    for p in paths:
        r, t = resident_bytes(p)
        res += r
        tot += t
    return res / tot if tot else 1.0


def proc_io() -> dict[str, int]:
    """This process's ``/proc/self/io`` counters (all threads)."""
    out = {}
    with open("/proc/self/io") as f:
        for line in f:
            k, _, v = line.partition(":")
            out[k.strip()] = int(v)
    return out


def _status_kib(field_name: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field_name + ":"):
                return int(line.split()[1])
    return 0


def reset_peak_rss() -> bool:
    """Reset VmHWM to the current RSS (Linux ``clear_refs`` 5); ``False`` where unsupported."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def warm_files(paths: list[str]) -> None:
    buf = bytearray(8 * MiB)
    for p in paths:
        with open(p, "rb", buffering=0) as f:
            while f.readinto(buf):
                pass


# ----------------------------------------------------------------------------------------------------
# Read throttling (one cgroup for all ranks)


def block_device(path: str) -> tuple[int, int] | None:
    """``(major, minor)`` of the whole disk holding ``path``; ``None`` for a non-block file system."""
    st = os.stat(path)
    major, minor = os.major(st.st_dev), os.minor(st.st_dev)
    if major == 0:
        return None
    sys_path = f"/sys/dev/block/{major}:{minor}"
    if os.path.exists(os.path.join(sys_path, "partition")):
        try:
            with open(os.path.join(os.path.dirname(os.path.realpath(sys_path)), "dev")) as f:
                major, minor = (int(x) for x in f.read().split(":"))
        except OSError:
            pass
    return major, minor


def _cgroup2_root() -> str | None:
    try:
        with open("/proc/mounts") as f:
            for line in f:
                parts = line.split()
                if len(parts) > 2 and parts[2] == "cgroup2":
                    return parts[1]
    except OSError:
        pass
    return None


def setup_throttle(directory: str, read_mbps: float) -> dict[str, Any]:
    """Create a cgroup that limits reads from ``directory``'s disk to ``read_mbps`` MiB/s in total.

    Returns ``{"ok": True, "procs": <cgroup.procs path>, "leave": <root cgroup.procs>, "dir": ...,
    "mechanism": ...}`` or ``{"ok": False, "reason": ...}``. Needs root (or a delegated cgroup).
    """
    dev = block_device(directory)
    if dev is None:
        return {"ok": False, "reason": f"{directory} is not on a block device (tmpfs/overlay?): cannot throttle reads"}
    bps = int(read_mbps * MiB)
    name = f"pipeload-bench-{os.getpid()}"
    reasons = []
    v1 = "/sys/fs/cgroup/blkio"
    if os.path.isfile(os.path.join(v1, "blkio.throttle.read_bps_device")):
        cg = os.path.join(v1, name)
        try:
            os.makedirs(cg, exist_ok=True)
            with open(os.path.join(cg, "blkio.throttle.read_bps_device"), "w") as f:
                f.write(f"{dev[0]}:{dev[1]} {bps}")
            return {
                "ok": True,
                "mechanism": f"cgroup v1 blkio.throttle.read_bps_device {dev[0]}:{dev[1]} {bps}",
                "dir": cg,
                "procs": os.path.join(cg, "cgroup.procs"),
                "leave": os.path.join(v1, "cgroup.procs"),
                "device": f"{dev[0]}:{dev[1]}",
            }
        except OSError as e:
            reasons.append(f"cgroup v1 blkio: {e.strerror or e} ({cg})")
            _rmdir(cg)
    else:
        reasons.append("cgroup v1 blkio.throttle.read_bps_device not found")
    root = _cgroup2_root()
    if root:
        try:
            with open(os.path.join(root, "cgroup.controllers")) as f:
                controllers = f.read().split()
        except OSError:
            controllers = []
        if "io" not in controllers:
            reasons.append(f"cgroup v2 at {root} has no io controller (it may be bound to cgroup v1)")
        else:
            cg = os.path.join(root, name)
            try:
                with open(os.path.join(root, "cgroup.subtree_control"), "w") as f:
                    f.write("+io")
                os.makedirs(cg, exist_ok=True)
                with open(os.path.join(cg, "io.max"), "w") as f:
                    f.write(f"{dev[0]}:{dev[1]} rbps={bps}")
                return {
                    "ok": True,
                    "mechanism": f"cgroup v2 io.max {dev[0]}:{dev[1]} rbps={bps}",
                    "dir": cg,
                    "procs": os.path.join(cg, "cgroup.procs"),
                    "leave": os.path.join(root, "cgroup.procs"),
                    "device": f"{dev[0]}:{dev[1]}",
                }
            except OSError as e:
                reasons.append(f"cgroup v2 io.max: {e.strerror or e} ({cg})")
                _rmdir(cg)
    else:
        reasons.append("no cgroup v2 mount")
    return {"ok": False, "reason": "; ".join(reasons)}


def _rmdir(path: str) -> None:
    try:
        os.rmdir(path)
    except OSError:
        pass


def teardown_throttle(info: dict[str, Any]) -> None:
    if info.get("ok"):
        _rmdir(info["dir"])


def _join_cgroup(procs: str) -> None:
    with open(procs, "w") as f:
        f.write(str(os.getpid()))


# ----------------------------------------------------------------------------------------------------
# The runs (inside the world)


def _floor_read(paths: list[str], rank: int, world: int) -> int:
    """Read this rank's contiguous 1/world slice of the concatenated files; return the bytes read."""
    sizes = [os.path.getsize(p) for p in paths]
    total = sum(sizes)
    page = mmap.PAGESIZE
    per = -(-total // world)
    per = -(-per // page) * page  # page-aligned slices: no page is read by two ranks
    lo, hi = min(total, rank * per), min(total, (rank + 1) * per)
    buf = bytearray(8 * MiB)
    view = memoryview(buf)
    done = 0
    base = 0
    for p, size in zip(paths, sizes):
        a, b = max(lo, base), min(hi, base + size)
        if a < b:
            fd = os.open(p, os.O_RDONLY)
            try:
                off = a - base
                end = b - base
                while off < end:
                    n = os.preadv(fd, [view[: min(len(buf), end - off)]], off)
                    if n <= 0:
                        break
                    off += n
                    done += n
            finally:
                os.close(fd)
        base += size
    return done


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

    from .statedict import flatten as flatten_leaves
    from .statedict import tensor_box

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


def _rank_main(rank: int, world: int, cfg: BenchConfig) -> dict[str, Any] | None:
    global _T0
    _T0 = time.perf_counter()
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    import pipeload
    from pipeload import synth

    torch.set_num_threads(1)
    t_start = time.perf_counter()
    mesh = synth.make_mesh(world, cfg.tp, cfg.dp)
    kw = dict(layers=cfg.layers, experts=cfg.experts)
    ref = synth.build_state_dict(mesh, cfg.seed, cfg.size_mb, **kw)
    dest = synth.build_state_dict(mesh, cfg.seed, cfg.size_mb, fill=False, **kw)
    unique = synth.unique_bytes(ref)
    t_build = time.perf_counter() - t_start
    _log(cfg, rank, f"state dict built: {len(synth.flatten(ref))} leaves, {unique / MiB:.1f} MiB unique, "
                    f"{synth.local_bytes(ref) / MiB:.1f} MiB on each rank ({t_build:.1f} s)")

    root = cfg.dir
    shared = {"pipeload": os.path.join(root, "pipeload"), "dcp": os.path.join(root, "dcp")}
    if cfg.format == "hf" or "safetensors" in cfg.loaders:
        shared["hf"] = os.path.join(root, "hf")
    if cfg.format == "hf":
        ref, dest = _tensor_tree(ref), _tensor_tree(dest)
    if rank == 0:
        for p in shared.values():
            shutil.rmtree(p, ignore_errors=True)
    dist.barrier()
    loaders = list(cfg.loaders)
    t0 = time.perf_counter()
    save_times = {}
    pipeload.save(ref, shared["pipeload"])  # also what the floor reads
    dist.barrier()
    save_times["pipeload"] = time.perf_counter() - t0
    if "dcp" in loaders or cfg.format == "dcp":
        t0 = time.perf_counter()
        dcp.save(ref, checkpoint_id=shared["dcp"])
        dist.barrier()
        save_times["dcp"] = time.perf_counter() - t0
    if "hf" in shared:
        t0 = time.perf_counter()
        if rank == 0:  # whole tensors, sharded 5 GiB, with the index: what a model hub holds
            from .formats.convert import convert

            convert(shared["pipeload"], shared["hf"], to="hf", file_bytes=max(64 * MiB, unique // 4))
        dist.barrier()
        save_times["hf"] = time.perf_counter() - t0
    _log(cfg, rank, "saved: " + ", ".join(f"{k} {v:.1f} s" for k, v in save_times.items()))

    files = {k: data_files(v) for k, v in shared.items() if k in save_times}
    file_bytes = {k: sum(os.path.getsize(p) for p in v) for k, v in files.items()}

    # Separate nodes: each rank its own copy of both checkpoints.
    nodes = {}
    if any(m in SEPARATE for m in cfg.modes):
        t0 = time.perf_counter()
        mine = os.path.join(root, "nodes", f"rank{rank}")
        shutil.rmtree(mine, ignore_errors=True)
        for k, src in shared.items():
            if k in save_times:
                shutil.copytree(src, os.path.join(mine, k))
        nodes = {k: os.path.join(mine, k) for k in save_times}
        drop_cache([p for d in nodes.values() for p in data_files(d)])
        dist.barrier()
        _log(cfg, rank, f"per-rank copies written ({time.perf_counter() - t0:.1f} s)")

    def paths_for(mode: str) -> dict[str, str]:
        return nodes if mode in SEPARATE else shared

    def emulate_hosts(mode: str) -> None:
        """Separate nodes (cold, throttled): each rank tells pipeload it runs on a host of its own.

        warm and cold1 are one host: the variable is unset, so every rank reports this machine."""
        if mode in SEPARATE:
            os.environ["PIPELOAD_HOST_ID"] = f"emulated-node-{rank}"
        else:
            os.environ.pop("PIPELOAD_HOST_ID", None)

    def run_one(mode: str, loader: str, repeat: int) -> dict[str, Any]:
        where = paths_for(mode)
        emulate_hosts(mode)
        if cfg.format == "pipeload":
            src_kind = {"dcp": "dcp", "safetensors": "hf"}.get(loader, "pipeload")
        else:
            src_kind = cfg.format  # every loader (and the floor) reads the foreign checkpoint
        directory = where[src_kind]
        my_files = data_files(directory)
        if loader != FLOOR:
            _zero(dest, tensors_only=cfg.format == "hf")
        if mode == "warm":
            warm_files(my_files)
        else:
            drop_cache([p for d in where.values() if os.path.isdir(d) for p in data_files(d)])  # only those saved
        resident = residency(my_files)
        stats = None
        dist.barrier()
        io0 = proc_io()
        rss0 = _status_kib("VmRSS")
        peak_ok = reset_peak_rss()
        t0 = time.perf_counter()
        requested = None
        if loader == FLOOR:
            requested = _floor_read(my_files, rank, world)
        elif loader == "pipeload":  # the default policy ("auto"): what a user gets
            stats = pipeload.load(dest, directory, reuse_plan=False)
        elif loader == "pipeload-nobcast":
            stats = pipeload.load(dest, directory, broadcast_replicated_tensors=False, reuse_plan=False)
        elif loader == "dcp":
            dcp.load(dest, checkpoint_id=directory)
        elif loader == "safetensors":
            requested = _plain_safetensors_load(dest, directory)
        wall = time.perf_counter() - t0
        io1 = proc_io()
        dist.barrier()  # nobody verifies (and takes a core) while another rank still loads
        peak = _status_kib("VmHWM")  # without a reset: the process's peak so far
        if stats is not None:
            requested = stats.bytes_read
        rec = {
            "wall": wall,
            "read_bytes": io1["read_bytes"] - io0["read_bytes"],
            "requested_bytes": requested,
            "resident_before": resident,
            "rss_mib": rss0 / 1024,
            "peak_rss_mib": peak / 1024,
            "peak_rss_reset": peak_ok,
            "stats": _stats_dict(stats) if stats is not None else None,
        }
        if mode != "warm":
            # This rank's copy was dropped before the run: what is cached now is what it read.
            rec["read_by_file_mib"] = {
                os.path.basename(p): round(resident_bytes(p)[0] / MiB, 2) for p in my_files
            }
        problems: list[str] = []
        if loader == "safetensors":  # the HF layout holds no Python objects: compare the tensors
            problems = synth.same_tensors(_tensor_tree(ref), _tensor_tree(dest))
        elif loader != FLOOR:
            problems = synth.same_tensors(ref, dest)
            if not problems and not checked and cfg.format != "hf":
                checked.add(loader)
                # Once per benchmark, also regenerate every value from (seed, fqn, index): this checks the
                # reference the other runs are compared with.
                problems = synth.verify_state_dict(dest, cfg.seed, cfg.size_mb, **kw)
        _all_ok(problems, f"{LOADER_LABELS[loader]} ({mode}, repeat {repeat + 1})")
        per_rank = _gather(rec)
        run = {
            "mode": mode,
            "loader": loader,
            "repeat": repeat,
            "wall": max(r["wall"] for r in per_rank),
            "read_bytes": sum(r["read_bytes"] for r in per_rank),
            "requested_bytes": None if loader == "dcp" else sum(r["requested_bytes"] or 0 for r in per_rank),
            "resident_before": min(r["resident_before"] for r in per_rank),
            "peak_rss_mib": max(r["peak_rss_mib"] for r in per_rank),
            "peak_rss_delta_mib": max(r["peak_rss_mib"] - r["rss_mib"] for r in per_rank),
            "ranks": per_rank,
        }
        if any(r["stats"] for r in per_rank):
            run["broadcasts"] = max(r["stats"]["broadcasts"] for r in per_rank)
            run["bytes_received"] = sum(r["stats"]["bytes_received"] for r in per_rank)
            run["timings"] = {
                k: max(r["stats"]["timings"].get(k, 0.0) for r in per_rank) for k in TIMING_KEYS
            }
            # the fixed cost before any data moves, per rank, then the slowest rank
            run["plan_exchange"] = max(
                r["stats"]["timings"].get("plan", 0.0) + r["stats"]["timings"].get("exchange", 0.0)
                for r in per_rank
            )
            run["plan_by_rank"] = [r["stats"]["timings"].get("plan", 0.0) for r in per_rank]
        _log(cfg, rank, f"{mode:9s} {LOADER_LABELS[loader]:24s} repeat {repeat + 1}/{cfg.repeats}: "
                        f"{run['wall']:7.2f} s  read {run['read_bytes'] / MiB:8.1f} MiB  "
                        f"cache before {run['resident_before'] * 100:5.1f}%")
        return run

    checked: set[str] = set()
    runs: list[dict[str, Any]] = []
    throttle = cfg.throttle
    for mode in cfg.modes:
        if mode == "throttled":
            if not throttle.get("ok"):
                continue
            _join_cgroup(throttle["procs"])
        try:
            order = [FLOOR, *loaders]
            for repeat in range(cfg.repeats):
                k = repeat % len(order)
                for loader in order[k:] + order[:k]:
                    runs.append(run_one(mode, loader, repeat))
        finally:
            if mode == "throttled":
                _join_cgroup(throttle["leave"])
    reuse = _plan_reuse(cfg, dest, ref, shared[cfg.format]) if "pipeload" in loaders else None
    dist.barrier()
    shutil.rmtree(os.path.join(root, "nodes", f"rank{rank}"), ignore_errors=True)
    if rank != 0:
        return None
    return {
        "unique_bytes": unique,
        "file_bytes": file_bytes,
        "tensors": sum(1 for v in synth.flatten(ref).values() if isinstance(v, torch.Tensor)),
        "leaves": len(synth.flatten(ref)),
        "local_bytes": synth.local_bytes(ref),
        "save_seconds": save_times,
        "build_seconds": t_build,
        "runs": runs,
        "plan_reuse": reuse,
    }


def _zero(dest, *, tensors_only: bool) -> None:
    """Reset a destination before a load (``tensors_only``: the HF layout's tree, which holds no objects)."""
    from pipeload import synth

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
    from pipeload import synth

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


def _median(xs: list[float]) -> float | None:
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def _ratio(a: float | None, b: float) -> float | None:
    return None if a is None or not b else a / b


def summarize(runs: list[dict[str, Any]], unique: int) -> list[dict[str, Any]]:
    """One row per (mode, loader): medians over the repeats and the ratios the targets are stated in."""
    rows = []
    modes = list(dict.fromkeys(r["mode"] for r in runs))
    for mode in modes:
        in_mode = [r for r in runs if r["mode"] == mode]
        loaders = list(dict.fromkeys(r["loader"] for r in in_mode))
        med = {l: _median([r["wall"] for r in in_mode if r["loader"] == l]) for l in loaders}
        for loader in loaders:
            rs = [r for r in in_mode if r["loader"] == loader]
            wall = med[loader]
            row = {
                "mode": mode,
                "loader": loader,
                "runs": len(rs),
                "wall": wall,
                "walls": [r["wall"] for r in rs],
                "vs_floor": wall / med[FLOOR] if med.get(FLOOR) else None,
                "vs_dcp": wall / med["dcp"] if med.get("dcp") else None,
                "vs_plain": wall / med["safetensors"] if med.get("safetensors") else None,
                "read_amp": _median([r["read_bytes"] for r in rs]) / unique,
                "requested_amp": _ratio(_median([r["requested_bytes"] for r in rs]), unique),
                "resident_before": min(r["resident_before"] for r in rs),
                "peak_rss_mib": _median([r["peak_rss_mib"] for r in rs]),
                "peak_rss_delta_mib": _median([r["peak_rss_delta_mib"] for r in rs]),
                "broadcasts": _median([r.get("broadcasts") for r in rs]),
                "timings": {k: _median([r["timings"][k] for r in rs]) for k in TIMING_KEYS}
                if all("timings" in r for r in rs) else None,
                "plan_exchange": _median([r.get("plan_exchange") for r in rs]),
            }
            rows.append(row)
    return rows


def check_targets(rows: list[dict[str, Any]], dp: int, format: str = "pipeload",
                  default_size: bool = True) -> list[dict[str, Any]]:
    """The ratios the project commits to, evaluated on this run (those whose rows exist).

    ``default_size``: the checkpoint is the default one (size, tensor count), where the fixed cost of
    a load (plan + exchange) has a target; elsewhere it is reported only."""
    get = {(r["mode"], r["loader"]): r for r in rows}
    out = []

    def add(name: str, value: float | None, ok: bool | None, want: str) -> None:
        out.append({"target": name, "value": value, "want": want, "ok": ok})

    t_pl = get.get(("throttled", "pipeload"))
    if format == "dcp":  # pipeload reading the checkpoint dcp.save wrote, against dcp.load on it
        t_dcp = get.get(("throttled", "dcp"))
        if t_pl and t_dcp:
            speed = t_dcp["wall"] / t_pl["wall"]
            add("throttled, DCP checkpoint: dcp.load / pipeload (speed-up)", speed, speed >= 2.0, ">= 2.0")
        if t_pl:
            add("throttled, DCP checkpoint: pipeload read amplification", t_pl["read_amp"],
                t_pl["read_amp"] <= 1.02, "<= 1.02")
        return out
    if format == "hf":  # pipeload reading the HF layout, against a plain per-rank safetensors reader
        t_st = get.get(("throttled", "safetensors"))
        if t_pl and t_st:
            speed = t_st["wall"] / t_pl["wall"]
            add("throttled, HF layout: plain safetensors / pipeload (speed-up)", speed, speed >= 1.8, ">= 1.8")
        if t_pl:
            add("throttled, HF layout: pipeload read amplification", t_pl["read_amp"], None, "report")
        return out

    t_pl, t_dcp = get.get(("throttled", "pipeload")), get.get(("throttled", "dcp"))
    for mode in ("warm", "cold1"):
        pl, st = get.get((mode, "pipeload")), get.get((mode, "safetensors"))
        if pl and st and pl["vs_plain"] is not None:
            add(f"{mode}: pipeload / plain safetensors reader", pl["vs_plain"], pl["vs_plain"] <= 0.8, "<= 0.80")
    for mode in SEPARATE:
        pl = get.get((mode, "pipeload"))
        if pl:
            add(f"{mode}: pipeload read amplification", pl["read_amp"], pl["read_amp"] <= 1.02, "1.00 (<= 1.02)")
    if t_pl and t_pl["vs_floor"] is not None:
        add("throttled: pipeload / floor", t_pl["vs_floor"], t_pl["vs_floor"] <= 1.10, "<= 1.10")
    if t_pl and t_dcp:
        speed = t_dcp["wall"] / t_pl["wall"]
        add("throttled: DCP / pipeload (speed-up)", speed, speed >= 1.8, ">= 1.8")
    if t_dcp:
        add(f"throttled: DCP read amplification (dp={dp})", t_dcp["read_amp"], None, f"~{dp:.2f}")
    w_off = get.get(("warm", "pipeload-nobcast"))
    if w_off and w_off["vs_dcp"] is not None:
        add("warm: pipeload broadcast off / DCP", w_off["vs_dcp"], w_off["vs_dcp"] <= 1.10, "<= 1.10")
    w_on = get.get(("warm", "pipeload"))
    if w_on and w_on["vs_dcp"] is not None:
        add("warm: pipeload / DCP", w_on["vs_dcp"], None, "report")
    fixed = [r["plan_exchange"] for r in rows if r["loader"] == "pipeload" and r.get("plan_exchange") is not None]
    if fixed:
        worst = max(fixed)
        add("pipeload plan + exchange (max over ranks, median, worst mode)", worst,
            worst <= 0.15 if default_size else None, "<= 0.15" if default_size else "report (0.15 s at the default size)")
    return out


def _fmt(x: float | None, spec: str, none: str = "-") -> str:
    return none if x is None else format(x, spec)


def format_table(result: dict[str, Any]) -> str:
    rows = result["summary"]
    head = ["loader", "mode", "median s", "x floor", "x DCP", "x plain", "read amp", "requested", "bcasts",
            "plan+exch s", "peak RSS MiB (+load)", "cache before"]
    lines = []
    table = []
    for r in rows:
        table.append([
            LOADER_LABELS.get(r["loader"], r["loader"]),
            r["mode"],
            _fmt(r["wall"], ".2f"),
            _fmt(r["vs_floor"], ".2f"),
            _fmt(r["vs_dcp"], ".2f"),
            _fmt(r.get("vs_plain"), ".2f"),
            _fmt(r["read_amp"], ".2f"),
            _fmt(r["requested_amp"], ".2f"),
            _fmt(r["broadcasts"], ".0f"),
            _fmt(r.get("plan_exchange"), ".3f"),
            f"{r['peak_rss_mib']:.0f} (+{r['peak_rss_delta_mib']:.0f})" if r["loader"] != FLOOR else "-",
            f"{r['resident_before'] * 100:.0f}%",
        ])
    widths = [max(len(h), *(len(t[i]) for t in table)) if table else len(h) for i, h in enumerate(head)]
    fmt_row = lambda cells: "  ".join(c.ljust(w) if i < 2 else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths)))
    lines.append(fmt_row(head))
    lines.append("  ".join("-" * w for w in widths))
    for t in table:
        lines.append(fmt_row(t))
    timed = [r for r in rows if r.get("timings")]
    if timed:
        lines.append("")
        lines.append("pipeload LoadStats timings (median of the per-run max over ranks, seconds):")
        th = ["loader", "mode", *TIMING_KEYS, "wall"]
        tt = [[LOADER_LABELS[r["loader"]], r["mode"], *(_fmt(r["timings"][k], ".3f") for k in TIMING_KEYS),
               _fmt(r["wall"], ".3f")] for r in timed]
        tw = [max(len(h), *(len(t[i]) for t in tt)) for i, h in enumerate(th)]
        lines.append("  ".join(h.ljust(w) if i < 2 else h.rjust(w) for i, (h, w) in enumerate(zip(th, tw))))
        for t in tt:
            lines.append("  ".join(c.ljust(w) if i < 2 else c.rjust(w) for i, (c, w) in enumerate(zip(t, tw))))
    pr = result.get("plan_reuse")
    if pr and pr.get("first"):
        lines.append("")
        lines.append(f"plan + exchange (warm, max over ranks, median): first load {pr['first']:.4f} s, a second load "
                     f"reusing its plan {pr['reused']:.4f} s ({pr['reused'] / pr['first'] * 100:.1f} %)")
        if pr.get("first_span"):
            lines.append(f"  from the last rank's start to the last rank's end of exchange: first load "
                         f"{pr['first_span']:.4f} s, reused {pr['reused_span']:.4f} s "
                         f"({pr['reused_span'] / pr['first_span'] * 100:.1f} %)")
    if result.get("targets"):
        lines.append("")
        lines.append("targets:")
        for t in result["targets"]:
            mark = {True: "ok  ", False: "MISS", None: "    "}[t["ok"]]
            lines.append(f"  [{mark}] {t['target']}: {_fmt(t['value'], '.2f')} (want {t['want']})")
    return "\n".join(lines)


def describe(result: dict[str, Any]) -> str:
    cfg = result["config"]
    ck = result["checkpoint"]
    th = result["throttle"]
    out = [
        f"world {cfg['world']} = TP{cfg['tp']} x DP{cfg['dp']} (gloo, CPU), {ck['tensors']} tensors, "
        f"{ck['unique_bytes'] / MiB:.1f} MiB unique ({ck['local_bytes'] / MiB:.1f} MiB per rank), "
        f"seed {cfg['seed']}, {cfg['repeats']} repeats, median reported",
        f"checkpoint files: pipeload {ck['file_bytes'].get('pipeload', 0) / MiB:.1f} MiB, "
        f"DCP {ck['file_bytes'].get('dcp', 0) / MiB:.1f} MiB"
        + (f", HF {ck['file_bytes']['hf'] / MiB:.1f} MiB" if "hf" in ck["file_bytes"] else "")
        + f"; pipeload loads the {cfg.get('format', 'pipeload')} checkpoint; saves: "
        + ", ".join(f"{k} {v:.1f} s" for k, v in ck["save_seconds"].items()),
    ]
    if any(m in SEPARATE for m in cfg["modes"]):
        out.append("cold/throttled: separate nodes emulated - each rank reads its own copy of each checkpoint "
                   "(same bytes, separate page cache), dropped from the page cache before every run, and "
                   "tells pipeload it runs on a host of its own (PIPELOAD_HOST_ID=emulated-node-<rank>)")
    if "cold1" in cfg["modes"]:
        out.append("cold1: one host - all ranks read one shared copy, dropped from the page cache before "
                   "every run (PIPELOAD_HOST_ID unset)")
    if "warm" in cfg["modes"]:
        out.append("warm: one host - all ranks read one shared copy, page cache hot (PIPELOAD_HOST_ID unset)")
    if "pipeload" in cfg["loaders"]:
        out.append("pipeload: default policy (broadcast_replicated_tensors='auto': same-host replicas read "
                   "from the page cache under gloo, replicas on other hosts get a broadcast); every timed "
                   "load plans afresh (reuse_plan=False); plan+exch s = LoadStats plan + exchange, max over "
                   "ranks, median")
    if cfg.get("tensors"):
        out.append(f"--tensors {cfg['tensors']}: {cfg['layers']} layers x {cfg['experts']} experts")
    if "throttled" in cfg["modes"]:
        if th.get("ok"):
            out.append(f"throttled: all ranks together limited to {cfg['read_mbps']:g} MiB/s ({th['mechanism']})")
        else:
            out.append(f"throttled: SKIPPED - {th.get('reason')}")
    busy = max(result["environment"].get("loadavg", [0.0]))
    ncpu = result["environment"].get("cpus") or 1
    if busy > max(ncpu, cfg["world"]) + 0.5:
        out.append(f"WARNING: the machine was busy (1-minute load average up to {busy:.1f} on {ncpu} CPUs, "
                   f"{cfg['world']} of it this benchmark's ranks): timings are noisy")
    stuck = sorted({r["mode"] for r in result["summary"] if r["mode"] != "warm" and r["resident_before"] > 0.05})
    if stuck:
        out.append(f"WARNING: in {', '.join(stuck)} mode the page cache could not be emptied before every run "
                   "(is --dir on tmpfs?): those runs are not cold")
    out.append("read amp = bytes the ranks read from storage (/proc/<pid>/io read_bytes) / unique bytes; "
               "requested = bytes pipeload asked for (LoadStats.bytes_read, all ranks) / unique bytes")
    return "\n".join(out)


def plot(result: dict[str, Any], path: str) -> None:
    """A PNG: median wall per loader and mode (floor dashed), and read amplification."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise RuntimeError("--plot needs matplotlib: pip install 'pipeload[plot]' (or pip install matplotlib)")
    rows = result["summary"]
    modes = list(dict.fromkeys(r["mode"] for r in rows))
    loaders = [l for l in LOADERS if any(r["loader"] == l for r in rows)]
    get = {(r["mode"], r["loader"]): r for r in rows}
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    width = 0.8 / max(1, len(loaders))
    for i, loader in enumerate(loaders):
        xs = [m + (i - (len(loaders) - 1) / 2) * width for m in range(len(modes))]
        walls = [get[(m, loader)]["wall"] if (m, loader) in get else 0 for m in modes]
        amps = [get[(m, loader)]["read_amp"] if (m, loader) in get else 0 for m in modes]
        axes[0].bar(xs, walls, width, label=LOADER_LABELS[loader])
        axes[1].bar(xs, amps, width, label=LOADER_LABELS[loader])
    for m, mode in enumerate(modes):
        f = get.get((mode, FLOOR))
        if f:
            axes[0].hlines(f["wall"], m - 0.45, m + 0.45, colors="black", linestyles="dashed",
                           label="floor" if m == 0 else None)
    cfg = result["config"]
    axes[0].set_title(f"load time, {result['checkpoint']['unique_bytes'] / MiB:.0f} MiB, "
                      f"TP{cfg['tp']}xDP{cfg['dp']}")
    axes[0].set_ylabel("median wall (s)")
    axes[1].set_title("read amplification (storage bytes / unique bytes)")
    for ax in axes:
        ax.set_xticks(range(len(modes)))
        ax.set_xticklabels(modes)
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def run_bench(cfg: BenchConfig, *, out: str | None = None, plot_path: str | None = None) -> dict[str, Any]:
    """Run the benchmark; return the result dict (also written to ``out`` as JSON when given)."""
    from ._world import run_world

    for m in cfg.modes:
        if m not in MODES:
            raise ValueError(f"unknown mode {m!r}: choose from {', '.join(MODES)}")
    if cfg.format not in FORMATS:
        raise ValueError(f"unknown format {cfg.format!r}: choose from {', '.join(FORMATS)}")
    allowed = {"hf": HF_LOADERS, "dcp": DCP_LOADERS}.get(cfg.format, LOADERS)
    if tuple(cfg.loaders) == LOADERS:
        cfg.loaders = allowed
    for l in cfg.loaders:
        if l not in allowed:
            raise ValueError(f"unknown loader {l!r} for --format {cfg.format}: choose from {', '.join(allowed)}")
    if cfg.tp * cfg.dp != cfg.world:
        raise ValueError(f"--tp {cfg.tp} x --dp {cfg.dp} must equal --world {cfg.world}")
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
        values = run_world(_rank_main, cfg.world, cfg, timeout=cfg.timeout)
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
        from . import __version__

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
