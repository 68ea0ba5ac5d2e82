"""Test layouts: one set of global tensors, laid out on ranks in many ways (and what the ranks of a
test world share: :func:`expect_error`).

Every value is a function of (fqn, global index) only, so a checkpoint saved in one layout can be
loaded into any other and checked element by element.
"""

from __future__ import annotations

import random
import zlib

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.placement_types import _StridedShard
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

# fqn -> (global shape, dtype). Odd sizes make uneven shards; scalars and bool/int/bf16 make dtypes vary.
TENSORS: dict[str, tuple[tuple[int, ...], torch.dtype]] = {
    "model.embed.weight": ((96, 16), torch.float32),
    "model.layers.0.attn.q.weight": ((64, 48), torch.bfloat16),
    "model.layers.0.attn.o.weight": ((48, 64), torch.float32),
    "model.layers.0.norm.weight": ((64,), torch.float32),
    "model.layers.0.odd": ((7, 5), torch.float64),
    "model.layers.1.mlp.w": ((33, 20), torch.float16),
    "model.mask": ((10, 6), torch.bool),
    "model.ids": ((13,), torch.int64),
    "model.scale": ((), torch.float32),
    "optim.state.0.exp_avg": ((64, 48), torch.float32),
    "optim.state.0.step": ((), torch.float32),
}
OBJECTS = {
    "optim.param_groups.0.lr": 1e-3,
    "optim.param_groups.0.betas": (0.9, 0.95),
    "optim.param_groups.0.params": [0, 1, 2],
    "extra.epoch": 7,
    "extra.name": "run-42",
}


def global_value(fqn: str, shape, dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(zlib.crc32(fqn.encode()))
    if dtype == torch.bool:
        return torch.rand(shape, generator=g) > 0.5
    if dtype == torch.int64:
        return torch.randint(-(2**40), 2**40, shape, generator=g)
    return torch.randn(shape, generator=g, dtype=torch.float64).to(dtype)


def narrow(t, offsets, lengths):
    for d, (o, n) in enumerate(zip(offsets, lengths)):
        t = t.narrow(d, o, n)
    return t


def make_dtensor(g: torch.Tensor, mesh, placements) -> DTensor:
    lengths, offsets = compute_local_shape_and_global_offset(g.shape, mesh, placements)
    local = narrow(g, offsets, lengths).clone()
    return DTensor.from_local(local, mesh, placements, run_check=False, shape=g.shape, stride=g.stride())


def expect_error(fn, *needles) -> str:
    """The message of the :class:`pipeload.errors.PipeloadError` ``fn()`` raises on this rank, which
    must contain every needle; an ``AssertionError`` naming the rank otherwise."""
    from pipeload.errors import PipeloadError

    try:
        fn()
    except PipeloadError as e:
        msg = str(e)
        for n in needles:
            assert n in msg, f"rank {dist.get_rank()}: {n!r} not in error:\n{msg}"
        return msg
    raise AssertionError(f"rank {dist.get_rank()}: expected a PipeloadError")


def nest(flat: dict) -> dict:
    """Dotted keys -> nested dicts (numeric parts stay strings except under 'state', like optimizers)."""
    out: dict = {}
    for key, v in flat.items():
        parts = key.split(".")
        node = out
        for i, p in enumerate(parts[:-1]):
            k = int(p) if parts[i - 1 : i] == ["state"] else p
            if p == "param_groups":
                node = node.setdefault(p, [{}])
                node = node[0]
                continue
            if parts[i - 1 : i] == ["param_groups"]:
                continue
            node = node.setdefault(k, {})
        node[parts[-1]] = v
    return out


class Meshes:
    """The meshes a world of 4 (or 2) ranks tests with, created once per world (creation is collective)."""

    def __init__(self, world: int):
        self.world = world
        self.shapes = [(world,), (2, world // 2), (1, world), (world, 1)] if world >= 4 else [(world,), (1, world)]
        self.meshes = {s: init_device_mesh("cpu", s) for s in self.shapes}

    def get(self, shape):
        return self.meshes[tuple(shape)]


def placements_for(kind: str, fqn: str, shape, mesh) -> list | None:
    """None: a plain tensor on every rank. Otherwise the DTensor placements of ``kind``."""
    nd = len(shape)
    if kind == "plain":
        return None
    if kind == "tp2dp2":  # mesh (dp, tp): shard on tp, replicate on dp
        if nd == 0 or "norm" in fqn:
            return None if "norm" in fqn else [Replicate(), Replicate()]
        return [Replicate(), Shard(0 if "o.weight" not in fqn else 1)]
    if kind == "shard0":
        return [Shard(0)] if nd else [Replicate()]
    if kind == "shard1":
        return [Shard(1)] if nd >= 2 else ([Shard(0)] if nd else [Replicate()])
    raise ValueError(kind)


def mesh_for(kind: str, meshes: Meshes):
    return meshes.get((2, meshes.world // 2)) if kind == "tp2dp2" else meshes.get((meshes.world,))


def build(kind: str, meshes: Meshes, fill: bool = True, keys=None) -> dict:
    """The test state dict in layout ``kind``; zeros (and None objects) when ``fill`` is False."""
    mesh = mesh_for(kind, meshes)
    flat: dict = {}
    for fqn, (shape, dtype) in TENSORS.items():
        if keys is not None and fqn not in keys:
            continue
        g = global_value(fqn, shape, dtype) if fill else torch.zeros(shape, dtype=dtype)
        pl = placements_for(kind, fqn, shape, mesh)
        flat[fqn] = g.clone() if pl is None else make_dtensor(g, mesh, pl)
    for fqn, v in OBJECTS.items():
        if keys is None or fqn in keys:
            flat[fqn] = v if fill else None
    return nest(flat)


def random_build(rng: random.Random, meshes: Meshes, fill: bool, layout=None):
    """A random layout (mesh and per-tensor placements, FSDP2 over TP's strided ones among them); returns
    (state dict, layout) to rebuild it."""
    if layout is None:
        layout = {}
        for fqn, (shape, _) in TENSORS.items():
            if rng.random() < 0.2:
                layout[fqn] = None
                continue
            mshape = rng.choice(meshes.shapes)
            if len(mshape) == 2 and mshape[1] > 1 and shape and rng.random() < 0.25:
                d = rng.randrange(len(shape))  # FSDP2 over TP: the TP shard split again over dp
                layout[fqn] = (mshape, [f"SS{d}", f"S{d}"])
                continue
            pls = []
            for _ in mshape:
                opts = ["R"] + [f"S{d}" for d in range(len(shape))]
                pls.append(rng.choice(opts))
            layout[fqn] = (mshape, pls)
    flat: dict = {}
    for fqn, (shape, dtype) in TENSORS.items():
        g = global_value(fqn, shape, dtype) if fill else torch.zeros(shape, dtype=dtype)
        spec = layout[fqn]
        if spec is None:
            flat[fqn] = g.clone()
        else:
            mshape, pls = spec
            placements = [Replicate() if p == "R" else _StridedShard(int(p[2:]), split_factor=mshape[1])
                          if p.startswith("SS") else Shard(int(p[1:])) for p in pls]
            flat[fqn] = make_dtensor(g, meshes.get(mshape), placements)
    for fqn, v in OBJECTS.items():
        flat[fqn] = v if fill else None
    return nest(flat), layout


def flat_items(sd: dict):
    """(fqn, value) of every leaf, named the way pipeload names them."""
    from pipeload.plan.statedict import flatten

    return [(fqn, leaf.value) for fqn, leaf in flatten(sd).items()]


def check_values(sd: dict) -> None:
    """Assert every tensor/object of ``sd`` holds exactly the value of its global tensor/object."""
    for fqn, v in flat_items(sd):
        if fqn in TENSORS:
            shape, dtype = TENSORS[fqn]
            g = global_value(fqn, shape, dtype)
            if isinstance(v, DTensor):
                lengths, offsets = compute_local_shape_and_global_offset(g.shape, v.device_mesh, v.placements)
                if v.device_mesh.get_coordinate() is None:
                    continue
                want, got = narrow(g, offsets, lengths), v.to_local()
            else:
                want, got = g, v
            assert got.dtype == want.dtype and torch.equal(got, want), f"rank {dist.get_rank()}: {fqn} differs"
        else:
            assert v == OBJECTS[fqn], f"rank {dist.get_rank()}: object {fqn} is {v!r}"


def unique_bytes(keys=None) -> int:
    total = 0
    for fqn, (shape, dtype) in TENSORS.items():
        if keys is None or fqn in keys:
            n = 1
            for s in shape:
                n *= s
            total += n * dtype.itemsize
    return total
