"""Looking at a checkpoint without loading it: a summary, and a full integrity check.

:func:`inspect_checkpoint` reads only ``.metadata`` and the data files' sizes. :func:`verify_checkpoint`
reads every byte once, file by file in offset order, and reports every problem it finds (file, key,
what) instead of stopping at the first. ``pipeload inspect`` / ``pipeload verify`` format these.
"""

from __future__ import annotations

import math
import os
from collections import Counter, defaultdict
from typing import Any

from ..io import storage
from ..errors import CheckpointFormatError
from ..errors import TensorNotFoundError
from ..formats import detect, open_checkpoint
from ..formats.metadata import dtype_itemsize, resolve_inside


def _configured(path, storage_options):
    storage.configure(os.fspath(path), storage_options)
    return path


def _split_dims(shape: tuple[int, ...], chunks) -> tuple[int, ...]:
    """The dims along which a tensor's chunks cut it."""
    return tuple(d for d in range(len(shape)) if any(c.lengths[d] != shape[d] for c in chunks))


def _sidecar(path, format: str | None) -> str | None:
    """A DCP checkpoint's chunk-table sidecar as found before it is read: absent, current or stale."""
    if storage.is_url(path) or (format or detect(os.fspath(path))) != "dcp":
        return None
    from ..formats.dcpmeta import sidecar_state

    return sidecar_state(os.fspath(path))


def _layout(chunk_counts: Counter, split_dims: Counter) -> dict[str, Any]:
    return {
        "whole": chunk_counts.get(1, 0),
        "chunked": sum(n for k, n in chunk_counts.items() if k > 1),
        "empty": chunk_counts.get(0, 0),
        "by_chunk_count": {str(k): n for k, n in sorted(chunk_counts.items()) if k > 1},
        "by_split_dims": dict(sorted(split_dims.items())),
    }


def inspect_checkpoint(path: str | os.PathLike, format: str | None = None,
                       storage_options: dict | None = None) -> dict[str, Any]:
    """A summary of the checkpoint at ``path``, of any layout pipeload reads (JSON-serialisable).

    Keys: ``path``, ``save_id``, ``world_size`` (of the save), ``version``, ``tensors`` / ``chunks`` /
    ``objects`` (counts), ``tensor_bytes`` / ``object_bytes`` (payload), ``file_bytes`` (on disk),
    ``files`` (per data file: name, size, chunks, objects, payload bytes; ``size`` is ``None`` when the
    file is missing), ``dtypes`` (per dtype: tensors, bytes), ``layout`` (tensors stored whole vs cut
    into chunks, by chunk count and by the dims they are cut along), ``largest`` (the 5 biggest
    tensors), ``object_list`` (every object: fqn, file, bytes), ``format`` (pipeload, dcp, hf) and
    ``file_metadata`` (HF: each file's safetensors ``__metadata__``), ``sidecar`` (DCP: the chunk-table
    sidecar as this call found it: absent, current or stale; reading the checkpoint may then write it).
    """
    path = _configured(path, storage_options)
    sidecar = _sidecar(path, format)
    ckpt = open_checkpoint(path, format)
    directory, md = ckpt.root, ckpt.metadata
    per_file: dict[str, dict[str, Any]] = defaultdict(lambda: {"chunks": 0, "objects": 0, "payload_bytes": 0})
    dtypes: dict[str, dict[str, int]] = defaultdict(lambda: {"tensors": 0, "bytes": 0})
    chunk_counts: Counter[int] = Counter()
    split_dims: Counter[str] = Counter()
    sizes = []
    tensor_bytes = 0
    n_chunks = 0
    for fqn, t in md.tensors.items():
        itemsize = dtype_itemsize(t.dtype)
        nbytes = math.prod(t.shape) * itemsize
        tensor_bytes += nbytes
        dtypes[t.dtype]["tensors"] += 1
        dtypes[t.dtype]["bytes"] += nbytes
        chunk_counts[len(t.chunks)] += 1
        n_chunks += len(t.chunks)
        if len(t.chunks) > 1:
            dims = _split_dims(t.shape, t.chunks)
            split_dims[",".join(map(str, dims)) or "-"] += 1
        sizes.append((nbytes, fqn, t))
        for c in t.chunks:
            per_file[c.file]["chunks"] += 1
            per_file[c.file]["payload_bytes"] += c.numel * itemsize
    objects = []
    for fqn, o in sorted(md.objects.items()):
        per_file[o.file]["objects"] += 1
        per_file[o.file]["payload_bytes"] += o.nbytes
        objects.append({"fqn": fqn, "file": o.file, "bytes": o.nbytes})
    files = []
    file_bytes = 0
    for name in md.files:
        try:
            size = storage.size_of(os.path.join(directory, name))
            file_bytes += size
        except OSError:
            size = None
        files.append({"name": name, "size": size, **per_file[name]})
    sizes.sort(key=lambda x: (-x[0], x[1]))
    return {
        "path": os.fspath(path),
        "format": ckpt.format,
        "file_metadata": ckpt.file_metadata,
        "sidecar": sidecar,
        "save_id": md.save_id,
        "world_size": md.world_size,
        "version": md.version,
        "tensors": len(md.tensors),
        "chunks": n_chunks,
        "objects": len(md.objects),
        "tensor_bytes": tensor_bytes,
        "object_bytes": sum(o.nbytes for o in md.objects.values()),
        "file_bytes": file_bytes,
        "files": files,
        "dtypes": {k: dict(v) for k, v in sorted(dtypes.items())},
        "layout": _layout(chunk_counts, split_dims),
        "largest": [
            {"fqn": fqn, "dtype": t.dtype, "shape": list(t.shape), "bytes": nbytes, "chunks": len(t.chunks)}
            for nbytes, fqn, t in sizes[:5]
        ],
        "object_list": objects,
    }


# ----------------------------------------------------------------------------------------------------
# Integrity check


def _open(path: str, opener=None):
    """A safetensors file or object (``opener``: the layout's, e.g. an HF checkpoint's objects opened
    from the headers its table carries), every byte of it requested for one front-to-back pass."""
    f = (opener or storage.open_safetensors)(path)
    f.advise("sequential")  # verify reads every byte, front to back
    if storage.is_url(path):  # every byte is needed: request them all now, as parallel ranged GETs
        f.advise("willneed", f.data_offset, f.size)
    return f


def _decodes(data: bytearray) -> str | None:
    from ..io.reader import decode_object

    try:
        decode_object(data, "object")
    except CheckpointFormatError as e:
        return str(e).split(": ", 1)[-1]
    return None


def verify_checkpoint(path: str | os.PathLike, format: str | None = None,
                      storage_options: dict | None = None) -> list[str]:
    """Every problem of the checkpoint at ``path`` (any layout); an empty list when it is intact.

    Checks that the metadata (and a format-2 chunk index) parses and its chunks tile each tensor;
    that every data file it names
    exists and is valid (safetensors; for DCP, each item's torch.save blob); that every chunk and object
    is there with the dtype and shape the metadata records; that the stored bytes match the recorded
    xxh3-64 checksums where the layout records them (pipeload; HF and DCP record none, so their bytes
    are read but not compared); and that every object decodes with ``torch.load(weights_only=True)``.
    Each problem reads ``<file>: <key>: <what>``.
    """
    try:
        ckpt = open_checkpoint(_configured(path, storage_options), format)
    except CheckpointFormatError as e:
        return [str(e)]
    directory, md = ckpt.root, ckpt.metadata
    # (key, expected dtype, expected shape, checksum, what) per file
    wanted: dict[str, list[tuple[str, str, tuple[int, ...], str, str]]] = defaultdict(list)
    problems: list[str] = []
    for fqn in md.tensors:
        try:
            t = md.tensors[fqn]  # format 2: decoded and checked here, tensor by tensor
        except CheckpointFormatError as e:
            problems.append(str(e))
            continue
        for c in t.chunks:
            wanted[c.file].append((c.key, t.dtype, tuple(c.lengths), c.checksum, f"chunk of {fqn!r}"))
    for fqn, o in md.objects.items():
        wanted[o.file].append((o.key, "U8", (o.nbytes,), o.checksum, f"object {fqn!r}"))
    for name in sorted(wanted):
        fpath = os.path.join(directory, name)
        try:
            resolve_inside(directory, name)
        except CheckpointFormatError as e:
            problems.append(f"{name}: {str(e).split(': ', 1)[-1]}")
            continue
        try:
            f = _open(fpath, ckpt.opener) if ckpt.opener is None or ckpt.format == "hf" else ckpt.opener(fpath)
        except FileNotFoundError:
            problems.append(f"{name}: file is missing ({len(wanted[name])} chunks/objects live there)")
            continue
        except Exception as e:  # noqa: BLE001 - a bad header is reported, not raised
            kind = "safetensors" if ckpt.opener is None or ckpt.format == "hf" else ckpt.format
            problems.append(f"{name}: not a valid {kind} file: {_one_line(e)}")
            continue
        try:
            problems += _verify_file(f, name, wanted[name])
        finally:
            f.close()
    return problems


def _verify_file(f, name: str, wanted) -> list[str]:
    from ..io.reader import guarded_read  # torch is imported only when a file is actually read

    problems: list[str] = []
    entries = []
    for key, dtype, shape, expect, what in wanted:
        try:
            stored_dtype, stored_shape, start, _ = f.entry(key)
        except TensorNotFoundError:
            problems.append(f"{name}: {key}: missing ({what})")
            continue
        except Exception as e:  # noqa: BLE001 - e.g. a DCP item whose blob cannot be decoded
            problems.append(f"{name}: {key}: cannot read ({_one_line(e)})")
            continue
        if stored_dtype != dtype or tuple(stored_shape) != shape:
            problems.append(
                f"{name}: {key}: stored as {stored_dtype} {list(stored_shape)}, "
                f"the metadata says {dtype} {list(shape)} ({what})"
            )
            continue
        entries.append((start, key, expect, what))
    entries.sort()  # file-offset order: one sequential pass over the file
    for _, key, expect, what in entries:
        try:
            got, data = guarded_read(f, f.buffer(key), keep=what.startswith("object"))
        except Exception as e:  # noqa: BLE001 - an unreadable range is a problem to report
            problems.append(f"{name}: {key}: cannot read ({_one_line(e)})")
            continue
        if expect and got != expect:  # "" = the layout records no checksum
            problems.append(f"{name}: {key}: checksum {got}, the metadata recorded {expect} ({what})")
        elif data is not None:
            err = _decodes(data)
            if err:
                problems.append(f"{name}: {key}: does not load with torch.load(weights_only=True): {err}")
    return problems


def _one_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return text[0] if text else type(e).__name__
