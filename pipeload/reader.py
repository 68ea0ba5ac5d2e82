"""Copying ReadItems out of checkpoint files: the torch-facing side of ``pipeload._fastio``.

A stored chunk is viewed in place (``torch.frombuffer`` over the file's mapping, no copy) and the
ReadItem's box is copied from that view straight into its destination region: one copy per byte.
Nothing is pre-checked that the next call checks anyway: a missing file or key surfaces from the
open or lookup itself, with the file name and key in the message.
"""

from __future__ import annotations

import io
import math
import os
from typing import Any, Iterable

import numpy as np
import torch

from ._fastio import FileCache, SafetensorsFile
from .checksum import checksum
from .errors import ChecksumError, CheckpointFormatError, ReadError
from .metadata import ObjectMeta, dtype_name, torch_dtype
from .planner import ReadItem


def narrow(t: torch.Tensor, offsets: tuple[int, ...], lengths: tuple[int, ...]) -> torch.Tensor:
    """The box (offsets, lengths) of ``t`` as a view."""
    for dim, (o, n) in enumerate(zip(offsets, lengths)):
        if o != 0 or n != t.shape[dim]:
            t = t.narrow(dim, o, n)
    return t


def box_span(shape: tuple[int, ...], offsets: tuple[int, ...], lengths: tuple[int, ...], itemsize: int):
    """Byte range [lo, hi) of a C-contiguous tensor of ``shape`` that holds the box (offsets, lengths)."""
    first = last = 0
    stride = 1
    for n, o, k in zip(reversed(shape), reversed(offsets), reversed(lengths)):
        first += o * stride
        last += (o + k - 1) * stride
        stride *= n
    return first * itemsize, (last + 1) * itemsize


_MEMCPY_MIN = 1 << 16
_MERGE_GAP = 1 << 20  # prefetch ranges closer than this are requested as one


def copy_box(dst: torch.Tensor, src: torch.Tensor) -> None:
    """``dst.copy_(src)``, as a plain memcpy when both sides are contiguous host memory of one dtype.

    torch's ``copy_`` runs at ~0.7x of memcpy on a contiguous host copy (measured in
    bench/bench_fastio.py); numpy's ``copyto`` on byte views is a memcpy and releases the GIL.
    """
    if (
        dst.device.type == "cpu"
        and dst.dtype == src.dtype
        and dst.nbytes >= _MEMCPY_MIN
        and dst.is_contiguous()
        and src.is_contiguous()
    ):
        np.copyto(dst.reshape(-1).view(torch.uint8).numpy(), src.reshape(-1).view(torch.uint8).numpy())
    else:
        dst.copy_(src)


class ChunkReader:
    """Reads chunks of one checkpoint directory through one LRU of open files."""

    def __init__(self, directory: str, *, cache_size: int = 8, verify_checksums: bool = False):
        self.directory = directory
        self.cache = FileCache(cache_size)
        self.verify = verify_checksums
        self._verified: set[tuple[str, str]] = set()
        self.bytes_read = 0
        self.cast = False  # view chunks in their stored dtype and convert while copying
        self.format = ""  # the attached checkpoint's layout
        self.merge_gap = _MERGE_GAP  # prefetch ranges of one file closer than this are requested as one

    def attach(self, ckpt, *, cast: bool = False) -> None:
        """Serve the chunks of ``ckpt`` (a :class:`pipeload.formats.Checkpoint` of any layout).

        Its data files are opened by the layout's opener (safetensors files when it has none) and
        its file names are relative to its root. Call before the first read.
        """
        self.directory = ckpt.root
        self.format = ckpt.format
        self.cast = cast
        self.merge_gap = _MERGE_GAP if ckpt.merge_gap is None else ckpt.merge_gap
        if ckpt.opener is not None:
            self.cache.close()
            self.cache = FileCache(self.cache.capacity, opener=ckpt.opener)

    def _file(self, name: str) -> SafetensorsFile:
        # Files open with readahead off (see _fastio); every range is requested exactly
        # (MADV_WILLNEED) before it is copied. Sequential reads run as fast as with readahead;
        # scattered ones (another rank's file, resharding) no longer pull in neighbours nobody on this
        # node needs.
        f = self.cache.get(os.path.join(self.directory, name))
        f.check_unchanged()  # a truncated mapping would SIGBUS: refuse it with a ReadError instead
        return f

    def _bytes(self, f: SafetensorsFile, key: str, expect_checksum: str) -> memoryview:
        buf = f.buffer(key)
        # "" = the layout records no checksum (HF, DCP): nothing to check
        if self.verify and expect_checksum and (f.path, key) not in self._verified:
            got = checksum(buf)
            if got != expect_checksum:
                raise ChecksumError(
                    f"{f.path}: tensor {key!r} has checksum {got}, the metadata recorded {expect_checksum}"
                )
            self._verified.add((f.path, key))
        return buf

    def prefetch(self, items: Iterable[ReadItem]) -> None:
        """Ask the kernel for the bytes of ``items`` now, as few large requests (adjacent ranges merged).

        Asynchronous: the reads proceed while this rank copies what is already there.
        """
        spans: dict[str, list[tuple[int, int]]] = {}
        try:
            for item in items:
                if item.nbytes == 0:
                    continue
                f = self._file(item.file)
                start = f.entry(item.key)[2]
                itemsize = item.nbytes // math.prod(item.lengths)
                lo, hi = box_span(item.chunk_lengths, item.src_offsets, item.lengths, itemsize)
                spans.setdefault(item.file, []).append((start + lo, start + hi))
            for name, ranges in spans.items():
                f = self._file(name)
                gap = getattr(f, "merge_gap", self.merge_gap)  # a layout may hold other ranks' items closer
                ranges.sort()
                lo, hi = ranges[0]
                for a, b in ranges[1:]:
                    if a - hi > gap:
                        f.advise("willneed", lo, hi)
                        lo = a
                    hi = max(hi, b)
                f.advise("willneed", lo, hi)
        except Exception:  # noqa: BLE001 - a hint only; the read itself reports what is wrong
            pass

    def chunk(self, item: ReadItem, dtype: torch.dtype, advise: bool = True) -> torch.Tensor:
        """A zero-copy tensor view of the whole stored chunk ``item`` reads from."""
        f = self._file(item.file)
        stored_dtype, shape, start, _ = f.entry(item.key)
        if self.cast:
            dtype = torch_dtype(stored_dtype)  # copy_box converts into the destination's dtype
        if tuple(shape) != item.chunk_lengths or torch_dtype(stored_dtype) != dtype:
            raise CheckpointFormatError(
                f"{f.path}: tensor {item.key!r} is {stored_dtype} {list(shape)}, "
                f"the metadata says {dtype_name(dtype)} {list(item.chunk_lengths)}"
            )
        buf = self._bytes(f, item.key, item.checksum)
        if buf.nbytes == 0:
            return torch.empty(item.chunk_lengths, dtype=dtype)
        if advise:
            lo, hi = box_span(item.chunk_lengths, item.src_offsets, item.lengths, dtype.itemsize)
            f.advise("willneed", start + lo, start + hi)
        return torch.frombuffer(buf, dtype=torch.uint8).view(dtype).view(item.chunk_lengths)

    def read_into(self, item: ReadItem, out: torch.Tensor, advise: bool = True) -> None:
        """Copy ``item``'s box into ``out`` (the destination shard, or its staging view)."""
        if item.nbytes == 0:
            return
        try:
            src = narrow(self.chunk(item, out.dtype, advise), item.src_offsets, item.lengths)
            copy_box(narrow(out, item.dest_offsets, item.lengths), src)
        except (CheckpointFormatError, ReadError):
            raise
        except OSError as e:
            raise ReadError(f"{os.path.join(self.directory, item.file)}: {type(e).__name__}: {e.strerror or e}") from e
        self.bytes_read += item.nbytes

    def read_object(self, meta: ObjectMeta) -> Any:
        """A Python object, decoded with ``torch.load(weights_only=True)``: it cannot execute code."""
        f = self._file(meta.file)
        _, _, start, end = f.entry(meta.key)
        f.advise("willneed", start, end)
        buf = self._bytes(f, meta.key, meta.checksum)
        if buf.nbytes != meta.nbytes:
            raise CheckpointFormatError(
                f"{f.path}: object {meta.key!r} has {buf.nbytes} bytes, the metadata says {meta.nbytes}"
            )
        self.bytes_read += buf.nbytes
        return torch.load(io.BytesIO(bytes(buf)), weights_only=True)

    def close(self) -> None:
        self.cache.close()

    def __enter__(self) -> "ChunkReader":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
