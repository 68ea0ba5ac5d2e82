"""``pipeload.load(state_dict, tier, fallback=...)``: restore from a memory tier, the nearest copy first.

One restore, on every rank of the load's group, in this order:

1. each rank lists its own root (:mod:`.restoreread`: each file's summary, its first bytes) and computes
   the layout digest of its state dict;
2. two gathers (:func:`.restoreplan.exchange`): the rows, then every rank's listing; from them alone,
   alike on every rank, the newest step complete over the live ranks, whether every rank loads exactly
   its saved rank's file (the same layout), and who reads what (:mod:`.restoreplan`). Resharding is
   planned by the live transfer's planner (:mod:`.reshard`, :mod:`pipeload.move.plan`): one word per
   rank, then the two all-to-alls of boxes to the names' owners and of their answers, then one agreement
   on the problems found. Once a step is chosen, each rank parses the records of the files it will read; one that does not
   parse or disagrees with its summary is a failed copy, found before any transfer (as in 3);
3. checksums: every chunk and object a rank reads from its tier is hashed (xxh3) and compared with its
   header. Resharding checks the files it reads first (before any destination is written; their headers
   validated field by field too); the same layout hashes the bytes as they are read, sent and copied (one pass over the tier instead of two). Either
   way one word per rank then says whether some copy failed, and only then the failed copies travel:
   they are left out and step 2's decision is re-taken from the same words (another copy, an older
   whole step, or the fallback). A decision re-taken after the transfers rewrites every destination
   from one step, so two steps never mix in what a restore reports loaded;
4. the transfers (:mod:`pipeload.move.mover`; resharding: the live transfer's messages,
   :mod:`pipeload.move.run`) and the local copies (beside them in a thread, for the same layout: a copy
   needs no other rank), then the final agreement; Python objects
   are put in their containers and ``Stateful`` values loaded only after it succeeded.
No whole step: ``pipeload.load(state_dict, fallback, **options)``, the ordinary load.
A restore takes the one-operation-per-group guard as a load does (:mod:`pipeload.engine._busy`): a contended
rank's only collective is the rows gather, with the contention mark where a load's first gather has it.

Why this cannot deadlock (the argument of docs/ARCHITECTURE.md, for point-to-point messages): every
message has a position in one sequence all ranks derive from the gathered words (same layout:
transfers sorted by file and receiver, then tensor and chunk; resharding: the owners' answers, sorted
by name, receiver, destination and offsets, which both ends of a piece hold; small chunks packed into
messages and large ones cut into parts by rules both ends apply to sizes both know), and the gathers,
the owners' all-to-alls, the agreements and the re-taken
decisions are collectives every rank issues alike, since every rank holds the same words. Each rank
posts its messages in that order and blocks only on its oldest outstanding one. Take the lowest
message not yet complete: its sender and receiver have each posted it or are before it, and "before
it" is reading (which needs no other rank) or waiting on lower messages (complete, by the choice of the
lowest), so both post it; it is then the oldest outstanding message of each, which each waits on at
the latest when its in-flight bytes run out or it drains (a gloo message may need both ends waiting to
progress), and it completes. A sender whose read fails still sends (zeros) and reports the error at
the agreement; a same-layout receiver of object bytes waits for their sizes only after every older
message (a drain), which is waiting on its oldest (resharding: an object's size is in its answer).
"""

from __future__ import annotations

import asyncio
import time
import warnings
from dataclasses import dataclass, field

import numpy as np
import torch

from .. import device as devices
from ..engine import stateful
from ..engine._busy import CONTENDED, Guard, refuse_contended_or_disagreeing
from ..engine._gcpause import paused_gc
from ..engine.comm import Comm
from ..errors import DistributedError, PipeloadError, StateDictError
from ..formats.chunks import dtype_name
from ..plan.exchange import host_id
from ..plan.statedict import flatten, tensor_box
from ..plan.tensorkinds import refusal
from . import restoreplan
from .restoreread import list_root, load_header, verify
from .reshard import reshard_job
from .restorerun import SameJob

@dataclass
class Wanted:
    """This rank's destinations: tensors by fqn as (leaf, box, dtype name), objects by fqn (leaf)."""

    tensors: dict = field(default_factory=dict)
    objects: dict = field(default_factory=dict)
    problems: list = field(default_factory=list)

    def digest(self) -> int:
        return restoreplan.layout_digest(
            ((f, d, b.global_shape, b.offsets, b.lengths) for f, (_, b, d) in self.tensors.items()), self.objects)


def wanted(leaves: dict) -> Wanted:
    """Resolve each leaf: a tensor's box (a DTensor's local shard) or a Python object; problems collected."""
    w = Wanted()
    cache: dict = {}
    for fqn, leaf in leaves.items():
        v = leaf.value
        if not isinstance(v, torch.Tensor):
            w.objects[fqn] = leaf
            continue
        try:
            box = tensor_box(fqn, v, cache)
            name = dtype_name(v.dtype)
            why = refusal(box.local, load=True) if box.local is not None else None
            if why is None and box.local is not None and box.local.device.type == "meta":
                why = "a tensor on the meta device: materialise it (to_empty) before restoring from a tier"
        except Exception as e:  # noqa: BLE001 - reported on every rank after the gather
            why = f"{type(e).__name__}: {e}"
        if why is not None:
            w.problems.append(f"{fqn}: {why}")
            continue
        if box.local is not None and box.numel > 0:
            w.tensors[fqn] = (leaf, box, name)
    return w


async def restore(state_dict: dict, tier, fallback, stats_cls, plain_load, options: dict):
    """The tier restore of :func:`pipeload.load`; ``plain_load`` (``load_async``) serves the fallback."""
    t0 = time.perf_counter()
    if options.get("use_collectives") is False:
        raise PipeloadError("pipeload.load from a memory tier needs collectives (use_collectives=False given)")
    expanded, stateful_values = stateful.expand(state_dict)
    stats = stats_cls()
    comm = Comm(options.get("process_group"), options.get("timeout"))
    what = f"pipeload.load from memory tier {tier.root}"
    # GC paused as for a load's planning: full collections walking the trainer's objects cost more than
    # the restore. The guard registers here, in the event loop, like a load's (_busy.py): operations
    # started together in one loop see each other before either issues a collective.
    with paused_gc(), Guard() as guard:
        contended = await guard.enter(comm, comm.size > 1, what)
        result = await asyncio.to_thread(_restore, comm, guard, contended, expanded, tier, stats, what,
                                         options.get("strict", True))
    if result is None:
        if fallback is None:
            raise PipeloadError(f"pipeload.load from memory tier {tier.root}: no step of the tier is complete "
                                f"over the live ranks and no fallback was given")
        stats = await plain_load(state_dict, fallback, **options)
        stats.source, stats.step = "fallback", -1
        return stats
    for leaf, value in result:
        leaf.container[leaf.key] = value
    stateful.finish(stateful_values)
    stats.source = "tier"
    stats.wall = time.perf_counter() - t0
    return stats


def _restore(comm: Comm, guard: Guard, contended: str | None, state_dict: dict, tier, stats, what: str,
             strict: bool = True):
    """Steps 1-4 on this rank (in a worker thread); None: no whole step, the caller falls back.
    ``stats.timings``: list (root and state dict), exchange, check, transfer (and local copies), agree.
    ``contended`` (this rank's operation overlaps another, see _busy.py): its one collective is the rows
    gather, carrying it; every rank then refuses."""
    lap = _Laps(stats.timings)
    want = wanted(flatten(state_dict))
    files = {} if contended else list_root(tier.root, tier.job)
    listing = restoreplan.encode_listing(tf.entry() for tf in files.values())
    lap("list")
    g = restoreplan.exchange(comm, CONTENDED if contended else host_id(), want.digest(), listing, what,
                             flags=int(bool(want.problems)))
    refuse_contended_or_disagreeing(what, g.rows[:, restoreplan.R_HOST] == CONTENDED, np.zeros(len(g.rows)),
                                    contended, "")
    if np.any(g.rows[:, restoreplan.R_FLAGS]):
        _raise_problems(comm, want.problems, what)
    planned, checked = restoreplan.decide(g), set()
    lap("exchange")
    while True:
        if planned.choice is None:
            return None
        step = planned.choice.step
        same = SameJob(planned, comm.rank) if planned.same else None
        bad = _headers(files, same.files if same else _held(files, step), step, None if same else tier.job)
        if _any_bad(comm, bad, what, lap, "check"):
            planned = _retake(comm, planned, bad, files, what)
            continue
        job = same or reshard_job(comm, planned, files, want, strict, what)
        lap("exchange")
        if not planned.same:  # (the same layout checks its copies as it reads them: see SameJob.run)
            bad = _check(files, job.reads, checked, step)
            if _any_bad(comm, bad, what, lap, "check"):
                planned = _retake(comm, planned, bad, files, what)
                continue
        stats.step = planned.choice.step
        job.ring = devices.ring_for(devices.in_use())  # host bytes into accelerator destinations
        try:
            decoded, error, bad = job.run(comm, files, want, stats, what)
        finally:
            if job.ring is not None:
                job.ring.close()
        lap("transfer")
        if not _any_bad(comm, bad, what, lap, "agree"):
            break
        planned = _retake(comm, planned, bad, files, what)  # (this round's errors came from the bad copy)
    error = error or guard.late(comm)  # an operation overlapped this one after its rows: nothing is loaded
    comm.agree(what, error) if comm.size > 1 else _alone(error, what)
    lap("agree")
    return decoded


def _any_bad(comm: Comm, bad: list, what: str, lap, phase: str) -> bool:
    """One word per rank: did a copy it read fail its checks (every rank learns it alike)."""
    flags = comm.gather_rows(np.array([len(bad)], dtype=np.int64), what, "all-gather of tier checks")[:, 0]
    lap(phase)
    return bool(flags.any())


def _retake(comm: Comm, planned, bad: list, files: dict, what: str):
    """The failed copies of every rank left out, the decision taken again from the same words."""
    gathered = comm.all_gather_object(bad, what)
    for step, f, why in bad:  # (warned where the copy lies; every rank leaves it out)
        files.pop((step, f), None)
        warnings.warn(f"pipeload: {what}: this rank's copy of saved rank {f}'s file of step {step} is "
                      f"unusable ({why}); another copy, step or the fallback is used", RuntimeWarning,
                      stacklevel=3)
    return restoreplan.decide(restoreplan.exclude(
        planned.gathered, [(r, s, f) for r, items in enumerate(gathered) for (s, f, _) in items]))


class _Laps:
    def __init__(self, timings: dict):
        self.timings, self.last = timings, time.perf_counter()

    def __call__(self, phase: str) -> None:
        now = time.perf_counter()
        self.timings[phase] = self.timings.get(phase, 0.0) + now - self.last
        self.last = now


def _alone(error: str | None, what: str) -> None:
    if error:
        raise DistributedError(what, {0: error})


def _raise_problems(comm: Comm, problems: list, what: str) -> None:
    gathered = comm.all_gather_object(problems, what)
    if len(gathered) == 1:
        raise StateDictError(f"{what}: cannot load", gathered[0])
    raise DistributedError(f"{what}: validation", {r: "\n".join(p) for r, p in enumerate(gathered) if p})


def _held(files: dict, step: int) -> list:
    """The saved ranks of ``step`` whose files this rank lists."""
    return sorted(f for s, f in files if s == step)


def _headers(files: dict, needed, step: int, job: str | None) -> list:
    """Parse the records of the files of ``step`` this rank will read (listed from their summaries alone):
    [(step, saved rank, why)] of those that do not parse or disagree with their summaries, which are also
    dropped from ``files`` (missing copies: the decision is re-taken without them). With ``job`` (a
    resharding restore: the files' chunks are offered to the plan) each record is validated as it is
    parsed."""
    bad = []
    for f in sorted(needed):
        tf = files.get((step, f))
        why = load_header(tf, job) if tf is not None else "not listed"
        if why is not None:
            bad.append((step, f, why))
            files.pop((step, f), None)
    return bad


def _check(files: dict, reads: set, checked: set, step: int) -> list:
    """Verify the checksums of the files this rank will read (each once per restore; their records were
    validated as they were parsed, :func:`_headers`): [(step, saved rank, why)] of those that failed,
    which are also dropped from ``files``."""
    bad = []
    for f in sorted(reads):
        key = (step, f)
        if key in checked:
            continue
        tf = files.get(key)
        why = verify(tf) if tf is not None else "not listed"
        checked.add(key)
        if why is not None:
            bad.append((step, f, why))
            files.pop(key, None)
    return bad


__all__ = ["restore", "wanted", "Wanted"]
