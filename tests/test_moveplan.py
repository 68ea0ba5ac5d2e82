"""pipeload.move.plan in one process: every rank's encode, the owners' answers, every rank's decode.

The two all-to-alls are routed by hand, so the plan a group would make is checked whole: each needed
byte arrives once, from a rank that has it by then (a holder, or a relay that received it in an
earlier hop), the relay cost model's decisions, and that the plan does not depend on the order of the
records inside a rank.
"""

from __future__ import annotations

import random

import numpy as np
import pytest

from pipeload.move import plan as mp

F32 = 7  # any dtype code: the planner only compares them


def _box(name: int, shape, offsets, lengths, flags: int = 0) -> mp.Box:
    return mp.Box(name, F32, tuple(shape), tuple(offsets), tuple(lengths), flags)


def _plan(srcs: dict[int, list], dsts: dict[int, list], size: int, sides=True):
    """{rank: Answers} of the whole group (sides: the counts of ranks holding sources, destinations)."""
    nd = max(len(b.shape) for boxes in list(srcs.values()) + list(dsts.values()) for b in boxes)
    sent = {r: mp.encode(srcs.get(r, []), dsts.get(r, []), nd, size) for r in range(size)}
    held = (sum(1 for r in range(size) if srcs.get(r)), sum(1 for r in range(size) if dsts.get(r)))
    answers = {}
    for owner in range(size):
        got_counts, got_words = [], []
        for r in range(size):
            c, words = sent[r]
            lo = int(c[:owner].sum())
            got_counts.append(int(c[owner]))
            got_words.append(words[lo: lo + int(c[owner])])
        answers[owner] = mp.answer(np.array(got_counts), np.concatenate(got_words), nd, size,
                                   held if sides else None)
    out = {}
    for r in range(size):
        words = []
        for owner in range(size):
            c, a = answers[owner]
            lo = int(c[:r].sum())
            words.append(a[lo: lo + int(c[r])])
        out[r] = mp.decode(np.concatenate(words), nd, r)
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

    sends = sorted((op, r) for r, a in answers.items() for op in a.sends)
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
    assert mp.relays(needers, holders, (t, d)) is relayed
    assert mp.relays(needers, holders, None) is False


def _replicas(size: int, shape=(40, 8)):
    """Rank 0 holds two tensors whole; every other rank needs both whole, and a row block of one."""
    srcs = {0: [_box(1, shape, (0, 0), shape), _box(2, (6,), (0,), (6,))]}
    dsts = {r: [_box(1, shape, (0, 0), shape), _box(2, (6,), (0,), (6,)), _box(1, shape, (8, 0), (4, 8))]
            for r in range(1, size)}
    return srcs, dsts


def test_relayed_fan_reaches_every_needer_once_in_hops():
    srcs, dsts = _replicas(6)
    answers = _plan(srcs, dsts, 6)
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
    answers = _plan(srcs, dsts, 6, sides=False)
    _check_exact(srcs, dsts, answers)
    assert {op.hop for a in answers.values() for op in a.sends} == {0}


def test_fsdp_to_tp_replicas_exact_and_balanced():
    """4 source ranks hold row blocks (FSDP); 2 replicas x TP 2 need column-split boxes."""
    shape = (16, 12)
    srcs = {r: [_box(n, shape, (4 * r, 0), (4, 12)) for n in (1, 2)] for r in range(4)}
    dsts = {4 + e * 2 + t: [_box(n, shape, (0, 6 * t), (16, 6)) for n in (1, 2)] for e in range(2) for t in range(2)}
    answers = _plan(srcs, dsts, 8)
    _check_exact(srcs, dsts, answers)
    sent = [sum(int(np.prod(op.lengths)) for op in answers[r].sends) for r in range(4)]
    assert len(set(sent)) == 1


def test_plan_does_not_depend_on_record_order():
    srcs, dsts = _replicas(6)
    a = _plan(srcs, dsts, 6)
    rng = random.Random(0)
    for _ in range(3):
        # the same boxes listed in another order on each rank: compare by the boxes, not their indices
        perm = {r: rng.sample(range(len(b)), len(b)) for r, b in dsts.items()}
        d2 = {r: [dsts[r][i] for i in perm[r]] for r in dsts}
        b = _plan(srcs, d2, 6)
        _check_exact(srcs, d2, b)

        def shape_of(ans):
            return sorted((r, op.hop, op.peer, op.name, op.offsets, op.lengths) for r, x in ans.items()
                          for op in x.sends)
        assert shape_of(a) == shape_of(b)
