"""The pure parts of planning: balancing, the global load plan, the save plan, metadata."""

from __future__ import annotations

import json
import math
import random

import numpy as np
import pytest
import torch

from pipeload.plan import balance
from pipeload.errors import CheckpointFormatError
from pipeload.formats.metadata import ChunkMeta, Metadata, ObjectMeta, TensorMeta
from pipeload.plan.exchange import classes, decode_record, encode_record, group_digest, make_row
from pipeload.plan.globalplan import global_plan
from pipeload.plan.planner import DestShard, LocalPlan, local_plan, plan_record
from pipeload.save.saver import plan_save
from pipeload.plan.statedict import flatten, is_container


ITEMSIZE = 4


def plan_all(per_rank, *, broadcast=True, batch_bytes=0, can_create=True, reusable=None, stripe=True,
             min_stripe=1 << 20, n_keys=None, hosts=None, same_host_private=False, everything=False,
             writers=None):
    """The global plan of every rank, through the loader's own exchange formats (records, rows, classes).

    ``per_rank[r]`` = ([(key, broadcastable)], [object indices]); keys are (index, offsets, lengths)
    of 1-d or 2-d shards, ``ITEMSIZE`` bytes per element; ``writers``: key -> affinity.
    """
    world = len(per_rank)
    width = 2
    rows, recs = [], []
    for r, (shards, objects) in enumerate(per_rank):
        off = [list(k[1]) + [0] * (width - len(k[1])) for k, _ in shards]
        ln = [list(k[2]) + [0] * (width - len(k[2])) for k, _ in shards]
        rec = encode_record([k[0] for k, _ in shards], [bc for _, bc in shards], off, ln, objects, width,
                            [(writers or {}).get(k, -1) for k, _ in shards])
        groups = [group_digest(m) for m in (reusable[r] if reusable else [])]
        rows.append(make_row(record=rec, save_id="s", problems=False, host=hosts[r] if hosts else 0, groups=groups))
        recs.append(rec)
    rows = np.stack(rows)
    cls = classes(rows)
    records = [decode_record(recs[int(o)]) for o in cls.owners]
    n = n_keys or 1 + max([k[0] for shards, _ in per_rank for k, _ in shards] + [0])
    ndims = {k[0]: len(k[1]) for shards, _ in per_rank for k, _ in shards}
    ndim = np.array([ndims.get(i, 1) for i in range(n)], dtype=np.int64)
    itemsize = np.full(n, ITEMSIZE, dtype=np.int64)
    return [global_plan(rows, cls, records, me, ndim=ndim, itemsize=itemsize, broadcast=broadcast,
                        batch_bytes=batch_bytes, can_create=can_create, stripe=stripe, min_stripe=min_stripe,
                        same_host_private=same_host_private, everything=everything)
            for me in range(world)]


def _nbytes(key):
    return math.prod(key[2]) * ITEMSIZE


def _random_payloads(rng: random.Random, world: int, n_fqn: int):
    """Per-rank lists of (key, broadcastable) with random replication, plus object indices."""
    per_rank = [([], []) for _ in range(world)]
    for idx in range(n_fqn):
        rows = rng.choice([1, 2, 4, 8, 64, 3000])
        parts = rng.choice([1, 2, 4])
        for p in range(parts):
            key = (idx, (p * rows, 0), (rows, rng.choice([1, 16])))
            holders = rng.sample(range(world), rng.randint(1, world))
            bc = rng.random() > 0.05
            for r in holders:
                per_rank[r][0].append((key, bc if r == holders[0] else True))
    for r in range(world):
        per_rank[r][1].extend(rng.sample(range(n_fqn), 3))
    return per_rank


def _ops(plan):
    return [(op.group, op.reader, op.shards) for op in plan.ops]


@pytest.mark.parametrize("seed", range(5))
def test_global_plan_ignores_item_order(seed):
    """Shuffling any rank's items changes no decision and no rank's broadcast sequence."""
    rng = random.Random(seed)
    world = rng.choice([2, 3, 4, 8])
    per_rank = _random_payloads(rng, world, 60)
    kw = dict(batch_bytes=rng.choice([0, 512, 4096]), min_stripe=rng.choice([1, 1 << 20]))
    ref = plan_all(per_rank, **kw)
    assert any(p.ops for p in ref), "the random layout must share something"
    assert len({p.digest() for p in ref}) == 1
    for _ in range(3):
        shuffled = []
        for shards, objs in per_rank:
            shards, objs = shards[:], objs[:]
            rng.shuffle(shards)
            rng.shuffle(objs)
            shuffled.append((shards, objs))
        other = plan_all(shuffled, **kw)
        for a, b in zip(ref, other):
            assert a.digest() == b.digest() and _ops(a) == _ops(b) and a.pieces == b.pieces


@pytest.mark.parametrize("seed", range(4))
def test_every_rank_orders_shared_broadcasts_alike(seed):
    """Any two ranks issue the broadcasts they both take part in in the same order (no deadlock)."""
    rng = random.Random(100 + seed)
    world = rng.choice([3, 4, 8])
    plans = plan_all(_random_payloads(rng, world, 80), batch_bytes=rng.choice([0, 2048]), min_stripe=1)
    for a in plans:
        for b in plans:
            common = set(_ops(a)) & set(_ops(b))
            assert [o for o in _ops(a) if o in common] == [o for o in _ops(b) if o in common]
    for r, p in enumerate(plans):  # a rank's broadcasts are those of the holder sets it is in
        assert all(r in p.sets[op.group].members for op in p.ops)


@pytest.mark.parametrize("seed", range(4))
def test_readers_are_the_greedy_of_balance_assign(seed):
    """Without cutting, readers are exactly balance.assign (largest first, least loaded, ties to lower rank)."""
    rng = random.Random(200 + seed)
    world = rng.choice([2, 4, 8])
    per_rank = _random_payloads(rng, world, 60)
    plan = plan_all(per_rank, stripe=False, everything=True)[0]
    holders, bcs = {}, {}
    for r, (shards, _) in enumerate(per_rank):
        for k, bc in shards:
            holders.setdefault(k, []).append(r)
            bcs[k] = bcs.get(k, True) and bc
    shared = {k: h for k, h in holders.items() if len(h) >= 2 and bcs[k]}
    base: dict[int, int] = {}
    for k, h in holders.items():
        if len(h) == 1:
            base[h[0]] = base.get(h[0], 0) + _nbytes(k)
    expect = balance.assign({k: _nbytes(k) for k in shared}, shared, base)
    assert plan.readers == expect


def test_one_non_broadcastable_holder_makes_the_shard_private():
    k = (0, (0,), (10,))
    for plan in plan_all([([(k, True)], []), ([(k, False)], []), ([(k, True)], [])]):
        assert plan.ops == [] and plan.pieces == {}


def test_reader_is_least_loaded_largest_first_ties_in_rank_order():
    big, mid, small = (0, (0,), (100,)), (1, (0,), (60,)), (2, (0,), (50,))
    per_rank = [([(big, True), (mid, True), (small, True)], []) for _ in range(2)]
    plan = plan_all(per_rank)[0]
    # big -> rank 0 (tie, rank order); mid -> rank 1 (0 bytes); small -> rank 1 (240 < 400).
    assert plan.readers == {big: 0, mid: 1, small: 1}
    # Execution order is the key order, not the size order.
    assert [op.shards for op in plan.ops] == [(big,), (mid,), (small,)]


def test_small_shards_are_batched_per_group_and_reader():
    keys = [(i, (0,), (16,)) for i in range(10)]  # 64 bytes each, 64 aligned
    per_rank = [([(k, True) for k in keys], []) for _ in range(2)]
    plan = plan_all(per_rank, batch_bytes=256)[0]
    assert sum(len(op.shards) for op in plan.ops) == 10
    assert all(len({plan.readers[k] for k in op.shards}) == 1 for op in plan.ops)
    assert len(plan.ops) < 10
    assert sorted(k for op in plan.ops for k in op.shards) == keys


def test_subgroup_sets_need_a_group_unless_creatable():
    k = (0, (0,), (8,))
    per_rank = [([(k, True)], []), ([], []), ([(k, True)], [])]
    assert all(p.ops == [] for p in plan_all(per_rank, can_create=False))
    plan = plan_all(per_rank, can_create=True)[0]
    assert plan.creates == [(0, 2)]
    reuse = plan_all(per_rank, can_create=False, reusable=[[(0, 2)], [], [(0, 2)]])
    assert [_ops(p) for p in reuse] == [[(1, 0, (k,))], [], [(1, 0, (k,))]] and reuse[0].creates == []


def test_large_replicated_shards_are_cut_into_contiguous_equal_runs():
    """One huge shard and a few small ones, 8 replicas: every replica reads ~1/8, contiguous rows."""
    huge, small = (0, (0, 0), (1000, 64)), [(i, (0, 0), (3, 64)) for i in range(1, 4)]
    per_rank = [([(huge, True), *((k, True) for k in small)], []) for _ in range(8)]
    plans = plan_all(per_rank, min_stripe=1)
    plan = plans[0]
    loads = plan.loads
    assert max(loads) <= 1.01 * (sum(loads) / 8), loads
    pieces = plan.pieces[huge]
    assert len(pieces) >= 8 and sum(p[2][0] for p in pieces) == 1000
    starts = [p[1][0] for p in pieces]
    assert starts == sorted(starts) and all(a[1][0] + a[2][0] == b[1][0] for a, b in zip(pieces, pieces[1:]))
    assert len({p.digest() for p in plans}) == 1
    # without cutting, the reader of the huge shard reads ~all of it
    assert max(plan_all(per_rank, stripe=False)[0].loads) >= 1000 * 64 * ITEMSIZE


def test_exchange_record_roundtrip_is_compact():
    plan = LocalPlan()
    t = torch.zeros(3)
    for i in range(100):
        plan.shards.append(DestShard("x", (i, (i, 0), (3, 7)), torch.float32, 84, [], t, i % 2 == 0))
    data = plan_record(plan, 2)
    rec = decode_record(data)
    assert rec.index.tolist() == list(range(100)) and rec.broadcastable.tolist() == [i % 2 == 0 for i in range(100)]
    assert rec.offsets.tolist() == [[i, 0] for i in range(100)] and rec.lengths.tolist() == [[3, 7]] * 100
    assert rec.affinity is None  # no shard names a writer
    assert len(data) == 6 * 8 + 100 * 6 * 4  # int32 columns when every value fits; no affinity column
    for i, s in enumerate(plan.shards):
        s.affinity = i % 3
    rec = decode_record(plan_record(plan, 2))
    assert rec.affinity.tolist() == [i % 3 for i in range(100)] and rec.index.tolist() == list(range(100))


def test_affinity_sends_shards_to_their_writer_within_a_tenth_of_the_share():
    """Two replica pairs ({0, 2}, {1, 3}); a foreign layout wrote each shard in one holder's file. The
    writer reads it while it stays within 11/10 of the mean; a writer that wrote everything cannot
    unbalance the load."""
    rng = random.Random(3)
    per_rank = [([], []) for _ in range(4)]
    keys = []
    for idx in range(300):
        key = (idx, (0,), (rng.choice([16, 256, 4096, 20000]),))
        keys.append(key)
        for r in ((0, 2), (1, 3))[idx % 2]:
            per_rank[r][0].append((key, True))
    balanced = {k: ((0, 2), (1, 3))[k[0] % 2][rng.random() < 0.5] for k in keys}
    everything_by_0 = {k: 0 for k in keys}
    for writers in (balanced, everything_by_0):
        plans = plan_all(per_rank, writers=writers, stripe=False, everything=True)
        assert len({p.digest() for p in plans}) == 1
        loads = plans[0].loads
        for pair in ((0, 2), (1, 3)):
            share = sum(_nbytes(k) for k in keys if k[0] % 2 == pair[0]) // 2
            assert max(loads[r] for r in pair) <= share * 11 // 10 + 20000 * ITEMSIZE, (pair, loads)
        by_writer = sum(_nbytes(k) for k in keys if plans[0].readers[k] == writers[k])
        if writers is balanced:  # nearly everything read by the rank whose file holds it
            assert by_writer >= 0.9 * sum(_nbytes(k) for k in keys), by_writer
    plain = plan_all(per_rank, stripe=False, everything=True)[0]
    assert plain.readers == {k: balance.assign({k: _nbytes(k) for k in keys},
                                               {k: list(((0, 2), (1, 3))[k[0] % 2]) for k in keys})[k] for k in keys}


def test_balance_assign_is_order_independent():
    rng = random.Random(0)
    weights = {i: rng.randint(1, 1000) for i in range(200)}
    holders = {i: sorted(rng.sample(range(8), 3)) for i in weights}
    a = balance.assign(weights, holders)
    items = list(weights.items())
    rng.shuffle(items)
    assert balance.assign(dict(items), holders) == a


def _md(tensors: dict[str, TensorMeta]) -> Metadata:
    return Metadata(save_id="0" * 16, world_size=2, tensors=tensors)


def test_row_helpers_match_numpy_row_semantics():
    """The global plan's row helpers: _unique_rows is numpy's row-wise unique (first index, inverse; set ids
    follow its order), _row_tuples cuts each row to its own width, as Python ints."""
    from pipeload.plan.globalplan import _row_tuples, _unique_rows

    rng = np.random.default_rng(3)
    for _ in range(200):
        n, k = int(rng.integers(1, 120)), int(rng.integers(1, 4))
        hi = int(rng.choice([2, 7, 2**62]))
        a = rng.integers(-hi, hi, (n, k)).astype(np.int64)
        _, first, inverse = np.unique(a, axis=0, return_index=True, return_inverse=True)
        got_first, got_inverse = _unique_rows(a)
        assert np.array_equal(got_first, first) and np.array_equal(got_inverse, inverse.ravel())
        nd = rng.integers(0, k + 1, n)
        rows = _row_tuples(a, nd)
        assert rows == [tuple(int(x) for x in a[i, : nd[i]]) for i in range(n)]
        assert all(type(x) is int for r in rows for x in r)
    assert _row_tuples(np.zeros((3, 2), np.int64), np.zeros(3, np.int64)) == [(), (), ()]
    assert _row_tuples(np.zeros((0, 2), np.int64), np.zeros(0, np.int64)) == []


def _greedy_oracle(order, weight, sid, prefer, cap, members, loads):
    """The reader rule written plainly: affinity within the cap, then each shard to the member with
    the fewest bytes (lowest rank on ties), in ``order``."""
    reader = [-1] * len(weight)
    for i in order:
        h = prefer[i] if len(prefer) else -1
        if h >= 0 and h in members[sid[i]] and loads[h] + weight[i] <= cap[sid[i]]:
            reader[i] = h
            loads[h] += weight[i]
    for i in order:
        if reader[i] < 0:
            r = min(members[sid[i]], key=lambda m: (loads[m], m))
            reader[i] = r
            loads[r] += weight[i]
    return reader


@pytest.mark.parametrize("seed", range(6))
def test_assign_readers_is_the_plain_rule_over_overlapping_sets(seed):
    """The array greedy (lazily refreshed heaps, one per holder set) against the rule written plainly,
    on sets that share ranks (so heap entries go stale), with and without writers' affinity."""
    from pipeload.plan._greedy import assign_readers

    rng = np.random.default_rng(seed)
    world, n_sets, n = 12, 7, 400
    members = [sorted(rng.choice(world, size=int(rng.integers(1, world + 1)), replace=False).tolist())
               for _ in range(n_sets)]
    weight = rng.choice([1, 2, 3, 1000, 5000, 5000], size=n).astype(np.int64)
    sid = rng.integers(0, n_sets, size=n).astype(np.int64)
    order = rng.permutation(n)[: n - 17].astype(np.int64)  # some shards are not the greedy's (cut sets)
    base = rng.integers(0, 3000, size=world).astype(np.int64)
    # writers may name ranks outside the world (a hostile file name): never chosen, never indexed
    for prefer in (np.zeros(0, np.int64), rng.integers(-1, world + 1000, size=n).astype(np.int64),
                   rng.integers(-1, world, size=n).astype(np.int64)):
        cap = rng.integers(2000, 60000, size=n_sets).astype(np.int64)
        start = np.cumsum([0] + [len(m) for m in members[:-1]]).astype(np.int64)
        size = np.asarray([len(m) for m in members], dtype=np.int64)
        flat = np.asarray([r for m in members for r in m], dtype=np.int64)
        loads = base.copy()
        got = assign_readers(order, weight, sid, prefer, cap, start, size, flat, loads)
        want_loads = base.tolist()
        want = _greedy_oracle(order.tolist(), weight.tolist(), sid.tolist(), prefer.tolist(), cap.tolist(),
                              members, want_loads)
        assert got.tolist() == want and loads.tolist() == want_loads


def _cut_oracle(weight, rows, sizes):
    """Stream cutting written plainly: (shard, first row, end row, segment) per piece."""
    n = len(sizes)
    bounds = [sum(sizes[: i + 1]) for i in range(n - 1)]  # stream byte where segment i ends
    out, pos, seg = [], 0, 0
    for j, (w, r_all) in enumerate(zip(weight, rows)):
        if r_all < 1 or w == 0:
            while seg < n - 1 and bounds[seg] <= pos:
                seg += 1
            out.append((j, 0, r_all, seg))
            pos += w
            continue
        row, r0 = w // r_all, 0
        while r0 < r_all:
            while seg < n - 1 and bounds[seg] <= pos + r0 * row:
                seg += 1
            r1 = r_all if seg == n - 1 else min(r_all, max(r0 + 1, round((bounds[seg] - pos) / row)))
            out.append((j, r0, r1, seg))
            if r1 < r_all:
                seg += 1
            r0 = r1
        pos += w
    return out


@pytest.mark.parametrize("seed", range(8))
def test_cut_stream_is_the_rule_written_plainly(seed):
    """Stream cutting over arrays against the rule written plainly: shards that cannot be cut (no rows,
    no bytes), segment ends that fall on half a row (rounded half to even), empty segments."""
    from pipeload.plan._greedy import cut_stream

    rng = np.random.default_rng(seed)
    n_shards, members = int(rng.integers(1, 60)), int(rng.integers(1, 20))
    rows = rng.choice([0, 1, 2, 3, 7, 64, 1000], size=n_shards).astype(np.int64)
    row_bytes = rng.choice([2, 4, 6, 8, 1024], size=n_shards)
    weight = (np.maximum(rows, 1) * row_bytes).astype(np.int64)
    weight[rng.random(n_shards) < 0.05] = 0
    total = int(weight.sum())
    cuts = np.sort(rng.integers(0, total + 1, size=members - 1))
    sizes = np.diff(np.concatenate([[0], cuts, [total]])).astype(np.int64)
    got = cut_stream(weight, rows, sizes)
    want = _cut_oracle(weight.tolist(), rows.tolist(), sizes.tolist())
    assert [tuple(c) for c in got.T.tolist()] == want
    # every shard's rows are covered once, in order, by consecutive pieces
    for j in range(n_shards):
        mine = [(r0, r1) for jj, r0, r1, _ in want if jj == j]
        assert mine[0][0] == 0 and mine[-1][1] == rows[j] and all(a[1] == b[0] for a, b in zip(mine, mine[1:]))


def _batch_oracle(groups: list[int], weights: list[int], batch: int, align: int) -> list[list[int]]:
    """The batching rule written plainly: the pieces of each op, ops in the order they are created."""
    ops, pending = [], {}
    for i, (g, w) in enumerate(zip(groups, weights)):
        if w >= batch:
            ops.append([i])
            continue
        members, size = pending.get(g, ([], 0))
        members.append(i)
        size += -(-w // align) * align
        if size >= batch:
            ops.append(members)
            pending.pop(g, None)
        else:
            pending[g] = (members, size)
    ops += [m for m, _ in sorted(pending.values(), key=lambda v: v[0][0])]
    return ops


@pytest.mark.parametrize("seed", range(6))
def test_batch_ops_is_the_rule_written_plainly(seed):
    """Batching over arrays against the plain rule: pieces at or over the batch size alone, batches that
    close on the piece crossing it (each piece rounded up to the alignment), open ones last by first piece."""
    from pipeload.plan._greedy import batch_ops

    rng = np.random.default_rng(seed)
    n = int(rng.integers(0, 400))
    groups = rng.integers(0, int(rng.integers(1, 12)), size=n).astype(np.int64)
    weights = rng.choice([0, 1, 63, 64, 65, 1000, 4096, 10_000, 70_000], size=n).astype(np.int64)
    batch = int(rng.choice([0, 64, 4096, 65_536]))
    op_of = batch_ops(groups, weights, batch, 64)
    got = [np.flatnonzero(op_of == k).tolist() for k in range(int(op_of.max()) + 1 if n else 0)]
    assert got == _batch_oracle(groups.tolist(), weights.tolist(), batch, 64)
    with pytest.raises(ValueError):
        batch_ops(np.array([-1], dtype=np.int64), np.array([1], dtype=np.int64), 64, 64)


def test_local_plan_reshards_into_exact_read_items():
    # Stored as 3 uneven row chunks, loaded as a column shard: every element exactly once.
    chunks = tuple(
        ChunkMeta((o, 0), (n, 6), f"f{i}", f"k{i}", "0" * 16) for i, (o, n) in enumerate([(0, 3), (3, 4), (7, 3)])
    )
    md = _md({"w": TensorMeta("F32", (10, 6), chunks)})
    plan = local_plan(flatten({"w": torch.zeros(10, 6)}), md, lambda t: True)
    assert not plan.problems and len(plan.shards) == 1
    cover = torch.zeros(10, 6, dtype=torch.int32)
    for it in plan.shards[0].reads:
        sl = tuple(slice(o, o + n) for o, n in zip(it.dest_offsets, it.lengths))
        cover[sl] += 1
    assert torch.equal(cover, torch.ones_like(cover))
    assert sum(it.nbytes for it in plan.shards[0].reads) == plan.shards[0].nbytes == 240


def test_local_plan_collects_every_problem():
    md = _md({
        "a": TensorMeta("F32", (4,), (ChunkMeta((0,), (4,), "f", "a", "0" * 16),)),
        "b": TensorMeta("F32", (4,), (ChunkMeta((0,), (4,), "f", "b", "0" * 16),)),
    })
    sd = {"a": torch.zeros(4, dtype=torch.float64), "b": torch.zeros(5), "c": torch.zeros(1)}
    plan = local_plan(flatten(sd), md, lambda t: True)
    text = "\n".join(plan.problems)
    assert "'a'" in text and "F64" in text and "'b'" in text and "[5]" in text and "'c'" in text
    loose = local_plan(flatten({"c": torch.zeros(1)}), md, lambda t: True, strict=False)
    assert loose.missing == ["c"] and not loose.problems


def test_plan_save_writes_replicas_once_and_checks_tiling():
    e = lambda off, ln: ("t", "w", "F32", (8, 4), off, ln)  # noqa: E731
    owners, tensors, problems = plan_save([[e((0, 0), (4, 4))], [e((4, 0), (4, 4))], [e((0, 0), (4, 4))],
                                           [e((4, 0), (4, 4))]])
    assert not problems and sorted(owners.values()) == [0, 1]
    _, _, problems = plan_save([[e((0, 0), (4, 4))], [e((2, 0), (4, 4))]])
    assert problems and "tile" in problems[0]
    _, _, problems = plan_save([[("t", "w", "F32", (8, 4), (0, 0), (8, 4))], [("t", "w", "F16", (8, 4), (0, 0), (8, 4))]])
    assert problems and "F16" in problems[0]


def _moe_entries(world=4, tp=2):
    from pipeload.tools import synth

    spec = synth.model_spec(64)
    per_rank = [[] for _ in range(world)]
    for fqn, shape, role in spec.tensors():
        dim = {"col": 0, "row": 1}.get(role)
        for r in range(world):
            t = r % tp
            if dim is None or len(shape) < 2:
                off, ln = (0,) * len(shape), shape
            else:
                n = shape[dim] // tp
                off = tuple(t * n if d == dim else 0 for d in range(len(shape)))
                ln = tuple(n if d == dim else s for d, s in enumerate(shape))
            per_rank[r].append(("t", fqn, "BF16", shape, off, ln))
    for r in range(world):  # something only each rank has, and objects every rank has
        per_rank[r].append(("t", f"rank{r}.only", "BF16", (1000 * (r + 1),), (0,), (1000 * (r + 1),)))
        per_rank[r].append(("o", "iteration", 1100, "0" * 16))
    return per_rank


def test_save_balance_on_moe_shapes():
    """TP2xDP2 MoE-shaped layout: the largest writer writes at most 1.10x the mean."""
    world = 4
    per_rank = _moe_entries(world)
    owners, tensors, problems = plan_save(per_rank)
    assert not problems and len(tensors) > 3000
    written = [0] * world
    for key, r in owners.items():
        if key[0] == "t":
            written[r] += math.prod(key[3]) * 2
    assert max(written) <= 1.10 * (sum(written) / world), written


def test_unchanged_layout_reads_the_file_each_rank_wrote():
    per_rank = _moe_entries()
    owners, _, _ = plan_save(per_rank)
    names = sorted({e[1] for entries in per_rank for e in entries})
    index = {n: i for i, n in enumerate(names)}
    payloads = [([((index[e[1]], e[4], e[5]), True) for e in entries if e[0] == "t"],
                 [index[e[1]] for e in entries if e[0] == "o"]) for entries in per_rank]
    global ITEMSIZE
    saved, ITEMSIZE = ITEMSIZE, 2
    try:
        plan = plan_all(payloads, batch_bytes=6 << 20, n_keys=len(names))[0]
    finally:
        ITEMSIZE = saved
    assert len(plan.readers) > 3000
    for (idx, off, ln), reader in plan.readers.items():
        assert owners[("t", names[idx], off, ln)] == reader, names[idx]
    assert len({r for k, r in owners.items() if k[0] == "o"}) == 1  # objects live in one file


def test_metadata_roundtrip_and_rejects_bad_json():
    md = _md({"w": TensorMeta("BF16", (2, 3), (ChunkMeta((0, 0), (2, 3), "d.safetensors", "w", "a" * 16),))})
    md.objects["o"] = ObjectMeta("d.safetensors", "o#object", 10, "b" * 16)
    assert Metadata.from_json(md.to_json()) == md
    doc = json.loads(md.to_json())
    for mutate, needle in (
        (lambda d: d.update(format="x"), "not a pipeload checkpoint"),
        (lambda d: d.update(version=99), "version 99"),
        (lambda d: d["tensors"]["w"].update(dtype="F99"), "unsupported dtype"),
        (lambda d: d["tensors"]["w"]["chunks"][0].update(file="../etc/passwd"), "plain file name"),
        (lambda d: d["tensors"]["w"]["chunks"][0].update(lengths=[1, 3]), "tile"),
        (lambda d: d["tensors"]["w"]["chunks"][0].pop("checksum"), "checksum"),
    ):
        bad = json.loads(json.dumps(doc))
        mutate(bad)
        with pytest.raises(CheckpointFormatError, match=needle):
            Metadata.from_json(json.dumps(bad), source="ckpt/.metadata")
    with pytest.raises(CheckpointFormatError, match="ckpt/.metadata: metadata is not valid JSON"):
        Metadata.from_json(b"{", source="ckpt/.metadata")


def test_each_rank_plans_its_own_component_and_it_agrees_with_the_whole():
    """Ranks {0,1} share A, ranks {2,3} share B: a rank computes only its component, exactly as the whole."""
    a = [((i, (0,), (100 + i,)), True) for i in range(5)]
    b = [((10 + i, (0,), (50 + i,)), True) for i in range(5)]
    per_rank = [(a, []), (a, []), (b, []), (b, []), ([((20, (0,), (7,)), True)], [])]
    plans = plan_all(per_rank)
    whole = plan_all(per_rank, everything=True)[0]
    assert set(plans[0].readers) == {k for k, _ in a} and set(plans[2].readers) == {k for k, _ in b}
    for p in plans:
        for k, r in p.readers.items():
            assert whole.readers.get(k, r) == r
    assert plans[4].ops == [] and plans[4].readers == {}
    # creating a group is world-wide: every rank plans every creation, in its component or not
    assert whole.creates == [(0, 1), (2, 3)] and all(p.creates == whole.creates for p in plans)


def test_same_host_replicas_read_from_the_page_cache_under_the_host_aware_policy():
    k = (0, (0,), (1000,))
    per_rank = [([(k, True)], []) for _ in range(4)]
    both = plan_all(per_rank, hosts=[1, 1, 2, 2], same_host_private=True)
    assert all(p.ops for p in both)  # two hosts: broadcast
    one = plan_all(per_rank, hosts=[1, 1, 1, 1], same_host_private=True)
    assert all(p.ops == [] and p.pieces == {} for p in one)  # one host: everyone reads, page cache shared
    forced = plan_all(per_rank, hosts=[1, 1, 1, 1], same_host_private=False)
    assert all(p.ops for p in forced)


def test_plan_signature_names_no_leaf_but_tells_every_layout_apart():
    """plancache.signature walks the state dict as flatten does: leaves in flatten's order, and a
    signature that changes with any container's keys (their types too), order, nesting or any tensor's
    facts, and not with object values or tensor identities."""
    from pipeload.plan import plancache

    def sd(**over):
        d = {"a": torch.zeros(2, 3), "opt": {"step": 1, "groups": [{"lr": 0.1, "params": [0, 1]}],
                                           "state": {0: {"m": torch.zeros(4)}, 1: {"m": torch.zeros(4)}}}}
        d.update(over)
        return d

    state = sd()
    sig, values, homes = plancache.signature(state)
    leaves = flatten(state)
    assert all(v is lf.value for v, lf in zip(values, leaves.values())) and len(values) == len(leaves)
    objects = [i for i, lf in enumerate(leaves.values()) if not isinstance(lf.value, torch.Tensor)]
    assert {i: homes[i] for i in objects} == homes
    assert all(homes[i][0] is lf.container and homes[i][1] == lf.key
               for i, lf in enumerate(leaves.values()) if i in homes)
    assert plancache.leaf_positions(leaves, ["opt.state.1.m", "a"]) == [list(leaves).index("opt.state.1.m"), 0]
    assert plancache.signature(sd())[0] == sig  # new tensors, same layout
    assert plancache.signature(sd(opt={**sd()["opt"], "step": 99}))[0] == sig  # an object's value
    changed = [
        sd(a=torch.zeros(3, 2)),  # a tensor's shape
        sd(a=torch.zeros(2, 3, dtype=torch.float64)),  # dtype
        {"opt": sd()["opt"], "a": torch.zeros(2, 3)},  # key order
        sd(opt={**sd()["opt"], "state": {0: {"m": torch.zeros(4)}, True: {"m": torch.zeros(4)}}}),  # 1 -> True
        sd(opt={**sd()["opt"], "groups": [{"lr": 0.1, "params": [0, torch.zeros(1)]}]}),  # a leaf list -> a node
        sd(opt={**sd()["opt"], "step": {"n": 1}}),  # an object -> a container
        sd(b=torch.zeros(1)),  # one more key
    ]
    assert plancache.signature({"a": {}, "b": 1})[0] != plancache.signature({"a": 1, "b": {}})[0]
    assert all(plancache.signature(c)[0] != sig for c in changed)
    with pytest.raises(TypeError):
        plancache.signature([torch.zeros(1)])
    for c in [sd(), sd(opt={**sd()["opt"], "step": 99}), *changed]:  # the reused load's in-place comparison
        _same_as_signature(c, sig)
    # an OrderedDict (what Module.state_dict() returns) is visited in its own order, also once an entry
    # was moved: the comparison follows it, not the order the entries are stored in
    from collections import OrderedDict

    from pipeload.plan._leafplan import match

    od = OrderedDict([("a", torch.zeros(2)), ("b", torch.zeros(3)), ("c", 1)])
    od_sig = plancache.signature({"m": od})[0]
    moved = OrderedDict(od)
    moved.move_to_end("a")
    back = OrderedDict(moved)
    back.move_to_end("a", last=False)
    for c in (od, moved, back):
        _same_as_signature({"m": c}, od_sig)
    assert match({"m": moved}, is_container, *od_sig) is None and match({"m": back}, is_container, *od_sig)


def _same_as_signature(state, sig) -> None:
    """``_leafplan.match`` (a reused load's check) accepts ``state`` exactly when its signature is ``sig``,
    and then gives the signature's leaves and homes."""
    from pipeload.plan import plancache
    from pipeload.plan._leafplan import match

    got = match(state, is_container, *sig)
    want, values, homes = plancache.signature(state)
    if want != sig:
        assert got is None
    else:
        assert got is not None and len(got[0]) == len(values) and all(a is b for a, b in zip(got[0], values))
        assert got[1].keys() == homes.keys() and all(got[1][i][0] is homes[i][0] and got[1][i][1] == homes[i][1]
                                                     for i in homes)


def test_in_place_comparison_agrees_with_the_signature_on_random_layouts():
    """Random nested state dicts, each compared with random mutations of itself (a key renamed, retyped
    or moved, a list longer, a tensor reshaped, retyped or turned into an object or a container, a
    container emptied): the in-place comparison reuses a plan exactly when the signatures are equal."""
    import copy

    from pipeload.plan import plancache

    rng = random.Random(7)

    def build(depth: int):
        if depth > 2 or rng.random() < 0.3:
            return rng.choice([lambda: torch.zeros(rng.randint(1, 3)), lambda: rng.random(), lambda: "x",
                               lambda: torch.zeros(2, dtype=torch.float16)])()
        if rng.random() < 0.7:
            return {rng.choice(["a", "b", "c", 1, 2, True]): build(depth + 1) for _ in range(rng.randint(0, 4))}
        return [build(depth + 1) for _ in range(rng.randint(0, 3))]

    def nodes_of(x, out):
        if isinstance(x, (dict, list)):
            out.append(x)
            for v in (x.values() if isinstance(x, dict) else x):
                nodes_of(v, out)
        return out

    def mutate(state):
        s = copy.deepcopy(state)
        node = rng.choice(nodes_of(s, []))
        op = rng.randrange(6)
        if isinstance(node, dict) and node:
            k = rng.choice(list(node))
            if op == 0:
                node[str(k) + "_"] = node.pop(k)  # renamed (and moved to the end)
            elif op == 1:
                node[k] = torch.zeros(5)
            elif op == 2:
                node[k] = {"n": 1} if not isinstance(node[k], dict) else 1
            elif op == 3:
                node[k] = node.pop(k)  # moved to the end
            elif op == 4:
                node[k] = "object" if isinstance(node[k], torch.Tensor) else torch.zeros(1, 1)
            else:
                node.clear()
        elif isinstance(node, list):
            node.append(torch.zeros(1)) if op % 2 else node.extend([1])
        else:
            node["z"] = 0
        return s

    n_same = n_differ = 0
    for _ in range(300):
        state = {"root": build(0), "t": torch.zeros(2)}
        sig = plancache.signature(state)[0]
        _same_as_signature(copy.deepcopy(state), sig)
        for _ in range(4):
            other = mutate(state)
            _same_as_signature(other, sig)
            if plancache.signature(other)[0] == sig:
                n_same += 1
            else:
                n_differ += 1
    assert n_differ > 500 and n_same > 20  # both outcomes exercised
