"""Chunk units in a real world: 4 gloo ranks on emulated separate nodes load whole-tensor checkpoints
into tensor parallelism, each stored byte read once (pipeload.plan.chunkunits).

One spawned world runs every case: a Hugging Face two-file checkpoint of whole tensors (``Shard(0)``,
``Shard(1)`` and replicated placements) loaded at TP2 x DP2 from files (each rank its own copy, its
page cache dropped: device bytes from ``/proc/self/io``) and from ``s3://`` (a moto server: bytes and
GETs from ``LoadStats``); a pipeload checkpoint saved at TP 1 (DP 4) loaded at TP2 x DP2 and TP4 x DP1.
Values are compared bit for bit; byte counts are deterministic, timings live in ``pipeload bench``.
"""

from __future__ import annotations

import contextlib
import math
import os
import shutil

import pytest
import torch
import torch.distributed as dist

import pipeload
from pipeload.tools._world import run_world

import layouts as L

# (shape, placement on the tp dimension): rows of 1-4 KiB, so a Shard(1) half-row shares pages with its neighbour
MODEL = {
    "a.col.weight": ((512, 1024), "col"),  # Shard(0)
    "a.row.weight": ((1024, 384), "row"),  # Shard(1)
    "a.norm.weight": ((1024,), "rep"),
    "b.col.weight": ((768, 512), "col"),
    "b.row.weight": ((512, 1024), "row"),
    "b.emb.weight": ((256, 512), "rep"),
}
UNIQUE = sum(math.prod(s) * 4 for s, _ in MODEL.values())
PART = 1 << 20


def _placements(role: str, nd: int):
    from torch.distributed.tensor import Replicate, Shard

    return [Replicate(), {"col": Shard(0), "row": Shard(1 if nd > 1 else 0)}.get(role, Replicate())]


def _state_dict(mesh, fill: bool) -> dict:
    out = {}
    for name, (shape, role) in MODEL.items():
        g = L.global_value(name, shape, torch.float32) if fill else torch.zeros(shape)
        out[name] = L.make_dtensor(g, mesh, _placements(role, len(shape)))
    return out


def _check(sd: dict, where: str) -> None:
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    for name, (shape, _) in MODEL.items():
        g = L.global_value(name, shape, torch.float32)
        t = sd[name]
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


def world_units(rank: int, world: int, root: str, port: int | None, links: list[str]) -> dict:
    meshes = L.Meshes(world)
    tp2, tp4 = meshes.get((2, 2)), meshes.get((1, 4))
    if rank == 0:
        from safetensors.torch import save_file

        full = {k: L.global_value(k, s, torch.float32) for k, (s, _) in MODEL.items()}
        os.makedirs(os.path.join(root, "hf"))
        save_file({k: v for k, v in full.items() if k.startswith("a.")}, os.path.join(root, "hf", "model-1.safetensors"))
        save_file({k: v for k, v in full.items() if k.startswith("b.")}, os.path.join(root, "hf", "model-2.safetensors"))
    # saved at TP 1: every tensor whole, replicated over the 4 ranks (DP 4)
    pipeload.save({k: L.global_value(k, s, torch.float32) for k, (s, _) in MODEL.items()}, os.path.join(root, "tp1"))
    if rank == 0:
        for r in range(world):  # each rank its own copy: the emulated nodes share no page cache
            for name in ("hf", "tp1"):
                shutil.copytree(os.path.join(root, name), os.path.join(root, f"{name}-{r}"))
        if port is not None:
            from pipeload.tools.s3testing import LocalS3

            LocalS3(port).upload(os.path.join(root, "hf"), "units", "hf")
    dist.barrier()
    out: dict = {}

    def load(name: str, mesh, where: str, **kw):
        sd = _state_dict(mesh, False)
        stats = pipeload.load(sd, where, **kw)
        _check(sd, f"{name} on rank {rank}")
        return stats

    for name, mesh, ck in (("hf", tp2, "hf"), ("tp1-tp2", tp2, "tp1"), ("tp1-tp4", tp4, "tp1")):
        d = os.path.join(root, f"{ck}-{rank}")
        out[name] = _device_bytes(d, lambda: load(name, mesh, d))
    if port is not None:
        from pipeload.tools.s3testing import LocalS3

        out["s3"] = load("s3", tp2, "s3://units/hf",
                         storage_options=LocalS3.options(links[rank], part_size=PART, header_get=4096))
    return out


@pytest.mark.timeout(240)
def test_whole_tensor_checkpoints_load_into_tp_reading_each_byte_once(tmp_path):
    with contextlib.ExitStack() as stack:
        port, links, proxy = None, [], None
        try:
            from pipeload.tools.s3testing import FaultProxy, Faults, LocalS3

            server = stack.enter_context(LocalS3())
            server.bucket("units")
            proxy = stack.enter_context(FaultProxy(server.port, links=4, faults=Faults(rules=[])))
            port, links = server.port, [proxy.url(i) for i in range(4)]
        except ImportError:  # no moto: the file cases still run
            pass
        results = run_world(world_units, 4, str(tmp_path), port, links, timeout=200, separate_hosts=True)
        gets = proxy.requests("GET") if proxy is not None else []
    for case in ("hf", "tp1-tp2", "tp1-tp4"):
        stats = [r[case][0] for r in results]
        device = sum(r[case][1] for r in results)
        assert all(s.chunk_units == 2 for s in stats), case  # the two Shard(1) tensors
        assert sum(s.bytes_read for s in stats) == UNIQUE, case  # every stored byte copied out once
        assert sum(s.chunk_bytes_saved for s in stats) > 0, case
        print(f"{case}: device bytes {device / UNIQUE:.3f}x the unique bytes, chunk bytes saved "
              f"{sum(s.chunk_bytes_saved for s in stats)}")
        assert device <= 1.05 * UNIQUE, (case, device, UNIQUE)  # each stored page read once, on some node
    if proxy is not None:
        fetched = sum(r["s3"].bytes_fetched for r in results)
        objects = len(os.listdir(tmp_path / "hf"))
        files = sum(os.path.getsize(os.path.join(tmp_path, "hf", n)) for n in os.listdir(tmp_path / "hf"))
        data = [g for g in gets if g.path.startswith("/units/hf/") and not (g.range or "").startswith("bytes=0-")]
        heads = [g for g in gets if g.path.startswith("/units/hf/") and (g.range or "").startswith("bytes=0-")]
        moved = sum(int(b) - int(a) + 1 for a, b in (g.range.split("=")[1].split("-") for g in data))
        bound = math.ceil(fetched / PART) + 2 * objects
        print(f"s3: fetched {fetched / files:.4f}x the objects, {len(gets)} GETs ({len(data)} data, "
              f"{len(heads)} header, {len(gets) - len(data) - len(heads)} LIST; ceil(bytes / part) = "
              f"{math.ceil(moved / PART)}, bound {bound})")
        assert fetched <= 1.02 * files, (fetched, files)
        # each rank's ranges in parts of part_size: no GET per tensor segment
        assert len(data) <= math.ceil(moved / PART) + 2 * 2, [g.range for g in data]
        # headers are read once, by rank 0 building the table: the other ranks open the objects from it
        assert len(heads) <= objects and {g.link for g in heads} == {0}, [(g.link, g.path) for g in heads]
        # issue #32: every GET of the load (LIST, headers, data) within ceil(bytes fetched / part) + 2 per object
        assert len(gets) <= bound, [(g.link, g.path, g.range) for g in gets]
