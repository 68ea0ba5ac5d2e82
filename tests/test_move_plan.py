"""``pipeload.move.plan`` on its own: the owner's vectorised greedy against the one-piece-at-a-time rule,
and ``encode`` / ``decode`` against the record and op layouts written out one box and one row at a time.

Every rank of a small random group encodes, every owner answers, every rank decodes, in one process.
"""

from __future__ import annotations

import numpy as np
import pytest

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


@pytest.mark.parametrize("seed", range(20))
def test_water_fill_is_least_loaded_one_by_one(seed):
    rng = np.random.default_rng(seed)
    h = int(rng.integers(1, 12))
    load = rng.integers(0, 50, size=h).astype(np.int64)
    pos = rng.permutation(h)
    w, m = int(rng.integers(1, 9)), int(rng.integers(1, 40))
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
