"""``pipeload.save()``: every rank streams the chunks it owns into its own safetensors file.

Order of a save (every rank of the group), in three phases:

1. :func:`plan_phase`, no I/O: three words per rank decide whether every rank reuses the plan of the
   previous save (:mod:`pipeload.save.savecache`; rank 0's word is the fresh save id; the third says a
   rank's caller declined the save, :func:`decline`). Otherwise each rank
   builds its columnar record (:mod:`pipeload.save.saveplan`: name table and shard record; objects
   serialised and checked to load back under ``weights_only=True``), the rows and the distinct records
   are exchanged, and every rank derives the same plan: replicated chunks written once, by the writer
   the design's greedy picks. Any rank's problem, and any disagreement between ranks, raises on every
   rank before a single byte is written.
2. :func:`write_phase`: each rank writes ``data-<save id>-<rank>.safetensors``, tensor by tensor,
   host tensors straight from their memory, in ``writev`` batches of at most 8 MiB (a device tensor's
   host copy lives until its batch is written: never a second copy of the state dict), checksumming
   while it writes, then fsyncs the file and the directory.
3. :func:`commit_phase`: two words per rank agree on the writes; each rank's chunk rows (box,
   checksum) are gathered to rank 0, which writes the chunk index and ``.metadata`` (temporary name,
   fsync, rename, fsync): that rename is the commit point. The data files of the checkpoint it
   replaces are deleted after it, by a thread of rank 0 (the next commit of the process waits for
   it). One word per rank agrees on the commit.

Because data file names carry the save id, an unfinished save never mixes with a finished one: until
the new ``.metadata`` lands, the directory loads as the previous checkpoint (or not at all).
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import io
import json
import math
import os
import re
import sys
import threading
import time
import warnings
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np
import torch

from ..plan import balance
from . import savecache, saveowners, saveplan
from .saveplan import encode_object  # noqa: F401 - the saver's rule, kept importable here
from ..io import storage
from ..engine._busy import Guard
from ..io.checksum import checksum
from ..formats.chunkindex import ARRAYS, build_arrays, index_file_name
from ..engine.comm import Comm
from ..errors import CheckpointFormatError, DistributedError, StateDictError
from ..formats.metadata import (METADATA_FILE, Metadata, ObjectMeta, TensorMeta, dtype_itemsize,
                                read_metadata_bytes, tiling_problem)
from ..plan.statedict import flatten

DATA_FILE_RE = re.compile(r"^(data-[0-9a-f]{16}-\d{5,}|index-[0-9a-f]{16})\.safetensors$")
_BATCH_BYTES = 8 << 20  # a writev goes out once its views hold this many bytes
_BATCH_VIEWS = 1024  # or this many views (IOV_MAX on Linux)


def data_file_name(save_id: str, rank: int) -> str:
    return f"data-{save_id}-{rank:05d}.safetensors"


def object_key(fqn: str) -> str:
    return f"{fqn}#object"


def plan_save(per_rank: list[list[tuple]]) -> tuple[dict[tuple, int], dict[str, tuple], list[str]]:
    """The reference plan over every rank's entries: ({key: owner rank}, {fqn: (dtype, shape)}, problems).

    What the save ran on every rank before it was planned through the exchange (W x S entries in
    Python); kept as the rule :mod:`pipeload.save.saveplan` must reproduce (the tests compare them). Entries
    are ``("t", fqn, dtype, global shape, offsets, lengths)`` and ``("o", fqn, nbytes, checksum)``.
    """
    problems: list[str] = []
    holders: dict[tuple, list[int]] = defaultdict(list)
    weights: dict[tuple, int] = {}
    tensors: dict[str, tuple[str, tuple[int, ...]]] = {}
    chunks: dict[str, set[tuple]] = defaultdict(set)
    kinds: dict[str, str] = {}
    object_sums: dict[str, set[str]] = defaultdict(set)
    for rank, entries in enumerate(per_rank):
        for e in entries:
            kind, fqn = e[0], e[1]
            if kinds.setdefault(fqn, kind) != kind:
                problems.append(f"{fqn!r}: a tensor on some ranks and a Python object on rank {rank}")
                continue
            if kind == "t":
                _, _, dtype, shape, offsets, lengths = e
                known = tensors.setdefault(fqn, (dtype, shape))
                if known != (dtype, shape):
                    problems.append(
                        f"{fqn!r}: rank {rank} has dtype {dtype} shape {list(shape)}, "
                        f"an earlier rank {known[0]} {list(known[1])}"
                    )
                    continue
                key = ("t", fqn, offsets, lengths)
                weights[key] = math.prod(lengths) * dtype_itemsize(dtype)
                chunks[fqn].add(key)
            else:
                _, _, nbytes, csum = e
                key = ("o", fqn)
                weights[key] = max(weights.get(key, 0), nbytes)
                object_sums[fqn].add(csum)
            holders[key].append(rank)
    for fqn, keys in chunks.items():
        shape = tensors[fqn][1]
        # Zero-size chunks carry no bytes: keep one only to record an empty tensor.
        empty = sorted(k for k in keys if weights[k] == 0)
        for k in empty[1:] if len(empty) == len(keys) else empty:
            del weights[k], holders[k]
            keys.discard(k)
        problem = tiling_problem(shape, [(k[2], k[3]) for k in keys])
        if problem:
            problems.append(f"{fqn!r}: the ranks' shards {problem}")
    owners = _owners(weights, holders)
    differing = sorted(f for f, sums in object_sums.items() if len(sums) > 1)
    if differing:
        warnings.warn(
            f"pipeload.save: Python objects differ between ranks; one rank's value is stored for "
            f"{differing[:5]}{' ...' if len(differing) > 5 else ''}",
            RuntimeWarning,
            stacklevel=3,
        )
    return owners, tensors, problems


def _owners(weights: dict[tuple, int], holders: dict[tuple, list[int]]) -> dict[tuple, int]:
    """Who writes what, chosen so that a load with the same layout reads each rank's own file.

    A chunk only one rank holds is written by it. Chunks several ranks hold go through the same
    greedy, with the same starting loads (each rank's single-holder bytes), as the load's choice of
    readers (:func:`pipeload.plan.planner.global_plan`), so on an unchanged layout every reader finds its
    shards in the file it wrote and reads it front to back. Python objects, which every rank reads
    for itself on load, all go to one file: the least loaded rank's, after its tensors.
    """
    owners: dict[tuple, int] = {}
    base: dict[int, int] = {}
    shared: dict[tuple, int] = {}
    for key, w in weights.items():
        if key[0] != "t":
            continue
        if len(holders[key]) == 1:
            owners[key] = holders[key][0]
            base[owners[key]] = base.get(owners[key], 0) + w
        else:
            shared[key] = w
    owners.update(balance.assign(shared, holders, base))
    objects = [k for k in weights if k[0] == "o"]
    if objects:
        written: dict[int, int] = {}
        for key, r in owners.items():
            written[r] = written.get(r, 0) + weights[key]
        candidates = set.intersection(*(set(holders[k]) for k in objects)) or None
        pool = sorted(candidates) if candidates else sorted({r for k in objects for r in holders[k]})
        target = min(pool, key=lambda r: (written.get(r, 0), r))
        for key in objects:
            owners[key] = target if target in holders[key] else holders[key][0]
    return owners


_from_memory = ctypes.pythonapi.PyMemoryView_FromMemory
_from_memory.restype = ctypes.py_object
_from_memory.argtypes = (ctypes.c_void_p, ctypes.c_ssize_t, ctypes.c_int)
_PyBUF_READ = 0x100


def _host_bytes(t: torch.Tensor) -> tuple[memoryview, Any]:
    """(a host, contiguous byte view of ``t``, what keeps its memory alive); copies only when ``t`` is on
    a device or its bytes are not its values as laid out (strided, conjugate, negative views).

    The common case (a contiguous host tensor) is a view over ``t``'s memory made directly (~2 us): the
    chain of torch views and ``numpy()`` cost ~50 us per tensor, more than writing most of them.
    """
    if t.device.type == "cpu" and t.is_contiguous() and not t.is_conj() and not t.is_neg():
        n, p = t.nbytes, t.data_ptr()
        if p or not n:  # (a subclass without memory of its own reports 0: torch's copy below raises or works)
            return (_from_memory(p, n, _PyBUF_READ) if n else memoryview(b"")), t
    t = t.detach()
    if t.device.type != "cpu":
        t = t.to("cpu")
    t = t.resolve_conj().resolve_neg().contiguous().reshape(-1)
    if t.numel() == 0:
        return memoryview(b""), t
    return memoryview(t.view(torch.uint8).numpy()), t


class _Batch:
    """Views written by one ``writev`` (local files) once they reach :data:`_BATCH_BYTES` or
    :data:`_BATCH_VIEWS`: no byte is copied on its way to the kernel, and small tensors cost one
    system call per batch, not one each. Each view's owner is held until the view is written."""

    def __init__(self, f) -> None:
        self.f, self.views, self.owners, self.nbytes = f, [], [], 0
        self.fd = f.fileno() if isinstance(f, io.FileIO) else None

    def add(self, view: memoryview, owner: Any) -> None:
        self.views.append(view)
        self.owners.append(owner)
        self.nbytes += view.nbytes
        if self.nbytes >= _BATCH_BYTES or len(self.views) >= _BATCH_VIEWS:
            self.flush()

    def add_framed(self, head, view: memoryview, owner: Any, tail) -> None:
        """``head`` (bytes-like), ``view`` (kept alive by ``owner``), ``tail``, in that order: one item's
        three views for the price of one :meth:`add`."""
        self.views += (memoryview(head), view, memoryview(tail))
        self.owners.append(owner)
        self.nbytes += len(head) + view.nbytes + len(tail)
        if self.nbytes >= _BATCH_BYTES or len(self.views) > _BATCH_VIEWS - 3:
            self.flush()

    def flush(self) -> None:
        views, self.views, self.owners, self.nbytes = self.views, [], [], 0
        if self.fd is None:
            for v in views:
                self.f.write(v)
            return
        done = os.writev(self.fd, views) if views else 0
        for v in views:  # a short write (a signal, a full disk): the rest, one view at a time
            if done >= v.nbytes:
                done -= v.nbytes
                continue
            v = v.cast("B")[done:]
            done = 0
            while v.nbytes:
                v = v[os.write(self.fd, v):]


def _header(save_id: str, items: list[tuple]) -> tuple[bytes, list[int]]:
    """(the safetensors header of ``items``, padded to 8 bytes; each item's size).

    Written as text, entry by entry: a dict per item would be thousands of tracked objects alive for the
    whole write, which Python's cyclic collector then walks (and, promoted, makes a full collection of the
    trainer's heap come sooner).
    """
    parts = [json.dumps({"__metadata__": {"format": "pipeload", "save_id": save_id}}, separators=(",", ":"))[:-1]]
    start = 0
    sizes = []
    for key, dtype, shape, value in items:
        n = len(value) if isinstance(value, bytes) else value.nbytes
        parts.append(f',{json.dumps(key)}:{{"dtype":"{dtype}","shape":[{",".join(map(str, shape))}],'
                     f'"data_offsets":[{start},{start + n}]}}')
        sizes.append(n)
        start += n
    raw = ("".join(parts) + "}").encode()
    return raw + b" " * (-(8 + len(raw)) % 8), sizes


def _write_file(path: str, save_id: str, items: list[tuple[str, str, tuple[int, ...], Any]],
                on_written: Callable[[int], None] | None = None) -> dict[str, str]:
    """Write ``items`` [(key, dtype, shape, tensor-or-bytes)] as one safetensors file; {key: checksum}.

    ``on_written(n)``, when given, is called once the first n items' bytes are in the file; a
    background save releases its caller there. Each item is looked up only when its turn comes
    (with ``on_written``, after the items before it are written).
    """
    raw, sizes = _header(save_id, items)
    sums: dict[str, str] = {}
    with storage.create(path, 0) as f:
        out = _Batch(f)
        out.add(memoryview(len(raw).to_bytes(8, "little") + raw), None)
        for i, n in enumerate(sizes):
            key, _, _, value = items[i]
            data, owner = (memoryview(value), value) if isinstance(value, bytes) else _host_bytes(value)
            if data.nbytes != n:
                raise RuntimeError(f"{key!r} changed size while being saved")
            sums[key] = checksum(data)
            out.add(data, owner)
            del data, value, owner
            if on_written is not None:
                out.flush()
                on_written(i + 1)
        out.flush()
        storage.durable(f)
    return sums


def write_chunk_index(directory: str, md: Metadata, arrays: dict[str, np.ndarray] | None = None) -> str:
    """Write format 2's chunk index of ``md`` (or the given ``arrays``) into ``directory``, durably;
    its file name.

    It must be durable before the ``.metadata`` that names it is renamed into place.
    """
    index = index_file_name(md.save_id)
    if arrays is None:
        arrays = build_arrays(sorted(md.tensors), md.tensors, md.files)
    _write_file(storage.join(directory, index), md.save_id,
                [(k, ARRAYS[k][0], a.shape, a.tobytes()) for k, a in arrays.items()])
    _fsync_dir(directory)
    return index


def _fsync_dir(path: str) -> None:
    if storage.is_url(path):  # an object is durable once its PUT (or multipart upload) completed
        return
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


LOCK_FILE = ".pipeload-save.lock"


def _lock_directory(directory: str) -> tuple[int | None, str | None]:
    """Rank 0: (fd holding an exclusive flock on the directory, None) or (None, problem).

    One save at a time per directory, across processes and jobs: a second save is refused, not
    queued. The lock is taken on the directory itself; where the file system cannot lock a directory
    (NFS emulates flock with byte-range locks, which need a regular file) on a lock file inside it.
    Either way it dies with the process, so a killed save never blocks the next one.
    """
    busy = f"another save into {directory} is in progress; save again after it"
    if storage.is_url(directory):  # no lock on object storage: see docs/ARCHITECTURE.md
        return None, None
    try:
        os.makedirs(directory, exist_ok=True)
        fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError as e:
        return None, f"creating {directory}: {_error_text(e)}"
    for attempt in range(2):
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return fd, None
        except OSError as e:
            os.close(fd)
            if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                return None, busy
            if attempt:
                return None, f"locking {directory}: {_error_text(e)}"
        try:
            fd = os.open(os.path.join(directory, LOCK_FILE), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        except OSError as e:
            return None, f"locking {directory}: {_error_text(e)}"
    raise AssertionError("unreachable")


def _previous_files(directory: str) -> set[str]:
    """Data and index files of the checkpoint the commit replaces, as its own ``.metadata`` lists them.

    Only names a pipeload save would write count (a hostile ``.metadata`` cannot get other files of
    the directory deleted); an unreadable or invalid ``.metadata`` gives none. Format 2 lists its files
    and index in the JSON itself, so a damaged index does not keep its data files alive.
    """
    try:
        raw = read_metadata_bytes(directory)
        doc = json.loads(raw)
        if isinstance(doc, dict) and doc.get("version") == 2:
            names = [*doc.get("files", []), doc.get("index")]
            names += [o.get("file") for o in doc.get("objects", {}).values() if isinstance(o, dict)]
        else:
            names = Metadata.from_json(raw, source=os.path.join(directory, METADATA_FILE)).files
    except (CheckpointFormatError, ValueError, TypeError, AttributeError):
        return set()
    return {name for name in names if isinstance(name, str) and DATA_FILE_RE.match(name)}


def _commit(directory: str, md: Metadata, arrays: dict[str, np.ndarray] | None = None) -> None:
    """Rank 0: write ``.metadata`` atomically, then remove the data files of the checkpoint it replaced
    (in a thread: :func:`_delete_later`).

    Raises only while the previous state is intact (before the rename): also when a data file of this
    save has vanished, so a save never reports success for a checkpoint that does not load. After
    the rename the checkpoint is committed, and a failing fsync of the directory or clean-up is a
    warning, never a reason for the ranks to delete the files the new ``.metadata`` points at. Only
    files the previous ``.metadata`` referenced are deleted: never another writer's files, and never
    leftovers of unknown origin.
    """
    if storage.is_url(directory):
        return storage.commit_objects(directory, md, lambda d, m: write_chunk_index(d, m, arrays), _previous_files,
                                      METADATA_FILE)
    missing = [n for n in md.files if not os.path.isfile(os.path.join(directory, n))]
    if missing:
        raise FileNotFoundError(
            f"data file(s) of this save vanished before the commit: {', '.join(missing[:3])}"
            f"{' ...' if len(missing) > 3 else ''}"
        )
    previous = _previous_files(directory)
    final = os.path.join(directory, METADATA_FILE)
    tmp = os.path.join(directory, f"{METADATA_FILE}.tmp-{md.save_id}")
    index = write_chunk_index(directory, md, arrays)
    with open(tmp, "w") as f:
        f.write(md.to_json_v2(index))
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, final)
    try:
        _fsync_dir(directory)
    except OSError as e:
        warnings.warn(f"pipeload.save: fsync of {directory} failed after the commit: {e}", RuntimeWarning,
                      stacklevel=3)
    _delete_later(directory, sorted(previous - {*md.files, index}))


_cleanups: list[tuple[threading.Thread, frozenset[str]]] = []  # this process's, newest last, with their paths
_cleanups_lock = threading.Lock()


def _delete_later(directory: str, names: list[str]) -> None:
    """Delete ``names`` in ``directory`` (best effort) in a thread, after the commit point; returns at once.

    Freeing a file's blocks is not free (~0.7 ms per MiB on ext4 here, one file after another even
    from several threads): done inline it made every rank wait at the commit's agreement for rank 0
    to delete the replaced checkpoint. Nothing depends on the deletion: the committed ``.metadata``
    names none of these files. One clean-up at a time per process: each thread first waits for the one
    before it, so a save that must not reuse a name still being deleted waits for that alone
    (:func:`wait_cleanup`). The threads are not daemons, so they complete at exit, and they run below
    the caller's CPU priority (:func:`lower_priority`).
    """
    if not names:
        return
    paths = [os.path.join(directory, name) for name in names]
    with _cleanups_lock:
        before = _cleanups[-1][0] if _cleanups else None

        def run() -> None:
            if before is not None:
                before.join()
            lower_priority()
            for path in paths:
                try:
                    os.unlink(path)
                except OSError:
                    pass

        thread = threading.Thread(target=run, name="pipeload-save-cleanup", daemon=False)
        _cleanups[:] = [c for c in _cleanups if c[0].is_alive()] + [(thread, frozenset(paths))]
        thread.start()


BACKGROUND_NICE = int(os.environ.get("PIPELOAD_SAVE_NICE", "10"))  # see lower_priority; 0 keeps the caller's


def lower_priority() -> None:
    """The calling thread's CPU priority :data:`BACKGROUND_NICE` below the process's main thread (Linux,
    where nice is per thread; elsewhere it would lower the whole process, so nothing is done).

    For the save's threads that work behind the trainer's back (a background save's worker, the
    clean-up): theirs is throughput work with until the next save to finish, the trainer's thread is
    latency work. Where they share cores they yield: 4 ranks on 2 cores, the blocked time of a
    background save whose peers' workers already write fell by a fifth (3 runs each way), the time
    to commit did not change. A thread started by one (the worker's clean-up) is already there.
    """
    if BACKGROUND_NICE <= 0 or not sys.platform.startswith("linux"):
        return
    try:
        tid, want = threading.get_native_id(), os.getpriority(os.PRIO_PROCESS, os.getpid()) + BACKGROUND_NICE
        if os.getpriority(os.PRIO_PROCESS, tid) < want:
            os.setpriority(os.PRIO_PROCESS, tid, want)
    except OSError:  # not permitted here: the thread keeps its priority
        pass


def wait_cleanup(prefix: str | None = None) -> None:
    """Wait until the files this process's commits left to delete are deleted: all of them, or (with
    ``prefix``) those whose paths start with it, and the ones queued before them."""
    with _cleanups_lock:
        pending = list(_cleanups)
    for thread, paths in reversed(pending):
        if prefix is None or any(p.startswith(prefix) for p in paths):
            thread.join()  # each joined the one before it
            return


def _error_text(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}"


@dataclass
class SaveStats:
    """This rank's view of one save: seconds from the start of ``save()`` to the end of planning (the
    first byte is written next), writing this rank's file, and the agreement and commit; whether the
    plan of an earlier save was reused; the items this rank wrote."""

    plan_s: float = 0.0
    write_s: float = 0.0
    commit_s: float = 0.0
    plan_reused: bool = False
    items_written: int = 0


def _save(state_dict: dict, directory: str, comm: Comm, guard: Guard, contended: str | None,
          lock: list[int], stats: SaveStats, start: float) -> None:
    """``contended``: why this rank must not save (see _busy.py), carried into the first gather.

    The three phases run in this order on every rank, each issuing its collectives in the same
    order everywhere. Rank 0 takes the directory's lock in :func:`write_phase`, after validation and
    before anything is written; its fd lands in ``lock`` for the caller to release.
    """
    plan = plan_phase(state_dict, directory, comm, contended)
    plan.locks = lock
    t1 = time.perf_counter()
    stats.plan_s, stats.plan_reused, stats.items_written = t1 - start, plan.reused, len(plan.items)
    error, sums = write_phase(plan, directory, comm)
    error = error or guard.late(comm)  # an operation overlapped this one: nothing may be committed
    t2 = time.perf_counter()
    stats.write_s = t2 - t1
    commit_phase(plan, directory, comm, error, sums)
    stats.commit_s = time.perf_counter() - t2


@dataclass
class SavePlan:
    """What one rank writes and what the commit needs, decided identically on every rank.

    ``items`` are this rank's owned entries in write order, each ``(storage key, dtype, shape, tensor
    or bytes)``: tensors first (by key), then Python objects. ``rows`` are the same entries as the
    commit reports them (``(key index, offsets, lengths)`` for a chunk, ``(key index,)`` for an
    object), ``table`` the key table of the whole save (names, kinds, dtypes, shapes: what rank 0
    writes into ``.metadata``). ``reused``: planned by an earlier save (:mod:`pipeload.save.savecache`).
    ``locks`` collects rank 0's directory lock fd for the caller to release. ``memo`` is the kept plan's
    (the same dict at every save that reuses it): what a consumer derives from the plan alone is kept
    there once (the background save's staging layout).
    """

    save_id: str
    rank: int
    file: str
    items: list[tuple[str, str, tuple[int, ...], Any]]
    rows: list[tuple]
    table: saveplan.Plan
    reused: bool = False
    locks: list[int] = field(default_factory=list)
    on_written: Callable[[int], None] | None = None  # see _write_file (a background save's hand-over)
    memo: dict = field(default_factory=dict)

    @property
    def tensors(self) -> dict[str, tuple[str, tuple[int, ...]]]:
        """``{fqn: (dtype, global shape)}`` of every tensor of the save (built on each call)."""
        t = self.table
        return {t.names[k]: (t.dtype_name(k), t.shape_of(k)) for k in np.flatnonzero(t.kind == saveplan.KIND_TENSOR)}


ASK = object()  # plan_phase's offer: look for a kept plan here


def plan_phase(state_dict: dict, directory: str, comm: Comm, contended: str | None, *, box_of=None,
               offer=ASK) -> SavePlan:
    """Validate and plan; no I/O. Any rank's problem raises :class:`StateDictError` on every rank.

    ``box_of``: how a tensor's box is resolved (default :func:`~pipeload.plan.statedict.tensor_box`; the
    simulation, :mod:`pipeload.tools.simsave`, passes the boxes of its virtual meshes). ``offer``: what
    :func:`pipeload.save.savecache.offer` gave for ``state_dict`` on ``comm`` when the caller already
    asked (``dcp.save``'s door does), else it is asked here.

    Collectives, the same on every rank in this order: the reuse words (:mod:`pipeload.save.savecache`;
    they carry rank 0's fresh save id, and one rank's :func:`decline` makes every rank raise
    :class:`Declined` right after them); unless every rank reuses its kept plan, the exchange of
    :func:`pipeload.save.saveplan.exchange`. ``contended`` is this rank's reason not to save, reported
    like a problem of its state dict.
    """
    what = f"pipeload.save into {directory}"
    offer = None if contended else savecache.offer(comm, state_dict) if offer is ASK else offer
    words = _reuse_words(comm, offer.token if offer else 0, False, what)
    save_id = savecache.save_id_of(int(words[0, 1]))
    if savecache.all_reuse(words[:, 0]):
        return _plan_from(offer.entry, offer.items, save_id, comm.rank, reused=True)
    rec = saveplan.LocalRecord([], [], {}, [contended] if contended else []).encode()
    leaves = None
    if not contended:
        try:
            leaves = flatten(state_dict)
            rec = saveplan.local_record(leaves, box_of)
        except Exception as e:  # noqa: BLE001 - raised below on every rank, never on this one alone
            rec = saveplan.LocalRecord([], [], {}, [f"{type(e).__name__}: {e}"]).encode()
    try:
        xc = saveplan.exchange(comm, rec, rec.problems, what, records=False)
    except saveplan.SaveProblems as e:
        raise StateDictError(f"{what}: cannot save",
                             [f"rank {r}: {p}" for r, ps in sorted(e.failures.items()) for p in ps]) from None
    table = saveowners.plan_save(comm, xc, rec, comm.rank, what)
    if table.problems:
        raise StateDictError("pipeload.save: ranks disagree about the state dict", table.problems)
    if table.differing_objects:
        a, b = table.differing_objects
        warnings.warn(f"pipeload.save: Python objects differ between ranks (ranks {a} and {b} hold the same keys "
                      f"with different values); one rank's value is stored", RuntimeWarning, stacklevel=4)
    entry = savecache.Entry.of(table, rec, comm.rank, xc.rows)
    if leaves is not None:
        savecache.store(comm, state_dict, leaves, entry)
    return _plan_from(entry, savecache.items_of(entry, rec.payload), save_id, comm.rank, reused=False)


REUSE_CALL = "all-gather of save plan tokens"


class Declined(Exception):
    """Raised by :func:`plan_phase` on every rank alike, before anything is planned, when the caller on
    some rank declined the save with :func:`decline` (the DCP switch, for a call only DCP's own code can
    save); ``ranks`` are those ranks."""

    def __init__(self, ranks: list[int]) -> None:
        super().__init__(f"rank(s) {ranks} declined the save")
        self.ranks = ranks


def _reuse_words(comm: Comm, token: int, declined: bool, what: str) -> np.ndarray:
    """The plan phase's first collective: per rank its kept plan's token, rank 0's fresh save word, and
    whether the rank declined (so that a caller's own go/no-go costs no collective of its own)."""
    save_word = savecache.new_save_word() if comm.rank == 0 else 0
    words = comm.gather_rows(np.array([token, save_word, declined], dtype=np.int64), what, REUSE_CALL)
    if words[:, 2].any():
        raise Declined(np.flatnonzero(words[:, 2]).tolist())
    return words


def decline(comm: Comm, directory: str) -> None:
    """Take part in the other ranks' :func:`plan_phase` as a rank that will not save with them: their
    first collective, after which each of them raises :class:`Declined`."""
    try:
        _reuse_words(comm, 0, True, f"pipeload.save into {directory}")
    except Declined:
        pass  # this rank's own word declined: it raises on every rank, here too


def _plan_from(entry, items, save_id: str, rank: int, reused: bool) -> SavePlan:
    return SavePlan(save_id, rank, data_file_name(save_id, rank), items, entry.rows, entry.table, reused,
                    memo=entry.memo)


def write_phase(plan: SavePlan, directory: str, comm: Comm) -> tuple[str | None, dict[str, str]]:
    """Write this rank's file durably; ``(error or None, {storage key: checksum})``. No collective.

    Failures are returned, never raised: the commit's agreement makes every rank raise together.
    Rank 0 takes the directory's lock here (its fd goes to ``plan.locks``).
    """
    path = storage.join(directory, plan.file)
    error, sums = None, {}
    if comm.rank == 0:
        fd, error = _lock_directory(directory)
        plan.locks += [fd] if fd is not None else []
    try:
        storage.makedirs(directory)  # every rank: rank 0 commits even when it writes no data
    except OSError as e:
        error = error or f"creating {directory}: {_error_text(e)}"
    if plan.items and error is None:
        try:
            sums = _write_file(path, plan.save_id, plan.items, plan.on_written)
            _fsync_dir(directory)
        except Exception as e:  # noqa: BLE001
            error = f"writing {path}: {_error_text(e)}"
    return error, sums


def _remove_own_file(plan: SavePlan, directory: str) -> None:
    """Remove this rank's new data file after a failure, unless rank 0 already committed this save.

    The final agreement can fail after the rename (a rank dying in between, likelier with a long
    background write): the committed ``.metadata`` then names this file, which must stay.
    """
    if plan.items and not _committed(directory, plan.save_id):
        try:
            storage.remove(storage.join(directory, plan.file))
        except OSError:
            pass


def _committed(directory: str, save_id: str) -> bool:
    try:
        doc = json.loads(read_metadata_bytes(directory))
    except (CheckpointFormatError, ValueError):
        return False
    return isinstance(doc, dict) and doc.get("save_id") == save_id


def commit_phase(plan: SavePlan, directory: str, comm: Comm, error: str | None, sums: dict[str, str]) -> None:
    """Agree on the writes, gather the files' chunk rows to rank 0, which commits; every rank raises if
    any rank failed.

    Collectives, in this order on every rank: one all-gather of two words per rank (failed, bytes of its
    chunk rows), and only on a failure the error texts; the gather of the chunk rows to rank 0 (what
    rank 0 receives grows with the chunks of the checkpoint, what the others receive does not); the
    commit's agreement (one word per rank). A failure before the commit removes this rank's file.
    """
    what = "pipeload.save"
    mine = _file_rows(plan, sums) if error is None else b""
    try:
        sizes = comm.agree_on(len(mine), error, what, "agreement on the writes")
    except DistributedError:
        _remove_own_file(plan, directory)
        raise
    gathered = comm.gather_to_first(mine, sizes, what)
    error = None
    if comm.rank == 0:
        try:
            _commit(directory, *commit_metadata(plan, gathered, comm.size))
        except Exception as e:  # noqa: BLE001
            error = f"committing {os.path.join(directory, METADATA_FILE)}: {_error_text(e)}"
    try:
        comm.agree(what, error)
    except DistributedError:
        _remove_own_file(plan, directory)
        raise


def _file_rows(plan: SavePlan, sums: dict[str, str]) -> bytes:
    """This rank's file as the commit needs it (:func:`pipeload.save.saveplan.encode_file_rows`)."""
    width = plan.table.shape.shape[1]
    t = [(row, key) for (key, *_), row in zip(plan.items, plan.rows) if len(row) == 3]
    o = [(row[0], len(value), key) for (key, _, _, value), row in zip(plan.items, plan.rows) if len(row) == 1]
    pad = lambda x: tuple(x) + (0,) * (width - len(x))  # noqa: E731
    return saveplan.encode_file_rows(
        [r[0] for r, _ in t], saveplan.checksum_words([sums[k] for _, k in t]),
        np.asarray([pad(r[1]) for r, _ in t], dtype=np.int64).reshape(len(t), width),
        np.asarray([pad(r[2]) for r, _ in t], dtype=np.int64).reshape(len(t), width),
        [x[0] for x in o], [x[1] for x in o], saveplan.checksum_words([sums[x[2]] for x in o]))


def commit_metadata(plan: SavePlan, per_rank, world: int) -> tuple[Metadata, dict[str, np.ndarray]]:
    """Rank 0: the checkpoint's :class:`Metadata` (format 2, its chunks in the index arrays) and the
    chunk index arrays, from every rank's file rows."""
    names, tensors, files, arrays, objects = saveplan.index_arrays(
        plan.table, per_rank, lambda r: data_file_name(plan.save_id, r))
    md = Metadata(save_id=plan.save_id, world_size=world, version=2, index_file=index_file_name(plan.save_id),
                  data_files=files)
    md.tensors = {n: TensorMeta(*tensors[n], ()) for n in names}
    for fqn, (fname, nbytes, csum) in objects.items():
        md.objects[fqn] = ObjectMeta(fname, object_key(fqn), nbytes, csum)
    return md, arrays
