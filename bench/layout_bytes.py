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
every rank) or ``dpXtpY`` (``pipeload.tools.bench.config.layout_dims``), or ``fsdpXtpY``: FSDP2 over TP
on the same 2-D mesh, dp splitting each TP shard's rows as FSDP2 writes it (``_StridedShard(0, Y)`` over
``Shard(0)``, ``Shard(0)`` over ``Shard(1)`` or ``Replicate``; ``--cases fsdp`` runs five such cases). A
case is ``SAVE:LOAD``. Times: ``pipeload bench --save-layout LAYOUT --modes throttled``.

``--storage s3``: the same cases from ``s3://`` instead (a moto server on 127.0.0.1 behind
:class:`pipeload.tools.s3testing.FaultProxy`, one proxy port per rank, no faults): rank 0 uploads each
saved checkpoint, every rank loads it with ``part_size`` ``--part-mib``; reported are the body bytes
fetched (``LoadStats.bytes_fetched``, summed over the ranks) over the objects' bytes, and every GET the
proxy saw during the case (LIST, headers, metadata and data; per object with ``--by-file``) against
``ceil(bytes fetched / part size) + 2 x objects``.

``--pages``: the page model of part delivery. Each rank records the file span of every box it copies
(``ChunkReader.read_into``, wrapped in this script only); per page of each file, the ranks touching it
and the bytes each needs there. Printed: the pages the ranks touch, summed (the device bytes the model
predicts), the distinct pages (what each page read once, by one owner, would cost), the pages two or
more nodes touch, and what delivering would move: every non-owner's bytes of a shared page sent to it
by the page's owner (the rank needing most of it; ties to the lower rank), in bytes and in messages if
packed per (owner, receiver) pair — beside the bytes the load's broadcasts moved (``bytes_received``).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import shutil
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

CASES = "tp1:tp1,tp1:dp2tp2,tp1:tp4,tp4:dp2tp2,dp2tp2:tp1,dcp-tp1:dp2tp2"
FSDP_CASES = "fsdp2tp2:dp2tp2,dp2tp2:fsdp2tp2,tp1:fsdp2tp2,fsdp2tp2:tp4,tp4:fsdp2tp2"


def _layout(name: str, world: int) -> tuple[int, int, bool]:
    """(dp, tp, fsdp) of a layout name: ``tpN``, ``dpXtpY`` or ``fsdpXtpY``."""
    from pipeload.tools.bench.config import layout_dims

    fsdp = name.startswith("fsdp")
    return (*layout_dims(name[2:] if fsdp else name, world), fsdp)


def _save_all(rank: int, world: int, args, root: str, saves: list[str]) -> None:
    """Every save layout written once, then copied per rank (rank ``r`` reads ``root/NAME-r``)."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    import pipeload
    from pipeload.tools import synth

    for name in saves:
        via_dcp = name.startswith("dcp-")
        dp, tp, fsdp = _layout(name[4:] if via_dcp else name, world)
        sd = synth.build_state_dict(synth.make_mesh(world, tp, dp), args.seed, args.size, fsdp=fsdp,
                                    **_shape(args))
        where = os.path.join(root, name)
        if via_dcp:
            dcp.save(sd, checkpoint_id=where)
        else:
            pipeload.save(sd, where)
        dist.barrier()
    if args.storage == "s3":
        if rank == 0:
            from pipeload.tools.s3testing import LocalS3

            for name in saves:
                LocalS3(args.port).upload(os.path.join(root, name), "layouts", name)
        dist.barrier()
        return
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
    from pipeload.tools.bench.system import data_files, drop_cache, proc_io, resident_bytes

    cases = [tuple(c.split(":")) for c in args.cases.split(",")]
    _save_all(rank, world, args, root, sorted({s for s, _ in cases}))
    out = []
    for save, load in cases:
        dp, tp, fsdp = _layout(load, world)
        dest = synth.build_state_dict(synth.make_mesh(world, tp, dp), args.seed, args.size, fill=False,
                                      fsdp=fsdp, **_shape(args))
        if args.storage == "s3":
            out += _s3_case(rank, args, dest, save, load)
            continue
        mine = os.path.join(root, f"{rank}", save)
        for _ in range(args.repeats):
            synth.zero_(dest)
            drop_cache(data_files(mine))
            dist.barrier()
            spans: list = []
            io0, t0 = proc_io()["read_bytes"], time.perf_counter()
            with _recording(spans if args.pages else None):
                stats = pipeload.load(dest, mine, reuse_plan=False)
            wall, read = time.perf_counter() - t0, proc_io()["read_bytes"] - io0
            # this rank's copy was dropped before the load: what is cached now is what it read
            by_file = {os.path.basename(f): round(resident_bytes(f)[0] / 2**20, 2) for f in data_files(mine)}
            problems = synth.verify_state_dict(dest, args.seed, args.size, **_shape(args))
            dist.barrier()
            out.append({"case": f"{save}:{load}", "read": read, "requested": stats.bytes_read, "wall": wall,
                        "problems": problems[:5], "unique": synth.unique_bytes(dest), "by_file": by_file,
                        "spans": spans, "received": stats.bytes_received})
    return out


@contextlib.contextmanager
def _recording(spans: list | None):
    """While active, every box this process copies out of a file appends (file, first byte, end) to
    ``spans`` (None: nothing is wrapped)."""
    if spans is None:
        yield
        return
    from pipeload.io.reader import ChunkReader

    real = ChunkReader.read_into

    def read_into(self, item, out, advise=True, file=None):
        f = file if file is not None else self.file(item.file)
        if item.nbytes and hasattr(f, "entry"):
            lo, hi = self._span(f, item)
            spans.append((item.file, lo, hi))
        return real(self, item, out, advise, file)

    ChunkReader.read_into = read_into
    try:
        yield
    finally:
        ChunkReader.read_into = real


def page_model(per_rank: list[list], page: int = 4096) -> dict:
    """The page model of part delivery (module docstring) from each rank's spans. ``parts``: the bytes
    moved if instead each non-owner's whole span (its part) touching a shared page were delivered."""
    need: dict[tuple[str, int], dict[int, int]] = {}  # (file, page) -> rank -> bytes it needs there
    span_of: dict[tuple[str, int, int], list[tuple[int, int]]] = {}  # (file, page, rank) -> its spans there
    for rank, spans in enumerate(per_rank):
        for name, lo, hi in spans:
            for p in range(lo // page, (hi - 1) // page + 1):
                got = need.setdefault((name, p), {})
                got[rank] = got.get(rank, 0) + min(hi, (p + 1) * page) - max(lo, p * page)
                span_of.setdefault((name, p, rank), []).append((lo, hi))
    touched = sum(len(r) for r in need.values())
    shared = wire = 0
    pairs, parts = set(), set()
    for (name, p), ranks in need.items():
        if len(ranks) < 2:
            continue
        shared += 1
        owner = min(ranks, key=lambda r: (-ranks[r], r))
        for r, n in ranks.items():
            if r != owner:
                wire += n
                pairs.add((owner, r))
                parts.update((name, r, *sp) for sp in span_of[name, p, r])
    return {"touched": touched * page, "distinct": len(need) * page, "shared_pages": shared,
            "delivered": wire, "pairs": len(pairs), "parts": sum(hi - lo for _, _, lo, hi in parts)}


def _s3_case(rank: int, args, dest: dict, save: str, load: str) -> list[dict]:
    """One case from ``s3://layouts/SAVE``: each repeat's bytes fetched, requests and time window."""
    import torch.distributed as dist

    import pipeload
    from pipeload.tools import synth
    from pipeload.tools.s3testing import LocalS3

    opts = LocalS3.options(args.links[rank], part_size=int(args.part_mib * 2**20))
    out = []
    for _ in range(args.repeats):
        synth.zero_(dest)
        dist.barrier()
        t0, start = time.perf_counter(), time.time()
        stats = pipeload.load(dest, f"s3://layouts/{save}", storage_options=opts, reuse_plan=False)
        wall, end = time.perf_counter() - t0, time.time()
        problems = synth.verify_state_dict(dest, args.seed, args.size, **_shape(args))
        dist.barrier()
        out.append({"case": f"{save}:{load}", "read": stats.bytes_fetched, "requested": stats.bytes_read,
                    "wall": wall, "start": start, "end": end, "requests": stats.requests,
                    "problems": problems[:5], "unique": synth.unique_bytes(dest), "by_file": {}})
    return out


def _s3_rows(rows: list[dict], res: list, root: str, proxy, part: int) -> None:
    """Each row's S3 figures: fetched over the objects' bytes, the GETs of its window, the bound."""
    for i, row in enumerate(rows):
        save = row["case"].split(":")[0]
        names = [n for n in os.listdir(os.path.join(root, save)) if os.path.isfile(os.path.join(root, save, n))]
        objects = sum(os.path.getsize(os.path.join(root, save, n)) for n in names)
        lo, hi = min(r[i]["start"] for r in res), max(r[i]["end"] for r in res)
        gets = [g for g in proxy.requests("GET") if lo <= g.start <= hi]  # the case's: LIST, headers, data
        fetched = sum(r[i]["read"] for r in res)
        by: dict[str, int] = {}  # object (or LIST) -> GETs of the case, over the ranks
        for g in gets:
            name = g.path.rsplit("/", 1)[-1] if f"/{save}/" in g.path else "LIST"
            kind = "header" if (g.range or "").startswith("bytes=0-") else "data"
            by[f"{name} {kind}"] = by.get(f"{name} {kind}", 0) + 1
        row.update(fetched_x=fetched / objects, gets=len(gets), objects=len(names), gets_by=by,
                   get_bound=math.ceil(fetched / part) + 2 * len(names),
                   requests=sum(r[i]["requests"] for r in res))


def _print_s3(rows: list[dict], args) -> None:
    print(f"{'save:load':<18} {'fetched/objects':>15} {'GETs':>5} {'bound':>5} {'requests':>8} {'wall s':>7}  values")
    for r in rows:
        print(f"{r['case']:<18} {r['fetched_x']:15.4f} {r['gets']:5d} {r['get_bound']:5d} {r['requests']:8d} "
              f"{r['wall_s']:7.2f}  {'bit-exact' if r['exact'] else 'MISMATCH ' + '; '.join(r['problems'])}")
        if args.by_file:
            print("    GETs: " + ", ".join(f"{k} {v}" for k, v in sorted(r["gets_by"].items())))
    print(f"(unique {rows[0]['unique_mib']:.1f} MiB, {args.world} ranks, s3:// through moto, part size "
          f"{args.part_mib:g} MiB; bound = ceil(fetched / part size) + 2 x objects)")


def main(argv=None) -> int:
    from pipeload.tools._world import run_world

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--world", type=int, default=4)
    p.add_argument("--size", type=float, default=53.0, help="state dict MB (53: ~100 KiB expert tensors)")
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--experts", type=int, default=24)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--cases", default=CASES, help=f"SAVE:LOAD,... (default {CASES}; 'fsdp': {FSDP_CASES})")
    p.add_argument("--repeats", type=int, default=1, help="loads per case (byte counts barely vary)")
    p.add_argument("--dir", default=None, help="where checkpoints are written (default: a temporary directory)")
    p.add_argument("--by-file", action="store_true", help="also print each rank's MiB read per file")
    p.add_argument("--json", action="store_true")
    p.add_argument("--storage", choices=("file", "s3"), default="file",
                   help="s3: load from a local moto server (bytes fetched and GETs instead of device bytes)")
    p.add_argument("--part-mib", type=float, default=8.0, help="s3: part size of ranged GETs, MiB (default 8)")
    p.add_argument("--pages", action="store_true", help="also the page model of part delivery (docstring)")
    args = p.parse_args(argv)
    args.cases = FSDP_CASES if args.cases == "fsdp" else args.cases
    with tempfile.TemporaryDirectory(prefix="pipeload-layout-bytes-", dir=args.dir) as d, \
            contextlib.ExitStack() as stack:
        proxy = None
        if args.storage == "s3":
            from pipeload.tools.s3testing import FaultProxy, Faults, LocalS3

            server = stack.enter_context(LocalS3())
            server.bucket("layouts")
            proxy = stack.enter_context(FaultProxy(server.port, links=args.world, faults=Faults(rules=[])))
            args.port, args.links = server.port, [proxy.url(i) for i in range(args.world)]
        res = run_world(_rank, args.world, args, d, timeout=1800, separate_hosts=True)
        rows = _rows(res)
        if proxy is not None:
            _s3_rows(rows, res, d, proxy, int(args.part_mib * 2**20))
    if args.json:
        print(json.dumps(rows, indent=1))
    elif args.storage == "s3":
        _print_s3(rows, args)
    else:
        _print(rows, args)
    return 0 if all(r["exact"] for r in rows) else 1


def _rows(res: list) -> list[dict]:
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
        if any(r.get("spans") for r in per_rank):
            m = page_model([r["spans"] for r in per_rank])
            rows[-1]["pages"] = {**{k: m[k] / unique for k in ("touched", "distinct", "delivered", "parts")},
                                 "shared_pages": m["shared_pages"], "pairs": m["pairs"],
                                 "received": sum(r["received"] for r in per_rank) / unique}
    return rows


def _print(rows: list[dict], args) -> None:
    print(f"{'save:load':<18} {'device/unique':>13} {'requested':>9} {'wall s':>7}  values")
    for r in rows:
        print(f"{r['case']:<18} {r['device_x']:13.3f} {r['requested_x']:9.3f} {r['wall_s']:7.2f}  "
              f"{'bit-exact' if r['exact'] else 'MISMATCH ' + '; '.join(r['problems'])}")
        for rank, files in enumerate(r["by_file_mib"] if args.by_file else []):
            print(f"    rank {rank}: " + ", ".join(f"{k} {v}" for k, v in files.items() if v))
        if "pages" in r:
            m = r["pages"]
            print(f"    pages: touched {m['touched']:.3f}, distinct {m['distinct']:.3f} (x unique), "
                  f"{m['shared_pages']} pages on 2+ nodes; delivering them moves {m['delivered']:.4f} x unique "
                  f"in {m['pairs']} (owner, receiver) pairs ({m['parts']:.3f} if whole parts), beside "
                  f"{m['received']:.3f} the broadcasts moved")
    print(f"(unique {rows[0]['unique_mib']:.1f} MiB, {args.world} ranks, each its own copy, cache dropped)")


if __name__ == "__main__":
    sys.exit(main())
