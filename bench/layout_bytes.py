"""Device bytes of loads whose layout differs from the save's, separate nodes emulated.

    python bench/layout_bytes.py [--size 53] [--layers 6] [--experts 24] [--cases tp1:dp2tp2,...]

One local gloo world of ``--world`` ranks (each its own host, ``PIPELOAD_HOST_ID``) saves the bench's
synthetic MoE state dict (:mod:`pipeload.tools.synth`) once per save layout, with ``pipeload.save`` (or
``dcp.save`` for a case whose save layout is written ``dcp-LAYOUT``); every rank copies each checkpoint
to a directory of its own (separate page caches). Each case then loads one checkpoint into another
layout with ``pipeload.load``: every rank's copy is dropped from the page cache
(``posix_fadvise(DONTNEED)``) before the load, and the bytes its process read from the device
(``/proc/self/io`` ``read_bytes``, readahead included) are summed over the ranks and divided by the
unique tensor bytes. Every load is verified bitwise against the synthetic values. The figures are byte
counts, not times: other work on the machine does not move them.

A layout is ``tpN`` (``N``-way tensor parallel, the rest data parallel: ``tp1`` is whole tensors on
every rank) or ``dpXtpY`` (``pipeload.tools.bench.config.layout_dims``). A case is ``SAVE:LOAD``.
Times: ``pipeload bench --save-layout LAYOUT --modes throttled``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

CASES = "tp1:tp1,tp1:dp2tp2,tp1:tp4,tp4:dp2tp2,dp2tp2:tp1,dcp-tp1:dp2tp2"


def _save_all(rank: int, world: int, args, root: str, saves: list[str]) -> None:
    """Every save layout written once, then copied per rank (rank ``r`` reads ``root/NAME-r``)."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    import pipeload
    from pipeload.tools import synth
    from pipeload.tools.bench.config import layout_dims

    for name in saves:
        via_dcp = name.startswith("dcp-")
        dp, tp = layout_dims(name[4:] if via_dcp else name, world)
        sd = synth.build_state_dict(synth.make_mesh(world, tp, dp), args.seed, args.size, **_shape(args))
        where = os.path.join(root, name)
        if via_dcp:
            dcp.save(sd, checkpoint_id=where)
        else:
            pipeload.save(sd, where)
        dist.barrier()
    shutil.rmtree(os.path.join(root, f"{rank}"), ignore_errors=True)
    for name in saves:
        shutil.copytree(os.path.join(root, name), os.path.join(root, f"{rank}", name))
    dist.barrier()


def _shape(args) -> dict:
    return dict(layers=args.layers, experts=args.experts)


def _rank(rank: int, world: int, args, root: str) -> list[dict]:
    import torch.distributed as dist

    import pipeload
    from pipeload.tools import synth
    from pipeload.tools.bench.config import layout_dims
    from pipeload.tools.bench.system import data_files, drop_cache, proc_io, resident_bytes

    cases = [tuple(c.split(":")) for c in args.cases.split(",")]
    _save_all(rank, world, args, root, sorted({s for s, _ in cases}))
    out = []
    for save, load in cases:
        dp, tp = layout_dims(load, world)
        dest = synth.build_state_dict(synth.make_mesh(world, tp, dp), args.seed, args.size, fill=False,
                                      **_shape(args))
        mine = os.path.join(root, f"{rank}", save)
        for _ in range(args.repeats):
            synth.zero_(dest)
            drop_cache(data_files(mine))
            dist.barrier()
            io0, t0 = proc_io()["read_bytes"], time.perf_counter()
            stats = pipeload.load(dest, mine, reuse_plan=False)
            wall, read = time.perf_counter() - t0, proc_io()["read_bytes"] - io0
            # this rank's copy was dropped before the load: what is cached now is what it read
            by_file = {os.path.basename(f): round(resident_bytes(f)[0] / 2**20, 2) for f in data_files(mine)}
            problems = synth.verify_state_dict(dest, args.seed, args.size, **_shape(args))
            dist.barrier()
            out.append({"case": f"{save}:{load}", "read": read, "requested": stats.bytes_read, "wall": wall,
                        "problems": problems[:5], "unique": synth.unique_bytes(dest), "by_file": by_file})
    return out


def main(argv=None) -> int:
    from pipeload.tools._world import run_world

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--world", type=int, default=4)
    p.add_argument("--size", type=float, default=53.0, help="state dict MB (53: ~100 KiB expert tensors)")
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--experts", type=int, default=24)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--cases", default=CASES, help=f"SAVE:LOAD,... (default {CASES})")
    p.add_argument("--repeats", type=int, default=1, help="loads per case (byte counts barely vary)")
    p.add_argument("--dir", default=None, help="where checkpoints are written (default: a temporary directory)")
    p.add_argument("--by-file", action="store_true", help="also print each rank's MiB read per file")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="pipeload-layout-bytes-", dir=args.dir) as d:
        res = run_world(_rank, args.world, args, d, timeout=1800, separate_hosts=True)
    rows = []
    for i, run in enumerate(res[0]):
        per_rank = [r[i] for r in res]
        unique = run["unique"]
        rows.append({"case": run["case"], "device_x": sum(r["read"] for r in per_rank) / unique,
                     "requested_x": sum(r["requested"] for r in per_rank) / unique,
                     "wall_s": max(r["wall"] for r in per_rank), "unique_mib": unique / 2**20,
                     "exact": not any(r["problems"] for r in per_rank),
                     "by_file_mib": [r["by_file"] for r in per_rank],
                     "problems": [p for r in per_rank for p in r["problems"]][:5]})
    if args.json:
        print(json.dumps(rows, indent=1))
    else:
        print(f"{'save:load':<18} {'device/unique':>13} {'requested':>9} {'wall s':>7}  values")
        for r in rows:
            print(f"{r['case']:<18} {r['device_x']:13.3f} {r['requested_x']:9.3f} {r['wall_s']:7.2f}  "
                  f"{'bit-exact' if r['exact'] else 'MISMATCH ' + '; '.join(r['problems'])}")
            for rank, files in enumerate(r["by_file_mib"] if args.by_file else []):
                print(f"    rank {rank}: " + ", ".join(f"{k} {v}" for k, v in files.items() if v))
        print(f"(unique {rows[0]['unique_mib']:.1f} MiB, {args.world} ranks, each its own copy, cache dropped)")
    return 0 if all(r["exact"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
