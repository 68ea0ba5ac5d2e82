"""DCP's pickled ``.metadata`` as a chunk table, decoded once on the rank that reads it.

``dcp.save`` pickles one ``Metadata`` object: per tensor a ``TensorStorageMetadata`` listing every
chunk (``ChunkStorageMetadata``), and ``storage_data`` mapping each (fqn, chunk offsets) to the byte
range of a ``.distcp`` file holding it. At 4,096 FSDP ranks that is 1.9 M chunks: unpickling it builds
~10 M Python objects, and every rank doing so (as ``dcp.load`` does) costs each rank about a minute.

Here rank 0 alone unpickles it, with the allow-list unpickler of :mod:`pipeload.formats.dcp` (the only
code that reads the pickle; any other global is refused). Its chunk-heavy classes (the chunk, the
storage key and the byte range) are stood in for by slotted recorders whose ``__setstate__`` appends
their numbers to flat ``array('q')`` columns and drops the state dict, and ``torch.Size`` by ``tuple``;
the cyclic GC is paused (millions of acyclic objects would trigger full collections). The unpickler reads
the pickle through :mod:`pipeload.formats._memoprune`, which memoizes only the entries the pickle reads back:
otherwise its memo would keep ~15 objects a chunk alive to the end (~1.2 KB a chunk; ~430 B with it). The columns become
a :mod:`pipeload.formats.table` blob with numpy only: every other rank receives that, not the pickle.

A pickle the recorders cannot follow (another DCP version's state layout, shared chunk objects) is
decoded again with DCP's own classes (:func:`_columns_of_objects`); both paths fill the same columns
and share every check, so they give the same table.
"""

from __future__ import annotations

import itertools
import math
import operator
import os
from array import array
from typing import Any

import numpy as np

from ..engine._gcpause import paused_gc
from ..errors import CheckpointFormatError
from .metadata import dtype_name, plain_file_name
from . import table

_I = operator.attrgetter("i")
_DCP_MD = "torch.distributed.checkpoint.metadata"
_FS = "torch.distributed.checkpoint.filesystem"
VERSION = 1  # of the table's facts for DCP; a sidecar of another version is rebuilt


class _NotPlain(Exception):
    """The recorders met a structure they do not follow: decode with DCP's own classes instead."""


class _Columns:
    """What the recorders (or the walk over DCP's objects) collect, in stream order."""

    def __init__(self):
        self.cdim = array("q")  # per chunk: len(offsets), len(sizes)
        self.cval = array("q")  # per chunk: its offsets, then its sizes
        self.ifqn: list = []  # per storage key: its fqn
        self.idim = array("q")  # per storage key: len(offset), -1 when None (a non-tensor item)
        self.ival = array("q")  # per storage key: its offset
        self.spath: list = []  # per storage value: relative_path
        self.sval = array("q")  # per storage value: offset, length
        self.transforms: dict[int, list[str]] = {}  # storage value -> its transform descriptors

    def chunk(self, offsets, sizes) -> int:
        self.cdim.append(len(offsets))
        self.cdim.append(len(sizes))
        self.cval.extend(offsets)
        self.cval.extend(sizes)
        return (len(self.cdim) >> 1) - 1

    def key(self, fqn, offset) -> int:
        self.ifqn.append(fqn)
        if offset is None:
            self.idim.append(-1)
        else:
            self.idim.append(len(offset))
            self.ival.extend(offset)
        return len(self.ifqn) - 1

    def value(self, path, offset, length, transforms) -> int:
        self.spath.append(path)
        self.sval.append(offset)
        self.sval.append(length)
        i = len(self.spath) - 1
        if transforms:
            self.transforms[i] = [str(t) for t in transforms]
        return i


def _recorders(cols: _Columns) -> dict[tuple[str, str], Any]:
    """The stand-in classes the fast unpickler returns for DCP's chunk-heavy ones, bound to ``cols``."""
    chunk, key, value = cols.chunk, cols.key, cols.value

    def state(st):
        return st[1] if type(st) is tuple and len(st) == 2 else st  # (dict, slots) of a slotted class

    class Chunk:
        __slots__ = ("i",)

        def __setstate__(self, st):
            st = state(st)
            self.i = chunk(st["offsets"], st["sizes"])
            st.clear()

    class Key:  # hashed by identity: storage_data is iterated, never looked up
        __slots__ = ("i",)

        def __setstate__(self, st):
            st = state(st)
            self.i = key(st["fqn"], st.get("offset"))
            st.clear()

    class Value:
        __slots__ = ("i",)

        def __setstate__(self, st):
            st = state(st)
            self.i = value(st["relative_path"], st["offset"], st["length"], st.get("transform_descriptors"))
            st.clear()

    class Tensor:
        __slots__ = ("dtype", "size", "lo", "n")

        def __setstate__(self, st):
            st = state(st)
            self.dtype, self.size = st["properties"].dtype, st["size"]
            chunks = st["chunks"]
            self.n = n = len(chunks)
            ids = np.fromiter(map(_I, chunks), dtype=np.int64, count=n)
            self.lo = int(ids[0]) if n else 0
            if n and not np.array_equal(ids, np.arange(self.lo, self.lo + n)):
                raise _NotPlain("chunks shared or out of order")
            st.clear()

    class Bytes:
        __slots__ = ()

        def __setstate__(self, st):
            pass

    class Top:  # Metadata: one object, its attributes kept
        pass

    return {(_DCP_MD, "ChunkStorageMetadata"): Chunk, (_DCP_MD, "MetadataIndex"): Key, (_FS, "_StorageInfo"): Value,
            (_DCP_MD, "TensorStorageMetadata"): Tensor, (_DCP_MD, "BytesStorageMetadata"): Bytes,
            (_DCP_MD, "Metadata"): Top, ("torch", "Size"): tuple}


def _fast_unpickler(base: type, stream, source: str, cols: _Columns):
    """The allow-list unpickler (``base``), with the recorders in place of the classes they stand in for."""
    stand_in = _recorders(cols)

    class Fast(base):
        def find_class(self, module: str, name: str) -> Any:
            hit = stand_in.get((module, name))
            return hit if hit is not None else super().find_class(module, name)

    return Fast(stream, source), stand_in


def decode(stream_of, source: str, unpickler: type) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    """(arrays, facts) of the table of a DCP ``.metadata``; ``stream_of()`` opens its bytes afresh.

    Raises CheckpointFormatError naming ``source`` (a refused global, a malformed pickle, a chunk with
    no storage entry, geometry outside a tensor's shape)."""
    with paused_gc():
        cols = _Columns()
        try:
            u, classes = _fast_unpickler(unpickler, _pruned(stream_of()), source, cols)
            top = u.load()
            del u
            parts = _parts_of_recorded(top, cols, classes)
            del top  # storage_data's stand-ins: the columns hold what they recorded
        except CheckpointFormatError:
            raise
        except Exception:  # noqa: BLE001 - not the plain layout: DCP's own classes decide
            cols = _Columns()
            parts = _columns_of_objects(_load_objects(stream_of(), source, unpickler), cols, source)
        try:
            return _table(cols, *parts, source)
        except (TypeError, ValueError, OverflowError, IndexError) as e:
            raise CheckpointFormatError(f"{source}: malformed metadata ({type(e).__name__}: {e})") from None


def _pruned(stream):
    """``stream``'s pickle replayed with only the memo entries it reads back (:mod:`._memoprune`: the memo
    would otherwise keep ~15 objects a chunk alive), or ``stream`` itself when the rewrite does not follow it.
    The pickle's bytes are held while it is unpickled (a quarter of what the pruned memo saves)."""
    from ._memoprune import pruned

    data = stream.getvalue() if hasattr(stream, "getvalue") else stream.read()
    p = pruned(data)
    if p is None:
        stream.seek(0)
        return stream
    return p


def _load_objects(stream, source: str, unpickler: type):
    from torch.distributed.checkpoint.metadata import Metadata as DcpMetadata

    try:
        md = unpickler(stream, source).load()
    except CheckpointFormatError:
        raise
    except Exception as e:  # noqa: BLE001 - any malformed pickle
        raise CheckpointFormatError(f"{source}: not a valid torch.distributed.checkpoint metadata "
                                    f"({type(e).__name__}: {e})") from None
    if not isinstance(md, DcpMetadata):
        raise CheckpointFormatError(f"{source}: holds a {type(md).__name__}, not a DCP Metadata")
    return md


def _parts_of_recorded(top, cols: _Columns, classes) -> tuple:
    """(tensor entries, object fqns, storage pairs checked, save id) from the recorders' objects."""
    if type(top) is not classes[(_DCP_MD, "Metadata")]:
        raise _NotPlain("not a Metadata")
    sdm, storage = top.state_dict_metadata, top.storage_data
    if type(sdm) is not dict or type(storage) is not dict:
        raise _NotPlain("unexpected containers")
    n = len(storage)
    keys = np.fromiter(map(_I, storage.keys()), dtype=np.int64, count=n)
    values = np.fromiter(map(_I, storage.values()), dtype=np.int64, count=n)
    if len(cols.ifqn) != n or len(cols.spath) != n or not (np.array_equal(keys, np.arange(n))
                                                            and np.array_equal(values, keys)):
        raise _NotPlain("storage keys or values recorded outside storage_data")
    tensor_cls, bytes_cls = classes[(_DCP_MD, "TensorStorageMetadata")], classes[(_DCP_MD, "BytesStorageMetadata")]
    tensors, objects = [], []
    for fqn, m in sdm.items():
        if type(m) is tensor_cls:
            tensors.append((fqn, m.dtype, m.size, m.lo, m.n))
        elif type(m) is bytes_cls:
            objects.append(fqn)
        else:
            raise _NotPlain("unknown item metadata")
    return tensors, objects, _save_id(top)


def _save_id(top) -> str:
    sid = getattr(getattr(top, "storage_meta", None), "save_id", None)
    return str(sid or "")


def _columns_of_objects(md, cols: _Columns, source: str) -> tuple:
    """The same parts from DCP's own objects (the exact path: per-chunk Python, any layout DCP writes)."""
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, TensorStorageMetadata

    tensors, objects = [], []
    try:
        for fqn, m in md.state_dict_metadata.items():
            if isinstance(m, BytesStorageMetadata):
                objects.append(fqn)
            elif isinstance(m, TensorStorageMetadata):
                lo = len(cols.cdim) >> 1
                for c in m.chunks:
                    cols.chunk(tuple(c.offsets), tuple(c.sizes))
                tensors.append((fqn, m.properties.dtype, tuple(m.size), lo, len(m.chunks)))
            else:
                raise CheckpointFormatError(f"{source}: {fqn!r} has unknown metadata {type(m).__name__}")
        for idx, info in (md.storage_data or {}).items():
            cols.key(idx.fqn, None if idx.offset is None else tuple(idx.offset))
            cols.value(getattr(info, "relative_path", None), getattr(info, "offset", None),
                       getattr(info, "length", None), getattr(info, "transform_descriptors", None))
    except (TypeError, OverflowError, AttributeError) as e:
        raise CheckpointFormatError(f"{source}: malformed chunk or storage entry ({type(e).__name__}: {e})") from None
    return tensors, objects, _save_id(md)


def _padded(dims: np.ndarray, vals: np.ndarray, starts: np.ndarray, skip: np.ndarray | int, width: int) -> np.ndarray:
    """An n x ``width`` array: row i holds ``vals[starts[i] + skip[i] : ... + dims[i]]``, zero-padded."""
    out = np.zeros((len(dims), width), dtype=np.int64)
    for k in range(width):
        m = dims > k
        out[m, k] = vals[(starts + skip + k)[m]]
    return out


def _table(cols: _Columns, tensors: list, objects: list, save_id: str, source: str):
    """Columns -> (arrays, facts): tensor table sorted by name, chunks by (tensor, offsets), joined to
    their byte ranges; geometry checked vectorised (inside the shape, volumes sum to the tensor's)."""
    names = sorted(f for f, *_ in tensors)
    if len(set(names)) != len(names) or not all(type(f) is str for f in names) \
            or not all(type(f) is str for f in objects):
        raise CheckpointFormatError(f"{source}: item names must be unique strings")
    row_of = {f: i for i, f in enumerate(names)}
    t_count = len(names)
    dtypes, shapes, ndims = [""] * t_count, [()] * t_count, [0] * t_count
    by_lo = sorted(tensors, key=lambda e: e[3])
    for fqn, dt, size, _, _ in tensors:
        r = row_of[fqn]
        try:
            dtypes[r] = dtype_name(dt)
        except (KeyError, TypeError):
            raise CheckpointFormatError(f"{source}: tensor {fqn!r} has dtype {dt}, which safetensors names do not "
                                        f"cover") from None
        if type(size) is not tuple or not all(type(x) is int and x >= 0 for x in size) or math.prod(size) >= 1 << 62:
            raise CheckpointFormatError(f"{source}: tensor {fqn!r} has a bad size {size!r}")
        shapes[r], ndims[r] = size, len(size)
    width = max(ndims, default=0)
    n_chunks = len(cols.cdim) >> 1
    expect = 0
    for fqn, _, _, lo, n in by_lo:
        if lo != expect and n:
            raise CheckpointFormatError(f"{source}: tensor {fqn!r}: chunks shared with another tensor")
        expect = lo + n if n else expect
    if expect != n_chunks:
        raise CheckpointFormatError(f"{source}: chunks listed by no tensor")
    counts = np.array([e[4] for e in by_lo], dtype=np.int64)
    ctensor = np.repeat(np.array([row_of[e[0]] for e in by_lo], dtype=np.int64), counts)
    nd = np.array(ndims, dtype=np.int64)
    cdim = np.frombuffer(cols.cdim, dtype=np.int64).reshape(n_chunks, 2) if n_chunks else np.zeros((0, 2), np.int64)
    if np.any(cdim[:, 0] != nd[ctensor]) or np.any(cdim[:, 1] != nd[ctensor]):
        bad = int(np.flatnonzero((cdim[:, 0] != nd[ctensor]) | (cdim[:, 1] != nd[ctensor]))[0])
        raise CheckpointFormatError(f"{source}: tensor {names[ctensor[bad]]!r}: a chunk of another rank")
    cval = np.frombuffer(cols.cval, dtype=np.int64)
    cstart = np.zeros(n_chunks, dtype=np.int64)
    np.cumsum(2 * cdim[:-1, 0], out=cstart[1:])
    coff = _padded(cdim[:, 0], cval, cstart, 0, width)
    clen = _padded(cdim[:, 0], cval, cstart, cdim[:, 0], width)
    shape = np.zeros((t_count, width), dtype=np.int64)
    for r, s in enumerate(shapes):
        shape[r, : len(s)] = s
    _check_geometry(names, nd, ctensor, coff, clen, shape, source)
    order = np.lexsort([*(coff[:, k] for k in reversed(range(width))), ctensor])
    ctensor, coff, clen = ctensor[order], coff[order], clen[order]
    if n_chunks > 1:
        same = (ctensor[1:] == ctensor[:-1]) & np.all(coff[1:] == coff[:-1], axis=1)
        if same.any():
            k = int(np.flatnonzero(same)[0])
            raise CheckpointFormatError(f"{source}: tensor {names[ctensor[k]]!r} lists two chunks at "
                                        f"{coff[k, : nd[ctensor[k]]].tolist()}")
    where, files, objs, sfile = _join(cols, names, row_of, nd, ctensor, coff, objects, width, source)
    transforms = {int(r): cols.transforms[int(s)] for r, s in enumerate(where.tolist()) if int(s) in cols.transforms} \
        if cols.transforms else {}
    return _arrays(names, dtypes, ndims, shape, ctensor, coff, clen, where, cols, files, objs, transforms, save_id,
                   sfile)


def _check_geometry(names, nd, ctensor, coff, clen, shape, source: str) -> None:
    """Every chunk lies inside its tensor's shape, and each tensor's chunk volumes sum to its numel
    (overlaps are found where a box is looked up, as for format 2: a box's chunks must cover it exactly)."""
    bad = np.any(coff < 0, axis=1) | np.any(clen < 0, axis=1) | np.any(coff + clen > shape[ctensor], axis=1)
    if bad.any():
        k = int(np.flatnonzero(bad)[0])
        raise CheckpointFormatError(f"{source}: tensor {names[ctensor[k]]!r}: chunk at {coff[k].tolist()} of size "
                                    f"{clen[k].tolist()} lies outside the shape {shape[ctensor[k]].tolist()}")
    real = np.arange(shape.shape[1]) < nd[:, None]  # T x K: which columns are dims of the tensor
    vol = np.prod(np.where(real[ctensor], clen, 1), axis=1)
    total = np.zeros(len(names), dtype=np.int64)
    np.add.at(total, ctensor, vol)
    numel = np.prod(np.where(real, shape, 1), axis=1)
    off = np.flatnonzero(total != numel)
    if len(off):
        raise CheckpointFormatError(f"{source}: tensor {names[off[0]]!r}: chunks do not tile the shape "
                                    f"{shape[off[0], : nd[off[0]]].tolist()} exactly (gap or overlap)")


def _join(cols: _Columns, names, row_of, nd, ctensor, coff, objects, width: int, source: str):
    """Per chunk (in table order) the storage entry holding it; the file list; the objects' entries.

    One sort of chunk keys and storage keys together (tagged 1 and 0): a chunk's entry is the storage key
    just before it with the same (tensor, offsets). A key given twice keeps the later one, as the dict it
    came from did."""
    n = len(cols.ifqn)
    idim = np.frombuffer(cols.idim, dtype=np.int64) if n else np.zeros(0, dtype=np.int64)
    srow = np.fromiter(map(row_of.get, cols.ifqn, itertools.repeat(-1)), dtype=np.int64, count=n) if n else idim
    ok = (idim >= 0) & (srow >= 0)
    ok[ok] &= idim[ok] == nd[srow[ok]]
    ival = np.frombuffer(cols.ival, dtype=np.int64)
    istart = np.zeros(n, dtype=np.int64)
    np.cumsum(np.maximum(idim[:-1], 0), out=istart[1:]) if n > 1 else None
    sel = np.flatnonzero(ok)
    soff = _padded(idim[sel], ival, istart[sel], 0, width)
    c = len(ctensor)
    rows = np.concatenate([srow[sel], ctensor])
    offs = np.concatenate([soff, coff]) if width else np.zeros((len(rows), 0), dtype=np.int64)
    tag = np.concatenate([np.zeros(len(sel), dtype=np.int64), np.ones(c, dtype=np.int64)])
    seq = np.concatenate([sel, np.arange(c)])
    order = np.lexsort([seq, tag, *(offs[:, k] for k in reversed(range(width))), rows])
    pos = np.empty(len(order), dtype=np.int64)
    pos[order] = np.arange(len(order))
    at = pos[len(sel):]  # each chunk's place in the sorted order
    prev = order[np.maximum(at - 1, 0)]
    found = (at > 0) & (tag[prev] == 0) & (rows[prev] == ctensor) & np.all(offs[prev] == coff, axis=1)
    if not found.all():
        k = int(np.flatnonzero(~found)[0])
        raise CheckpointFormatError(f"{source}: no storage entry for {names[ctensor[k]]!r} at "
                                    f"{coff[k, : nd[ctensor[k]]].tolist()}")
    where = seq[prev]  # the storage entry of each chunk
    uniq = list(dict.fromkeys(cols.spath))  # (relative_path is one object per file as DCP writes it)
    ix = {p: i for i, p in enumerate(uniq)}
    sfile = np.fromiter(map(ix.__getitem__, cols.spath), dtype=np.int64, count=n) if n else idim
    used = np.unique(sfile[where]).tolist()
    paths = [uniq[i] for i in used]
    obj_of = {}
    for i in np.flatnonzero(idim < 0).tolist():
        obj_of[cols.ifqn[i]] = i  # the later of two keys wins
    objs = []
    for fqn in objects:
        i = obj_of.get(fqn)
        if i is None:
            raise CheckpointFormatError(f"{source}: no storage entry for {fqn!r} at []")
        objs.append((fqn, i))
        if cols.spath[i] not in paths:
            paths.append(cols.spath[i])
    files = []
    for p in paths:
        try:
            files.append(plain_file_name(p, f"{source}: {p!r}"))
        except TypeError:
            raise CheckpointFormatError(f"{source}: a relative_path is not a file name") from None
    remap = np.full(len(uniq), -1, dtype=np.int64)
    remap[[ix[p] for p in paths]] = np.arange(len(paths))
    return where, files, objs, remap[sfile]


def _arrays(names, dtypes, ndims, shape, ctensor, coff, clen, where, cols: _Columns, files, objs, transforms,
            save_id: str, sfile: np.ndarray):
    """The table: format 2's chunk index arrays plus each chunk's byte range and each file's chunks."""
    c = len(ctensor)
    sval = np.frombuffer(cols.sval, dtype=np.int64).reshape(-1, 2) if len(cols.sval) else np.zeros((0, 2), np.int64)
    if np.any(sval < 0):
        raise CheckpointFormatError(f"{files[0] if files else '?'}: a storage entry has a negative byte range")
    chunk_file = sfile[where].astype(np.int32)
    counts = np.bincount(ctensor, minlength=len(names))
    start = np.zeros(len(names) + 1, dtype=np.int64)
    np.cumsum(counts, out=start[1:])
    max_rows = np.zeros(len(names), dtype=np.int64)
    if c and shape.shape[1]:
        np.maximum.at(max_rows, ctensor, clen[:, 0])
    file_rows = np.argsort(chunk_file, kind="stable").astype(np.int64)
    file_start = np.zeros(len(files) + 1, dtype=np.int64)
    np.cumsum(np.bincount(chunk_file, minlength=len(files)), out=file_start[1:])
    arrays = {"shape": shape, "chunk_start": start, "max_rows": max_rows, "chunk_offsets": coff,
              "chunk_lengths": clen, "chunk_file": chunk_file, "chunk_byte_offset": sval[where, 0] if c else
              np.zeros(0, np.int64), "chunk_byte_length": sval[where, 1] if c else np.zeros(0, np.int64),
              "file_rows": file_rows, "file_start": file_start}
    objects = {fqn: [int(sfile[i]), int(sval[i, 0]), int(sval[i, 1]), cols.transforms.get(i, [])]
               for fqn, i in objs}
    facts = {"layout": "dcp", "version": VERSION, "save_id": save_id, "names": names, "dtypes": dtypes,
             "ndims": ndims, "files": files, "objects": objects,
             "transforms": {str(r): t for r, t in transforms.items()}}
    return arrays, facts


# -- the table on every rank ---------------------------------------------------------------------------

SIDECAR = ".metadata.pipeload-table"  # the table kept beside a DCP checkpoint (docs/FORMAT.md)


def open_table(blob, source: str):
    """(Metadata, opener) of a DCP table blob, viewed in place: the chunk index over its arrays (no
    checksums recorded), the objects, and an opener whose files know the byte range of each of their items."""
    from .chunkindex import ChunkIndex, IndexedTensors
    from .metadata import OBJECT_ENCODING, Metadata, ObjectMeta

    arrays, facts = table.decode(blob, source)
    if facts.get("layout") != "dcp" or facts.get("version") != VERSION:
        raise CheckpointFormatError(f"{source}: not a DCP table of version {VERSION}")
    names = table.str_list(facts.get("names"), "names", source)
    dtypes = table.str_list(facts.get("dtypes"), "dtypes", source)
    files = [plain_file_name(f, f"{source}: files") for f in table.str_list(facts.get("files"), "files", source)]
    ndims, objects, save_id = facts.get("ndims"), facts.get("objects"), facts.get("save_id")
    if type(ndims) is not list or not all(type(x) is int for x in ndims) or type(objects) is not dict \
            or type(save_id) is not str or type(facts.get("transforms")) is not dict:
        raise CheckpointFormatError(f"{source}: table facts are malformed")
    idx = ChunkIndex(source, len(names), len(files), arrays=arrays, checksums=False)
    c, f = len(arrays["chunk_file"]), len(files)
    for name, want in (("chunk_byte_offset", (c,)), ("chunk_byte_length", (c,)), ("file_rows", (c,)),
                       ("file_start", (f + 1,))):
        a = arrays.get(name)
        if a is None or a.shape != want or a.dtype != np.int64:
            raise CheckpointFormatError(f"{source}: table array {name!r} is missing or malformed")
    md = Metadata(save_id=save_id, world_size=0)
    md.tensors = IndexedTensors(idx, names, dtypes, ndims, files)
    md.index_file, md.data_files = SIDECAR, files
    items = {}
    for fqn, o in objects.items():
        if type(o) is not list or len(o) != 4 or not all(type(x) is int and x >= 0 for x in o[:3]) or o[0] >= f:
            raise CheckpointFormatError(f"{source}: object {fqn!r} is malformed in the table")
        md.objects[fqn] = ObjectMeta(files[o[0]], fqn, o[2], "", OBJECT_ENCODING)
        items.setdefault(files[o[0]], {})[fqn] = ("object", "U8", (o[2],), o[1], o[2], tuple(o[3]))
    return md, TableOpener(idx, arrays, md.tensors, files, items, facts["transforms"])


class TableOpener:
    """Reader opener: a ``.distcp`` path -> a DistcpFile knowing its items, built from the table on first
    open (one Python entry per item of that file; the rest of the table is never walked)."""

    def __init__(self, idx, arrays, tensors, files, objects, transforms):
        self.idx, self.a, self.tensors, self.objects, self.transforms = idx, arrays, tensors, objects, transforms
        self.file_ix = {name: i for i, name in enumerate(files)}
        self._row_tensor = None
        self.file_class = None  # formats.dcp.DistcpFile, set by the layout that opened the table

    def items(self, name: str) -> dict[str, tuple]:
        from .metadata import chunk_key

        out = dict(self.objects.get(name, {}))
        i = self.file_ix.get(name)
        if i is None:
            return out
        a = self.a
        lo, hi = int(a["file_start"][i]), int(a["file_start"][i + 1])
        rows = a["file_rows"][lo:hi]
        if self._row_tensor is None:
            start = a["chunk_start"]
            self._row_tensor = np.repeat(np.arange(len(start) - 1), np.diff(start))
        t = self.tensors
        aliases = []
        for r, ti, off, ln, bo, bl in zip(rows.tolist(), self._row_tensor[rows].tolist(),
                                          a["chunk_offsets"][rows].tolist(), a["chunk_lengths"][rows].tolist(),
                                          a["chunk_byte_offset"][rows].tolist(), a["chunk_byte_length"][rows].tolist()):
            nd = t.ndims[ti]
            o, n = tuple(off[:nd]), tuple(ln[:nd])
            whole = n == self.idx.shape(ti, nd)
            item = ("tensor", t.dtypes[ti], n, bo, bl, tuple(self.transforms.get(str(r), ())))
            out[chunk_key(t.names[ti], o, whole)] = item
            if whole:  # a whole tensor is also found by its offsets, as every other chunk
                aliases.append((chunk_key(t.names[ti], o, False), item))
        for key, item in aliases:
            out.setdefault(key, item)
        return out

    def __call__(self, path: str):
        return self.file_class(path, self.items(os.path.basename(path)))


# -- rank 0: the sidecar, or the pickle ----------------------------------------------------------------


def read_table(path: str, unpickler: type) -> bytes | bytearray:
    """The table blob of the DCP checkpoint at ``path``: the sidecar when it was built from this very
    ``.metadata`` (size, mtime and xxh3 of its bytes all equal) and is intact, else decoded from the pickle
    and (directory writable) kept as the sidecar, written atomically. A sidecar that cannot be read,
    is damaged or belongs to other bytes is ignored; one that cannot be written is skipped."""
    from .metadata import MAX_METADATA_BYTES, METADATA_FILE, resolve_inside

    md_path = os.path.join(path, METADATA_FILE)
    try:
        fd = os.open(md_path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as e:
        raise CheckpointFormatError(f"{md_path}: cannot read metadata ({e.strerror or e})") from None
    with os.fdopen(fd, "rb", buffering=1 << 20) as f:
        st = os.fstat(fd)
        import stat as stat_mod

        if not stat_mod.S_ISREG(st.st_mode):
            raise CheckpointFormatError(f"{md_path}: metadata is not a regular file")
        resolve_inside(path, METADATA_FILE)
        if st.st_size > MAX_METADATA_BYTES:
            raise CheckpointFormatError(f"{md_path}: metadata is {st.st_size} bytes, over the "
                                        f"{MAX_METADATA_BYTES}-byte limit")
        try:
            key = {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "xxh3": _digest(f)}
        except OSError as e:
            raise CheckpointFormatError(f"{md_path}: cannot read metadata ({e.strerror or e})") from None
        kept = _read_sidecar(path, key)
        if kept is not None:
            return kept

        def stream():
            f.seek(0)
            return f

        arrays, facts = decode(stream, md_path, unpickler)
    facts["source"] = key
    facts["data_xxh3"] = _arrays_digest(arrays)
    blob = table.encode(arrays, facts)
    _write_sidecar(path, blob)
    return blob


def table_of_pickle(data: bytes, source: str, unpickler: type) -> bytes | bytearray:
    """The table blob of a ``.metadata`` pickle held in memory (an object store's), without a sidecar."""
    import io

    arrays, facts = decode(lambda: io.BytesIO(data), source, unpickler)
    facts["data_xxh3"] = _arrays_digest(arrays)
    return table.encode(arrays, facts)


def _digest(f) -> str:
    from ..io.checksum import hasher

    h = hasher()
    buf = bytearray(8 << 20)
    while True:
        n = f.readinto(buf)
        if not n:
            return h.hexdigest()
        h.update(memoryview(buf)[:n])


def _arrays_digest(arrays: dict) -> str:
    """:func:`_data_digest` of the blob ``arrays`` will be encoded into (they are laid end to end)."""
    from ..io.checksum import hasher

    h = hasher()
    for a in arrays.values():
        h.update(np.ascontiguousarray(a).reshape(-1).view(np.uint8))
    return h.hexdigest()


def _data_digest(blob) -> str:
    """xxh3 of a blob's array bytes (after its header): a sidecar's arrays are checked before use."""
    import struct

    from ..io.checksum import checksum

    (n,) = struct.unpack_from("<Q", blob, 0)
    return checksum(memoryview(blob)[8 + n:])


def _read_sidecar(path: str, key: dict):
    from .metadata import resolve_inside

    side = os.path.join(path, SIDECAR)
    try:
        resolve_inside(path, SIDECAR)
        fd = os.open(side, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except (OSError, CheckpointFormatError):
        return None
    try:
        import stat as stat_mod

        with os.fdopen(fd, "rb") as f:
            if not stat_mod.S_ISREG(os.fstat(f.fileno()).st_mode):
                return None
            blob = f.read()
        _, facts = table.decode(blob, side)
        if facts.get("source") != key or facts.get("data_xxh3") != _data_digest(blob):
            return None
        open_table(blob, side)  # everything every rank will check
        return blob
    except (OSError, CheckpointFormatError, ValueError, TypeError, KeyError):
        return None


def _write_sidecar(path: str, blob: bytearray) -> None:
    """Keep ``blob`` as the sidecar: a temporary file, fsync, rename (readers see all of it or nothing)."""
    if not os.access(path, os.W_OK):
        return
    tmp = os.path.join(path, f"{SIDECAR}.tmp-{os.getpid()}-{os.urandom(4).hex()}")
    try:
        with open(tmp, "wb") as f:
            f.write(blob)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, os.path.join(path, SIDECAR))
    except OSError:
        try:
            os.unlink(tmp)
        except OSError:
            pass


def sidecar_state(path: str) -> str:
    """``"absent"``, ``"current"`` (it would be used: built from this ``.metadata``, intact) or ``"stale"``
    (another ``.metadata``'s, or damaged: it would be rebuilt)."""
    from .metadata import METADATA_FILE

    if not os.path.lexists(os.path.join(path, SIDECAR)):
        return "absent"
    try:
        with open(os.path.join(path, METADATA_FILE), "rb") as f:
            st = os.fstat(f.fileno())
            key = {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "xxh3": _digest(f)}
    except OSError:
        return "stale"
    return "current" if _read_sidecar(path, key) is not None else "stale"
