"""DCP's own readers, reading the way pipeload does (the protocol: :mod:`pipeload.dcp.readonce`).

- :class:`StorageReader`: a ``FileSystemReader`` for DCP's layout (``.metadata`` + ``__<rank>_<i>.distcp``).
  A tensor box without transforms is viewed in the mapped ``.distcp`` file (the ``torch.save`` zip's
  storage record, found without ``torch.load``; anything unexpected falls back to
  ``torch.load(weights_only=True)``) and copied once, straight into DCP's destination. A box with
  transform descriptors (``ZStandard``, any registered ``StreamTransformExtension``) is read by
  ``FileSystemReader.read_data`` itself, shared or not. ``.metadata`` is read by every rank itself, as
  DCP's reader does, and unpickled with pipeload's allow-list (no code from the file runs); rank-local
  metadata (``__<rank>.metadata``, written without collectives) is read by DCP's reader.
- :class:`FileSystemReader`: what :func:`pipeload.dcp.install` binds in place of DCP's; a ``.metadata``
  the allow-list refuses is unpickled by DCP's reader, as it would be without ``install()``.
- :class:`HuggingFaceStorageReader`: DCP's reader of safetensors directories; shared boxes read by one
  rank through DCP's own code, the rest as DCP reads them.
"""

from __future__ import annotations

import io
import os
import warnings
from typing import Any

import torch
from torch.distributed.checkpoint import filesystem as _fs
from torch.distributed.checkpoint import hf_storage as _hf
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem

from ..errors import CheckpointFormatError, ReadError
from ..formats.dcp import _Unexpected, load_dcp_metadata, locate_tensor, writer_of
from ..formats.metadata import METADATA_FILE, plain_file_name, read_metadata_bytes, resolve_inside
from ..io._fastio import RawFile
from .readonce import ReadOnce, _key

# DCP's classes as they were when pipeload.dcp was first imported (before any install()).
DCP_FILE_SYSTEM_READER = _fs.FileSystemReader
DCP_HF_READER = _hf.HuggingFaceStorageReader


class StorageReader(ReadOnce, DCP_FILE_SYSTEM_READER):
    """``dcp.load(sd, storage_reader=StorageReader(path))``: DCP's ``FileSystemReader``, each stored box
    several ranks read fetched once and sent (see :mod:`pipeload.dcp`).

    ``process_group``: the group the sends go over (default: the world; it must hold every rank of the
    ``dcp.load``); ``share``: ``"auto"`` (default: when a box's readers span hosts), ``True``, ``False``."""

    # what the allow-lists refuse (a .metadata of other classes, a saved object torch.load(weights_only=True)
    # refuses): raised, naming the file, key and class; True (install(allow_pickle=True)): DCP's unpickling
    _allow_pickle = False

    def __init__(self, path: str | os.PathLike, _extension_registry: Any = None, *, process_group: Any = None,
                 share: bool | str = "auto"):
        super().__init__(path, _extension_registry)
        self._init_read_once(process_group, share)
        self._files: dict[str, RawFile] = {}
        self._sizes: dict[str, dict[tuple, tuple]] = {}

    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        super().reset(checkpoint_id)
        self._done()

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        """``.metadata`` read here and unpickled with the allow-list; rank-local metadata by DCP's reader."""
        if args or kwargs.get("rank") is not None:
            return super().read_metadata(*args, **kwargs)
        directory = os.fspath(self.path)
        try:
            md = load_dcp_metadata(read_metadata_bytes(directory), os.path.join(directory, METADATA_FILE))
        except CheckpointFormatError:
            if not self._allow_pickle:
                raise
            return super().read_metadata()
        if getattr(md, "storage_meta", None) is None:
            md.storage_meta = StorageMeta()
        md.storage_meta.load_id = self.load_id
        return md

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        super().set_up_storage_reader(metadata, is_coordinator, *args, **kwargs)
        self._sizes = {}

    def _transformed(self, item: ReadItem) -> bool:
        return bool(getattr(self.storage_data[item.storage_index], "transform_descriptors", None))

    def _shareable(self, item: ReadItem) -> bool:
        # stored bytes without transforms are the object's bytes: their length is in the metadata
        return item.type != LoadItemType.BYTE_IO or not self._transformed(item)

    def _writer(self, item: ReadItem) -> int:
        return writer_of(os.path.basename(str(self.storage_data[item.storage_index].relative_path)))

    def _read_box(self, item: ReadItem) -> torch.Tensor:
        return super()._read_box(item) if self._transformed(item) else self._read(item)

    def _read_private(self, plan: LoadPlan, planner: LoadPlanner) -> None:
        """Plain boxes in place, per file in file order; boxes with transforms by DCP's reader."""
        theirs = [i for i in plan.items if self._transformed(i)]
        if theirs:
            super()._read_private(LoadPlan(theirs, plan.storage_data, plan.planner_data), planner)
        plain = [i for i in plan.items if not self._transformed(i)]
        plain.sort(key=self._storage_order)
        for item in plain:
            self._deliver(item, self._read(item), planner)

    def _read(self, item: ReadItem) -> torch.Tensor:
        """The stored box of a plain ``item`` as a tensor: a view of the mapped file where the blob is plain."""
        idx = item.storage_index
        info = self.storage_data[idx]
        directory = os.fspath(self.path)
        name = plain_file_name(getattr(info, "relative_path", None), f"{directory}: {idx.fqn!r}")
        raw = self._files.get(name)
        if raw is None:
            try:
                raw = self._files[name] = RawFile(resolve_inside(directory, name))
            except OSError as e:
                raise ReadError(f"{os.path.join(directory, name)}: {e.strerror or e} (item {idx.fqn!r})") from None
        blob = raw.view(info.offset, info.length)
        self.stats.items_read.append(_key(item))
        self.stats.bytes_read += info.length
        if item.type == LoadItemType.BYTE_IO:
            return torch.frombuffer(bytearray(blob), dtype=torch.uint8)
        whole = self._chunk(idx.fqn, tuple(idx.offset))
        dtype = self._dtype(item)
        try:
            a, b = locate_tensor(blob, dtype, whole)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # a read-only mapping, only read from
                t = torch.frombuffer(blob[a:b], dtype=dtype).reshape(whole) if b > a else torch.zeros(whole, dtype=dtype)
        except _Unexpected:
            t = torch.load(io.BytesIO(bytes(blob)), map_location="cpu", weights_only=True)
            if not isinstance(t, torch.Tensor) or t.dtype != dtype or tuple(t.shape) != whole:
                raise CheckpointFormatError(f"{os.path.join(directory, name)}: item {idx.fqn!r} does not hold a "
                                            f"{dtype} tensor of shape {list(whole)}") from None
        box = tuple(slice(o, o + n) for o, n in zip(item.storage_offsets, item.lengths))
        return t[box]  # a view of the mapping (files close after the load's last read)

    def _chunk(self, fqn: str, offsets: tuple) -> tuple:
        sizes = self._sizes.get(fqn)
        if sizes is None:
            sizes = self._sizes[fqn] = {tuple(c.offsets): tuple(c.sizes)
                                        for c in self._md.state_dict_metadata[fqn].chunks}
        return sizes[offsets]

    def _done(self) -> None:
        for f in self._files.values():
            f.close()
        self._files = {}


class FileSystemReader(StorageReader):
    """What :func:`pipeload.dcp.install` binds as ``torch.distributed.checkpoint.FileSystemReader``:
    :class:`StorageReader` with DCP's constructor; what the allow-lists refuse is unpickled by DCP's
    code only under ``install(allow_pickle=True)``."""


class HuggingFaceStorageReader(ReadOnce, DCP_HF_READER):
    """DCP's ``HuggingFaceStorageReader`` (safetensors files), each box several ranks read fetched by one
    of them through DCP's own code and sent; what :func:`pipeload.dcp.install` binds in its place."""

    def __init__(self, path: str, thread_count: int = 1, *, process_group: Any = None,
                 share: bool | str = "auto"):
        super().__init__(path, thread_count)
        self._init_read_once(process_group, share)
