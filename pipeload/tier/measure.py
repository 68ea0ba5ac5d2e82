"""A snapshot into the tier measured side by side with a background save of the same state (for ``pipeload
bench --tier``; every rank of the world calls it)."""

from __future__ import annotations

import os
import statistics
import time

import numpy as np

from ..engine.comm import Comm
from ..save.api import save
from . import MemoryTier


def snapshot_against_save(state_dict: dict, tier: MemoryTier, directory: str | os.PathLike, *, step: int,
                          repeats: int = 3) -> dict[str, float]:
    """This rank's medians over ``repeats`` rounds of: a background snapshot of ``state_dict`` into ``tier``
    at ``step + i`` and a background ``pipeload.save`` of it into ``directory`` (alternating which goes
    first, every rank starting each together).

    Keys: ``snapshot_blocked_s`` / ``save_blocked_s`` (the call, until the caller may change the
    tensors), ``snapshot_done_s`` / ``save_done_s`` (the call until ``wait()`` returned: complete on every
    host, committed), and from the last snapshot ``file_bytes`` (this rank's file), ``bytes_sent`` and
    ``bytes_received`` (its copies). The tier ends holding step ``step + repeats - 1``.
    """
    comm = Comm()
    runs: dict[str, list[float]] = {k: [] for k in ("snapshot_blocked_s", "snapshot_done_s", "save_blocked_s",
                                                    "save_done_s")}
    last = None
    for i in range(repeats):
        order = ("snapshot", "save") if i % 2 == 0 else ("save", "snapshot")
        for kind in order:
            comm.gather_rows(np.zeros(1, dtype=np.int64), "pipeload bench --tier", "start of a round")
            t0 = time.perf_counter()
            if kind == "snapshot":
                handle = save(state_dict, tier, step=step + i, background=True)
            else:
                handle = save(state_dict, directory, background=True)
            handle.wait()
            runs[f"{kind}_done_s"].append(time.perf_counter() - t0)
            runs[f"{kind}_blocked_s"].append(handle.blocked_seconds)
            last = handle.stats if kind == "snapshot" else last
    out = {k: statistics.median(v) for k, v in runs.items()}
    out.update(file_bytes=last.file_bytes, bytes_sent=last.bytes_sent, bytes_received=last.bytes_received)
    return out
