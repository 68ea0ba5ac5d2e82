"""The ``pipeload`` command: inspect, verify (clean and every kind of corruption) and a tiny bench."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest
from safetensors.torch import load_file, save_file

import pipeload
from pipeload.tools import bench, synth
from pipeload.io._fastio import SafetensorsFile
from pipeload.tools.cli import main
from pipeload.tools.inspect import inspect_checkpoint, verify_checkpoint
from pipeload.formats.metadata import METADATA_FILE, Metadata, read_metadata

SMALL = dict(layers=1, experts=2)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A one-process checkpoint of the synthetic model (some tensors chunked by hand) plus objects."""
    root = tmp_path_factory.mktemp("ckpt")
    sd = synth.build_state_dict(None, 3, 1, **SMALL)
    path = str(root / "ckpt")
    pipeload.save(sd, path)
    return path


@pytest.fixture
def ckpt(saved, tmp_path):
    """A private copy of the saved checkpoint that a test may damage."""
    dst = str(tmp_path / "copy")
    shutil.copytree(saved, dst)
    return dst


def _md(path: str) -> Metadata:
    return read_metadata(path)


def test_inspect_summary(saved, capsys):
    info = inspect_checkpoint(saved)
    spec = synth.model_spec(1, **SMALL)
    assert info["tensors"] == len(spec.tensors()) + len(spec.step_fqns())
    assert info["objects"] >= 3  # param_groups, iteration, run (however the saver groups them)
    assert info["tensor_bytes"] == spec.model_nbytes + 4 * len(spec.step_fqns())
    assert info["dtypes"]["BF16"]["tensors"] == len(spec.tensors())
    assert info["dtypes"]["F32"]["tensors"] == len(spec.step_fqns())
    assert info["file_bytes"] == sum(f["size"] for f in info["files"]) > info["tensor_bytes"]
    assert info["layout"]["whole"] == info["tensors"] and info["layout"]["chunked"] == 0
    assert info["largest"][0]["fqn"] in ("model.model.embed_tokens.weight", "model.lm_head.weight")
    assert main(["inspect", saved]) == 0
    out = capsys.readouterr().out
    assert f"tensors     {info['tensors']} in {info['chunks']} chunks" in out
    assert "BF16" in out and "files:" in out and "objects" in out
    assert main(["inspect", "--json", saved]) == 0
    assert json.loads(capsys.readouterr().out)["save_id"] == info["save_id"]


def test_inspect_reports_chunking(tmp_path):
    md = Metadata.from_json(json.dumps({
        "format": "pipeload", "version": 1, "save_id": "0" * 16, "world_size": 2,
        "tensors": {"w": {"dtype": "F32", "shape": [4, 6], "chunks": [
            {"offsets": [0, 0], "lengths": [4, 3], "file": "a.safetensors", "key": "w@0,0", "checksum": "0" * 16},
            {"offsets": [0, 3], "lengths": [4, 3], "file": "b.safetensors", "key": "w@0,3", "checksum": "0" * 16},
        ]}},
        "objects": {},
    }))
    (tmp_path / METADATA_FILE).write_text(md.to_json())
    info = inspect_checkpoint(str(tmp_path))
    assert info["layout"] == {"whole": 0, "chunked": 1, "empty": 0, "by_chunk_count": {"2": 1},
                              "by_split_dims": {"1": 1}}
    assert [f["size"] for f in info["files"]] == [None, None]  # missing files are shown, not fatal


def test_inspect_not_a_checkpoint(tmp_path, capsys):
    assert main(["inspect", str(tmp_path)]) == 1
    assert "not a pipeload checkpoint" in capsys.readouterr().err


def test_verify_clean(saved, capsys):
    assert verify_checkpoint(saved) == []
    assert main(["verify", saved]) == 0
    assert "ok" in capsys.readouterr().out


def _a_chunk(path: str, fqn: str = "model.model.layers.0.self_attn.q_proj.weight"):
    md = _md(path)
    return md.tensors[fqn].chunks[0]


def test_verify_flipped_byte(ckpt, capsys):
    c = _a_chunk(ckpt)
    fpath = os.path.join(ckpt, c.file)
    with SafetensorsFile(fpath) as f:
        _, _, start, _ = f.entry(c.key)
    with open(fpath, "r+b") as f:
        f.seek(start + 5)
        b = f.read(1)
        f.seek(start + 5)
        f.write(bytes([b[0] ^ 0x01]))
    problems = verify_checkpoint(ckpt)
    assert len(problems) == 1
    assert problems[0].startswith(f"{c.file}: {c.key}: checksum ") and c.checksum in problems[0]
    assert main(["verify", ckpt]) == 1
    err = capsys.readouterr().err
    assert "1 problem(s)" in err and c.key in err


def test_verify_every_problem_at_once(ckpt):
    c = _a_chunk(ckpt)
    other = _a_chunk(ckpt, "model.lm_head.weight")
    assert other.file == c.file  # a world of one writes one data file
    # Drop one key and store another with the wrong shape: both are reported.
    fpath = os.path.join(ckpt, c.file)
    tensors = load_file(fpath)
    del tensors[c.key]
    tensors[other.key] = tensors[other.key].reshape(-1)
    save_file(tensors, fpath)
    problems = verify_checkpoint(ckpt)
    text = "\n".join(problems)
    assert len(problems) == 2, text
    assert f"{c.file}: {c.key}: missing (chunk of 'model.model.layers.0.self_attn.q_proj.weight')" in text
    assert f"{c.file}: {other.key}: stored as BF16 [" in text and "the metadata says BF16" in text


def test_verify_broken_and_missing_files(ckpt, capsys):
    md = _md(ckpt)
    name = md.files[0]
    with open(os.path.join(ckpt, name), "r+b") as f:
        f.write(b"\xff" * 8)  # header length far beyond the file
    problems = verify_checkpoint(ckpt)
    assert any(p.startswith(f"{name}: not a valid safetensors file") for p in problems), problems
    os.remove(os.path.join(ckpt, name))
    problems = verify_checkpoint(ckpt)
    assert any(p.startswith(f"{name}: file is missing") for p in problems), problems
    os.remove(os.path.join(ckpt, METADATA_FILE))
    assert main(["verify", ckpt]) == 1
    assert "not a pipeload checkpoint" in capsys.readouterr().err


def test_verify_corrupt_object(ckpt):
    md = _md(ckpt)
    fqn, o = sorted(md.objects.items())[0]
    fpath = os.path.join(ckpt, o.file)
    with SafetensorsFile(fpath) as f:
        _, _, start, end = f.entry(o.key)
    with open(fpath, "r+b") as f:
        f.seek(start)
        f.write(b"\x00" * min(16, end - start))
    problems = verify_checkpoint(ckpt)
    assert len(problems) == 1 and problems[0].startswith(f"{o.file}: {o.key}: checksum") and fqn in problems[0]


def test_python_dash_m(saved):
    r = subprocess.run([sys.executable, "-m", "pipeload", "verify", os.path.dirname(saved)],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 1 and "not a pipeload checkpoint" in r.stderr


def test_a_reader_that_closes_the_pipe_early_gets_no_traceback(tmp_path, capsys):
    """``pipeload inspect CKPT | head -1``: the reader goes after one line of far more than the pipe holds;
    the command ends quietly with 141 (as if ended by SIGPIPE), for both ways of starting it."""
    path = str(tmp_path / "many")
    pipeload.save({f"objects.{'x' * 1000}.{i}": i for i in range(160)}, path)
    assert main(["inspect", "--objects", path]) == 0
    assert len(capsys.readouterr().out) > 2 * 65536  # more than a Linux pipe buffers
    script = os.path.join(os.path.dirname(sys.executable), "pipeload")  # the installed entry point
    for cmd in [[sys.executable, "-m", "pipeload"]] + ([[script]] if os.path.exists(script) else []):
        p = subprocess.Popen(cmd + ["inspect", "--objects", path], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        assert p.stdout.readline().startswith(b"checkpoint")
        p.stdout.close()
        err = p.stderr.read().decode()
        assert p.wait(timeout=120) == 141 and err == "", err


# -- bench machinery -----------------------------------------------------------------------------------


def test_cache_drop_and_residency(tmp_path):
    p = str(tmp_path / "f.bin")
    with open(p, "wb") as f:
        f.write(os.urandom(4 << 20))
    bench.warm_files([p])
    assert bench.residency([p]) == 1.0
    if bench.block_device(p) is None:
        pytest.skip("not on a block device: the page cache cannot be dropped")
    bench.drop_cache([p])
    assert bench.residency([p]) < 0.05
    with open(p, "rb") as f:
        f.read(1 << 20)
    assert 0.2 <= bench.residency([p]) <= 1.0  # the first MiB, plus whatever readahead fetched


def test_floor_slices_cover_every_byte_once(tmp_path):
    paths = []
    for i, n in enumerate((5000, 0, 123457, 4096)):
        p = tmp_path / f"{i}.bin"
        p.write_bytes(os.urandom(n))
        paths.append(str(p))
    total = sum(os.path.getsize(p) for p in paths)
    for world in (1, 3, 4):
        assert sum(bench._floor_read(paths, r, world) for r in range(world)) == total


def _fake_runs():
    runs = []
    for mode, walls in (("warm", {"floor": 0.1, "pipeload": 1.0, "pipeload-nobcast": 1.0, "safetensors": 1.5,
                                  "dcp": 0.85}),
                        ("cold1", {"floor": 0.5, "pipeload": 1.0, "safetensors": 1.2}),
                        ("throttled", {"floor": 2.0, "pipeload": 2.2, "pipeload-nobcast": 4.1, "safetensors": 8.0,
                                       "dcp": 4.4})):
        for repeat in range(3):
            for loader, w in walls.items():
                run = {"mode": mode, "loader": loader, "repeat": repeat, "wall": w * (1 + 0.01 * repeat),
                       "read_bytes": 100 if loader in ("floor", "pipeload") else 200,
                       "requested_bytes": None if loader == "dcp" else 100, "resident_before": 0.0,
                       "peak_rss_mib": 500.0, "peak_rss_delta_mib": 10.0}
                if loader.startswith("pipeload"):
                    run["broadcasts"] = 7
                    run["timings"] = {k: 0.1 for k in bench.TIMING_KEYS}
                    run["plan_exchange"] = 0.12 + 0.01 * repeat + (0.1 if mode == "cold1" else 0.0)
                runs.append(run)
    return runs


def test_summary_ratios_and_targets():
    rows = bench.summarize(_fake_runs(), unique=100)
    get = {(r["mode"], r["loader"]): r for r in rows}
    pl = get[("throttled", "pipeload")]
    assert pl["wall"] == pytest.approx(2.2 * 1.01)
    assert pl["vs_floor"] == pytest.approx(1.1)
    assert pl["vs_dcp"] == pytest.approx(0.5)
    assert pl["read_amp"] == 1.0 and get[("throttled", "dcp")]["read_amp"] == 2.0
    assert get[("throttled", "dcp")]["requested_amp"] is None
    targets = {t["target"]: t for t in bench.check_targets(rows, dp=2)}
    assert targets["throttled: pipeload / floor"]["ok"] is True
    assert targets["throttled: DCP / pipeload (speed-up)"]["ok"] is True
    assert targets["warm: pipeload broadcast off / DCP"]["ok"] is False  # 1.0 / 0.85 = 1.18
    assert get[("warm", "pipeload")]["vs_plain"] == pytest.approx(1.0 / 1.5)
    assert targets["warm: pipeload / plain safetensors reader"]["ok"] is True  # 0.67
    assert targets["cold1: pipeload / plain safetensors reader"]["ok"] is False  # 0.83
    assert targets["throttled: pipeload read amplification"]["ok"] is True
    assert targets["throttled: pipeload / floor"]["value"] == pytest.approx(1.1)
    # plan + exchange: median over repeats per mode, then the worst mode (cold1: 0.23)
    assert get[("warm", "pipeload")]["plan_exchange"] == pytest.approx(0.13)
    fixed = [t for t in targets.values() if t["target"].startswith("pipeload plan + exchange")]
    assert len(fixed) == 1 and fixed[0]["value"] == pytest.approx(0.23) and fixed[0]["ok"] is False
    other = [t for t in bench.check_targets(rows, dp=2, default_size=False)
             if t["target"].startswith("pipeload plan + exchange")]
    assert other[0]["ok"] is None  # reported only away from the default size
    result = {"summary": rows, "targets": bench.check_targets(rows, dp=2)}
    assert "[ok  ]" not in bench.format_table(result)  # targets are printed for --check only
    table = bench.format_table(result, targets=True)
    assert "plain safetensors reader" in table and "torch DCP" in table and "[ok  ]" in table
    assert "plan+exch s" in table and "x plain" in table and "0.130" in table
    assert "plan" in table and "teardown" in table


def test_throttle_cgroup_roundtrip(tmp_path):
    info = bench.setup_throttle(str(tmp_path), 123)
    if not info["ok"]:
        assert info["reason"]
        pytest.skip(info["reason"])
    try:
        ctl = "blkio.throttle.read_bps_device" if "v1" in info["mechanism"] else "io.max"
        with open(os.path.join(info["dir"], ctl)) as f:
            assert str(123 * 2**20) in f.read()
    finally:
        bench.teardown_throttle(info)
    assert not os.path.exists(info["dir"])


def test_disk_reads_span():
    # samples every 10 ms: nothing for 50 ms, then 2 MiB every 10 ms up to 20 MiB, then idle
    MiB = bench.MiB
    disk = bench.DiskReads((0, 0), interval=0.01)
    for i in range(30):
        disk.times.append(100 + i * 0.01)
        disk.bytes.append(5 * MiB + min(max(0, i - 5), 10) * 2 * MiB)
    span = disk.span(100.0, 100.25)
    assert span["first_s"] == pytest.approx(0.06) and span["last_s"] == pytest.approx(0.15)
    assert span["mib"] == pytest.approx(20)
    assert disk.span(99.0, 99.5) is None  # before the first sample
    rows = bench.summarize([{"mode": "cold", "loader": "floor", "wall": 0.2, "read_bytes": 1, "requested_bytes": 1,
                             "resident_before": 0.0, "peak_rss_mib": 1.0, "peak_rss_delta_mib": 0.0, "disk": span}],
                           unique=1)
    assert rows[0]["disk"]["after_s"] == pytest.approx(0.05)
    assert "after last" in bench.format_table({"summary": rows})


@pytest.mark.timeout(120)
def test_tiny_bench_end_to_end(tmp_path, capsys):
    out = tmp_path / "r.json"
    # --tensors 40 with one layer: 5 experts, 39 tensors (the closest count the model shape allows)
    rc = main(["bench", "--world", "2", "--tp", "1", "--size", "1", "--layers", "1", "--tensors", "40",
               "--repeats", "1", "--modes", "warm,cold1,cold", "--full", "--out", str(out), "--dir", str(tmp_path / "b"),
               "--quiet", "--timeout", "100"])
    assert rc == 0
    text = capsys.readouterr().out
    head = text.split("\n\n")[0].splitlines()  # the headline comes first, at most five lines
    assert head[0].startswith("pipeload bench: 2 ranks") and len(head) <= 5
    assert any(l.startswith("separate nodes, cold page cache: pipeload") and "faster than torch DCP" in l
               for l in head)
    assert "targets:" not in text  # the pass/fail lines are --check's
    assert "separate nodes emulated" in text and "torch DCP" in text and "plain safetensors reader" in text
    assert "PIPELOAD_HOST_ID unset" in text and "plan+exch s" in text
    result = json.loads(out.read_text())
    assert result["config"]["experts"] == 5 and result["checkpoint"]["tensors"] == bench.tensor_count(1, 5) == 39
    assert {(r["mode"], r["loader"]) for r in result["runs"]} == {
        (m, l) for m in ("warm", "cold1", "cold") for l in ("floor", *bench.LOADERS)}
    assert not (tmp_path / "b" / "nodes").exists()  # per-rank copies are removed
    assert (tmp_path / "b" / "pipeload" / METADATA_FILE).exists()
    assert (tmp_path / "b" / "hf" / "model.safetensors.index.json").exists()
    by = {(r["mode"], r["loader"]): r for r in result["runs"]}
    on_block = bench.block_device(str(tmp_path)) is not None
    for mode in ("cold1", "cold"):
        assert all(by[(mode, l)]["resident_before"] == 0.0 for l in ("floor", *bench.LOADERS)) or not on_block
    if on_block:  # separate nodes: the disk's own timeline of every load (the floor's reads end when it does)
        disk = by[("cold", "floor")]["disk"]
        assert disk["mib"] > 0 and disk["last_s"] <= by[("cold", "floor")]["wall"] + 0.05, disk
        assert all("disk" in by[("cold", l)] for l in bench.LOADERS) and "disk" not in by[("warm", "floor")]
        assert "after last" in text
    # one host (warm, cold1): the default policy reads replicas from the page cache; separate nodes broadcast
    assert by[("warm", "pipeload")]["broadcasts"] == 0 and by[("cold1", "pipeload")]["broadcasts"] == 0
    assert by[("cold", "pipeload")]["broadcasts"] > 0 and by[("cold", "pipeload-nobcast")]["broadcasts"] == 0
    # the plain reader reads its own node's copy: every rank its replica's bytes, no collective
    assert by[("cold", "safetensors")]["requested_bytes"] >= 2 * result["checkpoint"]["unique_bytes"] * 0.95
    for (mode, loader), r in by.items():
        if loader.startswith("pipeload"):
            assert 0 < r["plan_exchange"] <= r["wall"] and len(r["plan_by_rank"]) == 2


def test_tiny_bench_of_the_hf_layout_with_pipeload_only(tmp_path):
    """--format hf with one loader: no DCP checkpoint is written (cold mode drops only what exists) and
    the plan-reuse measurement reads the HF copy into the tensors-only tree."""
    out = tmp_path / "r.json"
    rc = main(["bench", "--world", "2", "--tp", "1", "--size", "1", "--layers", "1", "--tensors", "40",
               "--repeats", "1", "--modes", "cold", "--format", "hf", "--loaders", "pipeload", "--out", str(out),
               "--dir", str(tmp_path / "b"), "--quiet", "--timeout", "100"])
    assert rc == 0
    result = json.loads(out.read_text())
    assert not (tmp_path / "b" / "dcp").exists()
    assert result["plan_reuse"]["reused"] is not None and result["plan_reuse"]["first"] > 0


@pytest.mark.timeout(120)
def test_tiny_whole_file_bench(tmp_path, capsys):
    """--whole-file: every row runs and is verified; load_file reads the file once, every rank 4 times."""
    out = tmp_path / "r.json"
    rc = main(["bench", "--whole-file", "--world", "2", "--size", "2", "--repeats", "1", "--out", str(out),
               "--dir", str(tmp_path / "b"), "--quiet", "--timeout", "100"])
    assert rc == 0
    text = capsys.readouterr().out
    assert "pipeload.load_file" in text and "torch.load on every rank" in text and "target:" in text
    result = json.loads(out.read_text())
    assert set(result["rows"]) == {"read alone", "torch.load alone", "torch.load on every rank", "pipeload.load_file"}
    assert not (tmp_path / "b" / "file-bench").exists()
    if bench.block_device(str(tmp_path)) is not None:  # bytes from the device: each copy dropped before
        rows, size = result["rows"], result["size"]
        assert rows["pipeload.load_file"]["read_bytes"] <= 1.02 * size
        assert rows["torch.load on every rank"]["read_bytes"] >= 1.9 * size


def test_bench_rejects_bad_layout(capsys):
    assert main(["bench", "--world", "4", "--tp", "3", "--quiet"]) == 2
    # DCP's checkpoint has no HF copy to read plainly; fewer tensors than one expert per layer allows
    assert main(["bench", "--format", "dcp", "--loaders", "safetensors", "--quiet"]) == 2
    assert main(["bench", "--tensors", "100", "--layers", "8", "--quiet"]) == 2
    assert bench.tensor_count(8, bench.experts_for(100_000, 8)) == 99_990
    assert "must equal --world" in capsys.readouterr().err


def _mismatch_case(rank, world):
    ref = synth.build_state_dict(None, 1, 1, **SMALL)
    got = synth.build_state_dict(None, 1, 1, **SMALL)
    if rank == 1:
        got["model"]["model.norm.weight"][3] = 0
    try:
        bench._all_ok(synth.same_tensors(ref, got), "a load")
    except bench._Failure as e:
        return str(e)
    return None


@pytest.mark.timeout(60)
def test_a_mismatch_on_one_rank_fails_every_rank():
    from pipeload.tools._world import run_world

    for msg in run_world(_mismatch_case, 2, timeout=50):
        assert msg is not None
        assert "a load: loaded values do not match on rank(s) [1]" in msg
        assert "[rank 1] model.model.norm.weight: 1 of" in msg
