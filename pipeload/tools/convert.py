"""Rewrite a checkpoint of any readable layout as a pipeload or a Hugging Face checkpoint.

Streaming: each output file's header is computed from the metadata alone, written first, and then the
tensors are copied in one at a time, so memory stays bounded by one stored chunk (pipeload output keeps
the source's chunks) or by one whole tensor (HF output stores tensors whole). Checksums are computed
while writing. The output is committed like ``pipeload.save`` commits: data files first, fsynced,
then ``.metadata`` (or the index) under a temporary name, renamed.
"""

from __future__ import annotations

import json
import math
import os
import uuid
from typing import Any, Iterable

import torch

from ..io import storage
from ..io.checksum import hasher
from ..errors import CheckpointFormatError
from ..formats.metadata import (METADATA_FILE, OBJECT_ENCODING, ChunkMeta, Metadata, ObjectMeta, TensorMeta,
                                chunk_key, dtype_itemsize, torch_dtype)
from ..plan.planner import ReadItem
from ..io.reader import ChunkReader
from ..save.saver import write_chunk_index
from ..formats import Checkpoint, KeyMap, open_checkpoint
from ..formats.hf import INDEX_FILE

DEFAULT_FILE_BYTES = 2 << 30  # pipeload output: start a new data file past this many bytes
DEFAULT_SHARD_BYTES = 5 << 30  # HF output: the usual max shard size


def _header(entries: list[tuple[str, str, tuple[int, ...], int]], metadata: dict[str, str]) -> tuple[bytes, list[tuple[int, int]]]:
    """The safetensors header bytes (8-byte length + JSON padded to 8) and each entry's data range."""
    doc: dict[str, Any] = {"__metadata__": metadata} if metadata else {}
    ranges, pos = [], 0
    for name, dtype, shape, nbytes in entries:
        doc[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [pos, pos + nbytes]}
        ranges.append((pos, pos + nbytes))
        pos += nbytes
    text = json.dumps(doc, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return len(text).to_bytes(8, "little") + text, ranges


def _bytes_of(t: torch.Tensor) -> memoryview:
    return memoryview(t.contiguous().reshape(-1).view(torch.uint8).numpy())


def _chunk_item(c: ChunkMeta, itemsize: int) -> ReadItem:
    zero = (0,) * len(c.lengths)
    return ReadItem(c.file, c.key, c.checksum, c.lengths, zero, zero, c.lengths, math.prod(c.lengths) * itemsize)


def _whole(reader: ChunkReader, t: TensorMeta) -> torch.Tensor:
    """The global tensor ``t`` assembled from its chunks."""
    dtype = torch_dtype(t.dtype)
    if len(t.chunks) == 1 and t.chunks[0].lengths == t.shape:
        return reader.chunk(_chunk_item(t.chunks[0], dtype.itemsize), dtype)
    out = torch.empty(t.shape, dtype=dtype)
    for c in t.chunks:
        zero = (0,) * len(c.lengths)
        reader.read_into(ReadItem(c.file, c.key, c.checksum, c.lengths, zero, c.offsets, c.lengths,
                                  math.prod(c.lengths) * dtype.itemsize), out)
    return out


def _pack(sizes: Iterable[tuple[Any, int]], limit: int) -> list[list[Any]]:
    """Consecutive groups of items whose byte sizes add up to at most ``limit`` (one oversize item alone)."""
    groups: list[list[Any]] = [[]]
    total = 0
    for item, n in sizes:
        if groups[-1] and total + n > limit:
            groups.append([])
            total = 0
        groups[-1].append(item)
        total += n
    return [g for g in groups if g]


def _write(path: str, header: bytes, payloads: Iterable[memoryview], checksums: list[str] | None) -> None:
    with storage.create(path, -1) as f:
        f.write(header)
        for data in payloads:
            if checksums is not None:
                h = hasher()
                h.update(data)
                checksums.append(h.hexdigest())
            f.write(data)
        storage.durable(f)


def _commit(dst: str, name: str, text: str) -> None:
    if storage.is_url(dst):  # one PUT, after every data object completed: the commit point
        storage.put_bytes(storage.join(dst, name), text.encode())
        return
    tmp = os.path.join(dst, f".{name}.tmp-{uuid.uuid4().hex[:8]}")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, os.path.join(dst, name))
    fd = os.open(dst, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def convert(src: str | os.PathLike, dst: str | os.PathLike, *, to: str = "pipeload", format: str | None = None,
            key_map: KeyMap = None, file_bytes: int | None = None,
            storage_options: dict | None = None) -> dict[str, Any]:
    """Write the checkpoint at ``src`` (any layout, or ``format``) to the directory ``dst``.

    ``to="pipeload"`` keeps every stored chunk and object (checksums computed); ``to="hf"`` writes
    whole tensors into ``model-0000k-of-0000n.safetensors`` files of at most ``file_bytes`` (5 GiB) with
    ``model.safetensors.index.json``; Python objects have no place there and are left out (counted in
    the result). Returns {"format", "files", "tensors", "objects", "skipped_objects"}.
    """
    if to not in ("pipeload", "hf"):
        raise ValueError(f"to must be 'pipeload' or 'hf', got {to!r}")
    for path in (src, dst):  # either may be an object-store URL
        storage.configure(os.fspath(path), storage_options)
    ckpt = open_checkpoint(src, format, key_map)
    dst = os.fspath(dst)
    if storage.exists(os.path.join(dst, METADATA_FILE)) or storage.exists(os.path.join(dst, INDEX_FILE)):
        raise CheckpointFormatError(f"{dst}: already holds a checkpoint; convert into an empty directory")
    storage.makedirs(dst)
    with ChunkReader(ckpt.root) as reader:
        reader.attach(ckpt)
        if to == "pipeload":
            return _to_pipeload(ckpt, reader, dst, file_bytes or DEFAULT_FILE_BYTES)
        return _to_hf(ckpt, reader, dst, file_bytes or DEFAULT_SHARD_BYTES)


def _to_pipeload(ckpt: Checkpoint, reader: ChunkReader, dst: str, limit: int) -> dict[str, Any]:
    md = ckpt.metadata
    save_id = uuid.uuid4().hex[:16]
    # (kind, fqn, chunk or object meta, stored name, dtype, shape, nbytes) in key order
    work = []
    for fqn in sorted(md.tensors):
        t = md.tensors[fqn]
        itemsize = dtype_itemsize(t.dtype)
        for c in sorted(t.chunks, key=lambda c: c.offsets):
            whole = c.lengths == t.shape and not any(c.offsets)
            name = chunk_key(fqn, c.offsets, whole)
            work.append(("t", fqn, c, name, t.dtype, c.lengths, c.numel * itemsize))
    for fqn in sorted(md.objects):
        o = md.objects[fqn]
        work.append(("o", fqn, o, f"{fqn}#object", "U8", (o.nbytes,), o.nbytes))
    out = Metadata(save_id=save_id, world_size=1)
    groups = _pack(((w, w[6]) for w in work), limit)
    for rank, group in enumerate(groups):
        fname = f"data-{save_id}-{rank:05d}.safetensors"
        header, _ = _header([(w[3], w[4], w[5], w[6]) for w in group], {"format": "pipeload", "save_id": save_id})
        sums: list[str] = []

        def payloads(group=group):
            for kind, fqn, meta, _, dtype, shape, _n in group:
                if kind == "t":
                    yield _bytes_of(reader.chunk(_chunk_item(meta, dtype_itemsize(dtype)), torch_dtype(dtype)))
                else:
                    yield reader.cache.get(os.path.join(reader.directory, meta.file)).buffer(meta.key)

        _write(os.path.join(dst, fname), header, payloads(), sums)
        for (kind, fqn, meta, name, dtype, shape, n), s in zip(group, sums):
            if kind == "t":
                prev = out.tensors.get(fqn)
                chunk = ChunkMeta(meta.offsets, meta.lengths, fname, name, s)
                src = md.tensors[fqn]
                out.tensors[fqn] = TensorMeta(src.dtype, src.shape, (*(prev.chunks if prev else ()), chunk))
            else:
                out.objects[fqn] = ObjectMeta(fname, name, n, s, OBJECT_ENCODING)
    out.world_size = max(1, len(groups))
    _commit(dst, METADATA_FILE, out.to_json_v2(write_chunk_index(dst, out)))
    return {"format": "pipeload", "files": len(groups), "tensors": len(out.tensors), "objects": len(out.objects),
            "skipped_objects": 0}


def _to_hf(ckpt: Checkpoint, reader: ChunkReader, dst: str, limit: int) -> dict[str, Any]:
    md = ckpt.metadata
    names = sorted(md.tensors)
    sizes = [(n, math.prod(md.tensors[n].shape) * dtype_itemsize(md.tensors[n].dtype)) for n in names]
    groups = _pack(sizes, limit)
    size_of = dict(sizes)  # once: rebuilding it per tensor made a 100k-tensor conversion quadratic
    meta = {"format": "pt"}
    if ckpt.format == "hf" and len(ckpt.file_metadata) == 1:
        meta = dict(next(iter(ckpt.file_metadata.values()))) or meta  # keep a single file's __metadata__
    weight_map: dict[str, str] = {}
    total = 0
    for i, group in enumerate(groups):
        fname = f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors"
        entries = [(n, md.tensors[n].dtype, md.tensors[n].shape, size_of[n]) for n in group]
        header, _ = _header(entries, meta)
        _write(os.path.join(dst, fname), header, (_bytes_of(_whole(reader, md.tensors[n])) for n in group), None)
        for n in group:
            weight_map[n] = fname
        total += sum(e[3] for e in entries)
    _commit(dst, INDEX_FILE, json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
    return {"format": "hf", "files": len(groups), "tensors": len(names), "objects": 0,
            "skipped_objects": len(md.objects)}


__all__ = ["convert"]
