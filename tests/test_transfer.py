"""``pipeload.transfer`` in a real 6-rank gloo world, every sub-case in one spawned world.

Ranks 0-3 train (FSDP2 of a MoE-shaped model in Hugging Face naming, ``fully_shard`` over a 4-rank
mesh), ranks 4-5 are an engine of TP 2 and ranks 2-3 a second, colocated one (they pass both ``src``
and ``dst``). Shows, each checked bit for bit in the parent against the trainer's full tensors:

- FSDP2 -> two TP 2 engines in the fused layout (qkv_proj, gate_up_proj, w13/w2, padded vocabulary,
  padding rows untouched), then again after an optimizer step with the plan reused;
- TP 2 -> TP 4 with DTensor destinations; FSDP2 over TP (2 x 2) -> two whole-tensor engine replicas;
- the same transfer on a group that is not the default world's (a bare ``ProcessGroupGloo`` built on a
  store of its own, engine ranks first), into destinations ``record_slices`` found in the engine's loader;
- one holder and five engine replicas: the regions relayed in hops (the holder sends three copies);
- faults raised on every rank, naming the key: a name the source lacks, a destination of another
  shape, a version that differs, a transfer beside a load on the same group; after each the next
  transfer works.
"""

from __future__ import annotations

import os
import threading
from datetime import timedelta

import pytest
import torch

from pipeload.tools._world import run_world

WORLD = 6
TRAINERS = [0, 1, 2, 3]


def _shape():
    from pipeload.tools.engineshape import Shape

    return Shape(layers=2, hidden=32, heads=4, kv_heads=2, head_dim=8, inter=64, experts=3, vocab=100)


def _engine(rank: int):
    """(tp rank, engine id) of an engine rank, or None."""
    return {4: (0, "A"), 5: (1, "A"), 2: (0, "B"), 3: (1, "B")}.get(rank)


def _fsdp2(s, mesh):
    import torch.distributed.fsdp as fsdp

    from pipeload.tools.engineshape import leaf_modules, trainer_model

    model = trainer_model(s, seed=1)
    for m in leaf_modules(model):
        fsdp.fully_shard(m, mesh=mesh)
    fsdp.fully_shard(model, mesh=mesh)
    return model


def _full(model) -> dict:
    return {k: v.full_tensor().clone() for k, v in model.state_dict().items()}


def _fused_case(rank, mesh, s) -> dict:
    """FSDP2 -> two engines; an optimizer step; again (plan reused); another step, and the same state
    dict object passed again (what a trainer keeping its state dict across steps does)."""
    import pipeload
    from pipeload.tools.engineshape import engine_params, engine_slices

    model = _fsdp2(s, mesh) if rank in TRAINERS else None
    eng = _engine(rank)
    params = engine_params(s, 2, eng[0]) if eng else None
    dst = engine_slices(s, params, 2, eng[0]) if eng else None
    out = {}
    for step in (1, 2, 3):  # (3: step 2's state dict passed again: its DTensors are the parameters' views)
        src = model.state_dict() if model is not None and step < 3 else src if step == 3 else None
        st = pipeload.transfer(src, dst, version=step)
        out[step] = {"planned": st.planned, "version": st.version, "complete": st.complete,
                     "written": len(st.written), "destinations": st.destinations,
                     "received": st.bytes_received, "copied": st.bytes_copied,
                     "params": {k: v.clone() for k, v in params.items()} if params else None,
                     "full": _full(model) if model is not None else None}
        if model is not None:  # the trainer steps: every weight changes in place
            opt = torch.optim.AdamW(model.parameters(), lr=0.1)
            sum((p.to_local() ** 2).sum() for p in model.parameters()).backward()
            opt.step()
            opt.zero_grad()
    return out


def _tp2_to_tp4(rank) -> dict:
    """TP 2 (Shard(0) and Shard(1)) on ranks 0-1 -> DTensor destinations of TP 4 on ranks 2-5."""
    import pipeload
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor, Shard

    g = torch.Generator().manual_seed(5)
    full = {"w.rows": torch.randn(12, 10, generator=g), "w.cols": torch.randn(8, 10, generator=g).to(torch.bfloat16)}
    src_mesh, dst_mesh = DeviceMesh("cpu", [0, 1]), DeviceMesh("cpu", [2, 3, 4, 5])
    src = dst = None
    if rank in (0, 1):
        src = {k: DTensor.from_local(torch.chunk(v, 2, d)[rank].clone(), src_mesh, [Shard(d)], run_check=False,
                                     shape=v.shape, stride=v.stride())
               for (k, v), d in zip(full.items(), (0, 1))}
    else:
        t = rank - 2
        dst = {k: DTensor.from_local(torch.zeros_like(torch.chunk(v, 4, d)[t]), dst_mesh, [Shard(d)],
                                     run_check=False, shape=v.shape, stride=v.stride())
               for (k, v), d in zip(full.items(), (1, 0))}
    pipeload.transfer(src, dst)
    if dst is None:
        return {}
    t = rank - 2
    return {k: torch.equal(v.to_local(), torch.chunk(full[k], 4, d)[t]) for (k, v), d in zip(dst.items(), (1, 0))}


def _fsdp_tp_to_replicas(rank) -> dict:
    """FSDP2 over TP (2 x 2: _StridedShard + Shard) on ranks 0-3 -> whole tensors on ranks 4 and 5."""
    import pipeload
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor, Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    g = torch.Generator().manual_seed(7)
    full = torch.randn(16, 6, generator=g)
    mesh = DeviceMesh("cpu", [[0, 1], [2, 3]], mesh_dim_names=("dp", "tp"))
    src = dst = None
    if rank in TRAINERS:
        dp, tp = divmod(rank, 2)
        local = torch.chunk(torch.chunk(full, 2, 0)[tp], 2, 0)[dp].clone()
        src = {"w": DTensor.from_local(local, mesh, [_StridedShard(0, split_factor=2), Shard(0)],
                                       run_check=False, shape=full.shape, stride=full.stride())}
    if rank in (4, 5):
        dst = {"w": torch.zeros(16, 6)}
    st = pipeload.transfer(src, dst)
    return {"exact": torch.equal(dst["w"], full), "received": st.bytes_received} if dst else {"sent": st.bytes_sent}


def _bare_group_case(rank, root: str) -> dict:
    """The TP 2 fused transfer on a group built from a store of its own, ranks renumbered; the engine's
    destinations recorded from its own (vLLM-style) loader by ``record_slices``."""
    import torch.distributed as dist

    import pipeload
    from pipeload.tools.engineshape import checkpoint_shapes, engine_loader, engine_params, trainer_model

    s = _shape()
    order = [4, 5, 0, 1, 2, 3]  # the engine ranks first
    store = dist.FileStore(os.path.join(root, "bare-store"), WORLD)
    pg = dist.ProcessGroupGloo(dist.PrefixStore("rl", store), order.index(rank), WORLD, timedelta(seconds=60))
    full = trainer_model(s, seed=3).state_dict()
    src = dict(full) if rank in TRAINERS else None  # whole tensors on every trainer: replicated sources
    params = engine_params(s, 2, rank - 4) if rank in (4, 5) else None
    dst = None
    if params is not None:
        rec = pipeload.record_slices(engine_loader(s, params, 2, rank - 4),
                                     {n: (sh, s.dtype) for n, sh in checkpoint_shapes(s).items()})
        assert not rec.refused and not rec.unused, (rec.refused, rec.unused)
        dst = rec.slices
    st = pipeload.transfer(src, dst, group=pg)
    exact = None
    if params is not None:
        from pipeload.tools.engineshape import expected

        want = expected(s, dict(full), 2, rank - 4)
        exact = all(torch.equal(params[k], want[k]) for k in params)
    return {"exact": exact, "sent": st.bytes_sent}


def _faults(rank, root: str) -> dict:
    import pipeload

    out = {}
    full = {"a": torch.arange(12.0).reshape(3, 4)}
    src = full if rank == 0 else None

    def attempt(key, src, dst, **kw):
        try:
            pipeload.transfer(src, dst, **kw)
            out[key] = None
        except pipeload.PipeloadError as e:
            out[key] = str(e)

    attempt("missing", src, {"b": torch.zeros(3, 4)} if rank == 5 else None)
    attempt("shape", src, {"a": torch.zeros(4, 4)} if rank == 5 else None)
    attempt("dtype", src, {"a": torch.zeros(3, 4, dtype=torch.float16)} if rank == 5 else None)
    attempt("version", src, None, version=rank)
    dst = {"a": torch.zeros(3, 4, dtype=torch.float16)} if rank == 5 else None
    attempt("cast", src, dst, cast=True)
    out["cast_exact"] = bool(torch.equal(dst["a"], full["a"].half())) if dst else None
    out["beside_load"] = _beside_load(root, src)
    dst = {"a": torch.zeros(3, 4)} if rank in (1, 5) else None
    attempt("after", src, dst)
    out["after_exact"] = bool(torch.equal(dst["a"], full["a"])) if dst else None
    return out


def _beside_load(root, src) -> list[str]:
    """A load and a transfer started together on the same group: both refused on every rank."""
    import asyncio

    import pipeload

    ckpt = os.path.join(root, "beside")
    pipeload.save({"x": torch.ones(4)}, ckpt)

    async def both():
        return await asyncio.gather(pipeload.load_async({"x": torch.zeros(4)}, ckpt),
                                    asyncio.to_thread(pipeload.transfer, src, None), return_exceptions=True)

    return [f"{type(r).__name__}: {r}" for r in asyncio.run(both())]


def _layout_changed(rank) -> dict:
    """A kept plan, then a destination of another region (re-planned, exact), then one of another
    shape (refused on every rank, the destination untouched)."""
    import pipeload

    full = {"a": torch.arange(24.0).reshape(6, 4)}
    src = full if rank in (0, 1) else None
    out: dict = {}
    dst = {"a": torch.zeros(6, 4)} if rank == 5 else None
    out["first"] = pipeload.transfer(src, dst).planned
    view = torch.zeros(3, 4)
    out["moved"] = pipeload.transfer(src, [pipeload.Slice(view, "a", (2, 0), (6, 4))] if rank == 5 else None).planned
    out["moved_exact"] = bool(torch.equal(view, full["a"][2:5])) if rank == 5 else None
    bad = torch.zeros(7, 4)
    try:
        pipeload.transfer(src, {"a": bad} if rank == 5 else None)
        out["refused"] = None
    except pipeload.PipeloadError as e:
        out["refused"] = str(e)
    out["untouched"] = bool((bad == 0).all())
    return out


def _stream_case(rank, mesh, s) -> dict:
    """Full tensors streamed in small buckets into engine A's own loader, twice (plans kept per bucket;
    each bucket consumed on the stream's thread while the next arrives), once more in the caller's thread
    (``overlap=False``), then a loader that raises on rank 5: every rank raises, after every bucket's
    transfer."""
    import pipeload
    from pipeload.tools.engineshape import checkpoint_shapes, engine_loader, engine_params

    model = _fsdp2(s, mesh) if rank in TRAINERS else None
    want = {k: (v, s.dtype) for k, v in checkpoint_shapes(s).items()} if rank in (4, 5) else None
    params = engine_params(s, 2, rank - 4) if want else None
    loader = engine_loader(s, params, 2, rank - 4) if want else None
    biggest, threads = [], []

    def load_weights(weights):
        biggest.append(sum(t.numel() * t.element_size() for _, t in weights))
        threads.append(threading.current_thread() is threading.main_thread())
        loader(weights)

    src = model.state_dict() if model is not None else None
    runs = [pipeload.stream(src, want, load_weights if want else None, bucket_mb=0.02, version=7) for _ in (1, 2)]
    out = {"planned": [r.planned for r in runs], "version": runs[1].version, "buckets": len(biggest),
           "biggest": max(biggest, default=0), "params": {k: v.clone() for k, v in params.items()} if params else None,
           "full": _full(model) if model is not None else None, "sent": runs[1].bytes_sent}
    if params:  # the same again into fresh parameters, each bucket handed over in the caller's thread
        params = engine_params(s, 2, rank - 4)
        loader = engine_loader(s, params, 2, rank - 4)
    overlapped, threads[:] = list(threads), []
    pipeload.stream(src, want, load_weights if want else None, bucket_mb=0.02, overlap=False)
    out["threads"] = (set(overlapped), set(threads))
    out["again"] = {k: v.clone() for k, v in params.items()} if params else None

    def failing(weights):
        if rank == 5 and any("layers.1" in n for n, _ in weights):
            raise RuntimeError("engine out of memory")
        loader(weights)

    try:
        pipeload.stream(src, want, failing if want else None, bucket_mb=0.02)
        out["failed"] = None
    except pipeload.PipeloadError as e:
        out["failed"] = str(e)
    return out


def _relay_case(rank) -> dict:
    """One rank holds the weights, five engine replicas need them: relayed in hops, each exact."""
    import pipeload

    g = torch.Generator().manual_seed(5)
    full = {"w": torch.randn(40, 8, generator=g), "b": torch.randn(6, generator=g)}
    src = full if rank == 0 else None
    dst = None
    if rank:
        d = {k: torch.zeros_like(v) for k, v in full.items()}
        part = torch.zeros(4, 8)
        dst = [pipeload.Slice(d["w"], "w", (0, 0), (40, 8)), pipeload.Slice(d["b"], "b", (0,), (6,)),
               pipeload.Slice(part, "w", (8, 0), (40, 8))]
    out = {}
    for step in (1, 2):
        st = pipeload.transfer(src, dst)
        out[step] = {"sent": st.bytes_sent, "planned": st.planned, "received": st.bytes_received,
                     "exact": dst is None or all(torch.equal(sl.view, full[sl.name][sl.offsets[0]:][:len(sl.view)])
                                                 for sl in dst)}
        full["w"].mul_(2)  # the trainer steps (every rank keeps the values to compare with)
    return out


def world6(rank: int, world: int, root: str) -> dict:
    import pipeload
    from torch.distributed.device_mesh import DeviceMesh

    s = _shape()
    mesh = DeviceMesh("cpu", TRAINERS)
    res = {"fused": _fused_case(rank, mesh, s)}
    pipeload.clear_plan_cache()
    res["tp2_tp4"] = _tp2_to_tp4(rank)
    res["fsdp_tp"] = _fsdp_tp_to_replicas(rank)
    res["bare"] = _bare_group_case(rank, root)
    res["faults"] = _faults(rank, root)
    res["layout"] = _layout_changed(rank)
    res["stream"] = _stream_case(rank, mesh, s)
    res["relay"] = _relay_case(rank)
    return _plain(res)


def _plain(x):
    """Tensors as numpy arrays (a tensor crosses the result queue by a file descriptor of the rank's
    shared memory, gone once the rank exits)."""
    if isinstance(x, torch.Tensor):
        return x.detach().numpy().copy()
    if isinstance(x, dict):
        return {k: _plain(v) for k, v in x.items()}
    return x


def _tensors(d: dict) -> dict:
    return {k: torch.from_numpy(v) for k, v in d.items()}


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return run_world(world6, WORLD, str(tmp_path_factory.mktemp("transfer")), timeout=200)


@pytest.mark.timeout(240)
def test_fsdp2_into_fused_tp2_engines_exact_and_reused(results):
    from pipeload.tools.engineshape import PAD, _vocab, expected

    s = _shape()
    for step in (1, 2, 3):
        full = _tensors(results[0]["fused"][step]["full"])
        for rank in (2, 3, 4, 5):
            got = results[rank]["fused"][step]
            want = expected(s, full, 2, _engine(rank)[0])
            params = _tensors(got["params"])
            bad = [k for k in want if not torch.equal(params[k], want[k])]
            assert not bad, (step, rank, bad)
            assert got["complete"] and got["written"] == got["destinations"] > 0
            _, held, rows = _vocab(s, 2, _engine(rank)[0])
            assert (params["lm_head.weight"][held:] == PAD).all() and (rows > held) == (_engine(rank)[0] == 1)
        assert [results[r]["fused"][step]["planned"] for r in range(WORLD)] == [step == 1] * WORLD
        assert {results[r]["fused"][step]["version"] for r in range(WORLD)} == {step}
    assert results[2]["fused"][1]["copied"] > 0  # the colocated engine copied its own shard locally


@pytest.mark.timeout(240)
def test_each_destination_byte_received_once(results):
    from pipeload.tools.engineshape import _vocab, engine_params

    s = _shape()
    for rank in (4, 5):
        t = _engine(rank)[0]
        _, held, rows = _vocab(s, 2, t)
        want = sum(v.numel() * v.element_size() for v in engine_params(s, 2, t).values())
        want -= 2 * (rows - held) * s.hidden * 4  # the padding rows of embed_tokens and lm_head
        got = results[rank]["fused"][1]
        assert want <= got["received"] <= want * 1.01, (got["received"], want)


@pytest.mark.timeout(240)
def test_reshard_layouts_exact(results):
    for rank in (2, 3, 4, 5):
        assert all(results[rank]["tp2_tp4"].values()), results[rank]["tp2_tp4"]
    for rank in (4, 5):
        assert results[rank]["fsdp_tp"]["exact"]
    assert sum(results[r]["fsdp_tp"]["sent"] for r in TRAINERS) == 2 * 16 * 6 * 4


@pytest.mark.timeout(240)
def test_group_outside_the_default_world(results):
    assert results[4]["bare"]["exact"] and results[5]["bare"]["exact"]
    senders = [results[r]["bare"]["sent"] for r in TRAINERS]
    assert min(senders) > 0  # replicated sources: every holder sends a share
    assert max(senders) <= 1.5 * (sum(senders) / len(senders)), senders


@pytest.mark.timeout(240)
def test_faults_raised_on_every_rank_naming_the_key(results):
    for rank in range(WORLD):
        f = results[rank]["faults"]
        assert "'b'" in f["missing"] and "no rank of the group holds" in f["missing"], f["missing"]
        assert "'a'" in f["shape"] and "global shape" in f["shape"]
        assert "dtype" in f["dtype"] and "cast=True" in f["dtype"]
        assert "different versions" in f["version"]
        assert f["cast"] is None and f["after"] is None
        assert len(f["beside_load"]) == 2 and all("at the same time" in e for e in f["beside_load"]), f["beside_load"]
    assert results[5]["faults"]["cast_exact"] and results[1]["faults"]["after_exact"]


@pytest.mark.timeout(240)
def test_changed_destination_replanned_or_refused(results):
    for rank in range(WORLD):
        f = results[rank]["layout"]
        assert f["first"] and f["moved"], f  # the kept plan is not used for another layout
        assert "'a'" in f["refused"] and "global shape" in f["refused"], f["refused"]
        assert f["untouched"]
    assert results[5]["layout"]["moved_exact"]


@pytest.mark.timeout(240)
def test_stream_full_tensors_into_the_engine_loader(results):
    from pipeload.tools.engineshape import expected

    s = _shape()
    full = _tensors(results[0]["stream"]["full"])
    for rank in (4, 5):
        got = results[rank]["stream"]
        want = expected(s, full, 2, rank - 4)
        params = _tensors(got["params"])
        assert all(torch.equal(params[k], want[k]) for k in want), rank
        assert got["buckets"] > 10 and got["version"] == 7
        assert got["threads"] == ({False}, {True}), got["threads"]  # overlapped, then in the caller's thread
        again = _tensors(got["again"])
        assert all(torch.equal(again[k], want[k]) for k in want), rank
        largest = max(v.numel() * 4 for v in full.values())
        assert got["biggest"] <= max(0.02 * (1 << 20), largest), got["biggest"]  # one bucket at a time
    assert [results[r]["stream"]["planned"] for r in range(WORLD)] == [[True, False]] * WORLD
    senders = [results[r]["stream"]["sent"] for r in TRAINERS]
    assert min(senders) > 0 and max(senders) <= 1.5 * sum(senders) / len(senders), senders
    for rank in range(WORLD):
        f = results[rank]["stream"]["failed"]
        assert "rank 5" in f and "load_weights raised" in f and "engine out of memory" in f, f


def test_replicas_served_through_relays(results):
    """Five needers, one holder: three hops; the holder sends three copies, not five (bytes: w, b and
    the row block w[8:12], float32), every replica exact, again with the plan reused."""
    one = (40 * 8 + 6 + 4 * 8) * 4
    for step in (1, 2):
        assert results[0]["relay"][step]["sent"] == 3 * one
        assert sum(results[r]["relay"][step]["sent"] for r in range(WORLD)) == 5 * one
        for r in range(1, WORLD):
            assert results[r]["relay"][step]["exact"] and results[r]["relay"][step]["received"] == one
        assert [results[r]["relay"][step]["planned"] for r in range(WORLD)] == [step == 1] * WORLD
