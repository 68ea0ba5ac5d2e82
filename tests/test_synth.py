"""The synthetic state dict: shapes, determinism, layout independence and exact verification."""

from __future__ import annotations

import pytest
import torch

from pipeload.tools import synth
from pipeload.tools._world import run_world

SMALL = dict(layers=2, experts=4)


def test_default_shape_counts():
    spec = synth.model_spec(64)
    names = [fqn for fqn, _, _ in spec.tensors()]
    assert len(names) == len(set(names)) == 3 + 8 * (9 + 128 * 3)  # 3,147 like a Qwen3-30B-A3B slice
    assert len(spec.step_fqns()) == 3 + 8 * 9
    roles = {role for _, _, role in spec.tensors()}
    assert roles == {"col", "row", "replicate", "plain"}


@pytest.mark.parametrize("size_mb", [1, 16, 300, 4096])
def test_size_knob_scales_widths_not_count(size_mb):
    spec = synth.model_spec(size_mb)
    assert len(spec.tensors()) == 3147
    assert abs(spec.model_nbytes / synth.MiB - size_mb) <= max(1.0, 0.05 * size_mb)
    for width in (spec.vocab, spec.hidden, spec.head_dim, spec.moe_inter):
        assert width % 8 == 0


def test_values_depend_on_seed_fqn_and_index_only():
    shape = (24, 40)
    full = synth.fill_box(torch.empty(shape, dtype=synth.DTYPE), 3, "w", shape, (0, 0))
    assert not full.isnan().any() and not full.isinf().any()
    assert full.abs().min() >= 2**-7 and full.abs().max() < 2
    box = synth.fill_box(torch.empty(5, 16, dtype=synth.DTYPE), 3, "w", shape, (7, 20))
    assert torch.equal(box.view(torch.int16), full[7:12, 20:36].view(torch.int16))
    other_fqn = synth.fill_box(torch.empty(shape, dtype=synth.DTYPE), 3, "v", shape, (0, 0))
    other_seed = synth.fill_box(torch.empty(shape, dtype=synth.DTYPE), 4, "w", shape, (0, 0))
    assert (other_fqn.view(torch.int16) != full.view(torch.int16)).float().mean() > 0.9
    assert (other_seed.view(torch.int16) != full.view(torch.int16)).float().mean() > 0.9
    # Neighbouring elements differ, so a shifted or transposed copy cannot pass verification.
    assert (full[:, 1:].view(torch.int16) != full[:, :-1].view(torch.int16)).float().mean() > 0.9


def test_blocks_cover_long_rows(monkeypatch):
    monkeypatch.setattr(synth, "_BLOCK", 64)
    shape = (3, 200)
    small = synth.fill_box(torch.empty(shape, dtype=synth.DTYPE), 0, "x", shape, (0, 0))
    monkeypatch.setattr(synth, "_BLOCK", 1 << 18)
    big = synth.fill_box(torch.empty(shape, dtype=synth.DTYPE), 0, "x", shape, (0, 0))
    assert torch.equal(small.view(torch.int16), big.view(torch.int16))


def test_one_process_build_and_verify():
    sd = synth.build_state_dict(None, 7, 2)
    assert synth.verify_state_dict(sd, 7, 2) == []
    assert synth.unique_bytes(sd) == synth.model_spec(2).model_nbytes + 4 * len(synth.model_spec(2).step_fqns())
    assert synth.local_bytes(sd) == synth.unique_bytes(sd)
    small = synth.build_state_dict(None, 7, 1, **SMALL)
    wrong_seed = synth.verify_state_dict(small, 8, 1, **SMALL)
    tensors = [k for k, v in synth.flatten(small).items() if isinstance(v, torch.Tensor)]
    assert len(wrong_seed) == len(tensors) + 3  # every tensor, param_groups, iteration, run


def test_verify_reports_every_problem():
    sd = synth.build_state_dict(None, 1, 1, **SMALL)
    sd["model"]["model.layers.1.self_attn.o_proj.weight"][2, 3] = 0
    del sd["model"]["lm_head.weight"]
    sd["model"]["extra.weight"] = torch.zeros(2, dtype=synth.DTYPE)
    sd["optim"]["state"]["model.norm.weight"]["step"] += 1
    sd["optim"]["param_groups"][0]["lr"] = 1.0
    sd["run"]["name"] = "other"
    problems = synth.verify_state_dict(sd, 1, 1, **SMALL)
    text = "\n".join(problems)
    assert len(problems) == 6, text
    assert "o_proj.weight: 1 of" in text and "local row 2, column 3" in text
    assert "model.lm_head.weight: missing" in text
    assert "model.extra.weight: unexpected key" in text
    assert "optim.state.model.norm.weight.step" in text
    assert "optim.param_groups" in text and "run:" in text


def test_betas_may_come_back_as_a_list():
    sd = synth.build_state_dict(None, 1, 1, **SMALL)
    sd["optim"]["param_groups"][0]["betas"] = list(sd["optim"]["param_groups"][0]["betas"])
    assert synth.verify_state_dict(sd, 1, 1, **SMALL) == []


def test_empty_destination_and_zero():
    ref = synth.build_state_dict(None, 2, 1, **SMALL)
    dst = synth.build_state_dict(None, 2, 1, fill=False, **SMALL)
    assert synth.flatten(dst).keys() - synth.flatten(ref).keys() == set()
    assert all(v is None for k, v in synth.flatten(dst).items() if not isinstance(v, torch.Tensor))
    assert synth.same_tensors(ref, dst)
    filled = synth.build_state_dict(None, 2, 1, **SMALL)
    assert synth.same_tensors(ref, filled) == []
    synth.zero_(filled)
    assert synth.same_tensors(dst, filled) == []


def _mesh_case(rank, world, tp, size_mb):
    mesh = synth.make_mesh(world, tp)
    sd = synth.build_state_dict(mesh, 5, size_mb, **SMALL)
    problems = synth.verify_state_dict(sd, 5, size_mb, **SMALL)
    # Layout independence: the gathered global tensors equal the one-process build.
    ref = synth.build_state_dict(None, 5, size_mb, **SMALL)
    differ = []
    for fqn, t in sd["model"].items():
        full = t.full_tensor() if hasattr(t, "full_tensor") else t
        if not torch.equal(full.view(torch.int16), ref["model"][fqn].view(torch.int16)):
            differ.append(fqn)
    # A shard verified against another rank's box must fail (the check sees the layout).
    from torch.distributed.tensor import DTensor

    q = sd["model"]["model.layers.0.self_attn.q_proj.weight"]
    assert isinstance(q, DTensor)
    wrong = synth.box_mismatch(q.to_local(), 5, "model.layers.0.self_attn.q_proj.weight", tuple(q.shape),
                               (q.shape[0] // tp * ((mesh.get_local_rank("tp") + 1) % tp), 0))
    placements = {fqn: tuple(str(p) for p in t.placements) for fqn, t in sd["model"].items()
                  if isinstance(t, DTensor)}
    # FSDP2 over TP on the same mesh: verified exactly, the same global values, a quarter of each DTensor
    fsdp = synth.build_state_dict(mesh, 5, size_mb, fsdp=True, **SMALL)
    problems += synth.verify_state_dict(fsdp, 5, size_mb, **SMALL)
    for fqn, t in fsdp["model"].items():
        full = t.full_tensor() if hasattr(t, "full_tensor") else t
        if not torch.equal(full.view(torch.int16), ref["model"][fqn].view(torch.int16)):
            differ.append(f"fsdp {fqn}")
    placements["fsdp"] = {fqn: tuple(str(p) for p in t.placements) for fqn, t in fsdp["model"].items()
                          if isinstance(t, DTensor)}
    return problems, differ, wrong is not None or tp == 1, synth.unique_bytes(sd), synth.local_bytes(sd), placements


@pytest.mark.timeout(60)
def test_spawned_mesh_layouts():
    results = run_world(_mesh_case, 4, 2, 2, timeout=50)
    for problems, differ, wrong_detected, unique, local, _ in results:
        assert problems == [] and differ == [] and wrong_detected
        assert local < unique  # tp shards the projections and experts
    assert len({r[3] for r in results}) == 1
    placements = results[0][5]
    assert placements["model.layers.0.self_attn.q_proj.weight"] == ("R", "S(0)")
    assert placements["model.layers.0.self_attn.o_proj.weight"] == ("R", "S(1)")
    assert placements["model.layers.0.mlp.experts.3.down_proj.weight"] == ("R", "S(1)")
    assert placements["model.layers.0.mlp.gate.weight"] == ("R", "R")
    assert "model.layers.0.input_layernorm.weight" not in placements  # a plain replicated tensor
    fsdp = placements["fsdp"]  # dp splits the TP shard's rows, as FSDP2 over TP writes it
    assert fsdp["model.layers.0.self_attn.q_proj.weight"] == ("_S(0, 2)", "S(0)")
    assert fsdp["model.layers.0.self_attn.o_proj.weight"] == ("S(0)", "S(1)")
    assert fsdp["model.layers.0.mlp.gate.weight"] == ("S(0)", "R")
