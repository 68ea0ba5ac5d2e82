"""``pipeload.load()`` and ``pipeload.load_async()``: orchestration of one load.

Phases (every rank of the group, in this order; see docs/ARCHITECTURE.md):

1. plan: rank 0 reads ``.metadata`` and broadcasts it; flatten the state dict, resolve ReadItems,
   validate — no destination is touched, problems are collected;
2. exchange: one all-gather of a fixed-size row per rank, then each distinct plan record once
   (:mod:`pipeload.plan.exchange`; every rank, also one with nothing to load); any rank's problem raises on
   every rank. (Before 1, four words per rank decide plan reuse, refuse concurrent loads and options that
   differ between ranks, and tell whether anything can be broadcast: if not, the records never move.)
3. plan (global part): pure, identical on every rank (:mod:`pipeload.plan.globalplan`);
4. groups: resolve or create the broadcast groups, by the same decision on every rank;
5. shared: read-once + broadcast pipeline; 6. private: the rest, per file;
7. teardown: drain, destroy created groups, agree on success — every rank raises the same error.
"""

from __future__ import annotations

import asyncio
import atexit
import os
import pickle
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Sequence

import numpy as np
import torch

from .. import device as devices
from ..plan import plancache
from . import delivery, stateful
from ._busy import CONTENDED, Guard, refuse_contended_or_disagreeing
from ._gcpause import paused_gc
from .comm import Comm
from ..errors import CheckpointFormatError, DistributedError, PipeloadError, StateDictError
from ..plan.exchange import (F_FLAGS, F_SAVE, FLAG_PROBLEMS, FLAG_RESHARDED, classes, decode_record, encode_record, hash64,
                             host_id, make_row, record_transfer)
from ..plan import keyowners, storageorder
from ..plan.globalplan import GlobalPlan, global_plan
from .. import formats
from ..io import storage
from ..formats.metadata import Metadata
from ..plan.chunkunits import chunk_table
from ..plan.planner import (Binding, fqn_index, local_plan, piece_shard, plan_record, resharded, stored_dtype, unbind,
                            unit_pieces)
from ..formats.chunks import box_span
from ..io.reader import ChunkReader
from ..save.saver import data_file_name
from .scheduler import Counters, SharedPhase, fill_twins, read_private
from ..plan.statedict import Leaf, check_top, flatten, load_target, mesh_groups, meshes_of

DEFAULT_BATCH_BYTES = 6 * 2**20
DEFAULT_MAX_INFLIGHT = 8
# At most this much of what it will read itself a rank requests while planning (its own file, loaded
# as saved; the start of its region, readers by storage position): enough to keep storage busy until
# the shared phase's own prefetch takes over (shared storage at 200 MiB/s serves 4 ranks ~8 MiB each in
# 0.15 s of planning). More was measured slower, not faster: 64 MiB of its own file cost a rank 16 ms
# of CPU in the planning every rank waits for, and 16 MiB of its region made a 253 MiB Hugging Face
# load 10-15 % slower than 8 MiB (pipeload bench --format hf, medians of 9 runs).
SPECULATIVE_PREFETCH = 8 << 20


@dataclass
class LoadStats:
    """What one rank's load did. Byte counts are payload bytes of this rank."""

    bytes_read: int = 0  # read from checkpoint files by this rank
    bytes_received: int = 0  # received by broadcast
    broadcasts: int = 0  # data collectives this rank took part in
    shared_shards: int = 0  # this rank's shards loaded through a broadcast (read or received)
    # stored chunks this rank needs parts of that were read once, by one rank, and broadcast whole (or
    # in row ranges) to every rank needing part of them; and the bytes of storage that saved this rank
    # (the spans its boxes of those chunks cover, less what it read of them; negative on a reader)
    chunk_units: int = 0
    chunk_bytes_saved: int = 0
    private_shards: int = 0  # this rank's shards it read alone
    # part delivery (option part_delivery): page parts this rank sent (as a page's owner) or received
    # instead of reading their page, and the bytes it sent and received for them, point to point
    pages_delivered: int = 0
    part_bytes_sent: int = 0
    part_bytes_received: int = 0
    objects: int = 0  # Python objects loaded
    files_opened: int = 0  # cold opens of data files
    groups_created: int = 0
    missing_keys: list[str] = field(default_factory=list)  # strict=False: state dict keys not in the checkpoint
    unexpected_keys: list[str] = field(default_factory=list)  # checkpoint keys no rank asked for
    timings: dict[str, float] = field(default_factory=dict)  # plan, exchange, groups, shared, private, teardown
    wall: float = 0.0
    plan_reused: bool = False  # the plan of an earlier load of the same checkpoint and tensors was reused
    format: str = ""  # layout of the checkpoint: "pipeload", "dcp" or "hf"
    # object storage (s3:// and other URLs), this rank's process during the load; 0 for local files
    requests: int = 0  # GET/HEAD/LIST requests sent, retries included
    bytes_fetched: int = 0  # body bytes received from the store (staged parts, headers, metadata)
    retries: int = 0
    throttled: int = 0  # answers 503 SlowDown
    max_inflight_requests: int = 0  # most requests in flight at once
    # a load from a memory tier (pipeload.load(sd, tier, fallback=...)): "tier" or "fallback" ("" otherwise),
    # and the step restored from the tier (-1: from the fallback, or a plain load)
    source: str = ""
    step: int = -1


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
    this rank needs, from one file. Not made when a shard this rank holds is over half its own file's
    bytes: the plan then cuts that shard's holder set into contiguous runs (pipeload.plan.globalplan,
    stream cutting) which the save's writers did not follow, and the guess would read other readers' runs.
    From objects the guess is the file's first shards only, one range: the smaller shards further on,
    asked for now, would leave gaps that become GETs of their own when the rest is asked for
    (:func:`pipeload.engine.delivery.own_ranges`).
    """
    try:
        f = reader.file(own_file)
        share = f.size - f.data_offset
    except Exception:  # noqa: BLE001 - a hint only (this rank may have written no file)
        return
    if any(2 * s.nbytes > share for s in plan.shards):
        return
    whole, items, total = [], [], 0
    prefix = storage.is_url(reader.directory)  # (objects: a GET a range; the rest is asked for as one later)
    for s in plan.shards:  # (in the worker, holding the GIL the planning thread needs: no key built in vain)
        if total >= SPECULATIVE_PREFETCH:
            break
        if total + s.nbytes > SPECULATIVE_PREFETCH:  # a guess never asks for more than its budget: a shard
            if prefix:  # larger than what is left (a 110 MiB embedding) may be cut among readers by the plan
                break
            continue
        file = s.exact_file
        if file is not None:  # the usual case: no ReadItem is built for it before it is read
            if file == own_file:
                whole.append(s.exact_key())
                total += s.nbytes
            continue
        for it in s.reads:  # (a strided box's span is not what it needs: left to its reader, or a unit)
            if it.file == own_file and _contiguous(it):
                items.append(it)
                total += it.nbytes
    reader.prefetch(items, whole={own_file: whole} if whole else None)


def _prefetch_region(reader: ChunkReader, shards: list) -> None:
    """Start reading, before the plan exchange, the first shards of this rank's region when readers are
    preferred by storage position (:func:`pipeload.plan.storageorder.speculative` chose them): what the
    plan will make it read itself, in the order its broadcasts take them."""
    whole: dict[str, list[str]] = {}
    for s in shards:
        if s.exact_file is not None:
            whole.setdefault(s.exact_file, []).append(s.exact_key())
    reader.prefetch([it for s in shards if s.exact_file is None for it in s.reads], whole=whole or None)


def _request_early(workers, reader: ChunkReader, plan, md, ckpt, comm: Comm, directory: str, sharing: bool,
                   moved: bool) -> None:
    """Ask storage, while the plan is exchanged, for bytes this rank will surely read: the start of its
    region (readers by storage position, ``sharing``: something may be broadcast) from the early-request
    thread, or (loaded as saved) its own file from the read worker. ``workers``: (read worker, that thread)."""
    pool, ahead = workers
    if ckpt.by_position:
        if sharing and not storage.is_url(directory) and storageorder.applies(md, comm.size):
            # (objects: a guess the balance cap overrules would cost GETs of bytes nobody here reads)
            early = storageorder.speculative(plan, md, comm.size, comm.rank, SPECULATIVE_PREFETCH)
            for name in sorted({s.exact_file or s.reads[0].file for s in early}):
                reader.file(name)  # opened here: two threads must not both open one file
            if early:
                ahead.submit(_prefetch_region, reader, early)
    elif md.world_size == comm.size and not moved:
        pool.submit(_prefetch_own_file, reader, plan, data_file_name(md.save_id, comm.rank))


def _contiguous(it) -> bool:
    """Whether a ReadItem's box is one contiguous range of its stored chunk."""
    if not it.nbytes:
        return False
    lo, hi = box_span(it.chunk_lengths, it.src_offsets, it.lengths, it.nbytes // max(1, int(np.prod(it.lengths))))
    return hi - lo == it.nbytes


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
    state_dict = load_target(state_dict)  # (a list of Slices: a dict of them)
    if not isinstance(checkpoint_dir, (str, os.PathLike)) and _is_tier(checkpoint_dir):
        from ..tier.restore import restore  # the tier's only door into the engine, and back (fallback)

        fallback = options.pop("fallback", None)
        return await restore(state_dict, checkpoint_dir, fallback, LoadStats, load_async, options)
    state_dict, stateful_values = stateful.expand(state_dict)  # Stateful values: pipeload/stateful.py
    with paused_gc(), Guard() as guard:
        stats = await _load(state_dict, checkpoint_dir, guard, **options)
    stateful.finish(stateful_values)  # only after a successful load
    return stats


def _is_tier(location: Any) -> bool:
    from ..tier import MemoryTier

    return isinstance(location, MemoryTier)


@dataclass
class _Prepared:
    """Everything steps 1-4 decide for one rank; what a reused plan runs again."""

    plan: Any  # LocalPlan
    gp: GlobalPlan
    shared: dict  # piece key -> DestShard
    private: list
    groups: dict
    created: list
    missing: list[str]
    unexpected: list[str]
    rows: np.ndarray | None = None  # the exchange rows: the plan-cache token hashes them
    stat: tuple = ()  # of the checkpoint's metadata file(s) when they were read
    ckpt: Any = None  # the formats.Checkpoint the reader serves
    signature: tuple = ()  # plancache.signature of the state dict it was planned for (when it may be kept)
    leaf_pos: list = field(default_factory=list)  # each shard's, then each object's leaf position (kept plans)
    binding: Binding | None = None  # where a kept plan's shards find the tensors of the load it serves
    cut: list = field(default_factory=list)  # (piece, its shard) of every shared shard cut into pieces
    skip: set = field(default_factory=set)  # stored chunks (file, key) chunk units deliver: no private read
    units: tuple = (0, 0)  # (chunk units this rank is in, storage bytes they saved it)
    deliveries: list = field(default_factory=list)  # part delivery: this rank's (pipeload.plan.partdelivery)
    located: list = field(default_factory=list)  # chunk positions other readers found (delivery.Planned)


@dataclass(frozen=True)
class _Options:
    """The options of one load (see :func:`load`), validated once."""

    process_group: Any = None
    use_collectives: bool = True
    broadcast_replicated_tensors: bool | str = "auto"
    broadcast_groups: Sequence[Any] | None = None
    broadcast_batch_bytes: int = DEFAULT_BATCH_BYTES
    max_inflight: int = DEFAULT_MAX_INFLIGHT
    strict: bool | str = True
    verify_checksums: bool = False
    timeout: timedelta | float | None = None
    progress: bool = False
    reuse_plan: bool = True
    format: str | None = None
    key_map: formats.KeyMap = None
    cast: bool = False
    storage_options: dict | None = None
    h2d_ring_bytes: int = devices.DEFAULT_H2D_RING_BYTES
    part_delivery: str = "auto"
    # a caller's reason to refuse this rank's part, raised at planning like a problem of the state dict
    # (the DCP switch's: what the engine would serve differently from DCP; see pipeload.dcp.load)
    _refusal: str | None = None

    def __post_init__(self) -> None:
        if self.max_inflight < 1:
            raise ValueError("max_inflight must be at least 1")
        if self.h2d_ring_bytes < 0:
            raise ValueError("h2d_ring_bytes must be non-negative")
        if self.format is not None and self.format not in formats.FORMATS:
            raise ValueError(f"format must be one of {', '.join(formats.FORMATS)} or None, got {self.format!r}")
        if self.broadcast_replicated_tensors not in (True, False, "auto"):
            raise ValueError("broadcast_replicated_tensors must be True, False or 'auto', "
                             f"not {self.broadcast_replicated_tensors!r}")
        if self.part_delivery not in ("auto", "off"):
            raise ValueError(f"part_delivery must be 'auto' or 'off', not {self.part_delivery!r}")
        if self.broadcast_batch_bytes < 0:
            raise ValueError("broadcast_batch_bytes must be non-negative")
        if self.strict != "missing":
            if self.strict not in (True, False):
                raise ValueError(f"strict must be True, False or 'missing', not {self.strict!r}")
            object.__setattr__(self, "strict", bool(self.strict))

    @property
    def agreed(self) -> tuple:
        """What every rank must pass alike: these decide which collectives the load issues."""
        return (self.broadcast_replicated_tensors, self.broadcast_batch_bytes, self.strict, self.part_delivery)

    @property
    def planned(self) -> tuple:
        """What a kept plan was made for (a later load reuses it only with the same)."""
        key_map = id(self.key_map) if self.key_map is not None else None
        return (*self.agreed, tuple(id(g) for g in self.broadcast_groups or ()), self.format, key_map,
                bool(self.cast))


@dataclass
class _Run:
    """One load on one rank: where it reads, who takes part, what it reports."""

    directory: str
    comm: Comm
    collective: bool  # collectives on (and more than one rank)
    host: int
    guard: Guard
    stats: LoadStats = field(default_factory=LoadStats)
    clock: _Clock = None  # type: ignore[assignment]
    fetched: dict = field(default_factory=dict)  # the object-store counters when the load started

    def __post_init__(self) -> None:
        self.clock = _Clock(self.stats.timings)

    @property
    def what(self) -> str:
        return f"pipeload.load from {self.directory}"


@dataclass
class _Start:
    """What the first gather decided: a reused plan (or None), the plan-cache key this load may keep its
    plan under, whether no shard is broadcast, and rank 0's metadata if it was read before the gather."""

    prep: _Prepared | None = None
    cache_key: tuple | None = None
    private_only: bool = False
    sent: tuple = (-1, None)


async def _load(state_dict: dict, checkpoint_dir: str | os.PathLike, guard: Guard, **options: Any) -> LoadStats:
    """One load, as its steps: the first gather (reuse), the plan (local, exchange, global, groups) unless
    reused, the shared and private phases, the agreement, then the plan kept for the next load."""
    check_top(state_dict)
    opts = _Options(**options)
    t0 = time.perf_counter()
    comm = Comm(opts.process_group, opts.timeout)
    run = _Run(os.fspath(checkpoint_dir), comm, opts.use_collectives and comm.size > 1, host_id(), guard)
    storage.configure(run.directory, opts.storage_options)
    run.fetched = storage.counters(reset_peak=True)
    contended = await guard.enter(comm, run.collective, run.what)  # see _busy.py
    # Every read runs in one worker thread (it copies onto the broadcast device: make it current).
    device = comm.broadcast_device
    init = (lambda: devices.set_current(device)) if device.type != "cpu" else None
    # Early requests of a rank's region go from a thread of their own (under a throttled device queueing
    # them blocks, and the first read of the shared phase must not wait for that); those of its own file
    # from the read worker, before its first read (as measured, and one thread opens the file).
    with ChunkReader(run.directory, verify_checksums=opts.verify_checksums) as reader, ThreadPoolExecutor(
        max_workers=1, thread_name_prefix="pipeload-read", initializer=init
    ) as pool, ThreadPoolExecutor(max_workers=1, thread_name_prefix="pipeload-ahead") as ahead:
        # host -> accelerator copies through page-locked slots (none unless the accelerator is in use)
        reader.ring = devices.ring_for(devices.in_use(), opts.h2d_ring_bytes)
        start = await _first_gather(run, opts, state_dict, reader, contended) if run.collective else _Start(
            private_only=opts.broadcast_replicated_tensors is False)
        prep = start.prep or _prepare(
            state_dict, run.directory, comm, run.collective, opts.strict, opts.broadcast_replicated_tensors,
            opts.broadcast_batch_bytes, opts.broadcast_groups, reader, (pool, ahead), run.clock,
            (opts.format, opts.key_map, opts.cast), keepable=start.cache_key is not None,
            private_only=start.private_only, sent=start.sent, host=run.host, refusal=opts._refusal,
            part_delivery=opts.part_delivery == "auto" and not opts.cast)  # (cast: read whole, see load)
        _count_plan(run.stats, prep, reader)
        counters = Counters()
        decoded = await _execute_and_agree(run, opts, prep, reader, pool, counters, start.cache_key)
    for obj, value in decoded:
        obj.leaf.container[obj.leaf.key] = value
    for leaf, tensor in prep.plan.adopted:  # meta leaves: the tensors loaded in their place
        leaf.container[leaf.key] = tensor
    if start.cache_key is not None and not prep.plan.adopted:  # (a plan for meta leaves is never reused)
        _keep(prep, start.cache_key, comm, opts, reused=run.stats.plan_reused)
    return _finish(run, reader, counters, t0)


async def _first_gather(run: _Run, opts: _Options, state_dict: dict, reader: ChunkReader,
                        contended: str | None) -> _Start:
    """The first collective of every collective load: four words per rank.

    They say whether a plan every rank still holds can be reused (the same non-zero token everywhere),
    refuse on every rank alike a load that ran concurrently with another on an overlapping group (in any
    rank's process: see _busy.py) or with options that differ between ranks, whether the ranks share one
    host (then, under gloo and the default policy, no shard will be broadcast), and the size of the
    metadata rank 0 will send when it offered no plan (it read it already: one broadcast of known size).
    """
    comm, start = run.comm, _Start(private_only=opts.broadcast_replicated_tensors is False)
    entry, found = None, None
    if opts.reuse_plan and not contended and not storage.is_url(run.directory):  # (versions pinned per plan)
        # this rank's host is part of the key (not of the token, which all ranks share): it decides
        # which shards are broadcast, and PIPELOAD_HOST_ID may change between loads
        start.cache_key = plancache.key(comm.global_ranks, run.directory, (*opts.planned, run.host))
        entry, found = _cached(start.cache_key, comm, run.directory, state_dict)
    offer = CONTENDED if contended else entry.token if entry is not None else 0
    early = _metadata_bytes(run.directory, opts.format) if comm.rank == 0 and offer == 0 else None
    tokens, reuse = None, False
    try:
        agreed = repr((opts.agreed, comm.broadcast_device.type)).encode()  # the device decides collectives too
        gathered = comm.start_gather_rows(np.array([offer, run.host, hash64(agreed),
                                                    len(early) if early is not None else -1], dtype=np.int64),
                                          run.what)
        if entry is not None:  # while the other ranks' words arrive
            _rebind(entry.state, *found)
        run.clock.lap("plan")
        first = gathered()
        tokens = first[:, 0]
        reuse = offer != 0 and bool(np.all(tokens == offer))
    finally:
        if entry is not None and not reuse:
            _strip(entry.state)  # replaced by this load's plan, or dropped: never holds our tensors
    refuse_contended_or_disagreeing(run.what, first[:, 0] == CONTENDED, first[:, 2], contended,
                                    "broadcast_replicated_tensors, broadcast_batch_bytes, strict or part_delivery "
                                    "options (or "
                                    "broadcast device: the group's backend and accelerator)")
    if reuse:
        start.prep = entry.state
        reader.attach(start.prep.ckpt, cast=opts.cast)
        run.stats.plan_reused = True
    one_host = len(np.unique(first[:, 1])) == 1
    start.private_only = start.private_only or (opts.broadcast_replicated_tensors == "auto" and one_host
                                                and comm.broadcast_device.type == "cpu")
    start.sent = (int(first[0, 3]), early)
    run.clock.lap("exchange")
    return start


def _count_plan(stats: LoadStats, prep: _Prepared, reader: ChunkReader) -> None:
    stats.format = reader.format
    stats.chunk_units, stats.chunk_bytes_saved = prep.units
    stats.missing_keys, stats.unexpected_keys = list(prep.missing), list(prep.unexpected)
    stats.shared_shards = len(prep.plan.shards) - len(prep.private)
    stats.private_shards, stats.objects = len(prep.private), len(prep.plan.objects)
    stats.groups_created = 0 if stats.plan_reused else len(prep.created)


async def _execute_and_agree(run: _Run, opts: _Options, prep: _Prepared, reader: ChunkReader, pool,
                             counters: Counters, cache_key: tuple | None) -> list:
    """The shared and private phases, then the agreement every rank raises alike from; on any failure the
    plan is forgotten and the groups this load created are destroyed (never left behind)."""
    comm, keep = run.comm, False
    try:
        decoded = await _execute(comm, reader, pool, prep.shared, prep.private, prep.plan.objects, prep.groups,
                                 prep.gp, counters, opts.max_inflight, opts.progress, run.clock, prep.skip,
                                 prep.plan.twins, prep.deliveries, prep.located)
        error = counters.error_report() or run.guard.late(comm)
        if run.collective:
            comm.agree(run.what, error)
        elif error:
            raise DistributedError(run.what, {comm.rank: error})
        keep = True
        return decoded
    finally:
        if not keep:
            if cache_key is not None:
                plancache.drop(cache_key, comm.destroy)
            if not run.stats.plan_reused:
                comm.destroy(prep.created)


def _keep(prep: _Prepared, cache_key: tuple, comm: Comm, opts: _Options, reused: bool) -> None:
    """Keep a successful load's plan (and groups) for the next load; it holds none of this load's tensors."""
    if not reused:
        _attach(prep)
        token = plancache.token_of(prep.rows, opts.planned)
        plancache.store(cache_key, plancache.Entry(comm.pg, prep.stat, prep.signature, token, prep, prep.created),
                        comm.destroy)
    _strip(prep)  # a kept plan never holds the state dict's tensors (also after it was reused)


def _finish(run: _Run, reader: ChunkReader, counters: Counters, t0: float) -> LoadStats:
    stats = run.stats
    stats.bytes_read = reader.bytes_read
    stats.bytes_received = counters.bytes_received
    stats.broadcasts = counters.broadcasts
    stats.pages_delivered = counters.pages_delivered
    stats.part_bytes_sent, stats.part_bytes_received = counters.part_bytes_sent, counters.part_bytes_received
    stats.files_opened = reader.cache.opens
    _storage_stats(stats, run.fetched)
    run.clock.lap("teardown")
    stats.wall = time.perf_counter() - t0
    return stats


def _storage_stats(stats: LoadStats, before: dict[str, int]) -> None:
    """The object-store counters this load added (the process's counters are cumulative)."""
    now = storage.counters()
    stats.requests = now["requests"] - before["requests"]
    stats.bytes_fetched = now["bytes_fetched"] - before["bytes_fetched"]
    stats.retries = now["retries"] - before["retries"]
    stats.throttled = now["throttled"] - before["throttled"]
    stats.max_inflight_requests = now["max_inflight"]


def _strip(prep: _Prepared) -> None:
    """Drop every reference a kept plan holds to the state dict (its tensors may be large, and freed).

    Each shard and cut piece keeps where the next load's tensor lies (:func:`_attach`), so a load that
    reuses the plan binds it in one step (:func:`_rebind`) and each tensor is found when first used.
    """
    unbind(prep.plan.shards)
    unbind([twin for _, twin, _ in prep.plan.twins])
    unbind([piece for piece, _ in prep.cut])
    for obj in prep.plan.objects:
        obj.leaf = None
    if prep.binding is not None:
        prep.binding.values = None


def _attach(prep: _Prepared) -> None:
    """Before a plan is first kept: each shard learns its leaf position, each cut piece its shard's and its
    rows (the shared pieces stay: an uncut one is its shard itself)."""
    binding = prep.binding = Binding()
    for shard, i in zip([*prep.plan.shards, *(twin for _, twin, _ in prep.plan.twins)], prep.leaf_pos):
        shard.leaf = (binding, i, 0, None)
    for piece, shard in prep.cut:
        piece.leaf = (binding, shard.leaf[1], piece.key[1][0] - shard.key[1][0], piece.key[2][0])


def _rebind(prep: _Prepared, values: list, homes: dict) -> None:
    """Point a kept plan at this load's tensors and containers: ``values``/``homes`` are the leaves of a
    state dict whose signature matched (same containers, keys, boxes, dtypes), so each is where it was."""
    prep.binding.values = values
    for obj, i in zip(prep.plan.objects, prep.leaf_pos[len(prep.plan.shards) + len(prep.plan.twins):]):
        obj.leaf = Leaf(obj.fqn, *homes[i], values[i])


def _cached(cache_key, comm: Comm, directory: str, state_dict: dict):
    """(the cached plan this rank may offer or None, the state dict's leaves: plancache.signature's values
    and homes)."""
    if not plancache.holds(cache_key):  # nothing to offer: the full path flattens the state dict itself
        return None, None
    try:
        found = plancache.lookup(cache_key, comm.pg, plancache.checkpoint_stat(directory), state_dict)
    except Exception:  # noqa: BLE001 - the full path reports what is wrong with the state dict
        return None, None
    return found if found is not None else (None, None)


def _prepare(state_dict, directory, comm, collective, strict, broadcast_replicated_tensors, batch_bytes,
             broadcast_groups, reader, workers, clock, request, keepable: bool = False,
             private_only: bool = False, sent: tuple = (-1, None), host: int | None = None,
             refusal: str | None = None, part_delivery: bool = False) -> _Prepared:
    """Steps 1-4: local plan, exchange, global plan, groups (every rank, every collective in order).

    ``part_delivery``: plan this rank's page deliveries too (:func:`_deliveries`; no collective, only
    point-to-point messages between the readers of one DCP blob).

    ``private_only`` (every rank decided it alike from the first gather): no shard will be broadcast,
    so the exchange stops after the rows and the union of requested keys (see :func:`exchange_and_plan`).
    """
    stat = plancache.checkpoint_stat(directory)
    # 1. local plan: problems are carried to the exchange, never raised on this rank alone
    md, leaves, plan, problems, ckpt = _local_plan(state_dict, directory, comm, collective, strict, reader, request,
                                                   sent)
    if refusal:
        problems = [*problems, refusal]
    reusable = (comm.reusable_groups([*(broadcast_groups or ()),
                                      *mesh_groups(plan.meshes if plan is not None else meshes_of(leaves))])
                if collective and not private_only else {})
    moved = plan is not None and resharded(plan.shards)  # (its own file was written for another layout)
    if not problems:
        _request_early(workers, reader, plan, md, ckpt, comm, directory, collective and not private_only, moved)
    clock.lap("plan")

    # 2-3. exchange and global plan
    names = list(fqn_index(md)) if md else []  # checkpoint keys in index order (sorted)
    width = md.width() if md else 0
    record = plan_record(plan, width) if plan else encode_record([], [], [], [], [], width)
    rows_seen: list[np.ndarray] = []
    # without collectives this rank plans alone, as rank 0 of a world of one
    gp = exchange_and_plan(comm if collective else None, comm.rank if collective else 0,
                           comm.size if collective else 1, md, names, record, problems,
                           list(reusable), directory=directory,
                           broadcast=collective and broadcast_replicated_tensors is not False,
                           batch_bytes=batch_bytes, can_create=comm.is_world, global_ranks=comm.global_ranks,
                           clock=clock, rows_out=rows_seen, private_only=private_only,
                           same_host_private=broadcast_replicated_tensors == "auto" and comm.broadcast_device.type == "cpu",
                           host=host, resharded=moved, by_position=ckpt is not None and ckpt.by_position,
                           part_reads=part_delivery and collective and broadcast_replicated_tensors is not False)
    unexpected = []
    if collective:
        unasked = np.ones(len(names), dtype=bool)
        unasked[gp.requested] = False  # (np.setdiff1d sorts both: 0.7 ms on 3,230 keys)
        unexpected = [names[i] for i in np.flatnonzero(unasked).tolist()]
    if strict is True and unexpected:
        raise _refused(StateDictError(
            f"pipeload.load from {directory}: keys in the checkpoint that no rank loads (strict=True)", unexpected
        ))
    shared, private, cut = {}, [], []
    pieces_of = gp.pieces
    units, skip, spanned = unit_pieces(plan.shards, pieces_of, names, lambda i: stored_dtype(md, names[i]))
    shared.update(units)
    read_units = sum(u.nbytes for op in gp.ops if op.reader == comm.rank for k in op.shards
                     if (u := units.get(k)) is not None)
    for s in plan.shards:
        pieces = pieces_of.get(s.key)
        if pieces is None:
            private.append(s)
        elif len(pieces) == 1 and pieces[0] == s.key:  # not striped: the piece is the shard
            shared[s.key] = s
        else:
            for pk in pieces:
                piece = shared[pk] = piece_shard(s, pk)
                if piece is not s:
                    cut.append((piece, s))
    planned = _deliveries(workers[0], gp, md, names, reader, comm, rows_seen, shared, private, skip)
    clock.lap("plan")

    # 4. groups
    groups, created = comm.make_groups(gp.sets, reusable) if collective else ({}, [])
    clock.lap("groups")
    prep = _Prepared(plan, gp, shared, private, groups, created, list(plan.missing), unexpected,
                     rows_seen[0] if rows_seen else None, stat, ckpt, cut=cut, skip=skip,
                     units=(len({k for k in pieces_of if k[0] < 0}), spanned - read_units), **planned._asdict())
    if keepable:  # taken now, as planned: an object a later load replaces is a leaf in it either way
        prep.signature = plancache.signature(state_dict)[0]
        prep.leaf_pos = plancache.leaf_positions(leaves, [*plan.leaf_paths(), *(o.fqn for o in plan.objects)])
    return prep


def _deliveries(pool, gp, md, names: list[str], reader, comm, rows_seen: list, shared, private,
                skip) -> delivery.Planned:
    """This rank's page deliveries (:func:`pipeload.engine.delivery.plan`) when the plan lists every rank's
    reads (else none; from objects, the ranges this rank reads: :func:`~pipeload.engine.delivery.own_ranges`),
    planned in the read worker: it opens files, after the worker's early request of this rank's own file,
    never beside it."""
    planned = gp.every is not None and rows_seen
    if not planned and not storage.is_url(reader.directory):
        return delivery.Planned([], [])
    mine = list(_my_reads(comm.rank, shared, private, gp.ops, skip))
    if not planned:  # objects: this rank's own ranges, asked for at once
        reader.runs = pool.submit(delivery.own_ranges, reader, mine).result()
        return delivery.Planned([], [])
    return pool.submit(delivery.plan, gp, md, names, reader, comm, rows_seen[0], mine).result()


def _local_plan(state_dict: dict, directory: str, comm: Comm, collective: bool, strict: bool, reader, request,
                sent: tuple = (-1, None)):
    """(metadata, leaves, local plan, problems, checkpoint); any exception becomes a problem to gather."""
    md, leaves, plan, ckpt = None, {}, None, None
    format, key_map, cast = request
    try:
        ckpt = _shared_checkpoint(directory, comm, format, key_map, sent) if collective else (
            formats.open_checkpoint(directory, format, key_map))
        reader.attach(ckpt, cast=cast)
        md = ckpt.metadata
        leaves = flatten(state_dict)
        if cast:
            md = formats.cast_metadata(md, leaves)
        plan = local_plan(leaves, md, comm.broadcastable, strict=strict, writer_of=ckpt.writer_of)
        if ckpt.by_position and collective:
            storageorder.place(plan, md, comm.size)
        return md, leaves, plan, plan.problems, ckpt
    except Exception as e:  # noqa: BLE001
        return md, leaves, plan, [str(e) if isinstance(e, PipeloadError) else f"{type(e).__name__}: {e}"], ckpt


def _metadata_bytes(directory: str, format: str | None) -> bytes:
    """Rank 0's metadata for everyone, pickled: the layout's payload, or the error reading it raised (which
    then reaches every rank, as a problem of each, after the exchange)."""
    try:
        payload = formats.read_payload(directory, format, headers=True)
    except Exception as e:  # noqa: BLE001 - any failure must still reach the broadcast
        payload = e if isinstance(e, PipeloadError) else CheckpointFormatError(f"{directory}: {type(e).__name__}: {e}")
    try:
        return pickle.dumps(payload, protocol=pickle.HIGHEST_PROTOCOL)
    except Exception as e:  # noqa: BLE001 - an error that does not pickle still travels as text
        return pickle.dumps(CheckpointFormatError(f"{directory}: {type(e).__name__}: {e}"))


def _shared_checkpoint(directory: str, comm: Comm, format: str | None, key_map,
                       sent: tuple = (-1, None)) -> formats.Checkpoint:
    """Rank 0 reads the checkpoint's metadata (any layout) and broadcasts it: one read per job.

    ``sent``: (its size, and on rank 0 its bytes) when rank 0 read it before the first gather, which
    carried the size: one broadcast. Otherwise (rank 0 offered a plan that was not reused) it is read
    now and sent with its size. Every rank decodes the payload itself, against its own path (copies per
    node differ); format 2's chunk index is mapped by each rank, which reads only the chunks its boxes
    need. A rank-0 read error reaches every rank and is raised as a problem of each, after the exchange.
    """
    size, data = sent
    what = f"pipeload.load from {directory}"
    if size < 0:
        data = _metadata_bytes(directory, format) if comm.rank == 0 else None
        size = int(comm.gather_rows(np.array([len(data) if data is not None else 0], dtype=np.int64), what,
                                    "all-gather of the metadata size")[0, 0])
    payload = pickle.loads(comm.broadcast_bytes(data, size, what))
    if isinstance(payload, Exception):
        raise payload
    return formats.from_payload(payload, directory, key_map)


def exchange_and_plan(ex, rank: int, world: int, md: Metadata | None, names: list[str], record: bytes,
                      problems: list[str], groups: list[int], *, directory: str, broadcast: bool,
                      batch_bytes: int, can_create: bool, global_ranks=None, clock=None,
                      on_phase=None, rows_out: list | None = None, same_host_private: bool = False,
                      everything: bool = False, private_only: bool = False, host: int | None = None,
                      resharded: bool = False, by_position: bool = False, part_reads: bool = False) -> GlobalPlan:
    """Steps 2-3 of a load on one rank: the exchange through ``ex`` and this rank's global plan.

    ``ex`` is the load's :class:`~pipeload.engine.comm.Comm` (or the simulated exchange of
    :mod:`pipeload.tools.simulate`; ``None``: no collectives, a world of one). It must provide
    ``gather_rows``, ``transfer_records`` and ``all_gather_object`` (and ``union`` for ``private_only``).
    Any rank's problem raises the same error on every rank; ranks that read different saves raise too.
    Which way the records go is read from the rows (every rank alike): each distinct record to every
    rank, or, when that is many bytes (``R = 1``), only shard keys, to their key owners
    (:mod:`pipeload.plan.keyowners`, which also needs ``all_to_all``; it falls back here when some rank's
    component is more than its one holder set).
    ``host``: this rank's :func:`~pipeload.plan.exchange.host_id` (None: read here). ``resharded``: some box
    of this rank is not exactly one stored chunk (its row says so; when any row does, the global plan
    looks for chunk units, and other layouts' holder sets read by runs of storage:
    :mod:`pipeload.plan.chunkunits`, :mod:`pipeload.plan.storageorder`; ``part_reads``: every rank's reads,
    :attr:`GlobalPlan.every`). ``by_position``: readers by storage position (alike), broadcasts in region order.

    ``private_only``: every rank knows no shard will be broadcast (all on one host under gloo and the
    default policy, or broadcasting off), so nobody needs another rank's record: after the rows, one
    all-reduce of a byte per checkpoint key tells which keys some rank loads (``strict``), and the plan
    is "each rank reads what it needs" — what the global plan would decide, without computing it.
    """
    what = f"pipeload.load from {directory}"
    row = make_row(record=record, save_id=md.save_id if md else None, problems=bool(problems),
                   host=host_id() if host is None else host, groups=groups, resharded=resharded)
    rows = ex.gather_rows(row, what) if ex is not None else row.reshape(1, -1)
    if np.any(rows[:, F_FLAGS] & FLAG_PROBLEMS):
        gathered = ex.all_gather_object(problems, what) if ex is not None else [problems]
        failures = {r: "\n".join(p) for r, p in enumerate(gathered) if p}
        if len(gathered) == 1:
            raise _refused(StateDictError(f"{what}: cannot load", gathered[0]))
        raise _refused(DistributedError(f"{what}: validation", failures))
    if len(np.unique(rows[:, F_SAVE])) > 1:
        raise PipeloadError(
            f"pipeload.load: ranks read different checkpoints from {directory} (it was overwritten during the load)"
        )
    if rows_out is not None:
        rows_out.append(rows)
    if private_only:
        mine = decode_record(record)
        wanted = np.zeros(len(names), dtype=np.uint8)
        wanted[np.asarray(mine.index, dtype=np.intp)] = 1
        wanted[np.asarray(mine.objects, dtype=np.intp)] = 1
        if ex is not None:
            wanted = ex.union(wanted, what)
        if clock is not None:
            clock.lap("exchange")
        return GlobalPlan([], {}, {}, np.flatnonzero(wanted), {}, [], 0)
    cls = classes(rows)
    transfer = record_transfer(cls, len(rows))
    if ex is not None and not everything and keyowners.use_key_owners(rows, cls, transfer):
        ndim, itemsize = _key_arrays(md, names)
        # R = 1: shared keys through their owners; None (every rank alike) when some rank cannot plan so
        gp = keyowners.plan(ex, decode_record(record), rank, rows, cls, ndim=ndim, itemsize=itemsize,
                            n_names=len(names), broadcast=broadcast, batch_bytes=batch_bytes, can_create=can_create,
                            global_ranks=global_ranks, same_host_private=same_host_private, what=what,
                            on_phase=on_phase)
        if clock is not None:
            clock.lap("exchange")
        if gp is not None:
            return gp
    raw = ex.transfer_records(transfer, cls, record, what) if ex is not None else [record]
    records = [decode_record(b) for b in raw]
    if clock is not None:
        clock.lap("exchange")
    ndim, itemsize = _key_arrays(md, names)
    chunks = (chunk_table(md, names) if md is not None and broadcast and np.any(rows[:, F_FLAGS] & FLAG_RESHARDED)
              else None)
    positions = storageorder.key_positions(md, names, world) if by_position and md is not None else None
    starts = storageorder.box_starts(md, names) if chunks is not None and not by_position else None  # by runs
    (on_phase or (lambda name: None))("key shapes")
    return global_plan(rows, cls, records, rank, ndim=ndim, itemsize=itemsize, broadcast=broadcast,
                       batch_bytes=batch_bytes, can_create=can_create, global_ranks=global_ranks,
                       on_phase=on_phase, same_host_private=same_host_private, everything=everything,
                       chunks=chunks, positions=positions, starts=starts, reads=part_reads and chunks is not None)


def _refused(error: PipeloadError) -> PipeloadError:
    """``error``, marked as raised alike on every rank at planning, before any read or write."""
    error.planning = True
    return error


def _key_arrays(md: Metadata | None, names: list[str]) -> tuple[np.ndarray, np.ndarray]:
    """(tensor rank, itemsize) of each checkpoint key, by key index (empty without metadata)."""
    return md.key_arrays(names) if md is not None else (np.zeros(0, np.int64), np.zeros(0, np.int64))


async def _execute(comm, reader, pool, shared, private, objects, groups, gp, counters, max_inflight,
                   progress, clock, skip=frozenset(), twins=(), deliveries=(), located=()) -> list:
    """Part delivery (``deliveries``: before every broadcast; ``located``: chunk positions other readers
    found, :class:`~pipeload.engine.delivery.Planned`), the shared phase, then the private phase, reading
    in ``pool``, then the copies into ``twins`` (:func:`~pipeload.engine.scheduler.fill_twins`); returns
    decoded objects."""
    bar = _progress_bar(progress, comm.rank, sum(s.nbytes for s in [*shared.values(), *private]))
    on_bytes = bar.update if bar is not None else None
    reader.set_patches(())
    delivery.install(reader, located)  # (a reused plan's: this load's reader has not seen them)
    if reader.runs:  # objects: the ranges planned with part delivery, asked for at once
        await asyncio.get_running_loop().run_in_executor(pool, delivery.fetch_runs, reader)
    if deliveries:
        await asyncio.get_running_loop().run_in_executor(
            pool, delivery.deliver, comm, reader, deliveries, counters, f"pipeload.load from {reader.directory}")
        clock.lap("delivery")
    reader.expect(_my_reads(comm.rank, shared, private, gp.ops, skip))  # how each file is requested
    try:
        if gp.ops:
            phase = SharedPhase(comm, reader, shared, groups, pool, counters, max_inflight, on_bytes,
                                {sid: hs.members for sid, hs in gp.sets.items()})
            await phase.run(gp.ops)
        clock.lap("shared")
        loop = asyncio.get_running_loop()
        decoded = await loop.run_in_executor(pool, read_private, reader, private, objects, counters, on_bytes, skip)
        if twins:
            await loop.run_in_executor(pool, fill_twins, twins, counters, reader.ring)
        clock.lap("private")
        return decoded
    finally:
        if reader.ring is not None:  # the last copies into the accelerator done, the slots freed
            reader.ring.close()
        if bar is not None:
            bar.close()


def _my_reads(rank: int, shared: dict, private: list, ops: list, skip=frozenset()):
    """Every ReadItem this rank reads in this load: those of the broadcasts it reads, then of its private
    shards (less the stored chunks units delivered). From this rank's plan alone: no collective."""
    for op in ops:
        if op.reader == rank:
            for k in op.shards:
                yield from shared[k].reads
    for s in private:
        for item in s.reads:
            if not skip or (item.file, item.key) not in skip:
                yield item


def load(state_dict: dict, checkpoint_dir: str | os.PathLike, **options: Any) -> LoadStats:
    """Load a checkpoint into ``state_dict`` in place; every rank of the group must call it.

    The checkpoint may be pipeload's own, torch.distributed.checkpoint's, or Hugging Face safetensors
    (``format``); all load through the same plan, broadcasts and errors. ``checkpoint_dir`` may also be a
    :class:`pipeload.MemoryTier`: the newest step complete over the live hosts is restored, each rank's
    state from its own host's memory or from a peer holding a copy (:mod:`pipeload.tier.restore`); with
    no whole step, ``fallback=`` (a checkpoint directory or URL) is loaded instead, with the same options.
    ``LoadStats.source`` says which ("tier" / "fallback") and ``LoadStats.step`` the tier's step.

    Tensors, DTensor shards and :class:`pipeload.Slice` views (a list of Slices too) are filled; objects replaced. A
    ``Stateful`` value (``state_dict()``/``load_state_dict()``: a model, an optimizer, a wrapper of both)
    at any depth is loaded as torch.distributed.checkpoint does: its ``state_dict()`` is loaded into, then
    its ``load_state_dict()`` called with it, only when the load succeeded (:mod:`pipeload.engine.stateful`).
    Each shard held by several ranks is read from storage once and broadcast to the others while the
    next shards are read. Returns this rank's :class:`LoadStats`.

    Options:
        process_group: the group whose ranks load together (default: the world).
        use_collectives: ``False`` skips the plan exchange and every collective: each rank reads what it
            needs on its own (the safe fallback; ``broadcast_replicated_tensors`` is then ignored).
        broadcast_replicated_tensors: read each shard several ranks hold once and broadcast it.
            ``"auto"`` (default): so under an accelerator backend (NCCL); under gloo only when its holders
            run on more than one host — ranks of one host share a page cache, where reading a replica
            again costs a memory copy while a gloo broadcast costs a TCP round trip. ``True``: always
            (also within a host); ``False``: never, every rank reads what it needs. The host is
            ``socket.gethostname()``, or ``PIPELOAD_HOST_ID`` when set (to emulate separate nodes).
        part_delivery: ``"auto"`` (default) or ``"off"``. In a load into another layout than the save's
            (some box cuts a stored chunk), the page where two ranks' parts of a chunk meet is read once,
            by its owner (the reader needing most of it), who sends the ranks of other hosts their bytes
            of it point to point before any broadcast (:mod:`pipeload.plan.partdelivery`, its costs
            ``STORAGE_COST`` and ``WIRE_COST``), never within a host (one page cache). From an object
            store (``s3://``) the unit is a run instead of a page: each object whose readers' own requests
            would fetch other ranks' bytes is cut into a few contiguous runs, each fetched by one reader in
            large GETs, which sends the other ranks their bytes inside it (``RUN_BYTES``, ``RUN_SLACK``).
            Off with ``cast=True`` (each item is read whole and converted while copied).
            ``LoadStats.pages_delivered`` (parts, either form) and ``part_bytes_*``.
        broadcast_groups: process groups the load may reuse for broadcasting (DTensor mesh groups in the
            state dict are reused automatically).
        broadcast_batch_bytes: shards smaller than this are packed into one broadcast (6 MiB).
        max_inflight: broadcasts outstanding at once (8).
        strict: raise listing every state dict key missing from the checkpoint and every checkpoint key
            no rank loads (``False``: report them in the stats; ``"missing"``: only the former, as DCP).
        verify_checksums: check each stored chunk's xxh3 checksum before using it.
        timeout: for groups the load creates (default: the process group's own timeout).
        progress: a progress bar of loaded bytes on rank 0 (needs tqdm).
        reuse_plan: reuse the plan (and the groups it created) of an earlier load of the same checkpoint
            into a state dict of the same layout on the same group, when every rank still holds it (default ``True``;
            see :mod:`pipeload.plan.plancache`; :func:`pipeload.clear_plan_cache` forgets them).
        format: the checkpoint's layout: ``"pipeload"``, ``"dcp"`` (torch.distributed.checkpoint) or
            ``"hf"`` (Hugging Face safetensors: one file, an index, or a directory of files); None
            detects it (see :mod:`pipeload.formats`). ``LoadStats.format`` says which was read.
        key_map: renames checkpoint keys before matching them with the state dict: a dict (unlisted
            names kept) or a callable (returning None leaves the key out). ``strict`` sees the new names.
        storage_options: for a checkpoint in object storage (``s3://bucket/prefix``): obstore's
            configuration keys (``endpoint``, ``region``, ``access_key_id``, ...; default: the AWS_*
            environment) and pipeload's ``part_size`` (8 MiB), ``max_requests`` (GETs in flight, 16),
            ``retries`` (8), ``retry_base`` / ``retry_max`` (backoff seconds), ``retry_timeout``.
        cast: convert tensors whose stored dtype differs from the destination's while copying
            (default ``False``: a dtype mismatch is an error listing every such tensor).
        h2d_ring_bytes: page-locked bytes (64 MiB, 4 slots) host bytes reach accelerator tensors through,
            non-blocking on a side stream (:class:`pipeload.device.H2DRing`); 0: synchronous copies.

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
    return _run_to_end(lambda: load_async(state_dict, checkpoint_dir, **options))


def _run_to_end(make) -> LoadStats:
    """The coroutine ``make()`` returns, run to its end on the main thread's kept loop (another thread: a
    loop of its own, closed after), leaving no task behind."""
    kept = threading.current_thread() is threading.main_thread()
    loop = _main_loop() if kept else _new_loop()
    try:
        return loop.run_until_complete(make())
    finally:
        # as asyncio.run ends: nothing a load started runs on afterwards (a load that ran to its end,
        # raising or not, leaves no task: only an interrupt does, and then the loop is not kept)
        left = asyncio.all_tasks(loop)
        try:
            if left:
                for task in left:
                    task.cancel()
                loop.run_until_complete(asyncio.gather(*left, return_exceptions=True))
        finally:
            if left or not kept:
                _close(loop)


def _new_loop() -> asyncio.AbstractEventLoop:
    try:
        import uvloop
    except ImportError:
        return asyncio.new_event_loop()
    return uvloop.new_event_loop()


def _close(loop: asyncio.AbstractEventLoop) -> None:
    global _kept
    if _kept is not None and _kept[1] is loop:
        _kept = None
    if not loop.is_closed():
        try:
            loop.run_until_complete(loop.shutdown_asyncgens())
        finally:
            loop.close()


_kept: tuple | None = None  # (pid, loop) of the main thread's


def _main_loop() -> asyncio.AbstractEventLoop:
    """The event loop :func:`load` runs on in the main thread: uvloop's when installed, created on the
    first call (in each process: a loop does not survive fork), kept, and closed at exit. Creating and
    closing one per load cost ~0.4 ms (an epoll, pipes), before the first collective of every load.
    Other threads get a loop per call (a loop kept per thread would hold its descriptors as long as the
    process, one set per thread that ever loaded)."""
    global _kept
    if _kept is None or _kept[0] != os.getpid() or _kept[1].is_closed():
        if _kept is None:  # (a forked child inherits the registration)
            atexit.register(_close_kept)
        elif _kept[0] != os.getpid():
            # a parent's loop, inherited by fork: left alone (its descriptors are shared with the
            # parent's loop; only the process that made a loop closes it)
            _inherited.append(_kept[1])
        _kept = (os.getpid(), _new_loop())
    return _kept[1]


_inherited: list = []


def _close_kept() -> None:
    if _kept is not None and _kept[0] == os.getpid():
        _close(_kept[1])
