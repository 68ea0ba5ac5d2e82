"""The data model of stored chunks: dtype names, a tensor's chunks, and when chunks tile a tensor.

Pure (torch's dtypes only); what the metadata parser and the chunk index both build on.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

# safetensors dtype name <-> torch dtype. Only dtypes both sides know are listed.
_DTYPE_NAMES: dict[str, torch.dtype] = {
    "BOOL": torch.bool,
    "U8": torch.uint8,
    "I8": torch.int8,
    "I16": torch.int16,
    "I32": torch.int32,
    "I64": torch.int64,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F32": torch.float32,
    "F64": torch.float64,
    "C64": torch.complex64,
}
for _name, _attr in (
    ("U16", "uint16"),
    ("U32", "uint32"),
    ("U64", "uint64"),
    ("C128", "complex128"),
    ("F8_E4M3", "float8_e4m3fn"),
    ("F8_E5M2", "float8_e5m2"),
    ("F8_E4M3FNUZ", "float8_e4m3fnuz"),
    ("F8_E5M2FNUZ", "float8_e5m2fnuz"),
    ("F8_E8M0", "float8_e8m0fnu"),
):
    if hasattr(torch, _attr):
        _DTYPE_NAMES[_name] = getattr(torch, _attr)
NAMES_OF_DTYPES = {v: k for k, v in _DTYPE_NAMES.items()}  # torch dtype -> safetensors name


def dtype_name(dtype: torch.dtype) -> str:
    """The safetensors name of ``dtype``; ``KeyError`` if safetensors cannot store it."""
    return NAMES_OF_DTYPES[dtype]


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype of a safetensors dtype name; ``KeyError`` if torch has none."""
    return _DTYPE_NAMES[name]


def dtype_itemsize(name: str) -> int:
    return torch_dtype(name).itemsize


def storable_dtype(dtype: torch.dtype) -> bool:
    return dtype in NAMES_OF_DTYPES


class ChunkMeta(NamedTuple):
    """One stored box of a global tensor, written once by one rank.

    (NamedTuples: a checkpoint has one per chunk, built on every rank at every load.)
    """

    offsets: tuple[int, ...]  # where the box starts in the global tensor, per dim
    lengths: tuple[int, ...]  # its extent per dim; the stored tensor has exactly this shape
    file: str  # data file name, relative to the checkpoint directory
    key: str  # tensor name inside that safetensors file
    checksum: str  # xxh3-64 of the stored bytes, 16 hex digits

    @property
    def numel(self) -> int:
        return math.prod(self.lengths)


class TensorMeta(NamedTuple):
    """A global tensor: its dtype (safetensors name), global shape, and the chunks that tile it."""

    dtype: str
    shape: tuple[int, ...]
    chunks: tuple[ChunkMeta, ...]

    @property
    def itemsize(self) -> int:
        return dtype_itemsize(self.dtype)


Boxes = list[tuple[tuple[int, ...], tuple[int, ...]]]


def tiling_problem(shape: tuple[int, ...], boxes: Boxes) -> str | None:
    """Why the (offsets, lengths) ``boxes`` do not tile ``shape`` exactly, or None when they do."""
    if len(boxes) == 1 and boxes[0][1] == shape and len(boxes[0][0]) == len(shape) and not any(boxes[0][0]):
        return None  # one chunk holding the whole tensor: the common case
    total = 0
    for off, ln in boxes:
        if len(off) != len(shape) or len(ln) != len(shape):
            return f"a chunk has rank {len(ln)}, the tensor {len(shape)}"
        for o, n, s in zip(off, ln, shape):
            if o < 0 or n < 0 or o + n > s:
                return f"chunk at {list(off)} of size {list(ln)} lies outside the shape {list(shape)}"
        numel = 1
        for n in ln:
            numel *= n
        total += numel
    numel = 1
    for s in shape:
        numel *= s
    if total != numel or _any_overlap(boxes):
        return f"chunks do not tile the shape {list(shape)} exactly (gap or overlap)"
    return None


def _any_overlap(boxes: Boxes) -> bool:
    nonempty = sorted(b for b in boxes if all(b[1]))
    if not nonempty or not nonempty[0][0]:
        return len(nonempty) > 1  # 0-d tensors: two chunks of a scalar overlap
    # Sweep along dim 0 keeps this near-linear for the usual row-sharded layouts.
    active: Boxes = []
    for off, ln in nonempty:
        active = [(o, n) for o, n in active if o[0] + n[0] > off[0]]
        for o, n in active:
            if all(a < b + m and b < a + k for a, k, b, m in zip(off, ln, o, n)):
                return True
        active.append((off, ln))
    return False


def chunk_key(fqn: str, offsets: tuple[int, ...], whole: bool) -> str:
    """The safetensors tensor name of a chunk: the fqn for a whole tensor, ``fqn@o0,o1,...`` otherwise."""
    return fqn if whole else f"{fqn}@{','.join(map(str, offsets))}"


def box_span(shape: tuple[int, ...], offsets: tuple[int, ...], lengths: tuple[int, ...], itemsize: int):
    """Byte range [lo, hi) of a C-contiguous tensor of ``shape`` that holds the box (offsets, lengths)."""
    first = last = 0
    stride = 1
    for n, o, k in zip(reversed(shape), reversed(offsets), reversed(lengths)):
        first += o * stride
        last += (o + k - 1) * stride
        stride *= n
    return first * itemsize, (last + 1) * itemsize
