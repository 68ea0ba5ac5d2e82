"""Checkpoints written by other tools, loaded by pipeload on one real gloo world of 4 processes.

- torch.distributed.checkpoint: an FSDP2 (``fully_shard``) model + AdamW state saved with ``dcp.save``
  over 4 ranks, loaded into tensor-parallel DTensors on a 2-rank subgroup (another world size) and on
  a 2x2 (dp, tp) mesh; every value must equal what ``dcp.load`` gives for the same layout, bit for bit.
- Hugging Face: files written by ``safetensors.torch.save_file`` (sharded, with an index) and by
  torch's ``HuggingFaceStorageWriter`` (one file + index, and per-rank shards), loaded into TP DTensors.

One world runs every sub-case (spawning costs seconds); failures come back as rank tracebacks.
"""

from __future__ import annotations

import json
import os
import warnings

import pytest
import torch
import torch.distributed as dist
from torch import nn

import pipeload
from pipeload.tools._world import run_world
from pipeload.formats.dcp import writer_of as dcp_writer_of

WORLD_TIMEOUT = 150
DIM, HIDDEN = 24, 40  # odd splits: 40 rows over 4 FSDP ranks, 24 columns over 2 TP ranks


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(DIM, HIDDEN)
        self.fc2 = nn.Linear(HIDDEN, DIM, bias=False)
        self.norm = nn.LayerNorm(DIM)

    def forward(self, x):
        return self.norm(self.fc2(torch.relu(self.fc1(x))))


def _tp(model: nn.Module, mesh):
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    return parallelize_module(model, mesh, {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()})


def _tp_state(mesh):
    """A TP model's full state dict (model + AdamW, state initialised) as a trainer builds it."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    torch.manual_seed(1234)  # differs from the saved values: a missed tensor shows
    model = _tp(MLP(), mesh)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    msd, osd = get_state_dict(model, optim)
    return {"model": msd, "optim": osd}


def _leaves(sd, prefix=""):
    for k, v in sd.items():
        name = f"{prefix}{k}"
        if isinstance(v, dict):
            yield from _leaves(v, name + ".")
        elif isinstance(v, list) and any(isinstance(x, (dict, list, torch.Tensor)) for x in v):
            yield from _leaves(dict(enumerate(v)), name + ".")
        else:
            yield name, v


def _assert_identical(a, b, what):
    la, lb = dict(_leaves(a)), dict(_leaves(b))
    assert la.keys() == lb.keys(), (what, la.keys() ^ lb.keys())
    tensors = 0
    for k, x in la.items():
        y = lb[k]
        if isinstance(x, torch.Tensor):
            x = x.to_local() if hasattr(x, "to_local") else x
            y = y.to_local() if hasattr(y, "to_local") else y
            assert x.dtype == y.dtype and x.shape == y.shape, (what, k)
            assert torch.equal(x.reshape(-1).view(torch.uint8), y.reshape(-1).view(torch.uint8)), (what, k)
            tensors += 1
        else:
            assert x == y, (what, k, x, y)
    assert tensors > 0
    return tensors


def _full_tensors():
    g = torch.Generator().manual_seed(7)
    return {
        "embed.weight": torch.randn(HIDDEN, DIM, generator=g),
        "fc1.weight": torch.randn(HIDDEN, DIM, generator=g),
        "fc1.bias": torch.randn(HIDDEN, generator=g),
        "fc2.weight": torch.randn(DIM, HIDDEN, generator=g).to(torch.bfloat16),
        "norm.weight": torch.randn(DIM, generator=g),
    }


def _hf_dest(mesh, dtype_fc2=torch.bfloat16):
    """TP DTensors for the HF tensors: fc1 column-sharded, fc2 row-sharded, the rest replicated."""
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    full = _full_tensors()
    place = {"fc1.weight": Shard(0), "fc1.bias": Shard(0), "fc2.weight": Shard(1)}
    dest, expect = {}, {}
    for k, t in full.items():
        if k == "fc2.weight":
            t = t.to(dtype_fc2)
        p = [place.get(k, Replicate())] if mesh.ndim == 1 else [Replicate(), place.get(k, Replicate())]
        expect[k] = distribute_tensor(t, mesh, p).to_local()
        dest[k] = distribute_tensor(torch.zeros_like(t), mesh, p)
    return {"model": dest}, expect


def _check_hf(sd, expect, what):
    for k, t in expect.items():
        got = sd["model"][k].to_local()
        assert got.dtype == t.dtype and torch.equal(got, t), (what, k)


def world(rank: int, ws: int, root: str) -> dict:
    warnings.filterwarnings("ignore")
    import torch.distributed.checkpoint as dcp
    from safetensors.torch import save_file
    from torch.distributed.checkpoint import HuggingFaceStorageWriter
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
    from torch.distributed.fsdp import fully_shard

    out: dict = {}
    # -- 1. DCP checkpoint of an FSDP2 model + AdamW, as a trainer writes it --------------------------
    mesh4 = init_device_mesh("cpu", (ws,))
    torch.manual_seed(0)
    model = MLP()
    fully_shard(model, mesh=mesh4)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for _ in range(2):
        torch.manual_seed(rank)
        model(torch.randn(8, DIM)).square().mean().backward()
        optim.step()
        optim.zero_grad()
    msd, osd = get_state_dict(model, optim)
    dcp_dir = os.path.join(root, "dcp")
    dcp.save({"model": msd, "optim": osd, "extra": {"epoch": 3, "tag": "run"}}, checkpoint_id=dcp_dir)

    # -- 2. into TP on a 2-rank subgroup (another world size), equal to dcp.load ---------------------
    pg2 = dist.new_group([0, 1])
    if rank < 2:
        mesh2 = DeviceMesh.from_group(pg2, "cpu")
        ours, ref = _tp_state(mesh2), _tp_state(mesh2)
        ours["extra"], ref["extra"] = {"epoch": 0, "tag": ""}, {"epoch": 0, "tag": ""}
        stats = pipeload.load(ours, dcp_dir, process_group=pg2)
        dcp.load(ref, checkpoint_id=dcp_dir, process_group=pg2)
        out["tp2_tensors"] = _assert_identical(ours, ref, "dcp -> tp2")
        assert ours["extra"] == {"epoch": 3, "tag": "run"}
        out["tp2_format"] = stats.format
    # -- 3. into dp2 x tp2 (replicas across dp: read once, broadcast), equal to dcp.load ------------
    mesh22 = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    ours, ref = _tp_state(mesh22["tp"]), _tp_state(mesh22["tp"])
    stats = pipeload.load(ours, dcp_dir, strict=False)
    dcp.load(ref, checkpoint_id=dcp_dir)
    _assert_identical(ours, ref, "dcp -> dp2 x tp2")
    out["dp_tp"] = (stats.format, stats.bytes_read, stats.bytes_received, stats.unexpected_keys)

    # -- 4. HF: safetensors.save_file, sharded with an index, into TP DTensors ----------------------
    hf_dir = os.path.join(root, "hf")
    full = _full_tensors()
    if rank == 0:
        os.makedirs(hf_dir)
        names = sorted(full)
        shards = {f"model-0000{i + 1}-of-00002.safetensors": names[i::2] for i in range(2)}
        for fname, keys in shards.items():
            save_file({f"model.{k}": full[k] for k in keys}, os.path.join(hf_dir, fname), metadata={"format": "pt"})
        with open(os.path.join(hf_dir, "model.safetensors.index.json"), "w") as f:
            json.dump({"metadata": {}, "weight_map": {f"model.{k}": fn for fn, ks in shards.items() for k in ks}}, f)
    dist.barrier()
    sd, expect = _hf_dest(mesh22["tp"])
    strip = lambda k: k.removeprefix("model.")  # noqa: E731
    stats = pipeload.load(sd, hf_dir, key_map=lambda k: "model." + strip(k))
    _check_hf(sd, expect, "save_file -> tp")
    out["hf"] = (stats.format, stats.bytes_read, stats.bytes_received)
    # bf16 stored, fp32 wanted: refused without cast, converted with it
    sd, expect = _hf_dest(mesh22["tp"], dtype_fc2=torch.float32)
    try:
        pipeload.load(sd, hf_dir, format="hf")
        raise AssertionError("a dtype mismatch loaded")
    except pipeload.PipeloadError as e:
        assert "fc2.weight" in str(e) and "BF16" in str(e), str(e)
    stats = pipeload.load(sd, hf_dir, format="hf", cast=True)
    _check_hf(sd, expect, "cast bf16 -> fp32")

    # -- 5. HF: torch's HuggingFaceStorageWriter (one file + index from rank 0; per-rank shards) ----
    hfw_dir = os.path.join(root, "hf_writer")
    if rank == 0:
        dcp.save({f"model.{k}": v for k, v in full.items()},
                 storage_writer=HuggingFaceStorageWriter(hfw_dir, fqn_to_index_mapping={
                     f"model.{k}": 1 + i % 2 for i, k in enumerate(sorted(full))}), no_dist=True)
    dist.barrier()
    sd, expect = _hf_dest(mesh22["tp"])
    stats = pipeload.load(sd, hfw_dir)
    _check_hf(sd, expect, "HuggingFaceStorageWriter -> tp")
    out["hfw"] = (stats.format, sorted(os.listdir(hfw_dir)))

    # save_distributed=True: each rank writes the chunks it owns, with their offsets in __metadata__
    from torch.distributed.tensor import Shard, distribute_tensor

    hfd_dir = os.path.join(root, "hf_dist")
    src = {f"model.{k}": distribute_tensor(v, mesh4, [Shard(0)]) for k, v in full.items()}
    dcp.save(src, storage_writer=HuggingFaceStorageWriter(hfd_dir, save_distributed=True))
    dist.barrier()
    sd, expect = _hf_dest(mesh22["tp"])
    stats = pipeload.load(sd, hfd_dir)
    _check_hf(sd, expect, "HuggingFaceStorageWriter(save_distributed) -> tp")
    out["hfd"] = sorted(os.listdir(hfd_dir))

    # -- 6. every rank reads its own path (a copy per node), though rank 0 reads the metadata -------
    own = os.path.join(root, f"own{rank}")
    os.makedirs(own)
    save_file({"x": torch.full((3,), float(rank))}, os.path.join(own, "model.safetensors"))
    dist.barrier()
    sd = {"x": torch.zeros(3)}
    pipeload.load(sd, own, broadcast_replicated_tensors=False)  # private reads: no broadcast to hide it
    assert torch.equal(sd["x"], torch.full((3,), float(rank))), (rank, sd["x"])

    # -- 7. DCP saved and loaded in one layout, nodes apart: a replicated item is read by the rank whose
    # file DCP wrote it to (affinity; DCP spread the 24 replicated tensors evenly over its 4 files), so
    # each rank's reads stay inside its own file
    from pipeload.formats import dcp as dcp_layout

    same_dir = os.path.join(root, "dcp_same")
    torch.manual_seed(5)
    saved = {f"w{i}": torch.randn(64 + 8 * i, 32) for i in range(24)}
    dcp.save(saved, checkpoint_id=same_dir)
    files: dict[str, int] = {}
    resolve = dcp_layout.DistcpFile._resolve

    def counting(self, key):  # observe which file each item this rank reads comes from
        hit = resolve(self, key)
        files[os.path.basename(self.path)] = files.get(os.path.basename(self.path), 0) + hit[3] - hit[2]
        return hit

    dcp_layout.DistcpFile._resolve = counting
    try:
        sd = {k: torch.zeros_like(v) for k, v in saved.items()}
        pipeload.load(sd, same_dir)
    finally:
        dcp_layout.DistcpFile._resolve = resolve
    _assert_identical(sd, saved, "dcp -> the same layout")
    out["same_layout_files"] = files
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("formats"))
    return run_world(world, 4, root, timeout=WORLD_TIMEOUT, separate_hosts=True)


def test_dcp_fsdp_to_tp_equals_dcp_load(results):
    assert results[0]["tp2_format"] == "dcp" and results[0]["tp2_tensors"] >= 10
    fmt, _, _, unexpected = results[0]["dp_tp"]
    assert fmt == "dcp" and unexpected == ["extra.epoch", "extra.tag"]  # strict=False reports them


def test_dcp_same_layout_reads_each_ranks_own_file(results):
    assert dcp_writer_of("__3_0.distcp") == 3 and dcp_writer_of("data.distcp") == -1
    for rank, r in enumerate(results):
        files = r["same_layout_files"]
        own = sum(n for f, n in files.items() if f.startswith(f"__{rank}_"))
        assert own >= 0.9 * sum(files.values()), (rank, files)


def test_dcp_replicas_read_once(results):
    # dp2 x tp2: each tp shard has 2 replicas; the pair reads it once and broadcasts
    read = sum(r["dp_tp"][1] for r in results)
    received = sum(r["dp_tp"][2] for r in results)
    assert received > 0 and read > 0


def test_hf_sharded_index_into_tp(results):
    assert all(r["hf"][0] == "hf" for r in results)
    assert sum(r["hf"][2] for r in results) > 0  # dp replicas got their shards by broadcast


def test_hf_storage_writer_outputs(results):
    fmt, files = results[0]["hfw"]
    assert fmt == "hf" and "model.safetensors.index.json" in files
    assert any(f.startswith("shard-") for f in results[0]["hfd"])
