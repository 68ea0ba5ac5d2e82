"""Restoring from a memory tier with real processes: 4 ranks, each an emulated host with a tier root of its
own (PIPELOAD_HOST_ID), one world for every sub-case.

Shows: after one host's root is wiped, ``load(sd, tier, fallback=...)`` is exact and never opens the
persistent checkpoint (it is renamed away during the load: any access would fail); with three roots
wiped it falls back and loads the persistent step exactly; a corrupted copy on the host that would be
used is treated as missing (another copy, else the fallback); loading into another layout (resharding)
is exact; the same for an FSDP-like layout (every shard on one rank only).
"""

from __future__ import annotations

import os
import shutil

import pytest
import torch

from pipeload.tools._world import run_world

JOB = "restore-test"


def _tier(root, job=JOB):
    from pipeload.tier import MemoryTier

    return MemoryTier(root, replicas=2, job=job)


def _snapshot(rank: int, world: int, roots: list[str], step: int, sd: dict, job: str = JOB) -> None:
    """Snapshot ``sd`` at ``step`` into the tier (each rank's root is its host's; a copy on the next host)."""
    import pipeload

    pipeload.save(sd, _tier(roots[rank], job), step=step)


def _wipe(rank: int, roots: list[str], who) -> None:
    """A replaced node: the roots of ranks ``who`` emptied (by their own rank), every rank waits."""
    import torch.distributed as dist

    dist.barrier()
    if rank in who:
        shutil.rmtree(roots[rank], ignore_errors=True)
        os.makedirs(roots[rank])
    dist.barrier()


def _flip(path: str) -> None:
    """Corrupt one byte of a rank file's data (its last byte: a tensor's, not the header's)."""
    with open(path, "r+b") as f:
        f.seek(-1, os.SEEK_END)
        b = f.read(1)
        f.seek(-1, os.SEEK_END)
        f.write(bytes([b[0] ^ 0xFF]))


def _tp_dp_state(mesh, scale: float) -> dict:
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    w = torch.arange(48, dtype=torch.float32).reshape(8, 6) * scale
    b = torch.arange(6, dtype=torch.bfloat16) * scale
    return {"model": {"w": distribute_tensor(w, mesh, [Replicate(), Shard(0)]),
                      "b": distribute_tensor(b, mesh, [Replicate(), Replicate()]),
                      "plain": torch.full((3,), scale)},
            "meta": {"step": int(scale), "lr": 0.1 * scale}}


def _fsdp_state(mesh1, scale: float) -> dict:
    from torch.distributed.tensor import Shard, distribute_tensor

    f = torch.arange(40, dtype=torch.float32).reshape(8, 5) * scale
    g = torch.arange(7, dtype=torch.float32) * scale  # uneven: 2, 2, 2, 1
    return {"f": distribute_tensor(f, mesh1, [Shard(0)]), "g": distribute_tensor(g, mesh1, [Shard(0)]),
            "step": int(scale)}


def _zeroed(sd):
    from torch.distributed.tensor import DTensor

    out = {}
    for k, v in sd.items():
        if isinstance(v, dict):
            out[k] = _zeroed(v)
        elif isinstance(v, DTensor):
            v = v.detach().clone()
            v.to_local().zero_()
            out[k] = v
        elif isinstance(v, torch.Tensor):
            out[k] = torch.zeros_like(v)
        else:
            out[k] = None
    return out


def _same(a, b, where="") -> None:
    from torch.distributed.tensor import DTensor

    assert a.keys() == b.keys(), where
    for k in a:
        x, y = a[k], b[k]
        if isinstance(x, dict):
            _same(x, y, f"{where}{k}.")
        elif isinstance(x, torch.Tensor):
            lx = x.to_local() if isinstance(x, DTensor) else x
            ly = y.to_local() if isinstance(y, DTensor) else y
            assert torch.equal(lx, ly), f"{where}{k}: {lx} != {ly}"
        else:
            assert x == y, f"{where}{k}: {x!r} != {y!r}"


def _load_hidden(rank, sd, tier, ckpt):
    """load(sd, tier, fallback=ckpt) with the persistent checkpoint renamed away meanwhile: a load that
    touched it would fail."""
    import torch.distributed as dist

    import pipeload

    dist.barrier()
    if rank == 0:
        os.rename(ckpt, ckpt + "-away")
    dist.barrier()
    try:
        return pipeload.load(sd, tier, fallback=ckpt)
    finally:
        dist.barrier()
        if rank == 0:
            os.rename(ckpt + "-away", ckpt)
        dist.barrier()


def _restored_after_loss(rank, world, roots, ckpt, sd, step: int, lost: set):
    """Snapshot ``sd`` at ``step``, wipe the roots of ``lost``, restore into zeros: exact, from the tier."""
    _snapshot(rank, world, roots, step, sd)
    _wipe(rank, roots, lost)
    dest = _zeroed(sd)
    stats = _load_hidden(rank, dest, _tier(roots[rank]), ckpt)
    _same(dest, sd)
    assert (stats.source, stats.step) == ("tier", step)
    return stats


def _case_one_host_lost(rank, world, roots, ckpt, mesh):
    stats = _restored_after_loss(rank, world, roots, ckpt, _tp_dp_state(mesh, 7.0), 7, {2})
    return {"received": stats.bytes_received, "read": stats.bytes_read}


def _case_corrupt_own_copy(rank, world, roots, ckpt, mesh):
    """Rank 0's own copy fails its checksum: it gets its file from the host holding the other copy."""
    import torch.distributed as dist

    from pipeload.tier import format as tf

    tier_sd = _tp_dp_state(mesh, 8.0)
    _snapshot(rank, world, roots, 8, tier_sd)
    dist.barrier()
    if rank == 0:
        _flip(os.fspath(tf.rank_file(roots[0], 8, 0)))
    dest = _zeroed(tier_sd)
    with pytest.warns(RuntimeWarning, match="unusable") if rank == 0 else _nothing():
        stats = _load_hidden(rank, dest, _tier(roots[rank]), ckpt)
    _same(dest, tier_sd)
    assert (stats.source, stats.step) == ("tier", 8)
    return {"received": stats.bytes_received}


def _rewrite_header(path: str, edit) -> None:
    """Rewrite a rank file with ``edit(header)`` applied to its safetensors header (data untouched:
    its offsets are relative to the end of the header)."""
    import json

    with open(path, "rb") as f:
        raw = f.read()
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8: 8 + n])
    edit(header)
    new = json.dumps(header, separators=(",", ":")).encode()
    new += b" " * (-(8 + len(new)) % 8)
    with open(path, "wb") as f:
        f.write(len(new).to_bytes(8, "little") + new + raw[8 + n:])


def _case_summary_disagrees(rank, world, roots, ckpt, mesh):
    """Rank 0's own file lists from its summary (the layout rank 0 loads) but its record describes
    another layout: a missing copy, found before any transfer and warned naming the file; rank 0 gets
    its file from the other copy's host."""
    import json

    import torch.distributed as dist

    from pipeload.tier import format as tf

    tier_sd = _tp_dp_state(mesh, 20.0)
    _snapshot(rank, world, roots, 20, tier_sd)
    dist.barrier()
    path = os.fspath(tf.rank_file(roots[0], 20, 0))
    if rank == 0:
        def skew(header):
            record = json.loads(header["__metadata__"][tf.META_KEY])
            record["tensors"]["model.plain"]["shape"] = [4]
            header["__metadata__"][tf.META_KEY] = json.dumps(record)

        _rewrite_header(path, skew)
        assert tf.read_summary(path, job=JOB, step=20, rank=0) is not None  # (still lists)
    dest = _zeroed(tier_sd)
    with pytest.warns(RuntimeWarning, match=f"{path}: its summary disagrees") if rank == 0 else _nothing():
        stats = _load_hidden(rank, dest, _tier(roots[rank]), ckpt)
    _same(dest, tier_sd)
    assert (stats.source, stats.step) == ("tier", 20)
    return {"received": stats.bytes_received}


def _case_no_summary(rank, world, roots, ckpt, mesh):
    """Files written before the summary existed (no summary key) are listed from their whole header
    and restore as before, one host lost."""
    import glob

    from pipeload.tier import format as tf

    tier_sd = _tp_dp_state(mesh, 21.0)
    _snapshot(rank, world, roots, 21, tier_sd)
    for path in glob.glob(os.path.join(tf.step_dir(roots[rank], 21), "rank-*.safetensors")):
        _rewrite_header(path, lambda header: header["__metadata__"].pop(tf.SUMMARY_KEY))
        r = int(os.path.basename(path)[5:11])
        assert tf.read_summary(path, job=JOB, step=21, rank=r) is None
        assert tf.read_rank_header(path, job=JOB).step == 21
    _wipe(rank, roots, {1})
    dest = _zeroed(tier_sd)
    stats = _load_hidden(rank, dest, _tier(roots[rank]), ckpt)
    _same(dest, tier_sd)
    assert (stats.source, stats.step) == ("tier", 21)
    return {"received": stats.bytes_received}


def _case_fallbacks(rank, world, roots, ckpt, mesh, persistent):
    """The only other copy corrupted, then three roots of four wiped: the persistent step, exactly."""
    import pipeload
    import torch.distributed as dist

    from pipeload.tier import format as tf

    tier_sd = _tp_dp_state(mesh, 9.0)
    _snapshot(rank, world, roots, 9, tier_sd)
    _wipe(rank, roots, {2})
    if rank == 3:  # host 3 holds the copy of host 2's file: corrupt it
        _flip(os.fspath(tf.rank_file(roots[3], 9, 2)))
    dist.barrier()
    dest = _zeroed(tier_sd)
    stats = pipeload.load(dest, _tier(roots[rank]), fallback=ckpt)
    _same(dest, persistent)
    assert stats.source == "fallback"
    _snapshot(rank, world, roots, 10, _tp_dp_state(mesh, 10.0))
    _wipe(rank, roots, {1, 2, 3})
    dest = _zeroed(tier_sd)
    stats = pipeload.load(dest, _tier(roots[rank]), fallback=ckpt)
    _same(dest, persistent)
    assert stats.source == "fallback" and stats.bytes_read > 0
    with pytest.raises(pipeload.PipeloadError, match="no step of the tier is complete"):
        pipeload.load(dest, _tier(roots[rank]))  # no whole step, no fallback: refused on every rank


def _case_reshard(rank, world, roots, ckpt, mesh1):
    """Saved TP2 x DP2, loaded with every tensor sharded over the 4 ranks by columns, one host lost."""
    import pipeload
    from torch.distributed.tensor import Shard, distribute_tensor

    _wipe(rank, roots, {1})
    w = torch.arange(48, dtype=torch.float32).reshape(8, 6) * 10.0
    b = torch.arange(6, dtype=torch.bfloat16) * 10.0
    want = {"model": {"w": distribute_tensor(w, mesh1, [Shard(1)]), "b": distribute_tensor(b, mesh1, [Shard(0)]),
                      "plain": torch.full((3,), 10.0)}, "meta": {"step": 10, "lr": 0.1 * 10.0}}
    dest = _zeroed(want)
    stats = _load_hidden(rank, dest, _tier(roots[rank]), ckpt)
    _same(dest, want)
    assert (stats.source, stats.step) == ("tier", 10)
    # a key the step does not hold (strict): refused on every rank before anything is written
    extra = {**dest, "extra": torch.ones(2)}
    with pytest.raises(pipeload.PipeloadError, match="extra"):
        pipeload.load(extra, _tier(roots[rank]), fallback=ckpt)
    assert torch.equal(extra["extra"], torch.ones(2))


def _case_reshard_corrupt(rank, world, roots, ckpt, mesh, mesh1):
    """A resharding restore whose local copy fails its checksum: rank 3's own file (the row half it
    copies locally) is corrupted; it is found after the owners' plan and before any transfer, the
    decision is re-taken without it and the plan made again: rank 3 receives that half instead."""
    import torch.distributed as dist
    from torch.distributed.tensor import Shard, distribute_tensor

    from pipeload.tier import format as tf

    _snapshot(rank, world, roots, 12, _tp_dp_state(mesh, 12.0))
    _wipe(rank, roots, {1})
    if rank == 3:
        _flip(os.fspath(tf.rank_file(roots[3], 12, 3)))
    dist.barrier()
    w = torch.arange(48, dtype=torch.float32).reshape(8, 6) * 12.0
    b = torch.arange(6, dtype=torch.bfloat16) * 12.0
    want = {"model": {"w": distribute_tensor(w, mesh1, [Shard(1)]), "b": distribute_tensor(b, mesh1, [Shard(0)]),
                      "plain": torch.full((3,), 12.0)}, "meta": {"step": 12, "lr": 0.1 * 12.0}}
    dest = _zeroed(want)
    with pytest.warns(RuntimeWarning, match="unusable") if rank == 3 else _nothing():
        stats = _load_hidden(rank, dest, _tier(roots[rank]), ckpt)
    _same(dest, want)
    assert (stats.source, stats.step) == ("tier", 12)
    return stats.bytes_received


def _case_fsdp(rank, world, roots, ckpt, mesh1):
    import pipeload

    froots = [os.path.join(os.path.dirname(r), "fsdp-" + os.path.basename(r)) for r in roots]
    os.makedirs(froots[rank], exist_ok=True)
    persistent = _fsdp_state(mesh1, 3.0)
    fckpt = ckpt + "-fsdp"
    pipeload.save(persistent, fckpt)
    tier_sd = _fsdp_state(mesh1, 5.0)
    _snapshot(rank, world, froots, 5, tier_sd, job="fsdp")
    _wipe(rank, froots, {3})
    dest = _zeroed(tier_sd)
    stats = _load_hidden(rank, dest, _tier(froots[rank], "fsdp"), fckpt)
    _same(dest, tier_sd)
    assert (stats.source, stats.step) == ("tier", 5)
    received = stats.bytes_received
    _wipe(rank, froots, {0, 1, 3})
    dest = _zeroed(tier_sd)
    stats = pipeload.load(dest, _tier(froots[rank], "fsdp"), fallback=fckpt)
    _same(dest, persistent)
    assert stats.source == "fallback"
    return received


def _many_state(mesh, scale: float) -> dict:
    """Tensors of many sizes: under, around and over the (shrunk) message sizes of the case below."""
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    out = {}
    for i, n in enumerate([1, 3, 5, 8, 17, 40, 64, 100, 2, 7, 33, 250]):
        t = (torch.arange(n * 4, dtype=torch.float32).reshape(n, 4) + 1000 * i) * scale
        out[f"t{i:02d}"] = distribute_tensor(t, mesh, [Replicate(), Shard(0) if n >= 2 else Replicate()])
    return {"model": out, "step": int(scale)}


def _case_small_messages(rank, world, roots, ckpt, mesh, mesh1):
    """Messages of at most 256 bytes, 512 in flight: transfers cut into many parts and packed messages,
    their buffers reused as messages complete; a restore and a resharding restore stay exact."""
    from torch.distributed.tensor import Shard, distribute_tensor

    from pipeload.move import mover as restorexfer

    sizes = restorexfer.PIECE, restorexfer.SMALL, restorexfer.INFLIGHT
    restorexfer.PIECE, restorexfer.SMALL, restorexfer.INFLIGHT = 256, 64, 512
    try:
        sd = _many_state(mesh, 11.0)
        received = _restored_after_loss(rank, world, roots, ckpt, sd, 11, {1}).bytes_received
        full = {k: v.full_tensor() for k, v in sd["model"].items()}
        want = {"model": {k: distribute_tensor(v, mesh1, [Shard(1)]) for k, v in full.items()}, "step": 11}
        dest = _zeroed(want)
        _load_hidden(rank, dest, _tier(roots[rank]), ckpt)
        _same(dest, want)
        return received
    finally:
        restorexfer.PIECE, restorexfer.SMALL, restorexfer.INFLIGHT = sizes


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def _world_main(rank: int, world: int, tmp: str) -> dict:
    import warnings

    from torch.distributed.device_mesh import init_device_mesh

    import pipeload

    warnings.simplefilter("ignore", ResourceWarning)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    mesh1 = init_device_mesh("cpu", (4,))
    roots = [os.path.join(tmp, f"host{r}") for r in range(world)]
    os.makedirs(roots[rank], exist_ok=True)
    ckpt = os.path.join(tmp, "ckpt")
    persistent = _tp_dp_state(mesh, 3.0)
    pipeload.save(persistent, ckpt)
    out = {"lost": _case_one_host_lost(rank, world, roots, ckpt, mesh)}
    out["corrupt"] = _case_corrupt_own_copy(rank, world, roots, ckpt, mesh)
    _case_fallbacks(rank, world, roots, ckpt, mesh, persistent)
    _snapshot(rank, world, roots, 10, _tp_dp_state(mesh, 10.0))
    _case_reshard(rank, world, roots, ckpt, mesh1)
    out["reshard_corrupt"] = _case_reshard_corrupt(rank, world, roots, ckpt, mesh, mesh1)
    out["fsdp"] = _case_fsdp(rank, world, roots, ckpt, mesh1)
    out["skewed"] = _case_summary_disagrees(rank, world, roots, ckpt, mesh)
    out["old"] = _case_no_summary(rank, world, roots, ckpt, mesh)
    out["small"] = _case_small_messages(rank, world, roots, ckpt, mesh, mesh1)
    return out


def test_restore_world4(tmp_path):
    res = run_world(_world_main, 4, str(tmp_path), timeout=120, separate_hosts=True)
    # one host lost: only its rank received its state; the rank holding the copy read it to send it
    assert res[2]["lost"]["received"] > 0
    assert all(res[r]["lost"]["received"] == 0 for r in (0, 1, 3))
    assert res[3]["lost"]["read"] > res[0]["lost"]["read"]
    # a corrupted own copy: rank 0 received its file from the other copy's host
    assert res[0]["corrupt"]["received"] > 0 and res[1]["corrupt"]["received"] == 0
    assert res[3]["fsdp"] > 0
    assert res[3]["reshard_corrupt"] > 0  # (its own copy failed: the half it held came from a peer)
    # a summary disagreeing with its record: that copy is missing, rank 0 received its file
    assert res[0]["skewed"]["received"] > 0 and res[1]["skewed"]["received"] == 0
    assert res[1]["small"] > 4 * 256  # (many messages: the buffers were reused)
    # files without a summary: listed whole, the lost host's rank received its state
    assert res[1]["old"]["received"] > 0 and res[0]["old"]["received"] == 0


def _grown_state(mesh, rank: int) -> dict:
    """What the 2-rank job snapshots (``mesh`` of 2: rows, uneven columns, a replicated bf16 vector, a
    0-d tensor) and its Python objects, one of them this rank's own."""
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    w = torch.arange(48, dtype=torch.float32).reshape(8, 6) / 7
    e = torch.arange(15, dtype=torch.int64).reshape(5, 3) * -3
    return {"model": {"w": distribute_tensor(w, mesh, [Shard(0)]), "e": distribute_tensor(e, mesh, [Shard(1)]),
                      "b": distribute_tensor(torch.arange(6, dtype=torch.bfloat16) / 3, mesh, [Replicate()]),
                      "scale": torch.tensor(0.5)},
            "step": 5, "rng": {"rank": rank, "seed": [rank] * 3}}


def _world2_snapshot(rank: int, world: int, tmp: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    import pipeload

    root = os.path.join(tmp, f"host{rank}")
    os.makedirs(root, exist_ok=True)
    pipeload.save(_grown_state(init_device_mesh("cpu", (2,)), rank), _tier(root), step=5)


def _world4_restore(rank: int, world: int, tmp: str) -> dict:
    """The 2-rank snapshot restored by 4 ranks on a (2, 2) mesh: ranks 2 and 3 are new hosts with empty
    roots; every tensor in another layout; rank r < 2 keeps its own saved rank's ``rng``, the new ranks
    take saved rank 0's."""
    import pipeload
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    root = os.path.join(tmp, f"host{rank}")
    os.makedirs(root, exist_ok=True)
    full = _grown_state(init_device_mesh("cpu", (4,)), 0)  # (the global values; its DTensors unused)
    want = {"model": {"w": distribute_tensor(full["model"]["w"].full_tensor(), mesh, [Shard(1), Shard(0)]),
                      "e": distribute_tensor(full["model"]["e"].full_tensor(), mesh, [Replicate(), Shard(0)]),
                      "b": distribute_tensor(full["model"]["b"].full_tensor(), mesh, [Replicate(), Shard(0)]),
                      "scale": torch.tensor(0.5)},
            "step": 5, "rng": {"rank": rank if rank < 2 else 0, "seed": [rank if rank < 2 else 0] * 3}}
    dest = _zeroed(want)
    stats = pipeload.load(dest, _tier(root))
    _same(dest, want)
    assert (stats.source, stats.step) == ("tier", 5) and stats.objects >= 2
    return {"received": stats.bytes_received, "read": stats.bytes_read}


def test_restore_into_another_world(tmp_path):
    """Snapshotted by 2 ranks, restored by 4 (resharding through the owners' plan): bit-exact, objects
    included; the new hosts read nothing from a tier and receive everything."""
    run_world(_world2_snapshot, 2, str(tmp_path), timeout=60, separate_hosts=True)
    res = run_world(_world4_restore, 4, str(tmp_path), timeout=90, separate_hosts=True)
    assert all(res[r]["read"] == 0 and res[r]["received"] > 0 for r in (2, 3))
    assert all(res[r]["read"] > 0 for r in (0, 1))


def _world4_two_per_host(rank: int, world: int, tmp: str) -> dict:
    """Hosts of two ranks sharing one root (PIPELOAD_HOST_ID), replicas=2: host 1's root wiped, then a
    restore into TP 4 (resharding). Both ranks of host 0 list every file; host 1's ranks receive all."""
    import pipeload
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    os.environ["PIPELOAD_HOST_ID"] = f"host-{rank // 2}"
    roots = [os.path.join(tmp, f"shared{r // 2}") for r in range(world)]
    os.makedirs(roots[rank], exist_ok=True)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    sd = _tp_dp_state(mesh, 4.0)
    sd["meta"]["who"] = rank
    _snapshot(rank, world, roots, 4, sd)
    _wipe(rank, roots, {2})  # (rank 2 empties host 1's shared root)
    mesh1 = init_device_mesh("cpu", (4,))
    w = torch.arange(48, dtype=torch.float32).reshape(8, 6) * 4.0
    want = {"model": {"w": distribute_tensor(w, mesh1, [Shard(0)]),
                      "b": distribute_tensor(torch.arange(6, dtype=torch.bfloat16) * 4.0, mesh1, [Shard(0)]),
                      "plain": torch.full((3,), 4.0)}, "meta": {"step": 4, "lr": 0.4, "who": rank}}
    dest = _zeroed(want)
    stats = pipeload.load(dest, _tier(roots[rank]))
    _same(dest, want)
    assert (stats.source, stats.step) == ("tier", 4)
    return {"received": stats.bytes_received, "read": stats.bytes_read}


def test_reshard_with_hosts_of_two_ranks(tmp_path):
    res = run_world(_world4_two_per_host, 4, str(tmp_path), timeout=90)
    assert all(res[r]["received"] == 0 and res[r]["read"] > 0 for r in (0, 1))  # (local reads of the shared root)
    assert all(res[r]["received"] > 0 and res[r]["read"] == 0 for r in (2, 3))
