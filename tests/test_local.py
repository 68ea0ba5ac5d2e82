"""A world of one (no process group): save/load round trips, async entry points, validation."""

from __future__ import annotations

import asyncio
import os

import pytest
import torch

import pipeload
from pipeload.errors import DistributedError, PipeloadError, StateDictError
from pipeload.save.saver import wait_cleanup


def _sd():
    g = torch.Generator().manual_seed(0)
    return {
        "model": {
            "w": torch.randn(6, 4, generator=g),
            "ids": torch.arange(7),
            "half": torch.randn(5, generator=g).to(torch.bfloat16),
            "scalar": torch.tensor(3.5),
            "empty": torch.zeros(0, 4),
            "flag": torch.tensor([True, False, True]),
        },
        "optim": {
            "state": {0: {"step": torch.tensor(10.0), "exp_avg": torch.randn(6, 4, generator=g)}},
            "param_groups": [{"lr": 3e-4, "betas": (0.9, 0.95), "params": [0], "name": None}],
        },
        "epoch": 4,
    }


def _blank(sd):
    if isinstance(sd, dict):
        return {k: _blank(v) for k, v in sd.items()}
    if isinstance(sd, list):
        return [_blank(v) for v in sd]
    return torch.zeros_like(sd) if isinstance(sd, torch.Tensor) else None


def _assert_same(a, b):
    if isinstance(a, dict):
        assert a.keys() == b.keys()
        for k in a:
            _assert_same(a[k], b[k])
    elif isinstance(a, list):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            _assert_same(x, y)
    elif isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and torch.equal(a, b)
    else:
        assert a == b


def test_roundtrip_in_place(tmp_path):
    src = _sd()
    pipeload.save(src, tmp_path)
    dst = _blank(src)
    w = dst["model"]["w"]
    stats = pipeload.load(dst, tmp_path)
    _assert_same(src, dst)
    assert dst["model"]["w"] is w  # copied into, not replaced
    assert stats.shared_shards == 0 and stats.broadcasts == 0 and stats.files_opened == 1
    assert stats.private_shards == 7  # the empty tensor needs no read


def test_non_contiguous_destination(tmp_path):
    pipeload.save({"w": torch.arange(12.0).reshape(3, 4)}, tmp_path)
    dst = {"w": torch.zeros(4, 3).t()}
    pipeload.load(dst, tmp_path)
    assert torch.equal(dst["w"], torch.arange(12.0).reshape(3, 4))


def test_non_contiguous_source_is_saved_by_value(tmp_path):
    base = torch.arange(20.0).reshape(4, 5)
    pipeload.save({"w": base.t(), "col": base[:, 1]}, tmp_path)
    dst = {"w": torch.zeros(5, 4), "col": torch.zeros(4)}
    pipeload.load(dst, tmp_path)
    assert torch.equal(dst["w"], base.t()) and torch.equal(dst["col"], base[:, 1])


@pytest.mark.asyncio
async def test_load_async_and_sync_refusal(tmp_path):
    src = _sd()
    pipeload.save(src, tmp_path)
    dst = _blank(src)
    ticks = 0

    async def ticker():
        nonlocal ticks
        while True:
            ticks += 1
            await asyncio.sleep(0)

    t = asyncio.ensure_future(ticker())
    await pipeload.load_async(dst, tmp_path)
    t.cancel()
    _assert_same(src, dst)
    assert ticks > 0  # the loop kept running other tasks during the load
    with pytest.raises(PipeloadError, match="load_async"):
        pipeload.load(_blank(src), tmp_path)


def test_sync_loads_keep_the_main_threads_loop_and_close_other_threads_loops(tmp_path, monkeypatch):
    """load() keeps the main thread's event loop between calls (creating one cost ~0.4 ms a load), also
    after a load that raised, with no task left on it; a load in another thread runs on a loop of its own,
    closed when it returns."""
    import threading

    from pipeload.engine import loader

    src = _sd()
    pipeload.save(src, tmp_path)
    pipeload.load(_blank(src), tmp_path)
    kept = loader._kept[1]
    bad = _blank(src)
    bad["model"]["w"] = torch.zeros(1)
    with pytest.raises(StateDictError):
        pipeload.load(bad, tmp_path)
    dst = _blank(src)
    pipeload.load(dst, tmp_path)
    _assert_same(src, dst)
    assert loader._kept[1] is kept and not kept.is_closed() and not asyncio.all_tasks(kept)

    made, new_loop = [], loader._new_loop
    monkeypatch.setattr(loader, "_new_loop", lambda: made.append(new_loop()) or made[-1])
    out = {}

    def other():
        out["dst"] = _blank(src)
        pipeload.load(out["dst"], tmp_path)

    t = threading.Thread(target=other)
    t.start()
    t.join(60)
    _assert_same(src, out["dst"])
    assert len(made) == 1 and made[0] is not kept and made[0].is_closed()
    assert loader._kept[1] is kept

    # A child forked after a load (a data-loader worker, say) loads on a loop of its own; the parent's
    # kept loop goes on working.
    pid = os.fork()
    if pid == 0:  # the child: report through the exit code only
        code = 1
        try:
            child = _blank(src)
            pipeload.load(child, tmp_path)
            _assert_same(src, child)
            code = 0 if loader._kept[1] is not kept and loader._kept[0] == os.getpid() else 2
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    again = _blank(src)
    pipeload.load(again, tmp_path)
    _assert_same(src, again)
    assert loader._kept[1] is kept


def test_validation_reports_everything_and_writes_nothing(tmp_path):
    pipeload.save(_sd(), tmp_path)
    dst = _blank(_sd())
    dst["model"]["w"] = torch.zeros(6, 5)
    dst["model"]["ids"] = torch.zeros(7, dtype=torch.int32)
    dst["model"]["extra"] = torch.zeros(2)
    with pytest.raises(StateDictError) as e:
        pipeload.load(dst, tmp_path)
    msg = str(e.value)
    assert "'model.w'" in msg and "'model.ids'" in msg and "'model.extra'" in msg
    assert not dst["optim"]["state"][0]["exp_avg"].any() and dst["epoch"] is None


def test_strict_false_reports_missing(tmp_path):
    pipeload.save({"a": torch.ones(2)}, tmp_path)
    dst = {"a": torch.zeros(2), "b": torch.zeros(1)}
    stats = pipeload.load(dst, tmp_path, strict=False)
    assert stats.missing_keys == ["b"] and torch.equal(dst["a"], torch.ones(2))


def test_not_a_checkpoint(tmp_path):
    with pytest.raises(PipeloadError, match="no .metadata"):
        pipeload.load({"a": torch.zeros(1)}, tmp_path)


def test_unsafe_object_rejected_before_writing(tmp_path):
    class Custom:
        pass

    with pytest.raises(StateDictError, match="'cfg.obj'.*Custom"):
        pipeload.save({"cfg": {"obj": Custom()}, "w": torch.zeros(2)}, tmp_path)
    assert os.listdir(tmp_path) == []


def test_bad_tensors_rejected(tmp_path):
    sd = {"meta": torch.empty(2, device="meta"), "sparse": torch.zeros(2, 2).to_sparse()}
    with pytest.raises(StateDictError) as e:
        pipeload.save(sd, tmp_path)
    assert "'meta'" in str(e.value) and "'sparse'" in str(e.value)


def test_overwrite_replaces_files(tmp_path):
    pipeload.save({"a": torch.ones(2)}, tmp_path)
    first = set(os.listdir(tmp_path))
    pipeload.save({"a": torch.full((2,), 2.0)}, tmp_path)
    wait_cleanup()  # the replaced files are deleted by a thread, after the commit
    second = set(os.listdir(tmp_path))
    assert len(second) == 3 and not (first - {".metadata"}) & second  # .metadata, index, one data file
    dst = {"a": torch.zeros(2)}
    pipeload.load(dst, tmp_path)
    assert torch.equal(dst["a"], torch.full((2,), 2.0))


def test_read_failure_names_file(tmp_path):
    pipeload.save({"a": torch.ones(2)}, tmp_path)
    data = [f for f in os.listdir(tmp_path) if f.startswith("data-")][0]
    os.unlink(tmp_path / data)
    with pytest.raises(DistributedError, match=f"{data}.*FileNotFoundError"):
        pipeload.load({"a": torch.zeros(2)}, tmp_path)


def test_checksum_verification(tmp_path):
    pipeload.save({"a": torch.ones(64)}, tmp_path)
    data = tmp_path / [f for f in os.listdir(tmp_path) if f.startswith("data-")][0]
    raw = bytearray(data.read_bytes())
    raw[-1] ^= 0x01
    data.write_bytes(bytes(raw))
    dst = {"a": torch.zeros(64)}
    pipeload.load(dst, tmp_path)  # off by default: the flipped bit goes through
    with pytest.raises(DistributedError, match="checksum"):
        pipeload.load(dst, tmp_path, verify_checksums=True)


def test_progress_bar_on_rank_zero(tmp_path, capsys):
    pipeload.save({"a": torch.ones(1000)}, tmp_path)
    pipeload.load({"a": torch.zeros(1000)}, tmp_path, progress=True)
    err = capsys.readouterr().err
    assert "pipeload" in err and "3.91k" in err  # 4000 bytes, in KiB units


def test_loads_into_parameters(tmp_path):
    model = torch.nn.Linear(4, 3)
    pipeload.save(model.state_dict(), tmp_path)
    other = torch.nn.Linear(4, 3)
    sd = {k: v for k, v in other.named_parameters()}  # requires_grad leaves, loaded in place
    pipeload.load(sd, tmp_path)
    assert torch.equal(other.weight, model.weight) and other.weight.requires_grad
    big = torch.nn.Parameter(torch.zeros(128, 256))  # large enough for the memcpy path
    pipeload.save({"w": torch.ones(128, 256)}, tmp_path / "big")
    pipeload.load({"w": big}, tmp_path / "big")
    assert bool((big == 1).all())


def test_gc_pause_nests_and_restores():
    import gc

    from pipeload.engine._gcpause import paused_gc

    assert gc.isenabled()
    with paused_gc():
        with paused_gc():
            assert not gc.isenabled()
        assert not gc.isenabled()
    assert gc.isenabled()
    gc.disable()
    try:
        with paused_gc():
            pass
        assert not gc.isenabled()  # a caller's own choice is left alone
    finally:
        gc.enable()


def test_empty_state_dict_into_a_new_nested_directory(tmp_path):
    target = tmp_path / "runs" / "step-0"
    pipeload.save({"model": {}}, target)
    assert sorted(os.listdir(target))[0] == ".metadata" and len(os.listdir(target)) == 2  # + the chunk index
    stats = pipeload.load({"model": {}}, target)
    assert stats.bytes_read == 0 and stats.private_shards == 0


FIXTURES = os.path.join(os.path.dirname(__file__), "fixtures")


def test_format_1_checkpoints_still_load():
    """A checkpoint written by the release that wrote format 1 (kept as a fixture) loads exactly."""
    import layouts as L
    from pipeload.tools.inspect import inspect_checkpoint, verify_checkpoint
    from pipeload.formats.metadata import read_metadata

    fixture = os.path.join(FIXTURES, "v1")
    assert read_metadata(fixture).version == 1
    flat = {fqn: torch.zeros(shape, dtype=dtype) for fqn, (shape, dtype) in L.TENSORS.items()}
    flat.update({fqn: None for fqn in L.OBJECTS})
    sd = L.nest(flat)
    pipeload.load(sd, fixture)
    L.check_values(sd)
    assert inspect_checkpoint(fixture)["version"] == 1 and verify_checkpoint(fixture) == []


def test_format_2_index_is_read_only_where_needed_and_validated(tmp_path):
    """Format 2 keeps chunks in a safetensors index; a damaged index is a named CheckpointFormatError."""
    from safetensors import safe_open

    from pipeload.formats.metadata import read_metadata

    full = torch.arange(64 * 8, dtype=torch.float32).reshape(64, 8)
    pipeload.save({"w": full, "s": 3}, tmp_path)
    md = read_metadata(tmp_path)
    assert md.version == 2 and md.indexed and "w" in md.tensors
    index = tmp_path / md.index_file
    with safe_open(str(index), "np") as f:  # any safetensors tool reads the index
        assert f.get_tensor("chunk_start").tolist() == [0, 1]
    assert [c.key for c in md.chunks_for("w", (8, 0), (8, 8))] == ["w"]
    dst = {"w": torch.zeros(64, 8), "s": None}
    pipeload.load(dst, tmp_path)
    assert torch.equal(dst["w"], full) and dst["s"] == 3
    os.unlink(index)
    with pytest.raises(PipeloadError, match="chunk index of this checkpoint is missing"):
        pipeload.load({"w": torch.zeros(64, 8), "s": None}, tmp_path)


def test_format_2_chunk_files_survive_an_objects_only_file(tmp_path):
    """The index numbers chunk files in the .metadata file list, which also lists objects-only files."""
    from pipeload.formats.chunkindex import ARRAYS, build_arrays, index_file_name
    from pipeload.formats.metadata import ChunkMeta, Metadata, ObjectMeta, TensorMeta, read_metadata
    from pipeload.save.saver import _write_file

    md = Metadata("0" * 16, 2, {"w": TensorMeta("F32", (4,), (ChunkMeta((0,), (4,), "b.safetensors", "w", "1" * 16),))},
                  {"o": ObjectMeta("a.safetensors", "o#object", 3, "2" * 16)})
    name = index_file_name(md.save_id)
    arrays = build_arrays(sorted(md.tensors), md.tensors, md.files)
    _write_file(str(tmp_path / name), md.save_id, [(k, ARRAYS[k][0], a.shape, a.tobytes()) for k, a in arrays.items()])
    (tmp_path / ".metadata").write_text(md.to_json_v2(name))
    back = read_metadata(tmp_path)
    assert back.chunks_for("w", (0,), (4,)) == [ChunkMeta((0,), (4,), "b.safetensors", "w", "1" * 16)]
    assert back.tensors["w"] == md.tensors["w"] and back.files == ["a.safetensors", "b.safetensors"]


def test_format_2_index_mapped_or_sent_loads_the_same(tmp_path):
    """A small index travels with .metadata; a large one is mapped by each rank: both paths load alike."""
    from pipeload.formats import chunkindex

    full = torch.arange(300 * 7, dtype=torch.float64).reshape(300, 7)
    pipeload.save({"w": full, "v": torch.ones(3)}, tmp_path)
    for limit in (chunkindex.INLINE_INDEX, 0):
        saved, chunkindex.INLINE_INDEX = chunkindex.INLINE_INDEX, limit
        try:
            dst = {"w": torch.zeros(300, 7, dtype=torch.float64), "v": torch.zeros(3)}
            pipeload.load(dst, tmp_path)
        finally:
            chunkindex.INLINE_INDEX = saved
        assert torch.equal(dst["w"], full) and torch.equal(dst["v"], torch.ones(3))


def test_format_2_exact_chunk_lookup_agrees_with_the_chunk_list(tmp_path):
    """The vectorised lookup of "the one chunk that is this box" finds exactly the chunks equal to a box,
    and nothing for boxes that span, split or miss chunks (those resolve box by box)."""
    import random

    from pipeload.formats.chunkindex import ARRAYS, build_arrays, index_file_name
    from pipeload.formats.metadata import ChunkMeta, Metadata, TensorMeta, read_metadata
    from pipeload.save.saver import _write_file

    rng = random.Random(7)
    tensors = {"scalar": TensorMeta("F32", (), (ChunkMeta((), (), "d.safetensors", "scalar", "0" * 16),))}
    for t in range(12):
        rows, cols = rng.randint(1, 40), rng.randint(1, 9)
        rcut = sorted({0, *rng.sample(range(1, rows + 1), min(rows, rng.randint(0, 5))), rows})
        ccut = sorted({0, *rng.sample(range(1, cols + 1), min(cols, rng.randint(0, 3))), cols})
        chunks = tuple(ChunkMeta((r0, c0), (r1 - r0, c1 - c0), f"f{rng.randint(0, 2)}.safetensors", f"t{t}@{r0},{c0}",
                                 f"{rng.getrandbits(64):016x}")
                       for r0, r1 in zip(rcut, rcut[1:]) for c0, c1 in zip(ccut, ccut[1:]))
        tensors[f"t{t}"] = TensorMeta("F32", (rows, cols), chunks)
    md = Metadata("0" * 16, 1, tensors, {})
    name = index_file_name(md.save_id)
    arrays = build_arrays(sorted(md.tensors), md.tensors, md.files)
    _write_file(str(tmp_path / name), md.save_id, [(k, ARRAYS[k][0], a.shape, a.tobytes()) for k, a in arrays.items()])
    (tmp_path / ".metadata").write_text(md.to_json_v2(name))
    back = read_metadata(tmp_path)
    boxes = []
    for fqn, t in tensors.items():
        boxes += [(fqn, c.offsets, c.lengths) for c in t.chunks]  # each chunk: found
        if t.shape:
            boxes.append((fqn, (0, 0), t.shape))  # the whole tensor: found only when it is one chunk
            for _ in range(5):  # random boxes: found only when they happen to be a chunk
                r0, c0 = rng.randrange(t.shape[0]), rng.randrange(t.shape[1])
                boxes.append((fqn, (r0, c0), (rng.randint(1, t.shape[0] - r0), rng.randint(1, t.shape[1] - c0))))
    got = back.exact_chunks([b[0] for b in boxes], [b[1] for b in boxes], [b[2] for b in boxes])
    for (fqn, off, ln), hit in zip(boxes, got):
        same = [c for c in tensors[fqn].chunks if c.offsets == off and c.lengths == ln]
        assert hit == ((same[0].file, same[0].checksum) if same else None), (fqn, off, ln)
    assert sum(h is not None for h in got) >= sum(len(t.chunks) for t in tensors.values())


def test_every_mismatch_is_named_alike_in_both_metadata_formats(tmp_path):
    """The local plan checks each leaf against the checkpoint's tensor table (format 2: columns compared in
    place; format 1: a dict of TensorMeta): the same problems, each naming the key and both sides."""
    from pipeload.formats.metadata import Metadata, read_metadata
    from pipeload.plan.planner import local_plan
    from pipeload.plan.statedict import flatten

    pipeload.save({"a": torch.ones(4, 3), "b": torch.ones(4), "c": torch.ones(2, 2, 2), "d": torch.tensor(1.0),
                   "e": torch.ones(2, 3), "obj": {"k": 1}, "t": torch.ones(2)}, tmp_path)
    v2 = read_metadata(tmp_path)
    assert v2.indexed
    v1 = Metadata(v2.save_id, v2.world_size, {k: v2.tensors[k] for k in v2.tensors}, v2.objects)
    sd = {"a": torch.zeros(4, 3, dtype=torch.float64), "b": torch.zeros(5), "c": torch.zeros(2, 4),
          "d": torch.zeros(1), "e": torch.zeros(2, 3), "obj": {"k": torch.zeros(1)}, "t": 7, "x": torch.zeros(1)}
    want = ["'a': the state dict has dtype F64 shape [4, 3], the checkpoint F32 [4, 3]",
            "'b': the state dict has dtype F32 shape [5], the checkpoint F32 [4]",
            "'c': the state dict has dtype F32 shape [2, 4], the checkpoint F32 [2, 2, 2]",
            "'d': the state dict has dtype F32 shape [1], the checkpoint F32 []",
            "'obj.k': the checkpoint holds a Python object, the state dict a tensor",
            "'t': the checkpoint holds a tensor, the state dict a int",
            "'x': missing from the checkpoint"]
    for md in (v2, v1):
        plan = local_plan(flatten(sd), md, lambda t: True)
        assert sorted(plan.problems) == want, md.version
        assert [s.fqn for s in plan.shards] == ["e"] and plan.missing == ["x"]
        assert plan.boxes[0].shape == (1, 3) and plan.boxes[1].tolist() == [[2, 3, 0]]
    with pytest.raises(StateDictError) as e:
        pipeload.load(sd, tmp_path)
    assert all(w in str(e.value) for w in want)


def test_a_malformed_box_is_a_problem_not_a_crash(tmp_path):
    """The compiled local plan indexes a box's offsets and lengths without bounds checks: a box whose
    offsets or lengths do not match its tensor's rank (from a ``box_of`` such as the simulation's) must be
    refused as a problem naming the key before any of it is read."""
    from pipeload.formats.metadata import read_metadata
    from pipeload.plan.planner import local_plan
    from pipeload.plan.statedict import Box, flatten

    pipeload.save({"a": torch.ones(4, 3), "b": torch.ones(2), "c": torch.ones(3, 2)}, tmp_path)
    md = read_metadata(tmp_path)
    boxes = {"a": ((4, 3), (0,), (4, 3)), "b": ((2,), (0,), (2,)), "c": ((3, 2), (0, 0), (3,))}
    plan = local_plan(flatten({k: torch.zeros(v[0]) for k, v in boxes.items()}), md, lambda t: True,
                      box_of=lambda fqn, v, cache: Box(*boxes[fqn], v))
    assert [s.fqn for s in plan.shards] == ["b"]
    assert [p.split(":")[0] for p in plan.problems] == ["'a'", "'c'"]
    assert "1 offsets and 2 lengths" in plan.problems[0] and "2 offsets and 1 lengths" in plan.problems[1]
