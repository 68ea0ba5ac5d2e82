"""The box of a DTensor whose placements include ``_StridedShard``: FSDP2 over tensor parallelism.

``fully_shard`` applied to a module that ``parallelize_module`` already split shards a tensor dim the TP
placement shards too: each TP shard is split again over the data-parallel mesh dim (right to left).
DTensor writes this as ``_StridedShard(dim, split_factor=<shards made before it>)`` on the data-parallel
dim followed by ``Shard(dim)`` on the TP dim — the layout of every torchtitan, Lightning or Accelerate
job that combines FSDP2 with TP. Read left to right, the placements say which rows of each tensor dim a
mesh coordinate holds:

- ``Shard(d)`` on a mesh dim of size ``m``: the coordinate's ceil-sized chunk of the rows so far;
- ``_StridedShard(d, split_factor=s)``: the rows so far cut into ``s`` ceil-sized parts, and from each
  part the coordinate's ceil-sized chunk of ``m``, in order.

pipeload stores and reads boxes, so the rows a rank holds along each dim must be one ascending range
(row ``k`` of its local tensor is global row ``first + k``). FSDP2 over TP always gives that, even and
uneven; placements that leave a rank interleaved rows are refused by name (the tensor is still loadable
after a ``redistribute`` to plain ``Shard``). The box found here must agree with DTensor's own
``compute_local_shape_and_global_offset`` (the box torch DCP records): if a torch release changed the
meaning of the placement, the load is refused rather than filled from the wrong rows.
"""

from __future__ import annotations

from typing import Any

import numpy as np

try:
    from torch.distributed.tensor.placement_types import _StridedShard
except ImportError:  # pragma: no cover - torch before 2.5 has no strided placement
    _StridedShard = None


def is_strided(placement: Any) -> bool:
    return _StridedShard is not None and type(placement) is _StridedShard


def _chunk(rows: np.ndarray, parts: int, i: int) -> np.ndarray:
    """Part ``i`` of ``rows`` cut into ``parts`` ceil-sized chunks (``torch.chunk``, DTensor's ``Shard``)."""
    size = -(-len(rows) // parts)
    lo = min(i * size, len(rows))
    return rows[lo : min(lo + size, len(rows))]


def _rows(shape: tuple[int, ...], mesh_shape: tuple[int, ...], coord: list[int], placements) -> dict[int, np.ndarray]:
    """Per sharded tensor dim, the global rows (ascending or not) the coordinate holds, in local order."""
    rows: dict[int, np.ndarray] = {}
    for mdim, p in enumerate(placements):
        if p.is_replicate() or p.is_partial():
            continue
        d, m, c = p.dim, mesh_shape[mdim], coord[mdim]
        cur = rows.get(d)
        if cur is None:
            cur = np.arange(shape[d], dtype=np.int64)
        if is_strided(p):
            s = int(p.split_factor)
            cur = np.concatenate([_chunk(_chunk(cur, s, j), m, c) for j in range(s)])
        else:
            cur = _chunk(cur, m, c)
        rows[d] = cur
    return rows


def strided_box(shape: tuple[int, ...], mesh_shape: tuple[int, ...], coord: list[int] | None,
                placements) -> tuple[tuple[int, ...] | None, tuple[int, ...] | None]:
    """(lengths, offsets) of the box coordinate ``coord`` holds, or (None, None) outside the mesh.

    Raises ``ValueError`` when the rows of some dim are not one ascending range. An empty dim's offset is
    the dim's size, as DTensor gives it."""
    if coord is None:
        return None, None
    lengths, offsets = list(shape), [0] * len(shape)
    for d, r in _rows(shape, mesh_shape, coord, placements).items():
        if len(r) and np.any(r != r[0] + np.arange(len(r))):
            raise ValueError(f"placements {list(placements)} give this rank rows of dim {d} that are not one "
                             f"range ({_sample(r)}): redistribute to Shard/Replicate placements before saving "
                             f"or loading")
        lengths[d], offsets[d] = len(r), int(r[0]) if len(r) else shape[d]
    return tuple(lengths), tuple(offsets)


def _sample(r: np.ndarray) -> str:
    head = ", ".join(str(int(x)) for x in r[:6])
    return f"rows {head}{', ...' if len(r) > 6 else ''}"


def mesh_box(shape: tuple[int, ...], mesh, placements) -> tuple[tuple[int, ...] | None, tuple[int, ...] | None]:
    """:func:`strided_box` on a real mesh, checked against DTensor's own box (module docstring)."""
    coord = mesh.get_coordinate()
    lengths, offsets = strided_box(shape, tuple(mesh.shape), coord, placements)
    if lengths is None:
        return None, None
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    t_len, t_off = compute_local_shape_and_global_offset(shape, mesh, placements)
    t_len, t_off = tuple(int(x) for x in t_len), tuple(int(x) for x in t_off)
    if t_len != lengths or any(n and a != b for n, a, b in zip(lengths, offsets, t_off)):
        raise ValueError(f"placements {list(placements)}: DTensor gives this rank the box at {list(t_off)} of "
                         f"{list(t_len)}, pipeload's reading of the placements {list(offsets)} of {list(lengths)}; "
                         f"not loaded (redistribute to Shard/Replicate placements)")
    return lengths, offsets
