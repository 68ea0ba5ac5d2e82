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
from typing import Any, Callable, NamedTuple

import numpy as np
import torch

from ..plan import keyowners
from ..save import savecache, saveowners, saveplan
from ..engine._gcpause import paused_gc
from ..plan.exchange import received_bytes
from ..save.saveplan import KIND_OBJECT, KIND_TENSOR, LocalRecord
from ..save.saver import REUSE_CALL
from ._measure import timed
from .simulate import Layout
from ..plan.statedict import Box

_TORCH = {"BF16": torch.bfloat16, "F32": torch.float32}
_SAVE_WORD = 0x0123456789ABCDEF


class SaveKeyWorld:
    """What the save's tensor-owner rounds (:mod:`pipeload.save.saveowners`) hand each rank, from every
    rank's record.

    Round 1 comes from the module's own row format over every class's chunks, round 2 from
    :func:`~pipeload.save.saveowners.answer_messages` on exactly the words each owner a rank hears from
    received. The gathered summaries come from the digest path's whole plan (``full``: its bytes alone
    and holder sets), a second derivation: a sampled rank's summary must equal it, or the simulation fails.
    """

    def __init__(self, xc: saveplan.Exchanged, full: saveplan.Plan):
        self.p, self.gmap = saveplan.key_table(xc)
        self.cls, self.world = xc.record_cls, len(xc.rows)
        names_of = xc.names_cls.of_rank[self.cls.owners]
        owns = [saveowners.own_chunks(b, self.p, self.gmap, int(names_of[c])) for c, b in enumerate(xc.records)]
        self.owns = owns
        n = np.array([len(o.index) for o in owns], dtype=np.int64)
        cl = np.repeat(np.arange(len(owns)), n)
        cat = lambda f: np.concatenate([f(o) for o in owns]) if owns else np.zeros(0, np.int64)  # noqa: E731
        index = cat(lambda o: o.index)
        width = self.p.shape.shape[1]
        self.rows = np.column_stack([cl, cat(lambda o: np.arange(len(o.index))), np.ones(len(cl)), np.full(len(cl), -1),
                                     index, np.concatenate([o.offsets for o in owns]).reshape(-1, width),
                                     np.concatenate([o.lengths for o in owns]).reshape(-1, width)]).astype(np.int64)
        self.dest = saveowners.tensor_owner(index, self.world)
        self.by_dest = np.argsort(self.dest, kind="stable")  # per owner: rows in source (class) order
        self.bounds = np.searchsorted(self.dest[self.by_dest], np.arange(self.world + 1))
        self.prepared: dict[int, tuple] = {}
        self._answers: dict[int, tuple] = {}
        self.summary = _summaries(full, self.cls, self.world) if not full.problems else self._learned()

    def _learned(self) -> np.ndarray:
        """Every rank's summary through the module's own steps (used when the plan has problems, where
        the digest path stops before its writers: small worlds only)."""
        rows = []
        for r in range(self.world):
            own = self.owns[int(self.cls.of_rank[r])]
            held, kept_empty = saveowners.parse_answers(*self.answers_to(r), len(own.index), len(self.cls.members))
            rows.append(saveowners.learn(own, held, kept_empty, r, self.cls, bool(self.problems()[r])).row)
        return np.stack(rows)

    def blobs(self) -> list[bytes]:
        """Every class's shared-rows blob (:mod:`pipeload.save.sharedrows`), through the module's own
        steps on each class owner's answers (computed once, only when the save takes that path)."""
        if getattr(self, "_blobs", None) is None:
            from ..save import sharedrows

            out = []
            for c, r in enumerate(self.cls.owners.tolist()):
                own = self.owns[c]
                held, kept_empty = saveowners.parse_answers(*self.answers_to(r), len(own.index), len(self.cls.members))
                view = saveowners.learn(own, held, kept_empty, r, self.cls, False)
                out.append(sharedrows.blob(own, view, r, self.cls))
            self._blobs = out
        return self._blobs

    def problems(self) -> list[list[str]]:
        """Each rank's tiling problems as an owner (what the all-gather of problem texts hands out)."""
        return [self._answer(o)[2] for o in range(self.world)]

    def _answer(self, o: int) -> tuple:
        if o not in self._answers:  # an owner's answers to every rank, computed once
            self._answers[o] = saveowners.answer_messages(self.incoming(o)[1], self.p, self.cls, self.world)
        return self._answers[o]

    def busiest_owner_s(self) -> float:
        """CPU seconds of the round-2 work of the busiest of the 8 owners that receive the most chunks
        (part of those ranks' planning, which the sampled ranks need not show)."""
        worst = 0.0
        for o in np.argsort(-np.diff(self.bounds), kind="stable")[:8].tolist():
            words = self.incoming(o)[1]
            start = time.process_time()
            saveowners.answer_messages(words, self.p, self.cls, self.world)
            worst = max(worst, time.process_time() - start)
        return worst

    def prepare(self, rank: int) -> None:
        """What ``rank`` sends and receives in both rounds (and the shared rows, when the summaries
        choose them), computed outside the rank's measured time."""
        self.prepared = {rank: (self.incoming(rank), self.answers_to(rank))}
        if np.bitwise_or.reduce(self.summary[:, saveowners.S_FLAG]) == saveowners.FLAG_SETS:
            self.blobs()

    def sent(self, rank: int):
        c = int(self.cls.of_rank[rank])
        return saveowners.chunk_messages(self.owns[c], c, self.world) if int(self.cls.owners[c]) == rank else None

    def received(self, rank: int, step: int) -> tuple[np.ndarray, np.ndarray]:
        got = self.prepared.get(rank)
        return got[step] if got is not None else (self.incoming, self.answers_to)[step](rank)

    def incoming(self, owner: int) -> tuple[np.ndarray, np.ndarray]:
        """Round 1 as ``owner`` receives it: (words per source, words in source order)."""
        rows = self.rows[self.by_dest[self.bounds[owner]: self.bounds[owner + 1]]]
        counts = np.bincount(self.cls.owners[rows[:, 0]], minlength=self.world).astype(np.int64) * rows.shape[1]
        return counts, rows.ravel()

    def answers_to(self, rank: int) -> tuple[np.ndarray, np.ndarray]:
        """Round 2 as ``rank`` receives it, from the owners of its class's tensors, in source order."""
        own = self.owns[int(self.cls.of_rank[rank])]
        counts = np.zeros(self.world, dtype=np.int64)
        parts = []
        for o in np.unique(saveowners.tensor_owner(own.index, self.world)).tolist():
            got_c, got, _ = self._answer(o)
            at = int(got_c[:rank].sum())
            counts[o] = got_c[rank]
            parts.append(got[at: at + int(got_c[rank])])
        return counts, np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)


def _summaries(full: saveplan.Plan, cls, world: int) -> np.ndarray:
    """Every rank's summary row from the digest path's whole plan: a class in two holder sets, or in a
    set too large to describe, flags; the bytes alone are the plan's before its greedy."""
    n_classes = len(cls.members)
    in_sets = np.zeros(n_classes, dtype=np.int64)
    too_large = np.zeros(n_classes, dtype=bool)
    for s in full.holder_sets:
        in_sets[list(s)] += 1
        if len(s) > keyowners.MAX_SET_CLASSES and len(s) != n_classes:
            too_large[list(s)] = True
    out = np.zeros((world, saveowners.SUMMARY_WORDS), dtype=np.int64)
    flags = np.where(in_sets > 1, saveowners.FLAG_SETS, 0) | np.where(too_large, saveowners.FLAG_TOO_LARGE, 0)
    out[:, saveowners.S_FLAG] = flags[cls.of_rank]
    out[:, saveowners.S_ALONE] = full.alone
    return out


class SimSaveExchange:
    """The save's collectives as one rank sees them, from every rank's rows and distinct bytes (``keys``:
    the tensor-owner rounds, when the rows choose them)."""

    def __init__(self, rows: np.ndarray, tables: list[bytes], records: list[bytes], rank: int,
                 keys: SaveKeyWorld | None = None):
        self.rows, self.tables, self.records, self.rank, self.keys = rows, tables, records, rank, keys
        self.size = len(rows)
        self.global_ranks = range(self.size)
        self.pg = object()
        self.sent = self.received = 0
        self._transfers = self._all_to_alls = 0
        self.path = "digest"

    def gather_rows(self, row: np.ndarray, what: str = "", call: str = "") -> np.ndarray:
        if call == REUSE_CALL:  # the reuse words: no rank offers a kept plan; rank 0 sends the save id
            words = np.zeros((self.size, len(row)), dtype=np.int64)
            words[0, 1] = _SAVE_WORD
            got = words
        elif call == saveowners.SIZES_CALL:
            self.path = "shared rows"
            got = np.asarray([len(b) for b in self.keys.blobs()], dtype=np.int64)[self.keys.cls.of_rank].reshape(-1, 1)
            if not np.array_equal(row, got[self.rank]):
                raise AssertionError(f"rank {self.rank}: the saver's shared-rows size differs from the simulated one")
        else:
            expect = self.keys.summary if call == saveowners.SUMMARY_CALL else self.rows
            if not np.array_equal(row, expect[self.rank]):
                raise AssertionError(f"rank {self.rank}: the saver's row differs from the simulated one "
                                     f"({call or 'rows'})")
            got = expect
        self.sent += row.nbytes
        self.received += (self.size - 1) * row.nbytes
        return got

    def all_to_all(self, counts: np.ndarray, words: np.ndarray, what: str = "") -> tuple[np.ndarray, np.ndarray]:
        step, self._all_to_alls = self._all_to_alls, self._all_to_alls + 1
        self.path = "key owners"
        if step == 0:
            expect = self.keys.sent(self.rank)
            if expect is None and len(words) or expect is not None and not (
                    np.array_equal(counts, expect[0]) and np.array_equal(words, expect[1])):
                raise AssertionError(f"rank {self.rank}: the saver's chunk messages differ from the simulated ones")
        got_c, got = self.keys.received(self.rank, step)
        others = np.arange(self.size) != self.rank
        self.sent += 8 * (int(others.sum()) + int(counts[others].sum()))
        self.received += 8 * (int(others.sum()) + int(got_c[others].sum()))
        return got_c, got

    def transfer_records(self, t, cls, mine: bytes, what: str = "") -> list[bytes]:
        shared = self._transfers == 1 and self._all_to_alls == 2 and self.path == "shared rows"
        expected = self.tables if self._transfers == 0 else self.keys.blobs() if shared else self.records
        self._transfers += 1
        if self._transfers == 2 and not shared:
            self.path = "digest, after key owners" if self._all_to_alls else "digest"
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
        if self.keys is not None and self._all_to_alls == 2:  # the owners' tiling problems
            return self.keys.problems()
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


def _plan_rank(rows, tables, records, rank: int, state, keys: SaveKeyWorld | None):
    from ..save.saver import plan_phase

    sd, boxes = state
    ex = SimSaveExchange(rows, tables, records, rank, keys)
    with paused_gc():
        sp = plan_phase(sd, "<simulated>", ex, None, box_of=lambda fqn, v, cache: boxes[fqn])
    savecache.clear()
    return sp, ex


class _World(NamedTuple):
    """Every rank's exchange as the simulation builds it: rows, the distinct bytes, each rank's class."""

    xc: saveplan.Exchanged
    recs: dict  # class key -> the LocalRecord of its ranks
    keys: list  # class key of each rank


def _world(lay: Layout) -> _World:
    from ..io.checksum import checksum
    from ..save.saver import encode_object

    objects = {o: encode_object((1e-4, (0.9, 0.95))) for o in lay.objects}
    sums = [(o, checksum(d)) for o, d in sorted(objects.items())]
    keys = [lay.class_of(r) for r in range(lay.world)]
    rep: dict[tuple, int] = {}
    for r, k in enumerate(keys):
        rep.setdefault(k, r)
    recs = {k: _record(lay, r, objects, sums) for k, r in rep.items()}
    row_of = {k: saveplan.make_row(rec, False) for k, rec in recs.items()}
    rows = np.stack([row_of[k] for k in keys])
    ncls = saveplan._classes_of(rows, saveplan.R_NAMES, saveplan.R_NNBYTES)
    rcls = saveplan._classes_of(rows, saveplan.R_RECORD, saveplan.R_RNBYTES)
    xc = saveplan.Exchanged(rows, rcls, [recs[keys[int(o)]].record for o in rcls.owners], ncls,
                            [recs[keys[int(o)]].names for o in ncls.owners])
    return _World(xc, recs, keys)


def _sample(w: _World, lay: Layout, rank: int, keys: SaveKeyWorld | None, memory: bool) -> dict[str, Any]:
    """One rank's planning: CPU (process time), peak traced memory of a second run, bytes moved."""
    xc = w.xc
    state = _state(lay, rank)
    if keys is not None:
        keys.prepare(rank)
    runs: list = []
    _, cpu, peak = timed(lambda: runs.append(_plan_rank(xc.rows, xc.tables, xc.records, rank, state, keys)), memory)
    sp, ex = runs[0]
    return dict(rank=rank, cpu=cpu, peak=peak, sent=ex.sent, received=ex.received, plan=sp, path=ex.path,
                shards=len(w.recs[w.keys[rank]].shards))


def simulate_save(world: int, layout: str, *, optim: bool = False, samples: int = 3, memory: bool = True,
                  log: Callable[[str], None] | None = None) -> dict[str, Any]:
    """The save's planning for ``samples`` ranks of a ``world``-rank save of ``layout``, and rank 0's
    commit; a result dict (the load's keys where they mean the same)."""
    log = log or (lambda m: None)
    t0 = time.perf_counter()
    lay = Layout(layout, world, optim)
    w = _world(lay)
    xc = w.xc
    log(f"{world} rows, {len(xc.tables)} distinct name tables, {len(xc.records)} distinct records "
        f"({sum(map(len, xc.records)) / 1e6:.2f} MB)")
    sampled = sorted({0, world // 2 + 3 if world > 8 else world // 2, world - 1})[:max(1, samples)]
    full = saveplan.plan(xc, sampled[0], everything=True)
    keys = SaveKeyWorld(xc, full) if saveowners.use_key_owners(xc, *saveplan.key_table(xc)) else None  # the saver's choice
    if keys is not None:
        log(f"tensor owners: {int(keys.summary[:, saveowners.S_FLAG].sum())} ranks flagged")
    results = []
    for rank in sampled:
        results.append(_sample(w, lay, rank, keys, memory))
        log(f"rank {rank}: {results[-1]['cpu']:.3f} s CPU, writes {len(results[-1]['plan'].items)} items "
            f"({results[-1]['path']})")
    identical = all(
        [it[0] for it in r["plan"].items] == [s[0] for s in savecache.Entry.of(full, w.recs[w.keys[r["rank"]]],
                                                                                r["rank"], xc.rows).specs]
        and r["plan"].save_id == results[0]["plan"].save_id for r in results)
    res = _result(lay, w, full, results, identical, _rank0_commit(full, results[0]["plan"], world, memory), t0)
    res["busiest_owner_s"] = keys.busiest_owner_s() if keys is not None else None
    return res


def _result(lay: Layout, w: _World, full, results: list[dict], identical: bool, commit: dict, t0: float) -> dict:
    memory = results[0]["peak"] is not None
    loads = full.loads.astype(np.float64)
    mean = loads.mean() if len(loads) else 0.0
    return {
        "op": "save", "layout": lay.name, "world": lay.world, "optim": bool(lay.objects),
        "tensors": len(lay.tensors), "shards_per_rank": max(r["shards"] for r in results),
        "distinct_records": len(w.xc.records), "distinct_name_tables": len(w.xc.tables),
        "sampled_ranks": [r["rank"] for r in results], "path": sorted({r["path"] for r in results}),
        "per_rank_cpu_s": max(r["cpu"] for r in results),
        "per_rank_peak_mb": max(r["peak"] for r in results) if memory else None,
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
        f"  plans identical     {res['plans_identical']} (path: {', '.join(res['path'])})",
        *([f"  busiest owner       {res['busiest_owner_s']:.3f} s CPU answering its tensors' holders"]
          if res.get("busiest_owner_s") is not None else []),
        f"  rank 0 commit       {res['rank0_commit_s']:.3f} s{cpeak}, received "
        f"{res['rank0_commit_bytes_received'] / 1e6:.3f} MB, wrote {res['metadata_bytes'] / 1e6:.2f} MB",
    ])
