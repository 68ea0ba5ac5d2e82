"""The failure model (docs/ARCHITECTURE.md, "Failure model"), one fault at a time, with real processes.

Faults: concurrent loads/saves on one group or directory, a file truncated while it is copied, hostile
checkpoint files (FIFO, /dev/zero, links leaving the directory, compressed object records, malformed
metadata) and ranks killed mid-load or mid-restore from a memory tier. Each case asserts a PipeloadError
on every surviving rank, promptly, and that nothing is reported loaded or committed.
"""

from __future__ import annotations

import asyncio
import io
import json
import multiprocessing as mp
import os
import re
import queue
import signal
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
import zipfile

import pytest
import torch
import torch.distributed as dist

import pipeload
from pipeload.tools import inspect as pinspect
from pipeload.io._fastio import SafetensorsFile
from pipeload.tools._world import _rank_main, run_world
from pipeload.errors import CheckpointFormatError, DistributedError, PipeloadError, ReadError
from pipeload.formats.metadata import METADATA_FILE, Metadata, read_metadata
from pipeload.io.reader import copy_box
from pipeload.save import saver

BIG = 200 << 20  # bytes of the tensor truncated under the reader


def _big_checkpoint(path: str, nbytes: int = BIG) -> str:
    """A checkpoint of one zero tensor; zeros, so re-extending the truncated file restores it exactly."""
    pipeload.save({"w": torch.zeros(nbytes // 4)}, path)
    return next(os.path.join(path, f) for f in os.listdir(path) if f.startswith("data-"))


def _truncate_when_copy_starts(dst: torch.Tensor, data_file: str, done: threading.Event) -> threading.Thread:
    """Truncate ``data_file`` to its header the moment ``dst`` starts being overwritten.

    Element 4096, not 0: a large memcpy stores its first few vectors last.
    """
    keep = SafetensorsFile(data_file).data_offset

    def watch():
        while not done.is_set():
            if dst[4096].item() == 0.0:
                os.truncate(data_file, keep)
                return
            time.sleep(0.0002)

    t = threading.Thread(target=watch, daemon=True)
    t.start()
    return t


# -- SIGBUS: a file truncated under the copy -----------------------------------------------------------


def test_guarded_copy_turns_sigbus_into_read_error(tmp_path):
    """Deterministic: the mapping is made, then the file shrinks, then the copy touches missing pages."""
    data_file = _big_checkpoint(str(tmp_path), 8 << 20)
    f = SafetensorsFile(data_file)
    src = torch.frombuffer(f.buffer("w"), dtype=torch.uint8)
    os.truncate(data_file, f.data_offset + 4096)
    dst = torch.empty_like(src)
    with pytest.raises(ReadError, match="bus error"):
        copy_box(dst, src, data_file)
    # strided: every other row of a 2-D view
    with pytest.raises(ReadError, match="bus error"):
        copy_box(dst.view(1024, -1)[::2], src.view(1024, -1)[::2], data_file)
    # the thread still works, and copies below the cut succeed
    copy_box(dst[:4096], src[:4096], data_file)
    # the reader's one-call path (SafetensorsFile.copy_box) names the tensor: a contiguous box is pread()
    # (the cut file is a short read), a strided one copied from the mapping under the guard
    n = src.numel() // 4  # float32 elements
    with pytest.raises(ReadError, match="file ended while tensor 'w' was read"):
        f.copy_box("w", "F32", (n,), (0,), (n,), dst.data_ptr(), (0,), (1,), (n,))
    with pytest.raises(ReadError, match="bus error while copying tensor 'w'"):  # into every other element
        f.copy_box("w", "F32", (n,), (0,), (n // 2,), dst.data_ptr(), (0,), (2,), (n // 2,))
    assert f.copy_box("w", "F32", (n,), (0,), (1024,), dst.data_ptr(), (0,), (1,), (n,)) == 4096
    f.close()


_TRUNCATE_CHILD = textwrap.dedent(
    """
    import os, sys, threading, torch, pipeload
    sys.path.insert(0, {tests!r})
    from test_faults import _truncate_when_copy_starts
    from pipeload.errors import PipeloadError
    ckpt, data_file, size = {ckpt!r}, {data_file!r}, {size}
    outcomes = []
    for attempt in range(6):
        if attempt == 3:  # the same through the mapping: a strided or small box's path, SIGBUS-guarded
            pipeload.io._fastio._set_pread_min(1 << 62)
        os.truncate(data_file, size)  # zeros again: the checkpoint is whole
        dst = {{"w": torch.ones({n})}}
        done = threading.Event()
        t = _truncate_when_copy_starts(dst["w"], data_file, done)
        try:
            pipeload.load(dst, ckpt)
            # the cut came after the last byte was read (the watcher was not scheduled in time): the
            # load must then hold the whole checkpoint (zeros), never a part of it
            outcomes.append("loaded" if bool((dst["w"] == 0).all()) else "loaded wrong data")
        except PipeloadError as e:
            outcomes.append(str(e))
        done.set()
        t.join()
    print(repr(outcomes))
    """
)


def test_truncated_during_load_raises_not_sigbus(tmp_path):
    """A real process loads a 200 MiB chunk while the file is cut: a PipeloadError, never rc -7.

    Read with pread() (a contiguous box: the cut is a short read), then through the mapping (the cut
    is a SIGBUS the guard turns into a ReadError)."""
    data_file = _big_checkpoint(str(tmp_path))
    size = os.path.getsize(data_file)
    code = _TRUNCATE_CHILD.format(tests=os.path.dirname(__file__), ckpt=str(tmp_path), data_file=data_file,
                                  size=size, n=BIG // 4)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, f"rc {r.returncode}\n{r.stderr[-2000:]}"
    outcomes = eval(r.stdout.strip().splitlines()[-1])  # noqa: S307 - our own child's repr
    assert "loaded wrong data" not in outcomes, outcomes
    assert any("was truncated after it was opened" in o for o in outcomes[:3]), outcomes
    assert any("bus error" in o for o in outcomes[3:]), outcomes


# -- a slow device -----------------------------------------------------------------------------------------

_SLOW_OPEN_CHILD = textwrap.dedent(
    """
    import os, subprocess, sys, threading, time
    import numpy as np
    from safetensors.numpy import save_file
    from pipeload.tools import bench
    from pipeload.io._fastio import SafetensorsFile
    d = {d!r}
    path, big = os.path.join(d, "t.safetensors"), os.path.join(d, "big.bin")
    save_file({{f"t{{i}}": np.zeros(256, np.float32) for i in range(2000)}}, path)  # a 100 KiB header
    with open(big, "wb") as f:
        f.write(os.urandom(24 << 20))
    for p in (path, big):
        fd = os.open(p, os.O_RDONLY); os.fsync(fd); os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED); os.close(fd)
    th = bench.setup_throttle(d, 8)
    if not th.get("ok"):
        print("SKIP", th.get("reason")); sys.exit(0)
    try:
        bench._join_cgroup(th["procs"])
        # another process fills the device's queue: 24 MiB at 8 MiB/s, ahead of the header read
        hog = subprocess.Popen([sys.executable, "-c", "import mmap, os; fd = os.open(%r, os.O_RDONLY); "
                                "m = mmap.mmap(fd, 0, prot=mmap.PROT_READ); "
                                "[m.madvise(mmap.MADV_WILLNEED, o, 1 << 20) for o in range(0, len(m), 1 << 20)]; "
                                "import time; time.sleep(30)" % big])
        time.sleep(0.5)
        gaps, stop = [0.0], []
        def spin():
            last = time.perf_counter()
            while not stop:
                sum(range(200))
                now = time.perf_counter(); gaps.append(now - last); last = now
        t = threading.Thread(target=spin); t.start()
        time.sleep(0.05)
        a = time.perf_counter()
        f = SafetensorsFile(path)
        opened = time.perf_counter() - a
        stop.append(1); t.join(); hog.kill()
        assert len(f) == 2000
        print(repr((opened, max(gaps))))
    finally:
        bench._join_cgroup(th["leave"]); bench.teardown_throttle(th)
    """
)


def test_opening_a_file_behind_a_busy_device_does_not_stall_other_threads(tmp_path):
    """The header is read without the GIL: while a file opens behind a queue of other reads (a
    throttled device, another process's 24 MiB ahead of it), the process's other threads keep running.
    Real processes and a real cgroup read limit; skipped where no cgroup can be written."""
    r = subprocess.run([sys.executable, "-c", _SLOW_OPEN_CHILD.format(d=str(tmp_path))], capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    out = r.stdout.strip().splitlines()[-1]
    if out.startswith("SKIP"):
        pytest.skip(f"no writable cgroup to throttle reads: {out[5:]}")
    opened, gap = eval(out)  # noqa: S307 - our own child's repr
    assert opened > 0.5, f"the open did not wait behind the queue ({opened:.2f} s): the test proves nothing"
    assert gap < 0.2, f"another thread stalled {gap:.2f} s while a file opened in {opened:.2f} s"


# -- hostile files ---------------------------------------------------------------------------------------


def _three_ways(path):
    """load, inspect and verify of ``path``: each must raise a PipeloadError or report a problem."""
    with pytest.raises(PipeloadError) as e1:
        pipeload.load({"a": torch.zeros(2)}, path)
    with pytest.raises(PipeloadError) as e2:
        pinspect.inspect_checkpoint(path)
    problems = pinspect.verify_checkpoint(path)
    assert problems, "verify reported an intact checkpoint"
    return str(e1.value), str(e2.value), problems


@pytest.mark.timeout(30)
def test_metadata_fifo_and_dev_zero_refused(tmp_path):
    fifo = tmp_path / "fifo"
    fifo.mkdir()
    os.mkfifo(fifo / METADATA_FILE)
    for msg in _three_ways(fifo)[:2]:
        assert "not a regular file" in msg
    zero = tmp_path / "zero"
    zero.mkdir()
    os.symlink("/dev/zero", zero / METADATA_FILE)
    for msg in _three_ways(zero)[:2]:
        assert "not a regular file" in msg


def test_metadata_size_limit(tmp_path, monkeypatch):
    pipeload.save({"a": torch.ones(2)}, tmp_path)
    monkeypatch.setattr(pipeload.formats.metadata, "MAX_METADATA_BYTES", 100)
    with pytest.raises(CheckpointFormatError, match="over the 100-byte limit"):
        read_metadata(tmp_path)


def test_links_leaving_the_checkpoint_refused(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    pipeload.save({"a": torch.ones(2)}, a)
    pipeload.save({"a": torch.full((2,), 7.0)}, b)
    [fa] = [f for f in os.listdir(a) if f.startswith("data-")]
    [fb] = [f for f in os.listdir(b) if f.startswith("data-")]
    os.unlink(a / fa)
    os.symlink(b / fb, a / fa)  # another checkpoint's file under this one's name
    dst = {"a": torch.zeros(2)}
    with pytest.raises(PipeloadError, match="resolves outside the checkpoint directory"):
        pipeload.load(dst, a)
    assert torch.equal(dst["a"], torch.zeros(2))
    assert any("outside the checkpoint directory" in p for p in pinspect.verify_checkpoint(a))
    # a link inside the directory is fine
    os.unlink(a / fa)
    os.rename(b / fb, a / "real.bin")
    os.symlink("real.bin", a / fa)
    dst = {"a": torch.zeros(2)}
    pipeload.load(dst, a)
    assert torch.equal(dst["a"], torch.full((2,), 7.0))
    # .metadata itself linked from elsewhere
    c = tmp_path / "c"
    c.mkdir()
    os.symlink(a / METADATA_FILE, c / METADATA_FILE)
    with pytest.raises(PipeloadError, match="resolves outside"):
        pipeload.load({"a": torch.zeros(2)}, c)


def test_header_errors_never_echo_file_content(tmp_path):
    pipeload.save({"a": torch.ones(2)}, tmp_path)
    [name] = [f for f in os.listdir(tmp_path) if f.startswith("data-")]
    (tmp_path / name).write_bytes(b"HUNTER2!" + b"x" * 100)  # not safetensors: its first bytes are text
    with pytest.raises(PipeloadError) as e:
        pipeload.load({"a": torch.zeros(2)}, tmp_path)
    value = int.from_bytes(b"HUNTER2!", "little")
    assert "HUNTER2" not in str(e.value) and str(value) not in str(e.value)
    for p in pinspect.verify_checkpoint(tmp_path):
        assert "HUNTER2" not in p and str(value) not in p


def _deflated_object_checkpoint(path) -> None:
    """Rewrite the only object record of a fresh checkpoint as a DEFLATE zip of ~16 MiB of zeros."""
    pipeload.save({"obj": "hello"}, path)
    md = read_metadata(path)
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", compression=zipfile.ZIP_DEFLATED) as z:
        z.writestr("archive/data.pkl", b"\x00" * (16 << 20))
    data = buf.getvalue()
    from pipeload.io.checksum import checksum
    from pipeload.save.saver import _write_file

    o = md.objects["obj"]
    sums = _write_file(os.path.join(path, o.file), md.save_id, [(o.key, "U8", (len(data),), data)])
    md.objects["obj"] = type(o)(o.file, o.key, len(data), checksum(data))
    assert sums[o.key] == checksum(data)
    with open(os.path.join(path, METADATA_FILE), "w") as f:
        f.write(md.to_json())


def test_compressed_object_records_refused(tmp_path):
    _deflated_object_checkpoint(tmp_path)
    sd = {"obj": ""}
    with pytest.raises(PipeloadError, match="compressed"):
        pipeload.load(sd, tmp_path)
    assert sd["obj"] == ""
    assert any("compressed" in p for p in pinspect.verify_checkpoint(tmp_path))


def _edit_metadata(path, fn) -> None:
    p = os.path.join(path, METADATA_FILE)
    with open(p) as f:
        doc = json.load(f)
    fn(doc)
    with open(p, "w") as f:
        json.dump(doc, f)


def test_format_2_tensor_table_faults(tmp_path):
    """The format-2 tensor table (names, dtypes, ranks) is checked in whole-list passes: each fault is
    still refused with its own message, a bad dtype naming its tensor."""
    pipeload.save({"a": torch.ones(2, 3), "b": torch.ones(4), "c": torch.ones(1, 1, 1)}, tmp_path)
    good = open(os.path.join(tmp_path, METADATA_FILE)).read()

    def table(doc):
        return doc["tensors"]

    cases = [
        (lambda d: table(d)["names"].reverse(), "sorted and unique"),
        (lambda d: table(d)["names"].__setitem__(1, "a"), "sorted and unique"),
        (lambda d: table(d)["dtypes"].__setitem__(1, "F99"), "tensor 'b': unsupported dtype 'F99'"),
        (lambda d: table(d)["dtypes"].__setitem__(2, ["F32"]), "tensor 'c': unsupported dtype"),
        (lambda d: table(d)["ndims"].__setitem__(0, -1), "equal length"),
        (lambda d: table(d)["ndims"].__setitem__(0, 65), "equal length"),
        (lambda d: table(d)["ndims"].__setitem__(0, True), "equal length"),
        (lambda d: table(d)["ndims"].__setitem__(0, "2"), "equal length"),
        (lambda d: table(d)["names"].__setitem__(0, 7), "equal length"),
        (lambda d: table(d)["dtypes"].pop(), "equal length"),
    ]
    for edit, needle in cases:
        with open(os.path.join(tmp_path, METADATA_FILE), "w") as f:
            f.write(good)
        _edit_metadata(tmp_path, edit)
        with pytest.raises(CheckpointFormatError, match=re.escape(needle)):
            read_metadata(tmp_path)
    with open(os.path.join(tmp_path, METADATA_FILE), "w") as f:
        f.write(good)
    assert sorted(read_metadata(tmp_path).tensors) == ["a", "b", "c"]


def test_small_metadata_faults(tmp_path):
    from test_metadata_fuzz import as_format_1

    pipeload.save({"a": torch.ones(2, 3)}, tmp_path)
    as_format_1(tmp_path)  # these faults are of format 1's chunk entries
    good = open(os.path.join(tmp_path, METADATA_FILE)).read()

    def chunk(doc):
        return doc["tensors"]["a"]["chunks"][0]

    cases = {
        "file-list": (lambda d: chunk(d).__setitem__("file", ["x"]), "field 'file' has the wrong type"),
        "file-object": (lambda d: chunk(d).__setitem__("file", {"x": 1}), "field 'file' has the wrong type"),
        "offsets-empty": (lambda d: chunk(d).__setitem__("offsets", []), "a chunk has rank"),
        "offsets-rank": (lambda d: chunk(d).__setitem__("offsets", [0, 0, 0]), "a chunk has rank"),
    }
    for name, (edit, needle) in cases.items():
        with open(os.path.join(tmp_path, METADATA_FILE), "w") as f:
            f.write(good)
        _edit_metadata(tmp_path, edit)
        for fn in (lambda: read_metadata(tmp_path), lambda: pinspect.inspect_checkpoint(tmp_path)):
            with pytest.raises(CheckpointFormatError, match=needle):
                fn()
        with pytest.raises(PipeloadError, match=needle):
            pipeload.load({"a": torch.zeros(2, 3)}, tmp_path)
        assert needle in pinspect.verify_checkpoint(tmp_path)[0], name
    deep = b"[" * 100_000 + b"]" * 100_000
    with pytest.raises(CheckpointFormatError, match="nested too deeply"):
        Metadata.from_json(deep)
    dup = good.replace('{"format":"pipeload",', '{"format":"pipeload","version":1,', 1)
    with pytest.raises(CheckpointFormatError, match="'version' twice"):
        Metadata.from_json(dup)
    surrogate = good.replace('"tensors":{"a"', '"tensors":{"a\\ud800"', 1)
    with open(os.path.join(tmp_path, METADATA_FILE), "w") as f:
        f.write(surrogate)
    with pytest.raises(CheckpointFormatError, match="lone"):
        pinspect.inspect_checkpoint(tmp_path)
    r = subprocess.run([sys.executable, "-m", "pipeload", "inspect", str(tmp_path)], capture_output=True,
                       text=True, timeout=60)
    assert "Traceback" not in r.stderr and "lone" in r.stderr + r.stdout


def test_stored_dtype_differs_from_metadata(tmp_path):
    from pipeload.save.saver import _write_file

    pipeload.save({"a": torch.ones(4)}, tmp_path)
    md = read_metadata(tmp_path)
    c = md.tensors["a"].chunks[0]
    _write_file(os.path.join(tmp_path, c.file), md.save_id, [(c.key, "F4", (4,), b"\x00\x00")])
    with pytest.raises(PipeloadError, match="is F4 \\[4\\], the metadata says F32 \\[4\\]"):
        pipeload.load({"a": torch.zeros(4)}, tmp_path)


# -- concurrent saves into one directory (real processes) -------------------------------------------------

# Another process saving into the directory, reduced to what matters: it holds the save lock (the
# same flock on the directory that pipeload.save.saver._lock_directory takes; no torch import, so it is quick).
_HOLD_LOCK = textwrap.dedent(
    """
    import fcntl, os, sys, time
    fd = os.open(sys.argv[1], os.O_RDONLY | os.O_DIRECTORY)
    fcntl.flock(fd, fcntl.LOCK_EX)
    print("locked", flush=True)
    time.sleep(60)
    """
)


def test_concurrent_save_into_one_directory_refused(tmp_path):
    pipeload.save({"a": torch.ones(2)}, tmp_path)
    before = sorted(os.listdir(tmp_path))
    holder = subprocess.Popen([sys.executable, "-c", _HOLD_LOCK, str(tmp_path)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        with pytest.raises(PipeloadError, match="another save into .* is in progress"):
            pipeload.save({"a": torch.full((2,), 3.0)}, tmp_path)
    finally:
        holder.kill()
        holder.wait()
    assert sorted(os.listdir(tmp_path)) == before
    dst = {"a": torch.zeros(2)}
    pipeload.load(dst, tmp_path)
    assert torch.equal(dst["a"], torch.ones(2))
    pipeload.save({"a": torch.full((2,), 3.0)}, tmp_path)  # the lock died with its holder
    pipeload.load(dst, tmp_path)
    assert torch.equal(dst["a"], torch.full((2,), 3.0))


def test_overlapping_saves_from_two_threads_leave_a_loadable_checkpoint(tmp_path):
    """Two saves (worlds of one) into one directory at once: at most one may be refused, none may report
    success for a checkpoint that does not load, and the directory holds one of the two complete."""
    pipeload.save({"a": torch.zeros(8 << 20)}, tmp_path)
    results: dict = {}

    def save(value: float) -> None:
        try:
            pipeload.save({"a": torch.full((8 << 20,), value)}, tmp_path)
            results[value] = "ok"
        except PipeloadError as e:
            results[value] = str(e)

    threads = [threading.Thread(target=save, args=(v,)) for v in (1.0, 2.0)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert "ok" in results.values(), results
    for v, r in results.items():
        assert r == "ok" or "another save into" in r, r
    dst = {"a": torch.empty(8 << 20)}
    pipeload.load(dst, tmp_path, verify_checksums=True)
    assert float(dst["a"][0]) in [v for v, r in results.items() if r == "ok"]
    assert torch.equal(dst["a"], torch.full_like(dst["a"], float(dst["a"][0])))


def test_commit_deletes_only_the_replaced_checkpoints_files(tmp_path):
    pipeload.save({"a": torch.ones(2)}, tmp_path)
    old = {f for f in os.listdir(tmp_path) if f.endswith(".safetensors")}
    foreign = "data-0123456789abcdef-00000.safetensors"  # another writer's file, not in .metadata
    (tmp_path / foreign).write_bytes(b"in progress")
    pipeload.save({"a": torch.full((2,), 2.0)}, tmp_path)
    saver.wait_cleanup()  # the replaced files are deleted by a thread, after the commit
    now = set(os.listdir(tmp_path))
    assert foreign in now and not old & now


def test_commit_refuses_when_a_data_file_vanished(tmp_path):
    from pipeload.save.saver import _commit

    pipeload.save({"a": torch.ones(2)}, tmp_path)
    md = read_metadata(tmp_path)
    before = open(os.path.join(tmp_path, METADATA_FILE)).read()
    gone = md.tensors["a"].chunks[0]._replace(file="data-ffffffffffffffff-00000.safetensors")
    md2 = Metadata(save_id="f" * 16, world_size=1, tensors={"a": md.tensors["a"]._replace(chunks=(gone,))})
    with pytest.raises(FileNotFoundError, match="vanished before the commit"):
        _commit(str(tmp_path), md2)
    assert open(os.path.join(tmp_path, METADATA_FILE)).read() == before


# -- concurrent loads in a world of one --------------------------------------------------------------------


@pytest.mark.asyncio
async def test_concurrent_loads_in_a_world_of_one_work(tmp_path):
    pipeload.save({"a": torch.ones(3)}, tmp_path / "x")
    pipeload.save({"a": torch.full((3,), 2.0)}, tmp_path / "y")
    sx, sy = {"a": torch.zeros(3)}, {"a": torch.zeros(3)}
    await asyncio.gather(pipeload.load_async(sx, tmp_path / "x"), pipeload.load_async(sy, tmp_path / "y"))
    assert torch.equal(sx["a"], torch.ones(3)) and torch.equal(sy["a"], torch.full((3,), 2.0))


# -- a world of two: concurrent use on one group, truncation under a shared read ---------------------------


def _expect(coro_or_fn, *needles) -> str:
    try:
        r = coro_or_fn()
        if asyncio.iscoroutine(r):
            asyncio.run(r)
    except PipeloadError as e:
        for n in needles:
            assert n in str(e), f"rank {dist.get_rank()}: {n!r} not in:\n{e}"
        return str(e)
    raise AssertionError(f"rank {dist.get_rank()}: expected a PipeloadError")


def _sd(n: int, fill: float | None = None) -> dict:
    return {f"t{i:03d}": (torch.zeros(1024) if fill is None else torch.full((1024,), fill + i)) for i in range(n)}


def world2_concurrency(rank: int, world: int, root: str) -> dict:
    out = {}
    a, b = os.path.join(root, "a"), os.path.join(root, "b")
    pipeload.save(_sd(40, 1.0), a)
    pipeload.save(_sd(40, 100.0), b)

    async def both(first, second):
        sa, sb = _sd(40), _sd(40)
        results = await asyncio.gather(pipeload.load_async(sa, first), pipeload.load_async(sb, second),
                                       return_exceptions=True)
        return results

    from pipeload.tier import MemoryTier

    tier = MemoryTier(os.path.join(root, f"tier{rank}"), replicas=2, job="concurrency")
    pipeload.save(_sd(40, 7.0), tier, step=1)
    # Two loads at once on the world, the same order on every rank, then in opposite orders; a tier
    # restore beside a load, in both orders.
    for name, (x, y) in {"same": (a, b), "same-ckpt": (a, a), "crossed": (a, b) if rank == 0 else (b, a),
                         "tier": (tier, a), "tier-crossed": (tier, a) if rank == 0 else (a, tier)}.items():
        t0 = time.monotonic()
        results = asyncio.run(both(x, y))
        out[name] = time.monotonic() - t0
        for r in results:
            assert isinstance(r, PipeloadError), f"rank {rank} {name}: {r!r}"
            assert "at the same time" in str(r), str(r)
    # The registry is clean afterwards: a plain load works.
    sd = _sd(40)
    pipeload.load(sd, a)
    assert all(torch.equal(sd[f"t{i:03d}"], torch.full((1024,), 1.0 + i)) for i in range(40))
    pipeload.load(sd, tier)
    assert all(torch.equal(sd[f"t{i:03d}"], torch.full((1024,), 7.0 + i)) for i in range(40))
    # use_collectives=False loads may run together.
    async def free():
        sa, sb = _sd(40), _sd(40)
        await asyncio.gather(pipeload.load_async(sa, a, use_collectives=False),
                             pipeload.load_async(sb, b, use_collectives=False))
        return sa, sb
    sa, sb = asyncio.run(free())
    assert torch.equal(sa["t000"], torch.full((1024,), 1.0)) and torch.equal(sb["t000"], torch.full((1024,), 100.0))

    # Two saves at once on the world (two threads per rank): both refused everywhere, nothing committed.
    errors: list = []

    def save(path, value):
        try:
            pipeload.save(_sd(40, value), path)
            errors.append(None)
        except PipeloadError as e:
            errors.append(str(e))

    threads = [threading.Thread(target=save, args=(a, 5.0)), threading.Thread(target=save, args=(b, 6.0))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert len(errors) == 2 and all(e is not None and "at the same time" in e for e in errors), errors
    dist.barrier()
    for path, base in ((a, 1.0), (b, 100.0)):
        sd = _sd(40)
        pipeload.load(sd, path)
        assert torch.equal(sd["t000"], torch.full((1024,), base)), f"{path} changed"

    # A 200 MiB replicated tensor truncated under its reader: a DistributedError on both ranks that
    # names the reader and the cause; the receiver is released at once.
    big = os.path.join(root, "big")
    data_file = _big_checkpoint(big)  # replicated: written once
    size = os.path.getsize(data_file)
    dist.barrier()
    outcomes = []
    for _ in range(3):
        if rank == 0:
            os.truncate(data_file, size)
        dist.barrier()
        dst = {"w": torch.ones(BIG // 4)}
        done = threading.Event()
        watcher = _truncate_when_copy_starts(dst["w"], data_file, done)
        t0 = time.monotonic()
        try:
            pipeload.load(dst, big)
            outcomes.append("loaded" if bool((dst["w"] == 0).all()) else "loaded wrong data")  # cut too late
        except DistributedError as e:
            outcomes.append((str(e), sorted(e.failures), time.monotonic() - t0))
        done.set()
        watcher.join()
        dist.barrier()
    out["truncate"] = outcomes
    return out


@pytest.mark.timeout(180)
def test_world2_concurrent_use_and_truncation(tmp_path):
    res = run_world(world2_concurrency, 2, str(tmp_path), timeout=150, pg_timeout=60, separate_hosts=True)
    for r in res:
        for name in ("same", "same-ckpt", "crossed", "tier", "tier-crossed"):
            assert r[name] < 10, f"{name} took {r[name]:.1f} s"
    for r in res:
        for o in r["truncate"]:
            assert o != "loaded wrong data", r["truncate"]
            if o == "loaded":  # the cut came after the copy (a busy machine): nothing to check
                continue
            msg, failed, took = o
            assert "bus error" in msg or "truncated" in msg, msg
            assert took < 30
    # both ranks saw the same failing ranks
    assert [o if o == "loaded" else o[1] for o in res[0]["truncate"]] == [o if o == "loaded" else o[1]
                                                                           for o in res[1]["truncate"]]
    assert any("bus error" in o[0] or "truncated" in o[0] for r in res for o in r["truncate"])


# -- a rank killed mid-load -------------------------------------------------------------------------------


def _spawn_survivors(fn, world: int, args, timeout: float, pg_timeout: float) -> dict[int, tuple]:
    """Like run_world, but a rank may die: {rank: (ok, value)} of the ranks that reported in time."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    out: dict[int, tuple] = {}
    with tempfile.TemporaryDirectory(prefix="pipeload-faults-") as tmp:
        store = os.path.join(tmp, "store")
        procs = [ctx.Process(target=_rank_main, args=(fn, r, world, store, pg_timeout, args, results, True), daemon=True)
                 for r in range(world)]
        for p in procs:
            p.start()
        deadline = time.monotonic() + timeout
        try:
            while time.monotonic() < deadline:
                if all(r in out or procs[r].exitcode not in (None, 0) for r in range(world)):
                    break
                try:
                    rank, ok, value = results.get(timeout=0.2)
                    out[rank] = (ok, value)
                except queue.Empty:
                    pass
        finally:
            for p in procs:
                if p.is_alive():
                    p.kill()
            for p in procs:
                p.join(5)
    return out


def _die_when(t: torch.Tensor) -> None:
    def watch():
        while t[4096].item() == 0.0:
            time.sleep(0.0005)
        os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=watch, daemon=True).start()


def _die_on_read(n: int) -> None:
    """SIGKILL this process as it starts its ``n``-th chunk read (a death inside the read loop)."""
    from pipeload.io.reader import ChunkReader

    read_into, calls = ChunkReader.read_into, [0]

    def dying(self, *args, **kwargs):
        calls[0] += 1
        if calls[0] == n:
            os.kill(os.getpid(), signal.SIGKILL)
        return read_into(self, *args, **kwargs)

    ChunkReader.read_into = dying


def world3_rank_death(rank: int, world: int, root: str, phase: str) -> dict:
    n = 60
    shared = os.path.join(root, "shared")
    private = os.path.join(root, "private")
    if phase == "shared":
        pipeload.save({f"t{i:03d}": torch.full((16 << 10,), 1.0 + i) for i in range(n)}, shared)
        sd = {f"t{i:03d}": torch.zeros(16 << 10) for i in range(n)}
        ckpt, opts = shared, {"broadcast_batch_bytes": 0, "max_inflight": 1}
    else:
        # each rank holds its own tensors: all private
        full = {f"r{r}.t{i:03d}": torch.full((16 << 10,), 1.0 + i) for r in range(world) for i in range(n)}
        pipeload.save({k: v for k, v in full.items() if k.startswith(f"r{rank}.")}, private)
        sd = {k: torch.zeros_like(v) for k, v in full.items() if k.startswith(f"r{rank}.")}
        ckpt, opts = private, {}
    dist.barrier()
    if rank == 1 and phase == "shared":
        # the victim dies once its 11th destination has landed: mid-phase (the broadcasts, one in flight,
        # keep it from finishing the phase before the watcher sees it)
        _die_when(sd[sorted(sd)[10]])
    elif rank == 1:
        # a private phase has no collective to hold the victim back, so it dies inside it, synchronously
        _die_on_read(11)
    return _outcome(lambda: pipeload.load(sd, ckpt, **opts))


@pytest.mark.timeout(200)
@pytest.mark.parametrize("phase", ["shared", "private"])
def test_rank_killed_mid_load(tmp_path, phase):
    res = _spawn_survivors(world3_rank_death, 3, (str(tmp_path), phase), timeout=90, pg_timeout=60)
    _survivors_named(res, victim=1)


def _outcome(load) -> dict:
    """A surviving rank's report of ``load()``: the PipeloadError it raised (or None), and how long it took."""
    t0 = time.monotonic()
    try:
        load()
    except PipeloadError as e:
        return {"error": str(e), "took": time.monotonic() - t0}
    return {"error": None, "took": time.monotonic() - t0}


def _survivors_named(res: dict, victim: int) -> None:
    """Every rank but ``victim`` reported, promptly, an error naming it (and not a finished operation)."""
    assert victim not in res, "the victim reported"
    for r in sorted({0, 1, 2} - {victim}):
        assert r in res, f"rank {r} did not report within the deadline ({res})"
        ok, value = res[r]
        assert ok, value
        assert value["error"] is not None, f"rank {r} reported the operation as done"
        assert value["took"] < 30, value
        assert f"rank(s) {victim} stopped answering" in value["error"], value["error"]


# -- a rank killed mid-restore from a memory tier -----------------------------------------------------------


def _die_on_pread(n: int) -> None:
    """SIGKILL this process as a tier restore reads its ``n``-th part to send (inside the transfers)."""
    from pipeload.tier import restorerun

    pread_into, calls = restorerun.pread_into, [0]

    def dying(*args, **kwargs):
        calls[0] += 1
        if calls[0] == n:
            os.kill(os.getpid(), signal.SIGKILL)
        return pread_into(*args, **kwargs)

    restorerun.pread_into = dying


def world3_restore_death(rank: int, world: int, root: str) -> dict:
    """Rank 1's host lost; rank 2, the host of its copy, dies while sending it (4 KiB messages, 8 KiB in
    flight: the transfer is many messages long)."""
    from pipeload.tier import MemoryTier
    from pipeload.move import mover as restorexfer

    restorexfer.PIECE, restorexfer.SMALL, restorexfer.INFLIGHT = 4096, 1024, 8192
    sd = {f"t{i:02d}": torch.full((16 << 10,), 1.0 + i + rank) for i in range(8)}
    tier = MemoryTier(os.path.join(root, f"host{rank}"), replicas=2, job="restore-death")
    pipeload.save(sd, tier, step=1)
    dist.barrier()
    if rank == 1:
        import shutil

        shutil.rmtree(tier.root)
        os.makedirs(tier.root)
    dist.barrier()
    if rank == 2:
        _die_on_pread(3)
    dest = {k: torch.zeros_like(v) for k, v in sd.items()}
    return _outcome(lambda: pipeload.load(dest, tier, fallback=os.path.join(root, "nothing")))


@pytest.mark.timeout(200)
def test_rank_killed_mid_restore(tmp_path):
    res = _spawn_survivors(world3_restore_death, 3, (str(tmp_path),), timeout=90, pg_timeout=60)
    _survivors_named(res, victim=2)
    assert "point-to-point transfer" in res[1][1]["error"]  # (the receiver was inside the transfer)


# -- a trainer rank killed mid-transfer (pipeload.transfer) ---------------------------------------------


def world3_transfer_death(rank: int, world: int) -> dict:
    """Ranks 0 and 1 hold the source (FSDP-like: each half of every tensor), rank 2 is the engine; rank
    1 dies as it packs its 4th message (4 KiB messages, 8 KiB in flight: many messages long)."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor, Shard

    from pipeload.live import run as live_run
    from pipeload.move import mover

    mover.PIECE, mover.SMALL, mover.INFLIGHT = 4096, 1024, 8192
    full = {f"t{i:02d}": torch.full((64, 64), 1.0 + i) for i in range(8)}
    mesh = DeviceMesh("cpu", [0, 1])
    src = {k: DTensor.from_local(torch.chunk(v, 2, 0)[rank].clone(), mesh, [Shard(0)], run_check=False,
                                 shape=v.shape, stride=v.stride()) for k, v in full.items()} if rank < 2 else None
    dst = {k: torch.zeros_like(v) for k, v in full.items()} if rank == 2 else None
    pipeload.transfer(src, dst)  # one that completes (and keeps its plan)
    dist.barrier()
    if rank == 1:
        packer, calls = live_run.LiveSource.sender, [0]

        def dying(*args, **kwargs):
            calls[0] += 1
            if calls[0] == 4:
                os.kill(os.getpid(), signal.SIGKILL)
            return packer(*args, **kwargs)

        live_run.LiveSource.sender = dying
    t0 = time.monotonic()
    try:
        pipeload.transfer(src, dst)
    except PipeloadError as e:
        stats = getattr(e, "stats", None)
        return {"error": str(e), "type": type(e).__name__, "took": time.monotonic() - t0,
                "written": None if stats is None else (len(stats.written), stats.destinations, stats.complete)}
    return {"error": None, "took": time.monotonic() - t0}


@pytest.mark.timeout(200)
def test_rank_killed_mid_transfer(tmp_path):
    res = _spawn_survivors(world3_transfer_death, 3, (), timeout=90, pg_timeout=60)
    assert 1 not in res, "the victim reported"
    for r in (0, 2):
        assert r in res, f"rank {r} did not report within the deadline ({res})"
        ok, value = res[r]
        assert ok, value
        assert value["error"] is not None and value["type"] == "TransferError", value
        assert value["took"] < 30, value
    written, total, complete = res[2][1]["written"]
    assert not complete and written < total == 8  # the engine knows the refresh did not finish


# -- a rank killed during part delivery's position messages (a DCP checkpoint into another layout) -------


def world3_position_death(rank: int, world: int, root: str) -> dict:
    """A DCP checkpoint of whole tensors (one blob each) loaded as row shards over three emulated hosts:
    every rank reads part of every blob, and the reader of a blob's first byte (rank 0) sends the others
    where each tensor starts. Rank 0 dies as it is about to send them."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import Shard, distribute_tensor

    import pipeload.engine.delivery as delivery

    full = {f"t{i}": torch.arange(96 * 512, dtype=torch.float32).view(96, 512) + i for i in range(4)}
    d = os.path.join(root, "ck")
    dcp.save(full, checkpoint_id=d)
    dist.barrier()
    mesh = DeviceMesh("cpu", [0, 1, 2])
    sd = {k: distribute_tensor(torch.zeros_like(v), mesh, [Shard(0)]) for k, v in full.items()}
    if rank == 0:
        def dying(*args, **kwargs):
            os.kill(os.getpid(), signal.SIGKILL)
        delivery._locate = dying
    return _outcome(lambda: pipeload.load(sd, d, reuse_plan=False))


@pytest.mark.timeout(200)
def test_rank_killed_during_position_messages(tmp_path):
    res = _spawn_survivors(world3_position_death, 3, (str(tmp_path),), timeout=90, pg_timeout=60)
    _survivors_named(res, victim=0)
    assert any("chunk positions" in res[r][1]["error"] for r in (1, 2)), res  # (inside the messages)
