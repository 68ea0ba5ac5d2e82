"""``pipeload simulate --op transfer``: a live transfer's planning for W trainer ranks and E engine ranks.

The group: trainer ranks ``0 .. W-1`` hold a model's weights as FSDP2 would, engine ranks ``W .. W+E-1``
(or, ``colocated``, the first E trainer ranks themselves) form ``E / tp`` replicas of tensor parallelism
``tp`` holding the fused layout of :func:`pipeload.tools.engineshape.engine_regions` (``qkv_proj`` row
blocks, KV heads replicated when ``tp`` exceeds them, ``gate_up_proj`` row blocks, ``o_proj`` /
``down_proj`` column blocks, every expert's rows split over the TP ranks into ``w13`` / ``w2``, a padded
vocabulary whose last block is shorter). Trainer layouts:

- ``fsdp``: every parameter ``Shard(0)`` over the W trainer ranks (``fully_shard`` on a 1-D mesh; ceil
  chunks, the last shorter, ranks past the rows hold nothing of it);
- ``hsdp``: ``Shard(0)`` over groups of ``shard_group`` consecutive ranks, replicated across the
  ``W / shard_group`` groups (``fully_shard`` on a 2-D (replicate, shard) mesh).

Every rank's boxes come from arithmetic on the model, with the name hashing and dtype codes of
:mod:`pipeload.live.sides`, so a rank's records are byte for byte what the real path encodes
(``tests/test_simulate_transfer.py`` checks that against real DTensor boxes and Slices).

For a few sampled ranks — rank 0, a trainer rank, an engine rank and the busiest owner (the rank whose
names carry the most pieces) — exactly what :func:`pipeload.transfer` runs to plan
(:func:`pipeload.live.api._plan`: its records, :func:`~pipeload.move.plan.records`, hashed for the layout
digest, the first gather, the records by owner, the all-to-all, :func:`~pipeload.move.plan.answer` as
owner, the second all-to-all, :func:`~pipeload.move.plan.decode`, the agreement; the cyclic GC paused as
:func:`pipeload.transfer` pauses it) runs against :class:`SimLink`, which hands the rank
what the collectives would: every rank's four-word row; as owner, the records every rank sends it
(generated per owner, columnar: :meth:`TransferWorld.incoming`); the answers every owner sends back
(:func:`~pipeload.move.plan.answer` run on each owner's own records: :func:`owners_answers`). The rank's
own rows and records must equal the generated ones, or the simulation fails.

Answers back are exact when every owner of a name the sampled ranks touch is run in full (``whole``,
the default up to :data:`WHOLE_PIECES` pieces in the plan); that also gives the sender balance (the
busiest trainer's bytes sent over the mean). Otherwise (``whole=False``) every owner that is not
sampled is run on its names' sources and the sampled ranks' own destination records only: the pieces
are the full plan's (they depend on the destination and the sources alone), the sender among a box's
replicas can differ, and a trainer rank receives only the sends for the sampled engine ranks.

The plan's size comes from the arithmetic first (:meth:`TransferWorld.sizes`: a destination row block
meets every source shard of its rows); a layout that gives one rank more than :data:`MAX_PIECES` pieces
(FSDP over all of 1k trainers of the 671B model: 19 M an engine rank) is reported and not run.
"""

from __future__ import annotations

import time
from dataclasses import replace
from typing import Any, Callable, NamedTuple

import numpy as np
import torch

from ..live import api
from ..live.sides import DTYPES, Side, _CODES, digest
from ..move import plan as moveplan
from ..move.plan import DST, HEAD, SRC, Box
from ..plan.exchange import hash64
from ._measure import timed
from .engineshape import Shape, checkpoint_shapes, engine_regions

MODELS = {
    # DeepSeek-V3-sized (GQA attention in place of MLA, no shared expert): 61 layers, the first 3 dense,
    # 256 experts of 2048, hidden 7168; 44,919 tensors, 672 B parameters
    "671b": Shape(layers=61, dense_layers=3, hidden=7168, heads=128, kv_heads=8, head_dim=128, inter=2048,
                  dense_inter=18432, experts=256, vocab=129280, dtype=torch.bfloat16),
    # Qwen3-235B-A22B-sized: 94 MoE layers of 128 experts of 1536, hidden 4096, 4 KV heads (replicated at
    # TP 8); 36,663 tensors, 235 B parameters
    "235b": Shape(layers=94, dense_layers=0, hidden=4096, heads=64, kv_heads=4, head_dim=128, inter=1536,
                  experts=128, vocab=151936, dtype=torch.bfloat16),
    # the transfer benchmark's shape at 2 layers (tests, quick runs)
    "small": Shape(layers=2, hidden=512, heads=8, kv_heads=2, head_dim=64, inter=512, experts=8, vocab=8192,
                   dtype=torch.bfloat16),
}
LAYOUTS = ("fsdp", "hsdp")
WHOLE_PIECES = 2_000_000_000  # run every owner in full (exact answers, sender balance) up to this many pieces
MAX_PIECES = 20_000_000  # a rank's pieces (as owner or as engine) past which the plan is not made: see sizes()


def _ceil(a, b):
    return -(-a // b)


class TransferWorld:
    """Every rank's boxes and records, from the model's arithmetic (see the module docstring)."""

    def __init__(self, shape: Shape, world: int, engines: int, tp: int = 8, layout: str = "fsdp",
                 shard_group: int = 8, colocated: bool = False):
        if layout not in LAYOUTS:
            raise ValueError(f"unknown transfer layout {layout!r} (one of {', '.join(LAYOUTS)})")
        group = world if layout == "fsdp" else shard_group
        if world < 1 or engines < tp or engines % tp or world % group:
            raise ValueError(f"need E a multiple of tp ({engines}, {tp}) and W a multiple of the shard group "
                             f"({world}, {group})")
        if colocated and engines > world:
            raise ValueError("colocated engines need E <= W")
        self.shape, self.world, self.engines, self.tp, self.layout = shape, world, engines, tp, layout
        self.group, self.colocated = group, colocated
        self.size = world if colocated else world + engines
        self.engine_base = 0 if colocated else world
        shapes = checkpoint_shapes(shape)
        self.names = list(shapes)
        self.shapes = [tuple(v) for v in shapes.values()]
        self.nd = max(len(v) for v in self.shapes)
        n = len(self.names)
        self.ndim = np.array([len(v) for v in self.shapes], dtype=np.int64)
        self.shp = np.zeros((n, self.nd), dtype=np.int64)
        for i, v in enumerate(self.shapes):
            self.shp[i, : len(v)] = v
        self.hashes = np.array([hash64(nm.encode()) for nm in self.names], dtype=np.int64)
        self.owner = moveplan.owner_of(self.hashes, self.size)
        self.code = _CODES[shape.dtype]
        self.itemsize = DTYPES[self.code].itemsize
        rows = self.shp[:, 0]
        self.chunk = _ceil(rows, group)
        self.k = _ceil(rows, self.chunk)  # shards that hold rows; the rest are empty and not sent
        self._src_index_tables()
        self._dest_tables()

    def _src_index_tables(self) -> None:
        """A trainer's index of name i is the number of earlier names its shard position holds rows of:
        per distinct shard count, how many earlier names have it."""
        self.kvals, which = np.unique(self.k, return_inverse=True)
        onehot = np.zeros((len(self.k) + 1, len(self.kvals)), dtype=np.int64)
        onehot[np.arange(1, len(self.k) + 1), which.ravel()] = 1
        self.kprefix = np.cumsum(np.cumsum(onehot, axis=0), axis=1)  # [i, v]: earlier names with k <= kvals[v]

    def src_index(self, i: int, s: np.ndarray) -> np.ndarray:
        pos = np.searchsorted(self.kvals, s, side="right") - 1
        below = np.where(pos >= 0, self.kprefix[i][np.maximum(pos, 0)], 0)
        return i - below

    def _dest_tables(self) -> None:
        """Per TP rank, its regions in order (name, offsets, lengths); and all of them by name."""
        at = {nm: i for i, nm in enumerate(self.names)}
        self.dest: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []
        cols = []
        for t in range(self.tp):
            regs = engine_regions(self.shape, self.tp, t)
            name = np.array([at[r.name] for r in regs], dtype=np.int64)
            off = np.zeros((len(regs), self.nd), dtype=np.int64)
            ln = np.zeros((len(regs), self.nd), dtype=np.int64)
            for j, r in enumerate(regs):
                off[j, : len(r.offsets)], ln[j, : len(r.lengths)] = r.offsets, r.lengths
            self.dest.append((name, off, ln))
            cols.append(np.column_stack([name, np.full(len(regs), t), np.arange(len(regs)), off, ln]))
        allr = np.concatenate(cols)
        allr = allr[np.argsort(allr[:, 0], kind="stable")]
        self.dest_by_name = allr
        self.dest_bounds = np.searchsorted(allr[:, 0], np.arange(len(self.names) + 1))

    # -- ranks ----------------------------------------------------------------------------------------

    def trainer(self, rank: int) -> int | None:
        """The shard position of a trainer rank, else None."""
        return rank % self.group if rank < self.world else None

    def engine(self, rank: int) -> int | None:
        """The TP rank of an engine rank, else None."""
        e = rank - self.engine_base
        return e % self.tp if 0 <= e < self.engines else None

    def engine_rank(self, replica: int, t: int) -> int:
        return self.engine_base + replica * self.tp + t

    def boxes(self, rank: int) -> tuple[list[Box], list[Box]]:
        """(sources, destinations) as :mod:`pipeload.live.sides` builds them on ``rank``."""
        src: list[Box] = []
        s = self.trainer(rank)
        if s is not None:
            for i in np.flatnonzero(s < self.k).tolist():
                shape = self.shapes[i]
                c = int(self.chunk[i])
                off, ln = (s * c,) + (0,) * (len(shape) - 1), (min(c, shape[0] - s * c),) + shape[1:]
                src.append(Box(int(self.hashes[i]), self.code, shape, off, ln, 0))
        dst: list[Box] = []
        t = self.engine(rank)
        if t is not None:
            name, off, ln = self.dest[t]
            for i, o, n in zip(name.tolist(), off.tolist(), ln.tolist()):
                d = len(self.shapes[i])
                dst.append(Box(int(self.hashes[i]), self.code, self.shapes[i], tuple(o[:d]), tuple(n[:d]), 0))
        return src, dst

    # -- records --------------------------------------------------------------------------------------

    def _rows(self, kind: int, name: np.ndarray, index: np.ndarray, off: np.ndarray, ln: np.ndarray) -> np.ndarray:
        w = moveplan.width(self.nd)
        rec = np.zeros((len(name), w), dtype=np.int64)
        rec[:, moveplan.K_KIND] = kind
        rec[:, moveplan.K_NAME] = self.hashes[name]
        rec[:, moveplan.K_DTYPE] = self.code
        rec[:, moveplan.K_NDIM] = self.ndim[name]
        rec[:, moveplan.K_INDEX] = index
        rec[:, HEAD: HEAD + self.nd] = self.shp[name]
        rec[:, HEAD + self.nd: HEAD + 2 * self.nd] = off
        rec[:, HEAD + 2 * self.nd:] = ln
        return rec

    def _src_rows(self, name: np.ndarray, s: np.ndarray, index: np.ndarray) -> np.ndarray:
        off = np.zeros((len(name), self.nd), dtype=np.int64)
        off[:, 0] = s * self.chunk[name]
        ln = self.shp[name].copy()
        ln[:, 0] = np.minimum(self.chunk[name], ln[:, 0] - off[:, 0])
        return self._rows(SRC, name, index, off, ln)

    def outgoing(self, rank: int) -> tuple[np.ndarray, np.ndarray]:
        """(words per owner, the words) ``rank`` sends in the first all-to-all, columnar."""
        parts, names = [], []
        s = self.trainer(rank)
        if s is not None:
            mine = np.flatnonzero(s < self.k)
            parts.append(self._src_rows(mine, np.full(len(mine), s), np.arange(len(mine))))
            names.append(mine)
        t = self.engine(rank)
        if t is not None:
            name, off, ln = self.dest[t]
            parts.append(self._rows(DST, name, np.arange(len(name)), off, ln))
            names.append(name)
        w = moveplan.width(self.nd)
        if not parts:
            return np.zeros(self.size, dtype=np.int64), np.zeros(0, dtype=np.int64)
        rec, owners = np.concatenate(parts), self.owner[np.concatenate(names)]
        order = np.argsort(owners, kind="stable")
        return np.bincount(owners, minlength=self.size) * w, rec[order].ravel()

    def incoming(self, owner: int, names: np.ndarray | None = None,
                 only: set[int] | None = None) -> tuple[np.ndarray, np.ndarray]:
        """The first all-to-all as ``owner`` receives it: (words from each rank, the words in rank order).
        ``names``: those names only (default: every name it owns); ``only``: of the destinations, the
        records of these ranks only (a restricted run, see the module docstring)."""
        names = np.flatnonzero(self.owner == owner) if names is None else names
        ranks, recs = [], []
        reps = np.arange(self.world // self.group)
        for i in names.tolist():
            s = np.arange(int(self.k[i]))
            r = (reps[:, None] * self.group + s[None, :]).ravel()
            ss = np.tile(s, len(reps))
            ranks.append(r)
            recs.append(self._src_rows(np.full(len(r), i), ss, np.tile(self.src_index(i, s), len(reps))))
            d = self.dest_by_name[self.dest_bounds[i]: self.dest_bounds[i + 1]]
            nrep = self.engines // self.tp
            dr = (self.engine_base + np.arange(nrep)[:, None] * self.tp + d[None, :, 1]).ravel()
            dd = np.tile(d, (nrep, 1))
            if only is not None:
                keep = np.isin(dr, list(only))
                dr, dd = dr[keep], dd[keep]
            ranks.append(dr)
            recs.append(self._rows(DST, dd[:, 0], dd[:, 2], dd[:, 3: 3 + self.nd], dd[:, 3 + self.nd:]))
        w = moveplan.width(self.nd)
        if not ranks:
            return np.zeros(self.size, dtype=np.int64), np.zeros(0, dtype=np.int64)
        r, rec = np.concatenate(ranks), np.concatenate(recs)
        order = np.lexsort((rec[:, moveplan.K_INDEX], rec[:, moveplan.K_KIND], r))
        return np.bincount(r, minlength=self.size) * w, rec[order].ravel()

    # -- the plan's size, from the arithmetic ---------------------------------------------------------

    def pieces_per_name(self) -> np.ndarray:
        """Pieces each name's plan has: per destination record, the source shards its dim-0 rows meet."""
        d = self.dest_by_name
        name, lo, n = d[:, 0], d[:, 3], d[:, 3 + self.nd]
        c, k = self.chunk[name], self.k[name]
        meet = np.minimum(k, _ceil(lo + n, c)) - np.minimum(k, lo // c)
        return np.bincount(name, weights=meet * (self.engines // self.tp), minlength=len(self.names)).astype(np.int64)

    def sizes(self, pieces: np.ndarray) -> dict[str, int]:
        """The plan's size from the arithmetic: every piece is a send row and a receive row (two answer
        rows of ``answer_width`` words) on its owner, an op on its sender and one on its receiver."""
        d = self.dest_by_name
        name, lo, n = d[:, 0], d[:, 3], d[:, 3 + self.nd]
        c, k = self.chunk[name], self.k[name]
        meet = np.minimum(k, _ceil(lo + n, c)) - np.minimum(k, lo // c)
        per_engine = np.bincount(d[:, 1], weights=meet, minlength=self.tp).astype(np.int64)
        per_owner = np.bincount(self.owner, weights=pieces, minlength=self.size)
        return {"pieces": int(pieces.sum()), "pieces_per_engine_rank": int(per_engine.max()),
                "pieces_busiest_owner": int(per_owner.max()),
                "busiest_owner_answer_bytes": int(per_owner.max()) * 2 * 8 * moveplan.answer_width(self.nd)}

    def row(self, rank: int, sampled: dict[int, int]) -> np.ndarray:
        """``rank``'s four words of the first gather: no kept plan, its digest (a sampled rank's real one,
        others a stand-in per class of identical ranks), widest rank | sides, no version."""
        s, t = self.trainer(rank), self.engine(rank)
        if s is not None and not np.any(s < self.k):
            s = None
        dig = sampled.get(rank) or hash64(repr((s, t)).encode()) or 1
        nd = max(int(self.ndim[s < self.k].max()) if s is not None else 0,
                 int(self.ndim[self.dest[t][0]].max()) if t is not None else 0)
        sides = (s is not None) | ((t is not None) << 1)
        return np.array([0, dig, nd | (sides << 8), api.NO_VERSION], dtype=np.int64)


# -- what every owner answers ------------------------------------------------------------------------

class Answered(NamedTuple):
    """The second all-to-all as each sampled rank receives it, and what the owners' answers add up to."""

    to: dict[int, tuple[np.ndarray, np.ndarray]]  # rank -> (words from each owner, the words in owner order)
    sent_bytes: np.ndarray | None  # per rank: the bytes it sends in the whole plan (``whole`` only)
    owners: int
    seconds: float  # the owners' answer() CPU, summed


def owners_answers(w: TransferWorld, sampled: list[int], whole: bool,
                   log: Callable[[str], None] = lambda m: None) -> Answered:
    """Run :func:`~pipeload.move.plan.answer` on every owner that owns a name (see the module docstring
    for ``whole``) and keep what each sampled rank receives."""
    nd, size = w.nd, w.size
    aw = moveplan.answer_width(nd)
    parts: dict[int, list[np.ndarray]] = {x: [] for x in sampled}
    counts = {x: np.zeros(size, dtype=np.int64) for x in sampled}
    sent = np.zeros(size, dtype=np.float64) if whole else None
    only = set(sampled)
    owners = np.unique(w.owner).tolist()
    cpu, t_log = 0.0, time.perf_counter()
    for n, o in enumerate(owners):
        inc = w.incoming(o) if whole or o in only else w.incoming(o, only=only)
        t0 = time.process_time()
        ac, words = moveplan.answer(*inc, nd, size, (w.world, w.engines))  # api._plan's sides, for relays
        cpu += time.process_time() - t0
        at = np.r_[0, np.cumsum(ac)]
        for x in sampled:
            counts[x][o] = ac[x]
            parts[x].append(words[at[x]: at[x + 1]].copy())  # (a view would keep every answer alive)
        if sent is not None:
            sent += _send_bytes(words.reshape(-1, aw), ac // aw, nd)
        if time.perf_counter() - t_log > 30:
            log(f"  owners answered: {n + 1} of {len(owners)}")
            t_log = time.perf_counter()
    to = {x: (counts[x], np.concatenate(parts[x]) if parts[x] else np.zeros(0, np.int64)) for x in sampled}
    return Answered(to, sent, len(owners), cpu)


_ITEMSIZE = np.array([d.itemsize for d in DTYPES], dtype=np.int64)


def _send_bytes(rows: np.ndarray, per_rank: np.ndarray, nd: int) -> np.ndarray:
    """Bytes each rank sends, from an owner's answer rows (in destination-rank order)."""
    dest = np.repeat(np.arange(len(per_rank)), per_rank)
    send = rows[:, moveplan.A_KIND] == moveplan.SEND
    ln = rows[send, moveplan.AHEAD + nd: moveplan.AHEAD + 2 * nd]
    ln = np.where(np.arange(nd) < rows[send, moveplan.A_NDIM][:, None], ln, 1)
    nbytes = ln.prod(axis=1) * _ITEMSIZE[rows[send, moveplan.A_DTYPE]]
    return np.bincount(dest[send], weights=nbytes, minlength=len(per_rank))


# -- one sampled rank's planning ---------------------------------------------------------------------

CALLS = {"all-gather of transfer rows": "rows", "all-to-all of transfer boxes": "boxes",
         "all-to-all of transfer answers": "answers", "agreement on the transfer's plan": "agreement"}


class SimLink:
    """The planning's collectives as one rank sees them (:class:`pipeload.move.link.Link`'s methods),
    counting the bytes each sends and receives; fails if the rank's own words differ from the world's."""

    def __init__(self, size: int, rank: int, rows: np.ndarray, outgoing, incoming, answers):
        self.size, self.rank, self.pg = size, rank, object()
        self.rows, self.outgoing, self.incoming, self.answers = rows, outgoing, incoming, answers
        self.bytes: dict[str, list[int]] = {}

    def _count(self, call: str, sent: int, received: int) -> None:
        b = self.bytes.setdefault(CALLS.get(call, call), [0, 0])
        b[0] += sent
        b[1] += received

    def gather_rows(self, row: np.ndarray, what: str = "", call: str = "all-gather of transfer rows") -> np.ndarray:
        if call == "agreement on the transfer's plan":
            if row[0]:
                raise AssertionError(f"rank {self.rank}: the simulated plan has problems")
            got = np.zeros((self.size, len(row)), dtype=np.int64)
        else:
            if not np.array_equal(row, self.rows[self.rank]):
                raise AssertionError(f"rank {self.rank}: its first gather's row {row.tolist()} differs from "
                                     f"the simulated {self.rows[self.rank].tolist()}")
            got = self.rows
        self._count(call, row.nbytes, (self.size - 1) * row.nbytes)
        return got

    def all_to_all(self, counts: np.ndarray, words: np.ndarray, what: str = "", call: str = "") -> tuple:
        if call == "all-to-all of transfer boxes":
            if not (np.array_equal(counts, self.outgoing[0]) and np.array_equal(words, self.outgoing[1])):
                raise AssertionError(f"rank {self.rank}: its records differ from the simulated ones")
            got_c, got = self.incoming
        else:
            got_c, got = self.answers
        others = np.arange(self.size) != self.rank
        n = int(others.sum())
        self._count(call, 8 * (n + int(counts[others].sum())), 8 * (n + int(got_c[others].sum())))
        return got_c, got

    def agree(self, what: str, error, call: str = "final agreement") -> None:
        self.gather_rows(np.array([error is not None, len(error or "")], dtype=np.int64), what, call)


def _sample(w: TransferWorld, rank: int, rows: np.ndarray, answered: Answered, memory: bool) -> dict[str, Any]:
    """One rank's planning (``api._plan``): CPU of a first pass, traced peak of a second."""
    src, dst = w.boxes(rank)
    s, d = Side(src, [None] * len(src), [""] * len(src)), Side(dst, [None] * len(dst), [""] * len(dst))
    outgoing, incoming = w.outgoing(rank), w.incoming(rank)
    links: list[SimLink] = []

    def run():
        link = SimLink(w.size, rank, rows, outgoing, incoming, answered.to[rank])
        links.append(link)
        out = api._plan(link, s, d, None, None, api.TransferStats(), "<simulated>", 0)
        api.clear()
        return out

    (sched, nd), cpu, peak = timed(run, memory)
    answers, link = sched.answers, links[0]
    return dict(rank=rank, role=_role(w, rank), cpu=cpu, peak=peak, bytes=link.bytes,
                sources=len(src), destinations=len(dst), records_received=len(incoming[1]) // moveplan.width(nd),
                answers_received=len(answered.to[rank][1]) // moveplan.answer_width(nd),
                sends=len(answers.sends), recvs=len(answers.recvs), local=len(answers.local),
                problems=len(answers.problems), covered=_covered(dst, answers),
                sends_inside=_inside(src, answers.sends))


def _role(w: TransferWorld, rank: int) -> str:
    parts = []
    if w.trainer(rank) is not None:
        parts.append(f"trainer (shard {w.trainer(rank)})")
    if w.engine(rank) is not None:
        parts.append(f"engine (TP rank {w.engine(rank)})")
    return " + ".join(parts) or "neither"


def _padded(boxes_or_ops, nd: int) -> tuple[np.ndarray, np.ndarray]:
    """(offsets, lengths) of boxes or ops, ``n x nd``, missing dims offset 0 and length 1."""
    off = np.zeros((len(boxes_or_ops), nd), dtype=np.int64)
    ln = np.ones((len(boxes_or_ops), nd), dtype=np.int64)
    for i, b in enumerate(boxes_or_ops):
        off[i, : len(b.offsets)], ln[i, : len(b.lengths)] = b.offsets, b.lengths
    return off, ln


def _covered(dst: list[Box], answers: moveplan.Answers) -> bool:
    """Whether every byte of every destination box lies in exactly one piece received or copied."""
    if not dst:
        return True
    ops = answers.recvs + answers.local
    nd = max(len(b.shape) for b in dst)
    boff, bln = _padded(dst, nd)
    off, ln = _padded(ops, nd)
    j = np.array([op.dst for op in ops], dtype=np.int64)
    if len(ops) and not (np.all(off >= boff[j]) and np.all(off + ln <= boff[j] + bln[j])):
        return False
    if not np.array_equal(np.bincount(j, weights=ln.prod(axis=1), minlength=len(dst)), bln.prod(axis=1)):
        return False
    # disjoint: along dim 0 between each piece and the farthest reach of the box's earlier pieces;
    # the boxes where pieces share rows are checked pair by pair
    big = int((boff + bln).max()) + 1
    order = np.lexsort((off[:, 0], j))
    lo = off[order, 0] + j[order] * big
    reach = np.maximum.accumulate(off[order, 0] + ln[order, 0] + j[order] * big)
    shared = np.flatnonzero(lo[1:] < reach[:-1]) + 1
    for box in np.unique(j[order][shared]).tolist():
        mine = np.flatnonzero(j == box)
        for a in range(len(mine)):
            for b in range(a + 1, len(mine)):
                x, y = mine[a], mine[b]
                if np.all(np.maximum(off[x], off[y]) < np.minimum(off[x] + ln[x], off[y] + ln[y])):
                    return False
    return True


def _inside(src: list[Box], sends: list) -> bool:
    """Whether every piece this rank sends lies inside the source box it names."""
    if not sends:
        return True
    nd = max(len(b.shape) for b in src)
    boff, bln = _padded(src, nd)
    off, ln = _padded(sends, nd)
    k = np.array([op.src for op in sends], dtype=np.int64)
    names = np.array([b.name for b in src], dtype=np.int64)
    return bool(np.all(names[k] == np.array([op.name for op in sends], dtype=np.int64))
                and np.all(off >= boff[k]) and np.all(off + ln <= boff[k] + bln[k]))


# -- the simulation -------------------------------------------------------------------------------

def sampled_ranks(w: TransferWorld, pieces: np.ndarray) -> tuple[list[int], int]:
    """(rank 0, a trainer rank, an engine rank of the last TP rank, the busiest owner; that owner)."""
    per_owner = np.bincount(w.owner, weights=pieces, minlength=w.size)
    busiest = int(np.argmax(per_owner))
    trainer = min(w.world - 1, w.world // 2 + 3)
    engine = w.engine_rank((w.engines // w.tp) // 2, w.tp - 1)
    return sorted({0, trainer, engine, busiest}), busiest


def simulate_transfer(world: int, layout: str = "fsdp", *, engines: int | None = None, tp: int = 8,
                      model: str = "671b", layers: int | None = None, shard_group: int = 8,
                      colocated: bool = False, whole: bool | None = None, memory: bool = True,
                      log: Callable[[str], None] | None = None, **_: Any) -> dict[str, Any]:
    """Plan a transfer of ``model`` from ``world`` trainer ranks into ``engines`` engine ranks (default
    ``world``); a result dict. ``whole``: run every owner in full (default: when the plan has at most
    :data:`WHOLE_PIECES` pieces)."""
    log = log or (lambda m: None)
    t0 = time.perf_counter()
    shape = MODELS[model] if layers is None else replace(MODELS[model], layers=layers)
    w = TransferWorld(shape, world, engines or world, tp, layout, shard_group, colocated)
    pieces = w.pieces_per_name()
    size = w.sizes(pieces)
    whole = size["pieces"] <= WHOLE_PIECES if whole is None else whole
    sampled, busiest = sampled_ranks(w, pieces)
    if max(size["pieces_per_engine_rank"], size["pieces_busiest_owner"]) > MAX_PIECES:
        return _too_large(w, shape, model, size, t0)
    log(f"{world} trainer + {w.engines} engine ranks ({'colocated, ' if colocated else ''}group of {w.size}), "
        f"{len(w.names):,} tensors, {size['pieces']:,} pieces in the plan ({size['pieces_per_engine_rank']:,} an "
        f"engine rank, {size['pieces_busiest_owner']:,} the busiest owner's); sampled ranks {sampled}; "
        f"{'every owner in full' if whole else 'owners restricted to the sampled ranks'}")
    digests = {}
    for r in sampled:
        src, dst = w.boxes(r)
        digests[r] = digest(Side(src, [], []), Side(dst, [], []))
    rows = np.stack([w.row(r, digests) for r in range(w.size)])
    answered = owners_answers(w, sampled, whole, log)
    log(f"owners answered: {answered.owners} in {answered.seconds:.1f} s CPU")
    results = []
    for r in sampled:
        results.append(_sample(w, r, rows, answered, memory))
        res = results[-1]
        log(f"rank {r} ({res['role']}): {res['cpu']:.3f} s CPU, {res['records_received']:,} records as owner, "
            f"{res['sends']:,} sends, {res['recvs']:,} receives, {res['local']:,} local")
    return _result(w, shape, model, sampled, busiest, results, answered, size, whole, t0)


def _config(w: TransferWorld, shape: Shape, model: str) -> dict[str, Any]:
    return {"op": "transfer", "model": model, "layers": shape.layers, "tensors": len(w.names),
            "parameters": sum(int(np.prod(s)) for s in w.shapes), "layout": w.layout, "shard_group": w.group,
            "world": w.world, "engine_world": w.engines, "tp": w.tp, "colocated": w.colocated, "group_size": w.size}


def _too_large(w: TransferWorld, shape: Shape, model: str, size: dict, t0: float) -> dict[str, Any]:
    """The result when a rank's part of the plan is past :data:`MAX_PIECES`: its size, nothing run."""
    return {**_config(w, shape, model), **size, "too_large": True, "plan_consistent": False,
            "wall_s": time.perf_counter() - t0}


def _result(w: TransferWorld, shape: Shape, model: str, sampled: list[int], busiest: int, results: list[dict],
            answered: Answered, size: dict, whole: bool, t0: float) -> dict[str, Any]:
    memory = results[0]["peak"] is not None
    calls = sorted({c for r in results for c in r["bytes"]}, key=list(CALLS.values()).index)
    balance = None
    if answered.sent_bytes is not None:
        tr = answered.sent_bytes[: w.world]
        balance = {"max_bytes": float(tr.max()), "mean_bytes": float(tr.mean()), "min_bytes": float(tr.min()),
                   "max_over_mean": float(tr.max() / tr.mean()) if tr.mean() else 1.0}
    return {
        **_config(w, shape, model), **size, "too_large": False,
        "answers": "exact: every owner in full" if whole else
        "restricted: other owners on the sampled ranks' own destinations (a trainer's sends: to those only)",
        "sampled_ranks": sampled, "busiest_owner": busiest,
        "per_rank_cpu_s": max(r["cpu"] for r in results),
        "per_rank_peak_mb": max(r["peak"] for r in results) if memory else None,
        "exchange_bytes_sent": max(sum(b[0] for b in r["bytes"].values()) for r in results),
        "exchange_bytes_received": max(sum(b[1] for b in r["bytes"].values()) for r in results),
        "received_per_call": {c: max(r["bytes"].get(c, [0, 0])[1] for r in results) for c in calls},
        "ranks": results,
        "sender_balance": balance,
        "owners_answer_cpu_s": answered.seconds,
        "plan_consistent": all(r["covered"] and r["sends_inside"] and not r["problems"] for r in results),
        "wall_s": time.perf_counter() - t0,
    }


def format_transfer_result(res: dict[str, Any]) -> str:
    mb = 1e6
    p = res["parameters"]
    head = f"transfer, model {res['model']} ({res['tensors']:,} tensors, " + \
        (f"{p / 1e9:.0f} B" if p >= 1e9 else f"{p / 1e6:.0f} M") + " parameters), " + \
        (f"{res['layout']}{'' if res['layout'] == 'fsdp' else ' (shard group ' + str(res['shard_group']) + ')'}: "
         f"W = {res['world']} trainers -> E = {res['engine_world']} engine ranks at TP {res['tp']}"
         f"{' (colocated)' if res['colocated'] else ''}; {res['pieces']:,} pieces ({res['pieces_per_engine_rank']:,} "
         f"an engine rank)")
    if res["too_large"]:
        gb = res["busiest_owner_answer_bytes"] / 1e9
        return "\n".join([head, f"  not planned: the busiest owner would answer {res['pieces_busiest_owner']:,} pieces "
                          f"({gb:.1f} GB of answers) and an engine rank receive {res['pieces_per_engine_rank']:,} "
                          f"ops; a rank's share past {MAX_PIECES:,} is not simulated (the sources' shards are too "
                          f"small for these destinations: each piece is one send and one receive)"])
    lines = [head + f"; answers {res['answers']}"]
    for r in res["ranks"]:
        peak = f"{r['peak']:.1f} MB" if r["peak"] is not None else "-"
        recv = ", ".join(f"{c} {b[1] / mb:.2f}" for c, b in r["bytes"].items())
        lines.append(f"  rank {r['rank']:>6} {r['role']:<26} {r['cpu']:.3f} s, peak {peak}; owner of "
                     f"{r['records_received']:,} records; {r['sends']:,} sends, {r['recvs']:,} receives, "
                     f"{r['local']:,} local; received MB: {recv}")
    b = res["sender_balance"]
    lines += [
        f"  per-rank CPU        {res['per_rank_cpu_s']:.3f} s (max over ranks {res['sampled_ranks']}; busiest owner "
        f"{res['busiest_owner']}: {res['pieces_busiest_owner']:,} pieces)",
        *([f"  per-rank peak       {res['per_rank_peak_mb']:.1f} MB"] if res["per_rank_peak_mb"] is not None else []),
        f"  exchange            sent {res['exchange_bytes_sent'] / mb:.3f} MB, received "
        f"{res['exchange_bytes_received'] / mb:.3f} MB per rank (max)",
        "  sender balance      " + (f"{b['max_over_mean']:.3f} (max {b['max_bytes'] / 2**30:.3f} GiB, mean "
                                    f"{b['mean_bytes'] / 2**30:.3f} GiB, min {b['min_bytes'] / 2**30:.3f} GiB a "
                                    f"trainer)" if b else "- (needs every owner in full: --whole)"),
        f"  plan consistent     {res['plan_consistent']} (each sampled destination byte in exactly one piece, "
        f"sends inside their sources, no problems)",
    ]
    return "\n".join(lines)
