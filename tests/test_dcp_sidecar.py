"""The chunk table of a DCP checkpoint, decoded once, and the sidecar that keeps it between jobs.

The sidecar is used only when it was built from the very ``.metadata`` beside it (size, mtime and xxh3
of its bytes) and is intact; a changed ``.metadata``, a truncated or bit-flipped sidecar, or another
checkpoint's sidecar is never used (the load still gives the right values), and a read-only directory
still loads. The table itself must give the same chunks as DCP's own objects (the recorders and the
exact path agree), and the allow-list still refuses a foreign global.
"""

from __future__ import annotations

import os
import pickle
import shutil
import subprocess

import pytest
import torch
import torch.distributed.checkpoint as dcp

import pipeload
from pipeload.tools.cli import main
from pipeload.errors import CheckpointFormatError
from pipeload.formats import dcp as dcp_layout
from pipeload.formats import dcpmeta, open_checkpoint
from pipeload.tools.inspect import inspect_checkpoint

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled", "ignore::UserWarning")


def _values(seed: int):
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(7, 5, generator=g), "b": torch.randn(5, generator=g).to(torch.bfloat16),
            "s": torch.tensor(float(seed)), "e": torch.zeros(0, 3), "step": seed}


def _save(path, seed: int) -> None:
    dcp.save(_values(seed), checkpoint_id=str(path))


def _load(path) -> dict:
    sd = {k: (torch.zeros_like(v) if isinstance(v, torch.Tensor) else None) for k, v in _values(0).items()}
    pipeload.load(sd, path)
    return sd


def _check(sd, seed: int) -> None:
    for k, v in _values(seed).items():
        assert (torch.equal(sd[k], v) if isinstance(v, torch.Tensor) else sd[k] == v), k


def _side(path) -> str:
    return os.path.join(path, dcpmeta.SIDECAR)


def test_sidecar_written_then_used_and_refused_when_stale(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    _save(a, 1)
    _save(b, 2)
    assert inspect_checkpoint(a)["sidecar"] == "absent"
    _check(_load(a), 1)
    first = os.stat(_side(a))
    assert inspect_checkpoint(a)["sidecar"] == "current"
    _check(_load(a), 1)
    assert os.stat(_side(a)).st_ino == first.st_ino  # used, not rebuilt
    # the .metadata replaced by another save: its values, never the sidecar's
    _check(_load(b), 2)  # (writes b's sidecar)
    shutil.rmtree(a)
    _save(a, 3)
    shutil.copy(_side(b), _side(a))  # another checkpoint's sidecar
    assert inspect_checkpoint(a)["sidecar"] == "stale"
    _check(_load(a), 3)
    assert inspect_checkpoint(a)["sidecar"] == "current"
    # same bytes, other mtime: rebuilt (the key is size, mtime and hash)
    before = os.stat(_side(a)).st_ino
    os.utime(os.path.join(a, ".metadata"), ns=(1, 1))
    assert inspect_checkpoint(a)["sidecar"] == "stale"
    _check(_load(a), 3)
    assert os.stat(_side(a)).st_ino != before


@pytest.mark.parametrize("damage", ["truncated", "flipped", "garbage", "empty"])
def test_damaged_sidecar_is_ignored_and_rebuilt(tmp_path, damage):
    path = tmp_path / "c"
    _save(path, 4)
    _load(path)
    side = _side(path)
    data = bytearray(open(side, "rb").read())
    if damage == "truncated":
        data = data[: len(data) - 9]
    elif damage == "flipped":
        data[-3] ^= 0x40  # inside the arrays: the header and the key still match
    elif damage == "garbage":
        data = bytearray(b"\xff" * 64)
    else:
        data = bytearray()
    open(side, "wb").write(data)
    assert inspect_checkpoint(path)["sidecar"] == "stale"
    _check(_load(path), 4)
    assert inspect_checkpoint(path)["sidecar"] == "current"


def _read_only(src, tmp_path):
    """A read-only view of ``src`` (a read-only bind mount; root ignores mode bits), or None."""
    mnt = tmp_path / "ro"
    mnt.mkdir()
    ok = subprocess.run(["mount", "--bind", str(src), str(mnt)], capture_output=True).returncode == 0
    if ok and subprocess.run(["mount", "-o", "remount,ro,bind", str(mnt)], capture_output=True).returncode == 0:
        return mnt
    if ok:
        subprocess.run(["umount", str(mnt)], capture_output=True)
    if os.geteuid() != 0:
        os.chmod(src, 0o555)
        return src
    return None


def test_read_only_directory_loads_without_sidecar(tmp_path):
    src = tmp_path / "d"
    _save(src, 5)
    ro = _read_only(src, tmp_path)
    if ro is None:
        pytest.skip("no way to make a read-only directory here")
    try:
        _check(_load(ro), 5)
        assert not os.path.exists(_side(ro))
        assert not [n for n in os.listdir(ro) if n.startswith(dcpmeta.SIDECAR)]  # no temporary left either
    finally:
        if ro != src:
            subprocess.run(["umount", str(ro)], capture_output=True)
        os.chmod(src, 0o755)


def test_recorders_and_dcp_objects_give_the_same_table(tmp_path):
    """The fast decode (stand-ins) and the exact one (DCP's classes) agree array for array."""
    import numpy as np

    path = tmp_path / "e"
    _save(path, 6)
    md_path = os.path.join(path, ".metadata")
    raw = open(md_path, "rb").read()
    fast = dcpmeta.decode(lambda: open(md_path, "rb"), md_path, dcp_layout._MetadataUnpickler)
    cols = dcpmeta._Columns()
    parts = dcpmeta._columns_of_objects(dcp_layout.load_dcp_metadata(raw, md_path), cols, md_path)
    exact = dcpmeta._table(cols, *parts, md_path)
    assert fast[1] == exact[1]
    for k in fast[0]:
        assert np.array_equal(fast[0][k], exact[0][k]), k


def test_hostile_pickle_still_refused_by_the_table_decode(tmp_path):
    path = tmp_path / "h"
    path.mkdir()

    class Evil:
        def __reduce__(self):
            return (os.system, ("echo owned > " + str(path / "owned"),))

    open(path / ".metadata", "wb").write(pickle.dumps({"x": Evil()}))
    with pytest.raises(CheckpointFormatError, match="refusing to unpickle (posix|os).system"):
        open_checkpoint(path, "dcp")
    assert not (path / "owned").exists() and not os.path.exists(_side(path))


def test_inspect_cli_shows_the_sidecar(tmp_path, capsys):
    path = tmp_path / "i"
    _save(path, 7)
    assert main(["inspect", str(path)]) == 0
    assert "sidecar     absent" in capsys.readouterr().out
    assert main(["inspect", str(path)]) == 0
    assert "sidecar     current" in capsys.readouterr().out
