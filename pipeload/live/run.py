"""A planned transfer's data movement on one rank, with live tensors as the source.

The messages, their order, packing and receiving are :mod:`pipeload.move.run`'s (shared with the
memory tier's restore); this module is the source side only: a sender packs each message from views
of its source tensors, casting to the destination's dtype there (what travels is what lands: a bf16
engine receives bf16 bytes from fp32 master weights); a lone contiguous piece of the right dtype is
sent from the tensor itself; a relay's piece is read from its own destination view (what it received
in an earlier hop); a colocated rank's local pieces are copies from its own source views.
"""

from __future__ import annotations

from typing import Callable

import torch

from ..move import mover
from ..move.plan import Op
from ..move.schedule import Schedule
from ..move.run import DTYPES, Progress, copies, flat, run as move_run, view
from .sides import Side

__all__ = ["Progress", "run", "LiveSource"]


class LiveSource:
    """A rank's source tensors (and, for relays, its destination views) as :class:`pipeload.move.run.Source`."""

    def __init__(self, src: Side, dst: Side):
        self.src, self.dst = src, dst

    def _views(self, msg: list[Op]) -> list[torch.Tensor]:
        return [view(self.src, op.src, op) if op.src >= 0 else view(self.dst, -1 - op.src, op) for op in msg]

    def bases(self) -> list[torch.Tensor]:
        return self.src.views + self.dst.views  # (a relay's piece is a region of its own destination)

    def base_of(self, op: Op) -> tuple[int, object]:
        if op.src >= 0:
            return op.src, self.src.boxes[op.src]
        return len(self.src.views) - 1 - op.src, self.dst.boxes[-1 - op.src]

    def sender(self, x: mover.Transfers, msg: list[Op], wire: torch.device) -> Callable | None:
        if len(msg) != 1:
            return None
        v = self._views(msg)[0]
        whole = flat(v, wire) if v.dtype == DTYPES[msg[0].dtype] else None
        return None if whole is None else (lambda lo, hi: whole[lo:hi])

    def pack(self, msg: list[Op], starts: list[int], buf: torch.Tensor) -> None:
        copies(msg, self._views(msg), starts, buf, into_buffer=True)

    def copy(self, op: Op, out: torch.Tensor) -> None:
        out.copy_(view(self.src, op.src, op))


def run(x: mover.Transfers, sched: Schedule, src: Side, dst: Side, progress: Progress, wire: torch.device) -> int:
    """Every message of this rank in the global order, then its local copies (:func:`pipeload.move.run.run`)."""
    return move_run(x, sched, LiveSource(src, dst), dst, progress, wire)
