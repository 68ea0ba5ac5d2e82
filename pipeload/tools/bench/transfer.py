"""``pipeload bench --transfer``: a trainer's weights into two inference engines, side by side in one run.

One local gloo world of 8 ranks: ranks 0-3 train (FSDP2 of the MoE-shaped model of
:mod:`pipeload.tools.engineshape`, Hugging Face names, bf16), ranks 4-5 and 6-7 are two engines of TP 2
holding the fused layout (``qkv_proj``, ``gate_up_proj``, ``w13`` / ``w2``, a padded vocabulary).
Measured ``repeats`` times each, in turns, barrier to barrier (the slowest rank):

- **pipeload**: ``pipeload.transfer(model.state_dict(), engine_slices)`` (after one warm-up transfer that
  plans: the timed ones reuse the plan, as every RL step after the first does);
- **stream** / **stream, no overlap**: ``pipeload.stream`` of the full Hugging Face tensors into the
  engine's own ``load_weights`` in buckets of ``--bucket-mb`` (for engines that take only full tensors:
  each tensor assembled on the engine rank from the balanced holders), with each bucket's
  ``load_weights`` overlapped with the next bucket's transfer, and without;
- **per-tensor**: what the frameworks do without buckets: for each tensor, ``full_tensor()`` on the
  trainers, a broadcast from trainer rank 0 to the four engine ranks, the engine's ``load_weights``
  slicing and fusing it;
- **bucketed**: the same with the full tensors packed into buckets of ``--bucket-mb`` (the frameworks'
  default path: verl, OpenRLHF, NeMo-RL), one broadcast per bucket;
- **floor**: each engine rank's destination bytes received once, at the point-to-point rate measured
  in the same run with the same concurrency (four trainer -> engine pairs at once, one message each);
- **wire**: the transfer's traffic with nothing else — each trainer sends each engine rank its share of
  that rank's destination bytes (a quarter: FSDP2 over four trainers) out of one buffer, in messages
  of at most 16 MiB, every pair at once — what the all-to-all itself costs on this machine's wire.

Every engine's parameters are compared bitwise against the per-tensor path's after each transfer.
Reported per rank from ``TransferStats``: bytes received against destination bytes, bytes sent
against the senders' mean, and the plan's share of a reused step.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass
from typing import Any

import torch

MiB = 1 << 20
TRAINERS = (0, 1, 2, 3)
ENGINES = {4: (0, "A"), 5: (1, "A"), 6: (0, "B"), 7: (1, "B")}
WORLD = 8


@dataclass
class TransferBenchConfig:
    size_mb: float = 64.0
    repeats: int = 5
    bucket_mb: float = 16.0
    timeout: float = 1800.0
    quiet: bool = False


def bench_shape(size_mb: float):
    """A bf16 MoE-shaped model of about ``size_mb`` MiB (layers chosen to reach it; at least 2)."""
    from ..engineshape import Shape, checkpoint_shapes

    base = dict(hidden=512, heads=8, kv_heads=2, head_dim=64, inter=512, experts=8, vocab=8192, dtype=torch.bfloat16)

    def mib(layers: int) -> float:
        return sum(torch.Size(s).numel() for s in checkpoint_shapes(Shape(layers=layers, **base)).values()) * 2 / MiB

    layers = 2
    while mib(layers + 2) <= size_mb:
        layers += 2
    return Shape(layers=layers, **base)


def _timed(step) -> float:
    import torch.distributed as dist

    dist.barrier()
    t0 = time.perf_counter()
    step()
    dist.barrier()
    return time.perf_counter() - t0


def _full_tensors(model, names):
    """Each tensor whole on every trainer (``full_tensor()``: an all-gather over the trainers' mesh)."""
    sd = model.state_dict()
    for name in names:
        yield name, sd[name].full_tensor()


def _per_tensor(rank, model, s, names, group, load):
    import torch.distributed as dist

    from ..engineshape import checkpoint_shapes

    shapes = checkpoint_shapes(s)
    full = _full_tensors(model, names) if model is not None else None
    for name in names:
        t = next(full)[1] if full is not None else torch.empty(shapes[name], dtype=s.dtype)
        if rank == 0 or rank in ENGINES:
            dist.broadcast(t, src=0, group=group)
        if load is not None:
            load([(name, t)])


def _bucketed(rank, model, s, names, group, load, bucket_bytes: int):
    import torch.distributed as dist

    from ..engineshape import checkpoint_shapes

    shapes = checkpoint_shapes(s)
    full = _full_tensors(model, names) if model is not None else None
    for bucket in _buckets(names, shapes, bucket_bytes):
        sizes = [torch.Size(shapes[n]).numel() for n in bucket]
        flat = torch.empty(sum(sizes), dtype=s.dtype)
        if full is not None:
            torch.cat([next(full)[1].reshape(-1) for _ in bucket], out=flat)
        if rank == 0 or rank in ENGINES:
            dist.broadcast(flat, src=0, group=group)
        if load is not None:
            load(zip(bucket, (v.view(shapes[n]) for n, v in zip(bucket, flat.split(sizes)))))


def _buckets(names, shapes, bucket_bytes: int) -> list[list[str]]:
    out, run, total = [], [], 0
    for n in names:
        b = torch.Size(shapes[n]).numel() * 2
        if run and total + b > bucket_bytes:
            out.append(run)
            run, total = [], 0
        run.append(n)
        total += b
    return out + ([run] if run else [])


def _pair_rate(rank: int, nbytes: int) -> float:
    """Bytes per second of one message between each trainer and one engine rank, all four pairs at once."""
    import torch.distributed as dist

    buf = torch.empty(nbytes, dtype=torch.uint8)
    peer = rank + 4 if rank in TRAINERS else rank - 4

    def step():
        (dist.send if rank in TRAINERS else dist.recv)(buf, peer)

    step()
    return nbytes / min(_timed(step) for _ in range(3))


def _wire(rank: int, dest_bytes: dict[int, int]):
    """The ``wire`` row's step: every trainer -> engine pair's bytes as bare messages, all posted at once."""
    import torch.distributed as dist

    from ...move.mover import PIECE

    peers = list(ENGINES) if rank in TRAINERS else list(TRAINERS)
    bufs = {p: torch.empty(dest_bytes[p if rank in TRAINERS else rank] // len(TRAINERS), dtype=torch.uint8)
            for p in peers}

    def step():
        works = []
        for p, buf in bufs.items():
            for lo in range(0, buf.numel(), PIECE):
                part = buf[lo: lo + PIECE]
                works.append(dist.isend(part, p) if rank in TRAINERS else dist.irecv(part, p))
        for w in works:
            w.wait()

    return step


def _rank_main(rank: int, world: int, cfg: TransferBenchConfig) -> dict[str, Any]:
    import torch.distributed as dist
    import torch.distributed.fsdp as fsdp
    from torch.distributed.device_mesh import DeviceMesh

    import pipeload

    from ..engineshape import (checkpoint_shapes, engine_loader, engine_params, engine_slices, leaf_modules,
                               trainer_model)

    s = bench_shape(cfg.size_mb)
    mesh = DeviceMesh("cpu", list(TRAINERS))
    group = dist.new_group([0, *ENGINES])
    model = None
    if rank in TRAINERS:
        model = trainer_model(s, seed=2)
        for m in leaf_modules(model):
            fsdp.fully_shard(m, mesh=mesh)
        fsdp.fully_shard(model, mesh=mesh)
    names = list(trainer_model(s, seed=0).state_dict()) if rank == 0 else None
    names = _broadcast_names(names)
    eng = ENGINES.get(rank)
    params = engine_params(s, 2, eng[0]) if eng else None
    load = engine_loader(s, params, 2, eng[0]) if eng else None
    slices = engine_slices(s, params, 2, eng[0]) if eng else None
    dest_bytes = sum(sl.view.numel() * sl.view.element_size() for sl in slices) if slices else 0
    every = [None] * WORLD
    dist.all_gather_object(every, dest_bytes)
    wire = _wire(rank, dict(enumerate(every)))
    wire()
    _per_tensor(rank, model, s, names, group, load)
    reference = {k: v.clone() for k, v in params.items()} if params else None
    st = pipeload.transfer(model.state_dict() if model else None, slices, version=0)  # plans
    want = {k: (v, s.dtype) for k, v in checkpoint_shapes(s).items()} if eng else None

    def stream(overlap: bool) -> None:
        pipeload.stream(model.state_dict() if model else None, want, load, bucket_mb=cfg.bucket_mb,
                        overlap=overlap)

    stream(True)  # plans each bucket
    times: dict[str, list[float]] = {k: [] for k in ("wire", "pipeload", "stream", "stream, no overlap", "per-tensor",
                                                     "bucketed")}
    stats = []
    for i in range(cfg.repeats):
        times["wire"].append(_timed(wire))
        _zero(params)
        times["pipeload"].append(_timed(lambda: stats.append(
            pipeload.transfer(model.state_dict() if model else None, slices, version=i + 1))))
        _exact(rank, params, reference, "pipeload.transfer")
        for label, overlap in (("stream", True), ("stream, no overlap", False)):
            _zero(params)
            times[label].append(_timed(lambda: stream(overlap)))
            _exact(rank, params, reference, f"pipeload.stream (overlap={overlap})")
        times["per-tensor"].append(_timed(lambda: _per_tensor(rank, model, s, names, group, load)))
        times["bucketed"].append(_timed(lambda: _bucketed(rank, model, s, names, group, load,
                                                          int(cfg.bucket_mb * MiB))))
    rate = _pair_rate(rank, 64 * MiB)
    last = stats[-1]
    return {"rank": rank, "times": times, "rate": rate, "dest_bytes": dest_bytes, "first_planned": st.planned,
            "received": last.bytes_received, "sent": last.bytes_sent, "planned": [x.planned for x in stats],
            "plan_s": [x.timings["plan"] for x in stats], "total_s": [x.timings["total"] for x in stats],
            "model_mib": sum(t.numel() for t in trainer_model(s, seed=0).state_dict().values()) * 2 / MiB
            if rank == 0 else None, "layers": s.layers}


def _exact(rank: int, params, reference, what: str) -> None:
    if params is not None and not all(torch.equal(params[k], reference[k]) for k in params):
        raise AssertionError(f"rank {rank}: engine weights differ after {what}")


def _broadcast_names(names):
    import torch.distributed as dist

    box = [names]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _zero(params) -> None:
    if params:
        for v in params.values():
            v.zero_()


def run(cfg: TransferBenchConfig) -> dict[str, Any]:
    """Run the transfer benchmark on a local world of 8 ranks; the result (rows, targets, config)."""
    from .._world import run_world

    t0 = time.perf_counter()
    values = run_world(_rank_main, WORLD, cfg, timeout=cfg.timeout)
    return summarize(values, cfg) | {"total_seconds": time.perf_counter() - t0}


def summarize(values: list[dict[str, Any]], cfg: TransferBenchConfig) -> dict[str, Any]:
    times = {k: statistics.median(max(v["times"][k][i] for v in values) for i in range(cfg.repeats))
             for k in values[0]["times"]}
    engines = [values[r] for r in ENGINES]
    rate = statistics.median(v["rate"] for v in engines)
    floor = max(v["dest_bytes"] for v in engines) / rate
    senders = [values[r]["sent"] for r in TRAINERS]
    mean = sum(senders) / len(senders)
    plan_share = max(statistics.median(p / t for p, t in zip(v["plan_s"], v["total_s"])) for v in values)
    rows = {
        "times": {k: round(v, 4) for k, v in times.items()} | {"floor": round(floor, 4)},
        "received_over_dest": [round(v["received"] / v["dest_bytes"], 4) for v in engines],
        "max_sender_over_mean": round(max(senders) / mean, 3),
        "plan_share_reused": round(plan_share, 4),
        "reused": all(all(p is False for p in v["planned"]) for v in values),
        "pair_rate_mibps": round(rate / MiB, 1),
        "model_mib": round(values[0]["model_mib"], 1), "layers": values[0]["layers"],
    }
    return {"config": asdict(cfg), "rows": rows, "targets": check_targets(rows)}


def check_targets(rows: dict[str, Any]) -> list[dict[str, Any]]:
    t = rows["times"]
    return [
        {"target": "every engine rank receives 1.00x its destination bytes",
         "value": max(rows["received_over_dest"]), "ok": max(rows["received_over_dest"]) <= 1.005},
        {"target": "no sender sends more than 1.15x the senders' mean", "value": rows["max_sender_over_mean"],
         "ok": rows["max_sender_over_mean"] <= 1.15},
        {"target": "time <= 1.3x the floor", "value": round(t["pipeload"] / t["floor"], 3),
         "ok": t["pipeload"] <= 1.3 * t["floor"]},
        {"target": "time <= 1/3 of the bucketed baseline", "value": round(t["pipeload"] / t["bucketed"], 3),
         "ok": t["pipeload"] <= t["bucketed"] / 3},
        {"target": "a reused step spends <= 5 % planning", "value": rows["plan_share_reused"],
         "ok": rows["plan_share_reused"] <= 0.05 and rows["reused"]},
    ]


def format_table(result: dict[str, Any]) -> str:
    r = result["rows"]
    t = r["times"]
    lines = [f"{'path':<20} {'seconds':>8} {'x floor':>8}"]
    for k in ("floor", "wire", "pipeload", "stream", "stream, no overlap", "bucketed", "per-tensor"):
        if k in t:
            lines.append(f"{k:<20} {t[k]:>8.3f} {t[k] / t['floor']:>8.2f}")
    if "wire" in t:
        lines.append(f"(pipeload / wire: {t['pipeload'] / t['wire']:.2f}; wire / floor: {t['wire'] / t['floor']:.2f})")
    lines.append("")
    lines.append(f"engine ranks' bytes received / destination bytes: {r['received_over_dest']}")
    lines.append(f"busiest sender / senders' mean: {r['max_sender_over_mean']}; planning's share of a reused step "
                 f"(the rank's own work; its collectives are one gather): "
                 f"{r['plan_share_reused']:.2%}; point-to-point rate {r['pair_rate_mibps']} MiB/s per pair")
    lines.append("")
    for x in result["targets"]:
        lines.append(f"{'met   ' if x['ok'] else 'MISSED'} {x['target']}: {x['value']}")
    return "\n".join(lines)
