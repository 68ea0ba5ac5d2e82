"""What the benchmark measures the machine with: page cache residency and eviction, I/O counters, peak
RSS, the cgroup read throttle, and the floor's raw parallel read. Linux only; no torch."""

from __future__ import annotations

import bisect
import ctypes
import mmap
import os
import threading
import time
from typing import Any

from .config import MiB



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


def status_kib(field_name: str) -> int:
    """A ``/proc/self/status`` field in KiB (``VmRSS``, ``VmHWM``); 0 where absent."""
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


class DiskReads:
    """The disk's own count of the bytes it has read (``/sys/dev/block/M:m/stat``, sectors read), sampled
    every ``interval`` seconds from a thread of the bench's parent process while the ranks run: when
    storage served a load's bytes, as against when a rank asked for them or a collective finished. The
    count is the whole disk's: a diagnostic on a machine whose other processes read little."""

    def __init__(self, device: tuple[int, int], interval: float = 0.005):
        self.path = f"/sys/dev/block/{device[0]}:{device[1]}/stat"
        self.interval = interval
        self.times: list[float] = []
        self.bytes: list[int] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="bench-disk-reads", daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                with open(self.path) as f:
                    sectors = int(f.read().split()[2])
            except (OSError, ValueError, IndexError):
                return
            self.times.append(time.perf_counter())  # CLOCK_MONOTONIC: the ranks' perf_counter too
            self.bytes.append(sectors * 512)
            self._stop.wait(self.interval)

    def __enter__(self) -> "DiskReads":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def span(self, t0: float, t1: float) -> dict[str, float] | None:
        """Of the reads between ``t0`` and ``t1``: when the first MiB and the last byte had been read
        (seconds after ``t0``) and the MiB read; None without samples around them."""
        lo = bisect.bisect_right(self.times, t0) - 1
        hi = bisect.bisect_right(self.times, t1 + 2 * self.interval)
        if lo < 0 or hi - lo < 2:
            return None
        base, end = self.bytes[lo], self.bytes[hi - 1]
        times, counts = self.times[lo:hi], self.bytes[lo:hi]
        first = next((t for t, b in zip(times, counts) if b - base >= MiB), None)
        last = next(t for t, b in zip(times, counts) if b >= end - MiB // 2)
        return {"first_s": None if first is None else first - t0, "last_s": last - t0, "mib": (end - base) / MiB}


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
