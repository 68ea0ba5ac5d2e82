"""A live transfer's two sides as boxes: what this rank holds (``src``) and what it fills (``dst``).

A source is a trainer's state dict (nested dicts and lists, as :func:`pipeload.plan.statedict.flatten`
walks it): each tensor leaf is the box of its global tensor this rank holds — a plain tensor the whole
of it, a DTensor the box its mesh and placements say (any mesh: FSDP2, TP, FSDP2 over TP, HSDP), named
by its dotted key. Non-tensor leaves are not weights and are skipped.

A destination is the same kind of state dict, or any nesting of dicts and lists, or a flat list, whose
leaves are tensors, DTensors (named by their keys) or :class:`pipeload.Slice` (named by themselves: one
name may appear many times). Every destination is a *view* written in place; the bytes outside it (a
padded vocabulary's tail, the other thirds of a fused ``qkv_proj``) are never touched.

:func:`digest` is the layout both sides' plan depends on: names, dtypes, global shapes, boxes and the
cast flag, in order — equal digests mean the kept plan's indices still name the same boxes.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Any, NamedTuple

import numpy as np
import torch

from ..errors import StateDictError
from ..move.plan import F_CAST, Box, records as plan_records
from ..move.run import CODES as _CODES, DTYPES  # noqa: F401 - (DTYPES: the codes boxes carry, shared with the tier)
from ..plan.exchange import hash64
from ..plan.statedict import flatten, tensor_box
from ..slices import Slice


class Side(NamedTuple):
    """One side of this rank: the plan's boxes, their tensors (views), and their names."""

    boxes: list[Box]
    views: list[torch.Tensor]
    names: list[str]


def _code(dtype: torch.dtype, name: str) -> int:
    try:
        return _CODES[dtype]
    except KeyError:
        raise StateDictError(f"{name!r}: dtype {dtype} cannot travel in a transfer") from None


def sources(src: Any) -> Side:
    """This rank's source boxes (an empty side for ``None``: an engine-only rank)."""
    out = Side([], [], [])
    if src is None:
        return out
    if not isinstance(src, dict):
        raise TypeError(f"src must be a state dict (a dict), got {type(src).__qualname__}")
    cache: dict = {}
    for fqn, leaf in flatten(src).items():
        if not isinstance(leaf.value, torch.Tensor):
            continue
        try:
            b = tensor_box(fqn, leaf.value, cache)
        except ValueError as e:
            raise StateDictError(f"source {fqn!r}: {e}") from None
        if b.local is None or (b.local.numel() == 0 and b.numel):
            continue
        _add(out, fqn, b.local, b.global_shape, b.offsets, b.lengths, 0)
    return out


def destinations(dst: Any, cast: bool) -> Side:
    """This rank's destination boxes (an empty side for ``None``: a trainer-only rank)."""
    out = Side([], [], [])
    if dst is None:
        return out
    flags = F_CAST if cast else 0
    cache: dict = {}
    for key, value in _leaves(dst):
        if isinstance(value, Slice):
            _add(out, value.name, value.view, value.shape, value.offsets, value.lengths, flags)
        elif isinstance(value, torch.Tensor):
            try:
                b = tensor_box(key, value, cache)
            except ValueError as e:
                raise StateDictError(f"destination {key!r}: {e}") from None
            if b.local is not None and b.numel:
                _add(out, key, b.local, b.global_shape, b.offsets, b.lengths, flags)
        else:
            raise StateDictError(f"destination {key!r} is a {type(value).__qualname__}, not a tensor or a Slice")
    return out


def _leaves(dst: Any):
    if isinstance(dst, dict):
        for fqn, leaf in flatten(dst).items():
            yield fqn, leaf.value
        return
    if isinstance(dst, Slice):
        yield dst.name, dst
        return
    try:
        items = list(dst)
    except TypeError:
        raise TypeError(f"dst must be a dict, a list of Slices or tensors, got {type(dst).__qualname__}") from None
    for i, value in enumerate(items):
        if isinstance(value, (dict, list, tuple)) and not isinstance(value, Slice):
            for k, v in _leaves(value):
                yield f"{i}.{k}", v
        else:
            yield str(i), value


@lru_cache(maxsize=1 << 18)
def _name(name: str) -> int:
    """A name's word in the plan (names repeat at every step: hashed once)."""
    return hash64(name.encode())


def _add(side: Side, name: str, view: torch.Tensor, shape, offsets, lengths, flags: int) -> None:
    """(``shape``, ``offsets``, ``lengths``: tuples of ints already, as boxes and Slices hold them)"""
    side.boxes.append(Box(_name(name), _code(view.dtype, name), tuple(shape), tuple(offsets), tuple(lengths), flags))
    side.views.append(view)
    side.names.append(name)


def digest(src: Side, dst: Side, records: np.ndarray | None = None) -> int:
    """The layout of both sides, in order (see the module docstring): a hash of their plan records
    (:func:`pipeload.move.plan.records` at their widest tensor rank: every box's name, dtype, shape,
    offsets, lengths and flags), given or made here; never 0 (0 means "no plan")."""
    if records is None:
        records = plan_records(src.boxes, dst.boxes, max(ndim(src), ndim(dst)))
    return hash64(np.ascontiguousarray(records).tobytes()) or 1


def ndim(side: Side) -> int:
    return max((len(b.shape) for b in side.boxes), default=0)
