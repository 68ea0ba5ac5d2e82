"""DCP's checkpoint layout, written from pipeload's save plan.

:mod:`pipeload.save.saver` plans who writes each chunk (replicated chunks once, by the rank the load's
greedy will make read them); this module writes what each rank owns the way DCP's ``FileSystemWriter``
(default options) lays it out, so that stock ``dcp.load`` and pipeload's DCP reader read it:

- rank ``r`` of the group writes ``__<r>_<i>.distcp``: each item appended as DCP's ``_write_item`` appends
  it (a tensor chunk as ``torch.save`` of a tensor of exactly the chunk's bytes — the very bytes, from
  :mod:`.torchsave`'s templates, without ``torch.save``'s cost per call —, a Python object as the bytes
  DCP's planner makes of it, ``torch.save`` into a ``BytesIO``), then fsynced when the writer's
  ``sync_files`` says so. No collective; a failure is returned to the commit. ``<i>`` is the lowest
  index whose file does not exist (:func:`choose_file`): 0 in a new directory, and a save into the
  directory of the last one writes beside that checkpoint's files, never over them — the committed
  ``.metadata`` names only files no save writes, so a save that fails on any rank, at any point before
  its commit, leaves the last checkpoint whole. After the commit each rank deletes its files the new
  ``.metadata`` does not name, from a thread (:func:`pipeload.save.saver._delete_later`), as
  ``pipeload.save`` deletes a replaced checkpoint's files;
- the commit: one agreement on the writes (two words per rank), then a gather (to rank 0 only, not an
  all-gather) of each rank's rows — its file's index; per item its key index, object or tensor, offset
  and length in its file, box — and of the flattening paths of the keys it wrote. Rank 0 builds DCP's
  ``Metadata`` (``state_dict_metadata``, ``storage_data`` of ``_StorageInfo``, ``planner_data``,
  ``storage_meta``, version) and pickles it to ``.metadata.tmp``, fsync, rename to ``.metadata``: the
  commit point, after every rank's data is durable. One more agreement carries the pickle's size, and
  one broadcast the pickle itself: every rank returns the ``Metadata``, as ``dcp.save`` does.

The phases have the signatures of :func:`pipeload.save.saver.write_phase` and
:func:`~pipeload.save.saver.commit_phase`, so a background save runs them in its worker as it runs the
saver's (:func:`pipeload.save.background.save`, ``phases=``).
"""

from __future__ import annotations

import ctypes
import io
import json
import os
import pickle
import threading
from typing import Any

import numpy as np
import torch
from torch.distributed.checkpoint import filesystem as dcp_fs
from torch.distributed.checkpoint.metadata import (BytesStorageMetadata, ChunkStorageMetadata, Metadata,
                                                   MetadataIndex, TensorProperties, TensorStorageMetadata)
from torch.distributed.checkpoint.planner import WriteItem, WriteItemType

from ..engine.comm import Comm
from ..formats.chunks import torch_dtype
from ..save.saver import (_Batch, _delete_later, _error_text, _fsync_dir, _host_bytes, _lock_directory,
                          wait_cleanup)
from . import torchsave

METADATA = ".metadata"
_HEAD = 4  # words before the rows: n, width, bytes of the paths' JSON, the file's index
_K, _OBJ, _AT, _LEN = 0, 1, 2, 3  # row columns; offsets and lengths of the box follow


def data_file(rank: int, index: int = 0) -> str:
    """DCP's name of group rank ``rank``'s file ``index`` (``FileSystemWriter`` numbers a rank's files)."""
    return f"__{rank}_{index}{dcp_fs.DEFAULT_SUFFIX}"


def choose_file(directory: str, rank: int) -> tuple[int, list[str]]:
    """(the index of this rank's file in this save, the names of this rank's files that exist now).

    The index is the lowest whose file does not exist, so the save never writes a file that the
    committed ``.metadata`` may name; the files that exist are what the commit leaves unnamed. The last
    save's clean-up of this rank's files is waited for first: every rank of a loop saving into one
    directory then takes the same index (rank 0 counts on it: :func:`_early_pickle`). Probed
    with a ``stat`` each, up to one past the index (a listing would cost every rank the whole directory,
    W names, on a shared file system)."""
    wait_cleanup(os.path.join(directory, f"__{rank}_"))
    existing: list[str] = []
    index, i = -1, 0
    while index < 0 or i <= index + 1:
        name = data_file(rank, i)
        if os.path.lexists(os.path.join(directory, name)):
            existing.append(name)
        elif index < 0:
            index = i
        i += 1
    return index, existing


def object_bytes(value: Any) -> bytes:
    """What DCP's planner writes for a Python object (``DefaultSavePlanner.transform_object``)."""
    buf = io.BytesIO()
    torch.save(value, buf)
    return buf.getvalue()


class DcpPhases:
    """The write and commit phases of one save into DCP's layout (see the module).

    ``objects``: this rank's Python objects by fqn, as DCP's bytes (what the plan carries for them is
    pipeload's encoding of those bytes); ``paths``: DCP's flattening paths of this rank's keys;
    ``writer``: the ``FileSystemWriter`` of the call (its ``sync_files`` and, on rank 0, its
    ``storage_meta``). ``metadata`` is the committed ``Metadata`` once :meth:`commit_phase` returned.
    """

    def __init__(self, objects: dict[str, bytes], paths: dict[str, tuple], writer) -> None:
        self.objects, self.paths, self.writer = objects, paths, writer
        self.sync = bool(getattr(writer, "sync_files", True))
        self.metadata: Metadata | None = None
        self.index, self.stale = 0, []  # this save's file index; this rank's files it leaves unnamed
        self._early = None  # rank 0, a reused plan: the kept Metadata's pickle, made while writing

    def write_phase(self, plan, directory: str, comm: Comm) -> tuple[str | None, list[tuple]]:
        """Write this rank's ``__<rank>_<i>.distcp`` (:func:`choose_file`); ``(error or None, [(row,
        offset, length, object)])``. A write that fails deletes its file; the last checkpoint's files are
        never touched. Rank 0 takes the directory's lock first (pipeload's: one save at a time per
        directory), its fd in ``plan.locks`` for the caller to release. Never raises: the commit's
        agreement does."""
        error, done = None, []
        if comm.rank == 0:
            fd, error = _lock_directory(directory)
            plan.locks += [fd] if fd is not None else []
        try:
            os.makedirs(directory, exist_ok=True)
            self.index, self.stale = choose_file(directory, comm.rank)
        except OSError as e:
            error = error or f"creating {directory}: {_error_text(e)}"
        if comm.rank == 0 and error is None:
            self._early = _early_pickle(plan, self.writer, self.index)
        path = os.path.join(directory, data_file(comm.rank, self.index))
        if plan.items and error is None:
            try:
                done = self._write_file(path, plan)
                if self.sync:
                    _fsync_dir(directory)
            except Exception as e:  # noqa: BLE001 - carried to the commit's agreement
                error = f"writing {path}: {_error_text(e)}"
                try:
                    os.unlink(path)
                except OSError:
                    pass
        return error, done

    def _write_file(self, path: str, plan) -> list[tuple]:
        """Append every item, in plan order: a Python object as its bytes (DCP's ``BYTE_IO``), a tensor
        as ``torch.save``'s archive of it — from :mod:`.torchsave`'s template around the tensor's own
        memory, in ``writev`` batches, or (no template: a huge tensor) through DCP's ``_write_item``."""
        done = []
        at = 0
        with open(path, "wb", buffering=0) as f:
            out = _Batch(f)
            for (_, _, _, value), row, tpl in zip(plan.items, plan.rows, _templates(plan)):
                if len(row) == 1:
                    data = self.objects[plan.table.names[row[0]]]
                    out.add(memoryview(data), None)
                    done.append((row, at, len(data), True))
                    at += len(data)
                    continue
                if tpl is None:
                    out.flush()
                    length = self._torch_save(f, plan, row, value)
                else:
                    view, owner = _host_bytes(value)
                    head, tail = tpl.parts(view)
                    out.add_framed(head, view, owner, tail)
                    length = len(head) + view.nbytes + len(tail)
                    del view, owner
                done.append((row, at, length, False))
                at += length
            out.flush()
            if self.sync:
                os.fsync(f.fileno())
        return done

    @staticmethod
    def _torch_save(f, plan, row, value) -> int:
        item = WriteItem(MetadataIndex(plan.table.names[row[0]], row[1]), WriteItemType.SHARD)
        data, owner = exact(value, row[2])
        info = dcp_fs._write_item(dcp_fs._StorageWriterTransforms(()), f, data, item, os.path.basename(f.name),
                                  dcp_fs.SerializationFormat.TORCH_SAVE).storage_data
        del data, owner
        return info.length

    def commit_phase(self, plan, directory: str, comm: Comm, error: str | None, done: list[tuple]) -> None:
        """Agree on the writes, gather the rows to rank 0, which commits; agree on the commit and give
        every rank the ``Metadata``. Every rank raises :class:`DistributedError` if any rank failed.

        Collectives, in this order on every rank: the writes' agreement (one all-gather of two words per
        rank, the error texts only on a failure), the gather of the rows to rank 0, the commit's
        agreement (two words), one broadcast. A save whose plan was reused and whose rows equal the
        last commit's has the same ``Metadata`` but for its ``storage_meta`` (:func:`_kept`): rank 0
        then rebuilds nothing and the broadcast carries only the ``storage_meta`` (the agreement's word
        says which, as ``-1 - size``); otherwise it carries the whole pickle."""
        what = f"dcp.save into {directory}"
        mine = encode_rows(plan, done, self.paths, self.index) if error is None else b""
        sizes = comm.agree_on(len(mine), error, what, "agreement on the writes")
        gathered = comm.gather_to_first(mine, sizes, what)
        error, send, value, md = None, b"", 0, None
        kept = plan.memo.get(_KEPT) if plan.reused else None
        if comm.rank == 0:
            try:
                md, raw, same = _kept(kept, plan.table, gathered, self.writer, self._early)
                self._commit(directory, raw)
                send = pickle.dumps((md.storage_meta, _files_of(gathered))) if same else raw
                value = -1 - len(send) if same else len(send)
            except Exception as e:  # noqa: BLE001
                error = f"committing {os.path.join(directory, METADATA)}: {_error_text(e)}"
        value = int(comm.agree_on(value, error, what, "agreement on the commit")[0])
        got = comm.broadcast_bytes(send, -1 - value if value < 0 else value, what)
        _delete_later(directory, self.stale)  # committed: the new .metadata names none of them
        if md is None:
            md = self._received(kept, got, value < 0, directory)
        files = _files_of(gathered) if comm.rank == 0 else None
        plan.memo[_KEPT] = _Kept(_rows_key(gathered) if comm.rank == 0 else None, files, _content(md),
                                 kept if value < 0 else None)
        self.metadata = md

    @staticmethod
    def _received(kept, got: bytes, same: bool, directory: str) -> Metadata:
        """A rank other than 0: the ``Metadata`` from the broadcast, or the kept content with the new
        ``storage_meta`` and file names (read back from ``.metadata`` should this rank have kept none)."""
        if not same:
            return pickle.loads(got)
        if kept is None:
            with open(os.path.join(directory, METADATA), "rb") as f:
                return pickle.load(f)
        storage_meta, files = pickle.loads(got)
        return _with_meta(kept.content_for(files), storage_meta)

    def _commit(self, directory: str, raw: bytes) -> None:
        tmp = os.path.join(directory, METADATA + ".tmp")
        with open(tmp, "wb") as f:
            f.write(raw)
            f.flush()
            if self.sync:
                os.fsync(f.fileno())
        os.replace(tmp, os.path.join(directory, METADATA))
        if self.sync:
            _fsync_dir(directory)


_KEPT = "dcp.metadata"  # in the kept plan's memo: a _Kept
_TEMPLATES = "dcp.templates"  # and: (torch.save's options, each item's template)


def _templates(plan) -> list:
    """Each item's :func:`torchsave.template` (None for an object or a tensor ``torch.save`` must write),
    kept with the plan while ``torch.save``'s options stay the same."""
    opts = torchsave.options()
    kept = plan.memo.get(_TEMPLATES)
    if kept is None or kept[0] != opts:
        made = [None if len(row) == 1 else torchsave.template(v.dtype, tuple(row[2]), opts)
                for (_, _, _, v), row in zip(plan.items, plan.rows)]
        kept = plan.memo[_TEMPLATES] = (opts, made)
    return kept[1]


def _files_of(per_rank: list[bytes]) -> tuple:
    """Each rank's file name from its :func:`encode_rows` (None for a rank that wrote none)."""
    return tuple(data_file(r, int(np.frombuffer(g, dtype=np.int64, count=_HEAD)[3])) if len(g) > 8 * _HEAD else None
                 for r, g in enumerate(per_rank))


def _rows_key(per_rank: list[bytes]) -> bytes:
    """The gathered rows without the file indices: equal when a commit's content is the last one's but
    for the names of the files."""
    return b"".join(g[: 8 * (_HEAD - 1)] + g[8 * _HEAD :] for g in per_rank)


class _Kept:
    """What a commit keeps for the next save of the same plan: rank 0's rows key and file names, and the
    ``Metadata``'s content for the files of this commit and of the one before (a training loop saving
    into one directory alternates between two sets of names: :func:`choose_file`).

    Content for other names is the kept content with its ``storage_data`` renamed (:meth:`content_for`)."""

    __slots__ = ("rows", "files", "contents")

    def __init__(self, rows: bytes | None, files: tuple | None, content: tuple, before: "_Kept | None") -> None:
        """``before``: the last commit's, when this commit's content is its but for the names."""
        self.rows, self.files = rows, files
        key = _files_in(content)
        self.contents = {key: content}
        if before is not None:  # the same content, under other names
            for k, c in before.contents.items():
                if k != key and len(self.contents) < 2:
                    self.contents[k] = c

    def content_for(self, files: tuple) -> tuple:
        got = self.contents.get(frozenset(f for f in files if f is not None))
        if got is not None:
            return got
        sdm, planner_data, storage = next(iter(self.contents.values()))
        rename = {_rank_of(f): f for f in files if f is not None}
        return sdm, planner_data, {k: dcp_fs._StorageInfo(rename.get(_rank_of(v.relative_path), v.relative_path),
                                                          v.offset, v.length) for k, v in storage.items()}


def _rank_of(name: str) -> str:
    return name[: name.index("_", 2)]


def _files_in(content: tuple) -> frozenset:
    return frozenset(v.relative_path for v in content[2].values())


def _content(md: Metadata) -> tuple:
    return md.state_dict_metadata, md.planner_data, md.storage_data


def _with_meta(content: tuple, storage_meta) -> Metadata:
    """A ``Metadata`` of kept content (its dicts copied: a caller changing one leaves the next alone)."""
    sdm, planner_data, storage = content
    return Metadata(dict(sdm), planner_data=dict(planner_data), storage_data=dict(storage),
                    storage_meta=storage_meta, version=dcp_fs.CURRENT_DCP_VERSION)


def _kept(kept: _Kept | None, table, gathered, writer, early) -> tuple[Metadata, bytes, bool]:
    """Rank 0: (the ``Metadata`` of this commit, its pickle, whether it is the kept content but for its
    ``storage_meta`` and file names)."""
    if kept is not None and kept.rows is not None and kept.rows == _rows_key(gathered):
        files = _files_of(gathered)
        got = early() if early is not None else None
        if got is None or got[2] != files:
            md = _with_meta(kept.content_for(files), writer.storage_meta())
            got = md, pickle.dumps(md), files
        return got[0], got[1], True
    md = build_metadata(table, gathered, writer.storage_meta())
    return md, pickle.dumps(md), False


def _early_pickle(plan, writer, index: int):
    """Rank 0 of a save whose plan was reused: start pickling the kept ``Metadata`` with this save's
    ``storage_meta`` on a thread, while this rank writes its file (the pickle of a 3,000-tensor
    ``Metadata`` takes as long as that write's Python part, and the writes and fsyncs release the GIL),
    guessing that every rank's file has rank 0's ``index`` (ranks saving into one directory alternate
    alike). Returns the function that waits for ``(Metadata, pickle, files)`` (None if it failed: the
    commit pickles again), or None without a kept ``Metadata``. The commit uses it only when every
    rank's rows equal the kept ones and its files are the guessed ones (:func:`_kept`), which is when its
    content is this commit's."""
    kept = plan.memo.get(_KEPT) if plan.reused else None
    if kept is None or kept.rows is None:
        return None
    files = tuple(None if f is None else data_file(int(_rank_of(f)[2:]), index) for f in kept.files)
    got: list = []

    def run() -> None:
        try:
            md = _with_meta(kept.content_for(files), writer.storage_meta())
            got.append((md, pickle.dumps(md), files))
        except Exception:  # noqa: BLE001 - the commit pickles it again, and raises there
            pass

    thread = threading.Thread(target=run, name="pipeload-dcp-metadata", daemon=True)
    thread.start()

    def result():
        thread.join()
        return got[0] if got else None

    return result


def exact(value: torch.Tensor, shape) -> tuple[torch.Tensor, torch.Tensor]:
    """(``value`` as a host tensor of ``shape`` whose storage is exactly its bytes, what owns that memory:
    keep it alive while the tensor is used). ``torch.save`` writes a tensor's whole storage: a view of a
    staging buffer or of a flat parameter would write all of it.

    A contiguous host tensor is re-wrapped without a copy (no attribute on the tensor either: pickling
    would save it); anything else is copied once, as DCP's writer copies a tensor whose storage is
    larger than it."""
    t = value.detach()
    if t.device.type != "cpu" or not t.is_contiguous() or t.is_conj() or t.is_neg():
        t = t.to("cpu").resolve_conj().resolve_neg().contiguous()
    if t.untyped_storage().nbytes() == t.nbytes and t.storage_offset() == 0:
        return t.view(tuple(shape)), t
    if t.nbytes == 0:
        return torch.empty(tuple(shape), dtype=t.dtype), t
    raw = (ctypes.c_char * t.nbytes).from_address(t.data_ptr())
    return torch.frombuffer(raw, dtype=torch.uint8).view(t.dtype).view(tuple(shape)), t


def encode_rows(plan, done: list[tuple], paths: dict[str, tuple], index: int = 0) -> bytes:
    """This rank's file for rank 0: ``[n, width, json bytes, index]``, the rows (int64: key index, object flag,
    offset, length, box offsets and lengths padded to ``width``), then the JSON paths of its keys."""
    width = plan.table.shape.shape[1]
    rows = np.zeros((len(done), 4 + 2 * width), dtype=np.int64)
    written = {}
    for i, (row, at, length, is_object) in enumerate(done):
        rows[i, :4] = (row[0], is_object, at, length)
        if not is_object:
            rows[i, 4 : 4 + len(row[1])] = row[1]
            rows[i, 4 + width : 4 + width + len(row[2])] = row[2]
        fqn = plan.table.names[row[0]]
        written[fqn] = list(paths.get(fqn, (fqn,)))
    text = json.dumps(written, separators=(",", ":")).encode("utf-8", "surrogatepass")
    return np.asarray([len(done), width, len(text), index], dtype=np.int64).tobytes() + rows.tobytes() + text


def _decode_rows(data: bytes) -> tuple[np.ndarray, dict]:
    n, width, nbytes, _ = (int(x) for x in np.frombuffer(data, dtype=np.int64, count=_HEAD))
    rows = np.frombuffer(data, dtype=np.int64, count=n * (4 + 2 * width), offset=8 * _HEAD).reshape(n, 4 + 2 * width)
    at = 8 * _HEAD + rows.nbytes
    return rows, json.loads(bytes(data[at : at + nbytes]).decode("utf-8", "surrogatepass"))


def build_metadata(table, per_rank, storage_meta) -> Metadata:
    """Rank 0: DCP's ``Metadata`` of the committed save from every rank's :func:`encode_rows`.

    Keys in the save's (sorted) order, each tensor's chunks by offsets (the ``MetadataIndex`` hints
    number them so); tensor properties are the dtype (DCP's other properties at their defaults)."""
    found: list[tuple] = []
    paths: dict[str, tuple] = {}
    for r, data in enumerate(per_rank):
        if not data or len(data) <= 8 * _HEAD:
            continue
        rows, written = _decode_rows(data)
        paths.update({k: tuple(v) for k, v in written.items()})
        for x in rows.tolist():
            found.append((r, x))
    found.sort(key=lambda e: (e[1][_K], e[1][4:]))
    md: dict[str, Any] = {}
    storage: dict[MetadataIndex, Any] = {}
    sizes_of: dict[tuple, torch.Size] = {}  # equal sizes and properties shared: pickled once
    props: dict[str, TensorProperties] = {}
    files = _files_of(per_rank)
    size = lambda v: sizes_of.get(v) or sizes_of.setdefault(v, torch.Size(v))  # noqa: E731
    for r, x in found:
        k = x[_K]
        fqn, info = table.names[k], dcp_fs._StorageInfo(files[r], x[_AT], x[_LEN])
        if x[_OBJ]:
            md[fqn] = BytesStorageMetadata()
            storage[MetadataIndex(fqn)] = info
            continue
        nd, width = int(table.ndim[k]), (len(x) - 4) // 2
        offsets, sizes = size(tuple(x[4 : 4 + nd])), size(tuple(x[4 + width : 4 + width + nd]))
        tmd = md.get(fqn)
        if tmd is None:
            name = table.dtype_name(k)
            prop = props.get(name) or props.setdefault(name, TensorProperties(dtype=torch_dtype(name)))
            tmd = md[fqn] = TensorStorageMetadata(prop, size(table.shape_of(k)), [])
        storage[MetadataIndex(fqn, offsets, len(tmd.chunks))] = info
        tmd.chunks.append(ChunkStorageMetadata(offsets, sizes))
    planner_data = {fqn: paths.get(fqn, (fqn,)) for fqn in md}
    return Metadata(md, planner_data=planner_data, storage_data=storage, storage_meta=storage_meta,
                    version=dcp_fs.CURRENT_DCP_VERSION)
