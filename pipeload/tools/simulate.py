"""``pipeload simulate``: the load's own planning path for W ranks, in one process.

For a layout and a world size it builds every rank's exchange row and every distinct plan record, then
runs, for a few sampled ranks, exactly what :func:`pipeload.load` runs before its first data read:
parse ``.metadata`` (:meth:`Metadata.from_json`), flatten the state dict and resolve its shards
(:func:`pipeload.plan.planner.local_plan`), encode the record, the exchange
(:func:`pipeload.engine.loader.exchange_and_plan`, with a simulated exchange that hands each rank exactly the
rows and record bytes the collectives would) and the global plan. Nothing is re-implemented: when the
loader's planning breaks, so does this.

Only two inputs are produced here rather than by the loader: each rank's destination boxes (computed
from mesh coordinates, the way DTensor places shards, since a DTensor of a 16,384-rank mesh cannot be
built in one process) and the records of the ranks that are not sampled (encoded by the loader's own
:func:`pipeload.plan.exchange.encode_record` from those boxes). A sampled rank's real record and row must
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
  (``R = 1`` for weights, 8 for norms);
- ``tp-from-whole``: ``dense``'s boxes loaded from a checkpoint of whole tensors (each tensor one chunk,
  as a Hugging Face checkpoint or one saved at TP 1 stores it): the column-parallel boxes are row
  blocks of a chunk, the row-parallel ones (``o_proj``, ``down_proj``: ``Shard(1)``) strided across a
  whole chunk, which the plan reads once as a chunk unit (:mod:`pipeload.plan.chunkunits`). ``--format
  hf`` stores every layout's tensors whole too.

The checkpoint metadata (format 2: ``.metadata`` and the chunk index, written to a temporary directory
by the saver's own writers) is the one the same layout would save (each distinct box one chunk). Ranks offer their
mesh-dimension groups for reuse, as DTensor state dicts do.
"""

from __future__ import annotations

import math
import os
import tempfile
import time
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np
import torch

from ..plan import keyowners
from ..plan.exchange import (Classes, Transfer, classes, decode_record, encode_record, group_digest, hash64,
                             make_row, padded, received_bytes, record_digest, record_transfer)
from ..engine._gcpause import paused_gc
from ._measure import timed
from ..engine.loader import exchange_and_plan
from ..formats.chunkindex import ARRAYS, build_arrays, index_file_name
from ..formats.metadata import (METADATA_FILE, ChunkMeta, Metadata, ObjectMeta, TensorMeta, chunk_key,
                                metadata_path, read_metadata, read_metadata_bytes)
from ..save.saver import _write_file
from ..plan import partdelivery
from ..plan.planner import fqn_index, local_plan, plan_record, resharded
from ..plan import storageorder
from ..plan.statedict import Box, flatten

LAYOUTS = ("dense", "dense-pp8", "moe", "fsdp", "tp-from-whole")
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
        self.whole = name == "tp-from-whole"  # the checkpoint stores each tensor as one chunk
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
            if not seen or self.whole:  # zero-size everywhere (or stored whole): one chunk
                seen = {((0,) * len(t.shape), t.shape): min(seen.values(), default=0)}
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

    def resharded(self, rank: int) -> bool:
        """Whether some box of ``rank`` is not one stored chunk (its row's ``FLAG_RESHARDED``)."""
        return self.whole and any(ln != t.shape for t, _, ln in self.boxes(rank))

    def record(self, rank: int, width: int, affinity: bool = False, position_md=None) -> bytes:
        """The record ``rank`` would send, encoded from its boxes by the loader's own encoder; ``affinity``:
        with each shard's writer rank (a DCP checkpoint's files name it: :func:`pipeload.tools.simforeign.writer`);
        ``position_md``: the metadata whose storage positions give each shard's affinity (a Hugging Face
        checkpoint: :mod:`pipeload.plan.storageorder`)."""
        bx = self.boxes(rank)
        aff = None
        offsets, lengths = padded([tuple(o) for _, o, _ in bx], width), padded([tuple(ln) for _, _, ln in bx], width)
        if affinity:
            from .simforeign import writer

            aff = [writer(self, t, rank) for t, _, _ in bx]
        elif position_md is not None:
            aff = storageorder.affinities(position_md, [t.fqn for t, _, _ in bx], offsets, lengths, self.world)
        return encode_record([self.index[t.fqn] for t, _, _ in bx], [True] * len(bx), offsets, lengths,
                             [self.index[o] for o in self.objects], width, aff)

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


class KeyOwnerWorld:
    """What the key-owner rounds (:mod:`pipeload.plan.keyowners`) hand each rank, from every rank's record.

    Round 1 (keys to owners) and round 2 (answers) are produced by the module's own functions: every
    class owner's :func:`~pipeload.plan.keyowners.key_messages`, and, for the owners a rank hears from,
    :func:`~pipeload.plan.keyowners.answer_messages` on exactly the words each received. The gathered
    summaries of all ranks come from the global plan's own steps over every record
    (:mod:`pipeload.plan.globalplan`), a second derivation: a sampled rank's summary must equal it, or the
    simulation fails.
    """

    def __init__(self, rows: np.ndarray, cls: Classes, records: list[bytes], md_arrays, n_names: int,
                 *, can_create: bool = True, broadcast: bool = True):
        from ..plan.globalplan import shard_columns

        self.rows, self.cls, self.world, self.n_names = rows, cls, len(rows), n_names
        self.records = [decode_record(r) for r in records]
        self.ndim, self.itemsize = md_arrays
        self.width = self.records[0].offsets.shape[1] if self.records else 0
        self.sh = shard_columns(self.records, self.ndim, self.itemsize)
        n_per = np.array([len(r.index) for r in self.records], dtype=np.int64)
        self.class_start = np.concatenate([[0], np.cumsum(n_per)[:-1]]).astype(np.int64)
        self.dest = keyowners.owner_of(self.sh.index, self.sh.offsets, self.sh.lengths, self.world)
        self.by_dest = np.argsort(self.dest, kind="stable")  # per owner: rows in source (class) order
        self.bounds = np.searchsorted(self.dest[self.by_dest], np.arange(self.world + 1))
        self.summary = _summaries(self, can_create=can_create, broadcast=broadcast)

    def prepare(self, rank: int) -> None:
        """Compute what ``rank`` receives in both rounds now (outside the rank's measured time)."""
        self.prepared = {rank: (self.incoming_keys(rank), self.answers_to(rank), self.sent_keys(rank))}

    def sent_keys(self, rank: int):
        """Round 1 as ``rank`` sends it (a class owner; None for a replica)."""
        c = int(self.cls.of_rank[rank])
        return keyowners.key_messages(self.records[c], c, self.world) if int(self.cls.owners[c]) == rank else None

    def received(self, rank: int, step: int) -> tuple[np.ndarray, np.ndarray]:
        got = getattr(self, "prepared", {}).get(rank)
        if got is not None:
            return got[step]
        return (self.incoming_keys, self.answers_to, self.sent_keys)[step](rank)

    def incoming_keys(self, owner: int) -> tuple[np.ndarray, np.ndarray]:
        """Round 1 as ``owner`` receives it: (words per source, words in source order)."""
        idx = self.by_dest[self.bounds[owner]: self.bounds[owner + 1]]
        cl = self.sh.cl[idx]
        aff = self.sh.affinity[idx] if self.sh.affinity is not None else np.full(len(idx), -1)
        words = np.column_stack([cl, idx - self.class_start[cl], self.sh.bc[idx], aff, self.sh.index[idx],
                                 self.sh.offsets[idx], self.sh.lengths[idx]]).astype(np.int64)
        counts = np.bincount(self.cls.owners[cl], minlength=self.world).astype(np.int64) * words.shape[1]
        return counts, words.ravel()

    def answers_to(self, rank: int) -> tuple[np.ndarray, np.ndarray]:
        """Round 2 as ``rank`` receives it, from the owners of its class's keys, in source order."""
        c = int(self.cls.of_rank[rank])
        lo = self.class_start[c]
        owners = np.unique(self.dest[lo: lo + len(self.records[c].index)]).tolist()
        counts = np.zeros(self.world, dtype=np.int64)
        parts = []
        for o in owners:
            got_c, got = keyowners.answer_messages(self.incoming_keys(o)[1], self.cls, self.world, self.width)
            at = int(got_c[:rank].sum())
            counts[o] = got_c[rank]
            parts.append(got[at: at + int(got_c[rank])])
        return counts, np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)


def _summaries(w: KeyOwnerWorld, *, can_create: bool, broadcast: bool) -> np.ndarray:
    """Every rank's summary row, from the global plan's steps over all records (see KeyOwnerWorld)."""
    from ..plan.globalplan import SetTable, _ranges, group_keys, holder_sets

    sh, cls = w.sh, w.cls
    d = len(cls.members)
    sizes = np.array([len(m) for m in cls.members], dtype=np.int64)
    kg = group_keys(sh, sizes)
    per_row = np.empty(len(kg.order), dtype=np.int64)  # group of each row of kg.order
    per_row[:] = np.repeat(np.arange(len(kg.starts)), kg.n_classes)
    holders = np.empty(len(sh.cl), dtype=np.int64)
    holders[kg.order] = kg.holders[per_row]
    cand = np.flatnonzero((kg.holders >= 2) & kg.all_bc) if broadcast else np.zeros(0, dtype=np.int64)
    big = cand[(kg.n_classes[cand] > keyowners.MAX_SET_CLASSES) & (kg.n_classes[cand] != d)]
    table = SetTable(w.rows, cls, can_create=can_create, same_host_private=False)
    sid_of = holder_sets(table, kg, sh.cl[kg.order], cand)
    good_g = cand[table.ok()[sid_of]] if len(cand) else cand
    good_sid = sid_of[table.ok()[sid_of]] if len(cand) else sid_of
    good = np.zeros(len(sh.cl), dtype=bool)
    pos = _ranges(kg.starts[good_g], kg.ends[good_g])
    good[kg.order[pos]] = True
    row_sid = np.repeat(good_sid, kg.n_classes[good_g])
    pairs = (np.unique(np.column_stack([sh.cl[kg.order[pos]], row_sid]), axis=0) if len(pos)
             else np.zeros((0, 2), np.int64))
    flag = np.bincount(pairs[:, 0], minlength=d) > 1
    creates = np.array([table.sets[s].create for s in pairs[:, 1].tolist()], dtype=bool)
    flag[pairs[creates, 0]] = True
    flag[sh.cl[kg.order[_ranges(kg.starts[big], kg.ends[big])]]] = True
    alone = np.bincount(sh.cl, weights=np.where(holders == 1, sh.weight, 0), minlength=d).astype(np.int64)
    private = np.bincount(sh.cl, weights=np.where((holders >= 2) & ~good, sh.weight, 0), minlength=d).astype(np.int64)
    out = np.zeros((w.world, keyowners.summary_width(w.n_names)), dtype=np.int64)
    of = cls.of_rank
    out[:, keyowners.S_FLAG] = flag[of]
    out[:, keyowners.S_ALONE] = np.where(flag, 0, alone)[of]
    out[:, keyowners.S_PRIVATE] = np.where(flag, 0, private)[of]
    if out.shape[1] > keyowners.S_BITS:
        for c, rec in enumerate(w.records):
            bits = np.zeros((out.shape[1] - keyowners.S_BITS) * 64, dtype=bool)
            bits[np.asarray(rec.index, dtype=np.intp)] = True
            bits[np.asarray(rec.objects, dtype=np.intp)] = True
            out[cls.members[c], keyowners.S_BITS:] = np.packbits(bits, bitorder="little").view(np.int64)
    return out


class SimExchange:
    """What the collectives of the exchange hand one rank, from the rows and records of all ranks
    (``keys``: the key-owner rounds, when the rows choose them), counting the bytes this rank sends and
    receives (its part to itself not counted)."""

    def __init__(self, rows: np.ndarray, cls: Classes, records: list[bytes], rank: int,
                 keys: KeyOwnerWorld | None = None):
        self.rows, self.cls, self.records, self.rank, self.keys = rows, cls, records, rank, keys
        self.sent = self.received = 0
        self.all_to_alls = 0
        self.path = "digest"

    def gather_rows(self, row: np.ndarray, what: str = "", call: str = "") -> np.ndarray:
        expect = self.keys.summary if call == keyowners.SUMMARY_CALL else self.rows
        if not np.array_equal(row, expect[self.rank]):
            raise AssertionError(f"rank {self.rank}: the loader's row differs from the simulated one "
                                 f"({call or 'rows'})")
        self.sent += row.nbytes
        self.received += (len(expect) - 1) * row.nbytes
        return expect

    def agreed(self, gathers: int) -> None:
        """Count ``gathers`` gathers of one word per rank (part delivery's agreements: every rank's is 1)."""
        self.sent += 8 * gathers
        self.received += 8 * gathers * (len(self.rows) - 1)

    def all_to_all(self, counts: np.ndarray, words: np.ndarray, what: str = "") -> tuple[np.ndarray, np.ndarray]:
        step, self.all_to_alls = self.all_to_alls, self.all_to_alls + 1
        self.path = "key owners"
        if step == 0:
            expect = self.keys.received(self.rank, 2)
            if expect is None and len(words) or expect is not None and not (
                    np.array_equal(counts, expect[0]) and np.array_equal(words, expect[1])):
                raise AssertionError(f"rank {self.rank}: the loader's key messages differ from the simulated ones")
        got_c, got = self.keys.received(self.rank, min(step, 1))
        others = np.arange(len(self.rows)) != self.rank
        self.sent += 8 * (int(others.sum()) + int(counts[others].sum()))
        self.received += 8 * (int(others.sum()) + int(got_c[others].sum()))
        return got_c, got

    def union(self, flags: np.ndarray, what: str = "") -> np.ndarray:
        out = np.zeros(len(flags), dtype=np.uint8)
        for rec in map(decode_record, self.records):
            out[np.asarray(rec.index, dtype=np.intp)] = 1
            out[np.asarray(rec.objects, dtype=np.intp)] = 1
        self.sent += flags.nbytes
        self.received += 2 * flags.nbytes  # an all-reduce
        return out

    def transfer_records(self, t: Transfer, cls: Classes, mine: bytes, what: str = "") -> list[bytes]:
        self.path = "digest, after key owners" if self.all_to_alls else "digest"
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


def _plan_rank(layout: Layout, directory: str, rows, cls, records, rank: int, phases: _Phases, state, keys=None,
               open_ckpt=None):
    """One rank's path from the start of load() to its first data read; returns (plan, exchange).

    ``state``: the rank's (state dict, boxes) from :meth:`Layout.state_dict`, built before the clock
    starts — a trainer holds its state dict before it calls load(). The cyclic GC is paused, as
    load_async() pauses it for all of this.
    """
    with paused_gc():
        writer_of, by_position = None, False
        if open_ckpt is None:
            md = Metadata.from_json(read_metadata_bytes(directory), source=metadata_path(directory), directory=directory)
        else:  # a foreign layout (pipeload.tools.simforeign): from the bytes rank 0 broadcasts
            ckpt = open_ckpt()
            md, writer_of, by_position = ckpt.metadata, ckpt.writer_of, ckpt.by_position
        phases.lap("metadata")
        sd, boxes = state
        leaves = flatten(sd)
        plan = local_plan(leaves, md, lambda t: True, box_of=lambda fqn, v, cache: boxes[fqn], writer_of=writer_of)
        if by_position:  # as the loader's _local_plan does
            storageorder.place(plan, md, layout.world)
        if plan.problems:
            raise AssertionError(f"rank {rank}: local plan problems: {plan.problems[:3]}")
        names = list(fqn_index(md))
        record = plan_record(plan, md.width())
        phases.lap("local plan")
        ex = SimExchange(rows, cls, records, rank, keys)
        groups = layout.group_digests(rank, {})
        gp = exchange_and_plan(ex, rank, layout.world, md, names, record, [], groups, directory="<simulated>",
                               broadcast=True, batch_bytes=6 << 20, can_create=True, clock=phases,
                               on_phase=lambda name: phases.lap(f"global plan: {name}"),
                               resharded=resharded(plan.shards), by_position=by_position, part_reads=True)
        phases.lap("global plan")
        if gp.every is not None:  # the loader's part delivery plan, chunk offsets from a simulated header
            files = {it.file for s in plan.shards for it in s.reads}
            starts, layouts = _sim_starts(md, names, directory)
            every, itemsize, host = gp.every(), md.key_arrays(names)[1], (lambda r: r // GPUS_PER_HOST)
            blobs = sorted(files) if writer_of is not None else []  # (DCP: chunks located by their heads)
            spans, expanded, _ = partdelivery.with_heads(every, md, names, itemsize, rank, files, blobs,
                                                         layouts.__getitem__, host)
            partdelivery.plan(every, md, names, itemsize, rank, files, lambda f, k: starts[(f, k)],
                              layouts.__getitem__, host, spans=spans, expanded=expanded, blob_files=blobs)
            ex.agreed(2 if writer_of is not None else 1)  # (engine.delivery.plan's: after the local steps, DCP)
            phases.lap("part delivery")
    return gp, ex, len(plan.shards)


_SIM_STARTS: dict = {}  # directory -> _sim_starts' answer (the last directory's only)


def _sim_starts(md, names: list[str], directory: str):
    """(``(file, key)`` -> first byte, file -> its chunks as (firsts, ends, keys)) of a simulated checkpoint
    (it has no data files): chunks laid end to end per file in key order, as a safetensors header would
    place them (built before the clock and cached: a rank reads its files' headers when it opens them)."""
    table = _SIM_STARTS
    if directory not in table:
        _, itemsize = md.key_arrays(names)
        sizes: dict[str, list] = {}
        cols = md.tensor_columns()
        for i, name in enumerate(names):
            if cols is not None:
                j = cols[0].get(name)
                if j is None:  # a Python object's key
                    continue
                shape = tuple(cols[3][j, : cols[2][j]].tolist())
            elif name in md.tensors:
                shape = tuple(md.tensors[name].shape)
            else:
                continue
            for c in md.chunks_for(name, (0,) * len(shape), shape):
                sizes.setdefault(c.file, []).append((c.key, math.prod(c.lengths) * int(itemsize[i])))
        starts, layouts = {}, {}
        for f, ks in sizes.items():
            at, rows = 0, ([], [], [])
            for k, n in sorted(ks):
                starts[(f, k)] = at
                for col, v in zip(rows, (at, at + n, k)):
                    col.append(v)
                at += -(-n // 8) * 8
            layouts[f] = rows
        table.clear()
        table[directory] = starts, layouts
    return table[directory]


def _world_rows(lay: Layout, width: int, dcp_writers: bool = False,
                save_id: str = SAVE_ID, position_md=None) -> tuple[np.ndarray, Classes, list[bytes]]:
    """Every rank's exchange row, the classes, and each class's record (encoded once per class;
    ``dcp_writers``: with the writer affinity a DCP checkpoint's file names give; ``position_md``: the
    metadata whose storage positions give the affinities, as the loader does for Hugging Face files)."""
    world = lay.world
    keys = [lay.class_of(r) for r in range(world)]
    rep: dict[tuple, int] = {}
    for r, k in enumerate(keys):
        rep.setdefault(k, r)
    rec_of = {k: lay.record(r, width, dcp_writers, position_md) for k, r in rep.items()}
    digest_of = {k: record_digest(rec) for k, rec in rec_of.items()}
    group_cache: dict = {}
    host = [hash64(f"host-{r // GPUS_PER_HOST}".encode()) for r in range(0, world, GPUS_PER_HOST)]
    moved = {k: lay.resharded(r) for k, r in rep.items()}
    rows = np.zeros((world, 16), dtype=np.int64)
    for r in range(world):
        rows[r] = make_row(record=rec_of[keys[r]], save_id=save_id, problems=False, host=host[r // GPUS_PER_HOST],
                           groups=lay.group_digests(r, group_cache), digest=digest_of[keys[r]],
                           resharded=moved[keys[r]])
    cls = classes(rows)
    return rows, cls, [rec_of[keys[int(o)]] for o in cls.owners]


def _sample_rank(lay: Layout, directory: str, rows, cls, records, rank: int, keys, opener, memory: bool,
                 log: Callable[[str], None]) -> dict[str, Any]:
    """One sampled rank's planning: CPU of a first pass, peak memory of a second (traced) one."""
    state = lay.state_dict(rank)
    if keys is not None:
        keys.prepare(rank)
    os.environ["PIPELOAD_HOST_ID"] = f"host-{rank // GPUS_PER_HOST}"
    first: list = []  # the first pass's phases and exchange (the traced pass only measures memory)

    if opener is None:  # the simulated headers, as the files' opening would have read them
        md = Metadata.from_json(read_metadata_bytes(directory), source=metadata_path(directory), directory=directory)
        _sim_starts(md, list(fqn_index(md)), directory)

    def run():
        phases = _Phases()
        gp, ex, n_shards = _plan_rank(lay, directory, rows, cls, records, rank, phases, state, keys, opener)
        if not first:
            first.append((phases, ex, n_shards))
        return gp

    gp, cpu, peak = timed(run, memory)
    phases, ex, n_shards = first[0]
    log(f"rank {rank}: {cpu:.2f} s CPU, {len(gp.ops)} broadcasts")
    return dict(rank=rank, cpu=cpu, peak=peak, phases=phases.timings, sent=ex.sent, received=ex.received,
                digest=gp.digest(), shards=n_shards, path=ex.path,
                ops=[(op.group, op.reader, op.shards) for op in gp.ops], gp=gp)


def simulate(world: int, layout: str, *, optim: bool = False, samples: int = 3, memory: bool = True,
             log: Callable[[str], None] | None = None, format: str = "pipeload") -> dict[str, Any]:
    """Run the planning path for ``samples`` ranks of a ``world``-rank load of ``layout``; a result dict.
    ``format``: the layout of the checkpoint's metadata (``dcp``, ``hf``: :mod:`pipeload.tools.simforeign`)."""
    log = log or (lambda m: None)
    t0 = time.perf_counter()
    lay = Layout(layout, world, optim)
    lay.whole = lay.whole or format == "hf"
    tmp = tempfile.TemporaryDirectory(prefix="pipeload-simulate-")
    directory = tmp.name
    foreign = None
    if format == "pipeload":
        md_bytes = lay.write_checkpoint_metadata(directory)
        md = read_metadata(directory)
    else:
        from .simforeign import prepare

        foreign = prepare(lay, directory, format, memory, log)
        md, md_bytes = foreign.md, foreign.metadata_bytes
    width = md.width()
    log(f"metadata: {len(lay.tensors)} tensors, {md_bytes / 1e6:.1f} MB (.metadata and chunk index)")
    rows, cls, records = _world_rows(lay, width, foreign is not None and format == "dcp", md.save_id,
                                     md if format == "hf" else None)
    log(f"{world} rows, {len(records)} distinct records ({sum(map(len, records)) / 1e6:.2f} MB)")
    keys = None
    if keyowners.use_key_owners(rows, cls, record_transfer(cls, world)):  # the loader's own choice
        names = list(fqn_index(md))
        keys = KeyOwnerWorld(rows, cls, records, md.key_arrays(names), len(names))
        log(f"key owners: {int(keys.summary[:, keyowners.S_FLAG].sum())} ranks flagged")
    sampled = sorted({0, world // 2 + 3 if world > 8 else world // 2, world - 1})[:max(1, samples)]
    opener = foreign.open_ckpt if foreign else None
    results = [_sample_rank(lay, directory, rows, cls, records, rank, keys, opener, memory, log) for rank in sampled]
    del keys
    # The whole plan, every component (each rank computes only its own), for balance and agreement: the
    # digest path's (everything=True never asks the key owners), so sampled plans are compared with it.
    ex = SimExchange(rows, cls, records, sampled[0])
    os.environ["PIPELOAD_HOST_ID"] = f"host-{sampled[0] // GPUS_PER_HOST}"
    gp = exchange_and_plan(ex, sampled[0], world, md, list(fqn_index(md)), records[int(cls.of_rank[sampled[0]])], [],
                           lay.group_digests(sampled[0], {}), directory="<simulated>", broadcast=True,
                           batch_bytes=6 << 20, can_create=True, everything=True,
                           resharded=lay.resharded(sampled[0]), by_position=format == "hf")
    loads = np.asarray(gp.loads, dtype=np.float64)
    mean = loads.mean() if len(loads) else 0.0
    views = [r.pop("gp") for r in results]
    identical = _identical(views, results, gp)
    os.environ.pop("PIPELOAD_HOST_ID", None)
    md.tensors.index.close()
    tmp.cleanup()
    phases = {k: max(r["phases"].get(k, 0.0) for r in results) for k in results[0]["phases"]}
    return {
        "op": "load", "layout": layout, "world": world, "optim": optim, "format": format,
        **(foreign.result if foreign else {}),
        "tensors": len(lay.tensors), "shards_per_rank": max(r["shards"] for r in results),
        "distinct_records": len(records), "metadata_bytes": md_bytes,
        "sampled_ranks": sampled,
        "per_rank_cpu_s": max(r["cpu"] for r in results),
        "per_rank_peak_mb": max(r["peak"] for r in results) if memory else None,
        "exchange_bytes_sent": max(r["sent"] for r in results),
        "exchange_bytes_received": max(r["received"] for r in results),
        "reader_balance": float(loads.max() / mean) if mean else 1.0,
        "reader_balance_bound": float(max(gp.bound, mean) / mean) if mean else 1.0,
        "groups_created": len(gp.creates),
        "unit_tensors": len({k[0] for k in gp.readers if k[0] < 0}),
        "broadcasts_per_rank": max(len(r["ops"]) for r in results),
        "plans_identical": bool(identical),
        "exchange_path": results[0]["path"],
        "phases": phases,
        "wall_s": time.perf_counter() - t0,
    }


def _identical(views: list, results: list[dict], gp) -> bool:
    """The sampled plans agree with the whole plan (the digest path's): readers, creations, the order of
    shared broadcasts, and the first sampled rank's broadcasts exactly (sets by members)."""
    return (all(v.creates == gp.creates for v in views)
            and all(gp.readers.get(k) == rd for v in views for k, rd in v.readers.items())
            and _orders_agree([r["ops"] for r in results])
            and _by_members(views[0], results[0]["ops"]) == _by_members(gp, [(o.group, o.reader, o.shards)
                                                                             for o in gp.ops]))


def _by_members(gp, ops: list) -> list:
    """``ops`` with each set id replaced by its members (paths number sets differently)."""
    return [(gp.sets[g].members, r, shards) for g, r, shards in ops]


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
        f"layout {res['layout']}{' + optimizer' if res['optim'] else ''}, W = {res['world']}"
        f"{'' if res.get('format', 'pipeload') == 'pipeload' else ', ' + res['format'] + ' metadata'}: "
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
        *([f"  chunk units         {res['unit_tensors']} tensors read once as whole chunks"]
          if res.get("unit_tensors") else []),
        f"  broadcasts per rank {res['broadcasts_per_rank']}",
        f"  plans identical     {res['plans_identical']}",
        f"  exchange path       {res['exchange_path']}",
        "  phases (s, max)     " + ", ".join(f"{k} {v:.3f}" for k, v in res["phases"].items()),
    ]
    if res.get("format", "pipeload") != "pipeload":  # rank 0 decodes the foreign metadata for everyone
        peak = res.get("rank0_peak_mb")
        lines.insert(1, f"  rank 0 decode       {res['rank0_decode_s']:.3f} s, peak "
                        f"{'-' if peak is None else f'{peak:.1f} MB'} (plain pickle.loads of the metadata "
                        f"{res['rank0_pickle_loads_s']:.3f} s)"
                        + (f"; with the sidecar {res['rank0_sidecar_s']:.3f} s" if "rank0_sidecar_s" in res else "")
                        + f"; broadcast {res['broadcast_bytes'] / 2**20:.1f} MiB")
    if "dcp_coordinator_cpu_s" in res:  # stock dcp.load's central planning, for comparison
        peak = res["dcp_coordinator_peak_mb"]
        lines.insert(2, f"  DCP's coordinator   {res['dcp_coordinator_cpu_s']:.2f} s, peak "
                        f"{'-' if peak is None else f'{peak:.0f} MB'}, gathers {res['dcp_gathered_bytes'] / 1e6:.1f} MB "
                        f"({res['dcp_read_items']} read items; measured on {res['dcp_plans_measured']} plans, "
                        f"scaled to {res['world']})")
    return "\n".join(lines)
