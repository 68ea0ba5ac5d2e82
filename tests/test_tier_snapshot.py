"""Snapshots into the memory tier (``pipeload.save(state_dict, MemoryTier, step=N)``) on real processes.

Each rank is an emulated host of its own (``PIPELOAD_HOST_ID``) with a tier root of its own. One world
of four runs the sub-cases: placement and exact bytes of every file and copy (DTensor shards, replicated
DTensors, strided views, objects, a ``Stateful``), a background snapshot that keeps the values at the
call, ``keep`` and the removal of unfinished and abandoned steps, refused kinds and roots of another job
(nothing written), one root given to every host (refused, naming it), a write failure on one rank (``RLIMIT_FSIZE``: every rank raises naming it, the
previous step stays the newest), a damaged file found by ``read_rank_header``. A world of three loses
a rank in the middle of a background snapshot.
"""

from __future__ import annotations

import filecmp
import json
import os
import resource
import signal
import time

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import load_file
from torch.distributed.checkpoint.stateful import Stateful
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard

import pipeload
from pipeload.errors import CheckpointFormatError, DistributedError, PipeloadError, StateDictError
from pipeload.tier import MemoryTier
from pipeload.tier import format as tf
from pipeload.tier import placement, transport
from pipeload.tier.measure import snapshot_against_save
from pipeload.tools._world import WorldError, run_world

BIG = 3 << 20  # bytes of each rank's largest tensor: several messages of the test's 1 MiB


class Counter(Stateful):
    def __init__(self) -> None:
        self.count = torch.zeros(3, dtype=torch.int64)

    def state_dict(self):
        return {"count": self.count}

    def load_state_dict(self, sd) -> None:
        self.count.copy_(sd["count"])


def _state(world: int) -> dict:
    mesh = init_device_mesh("cpu", (world,))
    emb = DTensor.from_local(torch.zeros(2, 4), mesh, [Shard(0)], run_check=False, shape=(2 * world, 4), stride=(4, 1))
    norm = DTensor.from_local(torch.zeros(4), mesh, [Replicate()], run_check=False)
    return {"emb": emb, "norm": norm, "big": torch.zeros(BIG // 4), "wt": torch.zeros(3, 5).t(),
            "opt": {"lr": 0.0, "betas": (0.9, 0.99)}, "counter": Counter(), "step": 0}


def _fill(sd: dict, step: int) -> None:
    r = dist.get_rank()
    sd["emb"].to_local().copy_(torch.arange(8.0).reshape(2, 4) + 100 * step + 10 * r)
    sd["norm"].to_local().fill_(step)
    sd["big"].fill_(step * 1000 + r)
    sd["wt"].copy_(torch.arange(15.0).reshape(5, 3) + step)
    sd["opt"]["lr"] = step / 10
    sd["counter"].count.fill_(step + r)
    sd["step"] = step


def _expected(rank: int, step: int) -> dict[str, torch.Tensor]:
    return {"emb": torch.arange(8.0).reshape(2, 4) + 100 * step + 10 * rank, "norm": torch.full((4,), float(step)),
            "big": torch.full((BIG // 4,), float(step * 1000 + rank)), "wt": torch.arange(15.0).reshape(5, 3) + step,
            "counter.count": torch.full((3,), step + rank, dtype=torch.int64)}


def _root(base: str, rank: int) -> str:
    return os.path.join(base, f"host{rank}")


def _check_file(base: str, host: int, rank: int, step: int, world: int) -> None:
    """``rank``'s file of ``step`` on ``host``'s root holds exactly ``rank``'s values at ``step``."""
    path = tf.rank_file(_root(base, host), step, rank)
    h = tf.read_rank_header(path, job="t")
    assert (h.rank, h.step, h.world) == (rank, step, world)
    assert h.tensors["emb"].shape == (2 * world, 4) and h.tensors["emb"].offsets == (2 * rank, 0)
    assert h.tensors["norm"].offsets == (0,) and h.tensors["wt"].lengths == (5, 3)
    plain = load_file(path)
    for k, want in _expected(rank, step).items():
        assert torch.equal(plain[k], want), (path, k, plain[k].flatten()[:4])
    raw = open(path, "rb").read()
    lr = h.objects["opt.lr"]
    assert torch.load(__import__("io").BytesIO(raw[lr.start:lr.end]), weights_only=True) == step / 10
    assert sorted(h.objects) == ["opt.betas", "opt.lr", "step"]


def _placement_cases(rank: int, world: int, base: str, tier: MemoryTier, sd: dict, out: dict) -> None:
    _fill(sd, 10)
    stats = pipeload.save(sd, tier, step=10)
    assert (stats.copies_sent, stats.copies_written) == (1, 1), stats
    _fill(sd, 11)
    h = pipeload.save(sd, tier, step=11, background=True)
    _fill(sd, 99)  # after the call: the snapshot holds step 11's values
    h.wait(60)
    out["blocked"] = h.blocked_seconds
    out["replica_bytes"] = h.stats.replica_bytes  # "norm" (replicated): staged by one rank, received by three
    dist.barrier()
    assert tier.steps() == [11], tier.steps()  # keep=1: step 10 dropped after 11 completed everywhere
    mine = tf.list_steps(tier.root, "t")[11]
    assert mine["ranks"] == sorted([rank, (rank - 1) % world]) and mine["hosts"] == world, mine
    if rank == 0:
        for host in range(world):
            for r in (host, (host - 1) % world):
                _check_file(base, host, r, 11, world)
            other = (host + 1) % world
            assert filecmp.cmp(tf.rank_file(_root(base, host), 11, host), tf.rank_file(_root(base, other), 11, host),
                               shallow=False)
    dist.barrier()
    # three copies of every file (replicas=3): this host and the next two of the ring
    wide = MemoryTier(tier.root, replicas=3, job="t")
    _fill(sd, 12)
    pipeload.save(sd, wide, step=12)
    assert tf.list_steps(tier.root, "t")[12]["ranks"] == sorted((rank - k) % world for k in range(3))
    # more replicas than hosts: every host holds every file
    pipeload.save(sd, MemoryTier(tier.root, replicas=9, job="t"), step=13, background=True).wait(60)
    assert tf.list_steps(tier.root, "t")[13]["ranks"] == list(range(world))
    assert tier.steps() == [13]


def _cleanup_cases(rank: int, world: int, base: str, tier: MemoryTier, sd: dict, out: dict) -> None:
    """Unfinished steps go at the next snapshot; so do steps at or past it (an abandoned future)."""
    os.makedirs(os.path.join(tf.step_dir(tier.root, 5), "junk"))  # unfinished, older
    os.makedirs(tf.step_dir(tier.root, 40))
    with open(os.path.join(tf.step_dir(tier.root, 40), tf.COMPLETE_FILE), "w") as f:  # complete, newer
        json.dump({"step": 40, "world": world, "job": "t", "ranks": [rank], "replicas": 2, "hosts": world}, f)
    assert tier.steps() == [13, 40]
    dist.barrier()
    _fill(sd, 20)
    pipeload.save(sd, MemoryTier(tier.root, job="t", keep=2), step=20)
    assert tier.steps() == [13, 20] and sorted(os.listdir(tier.root)) == [
        "TIER.json", "step-000000000013", "step-000000000020"], os.listdir(tier.root)
    pipeload.save(sd, tier, step=21)
    assert tier.steps() == [21]


def _refusal_cases(rank: int, world: int, base: str, tier: MemoryTier, sd: dict, out: dict) -> None:
    """Refused before anything is written, on every rank: a kind a save refuses, a root of another job."""
    before = sorted(os.listdir(tier.root))
    bad = dict(sd, extra=torch.ones(4).to_sparse()) if rank == 2 else sd
    with pytest.raises(StateDictError, match=r"rank 2: 'extra': a tensor of layout torch.sparse_coo"):
        pipeload.save(bad, tier, step=30)
    tier_json = os.path.join(tier.root, tf.TIER_FILE)
    if rank == 1:
        os.replace(tier_json, tier_json + ".mine")
        tf.write_json(tier_json, {"format": 1, "job": "someone-else"})
    with pytest.raises(DistributedError, match=r"rank\(s\) 1:[\s\S]*host1/TIER.json: the tier of job 'someone-else'"):
        pipeload.save(sd, tier, step=30, background=True)
    if rank == 1:
        with pytest.warns(RuntimeWarning, match="host1.*someone-else"):
            assert tier.steps() == []
        os.replace(tier_json + ".mine", tier_json)
    with pytest.raises(TypeError, match="needs step=N"):
        pipeload.save(sd, tier)
    with pytest.raises(PipeloadError, match="different step"):
        pipeload.save(sd, tier, step=30 + (rank == 3))
    assert sorted(os.listdir(tier.root)) == before and tier.steps() == [21]


def _write_error_case(rank: int, world: int, base: str, tier: MemoryTier, sd: dict, out: dict) -> None:
    """Rank 1 cannot write past 1 MiB (EFBIG, the full tmpfs's stand-in): every rank raises naming rank 1
    and its file; the failed step is gone everywhere and step 21 stays the newest."""
    limit = resource.getrlimit(resource.RLIMIT_FSIZE)
    if rank == 1:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, limit[1]))
    try:
        for background in (False, True):
            _fill(sd, 22)
            with pytest.raises(DistributedError) as got:
                h = pipeload.save(sd, tier, step=22, background=background)
                h.wait(60)
            assert sorted(got.value.failures) == [1], str(got.value)
            assert "File too large" in str(got.value) and "host1/step-000000000022/rank-00000" in str(got.value)
            out["write_error"] = str(got.value)
            dist.barrier()
            assert tier.steps() == [21] and not os.path.exists(tf.step_dir(tier.root, 22)), os.listdir(tier.root)
    finally:
        if rank == 1:
            resource.setrlimit(resource.RLIMIT_FSIZE, limit)


def _damage_case(rank: int, world: int, base: str, tier: MemoryTier, sd: dict, out: dict) -> None:
    path = tf.rank_file(tier.root, tier.steps()[-1], rank)
    tf.read_rank_header(path, job="t")
    with open(path, "r+b") as f:
        f.seek(12)
        f.write(b"\x00")  # inside the header's JSON
    with pytest.raises(CheckpointFormatError, match=f"rank-{rank:06d}"):
        tf.read_rank_header(path, job="t")
    os.truncate(path, os.path.getsize(path) - 5)
    with pytest.raises(CheckpointFormatError, match=f"rank-{rank:06d}"):
        tf.read_rank_header(path, job="t")


def _measure_case(rank: int, world: int, base: str, tier: MemoryTier, sd: dict, out: dict) -> None:
    """The bench's side-by-side measurement runs and leaves the tier at its last step."""
    got = snapshot_against_save(sd, tier, os.path.join(base, "ckpt"), step=50, repeats=2)
    assert all(got[k] > 0 for k in ("snapshot_blocked_s", "snapshot_done_s", "save_blocked_s", "save_done_s")), got
    assert got["snapshot_blocked_s"] <= got["snapshot_done_s"] and got["bytes_sent"] == got["file_bytes"] > BIG, got
    assert tier.steps() == [51]


def _split_refused_case(rank: int, world: int, base: str, tier: MemoryTier, sd: dict, out: dict) -> None:
    """Ranks that disagree on a replicated shard (rank 3 lacks "norm"): the check words differ, so no
    rank leaves its replica to another: each stages and writes its own, exact."""
    _fill(sd, 60)
    mine = {k: v for k, v in sd.items() if not (rank == 3 and k == "norm")}
    h = pipeload.save(mine, tier, step=60, background=True)
    _fill(sd, 98)
    h.wait(60)
    assert h.stats.replica_bytes == 0
    got = load_file(tf.rank_file(tier.root, 60, rank))
    assert ("norm" in got) == (rank != 3) and torch.equal(got["big"], torch.full((BIG // 4,), 60000.0 + rank))
    if rank != 3:
        assert torch.equal(got["norm"], torch.full((4,), 60.0))


def _shared_root_case(rank: int, world: int, base: str, tier: MemoryTier, sd: dict, out: dict) -> None:
    """Four hosts given one directory (a network file system, not host memory): refused on every rank,
    naming the root, before anything is claimed, removed or written; the hosts' own roots untouched."""
    shared = MemoryTier(os.path.join(base, "one-for-all"), job="t")
    for background in (False, True):
        with pytest.raises(DistributedError, match="each host needs a root of its own") as got:
            pipeload.save(sd, shared, step=80, background=background).wait(60)
        assert sorted(got.value.failures) == [0, 1, 2, 3] and "one-for-all" in str(got.value)
        dist.barrier()
        assert os.listdir(shared.root) == []
    assert tier.steps() == [60]


def world4_tier(rank: int, world: int, base: str) -> dict:
    transport.CHUNK = 1 << 20  # several messages per copy
    tier = MemoryTier(_root(base, rank), job="t")
    sd = _state(world)
    out: dict = {"took": {}}
    for name, case in (("placement", _placement_cases), ("cleanup", _cleanup_cases), ("refusals", _refusal_cases),
                       ("write error", _write_error_case), ("measure", _measure_case), ("split refused", _split_refused_case),
                       ("shared root", _shared_root_case), ("damage", _damage_case)):
        t0 = time.monotonic()
        case(rank, world, base, tier, sd, out)
        out["took"][name] = round(time.monotonic() - t0, 2)
        dist.barrier()
    return out


@pytest.mark.timeout(150)
def test_tier_snapshot_world4(tmp_path):
    res = run_world(world4_tier, 4, str(tmp_path), timeout=120, pg_timeout=40, separate_hosts=True)
    assert all("rank(s) 1:" in r["write_error"] for r in res)
    assert sorted(r["replica_bytes"] for r in res) == [0, 16, 16, 16], [r["replica_bytes"] for r in res]


def test_placement_rule():
    p = placement.place([7, 7, 3, 3, 5], replicas=2)  # hosts by lowest rank: {0, 1}, {2, 3}, {4}
    assert p.hosts == [[0, 1], [2, 3], [4]] and p.host_of == [0, 0, 1, 1, 2]
    assert p.copies == [(0, 1, 2), (1, 1, 3), (2, 2, 4), (3, 2, 4), (4, 0, 0)]
    assert p.held == [[0, 1, 4], [0, 1, 2, 3], [2, 3, 4]]
    assert placement.place([1, 2], replicas=5).copies == [(0, 1, 1), (1, 0, 0)]
    assert placement.place([1, 1, 1], replicas=2).copies == []  # one host: nowhere else to go


# -- a rank killed during a background snapshot ----------------------------------------------------------


def world3_killed(rank: int, world: int, base: str) -> dict:
    tier = MemoryTier(_root(base, rank), job="t")
    sd = {"x": torch.full((4 << 20,), float(rank)), "step": 1}
    pipeload.save(sd, tier, step=1)
    dist.barrier()
    h = pipeload.save(sd, tier, step=2, background=True)
    if rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)  # its worker is sending and writing: it never reaches the agreement
    t0 = time.monotonic()
    try:
        h.wait(60)
        result = {"error": None}
    except DistributedError as e:
        result = {"error": str(e), "failures": sorted(e.failures), "why": e.failures.get(1, ""),
                  "took": time.monotonic() - t0, "steps": tier.steps()}
    with open(os.path.join(base, f"result{rank}.json"), "w") as f:
        json.dump(result, f)
    return result


@pytest.mark.timeout(90)
def test_rank_killed_during_background_snapshot(tmp_path):
    with pytest.raises(WorldError, match="rank 1 failed:\nprocess exited with code -9"):
        run_world(world3_killed, 3, str(tmp_path), timeout=60, pg_timeout=30, separate_hosts=True)
    for r in (0, 2):
        value = json.load(open(tmp_path / f"result{r}.json"))
        assert value["error"] is not None, f"rank {r}: the snapshot completed without rank 1"
        # (the probe is best effort: a survivor that checks in late, on a loaded machine, is named too)
        assert 1 in value["failures"] and "stopped answering" in value["why"], value
        assert value["took"] < 30 and value["steps"] == [1], value


# -- one process -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("background", [False, True])
def test_every_kind_a_save_accepts_in_one_process(tmp_path, background):
    """What ``pipeload.save`` stores goes into the tier with its values (views resolved); what it refuses is
    refused before anything is written."""
    base = torch.complex(torch.arange(12.0), torch.arange(12.0) + 1).reshape(3, 4)
    sd = {"param": torch.nn.Parameter(torch.ones(2, 3)), "conj": base.conj(), "neg": base.conj().imag,
          "strided": torch.arange(20.0).reshape(4, 5)[:, ::2], "bf16": torch.ones(3, dtype=torch.bfloat16),
          "flag": torch.tensor(True), "empty": torch.empty(0, 2), "counter": Counter(),
          "objects": {"name": "run", "sizes": [1, 2], "t": (1.5, None)}}
    want = {k: (v.detach().resolve_conj().resolve_neg().clone() if isinstance(v, torch.Tensor) else v)
            for k, v in sd.items()}
    tier = MemoryTier(tmp_path / "h", job="one")
    got = pipeload.save(sd, tier, step=4, background=background)
    if background:
        sd["param"].data.fill_(7)  # after the call: the snapshot keeps the values at the call
        base.fill_(0)
        got.wait(30)
        got = got.stats
    assert got.step == 4 and got.copies_sent == got.copies_written == 0
    path = tf.rank_file(tier.root, 4, 0)
    assert got.file_bytes == os.path.getsize(path)
    plain = load_file(path)
    for k in ("param", "conj", "neg", "strided", "bf16", "flag", "empty"):
        assert torch.equal(plain[k], want[k]), k
    assert torch.equal(plain["counter.count"], torch.zeros(3, dtype=torch.int64))
    h = tf.read_rank_header(path, job="one")
    assert sorted(h.objects) == ["objects.name", "objects.sizes", "objects.t"]
    assert tier.steps() == [4]
    for bad, why in ((torch.empty(2, device="meta"), "meta"), (torch.ones(2).to_sparse(), "sparse")):
        with pytest.raises(StateDictError, match=f"'bad'.*{why}"):
            pipeload.save({"bad": bad, "x": torch.ones(2)}, tier, step=5, background=background)
    with pytest.raises(StateDictError, match="'obj'.*weights_only"):
        pipeload.save({"obj": object()}, tier, step=5)
    with pytest.raises(TypeError, match="step= is for a MemoryTier"):
        pipeload.save(sd, tmp_path / "dir", step=5)
    with pytest.raises(TypeError, match="staging_bytes"):
        pipeload.save(sd, tier, step=5, staging_bytes=1)
    with pytest.raises(ValueError, match="step must be an integer"):
        pipeload.save(sd, tier, step=-1)
    assert sorted(os.listdir(tier.root)) == ["TIER.json", "step-000000000004"]


@pytest.mark.asyncio
async def test_save_async_into_a_tier(tmp_path):
    """``save_async`` snapshots too: the event loop runs while the worker writes."""
    import asyncio

    sd = {"w": torch.arange(1 << 16, dtype=torch.float32), "step": 9}
    tier = MemoryTier(tmp_path / "h", job="a")
    task = asyncio.ensure_future(pipeload.save_async(sd, tier, step=9))
    await asyncio.sleep(0)
    sd["w"].zero_()
    handle = await task
    assert handle.done() and handle.stats.step == 9 and tier.steps() == [9]
    assert torch.equal(load_file(tf.rank_file(tier.root, 9, 0))["w"], torch.arange(1 << 16, dtype=torch.float32))
