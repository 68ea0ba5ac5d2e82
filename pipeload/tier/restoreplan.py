"""The restore's planning: pure functions over what every rank gathered (no I/O, no torch.distributed).

Every rank lists what its own tier root holds and sends it in two gathers (:func:`exchange`): a fixed
row (its host, the digest of the layout it loads into, how many entries it lists) and, padded to the
longest list, one entry per rank file it can read: ``(step, saved rank, saved world, layout digest of
the file, its bytes)``. From those words alone, identically on every rank:

- :func:`choose`: the newest step whose files, over the ranks that can still read them, cover every
  saved rank ``0 .. W_saved - 1`` (a file every reader of which failed its checksum is excluded: the
  decision is re-taken without it, never a step mixed with another). None: the fallback.
- :func:`same_layout`: the load's world is the saved world and every rank's destination layout digest
  equals its saved rank's file's: rank ``r`` needs exactly rank ``r``'s file.
- :func:`same_layout_plan`: rank ``r`` reads its file from its own root when it lists it (a private
  read); every other file is read by a *source* among the ranks that list it, chosen by the balanced
  greedy (:func:`pipeload.plan.balance.assign`: heaviest file first, to the candidate with the fewest
  bytes so far, counting its own file; ties to the lower rank), and sent to ``r`` point to point. The
  source need not need what it reads: sources are not destinations.
- any other layout (resharding) is not planned here: :mod:`pipeload.tier.reshard` hands the chosen
  step's stored chunks, as source boxes of the ranks that list their files, and every rank's destination
  boxes to the live transfer's planner (:mod:`pipeload.move.plan`).

Cost per rank: the rows are ``W x 4`` words, the entries ``W x E x 5`` words with ``E`` the longest
list (ranks per host x replicas x steps kept); choosing and the same-layout plan are O(entries) numpy
plus O(lost files x candidates) for the greedy.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Iterable, NamedTuple

import numpy as np

from ..engine._busy import CONTENDED
from ..plan.balance import assign
from ..plan.exchange import hash64

ROW_WORDS = 4  # host, layout digest, entries, flags
R_HOST, R_LAYOUT, R_COUNT, R_FLAGS = range(ROW_WORDS)
ENTRY_WORDS = 5  # step, saved rank, saved world, layout digest of the file, bytes of the file
E_STEP, E_RANK, E_WORLD, E_DIGEST, E_BYTES = range(ENTRY_WORDS)
STEPS_LISTED = 2  # the newest complete steps a rank reports (keep=1: the newest and the one before it)


def layout_digest(tensors: Iterable[tuple], objects: Iterable[str]) -> int:
    """The digest of what a rank holds: ``tensors`` as (fqn, safetensors dtype name, global shape, offsets,
    lengths), ``objects`` as fqns; independent of their order. The same for a state dict and for the
    rank file that holds exactly its boxes (so equal digests mean "this file is this rank's state")."""
    canon = sorted((str(f), str(d), [int(x) for x in s], [int(x) for x in o], [int(x) for x in n])
                   for f, d, s, o, n in tensors)
    return hash64(json.dumps([canon, sorted(map(str, objects))], separators=(",", ":")).encode())


def encode_listing(files: Iterable[tuple[int, int, int, int, int]]) -> np.ndarray:
    """A rank's entries ``(step, saved rank, saved world, digest, bytes)`` as a flat int64 array, the
    newest :data:`STEPS_LISTED` steps only, sorted (the order of a rank's listing never matters)."""
    rows = sorted({tuple(int(x) for x in f) for f in files}, reverse=True)
    steps = sorted({r[E_STEP] for r in rows}, reverse=True)[:STEPS_LISTED]
    kept = [r for r in sorted(rows) if r[E_STEP] in steps]
    return np.asarray(kept, dtype=np.int64).reshape(-1, ENTRY_WORDS)


class Gathered(NamedTuple):
    """Every rank's row and entries: ``entries`` columns are (holder rank, *entry words)."""

    rows: np.ndarray  # W x ROW_WORDS
    entries: np.ndarray  # N x (1 + ENTRY_WORDS), sorted by (step, saved rank, holder)


def exchange(ex, host: int, layout: int, listing: np.ndarray, what: str, flags: int = 0) -> Gathered:
    """The restore's two gathers through ``ex`` (:class:`pipeload.engine.comm.Comm` or a simulated one):
    the fixed rows, then every rank's entries padded to the longest list. Every rank takes both, unless
    some row's host word is :data:`~pipeload.engine._busy.CONTENDED` (``host`` of a rank whose restore
    overlaps another operation in its process): then every rank stops after the rows, and refuses."""
    listing = np.asarray(listing, dtype=np.int64).reshape(-1, ENTRY_WORDS)
    row = np.array([host, layout, len(listing), flags], dtype=np.int64)
    rows = ex.gather_rows(row, what, "all-gather of tier rows")
    counts = rows[:, R_COUNT]
    pad = int(counts.max()) if len(counts) else 0
    if pad == 0 or np.any(rows[:, R_HOST] == CONTENDED):  # (a contended operation issues this gather only)
        return Gathered(rows, np.zeros((0, 1 + ENTRY_WORDS), dtype=np.int64))
    mine = np.full((pad, ENTRY_WORDS), -1, dtype=np.int64)
    mine[: len(listing)] = listing
    every = ex.gather_rows(mine.ravel(), what, "all-gather of tier listings").reshape(len(rows), pad, ENTRY_WORDS)
    keep = np.arange(pad)[None, :] < counts[:, None]
    holder = np.broadcast_to(np.arange(len(rows))[:, None], keep.shape)[keep]
    entries = np.column_stack([holder, every[keep]]).astype(np.int64)
    return Gathered(rows, _sorted(entries))


def _sorted(entries: np.ndarray) -> np.ndarray:
    order = np.lexsort((entries[:, 0], entries[:, 1 + E_RANK], entries[:, 1 + E_STEP]))
    return entries[order]


def exclude(g: Gathered, bad: Iterable[tuple[int, int, int]]) -> Gathered:
    """``g`` without the entries (holder, step, saved rank) in ``bad`` (copies that failed a check)."""
    bad = {tuple(map(int, b)) for b in bad}
    if not bad or not len(g.entries):
        return g
    e = g.entries
    keep = np.array([(int(h), int(s), int(f)) not in bad
                     for h, s, f in zip(e[:, 0], e[:, 1 + E_STEP], e[:, 1 + E_RANK])], dtype=bool)
    return Gathered(g.rows, e[keep])


@dataclass
class Choice:
    """The step chosen and, per saved rank, who can read its file."""

    step: int
    world: int  # saved world
    starts: np.ndarray  # per saved rank f: entries[starts[f]:starts[f+1]] are its holders (by rank)
    entries: np.ndarray  # of the chosen step only, sorted by (saved rank, holder)
    digests: np.ndarray  # per saved rank: its file's layout digest (the lowest holder's)
    nbytes: np.ndarray  # per saved rank: its file's bytes

    def holders(self, f: int) -> np.ndarray:
        return self.entries[self.starts[f]: self.starts[f + 1], 0]

    def holds(self, rank: int, f: int) -> bool:
        h = self.holders(f)
        i = np.searchsorted(h, rank)
        return bool(i < len(h) and h[i] == rank)


def choose(g: Gathered) -> Choice | None:
    """The newest step every saved rank's file of which some rank lists; None when no step is whole.

    A step whose entries disagree on the saved world is damaged (a root of another layout's job kept
    under the same job id): it is skipped, as an incomplete one is."""
    e = g.entries
    if not len(e):
        return None
    for step in np.unique(e[:, 1 + E_STEP])[::-1].tolist():
        sel = e[e[:, 1 + E_STEP] == step]
        worlds = np.unique(sel[:, 1 + E_WORLD])
        if len(worlds) != 1 or worlds[0] < 1:
            continue
        world = int(worlds[0])
        f = sel[:, 1 + E_RANK]
        if f.min() < 0 or f.max() >= world:
            continue
        first = np.searchsorted(f, np.arange(world + 1))  # (sel is sorted by saved rank, then holder)
        if np.any(first[1:] == first[:-1]):
            continue  # some saved rank's file is on no live rank
        lead = sel[first[:-1]]
        return Choice(int(step), world, first, sel, lead[:, 1 + E_DIGEST].copy(), lead[:, 1 + E_BYTES].copy())
    return None


def _restrict(c: Choice, keep: np.ndarray) -> Choice:
    """``c`` with only the holders in ``keep`` (each saved rank keeps at least one)."""
    sel = c.entries[keep]
    first = np.searchsorted(sel[:, 1 + E_RANK], np.arange(c.world + 1))
    lead = sel[first[:-1]]
    return Choice(c.step, c.world, first, sel, lead[:, 1 + E_DIGEST].copy(), lead[:, 1 + E_BYTES].copy())


def same_layout(g: Gathered, c: Choice) -> tuple[bool, Choice]:
    """(whether rank r's destinations are exactly saved rank r's file for every r, the choice with only
    the copies that can serve): alike on every rank. A copy serves when its layout digest is the one its
    file is used with — the receiving rank's own (same layout), else the lowest holder's, whose header
    describes the chunks to every rank (resharding): a copy whose record differs is a damaged copy."""
    f = c.entries[:, 1 + E_RANK]
    if len(g.rows) == c.world:
        match = c.entries[:, 1 + E_DIGEST] == g.rows[f, R_LAYOUT]
        if np.all(np.bincount(f[match], minlength=c.world) > 0):
            return True, _restrict(c, match)
    return False, _restrict(c, c.entries[:, 1 + E_DIGEST] == c.digests[f])


@dataclass
class SamePlan:
    """Same layout: each rank's file is local, or comes from ``source[f]`` (a rank that lists it)."""

    local: np.ndarray  # bool per rank
    source: dict[int, int] = field(default_factory=dict)  # saved rank (= receiver) -> the rank that sends it

    def sends(self, rank: int) -> list[int]:
        """The files ``rank`` reads and sends, in the global order (by receiver)."""
        return sorted(f for f, s in self.source.items() if s == rank)


def same_layout_plan(c: Choice) -> SamePlan:
    """Local where the rank lists its own file; every other file from a source by the balanced greedy
    among its holders, counting each rank's own file as bytes it reads anyway."""
    e = c.entries
    own = e[e[:, 0] == e[:, 1 + E_RANK]]
    local = np.zeros(c.world, dtype=bool)
    local[own[:, 0]] = True
    lost = np.flatnonzero(~local).tolist()
    if not lost:
        return SamePlan(local)
    base = {int(r): int(c.nbytes[r]) for r in own[:, 0].tolist()}
    weights = {f: int(c.nbytes[f]) for f in lost}
    holders = {f: c.holders(f).tolist() for f in lost}
    return SamePlan(local, assign(weights, holders, base))


class Planned(NamedTuple):
    """One restore's decisions: None ``choice``: no whole step (the fallback)."""

    gathered: Gathered
    choice: Choice | None
    same: bool
    same_plan: SamePlan | None


def decide(g: Gathered) -> Planned:
    """The step, whether the layout is the saved one, and the same-layout plan, from gathered words."""
    c = choose(g)
    if c is None:
        return Planned(g, None, False, None)
    same, c = same_layout(g, c)
    return Planned(g, c, same, same_layout_plan(c) if same else None)


def plan(ex, host: int, layout: int, listing: np.ndarray, what: str) -> Planned:
    """The restore's planning on one rank: its two gathers through ``ex``, then :func:`decide`."""
    return decide(exchange(ex, host, layout, listing, what))
