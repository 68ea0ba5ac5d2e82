"""The public entry points of saving: :func:`save` and :func:`save_async` (every rank of the group calls
them). Blocking saves run :mod:`pipeload.save.saver`'s phases in the caller's thread; background ones
hand the write and the commit to :mod:`pipeload.save.background`."""

from __future__ import annotations

import os
import time
from typing import Any

from ..engine import stateful
from ..engine._busy import Guard
from ..engine._gcpause import paused_gc
from ..engine.comm import Comm
from ..io import storage
from ..plan.statedict import check_top
from ..tier import MemoryTier
from . import background as bg
from . import saver
from .background import SaveHandle


def save(state_dict: dict, checkpoint_dir: str | os.PathLike | MemoryTier, *, process_group=None,
         background: bool = False, staging_bytes: int | None = None, storage_options: dict | None = None,
         step: int | None = None):
    """Save ``state_dict`` as a pipeload checkpoint; every rank of ``process_group`` must call it.

    Values may be ``torch.Tensor`` (whole on this rank), ``DTensor`` (Shard/Replicate placements on any
    mesh, uneven shards included) and Python objects that ``torch.load(weights_only=True)`` accepts, numpy
    values of plain dtypes included (:mod:`pipeload.formats.objects`; Python objects are assumed equal on
    every rank: one copy is stored). Replicated chunks are written
    once. Bad input raises :class:`StateDictError` on every rank, naming the key, before anything is
    written; a failed write raises :class:`DistributedError` on every rank and leaves no new loadable
    checkpoint (a checkpoint previously saved in ``checkpoint_dir`` still loads). A later save of a state
    dict of the same layout on the same group reuses the plan (:mod:`pipeload.save.savecache`). Returns this
    rank's :class:`SaveStats`.

    ``background=True`` returns a :class:`pipeload.save.background.SaveHandle` instead, once this rank's
    chunks are copied into staging (at most ``staging_bytes``; default all it owns): the caller may
    then change or free every tensor; writing and the commit go on in a worker thread (see
    :mod:`pipeload.save.background`). Saves on one group run one at a time: any save first waits for the
    group's background save in flight to finish. ``Stateful`` values are saved as their ``state_dict()``.
    ``storage_options``: for a URL (``s3://bucket/prefix``), as for :func:`pipeload.load`.

    A :class:`pipeload.MemoryTier` as the location snapshots every rank's whole state at ``step`` (required)
    into host memory, with copies on other hosts (:mod:`pipeload.tier.snapshot`): the same values are
    accepted and refused; blocking, it returns this rank's :class:`pipeload.tier.snapshot.SnapshotStats`;
    ``background=True`` returns a :class:`SaveHandle` once the state is staged. Every rank of the world
    must call it. ``staging_bytes`` and ``storage_options`` do not apply to a tier.
    """
    state_dict = stateful.expand(state_dict)[0]  # a Stateful value is saved as its state_dict()
    check_top(state_dict)
    if isinstance(checkpoint_dir, MemoryTier):
        if staging_bytes is not None or storage_options is not None:
            raise TypeError("pipeload.save into a MemoryTier takes no staging_bytes or storage_options")
        from ..tier import snapshot

        comm = Comm(process_group)
        bg.wait_previous(comm)
        return snapshot.save(state_dict, checkpoint_dir, step, comm, background)
    if step is not None:
        raise TypeError("step= is for a MemoryTier location; a checkpoint directory takes none")
    directory = os.fspath(checkpoint_dir)
    storage.configure(directory, storage_options)  # s3:// and other URLs (see pipeload.load)
    comm = Comm(process_group)
    bg.wait_previous(comm)
    if background:
        return bg.save(state_dict, directory, comm, staging_bytes)
    stats = saver.SaveStats()
    start = time.perf_counter()
    with paused_gc(), Guard() as guard:
        contended = guard.enter_sync(comm, comm.size > 1, f"pipeload.save into {directory}",
                                     comm.timeout.total_seconds())
        lock: list[int] = []
        try:
            saver._save(state_dict, directory, comm, guard, contended, lock, stats, start)
        finally:
            for fd in lock:
                os.close(fd)
    return stats


async def save_async(state_dict: dict, checkpoint_dir, **options: Any) -> SaveHandle:
    """``pipeload.save(..., background=True)`` awaited until the commit, without blocking the event loop
    while the checkpoint is written (planning and the snapshot run in the loop's thread, as they
    must: the caller may change the tensors once they are done). Returns the finished handle."""
    handle = save(state_dict, checkpoint_dir, background=True, **options)
    await handle.wait_async()
    return handle
