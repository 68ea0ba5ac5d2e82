"""A planned movement's data on one rank: messages in the one global order, then local copies.

Shared by the live transfer (sources: a trainer's tensors) and the memory tier's resharding restore
(sources: the stored chunks of tier files); only the :class:`Source` differs — how a sender packs a
message out of what it holds and how it copies a piece it holds itself. The destinations are views of
boxes on both (:class:`Dests`: ``boxes`` and ``views`` in the plan's index order).

The pieces between one sender and one receiver are cut into *messages* alike on both ends (they sort
the same :class:`pipeload.move.plan.Op` keys and pack runs of small pieces with
:func:`pipeload.move.mover.batches`); each rank posts all its messages, sends and receives merged, by
the key of each message's first piece, through :class:`pipeload.move.mover.Transfers` (at most its
in-flight bound posted). A sender packs each message when its first part is posted; a source may send a
lone piece without packing (a contiguous tensor as it is, a run of a tier file in parts as they are
read). A receiver lands a lone contiguous piece straight in its destination view, anything else in a
buffer copied out once the message arrived. Local copies run while the last messages are in flight.
The cut, the order and each message's layout are a :class:`pipeload.move.schedule.Schedule`, made once
per plan (a live transfer keeps it with its plan); pieces between host tensors are packed, unpacked
and copied by its compiled rows, the others by the source and torch.

Which destinations are complete is tracked piece by piece (:class:`Progress`): if a peer dies, the
stats say exactly which destination views hold this step's bytes and which do not.
"""

from __future__ import annotations

import ctypes
from typing import Callable, Protocol

import numpy as np
import torch

from . import mover
from .plan import Answers, Op
from .schedule import (CODES, DTYPES, Batch, Item, Schedule, buffer_base, layout, nbytes, pack_batch,  # noqa: F401
                       run_rows, unpack_batch)  # (CODES, DTYPES, layout: shared)


class Dests(Protocol):
    """The destination side: ``boxes[i]`` (a :class:`pipeload.move.plan.Box`) is held by ``views[i]``."""

    boxes: list
    views: list


class Source(Protocol):
    """What a sender holds. ``sender`` may return ``part(lo, hi)`` for a message it sends without packing
    (else None); ``pack`` writes a message's pieces at ``starts`` into ``buf`` (a failure is recorded by
    the caller, the message still sent); ``copy`` writes a piece this rank both holds and needs.
    ``bases`` are the tensors its pieces are regions of (None for a source that is not tensors), and
    ``base_of(op)`` is (index in ``bases``, the box that tensor holds): pieces between host tensors are
    then packed and copied by compiled rows (:mod:`pipeload.move.schedule`), the rest by ``pack``/``copy``."""

    def bases(self) -> list[torch.Tensor] | None: ...

    def base_of(self, op: Op) -> tuple[int, object]: ...

    def sender(self, x: mover.Transfers, msg: list[Op], wire: torch.device) -> Callable | None: ...

    def pack(self, msg: list[Op], starts: list[int], buf: torch.Tensor) -> None: ...

    def copy(self, op: Op, out: torch.Tensor) -> None: ...


class Progress:
    """Pieces still to land per destination index; the ones with none left are written. After a failure
    a destination that received a relayed piece is not counted as written: its relay may have forwarded
    bytes it never received. Counted a message at a time, from counts the schedule keeps (a step of a
    large model lands 100,000s of pieces: one Python operation each was tens of milliseconds a step)."""

    def __init__(self, sched: Schedule, n_dst: int):
        needs, self.relayed = sched.needs(n_dst)
        self.left = needs.copy()
        self.done = 0

    def landed(self, it: Item) -> None:
        at, count = it.lands
        self.left[at] -= count
        self.done += len(it.msg)

    def written(self, failed: bool = False) -> list[int]:
        done = np.flatnonzero(self.left == 0).tolist()
        return [i for i in done if i not in self.relayed] if failed else done


def view(side, box_index: int, op: Op) -> torch.Tensor:
    """The view of ``side``'s box ``box_index`` (``side.boxes``, ``side.views``) that holds ``op``'s region."""
    box, base = side.boxes[box_index], side.views[box_index]
    if op.lengths == box.lengths:
        return base
    stride = base.stride()
    at = base.storage_offset() + sum((o - b) * st for o, b, st in zip(op.offsets, box.offsets, stride))
    return base.as_strided(op.lengths, stride, at)


def schedule(answers: Answers) -> Schedule:
    """This rank's messages of ``answers``, cut and ordered (keep it while the plan is kept)."""
    return Schedule(answers)


def run(x: mover.Transfers, sched: Schedule, source: Source, dst: Dests, progress: Progress,
        wire: torch.device, ring=None) -> int:
    """Post every message in the global order, copy the local pieces, wait for all; bytes copied locally.
    Before the first message of a later hop, every message posted so far completes (a relay forwards
    what it received; waiting only on earlier messages keeps the order's argument). ``ring``: a
    :class:`pipeload.device.H2DRing` for received bytes bound for accelerator destinations."""
    bound = sched.bind(source.bases(), source.base_of, dst.views, dst.boxes, wire)
    batches = bound.batches
    hop, copied = 0, 0
    for i, (it, prog) in enumerate(zip(sched.items, bound.programs)):
        if it.sending is None:
            copied += _copy_local(it, prog, bound, source, dst, progress)
            continue
        if it.msg[0].hop != hop:
            x.drain()
            hop = it.msg[0].hop
        copier = prog if batches is None else batches[i]  # (rows on the host's wire, a batch on a device's)
        if it.sending:
            x.send(it.msg[0].peer, it.nbytes, packer(x, it, copier, bound, source, wire))
        else:
            _post_recv(x, it, copier, bound, dst, progress, wire, ring)
    x.drain()
    return copied


def _copy_local(it, prog, bound, source: Source, dst: Dests, progress: Progress) -> int:
    op = it.msg[0]
    if prog is not None:
        run_rows(prog.rows, bound.src, bound.dst)
    else:
        source.copy(op, view(dst, op.dst, op))
    progress.landed(it)
    return it.nbytes


def flat(t: torch.Tensor, wire: torch.device) -> torch.Tensor | None:
    """``t``'s bytes as a flat uint8 view when a message may use them as they are."""
    if t.device != wire or not t.is_contiguous() or t.is_conj() or t.is_neg() or not t.numel():
        return None
    return t.reshape(-1).view(torch.uint8)


def packer(x: mover.Transfers, it, prog, bound, source: Source, wire: torch.device) -> Callable:
    """``part(lo, hi)`` for :meth:`Transfers.send`: the message's bytes, packed at the first call (its
    compiled rows or its batch, then the source's own packing of the pieces left)."""
    direct = source.sender(x, it.msg, wire)
    if direct is not None:
        return direct
    packed: list[torch.Tensor] = []

    def part(lo: int, hi: int) -> torch.Tensor:
        if not packed:
            buf = _buffer(x, it.nbytes, wire)
            try:
                if isinstance(prog, Batch):
                    pack_batch(prog, buf)
                elif prog is not None:
                    run_rows(prog.rows, bound.src, buffer_base(buf))
                rest = range(len(it.msg)) if prog is None else prog.slow
                if rest:
                    source.pack([it.msg[i] for i in rest], [it.starts[i] for i in rest], buf)
            except Exception as e:  # noqa: BLE001 - still sent (the receiver waits for it), and reported
                x.errors.append(f"packing a message for rank {it.msg[0].peer}: {type(e).__name__}: {e}")
            packed.append(buf)
        return packed[0][lo:hi]

    return part


def copies(msg: list[Op], views: list[torch.Tensor], starts: list[int], buf: torch.Tensor, into_buffer: bool,
           ring=None) -> None:
    """Each piece of a packed message between ``buf`` and its view: one ``memmove`` for a contiguous host
    view of the wire's dtype (most pieces are small; torch's cost per call was most of the time), a
    strided ``copy_`` (which also casts; through ``ring`` into an accelerator view) for the rest."""
    base = buf.data_ptr() if buf.device.type == "cpu" else None
    for op, v, at in zip(msg, views, starts):
        n = nbytes(op)
        ptr = mover.direct_ptr(v) if base is not None and v.dtype == DTYPES[op.dtype] else None
        if ptr is not None:
            ctypes.memmove(base + at, ptr, n) if into_buffer else ctypes.memmove(ptr, base + at, n)
        elif into_buffer:
            buf[at: at + n].view(DTYPES[op.dtype]).view(op.lengths).copy_(v)
        else:
            mover.copy_into(v, buf[at: at + n].view(DTYPES[op.dtype]).view(op.lengths), ring)


def _post_recv(x: mover.Transfers, it, prog, bound, dst: Dests, progress: Progress, wire: torch.device,
               ring=None) -> None:
    msg = it.msg
    if len(msg) == 1:
        whole = flat(view(dst, msg[0].dst, msg[0]), wire)
        if whole is not None:
            x.recv(msg[0].peer, whole, lambda: progress.landed(it))
            return
    buf = _buffer(x, it.nbytes, wire)
    rest = range(len(msg)) if prog is None else prog.slow

    def unpack() -> None:
        if isinstance(prog, Batch):
            unpack_batch(prog, buf)
        elif prog is not None:
            run_rows(prog.rows, buffer_base(buf), bound.dst)
        if rest:
            copies([msg[i] for i in rest], [view(dst, msg[i].dst, msg[i]) for i in rest],
                   [it.starts[i] for i in rest], buf, into_buffer=False, ring=ring)
        progress.landed(it)

    x.recv(msg[0].peer, buf, unpack)


def _buffer(x: mover.Transfers, n: int, wire: torch.device) -> torch.Tensor:
    """A message buffer: the mover's reused host buffers under gloo, device memory under NCCL."""
    return x.buffer(n) if wire.type == "cpu" else torch.empty(n, dtype=torch.uint8, device=wire)
