"""pipeload: load distributed PyTorch checkpoints as fast as the storage allows.

Public API::

    pipeload.save(state_dict, "ckpt/")                       # every rank of the group
    stats = pipeload.load(state_dict, "ckpt/")               # fills state_dict in place
    stats = await pipeload.load_async(state_dict, "ckpt/")   # same, inside a running event loop
    handle = pipeload.save(state_dict, "ckpt/", background=True)  # returns after the snapshot
    handle.wait()                                            # the commit (or the save's error)
    await pipeload.save_async(state_dict, "ckpt/")           # the same, awaited
    obj = pipeload.load_file("last.ckpt")                    # torch.load's result, the file read once
    stats = pipeload.transfer(src, dst, group=pg)            # live weights into engines' buffers
    rec = pipeload.record_slices(model.load_weights, shapes) # an engine's fused layout, as Slices
    stats = pipeload.load(rec.slices, "ckpt/")              # the same views filled from a checkpoint
"""

from .errors import (CheckpointFormatError, ChecksumError, DistributedError, HeaderError, PipeloadError,
                     ReadError, SaveTimeoutError, StateDictError, TensorNotFoundError, UnpicklingError)
from .engine.loader import LoadStats, load, load_async
from .engine.wholefile import FileStats, load_file
from .save.api import save, save_async
from .save.background import SaveHandle
from .tier import MemoryTier
from .slices import Slice
from .live import Recorded, TransferError, TransferStats, record_slices, stream, transfer


def clear_plan_cache() -> None:
    """Forget every kept load plan (destroying the groups those loads created), every kept save plan and
    every kept transfer plan."""
    from .live import api as live
    from .plan import plancache
    from .save import savecache

    plancache.clear()
    savecache.clear()
    live.clear()


__all__ = [
    "save",
    "save_async",
    "SaveHandle",
    "MemoryTier",
    "load",
    "load_async",
    "LoadStats",
    "load_file",
    "FileStats",
    "clear_plan_cache",
    "transfer",
    "stream",
    "record_slices",
    "Recorded",
    "TransferStats",
    "TransferError",
    "Slice",
    "PipeloadError",
    "CheckpointFormatError",
    "HeaderError",
    "TensorNotFoundError",
    "ChecksumError",
    "StateDictError",
    "ReadError",
    "DistributedError",
    "SaveTimeoutError",
    "UnpicklingError",
]
__version__ = "0.1.0"


def __getattr__(name: str):
    """``pipeload.dcp`` (the storage reader for ``dcp.load``) is imported on first use: it pulls in
    torch.distributed.checkpoint, which a plain load does not need."""
    if name == "dcp":
        import importlib

        return importlib.import_module(".dcp", __name__)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
