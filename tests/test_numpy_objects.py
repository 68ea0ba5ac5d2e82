"""numpy values among a state dict's objects: plain dtypes round-trip, nothing else loads, no code runs.

A world of one: pipeload's own checkpoints, a ``dcp.save`` checkpoint read by ``pipeload.load``, the
memory tier, and records rewritten with an object array or a hostile pickle (refused on load, naming
the key and the class; the object is not placed and no code runs). torch's process-wide allow-list
is the same before and after every one of them.
"""

from __future__ import annotations

import io
import os

import numpy as np
import pytest
import torch

import pipeload
from pipeload.errors import PipeloadError, StateDictError
from pipeload.formats.metadata import METADATA_FILE, read_metadata
from pipeload.tools import inspect as pinspect


def _state() -> dict:
    rng = np.random.RandomState(1234)
    rng.randint(0, 10, size=100)  # a state mid-stream: pos != 624
    return {
        "model": {"w": torch.arange(12.0).reshape(3, 4), "b": torch.ones(4, dtype=torch.bfloat16)},
        "rng": {"numpy": rng.get_state(), "torch": torch.get_rng_state()},
        "ema": np.linspace(0, 1, 7, dtype=np.float32),
        "step": np.int64(1000),
        "meta": {"lr": np.float64(3e-4), "seen": np.uint32(7), "mask": np.array([True, False]),
                 "dtype": np.dtype("uint16"), "z": np.complex64(1 - 2j), "half": np.float16(0.5)},
    }


def _blank(sd):
    if isinstance(sd, dict):
        return {k: _blank(v) for k, v in sd.items()}
    return torch.zeros_like(sd) if isinstance(sd, torch.Tensor) else None


def _same(a, b) -> None:
    assert type(a) is type(b), (a, b)
    if isinstance(a, dict):
        assert a.keys() == b.keys()
        for k in a:
            _same(a[k], b[k])
    elif isinstance(a, (tuple, list)):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            _same(x, y)
    elif isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and torch.equal(a, b)
    elif isinstance(a, np.ndarray):
        assert a.dtype == b.dtype and np.array_equal(a, b)
    elif isinstance(a, np.generic):
        assert a.dtype == b.dtype and a == b
    else:
        assert a == b


@pytest.fixture
def allow_list():
    """torch's process-wide allow-list must be as it was: pipeload's numpy entries are scoped to its loads."""
    before = set(torch.serialization.get_safe_globals())
    yield
    assert set(torch.serialization.get_safe_globals()) == before


def _torch_refuses_numpy() -> None:
    buf = io.BytesIO()
    torch.save(np.arange(3), buf)
    with pytest.raises(Exception, match="numpy"):
        torch.load(io.BytesIO(buf.getvalue()), weights_only=True)


def test_numpy_values_round_trip(tmp_path, allow_list):
    sd = _state()
    pipeload.save(sd, tmp_path)
    got = _blank(sd)
    pipeload.load(got, tmp_path)
    _same(sd, got)
    rng = np.random.RandomState()
    rng.set_state(got["rng"]["numpy"])
    again = np.random.RandomState(1234)
    again.randint(0, 10, size=100)
    assert rng.randint(0, 2**31, size=4).tolist() == again.randint(0, 2**31, size=4).tolist()
    assert pinspect.verify_checkpoint(tmp_path) == []
    _torch_refuses_numpy()  # a user's own torch.load is as strict as before


def test_numpy_values_from_dcp_save_and_the_memory_tier(tmp_path, allow_list):
    import torch.distributed.checkpoint as dcp

    sd = _state()
    dcp.save(sd, checkpoint_id=str(tmp_path / "dcp"), no_dist=True)
    got = _blank(sd)
    pipeload.load(got, str(tmp_path / "dcp"))
    _same(sd, got)
    tier = pipeload.MemoryTier(str(tmp_path / "tier"), job="t")
    pipeload.save(sd, tier, step=5)
    got = _blank(sd)
    stats = pipeload.load(got, tier)
    assert stats.source == "tier"
    _same(sd, got)


def test_object_arrays_refused_before_writing(tmp_path, allow_list):
    sd = {"w": torch.zeros(2), "cfg": {"names": np.array(["a", None], dtype=object)}}
    with pytest.raises(StateDictError) as e:
        pipeload.save(sd, tmp_path)
    msg = str(e.value)
    assert "'cfg.names'" in msg and "ndarray" in msg and "numpy.dtypes.ObjectDType" in msg
    assert "add_safe_globals([numpy.dtype, numpy.dtypes.ObjectDType])" in msg
    assert os.listdir(tmp_path) == []
    with pytest.raises(StateDictError, match=r"'cfg\.when'.*DateTime64DType"):
        pipeload.save({"cfg": {"when": np.array(["2026-01-01"], dtype="datetime64[D]")}}, tmp_path)
    assert os.listdir(tmp_path) == []


def test_object_arrays_load_when_the_user_allows_them(tmp_path, allow_list):
    sd = {"cfg": {"names": np.array(["a", None, 3], dtype=object)}}
    with torch.serialization.safe_globals([np.dtype, np.dtypes.ObjectDType]):
        pipeload.save(sd, tmp_path)
        got = {"cfg": {"names": None}}
        pipeload.load(got, tmp_path)
        assert {np.dtype, np.dtypes.ObjectDType} <= set(torch.serialization.get_safe_globals())  # still the user's
    assert got["cfg"]["names"].tolist() == ["a", None, 3]


def _rewrite_object(path, key: str, value) -> None:
    """Replace the record of object ``key`` of the checkpoint at ``path`` by ``torch.save(value)``'s bytes
    (checksums and sizes updated: only the unpickler stands between the bytes and the state dict)."""
    from pipeload.io.checksum import checksum
    from pipeload.save.saver import _write_file

    buf = io.BytesIO()
    torch.save(value, buf)
    data = buf.getvalue()
    md = read_metadata(path)
    o = md.objects[key]
    same_file = [(k, m) for k, m in md.objects.items() if m.file == o.file]
    assert same_file == [(key, o)], "the test needs the object alone in its file"
    _write_file(os.path.join(path, o.file), md.save_id, [(o.key, "U8", (len(data),), data)])
    md.objects[key] = type(o)(o.file, o.key, len(data), checksum(data))
    with open(os.path.join(path, METADATA_FILE), "w") as f:
        f.write(md.to_json())


class Hostile:
    """Pickles as a call of ``os.system``: loading it must refuse, never run it."""

    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_records_the_unpickler_refuses_are_never_placed_and_run_nothing(tmp_path, allow_list):
    marker = tmp_path / "ran"
    cases = {"objarr": (np.array([1, None], dtype=object), "numpy.dtypes.ObjectDType", "add_safe_globals"),
             "hostile": ((np.arange(3), Hostile(str(marker))), "posix.system", "is blocked")}
    for name, (value, cls, how) in cases.items():
        ckpt = tmp_path / name
        pipeload.save({"obj": "placeholder"}, ckpt)
        _rewrite_object(ckpt, "obj", value)
        sd = {"obj": "before"}
        with pytest.raises(PipeloadError) as e:
            pipeload.load(sd, ckpt)
        assert "'obj'" in str(e.value) and cls in str(e.value) and how in str(e.value), str(e.value)
        assert "Weights only load failed" not in str(e.value)  # torch's general advice left out
        assert sd["obj"] == "before"
        problems = pinspect.verify_checkpoint(ckpt)
        assert len(problems) == 1 and cls in problems[0]
    assert not marker.exists()
