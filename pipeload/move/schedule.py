"""A rank's messages of one planned movement: cut once, and their pieces compiled into region copies.

Cutting the pieces into messages and laying them out is a function of the plan alone, so a live
transfer keeps its :class:`Schedule` with its plan and the steps after the first cut nothing. Packing
and unpacking are compiled (:mod:`pipeload.move._regions`): each piece becomes a row of integers —
which base tensor, the byte offset of its region from the tensor's address, the contiguous bytes of a
run and up to three outer dimensions — and a message's rows run in one call without the GIL.

A row is emitted only for host memory that holds its values as laid out (not a conjugate or negative
view) and whose dtype is the piece's wire dtype; any other piece (an accelerator view, a cast, a region
needing more than three outer dimensions) is copied by torch as before. Rows depend on the strides of
the tensors they address, never on their addresses: each use checks the strides of every base tensor
against those the rows were compiled from (:meth:`Schedule.bind`) and compiles again when one changed;
the addresses are read from the tensors at each use. The shapes are the plan's (its digest holds
them) and each region is checked against its box, so a row's bytes lie inside its tensor.

Messages in accelerator memory (NCCL) cannot be packed by host rows: there each message's pieces that
are contiguous in their tensors form a :class:`Batch`, one ``torch._foreach_copy_`` against the
buffer's segments, their views kept while the tensors' addresses and strides stay the same.
"""

from __future__ import annotations

from math import prod
from operator import itemgetter
from typing import NamedTuple, Sequence

import numpy as np
import torch

from . import _regions, mover
from .plan import Answers, Op

DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64, torch.int32, torch.int16,
          torch.int8, torch.uint8, torch.bool, torch.float8_e4m3fn, torch.float8_e5m2, torch.complex64,
          torch.uint16, torch.uint32, torch.uint64, torch.complex128)  # a box's dtype code -> torch dtype
CODES = {d: i for i, d in enumerate(DTYPES)}

ITEMSIZE = tuple(d.itemsize for d in DTYPES)

WIDTH = _regions.width()
OUTER = 3  # outer dimensions a row carries


class Item(NamedTuple):
    """One message (or a local copy's piece, ``sending is None``) in the global order."""

    sending: bool | None
    msg: list[Op]
    starts: list[int]  # where each piece starts in the message
    nbytes: int
    lands: tuple = (np.zeros(0, np.int64), np.zeros(0, np.int64))  # (destination indices, pieces each):
    # what the item fills (a receive, a local copy; a send fills nothing here)


class Program(NamedTuple):
    """An item's compiled copies: ``rows`` for its pieces, but those listed in ``slow`` (torch's)."""

    rows: np.ndarray
    slow: list[int]  # positions in the message copied by torch


class Bound(NamedTuple):
    """The programs valid for this use's tensors, and the addresses of their bases."""

    programs: list[Program | None]
    src: np.ndarray  # addresses of the source side's bases
    dst: np.ndarray  # addresses of the destination bases
    batches: list | None = None  # per item, its Batch (messages on an accelerator's wire)


class Batch(NamedTuple):
    """A message's pieces moved by one ``torch._foreach_copy_`` against its buffer's segments (a message
    on an accelerator): those whose region is contiguous in a tensor on the wire's device, of the wire
    dtype, kept as flat byte views of their tensors."""

    sizes: list[int]  # the buffer cut in order into gaps and pieces (``torch.split``)
    segments: list[int]  # which of those segments are the batched pieces
    views: list[torch.Tensor]  # each batched piece's region, flat bytes, in the message's order
    slow: list[int]  # positions in the message left to torch one by one


class Schedule:
    """Every message of this rank in the one global order (sends and receives merged by the key of each
    message's first piece, as both ends sort them), then the local copies."""

    def __init__(self, answers: Answers):
        self.answers = answers
        self._items: list[Item] | None = None
        self._compiled: tuple | None = None  # (signature, programs)
        self._batches: tuple | None = None  # (signature, addresses, batches): messages on an accelerator

    @property
    def items(self) -> list[Item]:
        """Made at the first use (the first step's data movement), then kept with the schedule."""
        if self._items is None:
            a = self.answers
            items = messages(a.sends, True) + messages(a.recvs, False)
            items.sort(key=lambda it: it.msg[0].key)
            local = [Item(None, [op], [0], n, ([op.dst], [1])) for op, n in zip(a.local, _sizes(a.local))]
            self._items = items + local
        return self._items

    def needs(self, n_dst: int) -> tuple[np.ndarray, set]:
        """(pieces to land per destination index, the destinations a relayed piece lands in)."""
        needs = np.zeros(n_dst, dtype=np.int64)
        for it in self.items:
            if it.sending is not True:
                needs[it.lands[0]] += it.lands[1]
        return needs, {op.dst for op in self.answers.recvs if op.hop}

    def bind(self, source_bases: Sequence | None, source_of, dst_bases: Sequence, dst_boxes: Sequence,
             wire: torch.device = torch.device("cpu")) -> Bound:
        """The compiled programs for these tensors, and for messages on an accelerator (``wire``) their
        batches. ``source_of(op)`` is (base index, box) of a piece's source region among
        ``source_bases`` (None: a source without host tensors, e.g. files: sends are packed by the source
        itself and local copies by torch). On an accelerator's wire only the local copies get rows."""
        src = list(source_bases) if source_bases is not None else []
        given = src if source_bases is not None else None
        host_wire = wire.type == "cpu"
        sig = (_signature(src), _signature(dst_bases), source_bases is None, host_wire)
        if self._compiled is None or self._compiled[0] != sig:
            self._compiled = (sig, [self._compile(it, given, source_of, dst_bases, dst_boxes, host_wire)
                                    for it in self.items])
        bound = Bound(self._compiled[1], _addresses(src), _addresses(dst_bases))
        if host_wire:
            return bound
        # (a piece's torch copy costs a Python call each, ~15 us; a step of a large model has 100,000s.
        # The views hold their tensors: made again when an address or strides change, dropped with the plan)
        addresses = (bound.src.tobytes(), bound.dst.tobytes())
        if self._batches is None or self._batches[:2] != (sig, addresses):
            self._batches = (sig, addresses, [_batch(it, given, source_of, dst_bases, dst_boxes, wire)
                                              for it in self.items])
        return bound._replace(batches=self._batches[2])

    def _compile(self, it: Item, src, source_of, dst_bases, dst_boxes, host_wire: bool) -> Program | None:
        if it.sending is not None and not host_wire:
            return None
        rows, slow = [], []
        for i, (op, at) in enumerate(zip(it.msg, it.starts)):
            row = None
            if it.sending is not False and src is not None:  # out of a source region
                si, sbox = source_of(op)
                a = _region(src[si], sbox, op)
                b = (at, _packed(op.lengths)) if it.sending else _region(dst_bases[op.dst], dst_boxes[op.dst], op)
                row = _row(si, a, 0 if it.sending else op.dst, b, op)
            elif it.sending is False:  # into a destination view
                b = _region(dst_bases[op.dst], dst_boxes[op.dst], op)
                row = _row(0, (at, _packed(op.lengths)), op.dst, b, op)
            if row is None:
                slow.append(i)
            else:
                rows.append(row)
        if not rows:
            return None
        return Program(np.array(rows, dtype=np.int64).reshape(-1, WIDTH), slow)


def _batch(it: Item, src: list | None, source_of, dst_bases, dst_boxes, wire: torch.device) -> Batch | None:
    if it.sending is None or (it.sending and src is None):
        return None  # (a local copy, or a source that packs itself)
    sizes, segments, views, slow = [], [], [], []
    end = 0
    for i, (op, at) in enumerate(zip(it.msg, it.starts)):
        if it.sending:
            si, box = source_of(op)
            base = src[si]
        else:
            base, box = dst_bases[op.dst], dst_boxes[op.dst]
        flat = _flat_region(base, box, op, wire)
        if flat is None:
            slow.append(i)
            continue
        if at > end:
            sizes.append(at - end)
        segments.append(len(sizes))
        sizes.append(flat.numel())
        views.append(flat)
        end = at + flat.numel()
    if not views:
        return None
    if it.nbytes > end:
        sizes.append(it.nbytes - end)
    return Batch(sizes, segments, views, slow)


def _flat_region(base: torch.Tensor | None, box, op: Op, wire: torch.device) -> torch.Tensor | None:
    """``op``'s region of ``base`` as flat bytes, when it is contiguous in a tensor on ``wire`` of the
    piece's dtype (else None: torch copies it alone)."""
    if base is None or base.device != wire or base.is_conj() or base.is_neg() or base.dtype != DTYPES[op.dtype]:
        return None
    if not _fits(base, box, op):
        return None
    st = base.stride()
    at = base.storage_offset() + sum((o - b) * s for o, b, s in zip(op.offsets, box.offsets, st))
    v = base.as_strided(op.lengths, st, at)
    return v.reshape(-1).view(torch.uint8) if v.is_contiguous() and v.numel() else None


def pack_batch(batch: Batch, buf: torch.Tensor) -> None:
    """Copy a batch's pieces into the message buffer ``buf`` (one ``_foreach_copy_``)."""
    torch._foreach_copy_(_segments(batch, buf), batch.views)


def unpack_batch(batch: Batch, buf: torch.Tensor) -> None:
    """Copy a batch's pieces out of the message buffer ``buf`` into their tensors."""
    torch._foreach_copy_(batch.views, _segments(batch, buf))


def _segments(batch: Batch, buf: torch.Tensor) -> list[torch.Tensor]:
    segs = torch.split(buf, batch.sizes)
    return [segs[batch.segments[0]]] if len(batch.segments) == 1 else list(itemgetter(*batch.segments)(segs))


def nbytes(op: Op) -> int:
    return ITEMSIZE[op.dtype] * prod(op.lengths)


def _sizes(ops: list[Op]) -> list[int]:
    return [ITEMSIZE[op.dtype] * prod(op.lengths) for op in ops]


ALIGN = 16  # each piece of a packed message starts at a multiple of this (any dtype's alignment)


def layout(msg: list[Op]) -> tuple[list[int], int]:
    """(where each piece of a message starts, the message's bytes): alike on both ends. A piece starts at
    the previous one's start plus its bytes rounded up to :data:`ALIGN`."""
    at, starts, n = 0, [], 0
    for n in _sizes(msg):
        starts.append(at)
        at += n + (-n % ALIGN)
    return starts, (starts[-1] + n if starts else 0)


def messages(ops: list[Op], sending: bool) -> list[Item]:
    """``ops`` (one direction, sorted by key) cut into messages per (hop, peer), as both ends cut them:
    a piece of at least :data:`pipeload.move.mover.SMALL` bytes alone (sent in parts of
    :data:`~pipeload.move.mover.PIECE` bytes); between those, the smaller ones packed in their order,
    a new message wherever their packed offset crosses a multiple of ``PIECE - SMALL`` (so a message
    holds at most ``PIECE`` bytes). In numpy: at a transfer's first step this is every piece of the plan."""
    if not ops:
        return []
    n = len(ops)
    size = np.fromiter((ITEMSIZE[op.dtype] * prod(op.lengths) for op in ops), np.int64, n)
    group = np.fromiter(((op.hop << 32) | op.peer for op in ops), np.int64, n)
    order = np.argsort(group, kind="stable")
    group, size = group[order], size[order]
    big = size >= mover.SMALL
    cut = np.ones(n, dtype=bool)  # where a run of packed pieces starts
    cut[1:] = (group[1:] != group[:-1]) | big[1:] | big[:-1]
    padded = size + (-size % ALIGN)
    at = np.cumsum(padded) - padded  # (each piece's start in one long run)
    run = np.cumsum(cut) - 1
    rel = at - at[np.flatnonzero(cut)][run]  # its start in its run
    part = rel // (mover.PIECE - mover.SMALL)
    first = cut.copy()
    first[1:] |= part[1:] != part[:-1]
    heads = np.flatnonzero(first)
    starts = at - at[heads][np.cumsum(first) - 1]
    ends = np.append(heads[1:], n)
    total = starts[ends - 1] + size[ends - 1]
    lands = [Item._field_defaults["lands"]] * len(heads)
    if not sending:  # (what each message fills: destination indices and pieces each)
        dst = np.fromiter((op.dst for op in ops), np.int64, n)[order]
        lands = [np.unique(dst[a:b], return_counts=True) for a, b in zip(heads.tolist(), ends.tolist())]
    order, starts, take = order.tolist(), starts.tolist(), ops.__getitem__
    return [Item(sending, list(map(take, order[a:b])), starts[a:b], t, d)
            for a, b, t, d in zip(heads.tolist(), ends.tolist(), total.tolist(), lands)]


def run_rows(rows: np.ndarray, src: np.ndarray, dst: np.ndarray) -> None:
    """Copy a program's rows between the bases at ``src`` and ``dst`` (arrays of addresses)."""
    _regions.copy_rows(rows, src, dst)


def buffer_base(buf: torch.Tensor) -> np.ndarray:
    return np.array([buf.data_ptr()], dtype=np.uintp)


def _signature(bases: Sequence) -> tuple:
    """What rows depend on: each base's strides and dtype, and whether it is host memory as laid out
    (only a complex tensor is a conjugate or negative view)."""
    return tuple(None if v is None else (v.stride(), v.dtype, v.is_cpu) if not v.is_complex() else
                 (v.stride(), v.dtype, v.is_cpu and not v.is_conj() and not v.is_neg()) for v in bases)


def _addresses(bases: Sequence) -> np.ndarray:
    out = np.zeros(max(len(bases), 1), dtype=np.uintp)
    for i, v in enumerate(bases):
        if v is not None:
            out[i] = v.data_ptr()
    return out


def _packed(lengths) -> tuple[int, ...]:
    """Element strides of a region packed contiguously in a message."""
    out, n = [], 1
    for x in reversed(lengths):
        out.append(n)
        n *= x
    return tuple(reversed(out))


def _region(base: torch.Tensor | None, box, op: Op) -> tuple[int, tuple] | None:
    """(byte offset of ``op``'s region from ``base``'s address, element strides), or None when the
    base cannot take part in a row (not host memory as laid out, or not of the piece's dtype)."""
    if base is None or not base.is_cpu or base.is_conj() or base.is_neg() or base.dtype != DTYPES[op.dtype]:
        return None
    if not _fits(base, box, op):
        return None  # (never a row outside its tensor: torch's view of it raises by name instead)
    st = base.stride()
    if any(x == 0 and n > 1 for x, n in zip(st, base.shape)):
        return None  # (an expanded tensor: torch refuses to write one, by name; a row would write it)
    at = sum((o - b) * s for o, b, s in zip(op.offsets, box.offsets, st))
    return at * base.element_size(), st


def _fits(base: torch.Tensor, box, op: Op) -> bool:
    """Whether ``base`` has its box's shape and ``op``'s region lies inside the box."""
    return tuple(base.shape) == tuple(box.lengths) and all(
        b <= o and o + n <= b + m for o, n, b, m in zip(op.offsets, op.lengths, box.offsets, box.lengths))


def _row(si: int, a, di: int, b, op: Op) -> list[int] | None:
    """A row copying ``op``'s region from ``a`` to ``b`` ((byte offset, element strides) each), or
    None: a side not eligible, or a region that is not contiguous runs under three outer dimensions."""
    if a is None or b is None:
        return None
    isz = DTYPES[op.dtype].itemsize
    dims = [(n, sa * isz, sb * isz) for n, sa, sb in zip(op.lengths, a[1], b[1]) if n != 1]
    if any(n == 0 for n, _, _ in dims):
        return None
    merged: list[list[int]] = []  # innermost first: [count, source stride, destination stride]
    for n, sa, sb in reversed(dims):
        if merged and sa == merged[-1][1] * merged[-1][0] and sb == merged[-1][2] * merged[-1][0]:
            merged[-1][0] *= n
        else:
            merged.append([n, sa, sb])
    inner = isz
    if merged:
        if merged[0][1] != isz or merged[0][2] != isz:
            return None  # (runs of one element: torch copies those)
        inner = merged[0][0] * isz
        merged = merged[1:]
    if len(merged) > OUTER:
        return None
    merged += [[1, 0, 0]] * (OUTER - len(merged))
    return [si, a[0], di, b[0], inner] + [x for m in merged for x in m]
