"""Chunk units (pipeload.plan.chunkunits): a stored chunk several classes need different parts of is one
unit of reading, planned alike on every rank from the records, the rows and the chunk table.

The inputs are built through the loader's own exchange formats (records, rows, classes); the chunk table
is the plan's :class:`ChunkTable`, as :func:`chunk_table` builds it from any checkpoint's metadata.
"""

from __future__ import annotations

import itertools
import random

import numpy as np
import pytest

from pipeload.plan import globalplan as G
from pipeload.plan.chunkunits import ChunkTable, is_unit, unit_index
from pipeload.plan.exchange import classes, decode_record, encode_record, make_row

WIDTH = 2
ITEMSIZE = 4


def _table(chunks: dict[int, list[tuple[tuple, tuple]]], n: int) -> ChunkTable:
    """key index -> its stored chunks (offsets, lengths), as the plan's chunk table."""
    start, end, offs, lens = np.zeros(n, np.int64), np.zeros(n, np.int64), [], []
    for k in range(n):
        start[k] = len(offs)
        for o, ln in chunks.get(k, []):
            offs.append(list(o) + [0] * (WIDTH - len(o)))
            lens.append(list(ln) + [0] * (WIDTH - len(ln)))
        end[k] = len(offs)
    return ChunkTable(start, end, np.array(offs, np.int64).reshape(-1, WIDTH), np.array(lens, np.int64).reshape(-1, WIDTH))


def _plan(per_rank, chunks, me, *, hosts=None, order=None, n=None, **kw):
    """Rank ``me``'s global plan of ``per_rank`` (a list of shard keys per rank), records permuted by ``order``."""
    rows, recs = [], []
    for r, keys in enumerate(per_rank):
        keys = list(keys) if order is None else [keys[i] for i in order(len(keys), r)]
        off = [list(k[1]) + [0] * (WIDTH - len(k[1])) for k in keys]
        ln = [list(k[2]) + [0] * (WIDTH - len(k[2])) for k in keys]
        rec = encode_record([k[0] for k in keys], [True] * len(keys), off, ln, [], WIDTH)
        exact = all((k[1], k[2]) in chunks.get(k[0], []) for k in keys)
        rows.append(make_row(record=rec, save_id="s", problems=False, host=hosts[r] if hosts else r,
                             resharded=not exact))
        recs.append(rec)
    rows = np.stack(rows)
    cls = classes(rows)
    records = [decode_record(recs[int(o)]) for o in cls.owners]
    n = n or 1 + max(k[0] for keys in per_rank for k in keys)
    ndim = np.full(n, WIDTH, np.int64)
    return G.global_plan(rows, cls, records, me, ndim=ndim, itemsize=np.full(n, ITEMSIZE, np.int64), broadcast=True,
                         batch_bytes=kw.pop("batch_bytes", 0), can_create=True, chunks=_table(chunks, n), **kw)


def _tp_dp(tp: int, dp: int, tensors: dict[int, tuple[int, int, str]]):
    """Per rank (tp fastest) its boxes of whole-tensor chunks: col -> Shard(0), row -> Shard(1), else whole."""
    per_rank = []
    for r in range(tp * dp):
        t, keys = r % tp, []
        for i, (a, b, role) in sorted(tensors.items()):
            if role == "col":
                keys.append((i, (t * a // tp, 0), (a // tp, b)))
            elif role == "row":
                keys.append((i, (0, t * b // tp), (a, b // tp)))
            else:
                keys.append((i, (0, 0), (a, b)))
        per_rank.append(keys)
    return per_rank


TENSORS = {0: (64, 48, "col"), 1: (48, 64, "row"), 2: (8, 8, "rep"), 3: (32, 16, "row")}
WHOLE = {i: [((0, 0), (a, b))] for i, (a, b, _) in TENSORS.items()}


def _ops(gp):
    return [(op.group, op.reader, op.shards, gp.sets[op.group].members) for op in gp.ops]


def test_shard1_boxes_of_one_chunk_become_one_unit_read_once_by_one_reader():
    per_rank = _tp_dp(2, 2, TENSORS)
    gp = _plan(per_rank, WHOLE, 0)
    units = {k: r for k, r in gp.readers.items() if is_unit(k)}
    # the Shard(1) tensors (1 and 3) are units of the whole chunk; Shard(0) rows and the replicated one stay shards
    assert sorted({unit_index(k) for k in units}) == [1, 3]
    assert all(k[1] == (0, 0) or k[2][1] == TENSORS[unit_index(k)][1] for k in units)  # whole rows of the chunk
    assert sum(np.prod(k[2]) for k in units) == 48 * 64 + 32 * 16  # each chunk once, cut or not
    shard_keys = [k for k in gp.readers if not is_unit(k)]
    assert sorted({k[0] for k in shard_keys}) == [0, 2]
    # a unit's holder set is every rank needing part of it
    for op in gp.ops:
        if any(is_unit(k) for k in op.shards):
            assert gp.sets[op.group].members == (0, 1, 2, 3)
    # the bytes every rank reads sum to the unique bytes: each stored byte read once
    assert sum(gp.loads) == sum(a * b for a, b, _ in TENSORS.values()) * ITEMSIZE


@pytest.mark.parametrize("seed", range(4))
def test_units_are_derived_alike_on_every_rank_and_for_any_record_order(seed):
    rng = random.Random(seed)
    per_rank = _tp_dp(2, 2, TENSORS)

    def shuffled(n, r):
        idx = list(range(n))
        random.Random(seed * 100 + r).shuffle(idx)
        return idx

    base = [_plan(per_rank, WHOLE, me) for me in range(4)]
    perm = [_plan(per_rank, WHOLE, me, order=shuffled) for me in range(4)]
    assert len({gp.digest() for gp in base + perm}) == 1
    for a, b in zip(base, perm):
        assert _ops(a) == _ops(b)
    # the one global order: every op two ranks share comes in the same relative order on both
    for a, b in itertools.combinations(range(4), 2):
        common = [o for o in _ops(base[a]) if a in o[3] and b in o[3]]
        assert common == [o for o in _ops(base[b]) if a in o[3] and b in o[3]]
    assert rng is not None


def test_a_rank_in_no_unit_still_plans_and_takes_part_in_its_broadcasts():
    # ranks 0-3 TP2 x DP2 over the Shard(1) tensor 1; rank 4 holds only tensor 2 (replicated with rank 0's)
    per_rank = [keys for keys in _tp_dp(2, 2, {1: (48, 64, "row")})] + [[(2, (0, 0), (8, 8))]]
    per_rank[0] = per_rank[0] + [(2, (0, 0), (8, 8))]
    chunks = {1: [((0, 0), (48, 64))], 2: [((0, 0), (8, 8))]}
    plans = [_plan(per_rank, chunks, me) for me in range(5)]
    assert len({gp.digest() for gp in plans[:4]}) == 1
    lone = plans[4]
    assert not any(is_unit(k) for k in lone.pieces)
    assert [op.shards for op in lone.ops] == [((2, (0, 0), (8, 8)),)]
    assert [op.shards for op in plans[0].ops if (2, (0, 0), (8, 8)) in op.shards] == [((2, (0, 0), (8, 8)),)]


def test_mixed_shard_part_unit_part_private_and_policy_on_one_host():
    # a box spanning two chunks: rows 0-3 are also needed (differently) by the other class, rows 4-7 only by it
    chunks = {0: [((0, 0), (4, 8)), ((4, 0), (4, 8))]}
    per_rank = [[(0, (0, 0), (8, 4))], [(0, (0, 4), (4, 4))]]
    gp = _plan(per_rank, chunks, 0)
    units = [k for k in gp.pieces if is_unit(k)]
    assert units == [(-1, (0, 0), (4, 8))]  # the first chunk only: the second has one needer
    assert (0, (0, 0), (8, 4)) not in gp.pieces  # the mixed shard is not shared as a whole
    assert gp.loads == [4 * 8 * ITEMSIZE, 0]  # the unit's chunk, read by the lower rank (its private rows are its own)
    # on one host, under the host-aware policy, reading locally stays the choice: no unit, no broadcast
    same = _plan(per_rank, chunks, 0, hosts=[7, 7], same_host_private=True)
    assert not same.ops and not any(is_unit(k) for k in same.pieces)


def test_contiguous_parts_stay_shards_and_as_saved_loads_plan_no_unit():
    per_rank = _tp_dp(2, 1, {0: (64, 48, "col")})
    gp = _plan(per_rank, {0: [((0, 0), (64, 48))]}, 0)
    assert not any(is_unit(k) for k in gp.pieces)  # Shard(0) row blocks: contiguous parts, read once each
    saved = {0: [((0, 0), (32, 48)), ((32, 0), (32, 48))]}
    per_rank = _tp_dp(2, 2, {0: (64, 48, "col")})
    gp = _plan(per_rank, saved, 0)
    assert not any(is_unit(k) for k in gp.pieces) and gp.ops


def test_a_units_group_is_created_by_every_rank_also_one_in_no_unit():
    # ranks 0-2 need parts of tensor 0's one chunk (0 and 2 the same part); rank 3 loads tensor 1 alone
    chunks = {0: [((0, 0), (16, 32))], 1: [((0, 0), (4, 4))]}
    per_rank = [[(0, (0, 0), (16, 16))], [(0, (0, 16), (16, 16))], [(0, (0, 0), (16, 16))], [(1, (0, 0), (4, 4))]]
    plans = [_plan(per_rank, chunks, me) for me in range(4)]
    assert all(gp.creates == [(0, 1, 2)] for gp in plans)  # new_group is world-wide: rank 3 calls it too
    assert not plans[3].ops
    assert [[(op.reader, op.shards) for op in gp.ops] for gp in plans[:3]] == [[(0, ((-1, (0, 0), (16, 32)),))]] * 3
