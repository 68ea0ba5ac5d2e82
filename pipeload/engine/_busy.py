"""Refusing concurrent loads and saves on overlapping process groups, the same way on every rank.

Two collective operations of one process on groups that share a rank would interleave their
collectives on the shared communicators in an order each rank decides for itself: data crosses
between them, or a rank waits forever on a collective its peer issued for the other operation.
pipeload refuses such overlap instead of serialising it (no order of the two could be agreed on
without a collective, which is exactly what cannot be trusted yet).

The refusal must be the same on every rank, and a rank cannot know locally what its peers saw. So
(one registry per process, keyed by the global ranks of each operation's group):

- an operation that overlaps another one in this process, at any moment, is *contended*, and so is
  the other;
- a contended operation that is not yet past its first collective issues exactly one collective — a
  load its first four-word all-gather carrying "contended" (pipeload.engine.loader), a save its plan all-gather
  carrying it as a problem — and every rank then raises together. Before it,
  it waits until the operations that entered this process earlier on overlapping groups are done, so
  its one collective never interleaves with theirs; as every contended operation issues exactly one
  collective, the pairing across ranks is count-consistent whatever the order on each rank;
- an operation that was already past its exchange when it became contended completes its collectives
  (their number and sizes come from the gathered plans, identical on its peers) and reports the
  contention at its final agreement: every rank raises, nothing is reported loaded or saved.
"""

from __future__ import annotations

import itertools
import threading
from typing import Iterable

import numpy as np

from ..errors import PipeloadError

CONTENDED = -1
"""The first word of a rank's first row gather when its operation is contended: a load's and a tier
restore's first collectives are both four-word row gathers with it in word 0 (where a load has a plan
token, never -1, and a restore a 64-bit host hash), so whichever of the two a rank's gather is paired
with, every rank sees the contention."""

_lock = threading.Lock()
_seq = itertools.count()
_active: dict[int, "Activity"] = {}


class Activity:
    """One load or save of this process, registered from its start to its end."""

    def __init__(self, what: str, ranks: Iterable[int]):
        self.what = what
        self.ranks = frozenset(ranks)
        self.thread = threading.get_ident()
        self.contended = False
        self.other: str | None = None
        with _lock:
            self.seq = next(_seq)
            for a in _active.values():
                if a.ranks & self.ranks:
                    a.contended = self.contended = True
                    a.other = a.other or self.what
                    self.other = self.other or a.what
            _active[self.seq] = self

    def earlier(self) -> list["Activity"]:
        """Operations that entered before this one, overlap it and are still running."""
        with _lock:
            return [a for s, a in _active.items() if s < self.seq and a.ranks & self.ranks]

    def message(self, rank: int) -> str:
        return (
            f"{self.what}: another pipeload operation ({self.other}) ran at the same time on an "
            f"overlapping process group on rank {rank}; run loads and saves on one group one after "
            f"the other"
        )

    def close(self) -> None:
        with _lock:
            _active.pop(self.seq, None)


__all__ = ["Activity"]


class Guard:
    """One operation's use of the registry: ``with Guard() as g`` around it, ``enter`` at its start.

    ``enter`` returns the problem to carry into the first collective (None when not contended); ``late``
    the error to carry into the final agreement.
    """

    def __init__(self) -> None:
        self.activity: Activity | None = None

    def __enter__(self) -> "Guard":
        return self

    def __exit__(self, *exc) -> None:
        if self.activity is not None:
            self.activity.close()

    def _register(self, comm, collective: bool, what: str) -> bool:
        if not collective:  # no collective at all: nothing to cross (a world of one, use_collectives=False)
            return False
        self.activity = Activity(what, comm.global_ranks)
        return True

    async def enter(self, comm, collective: bool, what: str) -> str | None:
        import asyncio

        if not self._register(comm, collective, what):
            return None
        await asyncio.sleep(0)  # operations started together in this event loop all register first
        a = self.activity
        if not a.contended:
            return None
        while a.earlier():
            await asyncio.sleep(0.005)
        return a.message(comm.rank)

    def enter_sync(self, comm, collective: bool, what: str, timeout: float) -> str | None:
        import time

        if not self._register(comm, collective, what):
            return None
        a = self.activity
        if not a.contended:
            return None
        deadline = time.monotonic() + timeout
        while True:
            earlier = a.earlier()
            if not earlier:
                return a.message(comm.rank)
            if any(e.thread == a.thread for e in earlier) or time.monotonic() > deadline:
                # An earlier operation suspended in this very thread (an event loop blocked by this
                # call) can never finish while we wait: refuse here, the only choice left.
                from ..errors import PipeloadError

                raise PipeloadError(a.message(comm.rank) + " (refused on this rank alone: the earlier "
                                    "operation cannot finish while this call blocks its thread)")
            time.sleep(0.005)

    def late(self, comm) -> str | None:
        a = self.activity
        return a.message(comm.rank) if a is not None and a.contended else None


def refuse_contended_or_disagreeing(what: str, contended_ranks: np.ndarray, option_words: np.ndarray,
                                    contended: str | None, options: str) -> None:
    """Raise, on every rank alike (all hold the same gathered words), when a rank's operation overlapped
    another (``contended_ranks``: a boolean per rank) or a rank passed other collective-deciding options
    than rank 0 (``option_words``: a hash of them per rank; ``options`` names them)."""
    if np.any(contended_ranks):
        ranks = np.flatnonzero(contended_ranks).tolist()
        raise PipeloadError(contended or f"{what}: another pipeload operation ran at the same time on an "
                            f"overlapping process group on rank(s) {ranks}; run loads and saves on one "
                            f"group one after the other")
    if len(np.unique(option_words)) > 1:
        odd = np.flatnonzero(option_words != option_words[0]).tolist()
        raise PipeloadError(f"{what}: rank(s) {odd} passed other {options} than rank 0; every rank must pass "
                            f"the same (they decide which collectives the operation issues)")
