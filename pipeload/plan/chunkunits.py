"""Chunk units: a stored chunk that several record classes need different parts of, read once.

A shard (one box) several ranks hold is read once and broadcast (:mod:`pipeload.plan.globalplan`). When
classes hold *different* boxes cut from one stored chunk — whole tensors of a Hugging Face checkpoint
loaded into tensor parallelism with ``Shard(1)``, a checkpoint saved at TP 1 loaded at TP 2 — each box's
bytes lie strided across the whole chunk, and every class would read (or fault in) the whole span. A
*unit* is such a chunk: one rank reads it as one contiguous range and broadcasts it to every rank that
needs any part of it; each copies its boxes out of the received buffer.

A pure function of gathered data, like every other decision of the plan: the distinct records (shard
keys), the exchange rows and the checkpoint's chunk table (which every rank holds). Rules:

- a chunk is a unit when two or more distinct shard keys touch it, the bytes reading each key's part
  would cost (the span from its first to its last byte inside the chunk: what a strided box fetches
  from an object or faults in from a file) exceed the chunk's bytes, at least two ranks need it and
  every holder reported its part broadcastable. Otherwise the parts are cheaper (``Shard(0)`` row
  blocks are contiguous: each is one shard, read once and broadcast to its own holders, fewer bytes on
  the wire for the same bytes from storage);
- its *holder set* is the union of the classes whose keys touch it (every rank that needs any part);
  a unit whose set has no usable group (or, under the host-aware policy, sits on one host) is not a
  unit: its parts are planned as before;
- a key that touches a unit chunk is not shared as a shard: its bytes from unit chunks arrive through
  the units, the rest (other chunks no unit covers) is read privately by each holder;
- a unit is a row of the shared table like a shard, keyed ``(-1 - fqn index, chunk offsets, chunk
  lengths)`` (a negative index: no shard key collides with it), so the reader greedy, stream cutting
  (a cut unit is a row range of the chunk: still contiguous on storage), batching and the one global
  order treat it as they treat shards.

Nothing is computed when no row carries :data:`pipeload.plan.exchange.FLAG_RESHARDED` (every box of
every rank is exactly one stored chunk: a load in the layout it was saved in) — then no two distinct
keys can touch one chunk. Otherwise the cost is one vectorised exact-chunk search over the keys of the
flagged classes and an overlap test of the keys of the tensors they reshard against those tensors'
chunks (``O(keys x chunks per tensor)``, numpy).
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

MAX_PAIRS = 1 << 24  # (key, chunk) overlap candidates past which no unit is planned (the parts still load)


def encode(index: np.ndarray) -> np.ndarray:
    """The fqn-index column of unit rows: ``-1 - index`` (never a shard key's)."""
    return -1 - np.asarray(index, dtype=np.int64)


def is_unit(key: tuple) -> bool:
    return key[0] < 0


def unit_index(key: tuple) -> int:
    """The checkpoint key index of a unit (or unit piece) key."""
    return -1 - key[0]


class ChunkTable(NamedTuple):
    """The checkpoint's stored chunks by checkpoint key index, as the plan needs them: chunk rows
    ``start[k]:end[k]`` of key ``k``, their offsets and lengths (C x width, zero-padded)."""

    start: np.ndarray
    end: np.ndarray
    offsets: np.ndarray
    lengths: np.ndarray


def chunk_table(md, names: list[str]) -> ChunkTable:
    """The :class:`ChunkTable` of metadata ``md`` for the checkpoint keys ``names`` (index order).

    Format 2 (also every foreign layout, decoded into its table): views of the mapped chunk index, no
    chunk decoded. Format 1: built from the parsed chunks."""
    n = len(names)
    start, end = np.zeros(n, dtype=np.int64), np.zeros(n, dtype=np.int64)
    if md.indexed:
        t = md.tensors
        pos = np.fromiter((t.pos.get(x, -1) for x in names), dtype=np.int64, count=n)
        have = pos >= 0
        cs = t.index.a["chunk_start"]
        start[have], end[have] = cs[pos[have]], cs[pos[have] + 1]
        return ChunkTable(start, end, t.index.a["chunk_offsets"], t.index.a["chunk_lengths"])
    width = md.width()
    offs, lens, at = [], [], 0
    for k, x in enumerate(names):
        m = md.tensors.get(x)
        if m is None:
            continue
        start[k] = at
        for c in m.chunks:
            offs.append((*c.offsets, *(0,) * (width - len(c.offsets))))
            lens.append((*c.lengths, *(0,) * (width - len(c.lengths))))
        at += len(m.chunks)
        end[k] = at
    return ChunkTable(start, end, np.asarray(offs, dtype=np.int64).reshape(-1, width),
                      np.asarray(lens, dtype=np.int64).reshape(-1, width))


class Touch(NamedTuple):
    """Unit chunks and the key groups touching them, before holder sets are known."""

    chunk: np.ndarray  # (U,) chunk row of each unit, ascending
    index: np.ndarray  # (U,) its checkpoint key index
    offsets: np.ndarray  # (U, table width) the chunk's offsets and lengths
    lengths: np.ndarray
    classes: list[tuple[int, ...]]  # (U,) the classes needing part of it, ascending
    pair_group: np.ndarray  # key group of each (group, unit) pair
    pair_unit: np.ndarray  # unit (position in ``chunk``) of each pair
    row: np.ndarray  # (U,) the first shard row of the first key group touching it (its affinity is the unit's)


def _pairs(table: ChunkTable, groups: np.ndarray, idx: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(group, chunk row) of every chunk of each group's key."""
    n = table.end[idx] - table.start[idx]
    g = np.repeat(groups, n)
    starts = np.repeat(table.start[idx], n)
    first = np.repeat(np.cumsum(n) - n, n)
    return g, starts + np.arange(int(n.sum())) - first


def _spans(off: np.ndarray, ln: np.ndarray, c_off: np.ndarray, c_ln: np.ndarray, nd: np.ndarray,
           itemsize: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per (box, chunk) pair: whether they overlap, the bytes of the chunk's span holding the overlap
    (first to last byte, row-major) and the chunk's bytes."""
    width = off.shape[1]
    hit = np.ones(len(off), dtype=bool)
    first = np.zeros(len(off), dtype=np.int64)
    last = np.zeros(len(off), dtype=np.int64)
    stride = np.ones(len(off), dtype=np.int64)
    for d in reversed(range(width)):
        real = nd > d
        lo = np.maximum(off[:, d], c_off[:, d])
        hi = np.minimum(off[:, d] + ln[:, d], c_off[:, d] + c_ln[:, d])
        hit &= ~real | (hi > lo)
        first += np.where(real, (lo - c_off[:, d]) * stride, 0)
        last += np.where(real, (hi - 1 - c_off[:, d]) * stride, 0)
        stride *= np.where(real, c_ln[:, d], 1)
    return hit, (last - first + 1) * itemsize, stride * itemsize


def find_units(order: np.ndarray, starts: np.ndarray, ends: np.ndarray, cl: np.ndarray, index: np.ndarray,
               offsets: np.ndarray, lengths: np.ndarray, nd: np.ndarray, bc: np.ndarray, flagged: np.ndarray,
               sizes: np.ndarray, itemsize: np.ndarray, table: ChunkTable) -> Touch | None:
    """The unit chunks (module docstring) of the key groups ``order[starts[g]:ends[g]]`` (rows of the
    shard columns ``cl``, ``index``, ... ; ``bc``: every holder of the group broadcastable), considering
    the tensors some group with a row of a ``flagged`` class (per class) holds. None: no unit."""
    fr = order[starts]
    g_flag = np.logical_or.reduceat(flagged[cl[order]], starts) if len(order) else np.zeros(0, dtype=bool)
    keyed = (nd[fr] > 0) & (index[fr] < len(table.start))
    tensors = np.unique(index[fr[g_flag & keyed]])
    if not len(tensors):
        return None
    groups = np.flatnonzero(keyed & np.isin(index[fr], tensors))
    n = table.end[index[fr[groups]]] - table.start[index[fr[groups]]]
    if int(n.sum()) > MAX_PAIRS:
        return None
    g, c = _pairs(table, groups, index[fr[groups]])
    r = fr[g]
    w = min(offsets.shape[1], table.offsets.shape[1])
    hit, span, whole = _spans(offsets[r, :w].astype(np.int64), lengths[r, :w].astype(np.int64),
                              table.offsets[c, :w], table.lengths[c, :w], nd[r], itemsize[index[r]])
    g, c, span, whole = g[hit], c[hit], span[hit], whole[hit]
    chunks, inv = np.unique(c, return_inverse=True)
    inv = inv.ravel()
    n_keys = np.bincount(inv, minlength=len(chunks))
    spans = np.bincount(inv, weights=span, minlength=len(chunks))
    size = np.zeros(len(chunks), dtype=np.int64)
    size[inv] = whole
    all_bc = np.bincount(inv, weights=~bc[g], minlength=len(chunks)) == 0
    unit = (n_keys >= 2) & (spans > size) & all_bc
    if not unit.any():
        return None
    pos = np.full(len(chunks), -1, dtype=np.int64)
    pos[unit] = np.arange(int(unit.sum()))
    keep = pos[inv] >= 0
    pg, pu = g[keep], pos[inv[keep]]
    classes = _classes_of(pg, pu, int(unit.sum()), order, starts, ends, cl)
    ranks = np.array([int(sizes[list(k)].sum()) for k in classes], dtype=np.int64)
    many = ranks >= 2
    if not many.all():
        renum = np.cumsum(many) - 1
        sel = many[pu]
        pg, pu = pg[sel], renum[pu[sel]]
        classes = [k for k, m in zip(classes, many.tolist()) if m]
        if not classes:
            return None
    uc = chunks[unit][many]
    first_group = np.zeros(len(uc), dtype=np.int64)
    first_group[pu] = pg
    return Touch(uc, index[fr[first_group]].astype(np.int64), table.offsets[uc], table.lengths[uc], classes, pg, pu,
                 fr[first_group])


def _classes_of(pg, pu, n_units, order, starts, ends, cl) -> list[tuple[int, ...]]:
    """Per unit, the ascending classes of the rows of the groups touching it."""
    n = (ends - starts)[pg]
    rows = np.repeat(starts[pg], n) + np.arange(int(n.sum())) - np.repeat(np.cumsum(n) - n, n)
    pairs = np.unique(np.column_stack([np.repeat(pu, n), cl[order[rows]]]), axis=0)
    cut = np.searchsorted(pairs[:, 0], np.arange(n_units + 1))
    cls = pairs[:, 1].tolist()
    return [tuple(cls[a:b]) for a, b in zip(cut[:-1].tolist(), cut[1:].tolist())]
