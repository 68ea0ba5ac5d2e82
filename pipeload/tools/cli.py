"""The ``pipeload`` command: ``bench``, ``inspect``, ``verify`` and ``convert``. Only argument parsing and formatting
live here; the work is in :mod:`pipeload.tools.bench` and :mod:`pipeload.tools.inspect`."""

from __future__ import annotations

import argparse
import json
import os
import select
import sys
from typing import Any, Sequence

MiB = 2**20


def _size(n: int | None) -> str:
    if n is None:
        return "missing"
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} B"


def _csv(text: str) -> tuple[str, ...]:
    return tuple(x.strip() for x in text.split(",") if x.strip())


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="pipeload", description="Inspect, verify, convert and benchmark checkpoints "
                                "(pipeload, torch.distributed.checkpoint, Hugging Face safetensors), and "
                                "simulate the planning of large loads, saves and live transfers.")
    sub = p.add_subparsers(dest="command", required=True, metavar="{bench,inspect,verify,convert,simulate}")
    _bench_parser(sub)
    _checkpoint_parsers(sub)
    _simulate_parser(sub)
    return p


def _bench_parser(sub) -> None:
    from .bench import DEFAULT_SIZE_MB, LOADERS, MODES

    b = sub.add_parser(
        "bench",
        help="benchmark pipeload against torch.distributed.checkpoint on a local world",
        description="Save a synthetic MoE state dict with pipeload and with torch DCP on a local gloo world, "
        "then load it with pipeload (default policy, and broadcast off), a plain per-rank safetensors reader "
        "and DCP in each mode, verifying every load. warm/cold1 are one host; cold/throttled emulate "
        "separate nodes: each rank reads its own copy of the checkpoint and runs on a host of its own.",
    )
    b.add_argument("--world", type=int, default=4, help="ranks (default 4)")
    b.add_argument("--tp", type=int, default=2, help="tensor-parallel size (default 2)")
    b.add_argument("--dp", type=int, default=None, help="data-parallel size (default world / tp)")
    b.add_argument("--size", type=float, default=DEFAULT_SIZE_MB, metavar="MB",
                   help=f"model size in MiB; scales widths, not the tensor count (default {DEFAULT_SIZE_MB})")
    b.add_argument("--seed", type=int, default=0)
    b.add_argument("--repeats", type=int, default=3, help="runs per loader and mode; the median is reported (3)")
    b.add_argument("--modes", type=_csv, default=None,
                   help="comma list of " + ",".join(MODES) + " (default warm,throttled; --full: all)")
    b.add_argument("--loaders", type=_csv, default=None,
                   help="comma list of " + ",".join(LOADERS) + " (default pipeload and DCP, or the plain "
                   "reader for --format hf; --full: all)")
    b.add_argument("--full", action="store_true", help="every mode and every loader (several minutes)")
    b.add_argument("--check", action="store_true",
                   help="print the project's pass/fail targets for this run; exit 1 when one is missed")
    b.add_argument("--read-mbps", type=float, default=200.0, metavar="MIBPS",
                   help="throttled mode: read bandwidth of all ranks together, MiB/s (default 200)")
    b.add_argument("--layers", type=int, default=8, help="transformer layers (default 8)")
    b.add_argument("--experts", type=int, default=128, help="experts per layer (default 128)")
    b.add_argument("--tensors", type=int, default=None, metavar="N",
                   help="about N tensors in all (many small ones: sets the expert count; --size still sets the bytes)")
    b.add_argument("--dir", default=None, help="where checkpoints are written (default: a temp dir, deleted after)")
    b.add_argument("--out", default=None, metavar="JSON", help="write every run and the summary as JSON")
    b.add_argument("--plot", default=None, metavar="PNG", help="write a chart (needs matplotlib)")
    b.add_argument("--timeout", type=float, default=1800.0, help="give up after this many seconds (1800)")
    b.add_argument("--quiet", action="store_true", help="no progress lines")
    b.add_argument("--storage", choices=("file", "s3"), default="file",
                   help="file (default): the loaders above on local files; s3: pipeload from a local S3 server "
                   "(moto) behind an emulated network, read-once vs every rank reading, with and without 503s")
    b.add_argument("--latency-ms", type=float, default=20.0, help="s3: latency added to every request (20)")
    b.add_argument("--conn-mbps", type=float, default=0.5, metavar="MIBPS", help="s3: cap per connection (0.5)")
    b.add_argument("--link-mbps", type=float, default=3.0, metavar="MIBPS", help="s3: cap per node link (3)")
    b.add_argument("--max-requests", type=int, default=8, help="s3: GETs in flight per rank (8)")
    b.add_argument("--p503", type=float, default=0.10, help="s3: share of data GETs answered 503 (0.10)")
    _bench_kinds(b)


def _bench_kinds(b) -> None:
    """The benchmarks run instead of a load (--save, --whole-file, --tier, --transfer, --device), then what a
    load reads and how (--format, --save-layout, --via)."""
    b.add_argument("--save", action="store_true",
                   help="benchmark saving instead: write and memcpy floors, pipeload.save blocking and in the "
                   "background, dcp.save and dcp.async_save (--world, --tp, --dp, --size, --seed, --repeats, "
                   "--dir, --out, --timeout apply)")
    b.add_argument("--whole-file", action="store_true",
                   help="benchmark pipeload.load_file instead: one torch.save file (--size MiB) every rank loads, "
                   "against torch.load on every rank and one rank reading it alone, on emulated separate nodes "
                   "sharing a throttled file system (--world, --size, --repeats, --read-mbps, --dir, --out, "
                   "--timeout apply)")
    b.add_argument("--tier", action="store_true",
                   help="benchmark the memory tier instead: snapshot against a background save, and restore with "
                   "one host lost against a load from the persistent checkpoint on throttled storage "
                   "(--world, --tp, --dp, --size, --seed, --repeats, --read-mbps, --dir, --out, --timeout apply)")
    b.add_argument("--transfer", action="store_true",
                   help="live weight transfer: 4 FSDP2 trainer ranks into two TP 2 engines' fused layout "
                   "(8 ranks), pipeload.transfer against per-tensor and bucketed rank-0 broadcasts and the floor")
    b.add_argument("--bucket-mb", type=float, default=16.0, metavar="MB",
                   help="--transfer: bucket size of the bucketed baseline (16)")
    b.add_argument("--device", action="store_true",
                   help="benchmark the accelerator paths instead, on real device tensors (one accelerator, a few "
                   "minutes): ring H2D against a page-locked copy_, loads of pipeload/DCP/HF checkpoints into "
                   "device DTensors, load_file to the device, a background save and a tier snapshot of device "
                   "tensors, a gloo world holding device tensors; exact or not and time against its floor. "
                   "Without an accelerator it says so and exits 0 (--world: ranks of the gloo world; --size: "
                   "state MiB, default 512; --dir, --timeout apply)")
    b.add_argument("--format", choices=("pipeload", "dcp", "hf"), default="pipeload",
                   help="what pipeload loads: its own checkpoint (default), the one DCP wrote, or an HF-layout "
                   "copy; dcp/hf compare with dcp.load and a plain per-rank safetensors reader")
    b.add_argument("--save-layout", default=None, metavar="LAYOUT",
                   help="save the checkpoints in another layout than the load's: tpN (tp1: whole tensors on "
                   "every rank) or dpXtpY; the load reshards (default: the load's layout)")
    b.add_argument("--via", choices=("pipeload", "dcp.load", "dcp.save"), default="pipeload",
                   help="how the checkpoint is loaded: pipeload.load (default), or dcp.load: stock against "
                   "dcp.load under pipeload.dcp.install(), in every mode (needs --format dcp); with --save, "
                   "dcp.save: dcp.save and dcp.async_save under install() against pipeload.save, stock DCP "
                   "and the memcpy floor, and stock dcp.load reading the result")


def _checkpoint_parsers(sub) -> None:
    """inspect, verify, convert."""
    formats = ("pipeload", "dcp", "hf")
    i = sub.add_parser("inspect", help="summarise a checkpoint",
                       description="Summarise a checkpoint (pipeload, torch DCP or Hugging Face layout).")
    i.add_argument("checkpoint")
    i.add_argument("--format", choices=formats, default=None, help="layout (default: detected)")
    i.add_argument("--json", action="store_true", help="print the summary as JSON")
    i.add_argument("--objects", action="store_true", help="list every Python object")

    v = sub.add_parser(
        "verify",
        help="check every chunk's bytes against its checksum",
        description="Recompute every chunk's and object's checksum, check every data file is valid "
        "safetensors and every chunk's dtype and shape match the metadata. Exit 0 when clean, 1 otherwise.",
    )
    v.add_argument("checkpoint")
    v.add_argument("--format", choices=formats, default=None, help="layout (default: detected)")

    c = sub.add_parser(
        "convert",
        help="rewrite a checkpoint as a pipeload or Hugging Face checkpoint",
        description="Read a checkpoint of any layout (pipeload, torch DCP, Hugging Face) and write it to DST "
        "as a pipeload checkpoint (default; chunks kept, checksums computed) or, with --to hf, as Hugging Face "
        "safetensors shards with model.safetensors.index.json (whole tensors; Python objects left out). "
        "Streams: memory stays bounded by one chunk (one tensor for --to hf).",
    )
    c.add_argument("src")
    c.add_argument("dst")
    c.add_argument("--to", choices=("pipeload", "hf"), default="pipeload")
    c.add_argument("--format", choices=formats, default=None, help="layout of SRC (default: detected)")
    c.add_argument("--max-file-size", type=float, default=None, metavar="MB",
                   help="start a new output file past this size (default 2048 for pipeload, 5120 for hf)")


def _simulate_parser(sub) -> None:
    s = sub.add_parser(
        "simulate",
        help="run the planning of a load, a save, a restore or a live transfer for W simulated ranks and report "
        "its cost per rank",
        description="Build every rank's exchange row and plan record for a layout of W ranks, then run "
        "the loader's own planning path (metadata parse, local plan, exchange, global plan) for a few "
        "sampled ranks with a simulated exchange. Reports CPU and peak memory per rank, exchange bytes, "
        "reader balance, groups created, and whether every sampled rank took the same decisions. "
        "With --op save, the saver's own planning (pipeload.save.saver.plan_phase) runs instead, and rank 0's "
        "commit (what it receives, the chunk index and .metadata it writes). With --op restore, the restore's "
        "planning from a memory tier (pipeload.tier.restoreplan) with one host's tier lost. With --op transfer, "
        "pipeload.transfer's planning (pipeload.move.plan: records to the names' owners, their answers back) "
        "from W FSDP2 trainer ranks into E engine ranks holding a fused tensor-parallel layout, on rank 0, a "
        "trainer, an engine rank and the busiest owner; --layout fsdp (default) or hsdp. Exit 1 when the "
        "sampled ranks disagree (transfer: when a destination byte is not covered exactly once).",
    )
    s.add_argument("--op", choices=["load", "save", "restore", "transfer"], default="load",
                   help="the planning to simulate (default load); restore: from a memory tier, one host lost; "
                   "transfer: pipeload.transfer from trainer ranks into engine ranks")
    s.add_argument("--world", type=int, required=True, help="simulated ranks (a multiple of 8; 64 for dense-pp8); "
                   "transfer: trainer ranks")
    s.add_argument("--layout", choices=["dense", "dense-pp8", "moe", "fsdp", "tp-from-whole", "hsdp"],
                   help="load, save, restore (required): dense, dense-pp8, moe, fsdp, tp-from-whole; transfer: the "
                   "trainer's FSDP2 layout, fsdp (default: Shard(0) over all W) or hsdp (Shard(0) over "
                   "--shard-group ranks, replicated across the groups)")
    s.add_argument("--optim", action="store_true", help="add AdamW state (exp_avg, exp_avg_sq, step) per parameter")
    s.add_argument("--samples", type=int, default=3, help="ranks whose planning runs (default 3: first, middle, last)")
    s.add_argument("--no-memory", action="store_true", help="skip the second, memory-traced pass")
    s.add_argument("--json", action="store_true", help="print one JSON object")
    s.add_argument("--format", choices=["pipeload", "dcp", "hf"], default="pipeload",
                   help="layout of the simulated checkpoint's metadata: pipeload's (default), torch DCP's pickled "
                   ".metadata, or Hugging Face's index and headers; dcp and hf also report rank 0's decode")
    _simulate_transfer_args(s)


def _simulate_transfer_args(s) -> None:
    t = s.add_argument_group("--op transfer")
    t.add_argument("--engine-world", type=int, default=None, metavar="E",
                   help="engine ranks, E / TP replicas (default: W)")
    t.add_argument("--tp", type=int, default=8, help="the engines' tensor parallelism (default 8)")
    t.add_argument("--model", choices=["671b", "235b", "small"], default="671b",
                   help="671b: DeepSeek-V3-sized MoE (61 layers, 256 experts, hidden 7168; default); 235b: "
                   "Qwen3-235B-sized (94 layers, 128 experts, hidden 4096); small: the transfer bench's shape")
    t.add_argument("--layers", type=int, default=None, help="override the model's layer count")
    t.add_argument("--shard-group", type=int, default=8, help="hsdp: ranks each parameter is sharded over (default 8)")
    t.add_argument("--colocated", action="store_true", help="the engine ranks are the first E trainer ranks")
    t.add_argument("--whole", action=argparse.BooleanOptionalAction, default=None,
                   help="run every owner's answers in full: exact answers and the sender balance (default: when "
                   "the plan has at most 2 G pieces, ~11 minutes at 8k+8k; a plan giving one rank over 20 M pieces "
                   "is sized, not run)")


def _simulate(args: argparse.Namespace) -> int:
    from .simsave import format_save_result, simulate_save
    from .simulate import format_result, simulate

    log = None if args.json else (lambda m: print(m, file=sys.stderr))
    from .simrestore import format_restore_result, simulate_restore

    if args.op == "transfer":
        return _simulate_transfer(args, log)
    if args.layout in (None, "hsdp"):
        print(f"pipeload simulate --op {args.op}: --layout must be one of dense, dense-pp8, moe, fsdp, tp-from-whole",
              file=sys.stderr)
        return 2
    run, fmt = {"save": (simulate_save, format_save_result), "restore": (simulate_restore, format_restore_result),
                "load": (simulate, format_result)}[args.op]
    kw = {"format": args.format} if args.op == "load" else {}
    res = run(args.world, args.layout, optim=args.optim, samples=args.samples, memory=not args.no_memory, log=log, **kw)
    print(json.dumps(res, indent=2) if args.json else fmt(res))
    return 0 if res["plans_identical"] else 1


def _simulate_transfer(args: argparse.Namespace, log) -> int:
    from .simtransfer import format_transfer_result, simulate_transfer

    if args.layout not in (None, "fsdp", "hsdp"):
        print("pipeload simulate --op transfer: --layout is fsdp or hsdp", file=sys.stderr)
        return 2
    try:
        res = simulate_transfer(args.world, args.layout or "fsdp", engines=args.engine_world, tp=args.tp,
                                model=args.model, layers=args.layers, shard_group=args.shard_group,
                                colocated=args.colocated, whole=args.whole, memory=not args.no_memory, log=log)
    except ValueError as e:
        print(f"pipeload simulate --op transfer: {e}", file=sys.stderr)
        return 2
    print(json.dumps(res, indent=2) if args.json else format_transfer_result(res))
    return 0 if res["plan_consistent"] else 1


def _bench_save(args: argparse.Namespace, dp: int) -> int:
    import json

    from ._world import run_world_bench
    from .bench import save as bench_save
    if args.via == "dcp.save":
        from .bench import dcpsave as bench_save
    cfg = bench_save.SaveBenchConfig(world=args.world, tp=args.tp, dp=dp, size_mb=args.size, seed=args.seed,
                                     repeats=args.repeats, dir=args.dir, timeout=args.timeout, quiet=args.quiet)
    result, failed = run_world_bench("pipeload bench --save", lambda: bench_save.run(cfg))
    if failed is not None:
        return failed
    _write_json(args.out, result)
    print(f"{args.world} ranks (TP{args.tp} x DP{dp}), {args.size:g} MiB model, owned MiB per rank "
          f"{result['owned_mib']}, {args.repeats} repeats (medians)\n")
    print(bench_save.format_table(result))
    print(f"\ntotal {result['total_seconds']:.0f} s" + (f"; results in {args.out}" if args.out else ""))
    return 0


def _write_json(path: str | None, result: dict) -> None:
    """A bench's result as JSON at ``--out``, when one was given."""
    if path:
        with open(path, "w") as f:
            json.dump(result, f, indent=1)


def _bench_file(args: argparse.Namespace) -> int:
    from ._world import run_world_bench
    from .bench import wholefile

    cfg = wholefile.FileBenchConfig(world=args.world, size_mb=args.size, repeats=args.repeats,
                                    read_mbps=args.read_mbps, dir=args.dir, timeout=args.timeout, quiet=args.quiet)
    result, failed = run_world_bench("pipeload bench --whole-file", lambda: wholefile.run(cfg))
    if failed is not None:
        return failed
    _write_json(args.out, result)
    th = result["throttle"]
    print(f"{args.world} ranks, each its own node and copy, one {result['size'] / MiB:.0f} MiB torch.save file, "
          f"{args.repeats} repeats (medians); storage: "
          + (f"all ranks together {args.read_mbps:g} MiB/s" if th["ok"] else f"NOT throttled ({th['reason']})") + "\n")
    print(wholefile.format_table(result))
    print(f"\ntotal {result['total_seconds']:.0f} s, 1-minute load average {result['loadavg'][0]} -> "
          f"{result['loadavg'][1]}" + (f"; results in {args.out}" if args.out else ""))
    return 0


def _bench_tier(args: argparse.Namespace, dp: int) -> int:
    from ._world import run_world_bench
    from .bench import tier as bench_tier
    size = args.size
    cfg = bench_tier.TierBenchConfig(world=args.world, tp=args.tp, dp=dp, size_mb=size, seed=args.seed,
                                     repeats=args.repeats, read_mbps=args.read_mbps, dir=args.dir,
                                     timeout=args.timeout, quiet=args.quiet)
    result, failed = run_world_bench("pipeload bench --tier", lambda: bench_tier.run(cfg))
    if failed is not None:
        return failed
    _write_json(args.out, result)
    throttle = result["throttle"]
    print(f"{args.world} ranks (TP{args.tp} x DP{dp}), each an emulated host; {size:g} MiB model "
          f"({result['unique_mib']} MiB unique, per rank {result['local_mib']} MiB); tier roots under "
          f"{result['tier_root']}; persistent loads "
          + (f"throttled to {args.read_mbps:g} MiB/s ({throttle['mechanism']})" if throttle.get("ok")
             else f"NOT throttled ({throttle.get('reason')})") + f"; {args.repeats} repeats (medians)\n")
    print(bench_tier.format_table(result))
    print(f"\ntotal {result['total_seconds']:.0f} s, load average {result['loadavg']} (before, after)"
          + (f"; results in {args.out}" if args.out else ""))
    return 0


def _bench_transfer(args: argparse.Namespace) -> int:
    from ._world import run_world_bench
    from .bench import transfer as bench_transfer

    cfg = bench_transfer.TransferBenchConfig(size_mb=args.size, repeats=args.repeats, bucket_mb=args.bucket_mb,
                                             timeout=args.timeout, quiet=args.quiet)
    result, failed = run_world_bench("pipeload bench --transfer", lambda: bench_transfer.run(cfg))
    if failed is not None:
        return failed
    _write_json(args.out, result)
    r = result["rows"]
    print(f"8 ranks: 4 FSDP2 trainers -> 2 engines x TP 2 (fused layout), {r['model_mib']} MiB bf16 model "
          f"({r['layers']} layers), {args.repeats} repeats (medians of the slowest rank)\n")
    print(bench_transfer.format_table(result))
    print(f"\ntotal {result['total_seconds']:.0f} s" + (f"; results in {args.out}" if args.out else ""))
    return 0


def _bench_device(args: argparse.Namespace) -> int:
    from .bench import DEFAULT_SIZE_MB
    from .bench import device as bench_device

    size = bench_device.DEFAULT_SIZE_MB if args.size == DEFAULT_SIZE_MB else max(1, int(args.size))
    return bench_device.run(size, min(args.timeout, bench_device.BUDGET_SECONDS), args.world, args.dir)


def _bench(args: argparse.Namespace) -> int:
    if args.device:
        return _bench_device(args)
    if args.transfer:
        return _bench_transfer(args)
    if args.whole_file:
        return _bench_file(args)
    if args.storage == "s3":
        from .bench.s3 import main as bench_s3

        return bench_s3(args)
    from .bench import LOADERS, MODES, QUICK_MODES, BenchConfig, describe, format_table, headline, run_bench

    dp = args.dp if args.dp is not None else max(1, args.world // args.tp)
    if args.save:
        return _bench_save(args, dp)
    if args.via == "dcp.save":
        print("pipeload bench: --via dcp.save needs --save", file=sys.stderr)
        return 2
    if args.tier:
        return _bench_tier(args, dp)
    modes = args.modes or (MODES if args.full else QUICK_MODES)
    loaders = args.loaders or (LOADERS if args.full else None)
    cfg = BenchConfig(
        world=args.world, tp=args.tp, dp=dp, size_mb=args.size, seed=args.seed, repeats=args.repeats,
        modes=tuple(modes), loaders=tuple(loaders) if loaders else None, read_mbps=args.read_mbps, dir=args.dir,
        layers=args.layers, experts=args.experts, timeout=args.timeout, quiet=args.quiet, format=args.format,
        tensors=args.tensors, via=args.via, save_layout=args.save_layout,
    )
    if args.plot:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            print("pipeload bench: --plot needs matplotlib: pip install 'pipeload[plot]'", file=sys.stderr)
            return 2
    from ._world import run_world_bench

    result, failed = run_world_bench("pipeload bench", lambda: run_bench(cfg, out=args.out, plot_path=args.plot))
    if failed is not None:
        return failed
    print(headline(result))
    print()
    print(format_table(result, targets=args.check))
    print()
    print(describe(result))
    print(f"\ntotal {result['total_seconds']:.0f} s"
          + (f"; results in {args.out}" if args.out else "") + (f"; chart in {args.plot}" if args.plot else "")
          + ("" if args.full or args.check else "; pipeload bench --full runs every mode and loader"))
    missed = [t for t in result["targets"] if t["ok"] is False]
    return 1 if args.check and missed else 0


def format_inspect(info: dict[str, Any], objects: bool = False) -> str:
    lay = info["layout"]
    fmt = info.get("format", "pipeload")
    lines = [
        f"checkpoint  {info['path']}",
        f"save id     {info['save_id']} (format v{info['version']}, saved by {info['world_size']} rank(s))"
        if fmt == "pipeload" else f"layout      {fmt}" + (f" (save id {info['save_id']})" if info["save_id"] else ""),
        f"tensors     {info['tensors']} in {info['chunks']} chunks, {_size(info['tensor_bytes'])}",
        f"objects     {info['objects']}, {_size(info['object_bytes'])}",
        f"files       {len(info['files'])}, {_size(info['file_bytes'])} on disk",
        *([f"sidecar     {info['sidecar']} ({'used by the next load' if info['sidecar'] == 'current' else 'built by the next load where the directory is writable'})"]
          if info.get("sidecar") else []),
        "",
        "layout: "
        + f"{lay['whole']} tensors stored whole, {lay['chunked']} cut into chunks"
        + (f", {lay['empty']} empty" if lay["empty"] else ""),
    ]
    if lay["by_chunk_count"]:
        lines.append("  chunks per cut tensor: " + ", ".join(
            f"{n} tensors x {k}" for k, n in lay["by_chunk_count"].items()))
    if lay["by_split_dims"]:
        lines.append("  cut along dim: " + ", ".join(
            f"{k}: {n} tensors" for k, n in lay["by_split_dims"].items()))
    lines.append("")
    lines.append("dtypes:")
    for name, d in info["dtypes"].items():
        lines.append(f"  {name:<6} {d['tensors']:>7} tensors  {_size(d['bytes']):>10}")
    lines.append("")
    lines.append("files:")
    w = max([len(f["name"]) for f in info["files"]] + [4])
    for f in info["files"]:
        lines.append(f"  {f['name']:<{w}}  {_size(f['size']):>10}  {f['chunks']:>6} chunks  {f['objects']:>4} objects")
    if info["largest"]:
        lines.append("")
        lines.append("largest tensors:")
        for t in info["largest"]:
            lines.append(f"  {t['fqn']}  {t['dtype']} {t['shape']}  {_size(t['bytes'])}  {t['chunks']} chunk(s)")
    if info["object_list"]:
        lines.append("")
        shown = info["object_list"] if objects else info["object_list"][:10]
        lines.append("objects:" if objects or len(info["object_list"]) <= 10 else
                     f"objects (first 10 of {len(info['object_list'])}; --objects for all):")
        for o in shown:
            lines.append(f"  {o['fqn']}  {_size(o['bytes'])}  in {o['file']}")
    return "\n".join(lines)


def _inspect(args: argparse.Namespace) -> int:
    from ..errors import CheckpointFormatError
    from .inspect import inspect_checkpoint

    try:
        info = inspect_checkpoint(args.checkpoint, args.format)
    except CheckpointFormatError as e:
        print(f"pipeload inspect: {e}", file=sys.stderr)
        return 1
    print(json.dumps(info, indent=1) if args.json else format_inspect(info, objects=args.objects))
    return 0


def _verify(args: argparse.Namespace) -> int:
    from .inspect import verify_checkpoint

    problems = verify_checkpoint(args.checkpoint, args.format)
    if problems:
        print(f"{args.checkpoint}: {len(problems)} problem(s):", file=sys.stderr)
        for p in problems:
            print(f"  {p}", file=sys.stderr)
        return 1
    print(f"{args.checkpoint}: ok")
    return 0


def _convert(args: argparse.Namespace) -> int:
    from ..errors import PipeloadError
    from .convert import convert

    limit = int(args.max_file_size * MiB) if args.max_file_size else None
    try:
        r = convert(args.src, args.dst, to=args.to, format=args.format, file_bytes=limit)
    except PipeloadError as e:
        print(f"pipeload convert: {e}", file=sys.stderr)
        return 1
    skipped = f"; {r['skipped_objects']} Python object(s) left out (no place in the HF layout)" if r["skipped_objects"] else ""
    print(f"{args.dst}: {r['format']} checkpoint, {r['tensors']} tensors, {r['objects']} objects "
          f"in {r['files']} file(s){skipped}")
    return 0


EXIT_CLOSED_PIPE = 128 + 13  # what a shell reports for a command ended by SIGPIPE


def main(argv: Sequence[str] | None = None) -> int:
    """Run one command; its exit status. A reader that closes the output early (``pipeload inspect CKPT |
    head -1``) ends the command quietly with status 141, as a command ended by SIGPIPE would."""
    try:
        args = _parser().parse_args(argv)
        handler = {"bench": _bench, "inspect": _inspect, "verify": _verify, "convert": _convert,
                   "simulate": _simulate}[args.command]
        rc = handler(args)
        sys.stdout.flush()  # a closed pipe shows here, not at exit where it would print a traceback
        return rc
    except BrokenPipeError:
        if not _stdout_closed():
            raise  # a pipe of the command's own work (a bench world): a real error
        return EXIT_CLOSED_PIPE


def _stdout_closed() -> bool:
    """Whether standard output is a pipe whose reader has gone; if so, it is pointed at /dev/null so that
    the interpreter's last flush at exit has nowhere to fail."""
    try:
        fd = sys.stdout.fileno()
        poll = select.poll()
        poll.register(fd, select.POLLOUT)
        if not any(ev & (select.POLLERR | select.POLLHUP) for _, ev in poll.poll(0)):
            return False
        os.dup2(os.open(os.devnull, os.O_WRONLY), fd)
    except (OSError, ValueError, AttributeError):  # no real file behind stdout (captured, closed)
        return False
    return True


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
