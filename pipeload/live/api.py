"""``pipeload.transfer``: a trainer's live weights into other ranks' buffers, each byte sent once.

Collectives, in order, on the group (every rank calls :func:`transfer` with the same group):

1. an all-gather of four words per rank: the kept plan it offers (or "none", or "contended": word 0,
   as in a load's and a restore's first gather, :mod:`pipeload.engine._busy`), the digest of its layout
   (:func:`pipeload.live.sides.digest`), its widest tensor rank and the version it passes;
2. planning, only when some rank offers no kept plan or another one than the rest: the two all-to-alls
   of :mod:`pipeload.move.plan` (records to the names' owners, answers back), then an agreement on the
   problems the owners found — every rank raises before any destination is written when one is found;
3. the data (:mod:`pipeload.live.run`), point to point;
4. a final agreement: every rank learns that every other finished; a rank that failed or died makes
   every rank raise (:class:`TransferError`, whose ``stats`` say which destinations were written).

A plan is kept per group object for the layout it was made for; a later call offers it only if its own
layout digest is unchanged, and it is reused only if every rank offers the same one: one gather of a
few words per rank, nothing planned.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..engine._busy import CONTENDED, Guard
from ..engine._gcpause import paused_gc
from ..errors import DistributedError, PipeloadError
from ..move import mover, plan as moveplan
from ..move.link import Link
from ..move.run import schedule as move_schedule
from ..move.schedule import Schedule
from ..plan.exchange import hash64
from . import run as mover_run
from .sides import Side, destinations, digest, ndim, sources

ROW = 4  # the size of a load's and a restore's first gather: a contended one pairs with either
R_OFFER, R_DIGEST, R_SHAPE, R_VERSION = range(ROW)  # R_SHAPE: widest tensor rank | sides held << 8
NO_VERSION = -(1 << 62)
GUARD_WAIT_S = 60.0  # how long a contended transfer waits for the earlier operation before it refuses


class TransferError(DistributedError):
    """A transfer failed on some rank; raised on every rank, with this rank's ``stats`` attached."""

    stats: "TransferStats"


@dataclass
class TransferStats:
    """What one :func:`transfer` did on this rank. ``written`` lists the destinations (names, in the
    order ``dst`` gave them) that hold this version's bytes; after a failure, the others may hold a
    mix of versions and must not be served."""

    version: int | None = None
    planned: bool = True  # False: the kept plan was reused
    bytes_sent: int = 0
    bytes_received: int = 0
    bytes_copied: int = 0  # local pieces (a colocated rank)
    messages: int = 0
    destinations: int = 0
    written: list[str] = field(default_factory=list)
    complete: bool = False
    timings: dict[str, float] = field(default_factory=dict)


@dataclass
class _Kept:
    token: int
    digest: int
    nd: int
    schedule: Schedule  # its answers, their messages cut once (and their copies compiled)
    boxes: tuple  # (source boxes, destination boxes) it was made for, and their records
    records: np.ndarray


_kept: dict[tuple[int, int], _Kept] = {}  # (id(group object), slot) -> the plan its last transfer made
_pools: dict[int, mover.BufferPool] = {}  # id(group object) -> the message buffers its transfers reuse


def clear() -> None:
    """Forget every kept transfer plan (the next transfer on each group plans again) and free the
    message buffers kept for the next transfer."""
    _kept.clear()
    _pools.clear()


def transfer(src: Any, dst: Any, *, group: Any = None, version: int | None = None, cast: bool = False,
             what: str = "pipeload.transfer") -> TransferStats:
    """Fill every rank's ``dst`` from the ``src`` the group's ranks hold; a collective over ``group``.

    ``src``: this rank's part of the trainer's state dict (tensors and DTensors of any mesh; ``None`` on
    an engine-only rank). ``dst``: a state dict, or a list, of tensors, DTensors or
    :class:`pipeload.Slice` (``None`` on a trainer-only rank). ``group``: a ``ProcessGroup`` spanning
    both sides, registered with the default world or not (default: the default world). ``version``
    (e.g. the training step) is returned in every rank's stats. ``cast=True`` lets a destination's
    dtype differ from its source's (the sender converts). Raises :class:`pipeload.StateDictError` for
    bad input on this rank (before any collective), :class:`pipeload.DistributedError` on every rank
    when a layout problem is found (before any destination is written), :class:`TransferError` on
    every rank when a rank fails or dies during the data movement.
    """
    return run_transfer(Link(group), src, dst, version, cast, what)


def run_transfer(link: Link, src: Any, dst: Any, version: int | None, cast: bool, what: str,
                 slot: int = 0) -> TransferStats:
    """:func:`transfer` on ``link``. ``slot`` keys the kept plan: a caller that makes several transfers
    of different layouts in a fixed order on one group (:func:`pipeload.live.stream.stream`, a bucket
    each) passes each its own, so every one finds its plan kept."""
    t0 = time.perf_counter()
    with paused_gc():  # (as a load's and a save's planning: see _plan)
        s, d = sources(src), destinations(dst, cast)
    stats = TransferStats(destinations=len(d.boxes))
    stats.timings.update(plan=time.perf_counter() - t0, exchange=0.0)
    with Guard() as guard:
        contended = guard.enter_sync(link, link.size > 1, what, timeout=GUARD_WAIT_S)
        with paused_gc():
            sched, nd = _plan(link, s, d, version, contended, stats, what, slot)
        _move(link, sched, s, d, stats, what, guard.late(link))
    stats.timings["total"] = time.perf_counter() - t0
    return stats


def _plan(link: Link, s: Side, d: Side, version, contended, stats: TransferStats, what: str, slot: int):
    """(this rank's answers, nd): the kept plan when every rank offers it, else a new one. Timings:
    ``plan`` this rank's own work (its boxes, the digest, an owner's answers), ``exchange`` the
    collectives (which include waiting for the slowest rank to arrive). Called with the cyclic GC
    paused: decoding allocates an op per piece, and collections walking the process's objects meanwhile
    cost 0.83 s against 0.25 s for an engine rank's 150,000 pieces of a 671B MoE, in a bare process
    (``pipeload simulate --op transfer``; a trainer's process holds far more objects for them to walk)."""
    lap = _Lap(stats.timings)
    own = max(ndim(s), ndim(d))
    kept = _kept.get((id(link.pg), slot))
    if kept is not None and kept.boxes == (s.boxes, d.boxes):  # (the same boxes: their records and digest)
        rec, dig = kept.records, kept.digest
    else:
        rec = moveplan.records(s.boxes, d.boxes, own)  # (the digest's words, and the plan's when it plans)
        dig = digest(s, d, rec)
    offer = CONTENDED if contended else (kept.token if kept is not None and kept.digest == dig else 0)
    sides = bool(s.boxes) | (bool(d.boxes) << 1)
    row = np.array([offer, dig, own | (sides << 8), NO_VERSION if version is None else int(version)],
                   dtype=np.int64)
    lap("plan")
    rows = link.gather_rows(row, what)
    lap("exchange")
    _refuse(rows, contended, what)
    versions = rows[rows[:, R_VERSION] != NO_VERSION, R_VERSION]
    stats.version = int(versions[0]) if len(versions) else None
    if offer and offer != CONTENDED and np.all(rows[:, R_OFFER] == offer):
        stats.planned = False
        return kept.schedule, kept.nd
    nd = int((rows[:, R_SHAPE] & 0xFF).max())
    counts, words = moveplan.by_owner(moveplan.widen(rec, own, nd), link.size)
    lap("plan")
    got, received = link.all_to_all(counts, words, what, "all-to-all of transfer boxes")
    lap("exchange")
    held = rows[:, R_SHAPE] >> 8
    acounts, awords = moveplan.answer(got, received, nd, link.size,
                                      (int(np.count_nonzero(held & 1)), int(np.count_nonzero(held & 2))))
    lap("plan")
    _, mine = link.all_to_all(acounts, awords, what, "all-to-all of transfer answers")
    lap("exchange")
    answers = moveplan.decode(mine, nd, link.rank)
    problems = _problems(answers, d)
    lap("plan")
    link.agree(what, problems, "agreement on the transfer's plan")
    lap("exchange")
    token = hash64(np.ascontiguousarray(rows[:, [R_DIGEST, R_SHAPE]]).tobytes()) or 1
    sched = move_schedule(answers)
    _kept[(id(link.pg), slot)] = _Kept(token, dig, nd, sched, (s.boxes, d.boxes), rec)
    return sched, nd


class _Lap:
    """Adds the time since the last lap to ``timings[phase]``."""

    def __init__(self, timings: dict):
        self.timings, self.t = timings, time.perf_counter()

    def __call__(self, phase: str) -> None:
        now = time.perf_counter()
        self.timings[phase] = self.timings.get(phase, 0.0) + now - self.t
        self.t = now


def _refuse(rows: np.ndarray, contended: str | None, what: str) -> None:
    """Raise on every rank alike (all hold the same rows) for a contended rank or disagreeing versions."""
    bad = np.flatnonzero(rows[:, R_OFFER] == CONTENDED).tolist()
    if bad:
        raise PipeloadError(contended or f"{what}: another pipeload operation ran at the same time on an "
                            f"overlapping process group on rank(s) {bad}; run transfers and loads on one "
                            f"group one after the other")
    versions = np.unique(rows[rows[:, R_VERSION] != NO_VERSION, R_VERSION])
    if len(versions) > 1:
        raise PipeloadError(f"{what}: the ranks passed different versions {versions.tolist()}; pass the "
                            f"same version (or None) on every rank")


def _problems(answers: moveplan.Answers, d: Side) -> str | None:
    if not answers.problems:
        return None
    lines = [f"destination {d.names[i]!r} {tuple(d.views[i].shape)}: {moveplan.PROBLEMS[code]}"
             for i, code in answers.problems[:20]]
    more = len(answers.problems) - 20
    return "\n".join(lines + ([f"... and {more} more"] if more > 0 else []))


def _move(link: Link, sched: Schedule, s: Side, d: Side, stats: TransferStats, what: str, late: str | None) -> None:
    t0 = time.perf_counter()
    x = mover.Transfers(link, what, tolerant=True, pool=_pools.setdefault(id(link.pg), mover.BufferPool()))
    progress = mover_run.Progress(sched, len(d.boxes))
    error = late
    try:
        stats.bytes_copied = mover_run.run(x, sched, s, d, progress, link.device)
        problems = list(x.failed.values()) + x.errors
        if problems:
            error = "\n".join(problems[:4])
    except PipeloadError as e:
        error = str(e)
    except Exception as e:  # noqa: BLE001 - a local failure (a copy): every rank must learn of it
        error = f"{what}: {type(e).__name__}: {e}"
    stats.bytes_sent, stats.bytes_received, stats.messages = x.sent, x.received, x.messages
    stats.timings["move"] = time.perf_counter() - t0
    try:
        link.agree(what, error)
    except PipeloadError as e:
        stats.written = [d.names[i] for i in progress.written(failed=True)]
        raise _failed(e, error, stats, link.rank, what) from None
    stats.written = [d.names[i] for i in progress.written()]
    stats.complete = True


def _failed(e: PipeloadError, error: str | None, stats: TransferStats, rank: int, what: str) -> TransferError:
    """The error every rank raises: the failures the agreement gathered, or (the agreement itself
    failed: a peer died) this rank's view of it — its own failure first, which names the peer."""
    if isinstance(e, DistributedError):
        failures = e.failures
    else:
        failures = {rank: str(e) if error is None else f"{error}\nthen {e}"}
    err = TransferError(what, failures)
    err.stats = stats
    return err
