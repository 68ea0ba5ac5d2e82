"""The memory tier's file format (``pipeload.tier.format``) and ``MemoryTier``'s arguments, in one process.

Real files: a rank file written and read back (every dtype kind, objects, empty tensors), every field of
a hostile or damaged header refused with an error naming the file, and roots of another job or with a
damaged ``TIER.json`` / ``COMPLETE.json`` treated as holding nothing, with a warning naming them.
"""

from __future__ import annotations

import io
import json
import os
import warnings

import pytest
import torch
from safetensors.torch import load_file

import pipeload
from pipeload.errors import CheckpointFormatError, ChecksumError, HeaderError
from pipeload.tier import MemoryTier
from pipeload.tier import format as tf


def _obj(value) -> bytes:
    buf = io.BytesIO()
    torch.save(value, buf)
    return buf.getvalue()


def _sample():
    w = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    tensors = {
        "layer.w": (w[:, 2:5], (4, 12), (0, 5)),  # a strided view: its values are stored contiguous
        "layer.b": (torch.tensor([1, 2], dtype=torch.bfloat16), (8,), (6,)),
        "empty": (torch.empty(0, 3, dtype=torch.int64), (5, 3), (5, 0)),
        "flag": (torch.tensor(True), (), ()),
    }
    objects = {"step": _obj(7), "sched": _obj({"lr": [0.1, 0.01]})}
    return tensors, objects


def test_round_trip(tmp_path):
    tensors, objects = _sample()
    path = tf.rank_file(tmp_path, 12, 3)
    assert path == os.path.join(str(tmp_path), "step-000000000012", "rank-000003.safetensors")
    os.makedirs(os.path.dirname(path))
    size = tf.write_rank_file(path, 12, 3, 4, "job-a", tensors, objects)
    assert size == os.path.getsize(path) and not os.path.exists(path + ".tmp")
    h = tf.read_rank_header(path, job="job-a")
    assert (h.job, h.step, h.rank, h.world, h.size) == ("job-a", 12, 3, 4, size)
    assert sorted(h.tensors) == sorted(tensors) and sorted(h.objects) == sorted(objects)
    plain = load_file(path)  # any safetensors reader opens it
    for fqn, (local, shape, offsets) in tensors.items():
        e = h.tensors[fqn]
        assert (e.shape, e.offsets, e.lengths) == (shape, offsets, tuple(local.shape))
        assert torch.equal(plain[fqn], local)
        raw = open(path, "rb").read()[e.start:e.end]
        tf.verify_chunk(h, fqn, raw)
    for fqn, data in objects.items():
        e = h.objects[fqn]
        assert open(path, "rb").read()[e.start:e.end] == data
    assert torch.load(io.BytesIO(bytes(plain["sched"].numpy())), weights_only=True) == {"lr": [0.1, 0.01]}
    e = h.tensors["layer.w"]
    bad = bytearray(open(path, "rb").read()[e.start:e.end])
    bad[0] ^= 1
    with pytest.raises(ChecksumError, match="layer.w"):
        tf.verify_chunk(h, "layer.w", bytes(bad))


def _write_raw(path, record, tensors=None) -> None:
    """A safetensors file with ``record`` as its tier metadata and ``tensors`` {name: (dtype, shape, bytes)}."""
    tensors = tensors if tensors is not None else {"x": ("F32", [2], b"\0" * 8)}
    header = {"__metadata__": {"pipeload.tier": record if isinstance(record, str) else json.dumps(record)}}
    start, data = 0, b""
    for name, (dtype, shape, raw) in tensors.items():
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [start, start + len(raw)]}
        start += len(raw)
        data += raw
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "wb") as f:
        f.write(len(text).to_bytes(8, "little") + text + data)


def _good():
    return {"format": 1, "job": "j", "step": 5, "rank": 1, "world": 2,
            "tensors": {"x": {"shape": [4], "offsets": [2], "dtype": "F32", "checksum": "0" * 16}}, "objects": {}}


def _with(**changes):
    rec = _good()
    for k, v in changes.items():
        if k.startswith("x_"):
            rec["tensors"]["x"][k[2:]] = v
        else:
            rec[k] = v
    return rec


@pytest.mark.parametrize("record, tensors, message", [
    ("not json", None, "not valid JSON"),
    ('{"format": 1, "format": 1}', None, "not valid JSON"),
    ([1, 2], None, "exactly the keys"),
    (_with(extra=1), None, "exactly the keys"),
    (_with(format=2), None, "tier format 2"),
    (_with(format=True), None, "tier format True"),
    (_with(job=""), None, "job id"),
    (_with(job=7), None, "job id"),
    (_with(step=-1), None, "step -1"),
    (_with(step=1.5), None, "step 1.5"),
    (_with(rank=2), None, "0 <= rank < world"),
    (_with(world=0), None, "0 <= rank < world"),
    (_with(step=6), None, "records step 6, expected 5"),
    (_with(rank=0), None, "records rank 0, expected 1"),
    (_with(job="other"), None, "records job 'other', expected 'j'"),
    (_with(tensors=[]), None, "must be objects"),
    (_with(x_dtype="F16"), None, "dtype 'F16', the file F32"),
    (_with(x_shape=[3]), None, "does not fit the global shape"),
    (_with(x_shape=[4, 1]), None, "lists of 1 non-negative"),
    (_with(x_offsets=[-1]), None, "lists of 1 non-negative"),
    (_with(x_offsets=["2"]), None, "lists of 1 non-negative"),
    (_with(x_checksum="ZZ"), None, "16 lowercase hex"),
    (_with(x_more=1), None, "exactly shape, offsets, dtype, checksum"),
    (_with(tensors={}), None, "differ"),
    (_good(), {"x": ("F32", [2], b"\0" * 8), "y": ("U8", [1], b"\0")}, "differ"),
    (_with(objects={"x": "0" * 16}), None, "differ"),
    (_with(tensors={}, objects={"x": "0" * 16}), None, "1-D U8"),
])
def test_hostile_headers_refused(tmp_path, record, tensors, message):
    path = tf.rank_file(tmp_path, 5, 1)
    _write_raw(path, record, tensors)
    with pytest.raises(CheckpointFormatError, match="rank-000001.safetensors") as got:
        tf.read_rank_header(path, job="j")
    assert message in str(got.value)
    # a resharding restore parses a file it listed from its summary once, with the same checks
    from pipeload.tier.restoreread import TierFile, load_header
    listed = TierFile(5, 1, 2, os.fspath(path), os.path.getsize(path), None, None, None)
    why = load_header(listed, "j")
    assert why is not None and message in why and not listed.loaded


def test_damaged_and_foreign_files_refused(tmp_path):
    tensors, objects = _sample()
    path = tf.rank_file(tmp_path, 1, 0)
    os.makedirs(os.path.dirname(path))
    tf.write_rank_file(path, 1, 0, 1, "j", tensors, objects)
    good = open(path, "rb").read()
    for damaged in (good[: len(good) - 3], good[:6], b"", b"\xff" * 64, good[:8] + b"[" + good[9:]):
        with open(path, "wb") as f:
            f.write(damaged)
        with pytest.raises(HeaderError, match="rank-000000"):
            tf.read_rank_header(path)
    with open(path, "wb") as f:
        f.write(good)
    moved = tf.rank_file(tmp_path, 2, 0)  # the same file under another step's name
    os.makedirs(os.path.dirname(moved))
    os.rename(path, moved)
    with pytest.raises(CheckpointFormatError, match="records step 1, expected 2"):
        tf.read_rank_header(moved)
    assert tf.read_rank_header(moved, step=1).step == 1
    plain = os.path.join(str(tmp_path), "plain.safetensors")
    from safetensors.torch import save_file
    save_file({"x": torch.ones(2)}, plain)
    with pytest.raises(CheckpointFormatError, match="not a pipeload tier file"):
        tf.read_rank_header(plain)
    with pytest.raises(ValueError, match="0 <= rank < world"):
        tf.write_rank_file(tf.rank_file(tmp_path, 1, 0), 1, 1, 1, "j", {}, {})


def _complete(root, step, job, ranks, world=2):
    tf.write_json(os.path.join(tf.step_dir(root, step), tf.COMPLETE_FILE),
                  {"step": step, "world": world, "job": job, "ranks": ranks, "replicas": 2, "hosts": 2})


def test_list_steps_and_foreign_roots(tmp_path):
    root = str(tmp_path / "host0")
    assert tf.list_steps(root, "j") == {}  # a root that does not exist yet: empty, silently
    tf.claim(root, "j")
    assert json.load(open(os.path.join(root, "TIER.json"))) == {"format": 1, "job": "j"}
    for step, ranks in ((3, [0, 1]), (4, [0, 1]), (5, [1])):
        for r in ranks:
            os.makedirs(tf.step_dir(root, step), exist_ok=True)
            tf.write_rank_file(tf.rank_file(root, step, r), step, r, 2, "j", {"x": (torch.ones(2), (4,), (2 * r,))}, {})
    _complete(root, 3, "j", [0, 1])
    _complete(root, 4, "j", [0, 1])
    os.unlink(tf.rank_file(root, 4, 1))  # listed but gone: not reported as held
    open(os.path.join(tf.step_dir(root, 5), "rank-000000.safetensors.tmp"), "wb").close()
    os.makedirs(os.path.join(root, "step-12"))  # not ours: ignored
    steps = tf.list_steps(root, "j")
    assert steps == {3: {"complete": True, "ranks": [0, 1], "world": 2, "replicas": 2, "hosts": 2},
                     4: {"complete": True, "ranks": [0], "world": 2, "replicas": 2, "hosts": 2},
                     5: {"complete": False, "ranks": [1]}}
    assert MemoryTier(root, job="j").steps() == [3, 4]
    # a damaged COMPLETE.json: the step is not complete, with a warning naming it
    with open(os.path.join(tf.step_dir(root, 3), tf.COMPLETE_FILE), "w") as f:
        f.write('{"step": 3')
    with pytest.warns(RuntimeWarning, match="step-000000000003.*COMPLETE.json"):
        assert tf.list_steps(root, "j")[3] == {"complete": False, "ranks": [0, 1]}
    _complete(root, 3, "j", [0, 5])
    with pytest.warns(RuntimeWarning, match="below the world"):
        assert not tf.list_steps(root, "j")[3]["complete"]
    # another job's root holds nothing for this job: warned once, naming the root and the job
    with pytest.warns(RuntimeWarning, match=f"{root}.*job 'j', not of this job 'k'"):
        assert tf.list_steps(root, "k") == {}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert tf.list_steps(root, "k") == {}  # once per root
    with pytest.raises(CheckpointFormatError, match="job 'j', not of this job 'k'.*remove it"):
        tf.claim(root, "k")
    with open(os.path.join(root, "TIER.json"), "w") as f:
        f.write("{}")
    with pytest.warns(RuntimeWarning, match="TIER.json: not a pipeload tier record"):
        assert tf.list_steps(root, "j") == {}
    with pytest.raises(CheckpointFormatError, match="TIER.json"):
        tf.claim(root, "j")
    assert os.path.exists(tf.rank_file(root, 3, 0))  # nothing of the foreign root was touched


def test_memory_tier_arguments(tmp_path, monkeypatch):
    t = MemoryTier(tmp_path)
    assert (t.root, t.replicas, t.keep) == (str(tmp_path), 2, 1)
    assert pipeload.MemoryTier is MemoryTier
    monkeypatch.setenv("PIPELOAD_JOB_ID", "")
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "elastic-7")
    assert MemoryTier(tmp_path).job == "elastic-7"
    monkeypatch.setenv("PIPELOAD_JOB_ID", "mine")
    assert MemoryTier(tmp_path).job == "mine" and MemoryTier(tmp_path, job="x").job == "x"
    monkeypatch.delenv("PIPELOAD_JOB_ID")
    monkeypatch.delenv("TORCHELASTIC_RUN_ID")
    assert MemoryTier("rel").job == "default" and os.path.isabs(MemoryTier("rel").root)
    for bad, err in (({"root": b"/x"}, TypeError), ({"root": 3}, TypeError), ({"root": ""}, ValueError),
                     ({"replicas": 0}, ValueError), ({"replicas": True}, ValueError), ({"replicas": 2.0}, ValueError),
                     ({"keep": 0}, ValueError), ({"job": ""}, ValueError), ({"job": "a\nb"}, ValueError),
                     ({"job": 5}, ValueError)):
        args = {"root": tmp_path, **bad}
        with pytest.raises(err):
            MemoryTier(**args)
    assert "replicas=2" in repr(t)
