"""Saves planned through the exchange, on real gloo worlds of 4 and 8 processes.

One world per size runs every sub-case (TP x DP, EP, FSDP-like and balanced layouts; plan reuse; a
changed layout on one rank; refusals before any write; the real exchange beside the simulated one).
Ranks assert what they can see; the parent asserts across ranks from what they return. A rank's
failure comes back as its traceback; the world has a deadline.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
import torch.distributed as dist

import pipeload
from pipeload.tools._world import run_world

import layouts as L

WORLD_TIMEOUT = 240


def _ep(rank: int, world: int, fill: bool = True) -> dict:
    """Expert parallel: expert e lives whole on rank e % world only (ranks hold different keys); the
    router and the norm are replicated everywhere, and so is a trainer's numpy RNG state."""
    sd: dict = {"router": L.global_value("router", (16, 8), torch.float32) if fill else torch.zeros(16, 8),
                "norm": L.global_value("norm", (8,), torch.float32) if fill else torch.zeros(8), "step": 3,
                "np_rng": np.random.RandomState(3).get_state() if fill else None}
    for e in range(2 * world):
        if e % world == rank:
            g = L.global_value(f"experts.{e}.w", (12, 8), torch.bfloat16)
            sd[f"experts.{e}.w"] = g.clone() if fill else torch.zeros_like(g)
    return sd


def _ep_check(sd: dict) -> None:
    if "np_rng" in sd:
        want = np.random.RandomState(3).get_state()
        assert sd["np_rng"][0] == want[0] and sd["np_rng"][1].dtype == np.uint32, f"rank {dist.get_rank()}"
        assert np.array_equal(sd["np_rng"][1], want[1]) and sd["np_rng"][2:] == want[2:], f"rank {dist.get_rank()}"
    for fqn, v in sd.items():
        if isinstance(v, torch.Tensor):
            assert torch.equal(v, L.global_value(fqn, tuple(v.shape), v.dtype)), f"rank {dist.get_rank()}: {fqn}"


def _balanced(world: int, fill: bool = True) -> dict:
    """Replicated everywhere: 48 tensors of 1-64 KiB; the greedy must spread them evenly."""
    rng = np.random.default_rng(7)
    sizes = rng.integers(256, 16384, size=48)
    return {f"b.{i}": (torch.from_numpy(np.arange(n, dtype=np.float32) + i) if fill else torch.zeros(int(n)))
            for i, n in enumerate(sizes.tolist())}


def _payload_files(ckpt: str) -> dict[str, int]:
    """Bytes of tensor data in each data file of ``ckpt`` (headers and objects excluded)."""
    from safetensors import safe_open

    md = pipeload.formats.metadata.read_metadata(ckpt)
    out = {}
    for name in md.files:
        with safe_open(os.path.join(ckpt, name), "pt") as f:
            out[name] = sum(f.get_tensor(k).nbytes for k in f.keys() if not k.endswith("#object"))
    return out


def _exchange_case(meshes) -> dict:
    """The real exchange of a TP x DP state dict: this rank's record and what the collectives gave it."""
    from pipeload.save import saveplan
    from pipeload.engine.comm import Comm
    from pipeload.plan.statedict import flatten

    rec = saveplan.local_record(flatten(L.build("tp2dp2", meshes)))
    xc = saveplan.exchange(Comm(), rec, [], "test")
    p = saveplan.plan(xc, dist.get_rank())
    return {"names": rec.names, "record": rec.record, "objects_word": rec.objects_word,
            "rows": xc.rows, "tables": xc.tables, "records": xc.records,
            "mine": sorted(int(g) for g in np.flatnonzero(p.writer == dist.get_rank()))}


def _owners_case(rank: int, meshes, c) -> dict:
    """Tensor owners on the real collectives (threshold 0): per layout, this rank's writes through the
    owners (None: every rank fell back to the digest path) and through the digest path; each saved
    through the owners loads back."""
    from pipeload.engine.comm import Comm
    from pipeload.plan.statedict import flatten
    from pipeload.save import savecache, saveowners, saveplan

    def mine(p, rec, rows):
        return [s[0] for s in savecache.Entry.of(p, rec, rank, rows).specs] if p is not None else None

    out = {}
    os.environ["PIPELOAD_KEY_OWNER_BYTES"] = "0"
    try:
        for kind in ("shard0", "tp2dp2"):
            rec = saveplan.local_record(flatten(L.build(kind, meshes)))
            xc = saveplan.exchange(Comm(), rec, [], "test", records=False)
            keys = saveplan.key_table(xc)
            assert saveowners.use_key_owners(xc, *keys)
            got = saveowners.plan(Comm(), xc, keys, rec, rank, "test")
            saveplan.exchange_records(Comm(), xc, rec, "test")
            out[kind] = (mine(got, rec, xc.rows), mine(saveplan.plan(xc, rank), rec, xc.rows))
            pipeload.save(L.build(kind, meshes), c(f"owners-{kind}"))
            sd = L.build(kind, meshes, fill=False)
            pipeload.load(sd, c(f"owners-{kind}"), reuse_plan=False)
            L.check_values(sd)
    finally:
        del os.environ["PIPELOAD_KEY_OWNER_BYTES"]
    return out


def world_save(rank: int, world: int, root: str) -> dict:
    meshes = L.Meshes(world)
    out: dict = {}
    c = lambda name: os.path.join(root, name)  # noqa: E731
    # TP x DP, FSDP-like (Shard(0)) and plain DP: each loads back into itself and into the others
    for kind in ("tp2dp2", "shard0", "plain", "shard1"):
        out[f"save_{kind}"] = pipeload.save(L.build(kind, meshes), c(kind))
    for src, dst in (("tp2dp2", "tp2dp2"), ("tp2dp2", "shard1"), ("shard0", "shard0"), ("shard0", "tp2dp2"),
                     ("plain", "shard0"), ("shard1", "plain")):
        sd = L.build(dst, meshes, fill=False)
        pipeload.load(sd, c(src), reuse_plan=False)
        L.check_values(sd)
    out["tp2dp2_files"] = _payload_files(c("tp2dp2")) if rank == 0 else None
    out["shard0_files"] = _payload_files(c("shard0")) if rank == 0 else None
    # expert parallel: into itself, and into plain tensors on every rank
    pipeload.save(_ep(rank, world), c("ep"))
    sd = _ep(rank, world, fill=False)
    pipeload.load(sd, c("ep"), reuse_plan=False)
    _ep_check(sd)
    every = {f"experts.{e}.w": torch.zeros(12, 8, dtype=torch.bfloat16) for e in range(2 * world)}
    pipeload.load(every, c("ep"), reuse_plan=False, strict=False)
    _ep_check(every)
    # balance: replicated tensors spread within 10 % of the mean
    pipeload.save(_balanced(world), c("balanced"))
    out["balanced_files"] = _payload_files(c("balanced")) if rank == 0 else None
    sd = _balanced(world, fill=False)
    pipeload.load(sd, c("balanced"), reuse_plan=False)
    assert all(torch.equal(v, w) for v, w in zip(sd.values(), _balanced(world).values()))
    # plan reuse: the same layout again reuses; a changed layout on one rank makes every rank replan
    sd = L.build("tp2dp2", meshes)
    pipeload.clear_plan_cache()  # the tp2dp2 save above kept its plan (beside the other layouts')
    out["first"] = pipeload.save(sd, c("reuse"))
    out["second"] = pipeload.save(sd, c("reuse"))
    if rank == 3:
        sd["extra3"] = {"only3": torch.arange(5.0)}
    out["changed"] = pipeload.save(sd, c("reuse"))
    out["after_change"] = pipeload.save(sd, c("reuse"))
    got = L.build("tp2dp2", meshes, fill=False)
    pipeload.load(got, c("reuse"), reuse_plan=False, strict=False)
    L.check_values(got)
    # refused before any write, on every rank, naming the key
    bad = L.build("plain", meshes)
    if rank == 1:
        bad["model"]["ids"] = bad["model"]["ids"].to(torch.int32)
    out["dtype_error"] = L.expect_error(lambda: pipeload.save(bad, c("bad-dtype")), "model.ids", "rank 1 has dtype I32")
    hostile = L.build("plain", meshes)
    if rank == world - 1:
        hostile["extra"]["epoch"] = lambda: 0
    out["hostile_error"] = L.expect_error(lambda: pipeload.save(hostile, c("bad-object")), "extra.epoch")
    for d in ("bad-dtype", "bad-object"):
        assert not os.path.exists(c(d)) or not os.listdir(c(d)), f"rank {rank}: {d} has files"
    dist.barrier()
    out["exchange"] = _exchange_case(meshes)
    out["owners"] = _owners_case(rank, meshes, c)
    return out


@pytest.fixture(scope="module", params=[4, 8])
def world(request, tmp_path_factory):
    root = str(tmp_path_factory.mktemp(f"save{request.param}"))
    return request.param, run_world(world_save, request.param, root, timeout=WORLD_TIMEOUT)


def test_every_chunk_stored_once(world):
    _, res = world
    assert sum(res[0]["tp2dp2_files"].values()) == L.unique_bytes()
    assert sum(res[0]["shard0_files"].values()) == L.unique_bytes()


def test_writers_within_ten_percent_of_the_mean(world):
    n, res = world
    sizes = list(res[0]["balanced_files"].values())
    assert len(sizes) == n
    assert max(sizes) <= 1.1 * (sum(sizes) / n)


def test_plan_reused_until_a_rank_changes(world):
    _, res = world
    assert not any(r["first"].plan_reused for r in res)
    assert all(r["second"].plan_reused for r in res)
    assert not any(r["changed"].plan_reused for r in res)  # one rank's new key: every rank replans
    assert all(r["after_change"].plan_reused for r in res)
    assert sum(r["first"].items_written for r in res) == sum(r["second"].items_written for r in res)


def test_refusals_name_rank_and_key_on_every_rank(world):
    n, res = world
    assert all("rank 1 has dtype I32" in r["dtype_error"] for r in res)
    assert all(f"rank {n - 1}" in r["hostile_error"] and "extra.epoch" in r["hostile_error"] for r in res)


def test_real_exchange_equals_the_simulated_one(world):
    from pipeload.save import saveplan
    from pipeload.tools.simsave import SimSaveExchange

    n, res = world
    recs = []
    for r in res:
        rec = saveplan.LocalRecord([], [], {}, [], names=r["exchange"]["names"], record=r["exchange"]["record"],
                                   objects_word=r["exchange"]["objects_word"])
        recs.append(rec)
    rows = np.stack([saveplan.make_row(rec, False) for rec in recs])
    ncls = saveplan._classes_of(rows, saveplan.R_NAMES, saveplan.R_NNBYTES)
    rcls = saveplan._classes_of(rows, saveplan.R_RECORD, saveplan.R_RNBYTES)
    tables = [recs[int(o)].names for o in ncls.owners]
    records = [recs[int(o)].record for o in rcls.owners]
    for rank, (rec, r) in enumerate(zip(recs, res)):
        ex = r["exchange"]
        assert np.array_equal(ex["rows"], rows)
        sim = SimSaveExchange(rows, tables, records, rank)
        got = saveplan.exchange(sim, rec, [], "test")
        assert got.tables == ex["tables"] and got.records == ex["records"]
        assert sorted(np.flatnonzero(saveplan.plan(got, rank).writer == rank).tolist()) == ex["mine"]


def test_tensor_owners_plan_what_the_digest_path_plans(world):
    _, res = world
    for r in res:
        owners, digest = r["owners"]["shard0"]  # FSDP-like: every rank in one holder set at most
        assert owners is not None and owners == digest
        # replicas with their own chunks and a norm every class holds: two holder sets, the shared rows
        owners, digest = r["owners"]["tp2dp2"]
        assert owners is not None and owners == digest
    assert sum(len(r["owners"]["shard0"][0]) for r in res) > 0
