"""A destination that names its own region: ``Slice(view, name, offsets, shape)``.

A state dict names each destination by its key and takes its region from the tensor (a plain tensor
is the whole global tensor; a DTensor's placements say which box it holds). An inference engine's
parameters do not look like that: one fused ``qkv_proj`` holds three checkpoint tensors, one ``w13``
holds two per expert, a padded vocabulary shard holds rows of ``embed_tokens`` and a tail of padding.
A :class:`Slice` says it directly: *this view holds the box at ``offsets`` of the global tensor
``name`` of ``shape``*; the box's lengths are the view's shape. Several slices may name one tensor (a
replicated KV head lands in two engine ranks, or twice in one), and a view need not be contiguous (a
third of a fused parameter along dimension 0 of a row-major tensor is; a column block is not), so
filling one writes through the view, never around it.

The invariant every consumer relies on: a slice's box lies inside ``shape``, has the view's rank, and
is not empty unless the view is. :func:`Slice.__post_init__` checks it, naming the slice.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .errors import StateDictError


@dataclass(frozen=True, eq=False)
class Slice:
    """``view`` holds the box ``offsets .. offsets + view.shape`` of the global tensor ``name`` of
    ``shape``. Compared by identity (two slices of one name are two destinations)."""

    view: torch.Tensor
    name: str
    offsets: tuple[int, ...]
    shape: tuple[int, ...]

    def __post_init__(self) -> None:
        if not isinstance(self.view, torch.Tensor):
            raise StateDictError(f"Slice {self.name!r}: view is a {type(self.view).__name__}, not a tensor")
        offsets = tuple(int(o) for o in self.offsets)
        shape = tuple(int(s) for s in self.shape)
        object.__setattr__(self, "offsets", offsets)
        object.__setattr__(self, "shape", shape)
        lengths = tuple(self.view.shape)
        if not (len(offsets) == len(shape) == len(lengths)):
            raise StateDictError(f"Slice {self.name!r}: offsets {offsets}, shape {shape} and the view's "
                                 f"shape {lengths} have different ranks")
        for d, (o, n, s) in enumerate(zip(offsets, lengths, shape)):
            if o < 0 or o + n > s:
                raise StateDictError(f"Slice {self.name!r}: dimension {d} spans {o}..{o + n}, outside the "
                                     f"global shape {shape}")

    @property
    def lengths(self) -> tuple[int, ...]:
        return tuple(self.view.shape)

    @property
    def numel(self) -> int:
        return self.view.numel()

    @property
    def label(self) -> str:
        """How messages name it: its tensor and where its box starts (several slices may share a name)."""
        return f"Slice {self.name!r} at offsets {self.offsets}"

    def __repr__(self) -> str:
        return (f"Slice({self.name!r}, offsets={self.offsets}, lengths={self.lengths}, shape={self.shape}, "
                f"{str(self.view.dtype).removeprefix('torch.')}, {self.view.device})")
