"""``pipeload bench --storage s3``: loads from a local S3 server through an emulated network.

A moto S3 server on 127.0.0.1 serves the checkpoint through :class:`pipeload.tools.s3testing.FaultProxy`,
one proxy port per rank (each rank is its own emulated node, ``PIPELOAD_HOST_ID``), which adds a fixed
latency to every request and caps every connection's and every node link's bandwidth. A TP x DP world
of gloo ranks then loads it:

- read once: each replicated shard fetched by one rank and broadcast (pipeload's default across nodes);
- every rank reads: ``broadcast_replicated_tensors=False``;
- read once with fewer requests in flight (connection-bound instead of link-bound);
- read once with a share of GETs answered 503 SlowDown (retried with backoff).

The expected per-node rate is min(requests in flight x connection cap, link cap). For each case the
busiest node's bytes over that rate give the ideal time; measured wall time over ideal is reported
("of expected" = ideal / measured). Needs ``pipeload[test]`` (moto) and ``pipeload[s3]`` (obstore).
Every load is checked element by element.
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from typing import Any

MiB = 1 << 20


@dataclass
class S3BenchConfig:
    world: int = 4
    tp: int = 2
    size_mb: float = 256.0  # unique checkpoint bytes
    tensor_mb: float = 16.0  # each global tensor (sharded on tp)
    latency_ms: float = 20.0  # per request
    conn_mbps: float = 0.5  # MiB/s per connection
    link_mbps: float = 3.0  # MiB/s per node (all its connections)
    max_requests: int = 8  # GETs in flight per rank
    few_requests: int = 4  # the connection-bound case
    p503: float = 0.10
    repeats: int = 2
    timeout: float = 1800.0
    quiet: bool = False


CASES = ("read-once", "every-rank-reads", "read-once-few-conns", "read-once-503")


def _state_dict(mesh, cfg: S3BenchConfig, fill: bool) -> dict:
    import torch
    from torch.distributed.tensor import DTensor, Replicate, Shard
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    n = max(1, round(cfg.size_mb / cfg.tensor_mb))
    cols = 1024
    rows = max(cfg.tp, int(cfg.tensor_mb * MiB) // (4 * cols))
    out = {}
    for i in range(n):
        shape = (rows, cols)
        placements = [Replicate(), Shard(0)]
        lengths, offsets = compute_local_shape_and_global_offset(shape, mesh, placements)
        local = torch.zeros(lengths) if not fill else _values(i, offsets, lengths)
        out[f"layer{i}.w"] = DTensor.from_local(local, mesh, placements, run_check=False, shape=torch.Size(shape),
                                                stride=(cols, 1))
    return out


def _values(i: int, offsets, lengths):
    import torch

    r0, c0 = offsets
    rows = torch.arange(r0, r0 + lengths[0], dtype=torch.float32).unsqueeze(1)
    cols = torch.arange(c0, c0 + lengths[1], dtype=torch.float32).unsqueeze(0)
    return rows * 1024 + cols + i * 1e6


def _check(sd: dict) -> None:
    import torch

    for name, t in sd.items():
        i = int(name[5:].split(".")[0])
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

        lengths, offsets = compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)
        if not torch.equal(t.to_local(), _values(i, offsets, lengths)):
            raise AssertionError(f"{name}: loaded values differ")


def _world(rank: int, world: int, root: str, port: int, links: list[str], cfg: S3BenchConfig) -> dict:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    import pipeload
    from ..s3testing import LocalS3

    mesh = init_device_mesh("cpu", (world // cfg.tp, cfg.tp))
    local = os.path.join(root, "ckpt")
    pipeload.save(_state_dict(mesh, cfg, True), local)
    if rank == 0:
        up = LocalS3(port)
        for bucket in ("clean", "flaky"):
            up.upload(local, bucket, "ckpt")
    dist.barrier()
    base = LocalS3.options(links[rank], max_requests=cfg.max_requests)
    runs = {
        "read-once": ("s3://clean/ckpt", base, {}),
        "every-rank-reads": ("s3://clean/ckpt", base, {"broadcast_replicated_tensors": False}),
        "read-once-few-conns": ("s3://clean/ckpt", {**base, "max_requests": cfg.few_requests}, {}),
        "read-once-503": ("s3://flaky/ckpt", base, {}),
    }
    out: dict[str, list] = {c: [] for c in CASES}
    # warm-up, untimed: the I/O loop, the client and the load path's first-use costs
    small = S3BenchConfig(**{**asdict(cfg), "size_mb": cfg.tensor_mb, "repeats": 1})
    pipeload.save(_state_dict(mesh, small, True), os.path.join(root, "warm"))
    if rank == 0:
        LocalS3(port).upload(os.path.join(root, "warm"), "clean", "warm")
    dist.barrier()
    pipeload.load(_state_dict(mesh, small, False), "s3://clean/warm", storage_options=base)
    sd = _state_dict(mesh, cfg, False)
    for rep in range(cfg.repeats):
        for case in CASES:
            url, opts, kw = runs[case]
            for t in sd.values():
                t.to_local().zero_()
            dist.barrier()
            t0, start = time.perf_counter(), time.time()
            stats = pipeload.load(sd, url, storage_options=opts, **kw)
            wall = time.perf_counter() - t0
            if rep == 0:
                _check(sd)
            out[case].append({"wall": wall, "start": start, "end": time.time(), "bytes_fetched": stats.bytes_fetched, "requests": stats.requests,
                              "retries": stats.retries, "throttled": stats.throttled,
                              "max_inflight": stats.max_inflight_requests, "bytes_received": stats.bytes_received})
            if rank == 0 and not cfg.quiet:
                print(f"  [{rep + 1}/{cfg.repeats}] {case}: {wall:.2f} s", file=sys.stderr, flush=True)
    return out


def run_s3_bench(cfg: S3BenchConfig, out: str | None = None) -> dict[str, Any]:
    """Start moto and the proxy, run the world, return the summary (and write it as JSON to ``out``)."""
    from .._world import run_world
    from ..s3testing import Faults, FaultProxy, LocalS3

    if cfg.world % cfg.tp:
        raise ValueError("--world must be a multiple of --tp")
    t0 = time.perf_counter()
    root = tempfile.mkdtemp(prefix="pipeload-bench-s3-")
    try:
        with LocalS3() as server:
            server.bucket("clean")
            server.bucket("flaky")
            faults = Faults(latency=cfg.latency_ms / 1000, conn_rate=cfg.conn_mbps * MiB,
                            link_rate=cfg.link_mbps * MiB, rules=[("/flaky/ckpt/data-", {"p503": cfg.p503})])
            with FaultProxy(server.port, links=cfg.world, faults=faults) as proxy:
                links = [proxy.url(i) for i in range(cfg.world)]
                res = run_world(_world, cfg.world, root, server.port, links, cfg, timeout=cfg.timeout,
                                separate_hosts=True)
                _transfers(res, proxy.log)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    result = summarise(cfg, res)
    result["total_seconds"] = time.perf_counter() - t0
    if out:
        with open(out, "w") as f:
            json.dump({"config": asdict(cfg), "result": result, "runs": res}, f, indent=1)
    return result


def _transfers(res: list[dict], log) -> None:
    """Per rank and load: its data GETs as the proxy saw them, from the first one's arrival to the last
    answer sent: the node's transfer window ("transfer"), which leaves out planning and the metadata."""
    for rank, runs in enumerate(res):
        for case_runs in runs.values():
            for run in case_runs:
                gets = [r for r in log if r.link == rank and r.method == "GET" and "/data-" in r.path
                        and run["start"] <= r.start <= run["end"]]
                run["transfer"] = (max(r.end for r in gets) - min(r.start for r in gets)) if gets else 0.0
                run["data_bytes"] = sum(r.sent for r in gets)


def summarise(cfg: S3BenchConfig, res: list[dict]) -> dict[str, Any]:
    n = max(1, round(cfg.size_mb / cfg.tensor_mb))
    rows = max(cfg.tp, int(cfg.tensor_mb * MiB) // (4 * 1024))
    unique = n * rows * 1024 * 4
    cases = {}
    for case in CASES:
        walls = [max(r[case][i]["wall"] for r in res) for i in range(cfg.repeats)]
        i = walls.index(statistics.median_low(walls))
        per_rank = [r[case][i] for r in res]
        conns = cfg.few_requests if case == "read-once-few-conns" else cfg.max_requests
        rate = min(conns * cfg.conn_mbps, cfg.link_mbps) * MiB
        busiest = max(p["bytes_fetched"] for p in per_rank)
        fetched = sum(p["bytes_fetched"] for p in per_rank)
        # the storage throughput of each node over its own transfer window; the slowest node reported
        node_rates = [p["data_bytes"] / p["transfer"] for p in per_rank if p.get("transfer")]
        cases[case] = {
            "wall": walls[i], "walls": walls, "connections": conns, "expected_node_mibps": rate / MiB,
            "busiest_node_mib": busiest / MiB, "node_mibps": busiest / MiB / walls[i],
            "of_expected": (busiest / rate) / walls[i], "fetched_over_unique": fetched / unique,
            "transfer_mibps": min(node_rates) / MiB if node_rates else 0.0,
            "transfer_of_expected": min(node_rates) / rate if node_rates else 0.0,
            "gets": sum(p["requests"] for p in per_rank), "retries": sum(p["retries"] for p in per_rank),
            "throttled": sum(p["throttled"] for p in per_rank),
            "max_inflight": max(p["max_inflight"] for p in per_rank),
        }
    return {"unique_mib": unique / MiB, "cases": cases,
            "fault_slowdown": cases["read-once-503"]["wall"] / cases["read-once"]["wall"],
            "every_rank_slowdown": cases["every-rank-reads"]["wall"] / cases["read-once"]["wall"]}


def format_s3_table(cfg: S3BenchConfig, result: dict[str, Any]) -> str:
    lines = [f"S3 (moto on 127.0.0.1 behind an emulated network): {cfg.world} ranks (TP{cfg.tp} x "
             f"DP{cfg.world // cfg.tp}, one node each), {result['unique_mib']:.0f} MiB unique; "
             f"{cfg.latency_ms:g} ms per request, {cfg.conn_mbps:g} MiB/s per connection, "
             f"{cfg.link_mbps:g} MiB/s per node link; median of {cfg.repeats}",
             f"{'case':<22}{'conns':>6}{'expected':>10}{'transfer':>10}{'of exp.':>9}{'wall':>8}{'busiest':>9}"
             f"{'wall rate':>11}{'of exp.':>9}{'fetched':>9}{'GETs':>6}{'retries':>8}{'503s':>6}{'inflight':>9}",
             f"{'':<22}{'':>6}{'MiB/s':>10}{'MiB/s':>10}{'':>9}{'s':>8}{'MiB':>9}{'MiB/s':>11}{'':>9}{'/unique':>9}"]
    for case, c in result["cases"].items():
        lines.append(f"{case:<22}{c['connections']:>6}{c['expected_node_mibps']:>10.1f}{c['transfer_mibps']:>10.1f}"
                     f"{c['transfer_of_expected']:>8.0%} {c['wall']:>8.2f}"
                     f"{c['busiest_node_mib']:>9.1f}{c['node_mibps']:>11.1f}{c['of_expected']:>8.0%} "
                     f"{c['fetched_over_unique']:>8.2f}x{c['gets']:>6}{c['retries']:>8}{c['throttled']:>6}"
                     f"{c['max_inflight']:>9}")
    lines.append("transfer: the slowest node's data bytes over its window from first data GET to last byte "
                 "(the proxy's log); wall: the whole load (planning, LIST, metadata, headers included), "
                 "over the busiest node's bytes")
    lines.append(f"{cfg.p503:.0%} 503s vs fault-free: {result['fault_slowdown']:.2f}x the time (target <= 1.3x); "
                 f"every rank reading for itself: {result['every_rank_slowdown']:.2f}x the time, "
                 f"{result['cases']['every-rank-reads']['fetched_over_unique']:.2f}x the bytes")
    return "\n".join(lines)


def main(args) -> int:
    """The CLI's ``bench --storage s3`` (arguments parsed by pipeload.tools.cli)."""
    from .._world import WorldError

    cfg = S3BenchConfig(world=args.world, tp=args.tp, size_mb=args.size,
                        latency_ms=args.latency_ms, conn_mbps=args.conn_mbps, link_mbps=args.link_mbps,
                        max_requests=args.max_requests, p503=args.p503, repeats=args.repeats,
                        timeout=args.timeout, quiet=args.quiet)
    try:
        import moto  # noqa: F401
        import obstore  # noqa: F401
    except ImportError as e:
        print(f"pipeload bench --storage s3: needs {e.name}: pip install 'pipeload[s3,test]'", file=sys.stderr)
        return 2
    from .._world import run_world_bench

    result, failed = run_world_bench("pipeload bench", lambda: run_s3_bench(cfg, out=args.out))
    if failed is not None:
        return failed
    print(format_s3_table(cfg, result))
    print(f"\ntotal {result['total_seconds']:.0f} s" + (f"; results in {args.out}" if args.out else ""))
    return 0


__all__ = ["S3BenchConfig", "run_s3_bench", "summarise", "format_s3_table", "main"]
