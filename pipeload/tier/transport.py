"""Copies of rank files between hosts: point-to-point messages on the snapshot's own gloo group.

A file travels as a stream of messages of :data:`CHUNK` bytes (the last one shorter), whose count both
ends derive from the file's size, which every rank holds after the snapshot's gather. Each ordered pair
of ranks carries at most one file per snapshot (a rank sends only its own file, to one writer per
destination host), so the pair's messages match in posting order with no tag of their own.

Every message of every stream of a rank is posted without waiting on another rank, at most
:data:`DEPTH` per stream at once (bounded memory: ``DEPTH x CHUNK`` per stream), and the rank polls
them all rather than blocking on one: a rank blocked on one stream's message while its own next
message of another stream waits to be posted could close a cycle of waits between two ranks sending
to each other. Gloo progresses posted messages in its own threads, so every posted message completes
once its peer posts the matching one, and every peer does, in stream order. A peer that dies fails the
pending messages; a peer that stops progressing fails them at the group's timeout.

This module and :mod:`pipeload.engine.comm` are the only ones that call ``torch.distributed``'s
point-to-point functions.
"""

from __future__ import annotations

import os
import time
from collections import deque
from typing import Any

import torch
import torch.distributed as dist

from ..engine.comm import Comm

CHUNK = 8 << 20  # bytes per message
DEPTH = 2  # messages in flight per stream


class _Out:
    """The sending end of one file: ``parts`` (byte views, back to back) packed into messages."""

    def __init__(self, peer: int, parts: list[memoryview], size: int):
        self.peer, self.size = peer, size
        self.parts = deque(p.cast("B") if p.format != "B" else p for p in parts if p.nbytes)
        self.sent = 0
        self.pending: deque[tuple[Any, torch.Tensor]] = deque()
        self.free: list[torch.Tensor] = []

    def more(self) -> bool:
        return self.sent < self.size

    def post(self, pg) -> None:
        n = min(CHUNK, self.size - self.sent)
        buf = self.free.pop() if self.free else torch.empty(min(CHUNK, self.size), dtype=torch.uint8)
        out = memoryview(buf.numpy())
        filled = 0
        while filled < n:
            part = self.parts[0]
            k = min(part.nbytes, n - filled)
            out[filled:filled + k] = part[:k]
            filled += k
            if k == part.nbytes:
                self.parts.popleft()
            else:
                self.parts[0] = part[k:]
        self.pending.append((dist.isend(buf[:n], dst=self.peer, group=pg), buf))
        self.sent += n

    def done(self, work, buf: torch.Tensor) -> None:
        self.free.append(buf)


class _In:
    """The receiving end of one file: messages written to ``path`` as they arrive (``path.tmp``, renamed
    at the end). A write that fails is recorded and the stream is still drained: the sender never waits
    for a message that will not come."""

    def __init__(self, peer: int, path: str, size: int):
        self.peer, self.path, self.size = peer, path, size
        self.received = self.posted = 0
        self.pending: deque[tuple[Any, torch.Tensor]] = deque()
        self.free: list[torch.Tensor] = []
        self.error: str | None = None
        self.fd = -1
        try:
            self.fd = os.open(path + ".tmp", os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
        except OSError as e:
            self.error = f"writing the copy {path}: {type(e).__name__}: {e}"

    def more(self) -> bool:
        return self.posted < self.size

    def post(self, pg) -> None:
        n = min(CHUNK, self.size - self.posted)
        buf = self.free.pop() if self.free else torch.empty(min(CHUNK, self.size), dtype=torch.uint8)
        self.pending.append((dist.irecv(buf[:n], src=self.peer, group=pg), buf))
        self.posted += n

    def done(self, work, buf: torch.Tensor) -> None:
        n = min(CHUNK, self.size - self.received)
        self.received += n
        if self.error is None:
            try:
                view = memoryview(buf.numpy())[:n]
                while view.nbytes:
                    view = view[os.write(self.fd, view):]
            except OSError as e:
                self.error = f"writing the copy {self.path}: {type(e).__name__}: {e}"
        self.free.append(buf)

    def finish(self) -> str | None:
        """Close the file; rename it into place when every byte arrived and was written (fsync'd unless on a
        tmpfs), else remove it; the write error, if any."""
        from .format import on_tmpfs

        if self.fd >= 0:
            try:
                if self.error is None and not on_tmpfs(self.path):
                    os.fsync(self.fd)
            except OSError as e:
                self.error = f"writing the copy {self.path}: {type(e).__name__}: {e}"
            os.close(self.fd)
            self.fd = -1
            try:
                if self.error is None and self.received == self.size:
                    os.replace(self.path + ".tmp", self.path)
                else:
                    os.unlink(self.path + ".tmp")
            except OSError as e:
                self.error = self.error or f"writing the copy {self.path}: {type(e).__name__}: {e}"
        return self.error


def exchange(own: Comm, outs: list[tuple[int, list[memoryview], int]], ins: list[tuple[int, str, int]],
             what: str) -> str | None:
    """Send ``outs`` ((peer, file parts, size)) and receive ``ins`` ((peer, path, size)); the first write
    error of a received copy (naming the file), or None. Raises :class:`pipeload.PipeloadError` (naming the
    ranks that stopped answering, when the probe finds them) when a message fails or the group's timeout
    passes: the peers' messages cannot be abandoned otherwise."""
    streams: list[Any] = [_Out(p, parts, n) for p, parts, n in outs if n] + [_In(p, path, n) for p, path, n in ins]
    deadline = time.monotonic() + own.timeout.total_seconds()
    nap = 1e-4
    try:
        while True:
            busy = progressed = False
            for s in streams:
                while s.more() and len(s.pending) < DEPTH:
                    s.post(own.pg)
                while s.pending and s.pending[0][0].is_completed():
                    work, buf = s.pending.popleft()
                    work.wait()  # raises what the message failed with
                    s.done(work, buf)
                    progressed = True
                busy = busy or bool(s.pending)
            if not busy:
                break
            if time.monotonic() > deadline:
                raise TimeoutError(f"copies not finished after {own.timeout.total_seconds():.0f} s")
            nap = 1e-4 if progressed else min(nap * 2, 2e-3)
            time.sleep(nap)
    except Exception as e:  # noqa: BLE001 - a peer died or hung: named by the probe
        raise own._fail(what, "point-to-point copy of rank files", e) from e
    finally:
        errors = [s.finish() for s in streams if isinstance(s, _In)]
    return next((e for e in errors if e), None)
