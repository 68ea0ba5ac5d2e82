"""Background saves: ``pipeload.save(..., background=True)`` returns once the state dict is snapshotted.

A background save is the blocking save cut in two (see :mod:`pipeload.save.saver`):

- in the caller's thread: planning (its one gather on the caller's group, like any save), then the
  *snapshot*: every chunk this rank owns after deduplication is copied into staging buffers — plain
  host memory for host tensors, page-locked memory for device tensors, copied on a side stream that
  first waits for the work already queued on the device's current stream. Python objects are already
  bytes after planning. Then the caller gets a :class:`SaveHandle` back;
- in a worker thread: the write (checksums, fsync), the agreement and the commit, whose collectives
  run on a gloo group of the save's own (:func:`own_comm`), never on the trainer's groups.

Invariants:

- one save at a time per group: :func:`wait_previous` (called by every save before anything else)
  waits for the group's background save in flight, so its staging is never overwritten while it is
  read and its collectives never interleave with a next save's. The wait is local: the worker
  threads of every rank only need each other, never the callers, so it always ends;
- a group's own group is created at the first background save that passed planning. Planning passes
  or raises on every rank alike (its gather), so every rank of the world creates it at the same
  point, and reuses it afterwards (a re-initialised default group gets a new one, again on all ranks);
- staging of a group is one flat buffer per memory kind, kept between saves: a save of the same (or
  a smaller) layout allocates nothing; it is reallocated only to grow, or to shrink by more than
  :data:`STAGING_SLACK`;
- nothing the worker does can commit unless every rank's write succeeded: the commit is the saver's
  (``.metadata`` renamed last), so a failed or abandoned background save leaves the previous
  checkpoint loadable;
- the worker is the group's one thread, kept between saves (a ``concurrent.futures`` executor's): at
  interpreter exit Python lets it finish the save it holds and joins it before anything else is torn
  down, so a save still writing completes (or fails, committing nothing). A forked child forgets the
  parent's saves and workers.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable

import numpy as np
import torch

from .. import device as devices
from ..engine.comm import Comm
from . import saver
from ._stage import gather_host
from ..errors import DistributedError, PipeloadError, SaveTimeoutError

STAGING_SLACK = 64 << 20  # a kept staging buffer larger than needed by more than this is reallocated
_ALIGN = 64  # bytes: every staged tensor starts at a multiple (any dtype's view of the buffer is aligned)

_lock = threading.Lock()
_pending: dict[tuple[int, ...], "SaveHandle"] = {}
_own: dict[tuple[int, ...], tuple[Any, Any]] = {}  # group ranks -> (default group it was made under, own group)
_pools: dict[tuple[int, ...], "StagingPool"] = {}
# One worker thread per group, kept between saves: a thread started per save made the caller wait for
# the OS to schedule it. At interpreter exit it finishes what it was given (concurrent.futures joins it).
_workers: dict[tuple[int, ...], ThreadPoolExecutor] = {}
_side_streams: dict[Any, Any] = {}


class SaveHandle:
    """A background save in flight: :meth:`wait` for its commit, :meth:`done` to poll.

    ``staged_bytes`` is what this rank copied into staging, ``owned_bytes`` what it writes in all;
    ``blocked_seconds`` how long the call kept the caller (``plan_seconds`` of it planning, the rest
    the snapshot); ``staging_allocations`` how many staging
    buffers this save had to allocate (0 when a previous save's were reused); ``staging_held`` the
    bytes of staging the group keeps after this save. ``stats``: what the save reports about itself,
    filled in by the time it finishes (a memory tier snapshot's
    :class:`pipeload.tier.snapshot.SnapshotStats`; None for a checkpoint directory).
    """

    def __init__(self, what: str):
        self.what = what
        self.stats: Any = None
        self.staged_bytes = self.owned_bytes = self.staging_allocations = self.staging_held = 0
        self.blocked_seconds = self.plan_seconds = 0.0
        self._finished = threading.Event()
        self._error: BaseException | None = None
        self._callbacks: list[Callable[[], None]] = []

    def done(self) -> bool:
        """Whether the save has finished (committed, or failed: :meth:`wait` then raises)."""
        return self._finished.is_set()

    def wait(self, timeout: float | None = None) -> None:
        """Block until the checkpoint is committed; raise what the save raised.

        :class:`SaveTimeoutError` when ``timeout`` seconds pass first (the save is not cancelled: call
        again). A failure is a :class:`DistributedError` on every rank, naming the failing rank(s).
        """
        if not self._finished.wait(timeout):
            raise SaveTimeoutError(f"{self.what}: not finished after {timeout} s")
        if self._error is not None:
            raise self._error

    async def wait_async(self) -> None:
        """:meth:`wait` without blocking the running event loop (completion comes by callback)."""
        loop = asyncio.get_running_loop()
        fut = loop.create_future()

        def settle() -> None:
            try:
                loop.call_soon_threadsafe(lambda: fut.done() or fut.set_result(None))
            except RuntimeError:  # loop closed: nobody awaits any more
                pass

        self._on_finish(settle)
        await fut
        self.wait()

    def _on_finish(self, fn: Callable[[], None]) -> None:
        with _lock:
            if not self._finished.is_set():
                self._callbacks.append(fn)
                return
        fn()

    def _finish(self, error: BaseException | None) -> None:
        self._error = error
        with _lock:
            self._finished.set()
            callbacks, self._callbacks = self._callbacks, []
        for fn in callbacks:
            fn()


def group_key(comm: Comm) -> tuple[int, ...]:
    return tuple(comm.global_ranks)


def wait_previous(comm: Comm) -> None:
    """Wait for the background save in flight on ``comm``'s group, if any; its outcome is its own.

    Every save (background or not) calls this first, so saves on one group run one after the other.
    """
    with _lock:
        previous = _pending.get(group_key(comm))
    if previous is not None:
        previous._finished.wait()


def own_comm(comm: Comm) -> Comm:
    """The save's own gloo group for ``comm``'s group (created on first use, by every rank of the world).

    Only groups that are the whole world are supported: creating a group is a collective of every
    rank of the default group, which a subgroup's save cannot ask of ranks outside it.
    """
    if not comm.active or comm.size == 1:
        return comm
    import torch.distributed as dist

    key = group_key(comm)
    world = dist.group.WORLD
    got = _own.get(key)
    if got is None or got[0] is not world:
        pg = dist.new_group(backend="gloo", timeout=comm.timeout)
        _own[key] = got = (world, pg)
    own = Comm(got[1], timeout=comm.timeout)
    own.probe_tag = "background-save:"
    return own


class StagingPool:
    """One group's staging: a flat host buffer per memory kind (plain, page-locked), kept between saves."""

    def __init__(self) -> None:
        self.buffers: dict[bool, torch.Tensor | None] = {False: None, True: None}
        self.allocations = 0  # buffers allocated over the pool's life

    def take(self, pinned: bool, nbytes: int) -> torch.Tensor:
        """A buffer of at least ``nbytes``; the kept one unless too small or larger by over the slack."""
        buf = self.buffers[pinned]
        if buf is None or buf.numel() < nbytes or buf.numel() > nbytes + STAGING_SLACK:
            self.buffers[pinned] = buf = None  # the old one is freed before the new one is allocated
            buf = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pinned)
            self.buffers[pinned] = buf
            self.allocations += 1
        return buf

    def nbytes(self) -> int:
        return sum(b.numel() for b in self.buffers.values() if b is not None)


def pool_for(comm: Comm) -> StagingPool:
    with _lock:
        return _pools.setdefault(group_key(comm), StagingPool())


def _pinned(t: torch.Tensor) -> bool:
    """Whether ``t`` is staged in page-locked memory (a tensor of the accelerator usable here)."""
    return devices.pinnable(t.device.type)


def sizes_of(items: list[tuple]) -> list[int]:
    """Bytes of each item's tensor (0 for Python objects, already bytes)."""
    return [0 if isinstance(v, bytes) else v.nbytes for _, _, _, v in items]


def split(sizes: list[int], bound: int) -> int:
    """Index of the first staged item: the longest tail of the items (of tensor ``sizes``, see
    :func:`sizes_of`) that fits in ``bound`` bytes.

    The items before it (the head) are written from the live tensors before the save returns; the file
    keeps its order (the load reads it front to back).
    """
    first, total = len(sizes), 0
    if sum(sizes) <= bound:
        return 0
    while first > 0:
        n = sizes[first - 1]
        if total + n > bound:
            break
        total += n
        first -= 1
    return first


class Layout:
    """Where the staged items of one plan go in the group's buffers; computed once per (plan, ``first``).

    Depends only on what a reused plan keeps unchanged (each item's size, dtype and device: the plan is
    reused only for a state dict of the same signature), so it lives in the plan's memo
    (:attr:`pipeload.save.saver.SavePlan.memo`) and a steady save computes nothing per tensor before
    copying. Tensors of one (memory kind, device, dtype) are packed back to back, each span aligned.

    ``spans``: ``(pinned, device, dtype, item indices, start, nbytes)``; ``ends``: bytes per memory kind;
    ``host``: (item index, offset, length) arrays of the plain-memory items, for :func:`gather_host`;
    ``accel``: whether any item of the plan (head included) is an accelerator tensor staged in page-locked
    memory.
    """

    def __init__(self, items: list[tuple], sizes: list[int], first: int):
        present = devices.accelerator()
        groups: dict[tuple, list[int]] = {}
        self.accel = False
        for i, n in enumerate(sizes):
            if n:
                value = items[i][3]
                kind = present is not None and value.device.type == present
                self.accel = self.accel or kind
                if i >= first:
                    groups.setdefault((True, value.device, value.dtype) if kind else (False, None, value.dtype),
                                      []).append(i)
        self.ends = {False: 0, True: 0}
        self.spans: list[tuple] = []
        host: list[tuple[int, int, int]] = []
        for (kind, dev, dt), idx in groups.items():
            start = self.ends[kind]
            nbytes = sum(sizes[i] for i in idx)
            self.spans.append((kind, dev, dt, idx, start, nbytes))
            self.ends[kind] += -(-nbytes // _ALIGN) * _ALIGN
            if not kind:
                offsets = np.cumsum([start] + [sizes[i] for i in idx[:-1]])
                host += zip(idx, offsets.tolist(), (sizes[i] for i in idx))
        cols = np.array(host, dtype=np.int64).reshape(-1, 3)
        self.host = tuple(np.ascontiguousarray(cols[:, j]) for j in range(3))
        self.staged = sum(span[5] for span in self.spans)

    @classmethod
    def of(cls, plan, bound: int | None) -> tuple["Layout", list[int], int]:
        """(the layout, item sizes, the first staged item) of ``plan`` under the staging ``bound``
        (None: every byte the rank owns), from the plan's memo when an earlier save made them."""
        memo = plan.memo
        sizes = memo.get("sizes")
        if sizes is None:
            sizes = memo["sizes"] = sizes_of(plan.items)
        first = split(sizes, sum(sizes) if bound is None else max(0, int(bound)))
        kept = memo.get("layout")
        if kept is None or kept[0] != first:
            kept = memo["layout"] = (first, cls(plan.items, sizes, first))
        return kept[1], sizes, first

    def regions(self, buffers: dict[bool, torch.Tensor], s: int, sizes: list[int]) -> list[torch.Tensor]:
        """Span ``s``'s staged tensors: 1-D views of ``buffers`` (the file's header takes the shape from the plan)."""
        kind, _, dt, idx, start, nbytes = self.spans[s]
        size = torch.empty((), dtype=dt).element_size()
        return list(buffers[kind][start:start + nbytes].view(dt).split([sizes[i] // size for i in idx]))


def stage(items: list[tuple], sizes: list[int], layout: Layout, pool: StagingPool) -> Callable[[], list[tuple]]:
    """Copy the staged tensors of ``items`` into ``pool``'s buffers as ``layout`` places them; ``views``.

    Host tensors are copied into plain memory (:func:`gather_host`: one call, without the GIL); device
    tensors into page-locked memory on a side stream ordered after the device's current stream, queued
    first so they run while the host copies do, and waited for before returning: when this returns,
    the caller may change or free every source tensor. ``views()`` — called by the worker, off the
    caller's time — gives ``items`` with each staged tensor replaced by a 1-D view of its copy;
    zero-size tensors stay as they are (nothing is read from them).
    """
    buffers = {kind: pool.take(kind, n) for kind, n in layout.ends.items() if n}
    streams: dict[Any, Any] = {}
    with torch.no_grad():
        for s, (kind, dev, _, idx, _, _) in enumerate(layout.spans):
            if kind:
                _device_copy(layout.regions(buffers, s, sizes), [items[i][3] for i in idx], dev, streams)
        if layout.ends[False]:
            index, offset, length = layout.host
            slow = gather_host(items, index, offset, length, buffers[False].data_ptr())
            if slow:
                _copy_slow(items, sizes, layout, buffers, {int(index[j]) for j in slow})
    for st in streams.values():
        st.synchronize()

    def views() -> list[tuple]:
        out = list(items)
        for s, span in enumerate(layout.spans):
            for i, d in zip(span[3], layout.regions(buffers, s, sizes)):
                key, dtype, shape, _ = items[i]
                out[i] = (key, dtype, shape, d)
        return out

    return views


def _copy_slow(items: list[tuple], sizes: list[int], layout: Layout, buffers: dict, slow: set[int]) -> None:
    """The host tensors :func:`gather_host` left (``slow``, item indices: strided, conjugate or negative
    views), copied by torch into their staged views (torch raises on anything else it left)."""
    dsts, srcs = [], []
    for s, span in enumerate(layout.spans):
        if not span[0] and slow.intersection(span[3]):
            for i, d in zip(span[3], layout.regions(buffers, s, sizes)):
                if i in slow:
                    dsts.append(d)
                    srcs.append(items[i][3].reshape(-1))
    torch._foreach_copy_(dsts, srcs)


def _device_copy(dsts: list[torch.Tensor], srcs: list[torch.Tensor], dev, streams: dict[Any, Any]) -> None:
    """``dsts`` (page-locked host) <- ``srcs`` (accelerator tensors of ``dev``), queued on the device's side
    stream.

    The side stream waits for the device's current stream once per save, so the copies see every
    write already queued there (the training step that produced the values).
    """
    s = streams.get(dev)
    if s is None:
        s = _side_streams.get(dev)
        if s is None:
            s = _side_streams[dev] = devices.new_stream(dev)
        s.wait_stream(devices.current_stream(dev))
        streams[dev] = s
    with devices.on_stream(s):
        torch._foreach_copy_(dsts, [t.reshape(-1) for t in srcs], non_blocking=True)


def device_ready(items: list[tuple]) -> dict[Any, Any]:
    """{device: event recorded on its current stream} for the accelerator tensors among ``items``."""
    events = {}
    for _, _, _, value in items:
        if not isinstance(value, bytes) and _pinned(value) and value.device not in events:
            events[value.device] = devices.record(value.device)
    return events


@contextlib.contextmanager
def ordered_after(events: dict[Any, Any]):
    """In the worker: device copies (the unstaged head's) on side streams waiting for ``events``."""
    with contextlib.ExitStack() as stack:
        for dev, ev in events.items():
            s = devices.new_stream(dev)
            s.wait_event(ev)
            stack.enter_context(devices.on_stream(s))
        yield


def start(handle: SaveHandle, comm: Comm, work: Callable[[], None]) -> None:
    """Run ``work`` (write, agree, commit) on the group's worker thread; it finishes ``handle``."""

    def run() -> None:
        error: BaseException | None = None
        try:
            work()
        except DistributedError as e:
            error = e
        except PipeloadError as e:  # a collective of the own group failed: a rank died or hung
            error = DistributedError(handle.what, _failures(comm, e))
        except BaseException as e:  # noqa: BLE001 - reported by wait(), never lost in the thread
            error = DistributedError(handle.what, {comm.rank: f"{type(e).__name__}: {e}"})
        finally:
            with _lock:
                if _pending.get(group_key(comm)) is handle:
                    del _pending[group_key(comm)]
        handle._finish(error)

    with _lock:
        _pending[group_key(comm)] = handle
        worker = _workers.get(group_key(comm))
        if worker is None:
            worker = _workers[group_key(comm)] = ThreadPoolExecutor(1, f"pipeload-save-{comm.rank}",
                                                                    initializer=saver.lower_priority)
    try:
        worker.submit(run)
    except RuntimeError:  # shutting down (a save from an atexit hook): executors take no more work
        threading.Thread(target=run, name=f"pipeload-save-{comm.rank}-last", daemon=False).start()


def _forget_after_fork() -> None:
    """In a forked child: the parent's saves and worker threads are not the child's."""
    _pending.clear()
    _workers.clear()


os.register_at_fork(after_in_child=_forget_after_fork)


def _failures(comm: Comm, e: PipeloadError) -> dict[int, str]:
    """{rank: why} for a failed collective: the ranks the probe found silent, else this rank."""
    silent = getattr(comm, "silent_ranks", None) or []
    if silent:
        return {r: f"stopped answering during the background save ({e})" for r in silent}
    return {comm.rank: str(e)}


def save(state_dict: dict, directory: str, comm: Comm, staging_bytes: int | None, phases=saver,
         offer=saver.ASK) -> SaveHandle:
    """The caller's part of a background save: plan, snapshot, start the worker; the handle.

    Planning raises here, on every rank alike, as a blocking save would (nothing is written). After
    planning nothing raises here: a failure (staging, writing, a peer) reaches every rank's
    :meth:`SaveHandle.wait` through the agreement. ``staging_bytes`` bounds the staging (default:
    every byte this rank owns); the head of the file that does not fit is written from the live
    tensors, while the rest is copied, before this returns. ``offer``: as
    :func:`pipeload.save.saver.plan_phase` takes it.
    """
    from ..engine._busy import Guard
    from ..engine._gcpause import paused_gc

    if comm.active and comm.size > 1 and not comm.is_world:
        raise PipeloadError(
            f"pipeload.save into {directory}: background=True needs the world as the process group "
            f"(its own group is created by every rank of the world); save a subgroup with background=False"
        )
    t0 = time.perf_counter()
    handle = SaveHandle(f"pipeload.save into {directory} (background)")
    with paused_gc(), Guard() as guard:
        contended = guard.enter_sync(comm, comm.size > 1, f"pipeload.save into {directory}",
                                     comm.timeout.total_seconds())
        plan = saver.plan_phase(state_dict, directory, comm, contended, offer=offer)
        own = own_comm(comm)  # every rank passed planning: all create it here, or all reuse it
        handle.plan_seconds = time.perf_counter() - t0
        pool = pool_for(comm)
        allocations = pool.allocations
        snap = _Snapshot(plan, staging_bytes)
        if snap.first:  # the head is written from the live tensors while the tail is copied
            start(handle, own, lambda: snap.work(phases, directory, own))
        try:
            snap.stage(pool)
        except Exception as e:  # noqa: BLE001 - carried to the agreement: every rank's wait() raises
            snap.problem = f"staging {directory}: {type(e).__name__}: {e}"
        snap.problem = snap.problem or guard.late(comm)  # an operation overlapped this one
        snap.tail_staged.set()
        if not snap.first:
            start(handle, own, lambda: snap.work(phases, directory, own))
        snap.head_written.wait()
    handle.owned_bytes, handle.staged_bytes = snap.owned, snap.staged
    handle.staging_allocations = pool.allocations - allocations
    handle.staging_held = pool.nbytes()
    handle.blocked_seconds = time.perf_counter() - t0
    return handle


class _Snapshot:
    """One background save's plan split into the live head and the staged tail, and their hand-over.

    ``plan.items[:first]`` are written from the live tensors, before the caller is released;
    ``plan.items[first:]`` point at staging copies once :meth:`stage` ran. The worker writes the head,
    then waits for the tail's copies (``tail_staged``) before it goes on.
    """

    def __init__(self, plan, staging_bytes: int | None):
        self.plan = plan
        self.layout, self.sizes, self.first = Layout.of(plan, staging_bytes)
        self.owned = sum(self.sizes)
        self.head_ready = device_ready(plan.items[:self.first]) if self.layout.accel and self.first else {}
        self.head_written, self.tail_staged = threading.Event(), threading.Event()
        self.staged = 0
        self.views: Callable[[], list[tuple]] = lambda: plan.items
        self.problem: str | None = None
        plan.items = list(plan.items)
        plan.on_written = self.written if self.first else None
        if not self.first:
            self.head_written.set()

    def stage(self, pool: StagingPool) -> None:
        self.views = stage(self.plan.items, self.sizes, self.layout, pool)
        self.staged = self.layout.staged

    def use_staging(self) -> None:
        """In the worker, once the tail is staged: the plan's tail items become views of the copies
        (in place: the writer may be iterating the list)."""
        self.tail_staged.wait()
        if self.problem:
            raise RuntimeError(self.problem)
        self.plan.items[self.first:] = self.views()[self.first:]

    def written(self, n: int) -> None:
        """In the worker, after ``n`` items of the file: past the head, wait for the tail's copies."""
        if n == self.first:
            self.head_written.set()
            self.use_staging()

    def work(self, saver, directory: str, own: Comm) -> None:
        """The worker's part: write (unless staging failed), agree, commit; release the lock."""
        plan = self.plan
        try:
            if not self.first and not self.problem:
                self.use_staging()
            if self.problem and not self.first:
                error, sums = self.problem, {}
            else:
                with ordered_after(self.head_ready):
                    error, sums = saver.write_phase(plan, directory, own)
                error = error or self.problem
            saver.commit_phase(plan, directory, own, error, sums)
        finally:
            self.head_written.set()
            _close(plan.locks)


def _close(fds: list[int]) -> None:
    import os

    while fds:
        os.close(fds.pop())

