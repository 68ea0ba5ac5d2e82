"""Foreign layouts in one process: torch DCP and Hugging Face checkpoints written by their own tools.

Detection, the DCP metadata allow-list (a hostile pickle runs no code), in-place reads of DCP's
torch.save blobs and the torch.load fallback, HF forms and their errors, key_map, cast, and the
inspect / verify / convert commands on every layout. The multi-rank loads are in test_formats_dist.py.
"""

from __future__ import annotations

import io
import json
import os
import pickle

import pytest
import torch
from safetensors.torch import save_file

import pipeload
from pipeload.tools.cli import main
from pipeload.errors import CheckpointFormatError, StateDictError
from pipeload.formats import detect, open_checkpoint
from pipeload.formats.dcp import DistcpFile
from pipeload.tools.inspect import inspect_checkpoint, verify_checkpoint

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def _values():
    g = torch.Generator().manual_seed(3)
    return {
        "model": {
            "w": torch.randn(6, 5, generator=g).to(torch.bfloat16),
            "b": torch.randn(5, generator=g, dtype=torch.float64),
            "ids": torch.arange(7),
            "mask": torch.rand(4, 3, generator=g) > 0.5,
            "scale": torch.tensor(2.5),
            "empty": torch.zeros(0, 3),
        },
        "optim": {"param_groups": [{"lr": 0.1, "betas": (0.9, 0.95), "params": ["model.w"]}]},
        "step": 11,
    }


def _zeros_like(sd):
    if isinstance(sd, dict):
        return {k: _zeros_like(v) for k, v in sd.items()}
    if isinstance(sd, list):
        return [_zeros_like(v) for v in sd]
    if isinstance(sd, torch.Tensor):
        return torch.zeros_like(sd)
    return None


def _assert_equal(a, b):
    if isinstance(a, dict):
        assert a.keys() == b.keys()
        for k in a:
            _assert_equal(a[k], b[k])
    elif isinstance(a, list):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            _assert_equal(x, y)
    elif isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    else:
        assert a == b


@pytest.fixture(scope="module")
def dcp_dir(tmp_path_factory):
    import torch.distributed.checkpoint as dcp

    path = str(tmp_path_factory.mktemp("dcp") / "ckpt")
    dcp.save(_values(), checkpoint_id=path)
    return path


# -- DCP ---------------------------------------------------------------------------------------------


def test_dcp_loads_in_place(dcp_dir):
    assert detect(dcp_dir) == "dcp"
    sd = _zeros_like(_values())
    stats = pipeload.load(sd, dcp_dir)
    _assert_equal(sd, _values())
    assert stats.format == "dcp" and stats.objects == 4
    # every tensor chunk was located inside its torch.save blob, none decoded with torch.load
    ckpt = open_checkpoint(dcp_dir)
    for name in ckpt.metadata.files:
        f = ckpt.opener(os.path.join(dcp_dir, name))
        for t in ckpt.metadata.tensors.values():
            for c in t.chunks:
                if c.file == name:
                    f.buffer(c.key)
        assert f.fallbacks == 0
        f.close()


class Payload:
    """A class that is not DCP metadata: pickled inside a .metadata, it must be refused."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_dcp_metadata_refuses_foreign_class(tmp_path, dcp_dir):
    marker = tmp_path / "ran"
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / ".metadata").write_bytes(pickle.dumps(Payload(str(marker))))
    for fmt in (None, "dcp"):
        with pytest.raises(pipeload.PipeloadError, match=r"refusing to unpickle posix\.system"):
            pipeload.load({}, str(bad), format=fmt)
    with pytest.raises(CheckpointFormatError, match=r"posix\.system"):
        open_checkpoint(str(bad))
    assert not marker.exists()
    # a genuine DCP Metadata carrying an object of another class in a field: refused, naming the class
    from pipeload.formats.dcp import load_dcp_metadata

    md = load_dcp_metadata((open(os.path.join(dcp_dir, ".metadata"), "rb").read()), "x")
    md.planner_data = {"x": Counterfeit()}
    (bad / ".metadata").write_bytes(pickle.dumps(md))
    with pytest.raises(pipeload.PipeloadError, match=r"test_formats\.Counterfeit"):
        pipeload.load({}, str(bad))
    assert verify_checkpoint(str(bad))[0].count("Counterfeit") == 1


class Counterfeit:
    pass


def _handmade_dcp(path: str, blobs: dict[str, tuple[torch.Tensor, bytes]]):
    """A DCP layout built from torch's own metadata classes, with chosen torch.save blobs."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import (
        ChunkStorageMetadata,
        Metadata,
        MetadataIndex,
        TensorProperties,
        TensorStorageMetadata,
    )

    os.makedirs(path)
    sdm, storage, data = {}, {}, b""
    for fqn, (t, blob) in blobs.items():
        zero = torch.Size([0] * t.dim())
        sdm[fqn] = TensorStorageMetadata(TensorProperties(dtype=t.dtype), t.shape, [ChunkStorageMetadata(zero, t.shape)])
        storage[MetadataIndex(fqn, zero, 0)] = _StorageInfo("__0_0.distcp", len(data), len(blob))
        data += blob
    with open(os.path.join(path, "__0_0.distcp"), "wb") as f:
        f.write(data)
    with open(os.path.join(path, ".metadata"), "wb") as f:
        pickle.dump(Metadata(state_dict_metadata=sdm, storage_data=storage), f)


def _saved(t, **kw) -> bytes:
    b = io.BytesIO()
    torch.save(t, b, **kw)
    return b.getvalue()


def _with_comment(blob: bytes, comment: bytes) -> bytes:
    """A torch.save zip with an archive comment: its end record is no longer the last 22 bytes."""
    assert blob[-22:-18] == b"PK\x05\x06" and blob[-2:] == b"\x00\x00"
    return blob[:-2] + len(comment).to_bytes(2, "little") + comment


def test_dcp_unexpected_blobs_fall_back_to_torch_load(tmp_path):
    base = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    wide = torch.arange(40, dtype=torch.int32)
    blobs = {
        "plain": (base, _saved(base)),
        "commented": (base * 3, _with_comment(_saved(base * 3), b"an archive comment")),
        "transposed": (base.t(), _saved(base.t())),  # strided: not read in place
        "legacy": (base + 1, _saved(base + 1, _use_new_zipfile_serialization=False)),  # not a zip
        "view": (wide[10:20], _saved(wide[10:20])),  # a view: the whole storage is saved, offset 10
    }
    path = str(tmp_path / "hand")
    _handmade_dcp(path, blobs)
    sd = {k: torch.zeros_like(t) for k, (t, _) in blobs.items()}
    pipeload.load(sd, path)
    for k, (t, _) in blobs.items():
        assert torch.equal(sd[k], t), k
    ckpt = open_checkpoint(path)
    f = ckpt.opener(os.path.join(path, "__0_0.distcp"))
    assert isinstance(f, DistcpFile)
    for k in blobs:
        f.buffer(f"{k}@" + ",".join(["0"] * blobs[k][0].dim()))
    assert f.fallbacks == 2  # transposed and legacy; plain, commented and view were read in place
    f.close()
    # a blob that is no tensor at all: an error naming the file and the item, on load and on verify
    path2 = str(tmp_path / "broken")
    _handmade_dcp(path2, {"x": (base, b"PK\x03\x04 not really a zip" + bytes(50))})
    with pytest.raises(pipeload.PipeloadError, match=r"__0_0\.distcp.*'x'"):
        pipeload.load({"x": torch.zeros(3, 4)}, path2)
    assert any("'x'" in p for p in verify_checkpoint(path2))


def test_dcp_blobs_are_located_from_their_head():
    """A tensor in a torch.save blob is located by the local headers before it (the pages its reader
    reads anyway), giving the directory's answer; the zip directory at the end is not needed: a blob
    whose trailer is overwritten still resolves, and one that is no torch.save layout is refused."""
    from pipeload.formats import dcp as D

    cases = [torch.arange(25600, dtype=torch.float32), torch.zeros(0), torch.ones(3, 4, dtype=torch.bfloat16),
             torch.arange(100.0)[10:30], torch.arange(64, dtype=torch.int8).reshape(8, 8)[2:5], torch.tensor(3.5)]
    for t in cases:
        blob = _saved(t)
        where = D._walk_records(memoryview(blob), t.dtype, tuple(t.shape))
        assert where == D._locate_by_directory(memoryview(blob), t.dtype, tuple(t.shape))
        assert blob[where[0] : where[1]] == t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
        scrambled = memoryview(blob[: where[1]] + bytes(len(blob) - where[1]))  # trailer and directory gone
        assert D.locate_tensor(scrambled, t.dtype, tuple(t.shape)) == where
        with pytest.raises(D._Unexpected):
            D._locate_by_directory(scrambled, t.dtype, tuple(t.shape))
    t = torch.arange(12.0).reshape(3, 4).t()
    with pytest.raises(D._Unexpected, match="contiguous"):
        D._walk_records(memoryview(_saved(t)), t.dtype, tuple(t.shape))


# -- HF ----------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def hf_tensors():
    g = torch.Generator().manual_seed(5)
    return {
        "embed.weight": torch.randn(10, 4, generator=g),
        "layers.0.w": torch.randn(4, 4, generator=g).to(torch.bfloat16),
        "layers.1.w": torch.randn(4, 4, generator=g).to(torch.bfloat16),
        "norm.weight": torch.randn(4, generator=g),
    }


def test_hf_forms(tmp_path, hf_tensors):
    # one file, loaded by its path; __metadata__ kept
    single = tmp_path / "model.safetensors"
    save_file(hf_tensors, str(single), metadata={"format": "pt", "origin": "test"})
    sd = {k: torch.zeros_like(v) for k, v in hf_tensors.items()}
    assert pipeload.load(sd, str(single), verify_checksums=True).format == "hf"  # none recorded: skipped
    _assert_equal(sd, hf_tensors)
    info = inspect_checkpoint(str(single))
    assert info["format"] == "hf" and info["file_metadata"] == {"model.safetensors": {"format": "pt", "origin": "test"}}
    # a directory of files without an index
    d = tmp_path / "noindex"
    d.mkdir()
    names = sorted(hf_tensors)
    save_file({k: hf_tensors[k] for k in names[:2]}, str(d / "a.safetensors"))
    save_file({k: hf_tensors[k] for k in names[2:]}, str(d / "b.safetensors"))
    sd = {"model": {k: torch.zeros_like(v) for k, v in hf_tensors.items()}}
    pipeload.load(sd, str(d), key_map={k: f"model.{k}" for k in hf_tensors})
    _assert_equal(sd["model"], hf_tensors)
    # strict works on mapped names: a state dict key no mapped name matches is missing
    sd = {"model": {k: torch.zeros_like(v) for k, v in hf_tensors.items()}}
    with pytest.raises(StateDictError, match=r"'model\.norm\.weight': missing from the checkpoint"):
        pipeload.load(sd, str(d), key_map=lambda k: None if k == "norm.weight" else f"model.{k}")
    stats = pipeload.load(sd, str(d), strict=False, key_map=lambda k: None if k == "norm.weight" else f"model.{k}")
    assert stats.missing_keys == ["model.norm.weight"]


def test_hf_table_of_whole_tensors_is_the_chunked_table(tmp_path, hf_tensors):
    # the column-built table of whole-tensor files is the table the chunk-by-chunk path builds, byte for byte
    from pipeload.formats import hf

    d = tmp_path / "two"
    d.mkdir()
    more = {**hf_tensors, "scalar": torch.tensor(3.0), "cube": torch.arange(24, dtype=torch.int16).reshape(2, 3, 4),
            "unlisted": torch.ones(2)}
    save_file({k: more[k] for k in ("embed.weight", "scalar", "cube")}, str(d / "a.safetensors"), metadata={"m": "1"})
    save_file({k: more[k] for k in ("layers.0.w", "layers.1.w", "norm.weight", "unlisted")}, str(d / "b.safetensors"))
    raws = {"dir": (str(d), hf.read_raw(str(d)))}
    index = {"weight_map": {k: ("a" if k in ("embed.weight", "scalar", "cube") else "b") + ".safetensors"
                            for k in more if k != "unlisted"}}
    (d / "model.safetensors.index.json").write_text(json.dumps(index))
    raws["index"] = (str(d), hf.read_raw(str(d)))
    raws["single"] = (str(d / "a.safetensors"), hf.read_raw(str(d / "a.safetensors")))
    for form, (path, raw) in raws.items():
        assert bytes(hf._whole_table(raw, path)) == bytes(hf._chunked_table(raw, path)), form
    # an unknown dtype is named with its file
    raw = hf.read_raw(str(d))
    raw["headers"]["b.safetensors"]["norm.weight"] = ("Q7", [4], 0, 4)
    with pytest.raises(CheckpointFormatError, match=r"b.safetensors: tensor 'norm.weight' has dtype Q7"):
        hf.table_of(raw, str(d))


def test_hf_headers_read_at_once_name_the_first_bad_file(tmp_path, hf_tensors):
    # rank 0 reads the files' headers concurrently; a damaged one is still named, the first in order
    for i in range(5):
        save_file({f"l{i}.{k}": v for k, v in hf_tensors.items()}, str(tmp_path / f"m-{i}.safetensors"))
    for i in (1, 3):
        with open(tmp_path / f"m-{i}.safetensors", "r+b") as f:
            f.write(b"\xff" * 8)  # a header length past the file's end
    with pytest.raises(pipeload.PipeloadError, match=r"m-1\.safetensors"):
        pipeload.load({}, str(tmp_path), format="hf")


def test_hf_errors(tmp_path, hf_tensors):
    d = tmp_path / "dup"
    d.mkdir()
    save_file(hf_tensors, str(d / "a.safetensors"))
    save_file({"norm.weight": hf_tensors["norm.weight"]}, str(d / "b.safetensors"))
    with pytest.raises(pipeload.PipeloadError, match=r"'norm.weight' is in several files \(a.safetensors, b.safetensors\)"):
        pipeload.load({}, str(d))
    # with an index, the index decides: the duplicate is ignored; a tensor it names must exist
    index = {"weight_map": {k: "a.safetensors" for k in hf_tensors}}
    (d / "model.safetensors.index.json").write_text(json.dumps(index))
    sd = {k: torch.zeros_like(v) for k, v in hf_tensors.items()}
    pipeload.load(sd, str(d))
    _assert_equal(sd, hf_tensors)
    with pytest.raises(pipeload.PipeloadError, match=r"maps both"):
        pipeload.load({}, str(d), format="hf", key_map=lambda k: "same")
    index["weight_map"]["gone"] = "b.safetensors"
    (d / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(pipeload.PipeloadError, match=r"tensor 'gone' is not in b.safetensors"):
        pipeload.load({}, str(d))
    # a dtype mismatch without cast names every such tensor; with cast it converts
    single = tmp_path / "m.safetensors"
    save_file(hf_tensors, str(single))
    sd = {k: torch.zeros(v.shape, dtype=torch.float32) for k, v in hf_tensors.items()}
    with pytest.raises(StateDictError) as e:
        pipeload.load(sd, str(single))
    assert "layers.0.w" in str(e.value) and "layers.1.w" in str(e.value)
    pipeload.load(sd, str(single), cast=True)
    for k, v in hf_tensors.items():
        assert torch.equal(sd[k], v.float())
    with pytest.raises(pipeload.PipeloadError, match="not a pipeload checkpoint"):
        pipeload.load({}, str(tmp_path / "nothing-here"))


def test_hf_parts_of_two_saves_name_both_files(tmp_path):
    """Parts of a tensor (DCP's sharding info) left by two saves into one directory overlap: the refusal
    names the tensor and the two files whose parts overlap; a gap names the files that hold parts."""
    full = torch.arange(6 * 2, dtype=torch.float32).reshape(6, 2)

    def part(name: str, lo: int, hi: int) -> None:
        save_file({"w": full[lo:hi].contiguous()}, str(tmp_path / name),
                  metadata={"DCP_SHARDING_INFO": json.dumps({"w": {"saved_offsets": [lo, 0]}})})

    part("shard-00001-of-00002.safetensors", 0, 3)  # the first save: rows 0-2 and 3-5
    part("shard-00002-of-00002.safetensors", 3, 6)
    part("shard-00001-of-00003.safetensors", 0, 2)  # the second: rows 0-1, ...
    with pytest.raises(pipeload.PipeloadError) as e:
        pipeload.load({"w": torch.zeros(6, 2)}, str(tmp_path), format="hf")
    text = str(e.value)
    assert "'w'" in text and "shard-00001-of-00002.safetensors" in text and "shard-00001-of-00003.safetensors" in text
    assert "two saves" in text, text
    os.unlink(tmp_path / "shard-00001-of-00003.safetensors")
    part("shard-00002-of-00002.safetensors", 4, 6)  # row 3 missing
    with pytest.raises(pipeload.PipeloadError, match=r"gap or overlap\) \(chunks in shard-00001-of-00002"):
        pipeload.load({"w": torch.zeros(6, 2)}, str(tmp_path), format="hf")


def test_hf_tied_weights(tmp_path):
    """A model with tied embeddings (``lm_head.weight`` is ``embed.weight``) from a Hugging Face file that
    stores one of them loads strictly: filling one fills both. A key that only shares memory in another
    shape, or does not share it, is still missing."""

    class Tied(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = torch.nn.Embedding(10, 4)
            self.lm_head = torch.nn.Linear(4, 10, bias=False)
            self.lm_head.weight = self.embed.weight

    stored = torch.arange(40.0).reshape(10, 4)
    path = str(tmp_path / "model.safetensors")
    save_file({"embed.weight": stored}, path)
    model = Tied()
    sd = model.state_dict()
    stats = pipeload.load(sd, path)
    assert torch.equal(model.embed.weight, stored) and torch.equal(model.lm_head.weight, stored)
    assert not stats.missing_keys
    seen = {"embed.weight": torch.zeros(10, 4), "head": torch.zeros(10, 4)}  # equal values, not the same memory
    view = {"embed.weight": seen["embed.weight"], "flat": seen["embed.weight"].view(40)}
    for bad, key in ((seen, "head"), (view, "flat")):
        with pytest.raises(StateDictError, match=f"'{key}': missing from the checkpoint"):
            pipeload.load(bad, path)
        assert pipeload.load(bad, path, strict=False).missing_keys == [key]


def test_missing_keys_under_a_prefix_name_the_key_map(tmp_path):
    """A state dict whose keys are the checkpoint's with a prefix added (DDP's ``module.``) or removed (a
    wrapper's ``model.``): the refusal names the key_map that loads it, and that key_map does."""
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    pipeload.save(model.state_dict(), str(tmp_path / "plain"))
    pipeload.save({"model." + k: v for k, v in model.state_dict().items()}, str(tmp_path / "wrapped"))
    for prefix, ckpt, key_map in (("module.", "plain", lambda k: "module." + k),
                                  ("", "wrapped", lambda k: k.removeprefix("model."))):
        sd = {prefix + k: torch.zeros_like(v) for k, v in model.state_dict().items()}
        with pytest.raises(StateDictError) as e:
            pipeload.load(sd, str(tmp_path / ckpt))
        hint = "'module.' + k" if prefix else "k.removeprefix('model.')"
        assert f"pass key_map=lambda k: {hint}" in str(e.value), str(e.value)
        pipeload.load(sd, str(tmp_path / ckpt), key_map=key_map)
        for k, v in model.state_dict().items():
            assert torch.equal(sd[prefix + k], v)
    sd = {"module.0.weight": torch.zeros(4, 4), "other": torch.zeros(1)}  # no one prefix explains both
    with pytest.raises(StateDictError) as e:
        pipeload.load(sd, str(tmp_path / "plain"))
    assert "key_map" not in str(e.value)


# -- tools -------------------------------------------------------------------------------------------


def test_inspect_verify_convert(tmp_path, dcp_dir, capsys):
    assert main(["inspect", dcp_dir]) == 0
    assert "layout      dcp" in capsys.readouterr().out
    assert main(["verify", dcp_dir]) == 0
    # DCP -> pipeload: same values, checksums recorded and verified
    pl = str(tmp_path / "pl")
    assert main(["convert", dcp_dir, pl]) == 0
    assert detect(pl) == "pipeload" and verify_checkpoint(pl) == []
    sd = _zeros_like(_values())
    pipeload.load(sd, pl)
    _assert_equal(sd, _values())
    # pipeload -> HF, sharded small: an index, whole tensors, objects left out
    hf = str(tmp_path / "hf")
    assert main(["convert", pl, hf, "--to", "hf", "--max-file-size", "0.0001"]) == 0
    assert "left out" in capsys.readouterr().out
    files = sorted(os.listdir(hf))
    assert "model.safetensors.index.json" in files and sum(f.endswith(".safetensors") for f in files) >= 2
    assert main(["inspect", hf]) == 0 and main(["verify", hf]) == 0
    sd = _zeros_like(_values()["model"])
    pipeload.load(sd, hf, key_map=lambda k: k.removeprefix("model."))
    _assert_equal(sd, _values()["model"])
    # verify finds damage in a DCP file
    broken = tmp_path / "broken"
    os.makedirs(broken)
    for name in os.listdir(dcp_dir):
        data = open(os.path.join(dcp_dir, name), "rb").read()
        (broken / name).write_bytes(data[: len(data) // 2] if name.endswith(".distcp") else data)
    capsys.readouterr()
    assert main(["verify", str(broken)]) == 1
    assert "__0_0.distcp" in capsys.readouterr().err


def test_rawfile_views(tmp_path):
    from pipeload.io._fastio import FileCache, RawFile
    from pipeload.errors import ReadError

    p = tmp_path / "blob.bin"
    p.write_bytes(bytes(range(256)) * 64)
    f = RawFile(str(p))
    v = f.view(250, 12)
    assert bytes(v) == bytes(range(250, 256)) + bytes(range(6)) and f.size == 16384
    with pytest.raises(ReadError, match=r"blob\.bin: byte range \[16380, 16390\) runs past the end"):
        f.view(16380, 10)
    with pytest.raises(ValueError):
        f.view(-1, 2)
    f.willneed(0, 10**9)  # clipped, never raises
    f.close()
    assert bytes(v[:2]) == bytes([250, 251])  # views outlive close()
    with pytest.raises(ValueError, match="closed"):
        f.view(0, 1)
    cache = FileCache(1, opener=RawFile)
    a = cache.get(str(p))
    assert isinstance(a, RawFile) and cache.get(str(p)) is a and cache.opens == 1


def test_payload_is_decoded_against_each_ranks_own_path(tmp_path, dcp_dir, hf_tensors):
    """Rank 0 reads the metadata, but every rank reads data from the path it was given (a copy per node)."""
    import shutil

    from pipeload.formats import from_payload, read_payload

    single = tmp_path / "a" / "model.safetensors"
    single.parent.mkdir()
    save_file(hf_tensors, str(single))
    cases = [(dcp_dir, str(tmp_path / "dcp-copy")), (str(single.parent), str(tmp_path / "hf-copy"))]
    for src, copy in cases:
        shutil.copytree(src, copy)
        ckpt = from_payload(read_payload(src), copy)
        assert ckpt.root == copy
    ckpt = from_payload(read_payload(str(single)), str(tmp_path / "hf-copy" / "model.safetensors"))
    assert ckpt.root == str(tmp_path / "hf-copy")


def test_cast_converts_an_indexed_table_as_dcp_load_does(tmp_path):
    """A DCP checkpoint (its chunk table indexed, not decoded) loaded into destinations of other dtypes
    with ``cast=True``, and through ``dcp.load`` under the switch (which passes it): values converted as
    ``copy_`` converts them, the other tensors untouched by the dtype change."""
    import warnings

    import torch.distributed.checkpoint as dcp

    import pipeload.dcp as pd

    warnings.filterwarnings("ignore")
    torch.manual_seed(0)
    saved = {"a": torch.randn(4, 3), "b": torch.randn(5).to(torch.bfloat16), "c": torch.arange(6)}
    dcp.save(saved, checkpoint_id=str(tmp_path), no_dist=True)
    want = {"a": saved["a"].double(), "b": saved["b"].float(), "c": saved["c"]}
    dest = {k: torch.zeros_like(v) for k, v in want.items()}
    pipeload.load(dest, str(tmp_path), cast=True)
    assert all(torch.equal(dest[k], want[k]) and dest[k].dtype == want[k].dtype for k in want)
    dest = {k: torch.zeros_like(v) for k, v in want.items()}
    with pd.installed():
        dcp.load(dest, checkpoint_id=str(tmp_path), no_dist=True)
    assert pd.last_load().path == "engine", pd.last_load()
    assert all(torch.equal(dest[k], want[k]) and dest[k].dtype == want[k].dtype for k in want)
