"""``pipeload.load`` into :class:`pipeload.Slice` destinations: an inference engine's fused layout filled
from a checkpoint, each stored byte read once across the engine's TP ranks and its replicas.

The engine is :mod:`pipeload.tools.engineshape`'s vLLM-style layout of a small MoE model in Hugging Face
naming (fused ``qkv_proj`` / ``gate_up_proj``, experts stacked in ``w13`` / ``w2``, row-parallel column
blocks, a vocabulary padded with :data:`~pipeload.tools.engineshape.PAD` rows). One 4-rank gloo world
(2 TP ranks x 2 replicas, each rank its own emulated host) runs every distributed sub-case: from a
pipeload checkpoint an FSDP2 trainer saved, from a Hugging Face safetensors file and from ``dcp.save``'s
files, bit for bit against slicing the full tensors by hand, padding untouched, bytes read across the
world per unique stored byte, the plan reused and re-planned when the boxes move, with
``use_collectives=False``, and the refusals raised on every rank before anything is written. The
single-process cases (no process group) follow.
"""

from __future__ import annotations

import os
import random
import warnings

import pytest
import torch

import pipeload
from pipeload.tools._world import run_world

WORLD = 4
K = "model.layers.0.self_attn.k_proj.weight"
O = "model.layers.0.self_attn.o_proj.weight"


def _shape():
    from pipeload.tools.engineshape import Shape

    return Shape(layers=6, hidden=32, heads=4, kv_heads=2, head_dim=8, inter=64, experts=3, vocab=100)


def _full(seed: int = 1) -> dict[str, torch.Tensor]:
    from pipeload.tools.engineshape import trainer_model

    return {k: v.detach().clone() for k, v in trainer_model(_shape(), seed=seed).state_dict().items()}


def _engine(t: int):
    """TP rank ``t``'s parameters (zeros, padding rows PAD) and their Slices."""
    from pipeload.tools.engineshape import engine_params, engine_slices

    params = engine_params(_shape(), 2, t)
    return params, engine_slices(_shape(), params, 2, t)


def _bad(params: dict, full: dict, t: int) -> list[str]:
    """The parameters of TP rank ``t`` that differ from the full tensors sliced by hand (padding: PAD)."""
    from pipeload.tools.engineshape import PAD, _vocab, expected

    want = expected(_shape(), full, 2, t)
    bad = [k for k in want if not torch.equal(params[k], want[k])]
    _, held, _ = _vocab(_shape(), 2, t)
    if not (params["model.embed_tokens.weight"][held:] == PAD).all():
        bad.append("padding")
    return bad


def _extra(full_view_of, t: int) -> tuple[dict, dict]:
    """Besides the fused layout, one name several times on this rank: the rank's own KV rows twice more
    (a box the fused layout holds too: read once, copied) and the other TP rank's rows (another box of
    the same name), in a list inside a dict, beside a whole tensor; and the expected values."""
    rows = 8  # one KV head
    mine, other = (t * rows, 0), ((1 - t) * rows, 0)
    views = [torch.zeros(rows, 32), torch.zeros(rows, 32), torch.zeros(rows, 32)]
    sd = {"kv": [pipeload.Slice(views[0], K, mine, (16, 32)), pipeload.Slice(views[1], K, mine, (16, 32)),
                 pipeload.Slice(views[2], K, other, (16, 32))],
          "model.norm.weight": torch.zeros(32)}
    want = {0: full_view_of(K)[t * rows:(t + 1) * rows], 1: full_view_of(K)[t * rows:(t + 1) * rows],
            2: full_view_of(K)[(1 - t) * rows:(2 - t) * rows]}
    return sd, want


def _load_case(ckpt: str, t: int, full: dict, **kw) -> dict:
    """The fused layout (a dict holding the slices' list and the extra boxes) loaded twice (the plan
    kept), then the other TP rank's layout (its boxes moved: planned again)."""
    from pipeload.tools.engineshape import PAD

    params, slices = _engine(t)
    extra, want = _extra(full.__getitem__, t)
    sd = {"fused": slices, **extra}
    out: dict = {"runs": []}
    for _ in range(2):
        st = pipeload.load(sd, ckpt, **kw)
        bad = _bad(params, full, t)
        bad += [f"kv{i}" for i, w in want.items() if not torch.equal(sd["kv"][i].view, w)]
        bad += [] if torch.equal(sd["model.norm.weight"], full["model.norm.weight"]) else ["norm"]
        out["runs"].append({"bad": bad, "read": st.bytes_read, "reused": st.plan_reused, "received": st.bytes_received,
                            "units": st.chunk_units, "format": st.format})
        for p in params.values():  # the next load must write everything again (padding kept)
            p.masked_fill_(p != PAD, 0.0)
        for sl in sd["kv"]:
            sl.view.zero_()
    moved, moved_slices = _engine(1 - t)
    st = pipeload.load(moved_slices, ckpt, **kw)
    out["moved"] = {"bad": _bad(moved, full, 1 - t), "reused": st.plan_reused}
    return out


def _refusals(ckpt: str, rank: int) -> dict:
    """A wrong global shape on rank 1, a missing name on rank 2, another dtype on rank 3: every rank
    raises, naming each slice and its rank, and no destination is written; ``cast=True`` loads the
    other dtype."""
    view = torch.full((8, 32), 5.0)
    bad = {1: pipeload.Slice(view, K, (8, 0), (17, 32)),
           2: pipeload.Slice(view, "model.layers.0.self_attn.kk_proj.weight", (8, 0), (16, 32)),
           3: pipeload.Slice(view.to(torch.bfloat16), K, (8, 0), (16, 32))}
    good = torch.full((16, 32), 5.0)
    dst = [pipeload.Slice(good, K, (0, 0), (16, 32))] + ([bad[rank]] if rank in bad else [])
    out: dict = {}
    try:
        pipeload.load(dst, ckpt, strict="missing")
        out["error"] = None
    except pipeload.PipeloadError as e:
        out["error"] = f"{type(e).__name__}: {e}"
    out["untouched"] = bool((good == 5.0).all() and (view == 5.0).all() and (dst[-1].view == 5.0).all())
    half = torch.zeros(8, 32, dtype=torch.bfloat16)
    pipeload.load([pipeload.Slice(half, K, (8, 0), (16, 32))], ckpt, cast=True, strict="missing")
    out["cast"] = half
    return out


def _save_trainer(rank: int, root: str) -> tuple[str, str, str]:
    """The trainer's checkpoints: pipeload's and DCP's from an FSDP2 model over the 4 ranks, and a
    Hugging Face file rank 0 writes with safetensors."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    import torch.distributed.fsdp as fsdp
    from safetensors.torch import save_file
    from torch.distributed.device_mesh import DeviceMesh

    from pipeload.tools.engineshape import leaf_modules, trainer_model

    model = trainer_model(_shape(), seed=1)
    mesh = DeviceMesh("cpu", list(range(WORLD)))
    for m in leaf_modules(model):
        fsdp.fully_shard(m, mesh=mesh)
    fsdp.fully_shard(model, mesh=mesh)
    own, dcp_dir, hf = (os.path.join(root, n) for n in ("own", "dcp", "hf"))
    pipeload.save(model.state_dict(), own)
    dcp.save(model.state_dict(), checkpoint_id=dcp_dir)
    if rank == 0:
        os.makedirs(hf)
        save_file(_full(), os.path.join(hf, "model.safetensors"), metadata={"format": "pt"})
    dist.barrier()
    return own, dcp_dir, hf


def world4(rank: int, world: int, root: str) -> dict:
    t = rank % 2  # TP rank; rank // 2 is the replica
    full = _full()
    own, dcp_dir, hf = _save_trainer(rank, root)
    res = {"own": _load_case(own, t, full)}
    pipeload.clear_plan_cache()
    res["hf"] = _load_case(hf, t, full)
    params, slices = _engine(t)
    st = pipeload.load(slices, dcp_dir)
    res["dcp"] = {"bad": _bad(params, full, t), "format": st.format}
    params, slices = _engine(t)
    st = pipeload.load(slices, hf, use_collectives=False)
    res["alone"] = {"bad": _bad(params, full, t), "read": st.bytes_read, "received": st.bytes_received}
    res["refusals"] = _refusals(own, rank)
    res["cast_want"] = full[K][8:16].to(torch.bfloat16)
    return _plain(res)


def _plain(x):
    """Tensors as numpy-free nested lists (a tensor crosses the result queue by a shared-memory file
    descriptor, gone once the rank exits)."""
    if isinstance(x, torch.Tensor):
        return x.float().tolist()
    if isinstance(x, dict):
        return {k: _plain(v) for k, v in x.items()}
    if isinstance(x, list):
        return [_plain(v) for v in x]
    return x


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return run_world(world4, WORLD, str(tmp_path_factory.mktemp("slices")), timeout=150, separate_hosts=True)


def _unique_bytes() -> int:
    return sum(v.numel() * v.element_size() for v in _full().values())


@pytest.mark.timeout(200)
@pytest.mark.parametrize("case", ["own", "hf"])
def test_engine_layout_exact_read_once_and_reused(results, case):
    for rank, r in enumerate(results):
        runs = r[case]["runs"]
        assert [x["bad"] for x in runs] == [[], []], (rank, runs)
        assert [x["reused"] for x in runs] == [False, True], (rank, runs)
        assert r[case]["moved"] == {"bad": [], "reused": False}, (rank, r[case]["moved"])
        assert runs[0]["received"] > 0 and runs[0]["units"] > 0  # replicas broadcast; column blocks as units
    assert {r[case]["runs"][0]["format"] for r in results} == {"pipeload" if case == "own" else "hf"}
    for run in (0, 1):
        ratio = sum(r[case]["runs"][run]["read"] for r in results) / _unique_bytes()
        assert 1.0 <= ratio <= 1.02, (case, run, ratio)


@pytest.mark.timeout(200)
def test_dcp_checkpoint_and_without_collectives(results):
    for rank, r in enumerate(results):
        assert r["dcp"] == {"bad": [], "format": "dcp"}, (rank, r["dcp"])
        assert r["alone"]["bad"] == [] and r["alone"]["received"] == 0, (rank, r["alone"])
    # each rank reads its own boxes: every replica reads its part again
    assert sum(r["alone"]["read"] for r in results) > 1.5 * _unique_bytes()


@pytest.mark.timeout(200)
def test_refused_on_every_rank_naming_slice_and_rank(results):
    for rank, r in enumerate(results):
        e = r["refusals"]["error"]
        assert e is not None and e.startswith("DistributedError"), (rank, e)
        assert f"[rank 1] Slice {K!r} at offsets (8, 0)" in e and "global shape [17, 32]" in e, e
        assert "[rank 2] Slice 'model.layers.0.self_attn.kk_proj.weight' at offsets (8, 0): missing" in e, e
        assert f"[rank 3] Slice {K!r} at offsets (8, 0): the slice has dtype BF16" in e, e
        assert "[rank 0]" not in e
        assert r["refusals"]["untouched"], rank
        assert r["refusals"]["cast"] == results[0]["cast_want"]


# -- one process, no process group -------------------------------------------------------------------


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """The trainer's tensors saved by pipeload, as one Hugging Face file and by ``dcp.save``."""
    import torch.distributed.checkpoint as dcp
    from safetensors.torch import save_file

    root = tmp_path_factory.mktemp("slices1")
    full = _full(seed=2)
    own, hf, dc = str(root / "own"), str(root / "hf"), str(root / "dcp")
    pipeload.save(dict(full), own)
    os.makedirs(hf)
    save_file(full, os.path.join(hf, "model.safetensors"))
    with warnings.catch_warnings():  # (DCP warns that it saves in one process: it is meant to)
        warnings.simplefilter("ignore", UserWarning)
        dcp.save(dict(full), checkpoint_id=dc)
    return full, {"own": own, "hf": hf, "dcp": dc}


@pytest.mark.parametrize("fmt", ["own", "hf", "dcp"])
def test_one_process_fused_layout_from_each_format(checkpoints, fmt):
    full, dirs = checkpoints
    for t in (0, 1):
        params, slices = _engine(t)
        st = pipeload.load(tuple(slices) if t else slices, dirs[fmt])
        assert _bad(params, full, t) == [], (fmt, t)
        assert st.format == ("pipeload" if fmt == "own" else fmt)


def test_one_process_views_boxes_and_twins(checkpoints):
    """One name in several boxes and the same box twice, non-contiguous views written through (the
    bytes around them keep their sentinel), mixed with a tensor and an object's key; then a second
    load into other boxes of the same dict layout."""
    full, dirs = checkpoints
    base = torch.full((32, 48), -3.0)
    col = base[:, 8:24]  # a column block: not contiguous
    rows = torch.full((20, 32), -3.0)
    twin_a, twin_b = rows[2:10], torch.full((8, 32), -3.0)
    sd = {"eng": {"o": pipeload.Slice(col, O, (0, 16), (32, 32)), "k": pipeload.Slice(twin_a, K, (8, 0), (16, 32))},
          "twin": pipeload.Slice(twin_b, K, (8, 0), (16, 32)),
          "k0": pipeload.Slice(rows[12:20], K, (0, 0), (16, 32)),
          "model.norm.weight": torch.zeros(32)}
    pipeload.load(sd, dirs["own"])
    assert not col.is_contiguous() and torch.equal(col, full[O][:, 16:32])
    assert (base[:, :8] == -3).all() and (base[:, 24:] == -3).all()
    assert torch.equal(twin_a, full[K][8:16]) and torch.equal(twin_b, full[K][8:16])
    assert torch.equal(rows[12:20], full[K][:8]) and (rows[:2] == -3).all() and (rows[10:12] == -3).all()
    assert torch.equal(sd["model.norm.weight"], full["model.norm.weight"])


def test_one_process_refusals_touch_nothing(checkpoints):
    full, dirs = checkpoints
    view = torch.full((8, 32), 5.0)
    cases = {
        "missing": (pipeload.Slice(view, "model.nope.weight", (0, 0), (16, 32)),
                    "Slice 'model.nope.weight' at offsets (0, 0): missing from the checkpoint"),
        "shape": (pipeload.Slice(view, K, (8, 0), (24, 32)), f"Slice {K!r} at offsets (8, 0): the slice has dtype F32 "
                  "global shape [24, 32], the checkpoint F32 [16, 32]"),
        "dtype": (pipeload.Slice(view.half(), K, (8, 0), (16, 32)), f"Slice {K!r} at offsets (8, 0): the slice has "
                  "dtype F16"),
    }
    for what, (bad, words) in cases.items():
        ok = torch.full((16, 32), 5.0)
        with pytest.raises(pipeload.StateDictError) as e:
            pipeload.load([pipeload.Slice(ok, K, (0, 0), (16, 32)), bad], dirs["hf"])
        assert words in str(e.value), (what, str(e.value))
        assert (ok == 5).all() and (bad.view == 5).all(), what
    st = pipeload.load([cases["missing"][0]], dirs["hf"], strict=False)
    assert st.missing_keys == ["model.nope.weight"] and (view == 5).all()
    half = torch.zeros(8, 32, dtype=torch.float16)
    pipeload.load({"h": pipeload.Slice(half, K, (8, 0), (16, 32))}, dirs["hf"], cast=True)
    assert torch.equal(half, full[K][8:].half())
    with pytest.raises(TypeError, match="list or tuple of pipeload.Slice"):
        pipeload.load([pipeload.Slice(view, K, (8, 0), (16, 32)), torch.zeros(1)], dirs["hf"])
    with pytest.raises(pipeload.StateDictError, match="meta device"):
        pipeload.load([pipeload.Slice(torch.empty(8, 32, device="meta"), K, (8, 0), (16, 32))], dirs["hf"])


def test_plan_signature_keys_on_the_boxes():
    """A kept plan is offered only to the same boxes: the signature holds each slice's name, box and
    global shape (and its view's facts), not only its place in the dict."""
    from pipeload.plan import plancache

    v = torch.zeros(8, 32)
    sig = lambda off, name=K, view=v: plancache.signature({"a": [pipeload.Slice(view, name, off, (16, 32))]})[0]  # noqa: E731
    assert sig((0, 0)) == sig((0, 0))
    assert sig((0, 0)) != sig((8, 0))
    assert sig((0, 0)) != sig((0, 0), name="model.layers.1.self_attn.k_proj.weight")
    assert sig((0, 0)) != sig((0, 0), view=v.half())


def test_replicas_in_any_order_build_one_record(checkpoints):
    """Ranks holding the same boxes send one record whatever the order and paths of their slices (the
    planner orders shards by key), and a box held twice is one shard (the other view its twin)."""
    from pipeload import formats
    from pipeload.plan.planner import local_plan, plan_record
    from pipeload.plan.statedict import flatten, load_target

    _, dirs = checkpoints
    md = formats.open_checkpoint(dirs["hf"], None, None).metadata
    records = []
    for seed in range(3):
        _, slices = _engine(1)
        slices.append(pipeload.Slice(torch.zeros(8, 32), K, (8, 0), (16, 32)))  # the fused layout's k rows again
        random.Random(seed).shuffle(slices)
        plan = local_plan(flatten(load_target(slices)), md, lambda t: True)
        assert not plan.problems and len(plan.twins) == 1 and len(plan.shards) == len(slices) - 1
        records.append(plan_record(plan, md.width()))
    assert records[0] == records[1] == records[2]
