"""Each step of the global plan's pipeline (pipeload.plan.globalplan) on its own, and the pipeline as a whole.

The inputs are built through the loader's own exchange formats (records, rows, classes), as
``tests/test_planner.py`` does; each test states the invariant of one step.
"""

from __future__ import annotations

import random

import numpy as np
import pytest

from pipeload.plan import balance
from pipeload.plan import globalplan as G
from pipeload.plan.exchange import classes, decode_record, encode_record, group_digest, make_row

from test_planner import ITEMSIZE, _random_payloads, plan_all

WIDTH = 2


def _inputs(per_rank, reusable=None, hosts=None):
    """(rows, cls, records, ndim, itemsize) of ``per_rank`` as the loader exchanges them."""
    rows, recs = [], []
    for r, (shards, objects) in enumerate(per_rank):
        off = [list(k[1]) + [0] * (WIDTH - len(k[1])) for k, _ in shards]
        ln = [list(k[2]) + [0] * (WIDTH - len(k[2])) for k, _ in shards]
        rec = encode_record([k[0] for k, _ in shards], [bc for _, bc in shards], off, ln, objects, WIDTH)
        groups = [group_digest(m) for m in (reusable[r] if reusable else [])]
        rows.append(make_row(record=rec, save_id="s", problems=False, host=hosts[r] if hosts else r, groups=groups))
        recs.append(rec)
    rows = np.stack(rows)
    cls = classes(rows)
    records = [decode_record(recs[int(o)]) for o in cls.owners]
    n = 1 + max([k[0] for shards, _ in per_rank for k, _ in shards] + [o for _, objs in per_rank for o in objs] + [0])
    ndims = {k[0]: len(k[1]) for shards, _ in per_rank for k, _ in shards}
    ndim = np.array([ndims.get(i, 1) for i in range(n)], dtype=np.int64)
    return rows, cls, records, ndim, np.full(n, ITEMSIZE, dtype=np.int64)


def _sizes(cls):
    return np.array([len(m) for m in cls.members], dtype=np.int64)


def k1(i, n, at=0):
    return (i, (at,), (n,))


def test_shard_columns_concatenate_records_in_class_order_with_byte_weights():
    a, b = [(k1(0, 10), True), (k1(1, 3), False)], [(k1(1, 3), True)]
    rows, cls, records, ndim, itemsize = _inputs([(a, [2]), (b, [])])
    sh = G.shard_columns(records, ndim, itemsize)
    assert sh.cl.tolist() == [0, 0, 1] and sh.index.tolist() == [0, 1, 1]
    assert sh.bc.tolist() == [True, False, True] and sh.affinity is None
    assert sh.weight.tolist() == [40, 12, 12]  # itemsize x lengths, the padding column skipped
    assert sh.requested.tolist() == [0, 1, 2]  # shards and objects


def test_group_keys_joins_identical_keys_lowest_class_first():
    shared, alone = k1(0, 10), k1(1, 5)
    per_rank = [([(shared, True), (alone, True)], []), ([(shared, False)], []), ([(shared, True)], [])]
    rows, cls, records, ndim, itemsize = _inputs(per_rank)
    sh = G.shard_columns(records, ndim, itemsize)
    kg = G.group_keys(sh, _sizes(cls))
    by_key = {int(sh.index[kg.order[s]]): g for g, s in enumerate(kg.starts)}
    g = by_key[0]
    rows_of = kg.order[kg.starts[g]:kg.ends[g]]
    assert sh.cl[rows_of].tolist() == [0, 1, 2] and kg.holders[g] == 3 and kg.n_classes[g] == 3
    assert not kg.all_bc[g] and kg.all_bc[by_key[1]] and kg.holders[by_key[1]] == 1


def test_group_keys_counts_replicas_of_one_class_as_holders():
    k = k1(0, 8)
    rows, cls, records, ndim, itemsize = _inputs([([(k, True)], []), ([(k, True)], [])])  # one class, 2 ranks
    kg = G.group_keys(G.shard_columns(records, ndim, itemsize), _sizes(cls))
    assert len(records) == 1 and kg.holders.tolist() == [2] and kg.n_classes.tolist() == [1]


def test_alone_loads_and_private_bytes():
    mine, private = k1(0, 10), k1(1, 4)
    per_rank = [([(mine, True), (private, False)], []), ([(private, True)], []), ([], [])]
    rows, cls, records, ndim, itemsize = _inputs(per_rank)
    sh = G.shard_columns(records, ndim, itemsize)
    kg = G.group_keys(sh, _sizes(cls))
    assert G.alone_loads(sh, kg, cls, 3) == [40, 0, 0]  # only what a single rank holds
    multi = np.flatnonzero(kg.holders >= 2)
    extra = G.private_bytes(sh, kg, multi, len(records))
    assert extra[cls.of_rank].tolist() == [16, 16, 0]  # each holder of an unshared key reads its copy


@pytest.mark.parametrize("seed", range(3))
def test_set_signature_is_the_vectorised_one(seed):
    rng = random.Random(seed)
    rows, cls, records, ndim, itemsize = _inputs(_random_payloads(rng, 8, 40))
    sh = G.shard_columns(records, ndim, itemsize)
    kg = G.group_keys(sh, _sizes(cls))
    c = sh.cl[kg.order]
    groups = np.arange(len(kg.starts))
    sig = G.set_signatures(kg, c, groups, len(records))
    for g in groups.tolist():
        assert tuple(sig[g]) == G.set_signature(sorted(c[kg.starts[g]:kg.ends[g]].tolist()), len(records))


def test_holder_sets_number_sets_by_signature_and_decide_usable_from_rows():
    k, j = k1(0, 8), k1(1, 8)
    per_rank = [([(k, True), (j, True)], []), ([(j, True)], []), ([(k, True)], []), ([(k, True), (j, True)], [0])]
    rows, cls, records, ndim, itemsize = _inputs(per_rank, reusable=[[(0, 2, 3)], [], [(0, 2, 3)], [(0, 2, 3)]])
    sh = G.shard_columns(records, ndim, itemsize)
    kg = G.group_keys(sh, _sizes(cls))
    cand = np.flatnonzero(kg.holders >= 2)
    for can_create in (False, True):
        table = G.SetTable(rows, cls, can_create=can_create)
        sid_of = G.holder_sets(table, kg, sh.cl[kg.order], cand)
        members = {table.sets[s].members: s for s in sid_of.tolist()}
        assert set(members) == {(0, 2, 3), (0, 1, 3)}
        assert table.sets[members[(0, 2, 3)]].create is False  # every member offers that group
        assert table.sets[members[(0, 1, 3)]].create is True
        assert table.usable[members[(0, 1, 3)]] is can_create and table.usable[members[(0, 2, 3)]]
        sigs = sorted((G.set_signature(table.classes[s], len(records)), s) for s in table.sets)
        assert [s for _, s in sigs] == sorted(table.sets)  # ids in ascending signature order
    # the whole group is FULL (0), whatever its signature
    table = G.SetTable(rows, cls, can_create=False)
    assert table.add(tuple(range(len(records)))) == G.FULL and table.sets[G.FULL].members == (0, 1, 2, 3)


def test_components_join_classes_through_usable_sets_only():
    a, b, c = k1(0, 8), k1(1, 8), k1(2, 8)
    per_rank = [([(a, True)], []), ([(a, True), (b, True)], []), ([(b, True)], []), ([(c, True)], []),
                ([(c, True)], [1])]
    rows, cls, records, ndim, itemsize = _inputs(per_rank)
    sh = G.shard_columns(records, ndim, itemsize)
    kg = G.group_keys(sh, _sizes(cls))
    cand = np.flatnonzero(kg.holders >= 2)
    table = G.SetTable(rows, cls, can_create=True)
    sid_of = G.holder_sets(table, kg, sh.cl[kg.order], cand)
    find = G.components(table)
    of = cls.of_rank.tolist()
    assert find(of[0]) == find(of[1]) == find(of[2]) != find(of[3]) == find(of[4])  # a chain is one component
    good = table.ok()[sid_of]
    mine = G.in_component(table, find, of[0], sid_of, good)
    assert sorted(int(sh.index[kg.order[kg.starts[g]]]) for g in cand[mine]) == [0, 1]
    closed = G.SetTable(rows, cls, can_create=False)
    closed_sids = G.holder_sets(closed, kg, sh.cl[kg.order], cand)
    assert not closed.ok()[closed_sids].any()  # no group offered, none may be made: nothing joins


def _shared(per_rank, **kw):
    rows, cls, records, ndim, itemsize = _inputs(per_rank)
    sh = G.shard_columns(records, ndim, itemsize)
    kg = G.group_keys(sh, _sizes(cls))
    cand = np.flatnonzero((kg.holders >= 2) & kg.all_bc)
    table = G.SetTable(rows, cls, can_create=True)
    sid_of = G.holder_sets(table, kg, sh.cl[kg.order], cand)
    return G.shared_rows(sh, kg, cand, sid_of), table, G.alone_loads(sh, kg, cls, len(rows)), cls


@pytest.mark.parametrize("seed", range(4))
def test_choose_readers_is_balance_assign_and_ignores_row_order(seed):
    rng = random.Random(300 + seed)
    per_rank = _random_payloads(rng, rng.choice([2, 4, 8]), 50)
    s, table, loads, cls = _shared(per_rank)
    reader, is_cut, cut, after = G.choose_readers(s, table.sets, loads, lambda sid: 0, stripe=False, min_stripe=1)
    assert not is_cut.any() and cut == []
    keys = G._keys(s.index, s.offsets, s.lengths, s.nd)
    expect = balance.assign({k: int(w) for k, w in zip(keys, s.weight)},
                            {k: table.sets[int(sid)].members for k, sid in zip(keys, s.sid)},
                            dict(enumerate(loads)))
    assert dict(zip(keys, reader.tolist())) == expect
    assert after.tolist() == [loads[r] + sum(int(w) for k, w in zip(keys, s.weight) if expect[k] == r)
                              for r in range(len(loads))]
    perm = np.random.default_rng(seed).permutation(len(s.sid))
    shuffled = G.Shared(*(None if a is None else a[perm] for a in s))
    r2, *_ = G.choose_readers(shuffled, table.sets, loads, lambda sid: 0, stripe=False, min_stripe=1)
    assert dict(zip(G._keys(shuffled.index, shuffled.offsets, shuffled.lengths, shuffled.nd), r2.tolist())) == expect


def test_cut_streams_gives_each_member_one_contiguous_run_evening_loads():
    huge = (0, (0, 0), (1000, 64))
    per_rank = [([(huge, True), (k1(1, 64), True)], []) for _ in range(4)]
    per_rank[0][0].append((k1(2, 4000), True))  # rank 0 starts busier
    per_rank[0] = (per_rank[0][0], [])
    s, table, loads, cls = _shared(per_rank)
    reader, is_cut, cut, after = G.choose_readers(s, table.sets, loads, lambda sid: 0, stripe=True, min_stripe=1)
    assert is_cut.any() and (reader[is_cut] == -1).all()
    before = after.copy()
    (cs,) = G.cut_streams(s, [c for c in cut if len(table.sets[c].members) == 4], table.sets, after)
    assert (after - before).sum() == cs.piece_weight.sum() == s.weight[s.sid == cs.sid].sum()
    runs = {}
    for (pk, _, _, key, r) in cs.pieces():
        runs.setdefault(r, []).append(pk)
    assert len(runs) <= 4 and max(after) - min(after[[0, 1, 2, 3]]) <= 64 * 64 * ITEMSIZE


def test_rank_pieces_and_batch_keep_key_order_and_batch_per_set_and_reader():
    keys = [k1(i, 16) for i in range(8)]  # 64 bytes each
    per_rank = [([(k, True) for k in keys], []) for _ in range(2)]
    s, table, loads, cls = _shared(per_rank)
    reader, is_cut, cut, _ = G.choose_readers(s, table.sets, loads, lambda sid: 0, stripe=False, min_stripe=1)
    whole = np.flatnonzero(~is_cut)
    (p_keys, p_w, p_set, p_reader), pieces = G.rank_pieces(s, reader, whole, [], set(table.sets))
    assert list(p_keys) == keys and pieces == {k: [k] for k in keys}
    ops = G.batch(p_keys, p_w, p_set, p_reader, batch_bytes=128)
    assert sorted(k for op in ops for k in op.shards) == keys
    assert all(len(op.shards) == 2 for op in ops) and all(len({int(p_reader[keys.index(k)]) for k in op.shards}) == 1
                                                          for op in ops)
    assert G.batch((), [], [], [], 128) == []


@pytest.mark.parametrize("seed", range(6))
def test_the_pipeline_is_deterministic_and_the_same_on_every_rank_of_a_component(seed):
    """The same inputs give the same plan twice; ranks of one component agree with the whole plan."""
    rng = random.Random(400 + seed)
    per_rank = _random_payloads(rng, rng.choice([3, 4, 8]), 60)
    kw = dict(batch_bytes=rng.choice([0, 1024]), min_stripe=rng.choice([1, 1 << 20]))
    first, again = plan_all(per_rank, **kw), plan_all(per_rank, **kw)
    whole = plan_all(per_rank, everything=True, **kw)[0]
    for a, b in zip(first, again):
        assert a.digest() == b.digest() and a.ops == b.ops and a.pieces == b.pieces and a.loads == b.loads
        assert all(whole.readers[k] == r for k, r in a.readers.items())
        assert a.creates == whole.creates and a.bound == whole.bound


def _water_fill_by_steps(loads: list[int], total: int) -> list[int]:
    """The water filling spelled out: raise the k + 1 lowest together to the next load, one step at a time."""
    order = sorted(range(len(loads)), key=lambda i: loads[i])
    level, rest = 0.0, total
    for k, i in enumerate(order):
        last = k + 1 == len(order)
        need = float("inf") if last else (loads[order[k + 1]] - loads[i]) * (k + 1)
        if need >= rest:
            level = loads[i] + rest / (k + 1)
            break
        rest -= need
    add = [max(0, int(level - x)) for x in loads]
    add[order[0]] += total - sum(add)
    return add


@pytest.mark.parametrize("seed", range(4))
def test_water_fill_matches_the_steps(seed):
    """The vectorised water filling gives the step-by-step answer exactly (every rank must cut a set's
    stream at the same rows), for ties, one member, zero bytes and byte counts past 2**40."""
    rng = random.Random(seed)
    for _ in range(2000):
        n = rng.randint(1, 40)
        big = rng.choice([10, 1000, 10**9, 10**13])
        loads = [rng.randint(0, big) for _ in range(n)]
        if rng.random() < 0.3:
            loads = [rng.choice(loads) for _ in range(n)]
        total = rng.randint(0, big * rng.choice([1, 3, 50]))
        got = G._water_fill(np.asarray(loads, dtype=np.int64), total)
        assert got.tolist() == _water_fill_by_steps(loads, total), (loads, total)
        assert int(got.sum()) == total and got.min() >= 0
