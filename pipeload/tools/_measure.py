"""How the simulations measure one rank's step: process time of a run, traced memory of a second."""

from __future__ import annotations

import gc
import time
import tracemalloc
from typing import Any

from ..engine._gcpause import paused_gc


def timed(fn, memory: bool) -> tuple[Any, float, float | None]:
    """(fn(), its process time, the tracemalloc peak in MB of a second call or None); the GC paused as in
    a load or a save. The first result is dropped before the second call, so the peak is one call's."""
    gc.collect()
    with paused_gc():
        t0 = time.process_time()
        out = fn()
        cpu = time.process_time() - t0
    peak = None
    if memory:
        del out
        gc.collect()
        tracemalloc.start()
        with paused_gc():
            out = fn()
        peak = tracemalloc.get_traced_memory()[1] / 2**20
        tracemalloc.stop()
    return out, cpu, peak
