"""Local load planning: pure functions, no I/O, no torch.distributed.

Call order (every rank of the load's group)::

    local = local_plan(leaves, metadata, broadcastable)    # each rank alone
    record = plan_record(local, metadata.width())          # compact bytes for the exchange
    ...exchange (pipeload.plan.exchange): rows, then each distinct record once...
    plan = globalplan.global_plan(rows, classes, records, rank, ...)   # identical decisions everywhere

A striped shared shard is loaded as pieces (row ranges); :func:`piece_shard` gives the part of a
destination shard, and of its reads, that one piece covers.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, NamedTuple

import torch

from .exchange import encode_record, padded
from .globalplan import ShardKey
from ._leafplan import local_of, resolve, unbind  # noqa: F401 - unbind is the planner's, compiled
from ..formats.chunks import box_span
from ..formats.metadata import NAMES_OF_DTYPES, ChunkMeta, Metadata, ObjectMeta, chunk_key, torch_dtype
from ..slices import Slice
from .statedict import Box, Leaf, cached_meshes, mesh_of


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


class Binding:
    """The leaves of the state dict a kept plan serves now (``plancache.signature``'s values, in flatten
    order), or None between its loads. A load that reuses the plan sets :attr:`values` once; each shard
    finds its tensor there when first used (:attr:`DestShard.dest`), not in a pass before the load."""

    __slots__ = ("values",)

    def __init__(self) -> None:
        self.values: list | None = None


class DestShard:
    """What this rank needs of one tensor: a box of the global tensor, and where it goes.

    Built for every tensor leaf before the exchange, so what only the reads need is built when they
    run (in the worker thread, overlapping the broadcasts): a box loaded as saved keeps its one stored
    chunk as ``(file, checksum, whole)`` until :attr:`reads` is first asked for (a box inside a tensor's
    one whole chunk, ``(file, checksum, chunk shape)``), and :attr:`dest` is
    detached from autograd when first used, not at planning. The shard of a kept plan holds no tensor
    between loads, only where to find it: ``(binding, leaf position, first row, rows or None)``.
    """

    __slots__ = ("fqn", "key", "dtype", "nbytes", "_reads", "_dest", "broadcastable", "affinity", "leaf")

    def __init__(self, fqn: str, key: ShardKey, dtype: torch.dtype, nbytes: int, reads, dest, broadcastable: bool,
                 affinity: int = -1):
        self.fqn = fqn
        self.key = key
        self.dtype = dtype
        self.nbytes = nbytes
        self._reads = reads  # list[ReadItem], or (file, checksum, whole) of the one chunk that is the box
        self._dest = dest  # this rank's tensor holding the box (copied into in place)
        self.broadcastable = broadcastable
        self.affinity = affinity  # the rank the layout names as writer of the file holding it, or -1
        self.leaf: tuple | None = None  # a kept plan's: where dest is found (see the class docstring)

    @property
    def reads(self) -> list[ReadItem]:
        r = self._reads
        if type(r) is tuple:
            offsets, lengths = self.key[1], self.key[2]
            zero = (0,) * len(lengths)
            if type(r[2]) is not tuple:  # (file, checksum, whole): the stored chunk is this box
                file, checksum, whole = r
                item = ReadItem(file, chunk_key(self.fqn, offsets, whole), checksum, lengths, zero, zero, lengths,
                                self.nbytes)
            else:  # (file, checksum, shape): the box lies inside the tensor's one whole chunk
                file, checksum, shape = r
                item = ReadItem(file, chunk_key(self.fqn, zero, True), checksum, shape, offsets, zero, lengths,
                                self.nbytes)
            r = self._reads = [item]
        return r

    @property
    def exact_file(self) -> str | None:
        """The file of the stored chunk that is exactly this box, when its reads were not built yet."""
        r = self._reads
        return r[0] if type(r) is tuple and type(r[2]) is not tuple else None

    def exact_key(self) -> str:
        """The safetensors name of that chunk (only when :attr:`exact_file` is not None)."""
        return chunk_key(self.fqn, self.key[1], self._reads[2])

    @property
    def dest(self) -> torch.Tensor:
        d = self._dest
        if d is None and self.leaf is not None:
            binding, pos, lo, rows = self.leaf
            d = local_of(binding.values[pos])
            if rows is not None:
                d = d.narrow(0, lo, rows)
            self._dest = d
        if d is not None and d.requires_grad:  # a load's copies into parameters must not be recorded
            d = self._dest = d.detach()
        return d

    @dest.setter
    def dest(self, value: torch.Tensor | None) -> None:
        self._dest = value

    def __repr__(self) -> str:
        return f"DestShard({self.fqn!r}, {self.key}, {self.dtype}, {self.nbytes})"


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
    boxes: tuple | None = None  # (offsets, lengths) of ``shards`` as n x width arrays, when local_plan built them
    meshes: list = field(default_factory=list)  # every DTensor mesh of the state dict (its groups may be reused)
    # (leaf, tensor) of each meta leaf, loaded into a new CPU tensor put in its place after a successful load
    adopted: list = field(default_factory=list)
    # Slice leaves (pipeload.Slice): each shard's leaf path where some differ from their fqns (None: none
    # does), and (shard, twin, twin's path) for each further leaf holding a box a shard holds already
    # (a replicated KV head held twice): filled by a copy of the shard's destination once the load read it
    paths: list[str] | None = None
    twins: list = field(default_factory=list)

    def leaf_paths(self) -> list[str]:
        """The leaf path of each shard, then of each twin: where a kept plan finds their tensors."""
        return [*(self.paths if self.paths is not None else (s.fqn for s in self.shards)),
                *(path for _, _, path in self.twins)]


def fqn_index(md: Metadata) -> dict[str, int]:
    """Position of every checkpoint key in sorted order: the compact name used in the exchange."""
    return md.key_index()


def _intersect(chunk: ChunkMeta, offsets, lengths) -> tuple | None:
    """(offsets in the chunk, offsets in the destination, lengths) of their overlap, or None."""
    if chunk.offsets == offsets and chunk.lengths == lengths:  # same layout as saved: the usual case
        zero = (0,) * len(offsets)
        return zero, zero, lengths
    if not any(chunk.offsets) and all(0 <= o and 0 < n and o + n <= c for o, n, c in zip(offsets, lengths, chunk.lengths)):
        return tuple(offsets), (0,) * len(offsets), tuple(lengths)  # a box inside a whole stored tensor
    lo = [max(a, b) for a, b in zip(chunk.offsets, offsets)]
    hi = [min(a + n, b + m) for a, n, b, m in zip(chunk.offsets, chunk.lengths, offsets, lengths)]
    if any(h <= l for l, h in zip(lo, hi)):
        return None
    return (
        tuple(l - c for l, c in zip(lo, chunk.offsets)),
        tuple(l - o for l, o in zip(lo, offsets)),
        tuple(h - l for l, h in zip(lo, hi)),
    )


def _exact_or_inside(md: Metadata):
    """The chunk lookup of :func:`local_plan`: each box's exact chunk, or the one whole chunk it lies in."""
    return lambda rows, offsets, lengths: md.exact_rows(rows, offsets, lengths, inside=True)


def local_plan(
    leaves: dict[str, Leaf],
    md: Metadata,
    broadcastable: Callable[[torch.Tensor], bool],
    *,
    strict: bool = True,
    box_of: Callable[[str, torch.Tensor, dict], Box] | None = None,
    writer_of: Callable[[str], int] | None = None,
) -> LocalPlan:
    """Resolve this rank's destination shards into reads and validate them against ``md``.

    Nothing is read or written: every dtype/shape/key problem is collected in ``problems`` so the
    load can refuse before touching any destination. ``box_of`` resolves a tensor leaf's box (None:
    :func:`pipeload.plan.statedict.tensor_box`; the simulation passes the box a layout assigns).
    ``writer_of`` (a layout's :attr:`~pipeload.formats.Checkpoint.writer_of`) gives each shard stored
    in one file its affinity.

    Shards come in fqn order, so replicas build byte-identical exchange records. Loaded as saved, each
    box is one stored chunk, found for all boxes at once (:meth:`Metadata.exact_chunks`) and kept
    unbuilt (:class:`DestShard`); other boxes are matched with the chunks they overlap. The loop over
    the leaves is compiled (:func:`pipeload.plan._leafplan.resolve`).

    A :class:`pipeload.Slice` leaf is a box of the tensor it names: one shard per distinct box, whatever
    its path, so one tensor may have several shards on a rank (:func:`_by_box` orders them by key, and
    keeps a box held twice once, its other holders as ``twins``).
    """
    index = fqn_index(md)
    plan = LocalPlan()
    boxes: dict = {}  # meshes stay alive through this call, so their ids are stable keys
    width = md.width()  # the exchange record's: the boxes are padded to it once, for the lookup and the record

    def reads_of(fqn: str, offsets: tuple, lengths: tuple, itemsize: int) -> tuple[list[ReadItem], int]:
        reads = []
        for chunk in md.chunks_for(fqn, offsets, lengths):
            hit = _intersect(chunk, offsets, lengths)
            if hit is not None:
                src, dst, ln = hit
                reads.append(ReadItem(chunk.file, chunk.key, chunk.checksum, chunk.lengths, src, dst, ln,
                                      math.prod(ln) * itemsize))
        one_file = writer_of is not None and reads and all(r.file == reads[0].file for r in reads)
        return reads, writer_of(reads[0].file) if one_file else -1

    plan.shards, offsets, lengths, plan.problems, unboxed, others, adopted, paths = resolve(
        sorted(leaves), leaves, index, md, box_of, boxes, width, NAMES_OF_DTYPES, _exact_or_inside(md), reads_of, DestShard,
        broadcastable, writer_of)
    plan.boxes = (offsets, lengths)  # one shard per box, in order
    if paths is not None:
        _by_box(plan, paths)
    plan.adopted = [(leaves[fqn], t) for fqn, t in adopted]
    unnamed = _others(plan, leaves, others, md, index)
    meshes = {id(m): m for m in cached_meshes(boxes)}
    meshes.update((id(m), m) for m in map(mesh_of, unboxed) if m is not None)
    plan.meshes = list(meshes.values())
    _missing(plan, leaves, unnamed, index, strict)
    return plan


def _others(plan: LocalPlan, leaves: dict[str, Leaf], others: list[str], md: Metadata, index: dict) -> list[Slice]:
    """Sort the leaves that are no tensor of the checkpoint (``others``, in fqn order) into the plan's
    objects, missing keys and problems; return the slices whose tensor the checkpoint lacks."""
    unnamed: list[Slice] = []
    for fqn in others:
        leaf = leaves[fqn]
        value = leaf.value
        if isinstance(value, Slice):
            if value.name in md.objects:
                plan.problems.append(f"{value.label}: the checkpoint holds a Python object under that name")
            else:
                unnamed.append(value)
        elif isinstance(value, torch.Tensor):
            if fqn in md.objects:
                plan.problems.append(f"{fqn!r}: the checkpoint holds a Python object, the state dict a tensor")
            else:
                plan.missing.append(fqn)
        elif fqn in md.objects:
            plan.objects.append(ObjectRead(fqn, index[fqn], leaf, md.objects[fqn]))
        elif fqn in md.tensors:
            plan.problems.append(f"{fqn!r}: the checkpoint holds a tensor, the state dict a {type(value).__name__}")
        else:
            plan.missing.append(fqn)
    return unnamed


def _missing(plan: LocalPlan, leaves: dict[str, Leaf], unnamed: list[Slice], index: dict, strict) -> None:
    """The missing keys (tied weights filled by their twin are not), and under ``strict`` a problem for
    each, naming a slice by its tensor and offsets."""
    if plan.missing:
        plan.missing = _untied(leaves, plan.missing, plan.leaf_paths())
    names = list(dict.fromkeys(s.name for s in unnamed))
    if strict and (plan.missing or names):
        plan.problems += [f"{fqn!r}: missing from the checkpoint" for fqn in plan.missing]
        plan.problems += list(dict.fromkeys(f"{s.label}: missing from the checkpoint" for s in unnamed))
        hint = rename_hint([*plan.missing, *names], index)
        if hint:
            plan.problems.append(hint)
    plan.missing += [name for name in names if name not in plan.missing]


def _by_box(plan: LocalPlan, paths: list[str]) -> None:
    """Shards in key order (fqn index, offsets, lengths), whatever their leaves' paths, so that ranks
    holding the same boxes build the same record; a box held again by another leaf (the same slice of one
    tensor twice) stays one shard, read once, and the other leaf becomes a twin filled from it."""
    shards = plan.shards
    order = sorted(range(len(shards)), key=lambda k: (shards[k].key, paths[k]))
    kept: list[int] = []
    for k in order:
        if kept and shards[kept[-1]].key == shards[k].key:
            plan.twins.append((shards[kept[-1]], shards[k], paths[k]))
        else:
            kept.append(k)
    plan.shards = [shards[k] for k in kept]
    plan.paths = [paths[k] for k in kept]
    plan.boxes = (plan.boxes[0][kept], plan.boxes[1][kept])


def rename_hint(missing: list[str], names) -> str | None:
    """The ``key_map`` that would find every missing key, when the state dict's keys are the checkpoint's
    with one prefix added (DDP's ``module.``, ``torch.compile``'s ``_orig_mod.``) or removed (a wrapper's
    ``model.``), or None. Only on a failed load: ``O(keys x depth)``."""
    have = set(names)
    added = None  # prefixes that, removed from every missing key, give a checkpoint key
    for k in missing:
        found = {k[: i + 1] for i, ch in enumerate(k) if ch == "." and k[i + 1 :] in have}
        added = found if added is None else added & found
        if not added:
            break
    if added:
        p = min(added, key=len)
        return f"every missing key is a checkpoint key with {p!r} in front: pass key_map=lambda k: {p!r} + k"
    prefix_of: dict[str, set[str]] = {}  # checkpoint key less a leading prefix -> those prefixes
    for c in have:
        for i, ch in enumerate(c):
            if ch == ".":
                prefix_of.setdefault(c[i + 1 :], set()).add(c[: i + 1])
    removed = None
    for k in missing:
        removed = set(prefix_of.get(k, ())) if removed is None else removed & prefix_of.get(k, set())
        if not removed:
            return None
    p = min(removed, key=len)
    return f"every missing key is a checkpoint key without {p!r} in front: pass key_map=lambda k: k.removeprefix({p!r})"


def _untied(leaves: dict[str, Leaf], missing: list[str], loaded: list[str]) -> list[str]:
    """``missing`` less the keys whose tensor is the very tensor of a loaded key: tied weights
    (``lm_head.weight`` is ``embed_tokens.weight``; a Hugging Face checkpoint stores one of them), filled
    when the other is. The same memory, offset, shape, strides and dtype, and the same global shape."""
    def alias(value):
        t = local_of(value)
        if not isinstance(t, torch.Tensor) or t.device.type == "meta" or not t.numel():
            return None
        return (t.untyped_storage().data_ptr(), t.device, t.storage_offset(), tuple(t.shape), t.stride(), t.dtype,
                tuple(value.shape))

    filled = {alias(leaves[fqn].value) for fqn in loaded}
    return [fqn for fqn in missing if (a := alias(leaves[fqn].value)) is None or a not in filled]


# -- the exchange record and striped pieces -------------------------------------------------------------


def plan_record(plan: LocalPlan, width: int) -> bytes:
    """This rank's exchange record (:func:`pipeload.plan.exchange.encode_record`) of ``plan``.

    Replicas with the same destination shards produce byte-identical records: shards are in fqn order
    and carry no rank-specific field.
    """
    shards = plan.shards
    if plan.boxes is not None and plan.boxes[0].shape == (len(shards), width):
        offsets, lengths = plan.boxes
    else:
        offsets, lengths = padded([s.key[1] for s in shards], width), padded([s.key[2] for s in shards], width)
    return encode_record(
        [s.key[0] for s in shards], [s.broadcastable for s in shards], offsets, lengths,
        [o.index for o in plan.objects], width, [s.affinity for s in shards],
    )


def piece_shard(shard: DestShard, piece: ShardKey) -> DestShard:
    """The part of ``shard`` a striped piece covers: a row range of its destination and of its reads."""
    if piece == shard.key:
        return shard
    lo = piece[1][0] - shard.key[1][0]
    rows = piece[2][0]
    reads = []
    for it in shard.reads:
        a = max(lo, it.dest_offsets[0])
        b = min(lo + rows, it.dest_offsets[0] + it.lengths[0])
        if b <= a:
            continue
        ln = (b - a, *it.lengths[1:])
        reads.append(it._replace(
            src_offsets=(it.src_offsets[0] + a - it.dest_offsets[0], *it.src_offsets[1:]),
            dest_offsets=(a - lo, *it.dest_offsets[1:]),
            lengths=ln,
            nbytes=math.prod(ln) * shard.dtype.itemsize,
        ))
    dest = shard.dest.narrow(0, lo, rows)
    return DestShard(shard.fqn, piece, shard.dtype, dest.numel() * shard.dtype.itemsize, reads, dest,
                     shard.broadcastable)


class UnitPiece:
    """A row range of a chunk unit (:mod:`pipeload.plan.chunkunits`): one contiguous range of a stored
    chunk its reader reads (``reads``: one ReadItem, the whole rows) and broadcasts to every rank that
    needs part of the chunk; each member copies its boxes out of the received buffer (``outs``: its
    destination shard, where the box starts in the piece, where in the shard, its lengths).

    Holds the plan's own :class:`DestShard` objects, never a tensor: a kept plan finds the destinations
    through them (:attr:`DestShard.dest`) when a piece is unpacked."""

    __slots__ = ("fqn", "key", "dtype", "nbytes", "shape", "reads", "outs")

    def __init__(self, fqn: str, key: ShardKey, dtype: torch.dtype, reads: list[ReadItem], outs: list):
        self.fqn, self.key, self.dtype, self.reads, self.outs = fqn, key, dtype, reads, outs
        self.shape = key[2]
        self.nbytes = math.prod(key[2]) * dtype.itemsize

    def copies(self, buf: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(destination box, view of ``buf`` holding it) of each box this rank needs from the piece."""
        return [(_narrow(shard.dest, dst, ln), _narrow(buf, src, ln)) for shard, src, dst, ln in self.outs]

    def __repr__(self) -> str:
        return f"UnitPiece({self.fqn!r}, {self.key}, {self.dtype}, {self.nbytes})"


def _chunk_of(shard: DestShard, item: ReadItem) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(offsets, lengths) in the global tensor of the stored chunk ``item`` reads from."""
    return (tuple(o + d - s for o, d, s in zip(shard.key[1], item.dest_offsets, item.src_offsets)),
            item.chunk_lengths)


def unit_pieces(shards: list[DestShard], pieces: dict, names: list[str],
                dtype_of: Callable[[int], torch.dtype]) -> tuple[dict[ShardKey, UnitPiece], set, int]:
    """This rank's chunk-unit pieces (the unit keys of a plan's ``pieces``, index ``-1 - i``) as
    (piece key -> :class:`UnitPiece`; the stored chunks they deliver as (file, key), which the private
    reads skip; the storage bytes this rank's boxes of those chunks would have spanned less the bytes it
    reads for them, an estimate of what the units saved). ``dtype_of``: the stored dtype of a key index."""
    units = {k: v for k, v in pieces.items() if k[0] < 0}
    if not units:
        return {}, set(), 0
    wanted = {-1 - k[0] for k in units}
    items: dict[tuple, list] = {}
    for s in shards:
        if s.key[0] in wanted:
            for it in s.reads:
                items.setdefault((s.key[0], *_chunk_of(s, it)), []).append((s, it))
    out, skip, spanned = {}, set(), 0
    for uk, pks in units.items():
        idx = -1 - uk[0]
        mine = items.get((idx, uk[1], uk[2]), [])
        dtype = dtype_of(idx)
        for s, it in mine:
            skip.add((it.file, it.key))
            lo, hi = box_span(it.chunk_lengths, it.src_offsets, it.lengths, dtype.itemsize)
            spanned += hi - lo
        for pk in pks:
            r0 = pk[1][0] - uk[1][0] if uk[1] else 0
            rows = pk[2][0] if uk[1] else 1
            outs = []
            for s, it in mine:
                a, b = max(it.src_offsets[0], r0), min(it.src_offsets[0] + it.lengths[0], r0 + rows)
                if b > a:
                    outs.append((s, (a - r0, *it.src_offsets[1:]),
                                 (it.dest_offsets[0] + a - it.src_offsets[0], *it.dest_offsets[1:]),
                                 (b - a, *it.lengths[1:])))
            reads = []
            if mine:
                first = mine[0][1]
                zero = (0,) * len(pk[2])
                reads = [ReadItem(first.file, first.key, first.checksum, uk[2], (r0, *zero[1:]), zero, pk[2],
                                  math.prod(pk[2]) * dtype.itemsize)]
            out[pk] = UnitPiece(names[idx], pk, dtype, reads, outs)
    return out, skip, spanned


def _narrow(t: torch.Tensor, offsets: tuple[int, ...], lengths: tuple[int, ...]) -> torch.Tensor:
    for dim, (o, n) in enumerate(zip(offsets, lengths)):
        if o != 0 or n != t.shape[dim]:
            t = t.narrow(dim, o, n)
    return t


def resharded(shards: list[DestShard]) -> bool:
    """Whether some shard's box is not exactly one stored chunk (the exchange row's ``FLAG_RESHARDED``).
    A box loaded as saved keeps its chunk unbuilt (:attr:`DestShard.exact_file`): nothing is built here."""
    for s in shards:
        if s.exact_file is None:
            r = s.reads
            if len(r) != 1 or r[0].lengths != r[0].chunk_lengths:
                return True
    return False


def stored_dtype(md: Metadata, fqn: str) -> torch.dtype:
    """The dtype of tensor ``fqn`` as the plan sizes it (the stored one, or the destination's under ``cast``)."""
    t = md.tensors
    name = t.dtypes[t.pos[fqn]] if md.indexed else t[fqn].dtype
    return torch_dtype(name)
