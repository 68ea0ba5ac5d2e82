"""The read-once protocol over DCP's storage readers: a stored box several ranks read is read by one.

``dcp.load`` drives a reader through four hooks and tells it nothing about its group; what this module
relies on (torch 2.13's ``state_dict_loader._load_state_dict``):

- ``prepare_local_plan`` runs on every rank that loads; each rank's reader adds a :class:`_Tag` to its
  plan's ``storage_data``: its global rank, its host, whether it can send host tensors;
- ``prepare_global_plan`` runs on DCP's coordinator only, with one plan per rank of DCP's group (one under
  ``no_dist`` or a group of one). With two plans or more, every rank identified (distinct global ranks,
  each able to send over the reader's group, a gloo group), the coordinator gives each box several
  plans read (its *holders*) one reader (:func:`_choose_readers`: the rank that wrote its file, else the
  least loaded holder) and writes into each plan the shared boxes it takes part in, numbered;
  otherwise it plans nothing and every rank reads what it needs, as DCP's reader does;
- ``read_data`` on every rank: every receive posted, then this rank's shared boxes read in file order,
  each sent once read (``isend`` on the reader's group, to global ranks that are all in DCP's group),
  all awaited; then its own boxes, through the reader's own path.

So the reader issues no collective, and sends only between ranks DCP's coordinator reported as loading
together. Under the host-aware policy (``share="auto"``, the default) a box is shared only when its
holders run on more than one host (``PIPELOAD_HOST_ID`` emulates hosts), as in ``pipeload.load``.
A reader whose read fails still sends (zeros), then raises naming the file and the item; ``dcp.load``
gathers every rank's outcome and raises on all of them, naming the ranks; so does a planner whose
``resolve_tensor`` fails. A planner whose ``finish_plan`` drops the plan's ``storage_data`` or changes
the boxes the coordinator saw breaks the storage layer's contract with DCP and is not supported.
"""

from __future__ import annotations

import dataclasses
import io
import os
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch.futures import Future
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem

from ..io.reader import decode_object
from ..plan.exchange import host_id

SHARE_POLICIES = (True, False, "auto")


def _key(item: ReadItem) -> tuple:
    """The stored box a read item copies: the same key on every rank that reads it."""
    idx = item.storage_index
    return (idx.fqn, tuple(idx.offset or ()), tuple(item.storage_offsets or ()), tuple(item.lengths or ()),
            int(item.type.value))


@dataclasses.dataclass
class ReadStats:
    """What one reader did on this rank: boxes it read from storage (their keys), boxes it received from
    the rank that read them, and the bytes of each."""

    items_read: list = dataclasses.field(default_factory=list)
    items_received: int = 0
    bytes_read: int = 0
    bytes_received: int = 0
    messages_received: int = 0  # point-to-point messages those boxes came in (small ones share one per reader)


_last: ReadStats | None = None


def last_stats() -> ReadStats | None:
    """The statistics of the last ``read_data`` of a pipeload reader in this process (None before one):
    how a caller of ``dcp.load(sd, checkpoint_id=...)``, which never sees the reader, reads them."""
    return _last


@dataclasses.dataclass(frozen=True)
class _Tag:
    """A rank's words in its local plan's ``storage_data``, and the coordinator's answer (``ops``)."""

    rank: int | None  # global rank; None without an initialised process group
    host: int
    can_send: bool  # the send group holds this rank and carries host tensors
    inner: Any = None  # the plan's storage_data before the tag, handed back to DCP's own reader
    ops: tuple = ()  # (message tag, box key, reader, holders), global ranks, in the coordinator's order


def _carries_host_tensors(pg: Any) -> bool:
    """Whether a group's backend sends CPU tensors (gloo, also as the CPU half of ``cpu:gloo,cuda:nccl``)."""
    try:
        config = str(dist.get_backend_config(pg))
    except Exception:  # noqa: BLE001 - an unknown backend: do not send on it
        return False
    return any(part.strip() in ("gloo", "cpu:gloo") for part in config.split(","))


def _whoami(pg: Any) -> tuple[int | None, bool]:
    """(global rank, can send over ``pg``): (None, False) without a process group."""
    if not (dist.is_available() and dist.is_initialized()):
        return None, False
    group = pg if pg is not None else dist.distributed_c10d._get_default_group()
    return dist.get_rank(), dist.get_rank(group) >= 0 and _carries_host_tensors(group)


def plan_shared(plans: list[LoadPlan], tags: list[_Tag], nbytes: Callable[[ReadItem], int],
                shareable: Callable[[ReadItem], bool], writer: Callable[[ReadItem], int], *,
                same_host_private: bool) -> list[list[tuple]]:
    """Each plan's shared boxes: ``(message tag, key, reader, holders)`` with global ranks, in key order.

    A box is shared when two plans or more read it, ``shareable`` admits it and (``same_host_private``)
    its holders span hosts. Readers: :func:`_choose_readers`."""
    holders: dict[tuple, list[int]] = {}
    first: dict[tuple, ReadItem] = {}
    for i, p in enumerate(plans):
        for item in p.items:
            k = _key(item)
            hs = holders.setdefault(k, [])
            if not hs or hs[-1] != i:
                hs.append(i)
            first.setdefault(k, item)
    shared = {k for k, hs in holders.items() if len(hs) > 1 and shareable(first[k])
              and not (same_host_private and len({tags[h].host for h in hs}) == 1)}
    size = {k: nbytes(item) for k, item in first.items()}
    alone = [0] * len(plans)  # the bytes each plan reads anyway
    for k, hs in holders.items():
        if k not in shared:
            for h in hs:
                alone[h] += size[k]
    rank_of = {t.rank: i for i, t in enumerate(tags)}
    affinity = {k: rank_of.get(writer(first[k]), -1) for k in shared}
    reader = _choose_readers(sorted(shared, key=lambda k: (-size[k], k)), holders, size, affinity, alone)
    mine: list[list[tuple]] = [[] for _ in plans]
    for n, k in enumerate(sorted(shared)):
        op = (n, k, tags[reader[k]].rank, tuple(tags[h].rank for h in holders[k]))
        for h in holders[k]:
            mine[h].append(op)
    return mine


def _choose_readers(boxes: list[tuple], holders: dict, size: dict, affinity: dict, load: list[int]) -> dict:
    """One reader per shared box (largest first). Affinity first: a box goes to the rank that wrote its
    file (DCP's ``__<rank>_<i>.distcp``) when that rank holds it and stays within 11/10 of the mean load,
    so each rank reads its own file front to back and no page is fetched by two; then the greedy: the
    holder with the fewest bytes so far (its own reads included), ties to the first."""
    cap = 1.1 * (sum(load) + sum(size[k] for k in boxes)) / len(load)
    reader: dict[tuple, int] = {}
    for k in boxes:
        w = affinity[k]
        if w in holders[k] and load[w] + size[k] <= cap:
            reader[k] = w
            load[w] += size[k]
    for k in boxes:
        if k not in reader:
            r = min(holders[k], key=lambda h: (load[h], h))
            reader[k] = r
            load[r] += size[k]
    return reader


def _dense(target: torch.Tensor | None, item: ReadItem, reader: "ReadOnce") -> bool:
    """Whether a message of ``item``'s box can land in (or leave from) ``target`` itself: a plain dense host
    tensor with memory of its own (a wrapper subclass, e.g. ``LocalShardsWrapper``, reports a null
    pointer: it gets the box through ``copy_``, as from DCP's reader)."""
    return (type(target) is torch.Tensor and target.device.type == "cpu" and target.is_contiguous()
            and target.data_ptr() != 0 and tuple(target.shape) == tuple(item.lengths)
            and target.dtype == reader._dtype(item))


class _Capture:
    """A stand-in planner for one box read through DCP's own reader: its tensor lands in a fresh buffer
    (DCP's transforms, layouts and checks applied), its bytes are kept."""

    def __init__(self, empty: Callable[[ReadItem], torch.Tensor]):
        self.empty, self.value = empty, None

    def resolve_tensor(self, item: ReadItem) -> torch.Tensor:
        self.value = self.empty(item)
        return self.value

    def commit_tensor(self, item: ReadItem, tensor: torch.Tensor) -> None:
        pass

    def load_bytes(self, item: ReadItem, value: io.BytesIO) -> None:
        self.value = torch.frombuffer(bytearray(value.getvalue()), dtype=torch.uint8)


BATCH_BYTES = 6 << 20  # shared boxes under this go in one message per (reader, receiver)
BATCH_TAG = 1 << 30  # the tag of those messages (one per pair; box messages are tagged by box number)
_ALIGN = 16  # each box's offset in a batch: any dtype's view of it is aligned


class _Exchange:
    """One ``read_data``'s messages: the works to await, what lands where, and the batches of small
    boxes. Both ends lay a batch out alike — its boxes in box-number order (the coordinator's), each at
    an aligned offset — from the plan alone, so a receiver slices what its reader packed."""

    def __init__(self):
        self.works: list = []
        self.landed: list = []  # (items, buffer, resolved target)
        self.error: BaseException | None = None
        self.inbound: dict[int, list] = {}  # reader -> [(offset, nbytes, items, target)]
        self.outbound: dict[int, list] = {}  # receiver -> [[box number, offset, nbytes, box bytes]]
        self._size: dict[tuple[str, int], int] = {}
        self._parts: dict[tuple[int, int], list] = {}  # (receiver, box number) -> its part of the batch

    def _place(self, side: str, peer: int, nbytes: int) -> int:
        at = -(-self._size.get((side, peer), 0) // _ALIGN) * _ALIGN
        self._size[(side, peer)] = at + nbytes
        return at

    def expect(self, reader: int, n: int, items: list, nbytes: int, target) -> None:
        self.inbound.setdefault(reader, []).append((self._place("in", reader, nbytes), nbytes, items, target))

    def reserve(self, to: list[int], n: int, nbytes: int) -> None:
        """A small box this rank reads, placed in each receiver's batch (in box-number order, as there)."""
        for h in to:
            part = [n, self._place("out", h, nbytes), nbytes, None]
            self.outbound.setdefault(h, []).append(part)
            self._parts[(h, n)] = part

    def pack(self, to: list[int], n: int, box: torch.Tensor) -> None:
        data = box.reshape(-1).view(torch.uint8)
        for h in to:
            part = self._parts[(h, n)]
            if data.numel() != part[2]:
                raise AssertionError(f"box {n}: {data.numel()} bytes read, {part[2]} planned")
            part[3] = data

    def post_batches(self, pg: Any) -> dict[int, torch.Tensor]:
        bufs = {r: torch.empty(self._size[("in", r)], dtype=torch.uint8) for r in self.inbound}
        self.works += [dist.irecv(b, src=r, group=pg, tag=BATCH_TAG) for r, b in bufs.items()]
        return bufs

    def send_batches(self, pg: Any) -> None:
        for h, parts in self.outbound.items():
            buf = torch.zeros(self._size[("out", h)], dtype=torch.uint8)
            for _, at, nbytes, data in parts:
                if data is not None:  # (zeros where the read failed: the error is raised after the waits)
                    buf[at:at + nbytes] = data
            self.works.append(dist.isend(buf, dst=h, group=pg, tag=BATCH_TAG))

    def unpack(self, bufs: dict[int, torch.Tensor], dtype_of: Callable[[ReadItem], torch.dtype]) -> list:
        out = []
        for r, parts in self.inbound.items():
            for at, nbytes, items, target in parts:
                raw = bufs[r][at:at + nbytes]
                item = items[0]
                value = raw if item.type == LoadItemType.BYTE_IO else raw.view(dtype_of(item)).reshape(tuple(item.lengths))
                out.append((items, value, target))
        return out


class _SafeBytes:
    """A planner whose ``load_bytes`` first checks that the object unpickles under
    ``torch.load(weights_only=True)`` (DCP's default planner then unpickles it with
    ``weights_only=False``: with only allowed globals in the pickle, that runs no code of the file)."""

    def __init__(self, planner: LoadPlanner, directory: str):
        self._planner, self._directory = planner, directory

    def __getattr__(self, name: str) -> Any:
        return getattr(self._planner, name)

    def load_bytes(self, item: ReadItem, value: io.BytesIO) -> None:
        decode_object(value.getvalue(), f"{self._directory}: object {item.storage_index.fqn!r}")
        value.seek(0)
        self._planner.load_bytes(item, value)


class ReadOnce:
    """Mixin in front of one of DCP's readers (the next class in the MRO): the hooks above. Subclasses
    give :meth:`_nbytes`, :meth:`_shareable` and may give faster :meth:`_read_box` / :meth:`_read_private`.

    ``process_group``: the group sends go over (default: the world); every rank of DCP's group must be in
    it. ``share``: ``"auto"`` (default: across hosts only), ``True`` (always), ``False`` (never). The
    coordinator's reader decides for all."""

    def _init_read_once(self, process_group: Any, share: Any) -> None:
        if share not in SHARE_POLICIES:
            raise ValueError(f"share={share!r}: one of True, False, 'auto'")
        self.pg, self.share = process_group, share
        self.stats = ReadStats()
        self._md = None

    def reset(self, checkpoint_id: Any = None) -> None:
        super().reset(checkpoint_id)  # type: ignore[misc]
        self.stats = ReadStats()

    def set_up_storage_reader(self, metadata: Any, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        super().set_up_storage_reader(metadata, is_coordinator, *args, **kwargs)  # type: ignore[misc]
        self._md = metadata

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        plan = super().prepare_local_plan(plan)  # type: ignore[misc]
        rank, can_send = _whoami(self.pg)
        return dataclasses.replace(plan, storage_data=_Tag(rank, host_id(), can_send, plan.storage_data))

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        """Coordinator: the shared boxes of every plan, when every plan's rank is known and can send."""
        plans = super().prepare_global_plan(plans)  # type: ignore[misc]
        tags = [p.storage_data for p in plans]
        if (self.share is False or len(plans) < 2 or not all(isinstance(t, _Tag) for t in tags)
                or not all(t.rank is not None and t.can_send for t in tags)
                or len({t.rank for t in tags}) != len(tags)):
            return plans
        mine = plan_shared(plans, tags, self._nbytes, self._shareable, self._writer,
                           same_host_private=self.share == "auto")
        return [dataclasses.replace(p, storage_data=dataclasses.replace(t, ops=tuple(m)))
                for p, t, m in zip(plans, tags, mine)]

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future:
        """The shared boxes (read and sent, or received), then this rank's own boxes; a reader driven
        without ``set_up_storage_reader`` (its ``storage_data`` set by the caller) reads as DCP's does."""
        global _last
        if not getattr(self, "_allow_pickle", True):
            planner = _SafeBytes(planner, os.fspath(getattr(self, "path", "")))
        tag = plan.storage_data if isinstance(plan.storage_data, _Tag) else None
        if tag is not None:
            plan = dataclasses.replace(plan, storage_data=tag.inner)
        if self._md is None:  # driven without set_up_storage_reader (storage_data set by its caller):
            return self._dcp_read(plan, planner)  # what this reader knows of the layout comes from there
        try:
            rest = self._shared_phase(plan, planner, tag.ops) if tag is not None and tag.ops else plan.items
            if rest:
                self._read_private(dataclasses.replace(plan, items=list(rest)), planner)
        finally:
            _last = self.stats
            self._done()
        done: Future = Future()
        done.set_result(None)
        return done

    def _dcp_read(self, plan: LoadPlan, planner: LoadPlanner) -> Future:
        """Every box by DCP's own reader (this reader's class in DCP), as without pipeload."""
        global _last
        self.stats = ReadStats()
        try:
            return super().read_data(plan, planner)  # type: ignore[misc]
        finally:
            self.stats.items_read += [_key(i) for i in plan.items]
            _last = self.stats
            self._done()

    def _shared_phase(self, plan: LoadPlan, planner: LoadPlanner, ops: tuple) -> list[ReadItem]:
        """Every receive posted first; then this rank's shared boxes read in storage order, each large box
        sent to its holders as soon as it is read, the small ones (under ``BATCH_BYTES``) packed into one
        message per receiver sent after the last read; all awaited before any value is committed or any
        error raised (messages match by tag, so no rank waits on one another has not been able to post).
        A large box lands in, and is sent from, the planner's destination where that is a dense host
        tensor of the box's shape and dtype; otherwise in a buffer copied over at the end. Returns the
        items no op covers."""
        by_key: dict[tuple, list[ReadItem]] = {}
        for item in plan.items:
            by_key.setdefault(_key(item), []).append(item)
        me, run = dist.get_rank(), _Exchange()
        to_read = []
        for n, k, reader, holders in ops:
            items = by_key.pop(k)
            small = self._nbytes(items[0]) < BATCH_BYTES
            if me != reader:
                self._post_receive(run, n, items, reader, small, planner)
            else:
                to_read.append((n, items, [h for h in holders if h != me], small))
                if small:
                    run.reserve(to_read[-1][2], n, self._nbytes(items[0]))
        receives = run.post_batches(self.pg)
        self.stats.messages_received = len(run.works)
        for n, items, holders, small in sorted(to_read, key=lambda x: self._storage_order(x[1][0])):
            self._read_and_send(run, n, items, holders, small, planner)
        run.send_batches(self.pg)
        for w in run.works:
            w.wait()
        if run.error is not None:
            raise run.error
        for items, buf, target in run.landed + run.unpack(receives, self._dtype):
            self._deliver(items[0], buf, planner, target)
            for item in items[1:]:
                self._deliver(item, buf, planner)
        return [item for items in by_key.values() for item in items]

    def _post_receive(self, run: "_Exchange", n: int, items: list, reader: int, small: bool,
                      planner: LoadPlanner) -> None:
        target = None
        try:
            target = self._resolve(items[0], planner)
        except Exception as e:  # noqa: BLE001 - the receive is still posted: its sender waits on it
            run.error = run.error or e
        self.stats.items_received += 1
        self.stats.bytes_received += self._nbytes(items[0])
        if small:
            run.expect(reader, n, items, self._nbytes(items[0]), target)
            return
        buf = target if _dense(target, items[0], self) else self._empty(items[0])
        run.works.append(dist.irecv(buf, src=reader, group=self.pg, tag=n))
        run.landed.append((items, buf, target))

    def _read_and_send(self, run: "_Exchange", n: int, items: list, to: list[int], small: bool,
                       planner: LoadPlanner) -> None:
        target = None
        try:
            target = self._resolve(items[0], planner)
            box = self._read_box(items[0])
            if _dense(target, items[0], self):
                buf = target.copy_(box)
            else:
                buf = box.contiguous()  # a send needs a dense buffer
        except Exception as e:  # noqa: BLE001 - the holders still get their message
            run.error = run.error or e
            buf = self._empty(items[0])
        if small:
            try:
                run.pack(to, n, buf)
            except AssertionError as e:
                run.error = run.error or e
        else:
            run.works += [dist.isend(buf, dst=h, group=self.pg, tag=n) for h in to]
        run.landed.append((items, buf, target))

    def _resolve(self, item: ReadItem, planner: LoadPlanner) -> torch.Tensor | None:
        """The planner's destination of a tensor box (resolved once; committed in :meth:`_deliver`)."""
        return None if item.type == LoadItemType.BYTE_IO else planner.resolve_tensor(item).detach()

    # -- what a layout gives ------------------------------------------------------------------------

    def _dtype(self, item: ReadItem) -> torch.dtype:
        return self._md.state_dict_metadata[item.storage_index.fqn].properties.dtype

    def _nbytes(self, item: ReadItem) -> int:
        if item.type == LoadItemType.BYTE_IO:  # as stored (what a box without transforms holds)
            return int(getattr(self.storage_data.get(item.storage_index), "length", 0) or 0)
        n = self._dtype(item).itemsize
        for x in item.lengths:
            n *= x
        return n

    def _shareable(self, item: ReadItem) -> bool:
        """Whether a receiver can size the box from the plan alone (tensors: shape and dtype)."""
        return item.type != LoadItemType.BYTE_IO

    def _writer(self, item: ReadItem) -> int:
        """The global rank that wrote the box's file, when the layout names it; -1 otherwise."""
        return -1

    def _storage_order(self, item: ReadItem) -> tuple:
        """Where the box lies (file, offset): a rank reads its boxes in this order."""
        info = self.storage_data.get(item.storage_index)
        return (str(getattr(info, "relative_path", "")), int(getattr(info, "offset", 0) or 0))

    def _empty(self, item: ReadItem) -> torch.Tensor:
        if item.type == LoadItemType.BYTE_IO:
            return torch.zeros(self._nbytes(item), dtype=torch.uint8)
        return torch.zeros(tuple(item.lengths), dtype=self._dtype(item))

    def _read_box(self, item: ReadItem) -> torch.Tensor:
        """One box as a tensor (bytes: uint8), read by DCP's own reader into a buffer of ours."""
        capture = _Capture(self._empty)
        super().read_data(LoadPlan([item]), capture).wait()  # type: ignore[misc]
        self.stats.items_read.append(_key(item))
        self.stats.bytes_read += self._nbytes(item)
        return capture.value

    def _read_private(self, plan: LoadPlan, planner: LoadPlanner) -> None:
        """The boxes nobody shares with this rank: DCP's own reader reads them."""
        super().read_data(plan, planner).wait()  # type: ignore[misc]
        self.stats.items_read += [_key(i) for i in plan.items]
        self.stats.bytes_read += sum(self._nbytes(i) for i in plan.items)

    def _deliver(self, item: ReadItem, value: torch.Tensor, planner: LoadPlanner,
                 target: torch.Tensor | None = None) -> None:
        """A box into the planner's destination (``target``: already resolved), as DCP's reader hands it over."""
        if item.type == LoadItemType.BYTE_IO:
            planner.load_bytes(item, io.BytesIO(value.numpy().tobytes()))
            return
        if target is None:
            target = planner.resolve_tensor(item).detach()
        if target.shape != value.shape:
            raise AssertionError(f"req {item.storage_index} mismatch sizes {target.size()} vs {value.size()}")
        if target is not value:
            target.copy_(value)
        planner.commit_tensor(item, target)

    def _done(self) -> None:
        """After every read of a load (files to close)."""
