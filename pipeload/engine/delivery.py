"""Running part delivery (:mod:`pipeload.plan.partdelivery`): the owners' page bytes, point to point.

Before the shared phase, for each (owner, receiver) pair of this rank in the order (owner, receiver),
the owner reads its deliveries' bytes (from pages it reads anyway) into one packed message and sends it
on the load's :class:`~pipeload.engine.comm.Comm`; the receiver posts one receive per pair. Every
message is posted before any is waited on (an owner's reads need no peer), then all are awaited, oldest
first (:class:`pipeload.move.mover.Transfers` with no in-flight bound). The messages travel on the
load's broadcast device (an accelerator under NCCL: packed on the host, copied to it and back at the
ends). Why it cannot deadlock: the delivery messages come before every broadcast in the one global
order, and both ends of each derive it from the same plan; the lowest incomplete message has both ends
posted, so it completes, and the broadcasts follow in the plan's order, unchanged.

An owner whose read fails still sends (zeros where the bytes failed) and records the error: the load's
agreement then fails on every rank. A dead peer fails the transfer by name, as a failed broadcast does.
The received bytes become the reader's patches (:meth:`pipeload.io.reader.ChunkReader.set_patches`):
the reads of this load take a delivered head or tail from there and never ask storage for its page.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from ..io.reader import copy_box
from ..move.mover import Transfers
from ..plan import partdelivery
from ..plan.exchange import F_HOST
from ..plan.partdelivery import Delivery


def plan(gp, md, names: list[str], reader, me: int, rows: np.ndarray, my_items) -> list[Delivery]:
    """This rank's deliveries (sent or received), from the plan of every component (``gp.every``), the
    gathered rows' hosts and the headers of the files this rank reads (``my_items``: its ReadItems).
    Local only: no collective. Every reader of a file decides alike from its header; a DCP item that is
    not stored in place (decoded by torch.load) gives its blob's start: its pages are then misjudged
    alike on every rank (no saving), and the bytes still exact (parts are chunk-relative, from
    ``buffer()`` on both ends). Object stores never come here (the loader turns it off for URLs)."""
    hosts = rows[:, F_HOST].tolist()
    files = {name for name in {item.file for item in my_items if item.nbytes} if _in_place(reader, name)}
    if not files:
        return []
    _, itemsize = md.key_arrays(names)
    starts: dict[tuple[str, str], int] = {}  # (a DCP item's start costs a read of its local header)
    layouts: dict[str, Any] = {}  # (each a sort of the file's header entries)

    def start_of(file: str, key: str) -> int:
        s = starts.get((file, key))
        if s is None:
            s = starts[file, key] = _start(reader.file(file), key)
        return s

    def layout_of(file: str):
        if file not in layouts:
            layouts[file] = _layout(reader.file(file))
        return layouts[file]

    return partdelivery.plan(gp.every(), md, names, itemsize, me, files, start_of, layout_of, hosts.__getitem__)


def _layout(f: Any) -> tuple[list[int], list[int], list[str]] | None:
    """The chunks of an open file as (first bytes, ends, keys), by first byte, from its header; None for
    a file without one (a DCP blob: its pages are decided per chunk, see partdelivery.plan)."""
    if not hasattr(f, "keys"):
        return None
    rows = sorted((int(e[2]), int(e[3]), k) for k in f.keys() for e in (f.entry(k),))
    return [r[0] for r in rows], [r[1] for r in rows], [r[2] for r in rows]


def _in_place(reader, name: str) -> bool:
    try:
        f = reader.file(name)
    except Exception:  # noqa: BLE001 - the read itself reports it
        return False
    return hasattr(f, "entry") and hasattr(f, "buffer")


def _start(f: Any, key: str) -> int:
    """A stored chunk's first byte in its file (a DCP item: once its local header is read)."""
    resolve = getattr(f, "_resolve", None)
    if resolve is not None:
        return int(resolve(key)[2])
    return int(f.entry(key)[2])


def _pairs(deliveries: list[Delivery]) -> dict[tuple[int, int], list[Delivery]]:
    out: dict[tuple[int, int], list[Delivery]] = {}
    for d in deliveries:  # (sorted by owner, receiver, file, key, lo: the message order, and the packing)
        out.setdefault((d.owner, d.receiver), []).append(d)
    return out


def _pack(reader, parts: list[Delivery], counters) -> torch.Tensor:
    """One message: the bytes of ``parts`` read from this rank's files, back to back; a part whose read
    fails stays zero and the failure is recorded (the agreement fails the load on every rank)."""
    msg = torch.zeros(sum(d.hi - d.lo for d in parts), dtype=torch.uint8)
    for d in parts:  # every page asked for at once: storage serves them while the first are copied
        try:
            f = reader.file(d.file)
            start = _start(f, d.key)
            f.advise("willneed", start + d.lo, start + d.hi)
        except Exception:  # noqa: BLE001 - a hint only: the copy below reports what is wrong
            pass
    at = 0
    for d in parts:
        n = d.hi - d.lo
        try:
            f = reader.file(d.file)
            src = torch.frombuffer(reader._bytes(f, d.key, ""), dtype=torch.uint8)
            copy_box(msg[at : at + n], src[d.lo : d.hi], f.path)
        except Exception as e:  # noqa: BLE001 - still sent: the receiver waits for it
            counters.fail(d.key, d.file, e)
        at += n
    return msg


def deliver(comm, reader, deliveries: list[Delivery], counters, what: str) -> None:
    """Send and receive this rank's deliveries (see the module docstring), then install the received
    bytes as the reader's patches. Counts ``counters.pages_delivered`` (deliveries this rank took part
    in), ``part_bytes_sent`` and ``part_bytes_received``."""
    me, wire = comm.rank, comm.broadcast_device  # (under NCCL the messages are device tensors)
    pairs = _pairs(deliveries)
    t = Transfers(comm, what, limit=1 << 62)
    received: list[tuple[list[Delivery], torch.Tensor]] = []
    for (owner, receiver), parts in sorted(pairs.items()):
        if owner == me:
            msg = _pack(reader, parts, counters).to(wire)
            t.send(receiver, msg.numel(), lambda lo, hi, m=msg: m[lo:hi])
            counters.part_bytes_sent += msg.numel()
        elif receiver == me:
            buf = torch.empty(sum(d.hi - d.lo for d in parts), dtype=torch.uint8, device=wire)
            t.recv(owner, buf)
            received.append((parts, buf))
            counters.part_bytes_received += buf.numel()
        else:
            continue
        counters.pages_delivered += len(parts)
    t.drain()
    patches = []
    for parts, buf in received:
        buf, at = buf.cpu(), 0  # (the patches are copied into host reads)
        for d in parts:
            patches.append((d.file, d.key, d.lo, d.hi, buf[at : at + d.hi - d.lo]))
            at += d.hi - d.lo
    reader.set_patches(patches)
