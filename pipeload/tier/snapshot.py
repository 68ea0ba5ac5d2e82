"""``pipeload.save(state_dict, tier, step=N)``: a snapshot of every rank's state into the memory tier.

Order of a snapshot (every rank of the world; the collectives in this order on every rank):

1. **Caller's thread, no I/O** (:func:`_local`, :func:`_check_rows`): this rank's state as one file's
   content (:func:`pipeload.save.saveplan.local_record`: the kinds a directory save refuses are refused
   alike, objects must load back under ``weights_only=True``) and its root checked (another job's or
   damaged: refused, never touched). One all-gather of a fixed row per rank on the caller's group
   (problems, host, root, step, replicas, keep, job) raises the same error on every rank before
   anything is written; otherwise every rank derives the same placement
   (:func:`pipeload.tier.placement.place`) and the tier's own gloo group is created or reused, by every
   rank alike (:func:`pipeload.save.background.own_comm`: the background save's own group).
   A later snapshot of the same layout reuses what the first derived (:class:`_Kept`, matched by the
   state dict's signature), so the caller's thread does no per-leaf planning.
2. ``background=True``: the state is copied into the tier's staging (a
   :class:`pipeload.save.background.StagingPool` of its own, kept between snapshots) — a replicated
   DTensor shard by one rank of its replica group only (:mod:`.snapshare`; the others receive it in
   the worker) — the group's worker thread takes over and the caller gets a :class:`pipeload.SaveHandle`.
   Blocking: the caller's thread goes on.
3. **The write** (:func:`_work`, on the own group only): each host's lowest rank prepares its root —
   claims it for the job, removes unfinished step directories and any step ``>= N`` (a job that went
   back to an older step abandons those) — then one gather of (failed, file size) per rank; then every
   rank writes its own file while its copies stream to and from the other hosts
   (:mod:`pipeload.tier.transport`). **Agreement** (one word per rank): any failure raises one
   :class:`~pipeload.DistributedError` on every rank naming the rank and file, and the host's lowest rank
   removes the step directory. Otherwise the host's lowest rank writes ``COMPLETE.json``; a second
   agreement; only then are older complete steps beyond ``keep`` removed.

So the previous complete step is the tier's newest until the new one is complete on every host, and a
failed or abandoned snapshot leaves at most an unfinished directory, which restore ignores and the next
snapshot removes.
"""

from __future__ import annotations

import os
import shutil
import threading
import time
import warnings
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ..engine._busy import Guard
from ..engine._gcpause import paused_gc
from ..engine.comm import Comm
from ..errors import DistributedError, PipeloadError, StateDictError
from ..plan.exchange import hash64, host_id
from ..plan.statedict import flatten
from ..save import background as bg
from ..save import saveplan
from ..plan._leafplan import local_of, match
from ..plan.plancache import leaf_positions, signature
from ..plan.statedict import check_top, is_container
from ..save.savecache import encode_again
from . import MemoryTier, format as tf, snapshare, transport
from .placement import Placement, place

MAX_STEP = 10**12 - 1  # step directories carry 12 digits

_pools: dict[tuple[int, ...], bg.StagingPool] = {}  # the tier's staging per group, apart from directory saves'


@dataclass
class SnapshotStats:
    """This rank's view of one snapshot: its file's bytes, the copies it sent and wrote for other hosts,
    seconds from the call to the end of the agreement (``seconds``) and of which the caller was
    blocked (``blocked_seconds``: all of it for a blocking snapshot)."""

    step: int = 0
    file_bytes: int = 0
    copies_sent: int = 0
    copies_written: int = 0
    bytes_sent: int = 0
    bytes_received: int = 0
    replica_bytes: int = 0  # replicated shards received from the rank that staged them
    seconds: float = 0.0
    blocked_seconds: float = 0.0


class _Local:
    """This rank's file content: {fqn: (local tensor, global shape, offsets)}, {fqn: object bytes}."""

    def __init__(self) -> None:
        self.tensors: dict[str, tuple[torch.Tensor, tuple[int, ...], tuple[int, ...]]] = {}
        self.objects: dict[str, bytes] = {}
        self.problems: list[str] = []  # the state dict's (StateDictError)
        self.root_problem: str | None = None
        self.split = snapshare.NONE  # the replicated shards it stages for others / receives (background)
        self.memo: dict = {}  # staging items and layouts, kept with the snapshot layout (_Kept)
        self.staged: tuple | None = None  # (items, sizes, layout, views()) until the worker points at them


def check_step(step: Any) -> int:
    if step is None:
        raise TypeError("pipeload.save into a MemoryTier needs step=N (the training step it snapshots)")
    if type(step) is not int or not 0 <= step <= MAX_STEP:
        raise ValueError(f"step must be an integer in [0, {MAX_STEP}], not {step!r}")
    return step


def _local(state_dict: dict, tier: MemoryTier, contended: str | None, comm: Comm) -> _Local:
    """What this rank snapshots, and what stops it (collected, never raised: every rank raises together).

    A job snapshots one layout over and over: the first snapshot on a group keeps what it derived from
    the state dict (:class:`_Kept`); a later one whose state dict matches the kept signature binds the
    kept fqns, boxes and staging split to its values, walking the state dict once (no record is built)."""
    out = _Local()
    if contended:
        out.problems.append(contended)
        return out
    problem = tf.tier_problem(tier.root, tier.job)
    out.root_problem = f"{problem}; remove it or give this job a root of its own" if problem else None
    if _reuse(state_dict, comm, out):
        return out
    try:
        leaves = flatten(state_dict)
        rec = saveplan.local_record(leaves, encode=False)
    except Exception as e:  # noqa: BLE001 - raised on every rank after the gather
        out.problems.append(f"{type(e).__name__}: {e}")
        return out
    out.problems += rec.problems
    boxes = {pos: (offsets, lengths) for pos, offsets, lengths in rec.shards}
    for pos, (name, kind, _, shape) in enumerate(rec.entries):
        if kind == saveplan.KIND_TENSOR:
            out.tensors[name] = (rec.payload[name], tuple(shape), tuple(boxes[pos][0]))
        else:
            out.objects[name] = rec.payload[name]
    if not out.problems:
        out.split = snapshare.split({f: leaves[f].value for f in out.tensors}, out.tensors, comm.rank)
        _keep(state_dict, leaves, comm, out)
    return out


@dataclass
class _Kept:
    """One rank's snapshot layout on one group, without the state dict: the signature it was derived
    from, each tensor's (fqn, leaf position, global shape, offsets), each object's (fqn, position), the
    staging split, and the objects' last encodings (re-used while an object pickles alike)."""

    pg: Any
    signature: tuple
    tensors: list
    objects: list
    split: snapshare.Split
    encoded: dict
    memo: dict


_kept: dict[tuple[int, ...], _Kept] = {}


def _keep(state_dict: dict, leaves: dict, comm: Comm, local: _Local) -> None:
    try:
        sig = signature(state_dict)[0]
    except Exception:  # noqa: BLE001 - nothing kept: the next snapshot derives it again
        return
    fqns = sorted(local.tensors) + sorted(local.objects)
    at = dict(zip(fqns, leaf_positions(leaves, fqns)))
    tensors = [(f, at[f], shape, offsets) for f, (_, shape, offsets) in sorted(local.tensors.items())]
    if len(_kept) >= 4:
        _kept.clear()
    _kept[tuple(comm.global_ranks)] = _Kept(comm.pg, sig, tensors, [(f, at[f]) for f in sorted(local.objects)],
                                            local.split, {}, local.memo)


def _reuse(state_dict: dict, comm: Comm, out: _Local) -> bool:
    """Fill ``out`` from the kept layout when ``state_dict`` still matches it; False otherwise (the full
    path then reports whatever changed, naming the key)."""
    k = _kept.get(tuple(comm.global_ranks))
    if k is None or k.pg is not comm.pg:
        return False
    try:
        check_top(state_dict)
        found = match(state_dict, is_container, *k.signature)
        if found is None:
            return False
        values = found[0]
        out.objects = {f: encode_again(k.encoded, f, values[pos]) for f, pos in k.objects}
    except Exception:  # noqa: BLE001 - an object that no longer pickles safely, a leaf that cannot be read
        out.objects = {}
        return False
    out.tensors = {f: (local_of(values[pos]), shape, offsets) for f, pos, shape, offsets in k.tensors}
    out.split, out.memo = k.split, k.memo
    return True


def _check_rows(comm: Comm, tier: MemoryTier, step: int, local: _Local, background: bool, what: str) -> Placement:
    """The input gather on the caller's group: every rank raises the same error, or gets the placement.

    Row: flags, host, root, step, replicas, keep, job, background, and the staging split's two check
    words (:mod:`.snapshare`): the split is used only when every rank snapshots in the background and
    the words agree; otherwise every rank stages (or writes) everything it holds itself."""
    flags = (1 if local.problems else 0) | (2 if local.root_problem else 0)
    row = np.array([flags, host_id(), hash64(tier.root.encode()), step, tier.replicas, tier.keep,
                    hash64(tier.job.encode()), int(background), *local.split.words], dtype=np.int64)
    rows = comm.gather_rows(row, what, "all-gather of snapshot rows")
    if rows[:, 0].any():
        texts = comm.all_gather_object((local.problems, local.root_problem), what)
        if (rows[:, 0] & 1).any():
            raise StateDictError(f"{what}: cannot snapshot",
                                 [f"rank {r}: {p}" for r, (ps, _) in enumerate(texts) for p in ps])
        raise DistributedError(what, {r: rp for r, (_, rp) in enumerate(texts) if rp})
    for col, name in ((3, "step"), (4, "replicas"), (5, "keep"), (6, "job")):
        odd = np.flatnonzero(rows[:, col] != rows[0, col])
        if len(odd):
            raise PipeloadError(f"{what}: ranks 0 and {int(odd[0])} pass a different {name}; every rank must "
                                f"snapshot the same step into tiers of the same replicas, keep and job")
    hosts: dict[int, tuple[int, int]] = {}
    for r in range(len(rows)):
        first = hosts.setdefault(int(rows[r, 1]), (r, int(rows[r, 2])))
        if first[1] != rows[r, 2]:
            raise PipeloadError(f"{what}: ranks {first[0]} and {r} share a host but pass different tier roots; "
                                f"the ranks of a host must share its root")
    if not (rows[:, 7].all() and snapshare.consistent(rows, 8, 9)):
        local.split = snapshare.NONE
    return place(rows[:, 1].tolist(), tier.replicas)


def save(state_dict: dict, tier: MemoryTier, step: Any, comm: Comm, background: bool):
    """Every rank's part of a snapshot; :class:`SnapshotStats` (blocking) or a :class:`pipeload.SaveHandle`.

    Validation raises here on every rank alike, before anything is written. After it, nothing raises on
    one rank alone: failures reach every rank's error (or ``handle.wait()``) through the agreement.
    """
    step = check_step(step)
    what = f"pipeload.save into the memory tier {tier.root} (step {step})"
    if comm.active and comm.size > 1 and not comm.is_world:
        raise PipeloadError(f"{what}: a snapshot needs the world as the process group (the tier's own group "
                            f"is created by every rank of the world)")
    t0 = time.perf_counter()
    with paused_gc(), Guard() as guard:
        contended = guard.enter_sync(comm, comm.size > 1, what, comm.timeout.total_seconds())
        local = _local(state_dict, tier, contended, comm)
        placement = _check_rows(comm, tier, step, local, background, what)
        own = bg.own_comm(comm)  # every rank passed the gather: all create it here, or all reuse it
        stats = SnapshotStats(step=step)
        if background:
            return _start_background(local, tier, step, comm, own, placement, guard, stats, what, t0)
        try:
            _work(own, tier, step, placement, local, guard.late(comm), stats, what)
        except DistributedError:
            raise
        except PipeloadError as e:  # a collective of the own group failed: a rank died or hung
            raise DistributedError(what, bg._failures(own, e)) from e
    stats.seconds = stats.blocked_seconds = time.perf_counter() - t0
    return stats


def _start_background(local: _Local, tier: MemoryTier, step: int, comm: Comm, own: Comm, placement: Placement,
                      guard: Guard, stats: SnapshotStats, what: str, t0: float) -> bg.SaveHandle:
    """Stage this rank's tensors, hand the write to the group's worker; the handle."""
    handle = bg.SaveHandle(f"{what} (background)")
    problem = None
    try:
        _stage(local, comm, handle)
    except Exception as e:  # noqa: BLE001 - carried to the agreement: every rank's wait() raises
        problem = f"staging rank {comm.rank}'s state: {type(e).__name__}: {e}"
    problem = problem or guard.late(comm)
    handle.stats = stats  # complete once the handle finished
    handle.blocked_seconds = stats.blocked_seconds = time.perf_counter() - t0

    def work() -> None:
        _work(own, tier, step, placement, local, problem, stats, what)
        stats.seconds = time.perf_counter() - t0

    bg.start(handle, own, work)
    return handle


def _stage(local: _Local, comm: Comm, handle: bg.SaveHandle) -> None:
    """Copy ``local``'s tensors into the tier's staging (the caller may then change them), except the
    replicated shards another rank stages for this one (:mod:`.snapshare`): those get buffers of their
    own in the worker. ``local`` is pointed at the copies by the worker (:func:`_use_staging`)."""
    items, sizes, layout = _items(local, "staged", lambda fqn: fqn not in local.split.received)
    pool = _pools.setdefault(bg.group_key(comm), bg.StagingPool())
    allocations = pool.allocations
    local.staged = (items, sizes, layout, bg.stage(items, sizes, layout, pool))
    handle.owned_bytes = sum(sizes) + sum(len(b) for b in local.objects.values())
    handle.staged_bytes = layout.staged
    handle.staging_allocations = pool.allocations - allocations
    handle.staging_held = pool.nbytes()


def _items(local: _Local, kind: str, keep) -> tuple[list[tuple], list[int], bg.Layout]:
    """(staging items ``(fqn, dtype, shape, tensor)`` of the tensors ``keep`` selects, their sizes, their
    layout); what depends only on the layout is remembered with the kept snapshot layout (``memo``)."""
    key = (kind, bool(local.split.recvs or local.split.sends))
    got = local.memo.get(key)
    if got is None:
        names = [f for f in sorted(local.tensors) if keep(f)]
        heads = [(f, str(t.dtype), tuple(t.shape)) for f in names for t in (local.tensors[f][0],)]
        items = [(*h, local.tensors[h[0]][0]) for h in heads]
        sizes = bg.sizes_of(items)
        got = local.memo[key] = (heads, sizes, bg.Layout(items, sizes, 0))
    heads, sizes, layout = got
    return [(*h, local.tensors[h[0]][0]) for h in heads], sizes, layout


def _point_at(local: _Local, items: list[tuple], views: list[tuple]) -> None:
    """``local``'s tensors of ``items`` replaced by their (1-D) staged ``views``, shaped."""
    for (fqn, _, shape, _), (_, _, _, copy) in zip(items, views):
        _, gshape, offsets = local.tensors[fqn]
        local.tensors[fqn] = (copy.view(shape), gshape, offsets)


def _use_staging(local: _Local, own: Comm) -> None:
    """In the worker: point ``local`` at the staged copies, and give the shards this rank receives from
    their stagers buffers of the tier's own (kept between snapshots). The caller's tensors are never
    written, nor read after the caller got its handle."""
    if local.staged is not None:
        items, _, _, views = local.staged
        _point_at(local, items, views())
        local.staged = None
    names = local.split.received
    if not names:
        return
    items, sizes, layout = _items(local, "received", names.__contains__)
    pool = _pools.setdefault(("received", *bg.group_key(own)), bg.StagingPool())
    buffers = {kind: pool.take(kind, n) for kind, n in layout.ends.items() if n}
    views = list(items)
    for s, span in enumerate(layout.spans):
        for i, d in zip(span[3], layout.regions(buffers, s, sizes)):
            views[i] = (*items[i][:3], d)
    _point_at(local, items, views)


def _work(own: Comm, tier: MemoryTier, step: int, placement: Placement, local: _Local, error: str | None,
          stats: SnapshotStats, what: str) -> None:
    """Write this rank's file and copies, agree, mark the step complete, clean up (own group only)."""
    me, world = own.rank, own.size
    host = placement.host_of[me]
    lowest = placement.hosts[host][0] == me
    parts: list[memoryview] = []
    _use_staging(local, own)
    if local.split.sends or local.split.recvs:  # every rank of a replica group takes part, failed or not
        stats.replica_bytes = snapshare.transfer(own, local.split, local.tensors, me, what)
    if error is None:
        try:
            head, views, _owners = tf.encode(step, me, world, tier.job, local.tensors, local.objects)
            parts = [memoryview(head)] + views
        except Exception as e:  # noqa: BLE001 - carried to the gather below
            error = f"encoding rank {me}'s file: {type(e).__name__}: {e}"
    token = int.from_bytes(os.urandom(7), "little") if lowest else 0
    marker = os.path.join(tier.root, f"{MARKER}{token:014x}") if lowest else None
    try:  # (no marker goes before every host has looked: the second gather follows every look)
        if marker is not None and error is None:
            error = _touch(marker, tier.root, step)
        tokens = own.agree_on(token, error, what, "gather of tier roots")
        if lowest:
            error = _shared_root(tier.root, placement, tokens, me) or _prepare(tier, step)
        sizes = own.agree_on(sum(p.nbytes for p in parts), error, what, "gather of rank file sizes").tolist()
    finally:
        if marker is not None:
            _unlink(marker)
    error = _write_and_copy(own, tier, step, placement, parts, sizes, stats, what)
    try:
        own.agree(what, error)
    except DistributedError:
        if lowest:  # every rank of this host is past its writes: the unfinished step goes now
            _remove_step(tier.root, step)
        raise
    error = _mark_complete(tier, step, placement, host, world) if lowest else None
    try:
        own.agree(what, error)
    except DistributedError:
        if lowest:
            _unlink(os.path.join(tf.step_dir(tier.root, step), tf.COMPLETE_FILE))
        raise
    if lowest:
        try:
            _drop_old(tier, step)
        except Exception as e:  # noqa: BLE001 - the step is complete everywhere; the next snapshot retries
            warnings.warn(f"{what}: removing older steps from {tier.root} failed: {e}", RuntimeWarning, stacklevel=2)


def _write_and_copy(own: Comm, tier: MemoryTier, step: int, placement: Placement, parts: list[memoryview],
                    sizes: list[int], stats: SnapshotStats, what: str) -> str | None:
    """This rank's own file (a thread of its own) while its copies go out and other hosts' come in."""
    me = own.rank
    path = tf.rank_file(tier.root, step, me)
    result: list[str | None] = [None]

    def write_own() -> None:
        try:
            os.makedirs(tf.step_dir(tier.root, step), exist_ok=True)  # (the host's lowest rank made it)
            stats.file_bytes = tf.write_parts(path, parts)
        except Exception as e:  # noqa: BLE001 - reported by the agreement
            result[0] = f"writing {path}: {type(e).__name__}: {e}"

    writer = threading.Thread(target=write_own, name=f"pipeload-tier-write-{me}")
    writer.start()
    outs = [(c.writer, parts, sizes[me]) for c in placement.copies if c.rank == me]
    ins = [(c.rank, tf.rank_file(tier.root, step, c.rank), sizes[c.rank]) for c in placement.copies if c.writer == me]
    try:
        copy_error = transport.exchange(own, outs, ins, what)
    finally:
        writer.join()
    stats.copies_sent, stats.copies_written = len(outs), len(ins)
    stats.bytes_sent = sizes[me] * len(outs)
    stats.bytes_received = sum(n for _, _, n in ins)
    return result[0] or copy_error


MARKER = ".snapshot-"  # + 14 hex digits: a host's token, in its root while the snapshot checks the roots


def _touch(marker: str, root: str, step: int) -> str | None:
    try:
        os.makedirs(root, exist_ok=True)
        open(marker, "xb").close()
    except OSError as e:
        return f"preparing {root} for step {step}: {type(e).__name__}: {e}"
    return None


def _shared_root(root: str, placement: Placement, tokens: np.ndarray, me: int) -> str | None:
    """Why ``root`` is not this host's own, or None.

    A tier root must be host-local memory: hosts sharing one directory (a network file system) would
    remove each other's unfinished steps and overwrite each other's completion records. Each host's lowest
    rank puts an empty file named by a random token in its root before the gather of the tokens, and
    removes it only after the next gather, so when every host looks, every host's file exists: a root
    holding another host's token of this snapshot is shared, refused on every rank before anything is
    removed or written. Files of earlier snapshots carry other tokens and prove nothing.
    """
    lowest = {f"{MARKER}{int(tokens[ranks[0]]):014x}": ranks[0] for ranks in placement.hosts if ranks[0] != me}
    shared = sorted(lowest[n] for n in _listdir(root) if n in lowest)
    if not shared:
        return None
    return (f"the memory tier root {root} is also the root of the host of rank(s) {', '.join(map(str, shared))}: "
            f"each host needs a root of its own, in its own memory (a tmpfs such as /dev/shm)")


def _listdir(path: str) -> list[str]:
    try:
        return os.listdir(path)
    except OSError:
        return []


def _prepare(tier: MemoryTier, step: int) -> str | None:
    """The host's lowest rank, before anything of ``step`` is written: claim the root, remove unfinished
    steps and every step ``>= step``, create the step's directory; the problem, or None."""
    try:
        tf.claim(tier.root, tier.job)
        for s, info in tf.list_steps(tier.root, tier.job).items():
            if not info["complete"] or s >= step:
                _remove_step(tier.root, s)
        for name in os.listdir(tier.root):  # a clean-up cut short (by a kill) left one of these
            if name.startswith(".removing-"):
                shutil.rmtree(os.path.join(tier.root, name), ignore_errors=True)
        os.makedirs(tf.step_dir(tier.root, step))
    except Exception as e:  # noqa: BLE001
        return f"preparing {tier.root} for step {step}: {type(e).__name__}: {e}"
    return None


def _mark_complete(tier: MemoryTier, step: int, placement: Placement, host: int, world: int) -> str | None:
    path = os.path.join(tf.step_dir(tier.root, step), tf.COMPLETE_FILE)
    doc = {"step": step, "world": world, "job": tier.job, "ranks": placement.held[host],
           "replicas": min(tier.replicas, len(placement.hosts)), "hosts": len(placement.hosts)}
    try:
        tf.write_json(path, doc)
    except Exception as e:  # noqa: BLE001
        return f"writing {path}: {type(e).__name__}: {e}"
    return None


def _drop_old(tier: MemoryTier, step: int) -> None:
    """After ``step`` is complete everywhere: keep the ``keep`` newest complete steps up to it (best effort)."""
    complete = [s for s, info in tf.list_steps(tier.root, tier.job).items() if info["complete"] and s <= step]
    for s in complete[: max(0, len(complete) - tier.keep)]:
        _remove_step(tier.root, s)


def _remove_step(root: str, step: int) -> None:
    """Remove a step directory: its ``COMPLETE.json`` first (it stops counting at once), then the
    directory renamed out of the step names and deleted (best effort; the next snapshot retries)."""
    d = tf.step_dir(root, step)
    _unlink(os.path.join(d, tf.COMPLETE_FILE))
    gone = os.path.join(root, f".removing-{os.path.basename(d)}")
    try:
        os.replace(d, gone)
    except OSError:
        gone = d
    shutil.rmtree(gone, ignore_errors=True)


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass
