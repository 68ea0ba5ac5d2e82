"""``pipeload bench --device``: every device path of pipeload on real accelerator tensors.

One command, a few minutes on one accelerator: each case prints whether the values are exact and its
time against a floor, and a final summary line. Cases:

- ring H2D: :class:`pipeload.device.H2DRing` copying pageable host bytes, against one ``copy_`` out of
  page-locked memory (the floor every other case is measured with) and a plain pageable ``copy_``;
- a pipeload, a DCP and an HF checkpoint loaded into device DTensors in a world of one whose group has
  an accelerator backend (NCCL, HCCL...), first load and a second one (the kept plan);
- ``load_file`` (a ``torch.save`` file and a safetensors file) with ``map_location`` the device;
- a background save of device tensors the caller overwrites right after the call (the checkpoint
  must hold the values at the call);
- a memory tier snapshot of device tensors and its restore into device tensors;
- a gloo world of several ranks holding device tensors: the three formats read once and broadcast
  through the host (the receivers' bytes reach the device through the ring), and ``load_file``
  broadcast to every rank.

Without an accelerator it says so and runs nothing. Every case runs in its own ``try``: a failure is
printed and the next case runs; past the time budget the remaining cases are skipped, said so, and a
case still running 30 s past it (a hung collective) ends the process after the summary line.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
import threading
import time
import traceback
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from ... import device as devices

DEFAULT_SIZE_MB = 512
BUDGET_SECONDS = 280.0
GRACE_SECONDS = 30.0  # past the budget by this much, a case still running is stuck: the process ends
FORMATS = ("pipeload", "dcp", "hf")


@dataclass
class Row:
    name: str
    ok: bool | None  # None: skipped
    seconds: float = 0.0
    floor: float = 0.0
    note: str = ""


@dataclass
class _Bench:
    device: torch.device
    size_mb: int
    budget: float
    world: int
    t0: float = field(default_factory=time.perf_counter)
    rows: list[Row] = field(default_factory=list)
    h2d_bps: float = 0.0  # page-locked copy_ bandwidth, bytes/s (the floor of every case)
    running: str = ""  # the case in progress (the watchdog names it)

    def left(self) -> float:
        return self.budget - (time.perf_counter() - self.t0)

    def floor(self, nbytes: int) -> float:
        return nbytes / self.h2d_bps if self.h2d_bps else 0.0

    def case(self, name: str, fn: Callable[[], Row | list[Row]]) -> None:
        """Run one case (or a group of rows), print its rows as they come; never raise."""
        if self.left() < 15:
            self._add(Row(name, None, note="skipped: time budget spent"))
            return
        self.running = name
        try:
            got = fn()
        except Exception as e:  # noqa: BLE001 - one failed case must not stop the others
            tb = traceback.format_exc(limit=6)
            self._add(Row(name, False, note=f"FAILED: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"))
            print(tb, file=sys.stderr, flush=True)
            return
        for row in got if isinstance(got, list) else [got]:
            self._add(row)

    def _add(self, row: Row) -> None:
        self.rows.append(row)
        print(format_row(row), flush=True)


def format_row(row: Row) -> str:
    verdict = "skipped" if row.ok is None else "exact" if row.ok else "NOT EXACT" if not row.note.startswith(
        "FAILED") else "FAILED"
    if row.ok is None or row.note.startswith("FAILED"):
        return f"  {row.name:<60} {verdict:<9} {row.note}"
    ratio = f"{row.seconds / row.floor:5.1f}x floor" if row.floor > 0 else "   - floor"
    return f"  {row.name:<60} {verdict:<9} {row.seconds:8.3f} s  floor {row.floor:7.3f} s  {ratio}  {row.note}"


def summary(rows: list[Row], seconds: float) -> str:
    exact = sum(r.ok is True for r in rows)
    failed = sum(r.ok is False and r.note.startswith("FAILED") for r in rows)
    wrong = sum(r.ok is False for r in rows) - failed
    skipped = sum(r.ok is None for r in rows)
    return (f"pipeload bench --device: {exact} exact, {wrong} not exact, {failed} failed, {skipped} skipped "
            f"in {seconds:.0f} s")


def state(size_mb: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """A synthetic host state dict of about ``size_mb`` MiB: fp32, bf16 and int64 matrices with an even
    row count (a world of two splits them), 1-D biases and a scalar."""
    g = torch.Generator().manual_seed(seed)
    total = size_mb << 20
    sd: dict[str, torch.Tensor] = {}
    kinds = [(torch.float32, 8), (torch.bfloat16, 4), (torch.int64, 2)]
    share = total // sum(n for _, n in kinds)
    for dtype, n in kinds:
        itemsize = torch.empty((), dtype=dtype).element_size()
        rows = max(2, (share // (1024 * itemsize)) // 2 * 2)
        for i in range(n):
            name = f"{str(dtype).split('.')[-1]}.{i}"
            if dtype.is_floating_point:
                sd[name + ".weight"] = torch.randn(rows, 1024, generator=g).to(dtype)
                sd[name + ".bias"] = torch.randn(rows, generator=g).to(dtype)
            else:
                sd[name + ".weight"] = torch.randint(-2**40, 2**40, (rows, 1024), generator=g, dtype=dtype)
    sd["step"] = torch.tensor(1234, dtype=torch.int64)
    return sd


def nbytes(sd: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in sd.values())


def same(got: dict[str, Any], want: dict[str, torch.Tensor]) -> bool:
    """Every tensor of ``want`` equal (bits) in ``got`` (device tensors or DTensors, brought to the host)."""
    for k, w in want.items():
        g = got.get(k)
        if g is None:
            return False
        g = g.to_local() if hasattr(g, "to_local") else g  # (a mesh of one: the local shard is the tensor)
        if g.shape != w.shape or g.dtype != w.dtype or not torch.equal(g.cpu(), w):
            return False
    return True


def _timed(fn: Callable[[], Any], device: torch.device) -> tuple[Any, float]:
    devices.synchronize(device)
    t0 = time.perf_counter()
    out = fn()
    devices.synchronize(device)
    return out, time.perf_counter() - t0


def case_ring(b: _Bench) -> list[Row]:
    """Ring throughput against one page-locked ``copy_`` (the floor) and a plain pageable ``copy_``."""
    n = min(b.size_mb, 1024) << 20
    src = torch.randint(0, 256, (n,), dtype=torch.uint8)
    pinned = devices.host_buffer(n, True)
    pinned.copy_(src)
    floor_dst = torch.empty(n, dtype=torch.uint8, device=b.device)
    dst = torch.empty(n, dtype=torch.uint8, device=b.device)
    floors, plains, rings = [], [], []
    for _ in range(3):
        floors.append(_timed(lambda: floor_dst.copy_(pinned, non_blocking=True), b.device)[1])
        plains.append(_timed(lambda: dst.copy_(src), b.device)[1])
        dst.zero_()

        def ring_copy() -> None:
            ring = devices.H2DRing(b.device)
            ring.copy(dst, src)
            ring.close()

        rings.append(_timed(ring_copy, b.device)[1])
    floor = min(floors)
    b.h2d_bps = n / floor
    ok = torch.equal(dst, floor_dst) and torch.equal(dst[:4096].cpu(), src[:4096])
    gib = n / 2**30
    return [Row(f"ring H2D, {n >> 20} MiB pageable -> device", ok, min(rings), floor,
                f"ring {gib / min(rings):.1f} GiB/s, page-locked copy_ {gib / floor:.1f} GiB/s, "
                f"pageable copy_ {gib / min(plains):.1f} GiB/s ({pinned.is_pinned() and 'pinned' or 'NOT pinned'})")]


def write_checkpoints(sd: dict[str, torch.Tensor], root: str) -> dict[str, str]:
    """The state dict saved by pipeload, by DCP and as an HF safetensors file: {format: directory}."""
    import pipeload

    dirs = {f: os.path.join(root, f) for f in FORMATS}
    pipeload.save(sd, dirs["pipeload"])
    import torch.distributed.checkpoint as dcp

    try:
        dcp.save(sd, checkpoint_id=dirs["dcp"], no_dist=True)
    except TypeError:  # a torch whose save has no no_dist
        dcp.save(sd, checkpoint_id=dirs["dcp"])
    from safetensors.torch import save_file

    os.makedirs(dirs["hf"], exist_ok=True)
    save_file({k: v.contiguous() for k, v in sd.items()}, os.path.join(dirs["hf"], "model.safetensors"))
    return dirs


def case_loads_world_of_one(b: _Bench, sd: dict, dirs: dict[str, str]) -> list[Row]:
    """Each format into device DTensors (Shard(0) on a mesh of one) under the accelerator's backend."""
    import pipeload
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard

    mesh = init_device_mesh(b.device.type, (1,))
    backend = dist.get_backend_config()
    rows = []
    for fmt in FORMATS:
        for attempt in ("first", "again"):
            dest = {k: DTensor.from_local(torch.zeros_like(v, device=b.device), mesh,
                                          [Shard(0)] if v.dim() else [Replicate()], run_check=False)
                    for k, v in sd.items()}
            stats, took = _timed(lambda: pipeload.load(dest, dirs[fmt], format=fmt), b.device)
            rows.append(Row(f"load {fmt} -> device DTensors, world of 1 ({attempt})", same(dest, sd), took,
                            b.floor(nbytes(sd)), f"{backend}; plan reused: {stats.plan_reused}"))
    return rows


def case_load_file(b: _Bench, sd: dict, root: str) -> list[Row]:
    """``load_file`` of a torch.save file and of a safetensors file with ``map_location`` the device."""
    import pipeload
    from safetensors.torch import save_file

    pt, st = os.path.join(root, "whole.pt"), os.path.join(root, "whole.safetensors")
    torch.save(sd, pt)
    save_file({k: v.contiguous() for k, v in sd.items()}, st)
    rows = []
    for path in (pt, st):
        got, took = _timed(lambda: pipeload.load_file(path, map_location=str(b.device)), b.device)
        on = all(v.device == b.device for v in got.values())
        rows.append(Row(f"load_file {os.path.basename(path)} -> {b.device}", same(got, sd) and on, took,
                        b.floor(nbytes(sd)), "" if on else "some tensors not on the device"))
    return rows


def case_background_save(b: _Bench, sd: dict, root: str) -> Row:
    """A background save of device tensors, the caller overwriting them right after the call returns."""
    import pipeload

    live = {k: v.to(b.device, copy=True) for k, v in sd.items()}  # (copy: sd keeps the expected values)
    devices.synchronize(b.device)
    t0 = time.perf_counter()
    handle = pipeload.save(live, os.path.join(root, "background"), background=True)
    call = time.perf_counter() - t0
    for v in live.values():  # the trainer's next step
        v.add_(1)
    handle.wait(120)
    total = time.perf_counter() - t0
    back = {k: torch.zeros_like(v) for k, v in sd.items()}
    pipeload.load(back, os.path.join(root, "background"))
    return Row("background save of device tensors (call; snapshot)", same(back, sd), call, b.floor(nbytes(sd)),
               f"whole save {total:.2f} s; caller's tensors changed after the call, checkpoint holds the call's")


def case_tier(b: _Bench, sd: dict, root: str, fallback: str) -> Row:
    """A memory tier snapshot of device tensors, restored into device tensors."""
    import pipeload

    tier = pipeload.MemoryTier(os.path.join(root, "tier"), job="bench-device")
    live = {k: v.to(b.device) for k, v in sd.items()}
    _, snap = _timed(lambda: pipeload.save(live, tier, step=1), b.device)
    dest = {k: torch.zeros_like(v, device=b.device) for k, v in sd.items()}
    stats, took = _timed(lambda: pipeload.load(dest, tier, fallback=fallback), b.device)
    ok = same(dest, sd) and stats.source == "tier"
    return Row("tier snapshot + restore of device tensors (restore)", ok, took, b.floor(nbytes(sd)),
               f"snapshot {snap:.2f} s; source {stats.source!r}, step {stats.step}")


def _gloo_rank(rank: int, world: int, dirs: dict, root: str, size_mb: int, kind: str) -> list[tuple]:
    """One rank of the gloo world: (name, exact, seconds, bytes received, note) per sub-case. Every rank
    uses device 0 of ``kind`` (one accelerator shared by the ranks)."""
    import pipeload

    dev = torch.device(kind, 0) if kind != "cpu" else torch.device("cpu")
    devices.set_current(dev)
    sd = state(size_mb)
    out = []
    for fmt in FORMATS:
        try:
            dest = {k: torch.zeros_like(v, device=dev) for k, v in sd.items()}
            stats, took = _timed(lambda: pipeload.load(dest, dirs[fmt], format=fmt,
                                                       broadcast_replicated_tensors=True), dev)
            out.append((f"load {fmt} -> device tensors, gloo world of {world}", same(dest, sd), took,
                        stats.bytes_received, f"received {stats.bytes_received >> 20} MiB"))
        except Exception as e:  # noqa: BLE001 - reported, the next sub-case runs
            out.append((f"load {fmt} -> device tensors, gloo world of {world}", False, 0.0, 0,
                        f"FAILED: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"))
    out.append(_gloo_dtensors(rank, world, dirs["pipeload"], sd, dev))
    for name in ("whole.pt", "whole.safetensors"):
        try:
            got, took = _timed(lambda: pipeload.load_file(os.path.join(root, name), map_location=str(dev),
                                                          broadcast=True), dev)
            out.append((f"load_file {name} -> device, gloo world of {world}", same(got, sd), took, 0, "broadcast"))
        except Exception as e:  # noqa: BLE001
            out.append((f"load_file {name} -> device, gloo world of {world}", False, 0.0, 0,
                        f"FAILED: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"))
    return out


def _gloo_dtensors(rank: int, world: int, path: str, sd: dict, dev: torch.device) -> tuple:
    """Device DTensors sharded by rows over the gloo world (each rank its block of every matrix)."""
    import pipeload
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard

    name = f"load pipeload -> device DTensors Shard(0), gloo world of {world}"
    try:
        mesh = init_device_mesh(dev.type, (world,))
        dest, want = {}, {}
        for k, v in sd.items():
            if v.dim() and v.shape[0] % world == 0:
                local = v.chunk(world)[rank]
                dest[k] = DTensor.from_local(torch.zeros_like(local, device=dev), mesh, [Shard(0)], run_check=False)
            else:
                local = v
                dest[k] = DTensor.from_local(torch.zeros_like(v, device=dev), mesh, [Replicate()], run_check=False)
            want[k] = local
        stats, took = _timed(lambda: pipeload.load(dest, path, broadcast_replicated_tensors=True), dev)
        return name, same(dest, want), took, stats.bytes_received, f"received {stats.bytes_received >> 20} MiB"
    except Exception as e:  # noqa: BLE001 - reported, the next sub-case runs
        return name, False, 0.0, 0, f"FAILED: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"


def case_gloo_world(b: _Bench, sd: dict, dirs: dict, root: str) -> list[Row]:
    """Every rank of a local gloo world holding device tensors (the ranks share the accelerator)."""
    from .._world import run_world

    per_rank = run_world(_gloo_rank, b.world, dirs, root, b.size_mb, b.device.type, timeout=max(30.0, b.left() - 10),
                         separate_hosts=True)
    rows = []
    for i, (name, _, _, _, note) in enumerate(per_rank[0]):
        oks = [r[i][1] for r in per_rank]
        took = max(r[i][2] for r in per_rank)
        notes = "; ".join(sorted({r[i][4] for r in per_rank if r[i][4]}))
        failed = next((r[i][4] for r in per_rank if r[i][4].startswith("FAILED")), None)
        rows.append(Row(name, all(oks), took, b.floor(nbytes(sd)), failed or notes))
    return rows


def _init_group(device: torch.device) -> str:
    """A world of one whose group moves ``device``'s tensors (host memory: gloo); its backend config."""
    import torch.distributed as dist

    if device.type == "cpu":
        backend = "gloo"
    else:
        moving = dist.Backend.default_device_backend_map.get(device.type)
        if moving is None or moving == "gloo":
            raise RuntimeError(f"torch knows no collective backend for {device.type} (default_device_backend_map)")
        backend = f"cpu:gloo,{device.type}:{moving}"
    dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    return str(dist.get_backend_config())


def _grouped_cases(b: _Bench, sd: dict, dirs: dict, root: str) -> None:
    """The cases run in a world of one with the accelerator's backend (a trainer's setting)."""
    import torch.distributed as dist

    try:
        config = _init_group(b.device)
    except Exception as e:  # noqa: BLE001 - the cases below still run, without a group
        print(f"  (no process group for {b.device.type}: {type(e).__name__}: {e}; running without one)", flush=True)
        config = None
    try:
        if config is not None:
            b.case("load -> device DTensors, world of 1", lambda: case_loads_world_of_one(b, sd, dirs))
        b.case("background save of device tensors", lambda: case_background_save(b, sd, root))
        b.case("tier snapshot + restore of device tensors", lambda: case_tier(b, sd, root, dirs["pipeload"]))
    finally:
        if config is not None:
            devices.synchronize(b.device)
            dist.destroy_process_group()


def run(size_mb: int = DEFAULT_SIZE_MB, budget: float = BUDGET_SECONDS, world: int = 2, dir: str | None = None,
        device: torch.device | None = None) -> int:
    """Run every case; 0 when every case that ran was exact (or no accelerator was found), else 1.

    ``device``: run on that device instead of the accelerator (``torch.device("cpu")`` rehearses every
    case's code on the host, the tests do)."""
    if device is None:
        kind = devices.accelerator()
        if kind is None:
            print("pipeload bench --device: no accelerator found (torch.accelerator.is_available() is False); "
                  "nothing was run")
            return 0
        device = torch.device(kind, torch.accelerator.current_device_index())
    b = _Bench(device, size_mb, budget, world)
    name = _device_name(device)
    print(f"pipeload bench --device: {name}, torch {torch.__version__}, state {size_mb} MiB, gloo world of "
          f"{world}, budget {budget:.0f} s; floor = the bytes at the page-locked copy_ rate of the first case",
          flush=True)
    root = tempfile.mkdtemp(prefix="pipeload-bench-device-", dir=dir)
    watchdog = threading.Timer(budget + GRACE_SECONDS, _stuck, (b, root))
    watchdog.daemon = True
    watchdog.start()
    try:
        b.case("ring H2D", lambda: case_ring(b))
        sd = state(size_mb)
        try:
            dirs = write_checkpoints(sd, root)
        except Exception as e:  # noqa: BLE001 - the loads cannot run; the rest can
            print(f"  writing the checkpoints failed: {type(e).__name__}: {e}", flush=True)
            traceback.print_exc()
            dirs = {f: os.path.join(root, "missing-" + f) for f in FORMATS}
        b.case("load_file -> device, world of 1", lambda: case_load_file(b, sd, root))
        _grouped_cases(b, sd, dirs, root)
        if world > 1:
            b.case(f"gloo world of {world} holding device tensors", lambda: case_gloo_world(b, sd, dirs, root))
    finally:
        watchdog.cancel()
        shutil.rmtree(root, ignore_errors=True)
    print(summary(b.rows, time.perf_counter() - b.t0), flush=True)
    return 0 if all(r.ok is not False for r in b.rows) else 1


def _stuck(b: _Bench, root: str) -> None:
    """The total time guard: a case still running past the budget (a hung collective) ends the process,
    after printing what ran and the summary."""
    print(f"  {b.running:<60} FAILED    still running {time.perf_counter() - b.t0:.0f} s after the start "
          f"(budget {b.budget:.0f} s): stopped", flush=True)
    b.rows.append(Row(b.running, False, note="FAILED: stuck"))
    print(summary(b.rows, time.perf_counter() - b.t0), flush=True)
    shutil.rmtree(root, ignore_errors=True)
    os._exit(1)


def _device_name(device: torch.device) -> str:
    if device.type == "cpu":
        return "cpu (rehearsal: no accelerator copies)"
    try:
        module = torch.get_device_module(device.type)
        return f"{device} ({module.get_device_name(device)})"
    except Exception:  # noqa: BLE001 - the name is decoration
        return str(device)
