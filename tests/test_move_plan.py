"""``pipeload.move.plan`` on its own: the owner's vectorised greedy against the one-piece-at-a-time rule,
``encode`` / ``decode`` against the record and op layouts written out one box and one row at a time,
and relays: each needed byte arrives once, from a rank that has it by then (a holder, or a relay that
received it in an earlier hop), the cost model's decisions, no dependence on the order of records.

Every rank of a small group encodes, every owner answers, every rank decodes, in one process.
"""

from __future__ import annotations

import contextlib
import random

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from pipeload.move import plan as P


def _layout(seed: int):
    """A group's sources and destinations: tensors of rank 0-3 sharded along one dim over ``G`` parts,
    each part held by up to ``R`` ranks; destinations are row blocks, whole tensors, random boxes (some
    outside any source, some of another shape or dtype)."""
    rng = np.random.default_rng(seed)
    size = int(rng.integers(2, 24))
    srcs = [[] for _ in range(size)]
    dsts = [[] for _ in range(size)]
    for _ in range(int(rng.integers(1, 10))):
        name = int(rng.integers(-2**62, 2**62))
        ndim = int(rng.integers(0, 4))
        shape = tuple(int(x) for x in rng.integers(1, 24, size=ndim))
        d = int(rng.integers(0, ndim)) if ndim else 0
        parts = int(rng.integers(1, 6))
        c = -(-shape[d] // parts) if ndim else 1
        for s in range(parts if ndim else 1):
            off, ln = [0] * ndim, list(shape)
            if ndim:
                off[d], ln[d] = s * c, min(c, shape[d] - s * c)
                if ln[d] <= 0:
                    continue
            for r in rng.choice(size, size=min(size, int(rng.integers(1, 5))), replace=rng.random() < 0.2).tolist():
                srcs[r].append(P.Box(name, 1, shape, tuple(off), tuple(ln)))
        for _ in range(int(rng.integers(1, 16))):
            r = int(rng.integers(0, size))
            x = rng.random()
            if x < 0.4 or not ndim:
                off, ln = (0,) * ndim, shape
            else:
                off = tuple(int(rng.integers(0, s)) for s in shape)
                ln = tuple(int(rng.integers(1, s - o + 1)) for o, s in zip(off, shape))
            dt, sh = (2, shape) if x > 0.95 else (1, tuple(s + 1 for s in shape) if 0.92 < x <= 0.95 else shape)
            dsts[r].append(P.Box(name, dt, sh, off, ln))
    return size, 3, srcs, dsts


def _plan(size, nd, srcs, dsts):
    sent = [P.encode(srcs[r], dsts[r], nd, size) for r in range(size)]
    answered = []
    for o in range(size):
        counts = np.array([c[o] for c, _ in sent])
        words = np.concatenate([w[int(c[:o].sum()): int(c[: o + 1].sum())] for c, w in sent])
        answered.append(P.answer(counts, words, nd, size))
    mine = [np.concatenate([w[int(c[:r].sum()): int(c[: r + 1].sum())] for c, w in answered]) for r in range(size)]
    return sent, answered, mine


@pytest.mark.parametrize("seed", range(40))
def test_vectorised_greedy_is_the_greedy_one_piece_at_a_time(seed, monkeypatch):
    layout = _layout(seed)
    _, fast, _ = _plan(*layout)
    monkeypatch.setattr(P, "_greedy", P._greedy_sequential)
    _, slow, _ = _plan(*layout)
    for (c1, w1), (c2, w2) in zip(fast, slow):
        assert np.array_equal(c1, c2) and np.array_equal(w1, w2)


@settings(max_examples=500, deadline=None)
@given(st.integers(0, 2**32 - 1))
def test_water_fill_is_least_loaded_one_by_one(seed):
    """Loads near one another and far apart (in pieces), ties, one holder, more pieces than holders."""
    rng = np.random.default_rng(seed)
    h = int(rng.integers(1, 12))
    w, m = int(rng.integers(1, 9)), int(rng.integers(1, 40))
    load = rng.integers(0, [50, 5 * w, 10**6][int(rng.integers(0, 3))], size=h).astype(np.int64) + 10**9 * (seed % 2)
    pos = rng.permutation(h)
    got = P._water_fill(load.copy(), pos, w, m).tolist()
    cur, want = load.copy(), []
    for _ in range(m):
        best = min(range(h), key=lambda j: (cur[j], pos[j]))
        want.append(best)
        cur[best] += w
    assert got == want


def _encode_row(b: P.Box, kind: int, index: int, nd: int) -> list[int]:
    n = len(b.shape)
    pad = lambda t: list(t) + [0] * (nd - n)  # noqa: E731
    return [kind, b.name, b.dtype, n, index, b.flags] + pad(b.shape) + pad(b.offsets) + pad(b.lengths)


def _decode_rows(words: np.ndarray, nd: int, rank: int) -> P.Answers:
    out = {P.SEND: [], P.RECV: [], P.LOCAL: []}
    problems = []
    for r in words.reshape(-1, P.answer_width(nd)).tolist():
        if r[P.A_KIND] == P.ERROR:
            problems.append((r[P.A_DST], r[P.A_PEER]))
            continue
        n = r[P.A_NDIM]
        receiver = r[P.A_PEER] if r[P.A_KIND] == P.SEND else rank
        out[r[P.A_KIND]].append(P.Op(r[P.A_NAME], receiver, r[P.A_PEER], r[P.A_SRC], r[P.A_DST], r[P.A_DTYPE],
                                     tuple(r[P.AHEAD: P.AHEAD + n]), tuple(r[P.AHEAD + nd: P.AHEAD + nd + n])))
    return P.Answers(*(sorted(out[k], key=lambda op: op.key) for k in (P.SEND, P.RECV, P.LOCAL)), sorted(problems))


@pytest.mark.parametrize("seed", range(20))
def test_encode_and_decode_are_the_row_by_row_layouts(seed):
    size, nd, srcs, dsts = _layout(seed)
    sent, _, mine = _plan(size, nd, srcs, dsts)
    for r in range(size):
        rows = [_encode_row(b, P.SRC, i, nd) for i, b in enumerate(srcs[r])] + \
               [_encode_row(b, P.DST, i, nd) for i, b in enumerate(dsts[r])]
        owners = P.owner_of(np.array([x[1] for x in rows], dtype=np.int64), size) if rows else []
        want = [x for _, x in sorted(zip(list(owners), rows), key=lambda t: t[0])]
        assert sent[r][1].reshape(-1, P.width(nd)).tolist() == want
        got = P.decode(mine[r], nd, r)
        assert got == _decode_rows(mine[r], nd, r)
        assert all(type(op) is P.Op for op in got.sends + got.recvs + got.local)


def test_records_widened_are_the_records_at_the_wider_rank():
    boxes = [P.Box(5, 1, (4, 3), (0, 0), (2, 3), 1), P.Box(7, 2, (4,), (1,), (2,)), P.Box(8, 0, (), (), ())]
    dests = [P.Box(9, 1, (2, 2), (0, 1), (1, 1))]
    for to in (2, 3, 4):
        assert np.array_equal(P.widen(P.records(boxes, dests, 2), 2, to), P.records(boxes, dests, to))
    counts, words = P.encode(boxes, dests, 3, 5)
    again = P.by_owner(P.widen(P.records(boxes, dests, 2), 2, 3), 5)
    assert np.array_equal(counts, again[0]) and np.array_equal(words, again[1])


F32 = 7  # any dtype code: the planner only compares them


def _box(name: int, shape, offsets, lengths, flags: int = 0) -> P.Box:
    return P.Box(name, F32, tuple(shape), tuple(offsets), tuple(lengths), flags)


def _group_plan(srcs: dict[int, list], dsts: dict[int, list], size: int, sides=True):
    """{rank: Answers} of the whole group (sides: the counts of ranks holding sources, destinations)."""
    nd = max(len(b.shape) for boxes in list(srcs.values()) + list(dsts.values()) for b in boxes)
    sent = {r: P.encode(srcs.get(r, []), dsts.get(r, []), nd, size) for r in range(size)}
    held = (sum(1 for r in range(size) if srcs.get(r)), sum(1 for r in range(size) if dsts.get(r)))
    answers = {}
    for owner in range(size):
        got_counts, got_words = [], []
        for r in range(size):
            c, words = sent[r]
            lo = int(c[:owner].sum())
            got_counts.append(int(c[owner]))
            got_words.append(words[lo: lo + int(c[owner])])
        answers[owner] = P.answer(np.array(got_counts), np.concatenate(got_words), nd, size,
                                   held if sides else None)
    out = {}
    for r in range(size):
        words = []
        for owner in range(size):
            c, a = answers[owner]
            lo = int(c[:r].sum())
            words.append(a[lo: lo + int(c[r])])
        out[r] = P.decode(np.concatenate(words), nd, r)
    return out


def _execute(srcs, dsts, answers):
    """Move integer-labelled elements along the plan, hop by hop: {(rank, dst index): array}."""
    full = {}
    for boxes in list(srcs.values()) + list(dsts.values()):
        for b in boxes:
            full.setdefault(b.name, np.arange(int(np.prod(b.shape))).reshape(b.shape) + 1000 * b.name)
    have_src = {(r, i): full[b.name][tuple(slice(o, o + n) for o, n in zip(b.offsets, b.lengths))]
                for r, boxes in srcs.items() for i, b in enumerate(boxes)}
    got = {(r, i): np.full(b.lengths, -1) for r, boxes in dsts.items() for i, b in enumerate(boxes)}

    def region(arr, box, op):
        return arr[tuple(slice(o - bo, o - bo + n) for o, bo, n in zip(op.offsets, box.offsets, op.lengths))]

    sends = sorted(((op, r) for r, a in answers.items() for op in a.sends), key=lambda t: (t[0].key, t[1]))  # hop first
    recvs = {(r, op.key): op for r, a in answers.items() for op in a.recvs}
    for op, sender in sends:
        assert recvs.pop((op.receiver, op.key)).peer == sender  # both ends agree on every message
        if op.src >= 0:
            data = region(have_src[sender, op.src], srcs[sender][op.src], op)
        else:
            mine = dsts[sender][-1 - op.src]
            data = region(got[sender, -1 - op.src], mine, op)
            assert (data >= 0).all(), "a relay forwards a region it has not received"
        target = region(got[op.receiver, op.dst], dsts[op.receiver][op.dst], op)
        assert (target == -1).all(), "a region received twice"
        target[...] = data
    assert not recvs
    for r, a in answers.items():
        for op in a.local:
            region(got[r, op.dst], dsts[r][op.dst], op)[...] = region(have_src[r, op.src], srcs[r][op.src], op)
    return full, got


def _check_exact(srcs, dsts, answers):
    full, got = _execute(srcs, dsts, answers)
    for (r, i), arr in got.items():
        b = dsts[r][i]
        want = full[b.name][tuple(slice(o, o + n) for o, n in zip(b.offsets, b.lengths))]
        assert np.array_equal(arr, want), (r, i)


@pytest.mark.parametrize("needers,holders,t,d,relayed", [
    (1, 1, 4, 4, False),    # one needer: nothing to relay
    (2, 1, 4, 4, False),    # two engine replicas, as many trainer ranks as engine ranks: straight
    (5, 1, 1, 5, True),     # one trainer rank, five engine replicas: relays
    (8, 1, 2, 16, True),    # 8 replicas of TP 2 from 2 trainer ranks
    (8, 8, 8, 8, False),    # as many holders as needers
    (32, 1, 64, 256, False),  # 32 replicas of TP 8 from 64 trainer ranks: the senders keep up
    (32, 1, 16, 256, True),   # ... from 16: relays
])
def test_relay_cost_model(needers, holders, t, d, relayed):
    assert P.relays(needers, holders, (t, d)) is relayed
    assert P.relays(needers, holders, None) is False


def _replicas(size: int, shape=(40, 8)):
    """Rank 0 holds two tensors whole; every other rank needs both whole, and a row block of one."""
    srcs = {0: [_box(1, shape, (0, 0), shape), _box(2, (6,), (0,), (6,))]}
    dsts = {r: [_box(1, shape, (0, 0), shape), _box(2, (6,), (0,), (6,)), _box(1, shape, (8, 0), (4, 8))]
            for r in range(1, size)}
    return srcs, dsts


def test_relays_never_pay_without_more_destination_ranks_than_source_ranks():
    """What lets an owner skip looking for fans when D <= T."""
    for t in range(1, 40):
        for d in range(1, t + 1):
            for n in (2, 3, 7, 64, 1000, 10**6):
                for h in (1, 2, 5, 100):
                    assert not P.relays(n, h, (t, d)), (n, h, t, d)


def test_relayed_fan_reaches_every_needer_once_in_hops():
    srcs, dsts = _replicas(6)
    answers = _group_plan(srcs, dsts, 6)
    _check_exact(srcs, dsts, answers)
    hops = sorted({op.hop for a in answers.values() for op in a.sends})
    assert hops == [0, 1, 2]  # five needers, one holder: ceil(log2(6)) hops
    per_hop = {}
    for r, a in answers.items():
        for op in a.sends:
            per_hop.setdefault((r, op.hop, op.name, op.offsets, op.lengths), 0)
            per_hop[r, op.hop, op.name, op.offsets, op.lengths] += 1
    assert max(per_hop.values()) == 1  # no rank sends a region twice in a hop
    sent0 = sum(int(np.prod(op.lengths)) for op in answers[0].sends)
    assert sent0 == 3 * (40 * 8 + 6 + 4 * 8)  # the holder sends three copies, not five


def test_straight_when_the_model_says_so_or_without_counts():
    srcs, dsts = _replicas(6)
    answers = _group_plan(srcs, dsts, 6, sides=False)
    _check_exact(srcs, dsts, answers)
    assert {op.hop for a in answers.values() for op in a.sends} == {0}


def test_fsdp_to_tp_replicas_exact_and_balanced():
    """4 source ranks hold row blocks (FSDP); 2 replicas x TP 2 need column-split boxes."""
    shape = (16, 12)
    srcs = {r: [_box(n, shape, (4 * r, 0), (4, 12)) for n in (1, 2)] for r in range(4)}
    dsts = {4 + e * 2 + t: [_box(n, shape, (0, 6 * t), (16, 6)) for n in (1, 2)] for e in range(2) for t in range(2)}
    answers = _group_plan(srcs, dsts, 8)
    _check_exact(srcs, dsts, answers)
    sent = [sum(int(np.prod(op.lengths)) for op in answers[r].sends) for r in range(4)]
    assert len(set(sent)) == 1


def test_itemsizes_follow_the_dtype_codes():
    from pipeload.move.run import DTYPES
    assert [d.itemsize for d in DTYPES] == P.ITEMSIZES.tolist()


def test_senders_balanced_by_bytes_across_dtypes():
    """Two holders of every tensor; one owner plans a float32 tensor and six bfloat16 ones of as many
    elements. By bytes both holders send 512: by elements the float32 one counts as a bfloat16 one."""
    f32, bf16 = 0, 1  # codes of pipeload.move.run.DTYPES
    shape = (8, 8)
    names = [3 * k for k in range(1, 8)]  # one owner in a group of 3
    assert len(set(P.owner_of(np.array(names), 3).tolist())) == 1

    def boxes():
        return [P.Box(n, f32 if n == names[0] else bf16, shape, (0, 0), shape) for n in names]

    answers = _group_plan({0: boxes(), 1: boxes()}, {2: boxes()}, 3)
    _check_exact({0: boxes(), 1: boxes()}, {2: boxes()}, answers)
    sent = [sum(int(np.prod(op.lengths)) * int(P.ITEMSIZES[op.dtype]) for op in answers[r].sends) for r in (0, 1)]
    assert sent == [512, 512]


def test_plan_does_not_depend_on_record_order():
    srcs, dsts = _replicas(6)
    a = _group_plan(srcs, dsts, 6)
    rng = random.Random(0)
    for _ in range(3):
        # the same boxes listed in another order on each rank: compare by the boxes, not their indices
        perm = {r: rng.sample(range(len(b)), len(b)) for r, b in dsts.items()}
        d2 = {r: [dsts[r][i] for i in perm[r]] for r in dsts}
        b = _group_plan(srcs, d2, 6)
        _check_exact(srcs, d2, b)

        def shape_of(ans):
            return sorted((r, op.hop, op.peer, op.name, op.offsets, op.lengths) for r, x in ans.items()
                          for op in x.sends)
        assert shape_of(a) == shape_of(b)


@pytest.mark.parametrize("seed", range(20))
def test_relays_forward_only_what_arrived_in_an_earlier_hop(seed):
    """Random layouts with relays forced on (one source rank against many destination ranks): every
    relayed send is of a region its sender received, for that destination, in an earlier hop."""
    size, nd, srcs, dsts = _layout(seed)
    sent = [P.encode(srcs[r], dsts[r], nd, size) for r in range(size)]
    answered = []
    for o in range(size):
        counts = np.array([c[o] for c, _ in sent])
        words = np.concatenate([w[int(c[:o].sum()): int(c[: o + 1].sum())] for c, w in sent])
        answered.append(P.answer(counts, words, nd, size, (1, 1000)))
    ops = [P.decode(np.concatenate([w[int(c[:r].sum()): int(c[: r + 1].sum())] for c, w in answered]), nd, r)
           for r in range(size)]
    relayed = 0
    for r, a in enumerate(ops):
        got = {(op.dst, op.name, op.offsets, op.lengths): op.hop for op in a.recvs}
        for op in a.sends:
            if op.src < 0:
                assert got[(-1 - op.src, op.name, op.offsets, op.lengths)] < op.hop
                relayed += 1
    later = sum(1 for a in ops for op in a.sends if op.hop)
    assert later == sum(1 for a in ops for op in a.recvs if op.hop)  # both ends agree on the hops
    assert relayed <= later


# ----------------------------------------------------------------------------------------------------
# The vectorised pass over names with no choice (``answer(direct=True)``) against every name planned alone


def _grid(rng, shape):
    """A partition of ``shape`` into a grid: each dim cut at random points."""
    cuts = [sorted({0, *rng.integers(1, s, size=int(rng.integers(0, 3))).tolist()}) if s > 1 else [0]
            for s in shape]
    boxes = [((), ())]
    for c, s in zip(cuts, shape):
        ends = c[1:] + [s]
        boxes = [(o + (a,), n + (b - a,)) for o, n in boxes for a, b in zip(c, ends)]
    return boxes


def _mixed_layout(seed: int):
    """Names of every kind an owner meets: each tensor's sources a grid (sometimes with an extra box that
    overlaps, or none at all), each box held by one rank or several (sometimes listed twice by one rank);
    destinations the holder's own box (a local copy), a box inside one source box, a random box (cut by
    several), the whole tensor, replicas of one region on several ranks (fans), another shape, another
    dtype (with or without F_CAST), empty boxes, F_ROW objects; sources F_NEEDED at times, parts of a
    tensor no rank holds."""
    rng = np.random.default_rng(seed)
    size = int(rng.integers(2, 9))
    srcs, dsts = [[] for _ in range(size)], [[] for _ in range(size)]
    for _ in range(int(rng.integers(1, 12))):
        name, dt = int(rng.integers(-2**62, 2**62)), int(rng.choice([0, 1, 7]))
        ndim = int(rng.integers(0, 4))
        shape = tuple(int(x) for x in rng.integers(1, 9, size=ndim))
        flags = P.F_NEEDED if rng.random() < 0.2 else 0
        if rng.random() < 0.1:  # an object: rows of a (saved world, wide) table, taken with F_ROW
            shape = (size, 1 << 40)
            for f in range(size):
                if rng.random() < 0.6:
                    srcs[f].append(P.Box(name, dt, shape, (f, 0), (1, int(rng.integers(1, 99))), flags))
            for r in range(size):
                if rng.random() < 0.5:
                    dsts[r].append(P.Box(name, dt, shape, (0, 0), (0, 0) if rng.random() < 0.5 else (1, 1), P.F_ROW))
            continue
        boxes = [] if rng.random() < 0.05 else _grid(rng, shape)
        if rng.random() < 0.2:  # parts no rank holds
            boxes = [x for x in boxes if rng.random() < 0.7]
        if boxes and ndim and rng.random() < 0.15:  # a box that overlaps another, or lies past the shape
            off = tuple(int(rng.integers(0, s)) for s in shape)
            ln = tuple(int(rng.integers(1, s - o + 1)) for o, s in zip(off, shape))
            boxes.append((off, ln) if rng.random() < 0.5 else ((shape[0],) + off[1:], ln))
        held = {}
        for off, ln in boxes:
            for r in rng.choice(size, size=int(rng.integers(1, min(size, 3) + 1)), replace=rng.random() < 0.1):
                srcs[r].append(P.Box(name, dt, shape, off, ln, flags))
                held.setdefault(int(r), []).append((off, ln))
        for _ in range(int(rng.integers(0, 8))):
            r, x = int(rng.integers(0, size)), rng.random()
            if x < 0.3 and held.get(r):
                off, ln = held[r][int(rng.integers(0, len(held[r])))]
            elif x < 0.6 and boxes:
                o, n = boxes[int(rng.integers(0, len(boxes)))]
                off = tuple(a + int(rng.integers(0, m)) for a, m in zip(o, n))
                ln = tuple(int(rng.integers(1, a + m - b + 1)) for a, m, b in zip(o, n, off))
            elif x < 0.8 or not ndim:
                off, ln = (0,) * ndim, shape
            else:
                off = tuple(int(rng.integers(0, s)) for s in shape)
                ln = tuple(int(rng.integers(0 if rng.random() < 0.1 else 1, s - o + 1)) for o, s in zip(off, shape))
            y = rng.random()
            if y > 0.95:  # another shape (of another tensor rank for a scalar)
                shape_d, off, ln = (tuple(s + 1 for s in shape), off, ln) if ndim else ((1,), (0,), (1,))
            else:
                shape_d = shape
            box = P.Box(name, dt if y < 0.9 else 0 if dt else 1, shape_d, off, ln, P.F_CAST if rng.random() < 0.1 else 0)
            for q in ([r] if rng.random() < 0.8 else rng.choice(size, size=int(rng.integers(2, size + 1)))):
                dsts[int(q)].append(box)
    return size, 3, srcs, dsts


def _answers(size, nd, srcs, dsts, sides, direct):
    sent = [P.encode(srcs[r], dsts[r], nd, size) for r in range(size)]
    out = []
    for o in range(size):
        counts = np.array([c[o] for c, _ in sent])
        words = np.concatenate([w[int(c[:o].sum()): int(c[: o + 1].sum())] for c, w in sent])
        out.append(P.answer(counts, words, nd, size, sides, direct=direct))
    return out


@settings(max_examples=400, deadline=None)
@given(st.integers(0, 2**32 - 1), st.sampled_from([None, (1, 8), (8, 1), (3, 3)]))
def test_names_answered_at_once_are_answered_as_one_by_one(seed, sides):
    """The same words for every owner (the same rows in the same order per destination rank, so the same
    ops decoded), where some names go the vectorised way and others one by one, sharing the loads."""
    size, nd, srcs, dsts = _mixed_layout(seed)
    fast = _answers(size, nd, srcs, dsts, sides, True)
    slow = _answers(size, nd, srcs, dsts, sides, False)
    for (c1, w1), (c2, w2) in zip(fast, slow):
        assert np.array_equal(c1, c2) and np.array_equal(w1, w2)
    for r in range(size):
        mine = [np.concatenate([w[int(c[:r].sum()): int(c[: r + 1].sum())] for c, w in a]) for a in (fast, slow)]
        assert P.decode(mine[0], nd, r) == P.decode(mine[1], nd, r)


def _owner_direct(size, nd, srcs, dsts, owner, sides=None):
    sent = [P.encode(srcs[r], dsts[r], nd, size) for r in range(size)]
    counts = np.array([c[owner] for c, _ in sent])
    words = np.concatenate([w[int(c[:owner].sum()): int(c[: owner + 1].sum())] for c, w in sent])
    rec = words.reshape(-1, P.width(nd))
    ranks = np.repeat(np.arange(size), counts // P.width(nd))
    order = np.lexsort((rec[:, P.K_INDEX], rec[:, P.K_KIND], rec[:, P.K_NAME]))
    rec, ranks = rec[order], ranks[order]
    starts = P._bounds(rec[1:, P.K_NAME] != rec[:-1, P.K_NAME])
    return len(starts) - 1, P._direct(rec, ranks, starts, nd, sides)


def test_direct_takes_local_copies_and_holders_and_leaves_cut_destinations():
    """TP 2 (columns) into TP 4: every quarter inside one half, held by one rank, by two (a choice of
    sender) or by its own needer, all answered at once; names whose destinations straddle the halves
    (cut in two pieces) go one by one."""
    size, shape = 4, (8, 16)
    single = [4 * k for k in range(1, 40)]
    replicated = [4 * k + 1 for k in range(1, 40)]
    cut = [4 * k + 2 for k in range(1, 40)]
    srcs = {r: [_box(n, shape, (0, 8 * (r % 2)), (8, 8)) for n in single if r < 2] +
            [_box(n, shape, (0, 8 * (r % 2)), (8, 8)) for n in replicated + cut] for r in range(size)}
    dsts = {r: [_box(n, shape, (0, 4 * r), (8, 4)) for n in single + replicated] +
            [_box(n, shape, (0, 6), (8, 4)) for n in cut] for r in range(size)}
    every = np.array(single + replicated + cut)
    for owner in range(3):  # (names 4k + 3 none: owner 3 has no records)
        n, d = _owner_direct(size, 2, [srcs[r] for r in range(size)], [dsts[r] for r in range(size)], owner)
        names = sorted(set(every[P.owner_of(every, size) == owner].tolist()))
        assert {names[i] for i in d.slow.tolist()} == {x for x in names if x in cut}
        assert {names[i] for i in d.choices.nid.tolist()} == {x for x in names if x in replicated}
    answers = _group_plan(srcs, dsts, size)
    _check_exact(srcs, dsts, answers)
    _check_senders(srcs, answers)


def _check_senders(srcs, answers):
    """Every send from a box its sender holds, inside it (or, relayed, from its own destination:
    :func:`_check_exact` follows those); every receive of a region its receiver holds no box of (it would
    copy it locally), every local copy from a box of its own."""
    def inside(b, op):
        return b.name == op.name and all(o <= x and x + n <= o + m for o, m, x, n in
                                         zip(b.offsets, b.lengths, op.offsets, op.lengths))
    for r, a in answers.items():
        for op in a.sends:
            assert inside(srcs[r][op.src], op) if op.src >= 0 else op.hop > 0
        for op in a.recvs:
            assert not any(inside(b, op) for b in srcs.get(r, []))
        for op in a.local:
            assert inside(srcs[r][op.src], op)


def _replica_layout(seed: int):
    """Sharded tensors whose parts have replicas (HSDP, DP replicas, a tier's replicated files): each
    part held by 1-6 ranks (now and then a rank holding two parts, or one part twice), destinations
    each inside one part — the part itself, a slice of it, equal slices on many ranks (runs of equal
    pieces), on holders and others — in two dtypes; now and then a destination straddling parts."""
    rng = np.random.default_rng(seed)
    size = int(rng.integers(2, 40))
    srcs, dsts = {r: [] for r in range(size)}, {r: [] for r in range(size)}
    for name in (rng.choice(10**6, size=int(rng.integers(1, 14)), replace=False) + 1).tolist():
        dt, ndim = int(rng.choice([0, 1])), int(rng.integers(1, 3))
        shape = tuple(int(x) for x in rng.integers(2, 12, size=ndim))
        parts = int(rng.integers(1, min(4, shape[0]) + 1))
        c = -(-shape[0] // parts)
        boxes = [((s * c,) + (0,) * (ndim - 1), (min(c, shape[0] - s * c),) + shape[1:])
                 for s in range(parts) if s * c < shape[0]]
        for off, ln in boxes:
            for r in rng.choice(size, size=int(rng.integers(1, min(size, 6) + 1)), replace=rng.random() < 0.1):
                srcs[int(r)].append(P.Box(name, dt, shape, off, ln))
        for _ in range(int(rng.integers(1, 40))):
            off, ln = boxes[int(rng.integers(0, len(boxes)))]
            if rng.random() < 0.5:  # a slice of the part along its last dim
                a = int(rng.integers(0, ln[-1]))
                off, ln = off[:-1] + (off[-1] + a,), ln[:-1] + (int(rng.integers(1, ln[-1] - a + 1)),)
            if rng.random() < 0.05:  # straddling parts: cut in pieces, planned one by one
                off, ln = (0,) * ndim, shape
            box = P.Box(name, dt if rng.random() < 0.9 else 1 - dt, shape, off, ln, P.F_CAST)
            for q in rng.choice(size, size=int(rng.integers(1, min(size, 8) + 1)), replace=False):
                dsts[int(q)].append(box)
    return size, srcs, dsts


def _busiest_over_mean(answered, size, nd):
    sent = np.zeros(size)
    for c, w in answered:
        rows = w.reshape(-1, P.answer_width(nd))
        send = (rows[:, P.A_KIND] & 0xFF) == P.SEND
        ln = np.where(np.arange(nd) < rows[:, P.A_NDIM, None], rows[:, P.AHEAD + nd: P.AHEAD + 2 * nd], 1)
        wire = np.prod(ln, axis=1) * P.ITEMSIZES[rows[:, P.A_DTYPE]]
        np.add.at(sent, np.repeat(np.arange(size), c // P.answer_width(nd))[send], wire[send])
    busy = sent[sent > 0]
    return busy.max() / busy.mean() if len(busy) else 1.0


@settings(max_examples=150, deadline=None)
@given(st.integers(0, 2**32 - 1), st.sampled_from([None, (4, 4), (2, 40)]), st.sampled_from([0, 128, 10**9]))
def test_choices_answered_at_once_are_the_greedy_over_replicas(seed, sides, steps):
    """Names with a choice of sender answered at once — by scalar steps, by water-filling, or both
    (``SCALAR_STEPS``) — get the name-by-name greedy's words, so its balance: the busiest sender over
    the mean, by bytes, is the reference's (tolerance 0). And on the group: every destination byte
    arrives once, from a holder of a box it lies in, copied locally where the needer holds one."""
    size, srcs, dsts = _replica_layout(seed)
    nd = 2
    lists = [srcs[r] for r in range(size)], [dsts[r] for r in range(size)]
    with _scalar_steps(steps):
        fast = _answers(size, nd, *lists, sides, True)
        answers = _group_plan(srcs, dsts, size, sides=sides is not None)
    slow = _answers(size, nd, *lists, sides, False)
    for (c1, w1), (c2, w2) in zip(fast, slow):
        assert np.array_equal(c1, c2) and np.array_equal(w1, w2)
    assert _busiest_over_mean(fast, size, nd) <= _busiest_over_mean(slow, size, nd)
    _check_exact(srcs, dsts, answers)
    _check_senders(srcs, answers)


@contextlib.contextmanager
def _scalar_steps(steps: int):
    keep, P.SCALAR_STEPS = P.SCALAR_STEPS, steps
    try:
        yield
    finally:
        P.SCALAR_STEPS = keep


def test_hsdp_replicas_water_filled_at_once_and_balanced():
    """HSDP: 4 shard groups of 4 (each row block on 4 ranks); 16 engine ranks each need one row block:
    runs of 4 equal pieces over 4 holders, for 24 names, answered at once; every holder sends as much."""
    size, shape = 32, (16, 8)
    names = list(range(1, 25))
    srcs = {r: [_box(n, shape, (4 * (r % 4), 0), (4, 8)) for n in names] for r in range(16)}
    dsts = {16 + e: [_box(n, shape, (4 * (e % 4), 0), (4, 8)) for n in names] for e in range(16)}
    for steps in (0, 10**9):
        with _scalar_steps(steps):
            answers = _group_plan(srcs, dsts, size, sides=False)
        _check_exact(srcs, dsts, answers)
        _check_senders(srcs, answers)
        sent = [len(answers[r].sends) for r in range(16)]
        assert sent == [24] * 16
    n, d = _owner_direct(size, 2, [srcs.get(r, []) for r in range(size)], [dsts.get(r, []) for r in range(size)], 1)
    assert not len(d.slow) and len(d.choices.nid)


@settings(max_examples=200, deadline=None)
@given(st.integers(0, 2**32 - 1))
def test_meeting_is_not_disjoint_name_by_name(seed):
    """:func:`P._meeting` over many names at once against :func:`P._disjoint` on each name's boxes."""
    rng = np.random.default_rng(seed)
    n, ndim = int(rng.integers(1, 8)), int(rng.integers(1, 4))
    per_name = []
    for _ in range(n):
        boxes = {(tuple(rng.integers(0, 6, size=ndim).tolist()), tuple(rng.integers(0, 4, size=ndim).tolist()))
                 for _ in range(int(rng.integers(0, 6)))}
        per_name.append(sorted(boxes))
    bnid = np.array([k for k, b in enumerate(per_name) for _ in b], dtype=np.int64)
    boff = np.array([o for b in per_name for o, _ in b], dtype=np.int64).reshape(-1, ndim)
    bln = np.array([x for b in per_name for _, x in b], dtype=np.int64).reshape(-1, ndim)
    got = P._meeting(bnid, boff, bln, n).tolist()
    want = [bool(b) and not P._disjoint(np.array([[o, x] for o, x in b], dtype=np.int64)) for b in per_name]
    assert got == want
