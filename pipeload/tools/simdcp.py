"""What DCP's own central planning of a load costs its coordinator (``pipeload simulate --format dcp``).

Stock ``dcp.load`` (and any call the DCP switch leaves on DCP's path) plans in
``_DistWrapper.reduce_scatter``: every rank pickles its ``LoadPlan`` (one ``ReadItem`` per box it
loads), the coordinator gathers all of them (``gather_object``), unpickles them, runs the planner's
``create_global_plan`` and the reader's ``prepare_global_plan`` (the file-system reader's is the
identity), and pickles one plan per rank back for the scatter. This runs exactly those steps with
DCP's own classes and functions over the plans a layout gives: each rank's plan holds one ``ReadItem``
per box of :meth:`~pipeload.tools.simulate.Layout.boxes` (loaded as saved; a layout change only adds
items), pickled as ``gather_object`` pickles it.

Ranks of one class hold the same boxes, so one plan per class is built and pickled; the coordinator's
work is per rank (it unpickles W plans), so it is measured on ``min(W, MEASURED_PLANS)`` of the W plans
and scaled by W over that count: the cost is linear in W x S by construction (each plan is unpickled,
walked and pickled once). The pickles in flight (the gathered bytes) are counted whole.
"""

from __future__ import annotations

import gc
import pickle
import time
import tracemalloc
from typing import Any

MEASURED_PLANS = 1024


def _plans(lay) -> tuple[list[bytes], list[int]]:
    """(the pickled LoadPlan of each rank class, each rank's class), as ``gather_object`` sends them."""
    import torch
    from torch.distributed.checkpoint.metadata import MetadataIndex
    from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, ReadItem

    by_class: dict[tuple, int] = {}
    blobs: list[bytes] = []
    of_rank = []
    for rank in range(lay.world):
        c = lay.class_of(rank)
        if c not in by_class:
            items = []
            for t, off, ln in lay.boxes(rank):
                zero = torch.Size([0] * len(off))
                idx = MetadataIndex(t.fqn, torch.Size(off))
                items.append(ReadItem(LoadItemType.TENSOR, idx, zero, idx, zero, torch.Size(ln)))
            by_class[c] = len(blobs)
            blobs.append(pickle.dumps(LoadPlan(items)))
        of_rank.append(by_class[c])
    return blobs, of_rank


def coordinator_cost(lay, memory: bool = True) -> dict[str, Any]:
    """The coordinator's process time, its traced peak memory (the plans it holds; a second pass, as
    tracing slows the first) and the bytes it gathers and scatters, for the layout's W ranks."""
    blobs, of_rank = _plans(lay)
    world = lay.world
    measured = min(world, MEASURED_PLANS)
    scale = world / measured
    gc.collect()
    t0 = time.process_time()
    items, scattered = _central_step(blobs, of_rank[:measured])
    cpu = time.process_time() - t0
    peak = None
    if memory:
        gc.collect()
        tracemalloc.start()
        _central_step(blobs, of_rank[:measured])
        peak = tracemalloc.get_traced_memory()[1] * scale / 2**20
        tracemalloc.stop()
    return {"dcp_coordinator_cpu_s": cpu * scale, "dcp_coordinator_peak_mb": peak,
            "dcp_gathered_bytes": sum(len(blobs[c]) for c in of_rank), "dcp_scattered_bytes": int(scattered * scale),
            "dcp_read_items": int(items * scale), "dcp_plans_measured": measured}


def _central_step(blobs: list[bytes], of_rank: list[int]) -> tuple[int, int]:
    """The coordinator's step over the plans of these ranks: (read items, bytes scattered back)."""
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

    plans = [pickle.loads(blobs[c]) for c in of_rank]
    plans = DefaultLoadPlanner().create_global_plan(plans)
    return sum(len(p.items) for p in plans), sum(len(pickle.dumps(p)) for p in plans)
