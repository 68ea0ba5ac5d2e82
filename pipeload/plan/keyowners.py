"""Shared shard keys of R = 1 layouts, found through key owners instead of every record on every rank.

When nearly every rank's record is distinct (FSDP: ``R = 1``), moving each distinct record to every
rank costs each rank ``W x S`` rows. Here each shard key goes to one *owner* rank, chosen by a hash
of the key; the owner sees every holder of the keys it owns and answers, for each key held by two or
more classes, only those holders. A rank then knows, for each of its own shards, who else holds it,
and nothing about shards it does not hold. Bytes and CPU per rank grow with its own shards (and
``O(W)`` fixed-size words), not with ``W x S``.

Protocol (every rank of the load's group, at the same position; ``ex`` is a
:class:`pipeload.engine.comm.Comm` or the simulated exchange of :mod:`pipeload.tools.simulate`):

1. **Keys** (:func:`key_messages`, one ``ex.all_to_all``): the lowest rank of each class (its records'
   owner in :func:`pipeload.plan.exchange.classes`) sends each of its shards, ``[class, position, bc,
   affinity, index, offsets, lengths]``, to ``owner_of(key)``. Replicas send nothing.
2. **Answers** (:func:`answer_messages`, one ``ex.all_to_all``): an owner groups the keys it received;
   for every key held by two or more classes it tells each holder rank the key's position in that
   rank's record, whether every holder can broadcast it, the writer its lowest class names, its holder
   count and its holder set (its classes, or "every class").
3. **Summary** (:func:`learn`, one ``ex.gather_rows`` of :func:`summary_width` words): each rank's
   bytes read alone, bytes of private copies, a flag, and the keys it requests (a bitmap; above
   :data:`MAX_BITMAP_WORDS` words, a separate ``ex.union`` of one byte per key).

The flag says a rank cannot plan from what it knows: it is in two or more usable holder sets (so its
component may reach sets it is not in), a set it is in has to be created (a world-wide call every rank
must plan), or a set of more than :data:`MAX_SET_CLASSES` classes other than the whole group. Any flag
in the gathered summary sends every rank back to the digest path (the records' all-gather and
:func:`pipeload.plan.globalplan.global_plan`): every rank sees the same words, so every rank takes the same
branch. Otherwise each rank's component is exactly its one holder set, every member of which holds
every shard of the set, so every member has the same rows: :func:`pipeload.plan.globalplan.plan_component`
then takes, on every member, the decisions the global plan takes (tested on random layouts).

Which path a load takes is decided from the gathered rows by :func:`use_key_owners`: the digest
path's record bytes per rank against the smallest threshold some row carries (word
:data:`pipeload.plan.exchange.F_KEYOWNER`; ``PIPELOAD_KEY_OWNER_BYTES`` sets a rank's, default
:data:`pipeload.plan.exchange.KEY_OWNER_BYTES`).

API for other planners (a save's writer choice needs the same question answered: which ranks hold
each of my keys):

- ``owner_of(index, offsets, lengths, world)``: the owner rank of each key (int64 columns);
- ``key_messages(record, my_class, world) -> (counts, words)``;
- ``answer_messages(words, cls, world) -> (counts, words)`` on an owner;
- ``answers_of(counts, words, n_keys, n_classes) -> Held``: per own key, its holder set and counts;
- ``find_holders(ex, record, rank, cls, what) -> Held``: rounds 1 and 2 in one call.

``ex.all_to_all(counts, words, what)`` sends ``words[sum(counts[:d]) : ...]`` (int64) to rank ``d`` and
returns ``(counts received per source, words in source order)``.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from .exchange import F_KEYOWNER, Classes, Record, Transfer
from .globalplan import (MIN_STRIPE, GlobalPlan, KeyGroups, SetTable, Shared, _ranges, _row_groups,
                         plan_component, set_signature, set_signatures, shard_weights)

MAX_SET_CLASSES = 256  # a holder set of more classes (not the whole group) is not described: digest path
MAX_BITMAP_WORDS = 64  # requested keys travel in the summary row up to this many words

# a key row (round 1)
K_CLASS, K_POS, K_BC, K_AFF, K_KEY = 0, 1, 2, 3, 4
# an answer row (round 2)
A_POS, A_BC, A_AFF, A_HOLDERS, A_NCLASSES, A_SET = range(6)
A_WORDS = 6
# the summary row (round 3)
S_FLAG, S_ALONE, S_PRIVATE, S_BITS = 0, 1, 2, 3
SUMMARY_CALL = "all-gather of key-owner summaries"
EVERY_CLASS = -1  # a set entry's length word: the whole group (no class list follows)
TOO_LARGE = -2  # a set entry's length word: a set too large to describe


def digest_path_bytes(t: Transfer, cls: Classes, world: int) -> int:
    """Record bytes the busiest rank receives on the digest path (the transfer ``t`` of the rows)."""
    if t.how == "gather":
        return (world - 1) * t.pad
    if t.how == "broadcast":
        return int(cls.nbytes.sum())
    return 0


def use_key_owners(rows: np.ndarray, cls: Classes, t: Transfer) -> bool:
    """Whether the load asks the key owners: a pure function of the gathered rows (and what every rank
    derives from them), so every rank answers alike."""
    world = len(rows)
    return world > 1 and digest_path_bytes(t, cls, world) >= int(rows[:, F_KEYOWNER].min())


def owner_of(index: np.ndarray, offsets: np.ndarray, lengths: np.ndarray, world: int) -> np.ndarray:
    """The owner rank of each key (index, offsets, lengths): a 64-bit mix of its words modulo ``world``,
    the same on every rank and numpy version."""
    cols = [np.asarray(index, dtype=np.int64).reshape(-1, 1), np.asarray(offsets, dtype=np.int64),
            np.asarray(lengths, dtype=np.int64)]
    u = np.ascontiguousarray(np.concatenate(cols, axis=1)).view(np.uint64)
    h = np.full(len(u), 0x243F6A8885A308D3, dtype=np.uint64)
    with np.errstate(over="ignore"):
        for c in range(u.shape[1]):
            h ^= u[:, c]
            h *= np.uint64(0xBF58476D1CE4E5B9)
            h ^= h >> np.uint64(29)
            h *= np.uint64(0x94D049BB133111EB)
            h ^= h >> np.uint64(32)
    return (h % np.uint64(max(world, 1))).astype(np.int64)


def key_rows(record: Record, my_class: int) -> np.ndarray:
    """Round-1 rows of a record: ``[class, position, bc, affinity, index, offsets..., lengths...]``."""
    n, width = len(record.index), record.offsets.shape[1]
    aff = record.affinity if record.affinity is not None else np.full(n, -1, dtype=np.int64)
    return np.column_stack([np.full(n, my_class, dtype=np.int64), np.arange(n, dtype=np.int64),
                            np.asarray(record.broadcastable, dtype=np.int64), np.asarray(aff, dtype=np.int64),
                            np.asarray(record.index, dtype=np.int64), np.asarray(record.offsets, dtype=np.int64),
                            np.asarray(record.lengths, dtype=np.int64)]).reshape(n, K_KEY + 1 + 2 * width)


def key_messages(record: Record, my_class: int, world: int) -> tuple[np.ndarray, np.ndarray]:
    """Round 1 on a class owner: (words per destination, the words in destination order; each
    destination's rows in record order)."""
    rows = key_rows(record, my_class)
    width = record.offsets.shape[1]
    dest = owner_of(rows[:, K_KEY], rows[:, K_KEY + 1: K_KEY + 1 + width], rows[:, K_KEY + 1 + width:], world)
    order = np.argsort(dest, kind="stable")
    counts = np.bincount(dest, minlength=world).astype(np.int64) * rows.shape[1]
    return counts, rows[order].ravel()


class KeyRowGroups(NamedTuple):
    order: np.ndarray  # rows of each group together, lowest class first
    starts: np.ndarray
    ends: np.ndarray


def group_by_key(rows: np.ndarray) -> KeyRowGroups:
    """Key groups of round-1 rows (as :func:`pipeload.plan.globalplan.group_keys`), lowest class first."""
    order, starts = _row_groups(rows[:, K_KEY:])
    ends = np.append(starts[1:], len(order))
    gid = np.repeat(np.arange(len(starts)), ends - starts)
    order = order[np.lexsort((rows[order, K_CLASS], gid))]
    return KeyRowGroups(order, starts, ends)


def answer_messages(words: np.ndarray, cls: Classes, world: int, width: int) -> tuple[np.ndarray, np.ndarray]:
    """Round 2 on an owner, from the round-1 words it received: for each key of two or more classes,
    one answer row to every rank of every holder class; per destination ``[n_rows, n_sets, rows...,
    sets...]``, a set ``[n, classes...]`` (``n`` = :data:`EVERY_CLASS` or :data:`TOO_LARGE`: no list).
    The message to a destination depends only on the keys it holds, not on the other keys received."""
    rows = np.asarray(words, dtype=np.int64).reshape(-1, K_KEY + 1 + 2 * width)
    counts = np.zeros(world, dtype=np.int64)
    if not len(rows):
        return counts, np.zeros(0, dtype=np.int64)
    g = group_by_key(rows)
    n = g.ends - g.starts
    keep = np.flatnonzero(n >= 2)
    if not len(keep):
        return counts, np.zeros(0, dtype=np.int64)
    sizes = np.array([len(m) for m in cls.members], dtype=np.int64)
    c = rows[g.order, K_CLASS]
    holders = np.add.reduceat(sizes[c], g.starts)
    all_bc = np.logical_and.reduceat(rows[g.order, K_BC] != 0, g.starts)
    kg = KeyGroups(g.order, g.starts, g.ends, holders, all_bc, n)
    sig = set_signatures(kg, c, keep, len(sizes))
    set_first, set_of_keep = _unique_sig(sig)
    # one entry per (holder row of a kept group) x (rank of its class)
    at = _ranges(g.starts[keep], g.ends[keep])
    grp = np.repeat(np.arange(len(keep)), n[keep])
    flat = np.concatenate(cls.members).astype(np.int64)
    mstart = np.concatenate([[0], np.cumsum(sizes)[:-1]])
    reps = sizes[c[at]]
    dest = flat[_ranges(mstart[c[at]], mstart[c[at]] + reps)]
    e_at, e_grp = np.repeat(at, reps), np.repeat(grp, reps)
    gk = keep[e_grp]
    cols = np.column_stack([rows[g.order[e_at], K_POS], all_bc[gk].astype(np.int64),
                            rows[g.order[g.starts[gk]], K_AFF], holders[gk], n[gk], set_of_keep[e_grp]])
    by = np.lexsort((cols[:, A_POS], dest))
    return _pack(dest[by], cols[by], set_first, keep, kg, c, len(sizes), world)


def _unique_sig(sig: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(first kept group of each distinct set, set of each kept group)."""
    order = np.lexsort(sig.T[::-1])
    s = sig[order]
    new = np.ones(len(s), dtype=bool)
    new[1:] = np.any(s[1:] != s[:-1], axis=1)
    inv = np.empty(len(s), dtype=np.int64)
    inv[order] = np.cumsum(new) - 1
    return order[new], inv


def _set_words(set_first, keep, kg: KeyGroups, c, n_classes: int) -> tuple[np.ndarray, np.ndarray]:
    """Each distinct set's entry of an answer message, concatenated: (words, start of each)."""
    entries = []
    for grp in keep[set_first].tolist():
        cl = c[kg.starts[grp]:kg.ends[grp]]
        entries.append([EVERY_CLASS] if len(cl) == n_classes else [TOO_LARGE] if len(cl) > MAX_SET_CLASSES
                       else [len(cl), *cl.tolist()])
    lens = np.array([len(e) for e in entries], dtype=np.int64)
    return np.concatenate([np.asarray(e, dtype=np.int64) for e in entries]), np.concatenate([[0], np.cumsum(lens)])


def _pack(dest, cols, set_first, keep, kg: KeyGroups, c, n_classes: int, world: int):
    """The per-destination answer messages (rows sorted by destination then position), vectorised: an
    owner answering every rank of a world costs numpy passes, not a Python step per rank. Each
    message's sets are numbered in ascending set order, the rows' set words renumbered to match."""
    counts = np.zeros(world, dtype=np.int64)
    if not len(dest):
        return counts, np.zeros(0, dtype=np.int64)
    words, at = _set_words(set_first, keep, kg, c, n_classes)
    n_sets = len(set_first)
    key = dest * n_sets + cols[:, A_SET]
    pair = np.unique(key)  # (destination, set) pairs, by destination then set
    p_dest, p_set = np.divmod(pair, n_sets)
    first_pair = np.searchsorted(pair, np.arange(world) * n_sets)
    rows_of, sets_of = np.bincount(dest, minlength=world), np.bincount(p_dest, minlength=world)
    set_len = at[p_set + 1] - at[p_set]
    counts[:] = np.where(rows_of > 0, 2 + A_WORDS * rows_of, 0) + np.bincount(p_dest, weights=set_len, minlength=world)
    start = np.concatenate([[0], np.cumsum(counts)[:-1]])
    out = np.zeros(int(counts.sum()), dtype=np.int64)
    d = np.flatnonzero(rows_of)
    out[start[d]], out[start[d] + 1] = rows_of[d], sets_of[d]
    block = cols.copy()
    block[:, A_SET] = np.searchsorted(pair, key) - first_pair[dest]
    i = np.arange(len(dest)) - np.searchsorted(dest, dest)  # the row's place in its message
    out[(start[dest] + 2 + A_WORDS * i)[:, None] + np.arange(A_WORDS)] = block
    cum = np.cumsum(set_len) - set_len
    within = cum - cum[first_pair[p_dest]]  # words of the message's earlier sets
    base = start[p_dest] + 2 + A_WORDS * rows_of[p_dest] + within
    out[_ranges(base, base + set_len)] = words[_ranges(at[p_set], at[p_set + 1])]
    return counts, out


class Held(NamedTuple):
    """Per key of a rank's own record: who else holds it (from the answers; keys no answer named are
    held by the rank's class alone)."""

    answered: np.ndarray  # (n,) bool
    all_bc: np.ndarray  # (n,) bool, answered keys only
    aff: np.ndarray  # (n,) the writer the lowest holder class names, answered keys only
    holders: np.ndarray  # (n,) ranks holding it, answered keys only
    set_of: np.ndarray  # (n,) index into ``sets``, answered keys only (else -1)
    sets: list  # class tuples; () for a set too large to describe


def answers_of(counts: np.ndarray, words: np.ndarray, n_keys: int, n_classes: int) -> Held:
    """Parse the answers a rank received (round 2): one message per source with a nonzero count."""
    answered = np.zeros(n_keys, dtype=bool)
    all_bc = np.zeros(n_keys, dtype=bool)
    aff = np.full(n_keys, -1, dtype=np.int64)
    holders = np.zeros(n_keys, dtype=np.int64)
    set_of = np.full(n_keys, -1, dtype=np.int64)
    sets: list = []
    index: dict[tuple, int] = {}
    every = tuple(range(n_classes))  # built once: a set of every class is one tuple of W entries
    at = 0
    for cnt in counts[counts > 0].tolist():
        msg = words[at: at + cnt]
        at += cnt
        n_rows, n_sets = int(msg[0]), int(msg[1])
        block = msg[2: 2 + A_WORDS * n_rows].reshape(n_rows, A_WORDS)
        p = 2 + A_WORDS * n_rows
        local = []
        for _ in range(n_sets):
            k = int(msg[p])
            t = (every if k == EVERY_CLASS else () if k == TOO_LARGE
                 else tuple(msg[p + 1: p + 1 + k].tolist()))
            p += 1 + max(k, 0)
            key = k if k < 0 else t  # (hashing the W-entry tuple of every class would cost O(W) a time)
            local.append(index.setdefault(key, len(index)))
            if len(sets) < len(index):
                sets.append(t)
        pos = block[:, A_POS]
        answered[pos] = True
        all_bc[pos] = block[:, A_BC] != 0
        aff[pos] = block[:, A_AFF]
        holders[pos] = block[:, A_HOLDERS]
        set_of[pos] = np.asarray(local, dtype=np.int64)[block[:, A_SET]] if n_sets else -1
    return Held(answered, all_bc, aff, holders, set_of, sets)


def find_holders(ex, record: Record, rank: int, cls: Classes, what: str) -> Held:
    """Rounds 1 and 2: two all-to-alls, taken by every rank (class owners send their keys)."""
    world = len(cls.of_rank)
    my_class = int(cls.of_rank[rank])
    width = record.offsets.shape[1]
    if int(cls.owners[my_class]) == rank:
        counts, words = key_messages(record, my_class, world)
    else:
        counts, words = np.zeros(world, dtype=np.int64), np.zeros(0, dtype=np.int64)
    _, got = ex.all_to_all(counts, words, what)
    counts, words = answer_messages(got, cls, world, width)
    got_counts, got = ex.all_to_all(counts, words, what)
    return answers_of(got_counts, got, len(record.index), len(cls.members))


def summary_width(n_names: int) -> int:
    """Words of the summary row: flag, bytes alone, private bytes, and the requested-key bitmap when it
    has at most :data:`MAX_BITMAP_WORDS` words (else the keys travel in a union)."""
    bits = -(-n_names // 64)
    return S_BITS + (bits if bits <= MAX_BITMAP_WORDS else 0)


class View(NamedTuple):
    """What one rank knows after the answers: its summary row and, unless flagged, its shared rows."""

    row: np.ndarray
    shared: Shared
    table: SetTable
    in_use: set


def learn(record: Record, held: Held, rank: int, rows: np.ndarray, cls: Classes, *, ndim: np.ndarray,
          itemsize: np.ndarray, n_names: int, broadcast: bool, can_create: bool, global_ranks=None,
          same_host_private: bool = False) -> View:
    """This rank's summary row and shared rows, from its record and the answers. A key no answer named
    is held by this rank's class alone. The shared rows are those of the usable candidate sets, with
    the decisions' inputs :func:`pipeload.plan.globalplan.global_plan` reads from the key's lowest class."""
    my_class = int(cls.of_rank[rank])
    n = len(record.index)
    index = np.asarray(record.index, dtype=np.intp)
    weight = shard_weights(index, record.lengths, ndim, itemsize)
    own_aff = record.affinity if record.affinity is not None else np.full(n, -1, dtype=np.int64)
    holders = np.where(held.answered, held.holders, len(cls.members[my_class]))
    all_bc = np.where(held.answered, held.all_bc, np.asarray(record.broadcastable, dtype=bool))
    aff = np.where(held.answered, held.aff, np.asarray(own_aff, dtype=np.int64))
    tuples = [*held.sets, (my_class,)]
    key_set = np.where(held.answered, held.set_of, len(held.sets))
    candidate = (holders >= 2) & all_bc if broadcast else np.zeros(n, dtype=bool)
    table = SetTable(rows, cls, can_create=can_create, global_ranks=global_ranks, same_host_private=same_host_private)
    present = np.unique(key_set[candidate]).tolist()
    too_large = any(tuples[t] == () for t in present)
    sid_of_set = np.full(len(tuples), -1, dtype=np.int64)
    if not too_large:
        by_sig = sorted(present, key=lambda t: set_signature(tuples[t], len(cls.members)))
        for t in by_sig:
            sid_of_set[t] = table.add(tuples[t])
    ok = table.ok()
    sid = sid_of_set[key_set]
    good = candidate & (sid >= 0) & ok[np.maximum(sid, 0)] if len(ok) else np.zeros(n, dtype=bool)
    in_use = set(np.unique(sid[good]).tolist())
    flag = too_large or len(in_use) > 1 or any(table.sets[s].create for s in in_use)
    row = np.zeros(summary_width(n_names), dtype=np.int64)
    row[S_FLAG] = int(flag)  # a flagged row carries no byte counts (the digest path recomputes them)
    row[S_ALONE] = 0 if flag else int(weight[holders == 1].sum())
    row[S_PRIVATE] = 0 if flag else int(weight[(holders >= 2) & ~good].sum())
    if len(row) > S_BITS:
        bits = np.zeros((len(row) - S_BITS) * 64, dtype=bool)
        bits[index] = True
        bits[np.asarray(record.objects, dtype=np.intp)] = True
        row[S_BITS:] = np.packbits(bits, bitorder="little").view(np.int64)
    prefer = aff[good] if np.any(aff[good] >= 0) else None
    shared = Shared(index[good], record.offsets[good], record.lengths[good], ndim[index[good]], weight[good],
                    sid[good], prefer)
    return View(row, shared, table, in_use)


def requested_keys(ex, summary: np.ndarray, record: Record, n_names: int, what: str) -> np.ndarray:
    """The checkpoint keys some rank requests: the OR of the summary bitmaps, or (wide checkpoints)
    one union of a byte per key."""
    if summary.shape[1] > S_BITS:
        words = np.bitwise_or.reduce(summary[:, S_BITS:], axis=0)
        bits = np.unpackbits(np.ascontiguousarray(words).view(np.uint8), bitorder="little")[:n_names]
        return np.flatnonzero(bits)
    wanted = np.zeros(n_names, dtype=np.uint8)
    wanted[np.asarray(record.index, dtype=np.intp)] = 1
    wanted[np.asarray(record.objects, dtype=np.intp)] = 1
    return np.flatnonzero(ex.union(wanted, what))


def plan(ex, record: Record, rank: int, rows: np.ndarray, cls: Classes, *, ndim: np.ndarray, itemsize: np.ndarray,
         n_names: int, broadcast: bool, batch_bytes: int, can_create: bool, global_ranks=None,
         same_host_private: bool = False, stripe: bool = True, min_stripe: int = MIN_STRIPE,
         what: str = "pipeload", on_phase=None) -> GlobalPlan | None:
    """This rank's global plan through the key owners, or None when some rank's summary is flagged
    (every rank then returns None: the caller takes the digest path). Collectives: two all-to-alls, one
    gather of summaries, and, for wide checkpoints and no flag, one union."""
    lap = on_phase or (lambda name: None)
    held = find_holders(ex, record, rank, cls, what)
    lap("key owners")
    view = learn(record, held, rank, rows, cls, ndim=ndim, itemsize=itemsize, n_names=n_names, broadcast=broadcast,
                 can_create=can_create, global_ranks=global_ranks, same_host_private=same_host_private)
    summary = ex.gather_rows(view.row, what, SUMMARY_CALL)
    if np.any(summary[:, S_FLAG]):
        return None
    requested = requested_keys(ex, summary, record, n_names, what)
    lap("holder sets")
    return plan_component(view.shared, view.table.sets, summary[:, S_ALONE].tolist(), summary[:, S_PRIVATE], rank,
                          component_of=lambda sid: 0, requested=requested, in_use=view.in_use, stripe=stripe,
                          min_stripe=min_stripe, batch_bytes=batch_bytes, lap=lap)

