"""Loads into another layout than the save's read each stored byte about once from the device.

One spawned world of 4 gloo ranks, each its own host and its own copy of every checkpoint (separate
nodes: no shared page cache), runs every case, for two models:

- ``large`` (512 KiB float32 tensors): a pipeload checkpoint saved at TP 1 (every tensor whole on every
  rank, DP 4) loaded at TP2 x DP2 and at TP4, one saved at TP4 loaded at TP2 x DP2, and the checkpoint
  ``dcp.save`` wrote at TP 1 loaded at TP2 x DP2 with ``pipeload.load``. Each rank's share of every
  file is then scattered (pieces of 128-256 KiB interleaved with the other ranks'): requests merged
  across other ranks' pieces, or kernel readahead, made every node read them too (1.27-3.2x the unique
  bytes before the reader requested scattered files exactly).
- ``small`` (48-64 KiB tensors, as an MoE's experts): readers by runs of storage. A checkpoint saved at
  TP 4 loaded at TP2 x DP2 gives each DP pair half of every tensor, from two files; the greedy handed
  neighbouring halves to the pair's members by turns, so both read nearly every page of both files.
  With each holder set's shards in storage order cut into one run per member, each member reads one
  half of each file. Before / after: pipeload's save at TP 4 1.205 / 1.034, ``dcp.save``'s 1.744 /
  1.125, a save at TP2 x DP2 loaded whole on every rank 1.101 / 1.021. FSDP2 over TP (the 2-D mesh, dp
  splitting each TP shard's rows) saved and loaded across TP2 x DP2 and TP 4: bit-exact, and the bytes
  bounded as measured (a load into FSDP2 cuts every stored chunk into parts read on different nodes).

Device bytes come from ``/proc/self/io`` after the rank's copy was dropped from the page cache (byte
counts, stable from run to run); what is left over the unique bytes is pages two pieces share. Values
are compared bit for bit, and every stored byte is copied out once.
"""

from __future__ import annotations

import math
import os
import shutil
import time

import pytest
import torch
import torch.distributed as dist

import pipeload
from pipeload.tools._world import run_world

import layouts as L

# (shape, placement on the tp dimension) of each tensor
MODELS = {
    "large": {f"l{i}.{kind}.weight": (shape, kind) for i in range(8)
              for kind, shape in (("col", (128, 1024)), ("row", (1024, 128)), ("qkv", (256, 512)))},
    "small": {f"e{i:02d}.{kind}.weight": (shape, kind) for i in range(16)
              for kind, shape in (("col", (64, 256)), ("row", (256, 64)), ("qkv", (96, 128)))},
}
UNIQUE = {m: sum(math.prod(s) * 4 for s, _ in model.values()) for m, model in MODELS.items()}
# (model, saved as, loaded as) -> the most device bytes / unique bytes allowed
AT_MOST = {
    ("large", "tp1", "dp2tp2"): 1.10, ("large", "tp1", "tp4"): 1.10,  # measured 1.017-1.034
    ("large", "tp4", "dp2tp2"): 1.10, ("large", "dcp-tp1", "dp2tp2"): 1.10,
    ("small", "tp4", "dp2tp2"): 1.10, ("small", "dcp-tp4", "dp2tp2"): 1.35,  # after runs: 1.034, 1.125
    # DCP blobs cut between nodes: each blob's head read once, by its locator, which tells the other
    # readers (and those of the blobs next to it) where the tensor starts; the pages where two blobs
    # meet are then owned and delivered like any other (1.088 and 1.203 when every reader read the heads)
    ("small", "dcp-tp1", "dp2tp2"): 1.05, ("small", "dcp-tp1", "tp4"): 1.05,
    ("small", "dp2tp2", "tp1"): 1.06,  # 1.021
    # FSDP2 over TP (fsdp2tp2: dp splits each TP shard's rows) saved and loaded across DP x TP. Into FSDP2
    # each rank's box is a part of a stored chunk no other rank holds, read privately, and the page where
    # two ranks' parts meet was read by both nodes (1.283, 1.207 with part_delivery="off": the small
    # model's 12-16 KiB parts, a shared page each); its owner now delivers the other part: 1.016, 1.028
    ("small", "fsdp2tp2", "dp2tp2"): 1.06, ("small", "dp2tp2", "fsdp2tp2"): 1.06, ("small", "tp4", "fsdp2tp2"): 1.06,
}


# loaded once more with part_delivery="off": the page owners' deliveries must have lowered its device bytes
PART_CASE = ("small", "dp2tp2", "fsdp2tp2")
# loaded twice more with its plan kept: the reused plan carries the blobs' positions the locators sent
REUSE_CASE = ("small", "dcp-tp1", "tp4")


def _state_dict(model: str, mesh, fill: bool, fsdp: bool = False, dtype=torch.float32) -> dict:
    """The model on ``mesh`` (None: whole tensors), ``Replicate`` on dp, or with ``fsdp`` FSDP2 over TP:
    dp splits the TP shard's rows (``_StridedShard(0, 2)`` over ``Shard(0)``, ``Shard(0)`` over ``Shard(1)``)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    out = {}
    for name, (shape, kind) in MODELS[model].items():
        g = L.global_value(name, shape, torch.float32) if fill else torch.zeros(shape, dtype=dtype)
        if mesh is None:  # TP 1: the whole tensor on every rank
            out[name] = g
            continue
        tp = Shard(1) if kind == "row" else Shard(0)
        dp = (Shard(0) if kind == "row" else _StridedShard(0, split_factor=2)) if fsdp else Replicate()
        out[name] = L.make_dtensor(g, mesh, [dp, tp])
    return out


def _check(model: str, sd: dict, where: str) -> None:
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    for name, (shape, _) in MODELS[model].items():
        g = L.global_value(name, shape, torch.float32).to(sd[name].dtype)  # (a cast load: as copy_ converts)
        t = sd[name]
        if not hasattr(t, "to_local"):
            assert torch.equal(t, g), f"{where}: {name} differs"
            continue
        lengths, offsets = compute_local_shape_and_global_offset(g.shape, t.device_mesh, t.placements)
        assert torch.equal(t.to_local(), L.narrow(g, offsets, lengths)), f"{where}: {name} differs"


def _device_bytes(directory: str, fn) -> tuple[object, int]:
    """(fn(), bytes this process read from the device meanwhile), its copy's page cache dropped first."""
    from pipeload.tools.bench.system import data_files, drop_cache, proc_io

    drop_cache(data_files(directory))
    dist.barrier()
    before = proc_io()["read_bytes"]
    out = fn()
    return out, proc_io()["read_bytes"] - before


def world_layouts(rank: int, world: int, root: str) -> dict:
    import torch.distributed.checkpoint as dcp

    meshes = L.Meshes(world)
    mesh = {"tp1": None, "dp2tp2": meshes.get((2, 2)), "tp4": meshes.get((1, 4)), "fsdp2tp2": meshes.get((2, 2))}
    saved = sorted({(m, s) for m, s, _ in AT_MOST})
    for model, layout in saved:
        d = os.path.join(root, f"{model}-{layout}")
        if layout.startswith("dcp-"):
            dcp.save(_state_dict(model, mesh[layout[4:]], True), checkpoint_id=d)
        else:
            pipeload.save(_state_dict(model, mesh[layout], True, layout.startswith("fsdp")), d)
    dist.barrier()
    for model, layout in saved:  # each rank its own copy: the emulated nodes share no page cache
        shutil.copytree(os.path.join(root, f"{model}-{layout}"), os.path.join(root, f"{model}-{layout}-{rank}"))
    dist.barrier()
    out: dict = {}
    for model, layout, into in AT_MOST:
        d = os.path.join(root, f"{model}-{layout}-{rank}")
        sd = _state_dict(model, mesh[into], False, into.startswith("fsdp"))
        stats, read = _device_bytes(d, lambda: pipeload.load(sd, d, reuse_plan=False))
        _check(model, sd, f"{model} {layout} -> {into} on rank {rank}")
        out[model, layout, into] = (stats.bytes_read, read)
        out["delivered", model, layout, into] = (stats.pages_delivered, stats.part_bytes_sent,
                                                 stats.part_bytes_received)
    model, layout, into = PART_CASE  # the same load without part delivery: each node reads its cut pages
    d = os.path.join(root, f"{model}-{layout}-{rank}")
    sd = _state_dict(model, mesh[into], False, True)
    stats, read = _device_bytes(d, lambda: pipeload.load(sd, d, reuse_plan=False, part_delivery="off"))
    _check(model, sd, f"{model} {layout} -> {into} (part_delivery='off') on rank {rank}")
    out["off"] = (stats.bytes_read, read, stats.pages_delivered)
    out["failed"] = _owner_fails(rank, d, sd)
    out["unplanned"] = _planning_fails(rank, root, mesh)
    out["fallbacks"] = _fallbacks(rank, d, mesh[into])
    model, layout, into = REUSE_CASE
    d = os.path.join(root, f"{model}-{layout}-{rank}")
    sd = _state_dict(model, mesh[into], False)
    for i in range(2):
        stats, read = _device_bytes(d, lambda: pipeload.load(sd, d))
        _check(model, sd, f"{model} {layout} -> {into} (plan kept, load {i}) on rank {rank}")
    out["reused"] = (stats.bytes_read, read, stats.plan_reused)
    return out


def _fallbacks(rank: int, d: str, mesh) -> list[int]:
    """PART_CASE where a receiver's patched reads fall back to reading their items whole: checksums
    verified (the parts still delivered: every owner sends what its receivers planned to get), and
    float64 destinations (``cast=True``: no part delivery, the stored bytes are converted while copied).
    Both exact. Returns each load's deliveries."""
    model, layout, into = PART_CASE
    out = []
    for kw, dtype in (({"verify_checksums": True}, torch.float32), ({"cast": True}, torch.float64)):
        sd = _state_dict(model, mesh, False, True, dtype)
        stats = pipeload.load(sd, d, reuse_plan=False, **kw)
        _check(model, sd, f"{model} {layout} -> {into} ({kw}) on rank {rank}")
        out.append(stats.pages_delivered)
    return out


def _owner_fails(rank: int, d: str, sd: dict) -> str:
    """PART_CASE again, rank 1's reads of the pages it owns failing: it still sends (every receiver's
    message completes), and the agreement fails the load on every rank, naming the cause; no hang."""
    import pipeload.engine.delivery as delivery
    from pipeload.errors import PipeloadError, ReadError

    copy = delivery.copy_box
    if rank == 1:
        def broken(*args, **kwargs):
            raise ReadError("injected: an owner's page read failed")
        delivery.copy_box = broken
    try:
        pipeload.load(sd, d, reuse_plan=False)
        return ""
    except PipeloadError as e:
        return str(e)
    finally:
        delivery.copy_box = copy


def _planning_fails(rank: int, root: str, mesh) -> list:
    """Rank 1's planning of part delivery raises — before the DCP position messages (``with_heads``),
    and after them (``partdelivery.plan``, a safetensors layout change). Every rank drops part delivery for
    that load (no peer waits for rank 1's messages) and loads exactly; rank 1 warns, naming itself."""
    import warnings

    import pipeload.engine.delivery as delivery

    out = []
    owner = delivery.partdelivery
    for (model, layout, into), name in ((REUSE_CASE, "with_heads"), (PART_CASE, "plan")):
        d = os.path.join(root, f"{model}-{layout}-{rank}")
        sd = _state_dict(model, mesh[into], False, into.startswith("fsdp"))
        step = getattr(owner, name)
        if rank == 1:
            def broken(*args, **kwargs):
                raise ValueError("injected: a header that does not parse")
            setattr(owner, name, broken)
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                t0 = time.monotonic()
                stats = pipeload.load(sd, d, reuse_plan=False)
        finally:
            setattr(owner, name, step)
        _check(model, sd, f"{model} {layout} -> {into} (planning failed on rank 1) on rank {rank}")
        out.append((stats.pages_delivered, round(time.monotonic() - t0, 2),
                    [str(w.message) for w in caught if "part delivery not planned" in str(w.message)]))
    return out


@pytest.mark.timeout(300)
def test_layout_changes_read_each_stored_byte_about_once_from_the_device(tmp_path):
    results = run_world(world_layouts, 4, str(tmp_path), timeout=240, separate_hosts=True)
    ratio = {}
    for case in AT_MOST:
        assert sum(r[case][0] for r in results) == UNIQUE[case[0]], case  # every stored byte copied out once
        ratio[case] = round(sum(r[case][1] for r in results) / UNIQUE[case[0]], 3)
    print(f"device bytes / unique bytes: {ratio}")
    assert all(ratio[case] <= at_most for case, at_most in AT_MOST.items()), ratio
    # part delivery: the cut pages of PART_CASE were read once, by their owners, and delivered
    delivered = [r["delivered", *PART_CASE] for r in results]
    assert sum(d[0] for d in delivered) > 0 and sum(d[1] for d in delivered) == sum(d[2] for d in delivered) > 0
    off = round(sum(r["off"][1] for r in results) / UNIQUE[PART_CASE[0]], 3)
    assert sum(r["off"][0] for r in results) == UNIQUE[PART_CASE[0]] and all(r["off"][2] == 0 for r in results)
    print(f"{PART_CASE}: part delivery off {off}, on {ratio[PART_CASE]}, delivered {delivered}")
    assert ratio[PART_CASE] < off - 0.1, (ratio[PART_CASE], off)
    assert all("injected: an owner's page read failed" in r["failed"] for r in results), [r["failed"] for r in results]
    unplanned = [r["unplanned"] for r in results]  # (per rank: per case (pages delivered, seconds, warnings))
    assert all(case[0] == 0 and case[1] < 30 for r in unplanned for case in r), unplanned
    assert all(len(case[2]) == (r == 1) for r, cases in enumerate(unplanned) for case in cases), unplanned
    assert all("rank 1" in case[2][0] and "injected" in case[2][0] for case in unplanned[1]), unplanned
    assert all(r["fallbacks"][0] > 0 == r["fallbacks"][1] for r in results), [r["fallbacks"] for r in results]
    reused = round(sum(r["reused"][1] for r in results) / UNIQUE[REUSE_CASE[0]], 3)
    print(f"{REUSE_CASE} with its plan reused: {reused}")
    assert all(r["reused"][2] for r in results) and sum(r["reused"][0] for r in results) == UNIQUE[REUSE_CASE[0]]
    assert reused <= AT_MOST[REUSE_CASE], reused
