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


def test_blob_positions_go_from_each_locator_to_the_readers_of_its_blob_and_its_neighbours():
    """heads(): every rank derives the same messages from what it holds (the spans of the blobs it reads
    and of their neighbours), so what one rank sends another expects; a blob named by two keys (its fqn
    and its chunk key, one offset) is one blob; same-host readers get nothing (one page cache)."""
    from pipeload.plan.partdelivery import heads, neighbours

    rng = random.Random(3)
    hosts = _hosts(0, 1, 2, 2)
    layouts, spans_all = {}, {}
    for f in ("a", "b"):
        keys = [f"{f}{i}" for i in range(30)]
        firsts = [i * 5000 for i in range(30)]
        # each blob under its key and an alias at the same offset
        layouts[f] = ([x for x in firsts for _ in (0, 1)], [x + 5000 for x in firsts for _ in (0, 1)],
                      [k for key in keys for k in (key, key + "@0")])
        spans_all[f] = [(k, lo, lo + rng.randint(1, 900), r) for k in keys if rng.random() < 0.8
                        for r in rng.sample(range(4), rng.randint(1, 3)) for lo in (rng.randint(0, 2000),)]
    index = {f"{f}{i}": j for j, (f, i) in enumerate((f, i) for f in "ab" for i in range(30))}

    def known(me: int) -> dict:
        """The spans rank ``me`` holds: the keys it reads, then their neighbours'."""
        mine = {index[x[0]] for fs in spans_all.values() for x in fs if x[3] == me}
        part = {f: [x for x in fs if index[x[0]] in mine] for f, fs in spans_all.items()}
        more = neighbours(part, me, layouts.__getitem__, "ab", index) | mine
        return {f: [x for x in fs if index[x[0]] in more] for f, fs in spans_all.items()}

    got = {me: heads(known(me), me, hosts, "ab", layouts.__getitem__) for me in range(4)}
    want = {me: heads(spans_all, me, hosts, "ab", layouts.__getitem__) for me in range(4)}
    assert got == want
    pairs = 0
    for a in range(4):
        for b, items in got[a][0].items():
            assert got[b][1].get(a) == items and hosts(a) != hosts(b)
            pairs += 1
        for b, items in got[a][1].items():
            assert got[b][0].get(a) == items
    assert pairs and not got[2][0].get(3) and not got[3][0].get(2)
    assert all(not k.endswith("@0") for me in range(4) for items in got[me][0].values() for _, k in items)


def test_a_chunks_locator_owns_the_page_of_its_head_when_it_reads_there():
    # page 2 holds 1808 bytes of rank 0's chunk "a" and 2288 of rank 1's "b": rank 0 owns it unless the
    # page holds the head of a chunk rank 0 locates
    spans = [(0, 10000, 0, "a", 0), (10000, 20000, 1, "b", 10000)]
    assert decide(spans, _hosts(0, 1), "f", P) == [Delivery(1, 0, "f", "a", 8192, 10000)]
    assert decide(spans, _hosts(0, 1), "f", P, {2: 0}.get) == [Delivery(0, 1, "f", "b", 0, 2288)]
    assert decide(spans, _hosts(0, 1), "f", P, {2: 3}.get) == [Delivery(1, 0, "f", "a", 8192, 10000)]  # not there


# Object stores: runs (pipeload.plan.partruns.runs, run_deliveries, owned)

def _interleaved(rng, ranks: int, count: int, sizes=(15 << 10, 50 << 10), gaps=(0,)) -> list[tuple]:
    """``count`` spans in file order of rotating ranks (a tensor saved whole, loaded in rank slices), chunk
    keys of 8 spans each, chunk starts at a key's first span."""
    spans, at, start = [], 4096, 4096
    for i in range(count):
        if i % 8 == 0:
            start = at
        n = rng.randrange(*sizes)
        spans.append((at, at + n, i % ranks, f"k{i // 8}", start))
        at += n + rng.choice(gaps)
    return spans


def _check_runs(spans, cuts, file="f"):
    """Every byte a rank needs is in its own run or delivered to it exactly once, by the run's owner."""
    from pipeload.plan.partruns import by_rank, run_deliveries, union

    ds = run_deliveries(spans, cuts, file)
    got: dict[int, list] = {}
    for d in ds:
        s = next(x[4] for x in spans if x[3] == d.key)
        owner = [o for lo, hi, o in cuts if lo <= s + d.lo and s + d.hi <= hi]
        assert owner == [d.owner] and d.owner != d.receiver, d
        got.setdefault(d.receiver, []).append((s + d.lo, s + d.hi))
    for r, need in by_rank(spans).items():
        mine = [(max(a, lo), min(b, hi)) for a, b in need for lo, hi, o in cuts if o == r and a < hi and b > lo]
        pieces = sorted(got.get(r, []) + mine)
        assert all(b <= c for (_, b), (c, _) in zip(pieces, pieces[1:])), "a byte delivered or read twice"
        assert union(pieces) == need, r
    return ds


def test_interleaved_object_is_cut_into_runs_each_byte_read_once():
    from pipeload.plan.partruns import RUN_BYTES, owned, runs

    spans = _interleaved(random.Random(2), 4, 1600)  # ~50 MiB, each rank's pieces 15-50 KiB apart
    cuts = runs(spans)
    total = sum(b - a for a, b, *_ in spans)
    assert len(cuts) == min(4, -(-total // RUN_BYTES)) and len({o for *_, o in cuts}) == len(cuts)
    assert cuts[0][0] == spans[0][0] and cuts[-1][1] == spans[-1][1]
    assert all(a[1] == b[0] for a, b in zip(cuts, cuts[1:]))  # contiguous, tiling the union
    sizes = [hi - lo for lo, hi, _ in cuts]
    assert max(sizes) - min(sizes) <= 1
    _check_runs(spans, cuts)
    for lo, hi, o in cuts:  # an owner asks for its whole run: one range, no holes here
        assert owned(spans, cuts, o) == [(lo, hi)]


def test_runs_only_where_own_requests_would_fetch_other_ranks_bytes():
    from pipeload.plan.partruns import runs

    # each rank reads one contiguous half: its own requests fetch nothing twice
    assert runs([(0, 20 << 20, 0, "a", 0), (20 << 20, 40 << 20, 1, "b", 20 << 20)]) == []
    assert runs([(0, 20 << 20, 0, "a", 0)]) == []  # one reader
    spans = _interleaved(random.Random(3), 2, 400)
    assert runs(spans)  # interleaved: its merged requests would fetch the other rank's pieces


def test_a_run_goes_to_the_reader_needing_most_of_it():
    from pipeload.plan.partruns import runs

    # rank 1 reads the first 12 MiB alone, then ranks 0 and 1 interleave over the next 12 MiB
    spans = [(0, 12 << 20, 1, "a", 0)]
    at = 12 << 20
    for i in range(300):
        spans.append((at, at + 40960, i % 2, "b", 12 << 20))
        at += 40960
    cuts = runs(spans)
    assert [o for *_, o in cuts] == [1, 0]
    _check_runs(spans, cuts)


def test_runs_do_not_depend_on_the_order_of_the_spans_and_turn_between_objects():
    from pipeload.plan.partruns import run_deliveries, runs

    rng = random.Random(4)
    spans = _interleaved(rng, 4, 1000, gaps=(0, 0, 0, 512, 70000))
    want = runs(spans, order=1)
    ds = _check_runs(spans, want)
    for _ in range(4):
        rng.shuffle(spans)
        assert runs(spans, order=1) == want and run_deliveries(spans, want, "f") == ds
    # equal needs, two runs among four readers: the owners turn with the object's order, so the runs of
    # successive objects spread over the ranks
    even = _interleaved(rng, 4, 400, sizes=(40960, 40961))
    assert [[o for *_, o in runs(even, order=k)] for k in range(3)] == [[0, 1], [2, 3], [0, 1]]


def test_overlapping_spans_of_replicas_are_delivered_once_each():
    from pipeload.plan.partruns import runs

    # ranks 0 and 2 both read the same pieces (replicas reading for themselves), 1 and 3 the others
    spans = []
    at = 0
    for i in range(600):
        for r in ((0, 2), (1, 3))[i % 2]:
            spans.append((at, at + 30000, r, f"k{i // 10}", (i // 10) * 300000))
        at += 30000
    cuts = runs(spans)
    assert len(cuts) == 3
    _check_runs(spans, cuts)


def test_cut_balances_bytes_across_holes_and_owners_skip_long_holes():
    from pipeload.plan.partruns import cut, owned

    whole = [(0, 100), (300, 400), (1000, 1100)]  # 300 bytes, holes of 200 and 600
    assert cut(whole, 1) == [(0, 1100)]
    assert cut(whole, 3) == [(0, 300), (300, 1000), (1000, 1100)]  # 100 bytes each
    assert cut(whole, 2) == [(0, 350), (350, 1100)]
    spans = [(a, b, 0, "k", 0) for a, b in whole]
    cuts = [(0, 350, 0), (350, 1100, 1)]
    assert owned(spans, cuts, 0, gap=250) == [(0, 350)]  # the 200-byte hole is requested across
    assert owned(spans, cuts, 1, gap=250) == [(350, 400), (1000, 1100)]  # the 600-byte one is not


def test_a_small_range_inside_another_ranks_range_is_delivered_from_there():
    from pipeload.plan.partruns import nested, nested_deliveries

    # an object without runs: rank 0 reads its first half, rank 2 its second; rank 1 reads one small
    # tensor in rank 2's half, and every rank a record right after it (merged into rank 2's range only)
    half = 6 << 20
    spans = [(0, half, 0, "a", 0), (half, 2 * half, 2, "b", half), (half + 4096, half + 8192, 1, "b", half)]
    spans += [(2 * half, 2 * half + 100, r, "obj", 2 * half) for r in range(4)]
    inner = nested(spans)
    rec = (2 * half, 2 * half + 100)
    assert inner == [(half + 4096, half + 8192, 1, 2), (*rec, 0, 2), (*rec, 1, 2), (*rec, 3, 2)]
    ds = nested_deliveries(spans, inner, "f")
    assert ds == [Delivery(2, 0, "f", "obj", 0, 100), Delivery(2, 1, "f", "b", 4096, 8192),
                  Delivery(2, 1, "f", "obj", 0, 100), Delivery(2, 3, "f", "obj", 0, 100)]


def test_equal_ranges_go_to_the_lower_rank_and_nesting_ignores_the_order_of_the_spans():
    from pipeload.plan.partruns import nested

    spans = [(100, 200, r, "k", 0) for r in (3, 1, 2)]
    assert nested(spans) == [(100, 200, 2, 1), (100, 200, 3, 1)]
    rng = random.Random(5)
    spans = [(a, a + rng.randrange(1, 5000), rng.randrange(6), f"k{a}", a)
             for a in sorted(rng.sample(range(0, 40 << 20, 4096), 300))]
    want = nested(spans)
    for lo, hi, r, o in want:  # each nested range lies inside a range of its owner, none of them nested
        assert o != r and (o not in {x[2] for x in want if x[0] <= lo and hi <= x[1]})
    for _ in range(3):
        rng.shuffle(spans)
        assert nested(spans) == want


def test_object_reads_list_each_object_for_every_rank_of_the_class_reading_it():
    from types import SimpleNamespace

    import numpy as np

    from pipeload.plan.globalplan import object_reads

    records = [SimpleNamespace(objects=np.array([3, 5], dtype=np.int32)),
               SimpleNamespace(objects=np.array([], dtype=np.int32))]
    cls = SimpleNamespace(members=[np.array([0, 2]), np.array([1])])
    got = object_reads(records, cls)
    assert got.dtype == np.int64 and got.tolist() == [[0, 3], [2, 3], [0, 5], [2, 5]]
    assert object_reads(records[1:], SimpleNamespace(members=[np.array([1])])).shape == (0, 2)


def test_blob_runs_keep_each_blob_whole_and_deliver_every_other_readers_bytes():
    """An object whose chunks are located by their heads (DCP): each blob is fetched whole by the owner
    of the run holding its first byte, and every other reader's bytes of it are delivered, exactly once;
    every rank derives the same deliveries."""
    from pipeload.plan.partruns import blob_runs

    rng = random.Random(7)
    blobs, at, spans = {}, 0, []
    for i in range(200):  # blobs of 20-60 KiB, each cut in halves or quarters between 4 ranks
        n = rng.randrange(20 << 10, 60 << 10)
        blobs[f"k{i}"] = (at, at + n + 700)
        parts = rng.choice((2, 4))
        for j in range(parts):
            spans.append((f"k{i}", n * j // parts, n * (j + 1) // parts, (i + j) % 4))
        at += n + 700
    views = [blob_runs(spans, blobs, me, "f", order=1) for me in range(4)]
    every = sorted({d for got, _ in views for d in got})
    for me, (got, _) in enumerate(views):
        assert got == [d for d in every if me in (d.owner, d.receiver)]
    owner = {d.key: d.owner for d in every}
    for key, lo, hi, r in spans:  # each byte some non-owner needs comes from the blob's one owner
        if owner.get(key, r) != r:
            assert sum(d.hi - d.lo for d in every if d.key == key and d.receiver == r and lo <= d.lo < hi) == hi - lo
    fetched = sorted(x for _, ranges in views for x in ranges)
    assert all(any(a <= blobs[k][0] and blobs[k][1] <= b for a, b in fetched) for k in owner)
    assert sum(b - a for a, b in fetched) <= at  # no blob fetched twice


def test_runs_also_when_the_readers_own_regions_take_more_gets_than_the_object_needs():
    """Four readers of disjoint 3.25 MiB regions of one 13 MiB object fetch nothing twice but take four
    GETs where two parts hold it: two runs of whole parts; two readers of 6.5 MiB halves take two: none."""
    from pipeload.plan.partruns import runs

    mib = 1 << 20
    quarters = [(i * 13 * mib // 4, (i + 1) * 13 * mib // 4, i, "k", 0) for i in range(4)]
    cuts = runs(quarters)
    assert len(cuts) == 2 and cuts[0][0] == 0 and cuts[-1][1] == 13 * mib
    assert runs([(0, 13 * mib // 2, 0, "k", 0), (13 * mib // 2, 13 * mib, 1, "k", 0)]) == []
