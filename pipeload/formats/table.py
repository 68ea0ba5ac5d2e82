"""The columnar form of a foreign layout's metadata: decoded once, on the rank that reads it.

A *table* is format 2's chunk index (:mod:`pipeload.formats.chunkindex`: ``shape``, ``chunk_start``,
``max_rows``, ``chunk_offsets``, ``chunk_lengths``, ``chunk_file``) plus the columns a layout needs to
find a chunk's bytes (DCP: ``chunk_byte_offset``/``chunk_byte_length`` and the chunks of each file), in
one safetensors-layout blob whose ``__metadata__[TABLE_KEY]`` holds the tensor-level facts as JSON
(names, dtypes, ranks, files, objects). Rank 0 builds it from DCP's pickle or HF's headers and sends the
blob; every rank views its arrays in place (:func:`decode`: no copy, no per-chunk object) and looks its
boxes up with the chunk index's vectorised search. The same blob is the DCP sidecar file.

Invariants: arrays are little-endian, C-contiguous, laid end to end in header order from offset 0 of the
data section; :func:`decode` accepts nothing else and checks every size before viewing.
"""

from __future__ import annotations

import json
import math
import struct
from typing import Any

import numpy as np

from ..errors import CheckpointFormatError

TABLE_KEY = "pipeload.table"
MAX_HEADER = 256 << 20  # names and facts of a table: far below this even for 10^6 tensors
_DTYPES = {"I64": np.dtype("<i8"), "I32": np.dtype("<i4"), "U8": np.dtype("u1")}
_NAMES = {v: k for k, v in _DTYPES.items()}


def encode(arrays: dict[str, np.ndarray], facts: dict[str, Any]) -> bytearray:
    """One blob holding ``arrays`` (int64 / int32 / uint8) and ``facts`` (JSON-able), safetensors layout."""
    header: dict[str, Any] = {}
    at = 0
    for name, a in arrays.items():
        dt = _NAMES.get(a.dtype.newbyteorder("<") if a.dtype.byteorder == ">" else a.dtype)
        if dt is None:
            raise TypeError(f"table array {name!r} has dtype {a.dtype}")
        header[name] = {"dtype": dt, "shape": list(a.shape), "data_offsets": [at, at + a.nbytes]}
        at += a.nbytes
    header["__metadata__"] = {TABLE_KEY: json.dumps(facts, separators=(",", ":"))}
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)
    out = bytearray(8 + len(head) + at)
    struct.pack_into("<Q", out, 0, len(head))
    out[8 : 8 + len(head)] = head
    view = np.frombuffer(out, dtype=np.uint8)
    pos = 8 + len(head)
    for a in arrays.values():
        n = a.nbytes
        view[pos : pos + n] = np.ascontiguousarray(a).reshape(-1).view(np.uint8)
        pos += n
    return out


def decode(data, source: str) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    """(arrays viewing ``data`` in place, facts) of a blob :func:`encode` wrote; CheckpointFormatError naming
    ``source`` for anything malformed."""
    buf = memoryview(data).cast("B")
    if len(buf) < 8:
        raise CheckpointFormatError(f"{source}: table is truncated")
    (n,) = struct.unpack_from("<Q", buf, 0)
    if n > MAX_HEADER or 8 + n > len(buf):
        raise CheckpointFormatError(f"{source}: table header is truncated or too large")
    try:
        header = json.loads(bytes(buf[8 : 8 + n]))
        facts = json.loads(header.pop("__metadata__")[TABLE_KEY])
    except (ValueError, KeyError, TypeError, AttributeError, UnicodeDecodeError):
        raise CheckpointFormatError(f"{source}: table header is not valid") from None
    if not isinstance(facts, dict):
        raise CheckpointFormatError(f"{source}: table facts are not an object")
    base, size, at = 8 + n, len(buf) - 8 - n, 0
    arrays = {}
    for name, e in header.items():
        try:
            dt = _DTYPES[e["dtype"]]
            shape = tuple(e["shape"])
            lo, hi = e["data_offsets"]
            ok = all(type(x) is int and x >= 0 for x in (*shape, lo, hi))
        except (KeyError, TypeError, ValueError):
            ok = False
        if not ok or lo != at or hi - lo != math.prod(shape) * dt.itemsize or hi > size:
            raise CheckpointFormatError(f"{source}: table array {name!r} is malformed or truncated")
        arrays[name] = np.frombuffer(buf, dtype=dt, count=math.prod(shape), offset=base + lo).reshape(shape)
        at = hi
    if at != size:
        raise CheckpointFormatError(f"{source}: table has {size - at} bytes after its arrays")
    return arrays, facts


def str_list(v: Any, what: str, source: str) -> list[str]:
    if type(v) is not list or not all(type(x) is str for x in v):
        raise CheckpointFormatError(f"{source}: table {what} must be a list of strings")
    return v
