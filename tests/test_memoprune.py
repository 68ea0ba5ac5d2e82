"""Rank 0's DCP decode with a pruned memo (``pipeload.formats._memoprune``).

The rewritten stream must unpickle to the same objects as the original (back-references, shared and
cyclic objects, big opcodes included), keep only the memo entries something reads back, refuse to
rewrite anything it does not follow (the bytes are then unpickled as they are), and leave the allow-list
in charge: a hostile pickle is refused whichever way it is read. The decode's table must not change.
"""

from __future__ import annotations

import io
import os
import pickle

import numpy as np
import pytest
import torch

from pipeload.errors import CheckpointFormatError
from pipeload.formats import dcp as dcp_layout
from pipeload.formats import dcpmeta
from pipeload.formats._memoprune import pruned
from pipeload.tools import simforeign


def _dcp_metadata(tensors: int = 6, chunks: int = 5):
    """A DCP Metadata from torch's own classes, with the sharing dcp.save gives (one fqn string per
    tensor, one file name per writer)."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import (BytesStorageMetadata, ChunkStorageMetadata, Metadata,
                                                       MetadataIndex, TensorProperties, TensorStorageMetadata)

    files = [f"__{r}_0.distcp" for r in range(chunks)]
    sdm, storage = {}, {}
    for t in range(tensors):
        fqn, cs = f"layers.{t}.w", []
        for k in range(chunks):
            cs.append(ChunkStorageMetadata(offsets=torch.Size((k * 300, 0)), sizes=torch.Size((300, 70000 + t))))
            storage[MetadataIndex(fqn, (k * 300, 0))] = _StorageInfo(files[k], t * 5000, 4000 + k)
        sdm[fqn] = TensorStorageMetadata(TensorProperties(dtype=torch.bfloat16), torch.Size((300 * chunks, 70000 + t)),
                                         cs)
    sdm["optim.param_groups"] = BytesStorageMetadata()
    storage[MetadataIndex("optim.param_groups")] = _StorageInfo(files[0], 1 << 40, 1024)
    return Metadata(state_dict_metadata=sdm, storage_data=storage, planner_data={k: (k,) for k in sdm})


def _through(data: bytes):
    p = pruned(data)
    assert p is not None
    return pickle.Unpickler(p).load(), p.memo_entries


def test_dcp_metadata_round_trips_with_only_read_back_entries_memoized():
    md = _dcp_metadata()
    data = pickle.dumps(md, protocol=4)
    back, (memoized, kept) = _through(data)
    assert back == md
    assert memoized > 10 * kept and kept < 40  # globals, attribute names, fqns, file names


@pytest.mark.parametrize("protocol", [4, 5])
def test_shared_and_cyclic_objects_keep_their_identity(protocol):
    shared = [1, 2, (3, "x" * 300)]
    cyc: list = ["self"]
    cyc.append(cyc)
    obj = {"a": shared, "b": shared, "c": cyc, "big": "y" * (3 << 20), "long": 1 << 300, "f": 1.5,
           "bytes": b"z" * 70000, "set": {1, 2}, "fs": frozenset({"q"}), "t": (shared, shared), "n": None}
    many = [str(i) for i in range(400)]  # memo indices past 255: LONG_BINGET after renumbering
    obj["many"] = many + many
    back, _ = _through(pickle.dumps(obj, protocol=protocol))
    assert back == {**obj, "c": back["c"]}
    assert back["a"] is back["b"] is back["t"][0] is back["t"][1]
    assert back["c"][1] is back["c"]
    assert all(x is y for x, y in zip(back["many"][:400], back["many"][400:]))


@pytest.mark.parametrize("data", [
    pickle.dumps({"a": [1, 2]}, protocol=0),  # text opcodes
    pickle.dumps({"a": [1, 2]}, protocol=2),  # explicit BINPUT indices
    pickle.dumps({"a": "b" * 10}, protocol=4)[:-3],  # truncated: no STOP
    b"\x80\x04h\x00.",  # a get of an index not memoized yet
    b"\x80\x04\x8c\xff" + b"a" * 10 + b".",  # an argument running past the end
    b"\x80\x04\x8b\xff\xff\xff\xff.",  # LONG4 with a negative length
    b"\x80\x04\xfe.",  # an opcode that does not exist
    b"",
])
def test_streams_it_does_not_follow_are_left_alone(data):
    assert pruned(data) is None


def test_hostile_pickle_is_refused_through_the_pruned_stream(tmp_path):
    class Evil:
        def __reduce__(self):
            return (os.system, ("echo owned > " + str(tmp_path / "owned"),))

    for protocol in (2, 4, 5):
        data = pickle.dumps({"x": [Evil(), Evil()]}, protocol=protocol)
        assert (pruned(data) is None) == (protocol == 2)
        with pytest.raises(CheckpointFormatError, match="refusing to unpickle (posix|os).system"):
            dcpmeta.table_of_pickle(data, "hostile/.metadata", dcp_layout._MetadataUnpickler)
    assert not (tmp_path / "owned").exists()


def _decode(data: bytes, prune: bool, monkeypatch):
    if not prune:
        monkeypatch.setattr(dcpmeta, "_pruned", lambda stream: stream)
    out = dcpmeta.decode(lambda: io.BytesIO(data), "m/.metadata", dcp_layout._MetadataUnpickler)
    monkeypatch.undo()
    return out


def test_pruned_decode_gives_the_same_table_as_the_plain_stream_and_dcp_objects(monkeypatch):
    md = _dcp_metadata(tensors=9, chunks=7)
    data = pickle.dumps(md, protocol=4)
    seen = []
    real = dcpmeta._pruned
    monkeypatch.setattr(dcpmeta, "_pruned", lambda s: seen.append(real(s)) or seen[-1])
    fast = dcpmeta.decode(lambda: io.BytesIO(data), "m/.metadata", dcp_layout._MetadataUnpickler)
    monkeypatch.undo()
    assert type(seen[0]).__name__ == "PrunedStream"  # the fast path did read the pruned stream
    plain = _decode(data, False, monkeypatch)
    cols = dcpmeta._Columns()
    exact = dcpmeta._table(cols, *dcpmeta._columns_of_objects(md, cols, "m/.metadata"), "m/.metadata")
    for other in (plain, exact):
        assert fast[1] == other[1]
        assert fast[0].keys() == other[0].keys()
        for k in fast[0]:
            assert np.array_equal(fast[0][k], other[0][k]), k


def test_simulated_dcp_checkpoint_decodes_alike_either_way(tmp_path, monkeypatch):
    """The simulation's own ``.metadata`` (written in a child process) through both streams."""
    from pipeload.tools.simulate import Layout

    lay = Layout("fsdp", 16)
    lay.reps = sorted({lay.class_of(r): r for r in range(lay.world)}.values())
    size, n_chunks = simforeign._forked(lambda: simforeign.write_dcp(lay, str(tmp_path)))
    data = open(tmp_path / ".metadata", "rb").read()
    assert size == len(data) and n_chunks > 100
    new, old = _decode(data, True, monkeypatch), _decode(data, False, monkeypatch)
    assert new[1] == old[1] and all(np.array_equal(new[0][k], old[0][k]) for k in new[0])
    assert len(new[0]["chunk_file"]) == n_chunks


def test_forked_reports_the_childs_error():
    with pytest.raises(RuntimeError, match="ZeroDivisionError"):
        simforeign._forked(lambda: 1 // 0)
    assert simforeign._forked(lambda: ("ok", 3)) == ("ok", 3)
