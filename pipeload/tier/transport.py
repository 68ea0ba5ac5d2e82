"""Copies of rank files between hosts: point-to-point messages on the snapshot's own gloo group.

A file travels as a stream of messages of :data:`CHUNK` bytes (the last one shorter), whose count both
ends derive from the file's size, which every rank holds after the snapshot's gather. Each ordered pair
of ranks carries at most one file per snapshot (a rank sends only its own file, to one writer per
destination host), so the pair's messages match in posting order with no tag of their own.

Each stream (a file sent to one peer, or received from one) runs in a thread of its own, with at
most :data:`DEPTH` messages posted at once (bounded memory: ``DEPTH x CHUNK`` per stream), and waits
only for its own oldest message. One thread waiting for all streams could close a cycle between two
ranks that send to each other: each blocked on the other's next message, whose posting waits behind
that very wait. Gloo progresses posted messages in its own threads, so message ``k`` of a stream
completes once both ends posted it, and each end posts it once its message ``k - DEPTH`` completed:
by induction every message completes while both ends live. A peer that dies fails its streams' pending
messages; one that stops progressing fails them at the group's timeout.

This module and :mod:`pipeload.engine.comm` are the only ones that call ``torch.distributed``'s
point-to-point functions.
"""

from __future__ import annotations

import os
import threading
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
    ranks that stopped answering, when the probe finds them) when a message fails (a peer died) or the
    group's timeout passes (a peer hung): the peers' messages cannot be abandoned otherwise."""
    streams: list[Any] = [_Out(p, parts, n) for p, parts, n in outs if n] + [_In(p, path, n) for p, path, n in ins]
    failures: list[BaseException] = []
    threads = [threading.Thread(target=_run, args=(s, own.pg, failures), name=f"pipeload-tier-copy-{own.rank}")
               for s in streams[1:]]
    for t in threads:
        t.start()
    if streams:
        _run(streams[0], own.pg, failures)
    for t in threads:
        t.join()
    errors = [s.finish() for s in streams if isinstance(s, _In)]
    if failures:
        raise own._fail(what, "point-to-point copy of rank files", failures[0]) from failures[0]
    return next((e for e in errors if e), None)


def _run(stream, pg, failures: list[BaseException]) -> None:
    """One stream, to its end: post up to DEPTH messages, wait for the oldest, hand it over, repeat.

    A gloo message is complete only once waited for (``is_completed`` stays false until ``wait()``),
    so each stream waits in a thread of its own: a stream blocks only on its own messages, whose peer
    posts them in the same order, so no wait of one stream can hold back another's.
    """
    try:
        while stream.more() or stream.pending:
            while stream.more() and len(stream.pending) < DEPTH:
                stream.post(pg)
            work, buf = stream.pending.popleft()
            work.wait()  # the group's timeout bounds it; a dead peer fails it
            stream.done(work, buf)
    except BaseException as e:  # noqa: BLE001 - raised by exchange() once every stream has stopped
        failures.append(e)
