"""``pipeload simulate --op transfer`` against the real planning functions, every rank of a small world.

The simulation generates every rank's boxes and records from the model's arithmetic and runs the real
planning only on a few sampled ranks; here, at 16 + 16 ranks, every rank's boxes are built the way the
real path builds them (engine ranks: :func:`pipeload.live.sides.destinations` of the engine's own
:class:`pipeload.Slice` list; trainer ranks: the DTensor placements' boxes), every rank encodes, every
owner answers, every rank decodes, and the simulated records, answers and sampled plans must equal them.
"""

from __future__ import annotations

import functools
import json

import numpy as np
import pytest
from torch.distributed.tensor import Replicate, Shard

from pipeload.live.sides import _CODES, destinations
from pipeload.move import plan as moveplan
from pipeload.move.plan import Box
from pipeload.plan.exchange import hash64
from pipeload.plan.placements import strided_box
from pipeload.tools import simtransfer as st
from pipeload.tools.cli import main
from pipeload.tools.engineshape import checkpoint_shapes, engine_params, engine_slices

CASES = [dict(layout="fsdp", colocated=False, shard_group=8), dict(layout="hsdp", colocated=True, shard_group=4)]


def _world(case) -> st.TransferWorld:
    return st.TransferWorld(st.MODELS["small"], 16, 16, 8, case["layout"], case["shard_group"], case["colocated"])


def _real_sources(w: st.TransferWorld, rank: int) -> list[Box]:
    """What ``sides.sources`` gives a trainer rank of FSDP2 (``fully_shard`` on a 1-D mesh, or HSDP's 2-D
    (replicate, shard) mesh): the placements' box of every parameter it holds rows of."""
    if w.trainer(rank) is None:
        return []
    mesh, coord, placements = ((w.world,), [rank], [Shard(0)]) if w.layout == "fsdp" else \
        ((w.world // w.group, w.group), [rank // w.group, rank % w.group], [Replicate(), Shard(0)])
    out = []
    for name, shape in checkpoint_shapes(w.shape).items():
        lengths, offsets = strided_box(tuple(shape), mesh, coord, placements)
        if np.prod(lengths):
            out.append(Box(hash64(name.encode()), _CODES[w.shape.dtype], tuple(shape), offsets, lengths, 0))
    return out


def _real_dests(w: st.TransferWorld, rank: int) -> list[Box]:
    t = w.engine(rank)
    if t is None:
        return []
    return destinations(engine_slices(w.shape, engine_params(w.shape, w.tp, t), w.tp, t), False).boxes


@functools.lru_cache(maxsize=None)
def _real_plan_of(case: int):
    return _real_plan(_world(CASES[case]))


def _real_plan(w: st.TransferWorld):
    """Every rank's encode, every owner's answer, every rank's decode: (incoming per owner, answers
    each rank receives, decoded answers per rank)."""
    size, nd = w.size, w.nd
    sent = [moveplan.encode(_real_sources(w, r), _real_dests(w, r), nd, size) for r in range(size)]
    incoming, answered = [], []
    for o in range(size):
        parts = [words[int(c[:o].sum()): int(c[: o + 1].sum())] for c, words in sent]
        incoming.append((np.array([c[o] for c, _ in sent]), np.concatenate(parts)))
        answered.append(moveplan.answer(*incoming[-1], nd, size))
    to = []
    for r in range(size):
        parts = [words[int(c[:r].sum()): int(c[: r + 1].sum())] for c, words in answered]
        to.append((np.array([c[r] for c, _ in answered]), np.concatenate(parts)))
    return sent, incoming, to, [moveplan.decode(words, nd, r) for r, (_, words) in enumerate(to)]


@pytest.mark.parametrize("n", range(len(CASES)), ids=[c["layout"] for c in CASES])
def test_simulated_world_equals_the_real_plan(n):
    w = _world(CASES[n])
    sent, incoming, to, decoded = _real_plan_of(n)
    for r in range(w.size):
        src, dst = w.boxes(r)
        assert src == _real_sources(w, r) and dst == _real_dests(w, r), r
        assert all(np.array_equal(a, b) for a, b in zip(w.outgoing(r), sent[r])), r
        assert all(np.array_equal(a, b) for a, b in zip(w.incoming(r), incoming[r])), r
    pieces = w.pieces_per_name().sum()
    assert pieces == sum(len(a.recvs) + len(a.local) for a in decoded)
    # every send is some rank's receive, from that sender, and the other way round
    sends = sorted((op.key, r) for r, a in enumerate(decoded) for op in a.sends)
    recvs = sorted((op.key, op.peer) for a in decoded for op in a.recvs)
    assert sends == recvs and not any(a.problems for a in decoded)
    sampled, _ = st.sampled_ranks(w, w.pieces_per_name())
    got = st.owners_answers(w, sampled, whole=True)
    for r in sampled:
        assert all(np.array_equal(a, b) for a, b in zip(got.to[r], to[r])), r
    sent_bytes = np.zeros(w.size)
    for r, a in enumerate(decoded):
        sent_bytes[r] = sum(np.prod(op.lengths) for op in a.sends) * w.itemsize
    assert np.array_equal(got.sent_bytes, sent_bytes)
    # restricted: the sampled engine rank's pieces are the whole plan's (the senders may differ)
    engine = w.engine_rank(1, 7)
    part = st.owners_answers(w, [engine], whole=False).to[engine]
    mine = moveplan.decode(part[1], w.nd, engine)
    strip = lambda ops: sorted((op.key, op.lengths, op.dst) for op in ops)  # noqa: E731
    assert strip(mine.recvs + mine.local) == strip(decoded[engine].recvs + decoded[engine].local)


@pytest.mark.parametrize("n", range(len(CASES)), ids=[c["layout"] for c in CASES])
def test_simulation_runs_the_real_planning_on_the_sampled_ranks(n):
    case = CASES[n]
    res = st.simulate_transfer(16, case["layout"], engines=16, model="small", shard_group=case["shard_group"],
                               colocated=case["colocated"], memory=False)
    assert res["plan_consistent"] and res["answers"].startswith("exact")
    w = _world(case)
    decoded = _real_plan_of(n)[3]
    for r in res["ranks"]:
        a = decoded[r["rank"]]
        assert (r["sends"], r["recvs"], r["local"]) == (len(a.sends), len(a.recvs), len(a.local))
    assert res["sender_balance"]["max_over_mean"] >= 1.0
    # the first gather: four words from every rank of the group
    assert all(r["bytes"]["rows"][1] == 32 * (w.size - 1) for r in res["ranks"])


def test_coverage_check_finds_gaps_and_overlaps():
    dst = [Box(1, 1, (8, 4), (0, 0), (8, 4))]
    op = lambda o, n: moveplan.Op(1, 0, 1, 0, 0, 1, o, n)  # noqa: E731
    ok = moveplan.Answers([], [op((0, 0), (4, 4)), op((4, 0), (4, 4))], [], [])
    gap = moveplan.Answers([], [op((0, 0), (4, 4)), op((4, 0), (3, 4))], [], [])
    twice = moveplan.Answers([], [op((0, 0), (4, 4)), op((2, 0), (2, 4)), op((6, 0), (2, 4))], [], [])
    cols = moveplan.Answers([], [op((0, 0), (8, 2)), op((0, 2), (8, 2))], [], [])
    assert st._covered(dst, ok) and st._covered(dst, cols)
    assert not st._covered(dst, gap) and not st._covered(dst, twice)


def test_cli_transfer_json(capsys):
    assert main(["simulate", "--op", "transfer", "--world", "16", "--engine-world", "8", "--model", "small",
                 "--layers", "1", "--json", "--no-memory"]) == 0
    res = json.loads(capsys.readouterr().out)
    assert res["op"] == "transfer" and res["group_size"] == 24 and res["plan_consistent"]
    for key in ("per_rank_cpu_s", "per_rank_peak_mb", "exchange_bytes_received", "received_per_call",
                "sender_balance", "pieces"):
        assert key in res
    assert main(["simulate", "--op", "transfer", "--world", "16", "--layout", "dense"]) == 2


def test_a_plan_past_the_limit_is_sized_not_run(monkeypatch, capsys):
    monkeypatch.setattr(st, "MAX_PIECES", 300)
    res = st.simulate_transfer(16, "fsdp", model="small", memory=False)
    assert res["too_large"] and not res["plan_consistent"] and res["pieces_per_engine_rank"] == 308
    assert main(["simulate", "--op", "transfer", "--world", "16", "--model", "small"]) == 1
    assert "not planned" in capsys.readouterr().out
