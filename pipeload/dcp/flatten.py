"""DCP's ``flatten_state_dict``, the same keys, values and mappings, at a fraction of its cost per key.

``dcp.async_save`` under the switch blocks the training loop for its door's work; DCP's own traversal
(``_traverse.traverse_state_dict``) spends ~5 us a key in abstract-class checks and path joins, 16 ms
for a 3,000-key trainer state on this project's machines, as much as the snapshot copy itself. This
walk takes the values of the common exact types (tensors, numbers, strings, None) without any
``isinstance`` against an ABC and builds each key from its parent's, and follows DCP's rules for
everything else, in the same order:

- a ``Mapping`` is walked, its keys ``str()``-ed;
- a ``list`` is walked by index only when something inside it is a tensor or a ``Mapping`` (at any
  depth of nested lists); otherwise it is one value, as is every tuple and every other object;
- two paths that join to the same key raise DCP's ``ValueError``.

Under DCP's 2.3 compatibility mode (``_version._derived_version == "2_3"``, set by a load of an old
checkpoint) DCP's own function runs: that traversal differs and is rare.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch.distributed.checkpoint import _version
from torch.distributed.checkpoint._nested_dict import flatten_state_dict as _dcp_flatten
from torch.distributed.tensor import DTensor

_VALUES = frozenset({torch.Tensor, torch.nn.Parameter, DTensor, int, float, bool, str, bytes, type(None), tuple})
_TENSORS = frozenset({torch.Tensor, torch.nn.Parameter, DTensor})


def flatten_state_dict(state_dict) -> tuple[dict, dict]:
    """``(flat, mappings)`` exactly as ``torch.distributed.checkpoint._nested_dict.flatten_state_dict``."""
    if _version._derived_version == "2_3":
        return _dcp_flatten(state_dict)
    flat: dict = {}
    mappings: dict = {}

    def visit(path: tuple, fqn: str, value) -> None:
        if type(value) not in _VALUES:
            if isinstance(value, Mapping):
                for k, v in value.items():
                    key = str(k)
                    visit(path + (key,), f"{fqn}.{key}", v)
                return
            if isinstance(value, list) and _walked(value):
                for i, v in enumerate(value):
                    visit(path + (i,), f"{fqn}.{i}", v)
                return
        if fqn in flat:
            raise ValueError(f"duplicated flatten key {fqn}")
        flat[fqn] = value
        mappings[fqn] = path

    for key, value in state_dict.items():
        key = str(key)
        visit((key,), key, value)
    return flat, mappings


def _walked(values: list) -> bool:
    """Whether DCP walks into this list: a tensor or a mapping in it, or in a list in it (recursively)."""
    for v in values:
        t = type(v)
        if t in _TENSORS:
            return True
        if t in _VALUES:
            continue
        if isinstance(v, Mapping) or isinstance(v, torch.Tensor) or (isinstance(v, list) and _walked(v)):
            return True
    return False
