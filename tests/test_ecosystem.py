"""pipeload with the ecosystem's own tools, on one real gloo world of 4 processes.

- ``dcp.load(..., storage_reader=pipeload.dcp.StorageReader(path))`` equals a plain ``dcp.load`` bit for
  bit, and each stored box several ranks read (replicated tensors, the ``step`` object) is read from
  storage by one rank only.
- A tiny ``transformers`` Llama (built from a config here: nothing is downloaded) saved with
  ``save_pretrained`` (safetensors, sharded with its index) loads into a tensor-parallel
  (``parallelize_module``) and an FSDP2 (``fully_shard``) copy, equal bit for bit to ``from_pretrained``.

One world runs every sub-case; failures come back as rank tracebacks.
"""

from __future__ import annotations

import os
import warnings

import pytest
import torch
import torch.distributed as dist

import pipeload
from pipeload.tools._world import run_world

WORLD_TIMEOUT = 200


def _zeros(sd):
    from torch.distributed.tensor import DTensor

    out = {}
    for k, v in sd.items():
        if isinstance(v, dict):
            out[k] = _zeros(v)
        elif isinstance(v, DTensor):
            out[k] = DTensor.from_local(torch.zeros_like(v.to_local()), v.device_mesh, v.placements,
                                        shape=v.shape, stride=v.stride())
        elif isinstance(v, torch.Tensor):
            out[k] = torch.zeros_like(v)
        else:
            out[k] = None
    return out


def _same(a, b, what: str) -> int:
    from torch.distributed.tensor import DTensor

    n = 0
    assert a.keys() == b.keys(), what
    for k in a:
        x, y = a[k], b[k]
        if isinstance(x, dict):
            n += _same(x, y, what)
        elif isinstance(x, torch.Tensor):
            x = x.to_local() if isinstance(x, DTensor) else x
            y = y.to_local() if isinstance(y, DTensor) else y
            assert x.dtype == y.dtype and torch.equal(x, y), f"{what}: {k}"
            n += 1
        else:
            assert x == y, f"{what}: {k}"
    return n


def _storage_reader_case(rank: int, root: str, out: dict) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from pipeload.dcp import StorageReader

    mesh = init_device_mesh("cpu", (4,))
    torch.manual_seed(7)
    path = os.path.join(root, "dcp")
    saved = {"m": {"rep_w": torch.randn(16, 8), "rep_b": torch.randn(8).to(torch.bfloat16),
                   "shard": distribute_tensor(torch.randn(12, 6), mesh, [Shard(0)])}, "step": 5}
    dcp.save(saved, checkpoint_id=path)
    ref, ours = _zeros(saved), _zeros(saved)
    dcp.load(ref, checkpoint_id=path)
    reader = StorageReader(path)
    dcp.load(ours, storage_reader=reader)
    out["reader_tensors"] = _same(ours, ref, "StorageReader vs dcp.load")
    assert ours["step"] == ref["step"] == 5 and _same(ours, saved, "StorageReader vs saved")
    out["reader_read"] = [k[:2] for k in reader.stats.items_read]
    out["reader_received"] = reader.stats.items_received


def _llama(seed: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=96, max_position_embeddings=64, tie_word_embeddings=False)
    torch.manual_seed(seed)
    return LlamaForCausalLM(cfg)


def _transformers_case(rank: int, root: str, out: dict) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
    from transformers import LlamaForCausalLM

    path = os.path.join(root, "llama")
    if rank == 0:
        _llama(11).save_pretrained(path, max_shard_size="40KB", safe_serialization=True)
    dist.barrier()
    out["hf_files"] = sorted(os.listdir(path))
    expect = {k: v.detach().clone() for k, v in LlamaForCausalLM.from_pretrained(path).state_dict().items()}

    mesh = init_device_mesh("cpu", (4,))
    tp = _llama(12)
    plan = {}
    for i in range(len(tp.model.layers)):
        p = f"model.layers.{i}."
        plan.update({p + "self_attn.q_proj": ColwiseParallel(), p + "self_attn.k_proj": ColwiseParallel(),
                     p + "self_attn.v_proj": ColwiseParallel(), p + "self_attn.o_proj": RowwiseParallel(),
                     p + "mlp.gate_proj": ColwiseParallel(), p + "mlp.up_proj": ColwiseParallel(),
                     p + "mlp.down_proj": RowwiseParallel()})
    plan["lm_head"] = ColwiseParallel()
    parallelize_module(tp, mesh, plan)
    fsdp = _llama(13)
    for layer in fsdp.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(fsdp, mesh=mesh)
    for name, model in (("tp", tp), ("fsdp", fsdp)):
        sd = model.state_dict()
        stats = pipeload.load(sd, path, reuse_plan=False)
        assert stats.format == "hf", stats.format
        n = 0
        for k, v in model.state_dict().items():
            full = v.full_tensor() if isinstance(v, DTensor) else v
            assert full.dtype == expect[k].dtype and torch.equal(full, expect[k]), f"{name}: {k}"
            n += isinstance(v, DTensor)
        out[f"{name}_dtensors"] = n


def world(rank: int, size: int, root: str) -> dict:
    warnings.filterwarnings("ignore")
    out: dict = {}
    _storage_reader_case(rank, root, out)
    _transformers_case(rank, root, out)
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    pytest.importorskip("transformers")
    root = str(tmp_path_factory.mktemp("ecosystem"))
    return run_world(world, 4, root, timeout=WORLD_TIMEOUT, separate_hosts=True)


def test_storage_reader_equals_dcp_load_and_reads_replicas_once(results):
    assert all(r["reader_tensors"] == 3 for r in results)  # rep_w, rep_b and the shard (step compared too)
    reads = [k for r in results for k in r["reader_read"]]
    assert len(reads) == len(set(reads)), "a stored item was read by two ranks"
    replicated = {("m.rep_w", (0, 0)), ("m.rep_b", (0,)), ("step", ())}
    assert replicated <= set(reads)
    assert sum(r["reader_received"] for r in results) == 3 * len(replicated)  # 3 other holders each


def test_transformers_llama_into_tp_and_fsdp2_equals_from_pretrained(results):
    files = results[0]["hf_files"]
    assert "model.safetensors.index.json" in files and sum(f.endswith(".safetensors") for f in files) > 2
    assert all(r["tp_dtensors"] >= 14 and r["fsdp_dtensors"] >= 20 for r in results)
