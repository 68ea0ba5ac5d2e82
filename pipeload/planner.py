"""Load planning: pure functions, no I/O, no torch.distributed.

Call order (every rank of the load's group)::

    local = local_plan(leaves, metadata, broadcastable)    # each rank alone
    payload = encode_plan(local, index)                     # compact bytes for the one all-gather
    ...all-gather payloads...
    plan = global_plan([decode_plan(p) for p in payloads], sizes, ...)   # identical on every rank

``global_plan`` is the only place where ranks must agree without talking: every rank evaluates it on the
same gathered data and must get the same answer whatever the order of items inside any rank's plan;
otherwise two ranks would each wait for the other's broadcast forever.
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Callable, NamedTuple, Sequence

import numpy as np
import torch

from . import balance
from .metadata import ChunkMeta, Metadata, ObjectMeta, dtype_name
from .statedict import Leaf, is_tensor, tensor_box

# A destination shard's identity: (fqn index in the checkpoint, global offsets, lengths).
ShardKey = tuple[int, tuple[int, ...], tuple[int, ...]]
STAGING_ALIGN = 64  # byte alignment of each shard inside a staging buffer (any dtype can view it)


class ReadItem(NamedTuple):
    """One box copy: a region of a stored chunk -> the same-sized region of a destination shard."""

    file: str  # data file (relative name)
    key: str  # safetensors tensor name of the stored chunk
    checksum: str  # of the whole stored chunk
    chunk_lengths: tuple[int, ...]  # shape of the stored chunk
    src_offsets: tuple[int, ...]  # where the box starts inside the stored chunk
    dest_offsets: tuple[int, ...]  # where it starts inside the destination shard
    lengths: tuple[int, ...]  # extent of the box
    nbytes: int


@dataclass(slots=True)
class DestShard:
    """What this rank needs of one tensor: a box of the global tensor, and where it goes."""

    fqn: str
    key: ShardKey
    dtype: torch.dtype
    nbytes: int
    reads: list[ReadItem]
    dest: torch.Tensor  # this rank's tensor holding the box (copied into in place)
    broadcastable: bool


@dataclass
class ObjectRead:
    fqn: str
    index: int
    leaf: Leaf
    meta: ObjectMeta


@dataclass
class LocalPlan:
    shards: list[DestShard] = field(default_factory=list)
    objects: list[ObjectRead] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)  # validation failures (raise before any write)
    missing: list[str] = field(default_factory=list)  # state dict keys absent from the checkpoint


def fqn_index(md: Metadata) -> dict[str, int]:
    """Position of every checkpoint key in sorted order: the compact name used in the exchange."""
    return {fqn: i for i, fqn in enumerate(sorted([*md.tensors, *md.objects]))}


def _intersect(chunk: ChunkMeta, offsets, lengths) -> tuple | None:
    """(offsets in the chunk, offsets in the destination, lengths) of their overlap, or None."""
    if chunk.offsets == offsets and chunk.lengths == lengths:  # same layout as saved: the usual case
        zero = (0,) * len(offsets)
        return zero, zero, lengths
    lo = [max(a, b) for a, b in zip(chunk.offsets, offsets)]
    hi = [min(a + n, b + m) for a, n, b, m in zip(chunk.offsets, chunk.lengths, offsets, lengths)]
    if any(h <= l for l, h in zip(lo, hi)):
        return None
    return (
        tuple(l - c for l, c in zip(lo, chunk.offsets)),
        tuple(l - o for l, o in zip(lo, offsets)),
        tuple(h - l for l, h in zip(lo, hi)),
    )


def local_plan(
    leaves: dict[str, Leaf],
    md: Metadata,
    broadcastable: Callable[[torch.Tensor], bool],
    *,
    strict: bool = True,
) -> LocalPlan:
    """Resolve this rank's destination shards into ReadItems and validate them against ``md``.

    Nothing is read or written: every dtype/shape/key problem is collected in ``problems`` so the
    load can refuse before touching any destination.
    """
    index = fqn_index(md)
    plan = LocalPlan()
    boxes: dict = {}  # meshes stay alive through this call, so their ids are stable keys
    for fqn in sorted(leaves):
        leaf = leaves[fqn]
        value = leaf.value
        if not is_tensor(value):
            if fqn in md.objects:
                plan.objects.append(ObjectRead(fqn, index[fqn], leaf, md.objects[fqn]))
            elif fqn in md.tensors:
                plan.problems.append(
                    f"{fqn!r}: the checkpoint holds a tensor, the state dict a {type(value).__name__}"
                )
            else:
                plan.missing.append(fqn)
            continue
        tmeta = md.tensors.get(fqn)
        if tmeta is None:
            if fqn in md.objects:
                plan.problems.append(f"{fqn!r}: the checkpoint holds a Python object, the state dict a tensor")
            else:
                plan.missing.append(fqn)
            continue
        try:
            box = tensor_box(fqn, value, boxes)
        except ValueError as e:
            plan.problems.append(str(e))
            continue
        try:
            have = dtype_name(value.dtype)
        except KeyError:
            have = str(value.dtype)
        if have != tmeta.dtype or box.global_shape != tmeta.shape:
            plan.problems.append(
                f"{fqn!r}: the state dict has dtype {have} shape {list(box.global_shape)}, "
                f"the checkpoint {tmeta.dtype} {list(tmeta.shape)}"
            )
            continue
        if box.local is None or box.numel == 0:
            continue
        itemsize = value.element_size()
        reads = []
        for chunk in tmeta.chunks:
            hit = _intersect(chunk, box.offsets, box.lengths)
            if hit is not None:
                src, dst, ln = hit
                reads.append(
                    ReadItem(chunk.file, chunk.key, chunk.checksum, chunk.lengths, src, dst, ln,
                             math.prod(ln) * itemsize)
                )
        plan.shards.append(
            DestShard(
                fqn=fqn,
                key=(index[fqn], box.offsets, box.lengths),
                dtype=value.dtype,
                nbytes=box.numel * itemsize,
                reads=reads,
                dest=box.local.detach(),  # same storage; in-place copies into parameters need no autograd
                broadcastable=broadcastable(box.local),
            )
        )
    if strict and plan.missing:
        plan.problems += [f"{fqn!r}: missing from the checkpoint" for fqn in plan.missing]
    return plan


# -- the exchange: one compact record per shard, no pickled per-item objects ---------------------------

_OBJECT = -1


def encode_plan(plan: LocalPlan) -> bytes:
    """[index, ndim, broadcastable, *offsets, *lengths] per shard, [index, -1, 0] per object, as int64."""
    out: list[int] = []
    for s in plan.shards:
        idx, offsets, lengths = s.key
        out += [idx, len(offsets), int(s.broadcastable), *offsets, *lengths]
    for o in plan.objects:
        out += [o.index, _OBJECT, 0]
    return np.asarray(out, dtype=np.int64).tobytes()


def decode_plan(data: bytes) -> tuple[list[tuple[ShardKey, bool]], list[int]]:
    """Inverse of :func:`encode_plan`: ([(key, broadcastable)], [object indices])."""
    a = np.frombuffer(data, dtype=np.int64).tolist()
    shards, objects, i = [], [], 0
    while i < len(a):
        idx, ndim, bc = a[i], a[i + 1], a[i + 2]
        i += 3
        if ndim == _OBJECT:
            objects.append(idx)
            continue
        shards.append(((idx, tuple(a[i : i + ndim]), tuple(a[i + ndim : i + 2 * ndim])), bool(bc)))
        i += 2 * ndim
    return shards, objects


# -- the global plan -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Op:
    """One broadcast: ``reader`` reads ``shards`` and sends them to ``members`` (load-group ranks)."""

    members: tuple[int, ...]
    reader: int
    shards: tuple[ShardKey, ...]


@dataclass
class GlobalPlan:
    ops: list[Op]  # every broadcast of the load, in the one global order all ranks issue them in
    shared: dict[ShardKey, tuple[tuple[int, ...], int]]  # shard -> (members, reader)
    sets: list[tuple[int, ...]]  # distinct member sets, sorted: the groups the load needs
    create: list[bool]  # per set: must the load create it (some member has no group for it)
    requested: set[int]  # checkpoint keys some rank asked for


def aligned(n: int) -> int:
    return -(-n // STAGING_ALIGN) * STAGING_ALIGN


def global_plan(
    per_rank: Sequence[tuple[list[tuple[ShardKey, bool]], list[int]]],
    nbytes: Callable[[ShardKey], int],
    *,
    broadcast: bool,
    batch_bytes: int,
    reusable: Sequence[Sequence[tuple[int, ...]]] = (),
    can_create: bool = True,
) -> GlobalPlan:
    """The load's plan, identical on every rank: who reads each shared shard and the broadcast order.

    - A shard is *shared* when two or more ranks hold it, every holder can broadcast it, and its member
      set has a process group: the whole group, a group every member already has (``reusable[r]`` lists
      rank r's), or one the load may create (``can_create``).
    - Readers: shared shards by bytes, largest first, each to the replica with the fewest bytes so far
      (counting from what each rank alone holds); ties keep rank order (:func:`pipeload.balance.assign`,
      exactly as the saver chose writers, so an unchanged layout reads each rank's own file).
    - Order: shared shards by (fqn, offsets, lengths). Shards smaller than ``batch_bytes`` join the
      pending batch of their (members, reader) and the batch is sent at the position of the shard that
      fills it; batches still pending at the end follow in the order of their first shard.
    """
    size = len(per_rank)
    full = tuple(range(size))
    holders: dict[ShardKey, list[int]] = defaultdict(list)
    bc: dict[ShardKey, bool] = {}
    requested: set[int] = set()
    for rank, (shards, objects) in enumerate(per_rank):
        requested.update(objects)
        for key, ok in shards:
            holders[key].append(rank)
            bc[key] = bc.get(key, True) and ok
            requested.add(key[0])
    has = [set(map(tuple, sets)) for sets in reusable] if reusable else [set() for _ in range(size)]

    def available(members: tuple[int, ...]) -> bool:
        return members == full or can_create or all(members in has[r] for r in members)

    shared_keys = []
    if broadcast:
        for key, hs in holders.items():
            if len(hs) >= 2 and bc[key] and available(tuple(hs)):
                shared_keys.append(key)
    weights = {k: nbytes(k) for k in shared_keys}
    base: dict[int, int] = {}  # bytes each rank reads alone anyway, as the saver counted them
    for key, hs in holders.items():
        if key not in weights and len(hs) == 1:
            base[hs[0]] = base.get(hs[0], 0) + nbytes(key)
    readers = balance.assign(weights, {k: holders[k] for k in shared_keys}, base)
    shared = {k: (tuple(holders[k]), readers[k]) for k in shared_keys}

    ops: list[Op] = []
    pending: dict[tuple[tuple[int, ...], int], tuple[list[ShardKey], int]] = {}
    for key in sorted(shared_keys):
        group_key = shared[key]
        n = weights[key]
        if n >= batch_bytes:
            ops.append(Op(group_key[0], group_key[1], (key,)))
            continue
        keys, total = pending.get(group_key, ([], 0))
        keys.append(key)
        total += aligned(n)
        if total >= batch_bytes:
            ops.append(Op(group_key[0], group_key[1], tuple(keys)))
            pending.pop(group_key, None)
        else:
            pending[group_key] = (keys, total)
    for group_key, (keys, _) in sorted(pending.items(), key=lambda kv: kv[1][0][0]):
        ops.append(Op(group_key[0], group_key[1], tuple(keys)))

    sets = sorted({op.members for op in ops if op.members != full})
    create = [not all(s in has[r] for r in s) for s in sets]
    return GlobalPlan(ops, shared, sets, create, requested)
