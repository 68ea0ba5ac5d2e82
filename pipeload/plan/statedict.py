"""Flattening a trainer's state dict and resolving what box of each global tensor this rank holds.

A state dict is a nested structure of ``dict``/``list`` containers whose leaves are ``torch.Tensor``
(this rank holds the whole tensor), ``DTensor`` (this rank holds the local shard its mesh and
placements say) or plain Python objects. Leaves are named by their dotted path ("optim.state.0.step");
the path is the fqn stored in the checkpoint, so save and load flatten alike by construction.

A load destination may also be a :class:`pipeload.Slice`, a view that names its own tensor and box: its
path only places it in the state dict, its checkpoint key is its ``name`` (several leaves may name one
tensor, with different boxes or the same one), and its box is the one it states (:func:`tensor_box`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

from ..slices import Slice
from ._leafplan import box

try:  # DTensor moved out of the private namespace in torch 2.4
    from torch.distributed.tensor import DTensor
except ImportError:  # pragma: no cover - older torch
    from torch.distributed._tensor import DTensor  # type: ignore


@dataclass(slots=True)
class Leaf:
    """A leaf of the state dict and the container slot it lives in (so objects can be replaced)."""

    fqn: str
    container: Any  # the dict or list holding the value
    key: Any  # its key/index there
    value: Any


def flatten(state_dict: Any) -> dict[str, Leaf]:
    """Map every leaf's dotted path to its :class:`Leaf`; raise ``ValueError`` on ambiguous paths.

    Dicts are descended into, and so are lists that hold tensors or containers; everything else
    (tensors, tuples, numbers, strings, lists of plain values such as a param group's ``params``) is a
    leaf, stored as one object. An empty dict holds no leaves and is left as it is.
    """
    check_top(state_dict)
    out: dict[str, Leaf] = {}
    stack: list[tuple[str, Any]] = [("", state_dict)]
    while stack:
        prefix, node = stack.pop()
        items = node.items() if isinstance(node, dict) else enumerate(node)
        for k, v in items:
            fqn = f"{prefix}{k}"
            if not isinstance(v, torch.Tensor) and is_container(v):  # (tensors, most leaves, skip the call)
                stack.append((fqn + ".", v))
                continue
            if fqn in out:
                raise ValueError(f"state dict key {fqn!r} is reached by two different paths")
            out[fqn] = Leaf(fqn, node, k, v)
    return out


def check_top(state_dict: Any) -> None:
    """Raise ``TypeError`` unless ``state_dict`` is a ``dict`` or a subclass of it.

    Any subclass is a state dict like a plain dict (``nn.Module.state_dict()`` returns an
    ``OrderedDict``; ``defaultdict`` and user subclasses too) and is walked in its own iteration order.
    Other mappings are refused: a load replaces Python objects in their containers, which needs
    ``__setitem__`` on the very object the caller holds. Every entry point calls this before its first
    collective, so the message names what was passed instead of failing inside compiled code.
    """
    if not isinstance(state_dict, dict):
        raise TypeError(
            f"state_dict must be a dict (or a dict subclass such as the OrderedDict nn.Module.state_dict() "
            f"returns), got {type(state_dict).__module__}.{type(state_dict).__qualname__}"
        )


def is_container(v: Any) -> bool:
    """Whether :func:`flatten` descends into ``v``: a dict, or a list holding a tensor or a container.
    The one rule of what a leaf is (:func:`pipeload.plan.plancache.signature` walks by it too)."""
    return isinstance(v, dict) or (isinstance(v, list) and any(_is_node(x) for x in v))


def _is_node(x: Any) -> bool:
    return isinstance(x, (dict, list, torch.Tensor, Slice))


def load_target(dst: Any) -> Any:
    """What a load fills: a state dict as it is; a list or tuple of :class:`Slice` (an engine's fused
    layout) as ``{"0": slice, "1": ...}`` (the slices name their tensors, so their positions are only
    their paths). Anything else is returned for :func:`check_top` to name."""
    if isinstance(dst, (list, tuple)):
        for i, v in enumerate(dst):
            if not isinstance(v, Slice):
                raise TypeError(
                    f"state_dict must be a dict (or a dict subclass such as the OrderedDict nn.Module.state_dict() "
                    f"returns), or a list or tuple of pipeload.Slice only; got a {type(dst).__name__} whose item {i} "
                    f"is a {type(v).__module__}.{type(v).__qualname__}"
                )
        return {str(i): v for i, v in enumerate(dst)}
    return dst


def is_tensor(value: Any) -> bool:
    return isinstance(value, torch.Tensor)


class Box(NamedTuple):
    """The part of a global tensor this rank holds: ``offsets``/``lengths`` per dim of ``global_shape``.

    (A NamedTuple: one is built per tensor leaf at every load.)
    """

    global_shape: tuple[int, ...]
    offsets: tuple[int, ...]
    lengths: tuple[int, ...]
    local: torch.Tensor | None  # the tensor holding the box on this rank (None: this rank holds nothing)

    @property
    def numel(self) -> int:
        return math.prod(self.lengths)


def tensor_box(fqn: str, value: torch.Tensor | Slice, cache: dict | None = None) -> Box:
    """Resolve which box of its global tensor ``value`` holds on this rank.

    A :class:`Slice` holds the box it states (its view the local tensor). Plain tensors hold everything.
    DTensors may use any mesh with ``Shard(d)`` and ``Replicate()`` placements, several mesh dims sharding
    one tensor dim, uneven shards, and the ``_StridedShard`` of FSDP2 over TP
    (:mod:`pipeload.plan.placements`). Raises ``ValueError`` with a message naming ``fqn`` for what cannot
    be stored as a box (``Partial``, strided rows that are not one range).
    ``cache`` (one dict per call site and state dict) memoises the box per (shape, mesh, placements):
    a model repeats few of them, and computing one costs ~0.1 ms. Its values end with the mesh
    (:func:`cached_meshes`). Compiled (:func:`pipeload.plan._leafplan.box`): the local plan runs it per leaf.
    """
    return _box(Box, box(fqn, value, cache))


_box = tuple.__new__  # Box(...) without the NamedTuple's Python-level __new__


def cached_meshes(cache: dict) -> list[Any]:
    """The meshes of the DTensors :func:`tensor_box` resolved with ``cache`` (a few, however many leaves)."""
    return list({id(hit[-1]): hit[-1] for hit in cache.values()}.values())


def mesh_of(value: Any) -> Any:
    """A DTensor's mesh (its spec's: DTensor.device_mesh is a property, ~1 us a leaf), or None."""
    if isinstance(value, DTensor):
        spec = getattr(value, "_spec", None)
        return spec.mesh if spec is not None else value.device_mesh
    return None


def meshes_of(leaves: dict[str, Leaf]) -> list[Any]:
    """Every DTensor mesh in the state dict (each once)."""
    found = {}
    for leaf in leaves.values():
        mesh = mesh_of(leaf.value)
        if mesh is not None:
            found[id(mesh)] = mesh
    return list(found.values())


def mesh_groups(meshes: list[Any]) -> list[Any]:
    """Every process group of every dim of ``meshes`` (this rank's groups only)."""
    seen: dict[int, Any] = {}
    for mesh in meshes:
        if mesh.get_coordinate() is None:
            continue
        for dim in range(mesh.ndim):
            try:
                g = mesh.get_group(dim)
            except Exception:  # noqa: BLE001 - a mesh without groups simply offers none
                continue
            seen[id(g)] = g
    return list(seen.values())
