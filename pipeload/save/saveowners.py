"""The save's shared chunks of R = 1 layouts, found through tensor owners: no rank receives every record.

When nearly every rank's shard record is distinct (FSDP: ``R = 1``), the digest path of
:mod:`pipeload.save.saveplan` moves ``D x S`` record rows to every rank (57 MiB a rank for the simulated
FSDP layout at 4,096 ranks). Here the rows and the name tables travel as before (few name tables are
distinct), but the records stay home. Each tensor has an *owner* rank, a hash of its key index
(:func:`tensor_owner`); the owner receives every chunk of its tensors, so it alone decides what needs a
tensor's every chunk: which empty chunks are kept (a tensor without bytes records one), whether the
distinct chunks tile the tensor, and which chunks two or more record classes hold.

Protocol (every rank of the save's group, at the same position, after the name tables):

1. **Chunks** (one ``ex.all_to_all``): each record class's owner sends each of its chunks as the load's
   round-1 row (:mod:`pipeload.plan.keyowners`: ``[class, position, 1, -1, key index, offsets,
   lengths]``) to its tensor's owner. Replicas send nothing.
2. **Answers** (one ``ex.all_to_all``, :func:`answer_messages`): for each chunk two or more classes hold,
   the load's answer row and holder set (:func:`pipeload.plan.keyowners.answer_messages`) to every rank
   of those classes; the positions of the kept empty chunks one class holds, to that class's ranks. Per
   destination ``[n_empty, positions..., answer message or [0, 0]]``.
3. **Summary** (one ``ex.gather_rows`` of :data:`SUMMARY_WORDS` words): flags, the bytes this rank
   writes alone, and whether it found, as an owner, a tensor its ranks' chunks do not tile.

A problem word makes every rank gather the owners' problem texts (a rare all-gather) and refuse the
save alike. Every rank sees the same summaries, so every rank takes the same one of three ways:

- no flag: a rank's writes follow from its own chunks. One no other rank holds is its own; its holder
  set's chunks (a class of several replicas is a holder set of its own) go through the design's greedy
  over the set's members, from their bytes alone. Every member of a set is then in that set only and
  holds every chunk of it, so the set is a whole connected component of the digest path's, and the
  decisions are the digest path's (tested on random layouts). The Python objects' writer
  (:func:`_object_target`) is decided by the ranks of its component, the only candidates;
- :data:`FLAG_SETS` (some rank is in two holder sets, as with FSDP x TP and an optimizer's ``step``
  scalars): only the shared chunks travel, each once (a gather of one size word per rank, then a
  padded all-gather), and every rank runs the whole greedy (:mod:`pipeload.save.sharedrows`);
- :data:`FLAG_TOO_LARGE` (a set of more than :data:`pipeload.plan.keyowners.MAX_SET_CLASSES` classes
  that is not every class, which no answer describes): the digest path.

Cost per rank: its own ``S`` chunks out and ``O(S)`` answer rows in; as an owner, the chunks of its
tensors (``S`` rows on average, every chunk of a tensor at most); ``W x 24`` bytes of summary.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import numpy as np

from ..plan import keyowners
from ..plan._greedy import assign_readers
from ..plan.globalplan import _ranges
from ..plan.exchange import Classes, Transfer, record_transfer
from ..plan.keyowners import K_CLASS, K_KEY, K_POS, Held
from . import saveplan, sharedrows
from .saveplan import (KIND_OBJECT, R_KEYOWNER, Exchanged, LocalRecord, Plan, _differing_objects, _drop_empty,
                       _key_columns, _object_pool, _tiling_problems, chunk_weights, decode_shards, exchange_records,
                       key_table)

S_FLAG, S_ALONE, S_PROBLEMS = 0, 1, 2
SUMMARY_WORDS = 3
FLAG_SETS, FLAG_TOO_LARGE = 1, 2  # flag bits: in two holder sets; in a set too large to describe
SUMMARY_CALL = "all-gather of save key-owner summaries"
SIZES_CALL = "all-gather of shared-rows sizes"


def use_key_owners(xc: Exchanged, p: Plan, gmap: list[np.ndarray]) -> bool:
    """Whether the save asks the tensor owners: the digest path would move at least the smallest
    threshold some row carries, and some name table holds every Python object (else the objects'
    writer rule needs every rank's loads). A pure function of what every rank holds alike."""
    world = len(xc.rows)
    if world <= 1:
        return False
    t = record_transfer(xc.record_cls, world)
    if keyowners.digest_path_bytes(t, xc.record_cls, world) < int(xc.rows[:, R_KEYOWNER].min()):
        return False
    objects = p.kind == KIND_OBJECT
    total = int(objects.sum())
    return not total or any(int(objects[g].sum()) == total for g in gmap)


def tensor_owner(index: np.ndarray, world: int) -> np.ndarray:
    """The owner rank of each chunk: a hash of its key index alone, so a tensor's chunks meet."""
    none = np.zeros((len(index), 0), dtype=np.int64)
    return keyowners.owner_of(index, none, none, world)


class Own(NamedTuple):
    """This rank's chunks in record order: key indices, boxes padded to the table's width, bytes."""

    index: np.ndarray
    offsets: np.ndarray
    lengths: np.ndarray
    weight: np.ndarray


def own_chunks(record: bytes, p: Plan, gmap: list[np.ndarray], names_class: int) -> Own:
    """The chunks of a shard record (``names_class``: the rank's name table)."""
    pos, off, ln = decode_shards(record, p.shape.shape[1])
    index = gmap[names_class][pos] if len(pos) else np.zeros(0, dtype=np.int64)
    return Own(index, off, ln, chunk_weights(p, index, ln))


def chunk_messages(own: Own, my_class: int, world: int) -> tuple[np.ndarray, np.ndarray]:
    """Round 1 on a class owner: (words per destination, the words in destination order)."""
    n = len(own.index)
    rows = np.column_stack([np.full(n, my_class), np.arange(n), np.ones(n), np.full(n, -1), own.index,
                            own.offsets, own.lengths]).astype(np.int64).reshape(n, K_KEY + 1 + 2 * own.offsets.shape[1])
    dest = tensor_owner(own.index, world)
    order = np.argsort(dest, kind="stable")
    return np.bincount(dest, minlength=world).astype(np.int64) * rows.shape[1], rows[order].ravel()


def answer_messages(words: np.ndarray, p: Plan, cls: Classes, world: int) -> tuple[np.ndarray, np.ndarray, list[str]]:
    """Round 2 on an owner, from the chunks it received: (words per destination, the words, the tiling
    problems of its tensors)."""
    width = p.shape.shape[1]
    rows = np.asarray(words, dtype=np.int64).reshape(-1, K_KEY + 1 + 2 * width)
    if not len(rows):
        return np.zeros(world, dtype=np.int64), np.zeros(0, dtype=np.int64), []
    g = keyowners.group_by_key(rows)
    n = g.ends - g.starts
    first = rows[g.order[g.starts]]
    idx, off, ln = first[:, K_KEY], first[:, K_KEY + 1: K_KEY + 1 + width], first[:, K_KEY + 1 + width:]
    w = chunk_weights(p, idx, ln)
    keep = np.ones(len(idx), dtype=bool) if np.all(w > 0) else _drop_empty(idx, off, ln, w)
    sub = dataclasses.replace(p, chunk_index=idx[keep], chunk_offsets=off[keep], chunk_lengths=ln[keep],
                              chunk_weight=w[keep], problems=[])
    problems = _tiling_problems(sub)
    counts, msgs = keyowners.answer_messages(rows[g.order[np.repeat(keep, n)]].ravel(), cls, world, width)
    lone = rows[g.order[g.starts[np.flatnonzero(keep & (w == 0) & (n == 1))]]]
    sizes = np.asarray([len(cls.members[c]) for c in lone[:, K_CLASS].tolist()], dtype=np.int64)
    e_dest = (np.concatenate([cls.members[c] for c in lone[:, K_CLASS].tolist()]).astype(np.int64) if len(lone)
              else np.zeros(0, dtype=np.int64))
    return (*_frame(counts, msgs, e_dest, np.repeat(lone[:, K_POS], sizes), world), problems)


def _frame(counts: np.ndarray, msgs: np.ndarray, e_dest: np.ndarray, e_pos: np.ndarray, world: int):
    """Each destination's ``[n_empty, empty positions..., answer message or [0, 0]]``, vectorised."""
    n_empty = np.bincount(e_dest, minlength=world)
    to = (counts > 0) | (n_empty > 0)
    body = np.where(counts > 0, counts, 2 * to)
    out_counts = np.where(to, 1 + n_empty + body, 0).astype(np.int64)
    start = np.concatenate([[0], np.cumsum(out_counts)[:-1]])
    out = np.zeros(int(out_counts.sum()), dtype=np.int64)
    out[start[to]] = n_empty[to]
    by = np.argsort(e_dest, kind="stable")
    d = e_dest[by]
    out[start[d] + 1 + np.arange(len(d)) - np.searchsorted(d, d)] = e_pos[by]
    has = np.flatnonzero(counts)
    src = np.concatenate([[0], np.cumsum(counts)[:-1]])
    lo = start[has] + 1 + n_empty[has]
    out[_ranges(lo, lo + counts[has])] = msgs[_ranges(src[has], src[has] + counts[has])]
    return out_counts, out


def parse_answers(counts: np.ndarray, words: np.ndarray, n_own: int, n_classes: int) -> tuple[Held, np.ndarray]:
    """(the answers about this rank's chunks, which of its empty chunks are kept)."""
    kept_empty = np.zeros(n_own, dtype=bool)
    body_counts = np.zeros_like(counts)
    bodies, at = [], 0
    for src in np.flatnonzero(counts).tolist():
        msg = words[at: at + int(counts[src])]
        at += int(counts[src])
        ne = int(msg[0])
        kept_empty[msg[1: 1 + ne]] = True
        bodies.append(msg[1 + ne:])
        body_counts[src] = len(bodies[-1])
    body = np.concatenate(bodies) if bodies else np.zeros(0, dtype=np.int64)
    return keyowners.answers_of(body_counts, body, n_own, n_classes), kept_empty


class View(NamedTuple):
    """What a rank knows after the answers: its summary row, its kept chunks and those it shares, the
    holder set of each shared chunk (``set_of``, into ``tuples``: record classes), and its one holder
    set when it has one (classes and ranks; empty otherwise)."""

    row: np.ndarray
    kept: np.ndarray
    shared: np.ndarray
    tuples: list
    set_of: np.ndarray
    set_classes: tuple
    members: np.ndarray


def learn(own: Own, held: Held, kept_empty: np.ndarray, rank: int, cls: Classes, problems: bool) -> View:
    """This rank's view and summary row."""
    my_class = int(cls.of_rank[rank])
    kept = (own.weight > 0) | kept_empty | held.answered
    alone_class = len(cls.members[my_class]) == 1
    shared = kept & (held.answered | (not alone_class))
    tuples = [*held.sets, (my_class,)]
    set_of = np.where(shared, np.where(held.answered, held.set_of, len(held.sets)), -1)
    sets = {tuples[t] for t in np.unique(set_of[shared]).tolist()}
    flag = (FLAG_SETS if len(sets) > 1 else 0) | (FLAG_TOO_LARGE if () in sets else 0)
    classes_ = next(iter(sets)) if len(sets) == 1 else ()
    members = (np.sort(np.concatenate([cls.members[c] for c in classes_])).astype(np.int64) if classes_
               else np.zeros(0, dtype=np.int64))
    view = View(np.zeros(SUMMARY_WORDS, dtype=np.int64), kept, shared, tuples, set_of, classes_, members)
    row = view.row
    row[S_FLAG], row[S_ALONE], row[S_PROBLEMS] = flag, int(own.weight[kept & ~shared].sum()), int(problems)
    return view


def plan(ex, xc: Exchanged, key_tables: tuple, rec: LocalRecord, rank: int, what: str) -> Plan | None:
    """This rank's save plan through the tensor owners, or None when some rank is in a holder set too
    large to describe (every rank then returns None: the caller takes the digest path). Collectives: two
    all-to-alls, one gather of summaries; only when an owner found problems, an all-gather of their
    texts; only when some rank is in two holder sets, the padded all-gather of the shared chunks
    (:mod:`pipeload.save.sharedrows`)."""
    p, gmap = key_tables
    cls, world = xc.record_cls, len(xc.rows)
    my_class = int(cls.of_rank[rank])
    own = own_chunks(rec.record, p, gmap, int(xc.names_cls.of_rank[rank]))
    if int(cls.owners[my_class]) == rank:
        counts, words = chunk_messages(own, my_class, world)
    else:
        counts, words = np.zeros(world, dtype=np.int64), np.zeros(0, dtype=np.int64)
    _, got = ex.all_to_all(counts, words, what)
    counts, words, problems = answer_messages(got, p, cls, world)
    got_counts, got = ex.all_to_all(counts, words, what)
    held, kept_empty = parse_answers(got_counts, got, len(own.index), len(cls.members))
    view = learn(own, held, kept_empty, rank, cls, bool(problems))
    summary = ex.gather_rows(view.row, what, SUMMARY_CALL)
    if np.any(summary[:, S_PROBLEMS]):
        texts = ex.all_gather_object(problems, what)
        return dataclasses.replace(p, problems=sorted(t for ts in texts for t in ts))
    flags = np.bitwise_or.reduce(summary[:, S_FLAG])
    if flags & FLAG_TOO_LARGE:
        return None
    if flags & FLAG_SETS:  # every rank: only the shared chunks travel, and the whole greedy runs here
        blob = sharedrows.blob(own, view, rank, cls)
        sizes = ex.gather_rows(np.array([len(blob)], dtype=np.int64), what, SIZES_CALL)[cls.owners, 0]
        blobs = ex.transfer_records(Transfer("gather", cls.owners, int(sizes.max())), cls._replace(nbytes=sizes),
                                    blob, what)
        return sharedrows.decide(p, gmap, xc, own, view, summary[:, S_ALONE], blobs, rank)
    return decide(p, gmap, xc, own, view, summary, rank)


def decide(p: Plan, gmap, xc: Exchanged, own: Own, view: View, summary: np.ndarray, rank: int) -> Plan:
    """This rank's writers from its view and every rank's bytes alone (no flag anywhere)."""
    loads = summary[:, S_ALONE].astype(np.int64)
    writer = np.full(len(own.index), -1, dtype=np.int64)
    writer[view.kept & ~view.shared] = rank
    sel = np.flatnonzero(view.shared)
    if len(sel):
        w = own.weight.astype(np.int64)
        order = sel[np.lexsort([*_key_columns(own.index[sel], own.offsets[sel], own.lengths[sel]), -w[sel]])]
        reader = assign_readers(order.astype(np.int64), w, np.zeros(len(w), dtype=np.int64),
                                np.zeros(0, dtype=np.int64), np.zeros(1, dtype=np.int64), np.zeros(1, dtype=np.int64),
                                np.array([len(view.members)], dtype=np.int64), view.members, loads)
        writer[sel] = reader[sel]
    k = np.flatnonzero(view.kept)
    out = dataclasses.replace(p, problems=[], chunk_index=own.index[k], chunk_offsets=own.offsets[k],
                              chunk_lengths=own.lengths[k], chunk_weight=own.weight[k], writer=writer[k], loads=loads)
    target = _object_target(p, gmap, xc, view, loads, rank)
    if target == rank:
        out.object_writer = {k: rank for k in np.flatnonzero(p.kind == KIND_OBJECT).tolist()}
    out.differing_objects = _differing_objects(xc)
    return out


def _object_target(p: Plan, gmap, xc: Exchanged, view: View, loads: np.ndarray, rank: int) -> int:
    """The objects' writer as the digest path picks it (the least loaded rank holding every object in
    the component of the lowest such rank, ties to the lower rank), when this rank is in that component;
    else -1 (this rank is not a candidate)."""
    pool = _object_pool(p, gmap, xc.names_cls)
    if not len(pool):
        return -1
    cls = xc.record_cls
    c0 = int(cls.of_rank[pool[0]])
    if c0 in view.set_classes:
        component = view.members
    elif not view.set_classes and int(cls.of_rank[rank]) == c0:
        component = cls.members[c0]
    else:
        return -1
    cand = np.intersect1d(pool, component)
    return int(cand[np.lexsort((cand, loads[cand]))[0]])


def plan_save(ex, xc: Exchanged, rec: LocalRecord, rank: int, what: str) -> Plan:
    """The save plan after the rows and name tables: through the tensor owners when the rows choose
    them (and no holder set is too large to describe), else the distinct records' transfer and
    :func:`pipeload.save.saveplan.plan`. Every rank takes the same branches (each is decided from data
    every rank holds)."""
    keys = key_table(xc)
    if keys[0].problems:
        return keys[0]
    if use_key_owners(xc, *keys):
        got = plan(ex, xc, keys, rec, rank, what)
        if got is not None:
            return got
    exchange_records(ex, xc, rec, what)
    return saveplan.plan(xc, rank, key_tables=keys)
