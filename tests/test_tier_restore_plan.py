"""The restore's planning (pipeload.tier.restoreplan): pure functions over gathered words."""

from __future__ import annotations

import random

import numpy as np

from pipeload.plan.balance import assign
from pipeload.tier import restoreplan as rp


class _Ex:
    """The two gathers for W ranks given every rank's listing (this rank's view)."""

    def __init__(self, listings, digests, hosts):
        self.listings, self.digests, self.hosts = listings, digests, hosts

    def gather_rows(self, row, what="", call=""):
        w = len(self.listings)
        if call == "all-gather of tier rows":
            return np.array([[self.hosts[r], self.digests[r], len(self.listings[r]), 0] for r in range(w)])
        pad = max(len(x) for x in self.listings)
        out = np.full((w, pad, rp.ENTRY_WORDS), -1, dtype=np.int64)
        for r, x in enumerate(self.listings):
            out[r, : len(x)] = x
        return out.reshape(w, -1)


def _world(world=8, per_host=2, step=7, lost=(), nbytes=None, older=None):
    """Listings of ``world`` ranks, replicas=2 in a ring of hosts; hosts in ``lost`` list nothing."""
    hosts = world // per_host
    nbytes = nbytes or [100 + r for r in range(world)]
    listings = []
    for r in range(world):
        h = r // per_host
        files = [] if h in lost else [f for f in range(world) if f // per_host in (h, (h - 1) % hosts)]
        entries = [(step, f, world, 1000 + f, nbytes[f]) for f in files]
        if older is not None and h not in lost:
            entries += [(older, f, world, 1000 + f, nbytes[f]) for f in range(world) if f // per_host == h]
        listings.append(rp.encode_listing(entries))
    return listings, [1000 + r for r in range(world)], [r // per_host for r in range(world)]


def _plan(listings, digests, hosts, rank=0):
    return rp.plan(_Ex(listings, digests, hosts), hosts[rank], digests[rank], listings[rank], "test")


def test_one_host_lost_restores_from_the_next_host_balanced():
    listings, digests, hosts = _world(lost=(1,))
    p = _plan(listings, digests, hosts)
    assert p.choice.step == 7 and p.same
    assert p.same_plan.local.tolist() == [True, True, False, False, True, True, True, True]
    # host 1's files (ranks 2, 3) are copied on host 2 (ranks 4, 5): one file each, not both on one rank
    assert sorted(p.same_plan.source.items()) == [(2, 4), (3, 5)] or sorted(p.same_plan.source.values()) == [4, 5]
    # every rank of the world computes the same plan from the same words
    for r in range(8):
        q = _plan(listings, digests, hosts, r)
        assert q.same_plan.source == p.same_plan.source and np.array_equal(q.same_plan.local, p.same_plan.local)


def test_two_hosts_of_a_replica_set_lost_fall_back_or_take_an_older_whole_step():
    listings, digests, hosts = _world(lost=(1, 2))
    assert _plan(listings, digests, hosts).choice is None
    # with an older step each host still holds its own ranks' files of: still not whole (hosts 1, 2 gone)
    listings, digests, hosts = _world(lost=(1, 2), older=5)
    assert _plan(listings, digests, hosts).choice is None
    # newest step incomplete on a host, the older one whole: the older one, never a mix
    listings, digests, hosts = _world(older=5)
    listings[0] = rp.encode_listing([tuple(e) for e in listings[0].tolist() if e[0] == 5])
    listings[1] = listings[0]
    listings[6] = listings[7] = rp.encode_listing([tuple(e) for e in listings[6].tolist() if e[0] == 5])
    p = _plan(listings, digests, hosts)
    assert p.choice.step == 5


def test_bad_copies_are_excluded_and_the_decision_retaken():
    listings, digests, hosts = _world(lost=(1,))
    p = _plan(listings, digests, hosts)
    src = p.same_plan.source[2]
    q = rp.decide(rp.exclude(p.gathered, [(src, 7, 2)]))
    assert q.choice.step == 7 and q.same_plan.source[2] != src and q.same_plan.source[2] in (4, 5)
    # every copy of file 2 bad: no whole step
    r = rp.decide(rp.exclude(p.gathered, [(4, 7, 2), (5, 7, 2)]))
    assert r.choice is None


def test_another_layout_is_not_the_same_layout():
    listings, digests, hosts = _world()
    other = list(digests)
    other[3] = 42
    assert not _plan(listings, other, hosts).same


def test_greedy_is_the_balance_rule_and_independent_of_listing_order():
    rng = random.Random(3)
    for _ in range(20):
        world, per_host = 16, 2
        nbytes = [rng.randint(1, 1000) for _ in range(world)]
        lost = (rng.randrange(world // per_host),)
        listings, digests, hosts = _world(world, per_host, lost=lost, nbytes=nbytes)
        p = _plan(listings, digests, hosts)
        shuffled = [x[rng.sample(range(len(x)), len(x))] for x in listings]
        q = _plan(shuffled, digests, hosts, 5)
        assert p.same_plan.source == q.same_plan.source
        c = p.choice
        lost_files = [f for f in range(world) if not p.same_plan.local[f]]
        base = {r: nbytes[r] for r in range(world) if p.same_plan.local[r]}
        assert p.same_plan.source == assign({f: nbytes[f] for f in lost_files},
                                            {f: c.holders(f).tolist() for f in lost_files}, base)


class _File:
    """A listed tier file as the resharding planner reads it: its chunks and objects."""

    def __init__(self, tensors, objects=()):
        self.tensors = {fqn: (d, s, o, n, "") for fqn, (d, s, o, n) in tensors.items()}
        self.objects = {fqn: (size, "") for fqn, size in dict(objects).items()}


def _want(boxes, objects=()):
    """A rank's destinations as the restore resolves them: fqn -> (leaf, box, dtype name)."""
    from types import SimpleNamespace

    import torch

    from pipeload.plan.statedict import Box

    tensors = {fqn: (None, Box(shape, off, ln, torch.empty(ln, dtype=torch.float32)), "F32")
               for fqn, (shape, off, ln) in boxes.items()}
    return SimpleNamespace(tensors=tensors, objects={fqn: fqn for fqn in objects})


def _owners_plan(files_of, wants, world, step=7, saved_world=None, strict=True):
    """The resharding plan of every rank, through the exact functions a restore runs on each rank, the
    two all-to-alls simulated: (answers per rank, records words each rank received, answer words each
    rank received, the Dests per rank)."""
    from pipeload.move import plan as mp
    from pipeload.tier import reshard

    saved_world = saved_world or world
    sides = []
    for r in range(world):
        src, held = reshard.source_boxes({(step, f): tf for f, tf in files_of[r].items()}, step, saved_world, strict)
        sides.append((src, held, reshard.Dests(wants[r], saved_world)))
    nd = max(max(reshard.ndim(s), reshard.ndim(d.boxes)) for s, _, d in sides)
    sent = [mp.by_owner(mp.records(s, d.boxes, nd), world) for s, _, d in sides]
    inbox, answers_out = [], []
    for o in range(world):  # each owner: what every rank sent it, in rank order
        counts = np.array([c[o] for c, _ in sent])
        parts = [w[int(c[:o].sum()): int(c[:o + 1].sum())] for c, w in sent]
        inbox.append(int(counts.sum()))
        answers_out.append(mp.answer(counts, np.concatenate(parts), nd, world))
    answers, got = [], []
    for r in range(world):
        parts = [w[int(c[:r].sum()): int(c[:r + 1].sum())] for c, w in answers_out]
        got.append(sum(len(p) for p in parts))
        answers.append(mp.decode(np.concatenate(parts), nd, r))
    return answers, inbox, got, [d for _, _, d in sides], [h for _, h, _ in sides]


def _covers(answers, dests, r):
    """Whether rank r's receives and local copies cover each of its tensor boxes exactly once."""
    for i in range(dests[r].tensors):
        box = dests[r].boxes[i]
        mine = [op for op in answers[r].recvs + answers[r].local if op.dst == i]
        if sum(int(np.prod(op.lengths)) for op in mine) != int(np.prod(box.lengths)):
            return False
    return True


def test_reshard_is_planned_by_the_owners_with_local_copies_and_objects():
    """Saved TP2 x DP2 (a (4, 6) tensor in row halves, each on two saved ranks), one copy of each file on
    the next host; loaded by columns over 4 ranks: every box covered, a piece a rank's own root holds is
    a local copy, the sender of the rest lists the file; each rank takes its own saved rank's object."""
    world = 4
    saved = {f: _File({"w": ("F32", (4, 6), (2 * (f % 2), 0), (2, 6))}, {"rng": 10 + f, "step": 8})
             for f in range(world)}
    files_of = {r: {f: saved[f] for f in (r, (r - 1) % world)} for r in range(world)}
    wants = [_want({"w": ((4, 6), (0, r), (4, 1))}, ["rng", "step"]) for r in range(world)]
    answers, _, _, dests, held = _owners_plan(files_of, wants, world)
    for r in range(world):
        a = answers[r]
        assert not a.problems and _covers(answers, dests, r)
        for op in a.local:
            assert held[r][op.src][0] in files_of[r]
        assert not [op for op in a.recvs if op.dst == 0]  # (its root holds both row halves: local copies)
        rng = [op for op in a.recvs + a.local if dests[r].names[op.dst] == "rng"]
        assert len(rng) == 1 and rng[0].offsets == (r, 0) and rng[0].lengths == (1, 10 + r)
    for r in range(world):
        for op in answers[r].sends:
            assert held[r][op.src][0] in files_of[r]


def test_reshard_problems_and_a_world_beyond_the_saved_one():
    """Saved by 2 ranks, restored by 4: ranks 2 and 3 list nothing and take saved rank 0's object; a key
    no file holds is missing (strict: a problem), a stored key no rank loads is a problem with strict."""
    saved = {f: _File({"w": ("F32", (4, 2), (2 * f, 0), (2, 2)), "v": ("F32", (3,), (0,), (3,))},
                      {"rng": 20 + f}) for f in range(2)}
    files_of = {0: dict(saved), 1: dict(saved), 2: {}, 3: {}}
    wants = [_want({"w": ((4, 2), (r, 0), (1, 2)), "v": ((3,), (0,), (3,))}, ["rng"]) for r in range(4)]
    answers, _, _, dests, _ = _owners_plan(files_of, wants, 4, saved_world=2)
    assert all(not a.problems and _covers(answers, dests, r) for r, a in enumerate(answers))
    for r in range(4):
        (op,) = [op for op in answers[r].recvs + answers[r].local if dests[r].names[op.dst] == "rng"]
        assert op.offsets == ((r, 0) if r < 2 else (0, 0)) and op.lengths[1] == 20 + (r if r < 2 else 0)
    wants = [_want({"w": ((4, 2), (r, 0), (1, 2)), "x": ((2,), (0,), (2,))}, ["rng"]) for r in range(4)]
    answers, _, _, dests, held = _owners_plan(files_of, wants, 4, saved_world=2)
    from pipeload.tier import reshard

    lines = [reshard.problems(a, dests[r], held[r], True) for r, a in enumerate(answers)]
    assert all(m == ["x"] for _, m in lines)
    text = "\n".join(x for ls, _ in lines for x in ls)
    assert "x: not in step" in text and "v: in the tier's step" in text and "no rank loads it" in text
    assert not reshard.problems(answers[2], dests[2], held[2], False)[0]  # (not strict: only missing)


def test_reshard_planning_per_rank_is_not_total_chunks():
    """Each rank lists 2 files (its own, a copy of its neighbour's) of S tensors in TP-2 row halves,
    restored in TP-2 column halves. The old plan all-gathered every file's chunk table (the step's
    total chunks, W x S, to every rank); the owners' records a rank receives stay O(S) as W grows."""
    def world_of(w, s=16):
        saved = {f: _File({f"l{f // 2}.t{k}": ("F32", (4, 4), (2 * (f % 2), 0), (2, 4)) for k in range(s)})
                 for f in range(w)}
        files_of = {r: {f: saved[f] for f in (r, (r - 1) % w)} for r in range(w)}
        wants = [_want({f"l{r // 2}.t{k}": ((4, 4), (0, 2 * (r % 2)), (4, 2)) for k in range(s)}) for r in range(w)]
        answers, inbox, got, dests, _ = _owners_plan(files_of, wants, w)
        assert all(not a.problems and _covers(answers, dests, r) for r, a in enumerate(answers))
        return max(inbox), max(got), w * s

    small, large = world_of(32), world_of(256)
    assert large[2] == 8 * small[2]  # total chunks grew 8x
    assert large[0] <= 2 * small[0] and large[1] <= 2 * small[1]  # what the busiest rank receives did not
    assert large[0] < large[2]  # (fewer words than the old tables' chunks, which were records of 5+ fields)


def test_a_copy_whose_record_differs_is_not_used():
    listings, digests, hosts = _world(lost=(1,))
    # rank 4's copy of file 2 describes another layout (a damaged record): rank 5's copy serves
    e = listings[4].copy()
    e[(e[:, rp.E_RANK] == 2), rp.E_DIGEST] = 77
    listings[4] = e
    p = _plan(listings, digests, hosts)
    assert p.same and p.same_plan.source[2] == 5 and not p.choice.holds(4, 2)


def test_simulate_restore_runs_the_restore_planning():
    from pipeload.tools.simrestore import simulate_restore

    res = simulate_restore(64, "fsdp", memory=False)
    assert res["plans_identical"] and res["same_layout"] and res["step"] == 1000
    assert res["files_sent_by_source"] == 1  # the lost host's 8 files spread over the next host's 8 ranks
