"""Run a function on a local multi-process gloo world, with a deadline and per-rank tracebacks.

Used by the benchmark (``pipeload bench``) and by the test-suite. Each rank is a fresh process that
joins a ``torch.distributed`` world through a ``FileStore`` (no fixed port, no torchrun), runs
``fn(rank, world_size, *args)`` and sends back its return value or its formatted traceback. The
parent never hangs: past ``timeout`` every rank is killed and :class:`WorldError` reports which ranks
had not finished and the tracebacks of those that failed.

Ranks are forked from a ``multiprocessing`` fork server that has imported torch and pipeload once
(:data:`PRELOAD`): importing torch costs each spawned process seconds of CPU, which on a small machine
was most of a world's time. The server only imports (no thread pool, no process group, no device), so
forking it is safe; each rank gets the parent's environment as it is at the call, as a spawned process
would.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import sys
import tempfile
import time
import traceback
from datetime import timedelta
from typing import Any, Callable


class WorldError(RuntimeError):
    """A rank of a local world failed or did not finish in time."""


PRELOAD = ["numpy", "torch", "torch.distributed", "pipeload"]
_context: Any = None


def _ctx():
    """The fork-server context (started at its first use, then shared by every world of the process)."""
    global _context
    if _context is None:
        _context = mp.get_context("forkserver")
        _context.set_forkserver_preload(PRELOAD)
    return _context


def _rank_main(fn, rank: int, world: int, store_path: str, pg_timeout: float, args, results,
               separate_hosts: bool = False, env: dict | None = None) -> None:
    try:
        if env is not None:  # the parent's environment at the call, not the fork server's
            os.environ.clear()
            os.environ.update(env)
        if separate_hosts:  # each rank its own host, as pipeload's host-aware policy sees it
            os.environ["PIPELOAD_HOST_ID"] = f"emulated-node-{rank}"
        import torch
        import torch.distributed as dist

        # Ranks share this machine's cores: one intra-op thread each unless told otherwise.
        torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
        store = dist.FileStore(store_path, world)
        dist.init_process_group(
            "gloo", store=store, rank=rank, world_size=world, timeout=timedelta(seconds=pg_timeout)
        )
        try:
            value = fn(rank, world, *args)
        finally:
            try:
                dist.destroy_process_group()
            except Exception:
                pass
        results.put((rank, True, value))
    except BaseException:  # noqa: BLE001 - any failure must reach the parent as text
        results.put((rank, False, traceback.format_exc()))


def run_world(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout: float = 120.0,
    pg_timeout: float | None = None,
    separate_hosts: bool = False,
) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` spawned gloo ranks; return values by rank.

    ``fn`` must be importable by name (module level). ``pg_timeout`` is the process group's collective
    timeout (default: a little under ``timeout`` so a stuck collective surfaces as a rank traceback
    before the parent gives up). ``separate_hosts`` gives each rank its own host identity
    (``PIPELOAD_HOST_ID``), so that replicas broadcast as they would across nodes.
    """
    ctx = _ctx()
    results = ctx.Queue()
    pg_timeout = pg_timeout if pg_timeout is not None else max(5.0, timeout * 0.8)
    with tempfile.TemporaryDirectory(prefix="pipeload-world-") as tmp:
        store_path = os.path.join(tmp, "store")
        procs = [
            ctx.Process(
                target=_rank_main,
                args=(fn, r, world_size, store_path, pg_timeout, args, results, separate_hosts, dict(os.environ)),
                daemon=True,
            )
            for r in range(world_size)
        ]
        for p in procs:
            p.start()
        deadline = time.monotonic() + timeout
        values: dict[int, Any] = {}
        failures: dict[int, str] = {}
        try:
            while len(values) + len(failures) < world_size:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                try:
                    rank, ok, value = results.get(timeout=min(left, 0.5))
                except queue.Empty:
                    dead = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0)
                            and r not in values and r not in failures]
                    for r in dead:
                        failures[r] = f"process exited with code {procs[r].exitcode} before reporting"
                    continue
                (values if ok else failures)[rank] = value
                if failures:
                    # Give the other ranks a moment to report their own errors, then stop.
                    deadline = min(deadline, time.monotonic() + 10.0)
        finally:
            for p in procs:
                if p.is_alive():
                    p.kill()
            for p in procs:
                p.join(timeout=5)
    if failures or len(values) < world_size:
        missing = [r for r in range(world_size) if r not in values and r not in failures]
        parts = [f"rank {r} failed:\n{tb}" for r, tb in sorted(failures.items())]
        if missing:
            parts.append(f"rank(s) {missing} did not finish within {timeout:.0f} s")
        raise WorldError("\n".join(parts))
    return [values[r] for r in range(world_size)]


def run_world_bench(what: str, fn: Callable[[], Any]) -> tuple[Any, int | None]:
    """``(fn(), None)``, or ``(None, exit code)`` with the reason printed: 2 for a bad configuration, 1 for
    a world that failed (every bench spawns one)."""
    try:
        return fn(), None
    except ValueError as e:
        print(f"{what}: {e}", file=sys.stderr)
        return None, 2
    except WorldError as e:
        print(f"{what}: failed\n{e}", file=sys.stderr)
        return None, 1
