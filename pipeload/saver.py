"""``pipeload.save()``: every rank streams the chunks it owns into its own safetensors file.

Order of a save (every rank of the group):

1. Local plan, no I/O: flatten the state dict, resolve each tensor's box, serialise Python objects and
   check they load back under ``torch.load(weights_only=True)``. Problems are collected, not raised.
2. One all-gather of the compact plans (and rank 0's fresh save id). Any rank's problem raises on
   every rank, before a single byte is written.
3. Pure global plan: the same on every rank. Replicated chunks are written once; the owner of each
   is chosen by :func:`pipeload.balance.assign` (largest first, fewest bytes so far, ties to the lower
   rank). Dtype/shape disagreements and chunks that do not tile their tensor are rejected here.
4. Each rank writes its file ``data-<save id>-<rank>.safetensors``, tensor by tensor (one tensor's
   host copy at a time, never a second copy of the state dict), checksumming while it writes, then
   fsyncs the file and the directory.
5. All ranks agree on success; rank 0 then writes ``.metadata`` (temporary name, fsync, rename, fsync):
   that rename is the commit point. The data files of the checkpoint it replaces are deleted after it.

Because data file names carry the save id, an unfinished save never mixes with a finished one: until
the new ``.metadata`` lands, the directory loads as the previous checkpoint (or not at all).
"""

from __future__ import annotations

import errno
import fcntl
import io
import json
import math
import os
import re
import uuid
import warnings
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from . import balance
from ._busy import Guard
from ._gcpause import paused_gc
from .checksum import checksum, hasher
from .chunkindex import ARRAYS, build_arrays, index_file_name
from .comm import Comm
from .errors import CheckpointFormatError, DistributedError, StateDictError
from .metadata import (
    METADATA_FILE,
    ChunkMeta,
    Metadata,
    ObjectMeta,
    TensorMeta,
    chunk_key,
    dtype_itemsize,
    dtype_name,
    read_metadata_bytes,
    storable_dtype,
    tiling_problem,
)
from .statedict import flatten, is_tensor, tensor_box

DATA_FILE_RE = re.compile(r"^(data-[0-9a-f]{16}-\d{5,}|index-[0-9a-f]{16})\.safetensors$")
_WRITE_BUFFER = 8 << 20


def data_file_name(save_id: str, rank: int) -> str:
    return f"data-{save_id}-{rank:05d}.safetensors"


def object_key(fqn: str) -> str:
    return f"{fqn}#object"


def encode_object(value: Any) -> bytes:
    """Serialise a Python object so that loading it cannot execute code.

    The bytes are ``torch.save``'s; they are accepted only if ``torch.load(weights_only=True)`` restores
    them, which is exactly what load will do. ``ValueError`` otherwise.
    """
    buf = io.BytesIO()
    try:
        torch.save(value, buf)
    except Exception as e:  # noqa: BLE001 - unpicklable values
        raise ValueError(f"value of type {type(value).__name__} cannot be serialised ({e})") from None
    data = buf.getvalue()
    try:
        torch.load(io.BytesIO(data), weights_only=True)
    except Exception as e:  # noqa: BLE001 - the unpickler's refusal is the user's answer
        lines = [ln.strip() for ln in str(e).splitlines() if "WeightsUnpickler error" in ln]
        why = lines[0].split("error:", 1)[-1].strip() if lines else type(e).__name__
        raise ValueError(
            f"value of type {type(value).__name__} cannot be restored with torch.load(weights_only=True) "
            f"({why}); store plain Python types and tensors, or convert it first"
        ) from None
    return data


def _local_plan(leaves) -> tuple[list[tuple], dict, list[str]]:
    """(compact entries for the gather, {key: payload} of what this rank could write, problems)."""
    entries: list[tuple] = []
    payload: dict[tuple, Any] = {}
    problems: list[str] = []
    boxes: dict = {}
    for fqn, leaf in sorted(leaves.items()):
        v = leaf.value
        if is_tensor(v):
            if v.layout != torch.strided or v.is_nested:
                problems.append(f"{fqn!r}: tensors with layout {v.layout} cannot be stored; convert to dense")
                continue
            if v.device.type == "meta":
                problems.append(f"{fqn!r}: tensor on the meta device has no data to store")
                continue
            if not storable_dtype(v.dtype):
                problems.append(f"{fqn!r}: dtype {v.dtype} has no safetensors name")
                continue
            try:
                box = tensor_box(fqn, v, boxes)
            except ValueError as e:
                problems.append(str(e))
                continue
            if box.local is None:
                continue  # outside the DTensor's mesh: holds nothing
            key = ("t", fqn, box.offsets, box.lengths)
            entries.append(("t", fqn, dtype_name(v.dtype), box.global_shape, box.offsets, box.lengths))
            payload[key] = box.local
        else:
            try:
                data = encode_object(v)
            except ValueError as e:
                problems.append(f"{fqn!r}: {e}")
                continue
            entries.append(("o", fqn, len(data), checksum(data)))
            payload[("o", fqn)] = data
    return entries, payload, problems


def plan_save(per_rank: list[list[tuple]]) -> tuple[dict[tuple, int], dict[str, tuple], list[str]]:
    """Pure global plan: ({key: owner rank}, {fqn: (dtype, shape)}, problems). Same on every rank."""
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
    readers (:func:`pipeload.planner.global_plan`), so on an unchanged layout every reader finds its
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


def _host_bytes(t: torch.Tensor) -> memoryview:
    """A host, contiguous byte view of ``t`` (copies only when ``t`` is on a device or not contiguous)."""
    t = t.detach()
    if t.device.type != "cpu":
        t = t.to("cpu")
    t = t.resolve_conj().resolve_neg()
    if not t.is_contiguous():
        t = t.contiguous()
    flat = t.reshape(-1)
    if flat.numel() == 0:
        return memoryview(b"")
    return memoryview(flat.view(torch.uint8).numpy())


def _write_file(path: str, save_id: str, items: list[tuple[str, str, tuple[int, ...], Any]],
                on_written: Callable[[int], None] | None = None) -> dict[str, str]:
    """Write ``items`` [(key, dtype, shape, tensor-or-bytes)] as one safetensors file; {key: checksum}.

    ``on_written(n)``, when given, is called once the first n items' bytes are in the file (or in its
    write buffer, a copy); a background save releases its caller there. Each item is looked up only
    when its turn comes.
    """
    header: dict[str, Any] = {"__metadata__": {"format": "pipeload", "save_id": save_id}}
    start = 0
    sizes = []
    for key, dtype, shape, value in items:
        n = len(value) if isinstance(value, bytes) else value.numel() * value.element_size()
        header[key] = {"dtype": dtype, "shape": list(shape), "data_offsets": [start, start + n]}
        sizes.append(n)
        start += n
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-(8 + len(raw)) % 8)
    sums: dict[str, str] = {}
    with open(path, "wb", buffering=_WRITE_BUFFER) as f:
        f.write(len(raw).to_bytes(8, "little"))
        f.write(raw)
        for i, n in enumerate(sizes):
            key, _, _, value = items[i]
            data = memoryview(value) if isinstance(value, bytes) else _host_bytes(value)
            if data.nbytes != n:
                raise RuntimeError(f"{key!r} changed size while being saved")
            h = hasher()
            h.update(data)
            f.write(data)
            sums[key] = h.hexdigest()
            del data, value
            if on_written is not None:
                on_written(i + 1)
        f.flush()
        os.fsync(f.fileno())
    return sums


def write_chunk_index(directory: str, md: Metadata) -> str:
    """Write format 2's chunk index of ``md`` into ``directory``, durably; its file name.

    It must be durable before the ``.metadata`` that names it is renamed into place.
    """
    index = index_file_name(md.save_id)
    arrays = build_arrays(sorted(md.tensors), md.tensors, md.files)
    _write_file(os.path.join(directory, index), md.save_id,
                [(k, ARRAYS[k][0], a.shape, a.tobytes()) for k, a in arrays.items()])
    _fsync_dir(directory)
    return index


def _fsync_dir(path: str) -> None:
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


def _commit(directory: str, md: Metadata) -> None:
    """Rank 0: write ``.metadata`` atomically, then remove the data files of the checkpoint it replaced.

    Raises only while the previous state is intact (before the rename): also when a data file of this
    save has vanished, so a save never reports success for a checkpoint that does not load. After
    the rename the checkpoint is committed, and a failing fsync of the directory or clean-up is a
    warning, never a reason for the ranks to delete the files the new ``.metadata`` points at. Only
    files the previous ``.metadata`` referenced are deleted: never another writer's files, and never
    leftovers of unknown origin.
    """
    missing = [n for n in md.files if not os.path.isfile(os.path.join(directory, n))]
    if missing:
        raise FileNotFoundError(
            f"data file(s) of this save vanished before the commit: {', '.join(missing[:3])}"
            f"{' ...' if len(missing) > 3 else ''}"
        )
    previous = _previous_files(directory)
    final = os.path.join(directory, METADATA_FILE)
    tmp = os.path.join(directory, f"{METADATA_FILE}.tmp-{md.save_id}")
    index = write_chunk_index(directory, md)
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
    for name in sorted(previous - {*md.files, index}):
        try:
            os.unlink(os.path.join(directory, name))
        except OSError:
            pass


def _error_text(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}"


def save(state_dict: dict, checkpoint_dir: str | os.PathLike, *, process_group=None, background: bool = False,
         staging_bytes: int | None = None):
    """Save ``state_dict`` as a pipeload checkpoint; every rank of ``process_group`` must call it.

    Values may be ``torch.Tensor`` (whole on this rank), ``DTensor`` (Shard/Replicate placements on any
    mesh, uneven shards included) and Python objects that ``torch.load(weights_only=True)`` accepts
    (Python objects are assumed equal on every rank: one copy is stored). Replicated chunks are written
    once. Bad input raises :class:`StateDictError` on every rank, naming the key, before anything is
    written; a failed write raises :class:`DistributedError` on every rank and leaves no new loadable
    checkpoint (a checkpoint previously saved in ``checkpoint_dir`` still loads).

    ``background=True`` returns a :class:`pipeload.background.SaveHandle` once this rank's chunks are
    copied into staging (at most ``staging_bytes``; default all it owns): the caller may then change
    or free every tensor; writing and the commit go on in a worker thread (see
    :mod:`pipeload.background`). Saves on one group run one at a time: any save first waits for the
    group's background save in flight to finish.
    """
    from . import background as bg

    directory = os.fspath(checkpoint_dir)
    comm = Comm(process_group)
    bg.wait_previous(comm)
    if background:
        return bg.save(state_dict, directory, comm, staging_bytes)
    with paused_gc(), Guard() as guard:
        contended = guard.enter_sync(comm, comm.size > 1, f"pipeload.save into {directory}",
                                     comm.timeout.total_seconds())
        lock: list[int] = []
        try:
            _save(state_dict, directory, comm, guard, contended, lock)
        finally:
            for fd in lock:
                os.close(fd)


def _save(state_dict: dict, directory: str, comm: Comm, guard: Guard, contended: str | None,
          lock: list[int]) -> None:
    """``contended``: why this rank must not save (see _busy.py), carried into the first gather.

    The three phases run in this order on every rank, each issuing its collectives in the same
    order everywhere. Rank 0 takes the directory's lock in :func:`write_phase`, after validation and
    before anything is written; its fd lands in ``lock`` for the caller to release.
    """
    plan = plan_phase(state_dict, directory, comm, contended)
    plan.locks = lock
    error, sums = write_phase(plan, directory, comm)
    error = error or guard.late(comm)  # an operation overlapped this one: nothing may be committed
    commit_phase(plan, directory, comm, error, sums)


@dataclass
class SavePlan:
    """What one rank writes and what the commit needs, decided identically on every rank.

    ``items`` are this rank's owned entries in write order, each ``(storage key, dtype, shape, tensor
    or bytes)``: tensors first (sorted by key), then Python objects. ``tensors`` is the global table
    ``{fqn: (dtype, global shape)}``; ``owners`` maps every chunk/object key to its writer rank and
    ``object_sizes`` ``{(rank, fqn): nbytes}`` the serialised objects every rank holds. ``locks``
    collects rank 0's directory lock fd for the caller to release.
    """

    save_id: str
    rank: int
    file: str
    items: list[tuple[str, str, tuple[int, ...], Any]]
    tensors: dict[str, tuple[str, tuple[int, ...]]]
    owners: dict[tuple, int]
    object_sizes: dict[tuple[int, str], int]
    locks: list[int] = field(default_factory=list)
    on_written: Callable[[int], None] | None = None  # see _write_file (a background save's hand-over)


def plan_phase(state_dict: dict, directory: str, comm: Comm, contended: str | None) -> SavePlan:
    """Validate and plan; no I/O. Any rank's problem raises :class:`StateDictError` on every rank.

    One collective (the plans' all-gather, carrying rank 0's fresh save id). ``contended`` is this
    rank's reason not to save, reported like a problem of its state dict.
    """
    entries: list[tuple] = []
    payload: dict = {}
    problems = [contended] if contended else []
    if not contended:
        try:
            entries, payload, problems = _local_plan(flatten(state_dict))
        except Exception as e:  # noqa: BLE001 - raised below on every rank, never on this one alone
            entries, payload, problems = [], {}, [f"{type(e).__name__}: {e}"]
    save_id = uuid.uuid4().hex[:16] if comm.rank == 0 else None
    gathered = comm.all_gather_object((problems, entries, save_id), "pipeload.save")
    all_problems = [f"rank {r}: {p}" for r, g in enumerate(gathered) for p in g[0]]
    if all_problems:
        raise StateDictError(f"pipeload.save into {directory}: cannot save", all_problems)
    save_id = gathered[0][2]
    owners, tensors, plan_problems = plan_save([g[1] for g in gathered])
    if plan_problems:
        raise StateDictError("pipeload.save: ranks disagree about the state dict", plan_problems)
    mine = sorted((k for k, r in owners.items() if r == comm.rank), key=lambda k: (k[0] == "o", k))
    items = []
    for k in mine:
        if k[0] == "t":
            dtype, shape = tensors[k[1]]
            items.append((chunk_key(k[1], k[2], k[3] == shape), dtype, k[3], payload[k]))
        else:
            data = payload[k]
            items.append((object_key(k[1]), "U8", (len(data),), data))
    object_sizes = {(r, e[1]): e[2] for r, g in enumerate(gathered) for e in g[1] if e[0] == "o"}
    return SavePlan(save_id, comm.rank, data_file_name(save_id, comm.rank), items, tensors, owners,
                    object_sizes)


def write_phase(plan: SavePlan, directory: str, comm: Comm) -> tuple[str | None, dict[str, str]]:
    """Write this rank's file durably; ``(error or None, {storage key: checksum})``. No collective.

    Failures are returned, never raised: the commit's agreement makes every rank raise together.
    Rank 0 takes the directory's lock here (its fd goes to ``plan.locks``).
    """
    path = os.path.join(directory, plan.file)
    error, sums = None, {}
    if comm.rank == 0:
        fd, error = _lock_directory(directory)
        plan.locks += [fd] if fd is not None else []
    try:
        os.makedirs(directory, exist_ok=True)  # every rank: rank 0 commits even when it writes no data
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
            os.unlink(os.path.join(directory, plan.file))
        except OSError:
            pass


def _committed(directory: str, save_id: str) -> bool:
    try:
        doc = json.loads(read_metadata_bytes(directory))
    except (CheckpointFormatError, ValueError):
        return False
    return isinstance(doc, dict) and doc.get("save_id") == save_id


def commit_phase(plan: SavePlan, directory: str, comm: Comm, error: str | None, sums: dict[str, str]) -> None:
    """Agree on the writes, then rank 0 commits; every rank raises if any rank failed.

    Two collectives: the results' all-gather and the commit's agreement. A failure before the
    commit removes this rank's file, so no new checkpoint is left behind.
    """
    results = comm.all_gather_object((error, sums), "pipeload.save")
    failures = {r: e for r, (e, _) in enumerate(results) if e is not None}
    if failures:
        _remove_own_file(plan, directory)
        raise DistributedError("pipeload.save", failures)
    md = _metadata(plan, [s for _, s in results], comm.size)
    error = None
    if comm.rank == 0:
        try:
            _commit(directory, md)
        except Exception as e:  # noqa: BLE001
            error = f"committing {os.path.join(directory, METADATA_FILE)}: {_error_text(e)}"
    try:
        comm.agree("pipeload.save", error)
    except DistributedError:
        _remove_own_file(plan, directory)
        raise


def _metadata(plan: SavePlan, all_sums: list[dict[str, str]], world: int) -> Metadata:
    """The checkpoint's :class:`Metadata` from the plan and every rank's checksums."""
    md = Metadata(save_id=plan.save_id, world_size=world)
    tensors = plan.tensors
    chunks: dict[str, list[ChunkMeta]] = defaultdict(list)
    for key, owner in plan.owners.items():
        fname = data_file_name(plan.save_id, owner)
        if key[0] == "t":
            _, fqn, offsets, lengths = key
            skey = chunk_key(fqn, offsets, lengths == tensors[fqn][1])
            chunks[fqn].append(ChunkMeta(offsets, lengths, fname, skey, all_sums[owner][skey]))
        else:
            okey = object_key(key[1])
            md.objects[key[1]] = ObjectMeta(fname, okey, plan.object_sizes[owner, key[1]], all_sums[owner][okey])
    for fqn, cs in chunks.items():
        dtype, shape = tensors[fqn]
        md.tensors[fqn] = TensorMeta(dtype, shape, tuple(sorted(cs, key=lambda c: c.offsets)))
    return md
