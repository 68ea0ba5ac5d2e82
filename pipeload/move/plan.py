"""Who sends which region to whom: holders of source boxes against needers of destination boxes.

Pure functions over int64 words (no torch.distributed), so :mod:`pipeload.tools.simtransfer` runs
exactly this code for thousands of simulated ranks. One transfer's planning, on every rank of its group:

1. :func:`encode` (each rank alone): one *record* per source box it holds and per destination box it
   needs — ``[kind, name hash, dtype, ndim, local index, flags, shape, offsets, lengths]`` padded to
   the group's widest rank ``nd`` — each addressed to the *owner* of its name (:func:`owner_of`, a hash
   of the name modulo the group size). One all-to-all delivers them.
2. :func:`answer` (each owner alone, for the names it owns): every holder and every needer of each of
   its names, so it checks them against one another (the global shape, the dtype, that the sources
   cover every destination byte) and cuts each destination box into *pieces*, one per source box it
   meets. Each piece gets a sender: the needer itself when it holds the source box (a local copy),
   else one of the box's holders, chosen by the balanced greedy — heaviest piece first, to the holder
   with the fewest bytes so far, holders visited from a rotation of the name's hash so that owners
   that each see few names do not all start at the lowest rank. One more all-to-all returns to every
   rank exactly its own sends, receives, local copies and the problems found with its boxes.
3. :func:`decode` (each rank alone): its answers as :class:`Op` lists, in the one global order —
   ``(hop, name hash, receiver, destination index, offsets)``, a key both ends of a piece compute alike
   (:mod:`pipeload.move.mover` explains why that order cannot deadlock).

Each destination byte is sent once per needer; nothing is assembled whole. When several needers want
the same region (engine replicas) and the holders are few against them, the owner may *relay* it
instead (:func:`relays`, a cost model over the group's counts of source and destination ranks): the
holders send it to some needers in hop 0, and in each later hop every rank that has it sends it to one
more, so no holder sends more than one copy a hop. Hops go first in the global order, and a rank posts
a hop's messages only once the earlier ones it posted completed, so a relay forwards only bytes it
holds and the order's argument is unchanged.

Two flags serve a memory tier's restore (:mod:`pipeload.tier.reshard`), whose sources are stored
chunks: a source flagged :data:`F_NEEDED` makes a name no destination asks for a problem, reported to
its lowest holder (``strict``); a destination flagged :data:`F_ROW` asks for one whole source box whose
size only the holders know — a Python object, the row of its name's table that a saved rank's file
holds — and learns the size from the answer's lengths (:func:`_rows`).

Cost per rank: its own records out (``O(S)`` words) and one answer row back per piece it sends or
receives, plus, on an owner, ``O(holders + needers + pieces)`` of the names it owns, in numpy (the
greedy runs as a water-filling per run of equal pieces, Python steps per piece and holder only in runs
of at most :data:`SCALAR_STEPS` of them; a relayed fan is assigned per fan), with ``O(log)`` candidate
search per destination box along dim 0 — never ``W x S``. The names whose every destination lies whole
inside one source box (a same-layout transfer, a finer TP, from single holders or from replicas: DP /
HSDP, a tier's replicated files) are answered together in one numpy pass (:func:`_direct`); where a box
has several holders, the greedy's picks come from one loop in name order (:func:`_choose`): scalar
steps, a piece and a holder at a time, or one water-filling per long run of equal pieces: numpy calls per
long run, not per name. The rest (destinations cut by several source boxes, relayed fans, :data:`F_ROW`, problems) are
planned one name at a time (:func:`_plan_name`, ~0.15-0.2 ms of numpy calls a name); the rows are the
same, in the same order, either way.

A rank's pieces are what its layout makes them: a destination row block meets every source shard of its
rows, so sources sharded finer than the destinations multiply them (``docs/SCALE.md``, "Live
transfers"). Distinct source boxes of one name must not overlap (every DTensor layout partitions its
tensor, replicas repeat a box exactly); an owner that finds overlap reports it instead of guessing.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

SRC, DST = 0, 1
HEAD = 6
K_KIND, K_NAME, K_DTYPE, K_NDIM, K_INDEX, K_FLAGS = range(HEAD)
F_CAST = 1  # a destination's flag: its dtype may differ from the source's (the sender casts)
F_NEEDED = 2  # a source's flag: a name no destination asks for is a problem (reported to its lowest holder)
F_ROW = 4  # a destination's flag: it takes one whole source box, whose size only its holders know (see below)

SEND, RECV, LOCAL, ERROR = range(4)
HOP_SHIFT = 8  # an answer's kind word: kind | hop << HOP_SHIFT (hop 0: from a holder; later: a relay)
AHEAD = 7
A_KIND, A_NAME, A_PEER, A_SRC, A_DST, A_DTYPE, A_NDIM = range(AHEAD)

# problems an owner reports to a destination's rank (A_PEER carries the code, A_DST the index)
E_MISSING, E_SHAPE, E_DTYPE, E_UNCOVERED, E_OVERLAP, E_CONFLICT, E_UNUSED = range(1, 8)
PROBLEMS = {
    E_MISSING: "no rank of the group holds a source tensor of this name",
    E_SHAPE: "its global shape differs from the source's",
    E_DTYPE: "its dtype differs from the source's (pass cast=True to convert)",
    E_UNCOVERED: "part of its region is held by no source rank",
    E_OVERLAP: "the sources hold overlapping boxes that differ (not one layout)",
    E_CONFLICT: "the source ranks disagree on its global shape or dtype",
    E_UNUSED: "no rank of the group needs it",
}
_MASK = np.uint64((1 << 63) - 1)
# bytes per element of each dtype code (``pipeload.move.run.DTYPES``' order): the greedy balances the
# bytes each sender puts on the wire, in the destination's dtype (a cast happens on the sender)
ITEMSIZES = np.array([4, 2, 2, 8, 8, 4, 2, 1, 1, 1, 1, 1, 8, 2, 4, 8, 16], dtype=np.int64)


# a run of equal pieces of one box whose pieces x holders exceed this takes its senders from the
# water-filling's numpy calls (:func:`_water_fill`, ~15 calls), a smaller one in scalar steps (~0.15 us each)
SCALAR_STEPS = 128

_TRUE = np.ones(1, dtype=bool)
_ZERO = np.zeros(1, dtype=np.int64)


def _offsets(n: np.ndarray) -> np.ndarray:
    """``[0, n0, n0 + n1, ...]`` (``np.r_[0, np.cumsum(n)]``, without ``np.r_``'s cost per call: an owner
    makes a few calls per name)."""
    return np.concatenate((_ZERO, np.cumsum(n, dtype=np.int64)))


def _bounds(changed: np.ndarray) -> np.ndarray:
    """Where each run of equal neighbours starts, and the end: ``changed[i]`` says item ``i + 1`` differs
    from item ``i``."""
    return np.flatnonzero(np.concatenate((_TRUE, changed, _TRUE)))


def width(nd: int) -> int:
    return HEAD + 3 * nd


def answer_width(nd: int) -> int:
    return AHEAD + 2 * nd


def owner_of(names: np.ndarray, size: int) -> np.ndarray:
    """The rank that plans each name hash: the same on every rank."""
    return ((np.asarray(names, dtype=np.int64).view(np.uint64) & _MASK) % np.uint64(size)).astype(np.int64)


class Box(NamedTuple):
    """One side's box: ``index`` is its position in the rank's own list (how answers name it)."""

    name: int
    dtype: int
    shape: tuple[int, ...]
    offsets: tuple[int, ...]
    lengths: tuple[int, ...]
    flags: int = 0


def encode(sources: list[Box], dests: list[Box], nd: int, size: int) -> tuple[np.ndarray, np.ndarray]:
    """(words per owner rank, the records in owner order, flat) for one all-to-all."""
    return by_owner(records(sources, dests, nd), size)


def records(sources: list[Box], dests: list[Box], nd: int) -> np.ndarray:
    """One record per box (``width(nd)`` words), sources then destinations, each in its list's order."""
    rec = np.zeros((len(sources) + len(dests), width(nd)), dtype=np.int64)
    _fill(rec, 0, SRC, sources, nd)
    _fill(rec, len(sources), DST, dests, nd)
    return rec


def widen(rec: np.ndarray, nd: int, to: int) -> np.ndarray:
    """Records of tensor rank ``nd`` padded to ``to`` (the group's widest)."""
    if to == nd:
        return rec
    out = np.zeros((len(rec), width(to)), dtype=np.int64)
    out[:, :HEAD] = rec[:, :HEAD]
    for j in range(3):
        out[:, HEAD + j * to: HEAD + j * to + nd] = rec[:, HEAD + j * nd: HEAD + (j + 1) * nd]
    return out


def by_owner(rec: np.ndarray, size: int) -> tuple[np.ndarray, np.ndarray]:
    """(words per owner rank, ``rec`` in owner order, flat), each owner's records in their order."""
    owners = owner_of(rec[:, K_NAME], size)
    order = np.argsort(owners, kind="stable")
    return np.bincount(owners, minlength=size) * rec.shape[1], rec[order].ravel()


def _fill(rec: np.ndarray, base: int, kind: int, boxes: list[Box], nd: int) -> None:
    """Rows ``base ..`` of ``rec``: the records of ``boxes`` (their index: their position), per tensor rank."""
    if not boxes:
        return
    ndims = np.array([len(b[2]) for b in boxes], dtype=np.int64)
    for n in np.unique(ndims).tolist():
        at = np.flatnonzero(ndims == n)
        sel = boxes if len(at) == len(boxes) else [boxes[i] for i in at.tolist()]
        head = np.array([(b[0], b[1], b[5]) for b in sel], dtype=np.int64).reshape(-1, 3)  # name, dtype, flags
        geo = np.array([(*b[2], *b[3], *b[4]) for b in sel], dtype=np.int64).reshape(len(sel), 3 * n)
        rows = rec[base + at[0]: base + at[-1] + 1] if len(at) == at[-1] - at[0] + 1 else None
        block = np.zeros((len(sel), rec.shape[1]), dtype=np.int64)
        block[:, K_KIND], block[:, K_NAME], block[:, K_DTYPE] = kind, head[:, 0], head[:, 1]
        block[:, K_NDIM], block[:, K_INDEX], block[:, K_FLAGS] = n, at, head[:, 2]
        block[:, HEAD: HEAD + n] = geo[:, :n]
        block[:, HEAD + nd: HEAD + nd + n] = geo[:, n: 2 * n]
        block[:, HEAD + 2 * nd: HEAD + 2 * nd + n] = geo[:, 2 * n:]
        if rows is not None:
            rows[:] = block
        else:
            rec[base + at] = block


def answer(counts: np.ndarray, words: np.ndarray, nd: int, size: int,
           sides: tuple[int, int] | None = None, direct: bool = True) -> tuple[np.ndarray, np.ndarray]:
    """An owner's answers to the records it received (``counts`` words from each rank, in rank order):
    (words per destination rank, the answers in rank order, flat), for the second all-to-all.
    ``sides``: (ranks holding sources, ranks holding destinations) in the group, for :func:`relays`;
    None: never relay. ``direct``: False plans every name through :func:`_plan_name` (the reference the
    vectorised pass of :func:`_direct` is tested against); the answers are the same words either way."""
    w = width(nd)
    rec = np.asarray(words, dtype=np.int64).reshape(-1, w)
    ranks = np.repeat(np.arange(len(counts), dtype=np.int64), np.asarray(counts) // w)
    out: list[np.ndarray] = []
    if len(rec):
        # by name, kind, index, rank: the records arrive by rank, which the stable sort keeps among ties
        order = np.lexsort((rec[:, K_INDEX], rec[:, K_KIND], rec[:, K_NAME]))
        rec, ranks = rec[order], ranks[order]
        starts = _bounds(rec[1:, K_NAME] != rec[:-1, K_NAME])
        out = _plan_names(rec, ranks, starts, nd, size, sides, direct)
    return _by_destination(out, nd, size)


def _plan_names(rec: np.ndarray, ranks: np.ndarray, starts: np.ndarray, nd: int, size: int, sides,
                direct: bool) -> list[np.ndarray]:
    """Every name's answer blocks in name order: the names :func:`_direct` answers, as slices of its rows,
    between the others, each planned by :func:`_plan_name`. ``loads`` (bytes each rank sends so far,
    over this owner's names) is built up in name order, as the loop over every name would: the sends of
    direct names with no choice are added in bulk before the next name that looks at the loads; a
    direct name with a choice of sender picks its senders (:func:`_choose`) when its turn comes, and a
    name planned alone sees the loads of every name before it. So every sender, every row, and its place
    among a destination rank's rows, is the loop's."""
    loads = np.zeros(size, dtype=np.int64)
    d = _direct(rec, ranks, starts, nd, sides) if direct else _no_direct(len(starts) - 1, nd)
    c = d.choices
    cuts = _bounds(c.nid[1:] != c.nid[:-1]) if len(c.nid) else _ZERO
    turns = np.concatenate((d.slow, c.nid[cuts[:-1]]))  # the names that look at the loads, by name
    zero = np.zeros(len(d.slow), np.int64)
    a, b = np.concatenate((zero, cuts[:-1])), np.concatenate((zero, cuts[1:]))  # a turn's pieces to choose
    by = np.argsort(turns, kind="stable")
    turns, a, b = turns[by], a[by], b[by]
    sent = np.searchsorted(d.load_name, turns)  # the sends with no choice before each turn
    runs = (c.holders.rank, c.holders.rank.tolist(), np.diff(c.start).tolist(), c.h0.tolist(), c.count.tolist(),
            c.wire.tolist())
    rot = (rec[starts[:-1], K_NAME].view(np.uint64) % np.uint64(1 << 31)).astype(np.int64)[turns].tolist()
    pick: list[int] = []
    out: list[np.ndarray] = []
    prev, x = 0, 0
    for s, p, q, y, r in zip(turns.tolist(), a.tolist(), b.tolist(), sent.tolist(), rot):
        if y > x:
            np.add.at(loads, d.load_rank[x:y], d.load_bytes[x:y])
            x = y
        if q > p:
            _choose(loads, runs, r, range(p, q), pick)
            continue
        if d.at[s] > d.at[prev]:
            out.append(d.rows[d.at[prev]: d.at[s]])
        out.extend(_plan_name(rec[starts[s]: starts[s + 1]], ranks[starts[s]: starts[s + 1]], nd, loads, sides))
        prev = s + 1
    if len(d.rows) > d.at[prev]:
        out.append(d.rows[d.at[prev]:])
    _chosen(d.rows, c, np.array(pick, dtype=np.int64))
    return out


def _by_destination(blocks: list[np.ndarray], nd: int, size: int) -> tuple[np.ndarray, np.ndarray]:
    """(words per destination rank, the answers by destination rank, flat) from blocks of
    ``[destination rank, *answer]`` rows; a rank's answers keep the blocks' order. Each block is moved
    into its place and dropped (no concatenated copy of every row: a busy owner's answers are tens of MB)."""
    aw = answer_width(nd)
    dest = np.concatenate([b[:, 0] for b in blocks]) if blocks else np.zeros(0, np.int64)
    order = np.argsort(dest.astype(np.uint16) if size <= 1 << 16 else dest, kind="stable")  # (a radix sort)
    at = np.empty(len(order), np.int64)
    at[order] = np.arange(len(order))
    words = np.empty((len(order), aw), dtype=np.int64)
    a = 0
    for i, b in enumerate(blocks):
        words[at[a: a + len(b)]] = b[:, 1:]
        a += len(b)
        blocks[i] = None
    return np.bincount(dest, minlength=size) * aw, words.ravel()


class _Side(NamedTuple):
    ranks: np.ndarray
    index: np.ndarray
    dtype: np.ndarray
    flags: np.ndarray
    shape: np.ndarray  # n x nd
    off: np.ndarray
    len: np.ndarray


def _side(rec: np.ndarray, ranks: np.ndarray, nd: int, ndim: int) -> _Side:
    s = slice(HEAD, HEAD + ndim)
    return _Side(ranks, rec[:, K_INDEX], rec[:, K_DTYPE], rec[:, K_FLAGS], rec[:, s],
                 rec[:, HEAD + nd: HEAD + nd + ndim], rec[:, HEAD + 2 * nd: HEAD + 2 * nd + ndim])


def _plan_name(rec: np.ndarray, ranks: np.ndarray, nd: int, loads: np.ndarray, sides=None) -> list[np.ndarray]:
    """Every answer row about one name, as ``[destination rank, *answer words]``."""
    name = int(rec[0, K_NAME])
    is_src = rec[:, K_KIND] == SRC
    if not np.any(~is_src):
        return _unused(name, rec, ranks, nd)  # a source nobody needs
    dst_rec, dst_ranks = rec[~is_src], ranks[~is_src]
    if not np.any(is_src):
        return [_errors(name, dst_ranks, dst_rec[:, K_INDEX], E_MISSING, nd)]
    src_rec = rec[is_src]
    ndim = int(src_rec[0, K_NDIM])
    head = src_rec[:, [K_NDIM, K_DTYPE] + list(range(HEAD, HEAD + nd))]
    if np.any(head != head[0]):
        return [_errors(name, dst_ranks, dst_rec[:, K_INDEX], E_CONFLICT, nd)]
    src = _side(src_rec, ranks[is_src], nd, ndim)
    out, ok = _check_dests(name, dst_rec, dst_ranks, src_rec[0], nd)
    if not np.any(ok):
        return out
    dst = _side(dst_rec[ok], dst_ranks[ok], nd, ndim)
    boxes, holders = _distinct(src)
    shape = src.shape[0]
    if np.prod(boxes[:, 1], axis=1, dtype=np.int64).sum() > np.prod(shape, dtype=np.int64) or \
            not _disjoint(boxes):
        return out + [_errors(name, dst.ranks, dst.index, E_OVERLAP, nd)]
    if np.any(dst.flags & F_ROW):
        dst = _rows(dst, boxes)
    out.append(_pieces(name, dst, boxes, holders, src_rec[0, K_DTYPE], nd, ndim, loads, sides))
    return out


def _unused(name: int, rec: np.ndarray, ranks: np.ndarray, nd: int) -> list[np.ndarray]:
    """A name only sources hold: nothing, unless a holder flagged it :data:`F_NEEDED` (a restore's
    ``strict``): then one problem row to the lowest such holder, naming its source as ``-1 - index``."""
    needed = np.flatnonzero(rec[:, K_FLAGS] & F_NEEDED)
    if not len(needed):
        return []
    i = needed[np.argmin(ranks[needed])]
    return [_errors(name, ranks[i: i + 1], -1 - rec[i: i + 1, K_INDEX], E_UNUSED, nd)]


def _rows(dst: _Side, boxes: np.ndarray) -> _Side:
    """The :data:`F_ROW` destinations' regions: the distinct source box whose first offset is the
    destination's rank when there is one, else the first (boxes are sorted by offsets). What a memory
    tier's object is: a row ``(saved rank, 0)`` of lengths ``(1, its bytes)`` of a name's table, so a
    rank takes its own saved rank's value where the saved world had its rank, else the lowest's, and
    learns the size from the answer's lengths."""
    row = (dst.flags & F_ROW) != 0
    first = boxes[:, 0, 0]
    at = np.minimum(np.searchsorted(first, dst.ranks[row]), len(first) - 1)
    pick = np.where(first[at] == dst.ranks[row], at, 0)
    off, ln = dst.off.copy(), dst.len.copy()
    off[row], ln[row] = boxes[pick, 0], boxes[pick, 1]
    return dst._replace(off=off, len=ln)


def _check_dests(name: int, dst_rec: np.ndarray, dst_ranks: np.ndarray, src0: np.ndarray, nd: int):
    """(error rows, mask of the destinations that match the source's rank, shape and dtype)."""
    ndim = int(src0[K_NDIM])
    shape_ok = (dst_rec[:, K_NDIM] == ndim) & np.all(dst_rec[:, HEAD: HEAD + nd] == src0[HEAD: HEAD + nd], axis=1)
    dtype_ok = (dst_rec[:, K_DTYPE] == src0[K_DTYPE]) | ((dst_rec[:, K_FLAGS] & F_CAST) != 0)
    out = []
    bad = ~shape_ok
    if np.any(bad):
        out.append(_errors(name, dst_ranks[bad], dst_rec[bad, K_INDEX], E_SHAPE, nd))
    bad = shape_ok & ~dtype_ok
    if np.any(bad):
        out.append(_errors(name, dst_ranks[bad], dst_rec[bad, K_INDEX], E_DTYPE, nd))
    return out, shape_ok & dtype_ok


class _Holders(NamedTuple):
    """The holders of each distinct source box: ``rank[start[k]:start[k + 1]]`` (ascending) and their
    indices into their own sources."""

    rank: np.ndarray
    index: np.ndarray
    start: np.ndarray

    def reordered(self, order: np.ndarray) -> "_Holders":
        """The same holders, box ``k`` of the result being box ``order[k]``."""
        n = np.diff(self.start)[order]
        start = _offsets(n)
        at = np.arange(int(start[-1])) - np.repeat(start[:-1], n) + np.repeat(self.start[order], n)
        return _Holders(self.rank[at], self.index[at], start)


def _distinct(src: _Side) -> tuple[np.ndarray, _Holders]:
    """(distinct source boxes ``k x 2 x ndim`` sorted by offsets then lengths, their holders sorted by
    rank)."""
    key = np.concatenate([src.off, src.len], axis=1)
    by = np.lexsort(key.T[::-1]) if key.shape[1] else np.arange(len(key))  # (np.unique's row order)
    new = np.concatenate((_TRUE, np.any(key[by][1:] != key[by][:-1], axis=1)))
    uniq = key[by][new]
    inv = np.empty(len(key), np.int64)
    inv[by] = np.cumsum(new) - 1
    ndim = src.off.shape[1]
    order = np.lexsort((src.ranks, inv))
    start = np.searchsorted(inv[order], np.arange(len(uniq) + 1))
    holders = _Holders(src.ranks[order], src.index[order], start)
    boxes = np.stack([uniq[:, :ndim], uniq[:, ndim:]], axis=1) if ndim else np.zeros((len(uniq), 2, 0), np.int64)
    return boxes, holders


def _disjoint(boxes: np.ndarray) -> bool:
    """Whether no two distinct boxes overlap (checked along dim 0 between neighbours, then exactly
    among the few that share dim-0 rows: a TP ``Shard(1)`` layout has all its boxes on the same rows)."""
    if len(boxes) < 2 or boxes.shape[2] == 0:
        return len(boxes) < 2
    lo, hi = boxes[:, 0, 0], boxes[:, 0, 0] + boxes[:, 1, 0]
    order = np.argsort(lo, kind="stable")
    lo, hi = lo[order], hi[order]
    if np.all(lo[1:] >= np.maximum.accumulate(hi)[:-1]):
        return True
    b = boxes[order]
    for i in range(len(b)):
        j = i + 1
        while j < len(b) and lo[j] < hi[i]:
            if _meets(b[i], b[j]):
                return False
            j += 1
    return True


def _meets(a: np.ndarray, b: np.ndarray) -> bool:
    return bool(np.all(np.maximum(a[0], b[0]) < np.minimum(a[0] + a[1], b[0] + b[1])))


def _pieces(name: int, dst: _Side, boxes: np.ndarray, holders: _Holders, src_dtype: int, nd: int, ndim: int,
            loads: np.ndarray, sides=None) -> np.ndarray:
    """Each destination box cut by the source boxes it meets, each piece given a sender."""
    lo0 = boxes[:, 0, 0] if ndim else np.zeros(len(boxes), np.int64)
    order = np.argsort(lo0, kind="stable")
    boxes, holders, lo0 = boxes[order], holders.reordered(order), lo0[order]
    n_dst = len(dst.ranks)
    if ndim:  # the boxes a destination may meet along dim 0: from the first reaching past its start
        reach = np.maximum.accumulate(lo0 + boxes[:, 1, 0])
        a = np.searchsorted(reach, dst.off[:, 0], "right")
        b = np.searchsorted(lo0, dst.off[:, 0] + dst.len[:, 0], "left")
    else:
        a, b = np.zeros(n_dst, np.int64), np.full(n_dst, len(boxes), np.int64)
    cnt = np.maximum(b - a, 0)
    first = _offsets(cnt)
    i = np.repeat(np.arange(n_dst), cnt)  # candidate pairs (destination, box), by destination then box
    k = np.repeat(a, cnt) + np.arange(int(first[-1])) - np.repeat(first[:-1], cnt)
    lo = np.maximum(boxes[k, 0], dst.off[i])
    hi = np.minimum(boxes[k, 0] + boxes[k, 1], dst.off[i] + dst.len[i])
    keep = np.all(hi > lo, axis=1)
    i, k, o, n = i[keep], k[keep], lo[keep], (hi - lo)[keep]
    size = np.prod(n, axis=1, dtype=np.int64)
    got = _offsets(size)[np.searchsorted(i, np.arange(n_dst + 1))]
    uncovered = np.flatnonzero(np.diff(got) != np.prod(dst.len, axis=1, dtype=np.int64))
    if len(uncovered):
        ok = ~np.isin(i, uncovered)
        i, k, o, n, size = i[ok], k[ok], o[ok], n[ok], size[ok]
    wire = size * ITEMSIZES[dst.dtype[i]]
    rows = _assign(name, dst, _Cand(i, k, o, n, wire), holders, nd, ndim, loads, sides)
    if len(uncovered):
        rows = np.concatenate([rows, _errors(name, dst.ranks[uncovered], dst.index[uncovered], E_UNCOVERED, nd)])
    return rows


class _Cand(NamedTuple):
    """The pieces of one name, by destination then box: destination row, box, region, its bytes on the
    wire (elements x the destination dtype's size: what the greedy balances)."""

    dst: np.ndarray
    box: np.ndarray
    off: np.ndarray
    len: np.ndarray
    size: np.ndarray


def _assign(name: int, dst: _Side, c: _Cand, holders: _Holders, nd: int, ndim: int, loads: np.ndarray,
            sides=None) -> np.ndarray:
    """Answer rows for the pieces ``c``, heaviest first: a local copy where the needer holds the box, else
    a send from the holder the greedy picks (or, for a fan :func:`relays` relays, from the fan's hops)
    and the matching receive."""
    order = np.argsort(-c.size, kind="stable")  # heaviest first, then in candidate order
    receiver = dst.ranks[c.dst[order]]
    mine = _own_index(holders, c.box, dst.ranks[c.dst])[order]
    local = mine >= 0
    rot = int(np.uint64(np.int64(name).view(np.uint64)) % np.uint64(1 << 31))
    fans = _fans(c, dst, order, local, holders, sides)
    greedy = ~local
    for fan in fans:
        greedy[fan] = False
    remote = order[greedy]
    pick = (_greedy if _disjoint_holders(holders) else _greedy_sequential)(remote, c.box, c.size, holders, loads, rot)
    sender = np.full(len(order), -1, np.int64)
    sender[greedy] = holders.rank[pick]
    source = mine.copy()
    source[greedy] = holders.index[pick]
    hop = np.zeros(len(order), np.int64)
    for fan in fans:
        _relay(fan, order, c, dst, holders, loads, rot, sender, source, hop)
    # per piece in that order: its send (or local copy) row, then, for a send, the receive row
    pairs = None if np.any(local) else np.zeros((2 * len(order), answer_width(nd) + 1), dtype=np.int64)
    first = pairs[0::2] if pairs is not None else np.zeros((len(order), answer_width(nd) + 1), dtype=np.int64)
    first[:, 0] = np.where(local, receiver, sender)
    first[:, 1 + A_KIND] = np.where(local, LOCAL, SEND | hop << HOP_SHIFT)
    first[:, 1 + A_NAME] = name
    first[:, 1 + A_PEER] = receiver
    first[:, 1 + A_SRC] = source
    first[:, 1 + A_DST] = dst.index[c.dst[order]]
    first[:, 1 + A_DTYPE] = dst.dtype[c.dst[order]]
    first[:, 1 + A_NDIM] = ndim
    first[:, 1 + AHEAD: 1 + AHEAD + ndim] = c.off[order]
    first[:, 1 + AHEAD + nd: 1 + AHEAD + nd + ndim] = c.len[order]
    if pairs is not None:
        second = pairs[1::2]
        second[:] = first
    else:
        second = first[~local]
    second[:, 0] = receiver[~local]
    second[:, 1 + A_KIND] = RECV | hop[~local] << HOP_SHIFT
    second[:, 1 + A_PEER] = sender[~local]
    if pairs is not None:
        return pairs
    at = _offsets(np.where(local, 1, 2))
    rows = np.empty((int(at[-1]), first.shape[1]), dtype=np.int64)
    rows[at[:-1]] = first
    rows[at[:-1][~local] + 1] = second
    return rows


def relays(needers: int, holders: int, sides: tuple[int, int] | None) -> bool:
    """Whether a region ``needers`` ranks want alike, ``holders`` ranks hold, goes through relays.

    The cost model, per byte of such regions if every region were alike, with ``T`` ranks holding
    sources and ``D`` holding destinations: sent straight, the holders send ``needers`` copies spread
    over ``T`` ranks and the needers receive them spread over ``D``: ``max(N/T, N/D)``. Relayed, each
    hop has every rank that has it send one copy — the holders at most ``H/T`` of it, the receivers at
    most ``N/D`` — and ``ceil(log2(N/H + 1))`` hops serve every needer: ``hops * max(H/T, N/D)``.
    Relays win where the needers far outnumber the holders (many engine replicas, few trainer ranks),
    and never where ``D <= T``: then the straight cost is ``N/D``, and a relayed one is at least that
    (``hops >= 1``, and ``H/T > N/D`` only makes it larger)."""
    if sides is None or needers < 2:
        return False
    t, d = max(1, sides[0]), max(1, sides[1])
    n, h = needers, max(1, holders)
    hops = int(np.ceil(np.log2(n / h + 1)))
    return hops * max(h / t, n / d) < max(n / t, n / d)


def _fans(c: _Cand, dst: _Side, order: np.ndarray, local: np.ndarray, holders: _Holders, sides) -> list[np.ndarray]:
    """The fans to relay: positions (in ``order``) of the remote pieces that several needers want alike
    (the same box, region and destination dtype), by receiver rank, for each fan :func:`relays` relays."""
    if sides is None or max(1, sides[1]) <= max(1, sides[0]):
        return []  # no more destination ranks than source ranks: relays never pay (:func:`relays`)
    at = np.flatnonzero(~local)
    if len(at) < 2:
        return []
    p = order[at]
    key = np.column_stack([c.box[p], c.off[p], c.len[p], dst.dtype[c.dst[p]]])
    _, inv, count = np.unique(key, axis=0, return_inverse=True, return_counts=True)
    inv = inv.ravel()
    out = []
    for g in np.flatnonzero(count > 1).tolist():
        members = at[inv == g]
        k = int(c.box[order[members[0]]])
        if relays(len(members), int(holders.start[k + 1] - holders.start[k]), sides):
            by = np.lexsort((dst.index[c.dst[order[members]]], dst.ranks[c.dst[order[members]]]))
            out.append(members[by])
    return out


def _relay(fan: np.ndarray, order: np.ndarray, c: _Cand, dst: _Side, holders: _Holders, loads: np.ndarray,
           rot: int, sender: np.ndarray, source: np.ndarray, hop: np.ndarray) -> None:
    """One fan in hops: hop ``h`` has every rank that holds the region by then (the box's holders from
    the name's rotation, then the needers served, in that order) send it to the next needer. A relay's
    source index is its own destination's, as ``-1 - index`` (it forwards what it received)."""
    k = int(c.box[order[fan[0]]])
    h0, h1 = int(holders.start[k]), int(holders.start[k + 1])
    turn = (np.arange(h1 - h0) + rot) % (h1 - h0)
    have = [(int(holders.rank[h0 + j]), int(holders.index[h0 + j])) for j in turn.tolist()]
    todo, step, size = fan.tolist(), 0, int(c.size[order[fan[0]]])
    while todo:
        served = []
        for rank, index in list(have):
            if not todo:
                break
            q = todo.pop(0)
            sender[q], source[q], hop[q] = rank, index, step
            loads[rank] += size
            d = c.dst[order[q]]
            served.append((int(dst.ranks[d]), -1 - int(dst.index[d])))
        have += served
        step += 1


def _own_index(holders: _Holders, box: np.ndarray, receiver: np.ndarray) -> np.ndarray:
    """Per piece, the receiver's own index of the box when it holds it (its first listing), else -1."""
    if not len(box):
        return np.zeros(0, np.int64)
    span = int(max(holders.rank.max(initial=0), receiver.max())) + 1
    hbox = np.repeat(np.arange(len(holders.start) - 1), np.diff(holders.start))
    key = hbox * span + holders.rank  # ascending: boxes in order, each box's holders by rank
    want = box * span + receiver
    at = np.searchsorted(key, want)
    hit = at < len(key)
    hit[hit] = key[at[hit]] == want[hit]
    return np.where(hit, holders.index[np.minimum(at, len(key) - 1)], -1)


def _disjoint_holders(holders: _Holders) -> bool:
    """Whether no rank holds two distinct boxes of the name (true of every DTensor layout)."""
    return len(holders.rank) < 2 or int(np.bincount(holders.rank).max()) == 1


def _greedy(pieces: np.ndarray, box: np.ndarray, size: np.ndarray, holders: _Holders, loads: np.ndarray,
            rot: int) -> np.ndarray:
    """The holder (a position in ``holders``) that sends each of ``pieces`` (heaviest first): the least
    loaded of its box's holders, ties to the first from the name's rotation. Loads are updated.

    No rank holds two of the name's boxes, so each box's pieces go to its own holders alone, in their
    order; a run of equal pieces is the run's water-filling: its j-th piece goes to the holder of the
    j-th smallest ``(load + t * size, rotated position)``, t = 0, 1, ... (what the sequential greedy picks).
    """
    out = np.zeros(len(pieces), np.int64)
    if not len(pieces):
        return out
    pb = box[pieces]
    single = np.diff(holders.start)[pb] == 1
    if np.any(single):  # one holder: no choice
        out[single] = holders.start[pb[single]]
        np.add.at(loads, holders.rank[out[single]], size[pieces[single]])
    many = np.flatnonzero(~single)
    if not len(many):
        return out
    by_box = many[np.argsort(pb[many], kind="stable")]
    bounds = _bounds(pb[by_box][1:] != pb[by_box][:-1])
    for x, y in zip(bounds[:-1].tolist(), bounds[1:].tolist()):
        run = by_box[x:y]
        k = int(pb[run[0]])
        h0, h1 = int(holders.start[k]), int(holders.start[k + 1])
        rank = holders.rank[h0:h1]
        pos = (np.arange(h1 - h0) - rot % (h1 - h0)) % (h1 - h0)
        w = size[pieces[run]]
        cuts = _bounds(w[1:] != w[:-1])
        for u, v in zip(cuts[:-1].tolist(), cuts[1:].tolist()):
            pick = _water_fill(loads[rank], pos, int(w[u]), v - u)
            out[run[u:v]] = h0 + pick
            loads[rank] += np.bincount(pick, minlength=h1 - h0) * int(w[u])
    return out


def _water_fill(load: np.ndarray, pos: np.ndarray, w: int, m: int) -> np.ndarray:
    """The holders (indices into ``load``) that ``m`` pieces of ``w`` bytes go to, one by one to the
    least loaded, ties to the lowest ``pos``: the order of ``(load + t * w, pos)`` over t = 0, 1, ....

    The m-th smallest value lies in the first *level* ``l`` (values ``base + l * w .. base + l * w + w - 1``,
    ``base`` the least load) that holds it: a holder of load level ``a`` (``(load - base) // w``) has
    ``l - a + 1`` values up to level ``l``, so the ``k`` lowest levels reach ``m`` values from level
    ``ceil((m + their sum) / k) - 1`` on, if that is at or past the k-th lowest; the first level is the
    least such over ``k`` (each is reached, the true one among them). Its values, sorted, are the order."""
    base = int(load.min())
    a = np.sort((load - base) // w)
    k = np.arange(1, len(a) + 1)
    level = int(np.maximum(a, -(-(m + np.cumsum(a)) // k) - 1).min())
    n = np.maximum(0, level - (load - base) // w + 1)  # each holder's values up to that level's end
    hold = np.repeat(np.arange(len(load)), n)
    value = load[hold] + (np.arange(int(n.sum())) - np.repeat(_offsets(n)[:-1], n)) * w
    return hold[np.lexsort((pos[hold], value))[:m]]


def _greedy_sequential(pieces: np.ndarray, box: np.ndarray, size: np.ndarray, holders: _Holders,
                       loads: np.ndarray, rot: int) -> np.ndarray:
    """:func:`_greedy` one piece at a time (holders shared between boxes)."""
    out = np.zeros(len(pieces), np.int64)
    for j, p in enumerate(pieces.tolist()):
        h0, h1 = int(holders.start[box[p]]), int(holders.start[box[p] + 1])
        rank = holders.rank[h0:h1]
        pos = (np.arange(h1 - h0) - rot % (h1 - h0)) % (h1 - h0)
        best = int(np.lexsort((pos, loads[rank]))[0])
        out[j] = h0 + best
        loads[rank[best]] += int(size[p])
    return out


class _Choices(NamedTuple):
    """The remote pieces of the direct names that have a choice of sender, in *runs*: pieces that the
    greedy takes one after another, of one box and as many bytes each. Run ``r``: of name ``nid[r]``,
    its pieces' send rows ``row[start[r]:start[r + 1]]`` (each receive row follows its send), ``wire[r]``
    bytes a piece, its box's holders ``holders.rank[h0[r]:h0[r] + |count[r]|]`` (by rank, then index;
    ``count`` negative where a rank lists the box twice)."""

    nid: np.ndarray
    start: np.ndarray
    h0: np.ndarray
    count: np.ndarray
    wire: np.ndarray
    row: np.ndarray
    holders: _Holders


class _Direct(NamedTuple):
    """The names :func:`_direct` answers at once. ``slow``: the positions of the others, ascending; the
    direct names' rows (``[destination rank, *answer]``) in name order, name ``k``'s at
    ``rows[at[k]:at[k + 1]]``; the sends of those with no choice of sender, by name ascending: name,
    sender, bytes; the pieces of the others, whose senders :func:`_plan_names` chooses."""

    slow: np.ndarray
    rows: np.ndarray
    at: np.ndarray
    load_name: np.ndarray
    load_rank: np.ndarray
    load_bytes: np.ndarray
    choices: _Choices


def _no_direct(n: int, nd: int) -> _Direct:
    """Every one of ``n`` names left to :func:`_plan_name` (``answer(direct=False)``)."""
    none = np.zeros(0, np.int64)
    return _Direct(np.arange(n), np.zeros((0, answer_width(nd) + 1), np.int64), np.zeros(n + 1, np.int64),
                   none, none, none, _Choices(none, _ZERO, none, none, none, none, _Holders(none, none, _ZERO)))


def _choose(loads: np.ndarray, runs: tuple, rot: int, which: range, pick: list) -> None:
    """The senders of one name's ``which`` runs (:class:`_Choices`, as ``(holder ranks, the same as a
    list, pieces, h0, count, wire)`` per run), appended to ``pick`` as positions in the holders; ``loads``
    updated. Each piece goes to the least loaded holder of its box, ties to the first from the name's
    rotation, in the greedy's order: what :func:`_greedy_sequential` picks. A run's pieces are the
    greedy's next ones (:func:`_runs`), so where its holders are distinct ranks (``count`` > 0) its
    water-filling is the same picks (:func:`_greedy`); a short run, or one whose box a rank lists twice,
    goes in scalar steps, a piece and a holder at a time, with no numpy call."""
    ranks, rank, pieces, h0, count, wire = runs
    for r in which:
        first, n, w, m = h0[r], count[r], wire[r], pieces[r]
        if m * n > SCALAR_STEPS:  # (count < 0: a rank holds the box twice, scalar steps over its -count)
            hold = ranks[first: first + n]
            got = _water_fill(loads[hold], (np.arange(n) - rot % n) % n, w, m)
            loads[hold] += np.bincount(got, minlength=n) * w
            pick.extend((got + first).tolist())
            continue
        n = abs(n)
        for _ in range(m):
            best, low = first, None
            for t in range(n):
                j = first + (rot + t) % n
                load = loads[rank[j]]
                if low is None or load < low:
                    best, low = j, load
            pick.append(best)
            loads[rank[best]] += w


def _chosen(rows: np.ndarray, c: _Choices, pick: np.ndarray) -> None:
    """The chosen holders written into the pieces' send rows (sender, source) and receive rows (peer)."""
    if not len(pick):
        return
    sender, source = c.holders.rank[pick], c.holders.index[pick]
    rows[c.row, 0] = sender
    rows[c.row, 1 + A_SRC] = source
    rows[c.row + 1, 1 + A_PEER] = sender
    rows[c.row + 1, 1 + A_SRC] = source


def _direct(rec: np.ndarray, ranks: np.ndarray, starts: np.ndarray, nd: int, sides) -> _Direct:
    """The answers of the names whose every piece is a whole destination inside one source box, for all
    of them at once (numpy over the records, no step per name); every other name is left to
    :func:`_plan_name`.

    A name is direct when its sources agree on tensor rank, dtype and shape, its distinct source boxes
    are disjoint (:func:`_meeting`), and each destination has that rank, dtype and shape, no
    :data:`F_ROW`, some elements, and lies whole inside one source box (:func:`_containing`); where
    relays may pay, no two of its remote destinations are the same region. A name no destination asks
    for and no source flags :data:`F_NEEDED` is direct with no rows.

    Why the rows are :func:`_plan_name`'s: it reports no problem for such a name (nothing of
    :func:`_check_dests`, :func:`_distinct`'s overlap check, :func:`_pieces`' uncovered), and
    :func:`_pieces` cuts each destination into exactly one piece, the destination itself (a box that met
    it would meet its containing box, and the boxes are disjoint). :func:`_assign` then makes it a local
    copy from :func:`_own_index`'s index where the needer holds the box, else a send from a holder of
    the box, :func:`_fans` finds no fan, and the rows come heaviest piece first, ties in destination
    order, each send followed by its receive: the order :func:`_direct_rows` writes. A name's remote
    pieces all from single holders have their senders here (what any greedy picks for one holder); a
    name with a choice gets its senders from :func:`_choose`, in name order (:func:`_plan_names`)."""
    n = len(starts) - 1
    nid = np.repeat(np.arange(n), np.diff(starts))
    is_src = rec[:, K_KIND] == SRC
    ln = _dims(rec[:, HEAD + 2 * nd: HEAD + 3 * nd], rec[:, K_NDIM], 1)
    idle, ok = _uniform(rec, nid, starts, is_src, ln, nd)
    src = np.flatnonzero(is_src & ok[nid])
    dst = np.flatnonzero(~is_src & ok[nid])
    off = rec[:, HEAD + nd: HEAD + 2 * nd]
    box, bfirst = _box_ids(nid[src], off[src], ln[src])
    bnid, boff, bln = nid[src[bfirst]], off[src[bfirst]], ln[src[bfirst]]
    shape = _dims(rec[starts[:-1], HEAD: HEAD + nd], rec[starts[:-1], K_NDIM], 1)
    vol = np.zeros(n, np.int64)
    np.add.at(vol, bnid, np.prod(bln, axis=1, dtype=np.int64))
    ok &= (vol <= np.prod(shape, axis=1, dtype=np.int64)) & ~_meeting(bnid, boff, bln, n)
    k = _containing(nid[dst], off[dst], ln[dst], bnid, boff, bln)
    holders = _box_holders(box, ranks[src], rec[src, K_INDEX], len(bfirst))
    mine = np.where(k >= 0, _own_index(holders, np.maximum(k, 0), ranks[dst]), -1) if len(bfirst) else k
    local = mine >= 0  # (the needer's own lowest index of its box: a local copy)
    ok[nid[dst[k < 0]]] = False
    if sides is not None and max(1, sides[1]) > max(1, sides[0]):  # (:func:`_fans`' condition)
        remote = ~local & ok[nid[dst]]
        ok[_repeated(nid[dst[remote]], off[dst[remote]], ln[dst[remote]])] = False
    keep = ok[nid[dst]]
    ok |= idle
    return _direct_rows(rec[dst[keep]], nid[dst[keep]], ranks[dst[keep]], k[keep], mine[keep], holders, bnid,
                        np.prod(ln[dst[keep]], axis=1, dtype=np.int64), np.flatnonzero(~ok), n, nd)


def _dims(a: np.ndarray, ndim: np.ndarray, pad: int) -> np.ndarray:
    """``a`` (records' ``nd`` columns of shape, offsets or lengths) with the columns past each record's
    tensor rank set to ``pad``."""
    return np.where(np.arange(a.shape[1]) < ndim[:, None], a, pad)


def _uniform(rec: np.ndarray, nid: np.ndarray, starts: np.ndarray, is_src: np.ndarray, ln: np.ndarray,
             nd: int) -> tuple[np.ndarray, np.ndarray]:
    """Per name: (no destination and no :data:`F_NEEDED` source: nothing to answer; it has sources and
    destinations, every record has its first source's tensor rank, dtype and shape, and no destination
    is an :data:`F_ROW` or empty)."""
    first = starts[:-1]  # a name's first record: its first source when it has one (SRC sorts first)
    cols = [K_NDIM, K_DTYPE] + list(range(HEAD, HEAD + nd))
    ref = rec[first][:, cols]
    other = np.any(rec[:, cols] != ref[nid], axis=1)
    other |= ~is_src & (((rec[:, K_FLAGS] & F_ROW) != 0) | np.any(ln <= 0, axis=1))
    dests = np.logical_or.reduceat(~is_src, first)
    needed = np.logical_or.reduceat((rec[:, K_FLAGS] & F_NEEDED) != 0, first)
    return ~dests & ~needed, is_src[first] & dests & ~np.logical_or.reduceat(other, first)


def _box_ids(nid: np.ndarray, off: np.ndarray, ln: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(per source record its distinct box, numbered by name then offsets then lengths; per box its first
    record)."""
    key = np.column_stack([nid, off, ln])
    by = np.lexsort(key.T[::-1])
    new = np.concatenate((_TRUE, np.any(key[by][1:] != key[by][:-1], axis=1))) if len(by) else by > 0
    box = np.empty(len(by), np.int64)
    box[by] = np.cumsum(new) - 1
    return box, by[new]


def _meeting(bnid: np.ndarray, boff: np.ndarray, bln: np.ndarray, n: int) -> np.ndarray:
    """Per name: whether two of its distinct boxes (sorted by name, then offsets) meet, what
    :func:`_disjoint` finds (the pairs of boxes that share dim-0 rows, found by one search on dim-0
    starts made increasing across names). Names whose coordinates are too large for that: true when
    they have more than one box (left to :func:`_plan_name`)."""
    several = np.bincount(bnid, minlength=n) > 1
    if not len(bnid) or not np.any(several):
        return np.zeros(n, bool)
    lo, hi = boff[:, 0], boff[:, 0] + bln[:, 0]
    if max(int(np.abs(lo).max()), int(np.abs(hi).max())) >= 1 << 40 or n >= 1 << 20:
        return several
    minlo = np.full(n, 1 << 40, np.int64)
    np.minimum.at(minlo, bnid, lo)
    base = (np.arange(n, dtype=np.int64) << 42) - minlo  # name k's starts within [k << 42, (k + 1) << 42)
    key = lo + base[bnid]
    end = np.searchsorted(key, hi + base[bnid], "left")
    cnt = np.maximum(end - np.arange(len(lo)) - 1, 0)
    a = np.repeat(np.arange(len(lo)), cnt)
    b = a + 1 + np.arange(int(cnt.sum())) - np.repeat(_offsets(cnt)[:-1], cnt)
    meet = np.all(np.maximum(boff[a], boff[b]) < np.minimum(boff[a] + bln[a], boff[b] + bln[b]), axis=1)
    out = np.zeros(n, bool)
    out[bnid[a[meet]]] = True
    return out


def _containing(dnid: np.ndarray, doff: np.ndarray, dln: np.ndarray, bnid: np.ndarray, boff: np.ndarray,
                bln: np.ndarray) -> np.ndarray:
    """Per destination: a distinct box of its name that holds it whole, else -1. The one tried is the last
    box at or before its offsets in lexicographic order (the containing box of any grid of boxes)."""
    nb = len(bnid)
    if not nb or not len(dnid):
        return np.full(len(dnid), -1, np.int64)
    nid = np.concatenate([bnid, dnid])
    off = np.concatenate([boff, doff])
    order = np.lexsort((np.arange(len(nid)) >= nb,) + tuple(off.T[::-1]) + (nid,))  # boxes first at ties
    last = np.maximum.accumulate(np.where(order < nb, order, -1))
    k = np.empty(len(dnid), np.int64)
    k[order[order >= nb] - nb] = last[order >= nb]
    j = np.maximum(k, 0)
    inside = np.all((boff[j] <= doff) & (doff + dln <= boff[j] + bln[j]), axis=1)
    return np.where((k >= 0) & inside & (bnid[j] == dnid), k, -1)


def _box_holders(box: np.ndarray, srank: np.ndarray, sindex: np.ndarray, nbox: int) -> _Holders:
    """Each distinct box's holders (``box``: per source record its box), by rank then index: the order
    :func:`_distinct` gives them, which the greedy's rotation and :func:`_own_index` go by."""
    by = np.lexsort((sindex, srank, box))
    return _Holders(srank[by], sindex[by], np.searchsorted(box[by], np.arange(nbox + 1)))


def _repeated(nid: np.ndarray, off: np.ndarray, ln: np.ndarray) -> np.ndarray:
    """The names with two equal rows of ``(name, offsets, lengths)``: a fan :func:`_fans` might relay."""
    key = np.column_stack([nid, off, ln])
    if len(key) < 2:
        return np.zeros(0, np.int64)
    s = key[np.lexsort(key.T[::-1])]
    return s[1:, 0][np.all(s[1:] == s[:-1], axis=1)]


def _direct_rows(dst: np.ndarray, nid: np.ndarray, receiver: np.ndarray, box: np.ndarray, mine: np.ndarray,
                 holders: _Holders, bnid: np.ndarray, elements: np.ndarray, slow: np.ndarray, n: int,
                 nd: int) -> _Direct:
    """The direct names' rows from their destinations' records (in record order), each inside source
    ``box`` (of name ``bnid[box]``): per name, its pieces heaviest first, ties in record order, each a
    local copy from the needer's own index ``mine`` (>= 0), else a send then its receive
    (:func:`_assign`). A name whose remote pieces each have one holder gets them as senders; the others'
    pieces are left to :func:`_choose` (their sender and source written by :func:`_chosen`)."""
    wire = elements * ITEMSIZES[dst[:, K_DTYPE]]
    order = np.lexsort((np.arange(len(dst)), -wire, nid))
    dst, nid, receiver, box, mine, wire = (x[order] for x in (dst, nid, receiver, box, mine, wire))
    local = mine >= 0
    h0, count = holders.start[box], np.diff(holders.start)[box]
    choice = np.zeros(n, bool)
    choice[nid[~local & (count > 1)]] = True
    chosen = ~local & choice[nid]  # (a choosing name's single holders too: the greedy's order is the name's)
    fixed = ~local & ~chosen
    sender = np.where(local, receiver, np.where(fixed, holders.rank[h0], -1))
    at = _offsets(np.where(local, 1, 2))
    rows = np.zeros((int(at[-1]), answer_width(nd) + 1), dtype=np.int64)
    first = rows[at[:-1]]
    first[:, 0] = sender
    first[:, 1 + A_KIND] = np.where(local, LOCAL, SEND)
    first[:, 1 + A_NAME] = dst[:, K_NAME]
    first[:, 1 + A_PEER] = receiver
    first[:, 1 + A_SRC] = np.where(local, mine, holders.index[h0])
    first[:, 1 + A_DST] = dst[:, K_INDEX]
    first[:, 1 + A_DTYPE] = dst[:, K_DTYPE]
    first[:, 1 + A_NDIM] = dst[:, K_NDIM]
    first[:, 1 + AHEAD: 1 + AHEAD + 2 * nd] = dst[:, HEAD + nd: HEAD + 3 * nd]  # offsets, lengths (zero-padded)
    rows[at[:-1]] = first
    second = first[~local]
    second[:, 0] = receiver[~local]
    second[:, 1 + A_KIND] = RECV
    second[:, 1 + A_PEER] = sender[~local]
    rows[at[:-1][~local] + 1] = second
    per_name = np.bincount(nid, minlength=n) + np.bincount(nid[~local], minlength=n)
    runs = _runs(nid[chosen], box[chosen], wire[chosen], at[:-1][chosen], holders, bnid, n)
    return _Direct(slow, rows, _offsets(per_name), nid[fixed], sender[fixed], wire[fixed], runs)


def _runs(nid: np.ndarray, box: np.ndarray, wire: np.ndarray, row: np.ndarray, holders: _Holders,
          bnid: np.ndarray, n: int) -> _Choices:
    """The choosing names' pieces (in the greedy's order: by name, heaviest first, ties in destination
    order) in runs. Where no rank holds two of a name's holdings (:func:`_disjoint_holders`: every
    DTensor layout), its pieces go box by box instead — each box's holders see only that box's pieces,
    so they get the same picks (:func:`_greedy`'s order) — and each box's pieces of equal size are one
    run; elsewhere a run is a stretch of the greedy's order of one box and size. Either way a run's
    pieces are the greedy's next ones, so its water-filling is the greedy's picks, where its box's
    holders are distinct ranks: ``count`` is negative where they are not (scalar steps only)."""
    hbox = np.repeat(np.arange(len(holders.start) - 1), np.diff(holders.start))
    span = int(holders.rank.max(initial=0)) + 1
    key = np.sort(bnid[hbox] * span + holders.rank)
    shared = np.zeros(n, bool)
    shared[key[1:][key[1:] == key[:-1]] // span] = True
    twice = np.zeros(len(holders.start) - 1, bool)  # boxes a rank holds twice (two indices)
    twice[hbox[1:][(hbox[1:] == hbox[:-1]) & (holders.rank[1:] == holders.rank[:-1])]] = True
    by = np.lexsort((np.arange(len(nid)), -wire, np.where(shared[nid], 0, box), nid))
    nid, box, wire, row = nid[by], box[by], wire[by], row[by]
    start = _bounds((nid[1:] != nid[:-1]) | (box[1:] != box[:-1]) | (wire[1:] != wire[:-1])) if len(nid) else _ZERO
    k = box[start[:-1]]
    count = np.diff(holders.start)[k]
    return _Choices(nid[start[:-1]], start, holders.start[k], np.where(twice[k], -count, count), wire[start[:-1]],
                    row, holders)


def _errors(name: int, ranks: np.ndarray, index: np.ndarray, code: int, nd: int) -> np.ndarray:
    rows = np.zeros((len(ranks), answer_width(nd) + 1), dtype=np.int64)
    rows[:, 0] = ranks
    rows[:, 1 + A_KIND] = ERROR
    rows[:, 1 + A_NAME] = name
    rows[:, 1 + A_PEER] = code
    rows[:, 1 + A_DST] = index
    return rows


class Op(NamedTuple):
    """One piece as this rank handles it: ``peer`` the other end (itself for a local copy)."""

    name: int
    receiver: int
    peer: int
    src: int  # index into the sender's sources; a relay's send: -1 - its own destination's index
    dst: int  # index into the receiver's destinations
    dtype: int  # the destination's dtype (what travels)
    offsets: tuple[int, ...]  # global region
    lengths: tuple[int, ...]
    hop: int = 0  # 0: sent by a holder; h > 0: relayed, after every message of hop h - 1

    @property
    def key(self) -> tuple:
        return (self.hop, self.name, self.receiver, self.dst, self.offsets)


class Answers(NamedTuple):
    sends: list[Op]
    recvs: list[Op]
    local: list[Op]
    problems: list[tuple[int, int]]  # (destination index, or -1 - source index for E_UNUSED; problem code)


def decode(words: np.ndarray, nd: int, rank: int) -> Answers:
    """This rank's answers as ops in the one global order (:attr:`Op.key`)."""
    rows = np.asarray(words, dtype=np.int64).reshape(-1, answer_width(nd))
    kind = rows[:, A_KIND] & ((1 << HOP_SHIFT) - 1)
    err = rows[kind == ERROR]
    problems = sorted(zip(err[:, A_DST].tolist(), err[:, A_PEER].tolist()))
    ops = [_ops(rows[kind == k], k, nd, rank) for k in (SEND, RECV, LOCAL)]
    return Answers(*ops, problems)


_op = tuple.__new__  # Op(...) without the NamedTuple's Python-level __new__


def _ops(r: np.ndarray, kind: int, nd: int, rank: int) -> list[Op]:
    """Rows of one kind as ops, sorted by their key (hop, name, receiver, destination, offsets)."""
    if not len(r):
        return []
    receiver = r[:, A_PEER] if kind == SEND else np.full(len(r), rank, dtype=np.int64)
    hop = r[:, A_KIND] >> HOP_SHIFT
    off, ln = r[:, AHEAD: AHEAD + nd], r[:, AHEAD + nd: AHEAD + 2 * nd]
    order = np.lexsort(tuple(off[:, j] for j in range(nd - 1, -1, -1)) + (r[:, A_DST], receiver, r[:, A_NAME], hop))
    r, receiver, off, ln, hop = r[order], receiver[order], off[order], ln[order], hop[order]
    ndims = r[:, A_NDIM]
    n = int(ndims[0])
    if np.all(ndims == n):  # (one tensor rank: the tuples column by column)
        offs = list(zip(*(off[:, j].tolist() for j in range(n)))) if n else [()] * len(r)
        lens = list(zip(*(ln[:, j].tolist() for j in range(n)))) if n else [()] * len(r)
    else:
        offs = [tuple(o[:k]) for o, k in zip(off.tolist(), ndims.tolist())]
        lens = [tuple(x[:k]) for x, k in zip(ln.tolist(), ndims.tolist())]
    cols = (r[:, A_NAME].tolist(), receiver.tolist(), r[:, A_PEER].tolist(), r[:, A_SRC].tolist(),
            r[:, A_DST].tolist(), r[:, A_DTYPE].tolist(), offs, lens, hop.tolist())
    return [_op(Op, t) for t in zip(*cols)]
