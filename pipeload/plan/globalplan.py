"""The global load plan: who reads each shared shard, how large ones are cut, and this rank's broadcasts.

A pure function of the exchanged rows and distinct records (:mod:`pipeload.plan.exchange`), evaluated by
every rank on the same data, so every rank takes the same decisions without talking; if two ranks
disagreed on a reader, each would wait for the other's broadcast forever. Nothing here depends on the
order of items inside any rank's record (tested with permutations).

Cost per rank, with ``W`` ranks, ``D`` distinct records (``D = W / R`` for replication ``R``), ``S``
shards per record and ``P`` shared pieces after striping:

- grouping identical shard keys across the ``D x S`` record rows: vectorised (numpy hashing and one
  sort), the only step that stays ``O(W x S)`` when ``R = 1`` — and then nothing is shared, so it is
  also the last;
- reader choice: ``O(P log R)`` with one heap per distinct holder set (a holder set is a union of
  record classes, expanded to ranks once per distinct set), over arrays in :mod:`pipeload.plan._greedy`;
  stream cutting is ``O(P + R)`` per set;
- this rank's broadcasts: ``O(P_mine log P_mine)``, the pieces whose holder set contains it. Python
  objects (shard keys) are built only for those and for cut sets; ``GlobalPlan.readers`` (every piece
  of the component) is built when first read.

The plan is a pipeline of pure steps, each a function below (:func:`global_plan` runs them in order):

1. :func:`shard_columns` and :func:`group_keys`: the records' shards as columns, identical keys grouped
   across classes; :func:`pipeload.plan.chunkunits.find_units` and :func:`unit_sets`: stored chunks
   several classes need different parts of, each read once as a *chunk unit* (only when some row says a
   box of its rank is not one stored chunk); :func:`alone_loads` and :func:`private_bytes`: bytes no
   broadcast can save;
2. :func:`holder_sets` (into a :class:`SetTable`), :func:`components`, :func:`in_component`: the holder
   set of each shared key and the part of the plan this rank must compute (:func:`shared_rows`);
3. :func:`choose_readers` (affinity, then the greedy) and :func:`cut_streams`;
4. :func:`rank_pieces` and :func:`batch`: this rank's broadcasts in the one global order.

Steps 3-4 are :func:`plan_component`, which :mod:`pipeload.plan.keyowners` also calls with the shared rows
it found without every record (``R = 1`` layouts).

Rules (DESIGN.md, "Global plan"):

- a shard is *shared* when two or more ranks hold it, every holder reported it broadcastable, and its
  holder set has a process group (the load's own, one every member can reuse, or one the load may
  create) — and, under the host-aware policy (``same_host_private``), its holders are not all on one
  host;
- readers: shared shards by bytes, largest first (ties by key), each to the holder with the fewest
  bytes so far, ties to the lower rank; starting loads are the bytes each rank reads alone anyway —
  exactly :func:`pipeload.plan.balance.assign`, the rule the saver used to pick writers (so an unchanged
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
- **chunk units** (:mod:`pipeload.plan.chunkunits`): a unit is one more shared row, keyed (``-1 - fqn
  index``, chunk offsets, chunk lengths), held by every class needing part of its chunk; the greedy,
  cutting (at most one member per ``UNIT_STRIPE`` bytes of a set holding units) and batching treat it
  as a shard, so it cannot deadlock for the reason shards cannot: its holder set is derived from data
  every rank holds, its broadcasts sit at positions of the one order every member computes alike;
- **storage position** (:mod:`pipeload.plan.storageorder`, files no rank wrote): the records'
  affinities are the ranks whose equal share of the files' bytes holds each shard, honoured as a named
  writer is; a unit takes the affinity of the first row touching it (a strided box's is its chunk's);
  for other layouts when boxes cut stored chunks (``starts``), each holder set's rows in storage order are
  cut into one run per member, and a row's run member is its affinity (:func:`storageorder.runs`);
- order: pieces sorted by (fqn index, offsets, lengths) — by storage position, by (offset inside the
  region, key) or, by runs, (offset inside the run, key), so that every reader reads at once; pieces under ``batch_bytes`` join the pending
  batch of their (holder set, reader), which is sent at the position of the piece that fills it; the
  batches left at the end follow in the order of their first piece.
"""

from __future__ import annotations

import bisect
import hashlib
from dataclasses import dataclass
from operator import itemgetter
from typing import Callable, Iterable, NamedTuple, Sequence

import numpy as np

from ._greedy import assign_readers, batch_ops, cut_stream
from .chunkunits import ChunkTable, Touch, encode, find_units
from .storageorder import interleaved, runs
from .exchange import F_FLAGS, F_GROUPS, F_HOST, F_NGROUPS, FLAG_RESHARDED, Classes, Record, group_digest

ShardKey = tuple[int, tuple[int, ...], tuple[int, ...]]
STAGING_ALIGN = 64  # byte alignment of each shard inside a staging buffer (any dtype can view it)
MIN_STRIPE = 1 << 20  # a holder set whose mean share is smaller is never cut
UNIT_STRIPE = 32 << 20  # a set holding chunk units is cut among at most (its bytes / this) members
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
    # global_plan(reads=True) only: every box every rank of the load reads (see every_read); else None
    every: Callable[[], list] | None = None

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


def _water_fill(loads, total: int) -> np.ndarray:
    """Bytes to add to each of ``loads`` (int64 array-like) so that the busiest ends as low as possible
    (sum = ``total``): the k + 1 lowest are raised together to the next load until what is left does not
    reach it, then to ``level``; the rounding remainder goes to the lowest (ties: the first). In numpy:
    a set can have every rank of a 16k-rank load as members."""
    a = np.asarray(loads, dtype=np.int64)
    order = np.argsort(a, kind="stable")
    s = a[order]
    need = (s[1:] - s[:-1]) * np.arange(1, len(s), dtype=np.int64)  # raising the k + 1 lowest to the next
    spent = np.concatenate(([0], np.cumsum(need)))
    hit = np.flatnonzero(need >= total - spent[:-1])
    k = int(hit[0]) if len(hit) else len(s) - 1  # (the last step has no next load: it takes the rest)
    level = int(s[k]) + (total - int(spent[k])) / (k + 1)
    add = np.maximum(0, np.trunc(level - a.astype(np.float64))).astype(np.int64)
    add[order[0]] += total - int(add.sum())
    return add


class _CutSet:
    """The shards of one stream-cut holder set (rows of a :class:`Shared`, in key order) and, once
    :meth:`cut`, its pieces as arrays: shard, row range, weight, reader
    (:func:`pipeload.plan._greedy.cut_stream`)."""

    def __init__(self, sid: int, sh: "Shared", rows: np.ndarray):
        rows = rows[np.lexsort(_key_columns(sh.index[rows], sh.offsets[rows], sh.lengths[rows]))]
        width = sh.offsets.shape[1]
        self.sid = sid
        self.row_ids = rows  # rows of the Shared table, in key order
        self.index, self.offsets, self.lengths = sh.index[rows], sh.offsets[rows], sh.lengths[rows]
        self.ndim = sh.nd[rows]
        self.weight = sh.weight[rows].astype(np.int64, copy=False)
        self.rows = (np.where(self.ndim > 0, self.lengths[:, 0], 0).astype(np.int64) if width
                     else np.zeros(len(rows), dtype=np.int64))

    def cut(self, members: np.ndarray, sizes: list[int]) -> None:
        self.shard, self.r0, self.r1, seg = cut_stream(self.weight, self.rows, np.asarray(sizes, dtype=np.int64))
        rows = self.rows[self.shard]
        w = self.weight[self.shard]
        self.whole = (self.r0 == 0) & (self.r1 == rows)
        self.piece_weight = np.where(self.whole, w, (self.r1 - self.r0) * (w // np.maximum(rows, 1)))
        self.reader = members[seg]

    def pieces(self) -> list[tuple[ShardKey, int, int, ShardKey, int]]:
        """(piece key, weight, set, shard key, reader) of every piece (built on each call, not kept: a
        kept plan holds only the arrays)."""
        keys = _keys(self.index, self.offsets, self.lengths, self.ndim)
        index, off, ln, nd, reader = self.piece_columns()
        return list(zip(_keys(index, off, ln, nd), self.piece_weight.tolist(), [self.sid] * len(index),
                        [keys[i] for i in self.shard.tolist()], reader.tolist()))

    def piece_columns(self) -> tuple[np.ndarray, ...]:
        """(index, offsets, lengths, nd, reader) of every piece: a row range of its shard moves and
        shortens the first dimension."""
        j = self.shard
        off, ln = self.offsets[j].copy(), self.lengths[j].copy()
        if off.shape[1]:
            cut = ~self.whole
            off[cut, 0] += self.r0[cut]
            ln[cut, 0] = (self.r1 - self.r0)[cut]
        return self.index[j], off, ln, self.ndim[j], self.reader


# -- the pipeline: each step a pure function of the steps before it --------------------------------------


class Shards(NamedTuple):
    """Every distinct record's shards as columns: row ``i`` is a shard of record (class) ``cl[i]``."""

    cl: np.ndarray  # class of each row
    index: np.ndarray  # checkpoint key index
    bc: np.ndarray  # its holder reported it broadcastable
    affinity: np.ndarray | None  # the writer the layout names, -1 none (None: no record names one)
    offsets: np.ndarray  # (n, width), zero-padded
    lengths: np.ndarray
    nd: np.ndarray  # the tensor's rank
    weight: np.ndarray  # bytes: itemsize x the product of the lengths (padding skipped)
    requested: np.ndarray  # checkpoint key indices some record asks for (shards and objects), ascending


def shard_columns(records: Sequence[Record], ndim: np.ndarray, itemsize: np.ndarray) -> Shards:
    """Step 1a: the records concatenated in class order (class ``c``'s rows are contiguous, its own
    order kept). ``ndim``/``itemsize`` are indexed by checkpoint key index."""
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
    return Shards(cl, index, bc, affinity, offsets, lengths, ndim[index], shard_weights(index, lengths, ndim, itemsize),
                  requested)


def shard_weights(index: np.ndarray, lengths: np.ndarray, ndim: np.ndarray, itemsize: np.ndarray) -> np.ndarray:
    """Bytes of each shard row: itemsize x its lengths over its tensor's rank (zero padding skipped)."""
    weights = itemsize[index].astype(np.int64)
    nd = ndim[index]
    for d in range(lengths.shape[1]):
        weights *= np.where(nd > d, lengths[:, d], 1)
    return weights


class KeyGroups(NamedTuple):
    """Rows holding one shard key: ``order[starts[g]:ends[g]]`` are the rows of group ``g``, in row
    order (lowest class first); groups in no particular order."""

    order: np.ndarray
    starts: np.ndarray
    ends: np.ndarray
    holders: np.ndarray  # ranks holding the key (the sizes of its classes, summed)
    all_bc: np.ndarray  # every holder reported it broadcastable
    n_classes: np.ndarray  # classes holding it (rows of the group)


def group_keys(sh: Shards, sizes: np.ndarray) -> KeyGroups:
    """Step 1b: identical shard keys across classes (``sizes``: ranks per class). Vectorised; the only
    step that stays O(W x S) when R = 1."""
    order, starts = _row_groups(np.column_stack([sh.index, sh.offsets, sh.lengths]))
    ends = np.append(starts[1:], len(order))
    holders = np.add.reduceat(sizes[sh.cl[order]], starts) if len(order) else np.zeros(0, dtype=np.int64)
    all_bc = np.logical_and.reduceat(sh.bc[order], starts) if len(order) else np.zeros(0, dtype=bool)
    return KeyGroups(order, starts, ends, holders, all_bc, ends - starts)


def alone_loads(sh: Shards, kg: KeyGroups, cls: Classes, world: int, skip: np.ndarray | None = None) -> list[int]:
    """Bytes each rank reads alone anyway: the keys only it holds (a one-rank class), but the groups
    ``skip`` marks (covered by chunk units, whose bytes the units' readers count). These are the
    starting loads of the greedy, the same on every rank."""
    loads = [0] * world
    single = kg.holders == 1
    if skip is not None:
        single &= ~skip
    if np.any(single):
        first = kg.order[kg.starts[single]]
        per_class = np.bincount(sh.cl[first], weights=sh.weight[first], minlength=len(cls.members))
        for c in np.flatnonzero(per_class):
            loads[int(cls.members[c][0])] += int(per_class[c])
    return loads


def private_bytes(sh: Shards, kg: KeyGroups, groups: np.ndarray, n_classes: int) -> np.ndarray:
    """Per class, the bytes each of its ranks reads of the key ``groups`` (held by several ranks but
    not shared: not broadcastable, or no usable group): every holder reads its own copy."""
    extra = np.zeros(n_classes, dtype=np.int64)
    if len(groups):
        rws = np.repeat(groups, kg.n_classes[groups])
        pos = _ranges(kg.starts[groups], kg.ends[groups])
        extra += np.bincount(sh.cl[kg.order[pos]], weights=sh.weight[kg.order[kg.starts[rws]]],
                             minlength=n_classes).astype(np.int64)
    return extra


def set_signature(classes: Sequence[int], n_records: int) -> tuple[int, int, int]:
    """The signature of a holder set (its classes, ascending), as :func:`set_signatures` computes it for
    key groups: the class itself for one class, else two independent 64-bit sums of per-class random
    words. Sets are numbered in ascending signature order, which no rank needs the other sets for."""
    if len(classes) == 1:
        return int(classes[0]), -1, 1
    words = _class_words(n_records)
    c = np.asarray(classes, dtype=np.intp)
    with np.errstate(over="ignore"):
        return int(words[0][c].sum()), int(words[1][c].sum()), len(c)


def _class_words(n_records: int) -> np.ndarray:
    return _mix(np.arange(2 * n_records, dtype=np.uint64)).view(np.int64).reshape(2, n_records)


def set_signatures(kg: KeyGroups, class_of_row: np.ndarray, groups: np.ndarray, n_records: int) -> np.ndarray:
    """(len(groups), 3) int64: :func:`set_signature` of each key group's classes, vectorised
    (``class_of_row``: the class of each row of ``kg.order``)."""
    words = _class_words(n_records)
    with np.errstate(over="ignore"):
        sig = np.stack([np.add.reduceat(words[0][class_of_row], kg.starts)[groups],
                        np.add.reduceat(words[1][class_of_row], kg.starts)[groups], kg.n_classes[groups]], axis=1)
    single = kg.n_classes[groups] == 1
    sig[single, 0] = class_of_row[kg.starts[groups[single]]]
    sig[single, 1] = -1
    return sig


class SetTable:
    """Holder sets by id: ``FULL`` (0) for every class, then 1, 2, ... in the order :meth:`add` meets
    them (ascending signature in :func:`holder_sets`); members expanded once per set. Whether a set is
    *usable* (a group exists or may be made, and, under the host-aware policy, not all on one host)
    and must be *created* are functions of the gathered rows alone."""

    def __init__(self, rows: np.ndarray, cls: Classes, *, can_create: bool, global_ranks=None,
                 same_host_private: bool = False):
        self.rows, self.cls, self.can_create, self.same_host_private = rows, cls, can_create, same_host_private
        self.ranks_of = global_ranks if global_ranks is not None else range(len(rows))
        self.sets: dict[int, HolderSet] = {}
        self.usable: dict[int, bool] = {}
        self.classes: dict[int, tuple[int, ...]] = {}
        self.ids: dict[tuple[int, ...], int] = {}

    def add(self, classes: tuple[int, ...], sid: int | None = None) -> int:
        """The id of the set of ``classes`` (ascending), made on first sight (``sid``: the id to give it)."""
        got = self.ids.get(classes)
        if got is not None:
            return got
        rows = self.rows
        if len(classes) == len(self.cls.members):
            sid = FULL
            self.sets[sid] = HolderSet(tuple(range(len(rows))), False)
            self.usable[sid] = not (self.same_host_private and len(np.unique(rows[:, F_HOST])) == 1)
        else:
            sid = sid if sid is not None else len(self.sets) + (FULL not in self.sets)
            members = np.sort(np.concatenate([self.cls.members[c] for c in classes]))
            mt = tuple(int(x) for x in members)
            dg = group_digest([self.ranks_of[r] for r in mt])
            g = rows[members, F_GROUPS:]
            n = rows[members, F_NGROUPS]
            have = bool(np.any((g == dg) & (np.arange(g.shape[1]) < n[:, None]), axis=1).all())
            self.sets[sid] = HolderSet(mt, not have)
            self.usable[sid] = (have or self.can_create) and not (
                self.same_host_private and len(np.unique(rows[members, F_HOST])) == 1)
        self.ids[classes] = sid
        self.classes[sid] = classes
        return sid

    def ok(self) -> np.ndarray:
        """Usable, by set id (ids never given are not)."""
        return np.asarray([self.usable.get(x, False) for x in range(max(self.sets, default=-1) + 1)], dtype=bool)


def holder_sets(table: SetTable, kg: KeyGroups, class_of_row: np.ndarray, candidates: np.ndarray) -> np.ndarray:
    """Step 2: the holder set id of each candidate key group (``table`` gains the sets). Groups are
    mapped to sets by signature, so Python touches each distinct set once; sets are numbered in
    ascending signature order (``FULL`` is 0), a pure function of the sets that occur."""
    if not len(candidates):
        return np.zeros(0, dtype=np.int64)
    sig = set_signatures(kg, class_of_row, candidates, len(table.cls.members))
    first, inverse = _unique_rows(sig)
    sid_u = [table.add(tuple(sorted(class_of_row[kg.starts[g]:kg.ends[g]].tolist())))
             for g in candidates[first].tolist()]
    return np.asarray(sid_u, dtype=np.int64)[inverse.ravel()]


def components(table: SetTable) -> Callable[[int], int]:
    """Step 2b: the connected components of classes joined by usable holder sets, as ``find(class)``
    -> a root class. Loads couple reader choices only within one component, so every decision a rank
    needs lies in its own."""
    parent = list(range(len(table.cls.members)))

    def find(c: int) -> int:
        while parent[c] != c:
            parent[c] = parent[parent[c]]
            c = parent[c]
        return c

    for classes, sid in table.ids.items():
        if table.usable[sid]:
            root = find(classes[0])
            for c in classes[1:]:
                rc = find(c)
                if rc != root:
                    parent[rc] = root
    return find


def in_component(table: SetTable, find, my_class: int, sid_of: np.ndarray, good: np.ndarray) -> np.ndarray:
    """Of the usable candidate groups (``good``), those whose holder set lies in ``my_class``'s component."""
    if not len(sid_of):
        return good
    root = find(my_class)
    n = max(table.sets, default=-1) + 1
    set_in = np.asarray([x in table.classes and find(table.classes[x][0]) == root for x in range(n)], dtype=bool)
    return good & set_in[sid_of]


class Shared(NamedTuple):
    """The shared shards a rank plans, one row each: key columns, bytes, holder set and the writer its
    lowest holder class names (``prefer``; None: no record names one)."""

    index: np.ndarray
    offsets: np.ndarray
    lengths: np.ndarray
    nd: np.ndarray
    weight: np.ndarray
    sid: np.ndarray
    prefer: np.ndarray | None


def shared_rows(sh: Shards, kg: KeyGroups, groups: np.ndarray, sid: np.ndarray) -> Shared:
    """The key ``groups`` (with holder set ``sid`` each) as :class:`Shared` rows, read from each group's
    first row (its lowest class)."""
    fr = kg.order[kg.starts[groups]]
    return Shared(sh.index[fr], sh.offsets[fr], sh.lengths[fr], sh.nd[fr], sh.weight[fr], sid,
                  sh.affinity[fr] if sh.affinity is not None else None)


def unit_sets(table: SetTable, touch: Touch | None, n_groups: int) -> tuple[np.ndarray, np.ndarray]:
    """Step 1c: (holder set id of each unit, -1 where its set is not usable; which key groups a usable
    unit covers). Units' sets are made first, in unit order (ascending chunk row): a pure function of
    the units."""
    covered = np.zeros(n_groups, dtype=bool)
    if touch is None:
        return np.zeros(0, dtype=np.int64), covered
    sid = np.array([table.add(k) for k in touch.classes], dtype=np.int64)
    ok = table.ok()[sid]
    sid[~ok] = -1
    covered[touch.pair_group[ok[touch.pair_unit]]] = True
    return sid, covered


def with_units(s: Shared, touch: Touch, mine: np.ndarray, sid: np.ndarray, ndim: np.ndarray,
               itemsize: np.ndarray, affinity: np.ndarray | None = None) -> Shared:
    """The shared rows ``s`` and, after them, the units ``mine`` selects as rows keyed
    (``-1 - index``, chunk offsets, chunk lengths) (see :mod:`pipeload.plan.chunkunits`); a unit prefers
    the rank the shard columns' ``affinity`` names for the first row touching it."""
    pick = np.flatnonzero(mine)
    if not len(pick):
        return s
    idx = touch.index[pick]
    width = s.offsets.shape[1]
    off, ln = touch.offsets[pick], touch.lengths[pick]
    if off.shape[1] != width:
        off, ln = (np.pad(a[:, :width], ((0, 0), (0, max(0, width - a.shape[1])))) for a in (off, ln))
    nd = ndim[idx]
    weight = itemsize[idx].astype(np.int64)
    for d in range(width):
        weight *= np.where(nd > d, ln[:, d], 1)
    mine_prefer = affinity[touch.row[pick]] if affinity is not None else np.full(len(pick), -1, np.int64)
    prefer = (None if s.prefer is None and affinity is None else
              np.concatenate([s.prefer if s.prefer is not None else np.full(len(s.index), -1, np.int64), mine_prefer]))
    return Shared(np.concatenate([s.index, encode(idx)]), np.concatenate([s.offsets, off]),
                  np.concatenate([s.lengths, ln]), np.concatenate([s.nd, nd]), np.concatenate([s.weight, weight]),
                  np.concatenate([s.sid, sid[pick]]), prefer)


def _preferences(s: Shared, used: list[int], total: np.ndarray, sets: dict, loads: list[int],
                 component_of: Callable[[int], int]) -> tuple[np.ndarray, np.ndarray]:
    """(prefer, cap) for :func:`pipeload.plan._greedy.assign_readers`: each row's named writer and each
    set's cap (11/10 of its component's mean); empty ``prefer`` when no row names a writer."""
    cap = np.zeros(len(total), dtype=np.int64)
    prefer = s.prefer.astype(np.int64, copy=False) if s.prefer is not None else np.zeros(0, dtype=np.int64)
    if not np.any(prefer >= 0):
        return np.zeros(0, dtype=np.int64), cap
    component = {sid: component_of(sid) for sid in used}
    caps = _affinity_caps({sid: int(total[sid]) for sid in used}, sets, loads, component.__getitem__)
    for sid in used:
        cap[sid] = caps[component[sid]]
    return prefer, cap


def choose_readers(s: Shared, sets: dict[int, HolderSet], loads: list[int], component_of: Callable[[int], int],
                   *, stripe: bool, min_stripe: int) -> tuple[np.ndarray, np.ndarray, list[int], np.ndarray]:
    """Step 3: (reader of each row, -1 for rows of cut sets; which rows are in cut sets; the cut set
    ids, ascending; bytes per rank after the greedy). Shards by bytes, largest first (ties by key),
    affinity within its cap first, then each to its set's least loaded member (ties to the lower rank),
    starting from ``loads``: :func:`pipeload.plan.balance.assign`. Independent of the rows' order."""
    n_sid = max(sets, default=-1) + 1
    used = np.unique(s.sid).tolist()
    total = np.zeros(n_sid, dtype=np.int64)
    np.add.at(total, s.sid, s.weight)
    largest = np.zeros(n_sid, dtype=np.int64)
    np.maximum.at(largest, s.sid, s.weight)
    cut = [sid for sid in used
           if stripe and _cuts(int(total[sid]), int(largest[sid]), len(sets[sid].members), min_stripe)]
    is_cut = np.isin(s.sid, cut)
    reader_of = np.full(len(s.sid), -1, dtype=np.int64)
    load_arr = np.asarray(loads, dtype=np.int64)
    if len(s.sid):  # largest first, ties by key: one lexsort over the rows the keys are built from
        by_size = np.lexsort([*_key_columns(s.index, s.offsets, s.lengths), -s.weight])
        greedy = by_size[~is_cut[by_size]]
        prefer, cap = _preferences(s, used, total, sets, loads, component_of)
        set_start = np.zeros(n_sid, dtype=np.int64)
        set_size = np.zeros(n_sid, dtype=np.int64)
        at = 0
        for sid in used:
            set_start[sid], set_size[sid] = at, len(sets[sid].members)
            at += len(sets[sid].members)
        flat = np.fromiter((r for sid in used for r in sets[sid].members), dtype=np.int64, count=at)
        reader_of = assign_readers(greedy, s.weight, s.sid, prefer, cap, set_start, set_size, flat, load_arr)
    return reader_of, is_cut, cut, load_arr


def cut_streams(s: Shared, cut: list[int], sets: dict[int, HolderSet], load_arr: np.ndarray) -> list[_CutSet]:
    """Step 3b: after the greedy, each cut set in ascending id: its shards in key order form one byte
    stream cut at row boundaries into one contiguous segment per member, sized (water filling) to even
    out the members' loads; ``load_arr`` gains the pieces' bytes."""
    out = []
    for sid in cut:
        cs = _CutSet(sid, s, np.flatnonzero(s.sid == sid))
        members = np.asarray(sets[sid].members, dtype=np.int64)
        total = int(cs.weight.sum())
        if len(members) > 1 and np.any(cs.index < 0) and len(members) * UNIT_STRIPE > total:
            # a set holding chunk units (every rank needing part of a chunk: often the whole load) is cut
            # into pieces of about UNIT_STRIPE read by its least loaded members (ties to the lower rank):
            # each piece is a broadcast to the whole set, and thousands of tiny ones cost more than they balance
            k = max(1, total // UNIT_STRIPE)
            members = np.sort(members[np.lexsort((members, load_arr[members]))[:k]])
        cs.cut(members, _water_fill(load_arr[members], total))
        np.add.at(load_arr, cs.reader, cs.piece_weight)
        out.append(cs)
    return out


def rank_pieces(s: Shared, reader_of: np.ndarray, whole: np.ndarray, cut_sets: list[_CutSet], mine_sets: set[int],
                run_offset: np.ndarray | None = None):
    """Step 4a: this rank's pieces (of the sets it is in), in key order, as (keys, weight, set, reader)
    columns, and each of its shared shards -> its pieces (one, itself, unless cut; in row order).
    ``run_offset`` (per row, :func:`pipeload.plan.storageorder.runs`): the pieces are then ordered by
    (offset inside the reader's run, key); a piece of a cut shard takes its shard's offset plus its rows'."""
    mine = whole[np.isin(s.sid[whole], list(mine_sets))]
    mine = mine[np.lexsort(_key_columns(s.index[mine], s.offsets[mine], s.lengths[mine]))]
    mine_keys = _keys(s.index[mine], s.offsets[mine], s.lengths[mine], s.nd[mine])
    pieces: dict[ShardKey, list[ShardKey]] = {k: [k] for k in mine_keys}
    cols = mine_keys, s.weight[mine], s.sid[mine], reader_of[mine]
    off = run_offset[mine] if run_offset is not None else np.zeros(len(mine), dtype=np.int64)
    my_cut = []  # (pk, weight, set, shard key, reader, offset) of each piece of a cut shard
    for cs in cut_sets:
        if cs.sid in mine_sets:
            for (pk, pw, sid, key, reader), j in zip(cs.pieces(), cs.shard.tolist()):
                o = 0 if run_offset is None else int(run_offset[cs.row_ids[j]])
                if run_offset is not None and pk != key:  # a row range: the rows before it in its shard
                    o += (pk[1][0] - key[1][0]) * (pw // max(1, pk[2][0]))
                my_cut.append((pk, pw, sid, key, reader, o))
    if my_cut:  # merged with the whole shards by key
        for pk, _, _, key, _, _ in my_cut:  # (a shard's pieces come in row order: key order)
            pieces.setdefault(key, []).append(pk)
        merged = sorted([*zip(mine_keys, cols[1].tolist(), cols[2].tolist(), cols[3].tolist(), off.tolist()),
                         *((pk, pw, sid, reader, o) for pk, pw, sid, _, reader, o in my_cut)], key=itemgetter(0))
        p_keys, *rest = zip(*merged)
        cols = (p_keys, *(np.array(c, dtype=np.int64) for c in rest[:3]))
        off = np.array(rest[3], dtype=np.int64)
    if run_offset is not None and len(off):  # key order already: a stable sort by offset is (offset, key)
        order = np.argsort(off, kind="stable")
        cols = ([cols[0][j] for j in order.tolist()], *(np.asarray(c)[order] for c in cols[1:]))
    return cols, pieces


def batch(p_keys, p_weight, p_set, p_reader, batch_bytes: int) -> list[Op]:
    """Step 4b: pieces (in key order) into broadcasts in the one global order: pieces under
    ``batch_bytes`` join the open batch of their (set, reader), sent at the position of the piece that
    fills it; batches left open follow in the order of their first piece (:func:`batch_ops`)."""
    ops: list[Op] = []
    if not p_keys:
        return ops
    _, pair = _unique_rows(np.column_stack([p_set, p_reader]))
    op_of = batch_ops(pair.ravel().astype(np.int64), np.asarray(p_weight, dtype=np.int64), batch_bytes, STAGING_ALIGN)
    by_op = np.argsort(op_of, kind="stable")  # pieces of each op together, in key order
    ends = np.cumsum(np.bincount(op_of)).tolist()
    keys_by_op = [p_keys[i] for i in by_op.tolist()]
    firsts = by_op[[0, *ends[:-1]]]
    at = 0
    for end, sid, reader in zip(ends, np.asarray(p_set)[firsts].tolist(), np.asarray(p_reader)[firsts].tolist()):
        ops.append(Op(sid, reader, tuple(keys_by_op[at:end])))
        at = end
    return ops


class _Readers:
    """Builds ``GlobalPlan.readers`` when first asked; keeps only the component's rows as arrays (a kept
    plan must not hold the W x S record rows of an R = 1 layout, nor a key object per piece)."""

    def __init__(self, s: Shared, reader_of: np.ndarray, whole: np.ndarray, cut_sets: list[_CutSet]):
        self.whole = (s.index[whole], s.offsets[whole], s.lengths[whole], s.nd[whole], reader_of[whole])
        self.cut_sets = cut_sets

    def columns(self) -> tuple[np.ndarray, ...]:
        """(index, offsets, lengths, nd, reader) of every piece of the component: whole shards, then the
        cut sets' pieces."""
        parts = [self.whole, *(c.piece_columns() for c in self.cut_sets)]
        return tuple(np.concatenate([p[i] for p in parts]) for i in range(5))

    def __call__(self) -> dict[ShardKey, int]:
        idx, off, ln, nd, rd = self.columns()
        return dict(zip(_keys(idx, off, ln, nd), rd.tolist()))


def plan_component(s: Shared, sets: dict[int, HolderSet], loads: list[int], extra: np.ndarray, me: int, *,
                   component_of: Callable[[int], int], requested: np.ndarray, in_use: set[int], stripe: bool,
                   min_stripe: int, batch_bytes: int, lap=lambda name: None, positions: tuple | None = None,
                   starts: Callable | None = None) -> GlobalPlan:
    """Steps 3-4 for the shared rows ``s`` of one rank's component: readers, cutting, this rank's
    broadcasts. ``loads``: bytes each rank reads alone; ``extra``: per rank, bytes of private copies it
    reads (reported in ``loads`` only); ``in_use``: the set ids some broadcast of the load uses.
    ``starts`` (:func:`pipeload.plan.storageorder.box_starts`): readers by runs of each holder set in
    storage order (:func:`pipeload.plan.storageorder.runs`), broadcasts by offset inside the runs. Every
    rank of a component, given the same rows in any order, returns the same decisions."""
    run_offset = None
    if starts is not None and len(s.sid):
        prefer, run_offset = runs(s.sid, s.weight, starts(s.index, s.offsets, s.lengths),
                                  _key_columns(s.index, s.offsets, s.lengths),
                                  {sid: sets[sid].members for sid in np.unique(s.sid).tolist()},
                                  np.asarray(loads, dtype=np.int64), _water_fill)
        s = s._replace(prefer=prefer)
    reader_of, is_cut, cut, load_arr = choose_readers(s, sets, loads, component_of, stripe=stripe,
                                                      min_stripe=min_stripe)
    cut_sets = cut_streams(s, cut, sets, load_arr)
    whole = np.flatnonzero(~is_cut)
    bound = max(0, int(s.weight[whole].max()) if len(whole) else 0,
                max((int(cs.piece_weight.max()) for cs in cut_sets if len(cs.piece_weight)), default=0),
                max(loads, default=0))
    final = (load_arr + np.asarray(extra, dtype=np.int64)).tolist() if len(load_arr) else []
    readers = _Readers(s, reader_of, whole, cut_sets)
    lap("readers")
    mine_sets = {sid for sid, hs in sets.items() if contains(hs.members, me)}
    cols, pieces = rank_pieces(s, reader_of, whole, cut_sets, mine_sets, run_offset)
    if positions is not None:
        cols = interleaved(cols[0], cols[1:], positions, len(loads))
    ops = batch(*cols, batch_bytes)
    lap("ops")
    return GlobalPlan(ops, pieces, {sid: hs for sid, hs in sets.items() if sid in in_use}, requested, readers,
                      final, bound)


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
    chunks: ChunkTable | None = None,
    positions: tuple | None = None,
    starts: Callable | None = None,
    reads: bool = False,
) -> GlobalPlan:
    """This rank's view of the one global plan (see the module docstring for the rules): the steps
    above, in order.

    ``records[c]`` is the record of class ``c``; ``ndim``/``itemsize`` are indexed by checkpoint key
    index; ``global_ranks`` maps load-group ranks to world ranks (for group digests; default identity).
    ``same_host_private``: a shard whose holders all run on one host (the rows' host word) is read by
    each of them, from the one page cache they share, instead of broadcast. ``everything``: plan every
    component (for reporting), not only this rank's. ``chunks``: the checkpoint's chunk table
    (:func:`pipeload.plan.chunkunits.chunk_table`); without it no chunk unit is planned. ``positions``
    (:func:`pipeload.plan.storageorder.key_positions`): the records' affinities are storage regions,
    and the broadcasts go in region order. ``starts`` (:func:`pipeload.plan.storageorder.box_starts`;
    only without ``positions``): readers by runs of each holder set in storage order. ``reads``: plan
    every component (as ``everything``) and attach :attr:`GlobalPlan.every` (:func:`every_read`), the
    input of part delivery (:mod:`pipeload.plan.partdelivery`); this rank's decisions are unchanged.
    """
    reads = reads and len(np.unique(rows[:, F_HOST])) > 1  # one host, one page cache: nothing to deliver
    everything = everything or reads
    lap = on_phase or (lambda name: None)
    sizes = np.array([len(m) for m in cls.members], dtype=np.int64)
    sh = shard_columns(records, ndim, itemsize)
    lap("records")
    kg = group_keys(sh, sizes)
    lap("group keys")
    table = SetTable(rows, cls, can_create=can_create, global_ranks=global_ranks, same_host_private=same_host_private)
    touch = (find_units(kg.order, kg.starts, kg.ends, sh.cl, sh.index, sh.offsets, sh.lengths, sh.nd, kg.all_bc,
                        (rows[cls.owners, F_FLAGS] & FLAG_RESHARDED) != 0, sizes, itemsize, chunks)
             if broadcast and chunks is not None and np.any(rows[:, F_FLAGS] & FLAG_RESHARDED) else None)
    unit_sid, covered = unit_sets(table, touch, len(kg.starts))
    lap("chunk units")
    loads = alone_loads(sh, kg, cls, len(rows), covered)
    multi = (kg.holders >= 2) & ~covered
    candidates = np.flatnonzero(multi & kg.all_bc) if broadcast else np.zeros(0, dtype=np.int64)
    shut = np.flatnonzero(multi & ~kg.all_bc) if broadcast else np.flatnonzero(multi)
    sid_of = holder_sets(table, kg, sh.cl[kg.order], candidates)
    good = table.ok()[sid_of] if len(candidates) else np.zeros(0, dtype=bool)
    find = components(table)
    in_mine = good if everything else in_component(table, find, int(cls.of_rank[me]), sid_of, good)
    shared = shared_rows(sh, kg, candidates[in_mine], sid_of[in_mine])
    if touch is not None:
        unit_ok = unit_sid >= 0
        mine_u = unit_ok if everything else in_component(table, find, int(cls.of_rank[me]),
                                                         np.maximum(unit_sid, 0), unit_ok)
        shared = with_units(shared, touch, mine_u, unit_sid, ndim, itemsize, sh.affinity)
    extra = private_bytes(sh, kg, np.concatenate([candidates[~good], shut]), len(records))
    lap("holder sets")
    # every set some broadcast of the load uses, in any component: creating one is world-wide
    in_use = set(sid_of[good].tolist()) | set(unit_sid[unit_sid >= 0].tolist())
    gp = plan_component(shared, table.sets, loads, extra[cls.of_rank] if len(rows) else extra, me,
                        component_of=lambda sid: find(table.classes[sid][0]), requested=sh.requested,
                        in_use=in_use, stripe=stripe, min_stripe=min_stripe, batch_bytes=batch_bytes, lap=lap,
                        positions=positions, starts=starts if positions is None else None)
    if reads:
        gp.every = every_read(sh, kg, candidates[good], cls, gp, records)
    return gp


def every_read(sh: Shards, kg: KeyGroups, shared_groups: np.ndarray, cls: Classes, gp: GlobalPlan,
               records: Sequence[Record] = ()):
    """The function building :class:`EveryRead`: the boxes the ranks of the load read. Needs the plan of
    every component (``everything``): the pieces' readers are :attr:`GlobalPlan.readers`' rows. A pure
    function of the gathered rows and records: every rank builds the same boxes. Keys several ranks hold
    and read each (not broadcast) are left out: a subset of the real reads only costs savings, never
    exactness (an owner always reads the page it sends from; a reader left out of the model reads its
    pages itself), and replicas would multiply the boxes by R. ``records``: the classes' records, whose
    Python objects :attr:`EveryRead.objects` lists when asked (:func:`object_reads`)."""
    private = kg.holders == 1  # a key held by several ranks and not broadcast: each reads it, left out
    private[shared_groups] = False
    group_of = np.repeat(np.arange(len(kg.starts)), kg.ends - kg.starts)
    rows = kg.order[private[group_of]] if len(kg.order) else kg.order
    readers = gp._readers

    def build() -> EveryRead:
        idx, off, ln, nd, rd = readers.columns()  # (the _Readers of plan_component, taken before any use)
        count = np.array([len(cls.members[c]) for c in sh.cl[rows].tolist()], dtype=np.int64)
        ranks = (np.concatenate([cls.members[c] for c in sh.cl[rows].tolist()]).astype(np.int64)
                 if len(rows) else np.zeros(0, dtype=np.int64))
        pick = np.repeat(rows, count)
        return EveryRead(np.concatenate([idx, sh.index[pick]]), np.concatenate([off, sh.offsets[pick]]),
                         np.concatenate([ln, sh.lengths[pick]]), np.concatenate([nd, sh.nd[pick]]),
                         np.concatenate([rd, ranks]),
                         np.concatenate([np.zeros(len(idx), dtype=bool), np.ones(len(pick), dtype=bool)]),
                         lambda: object_reads(records, cls))

    return build


def object_reads(records: Sequence[Record], cls: Classes) -> np.ndarray:
    """``(rank, key index)`` of every Python object every rank reads (``records[c]``: class ``c``'s), an
    ``N x 2`` int64 array in class order, then object order: alike on every rank."""
    parts = [np.zeros((0, 2), dtype=np.int64)]
    for c, rec in enumerate(records):
        objs = np.asarray(rec.objects, dtype=np.int64)
        members = np.asarray(cls.members[c], dtype=np.int64)
        if len(objs) and len(members):
            parts.append(np.column_stack([np.tile(members, len(objs)), np.repeat(objs, len(members))]))
    return np.concatenate(parts)


class EveryRead:
    """Every box every rank of the load reads, as columns: ``(rank, key, private)`` per row (``key`` a
    shard key, a cut piece's or a unit piece's; ``private``: a key only one rank holds, read by it less the
    stored chunks units deliver, exactly as :func:`pipeload.engine.scheduler.read_private` skips them).
    Key objects are made only for the checkpoint keys asked for (:meth:`boxes`): part delivery expands the
    keys of one rank's files, not the W x S boxes of the load."""

    def __init__(self, index, offsets, lengths, nd, rank, private, objects: Callable[[], np.ndarray] | None = None):
        self.index, self.offsets, self.lengths, self.nd = index, offsets, lengths, nd
        self.rank, self.private = rank, private
        self._objects = objects
        self.key = np.where(index < 0, -1 - index, index)  # checkpoint key index (a unit's: its tensor's)

    def __len__(self) -> int:
        return len(self.rank)

    @property
    def objects(self) -> np.ndarray:
        """``(rank, key index)`` of each Python object each rank reads (:func:`object_reads`; built when
        first asked: only objects' runs take them in)."""
        if callable(self._objects):
            self._objects = self._objects()
        return np.zeros((0, 2), dtype=np.int64) if self._objects is None else self._objects

    def keys_of(self, rank: int) -> set[int]:
        """The checkpoint key indices ``rank`` reads a box of."""
        return set(np.unique(self.key[self.rank == rank]).tolist())

    def boxes(self, keys: Iterable[int]) -> list[tuple[int, ShardKey, bool]]:
        """``(rank, key, private)`` of every box of checkpoint keys ``keys``, in row order."""
        sel = np.flatnonzero(np.isin(self.key, np.fromiter(keys, dtype=np.int64)))
        return list(zip(self.rank[sel].tolist(),
                        _keys(self.index[sel], self.offsets[sel], self.lengths[sel], self.nd[sel]),
                        self.private[sel].tolist()))


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
