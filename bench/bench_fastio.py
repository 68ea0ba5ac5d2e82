"""Benchmark of pipeload.io._fastio against safetensors and numpy, measured side by side in one run.

    /work/venv/bin/python bench/bench_fastio.py [--quick]

Prints one table. Every number is the median of several repetitions; the two sides of a ratio are
measured alternately in the same loop, so drift on the machine hits both. Files go to /tmp and are
deleted at the end. About a minute on a 2-core machine (--quick: smaller sizes, for a smoke run).
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import struct
import sys
import tempfile
import time

import numpy as np
import torch
from safetensors import safe_open
from safetensors.numpy import save_file

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from pipeload.io._fastio import FileCache, SafetensorsFile  # noqa: E402

MiB = 1 << 20
GiB = 1 << 30


def median_alternating(fns, reps):
    """Run each fn once per round, `reps` rounds; the median time of each."""
    times = [[] for _ in fns]
    for _ in range(reps):
        for i, fn in enumerate(fns):
            t0 = time.perf_counter()
            fn()
            times[i].append(time.perf_counter() - t0)
    return [statistics.median(t) for t in times]


def write_raw(path, name, dtype, numel, itemsize, fill_mib=64):
    """A one-tensor file of numel*itemsize bytes, written in chunks (never the whole in memory)."""
    header = ('{"%s":{"dtype":"%s","shape":[%d],"data_offsets":[0,%d]}}' % (name, dtype, numel, numel * itemsize)).encode()
    header += b" " * (-len(header) % 8)
    rng = np.random.default_rng(0)
    chunk = rng.integers(0, 256, fill_mib * MiB, dtype=np.uint8).tobytes()
    left = numel * itemsize
    with open(path, "wb") as fh:
        fh.write(struct.pack("<Q", len(header)) + header)
        while left:
            n = min(left, len(chunk))
            fh.write(chunk[:n])
            left -= n
        fh.flush()
        os.fsync(fh.fileno())      # dirty pages cannot be dropped from the cache


def drop_cache(path):
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def read_bytes():
    with open("/proc/self/io") as fh:
        for line in fh:
            if line.startswith("read_bytes:"):
                return int(line.split()[1])
    return 0


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="small sizes: a smoke run, not a measurement")
    args = ap.parse_args()
    copy_bytes = 64 * MiB if args.quick else GiB
    cold_bytes = 32 * MiB if args.quick else 256 * MiB
    rows = []
    tmp = tempfile.mkdtemp(prefix="pipeload-bench-", dir="/tmp")
    paths = []

    def path(name):
        p = os.path.join(tmp, name)
        paths.append(p)
        return p

    try:
        # ---- 1. header parse + index, 9,000 tensors --------------------------------------------
        n = 9000
        many = path("many.safetensors")
        save_file({f"model.layers.{i // 90}.mlp.experts.{i % 90}.down_proj.weight": np.zeros((2, 2), np.float16)
                   for i in range(n)}, many, metadata={"format": "pt"})

        def ours_open():
            with SafetensorsFile(many) as f:
                f.keys()

        def st_open():
            with safe_open(many, framework="pt") as f:
                f.keys()

        for _ in range(3):
            ours_open(), st_open()
        t_ours, t_st = median_alternating([ours_open, st_open], 31)
        hlen = SafetensorsFile(many).data_offset - 8
        rows.append((f"header parse + index, {n} tensors ({hlen / MiB:.2f} MiB header)",
                     f"{t_ours * 1e3:.2f} ms", f"{t_st * 1e3:.2f} ms safe_open+keys()",
                     f"{t_st / t_ours:.1f}x faster", ">= 3x", t_st / t_ours >= 3))

        # ---- 2. FileCache: re-open of a cached file; cold opens --------------------------------
        small = path("small.safetensors")
        save_file({"w": np.zeros(16, np.float32)}, small)
        cache = FileCache(8)
        cache.get(small)
        batch = 1000

        def hits():
            for _ in range(batch):
                cache.get(small)

        (t_hit,) = median_alternating([hits], 21)
        t_hit /= batch
        rows.append(("FileCache.get, file already cached", f"{t_hit * 1e6:.2f} us", "", "", "<= 50 us",
                     t_hit <= 50e-6))
        t_cold_small, t_cold_many = median_alternating(
            [lambda: SafetensorsFile(small).close(), lambda: SafetensorsFile(many).close()], 31)
        rows.append(("cold open, 1 tensor (open+fstat+mmap+parse)", f"{t_cold_small * 1e6:.1f} us", "", "", "report", None))
        rows.append((f"cold open, {n} tensors", f"{t_cold_many * 1e3:.2f} ms", "", "", "report", None))

        # ---- 3. copy a 1 GiB tensor out of a warm file ----------------------------------------
        big = path("big.safetensors")
        write_raw(big, "w", "F32", copy_bytes // 4, 4)
        dst = torch.empty(copy_bytes, dtype=torch.uint8)
        src_np = np.random.default_rng(1).integers(0, 256, copy_bytes, dtype=np.uint8)
        dst_np = np.empty_like(src_np)
        dst_np.fill(0)
        dst.fill_(0)
        held = SafetensorsFile(big)
        held_t = torch.frombuffer(held.buffer("w"), dtype=torch.uint8)
        held_t.sum()                    # warm: page cache and this mapping's page tables

        def copy_fresh_map():
            with SafetensorsFile(big) as f:
                dst.copy_(torch.frombuffer(f.buffer("w"), dtype=torch.uint8))

        def copy_held_map():
            dst.copy_(held_t)

        dst_as_np = dst.numpy()         # the same memory as dst

        def memcpy_fresh_map():
            with SafetensorsFile(big) as f:
                np.copyto(dst_as_np, np.frombuffer(f.buffer("w"), dtype=np.uint8))

        def np_memcpy():
            np.copyto(dst_np, src_np)

        def torch_memcpy():
            dst.copy_(torch.from_numpy(src_np))

        fns = (copy_fresh_map, copy_held_map, memcpy_fresh_map, np_memcpy, torch_memcpy)
        for fn in fns:
            fn()
        t_fresh, t_held, t_mfresh, t_np, t_torch = median_alternating(fns, 9)
        gbs = lambda t: copy_bytes / t / GiB  # noqa: E731
        size_s = f"{copy_bytes // MiB} MiB" if copy_bytes < GiB else f"{copy_bytes // GiB} GiB"
        np_s = f"{gbs(t_np):.2f} GiB/s np.copyto in memory"
        rows.append((f"copy {size_s} out of a warm file: frombuffer + copy_, new mapping",
                     f"{gbs(t_fresh):.2f} GiB/s", np_s, f"{t_np / t_fresh:.2f}x", ">= 0.8x", t_np / t_fresh >= 0.8))
        rows.append(("  same, mapping already faulted in", f"{gbs(t_held):.2f} GiB/s", np_s,
                     f"{t_np / t_held:.2f}x", ">= 0.8x", t_np / t_held >= 0.8))
        rows.append(("  same bytes by memcpy: np.copyto(dst.numpy(), np.frombuffer(view))",
                     f"{gbs(t_mfresh):.2f} GiB/s", np_s, f"{t_np / t_mfresh:.2f}x", "report", None))
        rows.append(("  ceiling of copy_: torch copy_ of in-memory data", f"{gbs(t_torch):.2f} GiB/s", np_s,
                     f"{t_np / t_torch:.2f}x", f"report ({torch.get_num_threads()} torch threads)", None))
        del held_t
        held.close()
        del src_np, dst_np
        gc.collect()

        # ---- 4. madvise hints on cold reads -------------------------------------------------------
        cold = path("cold.safetensors")
        write_raw(cold, "w", "U8", cold_bytes, 1)
        cdst = torch.empty(cold_bytes, dtype=torch.uint8)
        results = {}
        for rep in range(3):
            for advice in ("normal", "sequential", "random"):
                drop_cache(cold)
                rb0 = read_bytes()
                t0 = time.perf_counter()
                with SafetensorsFile(cold) as f:
                    _, _, s, e = f.entry("w")
                    f.advise(advice, s, e)
                    cdst.copy_(torch.frombuffer(f.buffer("w"), dtype=torch.uint8))
                dt = time.perf_counter() - t0
                results.setdefault(advice, []).append((dt, read_bytes() - rb0))
        base = statistics.median(t for t, _ in results["normal"])
        for advice in ("normal", "sequential", "random"):
            t = statistics.median(x for x, _ in results[advice])
            rb = statistics.median(b for _, b in results[advice])
            rows.append((f"cold sequential read {cold_bytes // MiB} MiB, advise {advice!r}",
                         f"{cold_bytes / t / MiB:.0f} MiB/s", f"{rb / MiB:.0f} MiB read from device",
                         f"{base / t:.2f}x of 'normal'", "report", None))
        # scattered reads: one byte per MiB, the pattern of a rank that needs every 256th page
        results = {}
        for rep in range(3):
            for advice in ("normal", "random"):
                drop_cache(cold)
                rb0 = read_bytes()
                t0 = time.perf_counter()
                with SafetensorsFile(cold) as f:
                    f.advise(advice)
                    buf = f.buffer("w")
                    total = sum(buf[i] for i in range(0, cold_bytes, MiB))
                    del buf
                dt = time.perf_counter() - t0
                results.setdefault(advice, []).append((dt, read_bytes() - rb0))
        for advice in ("normal", "random"):
            t = statistics.median(x for x, _ in results[advice])
            rb = statistics.median(b for _, b in results[advice])
            rows.append((f"cold scattered read (1 byte per MiB), advise {advice!r}", f"{t * 1e3:.1f} ms",
                         f"{rb / MiB:.1f} MiB read from device", "", "report", None))
        del total
    finally:
        for p in paths:
            try:
                os.unlink(p)
            except FileNotFoundError:
                pass
        os.rmdir(tmp)

    w0 = max(len(r[0]) for r in rows)
    w1 = max(len(r[1]) for r in rows)
    w2 = max(len(r[2]) for r in rows)
    w3 = max(len(r[3]) for r in rows)
    print(f"pipeload.io._fastio benchmark ({os.cpu_count()} CPUs, torch {torch.__version__}, "
          f"medians of repeated runs{', QUICK sizes' if args.quick else ''})")
    print(f"{'measurement':<{w0}}  {'pipeload':>{w1}}  {'baseline':<{w2}}  {'ratio':<{w3}}  target")
    print("-" * (w0 + w1 + w2 + w3 + 20))
    for name, ours, ref, ratio, target, ok in rows:
        verdict = "" if ok is None else ("  ok" if ok else "  MISSED")
        print(f"{name:<{w0}}  {ours:>{w1}}  {ref:<{w2}}  {ratio:<{w3}}  {target}{verdict}")


if __name__ == "__main__":
    main()
