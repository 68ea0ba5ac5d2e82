"""torch's own DCP test files, run stock and under ``pipeload.dcp.install()``: what passes stock must pass
under the switch.

    python bench/torch_dcp_tests.py DIR [--files test_a.py test_b.py] [--timeout 900] [--test-timeout 300]
                                        [--same-host] [--gpu-tests-on-cpu] [--json OUT] [-k EXPR]

``DIR`` holds torch's test files for DCP: ``test/distributed/checkpoint/*.py`` of the pytorch repository
at the installed torch's commit (``python -c "import torch; print(torch.version.git_version)"``; the
main branch is close to it). They are not in the wheel (the helpers they import,
``torch.testing._internal.distributed...``, are). To obtain them::

    git clone --filter=blob:none --no-checkout https://github.com/pytorch/pytorch /tmp/pytorch
    git -C /tmp/pytorch sparse-checkout set test/distributed/checkpoint
    git -C /tmp/pytorch checkout $(python -c "import torch; print(torch.version.git_version)")
    python bench/torch_dcp_tests.py /tmp/pytorch/test/distributed/checkpoint --files \\
        test_file_system_checkpoint_cpu.py test_hf_safetensor_e2e.py test_hf_storage.py

(or copy single files with ``git show <commit>:test/distributed/checkpoint/<file>``). Without
``--files``, every ``test_*.py`` directly in ``DIR``. Files that need GPUs skip on a CPU machine.

Each file runs twice with pytest, one run at a time (``--timeout`` bounds a run; ``--test-timeout`` each
test, through pytest-timeout): **stock**, and **install**, where every Python process calls
``pipeload.dcp.install()`` at start-up. torch's ``MultiProcessTestCase`` spawns (or forks) its ranks, so
the switch cannot be set from the test process alone: the runner puts a directory first on
``PYTHONPATH`` whose ``sitecustomize`` imports this file and calls :func:`activate`, in the pytest
process and in every rank it starts (a forked rank inherits it). :func:`activate` also wraps DCP's
``state_dict_loader._load_state_dict`` (the installed engine in front of it, or DCP's own in the stock
run) to write one JSON line per ``dcp.load`` call and rank: the test (``PYTEST_CURRENT_TEST``, which a
spawned rank inherits), whether the switch was on, and under install the path the call took
(``last_load().path``: ``engine`` or ``dcp``, with the reason; ``engine!`` for a call the engine failed),
so a table that shows engine calls proves the switch was active in the ranks, and the checkout each
process imported ``pipeload`` from: the runner puts its own checkout right after the hook on
``PYTHONPATH`` (ahead of an editable install of another checkout, whose finder comes after the path), and
the table's note says so should a call's ``pipeload`` come from elsewhere. Under install, each
``dcp.save`` / ``dcp.async_save`` the switch decides is recorded too (the path and reason it records in
``last_save_stats()``). Unless ``--same-host``, each rank sets ``PIPELOAD_HOST_ID`` to its own emulated
host as its process group starts (``init_process_group`` is wrapped; and again before each load), so
pipeload saves and broadcasts across "hosts" as on separate nodes. ``--gpu-tests-on-cpu`` runs the tests
that ``skip_if_lt_x_gpu(n)`` gates (most DTensor ones: ``DTensorTestBase`` is a gloo world of CPU ranks
on a machine without GPUs) in both runs; those that need a GPU for real then fail in both.
The test helpers need ``expecttest`` (``pip install expecttest``), which torch's wheel does not pull.

The table: per file, passed/failed/skipped stock and under install, the ``dcp.load`` calls (one per
rank) that took the engine vs DCP's path, and the same for the saves under install; then the reasons
loads and saves went DCP's way, and every test that passes stock and fails under install, with the head
of its failure.
"""

from __future__ import annotations

import argparse
import collections
import glob
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET

MODE_ENV = "PIPELOAD_TORCH_DCP_MODE"  # "stock" or "install": set by the runner for both runs
LOG_ENV = "PIPELOAD_TORCH_DCP_LOG"  # the directory each process appends its call records to
HOSTS_ENV = "PIPELOAD_TORCH_DCP_HOSTS"  # "1": each rank its own emulated host
CPU_ENV = "PIPELOAD_TORCH_DCP_GPU_TESTS_ON_CPU"  # "1": skip_if_lt_x_gpu(n) runs the test on a CPU machine
_SITECUSTOMIZE = """\
import os, sys
if os.environ.get({mode!r}):
    sys.path.insert(0, {bench!r})
    try:
        import torch_dcp_tests as _pipeload_torch_dcp_tests
        _pipeload_torch_dcp_tests.activate()
    finally:
        sys.path.remove({bench!r})
"""


# -- in every process of a run ------------------------------------------------------------------------


def activate() -> None:
    """Run at the start of each process of a run: under ``install`` mode, ``pipeload.dcp.install()``;
    in both modes, DCP's ``_load_state_dict`` (whatever is in place) wrapped to record each call."""
    import torch.distributed.checkpoint.state_dict_loader as sdl

    mode = os.environ.get(MODE_ENV)
    if os.environ.get(CPU_ENV) == "1":
        _gpu_tests_on_cpu()
    _host_at_init()
    if mode == "install":
        import pipeload.dcp

        pipeload.dcp.install()
        _record_saves()
    inner = sdl._load_state_dict
    if getattr(inner, "_pipeload_torch_dcp_record", False):
        return
    recording = _recording(inner, mode)
    for name, module in list(sys.modules.items()):  # format_utils binds the function by name
        if name.startswith("torch.distributed.checkpoint") and getattr(module, "_load_state_dict", None) is inner:
            module._load_state_dict = recording


def _gpu_tests_on_cpu() -> None:
    """``skip_if_lt_x_gpu(n)`` as ``skip_if_lt_x_gpu(n, allow_cpu=True)``, before any test module binds it:
    torch's DTensor tests gate on GPUs although ``DTensorTestBase`` runs a gloo world of CPU ranks."""
    from torch.testing._internal import common_distributed as cd

    gate = cd.skip_if_lt_x_gpu
    if getattr(gate, "_pipeload_torch_dcp_cpu", False):
        return

    def skip_if_lt_x_gpu(x, **kwargs):
        return gate(x, **{"allow_cpu": True, **kwargs})

    skip_if_lt_x_gpu._pipeload_torch_dcp_cpu = True
    cd.skip_if_lt_x_gpu = skip_if_lt_x_gpu


def _recording(inner, mode):
    def _load_state_dict(*args, **kwargs):
        _emulate_host()
        before = _last_load()
        ok, error = True, ""
        try:
            return inner(*args, **kwargs)
        except BaseException as e:
            ok, error = False, f"{type(e).__name__}: {str(e).strip()[:200]}"
            raise
        finally:
            _record(mode, before, ok, error)

    _load_state_dict._pipeload_torch_dcp_record = True
    _load_state_dict.__wrapped__ = inner
    return _load_state_dict


def _host_at_init() -> None:
    """``init_process_group`` followed by :func:`_emulate_host`: a rank is on its own host from the start
    (its saves too, not only its loads)."""
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d

    init = c10d.init_process_group
    if getattr(init, "_pipeload_torch_dcp_record", False):
        return

    def init_process_group(*args, **kwargs):
        result = init(*args, **kwargs)
        _emulate_host()
        return result

    init_process_group._pipeload_torch_dcp_record = True
    init_process_group.__wrapped__ = init
    for module in (dist, c10d):
        if getattr(module, "init_process_group", None) is init:
            module.init_process_group = init_process_group


def _record_saves() -> None:
    """Under install: each ``dcp.save`` / ``dcp.async_save`` the switch decides, one JSON line (``kind``
    ``save``) with the path it took and why, from the statistics the switch records for every call."""
    import pipeload.dcp.save as ps

    inner = ps._record
    if getattr(inner, "_pipeload_torch_dcp_record", False):
        return

    def _record_save(stats) -> None:
        inner(stats)
        _write({"test": os.environ.get("PYTEST_CURRENT_TEST", "").split(" ")[0], "mode": "install",
                "kind": "save", "call": stats.call, "installed": True, "path": stats.path,
                "why": stats.reason or "", "ok": True, "error": "", "pid": os.getpid(),
                "pipeload": _pipeload_root(), "host": os.environ.get("PIPELOAD_HOST_ID")})

    _record_save._pipeload_torch_dcp_record = True
    ps._record = _record_save


def _emulate_host() -> None:
    if os.environ.get(HOSTS_ENV) != "1":
        return
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        os.environ["PIPELOAD_HOST_ID"] = f"emulated-node-{dist.get_rank()}"


def _last_load():
    module = sys.modules.get("pipeload.dcp")
    return module.last_load() if module is not None else None


def _pipeload_root() -> str | None:
    """The checkout this process imported ``pipeload`` from (None if it did not import it)."""
    module = sys.modules.get("pipeload")
    path = getattr(module, "__file__", None)
    return os.path.dirname(os.path.dirname(os.path.abspath(path))) if path else None


def _record(mode, before, ok: bool, error: str) -> None:
    """One JSON line: the test, the mode, whether the switch was on, the path the call took and why."""
    installed = "pipeload.dcp" in sys.modules and sys.modules["pipeload.dcp"].is_installed()
    after = _last_load()
    if not installed:
        path, why = "stock", ""
    elif after is before:  # the engine raised before it recorded the call (an error past planning)
        path, why = "engine!", error
    else:
        path, why = after.path, after.why
    line = {"test": os.environ.get("PYTEST_CURRENT_TEST", "").split(" ")[0], "mode": mode,
            "installed": installed, "path": path, "why": why, "ok": ok, "error": error, "pid": os.getpid(),
            "pipeload": _pipeload_root(), "host": os.environ.get("PIPELOAD_HOST_ID")}
    _write(line)


def _write(line: dict) -> None:
    logdir = os.environ.get(LOG_ENV)
    if logdir:
        with open(os.path.join(logdir, f"{os.getpid()}.jsonl"), "a") as f:
            f.write(json.dumps(line) + "\n")


# -- the runner ---------------------------------------------------------------------------------------


_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the checkout this runner is in


def _hook_dir(root: str) -> str:
    """A directory whose ``sitecustomize`` calls :func:`activate` (when the mode is set)."""
    hook = os.path.join(root, "hook")
    os.makedirs(hook, exist_ok=True)
    bench = os.path.dirname(os.path.abspath(__file__))
    with open(os.path.join(hook, "sitecustomize.py"), "w") as f:
        f.write(_SITECUSTOMIZE.format(mode=MODE_ENV, bench=bench))
    return hook


def _run_file(path: str, mode: str, root: str, args) -> dict:
    """One pytest run of one file: its outcome per test (from the JUnit XML) and its call records."""
    name = os.path.basename(path)
    work = os.path.join(root, f"{name}.{mode}")
    logdir = os.path.join(work, "calls")
    os.makedirs(logdir)
    env = dict(os.environ)
    env.update({MODE_ENV: mode, LOG_ENV: logdir, HOSTS_ENV: "0" if args.same_host else "1",
                CPU_ENV: "1" if args.gpu_tests_on_cpu else "0",
                "PYTHONPATH": os.pathsep.join([_hook_dir(root), _REPO] + [p for p in [env.get("PYTHONPATH")] if p])})
    env.pop("PIPELOAD_HOST_ID", None)
    xml = os.path.join(work, "junit.xml")
    cmd = [sys.executable, "-m", "pytest", path, "-q", "-rN", "-p", "no:cacheprovider", "--rootdir", work,
           f"--junitxml={xml}", "-o", "junit_family=xunit1", f"--timeout={args.test_timeout}"]
    if args.k:
        cmd += ["-k", args.k]
    start = time.monotonic()
    proc = subprocess.Popen(cmd, cwd=work, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            start_new_session=True, text=True)
    try:
        out, _ = proc.communicate(timeout=args.timeout)
        timed_out = False
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # the run's own process group: pytest and its ranks
        out, _ = proc.communicate()
        timed_out = True
    with open(os.path.join(work, "pytest.out"), "w") as f:
        f.write(out)
    return {"tests": _outcomes(xml), "calls": _calls(logdir), "timed_out": timed_out, "rc": proc.returncode,
            "seconds": round(time.monotonic() - start, 1), "tail": out[-2000:], "work": work}


def _outcomes(xml: str) -> dict:
    """test id -> ("passed" | "failed" | "skipped", the head of the failure)."""
    if not os.path.exists(xml):
        return {}
    out = {}
    for case in ET.parse(xml).getroot().iter("testcase"):
        test = f"{case.get('classname', '')}.{case.get('name', '')}"
        outcome, detail = "passed", ""
        for child in case:
            if child.tag in ("failure", "error"):
                outcome, detail = "failed", (child.get("message") or child.text or "")[:600]
            elif child.tag == "skipped" and outcome == "passed":
                outcome, detail = "skipped", (child.get("message") or "")[:200]
        out[test] = (outcome, detail)
    return out


def _calls(logdir: str) -> list[dict]:
    calls = []
    for name in sorted(os.listdir(logdir)):
        with open(os.path.join(logdir, name)) as f:
            calls += [json.loads(line) for line in f if line.strip()]
    return calls


def _counts(tests: dict) -> str:
    c = collections.Counter(outcome for outcome, _ in tests.values())
    return f"{c['passed']}/{c['failed']}/{c['skipped']}"


def _row(name: str, stock: dict, ours: dict) -> tuple[list, list]:
    """The file's table row, and its regressions (passed stock, failed under install)."""
    paths = collections.Counter(c["path"] for c in ours["calls"] if c.get("kind", "load") == "load")
    saves = collections.Counter(c["path"] for c in ours["calls"] if c.get("kind") == "save")
    note = "timeout " if ours["timed_out"] or stock["timed_out"] else ""
    if ours["calls"] and not all(c["installed"] for c in ours["calls"]):
        note += "SWITCH OFF IN SOME CALLS "
    if any(c.get("pipeload") not in (None, _REPO) for c in ours["calls"]):
        note += "PIPELOAD FROM ANOTHER CHECKOUT "
    row = [name, _counts(stock["tests"]), _counts(ours["tests"]), len(stock["calls"]),
           paths["engine"] + paths["engine!"], paths["dcp"], saves["engine"], saves["dcp"],
           (note + (f"engine raised {paths['engine!']}" if paths["engine!"] else "")).strip()]
    regressions = [(name, test, ours["tests"].get(test, ("missing", "no result under install"))[1])
                   for test, (outcome, _) in sorted(stock["tests"].items())
                   if outcome == "passed" and ours["tests"].get(test, ("missing",))[0] not in ("passed",)]
    return row, regressions


def _print_table(rows: list, reasons: dict, regressions: list) -> None:
    head = ["file", "stock p/f/s", "install p/f/s", "loads stock", "engine", "dcp", "saves engine", "dcp",
            "note"]
    widths = [max(len(str(r[i])) for r in rows + [head]) for i in range(len(head))]
    for r in [head, ["-" * w for w in widths]] + rows:
        print("  ".join(str(v).ljust(w) for v, w in zip(r, widths)).rstrip())
    print("\n(loads: dcp.load calls, one per rank; engine: taken by pipeload's engine; dcp: DCP's path;"
          "\n saves: dcp.save / dcp.async_save calls under install, one per rank)")
    for kind in ("load", "save"):
        if reasons[kind]:
            print(f"\nwhy {kind}s went DCP's way (calls):")
            for why, n in reasons[kind].most_common():
                print(f"  {n:5d}  {why}")
    print(f"\npassed stock, failed under install: {len(regressions)}")
    for name, test, detail in regressions:
        print(f"  {name}::{test}\n      {' '.join(detail.split())[:400]}")


def _reason(why: str) -> str:
    """A reason without its paths and with one rank's words only, so that like calls count together."""
    why = re.sub(r"/[^\s:'\"]+", "<path>", why)
    return re.split(r" \[rank [1-9]\d*\] ", why)[0]


def _files(args) -> list[str]:
    if args.files:
        return [os.path.join(args.dir, f) for f in args.files]
    return sorted(glob.glob(os.path.join(args.dir, "test_*.py")))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("dir", help="a directory of torch's test/distributed/checkpoint files")
    parser.add_argument("--files", nargs="*", help="file names in DIR (default: every test_*.py)")
    parser.add_argument("--timeout", type=float, default=900, help="seconds for one pytest run of a file")
    parser.add_argument("--test-timeout", type=int, default=300, help="seconds for one test")
    parser.add_argument("--same-host", action="store_true", help="do not emulate a host per rank")
    parser.add_argument("--gpu-tests-on-cpu", action="store_true",
                        help="run tests gated by skip_if_lt_x_gpu on the CPU (gloo) ranks, both runs")
    parser.add_argument("-k", help="pytest -k expression, for both runs")
    parser.add_argument("--json", help="write every outcome and call record here")
    args = parser.parse_args(argv)
    root = tempfile.mkdtemp(prefix="torch_dcp_tests.")
    rows, regressions, everything = [], [], {}
    reasons = {"load": collections.Counter(), "save": collections.Counter()}
    for path in _files(args):
        stock, ours = (_run_file(path, mode, root, args) for mode in ("stock", "install"))
        row, regressed = _row(os.path.basename(path), stock, ours)
        rows.append(row)
        regressions += regressed
        for c in ours["calls"]:
            if c["path"] == "dcp":
                reasons[c.get("kind", "load")][_reason(c["why"])] += 1
        everything[os.path.basename(path)] = {"stock": stock, "install": ours}
        print(f"# {row[0]}: stock {row[1]} ({stock['seconds']} s), install {row[2]} ({ours['seconds']} s)",
              file=sys.stderr, flush=True)
    _print_table(rows, reasons, regressions)
    print(f"\nlogs: {root}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(everything, f, indent=1, default=str)
    return 1 if regressions else 0


if __name__ == "__main__":
    sys.exit(main())
