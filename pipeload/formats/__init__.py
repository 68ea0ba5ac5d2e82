"""Checkpoint layouts pipeload reads: its own, torch.distributed.checkpoint's, and Hugging Face's.

Each layout is one module that turns a checkpoint into the same in-memory
:class:`pipeload.formats.metadata.Metadata` (tensors -> chunks -> the file and key holding their bytes, plus
Python objects) and says how to open its data files. Nothing after this package knows which layout it
loads: the planner, the scheduler and the error handling see only ``Metadata`` and a file opener.

Reading happens in two steps so that one rank reads and every rank decodes (as ``.metadata`` is read
by rank 0 and broadcast)::

    payload = read_payload(path, format)          # one rank: file reads only; a picklable value
    ckpt = from_payload(payload, path, key_map)   # every rank, with its own path: parse, validate

``open_checkpoint(path)`` does both in one process (tools, tests). Layouts without checksums record
``""`` as a chunk's checksum: "none recorded", which ``verify_checksums`` skips.
"""

from __future__ import annotations

import copy
import dataclasses
import os
import stat
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

from ..errors import CheckpointFormatError
from .chunkindex import IndexedTensors
from .metadata import METADATA_FILE, Metadata, TensorMeta, dtype_name
from ..io import storage
from . import dcp, hf, native

FORMATS = ("pipeload", "dcp", "hf")
NO_CHECKSUM = ""  # a chunk or object whose layout records no checksum

KeyMap = Callable[[str], "str | None"] | Mapping[str, str] | None


@dataclass
class Checkpoint:
    """A checkpoint of any layout, as the engine sees it."""

    format: str  # "pipeload" | "dcp" | "hf"
    root: str  # directory the data file names of ``metadata`` are relative to
    metadata: Metadata
    # How the reader opens a data file (path -> object with SafetensorsFile's entry/buffer/advise/
    # check_unchanged/close); None: the files are safetensors files, keyed by tensor name.
    opener: Callable[[str], Any] | None = None
    # Per data file, the safetensors ``__metadata__`` map (HF layout; empty elsewhere).
    file_metadata: dict[str, dict[str, str]] = field(default_factory=dict)
    # Prefetch: a rank's ranges of one file closer than this are requested as one (None: the
    # reader's default, right when each rank reads mostly contiguous ranges of its own file).
    merge_gap: int | None = None
    # The rank a layout names as the writer of a data file (-1: none). The plan prefers that rank as the
    # reader of the replicated shards stored there (see pipeload.plan.globalplan): one rank then reads a run
    # of neighbouring items, and no storage page is read by two ranks. None: the layout names none
    # (pipeload's own save already places each shard in the file its load reader is chosen for).
    writer_of: Callable[[str], int] | None = None
    # No rank wrote the files (another tool did): readers are preferred by storage position instead
    # (pipeload.plan.storageorder), so each rank reads one contiguous run of them.
    by_position: bool = False


def detect(path: str) -> str:
    """The layout of the checkpoint at ``path``, from the files present (reads at most 1 byte).

    - ``.metadata`` whose first byte opens a JSON object: pipeload; a pickle (0x80): torch DCP;
    - a ``.safetensors`` file, a directory with ``model.safetensors.index.json`` or with
      ``*.safetensors`` files: Hugging Face.
    """
    if storage.is_url(path):
        return _detect_url(path, None)
    if os.path.isfile(path):
        if path.endswith(".safetensors"):
            return "hf"
        raise CheckpointFormatError(f"{path}: not a checkpoint (a file that is not .safetensors)")
    md_path = os.path.join(path, METADATA_FILE)
    try:
        # never blocking (a FIFO) and never endless (a device): only a regular file is peeked at; any
        # other .metadata is handed to the pipeload reader, which refuses it by name
        fd = os.open(md_path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
        try:
            head = os.read(fd, 64).lstrip() if stat.S_ISREG(os.fstat(fd).st_mode) else b"{"
        finally:
            os.close(fd)
    except FileNotFoundError:
        head = None
    except OSError as e:
        raise CheckpointFormatError(f"{md_path}: cannot read metadata ({e.strerror or e})") from None
    if head is not None:
        if head[:1] == b"\x80":
            return "dcp"
        return "pipeload"  # JSON, or garbage the pipeload parser will name
    if hf.is_hf_dir(path):
        return "hf"
    raise CheckpointFormatError(
        f"{path}: not a pipeload checkpoint (no {METADATA_FILE}), nor a torch.distributed.checkpoint "
        f"or Hugging Face safetensors one"
    )


def _detect_url(path: str, names) -> str:
    """:func:`detect` for object storage, from ``names`` (the prefix's snapshot; None: LIST it now)."""
    if path.endswith(".safetensors"):
        return "hf"
    names = storage.snapshot(path) if names is None else names
    if METADATA_FILE in names:
        head = storage.read_bytes(storage.join(path, METADATA_FILE), 1 << 30, keep=True)[:64].lstrip()
        return "dcp" if head[:1] == b"\x80" else "pipeload"
    if hf.INDEX_FILE in names or any(n.endswith(hf.SUFFIX) for n in names):
        return "hf"
    raise CheckpointFormatError(f"{path}: not a checkpoint (no {METADATA_FILE}, no *.safetensors objects)")


def read_payload(path: str | os.PathLike, format: str | None = None, headers: bool = False) -> tuple[str, Any]:
    """What one rank reads for everyone: (format, layout-specific data), picklable.

    It holds no path: ranks may load the same checkpoint from different paths (a copy per node), and
    each decodes the payload against its own (:func:`from_payload`). ``headers``: pipeload's layout in
    object storage, the data objects' headers too (:func:`pipeload.formats.native.object_headers`: for
    a load's ranks, who would each fetch the headers of the objects they open).
    """
    path = os.fspath(path)
    if storage.is_url(path):  # the versions every rank reads, pinned now: (format, data, versions)
        root = os.path.dirname(path) if path.endswith(".safetensors") else path
        versions = storage.snapshot(root)
        format = _detect_url(path, versions) if format is None else format
    if format is None:
        format = detect(path)
    elif format not in FORMATS:
        raise ValueError(f"format must be one of {', '.join(FORMATS)} or None, got {format!r}")
    module = {"pipeload": native, "dcp": dcp, "hf": hf}[format]
    if storage.is_url(path):
        data = (hf.read_payload(path, versions) if format == "hf" else
                native.read_payload(path, versions if headers else None) if format == "pipeload" else
                module.read_payload(path))
        return format, data, versions
    return format, module.read_payload(path)


def from_payload(payload: tuple[str, Any], path: str | os.PathLike, key_map: KeyMap = None) -> Checkpoint:
    """Decode and validate a payload into the Checkpoint at this rank's ``path``; ``key_map`` renames keys."""
    format, data = payload[:2]
    path = os.fspath(path)
    if len(payload) > 2:  # an object store's versions, as rank 0 listed them
        storage.pin(os.path.dirname(path) if path.endswith(".safetensors") else path, payload[2])
    module = {"pipeload": native, "dcp": dcp, "hf": hf}[format]
    ckpt = Checkpoint(format, *module.from_payload(path, data))
    if format == "hf":
        # Whole tensors, each read by several ranks in parts: the bytes between two of this rank's
        # ranges are usually another rank's share. Merge only what is about one page apart.
        ckpt.merge_gap = hf.MERGE_GAP
        ckpt.by_position = True
    elif format == "dcp":
        ckpt.writer_of = dcp.writer_of
    if key_map is not None:
        ckpt.metadata = rename(ckpt.metadata, key_map, path)
    return ckpt


def open_checkpoint(path: str | os.PathLike, format: str | None = None, key_map: KeyMap = None) -> Checkpoint:
    """Read and decode the checkpoint at ``path`` in this process."""
    return from_payload(read_payload(path, format), path, key_map)


def rename(md: Metadata, key_map: KeyMap, source: str) -> Metadata:
    """``md`` with every key passed through ``key_map``.

    A dict maps the names it lists and keeps the others; a callable returns the new name, or None to
    leave the key out of the load. Two keys mapped to one name are an error. Only names change: chunks
    still point at the stored file and key.
    """
    if isinstance(key_map, Mapping):
        table = key_map
        fn = lambda k: table.get(k, k)  # noqa: E731
    elif callable(key_map):
        fn = key_map
    else:
        raise TypeError(f"key_map must be a dict or a callable, not {type(key_map).__name__}")
    out = Metadata(md.save_id, md.world_size, version=md.version)
    origin: dict[str, str] = {}
    for kind, src, dst in (("tensor", md.tensors, out.tensors), ("object", md.objects, out.objects)):
        for key, value in src.items():
            new = fn(key)
            if new is None:
                continue
            if not isinstance(new, str):
                raise TypeError(f"key_map returned {type(new).__name__} for {key!r}; expected str or None")
            if new in origin:
                raise CheckpointFormatError(
                    f"{source}: key_map maps both {origin[new]!r} and {key!r} to {new!r}"
                )
            origin[new] = key
            dst[new] = value
    return out


def cast_metadata(md: Metadata, leaves: dict) -> Metadata:
    """``md`` with each tensor's dtype replaced by the state dict's where they differ (``cast=True``).

    The plan then sizes shards, staging buffers and broadcasts in the destination dtype; the reader
    views the stored bytes in their own dtype and converts while copying. Every rank must hold the
    same dtype for a key (true of any state dict built from one model). Only dtypes are compared (no
    chunk is decoded), so a load whose dtypes all match pays one lookup per tensor leaf.
    """
    from ..plan.statedict import is_tensor
    from ..slices import Slice

    changed = {}
    for fqn, leaf in leaves.items():
        value = leaf.value
        if isinstance(value, Slice):  # (its tensor is the one it names; its dtype its view's)
            fqn, value = value.name, value.view
        elif not is_tensor(value):
            continue
        stored = _stored_dtype(md.tensors, fqn)
        if stored is None:
            continue
        try:
            want = dtype_name(value.dtype)
        except KeyError:
            continue  # the planner reports the unsupported dtype
        if want != stored:
            changed.setdefault(fqn, want)  # (slices of one tensor in two dtypes: the planner names the other)
    if not changed:
        return md
    # every other field kept: an indexed table without its index_file/data_files is not one
    return dataclasses.replace(md, tensors=_with_dtypes(md.tensors, changed))


def _stored_dtype(tensors: Mapping, fqn: str) -> str | None:
    if isinstance(tensors, IndexedTensors):
        i = tensors.pos.get(fqn)
        return None if i is None else tensors.dtypes[i]
    t = tensors.get(fqn)
    return None if t is None else t.dtype


def _with_dtypes(tensors: Mapping, changed: dict[str, str]) -> Mapping:
    """``tensors`` with the dtypes of ``changed``; an indexed table stays one (its chunks undecoded)."""
    if isinstance(tensors, IndexedTensors):
        out = copy.copy(tensors)
        out.dtypes = list(tensors.dtypes)
        for fqn, dtype in changed.items():
            out.dtypes[tensors.pos[fqn]] = dtype
        return out
    out = dict(tensors)
    for fqn, dtype in changed.items():
        t = out[fqn]
        out[fqn] = TensorMeta(dtype, t.shape, t.chunks)
    return out


__all__ = [
    "FORMATS",
    "NO_CHECKSUM",
    "Checkpoint",
    "cast_metadata",
    "detect",
    "from_payload",
    "open_checkpoint",
    "read_payload",
    "rename",
]
