"""A ``torch.distributed.checkpoint`` storage reader that reads the way pipeload does.

``dcp.load(state_dict, storage_reader=pipeload.dcp.StorageReader(path))`` keeps DCP's own API, planner
and result, and changes how the bytes are fetched:

- in place: each tensor chunk's bytes are viewed in the mapped ``.distcp`` file (the ``torch.save``
  zip's storage record, found without ``torch.load``; anything else falls back to
  ``torch.load(weights_only=True)``) and copied once, straight into DCP's destination;
- read once: where the global plan shows the same stored box read by several ranks (replicas), the
  coordinator picks one reader per box (greedy, fewest bytes so far); it reads the box and sends it to
  the other holders (point-to-point, every rank walking the shared boxes in one global order, so no
  rank waits on a message another has not been able to send), instead of every replica reading it;
- ``.metadata`` is read from storage by rank 0 only and broadcast; every rank unpickles it with
  pipeload's allow-list unpickler (no code from the file runs), as DCP requires a ``Metadata`` per rank.

What this reader cannot change, because DCP's ``load`` does it around the reader: every rank unpickles
the whole ``.metadata`` (O(total chunks) per rank: about a minute per rank for 1.9 M chunks, FSDP at
4,096 ranks), every rank's planner walks it to build its ``ReadItem`` objects, and the coordinator
gathers every rank's pickled plan, plans centrally (O(W x S) Python objects on one rank) and scatters
the plans back. ``pipeload.load(state_dict, path)`` does none of these (one rank decodes the metadata
into a chunk table, see :mod:`pipeload.formats.dcpmeta`); use it where the caller can.

Failure: a reader whose read fails still sends (zeros) so its peers are never left waiting, then raises
naming the file, the item and the rank; ``dcp.load`` gathers every rank's outcome and raises on all.
"""

from __future__ import annotations

import dataclasses
import io
import os
import warnings
from typing import Any

import torch
import torch.distributed as dist
from torch.futures import Future
from torch.distributed.checkpoint import StorageReader as _DcpReader
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem

from .io._fastio import RawFile
from .errors import CheckpointFormatError, ReadError
from .formats.dcp import _Unexpected, load_dcp_metadata, locate_tensor
from .formats.metadata import METADATA_FILE, plain_file_name, read_metadata_bytes, resolve_inside

__all__ = ["StorageReader"]


def _key(item: ReadItem) -> tuple:
    """The stored box a read item copies: the same key on every rank that reads it."""
    idx = item.storage_index
    return (idx.fqn, tuple(idx.offset or ()), tuple(item.storage_offsets or ()), tuple(item.lengths or ()),
            int(item.type.value))


@dataclasses.dataclass
class ReadStats:
    """What this rank's reader did: items it read from storage, items it received, bytes read."""

    items_read: list = dataclasses.field(default_factory=list)  # keys (see _key) read from storage
    items_received: int = 0
    bytes_read: int = 0


class StorageReader(_DcpReader):
    """Reads a DCP checkpoint directory for ``dcp.load`` (see the module docstring for what it changes).

    ``process_group``: the group ``dcp.load`` runs on (default: the world); ``share=False`` reads every
    item on each rank that needs it (no sends)."""

    def __init__(self, path: str | os.PathLike, *, process_group: Any = None, share: bool = True):
        super().__init__()
        self.path = os.fspath(path)
        self.pg, self.share = process_group, share
        self.stats = ReadStats()
        self._files: dict[str, RawFile] = {}
        self._md: Metadata | None = None
        self._sizes: dict[str, dict[tuple, tuple]] = {}

    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        if checkpoint_id is not None:
            self.path = os.fspath(checkpoint_id)
        self.stats = ReadStats()
        self._close()

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        return os.path.isfile(os.path.join(os.fspath(checkpoint_id), METADATA_FILE))

    def _rank(self) -> int:
        return dist.get_rank(self.pg) if dist.is_initialized() else 0

    def _global(self, r: int) -> int:
        return dist.get_global_rank(self.pg, r) if self.pg is not None else r

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        """Rank 0 reads ``.metadata`` and broadcasts its bytes; each rank unpickles them (allow-list)."""
        source = os.path.join(self.path, METADATA_FILE)
        if dist.is_initialized() and dist.get_world_size(self.pg) > 1:
            box: list[Any] = [None]
            if self._rank() == 0:
                try:
                    box[0] = read_metadata_bytes(self.path)
                except CheckpointFormatError as e:
                    box[0] = e
            dist.broadcast_object_list(box, src=self._global(0), group=self.pg)
            data = box[0]
            if isinstance(data, Exception):
                raise data
        else:
            data = read_metadata_bytes(self.path)
        md = load_dcp_metadata(data, source)
        if getattr(md, "storage_meta", None) is None:
            md.storage_meta = StorageMeta()
        return md

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self._md = metadata
        self._sizes = {}

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        """Coordinator: each stored box that several ranks read gets one reader; every rank's plan carries
        the shared boxes it takes part in, in one global order (their position is the message tag)."""
        if not self.share or len(plans) < 2:
            return plans
        holders: dict[tuple, list[int]] = {}
        for r, p in enumerate(plans):
            for item in p.items:
                ranks = holders.setdefault(_key(item), [])
                if not ranks or ranks[-1] != r:
                    ranks.append(r)
        shared = sorted((k for k, rs in holders.items() if len(rs) > 1), key=lambda k: (-self._nbytes(k), k))
        load = [0] * len(plans)
        reader = {}
        for k in shared:  # largest first, each to its least-loaded holder (ties: the lowest rank)
            r = min(holders[k], key=lambda h: (load[h], h))
            reader[k] = r
            load[r] += self._nbytes(k)
        ops = [(tag, k, reader[k], holders[k]) for tag, k in enumerate(sorted(shared))]
        mine: list[list] = [[] for _ in plans]
        for op in ops:
            for h in op[3]:
                mine[h].append(op)
        return [dataclasses.replace(p, storage_data={"pipeload_shared": m}) for p, m in zip(plans, mine)]

    def _nbytes(self, k: tuple) -> int:
        fqn, _, _, lengths, kind = k
        if kind == LoadItemType.BYTE_IO.value:
            info = self._info_of(fqn, None)
            return int(getattr(info, "length", 0))
        n = 1
        for x in lengths:
            n *= x
        return n * self._md.state_dict_metadata[fqn].properties.dtype.itemsize

    def _info_of(self, fqn: str, offset):
        from torch.distributed.checkpoint.metadata import MetadataIndex

        return self._md.storage_data[MetadataIndex(fqn, offset)]

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future:
        """The shared boxes (read or received, in global order), then this rank's own reads."""
        ops = (plan.storage_data or {}).get("pipeload_shared", []) if isinstance(plan.storage_data, dict) else []
        by_key: dict[tuple, list[ReadItem]] = {}
        for item in plan.items:
            by_key.setdefault(_key(item), []).append(item)
        me, error = self._rank(), None
        works, landed = [], []
        for tag, k, reader, holders in ops:
            items = by_key.pop(k)
            if me == reader:
                try:
                    buf = self._read(items[0]).contiguous()  # (a send needs a dense buffer)
                except Exception as e:  # noqa: BLE001 - peers still get their message
                    error = error or e
                    buf = self._empty(items[0])
                for h in holders:
                    if h != me:
                        works.append(dist.isend(buf, dst=self._global(h), group=self.pg, tag=tag))
            else:
                buf = self._empty(items[0])
                works.append(dist.irecv(buf, src=self._global(reader), group=self.pg, tag=tag))
                self.stats.items_received += 1
            landed.append((items, buf))
        for w in works:
            w.wait()
        if error is not None:
            raise error
        for items, buf in landed:
            for item in items:
                self._deliver(item, buf, planner)
        for items in by_key.values():
            for item in items:
                self._deliver(item, self._read(item), planner)
        self._close()
        done: Future = Future()
        done.set_result(None)
        return done

    def _empty(self, item: ReadItem) -> torch.Tensor:
        if item.type == LoadItemType.BYTE_IO:
            return torch.zeros(self._nbytes(_key(item)), dtype=torch.uint8)
        dtype = self._md.state_dict_metadata[item.storage_index.fqn].properties.dtype
        return torch.zeros(tuple(item.lengths), dtype=dtype)

    def _deliver(self, item: ReadItem, value: torch.Tensor, planner: LoadPlanner) -> None:
        if item.type == LoadItemType.BYTE_IO:
            planner.load_bytes(item, io.BytesIO(value.numpy().tobytes()))
            return
        target = planner.resolve_tensor(item).detach()
        if target.shape != value.shape:
            raise CheckpointFormatError(f"{self.path}: item {item.storage_index.fqn!r}: the planner wants "
                                        f"{list(target.shape)}, the checkpoint holds {list(value.shape)}")
        target.copy_(value)
        planner.commit_tensor(item, target)

    def _read(self, item: ReadItem) -> torch.Tensor:
        """The stored box of ``item`` as a tensor: a view of the mapped file where the blob is plain."""
        idx = item.storage_index
        info = self._info_of(idx.fqn, idx.offset)
        name = plain_file_name(getattr(info, "relative_path", None), f"{self.path}: {idx.fqn!r}")
        if getattr(info, "transform_descriptors", None):
            raise CheckpointFormatError(f"{self.path}: item {idx.fqn!r} in {name} uses DCP transforms "
                                        f"{list(info.transform_descriptors)}, which pipeload does not decode")
        raw = self._files.get(name)
        if raw is None:
            try:
                raw = self._files[name] = RawFile(resolve_inside(self.path, name))
            except OSError as e:
                raise ReadError(f"{os.path.join(self.path, name)}: {e.strerror or e} (rank {self._rank()})") from None
        blob = raw.view(info.offset, info.length)
        self.stats.items_read.append(_key(item))
        self.stats.bytes_read += info.length
        if item.type == LoadItemType.BYTE_IO:
            return torch.frombuffer(bytearray(blob), dtype=torch.uint8)
        whole = self._chunk(idx.fqn, tuple(idx.offset))
        dtype = self._md.state_dict_metadata[idx.fqn].properties.dtype
        try:
            a, b = locate_tensor(blob, dtype, whole)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # a read-only mapping, only read from
                t = torch.frombuffer(blob[a:b], dtype=dtype).reshape(whole) if b > a else torch.zeros(whole, dtype=dtype)
        except _Unexpected:
            t = torch.load(io.BytesIO(bytes(blob)), map_location="cpu", weights_only=True)
            if not isinstance(t, torch.Tensor) or t.dtype != dtype or tuple(t.shape) != whole:
                raise CheckpointFormatError(f"{os.path.join(self.path, name)}: item {idx.fqn!r} does not hold a "
                                            f"{dtype} tensor of shape {list(whole)}") from None
        box = tuple(slice(o, o + n) for o, n in zip(item.storage_offsets, item.lengths))
        return t[box]

    def _chunk(self, fqn: str, offsets: tuple) -> tuple:
        sizes = self._sizes.get(fqn)
        if sizes is None:
            sizes = self._sizes[fqn] = {tuple(c.offsets): tuple(c.sizes)
                                        for c in self._md.state_dict_metadata[fqn].chunks}
        return sizes[offsets]

    def _close(self) -> None:
        for f in self._files.values():
            f.close()
        self._files = {}
