"""``pipeload simulate``: the load's own planning path for W ranks, in one process.

For a layout and a world size it builds every rank's exchange row and every distinct plan record, then
runs, for a few sampled ranks, exactly what :func:`pipeload.load` runs before its first data read:
parse ``.metadata`` (:meth:`Metadata.from_json`), flatten the state dict and resolve its shards
(:func:`pipeload.planner.local_plan`), encode the record, the exchange
(:func:`pipeload.loader.exchange_and_plan`, with a simulated exchange that hands each rank exactly the
rows and record bytes the collectives would) and the global plan. Nothing is re-implemented: when the
loader's planning breaks, so does this.

Only two inputs are produced here rather than by the loader: each rank's destination boxes (computed
from mesh coordinates, the way DTensor places shards, since a DTensor of a 16,384-rank mesh cannot be
built in one process) and the records of the ranks that are not sampled (encoded by the loader's own
:func:`pipeload.exchange.encode_record` from those boxes). A sampled rank's real record and row must
equal the generated ones, or the simulation fails.

Layouts (``bf16`` weights; ``--optim`` adds fp32 ``exp_avg``/``exp_avg_sq`` per parameter, laid out
like it, and a host-side fp32 ``step`` scalar per parameter held by every rank):

- ``dense``: a 70B-like decoder (80 layers, hidden 8192, MLP 28672, 64 heads / 8 KV heads, vocabulary
  128256; 723 tensors), TP 8 (column/row parallel, norms replicated), DP = W / 8;
- ``dense-pp8``: the same model in 8 pipeline stages (embedding on the first, final norm and head on
  the last), TP 8, DP = W / 64;
- ``moe``: 94 layers x 128 experts (hidden 4096, expert MLP 1536, 64 heads / 4 KV heads, vocabulary
  151936; 36,945 tensors), attention TP 8, experts EP 8 over the same ranks (16 whole experts per
  rank), DP = W / 8;
- ``fsdp``: the dense model, FSDP over W / 8 ranks x TP 8: every weight ``Shard(0)`` over the FSDP
  dimension and TP-sharded as in ``dense``; norms ``Shard(0)`` over FSDP, replicated over TP
  (``R = 1`` for weights, 8 for norms).

The checkpoint metadata (format 2: ``.metadata`` and the chunk index, written to a temporary directory
by the saver's own writers) is the one the same layout would save (each distinct box one chunk). Ranks offer their
mesh-dimension groups for reuse, as DTensor state dicts do.
"""

from __future__ import annotations

import gc
import math
import os
import tempfile
import time
import tracemalloc
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np
import torch

from .exchange import (Classes, Transfer, classes, encode_record, group_digest, hash64, make_row, padded,
                       received_bytes, record_digest)
from ._gcpause import paused_gc
from .loader import exchange_and_plan
from .chunkindex import ARRAYS, build_arrays, index_file_name
from .metadata import (METADATA_FILE, ChunkMeta, Metadata, ObjectMeta, TensorMeta, chunk_key, metadata_path,
                       read_metadata, read_metadata_bytes)
from .saver import _write_file
from .planner import fqn_index, local_plan, plan_record
from .statedict import Box, flatten

LAYOUTS = ("dense", "dense-pp8", "moe", "fsdp")
SAVE_ID = "0123456789abcdef"
GPUS_PER_HOST = 8


@dataclass
class Tensor:
    fqn: str
    shape: tuple[int, ...]
    role: str  # col | row | replicate | expert
    dtype: str = "BF16"
    stage: int = 0  # pipeline stage holding it
    expert: int = -1


def _dense_tensors(stages: int = 1, layers: int = 80) -> list[Tensor]:
    h, inter, heads, kv, hd, vocab = 8192, 28672, 64, 8, 128, 128256
    per = layers // stages
    out = [Tensor("embed_tokens.weight", (vocab, h), "col", stage=0)]
    for i in range(layers):
        st = i // per
        p = f"layers.{i}."
        out += [
            Tensor(p + "self_attn.q_proj.weight", (heads * hd, h), "col", stage=st),
            Tensor(p + "self_attn.k_proj.weight", (kv * hd, h), "col", stage=st),
            Tensor(p + "self_attn.v_proj.weight", (kv * hd, h), "col", stage=st),
            Tensor(p + "self_attn.o_proj.weight", (h, heads * hd), "row", stage=st),
            Tensor(p + "mlp.gate_proj.weight", (inter, h), "col", stage=st),
            Tensor(p + "mlp.up_proj.weight", (inter, h), "col", stage=st),
            Tensor(p + "mlp.down_proj.weight", (h, inter), "row", stage=st),
            Tensor(p + "input_layernorm.weight", (h,), "replicate", stage=st),
            Tensor(p + "post_attention_layernorm.weight", (h,), "replicate", stage=st),
        ]
    out += [Tensor("norm.weight", (h,), "replicate", stage=stages - 1),
            Tensor("lm_head.weight", (vocab, h), "col", stage=stages - 1)]
    return out


def _moe_tensors(layers: int = 94, experts: int = 128) -> list[Tensor]:
    h, inter, heads, kv, hd, vocab = 4096, 1536, 64, 4, 128, 151936
    out = [Tensor("embed_tokens.weight", (vocab, h), "col")]
    for i in range(layers):
        p = f"layers.{i}."
        out += [
            Tensor(p + "self_attn.q_proj.weight", (heads * hd, h), "col"),
            Tensor(p + "self_attn.k_proj.weight", (kv * hd, h), "col"),
            Tensor(p + "self_attn.v_proj.weight", (kv * hd, h), "col"),
            Tensor(p + "self_attn.o_proj.weight", (h, heads * hd), "row"),
            Tensor(p + "self_attn.q_norm.weight", (hd,), "replicate"),
            Tensor(p + "self_attn.k_norm.weight", (hd,), "replicate"),
            Tensor(p + "input_layernorm.weight", (h,), "replicate"),
            Tensor(p + "post_attention_layernorm.weight", (h,), "replicate"),
            Tensor(p + "mlp.gate.weight", (experts, h), "replicate"),
        ]
        for e in range(experts):
            q = f"{p}mlp.experts.{e}."
            out += [Tensor(q + "gate_proj.weight", (inter, h), "expert", expert=e),
                    Tensor(q + "up_proj.weight", (inter, h), "expert", expert=e),
                    Tensor(q + "down_proj.weight", (h, inter), "expert", expert=e)]
    out += [Tensor("norm.weight", (h,), "replicate"), Tensor("lm_head.weight", (vocab, h), "col")]
    return out


def _with_optim(tensors: list[Tensor]) -> tuple[list[Tensor], list[str]]:
    out = [Tensor("model." + t.fqn, t.shape, t.role, t.dtype, t.stage, t.expert) for t in tensors]
    steps = []
    for t in tensors:
        for s in ("exp_avg", "exp_avg_sq"):
            out.append(Tensor(f"optim.state.{t.fqn}.{s}", t.shape, t.role, "F32", t.stage, t.expert))
        out.append(Tensor(f"optim.state.{t.fqn}.step", (), "step", "F32", t.stage, t.expert))
        steps.append(t.fqn)
    return out, ["optim.param_groups"]


def _split(n: int, k: int, i: int) -> tuple[int, int]:
    """(start, size) of part ``i`` of ``n`` split ``k`` ways the way DTensor ``Shard`` does (ceil chunks)."""
    chunk = -(-n // k) if k else n
    start = min(i * chunk, n)
    return start, max(0, min(chunk, n - start))


class Layout:
    """A layout's tensors and every rank's boxes, by mesh coordinates."""

    def __init__(self, name: str, world: int, optim: bool = False):
        if name not in LAYOUTS:
            raise ValueError(f"unknown layout {name!r} (one of {', '.join(LAYOUTS)})")
        self.name, self.world, self.tp = name, world, 8
        self.pp = 8 if name == "dense-pp8" else 1
        if world % (self.tp * self.pp):
            raise ValueError(f"layout {name} needs a world size divisible by {self.tp * self.pp}")
        self.dp = world // (self.tp * self.pp)
        base = _moe_tensors() if name == "moe" else _dense_tensors(self.pp)
        self.tensors, self.objects = _with_optim(base) if optim else (base, [])
        self.names = sorted([*(t.fqn for t in self.tensors), *self.objects])
        self.index = {n: i for i, n in enumerate(self.names)}
        self.order = sorted(self.tensors, key=lambda t: t.fqn)

    def coords(self, rank: int) -> tuple[int, int, int]:
        """(pipeline stage, dp index, tp index) of ``rank`` on the mesh (pp, dp, tp)."""
        tp = rank % self.tp
        dp = (rank // self.tp) % self.dp
        return rank // (self.tp * self.dp), dp, tp

    def class_of(self, rank: int) -> tuple:
        """Ranks with the same class key hold the same boxes (their records are byte-identical)."""
        pp, dp, tp = self.coords(rank)
        return (pp, dp, tp) if self.name == "fsdp" else (pp, tp)

    def box(self, t: Tensor, rank: int) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
        """(offsets, lengths) of ``rank``'s box of ``t``, or None when the rank holds none of it."""
        pp, dp, tp = self.coords(rank)
        if t.stage != pp and self.pp > 1:
            return None
        off, ln = [0] * len(t.shape), list(t.shape)
        if self.name == "fsdp" and t.role != "step" and t.shape:
            off[0], ln[0] = _split(t.shape[0], self.dp, dp)
        if t.expert >= 0 and t.expert // (128 // self.tp) != tp:
            return None  # an expert (or its optimizer state) on another EP rank
        if t.role in ("col", "row"):
            d = 0 if t.role == "col" else 1
            s, n = _split(ln[d], self.tp, tp)
            off[d] += s
            ln[d] = n
        return tuple(off), tuple(ln)

    def boxes(self, rank: int) -> list[tuple[Tensor, tuple[int, ...], tuple[int, ...]]]:
        out = []
        for t in self.order:
            b = self.box(t, rank)
            if b is not None and math.prod(b[1]) > 0:
                out.append((t, *b))
        return out

    def groups(self, rank: int) -> list[tuple[int, int, int]]:
        """Each mesh-dimension group ``rank`` belongs to (dp and tp; pp too) as (first, step, size)."""
        pp, dp, tp = self.coords(rank)
        base = pp * self.dp * self.tp
        out = [(base + tp, self.tp, self.dp), (base + dp * self.tp, 1, self.tp)]
        if self.pp > 1:
            out.append((dp * self.tp + tp, self.dp * self.tp, self.pp))
        return out

    def group_digests(self, rank: int, cache: dict) -> list[int]:
        out = []
        for g in self.groups(rank):
            d = cache.get(g)
            if d is None:
                first, step, size = g
                d = cache[g] = group_digest(range(first, first + step * size, step))
            out.append(d)
        return out

    def write_checkpoint_metadata(self, directory: str) -> int:
        """Write the ``.metadata`` and chunk index this layout saves (format 2, the saver's own writers:
        each distinct box of each tensor one chunk, written by the lowest rank holding it); no data.
        Returns the bytes written."""
        reps = sorted({self.class_of(r): r for r in range(self.world)}.values())
        tensors = {}
        files = set()
        for t in self.tensors:
            seen: dict[tuple, int] = {}
            for r in reps:
                b = self.box(t, r)
                if b is not None and math.prod(b[1]) > 0 and b not in seen:
                    seen[b] = r
            if not seen:  # zero-size everywhere: one empty chunk
                seen[((0,) * len(t.shape), t.shape)] = 0
            chunks = []
            for (o, n), r in sorted(seen.items()):
                f = f"data-{SAVE_ID}-{r:05d}.safetensors"
                files.add(f)
                key = chunk_key(t.fqn, o, n == t.shape)
                chunks.append(ChunkMeta(o, n, f, key, "0" * 16))
            tensors[t.fqn] = TensorMeta(t.dtype, t.shape, tuple(chunks))
        md = Metadata(save_id=SAVE_ID, world_size=self.world, tensors=tensors)
        for o in self.objects:
            md.objects[o] = ObjectMeta(f"data-{SAVE_ID}-00000.safetensors", f"{o}#object", 1024, "0" * 16)
        index = index_file_name(SAVE_ID)
        arrays = build_arrays(sorted(tensors), tensors, md.files)
        _write_file(os.path.join(directory, index), SAVE_ID,
                    [(k, ARRAYS[k][0], a.shape, a.tobytes()) for k, a in arrays.items()])
        with open(os.path.join(directory, METADATA_FILE), "w") as f:
            f.write(md.to_json_v2(index))
        return sum(os.path.getsize(os.path.join(directory, n)) for n in (index, METADATA_FILE))

    def record(self, rank: int, width: int) -> bytes:
        """The record ``rank`` would send, encoded from its boxes by the loader's own encoder."""
        bx = self.boxes(rank)
        return encode_record([self.index[t.fqn] for t, _, _ in bx], [True] * len(bx),
                             padded([tuple(o) for _, o, _ in bx], width), padded([tuple(ln) for _, _, ln in bx], width),
                             [self.index[o] for o in self.objects], width)

    def state_dict(self, rank: int) -> tuple[dict, dict[str, Box]]:
        """``rank``'s state dict (meta tensors of the local shapes) and the box of each tensor fqn."""
        sd: dict[str, Any] = {}
        boxes: dict[str, Box] = {}
        torch_dtype = {"BF16": torch.bfloat16, "F32": torch.float32}
        for t, o, ln in self.boxes(rank):
            v = torch.empty(ln, dtype=torch_dtype[t.dtype], device="meta")
            sd[t.fqn] = v
            boxes[t.fqn] = Box(t.shape, o, ln, v)
        for o in self.objects:
            sd[o] = (1e-4, (0.9, 0.95))
        return sd, boxes


class SimExchange:
    """What the collectives of the exchange hand one rank, from the rows and records of all ranks."""

    def __init__(self, rows: np.ndarray, cls: Classes, records: list[bytes], rank: int):
        self.rows, self.cls, self.records, self.rank = rows, cls, records, rank
        self.sent = self.received = 0

    def gather_rows(self, row: np.ndarray, what: str = "") -> np.ndarray:
        if not np.array_equal(row, self.rows[self.rank]):
            raise AssertionError(f"rank {self.rank}: the loader's row differs from the simulated one")
        self.sent += row.nbytes
        self.received += (len(self.rows) - 1) * row.nbytes
        return self.rows

    def transfer_records(self, t: Transfer, cls: Classes, mine: bytes, what: str = "") -> list[bytes]:
        c = int(cls.of_rank[self.rank])
        if mine != self.records[c]:
            raise AssertionError(f"rank {self.rank}: the loader's record differs from the simulated one")
        world = len(self.rows)
        self.received += received_bytes(t, cls, self.rank, world)
        if t.how == "gather":
            self.sent += t.pad
        elif t.how == "broadcast" and int(cls.owners[c]) == self.rank:
            self.sent += len(mine)
        return list(self.records)

    def all_gather_object(self, obj: Any, what: str = "") -> list[Any]:
        raise AssertionError("a simulated rank reported problems")


class _Phases:
    def __init__(self):
        self.timings: dict[str, float] = {}
        self.last = time.process_time()

    def lap(self, phase: str) -> None:
        now = time.process_time()
        self.timings[phase] = self.timings.get(phase, 0.0) + now - self.last
        self.last = now


def _plan_rank(layout: Layout, directory: str, rows, cls, records, rank: int, phases: _Phases, state):
    """One rank's path from the start of load() to its first data read; returns (plan, exchange).

    ``state``: the rank's (state dict, boxes) from :meth:`Layout.state_dict`, built before the clock
    starts — a trainer holds its state dict before it calls load(). The cyclic GC is paused, as
    load_async() pauses it for all of this.
    """
    with paused_gc():
        md = Metadata.from_json(read_metadata_bytes(directory), source=metadata_path(directory), directory=directory)
        phases.lap("metadata")
        sd, boxes = state
        leaves = flatten(sd)
        plan = local_plan(leaves, md, lambda t: True, box_of=lambda fqn, v, cache: boxes[fqn])
        if plan.problems:
            raise AssertionError(f"rank {rank}: local plan problems: {plan.problems[:3]}")
        names = list(fqn_index(md))
        record = plan_record(plan, md.width())
        phases.lap("local plan")
        ex = SimExchange(rows, cls, records, rank)
        groups = layout.group_digests(rank, {})
        gp = exchange_and_plan(ex, rank, layout.world, md, names, record, [], groups, directory="<simulated>",
                               broadcast=True, batch_bytes=6 << 20, can_create=True, clock=phases,
                               on_phase=lambda name: phases.lap(f"global plan: {name}"))
        phases.lap("global plan")
    return gp, ex, len(plan.shards)


def simulate(world: int, layout: str, *, optim: bool = False, samples: int = 3, memory: bool = True,
             log: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Run the planning path for ``samples`` ranks of a ``world``-rank load of ``layout``; a result dict."""
    log = log or (lambda m: None)
    t0 = time.perf_counter()
    lay = Layout(layout, world, optim)
    tmp = tempfile.TemporaryDirectory(prefix="pipeload-simulate-")
    directory = tmp.name
    md_bytes = lay.write_checkpoint_metadata(directory)
    md = read_metadata(directory)
    width = md.width()
    log(f"metadata: {len(lay.tensors)} tensors, {md_bytes / 1e6:.1f} MB (.metadata and chunk index)")
    keys = [lay.class_of(r) for r in range(world)]
    rep: dict[tuple, int] = {}
    for r, k in enumerate(keys):
        rep.setdefault(k, r)
    rec_of = {k: lay.record(r, width) for k, r in rep.items()}
    digest_of = {k: record_digest(rec) for k, rec in rec_of.items()}
    group_cache: dict = {}
    host = [hash64(f"host-{r // GPUS_PER_HOST}".encode()) for r in range(0, world, GPUS_PER_HOST)]
    rows = np.zeros((world, 16), dtype=np.int64)
    for r in range(world):
        rows[r] = make_row(record=rec_of[keys[r]], save_id=SAVE_ID, problems=False, host=host[r // GPUS_PER_HOST],
                           groups=lay.group_digests(r, group_cache), digest=digest_of[keys[r]])
    cls = classes(rows)
    records = [rec_of[keys[int(o)]] for o in cls.owners]
    log(f"{world} rows, {len(records)} distinct records ({sum(map(len, records)) / 1e6:.2f} MB)")
    sampled = sorted({0, world // 2 + 3 if world > 8 else world // 2, world - 1})[:max(1, samples)]
    results = []
    for rank in sampled:
        state = lay.state_dict(rank)
        gc.collect()
        phases = _Phases()
        start = time.process_time()
        os.environ["PIPELOAD_HOST_ID"] = f"host-{rank // GPUS_PER_HOST}"
        gp, ex, n_shards = _plan_rank(lay, directory, rows, cls, records, rank, phases, state)
        cpu = time.process_time() - start
        peak = None
        if memory:
            del gp
            gc.collect()
            tracemalloc.start()
            gp2, _, _ = _plan_rank(lay, directory, rows, cls, records, rank, _Phases(), state)
            peak = tracemalloc.get_traced_memory()[1]
            tracemalloc.stop()
            gp = gp2
        results.append(dict(rank=rank, cpu=cpu, peak=peak, phases=phases.timings, sent=ex.sent,
                            received=ex.received, digest=gp.digest(), shards=n_shards,
                            ops=[(op.group, op.reader, op.shards) for op in gp.ops], gp=gp))
        log(f"rank {rank}: {cpu:.2f} s CPU, {len(gp.ops)} broadcasts")
    # The whole plan, every component (each rank computes only its own), for balance and agreement.
    ex = SimExchange(rows, cls, records, sampled[0])
    os.environ["PIPELOAD_HOST_ID"] = f"host-{sampled[0] // GPUS_PER_HOST}"
    gp = exchange_and_plan(ex, sampled[0], world, md, list(fqn_index(md)), records[int(cls.of_rank[sampled[0]])], [],
                           lay.group_digests(sampled[0], {}), directory="<simulated>", broadcast=True,
                           batch_bytes=6 << 20, can_create=True, everything=True)
    loads = np.asarray(gp.loads, dtype=np.float64)
    mean = loads.mean() if len(loads) else 0.0
    views = [r.pop("gp") for r in results]
    identical = (all(v.creates == gp.creates for v in views)
                 and all(gp.readers.get(k) == rd for v in views for k, rd in v.readers.items())
                 and _orders_agree([r["ops"] for r in results]))
    os.environ.pop("PIPELOAD_HOST_ID", None)
    md.tensors.index.close()
    tmp.cleanup()
    phases = {k: max(r["phases"].get(k, 0.0) for r in results) for k in results[0]["phases"]}
    return {
        "op": "load", "layout": layout, "world": world, "optim": optim,
        "tensors": len(lay.tensors), "shards_per_rank": max(r["shards"] for r in results),
        "distinct_records": len(records), "metadata_bytes": md_bytes,
        "sampled_ranks": sampled,
        "per_rank_cpu_s": max(r["cpu"] for r in results),
        "per_rank_peak_mb": max(r["peak"] for r in results) / 2**20 if memory else None,
        "exchange_bytes_sent": max(r["sent"] for r in results),
        "exchange_bytes_received": max(r["received"] for r in results),
        "reader_balance": float(loads.max() / mean) if mean else 1.0,
        "reader_balance_bound": float(max(gp.bound, mean) / mean) if mean else 1.0,
        "groups_created": len(gp.creates),
        "broadcasts_per_rank": max(len(r["ops"]) for r in results),
        "plans_identical": bool(identical),
        "phases": phases,
        "wall_s": time.perf_counter() - t0,
    }


def _orders_agree(op_lists: list[list]) -> bool:
    """Every pair of ranks issues the broadcasts they share in the same relative order."""
    for i in range(len(op_lists)):
        for j in range(i + 1, len(op_lists)):
            a, b = op_lists[i], op_lists[j]
            common = set(a) & set(b)
            if [x for x in a if x in common] != [x for x in b if x in common]:
                return False
    return True


def format_result(res: dict[str, Any]) -> str:
    lines = [
        f"layout {res['layout']}{' + optimizer' if res['optim'] else ''}, W = {res['world']}: "
        f"{res['tensors']} tensors, {res['shards_per_rank']} shards per rank, "
        f"{res['distinct_records']} distinct records, metadata {res['metadata_bytes'] / 1e6:.1f} MB",
        f"  per-rank CPU        {res['per_rank_cpu_s']:.3f} s (max over ranks {res['sampled_ranks']})",
    ]
    if res["per_rank_peak_mb"] is not None:
        lines.append(f"  per-rank peak       {res['per_rank_peak_mb']:.1f} MB")
    lines += [
        f"  exchange            sent {res['exchange_bytes_sent'] / 1e6:.3f} MB, "
        f"received {res['exchange_bytes_received'] / 1e6:.3f} MB per rank",
        f"  reader balance      {res['reader_balance']:.3f} (max/mean; bound {res['reader_balance_bound']:.3f})",
        f"  groups created      {res['groups_created']}",
        f"  broadcasts per rank {res['broadcasts_per_rank']}",
        f"  plans identical     {res['plans_identical']}",
        "  phases (s, max)     " + ", ".join(f"{k} {v:.3f}" for k, v in res["phases"].items()),
    ]
    return "\n".join(lines)
