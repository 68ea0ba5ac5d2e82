"""The asyncio pipeline of a load: read -> stage -> broadcast, then the private reads.

Shared phase. This rank walks the broadcasts it takes part in, in the global order of the plan. A
producer task prepares each one: as the reader it copies every ReadItem of every shard of the op
(in a worker thread, so the event loop stays free), as a receiver it only allocates. A consumer task
issues the broadcasts strictly in order, keeps at most ``max_inflight`` outstanding, and blocks only on
the oldest one; when one completes, its staging buffer is unpacked into the destinations with one
grouped copy. Reads therefore run ahead of the collectives (bounded by the queue) and overlap them,
and no rank ever waits on anything outside the global order, which is what keeps the load deadlock
free (docs/ARCHITECTURE.md).

A read that fails does not stop the pipeline: the reader still sends (whatever the buffer holds), so
no peer waits forever, and the error is recorded; the load's final agreement raises it on every rank.

Private phase, after the shared phase is flushed (peers may be waiting on us before that): every
shard nobody shares and every Python object, grouped by file and read in file order.
"""

from __future__ import annotations

import asyncio
from collections import deque
from concurrent.futures import Executor
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from .comm import Comm, finish
from ..errors import PipeloadError
from ..plan.globalplan import Op, ShardKey, aligned
from ..plan.planner import DestShard, ObjectRead, UnitPiece
from ..io.reader import ChunkReader


@dataclass
class Counters:
    """What this rank's shared and private phases did (bytes read are counted by the ChunkReader)."""

    bytes_received: int = 0
    broadcasts: int = 0
    # part delivery (pipeload.engine.delivery): deliveries this rank sent or received, and their bytes
    pages_delivered: int = 0
    part_bytes_sent: int = 0
    part_bytes_received: int = 0
    # (file, cause) -> fqns that failed with it: one line per cause, not one per tensor
    failed: dict[tuple[str, str], list[str]] = field(default_factory=dict)

    def fail(self, fqn: str, file: str, e: BaseException) -> None:
        self.failed.setdefault((file, f"{type(e).__name__}: {e}"), []).append(fqn)

    def error_report(self) -> str | None:
        lines = []
        for (file, cause), fqns in self.failed.items():
            more = f" and {len(fqns) - 3} more" if len(fqns) > 3 else ""
            lines.append(f"reading {', '.join(map(repr, fqns[:3]))}{more} from {file}: {cause}")
        return "\n".join(lines) or None


def _direct(shard: DestShard, device: torch.device) -> torch.Tensor | None:
    """The destination itself as a flat byte buffer, when it can be broadcast without staging (a
    conjugate or negative view cannot: its bytes are not its values)."""
    d = shard.dest
    if (d.is_contiguous() and d.device == device and d.numel() > 0 and d.data_ptr() and not d.is_conj()
            and not d.is_neg()):
        return d.reshape(-1).view(torch.uint8)
    return None


def _unpacks(shard: DestShard | UnitPiece, view: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The copies after ``view`` (the shard's part of the buffer) landed: into the shard's destination
    unless it is the buffer itself; a unit piece's boxes into each destination they belong to."""
    if type(shard) is UnitPiece:
        return shard.copies(view)
    return [] if view is shard.dest else [(shard.dest, view)]


@dataclass
class _Prepared:
    op: Op
    buffer: torch.Tensor  # what the broadcast sends or fills
    unpack: list[tuple[torch.Tensor, torch.Tensor]]  # (destination, staging view) copies after it


class SharedPhase:
    def __init__(
        self,
        comm: Comm,
        reader: ChunkReader,
        shards: dict[ShardKey, DestShard],
        groups: dict[int, Any],
        pool: Executor,
        counters: Counters,
        max_inflight: int,
        on_bytes: Callable[[int], None] | None = None,
        members: dict[int, tuple[int, ...]] | None = None,
    ):
        self.comm = comm
        self.reader = reader
        self.shards = shards
        self.groups = groups  # holder set id -> process group
        self.members = members or {}  # holder set id -> ranks (for error messages)
        self.pool = pool
        self.counters = counters
        self.max_inflight = max(1, max_inflight)
        self.on_bytes = on_bytes or (lambda n: None)
        self.device = comm.broadcast_device
        self._cursor = 0  # ops of this rank requested from storage so far (worker thread only)
        self._ends: list[int] = []  # cumulative bytes of this rank's read ops

    def _layout(self, op: Op) -> tuple[torch.Tensor, list[tuple[DestShard, torch.Tensor]]]:
        """The buffer to broadcast and, per shard, the view of it shaped like the shard."""
        shards = [self.shards[k] for k in op.shards]
        if len(shards) == 1 and type(shards[0]) is not UnitPiece:
            direct = _direct(shards[0], self.device)
            if direct is not None:
                return direct, [(shards[0], shards[0].dest)]
        total = sum(aligned(s.nbytes) for s in shards)
        staging = torch.empty(total, dtype=torch.uint8, device=self.device)
        views, pos = [], 0
        for s in shards:
            shape = s.shape if type(s) is UnitPiece else s.dest.shape
            views.append((s, staging[pos : pos + s.nbytes].view(s.dtype).view(shape)))
            pos += aligned(s.nbytes)
        return staging, views

    def _prefetch_ahead(self, mine: list[Op], i: int) -> None:
        """Request from storage the ops this rank reads next, up to PREFETCH_WINDOW bytes past op i."""
        if not self._ends:
            total = 0
            for op in mine:
                total += sum(self.shards[k].nbytes for k in op.shards)
                self._ends.append(total)
        limit = self._ends[i] + PREFETCH_WINDOW
        while self._cursor < len(mine) and (self._cursor <= i or self._ends[self._cursor - 1] < limit):
            self.reader.prefetch(it for k in mine[self._cursor].shards for it in self.shards[k].reads)
            self._cursor += 1

    def _read_op(self, mine: list[Op], i: int) -> _Prepared:
        """Reader side, in the worker thread: every ReadItem of every shard lands before the send.

        The ops this rank reads next are requested from storage before this one is copied, so the
        device keeps reading while the copies and the broadcasts run.
        """
        self._prefetch_ahead(mine, i)
        op = mine[i]
        buffer, views = self._layout(op)
        unpack = []
        for shard, view in views:
            for item in shard.reads:
                try:
                    self.reader.read_into(item, view, advise=False)
                except Exception as e:  # noqa: BLE001 - recorded, the broadcast still goes out
                    self.counters.fail(shard.fqn, item.file, e)
                    break
            unpack += _unpacks(shard, view)
        if self.reader.ring is not None:  # the broadcast (queued on the current stream) sees the copies
            self.reader.ring.join()
        return _Prepared(op, buffer, unpack)

    def _recv_op(self, op: Op) -> _Prepared:
        buffer, views = self._layout(op)
        return _Prepared(op, buffer, [pair for s, v in views for pair in _unpacks(s, v)])

    async def run(self, ops: list[Op]) -> None:
        loop = asyncio.get_running_loop()
        me = self.comm.rank
        queue: asyncio.Queue = asyncio.Queue(maxsize=self.max_inflight)

        mine = [op for op in ops if op.reader == me]
        position = {id(op): i for i, op in enumerate(mine)}

        async def produce() -> None:
            for op in ops:
                if op.reader == me:
                    prepared = await loop.run_in_executor(self.pool, self._read_op, mine, position[id(op)])
                else:
                    prepared = self._recv_op(op)
                await queue.put(prepared)
            await queue.put(None)

        producer = asyncio.ensure_future(produce())
        inflight: deque[tuple[asyncio.Future, _Prepared]] = deque()
        try:
            while True:
                getter = asyncio.ensure_future(queue.get())
                await asyncio.wait({getter, producer}, return_when=asyncio.FIRST_COMPLETED)
                if not getter.done():  # the producer died: surface its exception
                    getter.cancel()
                    producer.result()
                prepared = getter.result()
                if prepared is None:
                    break
                op = prepared.op
                inflight.append((self.comm.broadcast(prepared.buffer, self.groups[op.group], op.reader),
                                 prepared))
                while len(inflight) >= self.max_inflight:
                    await self._complete(*inflight.popleft())
            while inflight:
                await self._complete(*inflight.popleft())
        finally:
            if not producer.done():
                producer.cancel()
            # Never leave a posted broadcast un-awaited: its buffer must outlive the transfer.
            for fut, _ in inflight:
                try:
                    await fut
                except BaseException:  # noqa: BLE001 - the first error is already propagating
                    pass

    async def _complete(self, fut: asyncio.Future, prepared: _Prepared) -> None:
        op = prepared.op
        try:
            finish(await fut)
        except Exception as e:  # noqa: BLE001 - a peer died or timed out: name what was in flight
            first = self.shards[op.shards[0]].fqn
            raise PipeloadError(
                f"rank {self.comm.rank}: broadcast of {first!r}"
                f"{f' and {len(op.shards) - 1} more shards' if len(op.shards) > 1 else ''} from rank "
                f"{op.reader} to ranks {_ranks(self.members.get(op.group, ()))} failed: {type(e).__name__}: {e}"
                f"{self.comm.silent_peers()}"
            ) from e
        if prepared.unpack:
            unpack(prepared.unpack, self.reader.ring)
        n = sum(self.shards[k].nbytes for k in op.shards)
        self.counters.broadcasts += 1
        if op.reader != self.comm.rank:
            self.counters.bytes_received += n
        self.on_bytes(n)


def unpack(pairs: list[tuple[torch.Tensor, torch.Tensor]], ring=None) -> None:
    """Copy each staging view into its destination: one grouped copy, but a conjugate or negative view
    (which ``_foreach_copy_`` refuses as a destination) by its own ``copy_``, and a host view into an
    accelerator destination through ``ring`` (a :class:`pipeload.device.H2DRing`: page-locked slots, the
    copies queued on its side stream, the current stream ordered after them)."""
    if ring is not None:
        ringed = [_ringed(ring, d, s) for d, s in pairs]
        if any(ringed):
            for (d, s), r in zip(pairs, ringed):
                if r:
                    ring.copy(d, s)
            ring.join()
            pairs = [pair for pair, r in zip(pairs, ringed) if not r]
    lazy = [(d, s) for d, s in pairs if d.is_conj() or d.is_neg()]
    if lazy:
        for d, s in lazy:
            d.copy_(s)
        pairs = [(d, s) for d, s in pairs if not (d.is_conj() or d.is_neg())]
    if pairs:
        torch._foreach_copy_([d for d, _ in pairs], [s for _, s in pairs])


def _ringed(ring, d: torch.Tensor, s: torch.Tensor) -> bool:
    """Whether the copy ``d`` <- ``s`` goes through ``ring``: host bytes into its device, as they are."""
    return d.device == ring.device and s.device.type == "cpu" and d.dtype == s.dtype and not (d.is_conj() or d.is_neg())


def _ranks(members: tuple[int, ...]) -> str:
    if len(members) <= 8:
        return str(list(members))
    return f"[{members[0]}, {members[1]}, ..., {members[-1]}] ({len(members)} ranks)"


def read_private(
    reader: ChunkReader,
    shards: list[DestShard],
    objects: list[ObjectRead],
    counters: Counters,
    on_bytes: Callable[[int], None] | None = None,
    skip: set[tuple[str, str]] | frozenset = frozenset(),
) -> list[tuple[ObjectRead, Any]]:
    """Read every private shard and object, grouped by file and in file order; return decoded objects.

    ``skip``: stored chunks, as (file, key), that chunk units of the shared phase delivered: a shard's
    reads from them are already done (a shard read partly from units is complete once its other reads
    here are). Runs in the worker thread. Objects are decoded here but put into their containers by
    the caller, on the event loop's thread, after every read succeeded.
    """
    on_bytes = on_bytes or (lambda n: None)
    work: list[tuple[str, str, int, Any, Any]] = []
    for shard in shards:
        for i, item in enumerate(shard.reads):
            if not skip or (item.file, item.key) not in skip:
                work.append((item.file, item.key, i, shard, item))
    for obj in objects:
        work.append((obj.meta.file, obj.meta.key, 0, obj, None))
    # File-major, then by the stored key: the saver lays chunks out in key order, so this is file order.
    work.sort(key=lambda w: (w[0], w[1], w[2]))
    decoded = []
    failed: set[int] = set()
    windows = _windows(work)
    if windows:
        _prefetch(reader, windows[0])
    for i, window in enumerate(windows):
        if i + 1 < len(windows):  # storage works on the next window while this one is copied
            _prefetch(reader, windows[i + 1])
        name, f = None, None  # the file being copied from (work is file-major), checked once per window
        for file, _, _, target, item in window:
            if id(target) in failed:
                continue
            before = reader.bytes_read
            try:
                if item is None:
                    decoded.append((target, reader.read_object(target.meta)))
                else:
                    if file != name:  # (a file that fails to open is tried again for its next item)
                        f = reader.file(file)
                        name = file
                    reader.read_into(item, target.dest, advise=False, file=f)
            except Exception as e:  # noqa: BLE001 - gathered and raised on every rank by the loader
                failed.add(id(target))
                counters.fail(target.fqn, file, e)
            on_bytes(reader.bytes_read - before)
    return decoded


def fill_twins(twins: list, counters: Counters, ring=None) -> None:
    """Copy each shard's destination into its twins (``(shard, twin, path)``: another view this rank
    holds of the same box, :attr:`pipeload.plan.planner.LocalPlan.twins`), once every read and broadcast
    of the load has landed: the box is read once per rank however many views hold it. A shard whose
    read failed is not copied (the load fails anyway). Runs in the worker thread, after the private phase."""
    if ring is not None:  # the reads' copies into an accelerator, ordered before these
        ring.join()
    failed = {fqn for fqns in counters.failed.values() for fqn in fqns}
    for shard, twin, _ in twins:
        if shard.fqn in failed:
            continue
        try:
            twin.dest.copy_(shard.dest)
        except Exception as e:  # noqa: BLE001 - gathered and raised on every rank by the loader
            counters.fail(shard.fqn, "(a copy between two views of one box)", e)


PREFETCH_WINDOW = 64 << 20  # bytes requested ahead of the private reads


def _windows(work: list) -> list[list]:
    """Consecutive slices of ``work`` holding about PREFETCH_WINDOW bytes each."""
    windows: list[list] = []
    size = PREFETCH_WINDOW
    for w in work:
        if size >= PREFETCH_WINDOW:
            windows.append([])
            size = 0
        windows[-1].append(w)
        size += w[4].nbytes if w[4] is not None else w[3].meta.nbytes
    return windows


def _prefetch(reader: ChunkReader, window: list) -> None:
    """Ask storage for the window's items and its Python objects at once: objects stored side by side
    (a save's Python values, in one file) then come in one request instead of one each (on an object
    store, a GET per object per rank)."""
    reader.prefetch((w[4] for w in window if w[4] is not None), _object_chunks(reader, window))


def _object_chunks(reader: ChunkReader, window: list) -> dict[str, list[str]]:
    """file -> stored names of the window's objects, for files that prefetch whole chunks by name."""
    out: dict[str, list[str]] = {}
    for file, key, _, _, item in window:
        if item is None and (file, key) not in reader.patches:  # (a delivered one: not asked for)
            out.setdefault(file, []).append(key)
    for file in list(out):
        try:
            if not hasattr(reader.file(file), "willneed_tensors"):
                del out[file]
        except Exception:  # noqa: BLE001 - a hint only: the read itself reports what is wrong
            del out[file]
    return out


__all__ = ["Counters", "SharedPhase", "fill_twins", "read_private"]
