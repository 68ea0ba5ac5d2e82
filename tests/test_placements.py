"""Boxes of strided placements (FSDP2 over TP), without a world: every coordinate of a mesh at once.

The multi-process load and save of a real ``fully_shard(parallelize_module(...))`` model is in
``test_user_state_dicts.py``; here every mesh coordinate of many shapes, even and uneven, is checked
against DTensor's own computation and for an exact tiling of the tensor.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset

from pipeload.plan.placements import _StridedShard, strided_box

pytestmark = pytest.mark.skipif(_StridedShard is None, reason="torch without _StridedShard")


def _fsdp_over_tp(shape, dp, tp, dim, more=()):
    """The placements ``fully_shard`` gives a TP-sharded tensor: mesh (dp, tp, *more)."""
    return (dp, tp, *(m for m, _ in more)), (_StridedShard(dim, split_factor=tp), Shard(dim), *(p for _, p in more))


CASES = [
    ((8, 8), *_fsdp_over_tp((8, 8), 2, 2, 0)),
    ((10, 3), *_fsdp_over_tp((10, 3), 2, 2, 0)),  # uneven: 5 rows a TP shard, 3 + 2 a DP shard
    ((9,), *_fsdp_over_tp((9,), 2, 2, 0)),
    ((7, 5), *_fsdp_over_tp((7, 5), 3, 2, 0)),  # empty shards appear
    ((12, 6), *_fsdp_over_tp((12, 6), 2, 3, 1)),  # TP on dim 1 (row-parallel) sharded again by DP
    ((16, 4), (2, 2, 2), (_StridedShard(0, split_factor=2), Shard(0), Replicate())),
    ((16, 6), (2, 2), (Shard(0), Shard(1))),  # no strided placement: the same rule as Shard
]


@pytest.mark.parametrize("shape,mesh,placements", CASES)
def test_boxes_match_dtensor_and_tile_the_tensor(shape, mesh, placements):
    covered = np.zeros(shape, dtype=np.int64)
    for coord in itertools.product(*(range(m) for m in mesh)):
        lengths, offsets = strided_box(shape, mesh, list(coord), placements)
        t_len, t_off = _compute_local_shape_and_global_offset(shape, mesh, list(coord), placements)
        assert lengths == tuple(t_len), (coord, lengths, t_len)
        assert all(n == 0 or a == b for n, a, b in zip(lengths, offsets, t_off)), (coord, offsets, t_off)
        if all(lengths):
            covered[tuple(slice(o, o + n) for o, n in zip(offsets, lengths))] += 1
    replicas = int(np.prod([m for m, p in zip(mesh, placements) if isinstance(p, Replicate)]))
    assert (covered == replicas).all(), covered  # each element held by exactly the replicas, no more


def test_interleaved_rows_are_refused_by_name():
    # Shard then a strided split of the same dim: coordinate (0, 0) holds rows 0, 2 of 8 (DTensor's own
    # docstring example) — not one box
    with pytest.raises(ValueError, match="not one range"):
        strided_box((8,), (2, 2), [0, 0], (Shard(0), _StridedShard(0, split_factor=2)))


def test_outside_the_mesh():
    assert strided_box((8,), (2, 2), None, _fsdp_over_tp((8,), 2, 2, 0)[1]) == (None, None)
