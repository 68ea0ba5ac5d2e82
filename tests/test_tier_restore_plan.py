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


def test_reshard_pieces_cover_boxes_and_prefer_local_copies():
    # saved: a (4, 6) tensor in two row halves, each replicated on two saved ranks (TP2 x DP2)
    tables = {f: {"w": {"dtype": "F32", "shape": [4, 6], "offsets": [2 * (f % 2), 0], "lengths": [2, 6]}}
              for f in range(4)}
    chunks = rp.chunk_tables(tables)
    pieces, missing = rp.pieces_for([("w", (0, 0), (4, 3))], chunks, rank=1, local={3})
    assert not missing
    assert sorted((p.f, p.offsets, p.lengths) for p in pieces) == [(0, (0, 0), (2, 3)), (3, (2, 0), (2, 3))]
    _, missing = rp.pieces_for([("v", (0,), (3,))], chunks, rank=1)
    assert missing == ["v"]


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
