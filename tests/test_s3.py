"""Loading and saving ``s3://`` checkpoints against a real S3 server (moto) on 127.0.0.1.

One moto server per module, with a fault-injecting proxy in front of it that logs every request:
one proxy port ("link") per rank, so requests and bytes are counted per rank. Faults are chosen by
bucket (the proxy's rules match the request path), so one spawned world of 4 gloo ranks (TP2 x DP2,
each rank its own emulated host) runs every sub-case: bit-exact loads of the pipeload, DCP and HF
layouts, the bytes and GETs read-once costs, 503s/resets/short bodies, an exhausted retry budget, an
object replaced mid-load, a save into S3 that loads back. A killed save runs in its own process.
"""

from __future__ import annotations

import math
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch
import torch.distributed as dist

pytest.importorskip("obstore")
pytest.importorskip("moto")

import pipeload  # noqa: E402
from pipeload.tools._world import run_world  # noqa: E402
from pipeload.tools.s3testing import Faults, FaultProxy, LocalS3  # noqa: E402

import layouts as L  # noqa: E402

BIG = {f"w{i}": (1024, 1024) for i in range(4)}  # float32, 4 MiB each; sharded on tp, replicated on dp
BIG_BYTES = sum(math.prod(s) * 4 for s in BIG.values())
BUCKETS = ("clean", "flaky", "broken", "swap", "saves")


@pytest.fixture(scope="module")
def s3():
    with LocalS3() as server:
        for b in BUCKETS:
            server.bucket(b)
        faults = Faults(rules=[("/flaky/", {"p503": 0.10, "preset": 0.03, "pshort": 0.03, "first": "503"}),
                               ("/broken/big/data-", {"p503": 1.0})], seed=7)
        with FaultProxy(server.port, links=4, faults=faults) as proxy:
            yield server, proxy


def _big(mesh, fill: bool) -> dict:
    from torch.distributed.tensor import Replicate, Shard

    out = {}
    for name, shape in BIG.items():
        g = L.global_value(name, shape, torch.float32) if fill else torch.zeros(shape)
        out[name] = L.make_dtensor(g, mesh, [Replicate(), Shard(0)])
    return out


def _check_big(sd: dict, where: str) -> None:
    for name, shape in BIG.items():
        g = L.global_value(name, shape, torch.float32)
        t = sd[name]
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

        lengths, offsets = compute_local_shape_and_global_offset(g.shape, t.device_mesh, t.placements)
        assert torch.equal(t.to_local(), L.narrow(g, offsets, lengths)), f"{where}: {name} differs"


def _fails(fn, *needles) -> tuple[str, float]:
    """:func:`layouts.expect_error` and how long the failure took."""
    t0 = time.monotonic()
    return L.expect_error(fn, *needles), time.monotonic() - t0


def _setup(rank, root, meshes, server_url, port) -> None:
    """Save the checkpoints locally (all ranks), then rank 0 uploads them to each bucket that needs them."""
    import torch.distributed.checkpoint as dcp
    from safetensors.torch import save_file

    mesh = meshes.get((2, 2))
    pipeload.save(_big(mesh, True), os.path.join(root, "big"))
    pipeload.save(L.build("tp2dp2", meshes), os.path.join(root, "small"))
    dcp.save(L.build("tp2dp2", meshes), checkpoint_id=os.path.join(root, "dcp"))
    if rank == 0:
        hf = os.path.join(root, "hf")
        os.makedirs(hf)
        full = {k: L.global_value(k, s, d) for k, (s, d) in L.TENSORS.items()}
        names = sorted(full)
        save_file({k: full[k] for k in names[:5]}, os.path.join(hf, "model-1.safetensors"))
        save_file({k: full[k] for k in names[5:]}, os.path.join(hf, "model-2.safetensors"))
        os.makedirs(os.path.join(root, "file"))
        torch.save(_whole_file(), os.path.join(root, "file", "ckpt.pt"))
        up = LocalS3(port)
        for bucket, prefix, local in (("clean", "big", "big"), ("clean", "big-every", "big"),
                                      ("clean", "small", "small"), ("clean", "dcp", "dcp"), ("clean", "hf", "hf"),
                                      ("flaky", "big", "big"), ("flaky", "small", "small"),
                                      ("broken", "big", "big"), ("swap", "big", "big"), ("swap", "hf", "hf"),
                                      ("clean", "file", "file")):
            up.upload(os.path.join(root, local), bucket, prefix)
    dist.barrier()


def _whole_file() -> dict:
    """What load_file reads from S3: 12 MiB of tensors (two 8 MiB parts) and Python objects."""
    return {"model": {"w": L.global_value("file.w", (3 << 20,), torch.float32), "b": torch.arange(7)},
            "epoch": 2, "betas": (0.9, 0.95)}


def world_s3(rank: int, world: int, root: str, port: int, links: list[str]) -> dict:
    meshes = L.Meshes(world)
    mesh = meshes.get((2, 2))
    opts = LocalS3.options(links[rank])
    t0 = time.monotonic()
    _setup(rank, root, meshes, links[rank], port)
    if rank == 0 and os.environ.get("S3_TEST_TIMES"):
        print(f"setup {time.monotonic() - t0:.2f}", file=sys.stderr)
    out: dict = {}

    def big(url, fill=False, **kw):
        sd = _big(mesh, fill)
        stats = pipeload.load(sd, url, storage_options=opts, **kw)
        _check_big(sd, url)
        return stats

    _t = [time.monotonic()]

    def lap(what):
        if rank == 0 and os.environ.get("S3_TEST_TIMES"):
            print(f"{what}: {time.monotonic() - _t[0]:.2f}s", file=sys.stderr, flush=True)
        _t[0] = time.monotonic()

    lap("setup")
    out["big"] = big("s3://clean/big")
    lap("big")
    out["big_every"] = big("s3://clean/big-every", broadcast_replicated_tensors=False)
    lap('out["big_every"] = b')
    for name in ("small", "dcp"):
        sd = L.build("tp2dp2", meshes, fill=False)
        out[name] = pipeload.load(sd, f"s3://clean/{name}", storage_options=opts)
        L.check_values(sd)
    for name in ("small", "dcp"):  # into another layout: part delivery by runs (a DCP object's hold whole blobs)
        sd = L.build("shard1", meshes, fill=False)
        out[f"{name} shard1"] = pipeload.load(sd, f"s3://clean/{name}", storage_options=opts)
        L.check_values(sd)
    sd = L.build("tp2dp2", meshes, fill=False, keys=set(L.TENSORS))
    out["hf"] = pipeload.load(sd, "s3://clean/hf", storage_options=opts)
    lap('out["hf"] = pipeload')
    L.check_values(sd)

    # 503s, resets and short bodies on the flaky bucket: retried, the values exact
    out["flaky"] = big("s3://flaky/big")
    lap('out["flaky"] = big("')
    sd = L.build("tp2dp2", meshes, fill=False)
    out["flaky_small"] = pipeload.load(sd, "s3://flaky/small", storage_options=opts)
    lap('out["flaky_small"] =')
    L.check_values(sd)

    # every data GET answered 503: the budget runs out, every rank raises, promptly
    tight = {**opts, "retries": 2, "retry_base": 0.01}
    sd = _big(mesh, False)
    out["broken"] = _fails(lambda: pipeload.load(sd, "s3://broken/big", storage_options=tight),
                           "s3://broken/big/data-", "failed on rank", "503")
    lap('"s3://broken/big/dat')

    # the proxy replaces a data object at its first data GET: the load fails, never mixes versions
    sd = _big(mesh, False)
    out["swap"] = _fails(lambda: pipeload.load(sd, "s3://swap/big", storage_options=opts),
                         "s3://swap/big/data-", "replaced")
    lap('"s3://swap/big/data-')

    # ... and an HF object, after rank 0 read its header for the table every rank opens it from: the
    # ETag rank 0 read it at pins every data GET, so every rank fails naming it, none reads stale values
    sd = L.build("tp2dp2", meshes, fill=False, keys=set(L.TENSORS))
    out["swap_hf"] = _fails(lambda: pipeload.load(sd, "s3://swap/hf", storage_options=opts),
                            "s3://swap/hf/model-", "replaced")
    lap('"s3://swap/hf/model-')

    # a save into S3 loads back exactly (pipeload layout, objects included)
    sd = L.build("tp2dp2", meshes)
    pipeload.save(sd, "s3://saves/ck", storage_options=opts)
    sd = L.build("tp2dp2", meshes, fill=False)
    out["saved"] = pipeload.load(sd, "s3://saves/ck", storage_options=opts)
    lap('out["saved"] = pipel')
    L.check_values(sd)

    # one whole file every rank loads: fetched by its reader alone (through its link), broadcast
    fs = pipeload.FileStats()
    got = pipeload.load_file("s3://clean/file/ckpt.pt", storage_options=opts, stats=fs)
    want = torch.load(os.path.join(root, "file", "ckpt.pt"))
    out["file"] = (fs, torch.equal(got["model"]["w"], want["model"]["w"]) and got["epoch"] == 2
                   and got["betas"] == (0.9, 0.95) and torch.equal(got["model"]["b"], want["model"]["b"]))
    lap("load_file")
    return out


def _gets(proxy, prefix: str, link=None):
    return [r for r in proxy.requests("GET", link) if r.path.startswith(prefix)]


@pytest.mark.timeout(420)  # one spawned world for every case: 106-175 s measured here under load average 15-30
def test_s3_world(s3, tmp_path):
    server, proxy = s3
    data = {}

    def swap(req):  # first data GET of each swap checkpoint (past its header): replace that object
        for prefix, name in (("/swap/big/data-", "swapped"), ("/swap/hf/model-", "swapped_hf")):
            if req.path.startswith(prefix) and req.range and not req.range.startswith("bytes=0-") \
                    and name not in data:
                key = req.path[len("/swap/"):].split("?")[0]
                body = server.client().get_object(Bucket="swap", Key=key)["Body"].read()
                server.client().put_object(Bucket="swap", Key=key, Body=body[:-8] + b"\x00" * 8)
                data[name] = key

    proxy.set(hook=swap)
    links = [proxy.url(i) for i in range(4)]
    try:
        res = run_world(world_s3, 4, str(tmp_path), server.port, links, timeout=360, separate_hosts=True)
    finally:
        proxy.set(hook=None)
    part = 8 << 20
    objects = len(server.client().list_objects_v2(Bucket="clean", Prefix="big/")["Contents"])

    # a DCP checkpoint loaded into another layout: each blob fetched whole by one rank (the owner of its
    # run), which sends the other ranks their bytes: no rank fetches a head or bytes of its own
    listed = server.client().list_objects_v2(Bucket="clean", Prefix="dcp/")["Contents"]
    dcp_bytes = sum(o["Size"] for o in listed)  # (.metadata too: rank 0 fetches it)
    fetched = sum(r["dcp shard1"].bytes_fetched for r in res)
    assert fetched <= 1.02 * dcp_bytes, (fetched, dcp_bytes)  # (1.46x when each rank fetched its own parts)
    assert sum(r["dcp shard1"].part_bytes_received for r in res) > 0

    # read once: the store sends each needed byte about once, in few large GETs
    gets = _gets(proxy, "/clean/big/")
    fetched = sum(r.sent for r in gets)
    per_rank = {i: sum(r.sent for r in gets if r.link == i) for i in range(4)}
    if os.environ.get("S3_TEST_TIMES"):
        print("fetched", fetched, "unique", BIG_BYTES, "gets", len(gets), per_rank, file=sys.stderr)
    assert fetched <= 1.02 * BIG_BYTES, (fetched, BIG_BYTES, per_rank)
    assert len(gets) <= math.ceil(BIG_BYTES / part) + 2 * objects, [(r.link, r.path, r.range) for r in gets]
    assert sum(s["big"].bytes_fetched for s in res) == fetched
    assert sum(s["big"].bytes_received for s in res) > 0  # replicas were broadcast
    # every rank reading for itself: each replicated byte is fetched by both of its holders
    every = sum(r.sent for r in _gets(proxy, "/clean/big-every/"))
    assert every >= 1.9 * BIG_BYTES, (every, BIG_BYTES)
    for name in ("small", "dcp", "hf"):
        assert res[0][name].format == {"small": "pipeload"}.get(name, name)

    # faults: retried; the GETs beyond the fault-free bound are all answered by a retry
    retries = sum(s["flaky"].retries for s in res)
    throttled = sum(s["flaky"].throttled for s in res)
    flaky = _gets(proxy, "/flaky/big/")
    assert retries > 0 and throttled > 0, (retries, throttled)
    faulted = sum(1 for r in flaky if r.fault) + sum(1 for r in _gets(proxy, "/flaky?") if r.fault)
    assert retries <= faulted + sum(s["flaky_small"].retries for s in res), (retries, faulted)
    assert len(flaky) <= math.ceil(BIG_BYTES / part) + 2 * objects + retries
    for s in res:
        assert s["flaky"].max_inflight_requests >= 1
    for rank, s in enumerate(res):
        msg, took = s["broken"]
        assert took < 15, (rank, took, msg)
        msg, _ = s["swap"]
        assert "swapped" in data and data["swapped"] in msg, (data, msg)
        msg, took = s["swap_hf"]
        assert "swapped_hf" in data and data["swapped_hf"] in msg and took < 15, (rank, data, took, msg)

    # load_file: every rank got the file; only the reader's link carried its bytes, once
    reader = res[0]["file"][0].reader
    size = res[0]["file"][0].size
    file_gets = _gets(proxy, "/clean/file/")
    assert all(s["file"][1] and s["file"][0].broadcast and s["file"][0].reader == reader for s in res)
    assert {r.link for r in file_gets} == {reader}, [(r.link, r.range) for r in file_gets]
    assert size <= sum(r.sent for r in file_gets) <= 1.02 * size and len(file_gets) == math.ceil(size / part)
    assert res[reader]["file"][0].bytes_read == size and res[(reader + 1) % 4]["file"][0].bytes_received == size


SAVE_SCRIPT = textwrap.dedent("""
    import sys, torch, pipeload
    from pipeload.tools.s3testing import LocalS3
    url, endpoint, value = sys.argv[1], sys.argv[2], float(sys.argv[3])
    sd = {"w": torch.full((1 << 20,), value), "step": int(value)}
    pipeload.save(sd, url, storage_options=LocalS3.options(endpoint, part_size=5 << 20))
""")


def test_s3_killed_save_keeps_previous(s3, tmp_path):
    """A save killed at its .metadata PUT (the proxy kills the process there) leaves the previous
    checkpoint loading; the data objects it had uploaded are never referenced."""
    server, proxy = s3
    url = "s3://saves/killed"
    subprocess.run([sys.executable, "-c", SAVE_SCRIPT, url, proxy.url(0), "1"], check=True, timeout=120)
    state = {}

    def kill(req):
        if req.method == "PUT" and req.path.startswith("/saves/killed/.metadata") and "pid" in state:
            os.kill(state["pid"], signal.SIGKILL)
            req.fault = "reset"

    proxy.set(hook=kill)
    try:
        p = subprocess.Popen([sys.executable, "-c", SAVE_SCRIPT, url, proxy.url(0), "2"])
        state["pid"] = p.pid
        assert p.wait(timeout=120) == -signal.SIGKILL
    finally:
        proxy.set(hook=None)
    keys = [o["Key"] for o in server.client().list_objects_v2(Bucket="saves", Prefix="killed/")["Contents"]]
    assert sum(k.startswith("killed/data-") for k in keys) == 2, keys  # the killed save's data is there
    sd = {"w": torch.zeros(1 << 20), "step": 0}
    stats = pipeload.load(sd, url, storage_options=LocalS3.options(proxy.url(0)))
    assert torch.equal(sd["w"], torch.full((1 << 20,), 1.0)) and sd["step"] == 1
    assert stats.requests >= 3 and stats.bytes_fetched >= 4 << 20


def test_the_io_loop_stops_before_the_interpreter_finalizes(s3):
    """At exit the object store's loop is stopped and its thread joined (a daemon thread stopped inside
    a native callback during finalization aborts the process); a later request starts a new loop."""
    from pipeload.io import objstore

    server, proxy = s3
    sd = {"w": torch.arange(16.0)}
    pipeload.save(sd, "s3://saves/atexit", storage_options=LocalS3.options(proxy.url(0)))
    loop = objstore.io_loop()
    assert loop.thread.is_alive()
    objstore._stop_loop()
    assert not loop.thread.is_alive()
    back = {"w": torch.zeros(16)}
    pipeload.load(back, "s3://saves/atexit", storage_options=LocalS3.options(proxy.url(0)))
    assert torch.equal(back["w"], sd["w"]) and objstore.io_loop() is not loop


def test_missing_extra_names_it(tmp_path):
    """Without obstore the error names the extra that installs it (run in a process without it)."""
    code = textwrap.dedent("""
        import sys
        sys.modules["obstore"] = None  # as if not installed
        import torch, pipeload
        try:
            pipeload.load({"x": torch.zeros(1)}, "s3://bucket/ckpt")
        except pipeload.PipeloadError as e:
            print("ERR", e)
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert "pipeload[s3]" in out.stdout, out.stdout + out.stderr


def test_s3_tools(s3, tmp_path):
    """inspect, verify and convert (to and from object storage) on s3:// URLs; the CLI from the AWS_* env."""
    from pipeload.tools.convert import convert
    from pipeload.tools.inspect import inspect_checkpoint, verify_checkpoint

    server, proxy = s3
    opts = LocalS3.options(proxy.url(0))
    sd = {"a": torch.randn(300, 200), "b": torch.arange(17), "step": 3}
    pipeload.save(sd, str(tmp_path / "ck"))
    server.upload(str(tmp_path / "ck"), "clean", "tools")
    info = inspect_checkpoint("s3://clean/tools", storage_options=opts)
    assert info["format"] == "pipeload" and len(info["files"]) == 1 and info["files"][0]["size"] > 240_000, info
    assert verify_checkpoint("s3://clean/tools", storage_options=opts) == []
    convert("s3://clean/tools", "s3://clean/tools-hf", to="hf", storage_options=opts)
    out = {"a": torch.zeros(300, 200), "b": torch.zeros(17, dtype=torch.int64)}
    assert pipeload.load(out, "s3://clean/tools-hf", storage_options=opts).format == "hf"
    assert verify_checkpoint("s3://clean/tools-hf", storage_options=opts) == []  # objects opened from the table
    assert torch.equal(out["a"], sd["a"]) and torch.equal(out["b"], sd["b"])
    convert("s3://clean/tools-hf", str(tmp_path / "back"), storage_options=opts)
    out = {"a": torch.zeros(300, 200), "b": torch.zeros(17, dtype=torch.int64)}
    pipeload.load(out, str(tmp_path / "back"))
    assert torch.equal(out["a"], sd["a"])
    # a corrupted object fails verify, naming it
    key = next(o["Key"] for o in server.client().list_objects_v2(Bucket="clean", Prefix="tools/")["Contents"]
               if "/data-" in o["Key"])
    body = bytearray(server.client().get_object(Bucket="clean", Key=key)["Body"].read())
    body[-1] ^= 0xFF
    server.client().put_object(Bucket="clean", Key=key, Body=bytes(body))
    problems = verify_checkpoint("s3://clean/tools", storage_options=opts)
    assert problems and "checksum" in problems[0], problems
    env = {**os.environ, "AWS_ENDPOINT_URL": proxy.url(0), "AWS_ACCESS_KEY_ID": "testing",
           "AWS_SECRET_ACCESS_KEY": "testing", "AWS_REGION": "us-east-1", "AWS_ALLOW_HTTP": "true"}
    r = subprocess.run([sys.executable, "-m", "pipeload", "inspect", "s3://clean/tools-hf"], env=env,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "hf" in r.stdout, r.stdout + r.stderr


def test_object_parts_views_and_header(s3, tmp_path):
    """willneed → even parts of <= part_size, bounded in flight; views exact across parts; one GET for a
    safetensors header; If-Match on every GET."""
    from safetensors.torch import save_file

    from pipeload.io import storage

    server, proxy = s3
    t = torch.arange(5 << 20, dtype=torch.int32)  # 20 MiB
    save_file({"t": t, "u": torch.ones(3)}, str(tmp_path / "x.safetensors"))
    server.client().upload_file(str(tmp_path / "x.safetensors"), "clean", "parts/x.safetensors")
    storage.configure("s3://clean/parts", LocalS3.options(proxy.url(1), part_size=8 << 20, max_requests=2))
    storage.snapshot("s3://clean/parts")
    proxy.clear()
    f = storage.open_safetensors("s3://clean/parts/x.safetensors")
    assert len(proxy.requests("GET")) == 1 and sorted(f.keys()) == ["t", "u"]  # the header: one GET
    _, _, start, end = f.entry("t")
    before = storage.counters(reset_peak=True)
    f.willneed_tensors(["t", "u"])
    got = torch.frombuffer(bytearray(f.buffer("t")), dtype=torch.int32)
    assert torch.equal(got, t)
    gets = proxy.requests("GET")[1:]
    assert len(gets) == 3 and all(r.sent <= 8 << 20 for r in gets), [(r.range, r.sent) for r in gets]
    after = storage.counters()
    assert after["max_inflight"] <= 2 and after["requests"] - before["requests"] == 3
    assert sum(r.sent for r in gets) == f.size - 65536  # nothing fetched twice
    out = torch.zeros(10, dtype=torch.int32)  # a box inside one part and across two
    f.copy_box("t", "I32", (5 << 20,), ((2 << 20) - 5,), (10,), out.data_ptr(), (0,), (1,), (10,))
    assert torch.equal(out, t[(2 << 20) - 5: (2 << 20) + 5])


def test_object_opened_from_a_recorded_header(s3, tmp_path):
    """An object opened from the header bytes another rank read (the HF table's ``file_header``): no GET
    to open it, the same entries, the same verdict as ``_fastio.read_header`` on a bad header, and a
    replaced object failing its first read by name."""
    from safetensors.torch import save_file

    from pipeload.errors import HeaderError, ReadError
    from pipeload.io import storage
    from pipeload.io._fastio import read_header

    server, proxy = s3
    path, url = str(tmp_path / "x.safetensors"), "s3://clean/shared/x.safetensors"
    save_file({"t": torch.arange(1000, dtype=torch.int32), "u": torch.ones(3)}, path)
    server.client().upload_file(path, "clean", "shared/x.safetensors")
    storage.configure(url, LocalS3.options(proxy.url(1)))
    storage.snapshot("s3://clean/shared")
    header, (size, etag, head) = storage.read_object_header(url)
    proxy.clear()
    f = storage.open_safetensors(url, size=size, etag=etag, header=head)
    assert proxy.requests("GET") == [] and {**f.header, "__metadata__": f.metadata} == header
    assert f.data_offset == len(head) and torch.equal(torch.frombuffer(bytearray(f.buffer("u")), dtype=torch.float32),
                                                      torch.ones(3))
    bad = head.replace(b'"shape":[3]', b'"shape":[4]')  # same length, 16 bytes said for 12 stored
    assert bad != head
    with open(path, "r+b") as w:
        w.write(bad)
    with pytest.raises(HeaderError) as local:
        read_header(path)
    with pytest.raises(HeaderError) as remote:
        storage.open_safetensors(url, size=size, etag=etag, header=bad)
    assert str(remote.value).replace(url, "F") == str(local.value).replace(path, "F")
    with pytest.raises(HeaderError, match="truncated"):
        storage.open_safetensors(url, size=size, etag=etag, header=head[:-1])
    server.client().put_object(Bucket="clean", Key="shared/x.safetensors", Body=open(path, "rb").read())
    g = storage.open_safetensors(url, size=size, etag=etag, header=head)  # rank 0's version: no GET yet
    with pytest.raises(ReadError, match="replaced") as e:
        g.buffer("t")
    assert url in str(e.value)


def test_hf_parts_from_s3_open_from_the_table(s3, tmp_path):
    """An HF checkpoint whose files hold parts of a tensor (``DCP_SHARDING_INFO``) loads from s3://; the
    only header GETs are the reading rank's, one per object."""
    import json

    from safetensors.torch import save_file

    server, proxy = s3
    full = torch.arange(4 * 3, dtype=torch.float32).reshape(4, 3)
    for i, rows in enumerate(((0, 1), (1, 4))):
        info = json.dumps({"w": {"saved_offsets": [rows[0], 0]}})
        save_file({"w": full[rows[0] : rows[1]].contiguous()}, str(tmp_path / f"part-{i}.safetensors"),
                  metadata={"DCP_SHARDING_INFO": info})
    server.upload(str(tmp_path), "clean", "hf-parts")
    proxy.clear()
    out = {"w": torch.zeros(4, 3)}
    stats = pipeload.load(out, "s3://clean/hf-parts", storage_options=LocalS3.options(proxy.url(3)))
    assert stats.format == "hf" and torch.equal(out["w"], full)
    heads = [r for r in proxy.requests("GET", contains="/hf-parts/") if (r.range or "").startswith("bytes=0-")]
    assert len(heads) == 2, [(r.path, r.range) for r in proxy.requests("GET")]


@pytest.mark.asyncio
async def test_s3_load_async(s3, tmp_path):
    """load_async from s3:// inside a running loop (asyncio and uvloop): the GETs run on pipeload's own
    I/O loop, never blocking or borrowing the caller's."""
    import uuid

    server, proxy = s3
    sd = {"a": torch.randn(500, 300), "n": 5}
    pipeload.save(sd, str(tmp_path / "ck"))
    prefix = f"async-{uuid.uuid4().hex[:8]}"
    server.upload(str(tmp_path / "ck"), "clean", prefix)
    out = {"a": torch.zeros(500, 300), "n": 0}
    ticks = 0

    async def tick():
        nonlocal ticks
        while True:
            await __import__("asyncio").sleep(0.001)
            ticks += 1

    import asyncio

    ticker = asyncio.ensure_future(tick())
    stats = await pipeload.load_async(out, f"s3://clean/{prefix}", storage_options=LocalS3.options(proxy.url(2)))
    ticker.cancel()
    assert torch.equal(out["a"], sd["a"]) and out["n"] == 5 and stats.bytes_fetched > 600_000


# A layout change from s3://: whole tensors loaded in slices, each rank's pieces interleaved with the
# others' (1 MiB tensors cut in four: 256 KiB pieces, 768 KiB apart). Runs and part delivery
# (pipeload.plan.partruns.runs): every byte is fetched once.
WHOLE = {**{f"r{i:02d}": ((1024, 256), 0) for i in range(44)}, **{f"c{i}": ((256, 1024), 1) for i in range(4)}}


def _whole_tensors(mesh, placements_of, fill: bool) -> dict:
    out = {}
    for name, (shape, dim) in WHOLE.items():
        g = L.global_value(name, shape, torch.float32) if fill else torch.zeros(shape)
        out[name] = L.make_dtensor(g, mesh, placements_of(dim))
    return out


def world_s3_layouts(rank: int, world: int, root: str, port: int, links: list[str]) -> dict:
    from torch.distributed.tensor import Replicate, Shard

    meshes = L.Meshes(world)
    flat, square = meshes.get((4,)), meshes.get((2, 2))
    pipeload.save(_whole_tensors(flat, lambda d: [Replicate()], True), os.path.join(root, "whole"))
    dist.barrier()
    if rank == 0:
        LocalS3(port).upload(os.path.join(root, "whole"), "clean", "whole")
    dist.barrier()
    opts = {**LocalS3.options(links[rank]), "header_get": 16 << 10}
    out = {}
    for name, mesh, placements_of in (("tp4", flat, lambda d: [Shard(d)]),
                                      ("dp2tp2", square, lambda d: [Replicate(), Shard(d)])):
        sd = _whole_tensors(mesh, placements_of, False)
        out[name] = pipeload.load(sd, "s3://clean/whole", storage_options=opts)
        for key, t in sd.items():
            g = L.global_value(key, WHOLE[key][0], torch.float32)
            from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

            lengths, offsets = compute_local_shape_and_global_offset(g.shape, t.device_mesh, t.placements)
            assert torch.equal(t.to_local(), L.narrow(g, offsets, lengths)), f"{name}: {key} differs"
        dist.barrier()
    return out


OBJECTS = {"step": 1234, "config": {"lr": 0.5, "name": "resharded", "betas": [0.9, 0.95]}}


def world_s3_resharded(rank: int, world: int, root: str, port: int, links: list[str]) -> dict:
    """Saved tp4 (each rank its file) with Python objects, loaded dp2tp2 from s3:// (values checked)."""
    from torch.distributed.tensor import Replicate, Shard

    meshes = L.Meshes(world)
    flat, square = meshes.get((4,)), meshes.get((2, 2))
    pipeload.save({**_whole_tensors(flat, lambda d: [Shard(d)], True), **OBJECTS}, os.path.join(root, "tp4"))
    dist.barrier()
    if rank == 0:
        LocalS3(port).upload(os.path.join(root, "tp4"), "clean", "tp4")
    dist.barrier()
    sd = {**_whole_tensors(square, lambda d: [Replicate(), Shard(d)], False), "step": 0,
          "config": {"lr": 0.0, "name": "", "betas": None}}
    opts = {**LocalS3.options(links[rank]), "header_get": 16 << 10}
    stats = pipeload.load(sd, "s3://clean/tp4", storage_options=opts)
    assert sd["step"] == OBJECTS["step"] and sd["config"] == OBJECTS["config"], (sd["step"], sd["config"])
    for key in WHOLE:
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

        t = sd[key]
        g = L.global_value(key, WHOLE[key][0], torch.float32)
        lengths, offsets = compute_local_shape_and_global_offset(g.shape, t.device_mesh, t.placements)
        assert torch.equal(t.to_local(), L.narrow(g, offsets, lengths)), f"tp4 -> dp2tp2: {key} differs"
    dist.barrier()
    return stats


@pytest.mark.timeout(240)
def test_s3_resharded_load_fetches_objects_and_small_tensors_once(s3, tmp_path):
    """tp4 -> dp2tp2 from s3://: the Python objects' record every rank reads, and the small tensors a rank
    reads inside another rank's range, come by delivery (one GET each at most): GETs within the bound, no
    data byte fetched by two ranks."""
    server, proxy = s3
    links = [proxy.url(i) for i in range(4)]
    res = run_world(world_s3_resharded, 4, str(tmp_path), server.port, links, timeout=200, separate_hosts=True)
    listed = server.client().list_objects_v2(Bucket="clean", Prefix="tp4/")["Contents"]
    objects = sum(o["Size"] for o in listed)
    fetched = sum(s.bytes_fetched for s in res)
    assert fetched <= 1.02 * objects, (fetched, objects, [s.bytes_fetched for s in res])
    assert sum(s.part_bytes_received for s in res) > 0
    gets = _gets(proxy, "/clean/tp4/")
    assert len(gets) <= math.ceil(fetched / (8 << 20)) + 2 * len(listed), [(r.link, r.path, r.range) for r in gets]
    seen: dict[str, list[tuple[int, int, int]]] = {}  # data GETs past the headers: each byte by one rank
    for r in gets:
        if "/data-" in r.path and r.range and not r.range.startswith("bytes=0-"):
            a, b = (int(x) for x in r.range[len("bytes="):].split("-"))
            for c, d, link in seen.get(r.path, []):
                assert link == r.link or b < c or d < a, (r.path, r.link, r.range, link, c, d)
            seen.setdefault(r.path, []).append((a, b, r.link))


@pytest.mark.timeout(240)
def test_s3_layout_change_fetches_each_byte_once(s3, tmp_path):
    server, proxy = s3
    links = [proxy.url(i) for i in range(4)]
    res = run_world(world_s3_layouts, 4, str(tmp_path), server.port, links, timeout=200, separate_hosts=True)
    listed = server.client().list_objects_v2(Bucket="clean", Prefix="whole/")["Contents"]
    objects = sum(o["Size"] for o in listed)
    bound = 0
    for case in ("tp4", "dp2tp2"):
        fetched = sum(s[case].bytes_fetched for s in res)
        assert fetched <= 1.02 * objects, (case, fetched, objects, [s[case].bytes_fetched for s in res])
        assert sum(s[case].part_bytes_received for s in res) > 0  # the other ranks' pieces came by delivery
        bound += math.ceil(fetched / (8 << 20)) + 2 * len(listed)
    gets = _gets(proxy, "/clean/whole/")
    assert len(gets) <= bound, [(r.link, r.path, r.range) for r in gets]
    # the data objects' headers came with the metadata: one header GET each per load (rank 0's)
    data = [o["Key"] for o in listed if o["Key"].startswith("whole/data-")]
    heads = [r for r in gets if "/data-" in r.path and (r.range or "").startswith("bytes=0-")]
    assert len(heads) == 2 * len(data) and {r.link for r in heads} == {0}, [(r.link, r.path) for r in heads]
