"""pipeload.io._fastio: the mmap reader, checked against safetensors as the oracle, on real files."""

from __future__ import annotations

import gc
import json
import os
import random
import re
import struct
import subprocess
import sys
import threading
import time
import warnings
import weakref

import numpy as np
import pytest
import torch
from safetensors import safe_open
from safetensors.numpy import save_file as np_save_file
from safetensors.torch import save_file as torch_save_file

from pipeload.io import _fastio
from pipeload.io._fastio import DTYPE_BITS, DTYPE_SIZES, FileCache, SafetensorsFile, read_header
from pipeload.errors import CheckpointFormatError, HeaderError, ReadError, TensorNotFoundError

# --------------------------------------------------------------------------------------------------
# helpers


def raw_file(path, header, data=b"", hlen=None) -> str:
    """Write a safetensors file byte by byte: 8-byte length, header, data."""
    hb = header.encode() if isinstance(header, str) else header
    with open(path, "wb") as fh:
        fh.write(struct.pack("<Q", len(hb) if hlen is None else hlen) + hb + data)
    return str(path)


def entry_json(dtype, shape, start, end) -> str:
    return json.dumps({"dtype": dtype, "shape": list(shape), "data_offsets": [start, end]})


def oracle(path):
    """safetensors' reading of a file: (names -> (dtype, shape), metadata), or raises."""
    with safe_open(str(path), framework="np") as f:
        info = {k: (f.get_slice(k).get_dtype(), tuple(f.get_slice(k).get_shape())) for k in f.keys()}
        return info, f.metadata()


def ours(path):
    with SafetensorsFile(path) as f:
        return {k: f.entry(k)[:2] for k in f.keys()}, f.metadata


def mapped(path) -> bool:
    """Is `path` mapped into this process?"""
    real = os.path.realpath(path)
    with open("/proc/self/maps") as fh:
        return any(line.rstrip("\n").endswith(" " + real) or line.rstrip("\n").endswith(" " + real + " (deleted)")
                   for line in fh)


def check_like_oracle(path, expected_bytes: dict[str, bytes] | None = None):
    """pipeload reads exactly what safetensors reads; the bytes are the ones written."""
    ref_info, ref_md = oracle(path)
    with SafetensorsFile(path) as f:
        assert set(f.keys()) == set(ref_info)
        assert len(f) == len(ref_info)
        for k, (dtype, shape) in ref_info.items():
            assert k in f
            got_dtype, got_shape, start, end = f.entry(k)
            assert (got_dtype, got_shape) == (dtype, shape), k
            buf = f.buffer(k)
            assert buf.format == "B" and buf.ndim == 1 and not buf.readonly
            assert buf.nbytes == end - start
            assert bytes(f.span(start, end)) == bytes(buf)
            if expected_bytes is not None:
                assert bytes(buf) == expected_bytes[k], k
        # keys() in file order, tiling the data section from data_offset to the end
        pos = f.data_offset
        for k in f.keys():
            _, _, start, end = f.entry(k)
            assert start == pos
            pos = end
        assert pos == f.size == os.path.getsize(path)
        assert f.metadata == ref_md


ALL_DTYPES = ["BOOL", "F4", "F6_E2M3", "F6_E3M2", "U8", "I8", "F8_E5M2", "F8_E4M3", "F8_E8M0",
              "F8_E4M3FNUZ", "F8_E5M2FNUZ", "I16", "U16", "F16", "BF16", "I32", "U32", "F32", "C64",
              "F64", "I64", "U64"]


# --------------------------------------------------------------------------------------------------
# valid files: same reading as safetensors


NP_DTYPES = [np.bool_, np.uint8, np.int8, np.int16, np.uint16, np.int32, np.uint32, np.int64,
             np.uint64, np.float16, np.float32, np.float64, np.complex64]


@pytest.mark.parametrize("seed", range(6))
def test_numpy_written_files_read_like_safetensors(tmp_path, seed):
    rng = np.random.default_rng(seed)
    arrays = {}
    for i in range(int(rng.integers(1, 12))):
        dt = NP_DTYPES[int(rng.integers(len(NP_DTYPES)))]
        kind = rng.random()
        shape = () if kind < 0.15 else (0, 3) if kind < 0.3 else tuple(int(d) for d in rng.integers(1, 5, rng.integers(1, 4)))
        raw = rng.integers(0, 256, int(np.prod(shape, dtype=np.int64)) * np.dtype(dt).itemsize, dtype=np.uint8)
        a = raw.view(dt).reshape(shape) if dt is not np.bool_ else (raw % 2).astype(np.bool_).reshape(shape)
        arrays[f"layer{i}.{'w' if i % 2 else 'bias'}.ü"] = a
    metadata = {"format": "np", "seed": str(seed), "ünï": "v\n\"q\""} if seed % 2 else None
    path = str(tmp_path / "np.safetensors")
    np_save_file(arrays, path, metadata=metadata)
    check_like_oracle(path, {k: a.tobytes() for k, a in arrays.items()})


def _torch_tensor(dtype: torch.dtype, shape, gen: torch.Generator) -> torch.Tensor:
    n = 1
    for d in shape:
        n *= d
    raw = torch.randint(0, 256, (n * dtype.itemsize,), dtype=torch.uint8, generator=gen)
    if dtype == torch.bool:
        raw = raw % 2
    return raw.view(dtype).reshape(shape)


TORCH_DTYPES = [torch.bool, torch.uint8, torch.int8, torch.int16, torch.uint16, torch.int32, torch.uint32,
                torch.int64, torch.uint64, torch.float16, torch.bfloat16, torch.float32, torch.float64,
                torch.complex64, torch.float8_e4m3fn, torch.float8_e5m2, torch.float8_e4m3fnuz,
                torch.float8_e5m2fnuz, torch.float8_e8m0fnu, torch.float4_e2m1fn_x2]


def test_torch_written_files_all_dtypes_zero_copy(tmp_path):
    gen = torch.Generator().manual_seed(0)
    tensors = {}
    for i, dt in enumerate(TORCH_DTYPES):
        tensors[f"t{i}.{str(dt).split('.')[-1]}"] = _torch_tensor(dt, (3, 2 + i % 3), gen)
        tensors[f"s{i}"] = _torch_tensor(dt, (), gen) if dt != torch.float4_e2m1fn_x2 else _torch_tensor(dt, (1,), gen)
        tensors[f"z{i}"] = _torch_tensor(dt, (0, 4), gen)
    path = str(tmp_path / "pt.safetensors")
    torch_save_file(tensors, path, metadata={"format": "pt"})
    expected = {k: bytes(t.contiguous().reshape(-1).view(torch.uint8).numpy()) for k, t in tensors.items()}
    check_like_oracle(path, expected)
    # zero-copy torch views equal what safetensors loads, bit for bit
    with SafetensorsFile(path) as f, safe_open(path, framework="pt") as ref:
        for k, t in tensors.items():
            buf = f.buffer(k)
            if buf.nbytes == 0:
                continue
            with warnings.catch_warnings():
                warnings.simplefilter("error")     # a read-only buffer would warn here
                u8 = torch.frombuffer(buf, dtype=torch.uint8)
            assert u8.data_ptr() == np.frombuffer(buf, np.uint8).ctypes.data    # no copy
            got = u8.view(t.dtype).reshape(t.shape)
            want = ref.get_tensor(k)
            assert torch.equal(got.reshape(-1).view(torch.uint8), want.reshape(-1).view(torch.uint8))
    assert f.closed


def test_hand_built_headers_every_dtype_and_spelling(tmp_path):
    """Spellings safetensors accepts that its writers never produce: padding on both sides, escapes,
    [dtype, shape, offsets] entries, {"F32": null} dtypes, extra fields, any entry order, all 22
    dtypes including the sub-byte ones."""
    rng = random.Random(5)
    parts, data, expected, off = [], b"", {}, 0
    for i, dt in enumerate(ALL_DTYPES):
        bits = DTYPE_BITS[dt]
        shape = [2, 4] if bits < 8 else ([] if i % 3 == 0 else [i % 4, 3])
        nbytes = (2 * 4 * bits) // 8 if bits < 8 else (1 if not shape else shape[0] * shape[1]) * bits // 8
        payload = rng.randbytes(nbytes)
        name = f"w.{i}.\u00e9\U0001F600" if i % 2 else f"w.{i}"
        expected[name] = payload
        key = json.dumps(name, ensure_ascii=bool(i % 4 == 1))  # \ud83d\ude00 surrogate pair when ascii
        if i % 5 == 0:
            val = f'[{json.dumps(dt)}, {json.dumps(shape)}, [{off}, {off + nbytes}]]'
        elif i % 5 == 1:
            val = f'{{"data_offsets":[{off},{off + nbytes}], "x": {{"y": [1e300, null, "\\u00e9"]}},' \
                  f' "dtype": {{"{dt}": null}}, "shape": {json.dumps(shape)}}}'
        elif i % 5 == 2:
            val = '{"dt\\u0079pe": "%s", "shape": %s, "data_offsets": [%d, %d]}' % (dt, json.dumps(shape), off, off + nbytes)
        else:
            val = entry_json(dt, shape, off, off + nbytes)
        parts.append(f"{key}:{val}")
        data += payload
        off += nbytes
    rng.shuffle(parts)
    header = '\n\t {"\\u005f_metadata__": {"k\\n": "v\\u00e9", "k\\n": "last"},' + ",\n".join(parts) + "}  \r\n  "
    path = raw_file(tmp_path / "hand.safetensors", header, data)
    check_like_oracle(path, expected)
    with SafetensorsFile(path) as f:
        assert f.metadata == {"k\n": "last"}
        assert f.data_offset == 8 + len(header.encode())
        assert sorted(f.keys()) == sorted(expected)


def test_string_scanning_at_every_length_and_position(tmp_path):
    """Names of 0..40 characters with an escape, a non-ASCII or a control character at each
    position: the 8-bytes-at-a-time string scan must find every one of them."""
    names = {}
    for n in range(0, 41):
        for pos in range(0, n + 1, 3):
            base = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQ"[:n]
            for ins, spelled in (('"', '\\"'), ("\\", "\\\\"), ("\n", "\\n"), ("é", "é"), ("\x7f", "\x7f"),
                                 ("😀", "\\ud83d\\ude00"), ("/", "\\/")):
                names[base[:pos] + ins + base[pos:]] = '"' + base[:pos] + spelled + base[pos:] + '"'
    body = ",".join(f'{spelled}:{entry_json("U8", [1], i, i + 1)}' for i, spelled in enumerate(names.values()))
    path = raw_file(tmp_path / "names.safetensors", "{" + body + "}", bytes(range(256)) * (len(names) // 256 + 1))
    with open(path, "r+b") as fh:
        fh.truncate(8 + len(("{" + body + "}").encode()) + len(names))
    check_like_oracle(path, {name: bytes([i % 256]) for i, name in enumerate(names)})
    for ctrl in ("\x00", "\x01", "\x1f", "\t"):
        for n, tail in ((0, 0), (5, 0), (8, 16), (13, 9), (3, 30)):
            name = "x" * n + ctrl + "y" * tail
            p = raw_file(tmp_path / "ctrl.safetensors", '{"%s":%s}' % (name, entry_json("U8", [1], 0, 1)), b"\0")
            with pytest.raises(Exception):
                oracle(p)
            with pytest.raises(HeaderError, match="control character"):
                SafetensorsFile(p)


def test_empty_and_scalar_and_zero_size(tmp_path):
    path = raw_file(tmp_path / "e.safetensors", "{}")
    with SafetensorsFile(path) as f:
        assert len(f) == 0 and f.keys() == [] and f.metadata is None and f.data_offset == 10
    hdr = "{%s,%s,%s}" % ('"a":' + entry_json("F32", [], 0, 4), '"z":' + entry_json("F32", [0, 5], 4, 4),
                          '"y":' + entry_json("I64", [3, 0], 4, 4))
    path = raw_file(tmp_path / "s.safetensors", hdr, b"\x00\x00\x80?")
    check_like_oracle(path, {"a": b"\x00\x00\x80?", "z": b"", "y": b""})
    with SafetensorsFile(path) as f:
        assert f.entry("a") == ("F32", (), f.data_offset, f.data_offset + 4)
        assert f.entry("z")[1] == (0, 5) and f.buffer("z").nbytes == 0
        assert f.keys()[0] == "a"


def test_duplicate_names_last_one_wins_like_safetensors(tmp_path):
    hdr = '{"a":%s,"b":%s,"a":%s}' % (entry_json("F16", [1], 0, 2), entry_json("U8", [2], 2, 4),
                                      entry_json("I32", [1], 4, 8))
    hdr2 = '{"a":%s,"b":%s,"a":%s}' % (entry_json("F16", [1], 0, 2), entry_json("U8", [4], 0, 4),
                                       entry_json("I32", [1], 4, 8))
    # the first "a" is dropped: its bytes [0, 2) are then a hole -> both refuse
    path = raw_file(tmp_path / "d1.safetensors", hdr, bytes(range(8)))
    with pytest.raises(Exception):
        oracle(path)
    with pytest.raises(HeaderError, match="tensor 'b'.*the first tensor must start at 0"):
        SafetensorsFile(path)
    path = raw_file(tmp_path / "d2.safetensors", hdr2, bytes(range(8)))
    check_like_oracle(path, {"b": bytes(range(4)), "a": bytes(range(4, 8))})
    with SafetensorsFile(path) as f:
        assert f.keys() == ["b", "a"] and f.entry("a")[0] == "I32"


def test_many_tensors_out_of_order(tmp_path):
    """A big header (GIL released while scanning) whose entries are not in offset order."""
    n = 5000
    rng = random.Random(3)
    order = list(range(n))
    rng.shuffle(order)
    entries = {f"model.layers.{i}.mlp.weight": (i * 8, i * 8 + 8) for i in range(n)}
    hdr = "{" + ",".join(f'"model.layers.{i}.mlp.weight":' + entry_json("F64", [1], *entries[f"model.layers.{i}.mlp.weight"])
                         for i in order) + "}"
    data = b"".join(struct.pack("<d", float(i)) for i in range(n))
    path = raw_file(tmp_path / "many.safetensors", hdr, data)
    with SafetensorsFile(path) as f:
        assert f.keys() == [f"model.layers.{i}.mlp.weight" for i in range(n)]
        for i in (0, 1, 777, n - 1):
            assert struct.unpack("<d", f.buffer(f"model.layers.{i}.mlp.weight"))[0] == float(i)
    assert set(ours(path)[0]) == set(oracle(path)[0])


def test_dtype_tables_match_safetensors(tmp_path):
    """Exactly the dtype names the installed safetensors accepts, with the sizes it uses."""
    path = raw_file(tmp_path / "bad.safetensors", '{"a":' + entry_json("NOPE", [1], 0, 1) + "}", b"\0")
    with pytest.raises(Exception) as ei:
        oracle(path)
    listed = str(ei.value).split("expected one of")[1]
    names = {s.strip(" `,") for s in listed.split(",")}
    names = {n.split("`")[0].strip() for n in names if n}
    assert set(DTYPE_BITS) == names == set(ALL_DTYPES)
    assert DTYPE_SIZES == {k: v // 8 for k, v in DTYPE_BITS.items() if v % 8 == 0}
    assert {k for k in DTYPE_BITS if k not in DTYPE_SIZES} == {"F4", "F6_E2M3", "F6_E3M2"}
    for dt, bits in DTYPE_BITS.items():
        nbytes = 4 * bits // 8
        p = raw_file(tmp_path / f"{dt}.safetensors", '{"a":' + entry_json(dt, [4], 0, nbytes) + "}", bytes(nbytes))
        assert oracle(p)[0] == ours(p)[0] == {"a": (dt, (4,))}


def test_read_header(tmp_path):
    path = str(tmp_path / "r.safetensors")
    np_save_file({"b": np.arange(3, dtype=np.int16), "a": np.ones((2, 2), np.float32)}, path, metadata={"m": "1"})
    h = read_header(path)
    with SafetensorsFile(path) as f:
        assert h == {**{k: f.entry(k) for k in f.keys()}, "__metadata__": {"m": "1"}}
        assert list(h)[:2] == f.keys()
    np_save_file({"a": np.ones(1, np.uint8)}, path)
    assert read_header(path)["__metadata__"] is None


def test_header_is_not_parsed_with_json_module(tmp_path, monkeypatch):
    path = str(tmp_path / "j.safetensors")
    np_save_file({"a": np.ones(3, np.float32)}, path, metadata={"x": "y"})

    def boom(*a, **k):
        raise AssertionError("json used")

    monkeypatch.setattr(json, "loads", boom)
    monkeypatch.setattr(json, "load", boom)
    with SafetensorsFile(path) as f:
        assert f.entry("a")[:2] == ("F32", (3,)) and f.metadata == {"x": "y"}


def test_module_does_not_import_torch():
    root = os.path.dirname(os.path.dirname(os.path.abspath(_fastio.__file__)))
    code = (
        "import sys, types\n"
        f"pkg = types.ModuleType('pipeload'); pkg.__path__ = [{os.path.join(root, 'pipeload')!r}]\n"
        "sys.modules['pipeload'] = pkg\n"
        "import pipeload.io._fastio\n"
        "assert 'torch' not in sys.modules and 'numpy' not in sys.modules, sorted(sys.modules)\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


# --------------------------------------------------------------------------------------------------
# malformed files: refused by both, HeaderError naming the file and the problem

T = entry_json("F32", [2], 0, 8)

MALFORMED = [
    # (id, file bytes, message fragment)
    ("empty-file", b"", "0 bytes, too short"),
    ("7-bytes", b"\x02\x00\x00\x00\x00\x00\x00", "7 bytes, too short"),
    ("header-over-100M", struct.pack("<Q", 100_000_001) + b"{}", "over the 100,000,000-byte limit"),
    ("header-len-u64-max", struct.pack("<Q", 2**64 - 1) + b"{}", "over the 100,000,000-byte limit"),
    ("header-past-eof", struct.pack("<Q", 50) + b"{}", "runs past the end of the file"),
    ("header-100M-past-eof", struct.pack("<Q", 100_000_000) + b"{}", "runs past the end of the file"),
    ("not-utf8", struct.pack("<Q", 4) + b'{"\xff"', "not valid UTF-8"),
    ("utf8-surrogate", struct.pack("<Q", 6) + b'"\xed\xa0\x80" ', "not valid UTF-8"),
    ("utf8-overlong", struct.pack("<Q", 4) + b'"\xc0\xaf"', "not valid UTF-8"),
    ("empty-header", struct.pack("<Q", 0), "not valid JSON: unexpected end"),
    ("not-json", '{"a": nope}', "not valid JSON"),
    ("trailing-garbage", '{}x', "trailing characters"),
    ("nul-padding", '{}\0\0', "trailing characters"),
    ("trailing-comma", '{"a":%s,}' % T, "trailing comma"),
    ("array-top", "[]", "not an object"),
    ("string-top", '"x"', "not an object"),
    ("lone-surrogate-name", '{"\\ud800":%s}' % T, "unpaired surrogate"),
    ("control-char-name", '{"a\x01":%s}' % T, "control character"),
    ("bad-escape", '{"a\\x":%s}' % T, "invalid escape"),
    ("too-deep", '{"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8],"x":%s}}' % ("[" * 126 + "]" * 126), "deeper than 127"),
    ("float-out-of-range", '{"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8],"x":1e400}}', "number out of range"),
    ("metadata-not-map", '{"__metadata__":["a"],"a":%s}' % T, "__metadata__ must be"),
    ("metadata-int-value", '{"__metadata__":{"a":1},"a":%s}' % T, "__metadata__ must be"),
    ("metadata-twice", '{"__metadata__":{},"__metadata__":{},"a":%s}' % T, "__metadata__ twice"),
    ("entry-not-object", '{"a":5}', "tensor 'a': entry must be an object"),
    ("missing-dtype", '{"a":{"shape":[2],"data_offsets":[0,8]}}', "tensor 'a': missing field 'dtype'"),
    ("missing-shape", '{"a":{"dtype":"F32","data_offsets":[0,8]}}', "tensor 'a': missing field 'shape'"),
    ("missing-offsets", '{"a":{"dtype":"F32","shape":[2]}}', "tensor 'a': missing field 'data_offsets'"),
    ("dtype-twice", '{"a":{"dtype":"F32","dtype":"F32","shape":[2],"data_offsets":[0,8]}}', "'dtype' appears twice"),
    ("unknown-dtype", '{"a":{"dtype":"F128","shape":[2],"data_offsets":[0,8]}}', "tensor 'a': unknown dtype 'F128'"),
    ("dtype-lowercase", '{"a":{"dtype":"f32","shape":[2],"data_offsets":[0,8]}}', "unknown dtype 'f32'"),
    ("dtype-number", '{"a":{"dtype":5,"shape":[2],"data_offsets":[0,8]}}', "dtype must be a string"),
    ("shape-negative", '{"a":{"dtype":"F32","shape":[-2],"data_offsets":[0,8]}}', "shape must be a list"),
    ("shape-float", '{"a":{"dtype":"F32","shape":[2.0],"data_offsets":[0,8]}}', "shape must be a list"),
    ("shape-above-u64", '{"a":{"dtype":"F32","shape":[18446744073709551616],"data_offsets":[0,8]}}', "shape must be a list"),
    ("shape-string", '{"a":{"dtype":"F32","shape":"2","data_offsets":[0,8]}}', "shape must be a list"),
    ("offsets-three", '{"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8,8]}}', "data_offsets must be a list of two"),
    ("offsets-negative", '{"a":{"dtype":"F32","shape":[2],"data_offsets":[-0,8]}}', "data_offsets must be a list of two"),
    ("list-entry-short", '{"a":["F32",[2]]}', "exactly \\[dtype, shape, data_offsets\\]"),
    ("first-not-at-0", '{"a":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}}', "tensor 'a': data_offsets \\[4, 8\\] start at 4: the first tensor must start at 0"),
    ("gap", '{"a":%s,"b":{"dtype":"F32","shape":[1],"data_offsets":[12,16]}}' % entry_json("F32", [2], 0, 8), "tensor 'b'.*gap"),
    ("overlap", '{"a":%s,"b":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}}' % T, "tensor 'b'.*overlap"),
    ("end-before-start", '{"a":{"dtype":"U8","shape":[0],"data_offsets":[0,0]},"b":{"dtype":"U8","shape":[0],"data_offsets":[8,0]}}', "tensor 'b'.*end before"),
    ("numel-overflow", '{"a":{"dtype":"F32","shape":[4294967296,4294967296],"data_offsets":[0,8]}}', "tensor 'a'.*overflows"),
    ("bytes-overflow", '{"a":{"dtype":"U8","shape":[18446744073709551615],"data_offsets":[0,8]}}', "tensor 'a'.*overflows"),
    ("size-mismatch", '{"a":{"dtype":"F32","shape":[3],"data_offsets":[0,8]}}', "tensor 'a'.*hold 8 bytes but shape \\[3\\] of F32 needs 12"),
    ("f4-odd-count", '{"a":{"dtype":"F4","shape":[3],"data_offsets":[0,2]}}', "3 elements of F4 do not fill whole bytes"),
    ("f6-two", '{"a":{"dtype":"F6_E2M3","shape":[2],"data_offsets":[0,2]}}', "2 elements of F6_E2M3"),
    ("trailing-bytes", ('{"a":%s}' % T, 9), "1 trailing bytes"),
    ("truncated-data", ('{"a":%s}' % T, 7), "truncated"),
]


def _malformed_bytes(blob) -> bytes:
    if isinstance(blob, bytes):
        return blob
    if isinstance(blob, tuple):
        header, ndata = blob
        return struct.pack("<Q", len(header.encode())) + header.encode() + bytes(ndata)
    return struct.pack("<Q", len(blob.encode())) + blob.encode() + bytes(8)


@pytest.mark.parametrize("case_id,blob,fragment", MALFORMED, ids=[c[0] for c in MALFORMED])
def test_malformed_refused_by_both(tmp_path, case_id, blob, fragment):
    path = str(tmp_path / f"{case_id}.safetensors")
    with open(path, "wb") as fh:
        fh.write(_malformed_bytes(blob))
    with pytest.raises(Exception):
        oracle(path)
    with pytest.raises(HeaderError) as ei:
        SafetensorsFile(path)
    msg = str(ei.value)
    assert msg.startswith(path + ": ")
    assert "\n" not in msg
    assert re.search(fragment, msg), msg
    assert isinstance(ei.value, CheckpointFormatError)


def test_failed_open_leaves_no_descriptor_or_mapping(tmp_path):
    path = raw_file(tmp_path / "bad.safetensors", '{"a":%s}' % T, bytes(9))
    fds = len(os.listdir("/proc/self/fd"))
    for _ in range(20):
        with pytest.raises(HeaderError):
            SafetensorsFile(path)
    gc.collect()
    assert len(os.listdir("/proc/self/fd")) == fds
    assert not mapped(path)


# --------------------------------------------------------------------------------------------------
# open errors


def test_missing_and_directory_raise_the_oserror(tmp_path):
    missing = str(tmp_path / "nope.safetensors")
    with pytest.raises(FileNotFoundError) as ei:
        SafetensorsFile(missing)
    assert ei.value.filename == missing
    with pytest.raises(IsADirectoryError) as ei:
        SafetensorsFile(tmp_path)
    assert ei.value.filename == str(tmp_path)
    with pytest.raises(FileNotFoundError):
        FileCache().get(missing)


def _drop_file_capabilities():
    """In a child: drop CAP_DAC_OVERRIDE and CAP_DAC_READ_SEARCH from the bounding set, so that
    after exec even root is subject to file modes."""
    import ctypes
    libc = ctypes.CDLL(None, use_errno=True)
    for cap in (1, 2):                   # CAP_DAC_OVERRIDE, CAP_DAC_READ_SEARCH
        if libc.prctl(24, cap, 0, 0, 0) != 0:   # PR_CAPBSET_DROP
            raise OSError(ctypes.get_errno(), "prctl(PR_CAPBSET_DROP)")


def test_unreadable_raises_permission_error(tmp_path):
    path = raw_file(tmp_path / "p.safetensors", "{}")
    os.chmod(path, 0)
    if os.geteuid() != 0:
        with pytest.raises(PermissionError) as ei:
            SafetensorsFile(path)
        assert ei.value.filename == path
        return
    # root reads any file: try again in a child without the capabilities that let it
    root = os.path.dirname(os.path.dirname(os.path.abspath(_fastio.__file__)))
    code = (
        "import sys, types\n"
        f"pkg = types.ModuleType('pipeload'); pkg.__path__ = [{os.path.join(root, 'pipeload')!r}]\n"
        "sys.modules['pipeload'] = pkg\n"
        "from pipeload.io._fastio import SafetensorsFile\n"
        "try:\n"
        f"    SafetensorsFile({path!r})\n"
        "except PermissionError as e:\n"
        f"    assert e.filename == {path!r}\n"
        "    print('PermissionError')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                         preexec_fn=_drop_file_capabilities)
    assert out.stdout.strip() == "PermissionError", out.stderr


def test_fifo_is_refused_without_blocking(tmp_path):
    path = str(tmp_path / "fifo")
    os.mkfifo(path)
    with pytest.raises(HeaderError, match="not a regular file"):
        SafetensorsFile(path)


def test_pathlike_and_attributes(tmp_path):
    p = tmp_path / "a.safetensors"
    np_save_file({"a": np.arange(4, dtype=np.int32)}, str(p))
    f = SafetensorsFile(p)
    assert f.path == str(p) and isinstance(f.path, str)
    assert f.size == os.path.getsize(p) and not f.closed
    assert "a.safetensors" in repr(f)
    f.close()
    f.close()                                   # idempotent
    assert f.closed
    with pytest.raises(RuntimeError):
        f.__init__(p)                           # an open file cannot be re-initialised in place


def test_missing_key_names_file_and_key(tmp_path):
    path = str(tmp_path / "k.safetensors")
    np_save_file({"a": np.zeros(2, np.float32)}, path)
    with SafetensorsFile(path) as f:
        for call in (f.buffer, f.entry):
            with pytest.raises(TensorNotFoundError) as ei:
                call("model.missing")
            assert str(ei.value) == f"{path}: no tensor named 'model.missing'"
            assert isinstance(ei.value, KeyError)
        assert "model.missing" not in f and "a" in f


# --------------------------------------------------------------------------------------------------
# views and the mapping's lifetime


def _file_with(tmp_path, name="v.safetensors", n=4096 * 3):
    path = str(tmp_path / name)
    data = np.arange(n, dtype=np.uint8)
    np_save_file({"x": data, "y": np.full(5, 7, np.uint8)}, path)
    return path, data


def test_views_outlive_close_and_unmap_with_the_last_one(tmp_path):
    path, data = _file_with(tmp_path)
    f = SafetensorsFile(path)
    m = weakref.ref(f._mapping)
    buf = f.buffer("x")
    t = torch.frombuffer(f.buffer("y"), dtype=torch.uint8)
    assert f._mapping.exports >= 2
    f.close()
    del f
    gc.collect()
    assert m() is not None and mapped(path)
    assert bytes(buf) == data.tobytes()
    assert t.tolist() == [7] * 5
    del buf
    gc.collect()
    assert m() is not None                      # the tensor still holds the mapping
    assert t.sum().item() == 35
    del t
    gc.collect()
    assert m() is None and not mapped(path)


def test_operations_on_a_closed_file(tmp_path):
    path, _ = _file_with(tmp_path)
    f = SafetensorsFile(path)
    f.close()
    for call in (lambda: f.buffer("x"), lambda: f.span(0, 8), f.check_unchanged, lambda: f.advise("random")):
        with pytest.raises(ValueError, match="closed"):
            call()
    assert f.entry("y")[:2] == ("U8", (5,)) and f.keys() == ["x", "y"]   # the index stays


def test_views_are_copy_on_write(tmp_path):
    path, data = _file_with(tmp_path)
    before = open(path, "rb").read()
    with SafetensorsFile(path) as f:
        buf = f.buffer("x")
        buf[0:4] = b"\xff\xff\xff\xff"
        t = torch.frombuffer(f.buffer("y"), dtype=torch.uint8)
        t.fill_(1)
        assert bytes(f.buffer("x")[:4]) == b"\xff" * 4      # same private mapping
    assert open(path, "rb").read() == before
    with SafetensorsFile(path) as g:
        assert bytes(g.buffer("x")) == data.tobytes()


def test_span_bounds(tmp_path):
    path, data = _file_with(tmp_path)
    with SafetensorsFile(path) as f:
        _, _, s, e = f.entry("x")
        assert bytes(f.span(s, e)) == data.tobytes()
        assert f.span(f.size, f.size).nbytes == 0
        assert bytes(f.span(0, 8)) == struct.pack("<Q", f.data_offset - 8)
        with pytest.raises(ReadError, match=f"{path}: byte range \\[0, {f.size + 1}\\) runs past the end"):
            f.span(0, f.size + 1)
        for a, b in ((-1, 4), (8, 4)):
            with pytest.raises(ValueError):
                f.span(a, b)


def test_advise_reaches_madvise_for_the_range(tmp_path):
    """MADV_DONTNEED on a private mapping drops the pages written through views: the proof that
    advise() hands madvise the right pages, and only them."""
    path, data = _file_with(tmp_path, n=4096 * 8)
    with SafetensorsFile(path) as f:
        _, _, s, e = f.entry("x")
        buf = f.buffer("x")
        page = 4096
        first_full = -(-s // page) * page              # first page wholly inside x
        a, b = first_full - s, first_full - s + page    # offsets within buf of that page
        buf[a:a + 4] = b"\0\0\0\1"
        buf[b + page: b + page + 4] = b"\0\0\0\1"      # two pages later
        f.advise("dontneed", first_full, first_full + 10)
        assert bytes(buf[a:a + 4]) == data.tobytes()[a:a + 4]            # reverted to the file
        assert bytes(buf[b + page:b + page + 4]) == b"\0\0\0\1"          # outside: kept
        for adv in ("normal", "sequential", "random", "willneed"):
            f.advise(adv)
            f.advise(adv, s, e)
        f.advise("willneed", 5, 5)
        with pytest.raises(ValueError, match="unknown advice"):
            f.advise("hugepage")
        for a_, b_ in ((-1, 5), (10, 5), (0, f.size + 1)):
            with pytest.raises(ValueError):
                f.advise("normal", a_, b_)


def test_file_bigger_than_memory_maps(tmp_path):
    """A writable private map is charged against overcommit unless MAP_NORESERVE: a file larger than
    RAM + swap must still open (sparse here, so it costs no disk)."""
    ram = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    with open("/proc/meminfo") as fh:
        swap = next(int(line.split()[1]) * 1024 for line in fh if line.startswith("SwapTotal:"))
    n = 2 * (ram + swap) + (1 << 30)
    hdr = '{"big":' + entry_json("U8", [n], 0, n) + "}"
    path = raw_file(tmp_path / "big.safetensors", hdr)
    with open(path, "r+b") as fh:
        fh.truncate(8 + len(hdr) + n)
    with SafetensorsFile(path) as f:
        buf = f.buffer("big")
        assert buf.nbytes == n and not buf.readonly
        assert bytes(buf[n - 3:]) == b"\0\0\0"
        del buf


def test_read_only_mapping_fallback(tmp_path):
    """Under strict overcommit a writable private map can be refused: the views are then read-only."""
    path, data = _file_with(tmp_path)
    _fastio._set_force_readonly(True)
    try:
        with SafetensorsFile(path) as f:
            buf = f.buffer("x")
            assert buf.readonly and f._mapping.readonly
            assert bytes(buf) == data.tobytes()
            with pytest.raises(TypeError):
                buf[0] = 1
    finally:
        _fastio._set_force_readonly(False)
    with SafetensorsFile(path) as f:
        assert not f.buffer("x").readonly


# --------------------------------------------------------------------------------------------------
# the file changing under an open mapping


def test_check_unchanged_detects_rewrite_append_truncate(tmp_path):
    path, data = _file_with(tmp_path)
    size = os.path.getsize(path)
    with SafetensorsFile(path) as f:
        f.check_unchanged()
        st = os.stat(path)
        with open(path, "r+b") as fh:           # same size, new bytes, new mtime
            fh.seek(size - 1)
            fh.write(b"\x01")
        os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))
        with pytest.raises(ReadError, match=f"^{path}: file changed on disk"):
            f.check_unchanged()
    with SafetensorsFile(path) as f:
        with open(path, "ab") as fh:
            fh.write(b"\0")
        with pytest.raises(ReadError, match="changed on disk"):
            f.check_unchanged()
    os.truncate(path, size)
    with SafetensorsFile(path) as f:
        _, _, s, _ = f.entry("x")
        head = bytes(f.span(0, s))
        os.truncate(path, s)                    # the tensor bytes are gone: reading them would SIGBUS
        with pytest.raises(ReadError, match=f"^{path}: file was truncated to {s} bytes"):
            f.check_unchanged()
        assert bytes(f.span(0, s)) == head      # what is still backed reads fine


def test_replaced_by_rename_keeps_old_bytes(tmp_path):
    path, data = _file_with(tmp_path)
    f = SafetensorsFile(path)
    old = f.buffer("x")
    told = torch.frombuffer(f.buffer("x"), dtype=torch.uint8)
    tmp = str(tmp_path / "new.tmp")
    np_save_file({"x": np.full(len(data), 9, np.uint8), "y": np.zeros(5, np.uint8)}, tmp)
    os.replace(tmp, path)
    f.check_unchanged()                          # the open inode did not change
    assert bytes(old) == data.tobytes() and torch.equal(told, torch.from_numpy(data))
    with SafetensorsFile(path) as g:
        assert set(bytes(g.buffer("x"))) == {9}
    f.close()
    assert bytes(old) == data.tobytes()


# --------------------------------------------------------------------------------------------------
# FileCache


def _files(tmp_path, n):
    paths = []
    for i in range(n):
        p = str(tmp_path / f"f{i}.safetensors")
        np_save_file({"v": np.full(16, i, np.uint8)}, p)
        paths.append(p)
    return paths


def test_cache_counts_and_evicts_lru(tmp_path):
    a, b, c = _files(tmp_path, 3)
    cache = FileCache(2)
    assert cache.capacity == 2 and len(cache) == 0
    fa = cache.get(a)
    assert cache.get(a) is fa and (cache.opens, cache.hits) == (1, 1)
    fb = cache.get(b)
    cache.get(a)                                  # a is now the most recent
    fc = cache.get(c)                             # evicts b
    assert fb.closed and not fa.closed and not fc.closed
    assert len(cache) == 2 and b not in cache and a in cache
    assert (cache.opens, cache.hits) == (3, 2)
    fb2 = cache.get(b)                            # cold again; evicts a
    assert fb2 is not fb and fa.closed and (cache.opens, cache.hits) == (4, 2)
    cache.close()
    assert fc.closed and fb2.closed and len(cache) == 0


def test_cache_eviction_while_a_view_is_in_use(tmp_path):
    paths = _files(tmp_path, 4)
    cache = FileCache(1)
    f0 = cache.get(paths[0])
    t = torch.frombuffer(f0.buffer("v"), dtype=torch.uint8)
    mv = f0.buffer("v")
    for p in paths[1:]:
        cache.get(p)
    assert f0.closed
    gc.collect()
    assert t.tolist() == [0] * 16 and bytes(mv) == bytes(16)
    assert mapped(paths[0])
    del t, mv, f0
    gc.collect()
    assert not mapped(paths[0])


def test_cache_hit_is_cheap_and_makes_no_open(tmp_path, monkeypatch):
    (p,) = _files(tmp_path, 1)
    cache = FileCache()
    f = cache.get(p)

    def no_open(*a, **k):
        raise AssertionError("a cache hit opened the file")

    monkeypatch.setattr(os, "open", no_open)
    times = []
    for _ in range(2000):
        t0 = time.perf_counter()
        cache.get(p)
        times.append(time.perf_counter() - t0)
    times.sort()
    assert times[len(times) // 2] < 50e-6, times[len(times) // 2]
    assert cache.hits == 2000 and cache.opens == 1 and cache.get(p) is f


def test_cache_reopens_a_file_closed_by_its_user(tmp_path):
    (p,) = _files(tmp_path, 1)
    cache = FileCache()
    f = cache.get(p)
    f.close()
    g = cache.get(p)
    assert g is not f and not g.closed and cache.opens == 2 and cache.hits == 0


def test_cache_capacity_and_context_manager(tmp_path):
    for bad in (0, -3):
        with pytest.raises(ValueError):
            FileCache(bad)
    paths = _files(tmp_path, 2)
    with FileCache() as cache:
        assert cache.capacity == 8
        f = cache.get(paths[0])
        g = cache.get(type(tmp_path)(paths[1]))        # PathLike
        mv = g.buffer("v")
    assert f.closed and g.closed and bytes(mv) == b"\x01" * 16


def test_cache_threads(tmp_path):
    """Concurrent gets never corrupt the LRU or leak descriptors."""
    paths = _files(tmp_path, 4)
    cache = FileCache(2)
    fds = len(os.listdir("/proc/self/fd"))
    errors = []

    def work(seed):
        rng = random.Random(seed)
        try:
            for _ in range(300):
                cache.get(rng.choice(paths))
        except Exception as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and len(cache) == 2
    assert cache.opens + cache.hits == 1200
    cache.close()
    gc.collect()
    assert len(os.listdir("/proc/self/fd")) == fds


@pytest.mark.parametrize("pread_min", [1, 1 << 62], ids=["pread", "mapping"])
def test_copy_box_matches_torch_for_random_boxes_and_refuses_what_does_not_fit(tmp_path, pread_min):
    """The reader's fast path copies exactly what ``dst.narrow(...).copy_(src.narrow(...))`` copies,
    into contiguous and strided destinations, and checks every box against both tensors first.
    Contiguous boxes are pread() (``pread_min`` 1: all of them) or copied from the mapping."""
    old_min = _fastio._set_pread_min(pread_min)
    try:
        _copy_box_cases(tmp_path)
    finally:
        _fastio._set_pread_min(old_min)


def _copy_box_cases(tmp_path):
    rng = random.Random(7)
    gen = torch.Generator().manual_seed(7)
    tensors = {
        "a": torch.randn(37, 11, 5, generator=gen),
        "b": torch.randint(-99, 99, (64, 3), generator=gen, dtype=torch.int16),
        "s": torch.tensor(2.5, dtype=torch.float64),
    }
    path = str(tmp_path / "t.safetensors")
    torch_save_file(tensors, path)
    names = {torch.float32: "F32", torch.int16: "I16", torch.float64: "F64"}
    with SafetensorsFile(path) as f:
        for _ in range(200):
            key = rng.choice("ab")
            t = tensors[key]
            offs = tuple(rng.randrange(n) for n in t.shape)
            lens = tuple(rng.randint(0, n - o) for n, o in zip(t.shape, offs))
            big = torch.zeros([n + rng.randrange(4) for n in lens], dtype=t.dtype)
            dst = big.transpose(0, 1) if rng.random() < 0.3 and big.shape[0] == big.shape[1] else big
            doffs = tuple(rng.randrange(dn - n + 1) for dn, n in zip(dst.shape, lens))
            want = dst.clone()
            region = want
            src = t
            for d, (o, do, n) in enumerate(zip(offs, doffs, lens)):
                region, src = region.narrow(d, do, n), src.narrow(d, o, n)
            region.copy_(src)
            got = f.copy_box(key, names[t.dtype], tuple(t.shape), offs, lens, dst.data_ptr(), doffs,
                             dst.stride(), tuple(dst.shape), rng.random() < 0.5)
            assert got == src.nbytes
            assert torch.equal(dst, want), (key, offs, lens, doffs)
        out = torch.zeros((), dtype=torch.float64)
        assert f.copy_box("s", "F64", (), (), (), out.data_ptr(), (), (), ()) == 8 and out.item() == 2.5
        a = tensors["a"]
        for lo, rows in [(0, 37), (5, 9), (36, 1)]:  # row ranges: one contiguous run on both sides
            dst = torch.zeros(40, 11, 5)
            f.copy_box("a", "F32", (37, 11, 5), (lo, 0, 0), (rows, 11, 5), dst.data_ptr(), (2, 0, 0),
                       dst.stride(), tuple(dst.shape))
            assert torch.equal(dst[2 : 2 + rows], a[lo : lo + rows]) and not dst[:2].any() and not dst[2 + rows :].any()

        dst = torch.full((64, 3), 7, dtype=torch.int16)
        ptr = dst.data_ptr()
        with pytest.raises(CheckpointFormatError, match=r"t.safetensors: tensor 'b' is I16 \[64, 3\], the metadata says F32"):
            f.copy_box("b", "F32", (64, 3), (0, 0), (64, 3), ptr, (0, 0), (3, 1), (64, 3))
        with pytest.raises(CheckpointFormatError, match=r"is I16 \[64, 3\], the metadata says I16 \[64, 4\]"):
            f.copy_box("b", "I16", (64, 4), (0, 0), (64, 3), ptr, (0, 0), (3, 1), (64, 3))
        for offs, lens, doffs in [((1, 0), (64, 3), (0, 0)),       # past the chunk's end
                                  ((0, 0), (64, 3), (1, 0)),       # past the destination's end
                                  ((-1, 0), (2, 3), (0, 0)),       # negative offset
                                  ((0, 0), (-2, 3), (0, 0))]:      # negative length
            with pytest.raises(ValueError, match="does not fit"):
                f.copy_box("b", "I16", (64, 3), offs, lens, ptr, doffs, (3, 1), (64, 3))
        with pytest.raises(ValueError, match="box of 1 dims"):
            f.copy_box("b", "I16", (64, 3), (0,), (64,), ptr, (0,), (1,), (64,))
        with pytest.raises(TensorNotFoundError, match="no tensor named 'zz'"):
            f.copy_box("zz", "I16", (1,), (0,), (1,), ptr, (0,), (1,), (1,))
        assert torch.equal(dst, torch.full((64, 3), 7, dtype=torch.int16))  # nothing refused was copied
    with pytest.raises(ValueError, match="closed"):
        f.copy_box("b", "I16", (64, 3), (0, 0), (64, 3), ptr, (0, 0), (3, 1), (64, 3))


def test_opening_a_cold_file_reads_its_header_and_nothing_else(tmp_path):
    """Opening reads the header only: no readahead into the tensors (on shared storage those bytes are
    other ranks' shares). Residency in the page cache, after dropping the file, counts what was read."""
    from pipeload.tools.bench import drop_cache, resident_bytes

    path = str(tmp_path / "cold.safetensors")
    np_save_file({f"t{i:04d}": np.full(4096, i, np.float32) for i in range(512)}, path)  # 8 MiB of tensors
    drop_cache([path])
    if resident_bytes(path)[0] > 0:
        pytest.skip("the page cache keeps this file (it cannot be dropped here)")
    with SafetensorsFile(path) as f:
        cached = resident_bytes(path)[0]
        assert len(f) == 512
        assert cached <= f.data_offset + 2 * 4096, f"opening read {cached} bytes for a {f.data_offset}-byte header"


def test_willneed_tensors_requests_exactly_the_named_ranges_merged(tmp_path):
    from pipeload.tools.bench import drop_cache, resident_bytes

    path = str(tmp_path / "w.safetensors")
    np_save_file({f"t{i:02d}": np.full(16384, i, np.float32) for i in range(64)}, path)  # 64 KiB each
    with SafetensorsFile(path) as f:
        names = [f"t{i:02d}" for i in range(0, 64, 4)]
        random.Random(3).shuffle(names)
        assert f.willneed_tensors([], 0) == 0
        with pytest.raises(TensorNotFoundError, match="no tensor named 'nope'"):
            f.willneed_tensors([*names, "nope"], 0)
        # apart by 192 KiB: merged only when the gap allows
        assert f.willneed_tensors(names, 0) == 16 * 65536
        assert f.willneed_tensors(names, 1 << 20) == f.entry("t60")[3] - f.entry("t00")[2]
        assert f.willneed_tensors(["t05", "t05", "t06"], 0) == 2 * 65536  # duplicates and neighbours: one range
        drop_cache([path])
        if resident_bytes(path)[0] > 0:
            pytest.skip("the page cache keeps this file (it cannot be dropped here)")
        f.willneed_tensors(names, 0)
        deadline = time.monotonic() + 10
        while resident_bytes(path)[0] < 16 * 65536 and time.monotonic() < deadline:
            time.sleep(0.01)
        cached = resident_bytes(path)[0]
        assert 16 * 65536 <= cached <= 16 * 65536 + 32 * 4096, cached  # the named tensors (page-rounded)


def test_raw_file_copy_box_reads_a_chunk_at_an_offset_and_refuses_one_past_the_end(tmp_path):
    """``RawFile.copy_box`` (DCP's items read in place): the chunk is where the layout says, checked
    against the file's size before anything is copied."""
    from pipeload.io._fastio import RawFile

    t = torch.arange(6 * 4096, dtype=torch.float32).reshape(6, 4096)
    path = str(tmp_path / "raw.bin")
    with open(path, "wb") as fh:
        fh.write(b"x" * 100 + t.numpy().tobytes() + b"tail")
    with RawFile(path) as f:
        for pread_min in (1, 1 << 62):
            old = _fastio._set_pread_min(pread_min)
            try:
                dst = torch.zeros(3, 4096)
                assert f.copy_box("t", 100, 4, (6, 4096), (2, 0), (3, 4096), dst.data_ptr(), (0, 0),
                                  dst.stride(), tuple(dst.shape)) == 3 * 4096 * 4
                assert torch.equal(dst, t[2:5])
            finally:
                _fastio._set_pread_min(old)
        with pytest.raises(ReadError, match="item 't' of \\[7, 4096\\] x 4 bytes at 100 runs past the end"):
            f.copy_box("t", 100, 4, (7, 4096), (0, 0), (1, 4096), dst.data_ptr(), (0, 0), dst.stride(), tuple(dst.shape))
        with pytest.raises(ValueError, match="does not fit"):
            f.copy_box("t", 100, 4, (6, 4096), (4, 0), (3, 4096), dst.data_ptr(), (0, 0), dst.stride(), tuple(dst.shape))
    with pytest.raises(ValueError, match="closed"):
        f.copy_box("t", 100, 4, (6, 4096), (0, 0), (1, 4096), dst.data_ptr(), (0, 0), dst.stride(), tuple(dst.shape))
