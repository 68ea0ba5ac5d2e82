"""Part delivery's page owners (pipeload.plan.partdelivery.decide): pure decisions, the same from any order."""

from __future__ import annotations

import random

from pipeload.plan.partdelivery import Delivery, decide

P = 4096


def _hosts(*hosts):
    return lambda r: hosts[r]


def test_the_reader_needing_most_of_a_cut_page_owns_it_and_delivers_the_other_part():
    # rank 0 reads [0, 10000), rank 1 [10000, 20000): page 2 ([8192, 12288)) holds 1808 of 0's, 2288 of 1's
    spans = [(0, 10000, 0, "a", 0), (10000, 20000, 1, "a", 0)]
    assert decide(spans, _hosts(0, 1), "f", P) == [Delivery(1, 0, "f", "a", 8192, 10000)]


def test_one_host_a_whole_page_and_a_lone_reader_deliver_nothing():
    spans = [(0, 10000, 0, "a", 0), (10000, 20000, 1, "a", 0)]
    assert decide(spans, _hosts(7, 7), "f", P) == []  # one page cache
    assert decide([(0, 8192, 0, "a", 0), (4096, 8192, 1, "b", 4096)], _hosts(0, 1), "f", P) == []  # both cover it
    assert decide([(0, 10000, 0, "a", 0)], _hosts(0), "f", P) == []


def test_offsets_are_inside_the_chunk_and_ties_go_to_the_lower_rank():
    # chunk "b" starts at 6144: rank 1 reads its first 2048 bytes, rank 0 the 2048 before (chunk "a")
    spans = [(4096, 6144, 0, "a", 0), (6144, 8192, 1, "b", 6144), (8192, 9000, 1, "b", 6144)]
    assert decide(spans, _hosts(0, 1), "f", P) == [Delivery(0, 1, "f", "b", 0, 2048)]


def test_decisions_do_not_depend_on_the_order_of_the_spans():
    rng = random.Random(0)
    spans = _random_spans(rng, 200, (100, 20000), per_key=5, gaps=(0,))
    want = decide(spans, _hosts(0, 1, 2, 2), "f", P)
    assert want and all(d.owner != d.receiver for d in want)
    for _ in range(5):
        rng.shuffle(spans)
        assert decide(spans, _hosts(0, 1, 2, 2), "f", P) == want


def test_disjoint_spans_group_pages_as_the_sweep_does():
    import numpy as np

    from pipeload.plan.partdelivery import _neighbours, _sweep

    spans = _random_spans(random.Random(1), 300, (50, 12000), per_key=3, gaps=(0, 0, 0, 100, 5000))
    a = np.array([x[0] for x in spans])
    b = np.array([x[1] for x in spans])
    fast = list(_neighbours(spans, a, b, P))
    assert fast and fast == list(_sweep(spans, P))


def _random_spans(rng, count: int, sizes: tuple[int, int], per_key: int, gaps: tuple) -> list[tuple]:
    """``count`` spans of random sizes in file order, each of one of 4 ranks, ``per_key`` a chunk key,
    with one of ``gaps`` after each (the chunk's first byte: any value at or before the span's)."""
    spans, at = [], 0
    for i in range(count):
        n = rng.randrange(*sizes)
        spans.append((at, at + n, rng.randrange(4), f"k{i // per_key}", at - at % 7))
        at += n + rng.choice(gaps)
    return spans
