"""Readers by runs of storage: a load whose boxes cut stored chunks reads each file in runs.

One spawned world of 4 gloo ranks, each its own host and its own copy of every checkpoint (separate
nodes: no shared page cache), runs every case. A checkpoint saved at TP 4 (each rank's quarters in its
own file) loaded at TP2 x DP2 gives each DP pair half of every tensor, from two files: the greedy handed
neighbouring halves to the two members of the pair by turns, so both read nearly every page of both
files. With each holder set's shards in storage order cut into one run per member, each member reads
one half of each of the two files. Measured here (device bytes over the unique bytes; byte counts,
stable from run to run), before / after: a pipeload save at TP 4 loaded at TP2 x DP2 1.205 / 1.034,
the same from ``dcp.save``'s files 1.744 / 1.125, a save at TP2 x DP2 loaded whole on every rank
1.101 / 1.021. Values are compared bit for bit and every stored byte is copied out once.
"""

from __future__ import annotations

import math
import os
import shutil

import pytest
import torch
import torch.distributed as dist

import pipeload
from pipeload.tools._world import run_world

import layouts as L

# 16 experts of three 48-64 KiB float32 tensors: small pieces, as in an MoE, cut in halves and quarters
MODEL = {f"e{i:02d}.{kind}.weight": (shape, kind) for i in range(16)
         for kind, shape in (("col", (64, 256)), ("row", (256, 64)), ("qkv", (96, 128)))}
UNIQUE = sum(math.prod(s) * 4 for s, _ in MODEL.values())
AT_MOST = {"tp4-dp2tp2": 1.10, "dcp-tp4-dp2tp2": 1.35, "dp2tp2-tp1": 1.06}  # after: 1.034, 1.125, 1.021


def _state_dict(mesh, fill: bool) -> dict:
    from torch.distributed.tensor import Replicate, Shard

    out = {}
    for name, (shape, kind) in MODEL.items():
        g = L.global_value(name, shape, torch.float32) if fill else torch.zeros(shape)
        out[name] = g if mesh is None else L.make_dtensor(g, mesh, [Replicate(), Shard(1) if kind == "row" else Shard(0)])
    return out


def _check(sd: dict, where: str) -> None:
    for name, (shape, _) in MODEL.items():
        g = L.global_value(name, shape, torch.float32)
        t = sd[name]
        if not hasattr(t, "to_local"):
            assert torch.equal(t, g), f"{where}: {name} differs"
            continue
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

        lengths, offsets = compute_local_shape_and_global_offset(g.shape, t.device_mesh, t.placements)
        assert torch.equal(t.to_local(), L.narrow(g, offsets, lengths)), f"{where}: {name} differs"


def world_runs(rank: int, world: int, root: str) -> dict:
    import torch.distributed.checkpoint as dcp

    from pipeload.tools.bench.system import data_files, drop_cache, proc_io

    meshes = L.Meshes(world)
    tp2, tp4 = meshes.get((2, 2)), meshes.get((1, 4))
    pipeload.save(_state_dict(tp4, True), os.path.join(root, "tp4"))
    pipeload.save(_state_dict(tp2, True), os.path.join(root, "dp2tp2"))
    dcp.save(_state_dict(tp4, True), checkpoint_id=os.path.join(root, "dcp-tp4"))
    dist.barrier()
    for name in ("tp4", "dp2tp2", "dcp-tp4"):  # each rank its own copy: the emulated nodes share no page cache
        shutil.copytree(os.path.join(root, name), os.path.join(root, f"{name}-{rank}"))
    dist.barrier()
    out: dict = {}
    for case, ck, mesh in (("tp4-dp2tp2", "tp4", tp2), ("dcp-tp4-dp2tp2", "dcp-tp4", tp2),
                           ("dp2tp2-tp1", "dp2tp2", None)):
        d = os.path.join(root, f"{ck}-{rank}")
        sd = _state_dict(mesh, False)
        drop_cache(data_files(d))
        dist.barrier()
        before = proc_io()["read_bytes"]
        stats = pipeload.load(sd, d, reuse_plan=False)
        out[case] = (stats.bytes_read, proc_io()["read_bytes"] - before)
        _check(sd, f"{case} on rank {rank}")
    return out


@pytest.mark.timeout(300)
def test_loads_into_another_layout_read_runs_of_each_file(tmp_path):
    results = run_world(world_runs, 4, str(tmp_path), timeout=240, separate_hosts=True)
    ratio = {}
    for case in results[0]:
        assert sum(r[case][0] for r in results) == UNIQUE, case  # every stored byte copied out once
        ratio[case] = round(sum(r[case][1] for r in results) / UNIQUE, 3)
    print(f"device bytes / unique bytes: {ratio}")
    assert all(ratio[case] <= at_most for case, at_most in AT_MOST.items()), ratio
