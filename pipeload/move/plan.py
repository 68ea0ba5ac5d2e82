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
   ``(name hash, receiver, destination index, offsets)``, a key both ends of a piece compute alike
   (:mod:`pipeload.move.mover` explains why that order cannot deadlock).

Each destination byte is sent once per needer; nothing is assembled whole. When several needers want
the same region (engine replicas) and the holders are few against them, the owner may *relay* it
instead (:func:`relays`, a cost model over the group's counts of source and destination ranks): the
holders send it to some needers in hop 0, and in each later hop every rank that has it sends it to one
more, so no holder sends more than one copy a hop. Hops go in the global order before anything else
(``Op.key`` starts with the hop), and a rank posts a hop's messages only once the earlier ones it
posted completed, so a relay forwards only bytes it holds and the order's argument is unchanged. Cost per rank: its own
records out and its answers back (``O(S)`` words) plus, on an owner, ``O(holders + needers + pieces)``
of the names it owns, with ``O(log)`` candidate search per destination box along dim 0 — never
``W x S``. Distinct source boxes of one name must not overlap (every DTensor layout partitions its
tensor, replicas repeat a box exactly); an owner that finds overlap reports it instead of guessing.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

SRC, DST = 0, 1
HEAD = 6
K_KIND, K_NAME, K_DTYPE, K_NDIM, K_INDEX, K_FLAGS = range(HEAD)
F_CAST = 1  # a destination's flag: its dtype may differ from the source's (the sender casts)

SEND, RECV, LOCAL, ERROR = range(4)
HOP_SHIFT = 8  # an answer's kind word: kind | hop << HOP_SHIFT (hop 0: from a holder; later: a relay)
AHEAD = 7
A_KIND, A_NAME, A_PEER, A_SRC, A_DST, A_DTYPE, A_NDIM = range(AHEAD)

# problems an owner reports to a destination's rank (A_PEER carries the code, A_DST the index)
E_MISSING, E_SHAPE, E_DTYPE, E_UNCOVERED, E_OVERLAP, E_CONFLICT = range(1, 7)
PROBLEMS = {
    E_MISSING: "no rank of the group holds a source tensor of this name",
    E_SHAPE: "its global shape differs from the source's",
    E_DTYPE: "its dtype differs from the source's (pass cast=True to convert)",
    E_UNCOVERED: "part of its region is held by no source rank",
    E_OVERLAP: "the sources hold overlapping boxes that differ (not one layout)",
    E_CONFLICT: "the source ranks disagree on its global shape or dtype",
}
_MASK = np.uint64((1 << 63) - 1)


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
    w = width(nd)
    rec = np.zeros((len(sources) + len(dests), w), dtype=np.int64)
    for i, (kind, boxes) in enumerate(((SRC, sources), (DST, dests))):
        base = 0 if i == 0 else len(sources)
        for j, b in enumerate(boxes):
            n = len(b.shape)
            row = rec[base + j]
            row[:HEAD] = (kind, b.name, b.dtype, n, j, b.flags)
            row[HEAD: HEAD + n] = b.shape
            row[HEAD + nd: HEAD + nd + n] = b.offsets
            row[HEAD + 2 * nd: HEAD + 2 * nd + n] = b.lengths
    owners = owner_of(rec[:, K_NAME], size)
    order = np.argsort(owners, kind="stable")
    counts = np.bincount(owners, minlength=size) * w
    return counts, rec[order].ravel()


def answer(counts: np.ndarray, words: np.ndarray, nd: int, size: int,
           sides: tuple[int, int] | None = None) -> tuple[np.ndarray, np.ndarray]:
    """An owner's answers to the records it received (``counts`` words from each rank, in rank order):
    (words per destination rank, the answers in rank order, flat), for the second all-to-all.
    ``sides``: (ranks holding sources, ranks holding destinations) in the group, for :func:`relays`;
    None: never relay."""
    w = width(nd)
    rec = np.asarray(words, dtype=np.int64).reshape(-1, w)
    ranks = np.repeat(np.arange(len(counts), dtype=np.int64), np.asarray(counts) // w)
    out: list[np.ndarray] = []
    loads: dict[int, int] = {}
    if len(rec):
        order = np.lexsort((ranks, rec[:, K_INDEX], rec[:, K_KIND], rec[:, K_NAME]))
        rec, ranks = rec[order], ranks[order]
        starts = np.flatnonzero(np.r_[True, rec[1:, K_NAME] != rec[:-1, K_NAME], True])
        for a, b in zip(starts[:-1], starts[1:]):
            out.extend(_plan_name(rec[a:b], ranks[a:b], nd, loads, sides))
    aw = answer_width(nd)
    rows = np.concatenate(out) if out else np.zeros((0, aw + 1), dtype=np.int64)
    rows = rows[np.argsort(rows[:, 0], kind="stable")]
    return np.bincount(rows[:, 0], minlength=size) * aw, rows[:, 1:].ravel()


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


def _plan_name(rec: np.ndarray, ranks: np.ndarray, nd: int, loads: dict, sides=None) -> list[np.ndarray]:
    """Every answer row about one name, as ``[destination rank, *answer words]``."""
    name = int(rec[0, K_NAME])
    is_src = rec[:, K_KIND] == SRC
    if not np.any(~is_src):
        return []  # a source nobody needs
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
    out.append(_pieces(name, dst, boxes, holders, src_rec[0, K_DTYPE], nd, ndim, loads, sides))
    return out


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


def _distinct(src: _Side) -> tuple[np.ndarray, list[list[tuple[int, int]]]]:
    """(distinct source boxes ``k x 2 x ndim`` sorted by dim-0 offset, their holders as (rank, index)
    sorted by rank)."""
    key = np.concatenate([src.off, src.len], axis=1)
    uniq, inv = np.unique(key, axis=0, return_inverse=True)
    inv = inv.ravel()
    ndim = src.off.shape[1]
    holders: list[list[tuple[int, int]]] = [[] for _ in range(len(uniq))]
    for i in np.lexsort((src.ranks, inv)).tolist():
        holders[inv[i]].append((int(src.ranks[i]), int(src.index[i])))
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


def _pieces(name: int, dst: _Side, boxes: np.ndarray, holders: list, src_dtype: int, nd: int, ndim: int,
            loads: dict, sides=None) -> np.ndarray:
    """Each destination box cut by the source boxes it meets, each piece given a sender."""
    lo0 = boxes[:, 0, 0] if ndim else np.zeros(len(boxes), np.int64)
    order = np.argsort(lo0, kind="stable")
    boxes, holders = boxes[order], [holders[i] for i in order.tolist()]
    lo0 = lo0[order]
    reach = np.maximum.accumulate(lo0 + boxes[:, 1, 0]) if ndim else np.ones(len(boxes), np.int64)
    cand: list[tuple[int, int, np.ndarray, np.ndarray]] = []  # (dst row, box, region offsets, lengths)
    uncovered = []
    for i in range(len(dst.ranks)):
        off, ln = dst.off[i], dst.len[i]
        a, b = (int(np.searchsorted(reach, off[0], "right")), int(np.searchsorted(lo0, off[0] + ln[0], "left"))) \
            if ndim else (0, len(boxes))
        got = _meet(off, ln, boxes[a:b])
        if int(np.prod(got[1], axis=1, dtype=np.int64).sum()) != int(np.prod(ln, dtype=np.int64)):
            uncovered.append(i)
            continue
        for k, (o, n) in zip(got[2].tolist(), zip(got[0], got[1])):
            cand.append((i, a + k, o, n))
    rows = _assign(name, dst, cand, holders, nd, ndim, loads, sides)
    if uncovered:
        u = np.asarray(uncovered)
        rows = np.concatenate([rows, _errors(name, dst.ranks[u], dst.index[u], E_UNCOVERED, nd)])
    return rows


def _meet(off: np.ndarray, ln: np.ndarray, boxes: np.ndarray):
    """(region offsets, region lengths, which boxes) where ``off, ln`` meets ``boxes``, non-empty only."""
    if not len(boxes):
        return np.zeros((0, len(off)), np.int64), np.zeros((0, len(off)), np.int64), np.zeros(0, np.int64)
    lo = np.maximum(boxes[:, 0], off)
    hi = np.minimum(boxes[:, 0] + boxes[:, 1], off + ln)
    keep = np.all(hi > lo, axis=1) if len(off) else np.ones(len(boxes), bool)
    which = np.flatnonzero(keep)
    return lo[keep], (hi - lo)[keep], which


def _assign(name: int, dst: _Side, cand: list, holders: list, nd: int, ndim: int, loads: dict,
            sides=None) -> np.ndarray:
    """Answer rows for the pieces ``cand``: a local copy where the needer holds the box, else sends.
    Pieces that several needers want alike (the same box, region and dtype) form a *fan*: served
    straight from the holders the greedy picks, or through relays when :func:`relays` says so."""
    rot = int(np.uint64(np.int64(name).view(np.uint64)) % np.uint64(1 << 31))
    rows: list[tuple] = []
    fans: dict[tuple, list[int]] = {}
    for p, (i, k, o, n) in enumerate(cand):
        if any(r == int(dst.ranks[i]) for r, _ in holders[k]):
            x = next(x for r, x in holders[k] if r == int(dst.ranks[i]))
            rows.append((LOCAL, 0, int(dst.ranks[i]), int(dst.ranks[i]), x, i, o, n))
        else:
            fans.setdefault((k, tuple(o.tolist()), tuple(n.tolist()), int(dst.dtype[i])), []).append(p)
    size = {key: int(np.prod(cand[ps[0]][3], dtype=np.int64)) for key, ps in fans.items()}
    for key in sorted(fans, key=lambda key: (-size[key], fans[key][0])):
        k, ps = key[0], fans[key]
        needers = sorted(ps, key=lambda p: int(dst.ranks[cand[p][0]]))
        hops = relays(len(needers), len(holders[k]), sides)
        rows.extend(_fan(needers, holders[k], cand, dst, hops, size[key], loads, rot))
    return _rows(name, dst, rows, nd, ndim)


def relays(needers: int, holders: int, sides: tuple[int, int] | None) -> bool:
    """Whether a region ``needers`` ranks want alike, ``holders`` ranks hold, goes through relays.

    The cost model, per byte of such regions if every region were alike, with ``T`` ranks holding
    sources and ``D`` holding destinations: sent straight, the holders send ``needers`` copies spread
    over ``T`` ranks and the needers receive them spread over ``D``: ``max(N/T, N/D)``. Relayed, each
    hop has every rank that has it send one copy — the holders at most ``H/T`` of it, the receivers at
    most ``N/D`` — and ``ceil(log2(N/H + 1))`` hops serve every needer: ``hops * max(H/T, N/D)``.
    Relays win where the needers far outnumber the holders (many engine replicas, few trainer ranks)."""
    if sides is None or needers < 2:
        return False
    t, d = max(1, sides[0]), max(1, sides[1])
    n, h = needers, max(1, holders)
    hops = int(np.ceil(np.log2(n / h + 1)))
    return hops * max(h / t, n / d) < max(n / t, n / d)


def _fan(needers: list[int], hs: list[tuple[int, int]], cand: list, dst: _Side, relayed: bool, nbytes: int,
         loads: dict, rot: int) -> list[tuple]:
    """(kind, hop, sender, receiver, source index, destination row, offsets, lengths) of one fan: each
    needer from the least loaded holder, or (relayed) in hops: hop ``h`` has every rank that holds the
    region by then (holders first, then the needers served, in that order) send it to the next needer.
    A relay's source index is its own destination's (it forwards what it received)."""
    out = []
    if not relayed:
        for p in needers:
            i, _, o, n = cand[p]
            sender, sindex = _least_loaded(hs, loads, rot)
            loads[sender] = loads.get(sender, 0) + nbytes
            out.append((SEND, 0, sender, int(dst.ranks[i]), sindex, i, o, n))
        return out
    start = rot % len(hs)
    have = [(r, x, True) for r, x in hs[start:] + hs[:start]]  # (rank, its index, a holder)
    todo, hop = list(needers), 0
    while todo:
        served = []
        for r, x, holder in list(have):
            if not todo:
                break
            p = todo.pop(0)
            i, _, o, n = cand[p]
            out.append((SEND, hop, r, int(dst.ranks[i]), x if holder else -1 - x, i, o, n))
            loads[r] = loads.get(r, 0) + nbytes
            served.append((int(dst.ranks[i]), int(dst.index[i]), False))
        have += served
        hop += 1
    return out


def _rows(name: int, dst: _Side, plan: list[tuple], nd: int, ndim: int) -> np.ndarray:
    """Answer rows ``[to rank, *answer words]``: a send makes a row for its sender and one for its
    receiver; a relay's send carries its own destination index as ``-1 - index``."""
    aw = answer_width(nd)
    rows = np.zeros((2 * len(plan), aw + 1), dtype=np.int64)
    used = 0
    for kind, hop, sender, receiver, sindex, i, o, n in plan:
        dindex, dtype = int(dst.index[i]), int(dst.dtype[i])
        region = np.r_[o, np.zeros(nd - ndim, np.int64), n, np.zeros(nd - ndim, np.int64)]
        if kind == LOCAL:
            rows[used, :AHEAD + 1] = (receiver, LOCAL, name, receiver, sindex, dindex, dtype, ndim)
            rows[used, AHEAD + 1:] = region
            used += 1
            continue
        k = hop << HOP_SHIFT
        rows[used, :AHEAD + 1] = (sender, SEND | k, name, receiver, sindex, dindex, dtype, ndim)
        rows[used + 1, :AHEAD + 1] = (receiver, RECV | k, name, sender, sindex, dindex, dtype, ndim)
        rows[used: used + 2, AHEAD + 1:] = region
        used += 2
    return rows[:used]


def _least_loaded(hs: list[tuple[int, int]], loads: dict, rot: int) -> tuple[int, int]:
    start = rot % len(hs)
    best, best_load = hs[start], loads.get(hs[start][0], 0)
    for j in range(1, len(hs)):
        h = hs[(start + j) % len(hs)]
        lh = loads.get(h[0], 0)
        if lh < best_load:
            best, best_load = h, lh
    return best


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
    problems: list[tuple[int, int]]  # (destination index, problem code)


def decode(words: np.ndarray, nd: int, rank: int) -> Answers:
    """This rank's answers as ops in the one global order (:attr:`Op.key`)."""
    rows = np.asarray(words, dtype=np.int64).reshape(-1, answer_width(nd))
    sends, recvs, local, problems = [], [], [], []
    for r in rows.tolist():
        kind, hop = r[A_KIND] & ((1 << HOP_SHIFT) - 1), r[A_KIND] >> HOP_SHIFT
        if kind == ERROR:
            problems.append((r[A_DST], r[A_PEER]))
            continue
        n = r[A_NDIM]
        off, ln = tuple(r[AHEAD: AHEAD + n]), tuple(r[AHEAD + nd: AHEAD + nd + n])
        receiver = r[A_PEER] if kind == SEND else rank
        op = Op(r[A_NAME], receiver, r[A_PEER], r[A_SRC], r[A_DST], r[A_DTYPE], off, ln, hop)
        (sends if kind == SEND else recvs if kind == RECV else local).append(op)
    for ops in (sends, recvs, local):
        ops.sort(key=lambda op: op.key)
    return Answers(sends, recvs, local, sorted(problems))
