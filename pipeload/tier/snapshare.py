"""Replicated chunks of a snapshot: one holder stages each, the others receive it in the background.

Every host keeps its ranks' whole state, but a DTensor replicated along a mesh dimension (data
parallelism) has the same local shard on every rank of its *replica group*: the ranks of the mesh
whose coordinates equal this rank's on every dimension that is not ``Replicate``. Copying every
replica in the caller's thread would block a snapshot for twice (DP 2) the bytes a directory save
stages after deduplication. Instead each shard of a replica group is staged by one member, its
*stager*, and the others receive the stager's copy in the snapshot's worker before writing their
files (each file still holds everything its rank holds).

The split is a pure function of what each rank holds locally — DTensor specs, fqns and byte sizes —
so no chunk table is gathered (its cost is O(S) per rank whatever the world size): within each replica
group, shards are taken in fqn order and each goes to the member that has staged the fewest bytes so
far (lowest rank on ties), which every member computes alike from the same shards. Plain tensors and
DTensors with ``Partial`` placements are staged by every rank itself: nothing local says another rank
holds the same bytes.

Every member must hold the same shards of its replica groups for the split to match. That is checked
before anything is staged: each rank adds a hash of every (stager, receiver, fqn, bytes) it will send
and of every one it will receive into two words of the snapshot's gathered row; unless the world's
sums are equal, every rank stages everything itself (no transfer).

The transfers run on the snapshot's own group, in one global order: by (sender, receiver), then by fqn,
small shards packed (:func:`pipeload.move.mover.batches`); each rank posts its messages in that
order and waits on its oldest (the restore's deadlock argument, :mod:`pipeload.tier.restore`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from ..plan._leafplan import local_of
from ..plan.exchange import hash64
from ..move.mover import Transfers, batches, unpack_into

_MASK = (1 << 64) - 1


@dataclass
class Split:
    """This rank's part: ``sends`` (fqn, receivers) it stages and sends, ``recvs`` (fqn, stager) it
    receives; ``words`` the two check words (sends, receives) as signed int64 values."""

    sends: list[tuple[str, tuple[int, ...]]] = field(default_factory=list)
    recvs: list[tuple[str, int]] = field(default_factory=list)
    words: tuple[int, int] = (0, 0)

    @property
    def received(self) -> set[str]:
        return {fqn for fqn, _ in self.recvs}


NONE = Split()


def replica_group(value, cache: dict) -> tuple[int, ...] | None:
    """The global ranks holding the same local shard as this rank for the DTensor ``value`` (sorted;
    this rank among them), or None when nothing says another rank holds it (a plain tensor, a
    ``Partial`` placement, no ``Replicate`` dimension of size > 1, this rank outside the mesh)."""
    spec = getattr(value, "_spec", None)
    if spec is None:
        return None
    key = (id(spec.mesh), spec.placements)
    if key not in cache:
        cache[key] = _group_of(spec.mesh, spec.placements)
    return cache[key]


def _group_of(mesh, placements) -> tuple[int, ...] | None:
    if any(p.is_partial() for p in placements):
        return None
    coord = mesh.get_coordinate()
    ranks = mesh.mesh
    rep = [i for i, p in enumerate(placements) if p.is_replicate() and ranks.shape[i] > 1]
    if coord is None or not rep:
        return None
    index = tuple(slice(None) if i in rep else c for i, c in enumerate(coord))
    return tuple(sorted(int(r) for r in ranks[index].reshape(-1).tolist()))


def split(values: dict[str, torch.Tensor], tensors: dict, me: int) -> Split:
    """This rank's :class:`Split` of its ``tensors`` ({fqn: (local, global shape, offsets)}), the
    replica groups read off the state dict's ``values`` ({fqn: leaf value}).

    Deterministic within a replica group: the members see the same shards (fqns and sizes), taken in
    fqn order, each to the member with the fewest staged bytes so far."""
    cache: dict = {}
    groups: dict[tuple[int, ...], list[tuple[str, int]]] = {}
    for fqn in sorted(tensors):
        local = tensors[fqn][0]
        n = local.numel() * local.element_size()
        group = replica_group(values[fqn], cache) if n else None
        if group is not None and me in group:
            groups.setdefault(group, []).append((fqn, n))
    out = Split()
    sent = recv = 0
    for group, shards in groups.items():
        load = dict.fromkeys(group, 0)
        for fqn, n in shards:
            stager = min(group, key=lambda r: (load[r], r))
            load[stager] += n
            if stager == me:
                others = tuple(r for r in group if r != me)
                out.sends.append((fqn, others))
                sent += sum(_word(me, r, fqn, n) for r in others)
            else:
                out.recvs.append((fqn, stager))
                recv += _word(stager, me, fqn, n)
    out.words = (_signed(sent), _signed(recv))
    return out


def _word(sender: int, receiver: int, fqn: str, n: int) -> int:
    return hash64(f"{sender}\0{receiver}\0{n}\0{fqn}".encode()) & _MASK


def _signed(x: int) -> int:
    x &= _MASK
    return x - (1 << 64) if x >= 1 << 63 else x


def consistent(rows: np.ndarray, send_col: int, recv_col: int) -> bool:
    """Whether every rank's sends match some rank's receives (the gathered check words agree)."""
    sums = [int(rows[:, c].astype(np.uint64).sum(dtype=np.uint64)) for c in (send_col, recv_col)]
    return sums[0] == sums[1] and bool(rows[:, send_col].any() or rows[:, recv_col].any())


def local_values(tensors: dict, values: dict) -> dict:
    """{fqn: local tensor} of the state dict ``values`` ({fqn: leaf}) for ``tensors``' fqns."""
    return {fqn: local_of(values[fqn]) for fqn in tensors}


def transfer(own, plan: Split, tensors: dict, me: int, what: str) -> int:
    """Send the shards this rank staged to their receivers and receive the others' into ``tensors``'
    buffers (the worker's, allocated for them), in the global order; the bytes received."""
    x = Transfers(own, what)
    for peer, items, sending in _pairs(plan, tensors, me):
        for batch in batches(items):
            data = [tensors[fqn][0] for fqn, _ in batch]
            if sending:
                flat = torch.cat([d.reshape(-1).view(torch.uint8) for d in data]) if len(data) > 1 else \
                    data[0].reshape(-1).view(torch.uint8)
                x.send(peer, flat.numel(), lambda lo, hi, flat=flat: flat[lo:hi])
            elif len(data) == 1:
                x.recv(peer, data[0].reshape(-1).view(torch.uint8))
            else:
                buf = torch.empty(sum(n for _, n in batch), dtype=torch.uint8)
                x.recv(peer, buf, unpack_into(buf, data))
    x.drain()
    return x.received


def _pairs(plan: Split, tensors: dict, me: int):
    """(peer, [(fqn, bytes)], sending) per ordered pair of ranks this rank is in, by (sender, receiver)."""
    pairs: dict[tuple[int, int], list[str]] = {}
    for fqn, receivers in plan.sends:
        for r in receivers:
            pairs.setdefault((me, r), []).append(fqn)
    for fqn, stager in plan.recvs:
        pairs.setdefault((stager, me), []).append(fqn)
    for (s, r) in sorted(pairs):
        fqns = sorted(pairs[(s, r)])
        items = [(f, tensors[f][0].numel() * tensors[f][0].element_size()) for f in fqns]
        yield (r if s == me else s), items, s == me
