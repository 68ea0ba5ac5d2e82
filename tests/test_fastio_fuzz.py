"""Differential fuzz of the header validator: pipeload.io._fastio against safetensors (the Rust oracle).

Seeded mutations of valid files and generated headers: pipeload must never crash, must raise only
HeaderError on a bad file, and must accept exactly the files ``safetensors.safe_open`` accepts,
reading the same names, dtypes, shapes and metadata from them.
"""

from __future__ import annotations

import json
import os
import random
import struct

import pytest
from safetensors import safe_open

from pipeload.io._fastio import DTYPE_BITS, SafetensorsFile
from pipeload.errors import HeaderError

DTYPES = sorted(DTYPE_BITS)
BAD_DTYPES = ["F128", "f32", "F8", "F8_E4M3FN", "I4", "Q4", "", "BOOL ", "U4", "F6"]


def _oracle(path: str):
    try:
        with safe_open(path, framework="np") as f:
            names = sorted(f.keys())
            info = {k: (f.get_slice(k).get_dtype(), tuple(f.get_slice(k).get_shape())) for k in names}
            return True, info, f.metadata()
    except Exception as e:  # noqa: BLE001 - the oracle's verdict is all that matters
        return False, repr(e), None


def _ours(path: str):
    try:
        with SafetensorsFile(path) as f:
            info = {}
            for k in f.keys():
                dtype, shape, start, end = f.entry(k)
                assert f.buffer(k).nbytes == end - start
                info[k] = (dtype, shape)
            return True, info, f.metadata
    except HeaderError as e:
        assert str(e).startswith(path + ": "), str(e)
        return False, str(e), None


def _nbytes(dtype: str, shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n * DTYPE_BITS[dtype] // 8


def _shape_for(rng: random.Random, dtype: str):
    per = 8 // DTYPE_BITS[dtype] if DTYPE_BITS[dtype] < 8 else 1
    if DTYPE_BITS[dtype] == 6:
        per = 4
    kind = rng.random()
    if kind < 0.1:
        return [] if per == 1 else [per]
    if kind < 0.2:
        return [rng.randint(0, 3), 0]
    shape = [rng.randint(1, 4) for _ in range(rng.randint(1, 3))]
    shape[-1] *= per
    return shape


def _valid_entries(rng: random.Random):
    entries = []
    off = 0
    for i in range(rng.randint(0, 6)):
        dtype = rng.choice(DTYPES)
        shape = _shape_for(rng, dtype)
        n = _nbytes(dtype, shape)
        name = rng.choice([f"t{i}", f"layer.{i}.weight", f"é{i}", f"名前{i}", f"t\n{i}", f"emoji😀{i}"])
        entries.append([name, dtype, shape, [off, off + n]])
        off += n
    return entries, off


def _random_json(rng: random.Random, depth: int = 0):
    r = rng.random()
    if depth > 3 or r < 0.3:
        return rng.choice([None, True, False, 0, -1, 1.5, 1e300, "x", "é\u2028", 12345678901234567890])
    if r < 0.65:
        return [_random_json(rng, depth + 1) for _ in range(rng.randint(0, 3))]
    return {f"k{rng.randint(0, 3)}": _random_json(rng, depth + 1) for _ in range(rng.randint(0, 3))}


def _dump_string(rng: random.Random, s: str) -> str:
    if rng.random() < 0.7:
        return json.dumps(s, ensure_ascii=rng.random() < 0.5)
    return '"' + "".join(f"\\u{ord(c):04x}" if ord(c) < 0x10000 and rng.random() < 0.5 else
                         json.dumps(c, ensure_ascii=True)[1:-1] for c in s) + '"'


def _ws(rng: random.Random) -> str:
    return rng.choice(["", "", "", " ", "\n", "\t ", "\r\n  "])


def _render(rng: random.Random, entries, metadata) -> bytes:
    """A header that serde accepts in all its spellings: object or [dtype, shape, offsets] entries,
    dtype as "F32" or {"F32": null}, fields in any order, extra fields, escapes, whitespace."""
    parts = []
    if metadata is not None or rng.random() < 0.1:
        if metadata is None:
            md = "null"
        else:
            md = "{" + ",".join(f"{_dump_string(rng, k)}:{_ws(rng)}{_dump_string(rng, v)}"
                                for k, v in metadata.items()) + "}"
        parts.append((_dump_string(rng, "__metadata__"), md))
    for name, dtype, shape, offs in entries:
        dt = _dump_string(rng, dtype) if rng.random() < 0.9 else "{%s:null}" % _dump_string(rng, dtype)
        sh = "[" + f",{_ws(rng)}".join(str(d) for d in shape) + "]"
        of = f"[{offs[0]},{_ws(rng)}{offs[1]}]"
        if rng.random() < 0.1:
            val = f"[{dt},{sh},{of}]"
        else:
            fields = [('"dtype"', dt), ('"shape"', sh), ('"data_offsets"', of)]
            if rng.random() < 0.2:
                fields.append(('"extra"', json.dumps(_random_json(rng))))
            rng.shuffle(fields)
            val = "{" + ",".join(f"{k}:{_ws(rng)}{v}" for k, v in fields) + "}"
        parts.append((_dump_string(rng, name), val))
    rng.shuffle(parts)
    body = "{" + ",".join(f"{_ws(rng)}{k}{_ws(rng)}:{_ws(rng)}{v}" for k, v in parts) + "}"
    return (_ws(rng) + body + _ws(rng) + " " * rng.randint(0, 7)).encode()


def _file(header: bytes, data_len: int, rng: random.Random, hlen=None) -> bytes:
    hl = len(header) if hlen is None else hlen
    return struct.pack("<Q", hl) + header + bytes(rng.getrandbits(8) for _ in range(min(data_len, 64))) \
        + bytes(max(0, data_len - 64))


_TOKENS = [b'"', b"\\", b"\\u", b"\\ud83d", b"\\ude00", b"{", b"}", b"[", b"]", b",", b":", b" ",
           b"0", b"-", b"1e400", b"1.0", b"-0", b"18446744073709551616", b"null", b"true",
           b'"dtype"', b'"shape"', b'"data_offsets"', b'"__metadata__"', b'"F32"', b'"F4"',
           b'"BF16"', b"\x00", b"\x7f", b"\xc3\xa9", b"\xff", b"\xed\xa0\x80", b"\xf4\x90\x80\x80",
           b"\xe0\x80\x80", b"\t", b"\x0b", b"99999999999999999999", b"4294967296"]


def _u64(v: int) -> bytes:
    return struct.pack("<Q", v % 2**64)


def _mutate(rng: random.Random, blob: bytes) -> bytes:
    b = bytearray(blob)
    for _ in range(rng.choice([1, 1, 1, 2, 3])):
        op = rng.random()
        if not b:
            b = bytearray(rng.randbytes(rng.randint(0, 16)))
            continue
        hl = struct.unpack("<Q", bytes(b[:8]))[0] if len(b) >= 8 else 0
        hend = min(len(b), 8 + hl)
        lo = 8 if hend > 8 else 0
        pos = rng.randint(lo, max(lo, hend - 1))
        if op < 0.25:                       # flip a header byte
            if pos < len(b):
                b[pos] = rng.getrandbits(8)
        elif op < 0.45:                     # replace a header byte with a token, fix the length
            tok = rng.choice(_TOKENS)
            b[pos:pos + 1] = tok
            if len(b) >= 8 and rng.random() < 0.8:
                b[:8] = _u64(hl + len(tok) - 1)
        elif op < 0.55:                     # delete a span, fix the length
            n = rng.randint(1, 4)
            del b[pos:pos + n]
            if len(b) >= 8 and rng.random() < 0.8:
                b[:8] = _u64(hl - n)
        elif op < 0.65:                     # change a digit (shape / offsets / numbers)
            digits = [i for i in range(lo, hend) if 0x30 <= b[i] <= 0x39]
            if digits:
                b[rng.choice(digits)] = rng.choice(b"0123456789")
        elif op < 0.72:                     # grow or shrink the data section
            if rng.random() < 0.5:
                b += bytes(rng.randint(1, 9))
            elif len(b) > hend:
                del b[-rng.randint(1, min(9, len(b) - hend)):]
        elif op < 0.8:                      # mess with the length prefix
            if len(b) >= 8:
                b[:8] = _u64(rng.choice([0, 1, hl - 1, hl + 1, len(b), 100_000_001, 2**64 - 1,
                                         100_000_000, hl - 8]))
        elif op < 0.9:                      # swap the dtype of some entry
            s = bytes(b)
            i = s.find(b'"dtype"', lo)
            if i >= 0:
                j = s.find(b'"', s.find(b":", i) + 1)
                k = s.find(b'"', j + 1)
                if j > 0 and k > j:
                    new = json.dumps(rng.choice(DTYPES + BAD_DTYPES)).encode()
                    b[j:k + 1] = new
                    if rng.random() < 0.8:
                        b[:8] = _u64(hl + len(new) - (k + 1 - j))
        else:                               # truncate the file anywhere
            del b[rng.randint(0, len(b)):]
    return bytes(b)


def _case(rng: random.Random) -> bytes:
    entries, data_len = _valid_entries(rng)
    md = None
    if rng.random() < 0.3:
        md = {rng.choice(["format", "é", "k\u0000", "a\"b"]): rng.choice(["pt", "", "ü", "\\"])
              for _ in range(rng.randint(0, 3))}
    header = _render(rng, entries, md)
    blob = _file(header, data_len, rng)
    r = rng.random()
    if r < 0.15:
        return blob                        # valid as generated
    if r < 0.3 and entries:                # semantic breakage of one entry, still valid JSON
        e = rng.choice(entries)
        which = rng.randrange(5)
        if which == 0:
            e[3][0] += rng.choice([-1, 1])
        elif which == 1:
            e[3][1] += rng.choice([-1, 1, 8])
        elif which == 2:
            e[2] = e[2] + [rng.choice([0, 2, 2**32, 2**63])]
        elif which == 3:
            e[1] = rng.choice(DTYPES)
        else:
            entries.append(list(e))        # duplicate name
        return _file(_render(rng, entries, md), data_len + rng.choice([0, 0, 1, -1]), rng)
    return _mutate(rng, blob)


def _check(path: str, blob: bytes, label: str) -> bool:
    """Both readers on one file; returns the verdict. A fresh file per case: rewriting one file in
    place makes ext4 wait for the previous write-back on every case."""
    with open(path, "wb") as fh:
        fh.write(blob)
    try:
        ref = _oracle(path)
        got = _ours(path)
    finally:
        os.unlink(path)
    assert got[0] == ref[0], (
        f"{label}: pipeload {'accepts' if got[0] else 'rejects'} a file safetensors "
        f"{'accepts' if ref[0] else 'rejects'}\n  pipeload: {got[1]}\n  safetensors: {ref[1]}\n"
        f"  file: {blob[:400]!r}")
    if ref[0]:
        assert got[1] == ref[1], label
        assert got[2] == ref[2], label
    return ref[0]


@pytest.mark.parametrize("seed", range(4))
def test_fuzz_agrees_with_safetensors(tmp_path, seed):
    """3,000 seeded cases per seed (12,000 in all, a few seconds): every case runs both readers."""
    rng = random.Random(1000 + seed)
    accepted = rejected = 0
    for i in range(3000):
        if _check(str(tmp_path / f"c{i}.safetensors"), _case(rng), f"seed {seed} case {i}"):
            accepted += 1
        else:
            rejected += 1
    # the generator must exercise both verdicts, or the test proves nothing
    assert accepted >= 300 and rejected >= 1200, (accepted, rejected)


def test_fuzz_random_bytes_never_crash(tmp_path):
    """Pure noise after a plausible length prefix: always a HeaderError, never a crash."""
    rng = random.Random(7)
    for i in range(300):
        n = rng.randint(0, 64)
        body = rng.randbytes(n)
        prefix = struct.pack("<Q", rng.randint(0, n + 2)) if rng.random() < 0.8 else rng.randbytes(rng.randint(0, 8))
        assert not _check(str(tmp_path / f"n{i}"), prefix + body, f"noise case {i}")
