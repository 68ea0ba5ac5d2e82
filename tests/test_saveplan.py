"""The save's plan for many ranks in one process: the same writers as ``balance.assign`` (through
``saver.plan_save``, the rule the save used before it was planned through the exchange), disagreements
named, a rank's own component enough for its own decisions, and ``pipeload simulate --op save`` at a
small world size."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from pipeload.save import savecache, saveowners, saveplan
from pipeload.io.checksum import checksum
from pipeload.formats.metadata import dtype_name
from pipeload.save.saver import encode_object, plan_save
from pipeload.tools.simsave import SaveKeyWorld, SimSaveExchange, simulate_save
from pipeload.plan.statedict import Box, flatten

DTYPES = [torch.float32, torch.bfloat16, torch.int64, torch.float64]


def _split(n: int, k: int) -> list[tuple[int, int]]:
    """``n`` cut into ``k`` uneven (start, size) parts; some may be empty."""
    cuts = sorted(random.randint(0, n) for _ in range(k - 1))
    edges = [0, *cuts, n]
    return [(a, b - a) for a, b in zip(edges, edges[1:])]


def random_world(rng: random.Random, world: int):
    """Per rank: (state dict, boxes). Each tensor is cut along one dim; each part is held by a disjoint
    set of ranks (its replicas); some ranks hold nothing of it; objects on most ranks."""
    random.seed(rng.random())
    sds = [dict() for _ in range(world)]
    boxes = [dict() for _ in range(world)]
    for t in range(rng.randint(1, 12)):
        fqn = f"t{t:02d}.w"
        nd = rng.choice([0, 1, 2, 2])
        shape = tuple(rng.choice([0, 1, 3, 8, 17]) if rng.random() < 0.1 else rng.randint(1, 40) for _ in range(nd))
        dtype = rng.choice(DTYPES)
        if nd:
            d = rng.randrange(nd)
            parts = _split(shape[d], rng.randint(1, min(world, 5)))
        else:
            d, parts = None, [(0, 1)]
        ranks = list(range(world))
        rng.shuffle(ranks)
        cuts = sorted(rng.sample(range(1, world), len(parts) - 1)) if len(parts) > 1 else []
        groups = [ranks[a:b] for a, b in zip([0, *cuts], [*cuts, world])]
        for (start, size), holders in zip(parts, groups):
            off = [0] * nd
            ln = list(shape)
            if d is not None:
                off[d], ln[d] = start, size
            for r in holders[: rng.randint(1, len(holders))]:
                v = torch.zeros(ln, dtype=dtype)
                sds[r][fqn] = v
                boxes[r][fqn] = Box(shape, tuple(off), tuple(ln), v)
    for r in range(world):
        if rng.random() < 0.8:
            sds[r]["step"] = 7
            sds[r]["lr"] = 0.5
    return sds, boxes


def records_of(sds, boxes):
    return [saveplan.local_record(flatten(sd), lambda fqn, v, c, b=b: b[fqn]) for sd, b in zip(sds, boxes)]


def exchanged(recs) -> saveplan.Exchanged:
    """What every rank holds after the exchange, from every rank's record (the collectives' result)."""
    rows = np.stack([saveplan.make_row(r, bool(r.problems)) for r in recs])
    ncls = saveplan._classes_of(rows, saveplan.R_NAMES, saveplan.R_NNBYTES)
    rcls = saveplan._classes_of(rows, saveplan.R_RECORD, saveplan.R_RNBYTES)
    return saveplan.Exchanged(rows, rcls, [recs[int(o)].record for o in rcls.owners], ncls,
                              [recs[int(o)].names for o in ncls.owners])


def old_entries(sd, boxes):
    """The per-rank entries of the save before it was planned through the exchange."""
    out = []
    for fqn, v in sorted(sd.items()):
        if isinstance(v, torch.Tensor):
            b = boxes[fqn]
            out.append(("t", fqn, dtype_name(v.dtype), b.global_shape, b.offsets, b.lengths))
        else:
            data = encode_object(v)
            out.append(("o", fqn, len(data), checksum(data)))
    return out


def chunk_writers(p: saveplan.Plan) -> dict[tuple, int]:
    out = {}
    for g in np.flatnonzero(p.writer >= 0).tolist():
        k = int(p.chunk_index[g])
        d = int(p.ndim[k])
        out[("t", p.names[k], tuple(p.chunk_offsets[g, :d].tolist()), tuple(p.chunk_lengths[g, :d].tolist()))] = \
            int(p.writer[g])
    return out


@pytest.mark.parametrize("seed", range(40))
def test_writers_are_balance_assign_on_random_layouts(seed):
    rng = random.Random(seed)
    world = rng.randint(1, 12)
    sds, boxes = random_world(rng, world)
    owners, _, problems = plan_save([old_entries(sd, b) for sd, b in zip(sds, boxes)])
    recs = records_of(sds, boxes)
    xc = exchanged(recs)
    whole = saveplan.plan(xc, 0, everything=True)
    assert not problems and not whole.problems
    expected = {k: r for k, r in owners.items() if k[0] == "t"}
    assert chunk_writers(whole) == expected
    for me in range(world):  # each rank's own component decides what it writes, as the whole plan does
        mine = saveplan.plan(xc, me)
        got = chunk_writers(mine)
        assert all(expected[k] == r for k, r in got.items())
        assert {k for k, r in expected.items() if r == me} <= set(got)
        assert mine.object_writer == whole.object_writer
    objects = [k for k in owners if k[0] == "o"]
    for k in objects:  # every object written once, by a rank that holds it
        holder = whole.object_writer[whole.names.index(k[1])]
        assert "step" in sds[holder] or k[1] not in sds[holder]


def test_plan_does_not_depend_on_rank_order_of_identical_records():
    rng = random.Random(5)
    sds, boxes = random_world(rng, 8)
    recs = records_of(sds, boxes)
    a = saveplan.plan(exchanged(recs), 0, everything=True)
    b = saveplan.plan(exchanged(recs), 7, everything=True)
    assert chunk_writers(a) == chunk_writers(b) and a.object_writer == b.object_writer


def _one(fqn, shape, off, ln, dtype=torch.float32):
    v = torch.zeros(ln, dtype=dtype)
    return {fqn: v}, {fqn: Box(shape, off, ln, v)}


@pytest.mark.parametrize("case, needle", [
    ("dtype", "'w': rank 1 has dtype F16"),
    ("shape", "'w': rank 1 has dtype F32 shape [8, 5]"),
    ("kind", "'w': a tensor on rank 0 and a Python object on rank 1"),
    ("gap", "'w': the ranks' shards"),
    ("overlap", "'w': the ranks' shards"),
])
def test_disagreements_name_the_key(case, needle):
    a = _one("w", (8, 4), (0, 0), (4, 4))
    b = {
        "dtype": _one("w", (8, 4), (4, 0), (4, 4), torch.float16),
        "shape": _one("w", (8, 5), (4, 0), (4, 5)),
        "kind": ({"w": 3}, {}),
        "gap": _one("w", (8, 4), (5, 0), (3, 4)),
        "overlap": _one("w", (8, 4), (2, 0), (6, 4)),
    }[case]
    p = saveplan.plan(exchanged(records_of([a[0], b[0]], [a[1], b[1]])), 0)
    assert p.problems and needle in p.problems[0], p.problems


def test_a_grid_of_uneven_shards_tiles_and_a_non_grid_is_checked_exactly():
    parts = [((0, 0), (3, 5)), ((0, 5), (3, 2)), ((3, 0), (5, 7))]  # no grid, but a tiling
    sds, bxs = zip(*(_one("w", (8, 7), o, n) for o, n in parts))
    assert not saveplan.plan(exchanged(records_of(sds, bxs)), 0).problems
    grid = [((i, j), (a, b)) for i, a in ((0, 3), (3, 5)) for j, b in ((0, 5), (5, 2))]
    sds, bxs = zip(*(_one("w", (8, 7), o, n) for o, n in grid))
    assert not saveplan.plan(exchanged(records_of(sds, bxs)), 0).problems


def test_simulated_exchange_hands_out_what_the_records_say():
    rng = random.Random(3)
    sds, boxes = random_world(rng, 6)
    recs = records_of(sds, boxes)
    xc = exchanged(recs)
    for r, rec in enumerate(recs):
        sim = SimSaveExchange(xc.rows, xc.tables, xc.records, r)
        got = saveplan.exchange(sim, rec, [], "test")
        assert np.array_equal(got.rows, xc.rows) and got.tables == xc.tables and got.records == xc.records


@pytest.mark.parametrize("layout", ["dense", "fsdp"])
def test_simulate_save_small_world(layout):
    res = simulate_save(64, layout, samples=3, memory=False)
    assert res["plans_identical"]
    assert res["distinct_records"] == (64 if layout == "fsdp" else 8)
    assert res["rank0_commit_bytes_received"] > 0 and res["per_rank_cpu_s"] > 0
    assert res["writer_balance"] >= 1.0


def test_cli_simulate_op_save_prints_the_keys(capsys):
    import json

    from pipeload.tools.cli import main

    assert main(["simulate", "--op", "save", "--layout", "dense", "--world", "64", "--samples", "2",
                 "--no-memory", "--json"]) == 0
    res = json.loads(capsys.readouterr().out)
    for key in ("per_rank_cpu_s", "per_rank_peak_mb", "exchange_bytes_sent", "exchange_bytes_received",
                "plans_identical", "rank0_commit_s", "rank0_commit_bytes_received"):
        assert key in res
    assert res["op"] == "save" and res["plans_identical"]


def _through_owners(recs, rank: int):
    """``rank``'s plan as the saver takes it (rows and name tables, then :func:`saveowners.plan_save`),
    through the simulated exchange of every rank's records; (plan, path taken)."""
    xc = exchanged(recs)
    keys = SaveKeyWorld(xc, saveplan.plan(xc, 0, everything=True))
    sim = SimSaveExchange(xc.rows, xc.tables, xc.records, rank, keys)
    got = saveplan.exchange(sim, recs[rank], [], "test", records=False)
    return saveowners.plan_save(sim, got, recs[rank], rank, "test"), sim.path


def _writes(p, rec, rank: int, rows) -> list[str]:
    return [s[0] for s in savecache.Entry.of(p, rec, rank, rows).specs]


@pytest.mark.parametrize("seed", range(30))
def test_tensor_owner_plans_are_the_digest_path_plans_on_random_layouts(seed, monkeypatch):
    monkeypatch.setenv("PIPELOAD_KEY_OWNER_BYTES", "0")  # every save asks the tensor owners
    rng = random.Random(1000 + seed)
    world = rng.randint(2, 12)
    sds, boxes = random_world(rng, world)
    if seed % 3 == 0:  # FSDP-like: every rank's record distinct, replicated scalars on every rank
        sds = [{k: v for k, v in sd.items() if not isinstance(v, torch.Tensor)} for sd in sds]
        boxes = [dict() for _ in range(world)]
        parts = {n: _split(n, world) if n >= world else [(min(r, n), int(r < n)) for r in range(world)]
                 for n in (world * 3, world - 1, 5)}
        for r in range(world):
            for t, n in enumerate(parts):
                start, size = parts[n][r]
                v = torch.zeros(size, 4)
                sds[r][f"f{t}"], boxes[r][f"f{t}"] = v, Box((n, 4), (start, 0), (size, 4), v)
            v = torch.zeros(())
            sds[r]["scale"], boxes[r]["scale"] = v, Box((), (), (), v)
    if seed % 2:  # one more rank holding no tensor (its record is empty)
        sds.append({"step": 7, "lr": 0.5} if seed % 4 == 1 else {})
        boxes.append({})
        world += 1
    recs = records_of(sds, boxes)
    xc = exchanged(recs)
    paths = set()
    for me in range(world):
        got, path = _through_owners(recs, me)
        paths.add(path)
        assert not got.problems
        assert _writes(got, recs[me], me, xc.rows) == _writes(saveplan.plan(xc, me), recs[me], me, xc.rows)
    assert len(paths) == 1  # every rank took the same path
    if seed % 3 == 0:
        assert paths == {"key owners"}


@pytest.mark.parametrize("case, needle", [("gap", "'w': the ranks' shards"), ("overlap", "'w': the ranks' shards"),
                                          ("dtype", "'w': rank 1 has dtype F16")])
def test_tensor_owners_name_the_key_that_does_not_tile(case, needle, monkeypatch):
    monkeypatch.setenv("PIPELOAD_KEY_OWNER_BYTES", "0")
    a = _one("w", (8, 4), (0, 0), (4, 4))
    b = {"gap": _one("w", (8, 4), (5, 0), (3, 4)), "overlap": _one("w", (8, 4), (2, 0), (6, 4)),
         "dtype": _one("w", (8, 4), (4, 0), (4, 4), torch.float16)}[case]
    recs = records_of([a[0], b[0]], [a[1], b[1]])
    for me in range(2):
        got, path = _through_owners(recs, me)
        assert got.problems and needle in got.problems[0], got.problems
