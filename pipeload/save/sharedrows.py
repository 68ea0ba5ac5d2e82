"""The save's writers when a rank is in two holder sets: only the shared chunks travel, each once.

On the tensor-owner path (:mod:`pipeload.save.saveowners`) a rank whose chunks have two holder sets
(FSDP x TP with an optimizer: every rank holds every ``step`` scalar, and its tensor-parallel group
holds its norms) joins those sets into one connected component that no rank's own view covers. The
greedy's inputs are only the shared chunks, their holder sets and every rank's bytes alone, so those
are what travels instead of every record: each class owner sends the shared chunks its class is the
*sender* of (one class of each chunk's holder set, picked by a hash of the chunk, so the step scalars
every class holds are spread over all classes), with their holder sets, in one padded all-gather
(sizes from the summaries). Every rank then runs the design's greedy over all of them — the digest
path's decisions, every component at once.

A blob (int64 words): ``[n, n_sets, width]``, per chunk ``key index, offsets (width), lengths (width),
set``, per set ``[k, classes...]`` (``k = -1``: every class). Cost per rank: the ``P`` shared chunks of
the save, ``(2 + 2 x width) x 8`` bytes each, padded to the largest sender's blob times ``W``; the
greedy ``O(P log P)``.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import numpy as np

from ..plan._greedy import assign_readers
from ..plan.exchange import Classes
from ..plan.globalplan import _row_groups
from ..plan.keyowners import owner_of
from .saveplan import (Exchanged, Plan, _differing_objects, _key_columns, _object_pool, _object_writers, chunk_weights,
                       component_roots)

EVERY = -1
_HASH_RANGE = 1 << 31


def blob(own, view, rank: int, cls: Classes) -> bytes:
    """The shared chunks ``rank``'s class sends on this path (every rank of the class computes the same
    bytes; its owner's travel). Empty when a set is too large to describe (that save takes the digest
    path)."""
    my_class = int(cls.of_rank[rank])
    sel = np.flatnonzero(view.shared)
    if not len(sel) or any(view.tuples[t] == () for t in set(view.set_of[sel].tolist())):
        return b""
    set_of = view.set_of[sel]
    h = owner_of(own.index[sel], own.offsets[sel], own.lengths[sel], _HASH_RANGE)
    mine = np.zeros(len(sel), dtype=bool)
    for t in np.unique(set_of).tolist():
        at = set_of == t
        members = np.asarray(view.tuples[t], dtype=np.int64)
        mine[at] = members[h[at] % len(members)] == my_class
    sel, set_of = sel[mine], set_of[mine]
    sets, local = np.unique(set_of, return_inverse=True)
    width = own.offsets.shape[1]
    rows = np.column_stack([own.index[sel], own.offsets[sel], own.lengths[sel], local.reshape(-1)]).astype(np.int64)
    n_classes = len(cls.members)
    table = [[EVERY] if len(view.tuples[t]) == n_classes else [len(view.tuples[t]), *view.tuples[t]]
             for t in sets.tolist()]
    words = [np.asarray([len(sel), len(sets), width], dtype=np.int64), rows.reshape(-1),
             *(np.asarray(e, dtype=np.int64) for e in table)]
    return np.concatenate(words).tobytes()


def decode(blobs: Sequence[bytes], width: int, n_classes: int) -> tuple[np.ndarray, np.ndarray, list[tuple]]:
    """(every shared chunk's key row ``index, offsets, lengths``; its holder set; the sets' classes)."""
    keys, sids, tuples = [], [], []
    number: dict = {}  # a set's number by its classes (every class: by EVERY, never hashing W entries)
    every = tuple(range(n_classes))
    for b in blobs:
        if not b:
            continue
        a = np.frombuffer(b, dtype=np.int64)
        n, n_sets, w = (int(x) for x in a[:3])
        body = a[3: 3 + n * (2 + 2 * w)].reshape(n, 2 + 2 * w)
        at, local = 3 + n * (2 + 2 * w), []
        for _ in range(n_sets):
            k = int(a[at])
            key = EVERY if k == EVERY else tuple(a[at + 1: at + 1 + k].tolist())
            at += 1 + max(k, 0)
            if key not in number:
                number[key] = len(tuples)
                tuples.append(every if k == EVERY else key)
            local.append(number[key])
        rows = np.zeros((n, 1 + 2 * width), dtype=np.int64)
        rows[:, : 1 + w], rows[:, 1 + width: 1 + width + w] = body[:, : 1 + w], body[:, 1 + w: 1 + 2 * w]
        keys.append(rows)
        sids.append(np.asarray(local, dtype=np.int64)[body[:, -1]])
    if not keys:
        return np.zeros((0, 1 + 2 * width), dtype=np.int64), np.zeros(0, dtype=np.int64), tuples
    return np.concatenate(keys), np.concatenate(sids), tuples


def _greedy(p: Plan, keys: np.ndarray, sid: np.ndarray, tuples: list[tuple], alone: np.ndarray,
            cls: Classes) -> tuple[np.ndarray, np.ndarray]:
    """(the writer of each shared chunk, every rank's bytes): the design's greedy, largest first, ties
    by key, over each chunk's holder set, from the bytes alone."""
    width = p.shape.shape[1]
    index, off, ln = keys[:, 0], keys[:, 1: 1 + width], keys[:, 1 + width:]
    w = chunk_weights(p, index, ln).astype(np.int64)
    order = np.lexsort([*_key_columns(index, off, ln), -w]).astype(np.int64)
    members = [np.sort(np.concatenate([cls.members[c] for c in t])).astype(np.int64) for t in tuples]
    size = np.array([len(m) for m in members], dtype=np.int64)
    start = np.concatenate([[0], np.cumsum(size)[:-1]]).astype(np.int64)
    loads = np.asarray(alone, dtype=np.int64).copy()
    flat = np.concatenate(members) if members else np.zeros(0, dtype=np.int64)
    reader = assign_readers(order, w, sid, np.zeros(0, dtype=np.int64), np.zeros(len(tuples), dtype=np.int64),
                            start, size, flat, loads)
    return reader, loads


def decide(p: Plan, gmap, xc: Exchanged, own, view, alone: np.ndarray, blobs: Sequence[bytes], rank: int) -> Plan:
    """This rank's writers from every class's shared chunks and every rank's bytes alone."""
    cls = xc.record_cls
    keys, sid, tuples = decode(blobs, p.shape.shape[1], len(cls.members))
    reader, loads = _greedy(p, keys, sid, tuples, alone, cls)
    writer = np.full(len(own.index), -1, dtype=np.int64)
    writer[view.kept & ~view.shared] = rank
    mine = np.flatnonzero(view.shared)
    if len(mine):  # each of this rank's shared chunks is one row some class sent
        both = np.concatenate([keys, np.column_stack([own.index[mine], own.offsets[mine], own.lengths[mine]])])
        order, starts = _row_groups(both)
        gid = np.repeat(np.arange(len(starts)), np.diff(np.append(starts, len(order))))  # group of each position
        sent = np.full(len(starts), -1, dtype=np.int64)
        first = order < len(keys)
        sent[gid[first]] = order[first]
        at = np.empty(len(mine), dtype=np.int64)
        at[order[~first] - len(keys)] = sent[gid[~first]]
        if np.any(at < 0):
            raise AssertionError(f"rank {rank}: a shared chunk no class sent")  # the senders' rule broke
        writer[mine] = reader[at]
    k = np.flatnonzero(view.kept)
    out = dataclasses.replace(p, problems=[], chunk_index=own.index[k], chunk_offsets=own.offsets[k],
                              chunk_lengths=own.lengths[k], chunk_weight=own.weight[k], writer=writer[k], loads=loads)
    pool = _object_pool(p, gmap, xc.names_cls)
    out.object_writer = {k: r for k, r in _object_writers(out, gmap, xc.names_cls, pool, component_roots(tuples, len(cls.members))[cls.of_rank]).items()
                         if r == rank}
    out.differing_objects = _differing_objects(xc)
    return out
