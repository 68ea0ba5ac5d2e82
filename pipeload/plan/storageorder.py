"""Readers by storage position: for checkpoints no rank of the load wrote (Hugging Face files), and by
runs of each holder set's bytes for loads whose boxes cut stored chunks in any other layout.

A layout written by the ranks of a job names the writer of each file, and its load prefers that rank
as reader (the *affinity* of :mod:`pipeload.plan.globalplan`). Files written by another tool name no
rank, and the greedy alone then hands neighbouring tensors to different ranks: each rank reads
thousands of scattered ranges, every range boundary that falls inside a page is read from storage by
two ranks, and no rank can start reading before the whole plan is known.

Here the checkpoint's bytes, laid end to end (data files in the order the metadata lists them, the
chunks of a file in the order their bytes begin in it — recorded from each file's header; key order
where nothing is recorded, the order ``safetensors`` writes a file of one dtype in), are cut into
``W`` equal *regions*, one per rank of the load group, and each shard's affinity is the rank whose
region holds its first byte. The plan honours it as it honours a named writer (only a holder, within
11/10 of its component's mean), so each rank reads mostly one contiguous run of the files, and what a
rank needs from its own region it will read itself: it may ask storage for those bytes while the plan
is still being made (:func:`speculative`).

A pure function of the metadata every rank holds and the shard's box: replicas of one box compute the
same affinity, so their exchange records stay identical. ``O(C)`` for the ``C`` stored chunks, once
per metadata, then ``O(n)`` vectorised for the ``n`` boxes of a rank.

A layout some rank wrote (pipeload's own, DCP's) loaded into another one names writers whose files no
longer hold the boxes whole; a holder set then gets pieces of several files. There the same storage
order decides after the exchange, per holder set (:func:`runs`): the set's rows by the position of
their first byte (:func:`box_starts`, which places boxes of tensors stored in several chunks too), cut
into one run per member. ``O(n log n)`` for the ``n`` shared rows of a rank's component.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from ..formats.chunks import dtype_itemsize


class _Order(NamedTuple):
    """A metadata's storage order, computed once per metadata (kept on it)."""

    pos: np.ndarray  # per chunk row: its first byte's position
    total: int  # the checkpoint's tensor bytes
    itemsize: np.ndarray  # per tensor row
    ndim: np.ndarray  # per tensor row
    whole: np.ndarray  # per tensor row: its one chunk's row when that chunk is the whole tensor, else -1


def _order(md) -> _Order | None:
    if not md.indexed:
        return None
    cached = getattr(md, "_storage_order", None)
    if cached is not None:
        return cached
    t = md.tensors
    a = t.index.a
    start = a["chunk_start"]
    n_chunks = int(start[-1]) if len(start) else 0
    tensor_of = np.repeat(np.arange(len(start) - 1), np.diff(start))
    width = a["chunk_lengths"].shape[1] if a["chunk_lengths"].ndim == 2 else 0
    ndim = np.asarray(t.ndims, dtype=np.int64)
    nd = ndim[tensor_of]
    lens = a["chunk_lengths"].astype(np.int64, copy=False)
    numel = (np.prod(np.where(np.arange(width)[None, :] < nd[:, None], lens, 1), axis=1) if width
             else np.ones(n_chunks, np.int64))
    itemsize = np.fromiter((dtype_itemsize(d) for d in t.dtypes), dtype=np.int64, count=len(t.dtypes))
    nbytes = numel * itemsize[tensor_of]
    # by file, then where each chunk begins in it (a Hugging Face file records it), else key order
    inside = getattr(md, "storage_pos", None)
    order = np.lexsort((inside if inside is not None else np.arange(n_chunks), a["chunk_file"]))
    pos = np.empty(n_chunks, dtype=np.int64)
    pos[order] = np.cumsum(nbytes[order]) - nbytes[order]
    whole = np.asarray(t.index.whole_rows(), dtype=np.int64)
    out = md._storage_order = _Order(pos, int(nbytes.sum()), itemsize, ndim, whole)
    return out


MIN_CHUNKS_PER_REGION = 16
"""Readers go by position only when the stored chunks are at least this many per rank on average. With
fewer, a region is a tensor or two and its rank is chosen by where one tensor starts, which buys
nothing; and on a 7.5 MiB two-file checkpoint of 6 tensors at 4 ranks the device bytes then varied from
load to load (1.005 to, once in a dozen loads, over 1.05 of the unique bytes) where the greedy alone
read 1.005 in every load (a timing effect whose cause was not found)."""


def applies(md, world: int) -> bool:
    """Whether a load of ``world`` ranks from ``md`` prefers readers by storage position: an index, two or
    more ranks, and :data:`MIN_CHUNKS_PER_REGION` chunks per rank. Alike on every rank (the metadata's)."""
    o = _order(md) if world > 1 else None
    return o is not None and o.total > 0 and len(o.pos) >= MIN_CHUNKS_PER_REGION * world


def chunk_positions(md) -> tuple[np.ndarray, int] | None:
    """(position of each stored chunk's first byte in the storage order, the checkpoint's tensor bytes),
    chunk rows as in the metadata's index; None when the metadata has no index (format 1)."""
    o = _order(md)
    return None if o is None else (o.pos, o.total)


class _Boxes(NamedTuple):
    chunk: np.ndarray  # storage position of the box's tensor's one chunk, -1: several chunks
    first: np.ndarray  # bytes from there to the box's first byte
    rowwise: np.ndarray  # the box is one contiguous run of its chunk: a range of rows
    tensor_bytes: np.ndarray
    total: int


def _box_positions(md, fqns: list[str], offsets: np.ndarray, lengths: np.ndarray) -> _Boxes:
    """Where each box (tensor ``fqns[j]``, zero-padded ``offsets[j]``/``lengths[j]``) lies in the storage order."""
    o = _order(md)
    t = md.tensors
    a = t.index.a
    rows = np.fromiter((t.pos[f] for f in fqns), dtype=np.int64, count=len(fqns))
    one = o.whole[rows]  # the tensor's one whole chunk, or -1
    shape = a["shape"][rows].astype(np.int64, copy=False)
    nd = o.ndim[rows]
    w = min(offsets.shape[1], shape.shape[1]) if offsets.ndim == 2 else 0
    first = np.zeros(len(rows), dtype=np.int64)  # row-major index of the box's first element
    stride = np.ones(len(rows), dtype=np.int64)
    rowwise = np.ones(len(rows), dtype=bool)
    for d in reversed(range(w)):
        real = nd > d
        first += np.where(real, offsets[:, d] * stride, 0)
        stride *= np.where(real, shape[:, d], 1)
        if d:
            rowwise &= ~real | (lengths[:, d] == shape[:, d])
    itemsize = o.itemsize[rows]
    chunk = np.where(one >= 0, o.pos[np.maximum(one, 0)], -1) if len(o.pos) else np.full(len(rows), -1)
    return _Boxes(chunk, first * itemsize, rowwise, stride * itemsize, o.total)


def affinities(md, fqns: list[str], offsets: np.ndarray, lengths: np.ndarray, world: int) -> np.ndarray | None:
    """Per box (tensor ``fqns[j]``, ``offsets[j]``/``lengths[j]`` zero-padded), the load-group rank whose
    region holds its first byte — a box strided across its chunk (not a range of rows), its chunk's first
    byte: such a chunk is read whole, as a unit — or -1 (a tensor stored in several chunks: no position
    is taken for it). None: readers do not go by position here (:func:`applies`)."""
    if not len(fqns) or not applies(md, world):
        return None
    b = _box_positions(md, fqns, offsets, lengths)
    at = b.chunk + np.where(b.rowwise, b.first, 0)
    return np.where(b.chunk >= 0, np.minimum(world - 1, at * world // b.total), -1)


def speculative(plan, md, world: int, rank: int, budget: int) -> list:
    """The shards of a local plan this rank may ask storage for before the plan is made: affinity this
    rank (a box strided across its chunk has its chunk's, and the chunk, a unit, is read whole by that
    rank), small against the region and in its first half (the plan honours an affinity within a
    balance cap: a region crowded by a few large shards, or its tail, may go to others), in storage
    order — the order of this rank's first broadcasts —, at most ``budget`` bytes. None when the region
    is under four budgets: a small checkpoint gains nothing from it (measured: up to 8 % more device
    bytes on a 7.8 MB one)."""
    mine = [j for j, s in enumerate(plan.shards) if s.affinity == rank]
    if not mine or plan.boxes is None or len(plan.boxes[0]) != len(plan.shards):
        return []
    idx = np.asarray(mine)
    b = _box_positions(md, [plan.shards[j].fqn for j in mine], plan.boxes[0][idx], plan.boxes[1][idx])
    region = max(1, -(-b.total // world))
    if region < 4 * budget:
        return []
    at = np.where(b.chunk >= 0, b.chunk + b.first, -1)
    # what storage serves for it: the box, or the whole chunk a strided box's unit reads
    cost = np.where(b.rowwise, np.fromiter((plan.shards[j].nbytes for j in mine), dtype=np.int64, count=len(mine)),
                    b.tensor_bytes)
    keep = (cost <= region // 16) & (at >= 0) & (at - rank * region < region // 2)
    out, used = [], 0
    for k in np.flatnonzero(keep)[np.argsort(at[keep], kind="stable")].tolist():
        if used + int(cost[k]) > budget:
            break
        out.append(plan.shards[mine[k]])
        used += int(cost[k])
    return out


def place(plan, md, world: int) -> None:
    """Give each shard of a local plan the affinity of its storage position (:func:`affinities`)."""
    if plan.boxes is None or len(plan.boxes[0]) != len(plan.shards):
        return
    found = affinities(md, [s.fqn for s in plan.shards], *plan.boxes, world)
    if found is not None:
        for s, a in zip(plan.shards, found.tolist()):
            s.affinity = a


def key_positions(md, names: list[str], world: int) -> tuple[np.ndarray, np.ndarray, int] | None:
    """Per checkpoint key (``names``, index order): the storage position of its tensor's one whole chunk
    (-1: not one whole chunk, or an object) and the bytes of one of its rows; and the checkpoint's
    tensor bytes. None: readers do not go by position in a load of ``world`` ranks (:func:`applies`)."""
    if not applies(md, world):
        return None
    o = _order(md)
    pos, total = o.pos, o.total
    t = md.tensors
    a = t.index.a
    rows = np.fromiter((t.pos.get(x, -1) for x in names), dtype=np.int64, count=len(names))
    r = np.maximum(rows, 0)
    one = np.where(rows >= 0, o.whole[r], -1) if len(o.whole) else np.full(len(names), -1)
    whole = one >= 0
    at = np.where(whole, pos[np.maximum(one, 0)] if len(pos) else 0, -1)
    shape = a["shape"].astype(np.int64, copy=False)
    nd, itemsize = o.ndim, o.itemsize
    width = shape.shape[1] if shape.ndim == 2 else 0
    inner = (np.prod(np.where((np.arange(width)[None, :] >= 1) & (np.arange(width)[None, :] < nd[:, None]), shape, 1),
                     axis=1) if width else np.ones(len(nd), dtype=np.int64)) * itemsize
    return at, np.where(whole, inner[r], 0), total


def interleaved(p_keys, cols: tuple, positions: tuple, world: int) -> tuple:
    """``(p_keys, *cols)`` re-sorted so that readers advance through their regions together.

    With readers preferred by position, key order (the storage order of a Hugging Face file) would
    hand the first quarter of the broadcasts to the first region's rank, the next to the next: one
    rank reading at a time. Sorted by (offset of the piece inside its region, key) instead, the k-th
    megabyte of every region comes before the (k+1)-th of any, so every reader reads all the time. A
    pure function of the piece key and the metadata: every rank orders the pieces it shares alike.
    """
    if not p_keys:
        return (p_keys, *cols)
    start, row_bytes, total = positions
    region = max(1, -(-total // max(1, world)))
    last = region  # pieces of tensors without a position: after every region's bytes, in key order
    keyed = []
    for j, k in enumerate(p_keys):
        i = k[0] if k[0] >= 0 else -1 - k[0]
        at = int(start[i]) if i < len(start) else -1
        if at >= 0:
            at = (at + (k[1][0] * int(row_bytes[i]) if k[1] else 0)) % region
        keyed.append((at if at >= 0 else last, k, j))
    keyed.sort()
    order = [j for _, _, j in keyed]
    return ([p_keys[j] for j in order], *(np.asarray(c)[order] for c in cols))


# -- runs of holder sets: loads whose boxes cut stored chunks, in any layout --------------------------


def box_starts(md, names: list[str]):
    """A function ``at(index, offsets, lengths) -> positions``: for rows of the global plan (checkpoint key
    index, a unit row's ``-1 - index``; zero-padded offsets and lengths), the storage position of the
    row's first byte — in the stored chunk holding the box's first element, the chunk's position plus
    that element's row-major offset in it. -1 where no chunk holds it. None: the metadata has no index.

    Unlike :func:`key_positions` this places boxes of tensors stored in several chunks (a save at TP 4
    loaded at TP 2: a box's first byte is in the first of the chunks it spans). A pure function of the
    metadata and the row: every rank of a component computes the same positions."""
    o = _order(md)
    if o is None or not len(o.pos):
        return None
    t = md.tensors
    a = t.index.a
    trow = np.fromiter((t.pos.get(x, -1) for x in names), dtype=np.int64, count=len(names))
    cstart = a["chunk_start"].astype(np.int64, copy=False)
    c_off = a["chunk_offsets"].astype(np.int64, copy=False)
    c_len = a["chunk_lengths"].astype(np.int64, copy=False)

    def at(index: np.ndarray, offsets: np.ndarray, lengths: np.ndarray) -> np.ndarray:
        out = np.full(len(index), -1, dtype=np.int64)
        if not len(index):
            return out
        key = np.where(index < 0, -1 - index, index)
        rows = np.where((key >= 0) & (key < len(trow)), trow[np.clip(key, 0, max(0, len(trow) - 1))], -1)
        ok = rows >= 0
        r = np.maximum(rows, 0)
        lo, n = cstart[r], np.where(ok, cstart[r + 1] - cstart[r], 0)
        j = np.repeat(np.arange(len(index)), n)  # (row, chunk) pairs: a tensor's chunks are few
        c = np.repeat(lo, n) + np.arange(int(n.sum())) - np.repeat(np.cumsum(n) - n, n)
        nd = o.ndim[r][j]
        w = min(offsets.shape[1] if offsets.ndim == 2 else 0, c_off.shape[1] if c_off.ndim == 2 else 0)
        off = offsets[j, :w].astype(np.int64) if w else np.zeros((len(j), 0), dtype=np.int64)
        hit = np.ones(len(j), dtype=bool)
        first = np.zeros(len(j), dtype=np.int64)
        stride = np.ones(len(j), dtype=np.int64)
        for d in reversed(range(w)):
            real = nd > d
            inside = (off[:, d] >= c_off[c, d]) & (off[:, d] < c_off[c, d] + c_len[c, d])
            hit &= ~real | inside
            first += np.where(real, (off[:, d] - c_off[c, d]) * stride, 0)
            stride *= np.where(real, c_len[c, d], 1)
        j, c, first = j[hit], c[hit], first[hit]
        # the first chunk holding the box's first element (chunks of a tensor do not overlap: one)
        keep = np.unique(j, return_index=True)[1]
        out[j[keep]] = o.pos[c[keep]] + first[keep] * o.itemsize[r[j[keep]]]
        return out

    return at


def runs(sid: np.ndarray, weight: np.ndarray, at: np.ndarray, keycols: list[np.ndarray], members: dict,
         loads: np.ndarray, fill) -> tuple[np.ndarray, np.ndarray]:
    """(the member whose run holds each row, the row's byte offset inside that run): readers by storage
    position inside each holder set.

    A load whose boxes cut stored chunks gives each holder set pieces of every file; the greedy hands
    neighbours on storage to different members, and every page where two readers meet is read from
    storage by both. Here each set's rows, in storage order (``at``; ties and rows without a position by
    key, ``keycols`` as for ``np.lexsort``), form one stream cut into one run per member (``members[s]``,
    ascending), sized by ``fill`` (water filling over the members' ``loads``): each member reads one
    contiguous run of the set's bytes. Rows are never cut (a row goes to the run holding its middle).
    The result is the rows' affinity, honoured as a named writer's is. A pure function of the rows."""
    n = len(sid)
    prefer = np.full(n, -1, dtype=np.int64)
    offset = np.zeros(n, dtype=np.int64)
    if not n:
        return prefer, offset
    big = np.iinfo(np.int64).max
    order = np.lexsort([*keycols, np.where(at >= 0, at, big), sid])
    s_sorted = sid[order]
    cuts = np.flatnonzero(np.diff(s_sorted)) + 1
    for lo, hi in zip([0, *cuts.tolist()], [*cuts.tolist(), n]):
        rows = order[lo:hi]
        m = np.asarray(members[int(s_sorted[lo])], dtype=np.int64)
        w = weight[rows].astype(np.int64, copy=False)
        before = np.cumsum(w) - w
        sizes = np.asarray(fill(loads[m], int(w.sum())), dtype=np.int64)
        ends = np.cumsum(sizes)
        k = np.minimum(np.searchsorted(ends, before + w // 2, side="right"), len(m) - 1)
        prefer[rows] = m[k]
        offset[rows] = np.maximum(0, before - (ends[k] - sizes[k]))  # (a row astride two runs: its start)
    return prefer, offset
