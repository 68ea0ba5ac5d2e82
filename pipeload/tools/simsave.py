"""``pipeload simulate --op save``: the save's own planning and rank 0's commit for W ranks, in one process.

For a layout (:class:`pipeload.tools.simulate.Layout`) and a world size, every rank's exchange row and every
distinct name table and shard record are built with the saver's own encoders
(:mod:`pipeload.save.saveplan`) from each rank's boxes. Then, for a few sampled ranks, exactly what
:func:`pipeload.save` runs from its start to the first byte written runs:
:func:`pipeload.save.saver.plan_phase` (the reuse words, the local record of the rank's state dict, the
exchange, the plan, this rank's items), with :class:`SimSaveExchange` standing in for the collectives:
it hands the rank the words, rows and bytes the collectives would, counts the bytes, and fails if the
rank's own row or bytes differ from the generated ones. Nothing is re-implemented: when the saver's
planning breaks, so does this.

Rank 0's commit is measured too: every rank's file rows (its chunks in the whole plan, fake checksums)
are generated with the saver's encoder, and rank 0 runs :func:`pipeload.save.saver.commit_metadata` and
``_commit`` (chunk index, ``.metadata``, rename) into a temporary directory holding empty data files.

A sampled rank's state dict holds zero-stride CPU tensors of its local shapes (no memory) and the
layout's Python objects; its boxes come from the layout, as DTensor would place them.
"""

from __future__ import annotations

import gc
import os
import tempfile
import time
import tracemalloc
from typing import Any, Callable

import numpy as np
import torch

from ..save import savecache, saveplan
from ..engine._gcpause import paused_gc
from ..plan.exchange import received_bytes
from ..save.saveplan import KIND_OBJECT, KIND_TENSOR, LocalRecord
from .simulate import Layout
from ..plan.statedict import Box

_TORCH = {"BF16": torch.bfloat16, "F32": torch.float32}
_SAVE_WORD = 0x0123456789ABCDEF


class SimSaveExchange:
    """The save's collectives as one rank sees them, from every rank's rows and distinct bytes."""

    def __init__(self, rows: np.ndarray, tables: list[bytes], records: list[bytes], rank: int):
        self.rows, self.tables, self.records, self.rank = rows, tables, records, rank
        self.size = len(rows)
        self.global_ranks = range(self.size)
        self.pg = object()
        self.sent = self.received = 0
        self._transfers = 0

    def gather_rows(self, row: np.ndarray, what: str = "", call: str = "") -> np.ndarray:
        if len(row) == 2:  # the reuse words: no rank offers a kept plan; rank 0 sends the save id
            words = np.zeros((self.size, 2), dtype=np.int64)
            words[0, 1] = _SAVE_WORD
            got = words
        else:
            if not np.array_equal(row, self.rows[self.rank]):
                raise AssertionError(f"rank {self.rank}: the saver's row differs from the simulated one")
            got = self.rows
        self.sent += row.nbytes
        self.received += (self.size - 1) * row.nbytes
        return got

    def transfer_records(self, t, cls, mine: bytes, what: str = "") -> list[bytes]:
        expected = self.tables if self._transfers == 0 else self.records
        self._transfers += 1
        c = int(cls.of_rank[self.rank])
        if mine != expected[c]:
            raise AssertionError(f"rank {self.rank}: the saver's bytes differ from the simulated ones")
        self.received += received_bytes(t, cls, self.rank, self.size)
        if t.how == "gather":
            self.sent += t.pad
        elif t.how == "broadcast" and int(cls.owners[c]) == self.rank:
            self.sent += len(mine)
        return list(expected)

    def all_gather_object(self, obj: Any, what: str = "") -> list[Any]:
        raise AssertionError(f"rank {self.rank}: a simulated rank reported problems: {obj}")


def _record(lay: Layout, rank: int, objects: dict[str, bytes], object_sums: list[tuple[str, str]]) -> LocalRecord:
    """The record ``rank`` would build, from its boxes (the saver's encoders, not its local plan)."""
    names = sorted([*((t.fqn, t, o, ln) for t, o, ln in lay.boxes(rank)), *((o, None, None, None) for o in lay.objects)])
    entries, shards = [], []
    for i, (fqn, t, o, ln) in enumerate(names):
        if t is None:
            entries.append((fqn, KIND_OBJECT, "U8", ()))
        else:
            entries.append((fqn, KIND_TENSOR, t.dtype, tuple(t.shape)))
            shards.append((i, tuple(o), tuple(ln)))
    rec = LocalRecord(entries, shards, dict(objects), []).encode()
    rec.objects_word = saveplan.objects_word(object_sums)
    return rec


def _state(lay: Layout, rank: int) -> tuple[dict, dict[str, Box]]:
    sd: dict[str, Any] = {}
    boxes: dict[str, Box] = {}
    for t, o, ln in lay.boxes(rank):
        v = torch.zeros((), dtype=_TORCH[t.dtype]).expand(ln)  # a CPU tensor of the local shape, no memory
        sd[t.fqn] = v
        boxes[t.fqn] = Box(tuple(t.shape), tuple(o), tuple(ln), v)
    for o in lay.objects:
        sd[o] = (1e-4, (0.9, 0.95))
    return sd, boxes


def _plan_rank(rows, tables, records, rank: int, state):
    from ..save.saver import plan_phase

    sd, boxes = state
    ex = SimSaveExchange(rows, tables, records, rank)
    with paused_gc():
        sp = plan_phase(sd, "<simulated>", ex, None, box_of=lambda fqn, v, cache: boxes[fqn])
    savecache.clear()
    return sp, ex


def simulate_save(world: int, layout: str, *, optim: bool = False, samples: int = 3, memory: bool = True,
                  log: Callable[[str], None] | None = None) -> dict[str, Any]:
    """The save's planning for ``samples`` ranks of a ``world``-rank save of ``layout``, and rank 0's
    commit; a result dict (the load's keys where they mean the same)."""
    from ..io.checksum import checksum
    from ..save.saver import encode_object

    log = log or (lambda m: None)
    t0 = time.perf_counter()
    lay = Layout(layout, world, optim)
    objects = {o: encode_object((1e-4, (0.9, 0.95))) for o in lay.objects}
    sums = [(o, checksum(d)) for o, d in sorted(objects.items())]
    keys = [lay.class_of(r) for r in range(world)]
    rep: dict[tuple, int] = {}
    for r, k in enumerate(keys):
        rep.setdefault(k, r)
    rec_of = {k: _record(lay, r, objects, sums) for k, r in rep.items()}
    row_of = {k: saveplan.make_row(rec, False) for k, rec in rec_of.items()}
    rows = np.stack([row_of[k] for k in keys])
    ncls = saveplan._classes_of(rows, saveplan.R_NAMES, saveplan.R_NNBYTES)
    rcls = saveplan._classes_of(rows, saveplan.R_RECORD, saveplan.R_RNBYTES)
    tables = [rec_of[keys[int(o)]].names for o in ncls.owners]
    records = [rec_of[keys[int(o)]].record for o in rcls.owners]
    log(f"{world} rows, {len(tables)} distinct name tables, {len(records)} distinct records "
        f"({sum(map(len, records)) / 1e6:.2f} MB)")
    sampled = sorted({0, world // 2 + 3 if world > 8 else world // 2, world - 1})[:max(1, samples)]
    results = []
    for rank in sampled:
        state = _state(lay, rank)
        gc.collect()
        start = time.process_time()
        sp, ex = _plan_rank(rows, tables, records, rank, state)
        cpu = time.process_time() - start
        peak = None
        if memory:
            gc.collect()
            tracemalloc.start()
            _plan_rank(rows, tables, records, rank, state)
            peak = tracemalloc.get_traced_memory()[1]
            tracemalloc.stop()
        results.append(dict(rank=rank, cpu=cpu, peak=peak, sent=ex.sent, received=ex.received, plan=sp,
                            shards=len(rec_of[keys[rank]].shards)))
        log(f"rank {rank}: {cpu:.3f} s CPU, writes {len(sp.items)} items")
    full = saveplan.plan(saveplan.Exchanged(rows, rcls, records, ncls, tables), sampled[0], everything=True)
    identical = all(
        [it[0] for it in r["plan"].items] == [s[0] for s in savecache.Entry.of(full, rec_of[keys[r["rank"]]], r["rank"], rows).specs]
        and r["plan"].save_id == results[0]["plan"].save_id for r in results)
    commit = _rank0_commit(full, results[0]["plan"], world, memory)
    loads = full.loads.astype(np.float64)
    mean = loads.mean() if len(loads) else 0.0
    return {
        "op": "save", "layout": layout, "world": world, "optim": optim,
        "tensors": len(lay.tensors), "shards_per_rank": max(r["shards"] for r in results),
        "distinct_records": len(records), "distinct_name_tables": len(tables),
        "sampled_ranks": sampled,
        "per_rank_cpu_s": max(r["cpu"] for r in results),
        "per_rank_peak_mb": max(r["peak"] for r in results) / 2**20 if memory else None,
        "exchange_bytes_sent": max(r["sent"] for r in results),
        "exchange_bytes_received": max(r["received"] for r in results),
        "writer_balance": float(loads.max() / mean) if mean else 1.0,
        "writer_balance_bound": float(max(full.chunk_weight.max(initial=0), mean) / mean) if mean else 1.0,
        "plans_identical": bool(identical),
        **commit,
        "wall_s": time.perf_counter() - t0,
    }


def _file_rows(full, world: int) -> list[bytes | None]:
    """Every rank's file rows in the whole plan (checksums made up), through the saver's encoder."""
    width = full.shape.shape[1]
    order = np.argsort(full.writer, kind="stable")  # each writer's chunks in key order
    bounds = np.searchsorted(full.writer[order], np.arange(world + 1))
    objs: dict[int, list[int]] = {}
    for k, r in full.object_writer.items():
        objs.setdefault(r, []).append(k)
    out: list[bytes | None] = [None] * world
    for r in range(world):
        g = order[bounds[r] : bounds[r + 1]]
        ok = objs.get(r, [])
        if not len(g) and not ok:
            continue
        out[r] = saveplan.encode_file_rows(
            full.chunk_index[g], g.astype(np.int64) * 0x9E3779B1 + 1, full.chunk_offsets[g, :width],
            full.chunk_lengths[g, :width], ok, [1024] * len(ok), [7] * len(ok))
    return out


def _rank0_commit(full, plan0, world: int, memory: bool) -> dict[str, Any]:
    """What rank 0 receives and does to commit: the gathered file rows, the index and ``.metadata``."""
    from ..save.saver import _commit, commit_metadata, data_file_name

    per_rank = _file_rows(full, world)
    sizes = [len(b) if b else 0 for b in per_rank]
    received = (world - 1) * (max(sizes) + 2 * 8 + 8)  # the padded gather, the write words, the agreement
    with tempfile.TemporaryDirectory(prefix="pipeload-simulate-save-") as d:
        for r, b in enumerate(per_rank):
            if b:
                open(os.path.join(d, data_file_name(plan0.save_id, r)), "wb").close()
        gc.collect()
        start = time.process_time()
        with paused_gc():
            _commit(d, *commit_metadata(plan0, per_rank, world))
        cpu = time.process_time() - start
        peak = None
        if memory:
            gc.collect()
            tracemalloc.start()
            with paused_gc():
                _commit(d, *commit_metadata(plan0, per_rank, world))
            peak = tracemalloc.get_traced_memory()[1]
            tracemalloc.stop()
        md_bytes = sum(os.path.getsize(os.path.join(d, n)) for n in os.listdir(d))
    return {"rank0_commit_s": cpu, "rank0_commit_peak_mb": peak / 2**20 if memory else None,
            "rank0_commit_bytes_received": received, "metadata_bytes": md_bytes}


def format_save_result(res: dict[str, Any]) -> str:
    peak = f"{res['per_rank_peak_mb']:.1f} MB" if res["per_rank_peak_mb"] is not None else "-"
    cpeak = f", peak {res['rank0_commit_peak_mb']:.1f} MB" if res["rank0_commit_peak_mb"] is not None else ""
    return "\n".join([
        f"save, layout {res['layout']}{' + optimizer' if res['optim'] else ''}, W = {res['world']}: "
        f"{res['tensors']} tensors, {res['shards_per_rank']} shards per rank, {res['distinct_records']} distinct "
        f"records, {res['distinct_name_tables']} distinct name tables",
        f"  per-rank CPU        {res['per_rank_cpu_s']:.3f} s (max over ranks {res['sampled_ranks']})",
        f"  per-rank peak       {peak}",
        f"  exchange            sent {res['exchange_bytes_sent'] / 1e6:.3f} MB, "
        f"received {res['exchange_bytes_received'] / 1e6:.3f} MB per rank",
        f"  writer balance      {res['writer_balance']:.3f} (max/mean; bound {res['writer_balance_bound']:.3f}: "
        f"the largest chunk)",
        f"  plans identical     {res['plans_identical']}",
        f"  rank 0 commit       {res['rank0_commit_s']:.3f} s{cpeak}, received "
        f"{res['rank0_commit_bytes_received'] / 1e6:.3f} MB, wrote {res['metadata_bytes'] / 1e6:.2f} MB",
    ])
