"""Point-to-point data movement in one global order: the memory tier's restore and the live transfer.

Every transfer is a list of parts of at most :data:`PIECE` bytes; the sender and the receiver cut a
transfer into the same parts from sizes both know (a restore's receiver from its own destination, equal
to the file's chunk by the layout check; a resharding restore's and a live transfer's both ends
from the region the plan's answer names). Each rank walks its transfers in the global order and posts
every part at once (``comm.isend``/``comm.irecv``: :class:`pipeload.engine.comm.Comm` on a group of the
default world, :class:`pipeload.move.link.Link` on any process group), waiting for its oldest
outstanding part while more than :data:`INFLIGHT` bytes are in flight. A sender produces the next part
(``pread`` out of a tier file, a copy out of a live tensor) while the backend sends the previous ones.

Why one global order cannot deadlock, even when each rank knows only its own transfers: order every
message of the operation by a key both of its ends compute alike. Take the smallest message not yet
complete. Every message before it on either end is complete, so neither end is blocked on an older one:
each has posted it or posts it next, and it completes. By induction every message does, whatever the
in-flight bound.

Messages that are not a destination's own memory (a sender's parts, a receiver's packed messages) go
through a few :data:`PIECE`-byte buffers reused as their messages complete (:meth:`Transfers.buffer`):
fresh memory for every message made the first restore of a process fault in every byte it moved (59,000
page faults and 0.74 s of system time on the rank that sent 256 MiB, on this project's 2-core VM). An
operation that repeats (a live transfer every training step) passes the same :class:`BufferPool` to
each, so its steps after the first fault in nothing.
"""

from __future__ import annotations

import ctypes
from collections import deque
from typing import Callable

import torch

from ..errors import PipeloadError

PIECE = 16 << 20  # bytes of one point-to-point message
SMALL = 1 << 20  # chunks below this travel packed with their neighbours, up to PIECE bytes a message
INFLIGHT = 64 << 20  # bytes a rank has posted and not yet seen complete


class BufferPool:
    """:data:`PIECE`-byte host buffers, kept while the pool lives: at most INFLIGHT / PIECE + 2 of them
    (the posted ones and the one being filled)."""

    def __init__(self):
        self.free: list[torch.Tensor] = []  # buffers whose message completed
        self.pooled: dict[int, torch.Tensor] = {}  # address -> buffer, every buffer of the pool

    def take(self, n: int) -> torch.Tensor:
        if not self.free:
            base = torch.empty(PIECE, dtype=torch.uint8)
            self.pooled[base.data_ptr()] = base
            self.free.append(base)
        return self.free.pop()[:n]

    def give(self, buf: torch.Tensor) -> None:
        base = self.pooled.get(buf.data_ptr()) if self.pooled else None
        if base is not None:  # (a buffer of the pool carries one message of one part: complete, and read)
            self.free.append(base)

    def clear(self) -> None:
        self.free.clear()
        self.pooled.clear()


class Transfers:
    """One rank's sends and receives, posted in the global order, at most :data:`INFLIGHT` bytes in flight.

    ``tolerant``: a message that fails (its peer died) does not stop this rank; every later message
    with that peer is skipped, the others go on, and :attr:`failed` names the peer. A rank that stopped
    at its first failure would leave its live peers blocked on the messages it abandoned until the
    group's timeout; going on lets every message between live ranks complete (the global order's
    argument, restricted to them), so every survivor reaches the operation's final agreement at once.
    A ``then`` callback that raises is recorded in :attr:`errors` (the peer is fine: its messages go on)."""

    def __init__(self, comm, what: str, limit: int | None = None, tolerant: bool = False,
                 pool: BufferPool | None = None):
        self.comm, self.what, self.limit = comm, what, INFLIGHT if limit is None else limit
        self.tolerant = tolerant
        self.failed: dict[int, str] = {}  # peer -> the first failure of a message with it
        self.errors: list[str] = []  # then-callbacks that raised (tolerant only)
        self.pending: deque = deque()  # (work, bytes, buffer kept alive, then-callback, peer)
        self.inflight = 0
        self.sent = self.received = self.messages = 0
        self.pool = BufferPool() if pool is None else pool

    def buffer(self, n: int) -> torch.Tensor:
        """A flat uint8 buffer for one message of ``n`` bytes (its single part: ``n`` <= :data:`PIECE`),
        taken back for another message once the message it was posted with completed (after its
        ``then``). At most INFLIGHT / PIECE + 2 buffers exist: the posted ones and the one being filled."""
        if n == 0 or n > PIECE:
            return torch.empty(n, dtype=torch.uint8)
        return self.pool.take(n)

    def send(self, peer: int, nbytes: int, part: Callable[[int, int], torch.Tensor]) -> None:
        """Send ``nbytes`` to ``peer``: ``part(lo, hi)`` gives bytes [lo, hi) as a uint8 tensor."""
        for lo in range(0, nbytes, PIECE):
            hi = min(nbytes, lo + PIECE)
            buf = part(lo, hi)
            self._post(self._p2p(self.comm.isend, buf, peer), hi - lo, buf, None, peer)
            self.sent += hi - lo

    def recv(self, peer: int, target: torch.Tensor, then: Callable[[], None] | None = None) -> None:
        """Receive ``target.numel()`` bytes (a flat uint8 tensor) from ``peer``; ``then()`` once all arrived."""
        n = target.numel()
        if n == 0:
            if then is not None:
                then()
            return
        for lo in range(0, n, PIECE):
            hi = min(n, lo + PIECE)
            last = hi == n
            self._post(self._p2p(self.comm.irecv, target[lo:hi], peer), hi - lo, target, then if last else None,
                       peer)
            self.received += hi - lo

    def _p2p(self, call, buf: torch.Tensor, peer: int):
        if peer in self.failed:
            return None
        self.messages += 1
        try:
            return call(buf, peer)
        except Exception as e:  # noqa: BLE001 - a peer gone: the same failure every survivor sees
            err = self.comm._fail(self.what, f"point-to-point transfer with rank {peer}", e)
            if not self.tolerant:
                raise err from e
            self.failed.setdefault(peer, str(err))
            return None

    def _post(self, work, n: int, buf, then, peer: int) -> None:
        if work is None:  # skipped: its peer failed
            self.pool.give(buf)
            return
        self.pending.append((work, n, buf, then, peer))
        self.inflight += n
        while self.inflight > self.limit and self.pending:
            self._wait_oldest()

    def _wait_oldest(self) -> None:
        work, n, buf, then, peer = self.pending.popleft()
        self.inflight -= n
        try:
            work.wait()
        except Exception as e:  # noqa: BLE001
            err = self.comm._fail(self.what, f"point-to-point transfer with rank {peer}", e)
            if not self.tolerant:
                raise err from e
            self.failed.setdefault(peer, str(err))
            then = None
        if then is not None:
            try:
                then()
            except Exception as e:  # noqa: BLE001 - a local failure: recorded, the messages go on
                if not self.tolerant:
                    raise
                self.errors.append(f"{self.what}: after a message from rank {peer}: {type(e).__name__}: {e}")
        self.pool.give(buf)

    def drain(self) -> None:
        """Wait for everything posted (the oldest first)."""
        while self.pending:
            self._wait_oldest()


def flat_bytes(t: torch.Tensor) -> torch.Tensor | None:
    """``t``'s memory as a flat uint8 view when a receive may write straight into it, else None."""
    return t.reshape(-1).view(torch.uint8) if direct_ptr(t) is not None else None


def staged_into(dst: torch.Tensor, ring=None) -> tuple[torch.Tensor, Callable[[], None]]:
    """(a uint8 buffer to receive ``dst``'s bytes into, the copy into ``dst`` once they arrived); the copy
    into an accelerator tensor goes through ``ring`` (a :class:`pipeload.device.H2DRing`) when given."""
    direct = flat_bytes(dst)
    if direct is not None:
        return direct, lambda: None
    buf = torch.empty(dst.numel() * dst.element_size(), dtype=torch.uint8)

    def copy() -> None:
        copy_into(dst, buf.view(dst.dtype).view(dst.shape), ring)

    return buf, copy


def copy_into(dst: torch.Tensor, src: torch.Tensor, ring) -> None:
    """``dst.copy_(src)`` (``src`` on the host), through ``ring`` for a destination on its device."""
    if ring is not None and dst.device == ring.device and not dst.is_conj() and not dst.is_neg():
        ring.copy(dst, src)
    else:
        dst.copy_(src)


def batches(sizes: list[tuple[str, int]]) -> list[list[tuple[str, int]]]:
    """``sizes`` (name, bytes), in the transfer's order, cut into messages both ends derive alike: a chunk
    of at least :data:`SMALL` bytes alone (cut into parts by :meth:`Transfers.send`), runs of smaller ones
    packed up to :data:`PIECE` bytes (a message per chunk would make many small tensors latency-bound)."""
    out: list[list[tuple[str, int]]] = []
    run: list[tuple[str, int]] = []
    total = 0
    for name, n in sizes:
        if n >= SMALL:
            if run:
                out.append(run)
                run, total = [], 0
            out.append([(name, n)])
            continue
        if run and total + n > PIECE:
            out.append(run)
            run, total = [], 0
        run.append((name, n))
        total += n
    if run:
        out.append(run)
    return out


def direct_ptr(t: torch.Tensor) -> int | None:
    """The address of ``t``'s bytes when they may be written as one block (a contiguous host tensor that
    holds its values), else None."""
    if t.device.type != "cpu" or not t.is_contiguous() or t.is_conj() or t.is_neg() or not t.numel():
        return None
    ptr = t.data_ptr()
    if not ptr:
        raise PipeloadError("a destination tensor has no memory of its own")
    return ptr


def host_bytes(ptr: int, n: int) -> memoryview:
    """A writable byte view of ``n`` bytes at ``ptr`` (a tensor's memory, kept alive by its owner)."""
    return memoryview((ctypes.c_char * n).from_address(ptr)).cast("B")


def unpack_into(buf: torch.Tensor, dsts: list[torch.Tensor], ring=None) -> Callable[[], None]:
    """The copy of a packed message's slices into their destinations, in order, once it arrived (one
    ``memmove`` a contiguous host destination: packed chunks are small, torch's per-call cost was most)."""
    plan, at = [], 0
    for dst in dsts:
        n = dst.numel() * dst.element_size()
        if n:
            plan.append((direct_ptr(dst) or dst, at, n))
        at += n

    def unpack() -> None:
        base = buf.data_ptr()
        for dst, lo, n in plan:
            if type(dst) is int:
                ctypes.memmove(dst, base + lo, n)
            else:
                copy_into(dst, buf[lo: lo + n].view(dst.dtype).view(dst.shape), ring)

    return unpack
