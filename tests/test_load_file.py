"""``pipeload.load_file``: one real gloo world of 3 ranks (each its own emulated host) runs every
sub-case — a torch.save'd nested dict, map_location, the legacy format, a safetensors file, weights_only
refusals, a file that is no checkpoint, a missing file, a file truncated or replaced while it is read,
disagreeing options, a rank whose own copy is missing — and the world-of-one cases run in this process.
Every rank's result is compared with what ``torch.load`` (or ``safetensors.torch.load_file``) returns
for the same file, and bytes read from storage are taken from ``/proc/self/io``.
"""

from __future__ import annotations

import os
import pickle
import threading
import time
from collections import OrderedDict

import pytest
import torch
import torch.distributed as dist

import pipeload
from pipeload.tools.bench.system import drop_cache
from pipeload.tools._world import run_world

CHUNK = 256 << 10


class Custom:
    """A class ``weights_only=True`` refuses (importable by the ranks: module level)."""

    def __init__(self, n: int = 0):
        self.n = n

    def __eq__(self, other):
        return isinstance(other, Custom) and other.n == self.n


def _nested() -> dict:
    g = torch.Generator().manual_seed(3)
    return {"model": OrderedDict(w=torch.randn(512, 1024, generator=g), b=torch.arange(1000),
                                 h=torch.randn(64, 64, generator=g).half()),
            "optimizer": {"state": {0: {"step": torch.tensor(5.0), "exp_avg": torch.randn(300, generator=g)}},
                          "param_groups": [{"lr": 1e-3, "betas": (0.9, 0.95), "params": [0]}]},
            "epoch": 3, "name": "run", "shared": None}


def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.device == b.device and torch.equal(a, b)
    if isinstance(a, dict):
        return type(a) is type(b) and list(a) == list(b) and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


def _write_files(root: str) -> dict[str, str]:
    from safetensors.torch import save_file

    p = {k: os.path.join(root, n) for k, n in (("zip", "ckpt.pt"), ("legacy", "legacy.pt"),
                                               ("custom", "custom.pt"), ("st", "model.safetensors"),
                                               ("text", "notes.txt"), ("trunc", "trunc.bin"), ("swap", "swap.bin"))}
    torch.save(_nested(), p["zip"])
    torch.save(_nested(), p["legacy"], _use_new_zipfile_serialization=False)
    torch.save({"c": Custom(4), "t": torch.ones(3)}, p["custom"])
    save_file({"a": torch.randn(700, 300), "b": torch.arange(10, dtype=torch.int32)}, p["st"])
    with open(p["text"], "w") as f:
        f.write("not a checkpoint\n" * 100)
    for k in ("trunc", "swap"):
        torch.save({"x": torch.randn(1 << 20)}, p[k])  # 4 MiB: 256 broadcasts of 16 KiB below
    return p


def _read_bytes() -> int:
    with open("/proc/self/io") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("read_bytes"))


def _error(fn) -> dict:
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - the test compares what each rank raised
        return {"type": type(e).__name__, "msg": str(e), "pipeload": isinstance(e, pipeload.PipeloadError),
                "unpickling": isinstance(e, pickle.UnpicklingError)}
    return {"type": None}


def _when_opened(path: str, action, stop: threading.Event) -> threading.Thread:
    """Run ``action`` in a thread as soon as this process holds ``path`` open (only the reader does)."""

    def watch():
        while not stop.is_set():
            for fd in os.listdir("/proc/self/fd"):
                try:
                    if os.readlink(f"/proc/self/fd/{fd}") == path:
                        action()
                        return
                except OSError:
                    pass
            time.sleep(0.0005)

    t = threading.Thread(target=watch, daemon=True)
    t.start()
    return t


def _under_change(path: str, change, **kw) -> dict:
    stop = threading.Event()
    t = _when_opened(path, change, stop)
    t0 = time.monotonic()
    err = _error(lambda: pipeload.load_file(path, chunk_bytes=16 << 10, max_inflight=1, **kw))
    stop.set()
    t.join()
    return {**err, "took": time.monotonic() - t0}


def world_load_file(rank: int, world: int, root: str) -> dict:
    p = _write_files(root) if rank == 0 else None
    box = [p]
    dist.broadcast_object_list(box)
    p = box[0]
    out: dict = {}
    # read once: the page cache dropped, then only the reader may read the file from storage
    if rank == 0:
        drop_cache([p["zip"]])
    dist.barrier()
    stats = pipeload.FileStats()
    before = _read_bytes()
    got = pipeload.load_file(p["zip"], stats=stats, chunk_bytes=CHUNK, max_inflight=2)
    out["io"] = _read_bytes() - before
    out["stats"] = stats
    out["zip"] = _same(torch.load(p["zip"]), got)
    w = got["model"]["w"]
    w.mul_(2)  # the result is the caller's to change (it maps this rank's buffer, shared with nobody)
    out["writable"] = torch.equal(w, 2 * torch.load(p["zip"])["model"]["w"])
    for name, loc in (("cpu", "cpu"), ("dict", {"cpu": "cpu"}), ("callable", lambda s, _: s),
                      ("device", torch.device("cpu"))):
        got = pipeload.load_file(p["zip"], map_location=loc, chunk_bytes=CHUNK)
        out[f"map_{name}"] = _same(torch.load(p["zip"], map_location=loc), got)
    # the accelerator backend's path (a ring of staging chunks, copies on both sides) with host chunks
    from pipeload.engine import wholefile

    wholefile._STAGE_ON_HOST = True
    try:
        out["staged"] = _same(torch.load(p["zip"]), pipeload.load_file(p["zip"], chunk_bytes=CHUNK // 4, max_inflight=3))
    finally:
        wholefile._STAGE_ON_HOST = False
    out["legacy"] = _same(torch.load(p["legacy"]), pipeload.load_file(p["legacy"], chunk_bytes=CHUNK))
    st = pipeload.FileStats()
    from safetensors.torch import load_file as st_load

    out["st"] = _same(st_load(p["st"]), pipeload.load_file(p["st"], stats=st, chunk_bytes=CHUNK))
    out["st_format"] = st.format
    out["custom_refused"] = _error(lambda: pipeload.load_file(p["custom"]))
    out["custom_allowed"] = _same(torch.load(p["custom"], weights_only=False),
                                  pipeload.load_file(p["custom"], weights_only=False))
    out["text"] = _error(lambda: pipeload.load_file(p["text"]))
    out["text_torch"] = _error(lambda: torch.load(p["text"]))
    out["missing"] = _error(lambda: pipeload.load_file(os.path.join(root, "nope.pt")))
    out["options"] = _error(lambda: pipeload.load_file(p["zip"], chunk_bytes=CHUNK * (1 + (rank == 1))))
    out["trunc"] = _under_change(p["trunc"], lambda: os.truncate(p["trunc"], 1 << 20))
    other = os.path.join(root, f"other-{rank}.bin")
    torch.save({"y": torch.zeros(5)}, other)
    out["swap"] = _under_change(p["swap"], lambda: os.replace(other, p["swap"]))
    # an empty file: no chunk, torch.load's error on every rank
    empty = os.path.join(root, "empty.pt")
    if rank == 0:
        open(empty, "wb").close()
    dist.barrier()
    out["empty"] = _error(lambda: pipeload.load_file(empty))
    out["empty_torch"] = _error(lambda: torch.load(empty))
    # a subgroup of ranks 0 and 2 (global ranks): rank 1 takes no part
    sub = dist.new_group([0, 2])
    if rank != 1:
        st = pipeload.FileStats()
        out["sub"] = _same(torch.load(p["zip"]), pipeload.load_file(p["zip"], process_group=sub, stats=st))
        out["sub_stats"] = st
    # every rank reads its own copy; one rank's is missing: it raises its own error, the others theirs
    own = os.path.join(root, f"own-{rank}.pt")
    if rank != 1:
        torch.save({"r": torch.tensor(rank)}, own)
    each = pipeload.FileStats()
    out["own_missing"] = _error(lambda: pipeload.load_file(own, broadcast=False, stats=each))
    out["own_stats"] = each
    # one host (the default policy under gloo): every rank reads the file itself, no broadcast
    os.environ["PIPELOAD_HOST_ID"] = "one-host"
    one = pipeload.FileStats()
    out["one_host"] = _same(torch.load(p["zip"]), pipeload.load_file(p["zip"], stats=one))
    out["one_host_stats"] = one
    return out


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("load_file"))
    return run_world(world_load_file, 3, root, timeout=180, separate_hosts=True), root


def test_every_rank_gets_what_torch_load_returns(world):
    res, _ = world
    for r in res:
        assert r["zip"] and r["legacy"] and r["st"] and r["custom_allowed"] and r["staged"] and r["writable"]
        assert all(r[f"map_{n}"] for n in ("cpu", "dict", "callable", "device"))
        assert r["st_format"] == "safetensors" and r["stats"].format == "torch-zip"


def test_read_once_by_one_rank(world):
    from pipeload.plan.exchange import hash64

    res, _ = world
    size = res[0]["stats"].size
    readers = {r["stats"].reader for r in res}
    assert len(readers) == 1 and readers.pop() in range(3)
    reader = res[0]["stats"].reader
    assert reader == hash64(res[0]["stats"].path.encode()) % 3
    for rank, r in enumerate(res):
        s = r["stats"]
        assert s.broadcast and s.broadcasts == -(-size // CHUNK)
        if rank == reader:
            assert s.bytes_read == size and s.bytes_received == 0
            assert size <= r["io"] <= size + (8 << 20), r["io"]  # from the device (readahead at most)
        else:
            assert s.bytes_read == 0 and s.bytes_received == size
            # none of the file's ~2 MiB from the device (a few pages of whatever else the process touched
            # first — a module's code, a directory block — may count: once seen, 8 KiB in a fresh clone)
            assert r["io"] <= 64 << 10 < size, (rank, r["io"])


def test_refusals_are_torch_loads_on_every_rank(world):
    res, root = world
    for rank, r in enumerate(res):
        e = r["custom_refused"]
        assert e["type"] == "UnpicklingError" and e["pipeload"] and e["unpickling"], e
        assert "custom.pt" in e["msg"] and f"rank {rank}" in e["msg"] and "Custom" in e["msg"], e["msg"]
        e, t = r["text"], r["text_torch"]
        assert e["pipeload"] and "notes.txt" in e["msg"] and t["msg"] in e["msg"], (e, t)  # torch's own words
        assert e["unpickling"] == t["unpickling"] and f"rank {rank}" in e["msg"], (e, t)


def test_failures_raise_on_every_rank(world):
    from pipeload.plan.exchange import hash64

    res, root = world
    reader = hash64(os.path.join(root, "nope.pt").encode()) % 3  # the reader: the path's hash over the group
    for rank, r in enumerate(res):
        e = r["missing"]
        assert e["type"] == "DistributedError" and "nope.pt" in e["msg"] and f"rank(s) {reader}" in e["msg"], e
        assert "FileNotFoundError" in e["msg"], e
        assert r["options"]["type"] == "PipeloadError" and "rank(s) [1]" in r["options"]["msg"], r["options"]
        for case, needle in (("trunc", "trunc.bin"), ("swap", "swap.bin")):
            e = r[case]
            assert e["type"] == "DistributedError" and needle in e["msg"], (case, e)
            assert any(w in e["msg"] for w in ("truncated", "changed", "replaced")), (case, e)
            assert e["took"] < 30, (case, e)


def test_empty_file_and_subgroup(world):
    res, _ = world
    for rank, r in enumerate(res):
        assert r["empty"]["pipeload"] and r["empty_torch"]["msg"] in r["empty"]["msg"], (r["empty"], r["empty_torch"])
    for rank in (0, 2):
        s = res[rank]["sub_stats"]
        assert res[rank]["sub"] and s.broadcast and s.reader in (0, 1)  # group ranks
    assert "sub" not in res[1]
    assert sorted(res[r]["sub_stats"].bytes_read for r in (0, 2)) == [0, res[0]["sub_stats"].size]


def test_each_rank_reading_its_own_copy(world):
    res, _ = world
    for rank, r in enumerate(res):
        e = r["own_missing"]
        if rank == 1:
            assert e["type"] == "ReadError" and "own-1.pt" in e["msg"] and "rank 1" in e["msg"], e
        else:
            assert e["type"] == "DistributedError" and "own-1.pt" in e["msg"], e
        assert not r["own_stats"].broadcast
        s = r["one_host_stats"]
        assert r["one_host"] and not s.broadcast and s.bytes_read == s.size and s.broadcasts == 0


def test_world_of_one(tmp_path):
    """No process group: torch.load's result and errors, no collective."""
    sd = _nested()
    torch.save(sd, tmp_path / "a.pt")
    stats = pipeload.FileStats()
    assert _same(torch.load(tmp_path / "a.pt"), pipeload.load_file(tmp_path / "a.pt", stats=stats))
    assert stats.reader == -1 and not stats.broadcast and stats.bytes_read == stats.size > 0
    torch.save({"c": Custom(1)}, tmp_path / "c.pt")
    with pytest.raises(pickle.UnpicklingError, match="weights_only=True"):
        pipeload.load_file(tmp_path / "c.pt")
    assert pipeload.load_file(tmp_path / "c.pt", weights_only=False)["c"] == Custom(1)
    with pytest.raises(pipeload.ReadError, match="missing.pt"):
        pipeload.load_file(tmp_path / "missing.pt")
    with pytest.raises(ValueError, match="broadcast"):
        pipeload.load_file(tmp_path / "a.pt", broadcast="always")
