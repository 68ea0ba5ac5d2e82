"""The save's plan, through the load's machinery: fixed-size rows, distinct records once, arrays.

What a rank tells the others before a save, and the pure decisions every rank derives from it.

**Local record** (no communication, :func:`local_record`). A rank describes what it holds in two
byte strings:

- a *name table*: its keys, sorted, each with its kind (tensor or Python object), dtype and global
  shape. Every rank of a tensor-parallel position holds the same names (so do all the ranks of an
  FSDP layout): few distinct tables travel;
- a *shard record*: per tensor this rank holds, the position of its name in the table, the offsets and
  the lengths of its box (int32 where every value fits). Data-parallel replicas send identical bytes.

**Exchange** (:func:`exchange`, collectives through ``ex``: the save's :class:`~pipeload.engine.comm.Comm` or
a simulated one). One all-gather of a :data:`ROW_WORDS`-word row per rank (problem flag, the digests and
sizes of both byte strings, a hash of the rank's Python objects), then the distinct name tables and the
distinct shard records, each moved once by :func:`pipeload.plan.exchange.record_transfer` as the load moves
its records. The sorted union of the distinct name tables numbers every key; each table maps onto it.

**Plan** (:func:`plan`, the same on every rank from the same bytes). Kinds, dtypes and shapes must agree
between tables; identical chunks are grouped across records (``globalplan._row_groups``); zero-size
chunks are dropped unless a tensor has nothing else; the distinct chunks of each tensor must tile it.
Any problem names the key and the ranks, and is raised on every rank before a byte is written. Writers:
a chunk one rank holds is its own; chunks several ranks hold go through the design's greedy (largest
first, ties by key; the holder with the fewest bytes so far, ties to the lower rank; starting from the
bytes each rank writes alone), per holder set, in :func:`pipeload.plan._greedy.assign_readers` — exactly
:func:`pipeload.plan.balance.assign`. A rank computes only the connected component of holder sets its own
record class is in (plus that of the Python objects' writer pool, see :func:`_object_writer`).

Cost per rank (``W`` ranks, ``D`` distinct records, ``S`` chunks per record, ``N`` distinct name
tables of ``K`` keys): receive ``16 W`` bytes of plan-reuse words, ``8 W x ROW_WORDS`` of rows,
``N x K`` names and ``D x S`` record rows (``20-40`` bytes each); group ``D x S`` rows in numpy
(``O(D S)``, the only step that grows with ``W`` when ``R = 1``); the greedy ``O(P log R)`` over the
``P`` shared chunks of its component.
"""

from __future__ import annotations

import dataclasses

from dataclasses import dataclass, field
from typing import Any, Callable, NamedTuple, Sequence

import numpy as np
import torch

from ..plan._greedy import assign_readers
from ..io.checksum import checksum
from ..plan.exchange import Classes, classes, hash64, key_owner_threshold, record_digest, record_transfer
from ..plan.globalplan import _mix, _row_groups, _unique_rows
from ..formats.objects import encode_object  # noqa: F401 - the save's rule for objects, importable here
from ..formats.metadata import NAMES_OF_DTYPES, dtype_itemsize, dtype_name, storable_dtype, tiling_problem
from ..plan.statedict import is_tensor, tensor_box
from ..plan.tensorkinds import source_refusal

ROW_WORDS = 10
# row layout (int64 words)
R_FLAGS, R_RECORD, R_RNBYTES, R_NAMES, R_NNBYTES, R_OBJECTS, R_KEYOWNER = 0, 2, 4, 5, 7, 8, 9  # 1 unused
FLAG_PROBLEMS = 1
KIND_TENSOR, KIND_OBJECT = 0, 1
DTYPES = tuple(sorted(NAMES_OF_DTYPES.values()))  # dtype code -> safetensors name
_CODE = {n: i for i, n in enumerate(DTYPES)}
_I32_MAX = 2**31 - 1


@dataclass
class LocalRecord:
    """What one rank holds, as it travels (``names``, ``record``) and as its writes need it.

    ``entries[i]`` is ``(name, kind, dtype, global shape)`` of ``names`` position ``i`` (sorted by name);
    ``shards`` are ``(name position, offsets, lengths)`` of the tensors this rank holds, ``payload`` maps
    a name to its local tensor or serialised object bytes. ``objects_word`` hashes the rank's objects'
    (name, checksum) pairs: ranks whose objects differ have different words.
    """

    entries: list[tuple[str, int, str, tuple[int, ...]]]
    shards: list[tuple[int, tuple[int, ...], tuple[int, ...]]]
    payload: dict[str, Any]
    problems: list[str]
    names: bytes = b""
    record: bytes = b""
    objects_word: int = 0
    width: int = 0

    def encode(self) -> "LocalRecord":
        self.width = max((len(e[3]) for e in self.entries), default=0)
        self.names = encode_names(self.entries, self.width)
        self.record = encode_shards(self.shards, self.width)
        return self

    @property
    def class_digest(self) -> tuple[int, int]:
        """The digest ranks are grouped by: names and boxes alike (not the objects' values), so ranks of
        one record class also share one name table."""
        return record_digest(self.names + self.record)


def local_record(leaves, box_of: Callable | None = None, encode: bool = True) -> LocalRecord:
    """This rank's :class:`LocalRecord` from its flattened state dict; problems collected, not raised.
    ``encode=False`` leaves out what only travels (``names``, ``record``, ``objects_word``).

    ``box_of(fqn, value, cache)`` resolves a tensor's box (default :func:`tensor_box`; the simulation
    passes the boxes of its virtual meshes).
    """
    box_of = box_of or tensor_box
    entries, held, payload, problems = [], {}, {}, []
    sums: list[bytes] = []
    cache: dict = {}
    for fqn, leaf in sorted(leaves.items()):
        v = leaf.value
        if is_tensor(v):
            why = _unstorable(v)
            if why:
                problems.append(f"{fqn!r}: {why}")
                continue
            try:
                box = box_of(fqn, v, cache)
            except ValueError as e:
                problems.append(str(e))
                continue
            if box.local is None:
                continue  # outside the DTensor's mesh: holds nothing
            held[fqn] = (box.offsets, box.lengths)
            payload[fqn] = box.local
            entries.append((fqn, KIND_TENSOR, dtype_name(v.dtype), tuple(box.global_shape)))
        else:
            try:
                data = encode_object(v)
            except ValueError as e:
                problems.append(f"{fqn!r}: {e}")
                continue
            payload[fqn] = data
            entries.append((fqn, KIND_OBJECT, "U8", ()))
            if encode:
                sums.append((fqn, checksum(data)))
    shards = [(i, *held[e[0]]) for i, e in enumerate(entries) if e[1] == KIND_TENSOR]
    rec = LocalRecord(entries, shards, payload, problems)
    if encode:
        rec.encode().objects_word = objects_word(sums)
    return rec


def objects_word(pairs: Sequence[tuple[str, str]]) -> int:
    """The row word of a rank's Python objects: a hash of their (name, checksum) pairs in name order."""
    return hash64("\n".join(f"{n}\0{c}" for n, c in pairs).encode("utf-8", "surrogatepass")) if pairs else 0


def _unstorable(v: torch.Tensor) -> str | None:
    why = source_refusal(v)  # (the kinds of tensor a save refuses: pipeload.plan.tensorkinds)
    if why is not None:
        return why
    if not storable_dtype(v.dtype):
        return f"dtype {v.dtype} has no safetensors name"
    return None


# -- byte formats -------------------------------------------------------------------------------------


def encode_names(entries, width: int) -> bytes:
    """``[n, width]``, then per name ``kind, dtype code, ndim, shape (width)``, the UTF-8 lengths, the text."""
    n = len(entries)
    cols = np.zeros((n, 3 + width), dtype=np.int64)
    text = [e[0].encode("utf-8", "surrogatepass") for e in entries]
    for i, (_, kind, dtype, shape) in enumerate(entries):
        cols[i, :3] = (kind, _CODE[dtype], len(shape))
        cols[i, 3 : 3 + len(shape)] = shape
    head = np.asarray([n, width], dtype=np.int64)
    return b"".join([head.tobytes(), cols.tobytes(), np.asarray([len(t) for t in text], dtype=np.int64).tobytes(),
                     *text])


class Names(NamedTuple):
    names: list[str]
    kind: np.ndarray  # (n,)
    dtype: np.ndarray  # (n,) code into DTYPES
    ndim: np.ndarray  # (n,)
    shape: np.ndarray  # (n, width)


def decode_names(data: bytes) -> Names:
    n, width = (int(x) for x in np.frombuffer(data, dtype=np.int64, count=2))
    cols = np.frombuffer(data, dtype=np.int64, count=n * (3 + width), offset=16).reshape(n, 3 + width)
    at = 16 + cols.nbytes
    lens = np.frombuffer(data, dtype=np.int64, count=n, offset=at).tolist()
    at += 8 * n
    names = []
    for k in lens:
        names.append(bytes(data[at : at + k]).decode("utf-8", "surrogatepass"))
        at += k
    return Names(names, cols[:, 0], cols[:, 1], cols[:, 2], cols[:, 3:])


def encode_shards(shards, width: int) -> bytes:
    """``[n, width, itemsize]``, then the name positions, offsets (n x width), lengths (n x width)."""
    n = len(shards)
    a = np.zeros((n, 1 + 2 * width), dtype=np.int64)
    for i, (pos, off, ln) in enumerate(shards):
        a[i, 0] = pos
        a[i, 1 : 1 + len(off)] = off
        a[i, 1 + width : 1 + width + len(ln)] = ln
    dtype = np.int32 if (a.max() if a.size else 0) <= _I32_MAX else np.int64
    head = np.asarray([n, width, np.dtype(dtype).itemsize], dtype=np.int64)
    return head.tobytes() + a.astype(dtype).tobytes()


def decode_shards(data: bytes, width: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(name positions, offsets, lengths) as int64, the boxes padded to ``width`` columns."""
    n, w, itemsize = (int(x) for x in np.frombuffer(data, dtype=np.int64, count=3))
    a = np.frombuffer(data, dtype=np.int32 if itemsize == 4 else np.int64, offset=24).reshape(n, 1 + 2 * w)
    a = a.astype(np.int64)
    off = np.zeros((n, width), dtype=np.int64)
    ln = np.zeros((n, width), dtype=np.int64)
    off[:, :w] = a[:, 1 : 1 + w]
    ln[:, :w] = a[:, 1 + w :]
    return a[:, 0], off, ln


def _decode_records(records: Sequence[bytes], width: int):
    """(record class, rows): per row of every record, ``name position, offsets, lengths`` (int64, the
    boxes padded to ``width``); the records of one width and integer size are decoded as one array."""
    heads = [np.frombuffer(b, dtype=np.int64, count=3) for b in records]
    n = np.asarray([int(h[0]) for h in heads], dtype=np.int64)
    cl = np.repeat(np.arange(len(records)), n)
    keys = np.zeros((len(cl), 1 + 2 * width), dtype=np.int64)  # name position, offsets, lengths
    start = np.concatenate(([0], np.cumsum(n)))
    kinds: dict[tuple[int, int], list[int]] = {}
    for c, h in enumerate(heads):
        kinds.setdefault((int(h[1]), int(h[2])), []).append(c)
    for (w, itemsize), cs in kinds.items():
        dt = np.int32 if itemsize == 4 else np.int64
        a = np.concatenate([np.frombuffer(records[c], dtype=dt, offset=24) for c in cs]).reshape(-1, 1 + 2 * w)
        rows = np.concatenate([np.arange(start[c], start[c + 1]) for c in cs]) if len(cs) < len(records) else None
        at = slice(None) if rows is None else rows
        keys[at, : 1 + w] = a[:, : 1 + w]
        keys[at, 1 + width : 1 + width + w] = a[:, 1 + w :]
    return cl, keys


def make_row(rec: LocalRecord, problems: bool) -> np.ndarray:
    row = np.zeros(ROW_WORDS, dtype=np.int64)
    row[R_FLAGS] = FLAG_PROBLEMS if problems else 0
    row[R_RECORD : R_RECORD + 2] = rec.class_digest
    row[R_RNBYTES] = len(rec.record)
    row[R_NAMES : R_NAMES + 2] = record_digest(rec.names)
    row[R_NNBYTES] = len(rec.names)
    row[R_OBJECTS] = rec.objects_word
    row[R_KEYOWNER] = key_owner_threshold()
    return row


def _classes_of(rows: np.ndarray, digest: int, nbytes: int) -> Classes:
    """Ranks grouped by the digest at ``digest`` (two words) with sizes at ``nbytes``, through the
    load's :func:`pipeload.plan.exchange.classes` (which reads words 2-3 and 4 of its rows)."""
    view = np.zeros((len(rows), 5), dtype=np.int64)
    view[:, 2:4] = rows[:, digest : digest + 2]
    view[:, 4] = rows[:, nbytes]
    return classes(view)


# -- the exchange -------------------------------------------------------------------------------------


@dataclass
class Exchanged:
    """What every rank holds after the exchange: the rows, both class structures and their bytes."""

    rows: np.ndarray
    record_cls: Classes
    records: list[bytes]
    names_cls: Classes
    tables: list[bytes]


class SaveProblems(Exception):
    """Some rank reported problems: ``failures`` maps rank -> its problem lines (the same on every rank)."""

    def __init__(self, failures: dict[int, list[str]]):
        super().__init__(failures)
        self.failures = failures


def exchange(ex, rec: LocalRecord, problems: list[str], what: str, *, records: bool = True) -> Exchanged:
    """Rows, then (only when a row flags problems) every rank's problems, then the distinct name tables
    and (with ``records``) the distinct shard records. ``ex`` provides ``gather_rows``,
    ``transfer_records`` and ``all_gather_object``. Raises :class:`SaveProblems` on every rank alike when
    any rank has problems."""
    row = make_row(rec, bool(problems))
    rows = ex.gather_rows(row, what)
    if np.any(rows[:, R_FLAGS] & FLAG_PROBLEMS):
        gathered = ex.all_gather_object(problems, what)
        raise SaveProblems({r: p for r, p in enumerate(gathered) if p})
    ncls = _classes_of(rows, R_NAMES, R_NNBYTES)
    tables = ex.transfer_records(record_transfer(ncls, len(rows)), ncls, rec.names, what)
    xc = Exchanged(rows, _classes_of(rows, R_RECORD, R_RNBYTES), [], ncls, tables)
    if records:
        exchange_records(ex, xc, rec, what)
    return xc


def exchange_records(ex, xc: Exchanged, rec: LocalRecord, what: str) -> None:
    """The distinct shard records, each moved once (the digest path; ``xc.records`` is set)."""
    xc.records = ex.transfer_records(record_transfer(xc.record_cls, len(xc.rows)), xc.record_cls, rec.record, what)


# -- the plan -----------------------------------------------------------------------------------------


@dataclass
class Plan:
    """Every rank's view of the save plan (the same decisions on every rank that computes them).

    ``names`` numbers every key of the save (sorted); ``kind``/``dtype``/``ndim``/``shape`` describe
    each. The distinct chunks (``chunk_index``, ``chunk_offsets``, ``chunk_lengths``, ``chunk_weight``)
    are in no particular order (the same on every rank); ``writer`` is each one's writer rank, or -1 outside the components this rank
    computed. ``object_writer`` maps each Python object's key index to its writer. ``loads`` are the
    bytes each rank writes (exact inside the computed components).
    """

    names: list[str]
    kind: np.ndarray
    dtype: np.ndarray
    ndim: np.ndarray
    shape: np.ndarray
    chunk_index: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    chunk_offsets: np.ndarray = field(default_factory=lambda: np.zeros((0, 0), np.int64))
    chunk_lengths: np.ndarray = field(default_factory=lambda: np.zeros((0, 0), np.int64))
    chunk_weight: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    writer: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    object_writer: dict[int, int] = field(default_factory=dict)
    loads: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    problems: list[str] = field(default_factory=list)
    differing_objects: list[int] = field(default_factory=list)  # ranks whose objects differ from their peers'
    alone: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))  # bytes each rank holds alone
    holder_sets: list = field(default_factory=list)  # record classes of each holder set (digest path)

    def dtype_name(self, k: int) -> str:
        return DTYPES[int(self.dtype[k])]

    def shape_of(self, k: int) -> tuple[int, ...]:
        return tuple(self.shape[k, : int(self.ndim[k])].tolist())


def plan(xc: Exchanged, me: int, *, everything: bool = False, key_tables: tuple | None = None) -> Plan:
    """This rank's view of the save plan from the exchanged bytes (see the module docstring).

    ``everything``: writers for every component (for tests and the simulation's whole-plan check);
    ``key_tables``: :func:`key_table`'s result when the caller has it."""
    p, gmap = key_tables if key_tables is not None else key_table(xc)
    p = dataclasses.replace(p, problems=list(p.problems))
    if p.problems:
        return p
    world = len(xc.rows)
    rcls = xc.record_cls
    names_of = xc.names_cls.of_rank[rcls.owners]  # the name table of each record class
    width = p.shape.shape[1]
    cl, keys = _decode_records(xc.records, width)
    flat = np.concatenate(gmap) if gmap else np.zeros(0, np.int64)
    base = np.concatenate(([0], np.cumsum([len(g) for g in gmap])))[:-1].astype(np.int64)
    if len(keys):
        keys[:, 0] = flat[base[names_of[cl]] + keys[:, 0]]  # name positions -> key indices
    index, offsets, lengths = keys[:, 0], keys[:, 1 : 1 + width], keys[:, 1 + width :]
    weights = chunk_weights(p, index, lengths)
    order, starts = _row_groups(keys)
    sizes = np.asarray([len(m) for m in rcls.members], dtype=np.int64)
    holders = np.add.reduceat(sizes[cl[order]], starts) if len(order) else np.zeros(0, np.int64)
    # the groups in the order of their first row (found in one pass, no sort): the gathers below then
    # read the rows in order, and each record's rows arrive in key order
    mark = np.full(len(keys), -1, dtype=np.int64)
    mark[order[starts]] = np.arange(len(starts))
    groups = mark[mark >= 0]
    first = order[starts[groups]]
    fw = weights[first]
    if not np.all(fw > 0):
        keep = _drop_empty(index[first], offsets[first], lengths[first], fw)
        groups, first, fw = groups[keep], first[keep], fw[keep]
    chunks = keys if len(first) == len(keys) else keys[first]  # (all rows distinct: first is every row)
    p.chunk_index, p.chunk_offsets, p.chunk_lengths = chunks[:, 0], chunks[:, 1 : 1 + width], chunks[:, 1 + width :]
    p.chunk_weight = fw
    p.problems = _tiling_problems(p)
    if p.problems:
        return p
    ends = np.append(starts[1:], len(order))
    pool = _object_pool(p, gmap, xc.names_cls)
    p.writer, p.loads, root_of_rank = _writers(p, groups, holders[groups], starts, ends, order, cl, rcls, world,
                                               me, pool, everything)
    p.object_writer = _object_writers(p, gmap, xc.names_cls, pool, root_of_rank)
    p.differing_objects = _differing_objects(xc)
    return p


_ITEMSIZE = np.asarray([dtype_itemsize(d) for d in DTYPES], dtype=np.int64)


def chunk_weights(p: Plan, index: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """Bytes of each chunk (key ``index``, box ``lengths`` padded to the table's width)."""
    nd = p.ndim[index]
    weights = _ITEMSIZE[p.dtype[index]]
    for d in range(lengths.shape[1] if lengths.ndim == 2 else 0):
        weights = weights * np.where(nd > d, lengths[:, d], 1)
    return weights


def key_table(xc: Exchanged) -> tuple[Plan, list[np.ndarray]]:
    """The key table of the save (a :class:`Plan` without chunks, its ``problems`` the tables'
    disagreements) and each distinct name table's map onto it."""
    return _key_table([decode_names(t) for t in xc.tables], xc.names_cls)


def _key_columns(index: np.ndarray, offsets: np.ndarray, lengths: np.ndarray) -> list[np.ndarray]:
    """``np.lexsort`` columns (last primary) for key order: index, then offsets, then lengths."""
    width = offsets.shape[1]
    return [*(lengths[:, k] for k in reversed(range(width))), *(offsets[:, k] for k in reversed(range(width))), index]


def _key_table(tables: list[Names], ncls: Classes) -> tuple[Plan, list[np.ndarray]]:
    """The sorted union of the name tables, each table's map onto it, and the kind/dtype/shape of each
    key; disagreements between tables become problems naming the key and two ranks."""
    union = sorted(set().union(*(t.names for t in tables))) if tables else []
    pos = {n: i for i, n in enumerate(union)}
    width = max((t.shape.shape[1] for t in tables), default=0)
    gmap = [np.fromiter((pos[n] for n in t.names), dtype=np.int64, count=len(t.names)) for t in tables]
    n = len(union)
    cols = []
    for c, t in enumerate(tables):
        a = np.zeros((len(t.names), 5 + width), dtype=np.int64)
        a[:, 0], a[:, 1], a[:, 2], a[:, 3], a[:, 4] = gmap[c], c, t.kind, t.dtype, t.ndim
        a[:, 5 : 5 + t.shape.shape[1]] = t.shape
        cols.append(a)
    allrows = np.concatenate(cols) if cols else np.zeros((0, 5 + width), dtype=np.int64)
    first = np.unique(allrows[:, 0], return_index=True)[1]  # the first row of each key (every key has one)
    ref = allrows[first[allrows[:, 0]]] if len(allrows) else allrows
    p = Plan(union, np.zeros(n, np.int64), np.zeros(n, np.int64), np.zeros(n, np.int64),
             np.zeros((n, width), np.int64))
    if n:
        f = allrows[first]
        p.kind, p.dtype, p.ndim, p.shape = f[:, 2], f[:, 3], f[:, 4], f[:, 5:]
    bad = np.flatnonzero(np.any(allrows[:, 2:] != ref[:, 2:], axis=1))
    for i in bad[:20].tolist():
        k, c, r0 = int(allrows[i, 0]), int(allrows[i, 1]), int(ref[i, 1])
        a, b = int(ncls.owners[c]), int(ncls.owners[r0])
        fqn = union[k]
        if allrows[i, 2] != ref[i, 2]:
            t, o = (b, a) if ref[i, 2] == KIND_TENSOR else (a, b)
            p.problems.append(f"{fqn!r}: a tensor on rank {t} and a Python object on rank {o}")
        else:
            p.problems.append(f"{fqn!r}: rank {a} has dtype {DTYPES[allrows[i, 3]]} shape "
                              f"{allrows[i, 5:5 + allrows[i, 4]].tolist()}, rank {b} {DTYPES[ref[i, 3]]} "
                              f"{ref[i, 5:5 + ref[i, 4]].tolist()}")
    if len(bad) > 20:
        p.problems.append(f"... and {len(bad) - 20} more disagreements")
    return p, gmap


def _drop_empty(index, offsets, lengths, weight) -> np.ndarray:
    """Which distinct chunks are kept: every one with bytes; of a tensor whose chunks are all empty,
    only the first in key order (it records the empty tensor)."""
    keep = weight > 0
    empty = np.flatnonzero(~keep)
    if len(empty):
        has_bytes = np.zeros(int(index.max()) + 1, dtype=bool)
        has_bytes[index[keep]] = True
        cand = empty[~has_bytes[index[empty]]]
        cand = cand[np.lexsort(_key_columns(index[cand], offsets[cand], lengths[cand]))]
        _, firsts = np.unique(index[cand], return_index=True)
        keep[cand[firsts]] = True
    return keep


def _tiling_problems(p: Plan) -> list[str]:
    """The tensors whose distinct chunks do not tile them, each named with the reason.

    Arrays first: every box inside its shape, the volumes summing to the tensor's, and the chunks forming
    a grid (per dim, the distinct intervals partition it, and there are as many chunks as grid cells:
    distinct chunks of a grid are distinct cells, so they tile). A tensor that passes the first two but
    is no grid is checked exactly by :func:`~pipeload.formats.metadata.tiling_problem`.
    """
    idx, off, ln = p.chunk_index, p.chunk_offsets, p.chunk_lengths
    n = len(p.names)
    if not len(idx):
        return []
    nd = p.ndim[idx]
    width = off.shape[1]
    col = np.arange(width)
    real = col[None, :] < nd[:, None]
    inside = np.ones(len(idx), dtype=bool)
    for d in range(width):  # column by column: no (chunks x width) temporaries
        o, m = off[:, d], ln[:, d]
        inside &= ((o >= 0) & (m >= 0) & (o + m <= p.shape[:, d][idx])) | (nd <= d)
    total = _sums(idx, np.prod(np.where(real, ln, 1), axis=1), n)
    numel = np.prod(np.where(col[None, :] < p.ndim[:, None], p.shape, 1), axis=1)
    count = np.bincount(idx, minlength=n)
    cells = np.ones(n, dtype=np.int64)
    grid = np.ones(n, dtype=bool)
    for d in range(width):
        g, c = _grid_dim(idx, off[:, d], ln[:, d], nd > d, p.shape[:, d], n)
        grid &= g | (p.ndim <= d)
        cells *= np.where(p.ndim > d, c, 1)
    bad_inside = np.bincount(idx[~inside], minlength=n) > 0
    tensors = (count > 0) & (p.kind == KIND_TENSOR)
    suspect = np.flatnonzero(tensors & (bad_inside | (total != numel) | ~grid | (cells != count)))
    if not len(suspect):
        return []
    rows = np.flatnonzero(np.isin(idx, suspect))
    rows = rows[np.argsort(idx[rows], kind="stable")]
    bounds = np.searchsorted(idx[rows], np.append(suspect, n))
    problems = []
    for j, k in enumerate(suspect.tolist()):
        r = rows[bounds[j] : bounds[j + 1]]
        d = int(p.ndim[k])
        boxes = [(tuple(a[:d]), tuple(b[:d])) for a, b in zip(off[r].tolist(), ln[r].tolist())]
        why = tiling_problem(p.shape_of(k), boxes)
        if why:
            problems.append(f"{p.names[k]!r}: the ranks' shards {why}")
    return problems


def _grid_dim(idx, off, ln, real, shape, n) -> tuple[np.ndarray, np.ndarray]:
    """Per key: whether the distinct intervals of its chunks along one dim partition ``[0, shape)``, and
    how many there are. ``real``: the chunks whose tensor has this dim. Keys whose chunks all span the
    whole dim (the common case of an unsharded dim) need no sort."""
    grid = np.ones(n, dtype=bool)
    rows = np.flatnonzero(real)
    if not len(rows):
        return grid, np.zeros(n, dtype=np.int64)
    k, o, m = idx[rows], off[rows], ln[rows]
    full = (o == 0) & (m == shape[k])
    partial = np.bincount(k[~full], minlength=n) > 0
    count = (np.bincount(k, minlength=n) > 0).astype(np.int64)  # one interval where all are full
    sel = partial[k]
    k, o, m = k[sel], o[sel], m[sel]
    if not len(k):
        return grid, count
    top_o, top_m = int(o.max()) + 1, int(m.max()) + 1
    if o.min() >= 0 and m.min() >= 0 and n * top_o * top_m < 2**62:  # one packed int64 per interval
        v = np.sort((k * top_o + o) * top_m + m, kind="stable")  # runs of ascending keys: a merge
        k, rest = np.divmod(v, top_o * top_m)
        o, m = np.divmod(rest, top_m)
    else:
        order = np.lexsort((m, o, k))
        k, o, m = k[order], o[order], m[order]
    new = np.concatenate(([True], (k[1:] != k[:-1]) | (o[1:] != o[:-1]) | (m[1:] != m[:-1])))
    k, o, m = k[new], o[new], m[new]  # the distinct intervals, by key then offset
    same = np.concatenate(([False], (k[1:] == k[:-1]) & (o[1:] == o[:-1])))
    grid &= np.bincount(k[same], minlength=n) == 0  # one offset, two lengths: no grid
    run = np.concatenate(([True], k[1:] != k[:-1]))
    ok = np.where(run, o == 0, o == np.concatenate(([0], o[:-1] + m[:-1])))
    grid &= np.bincount(k[~ok], minlength=n) == 0
    grid &= np.where(partial, _sums(k, m, n) == shape, True)
    count[partial] = np.bincount(k, minlength=n)[partial]
    return grid, count


def _sums(keys: np.ndarray, values: np.ndarray, n: int) -> np.ndarray:
    """Per key in ``range(n)``, the exact int64 sum of ``values`` (``np.add.at`` is ~10x slower): by
    ``bincount`` while every partial sum is exact in a double, else by a sort."""
    if not len(keys):
        return np.zeros(n, dtype=np.int64)
    v = values.astype(np.float64)
    if float(np.abs(v).sum()) < 2.0**53:
        return np.rint(np.bincount(keys, weights=v, minlength=n)).astype(np.int64)
    order = np.argsort(keys, kind="stable")
    k, w = keys[order], values[order].astype(np.int64)
    starts = np.flatnonzero(np.concatenate(([True], k[1:] != k[:-1])))
    out = np.zeros(n, dtype=np.int64)
    out[k[starts]] = np.add.reduceat(w, starts)
    return out


def _object_pool(p: Plan, gmap: list[np.ndarray], ncls: Classes) -> np.ndarray:
    """The ranks the Python objects' writer is chosen from: those holding every object, else any holder."""
    objects = p.kind == KIND_OBJECT
    total = int(objects.sum())
    if not total:
        return np.zeros(0, dtype=np.int64)
    held = np.asarray([int(objects[g].sum()) for g in gmap], dtype=np.int64)
    tables = np.flatnonzero(held == total) if np.any(held == total) else np.flatnonzero(held > 0)
    return np.sort(np.concatenate([ncls.members[t] for t in tables.tolist()])).astype(np.int64)


def _holder_sets(starts, ends, order, cl, shared_groups) -> tuple[np.ndarray, list[tuple[int, ...]]]:
    """(set id of each shared group, the record classes of each set): Python touches each distinct set
    once (a set is keyed by its class when it has one, else by two sums of per-class random words)."""
    class_of_row = cl[order]
    s, e = starts[shared_groups], ends[shared_groups]
    n_cls = e - s
    if not len(shared_groups):
        return np.zeros(0, dtype=np.int64), []
    n = int(cl.max()) + 1
    words = _mix(np.arange(2 * n, dtype=np.uint64)).view(np.int64).reshape(2, n)
    with np.errstate(over="ignore"):
        sig = np.stack([np.add.reduceat(words[0][class_of_row], starts)[shared_groups],
                        np.add.reduceat(words[1][class_of_row], starts)[shared_groups], n_cls], axis=1)
    one = n_cls == 1
    sig[one, 0] = class_of_row[s[one]]
    sig[one, 1] = -1
    first, inverse = _unique_rows(sig)
    sets = [tuple(sorted(class_of_row[int(s[g]) : int(e[g])].tolist())) for g in first.tolist()]
    return inverse.ravel().astype(np.int64), sets


def component_roots(sets: Sequence[tuple[int, ...]], n_classes: int) -> np.ndarray:
    """The component root of each record class: classes joined by the holder sets they share
    (union-find; only equality of roots means anything)."""
    parent = list(range(n_classes))

    def find(c: int) -> int:
        while parent[c] != c:
            parent[c] = parent[parent[c]]
            c = parent[c]
        return c

    for classes_ in sets:
        root = find(classes_[0])
        for c in classes_[1:]:
            rc = find(c)
            if rc != root:
                parent[rc] = root
    return np.asarray([find(c) for c in range(n_classes)], dtype=np.int64)


def _writers(p: Plan, groups, holders, starts, ends, order, cl, rcls: Classes, world: int, me: int,
             pool: np.ndarray, everything: bool) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(writer of each distinct chunk, or -1 outside the computed components; bytes per rank; the
    component root of each rank). Components: record classes joined by the holder sets they share."""
    g = len(groups)
    writer = np.full(g, -1, dtype=np.int64)
    single = holders == 1
    first_class = cl[order[starts[groups]]]
    writer[single] = rcls.owners[first_class[single]]
    loads = _sums(writer[single], p.chunk_weight[single], world)
    shared = np.flatnonzero(~single)
    sid, sets = _holder_sets(starts, ends, order, cl, groups[shared])
    p.alone, p.holder_sets = loads.copy(), sets
    root_of_class = component_roots(sets, len(rcls.owners))
    root_of_rank = root_of_class[rcls.of_rank]
    wanted = {int(root_of_rank[me])}
    if len(pool):
        wanted.add(int(root_of_rank[pool[0]]))
    set_ok = np.asarray([everything or int(root_of_class[cs[0]]) in wanted for cs in sets], dtype=bool)
    sel = shared[set_ok[sid]] if len(sets) else shared
    if len(sel):
        w = p.chunk_weight.astype(np.int64)
        sid_all = np.zeros(g, dtype=np.int64)
        sid_all[shared] = sid
        # largest first, ties by key
        greedy = sel[np.lexsort([*_key_columns(p.chunk_index[sel], p.chunk_offsets[sel], p.chunk_lengths[sel]),
                                 -w[sel]])]
        used = np.unique(sid_all[sel]).tolist()
        set_start = np.zeros(len(sets), dtype=np.int64)
        set_size = np.zeros(len(sets), dtype=np.int64)
        members, at = [], 0
        for x in used:
            m = np.sort(np.concatenate([rcls.members[c] for c in sets[x]])).astype(np.int64)
            set_start[x], set_size[x] = at, len(m)
            members.append(m)
            at += len(m)
        reader = assign_readers(greedy.astype(np.int64), w, sid_all, np.zeros(0, dtype=np.int64),
                                np.zeros(len(sets), dtype=np.int64), set_start, set_size,
                                np.concatenate(members), loads)
        writer[sel] = reader[sel]
    return writer, loads, root_of_rank


def _object_writers(p: Plan, gmap, ncls: Classes, pool: np.ndarray, root_of_rank: np.ndarray) -> dict[int, int]:
    """Every Python object's writer: one rank for all of them where it holds them (their file, after
    its tensors): of the pool's ranks in the component of its lowest rank, the one with the fewest bytes
    (ties to the lower rank); an object that rank does not hold goes to its lowest holder."""
    if not len(pool):
        return {}
    cand = pool[root_of_rank[pool] == root_of_rank[pool[0]]]
    target = int(cand[np.lexsort((cand, p.loads[cand]))[0]])
    mine = set(gmap[int(ncls.of_rank[target])].tolist())
    lowest: dict[int, int] = {}
    for t, g in enumerate(gmap):
        owner = int(ncls.owners[t])
        for k in g[p.kind[g] == KIND_OBJECT].tolist():
            if k not in lowest or owner < lowest[k]:
                lowest[k] = owner
    return {k: (target if k in mine else r) for k, r in sorted(lowest.items())}


def _differing_objects(xc: Exchanged) -> list[int]:
    """Two ranks with the same keys whose Python objects differ (their rows' object hashes), or []."""
    words = xc.rows[:, R_OBJECTS]
    pairs = np.column_stack([xc.names_cls.of_rank, words])
    first, inverse = _unique_rows(pairs)
    per_table = np.bincount(pairs[first, 0], minlength=len(xc.names_cls.owners))
    bad = np.flatnonzero(per_table > 1)
    if not len(bad):
        return []
    ranks = np.flatnonzero(xc.names_cls.of_rank == bad[0])
    other = ranks[words[ranks] != words[ranks[0]]]
    return [int(ranks[0]), int(other[0])]


# -- what the commit gathers ------------------------------------------------------------------------


def encode_file_rows(keys, checksums, offsets, lengths, object_keys=(), object_nbytes=(), object_checksums=()) -> bytes:
    """One rank's file as rank 0 needs it for the index: ``[n, m, width]``, then per chunk
    ``key index, checksum, offsets (width), lengths (width)`` and per object ``key index, nbytes,
    checksum`` (int64; a checksum is the 64-bit value of its hex digest, as int64)."""
    offsets = np.asarray(offsets, dtype=np.int64)
    n = len(keys)
    width = offsets.shape[1] if offsets.ndim == 2 else 0
    t = np.zeros((n, 2 + 2 * width), dtype=np.int64)
    t[:, 0], t[:, 1] = keys, checksums
    t[:, 2 : 2 + width] = offsets.reshape(n, width)
    t[:, 2 + width :] = np.asarray(lengths, dtype=np.int64).reshape(n, width)
    o = np.column_stack([np.asarray(x, dtype=np.int64).reshape(-1) for x in (object_keys, object_nbytes, object_checksums)])
    return np.asarray([n, len(o), width], dtype=np.int64).tobytes() + t.tobytes() + o.tobytes()


def checksum_words(hexdigests) -> np.ndarray:
    """Hex checksums as int64 words (their 64-bit values)."""
    return np.asarray([int(h, 16) for h in hexdigests], dtype=np.uint64).view(np.int64)


def decode_file_rows(data: bytes) -> tuple[np.ndarray, np.ndarray]:
    n, m, width = (int(x) for x in np.frombuffer(data, dtype=np.int64, count=3))
    t = np.frombuffer(data, dtype=np.int64, count=n * (2 + 2 * width), offset=24).reshape(n, 2 + 2 * width)
    o = np.frombuffer(data, dtype=np.int64, count=3 * m, offset=24 + t.nbytes).reshape(m, 3)
    return t, o


def index_arrays(table: Plan, per_rank: Sequence[bytes | None], file_of: Callable[[int], str]):
    """Rank 0's commit input from every rank's :func:`encode_file_rows` (``None``/empty: wrote nothing):
    ``(tensor names, {fqn: (dtype, shape)}, files, chunk index arrays, {object fqn: (file, nbytes,
    checksum hex)})``. The arrays are :func:`pipeload.formats.chunkindex.build_arrays`' for the same chunks."""
    tensor_keys = np.flatnonzero(table.kind == KIND_TENSOR)
    tpos = np.full(len(table.names), -1, dtype=np.int64)
    tpos[tensor_keys] = np.arange(len(tensor_keys))
    width = int(table.ndim[tensor_keys].max()) if len(tensor_keys) else 0
    writers = [r for r, b in enumerate(per_rank) if b is not None and len(b) > 24]
    files = sorted(file_of(r) for r in writers)
    file_ix = {f: i for i, f in enumerate(files)}
    ts, fs, objects = [], [], {}
    for r in writers:
        t, o = decode_file_rows(per_rank[r])
        w = (t.shape[1] - 2) // 2
        a = np.zeros((len(t), 2 + 2 * width), dtype=np.int64)
        a[:, :2] = t[:, :2]
        a[:, 2 : 2 + min(w, width)] = t[:, 2 : 2 + min(w, width)]
        a[:, 2 + width : 2 + width + min(w, width)] = t[:, 2 + w : 2 + w + min(w, width)]
        ts.append(a)
        fs.append(np.full(len(t), file_ix[file_of(r)], dtype=np.int32))
        for k, nbytes, csum in o.tolist():
            objects[table.names[k]] = (file_of(r), int(nbytes), f"{csum & ((1 << 64) - 1):016x}")
    rows = np.concatenate(ts) if ts else np.zeros((0, 2 + 2 * width), dtype=np.int64)
    cfile = np.concatenate(fs) if fs else np.zeros(0, dtype=np.int32)
    tp = tpos[rows[:, 0]]
    off, ln = rows[:, 2 : 2 + width], rows[:, 2 + width :]
    order = np.lexsort([*(off[:, k] for k in reversed(range(width))), tp])
    tp, off, ln, cfile, csum = tp[order], off[order], ln[order], cfile[order], rows[order, 1]
    n = len(tensor_keys)
    count = np.bincount(tp, minlength=n)
    max_rows = np.zeros(n, dtype=np.int64)
    if width:
        has_rows = table.ndim[tensor_keys][tp] > 0
        np.maximum.at(max_rows, tp[has_rows], ln[has_rows, 0])
    arrays = {
        "shape": np.ascontiguousarray(table.shape[tensor_keys][:, :width]),
        "chunk_start": np.concatenate(([0], np.cumsum(count))).astype(np.int64),
        "max_rows": max_rows,
        "chunk_offsets": np.ascontiguousarray(off),
        "chunk_lengths": np.ascontiguousarray(ln),
        "chunk_file": cfile.astype(np.int32),
        "chunk_checksum": csum.view(np.uint64),
    }
    names = [table.names[k] for k in tensor_keys.tolist()]
    tensors = {table.names[k]: (table.dtype_name(k), table.shape_of(k)) for k in tensor_keys.tolist()}
    return names, tensors, files, arrays, objects
