"""Key owners (pipeload.plan.keyowners): the R = 1 path finds the shared keys without every record on every
rank, and takes exactly the digest path's decisions, on random layouts (through the simulated
exchange, which models both all-to-alls) and in a real 4-rank gloo world (through the real ones)."""

from __future__ import annotations

import os
import random

import numpy as np
import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard

import pipeload
from pipeload.plan import keyowners
from pipeload.tools import simulate as sim
from pipeload.tools._world import run_world
from pipeload.engine.comm import Comm
from pipeload.plan.exchange import (F_KEYOWNER, classes, decode_record, encode_record, group_digest, make_row,
                                    record_transfer)
from pipeload.plan.globalplan import global_plan
from pipeload.engine.loader import exchange_and_plan
from pipeload.formats.metadata import read_metadata
from pipeload.plan.planner import fqn_index, local_plan, plan_record
from pipeload.plan.statedict import flatten, mesh_groups, meshes_of

import layouts as L

ITEMSIZE, WIDTH = 4, 2


def _layout(rng: random.Random, world: int):
    """A random layout of disjoint holder sets (the R = 1 path plans it): per rank (shards, objects),
    the reusable groups, writers. Some sets are whole classes (identical records), some are split over
    distinct records, some are not broadcastable or have no group; every rank has private shards."""
    ranks = list(range(world))
    rng.shuffle(ranks)
    per_rank = {r: ([], [rng.randrange(200, 203)]) for r in range(world)}
    reusable = {r: [] for r in range(world)}
    writers = {}
    key = 0
    while ranks:
        members = sorted(ranks[: rng.choice([1, 2, 3, 4])])
        del ranks[: len(members)]
        replicas = len(members) > 1 and rng.random() < 0.25  # identical records: one class of several ranks
        if len(members) > 1 and rng.random() < 0.8:
            for r in members:
                reusable[r].append(tuple(members))
        for _ in range(rng.randint(1, 6)):  # the set's shared shards
            rows = rng.choice([1, 4, 64, 3000])
            k = (key, (0, 0), (rows, rng.choice([1, 16])))
            key += 1
            bc = rng.random() > 0.1
            if rng.random() < 0.3:
                writers[k] = rng.choice(members)
            for r in members:
                per_rank[r][0].append((k, bc if r == members[0] else True))
        if not replicas:
            for r in members:  # private shards, distinct per rank
                for _ in range(rng.randint(0, 4)):
                    per_rank[r][0].append(((key, (0, 0), (rng.choice([8, 500]), 4)), True))
                    key += 1
    return [per_rank[r] for r in range(world)], [reusable[r] for r in range(world)], writers, key


def _exchange(per_rank, reusable, writers, n_keys, threshold=0):
    world = len(per_rank)
    rows, recs = [], []
    for r, (shards, objects) in enumerate(per_rank):
        rec = encode_record([k[0] for k, _ in shards], [bc for _, bc in shards], [list(k[1]) for k, _ in shards],
                            [list(k[2]) for k, _ in shards], objects, WIDTH, [writers.get(k, -1) for k, _ in shards])
        rows.append(make_row(record=rec, save_id="s", problems=False, host=r, key_owner_bytes=threshold,
                             groups=[group_digest(m) for m in reusable[r]]))
        recs.append(rec)
    rows = np.stack(rows)
    cls = classes(rows)
    records = [recs[int(o)] for o in cls.owners]
    n = max(n_keys, 203)
    arrays = np.full(n, 2, dtype=np.int64), np.full(n, ITEMSIZE, dtype=np.int64)
    return rows, cls, records, recs, arrays, n


def _members(gp, ops):
    return [(gp.sets[o.group].members, o.reader, o.shards) for o in ops]


@pytest.mark.parametrize("seed", range(12))
def test_key_owner_plans_are_the_digest_path_plans_on_random_layouts(seed):
    rng = random.Random(seed)
    world = rng.choice([2, 5, 8, 16, 33])
    per_rank, reusable, writers, n_keys = _layout(rng, world)
    if seed % 4 == 3:  # two sets meet on a rank: every rank falls back, alike
        per_rank[0][0].append(((n_keys, (0, 0), (64, 4)), True))
        per_rank[world - 1][0].append(((n_keys, (0, 0), (64, 4)), True))
        n_keys += 1
    rows, cls, records, recs, (ndim, itemsize), n = _exchange(per_rank, reusable, writers, n_keys)
    assert keyowners.use_key_owners(rows, cls, record_transfer(cls, world))
    kw = dict(batch_bytes=rng.choice([0, 4096]), can_create=seed % 4 == 3, min_stripe=rng.choice([1, 1 << 20]))
    model = sim.KeyOwnerWorld(rows, cls, records, (ndim, itemsize), n, can_create=kw["can_create"])
    flagged = bool(model.summary[:, keyowners.S_FLAG].any())
    decoded = [decode_record(b) for b in records]
    whole = global_plan(rows, cls, decoded, 0, ndim=ndim, itemsize=itemsize, broadcast=True, everything=True, **kw)
    # the flag, derived from the whole plan: a set to create, or a rank in two sets some broadcast uses
    in_two = any(sum(r in s.members for s in whole.sets.values()) > 1 for r in range(world))
    assert flagged == (bool(whole.creates) or in_two)
    assert flagged == (seed % 4 == 3) or world <= 2
    for me in range(world):
        ex = sim.SimExchange(rows, cls, records, me, model)
        gp = keyowners.plan(ex, decode_record(recs[me]), me, rows, cls, ndim=ndim, itemsize=itemsize, n_names=n,
                            broadcast=True, **kw)
        if flagged:
            assert gp is None
            continue
        old = global_plan(rows, cls, decoded, me, ndim=ndim, itemsize=itemsize, broadcast=True, **kw)
        assert gp.digest() == old.digest() and gp.pieces == old.pieces and gp.loads == old.loads
        assert _members(gp, gp.ops) == _members(old, old.ops) and gp.bound == old.bound
        assert gp.requested.tolist() == old.requested.tolist() and gp.creates == old.creates == []
        assert all(whole.readers[k] == r for k, r in gp.readers.items())
        mine = {s.members for s in old.sets.values() if me in s.members}
        assert {s.members for s in gp.sets.values()} == mine


def test_wide_checkpoints_send_requested_keys_in_a_union_and_large_sets_fall_back():
    world = 6
    key = (0, (0, 0), (64, 4))
    per_rank = [([(key, True), ((1 + r, (0, 0), (8, 4)), True)], [5000 + r]) for r in range(world)]
    reusable = [[] for _ in range(world)]
    rows, cls, records, recs, (ndim, itemsize), n = _exchange(per_rank, reusable, {}, 6000)
    assert keyowners.summary_width(n) == keyowners.S_BITS  # above MAX_BITMAP_WORDS: no bitmap
    model = sim.KeyOwnerWorld(rows, cls, records, (ndim, itemsize), n)
    decoded = [decode_record(b) for b in records]
    for me in range(world):
        gp = keyowners.plan(sim.SimExchange(rows, cls, records, me, model), decode_record(recs[me]), me, rows, cls,
                            ndim=ndim, itemsize=itemsize, n_names=n, broadcast=True, batch_bytes=0, can_create=True)
        old = global_plan(rows, cls, decoded, me, ndim=ndim, itemsize=itemsize, broadcast=True, batch_bytes=0,
                          can_create=True)
        assert gp.requested.tolist() == old.requested.tolist() and gp.digest() == old.digest()
    old_max = keyowners.MAX_SET_CLASSES
    keyowners.MAX_SET_CLASSES = 2  # a set of 3 classes is then too large to describe
    try:
        per_rank = [([(key, True)], []) for _ in range(3)] + [([((1, (0, 0), (8, 4)), True)], [])]
        per_rank = [(s + [((10 + r, (0, 0), (8, 4)), True)], o) for r, (s, o) in enumerate(per_rank)]
        rows, cls, records, recs, arrays, n = _exchange(per_rank, [[] for _ in range(4)], {}, 20)
        model = sim.KeyOwnerWorld(rows, cls, records, arrays, n)
        assert model.summary[:, keyowners.S_FLAG].tolist() == [1, 1, 1, 0]
        for me in range(4):
            assert keyowners.plan(sim.SimExchange(rows, cls, records, me, model), decode_record(recs[me]), me, rows,
                                  cls, ndim=arrays[0], itemsize=arrays[1], n_names=n, broadcast=True,
                                  batch_bytes=0, can_create=True) is None
    finally:
        keyowners.MAX_SET_CLASSES = old_max


def test_owner_answers_depend_only_on_the_destination_keys():
    """An owner's message to a rank is the same whatever else it received (what the simulated
    exchange relies on when it asks each owner for one rank's answers)."""
    rng = random.Random(7)
    per_rank, reusable, writers, n_keys = _layout(rng, 12)
    rows, cls, records, recs, arrays, n = _exchange(per_rank, reusable, writers, n_keys)
    model = sim.KeyOwnerWorld(rows, cls, records, arrays, n)
    for owner in range(12):
        counts, words = model.incoming_keys(owner)
        full_c, full = keyowners.answer_messages(words, cls, 12, WIDTH)
        rows_in = words.reshape(-1, keyowners.K_KEY + 1 + 2 * WIDTH)
        for dest in np.flatnonzero(full_c).tolist():
            at = int(full_c[:dest].sum())
            mine = rows_in[np.isin(rows_in[:, keyowners.K_KEY], [k[0] for k, _ in per_rank[dest][0]])]
            sub_c, sub = keyowners.answer_messages(mine.ravel(), cls, 12, WIDTH)
            assert np.array_equal(sub[int(sub_c[:dest].sum()):][: sub_c[dest]], full[at: at + full_c[dest]])


# -- a real world: the all-to-alls over gloo ---------------------------------------------------------


def _fsdp_state(mesh, fill: bool) -> dict:
    """FSDP x TP: weights sharded over both dimensions (every rank's record distinct), norms sharded
    over dp and replicated over tp (each shared by the two ranks of a tp group)."""
    def value(fqn, shape, dtype):
        return L.global_value(fqn, shape, dtype) if fill else torch.zeros(shape, dtype=dtype)

    sd = {}
    for i in range(3):
        sd[f"w{i}"] = L.make_dtensor(value(f"w{i}", (512, 96), torch.bfloat16), mesh, [Shard(0), Shard(1)])
        sd[f"norm{i}"] = L.make_dtensor(value(f"norm{i}", (4096,), torch.float32), mesh, [Shard(0), Replicate()])
    sd["big"] = L.make_dtensor(value("big", (8192, 64), torch.float32), mesh, [Shard(0), Replicate()])
    return sd


def fsdp_world(rank: int, world: int, root: str) -> dict:
    from test_scale import _check

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    ckpt = os.path.join(root, "ckpt")
    pipeload.save(_fsdp_state(mesh, True), ckpt)
    out = {}
    if rank == 3:  # one rank's threshold suffices: the smallest in the rows decides for every rank
        os.environ["PIPELOAD_KEY_OWNER_BYTES"] = "0"
    sd = _fsdp_state(mesh, False)
    out["stats"] = pipeload.load(sd, ckpt, broadcast_replicated_tensors=True)
    _check(sd)
    comm = Comm()
    md = read_metadata(ckpt)
    leaves = flatten(_fsdp_state(mesh, False))
    record = plan_record(local_plan(leaves, md, comm.broadcastable), md.width())
    groups = list(comm.reusable_groups(mesh_groups(meshes_of(leaves))))
    kw = dict(directory=ckpt, broadcast=True, batch_bytes=6 << 20, can_create=True)
    names = list(fqn_index(md))
    seen: list = []
    gp = exchange_and_plan(comm, rank, world, md, names, record, [], groups, rows_out=seen, **kw)
    part = {} if rank == 2 else _fsdp_state(mesh, False)  # nothing to load: an empty record in the rounds
    pipeload.load(part, ckpt, broadcast_replicated_tensors=True, reuse_plan=False)
    if part:
        _check(part)
    os.environ.pop("PIPELOAD_KEY_OWNER_BYTES", None)
    old = exchange_and_plan(comm, rank, world, md, names, record, [], groups, **kw)  # every row: the default
    out.update(row=seen[0][rank], record=record, groups=groups, digest=gp.digest(), old_digest=old.digest(),
               ops=[(gp.sets[o.group].members, o.reader, o.shards) for o in gp.ops],
               old_ops=[(old.sets[o.group].members, o.reader, o.shards) for o in old.ops],
               pieces=gp.pieces, old_pieces=old.pieces, loads=gp.loads, old_loads=old.loads)
    return out


def test_real_world_of_4_finds_shared_keys_through_key_owners_as_the_simulation_does(tmp_path):
    res = run_world(fsdp_world, 4, str(tmp_path), timeout=240, separate_hosts=True)
    assert all(r["stats"].broadcasts > 0 for r in res)  # the norms and "big" went by broadcast
    for r in res:  # the real all-to-all path plans what the digest path plans
        assert r["digest"] == r["old_digest"] and r["ops"] == r["old_ops"]
        assert r["pieces"] == r["old_pieces"] and r["loads"] == r["old_loads"]
    assert len({r["digest"] for r in res if r["ops"]}) >= 2  # several components (tp groups)
    md = read_metadata(str(tmp_path / "ckpt"))
    rows = np.stack([r["row"] for r in res])
    cls = classes(rows)
    assert len(cls.owners) == 4 and keyowners.use_key_owners(rows, cls, record_transfer(cls, 4))
    records = [res[int(o)]["record"] for o in cls.owners]
    names = list(fqn_index(md))
    model = sim.KeyOwnerWorld(rows, cls, records, md.key_arrays(names), len(names))
    for rank, r in enumerate(res):
        os.environ["PIPELOAD_HOST_ID"] = f"emulated-node-{rank}"  # the host and threshold of the rank's row
        os.environ["PIPELOAD_KEY_OWNER_BYTES"] = str(int(r["row"][F_KEYOWNER]))
        ex = sim.SimExchange(rows, cls, records, rank, model)
        gp = exchange_and_plan(ex, rank, 4, md, names, r["record"], [], r["groups"], directory="sim",
                               broadcast=True, batch_bytes=6 << 20, can_create=True)
        assert ex.path == "key owners" and ex.received < 4 * sum(map(len, records))
        assert gp.digest() == r["digest"] and [(gp.sets[o.group].members, o.reader, o.shards) for o in gp.ops] == r["ops"]
    os.environ.pop("PIPELOAD_HOST_ID")
    os.environ.pop("PIPELOAD_KEY_OWNER_BYTES")
