"""Boxes of global tensors: their intersection and the local view of a global region.

A box is ``(offsets, lengths)`` per dim of a global tensor. A holder's box and a needer's box meet in
at most one box; a rank holding box ``b`` of a tensor keeps the region ``(o, n)`` of it at local
offsets ``o - b.offsets``. The memory tier's restore (stored chunks against destination boxes) and the
live transfer (source boxes against destination boxes) both cut their pieces with these.
"""

from __future__ import annotations

import torch

from ..io.reader import narrow


def intersect(a_off, a_len, b_off, b_len) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
    """The common box of two boxes, or None when it is empty (two 0-d boxes meet in the 0-d box)."""
    lo = tuple(max(x, y) for x, y in zip(a_off, b_off))
    hi = tuple(min(x + m, y + n) for x, m, y, n in zip(a_off, a_len, b_off, b_len))
    if any(h <= low for low, h in zip(lo, hi)) and (lo or hi):
        return None
    return lo, tuple(h - low for low, h in zip(lo, hi))


def region_of(box, offsets, lengths) -> tuple[tuple, tuple]:
    """(offsets within the local tensor, lengths) of a global region inside ``box`` (its ``offsets``)."""
    return tuple(o - b for o, b in zip(offsets, box.offsets)), tuple(lengths)


def dest_region(box, offsets, lengths) -> torch.Tensor:
    """The view of ``box.local`` that holds the global region ``(offsets, lengths)``."""
    return narrow(box.local, *region_of(box, offsets, lengths))
