"""Readers by storage position (pipeload.plan.storageorder) for checkpoints no rank wrote.

Affinities come from a real Hugging Face file's metadata as the loader decodes it; the plans are the
global plan's own, from records encoded by the loader's encoder.
"""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

import pipeload
from pipeload import formats
from pipeload.plan import globalplan as G
from pipeload.plan import storageorder
from pipeload.plan.chunkunits import chunk_table
from pipeload.plan.exchange import classes, decode_record, encode_record, make_row
from pipeload.plan.planner import fqn_index

# (rows, cols, role): col -> Shard(0) over tp, row -> Shard(1), rep -> whole on every rank
SHAPES = {f"layer{i:02d}.{n}": (s, role) for i in range(24)
          for n, s, role in (("a_col", (64, 32), "col"), ("b_row", (32, 64), "row"), ("c_rep", (16,), "rep"))}


@pytest.fixture(scope="module")
def hf(tmp_path_factory):
    """One Hugging Face file of float32 tensors, opened as the loader opens it."""
    root = tmp_path_factory.mktemp("hf")
    save_file({k: torch.randn(s) for k, (s, _) in SHAPES.items()}, str(root / "model.safetensors"))
    return formats.open_checkpoint(str(root))


def _boxes(md, tp: int, rank: int):
    """(fqns, offsets, lengths) of one rank's boxes, TP ``tp`` (rank % tp is its TP rank)."""
    t = rank % tp
    fqns, off, ln = [], [], []
    for k, (s, role) in sorted(SHAPES.items()):
        o, n = [0] * len(s), list(s)
        if role == "col":
            o[0], n[0] = t * s[0] // tp, s[0] // tp
        elif role == "row":
            o[1], n[1] = t * s[1] // tp, s[1] // tp
        fqns.append(k)
        off.append(o + [0] * (md.width() - len(o)))
        ln.append(n + [0] * (md.width() - len(n)))
    return fqns, np.array(off, np.int64), np.array(ln, np.int64)


def test_hf_checkpoints_are_placed_by_position_and_others_not(hf, tmp_path):
    assert hf.by_position and hf.writer_of is None
    pipeload.save({"w": torch.ones(4)}, str(tmp_path / "pl"))
    assert not formats.open_checkpoint(str(tmp_path / "pl")).by_position


def test_affinity_is_the_region_of_the_first_byte_alike_on_replicas(hf):
    md = hf.metadata
    world = 4
    pos, total = storageorder.chunk_positions(md)
    assert total == sum(int(np.prod(s)) * 4 for s, _ in SHAPES.values())
    assert len(set(pos.tolist())) == len(pos)  # one tensor a chunk, each at its own place
    fqns, off, ln = _boxes(md, 2, 0)
    aff = storageorder.affinities(md, fqns, off, ln, world)
    assert aff.min() >= 0 and aff.max() == world - 1
    # the regions follow the storage order: sorted by position, the affinities never go down
    t = md.tensors
    start = t.index.a["chunk_start"]
    first = np.array([pos[start[t.pos[f]]] for f in fqns])
    assert np.all(np.diff(aff[np.argsort(first, kind="stable")]) >= 0)
    assert np.array_equal(aff, storageorder.affinities(md, *_boxes(md, 2, 2), world))  # a DP replica
    # TP rank 1's half of a column-parallel tensor starts half-way: never in an earlier region
    other = storageorder.affinities(md, *_boxes(md, 2, 1), world)
    assert np.all(other >= aff)
    assert storageorder.affinities(md, fqns, off, ln, 1) is None
    # under MIN_CHUNKS_PER_REGION chunks a rank (72 chunks, 8 ranks: 9 each), no reader goes by position
    assert storageorder.applies(md, 4) and not storageorder.applies(md, 8)
    assert storageorder.affinities(md, fqns, off, ln, 8) is None
    assert storageorder.key_positions(md, list(fqn_index(md)), 8) is None


def test_positions_are_where_the_bytes_begin_also_with_several_dtypes(tmp_path):
    # safetensors writes a file's tensors by dtype (widest first), then by name: key order is not storage
    # order in a file of several dtypes. The positions follow each file's header.
    names = {f"t{i:02d}": (torch.float32 if i % 3 else torch.bfloat16) for i in range(40)}
    path = tmp_path / "model.safetensors"
    save_file({k: torch.ones(8 + i, dtype=d) for i, (k, d) in enumerate(names.items())}, str(path))
    md = formats.open_checkpoint(str(tmp_path)).metadata
    pos, total = storageorder.chunk_positions(md)
    t = md.tensors
    start = t.index.a["chunk_start"]
    header = formats.hf.read_header(str(path))
    keys = [k for k in header if k != "__metadata__"]
    by_storage = sorted(keys, key=lambda k: header[k][2])
    assert by_storage != sorted(keys)  # (the point of the case)
    assert sorted(keys, key=lambda k: pos[start[t.pos[k]]]) == by_storage
    assert total == sum(header[k][3] - header[k][2] for k in keys)


def _plan(hf, tp: int, dp: int, me: int, order=None, positions=True):
    """Rank ``me``'s global plan of a TP x DP load of ``hf`` with position affinities."""
    md = hf.metadata
    world = tp * dp
    names = list(fqn_index(md))
    index = {n: i for i, n in enumerate(names)}
    rows, recs = [], []
    for r in range(world):
        fqns, off, ln = _boxes(md, tp, r)
        aff = storageorder.affinities(md, fqns, off, ln, world)
        perm = list(range(len(fqns))) if order is None else order(len(fqns), r)
        rec = encode_record([index[fqns[i]] for i in perm], [True] * len(perm), off[perm], ln[perm], [],
                            md.width(), aff[perm])
        rows.append(make_row(record=rec, save_id="s", problems=False, host=r, resharded=tp > 1))
        recs.append(rec)
    rows = np.stack(rows)
    cls = classes(rows)
    ndim, itemsize = md.key_arrays(names)
    return G.global_plan(rows, cls, [decode_record(recs[int(o)]) for o in cls.owners], me, ndim=ndim,
                         itemsize=itemsize, broadcast=True, batch_bytes=0, can_create=True,
                         chunks=chunk_table(md, names),
                         positions=storageorder.key_positions(md, names, world) if positions else None)


def test_each_rank_reads_its_own_region_and_readers_advance_together(hf):
    tp, dp = 2, 2
    world = tp * dp
    md = hf.metadata
    names = list(fqn_index(md))
    start, row_bytes, total = storageorder.key_positions(md, names, world)
    region = -(-total // world)
    gp = _plan(hf, tp, dp, 0)
    # every unit and replicated tensor (held by every rank) is read by the owner of its region
    everyone = [op for op in gp.ops if len(gp.sets[op.group].members) == world]
    assert everyone
    for op in everyone:
        for key in op.shards:
            i = key[0] if key[0] >= 0 else -1 - key[0]
            at = int(start[i]) + (key[1][0] * int(row_bytes[i]) if key[1] else 0)
            assert op.reader == min(world - 1, at * world // total), key
    # the broadcasts go in region order: along the op list, each reader's offset inside its region grows
    # and no reader's offset runs more than a region's fraction ahead of another's
    seen = {}
    for op in gp.ops:
        for key in op.shards:
            i = key[0] if key[0] >= 0 else -1 - key[0]
            at = (int(start[i]) + (key[1][0] * int(row_bytes[i]) if key[1] else 0)) % region
            assert at >= seen.get(op.reader, -1)
            seen[op.reader] = at
    assert len(seen) == world  # every rank reads, from the start


@pytest.mark.parametrize("seed", [0, 1])
def test_position_plans_agree_on_every_rank_and_any_record_order(hf, seed):
    rng = random.Random(seed)

    def order(n, r):
        p = list(range(n))
        rng.shuffle(p)
        return p

    ref = _plan(hf, 2, 2, 0).digest()
    for me in range(4):
        assert _plan(hf, 2, 2, me, order=order).digest() == ref


def test_interleaved_is_a_pure_function_of_the_pieces():
    keys = [(i, (r,), (1,)) for i in range(3) for r in range(4)]
    start = np.array([0, 400, 800])
    row_bytes = np.array([100, 100, 100])
    cols = (np.arange(len(keys)), np.arange(len(keys)) * 10)
    out = storageorder.interleaved(keys, cols, (start, row_bytes, 1200), 3)
    # regions of 400 bytes: the k-th 100 bytes of every region, then the next
    assert out[0][:3] == [(0, (0,), (1,)), (1, (0,), (1,)), (2, (0,), (1,))]
    assert out[1].tolist() == [keys.index(k) for k in out[0]]
    shuffled = list(range(len(keys)))
    random.Random(3).shuffle(shuffled)
    again = storageorder.interleaved([keys[j] for j in shuffled], (cols[0][shuffled], cols[1][shuffled]),
                                     (start, row_bytes, 1200), 3)
    assert again[0] == out[0] and again[2].tolist() == out[2].tolist()


# -- runs of holder sets (loads whose boxes cut stored chunks, any layout) ------------------------------


def test_box_starts_place_a_box_at_its_first_byte(hf):
    md = hf.metadata
    names = list(fqn_index(md))
    at = storageorder.box_starts(md, names)
    start, row_bytes, _ = storageorder.key_positions(md, names, 2)
    i = names.index("layer03.a_col")  # (64, 32) float32, stored whole: rows of 128 bytes
    width = md.width()
    offsets = np.zeros((3, width), np.int64)
    lengths = np.zeros((3, width), np.int64)
    offsets[1, 0], offsets[2, :2] = 32, (32, 16)
    lengths[:, :2] = (32, 32)
    got = at(np.array([i, i, -1 - i]), offsets, lengths)
    assert got[0] == start[i] and got[1] == start[i] + 32 * row_bytes[i]
    assert got[2] == start[i] + (32 * 32 + 16) * 4  # a unit row (-1 - index) and an inner column
    assert at(np.array([len(names) + 5]), offsets[:1], lengths[:1])[0] == -1  # no such key: no position


def _runs(sid, weight, at, members, loads):
    keys = [np.arange(len(sid))]  # key order = row order here
    return storageorder.runs(np.asarray(sid), np.asarray(weight), np.asarray(at), keys, members,
                             np.asarray(loads, np.int64), G._water_fill)


def test_runs_give_each_member_one_contiguous_run_of_its_set():
    rng = random.Random(5)
    n = 60
    sid = [rng.choice([1, 2]) for _ in range(n)]
    weight = [rng.randint(1, 9) * 1000 for _ in range(n)]
    at = rng.sample(range(10**6), n)  # storage positions, unrelated to row order
    members = {1: (0, 2), 2: (1, 3, 5)}
    prefer, offset = _runs(sid, weight, at, members, [0] * 6)
    for s, m in members.items():
        rows = sorted((at[j], j) for j in range(n) if sid[j] == s)
        readers = [int(prefer[j]) for _, j in rows]
        assert readers == sorted(readers) and set(readers) == set(m)  # runs in storage order, every member
        total = sum(weight[j] for _, j in rows)
        for r in m:  # each within one row of the even share
            mine = sum(weight[j] for _, j in rows if prefer[j] == r)
            assert abs(mine - total / len(m)) <= 9000
        # the offset inside a run grows along it, from within a row of 0
        for r in m:
            offs = [int(offset[j]) for _, j in rows if prefer[j] == r]
            assert 0 <= offs[0] <= 9000 and offs == sorted(offs)
    # a member that reads alone already gets less of the set (water filling)
    prefer2, _ = _runs(sid, weight, at, members, [10**5, 0, 0, 0, 0, 0])
    assert sum(w for w, p, s in zip(weight, prefer2, sid) if p == 0) < sum(
        w for w, p, s in zip(weight, prefer2, sid) if p == 2)
    # a pure function of the rows: permuted rows, the same member and offset each
    perm = rng.sample(range(n), n)
    p3, o3 = _runs([sid[j] for j in perm], [weight[j] for j in perm], [at[j] for j in perm], members, [0] * 6)
    assert p3.tolist() == prefer[perm].tolist() and o3.tolist() == offset[perm].tolist()
