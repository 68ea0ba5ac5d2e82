"""The global load plan: who reads each shared shard, how large ones are cut, and this rank's broadcasts.

A pure function of the exchanged rows and distinct records (:mod:`pipeload.exchange`), evaluated by
every rank on the same data, so every rank takes the same decisions without talking; if two ranks
disagreed on a reader, each would wait for the other's broadcast forever. Nothing here depends on the
order of items inside any rank's record (tested with permutations).

Cost per rank, with ``W`` ranks, ``D`` distinct records (``D = W / R`` for replication ``R``), ``S``
shards per record and ``P`` shared pieces after striping:

- grouping identical shard keys across the ``D x S`` record rows: vectorised (numpy hashing and one
  sort), the only step that stays ``O(W x S)`` when ``R = 1`` — and then nothing is shared, so it is
  also the last;
- reader choice: ``O(P log R)`` with one heap per distinct holder set (a holder set is a union of
  record classes, expanded to ranks once per distinct set), over arrays in :mod:`pipeload._greedy`;
  stream cutting is ``O(P + R)`` per set;
- this rank's broadcasts: ``O(P_mine log P_mine)``, the pieces whose holder set contains it. Python
  objects (shard keys) are built only for those and for cut sets; ``GlobalPlan.readers`` (every piece
  of the component) is built when first read.

Rules (DESIGN.md, "Global plan"):

- a shard is *shared* when two or more ranks hold it, every holder reported it broadcastable, and its
  holder set has a process group (the load's own, one every member can reuse, or one the load may
  create) — and, under the host-aware policy (``same_host_private``), its holders are not all on one
  host;
- readers: shared shards by bytes, largest first (ties by key), each to the holder with the fewest
  bytes so far, ties to the lower rank; starting loads are the bytes each rank reads alone anyway —
  exactly :func:`pipeload.balance.assign`, the rule the saver used to pick writers (so an unchanged
  layout reads each rank's own file);
- **affinity**: a layout written by another tool names the rank that wrote each file (torch DCP's
  ``__<rank>_<i>.distcp``), and its writers chose differently. Before the greedy, largest first, a
  shard whose record carries such a writer goes to it when the writer holds it and stays within 11/10
  of the mean bytes of its component (its ranks' bytes plus every shared byte there, over its ranks);
  the greedy places the rest. The items of one file, neighbours on storage, are then read by one rank,
  and no page holding the end of one and the start of the next is read twice (measured: 6 % of a
  256 MiB DCP checkpoint). Without affinity (pipeload's own files) the decisions are exactly the
  greedy's;
- **stream cutting**: a holder set whose largest shard exceeds half a member's mean share (and whose
  share is at least ``min_stripe``) cannot be balanced by whole shards; after the greedy, its shards
  in key order form one byte stream that is cut, at row boundaries, into one contiguous segment per
  member, sized to even out the members' loads (water filling). Each segment's part of a shard is a
  *piece* (a row range), read by that member and broadcast to all; so one 245 MiB embedding no longer
  sets the load's time, and each reader's reads stay contiguous;
- order: pieces sorted by (fqn index, offsets, lengths); pieces under ``batch_bytes`` join the pending
  batch of their (holder set, reader), which is sent at the position of the piece that fills it; the
  batches left at the end follow in the order of their first piece.
"""

from __future__ import annotations

import bisect
import hashlib
from dataclasses import dataclass
from operator import itemgetter
from typing import Callable, Sequence

import numpy as np

from ._greedy import assign_readers, batch_ops, cut_stream
from .exchange import F_GROUPS, F_HOST, F_NGROUPS, Classes, Record, group_digest

ShardKey = tuple[int, tuple[int, ...], tuple[int, ...]]
STAGING_ALIGN = 64  # byte alignment of each shard inside a staging buffer (any dtype can view it)
MIN_STRIPE = 1 << 20  # a holder set whose mean share is smaller is never cut
FULL = 0  # set id of the whole load group


def aligned(n: int) -> int:
    return -(-n // STAGING_ALIGN) * STAGING_ALIGN


@dataclass(frozen=True)
class Op:
    """One broadcast: ``reader`` reads ``shards`` (pieces) and sends them to the members of set ``group``."""

    group: int
    reader: int
    shards: tuple[ShardKey, ...]


@dataclass
class HolderSet:
    members: tuple[int, ...]  # load-group ranks, ascending
    create: bool  # the load creates a group for it (every rank calls new_group, sets in sorted order)


@dataclass
class GlobalPlan:
    ops: list[Op]  # this rank's broadcasts, in the one global order
    pieces: dict[ShardKey, list[ShardKey]]  # this rank's shared shards -> their pieces (one if not striped)
    sets: dict[int, HolderSet]  # every holder set some broadcast uses (FULL: the load's group)
    requested: np.ndarray  # checkpoint key indices some rank asked for
    _readers: dict[ShardKey, int] | Callable[[], dict[ShardKey, int]]  # see readers
    loads: list[int]  # bytes each rank reads (exact for the ranks of this rank's component)
    bound: int  # the largest unsplittable read: no plan's busiest reader reads less

    @property
    def readers(self) -> dict[ShardKey, int]:
        """Every piece of this rank's component (all with ``everything=True``) -> its reader.

        Built on first use: a load needs only its own broadcasts (``ops``), and building a key per piece
        of the component cost more than choosing the readers.
        """
        if callable(self._readers):
            self._readers = self._readers()
        return self._readers

    @property
    def creates(self) -> list[tuple[int, ...]]:
        """Member sets the load creates groups for, in the order every rank creates them (sorted)."""
        return sorted(s.members for s in self.sets.values() if s.create)

    def digest(self) -> str:
        """A digest of the decisions this rank computed (readers of its component, created groups):
        equal on every rank of one component."""
        h = hashlib.blake2b(digest_size=16)
        for key in sorted(self.readers):
            h.update(repr((key, self.readers[key])).encode())
        h.update(repr(self.creates).encode())
        return h.hexdigest()


def _row_groups(keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(order, starts): ``keys[order]`` has identical rows adjacent; ``starts`` opens each run.

    Rows are hashed to 64 bits and sorted by hash; runs of equal hash are verified row by row, and a
    collision (never seen in practice) falls back to an exact lexicographic sort.
    """
    n = len(keys)
    if n == 0:
        return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64)
    u = np.ascontiguousarray(keys, dtype=np.int64).view(np.uint64)  # no copy for int64 rows
    h = np.full(n, 0x9E3779B97F4A7C15, dtype=np.uint64)
    tmp = np.empty_like(h)
    with np.errstate(over="ignore"):
        for c in range(u.shape[1]):  # in place: the rows can be millions
            np.bitwise_xor(h, u[:, c], out=h)
            np.multiply(h, np.uint64(0xBF58476D1CE4E5B9), out=h)
            np.right_shift(h, np.uint64(31), out=tmp)
            np.bitwise_xor(h, tmp, out=h)
    # Only rows whose hash bucket is shared can have a twin: sort just those (with R = 1 nearly none).
    size = 1 << max(4, int(2 * n - 1).bit_length())
    bucket = (h & np.uint64(size - 1)).astype(np.intp)
    twin = np.bincount(bucket, minlength=size)[bucket] > 1
    alone = np.flatnonzero(~twin)
    maybe = np.flatnonzero(twin)
    maybe = maybe[np.argsort(h[maybe], kind="stable")]
    order = np.concatenate([alone, maybe])
    hs = h[maybe]
    same_hash = np.concatenate([np.zeros(len(alone), dtype=bool), [False] if len(maybe) else [],
                                hs[1:] == hs[:-1]]).astype(bool)[1:]
    pairs = np.flatnonzero(same_hash)
    if pairs.size and np.any(keys[order[pairs]] != keys[order[pairs + 1]]):
        order = np.lexsort(keys.T[::-1])  # a collision: exact, slower
        ks = keys[order]
        new = np.concatenate(([True], np.any(ks[1:] != ks[:-1], axis=1)))
    else:
        new = np.concatenate(([True], ~same_hash))
    return order, np.flatnonzero(new)


def _water_fill(loads: list[int], total: int) -> list[int]:
    """Bytes to add to each of ``loads`` so that the busiest ends as low as possible (sum = ``total``)."""
    order = sorted(range(len(loads)), key=lambda i: loads[i])
    level, rest = 0.0, total
    for k, i in enumerate(order):  # raise the k+1 lowest together until they reach the next load
        nxt = loads[order[k + 1]] if k + 1 < len(order) else float("inf")
        need = (nxt - loads[i]) * (k + 1) if k + 1 < len(order) else float("inf")
        if need >= rest:
            level = loads[i] + rest / (k + 1)
            break
        rest -= need
    add = [max(0, int(level - x)) for x in loads]
    add[order[0]] += total - sum(add)  # rounding remainder
    return add


class _CutSet:
    """The shards of one stream-cut holder set (rows of the global plan's arrays, in key order) and,
    once :meth:`cut`, its pieces as arrays: shard, row range, weight, reader
    (:func:`pipeload._greedy.cut_stream`)."""

    def __init__(self, sid: int, rows: np.ndarray, first_rows, index, offsets, lengths, ndim, weights):
        fr = first_rows[rows]
        width = offsets.shape[1]
        order = np.lexsort(_key_columns(index[fr], offsets[fr], lengths[fr]))
        fr = fr[order]
        self.sid = sid
        self.index, self.offsets, self.lengths = index[fr], offsets[fr], lengths[fr]
        self.ndim = ndim[self.index]
        self.weight = weights[rows[order]].astype(np.int64, copy=False)
        self.rows = (np.where(self.ndim > 0, self.lengths[:, 0], 0).astype(np.int64) if width
                     else np.zeros(len(fr), dtype=np.int64))

    def cut(self, members: np.ndarray, sizes: list[int]) -> None:
        self.shard, self.r0, self.r1, seg = cut_stream(self.weight, self.rows, np.asarray(sizes, dtype=np.int64))
        rows = self.rows[self.shard]
        w = self.weight[self.shard]
        self.whole = (self.r0 == 0) & (self.r1 == rows)
        self.piece_weight = np.where(self.whole, w, (self.r1 - self.r0) * (w // np.maximum(rows, 1)))
        self.reader = members[seg]

    def pieces(self) -> list[tuple[ShardKey, int, int, ShardKey, int]]:
        """(piece key, weight, set, shard key, reader) of every piece."""
        keys = _keys(self.index, self.offsets, self.lengths, self.ndim)
        out = []
        for j, r0, r1, whole, pw, r in zip(self.shard.tolist(), self.r0.tolist(), self.r1.tolist(),
                                           self.whole.tolist(), self.piece_weight.tolist(), self.reader.tolist()):
            key = keys[j]
            piece = key if whole else (key[0], (key[1][0] + r0, *key[1][1:]), (r1 - r0, *key[2][1:]))
            out.append((piece, pw, self.sid, key, r))
        return out


def global_plan(
    rows: np.ndarray,
    cls: Classes,
    records: Sequence[Record],
    me: int,
    *,
    ndim: np.ndarray,
    itemsize: np.ndarray,
    broadcast: bool,
    batch_bytes: int,
    can_create: bool,
    global_ranks: Sequence[int] | None = None,
    stripe: bool = True,
    min_stripe: int = MIN_STRIPE,
    same_host_private: bool = False,
    everything: bool = False,
    on_phase: Callable[[str], None] | None = None,
) -> GlobalPlan:
    """This rank's view of the one global plan (see the module docstring for the rules).

    ``records[c]`` is the record of class ``c``; ``ndim``/``itemsize`` are indexed by checkpoint key
    index; ``global_ranks`` maps load-group ranks to world ranks (for group digests; default identity).
    ``same_host_private``: a shard whose holders all run on one host (the rows' host word) is read by
    each of them, from the one page cache they share, instead of broadcast.
    """
    lap = on_phase or (lambda name: None)
    world = len(rows)
    sizes = np.array([len(m) for m in cls.members], dtype=np.int64)
    n_per = [len(r.index) for r in records]
    width = records[0].offsets.shape[1] if records else 0
    cl = np.repeat(np.arange(len(records)), n_per)
    if records:
        index = np.concatenate([r.index for r in records]).astype(np.intp, copy=False)
        bc = np.concatenate([r.broadcastable for r in records])
        affinity = (np.concatenate([r.affinity if r.affinity is not None else np.full(len(r.index), -1, np.int64)
                                    for r in records])
                    if any(r.affinity is not None for r in records) else None)
        offsets = np.concatenate([r.offsets for r in records])  # int32 when every record fits it
        lengths = np.concatenate([r.lengths for r in records])
        requested = np.flatnonzero(np.bincount(np.concatenate([index, *[r.objects for r in records]]),
                                               minlength=len(ndim)))
    else:
        index = bc = np.zeros(0, dtype=np.int64)
        affinity = None
        offsets = lengths = np.zeros((0, width), dtype=np.int64)
        requested = np.zeros(0, dtype=np.int64)
    weights = itemsize[index].astype(np.int64)  # bytes of each shard: itemsize x its lengths (padding skipped)
    nd = ndim[index]
    for d in range(width):
        weights *= np.where(nd > d, lengths[:, d], 1)
    lap("records")

    # 1. identical shard keys across classes
    order, starts = _row_groups(np.column_stack([index, offsets, lengths]))
    ends = np.append(starts[1:], len(order))
    holders = np.add.reduceat(sizes[cl[order]], starts) if len(order) else np.zeros(0, dtype=np.int64)
    all_bc = np.logical_and.reduceat(bc[order], starts) if len(order) else np.zeros(0, dtype=bool)
    n_classes = ends - starts
    lap("group keys")

    # bytes each rank reads alone anyway: keys with exactly one holder rank
    loads = [0] * world
    single = holders == 1
    if np.any(single):
        first = order[starts[single]]
        per_class = np.bincount(cl[first], weights=weights[first], minlength=len(records))
        for c in np.flatnonzero(per_class):
            loads[int(cls.members[c][0])] += int(per_class[c])
    base = list(loads)
    # holders > 1 but private (not broadcastable / no group): every holder reads its own copy
    extra_private = np.zeros(len(records), dtype=np.int64)

    candidates = np.flatnonzero((holders >= 2) & all_bc) if broadcast else np.zeros(0, dtype=np.int64)
    shut = np.flatnonzero((holders >= 2) & ~all_bc) if broadcast else np.flatnonzero(holders >= 2)

    # 2. holder sets: a tuple of classes; members expanded once per distinct set. Groups are mapped to
    # their set by a signature of their classes (the class itself when there is one, else two
    # independent 64-bit sums of per-class random words), so Python touches each distinct set once.
    ranks_of = global_ranks if global_ranks is not None else range(world)
    set_ids: dict[tuple[int, ...], int] = {}
    sets: dict[int, HolderSet] = {}
    usable: dict[int, bool] = {}
    everyone = tuple(range(len(records)))

    def holder_set(classes: tuple[int, ...]) -> int:
        sid = set_ids.get(classes)
        if sid is not None:
            return sid
        if classes == everyone:
            sid = FULL
            sets[sid] = HolderSet(tuple(range(world)), False)
            usable[sid] = not (same_host_private and len(np.unique(rows[:, F_HOST])) == 1)
        else:
            sid = len(sets) + (FULL not in sets)  # 1, 2, ... in order of first use (FULL is 0)
            members = np.sort(np.concatenate([cls.members[c] for c in classes]))
            mt = tuple(int(x) for x in members)
            dg = group_digest([ranks_of[r] for r in mt])
            g = rows[members, F_GROUPS:]
            n = rows[members, F_NGROUPS]
            have = np.any((g == dg) & (np.arange(g.shape[1]) < n[:, None]), axis=1).all()
            sets[sid] = HolderSet(mt, not bool(have))
            usable[sid] = (bool(have) or can_create) and not (
                same_host_private and len(np.unique(rows[members, F_HOST])) == 1)
        set_ids[classes] = sid
        return sid

    class_of_row = cl[order]
    sid_of = np.zeros(len(candidates), dtype=np.int64)
    if len(candidates):
        words = _mix(np.arange(2 * len(records), dtype=np.uint64)).view(np.int64).reshape(2, len(records))
        with np.errstate(over="ignore"):
            sig = np.stack([np.add.reduceat(words[0][class_of_row], starts)[candidates],
                            np.add.reduceat(words[1][class_of_row], starts)[candidates],
                            n_classes[candidates]], axis=1)
        single = n_classes[candidates] == 1
        sig[single, 0] = class_of_row[starts[candidates[single]]]
        sig[single, 1] = -1
        first, inverse = _unique_rows(sig)
        sid_u = []
        for g in candidates[first].tolist():
            s_, e_ = int(starts[g]), int(ends[g])
            sid_u.append(holder_set(tuple(sorted(class_of_row[s_:e_].tolist()))))
        sid_of = np.asarray(sid_u, dtype=np.int64)[inverse.ravel()]
    ok = np.asarray([usable.get(x, False) for x in range(max(sets, default=-1) + 1)], dtype=bool)
    good = ok[sid_of] if len(candidates) else np.zeros(0, dtype=bool)

    # Loads couple reader choices only within a connected component of holder sets (sets sharing a
    # class); every decision this rank needs lies in its own component, which is all it computes
    # (``everything``: all components, for reporting).
    parent = list(range(len(records)))

    def find(c: int) -> int:
        while parent[c] != c:
            parent[c] = parent[parent[c]]
            c = parent[c]
        return c

    members_of = {sid: None for sid in sets}
    for classes, sid in set_ids.items():
        if usable[sid]:
            root = find(classes[0])
            for c in classes[1:]:
                rc = find(c)
                if rc != root:
                    parent[rc] = root
        members_of[sid] = classes
    my_class = int(cls.of_rank[me])
    if everything:
        in_mine = good
    else:
        mine_root = find(my_class)
        set_in_mine = np.asarray([members_of.get(x) is not None and find(members_of[x][0]) == mine_root
                                  for x in range(len(ok))], dtype=bool)
        in_mine = good & set_in_mine[sid_of] if len(candidates) else good

    # the shared shards it plans, as arrays over their rows: weight and holder set of each. Python keys
    # are built only for the shards this rank broadcasts and those of cut sets; the readers of the
    # others, on demand (GlobalPlan.readers)
    first_rows = order[starts[candidates[in_mine]]]
    w_rows = weights[first_rows]
    s_rows = sid_of[in_mine]

    def keys_of(rows: np.ndarray) -> list[ShardKey]:
        fr = first_rows[rows]
        return _keys(index[fr], offsets[fr], lengths[fr], ndim[index[fr]])

    # groups read by every holder: not broadcastable, or no usable group
    private_groups = np.concatenate([candidates[~good], shut])
    if len(private_groups):
        rws = np.repeat(private_groups, n_classes[private_groups])
        pos = _ranges(starts[private_groups], ends[private_groups])
        extra_private += np.bincount(class_of_row[pos], weights=weights[order[starts[rws]]],
                                     minlength=len(records)).astype(np.int64)
    lap("holder sets")

    # 3. readers: affinity, the greedy, then stream cutting of the sets the greedy cannot balance
    n_sid = max(sets, default=-1) + 1
    used = np.unique(s_rows).tolist()
    total = np.zeros(n_sid, dtype=np.int64)
    np.add.at(total, s_rows, w_rows)
    largest = np.zeros(n_sid, dtype=np.int64)
    np.maximum.at(largest, s_rows, w_rows)
    cut = [sid for sid in used if stripe and _cuts(int(total[sid]), int(largest[sid]), len(sets[sid].members), min_stripe)]
    is_cut = np.isin(s_rows, cut)
    reader_of = np.full(len(first_rows), -1, dtype=np.int64)
    load_arr = np.asarray(loads, dtype=np.int64)  # bytes per rank, updated by the greedy and the cuts
    if len(first_rows):  # largest first, ties by key: one lexsort over the rows the keys are built from
        by_size = np.lexsort([*_key_columns(index[first_rows], offsets[first_rows], lengths[first_rows]), -w_rows])
        greedy = by_size[~is_cut[by_size]]
        prefer = (affinity[first_rows].astype(np.int64, copy=False) if affinity is not None
                  else np.zeros(0, dtype=np.int64))
        cap = np.zeros(n_sid, dtype=np.int64)
        if np.any(prefer >= 0):  # a layout that names writers: within each component's cap (11/10 the mean)
            component = {sid: find(members_of[sid][0]) for sid in used}
            caps = _affinity_caps({sid: int(total[sid]) for sid in used}, sets, loads, component.__getitem__)
            for sid in used:
                cap[sid] = caps[component[sid]]
        else:
            prefer = np.zeros(0, dtype=np.int64)
        set_start = np.zeros(n_sid, dtype=np.int64)
        set_size = np.zeros(n_sid, dtype=np.int64)
        at = 0
        for sid in used:
            set_start[sid], set_size[sid] = at, len(sets[sid].members)
            at += len(sets[sid].members)
        flat_members = np.fromiter((r for sid in used for r in sets[sid].members), dtype=np.int64, count=at)
        reader_of = assign_readers(greedy, w_rows, s_rows, prefer, cap, set_start, set_size, flat_members, load_arr)
    # after the greedy: each cut set evens out its members' loads; its pieces as arrays (Python keys only
    # for the sets this rank is in)
    mine_sets = {sid for sid, s in sets.items() if contains(s.members, me)}
    cut_sets = [_CutSet(sid, np.flatnonzero(s_rows == sid), first_rows, index, offsets, lengths, ndim, w_rows)
                for sid in cut]
    for cs in cut_sets:
        members = np.asarray(sets[cs.sid].members, dtype=np.int64)
        sizes = _water_fill(load_arr[members].tolist(), int(cs.weight.sum()))
        cs.cut(members, sizes)
        np.add.at(load_arr, cs.reader, cs.piece_weight)
    loads = load_arr.tolist()
    for c in np.flatnonzero(extra_private):
        for r in cls.members[c]:
            loads[int(r)] += int(extra_private[c])
    whole = np.flatnonzero(~is_cut)
    bound = max(0, int(w_rows[whole].max()) if len(whole) else 0,
                max((int(cs.piece_weight.max()) for cs in cut_sets if len(cs.piece_weight)), default=0), *base)

    # what GlobalPlan.readers is built from, if it is read: only the component's rows (a kept plan must
    # not hold the W x S record rows of an R = 1 layout)
    fr = first_rows[whole]
    kept = (index[fr], offsets[fr], lengths[fr], ndim[index[fr]], reader_of[whole], cut_sets)

    def all_readers() -> dict[ShardKey, int]:
        idx, off, ln, nd, rd, cuts = kept
        out = dict(zip(_keys(idx, off, ln, nd), rd.tolist()))
        for c in cuts:
            out.update((p[0], p[4]) for p in c.pieces())
        return out

    lap("readers")

    # 4. this rank's broadcasts, in global order: its pieces in key order, batched per (set, reader)
    mine = whole[np.isin(s_rows[whole], list(mine_sets))]
    fm = first_rows[mine]
    mine = mine[np.lexsort(_key_columns(index[fm], offsets[fm], lengths[fm]))]
    mine_keys = keys_of(mine)
    pieces: dict[ShardKey, list[ShardKey]] = {k: [k] for k in mine_keys}
    p_keys, p_weight, p_set, p_reader = mine_keys, w_rows[mine], s_rows[mine], reader_of[mine]
    my_cut = [p for cs in cut_sets if cs.sid in mine_sets for p in cs.pieces()]
    if my_cut:  # (pk, weight, set, shard key, reader) of each piece, merged with the whole shards by key
        for pk, _, _, key, _ in my_cut:  # (a shard's pieces come in row order: key order)
            pieces.setdefault(key, []).append(pk)
        merged = sorted([*zip(mine_keys, p_weight.tolist(), p_set.tolist(), p_reader.tolist()),
                         *((pk, pw, sid, reader) for pk, pw, sid, _, reader in my_cut)], key=itemgetter(0))
        p_keys, *cols = zip(*merged)
        p_weight, p_set, p_reader = (np.array(c, dtype=np.int64) for c in cols)
    ops: list[Op] = []
    if p_keys:
        _, pair = _unique_rows(np.column_stack([p_set, p_reader]))
        op_of = batch_ops(pair.ravel().astype(np.int64), p_weight.astype(np.int64), batch_bytes, STAGING_ALIGN)
        by_op = np.argsort(op_of, kind="stable")  # pieces of each op together, in key order
        ends = np.cumsum(np.bincount(op_of)).tolist()
        keys_by_op = [p_keys[i] for i in by_op.tolist()]
        firsts = by_op[[0, *ends[:-1]]]
        at = 0
        for end, sid, reader in zip(ends, p_set[firsts].tolist(), p_reader[firsts].tolist()):
            ops.append(Op(sid, reader, tuple(keys_by_op[at:end])))
            at = end
    # every set some broadcast of the load uses, in any component: creating one is world-wide
    in_use = set(sid_of[good].tolist()) if len(candidates) else set()
    sets = {sid: s for sid, s in sets.items() if sid in in_use}
    lap("ops")
    return GlobalPlan(ops, pieces, sets, requested, all_readers, loads, bound)


def _cuts(total: int, largest: int, members: int, min_stripe: int) -> bool:
    """Whether a holder set is stream-cut: its mean share is at least ``min_stripe`` and its largest
    shard exceeds half of it (whole shards cannot balance it)."""
    share = total // members
    return share >= min_stripe and 2 * largest > share


def _affinity_caps(totals: dict[int, int], sets: dict, loads: list[int], component) -> dict[int, int]:
    """Per connected component of holder sets: the bytes a rank may reach by reading what it wrote,
    11/10 of the component's mean (its ranks' bytes so far plus every shared byte, over its ranks);
    ``totals``: the shared bytes of each holder set."""
    ranks: dict[int, set] = {}
    total: dict[int, int] = {}
    for sid, t in totals.items():
        c = component(sid)
        ranks.setdefault(c, set()).update(sets[sid].members)
        total[c] = total.get(c, 0) + t
    return {c: (total[c] + sum(loads[r] for r in rs)) * 11 // (10 * len(rs)) for c, rs in ranks.items()}


def _key_columns(index: np.ndarray, offsets: np.ndarray, lengths: np.ndarray) -> list[np.ndarray]:
    """The columns of record rows for ``np.lexsort`` (last one primary) in shard-key order: fqn index,
    then offsets, then lengths — the order of the keys' tuples (rows of one tensor share its rank)."""
    width = offsets.shape[1]
    return [*(lengths[:, k] for k in reversed(range(width))), *(offsets[:, k] for k in reversed(range(width))), index]


def _keys(index: np.ndarray, offsets: np.ndarray, lengths: np.ndarray, nd: np.ndarray) -> list[ShardKey]:
    """Shard keys (fqn index, offsets, lengths) of record rows, each cut to its tensor's rank ``nd``."""
    return list(zip(index.tolist(), _row_tuples(offsets, nd), _row_tuples(lengths, nd)))


def _row_tuples(a: np.ndarray, nd: np.ndarray) -> list[tuple[int, ...]]:
    """Row j of ``a`` cut to its first ``nd[j]`` columns, as a tuple of ints: one C conversion per
    distinct width (a shard key's offsets and lengths, built for every shared shard of a component)."""
    widths = np.unique(nd).tolist()
    if len(widths) == 1:
        return _tuples(a[:, : widths[0]])
    out: list = [None] * len(a)
    for n in widths:
        pos = np.flatnonzero(nd == n)
        for p, t in zip(pos.tolist(), _tuples(a[pos, :n])):
            out[p] = t
    return out


def _tuples(a: np.ndarray) -> list[tuple[int, ...]]:
    """The rows of 2-d ``a`` as tuples of ints (zipping its columns: no list per row on the way)."""
    if a.shape[1] == 0:
        return [()] * len(a)
    return list(zip(*a.T.tolist()))


def _unique_rows(a: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``np.unique(a, axis=0, return_index=True, return_inverse=True)[1:]`` of an int matrix, by one
    lexsort (the row-wise unique views rows as records: ~10x slower on thousands of rows)."""
    n = len(a)
    order = np.lexsort(a.T[::-1])  # column 0 first; stable, so each run starts at its lowest row
    s = a[order]
    new = np.ones(n, dtype=bool)
    new[1:] = np.any(s[1:] != s[:-1], axis=1)
    inverse = np.empty(n, dtype=np.intp)
    inverse[order] = np.cumsum(new) - 1
    return order[new], inverse


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64 of each element: fixed pseudo-random words, the same on every rank and numpy version."""
    with np.errstate(over="ignore"):
        z = (x + np.uint64(1)) * np.uint64(0x9E3779B97F4A7C15)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return z ^ (z >> np.uint64(31))


def _ranges(lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
    """The concatenation of ``arange(lo[i], hi[i])`` over ``i``, vectorised."""
    n = hi - lo
    return np.repeat(hi - np.cumsum(n), n) + np.arange(int(n.sum()))


def contains(members: Sequence[int], r: int) -> bool:
    """Whether ``r`` is in the ascending ``members`` (binary search: sets can hold thousands of ranks)."""
    i = bisect.bisect_left(members, r)
    return i < len(members) and members[i] == r
