"""``pipeload.load()`` and ``pipeload.load_async()``: orchestration of one load.

Phases (every rank of the group, in this order; see docs/ARCHITECTURE.md):

1. plan: rank 0 reads ``.metadata`` and broadcasts it; flatten the state dict, resolve ReadItems,
   validate — no destination is touched, problems are collected;
2. exchange: one all-gather of the compact plans (every rank, also one with nothing to load); any
   rank's problem raises on every rank;
3. plan (global part): pure, identical on every rank;
4. groups: resolve or create the broadcast groups, by the same decision on every rank;
5. shared: read-once + broadcast pipeline; 6. private: the rest, per file;
7. teardown: drain, destroy created groups, agree on success — every rank raises the same error.
"""

from __future__ import annotations

import asyncio
import math
import os
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Sequence

import torch

from ._gcpause import paused_gc
from .comm import Comm
from .errors import CheckpointFormatError, DistributedError, PipeloadError, StateDictError
from . import formats
from .metadata import Metadata
from .planner import decode_plan, encode_plan, fqn_index, global_plan, local_plan
from .reader import ChunkReader
from .saver import data_file_name
from .scheduler import Counters, SharedPhase, read_private
from .statedict import flatten, mesh_groups

DEFAULT_BATCH_BYTES = 6 * 2**20
DEFAULT_MAX_INFLIGHT = 8
SPECULATIVE_PREFETCH = 256 << 20  # at most this much of its own file a rank requests while planning


@dataclass
class LoadStats:
    """What one rank's load did. Byte counts are payload bytes of this rank."""

    bytes_read: int = 0  # read from checkpoint files by this rank
    bytes_received: int = 0  # received by broadcast
    broadcasts: int = 0  # data collectives this rank took part in
    shared_shards: int = 0  # this rank's shards loaded through a broadcast (read or received)
    private_shards: int = 0  # this rank's shards it read alone
    objects: int = 0  # Python objects loaded
    files_opened: int = 0  # cold opens of data files
    groups_created: int = 0
    missing_keys: list[str] = field(default_factory=list)  # strict=False: state dict keys not in the checkpoint
    unexpected_keys: list[str] = field(default_factory=list)  # checkpoint keys no rank asked for
    timings: dict[str, float] = field(default_factory=dict)  # plan, exchange, groups, shared, private, teardown
    wall: float = 0.0
    format: str = ""  # layout of the checkpoint: "pipeload", "dcp" or "hf"


class _Clock:
    def __init__(self, timings: dict[str, float]):
        self.timings = timings
        self.last = time.perf_counter()

    def lap(self, phase: str) -> None:
        now = time.perf_counter()
        self.timings[phase] = self.timings.get(phase, 0.0) + now - self.last
        self.last = now


def _prefetch_own_file(reader: ChunkReader, plan, own_file: str) -> None:
    """Start reading, before the plan exchange, what this rank needs from the file it wrote itself.

    Saved and loaded on the same world with the same layout, every rank reads exactly the shards it
    wrote (save and load pick writers and readers with one greedy), so storage starts streaming while
    the ranks are still planning. Otherwise this is a guess that can only be partly wrong: only bytes
    this rank needs, from one file.
    """
    items, total = [], 0
    for it in (it for s in plan.shards for it in s.reads if it.file == own_file):
        if total >= SPECULATIVE_PREFETCH:
            break
        items.append(it)
        total += it.nbytes
    reader.prefetch(items)


def _progress_bar(enabled: bool, rank: int, total: int):
    if not enabled or rank != 0:
        return None
    try:
        from tqdm import tqdm
    except ImportError:  # pragma: no cover - optional dependency
        return None
    return tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, desc="pipeload")


async def load_async(state_dict: dict, checkpoint_dir: str | os.PathLike, **options: Any) -> LoadStats:
    """Fill ``state_dict`` in place from ``checkpoint_dir``; see :func:`load` for the options."""
    with paused_gc():
        return await _load(state_dict, checkpoint_dir, **options)


async def _load(
    state_dict: dict,
    checkpoint_dir: str | os.PathLike,
    *,
    process_group: Any = None,
    use_collectives: bool = True,
    broadcast_replicated_tensors: bool = True,
    broadcast_groups: Sequence[Any] | None = None,
    broadcast_batch_bytes: int = DEFAULT_BATCH_BYTES,
    max_inflight: int = DEFAULT_MAX_INFLIGHT,
    strict: bool = True,
    verify_checksums: bool = False,
    timeout: timedelta | float | None = None,
    progress: bool = False,
    format: str | None = None,
    key_map: formats.KeyMap = None,
    cast: bool = False,
) -> LoadStats:
    if max_inflight < 1:
        raise ValueError("max_inflight must be at least 1")
    if format is not None and format not in formats.FORMATS:
        raise ValueError(f"format must be one of {', '.join(formats.FORMATS)} or None, got {format!r}")
    if broadcast_batch_bytes < 0:
        raise ValueError("broadcast_batch_bytes must be non-negative")
    stats = LoadStats()
    t0 = time.perf_counter()
    clock = _Clock(stats.timings)
    directory = os.fspath(checkpoint_dir)
    comm = Comm(process_group, timeout)
    collective = use_collectives and comm.size > 1
    # Every read runs in one worker thread (it copies onto the broadcast device: make it current).
    device = comm.broadcast_device
    init = (lambda: torch.cuda.set_device(device)) if device.type == "cuda" else None
    with ChunkReader(directory, verify_checksums=verify_checksums) as reader, ThreadPoolExecutor(
        max_workers=1, thread_name_prefix="pipeload-read", initializer=init
    ) as pool:
        # 1. local plan: problems are carried to the exchange, never raised on this rank alone
        request = (format, key_map, cast)
        md, leaves, plan, problems = _local_plan(state_dict, directory, comm, collective, strict, reader, request)
        stats.format = reader.format
        reusable = comm.reusable_sets([*(broadcast_groups or ()), *mesh_groups(leaves)]) if collective else {}
        if not problems and md.world_size == comm.size:
            # in the worker: under a throttled device, queueing the requests blocks for a while
            pool.submit(_prefetch_own_file, reader, plan, data_file_name(md.save_id, comm.rank))
        clock.lap("plan")

        # 2. exchange
        mine = (problems, md.save_id if md else None, encode_plan(plan) if plan else b"", sorted(reusable))
        gathered = comm.all_gather_object(mine, f"pipeload.load from {directory}") if collective else [mine]
        _raise_if_any_failed(gathered, directory)
        clock.lap("exchange")

        # 3. global plan
        names = list(fqn_index(md))  # checkpoint keys in index order (sorted)
        gp = _global_plan(md, names, gathered, comm, collective and broadcast_replicated_tensors,
                          broadcast_batch_bytes)
        stats.missing_keys = list(plan.missing)
        stats.unexpected_keys = [n for i, n in enumerate(names) if i not in gp.requested] if collective else []
        if strict and stats.unexpected_keys:
            raise StateDictError(
                f"pipeload.load from {directory}: keys in the checkpoint that no rank loads (strict=True)",
                stats.unexpected_keys,
            )
        shared = {s.key: s for s in plan.shards if s.key in gp.shared}
        private = [s for s in plan.shards if s.key not in gp.shared]
        stats.shared_shards, stats.private_shards, stats.objects = len(shared), len(private), len(plan.objects)
        clock.lap("plan")

        # 4. groups
        groups, created = comm.make_groups(gp.sets, gp.create, reusable) if collective else ({}, [])
        stats.groups_created = len(created)
        clock.lap("groups")

        # 5-6. shared, then private phase; 7. teardown, also on failure: never leave a group behind
        counters = Counters()
        try:
            my_ops = [op for op in gp.ops if comm.rank in op.members]
            decoded = await _execute(comm, reader, pool, shared, private, plan.objects, groups, my_ops,
                                     counters, max_inflight, progress, clock)
        finally:
            comm.destroy(created)
    error = counters.error_report()
    if collective:
        comm.agree(f"pipeload.load from {directory}", error)
    elif error:
        raise DistributedError(f"pipeload.load from {directory}", {comm.rank: error})
    for obj, value in decoded:
        obj.leaf.container[obj.leaf.key] = value
    stats.bytes_read = reader.bytes_read
    stats.bytes_received = counters.bytes_received
    stats.broadcasts = counters.broadcasts
    stats.files_opened = reader.cache.opens
    clock.lap("teardown")
    stats.wall = time.perf_counter() - t0
    return stats


def _local_plan(state_dict: dict, directory: str, comm: Comm, collective: bool, strict: bool, reader, request):
    """(metadata, leaves, local plan, problems); any exception becomes a problem to gather."""
    md, leaves, plan = None, {}, None
    format, key_map, cast = request
    try:
        ckpt = _shared_checkpoint(directory, comm, format, key_map) if collective else (
            formats.open_checkpoint(directory, format, key_map))
        reader.attach(ckpt, cast=cast)
        md = ckpt.metadata
        leaves = flatten(state_dict)
        if cast:
            md = formats.cast_metadata(md, leaves)
        plan = local_plan(leaves, md, comm.broadcastable, strict=strict)
        return md, leaves, plan, plan.problems
    except Exception as e:  # noqa: BLE001
        return md, leaves, plan, [str(e) if isinstance(e, PipeloadError) else f"{type(e).__name__}: {e}"]


def _shared_checkpoint(directory: str, comm: Comm, format: str | None, key_map) -> formats.Checkpoint:
    """Rank 0 reads the checkpoint's metadata (any layout) and broadcasts it: one read per job.

    The first collective of a load; a rank-0 read error reaches every rank and is raised as a
    problem of each, after the exchange. Every rank decodes the payload itself.
    """
    payload = None
    if comm.rank == 0:
        try:
            payload = formats.read_payload(directory, format)
        except Exception as e:  # noqa: BLE001 - any failure must still reach the broadcast
            payload = e if isinstance(e, PipeloadError) else CheckpointFormatError(f"{directory}: {type(e).__name__}: {e}")
    payload = comm.broadcast_object(payload, f"pipeload.load from {directory}")
    if isinstance(payload, Exception):
        raise payload
    return formats.from_payload(payload, directory, key_map)  # this rank's path: copies per node differ


def _raise_if_any_failed(gathered: list, directory: str) -> None:
    """The same error on every rank when any rank's local plan failed or ranks read different saves."""
    failures = {r: "\n".join(g[0]) for r, g in enumerate(gathered) if g[0]}
    if failures:
        if len(gathered) == 1:
            raise StateDictError(f"pipeload.load from {directory}: cannot load", gathered[0][0])
        raise DistributedError(f"pipeload.load from {directory}: validation", failures)
    if len({g[1] for g in gathered}) > 1:
        raise PipeloadError(
            f"pipeload.load: ranks read different checkpoints from {directory} (it was overwritten during the load)"
        )


def _global_plan(md: Metadata, names: list[str], gathered: list, comm: Comm, broadcast: bool, batch_bytes: int):
    itemsize = {i: md.tensors[n].itemsize for i, n in enumerate(names) if n in md.tensors}
    return global_plan(
        [decode_plan(g[2]) for g in gathered],
        lambda key: math.prod(key[2]) * itemsize[key[0]],
        broadcast=broadcast,
        batch_bytes=batch_bytes,
        reusable=[g[3] for g in gathered],
        can_create=comm.is_world,
    )


async def _execute(comm, reader, pool, shared, private, objects, groups, my_ops, counters, max_inflight,
                   progress, clock) -> list:
    """The shared phase, then the private phase, reading in ``pool``; returns decoded objects."""
    bar = _progress_bar(progress, comm.rank, sum(s.nbytes for s in [*shared.values(), *private]))
    on_bytes = bar.update if bar is not None else None
    try:
        if my_ops:
            phase = SharedPhase(comm, reader, shared, groups, pool, counters, max_inflight, on_bytes)
            await phase.run(my_ops)
        clock.lap("shared")
        loop = asyncio.get_running_loop()
        decoded = await loop.run_in_executor(pool, read_private, reader, private, objects, counters, on_bytes)
        clock.lap("private")
        return decoded
    finally:
        if bar is not None:
            bar.close()


def load(state_dict: dict, checkpoint_dir: str | os.PathLike, **options: Any) -> LoadStats:
    """Load a checkpoint into ``state_dict`` in place; every rank of the group must call it.

    The checkpoint may be pipeload's own, torch.distributed.checkpoint's, or Hugging Face safetensors
    (``format``); all load through the same plan, broadcasts and errors.

    Tensors and DTensor local shards are copied into; Python objects are replaced in their containers.
    Each shard held by several ranks is read from storage once and broadcast to the others while the
    next shards are read. Returns this rank's :class:`LoadStats`.

    Options:
        process_group: the group whose ranks load together (default: the world).
        use_collectives: ``False`` skips the plan exchange and every collective: each rank reads what it
            needs on its own (the safe fallback; ``broadcast_replicated_tensors`` is then ignored).
        broadcast_replicated_tensors: read shared shards once and broadcast them (default ``True``).
        broadcast_groups: process groups the load may reuse for broadcasting (DTensor mesh groups in the
            state dict are reused automatically).
        broadcast_batch_bytes: shards smaller than this are packed into one broadcast (6 MiB).
        max_inflight: broadcasts outstanding at once (8).
        strict: raise listing every state dict key missing from the checkpoint and every checkpoint key
            no rank loads (``False``: report them in the stats).
        verify_checksums: check each stored chunk's xxh3 checksum before using it.
        timeout: for groups the load creates (default: the process group's own timeout).
        progress: a progress bar of loaded bytes on rank 0 (needs tqdm).
        format: the checkpoint's layout: ``"pipeload"``, ``"dcp"`` (torch.distributed.checkpoint) or
            ``"hf"`` (Hugging Face safetensors: one file, an index, or a directory of files); None
            detects it (see :mod:`pipeload.formats`). ``LoadStats.format`` says which was read.
        key_map: renames checkpoint keys before matching them with the state dict: a dict (unlisted
            names kept) or a callable (returning None leaves the key out). ``strict`` sees the new names.
        cast: convert tensors whose stored dtype differs from the destination's while copying
            (default ``False``: a dtype mismatch is an error listing every such tensor).

    Runs the load on uvloop when it is installed. Inside a running event loop use
    ``await pipeload.load_async(...)`` instead.
    """
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        pass
    else:
        raise PipeloadError(
            "pipeload.load() was called from a running event loop; use `await pipeload.load_async(...)` there"
        )
    coro = load_async(state_dict, checkpoint_dir, **options)
    try:
        import uvloop
    except ImportError:
        return asyncio.run(coro)
    loop = uvloop.new_event_loop()
    try:
        return loop.run_until_complete(coro)
    finally:
        loop.run_until_complete(loop.shutdown_asyncgens())
        loop.close()
