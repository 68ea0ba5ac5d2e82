"""``pipeload.load_file``: a whole-file checkpoint every rank of a group loads, read from storage once.

Trainers that keep a checkpoint in one file (Lightning's DDP ``load_checkpoint``, Accelerate's
``load_state``, a ``Trainer`` resuming) call ``torch.load(path)`` on every rank: W ranks, W reads of
the same bytes. Here one rank of the group reads the file and broadcasts its bytes in chunks while it
reads the next ones; every rank then deserializes the same bytes with the call the caller would have
made, so every rank returns what ``torch.load`` (or ``safetensors.torch.load_file``) returns.

The collectives, issued in this order by every rank of the group (see docs/ARCHITECTURE.md):

1. four words per rank — contended, host, a hash of the collective-deciding options, a hash of the
   path: every rank decides alike whether the bytes are broadcast and which rank reads them (rank 0's
   path hash modulo the group size, so the files of one state directory spread their reads);
2. broadcast, the reading rank's file size (-1: it could not open the file, then 4.);
3. the bytes, ``ceil(size / chunk_bytes)`` broadcasts through a ring of ``max_inflight`` chunk
   buffers, at most ``max_inflight`` outstanding; a thread of the reader copies storage into its
   buffer ahead of them, and a reader whose read failed still sends (nothing more is read);
4. one word per rank: whether the read failed or the file changed under it (size, mtime, inode);
   then every rank raises one ``DistributedError`` naming the reader, the file and the cause;
5. each rank deserializes the buffer; one word per rank: whether it failed, then every rank raises.

Without broadcasting (``broadcast=False``, or ``"auto"`` with every rank on one host under gloo) only
1. and 5. remain: each rank calls ``torch.load(path)`` itself. A world of one issues no collective.

Memory: every rank's copy of the file is an anonymous in-memory file (``memfd``) written with
``pwrite`` (the broadcasts go through a small ring of chunk buffers); a ``torch.save`` zip is then
loaded with ``torch.load(..., mmap=True)`` and a safetensors file with safetensors' own mapping, both
over that file, so the tensors returned *are* those pages (no second copy). A file in the legacy
(non-zip) format is read from it into new storages: the buffer and the result coexist until the call
returns (at most the file twice, transiently).
"""

from __future__ import annotations

import concurrent.futures
import mmap
import os
import pickle
import stat as stat_module
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from .. import device as devices
from ..errors import CheckpointFormatError, DistributedError, PipeloadError, ReadError, UnpicklingError
from ..io import storage
from ..plan.exchange import hash64, host_id
from ._busy import Guard, refuse_contended_or_disagreeing
from .comm import Comm

CHUNK_BYTES = 4 << 20  # bytes per broadcast
MAX_INFLIGHT = 8  # broadcasts outstanding (and, under an accelerator backend, device chunks)
READ_STEP = 4 << 20  # bytes per preadv (and pwrite) of the reading thread
_STAGE_ON_HOST = False  # tests: run the accelerator path's device slots with host chunks
_ZIP = b"PK\x03\x04"  # how a torch.save zip (the default format since torch 1.6) begins


@dataclass
class FileStats:
    """What one rank's :func:`load_file` did (pass one as ``stats=`` to have it filled)."""

    path: str = ""
    size: int = 0  # bytes of the file
    format: str = ""  # "torch-zip", "torch-pickle" (legacy format, or bytes torch.load refuses), "safetensors"
    broadcast: bool = False  # read once by ``reader`` and broadcast; False: every rank read the file itself
    reader: int = -1  # the group rank that read the file (-1: every rank read its own)
    bytes_read: int = 0  # bytes this rank read from storage (fetched, for an object store)
    bytes_received: int = 0  # bytes this rank received by broadcast
    broadcasts: int = 0  # data broadcasts this rank took part in
    # exchange, transfer, deserialize, agree; read and wait: the caller's waits for storage and for the
    # oldest broadcast within transfer
    timings: dict[str, float] = field(default_factory=dict)
    wall: float = 0.0


@dataclass
class _Run:
    path: str
    comm: Comm
    stats: FileStats
    map_location: Any
    weights_only: bool
    last: float = field(default_factory=time.perf_counter)

    @property
    def what(self) -> str:
        return f"pipeload.load_file of {self.path}"

    def lap(self, phase: str) -> None:
        now = time.perf_counter()
        self.stats.timings[phase] = self.stats.timings.get(phase, 0.0) + now - self.last
        self.last = now


def load_file(path: str | os.PathLike, *, process_group=None, map_location=None, weights_only: bool = True,
              broadcast: bool | str = "auto", stats: FileStats | None = None, storage_options: dict | None = None,
              timeout=None, chunk_bytes: int = CHUNK_BYTES, max_inflight: int = MAX_INFLIGHT) -> Any:
    """What ``torch.load(path, map_location=..., weights_only=...)`` returns, on every rank of the group,
    the file read from storage by one rank. Every rank of ``process_group`` (default: the world) must
    call it; without an initialised process group it is a world of one.

    A path ending in ``.safetensors`` returns what ``safetensors.torch.load_file(path, device)`` returns
    (``map_location``: None, a device or a device string); any other file what ``torch.load`` returns,
    whatever its content (a ``torch.save`` zip, the legacy format, or bytes ``torch.load`` refuses,
    which fail alike on every rank). ``path`` may be a URL (``s3://bucket/key``, ``storage_options`` as
    for :func:`pipeload.load`): the reader fetches it by ranged GETs pinned to one version.

    Options:
        weights_only: as ``torch.load``'s (default True): what it refuses is refused, on every rank, as
            :class:`pipeload.UnpicklingError` (a ``pickle.UnpicklingError``) naming the file and rank.
        broadcast: ``"auto"`` (default): read once and broadcast under an accelerator backend, and under
            gloo when the group spans hosts (``socket.gethostname()`` or ``PIPELOAD_HOST_ID``; ranks of
            one host share a page cache, where a second read costs a memory copy); ``True``: always;
            ``False``: every rank reads the file itself.
        stats: a :class:`FileStats` filled with what this rank did (also when the call raises).
        timeout: how long to wait for an earlier pipeload operation of this process on an overlapping
            group before refusing (default: the group's timeout; the collectives keep the group's own).
        chunk_bytes, max_inflight: bytes per broadcast (4 MiB) and broadcasts outstanding (8); every
            rank must pass the same.

    Every failure raises on every rank. The file missing or unreadable on the reader, truncated,
    replaced or changed while read: one :class:`pipeload.DistributedError` naming the reader, the file
    and the cause, before anything is deserialized. A deserialization that failed: the rank's own error
    (``UnpicklingError``, ``CheckpointFormatError`` with torch's words, the file and the rank; the same
    bytes fail alike everywhere), a ``DistributedError`` naming them on a rank that did not fail. A
    rank that died: the collective's error on the others, naming the silent rank where it can.
    """
    path = os.fspath(path)
    _check_options(path, map_location, broadcast, chunk_bytes, max_inflight)
    stats = stats if stats is not None else FileStats()
    stats.__init__(path=path)  # a FileStats passed again starts afresh
    t0 = time.perf_counter()
    try:
        storage.configure(path, storage_options)
        comm = Comm(process_group, timeout)
        run = _Run(path, comm, stats, map_location, weights_only)
        if comm.size == 1:
            result, error = _each_reads(run)
            if error is not None:
                raise error
            return result
        with Guard() as guard:
            contended = guard.enter_sync(comm, True, run.what, comm.timeout.total_seconds())
            reader = _first_gather(run, (broadcast, chunk_bytes, max_inflight), contended)
            result, error = _read_once(run, reader, chunk_bytes, max_inflight) if reader >= 0 else _each_reads(run)
            _agree(run, error, guard.late(comm))
            return result
    finally:
        stats.wall = time.perf_counter() - t0


def _check_options(path: str, map_location, broadcast, chunk_bytes: int, max_inflight: int) -> None:
    if broadcast not in (True, False, "auto"):
        raise ValueError(f"broadcast must be True, False or 'auto', not {broadcast!r}")
    if chunk_bytes < 1 or max_inflight < 1:
        raise ValueError("chunk_bytes and max_inflight must be at least 1")
    if path.endswith(".safetensors") and not (map_location is None or isinstance(map_location, (str, int, torch.device))):
        raise ValueError(f"{path}: a safetensors file takes a device as map_location (safetensors.torch.load_file's "
                         f"device), not {type(map_location).__name__}")


def _first_gather(run: _Run, agreed: tuple, contended: str | None) -> int:
    """The first collective: the reading rank, or -1 when every rank reads the file itself."""
    comm = run.comm
    agreed_words = repr((agreed, comm.broadcast_device.type)).encode()  # the device decides collectives too
    row = np.array([contended is not None, host_id(), hash64(agreed_words), hash64(run.path.encode())],
                   dtype=np.int64)
    first = comm.gather_rows(row, run.what, "first gather of load_file")
    run.lap("exchange")
    refuse_contended_or_disagreeing(run.what, first[:, 0] != 0, first[:, 2], contended,
                                    "broadcast, chunk_bytes or max_inflight (or broadcast device: the group's "
                                    "backend and accelerator)")
    broadcast = agreed[0]
    one_host = len(np.unique(first[:, 1])) == 1
    if broadcast is False or (broadcast == "auto" and one_host and comm.broadcast_device.type == "cpu"):
        return -1
    return int(first[0, 3]) % comm.size


# -- every rank on its own -------------------------------------------------------------------------------


def _each_reads(run: _Run) -> tuple[Any, PipeloadError | None]:
    """This rank reads and deserializes the file itself: ``(result, None)`` or ``(None, its error)``."""
    try:
        if not storage.is_url(run.path):
            run.stats.size = run.stats.bytes_read = os.stat(run.path).st_size
            with open(run.path, "rb") as f:
                head = f.read(len(_ZIP))
            return _deserialize(run, run.path, head == _ZIP, mapped=False), None
        source = _ObjectSource(run.path)
        mem = _Memfile(source.size)
        try:
            run.stats.size = source.size
            source.start(mem)
            source.wait_for(source.size)
            run.stats.bytes_read = source.fetched
            source.close()
            run.lap("transfer")
            return _deserialize(run, mem.path, mem.head() == _ZIP), None
        finally:
            source.close()
            mem.close()
    except PipeloadError as e:
        return None, e
    except OSError as e:
        return None, ReadError(f"{run.path}: reading it on rank {run.comm.rank} failed: {type(e).__name__}: {e}")


def _deserialize(run: _Run, where: str, is_zip: bool, mapped: bool = True) -> Any:
    """``torch.load`` (or safetensors' ``load_file``) of ``where``, which holds the file's bytes; errors
    name the file (not ``where``) and this rank. ``mapped``: ``where`` is the received buffer, which a
    zip's tensors then map instead of copying."""
    t0 = time.perf_counter()
    st = run.path.endswith(".safetensors")
    run.stats.format = "safetensors" if st else "torch-zip" if is_zip else "torch-pickle"
    try:
        if st:
            from safetensors.torch import load_file as safetensors_load

            device = "cpu" if run.map_location is None else run.map_location
            target = _ring_target(device)
            if target is not None:  # read on the host, then through the ring
                return _tensors_via_ring(safetensors_load(where, device="cpu"), target)
            return safetensors_load(where, device=str(device) if isinstance(device, torch.device) else device)
        if not (mapped and is_zip):
            return torch.load(where, map_location=run.map_location, weights_only=run.weights_only)
        # MAP_SHARED: the buffer is this rank's alone, and a tensor written in place (an optimizer's
        # state) then writes its pages instead of copying them (a private mapping would keep both)
        target = _ring_target(run.map_location)
        with torch.serialization.set_default_mmap_options(mmap.MAP_SHARED):
            if target is None:
                return torch.load(where, map_location=run.map_location, weights_only=run.weights_only, mmap=True)
            with _StorageRing(target) as place:  # each storage once, through the ring (views keep sharing)
                return torch.load(where, map_location=place, weights_only=run.weights_only, mmap=True)
    except pickle.UnpicklingError as e:
        raise UnpicklingError(f"{run.path}: torch.load(weights_only={run.weights_only}) refused it on rank "
                              f"{run.comm.rank}: {_text(e, where, run.path)}") from e
    except PipeloadError:
        raise
    except Exception as e:  # noqa: BLE001 - torch's and safetensors' errors are of many kinds
        call = "safetensors.torch.load_file" if st else "torch.load"
        raise CheckpointFormatError(f"{run.path}: {call} failed on rank {run.comm.rank}: {type(e).__name__}: "
                                    f"{_text(e, where, run.path)}") from e
    finally:
        run.stats.timings["deserialize"] = time.perf_counter() - t0
        run.last = time.perf_counter()


def _ring_target(map_location) -> torch.device | None:
    """The accelerator device ``map_location`` names alone (a string or a device of the accelerator in
    use), which the received bytes reach through a :class:`pipeload.device.H2DRing`; None otherwise."""
    if not isinstance(map_location, (str, torch.device)):
        return None
    try:
        dev = torch.device(map_location)
    except (RuntimeError, ValueError):
        return None
    if dev.type == "cpu" or dev.type != devices.accelerator():
        return None
    return dev if dev.index is not None else torch.device(dev.type, torch.accelerator.current_device_index())


class _StorageRing:
    """``torch.load``'s ``map_location`` callable: each storage copied to ``device`` through one ring,
    whose last copies are waited for when the block ends."""

    def __init__(self, device: torch.device):
        self.ring = devices.H2DRing(device)

    def __enter__(self) -> "_StorageRing":
        return self

    def __exit__(self, *exc) -> None:
        self.ring.close()

    def __call__(self, storage, location: str):
        n = storage.nbytes()
        out = torch.empty(n, dtype=torch.uint8, device=self.ring.device)
        if n:
            self.ring.copy(out, torch.empty(0, dtype=torch.uint8).set_(storage))
        return out.untyped_storage()


def _tensors_via_ring(tensors: dict, device: torch.device) -> dict:
    """safetensors' host tensors as tensors on ``device``, copied through one ring."""
    ring = devices.H2DRing(device)
    try:
        out = {}
        for name, t in tensors.items():
            out[name] = torch.empty(t.shape, dtype=t.dtype, device=device)
            ring.copy(out[name], t)
        return out
    finally:
        ring.close()


def _text(e: BaseException, where: str, path: str) -> str:
    return str(e).replace(where, path)


def _agree(run: _Run, error: PipeloadError | None, late: str | None) -> None:
    """The last collective: every rank raises when any failed — its own error where it has one."""
    comm = run.comm
    mine = str(error) if error is not None else late
    failed = comm.gather_rows(np.array([mine is not None], dtype=np.int64), run.what, "final agreement")[:, 0]
    run.lap("agree")
    if not failed.any():
        return
    texts = comm.all_gather_object(mine, run.what)
    if error is not None:
        raise error
    raise DistributedError(run.what, {r: t for r, t in enumerate(texts) if t is not None})


# -- read once, broadcast --------------------------------------------------------------------------------


def _read_once(run: _Run, reader: int, chunk: int, inflight: int) -> tuple[Any, PipeloadError | None]:
    """Collectives 2-4 (the size, the bytes, the read's agreement), then this rank's deserialization."""
    comm, stats = run.comm, run.stats
    stats.broadcast, stats.reader = True, reader
    source, error, size = None, None, 0
    if comm.rank == reader:
        try:
            source = _ObjectSource(run.path) if storage.is_url(run.path) else _LocalSource(run.path)
            size = source.size
        except Exception as e:  # noqa: BLE001 - carried to every rank by the agreement below
            error, size = _read_error(run, e), -1
    size = int(comm.broadcast_row(np.array([size]), reader, run.what, "broadcast of the file's size")[0])
    run.lap("exchange")
    if size < 0:
        comm.agree(run.what, error)
    stats.size = size
    mem = _Memfile(size)
    try:
        try:
            error = _transfer(run, mem, source, reader, chunk, inflight)
        finally:
            if source is not None:
                source.close()
        comm.agree(run.what, error)
        run.lap("agree")
        try:
            return _deserialize(run, mem.path, mem.head() == _ZIP), None
        except PipeloadError as e:
            return None, e
    finally:
        mem.close()


def _read_error(run: _Run, e: BaseException) -> str:
    if isinstance(e, PipeloadError) and run.path in str(e):
        return str(e)
    return f"{run.path}: reading it failed: {type(e).__name__}: {e}"


def _transfer(run: _Run, mem: "_Memfile", source, reader: int, chunk: int, inflight: int) -> str | None:
    """The bytes from ``reader`` to every rank of the group; returns the reader's error (None elsewhere).

    Chunk k goes through ring slot k mod ``inflight``: the reader copies it there from its buffer once
    the source has it (the source runs ahead in a thread of its own), a receiver writes it from there
    into its buffer once its broadcast completed. At most ``inflight`` broadcasts are outstanding, so a
    slot is free again when it comes round; every one is awaited before the ring can go."""
    comm, stats = run.comm, run.stats
    reading = comm.rank == reader
    ring = _Ring(comm.broadcast_device, chunk, inflight)
    pending: deque = deque()
    error = None
    waited = [0.0, 0.0]  # for the source, on the oldest broadcast
    if reading:
        source.start(mem)
    try:
        for k, a in enumerate(range(0, mem.size, chunk)):
            b = min(mem.size, a + chunk)
            if len(pending) >= inflight:
                t0 = time.perf_counter()
                _complete(run, ring, mem, *pending.popleft())
                waited[1] += time.perf_counter() - t0
            if reading and error is None:
                t0 = time.perf_counter()
                try:
                    source.wait_for(b)
                except Exception as e:  # noqa: BLE001 - the broadcasts still go out; the agreement raises
                    error = _read_error(run, e)
                waited[0] += time.perf_counter() - t0
            sent = ring.outgoing(k, a, b, mem if reading and error is None else None)
            call = f"broadcast of bytes {a}-{b} from rank {reader}"
            pending.append((comm.post_broadcast(sent, reader, run.what, call), k, a, b, reading, call))
            stats.broadcasts += 1
        while pending:
            _complete(run, ring, mem, *pending.popleft())
    finally:
        for work, *_ in pending:  # a broadcast failed: the others must not fill a freed slot
            try:
                work.wait()
            except Exception:  # noqa: BLE001 - the first error is already propagating
                pass
        ring.close()
    run.lap("transfer")
    stats.timings["read"], stats.timings["wait"] = waited
    if reading:
        stats.bytes_read = source.fetched
        return error or source.check()
    stats.bytes_received = mem.size
    return None


def _complete(run: _Run, ring: "_Ring", mem: "_Memfile", work, k: int, a: int, b: int, reading: bool,
              call: str) -> None:
    run.comm.wait(work, run.what, call)
    if not reading:
        ring.incoming(k, a, b, mem)


class _Ring:
    """``slots`` chunk buffers the broadcasts go through, reused in turn (allocated once per call: the
    buffer of the file is written with ``pwrite``, which allocates its pages without zeroing them or
    faulting — several times cheaper than receiving into fresh memory, measured).

    Under an accelerator backend (NCCL) each slot also has a device chunk on the current device: the
    reader copies host -> device before the broadcast, a receiver device -> host after it (page-locked
    host slots; both copies complete before the CPU reuses the host slot, so no stream can still read
    or write it)."""

    def __init__(self, device: torch.device, chunk: int, slots: int):
        self.device = device
        self.host = [devices.host_buffer(chunk, devices.pinnable(device.type)) for _ in range(slots)]
        staged = device.type != "cpu" or _STAGE_ON_HOST
        self.dev = [torch.empty(chunk, dtype=torch.uint8, device=device) for _ in range(slots)] if staged else None

    def _host(self, k: int, n: int) -> tuple[torch.Tensor, memoryview]:
        t = self.host[k % len(self.host)][:n]
        return t, memoryview(t.numpy()).cast("B")

    def outgoing(self, k: int, a: int, b: int, mem: "_Memfile | None") -> torch.Tensor:
        """What chunk k's broadcast sends or fills: the reader's bytes [a, b) copied from ``mem`` (None:
        a receiver's slot, or a failed reader's, sent as it is)."""
        host, view = self._host(k, b - a)
        if mem is not None:
            mem.read(view, a)
        if self.dev is None:
            return host
        dev = self.dev[k % len(self.dev)][: b - a]
        if mem is not None:
            dev.copy_(host)
        return dev

    def incoming(self, k: int, a: int, b: int, mem: "_Memfile") -> None:
        """A receiver's chunk k, its broadcast complete, written into ``mem`` at ``a``."""
        host, view = self._host(k, b - a)
        if self.dev is not None:
            host.copy_(self.dev[k % len(self.dev)][: b - a])
        mem.write(view, a)

    def close(self) -> None:
        if self.device.type != "cpu":
            devices.current_stream(self.device).synchronize()
        self.host, self.dev = [], None


class _Memfile:
    """The file's bytes on this rank: an anonymous in-memory file (``memfd``) of its size, written and
    read with ``pwrite``/``preadv``; deserializers open it by name (``path``). Closing it leaves the
    pages that a returned tensor maps."""

    def __init__(self, size: int):
        self.size = size
        if hasattr(os, "memfd_create"):
            self.fd = os.memfd_create("pipeload-load-file", os.MFD_CLOEXEC)
        else:  # no memfd: an unlinked temporary file
            import tempfile

            f = tempfile.TemporaryFile()
            self.fd = os.dup(f.fileno())
            f.close()
        os.ftruncate(self.fd, size)

    @property
    def path(self) -> str:
        return f"/proc/self/fd/{self.fd}" if os.path.isdir("/proc/self/fd") else f"/dev/fd/{self.fd}"

    def write(self, view: memoryview, offset: int) -> None:
        done = 0
        while done < len(view):
            done += os.pwrite(self.fd, view[done:], offset + done)

    def read(self, view: memoryview, offset: int) -> None:
        done = 0
        while done < len(view):
            n = os.preadv(self.fd, [view[done:]], offset + done)
            if n <= 0:
                raise ReadError(f"pipeload's buffer ended at byte {offset + done}")
            done += n

    def head(self) -> bytes:
        return os.pread(self.fd, len(_ZIP), 0)

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


class _Progress:
    """How far a source has filled the buffer (a contiguous prefix), or the error that stopped it."""

    def __init__(self) -> None:
        self.fetched = 0
        self.error: BaseException | None = None
        self._cond = threading.Condition()

    def advance(self, upto: int) -> None:
        with self._cond:
            self.fetched = upto
            self._cond.notify_all()

    def fail(self, e: BaseException) -> None:
        with self._cond:
            self.error = e
            self._cond.notify_all()

    def wait_for(self, b: int) -> None:
        """Return once bytes [0, b) are in the buffer; raise the source's error if it stopped before."""
        with self._cond:
            self._cond.wait_for(lambda: self.fetched >= b or self.error is not None)
            if self.fetched < b:
                raise self.error


class _LocalSource(_Progress):
    """A local file copied front to back into the buffer by a thread of its own (``preadv`` into a
    small buffer, ``pwrite`` out of it): storage streams at its own pace, ahead of the broadcasts.
    ``check`` says whether the file changed meanwhile."""

    def __init__(self, path: str):
        super().__init__()
        self.path = path
        self.fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        self.stat = os.fstat(self.fd)
        if not stat_module.S_ISREG(self.stat.st_mode):
            os.close(self.fd)
            raise ReadError(f"{path}: not a regular file")
        self.size = self.stat.st_size
        self._stop = False
        self._thread: threading.Thread | None = None
        if hasattr(os, "posix_fadvise"):
            os.posix_fadvise(self.fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)

    def start(self, mem: _Memfile) -> None:
        self._thread = threading.Thread(target=self._run, args=(mem,), name="pipeload-read-file", daemon=True)
        self._thread.start()

    def _run(self, mem: _Memfile) -> None:
        pos, view = 0, memoryview(bytearray(min(self.size, READ_STEP)))
        try:
            while pos < self.size and not self._stop:
                n = os.preadv(self.fd, [view[: min(self.size - pos, READ_STEP)]], pos)
                if n <= 0:
                    raise ReadError(f"{self.path}: the file ends at byte {pos}, not at the {self.size} bytes it "
                                    f"had when it was opened (truncated while it was read)")
                mem.write(view[:n], pos)
                pos += n
                self.advance(pos)
        except BaseException as e:  # noqa: BLE001 - raised by wait_for in the caller's thread
            self.fail(e)

    def check(self) -> str | None:
        """None, or why the bytes read may not be one version of the file."""
        now = os.fstat(self.fd)
        if (now.st_size, now.st_mtime_ns) != (self.stat.st_size, self.stat.st_mtime_ns):
            return (f"{self.path}: the file changed while it was read (size {self.stat.st_size} -> {now.st_size}, "
                    f"mtime changed: {now.st_mtime_ns != self.stat.st_mtime_ns})")
        try:
            named = os.stat(self.path)
        except OSError as e:
            return f"{self.path}: the file was removed while it was read ({e.strerror})"
        if (named.st_ino, named.st_dev) != (self.stat.st_ino, self.stat.st_dev):
            return f"{self.path}: the file was replaced while it was read (another inode now has its name)"
        return None

    def close(self) -> None:
        self._stop = True
        if self._thread is not None:
            self._thread.join()
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


class _ObjectSource(_Progress):
    """An object fetched by ranged GETs (``part_size`` each, every part requested at once, the store's
    ``max_requests`` in flight) straight into a mapping of the buffer, every GET pinned to the ETag of
    one HEAD, so a replaced object fails the read."""

    def __init__(self, url: str):
        super().__init__()
        self.store, self.key = storage.store_of(url)
        self.size, self.etag = self.store.run(self.store.head(self.key))  # this call's version, not a pin
        self.parts: list[tuple[int, int, concurrent.futures.Future]] = []
        self._map: mmap.mmap | None = None

    def start(self, mem: _Memfile) -> None:
        if not self.size:
            return
        from ..io.objstore import io_loop

        self._map = mmap.mmap(mem.fd, self.size)
        view, loop, step = memoryview(self._map), io_loop(), self.store.part_size
        for lo in range(0, self.size, step):
            hi = min(self.size, lo + step)
            self.parts.append((lo, hi, loop.submit(self.store.get_into(self.key, lo, hi, self.etag, view[lo:hi]))))
        view.release()

    def wait_for(self, b: int) -> None:
        for lo, hi, fut in self.parts:
            if lo < b and hi > self.fetched:
                fut.result()  # the store's ReadError names the object and the range
                self.fetched = hi

    def check(self) -> str | None:
        return None  # every GET carried If-Match

    def close(self) -> None:
        for _, _, fut in self.parts:
            fut.cancel()
        concurrent.futures.wait([f for _, _, f in self.parts])
        if self._map is not None:
            try:
                self._map.close()
            except BufferError:  # a cancelled GET still holds its view: the mapping goes with it
                pass
            self._map = None


__all__ = ["FileStats", "load_file"]
