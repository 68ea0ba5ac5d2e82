"""``pipeload simulate --op restore``: the restore's planning from a memory tier for W ranks, one host lost.

For a layout (:class:`pipeload.tools.simulate.Layout`: dense, MoE, FSDP) and a world of W ranks on
hosts of 8, every rank's tier listing is generated as the snapshot's placement leaves it (replicas=2:
each rank's file on its own host and on the next host of the ring, the root shared by the host's
ranks, one complete step), then one host's root is emptied (a replaced node). For a few sampled ranks
— one of the lost host, the rank that holds the copy of its file, and others — exactly what
:func:`pipeload.tier.restore` plans before its first read runs: the layout digest of its state dict
(:func:`pipeload.tier.restoreplan.layout_digest`), its listing, the two gathers
(:func:`pipeload.tier.restoreplan.plan`, through :class:`SimTierExchange`, which hands the rank the
words the collectives would and fails if its own row or listing differs from the generated one), the
step chosen, the layout check and the source of every lost file. The plans of the sampled ranks must be
identical. Non-sampled ranks' digests are stand-ins (a hash of their class): only equality matters.
"""

from __future__ import annotations

import time
from typing import Any, Callable

import numpy as np

from ..formats.chunks import dtype_itemsize
from ..plan.exchange import hash64
from ..tier import restoreplan
from ._measure import timed
from .simulate import GPUS_PER_HOST, Layout

STEP = 1000
REPLICAS = 2


class SimTierExchange:
    """The restore's two gathers as one rank sees them (counting bytes sent and received)."""

    def __init__(self, rows: np.ndarray, listings: np.ndarray, counts: np.ndarray, rank: int):
        self.rows, self.listings, self.counts, self.rank = rows, listings, counts, rank
        self.sent = self.received = 0

    def gather_rows(self, row: np.ndarray, what: str = "", call: str = "") -> np.ndarray:
        if call == "all-gather of tier rows":
            expect = self.rows
        else:
            pad = int(self.counts.max())
            expect = self.listings[:, :pad].reshape(len(self.rows), -1)
        if not np.array_equal(row, expect[self.rank]):
            raise AssertionError(f"rank {self.rank}: the restore's {call} row differs from the simulated one")
        self.sent += row.nbytes
        self.received += (len(expect) - 1) * row.nbytes
        return expect


def _file_bytes(lay: Layout, rank: int) -> int:
    return sum(int(np.prod(n, dtype=np.int64)) * dtype_itemsize(t.dtype) for t, _, n in lay.boxes(rank))


def _digest(lay: Layout, rank: int) -> int:
    """The restore's own layout digest of ``rank``'s state dict (its boxes, as DTensor would place them)."""
    return restoreplan.layout_digest(((t.fqn, t.dtype, t.shape, o, n) for t, o, n in lay.boxes(rank)),
                                     lay.objects)


def world_listings(lay: Layout, lost: int, sampled: list[int]):
    """(rows, padded listings W x E x 5, counts, digests): every rank's words with host ``lost`` emptied."""
    world = lay.world
    hosts = world // GPUS_PER_HOST
    cls_digest: dict[tuple, int] = {}
    digests = np.zeros(world, dtype=np.int64)
    nbytes = np.zeros(world, dtype=np.int64)
    for r in range(world):
        k = lay.class_of(r)
        if k not in cls_digest:
            cls_digest[k] = (hash64(repr(k).encode()), _file_bytes(lay, r))
        digests[r], nbytes[r] = cls_digest[k]
    for r in sampled:
        digests[r] = _digest(lay, r)  # (a sampled rank's row must be what the restore computes)
    rows = np.zeros((world, restoreplan.ROW_WORDS), dtype=np.int64)
    host_words = np.array([hash64(f"host-{h}".encode()) for h in range(hosts)], dtype=np.int64)
    rows[:, restoreplan.R_HOST] = np.repeat(host_words, GPUS_PER_HOST)
    rows[:, restoreplan.R_LAYOUT] = digests
    per_host = GPUS_PER_HOST * min(REPLICAS, hosts)
    listings = np.full((world, per_host, restoreplan.ENTRY_WORDS), -1, dtype=np.int64)
    counts = np.zeros(world, dtype=np.int64)
    for h in range(hosts):
        if h == lost:
            continue
        files = np.concatenate([np.arange(g * GPUS_PER_HOST, (g + 1) * GPUS_PER_HOST)
                                for g in sorted({(h - k) % hosts for k in range(min(REPLICAS, hosts))})])
        block = np.column_stack([np.full(len(files), STEP), files, np.full(len(files), world), digests[files],
                                 nbytes[files]])
        block = restoreplan.encode_listing(map(tuple, block.tolist()))
        listings[h * GPUS_PER_HOST:(h + 1) * GPUS_PER_HOST, :len(block)] = block
        counts[h * GPUS_PER_HOST:(h + 1) * GPUS_PER_HOST] = len(block)
    rows[:, restoreplan.R_COUNT] = counts
    return rows, listings, counts, digests


def _sample(lay: Layout, rank: int, rows, listings, counts, memory: bool) -> dict[str, Any]:
    """One sampled rank's restore planning: CPU of a first pass, peak memory of a second (traced) one."""
    seen: list = []

    def run():
        ex = SimTierExchange(rows, listings, counts, rank)
        layout = _digest(lay, rank)  # from its state dict's boxes, as the restore computes it
        mine = listings[rank, : counts[rank]]
        planned = restoreplan.plan(ex, int(rows[rank, restoreplan.R_HOST]), layout, mine, "<simulated>")
        if not seen:
            seen.append(ex)
        return planned

    planned, cpu, peak = timed(run, memory)
    ex = seen[0]
    sp = planned.same_plan
    return dict(rank=rank, cpu=cpu, peak=peak, sent=ex.sent, received=ex.received,
                step=planned.choice.step if planned.choice else None, same=planned.same,
                plan=None if sp is None else (sp.local.tobytes(), tuple(sorted(sp.source.items()))),
                sends=len(sp.sends(rank)) if sp else 0, receives=int(sp is not None and not sp.local[rank]))


def simulate_restore(world: int, layout: str, *, optim: bool = False, samples: int = 3, memory: bool = True,
                     log: Callable[[str], None] | None = None, **_: Any) -> dict[str, Any]:
    """Plan a restore of ``layout`` at ``world`` ranks after one host (the middle one) lost its tier."""
    log = log or (lambda m: None)
    t0 = time.perf_counter()
    lay = Layout(layout, world, optim)
    hosts = world // GPUS_PER_HOST
    lost = hosts // 2
    receiver = lost * GPUS_PER_HOST + 3
    source = ((lost + 1) % hosts) * GPUS_PER_HOST + 3  # the next host holds the lost host's copies
    sampled = sorted({receiver, source, 0, world - 1})[:max(2, samples + 1)]
    rows, listings, counts, _ = world_listings(lay, lost, sampled)
    log(f"{world} ranks on {hosts} hosts, host {lost} lost; {int(counts.sum())} listed files")
    results = []
    for r in sampled:
        res = _sample(lay, r, rows, listings, counts, memory)
        log(f"rank {r}: {res['cpu']:.3f} s CPU, sends {res['sends']}, receives {res['receives']}")
        results.append(res)
    first = results[0]
    return {
        "op": "restore", "layout": layout, "world": world, "optim": optim, "hosts": hosts, "lost_host": lost,
        "sampled_ranks": sampled, "step": first["step"], "same_layout": first["same"],
        "per_rank_cpu_s": max(r["cpu"] for r in results),
        "per_rank_peak_mb": max(r["peak"] for r in results) if memory else None,
        "exchange_bytes_sent": max(r["sent"] for r in results),
        "exchange_bytes_received": max(r["received"] for r in results),
        "files_sent_by_source": next(r["sends"] for r in results if r["rank"] == source),
        "plans_identical": all(r["plan"] == first["plan"] and r["step"] == STEP for r in results)
        and first["plan"] is not None,
        "wall_s": time.perf_counter() - t0,
    }


def format_restore_result(res: dict[str, Any]) -> str:
    lines = [
        f"restore, layout {res['layout']}{' + optimizer' if res['optim'] else ''}, W = {res['world']} on "
        f"{res['hosts']} hosts, host {res['lost_host']} lost: step {res['step']}, same layout {res['same_layout']}",
        f"  per-rank CPU        {res['per_rank_cpu_s']:.3f} s (max over ranks {res['sampled_ranks']})",
    ]
    if res["per_rank_peak_mb"] is not None:
        lines.append(f"  per-rank peak       {res['per_rank_peak_mb']:.1f} MB")
    lines += [
        f"  exchange            sent {res['exchange_bytes_sent'] / 1e6:.3f} MB, "
        f"received {res['exchange_bytes_received'] / 1e6:.3f} MB per rank",
        f"  files sent by the lost rank's source  {res['files_sent_by_source']}",
        f"  plans identical     {res['plans_identical']}",
    ]
    return "\n".join(lines)
