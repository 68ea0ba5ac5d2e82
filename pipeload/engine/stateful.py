"""``Stateful`` values in a state dict, with torch.distributed.checkpoint's semantics.

A value with callable ``state_dict`` and ``load_state_dict`` (the protocol
``torch.distributed.checkpoint.stateful.Stateful`` checks: a model, an optimizer, a trainer's wrapper of
both, a data loader) stands for the state dict it returns. At any depth of the dict:

- :func:`expand` (before a load or a save) calls ``state_dict()`` once per such value and returns the
  state dict to load into or save: the caller's containers where no Stateful lies below them, shallow
  copies of those on a path to one (the caller's dict is never changed by this step);
- :func:`finish` (after a *successful* load only) calls each value's ``load_state_dict()`` with what was
  loaded into its state dict, in the order they were met, and writes every other replaced object (a Python
  leaf the load decoded) back into the caller's container that held it.

A state dict holding no Stateful is returned as it is (the same object: a kept plan still matches it) and
costs one pass over its non-tensor values.
"""

from __future__ import annotations

from typing import Any

import torch

_LEAF_TYPES = frozenset((int, float, str, bytes, bool, type(None), tuple, complex))


def is_stateful(v: Any) -> bool:
    """Whether ``v`` is a ``Stateful`` (an instance with callable ``state_dict`` and ``load_state_dict``)."""
    if type(v) in _LEAF_TYPES or isinstance(v, (torch.Tensor, type)):
        return False
    return callable(getattr(v, "state_dict", None)) and callable(getattr(v, "load_state_dict", None))


class Expanded:
    """What :func:`expand` did: each Stateful with its state dict, each copied container with its original."""

    __slots__ = ("found", "copies")

    def __init__(self):
        self.found: list[tuple[Any, Any]] = []  # (stateful, the state dict it gave), in walk order
        self.copies: list[tuple[Any, Any]] = []  # (caller's container, its shallow copy)


def expand(state_dict: Any) -> tuple[Any, Expanded | None]:
    """(the state dict to load into or save, what to finish with, or None when it holds no Stateful)."""
    if not isinstance(state_dict, (dict, list)):
        return state_dict, None  # (flatten names what is wrong with it)
    done = Expanded()
    out = _expand(state_dict, done, set())
    return (state_dict, None) if out is state_dict else (out, done)


def _expand(node: Any, done: Expanded, path: set[int]) -> Any:
    """``node``, or its shallow copy with every Stateful below it replaced by its ``state_dict()``."""
    if id(node) in path:  # a container inside itself: left to flatten to report
        return node
    path.add(id(node))
    copy = None
    for k, v in (node.items() if isinstance(node, dict) else enumerate(node)):
        if isinstance(v, torch.Tensor) or type(v) in _LEAF_TYPES:
            continue
        if isinstance(v, (dict, list)):
            new = _expand(v, done, path)
            if new is v:
                continue
        elif is_stateful(v):
            new = v.state_dict()
            done.found.append((v, new))
        else:
            continue
        if copy is None:
            copy = node.copy()
            done.copies.append((node, copy))
        copy[k] = new
    path.discard(id(node))
    return node if copy is None else copy


def finish(done: Expanded | None) -> None:
    """After a successful load: ``load_state_dict()`` of each Stateful, then the loaded Python objects
    written back into the caller's containers (invariant: never called after a failed load)."""
    if done is None:
        return
    for obj, sd in done.found:
        obj.load_state_dict(sd)
    copied = {id(c) for _, c in done.copies}
    for orig, copy in done.copies:
        for k, v in (copy.items() if isinstance(copy, dict) else enumerate(copy)):
            o = orig[k]
            if v is o or id(v) in copied or is_stateful(o):
                continue
            orig[k] = v  # a leaf the load replaced in the copy
