"""pipeload: load distributed PyTorch checkpoints as fast as the storage allows.

Public API::

    pipeload.save(state_dict, "ckpt/")                       # every rank of the group
    stats = pipeload.load(state_dict, "ckpt/")               # fills state_dict in place
    stats = await pipeload.load_async(state_dict, "ckpt/")   # same, inside a running event loop
"""

from .errors import (
    CheckpointFormatError,
    ChecksumError,
    DistributedError,
    HeaderError,
    PipeloadError,
    ReadError,
    StateDictError,
    TensorNotFoundError,
)
from .loader import LoadStats, load, load_async
from .plancache import clear as clear_plan_cache
from .saver import save

__all__ = [
    "save",
    "load",
    "load_async",
    "LoadStats",
    "clear_plan_cache",
    "PipeloadError",
    "CheckpointFormatError",
    "HeaderError",
    "TensorNotFoundError",
    "ChecksumError",
    "StateDictError",
    "ReadError",
    "DistributedError",
]
__version__ = "0.1.0"


def __getattr__(name: str):
    """``pipeload.dcp`` (the storage reader for ``dcp.load``) is imported on first use: it pulls in
    torch.distributed.checkpoint, which a plain load does not need."""
    if name == "dcp":
        import importlib

        return importlib.import_module(".dcp", __name__)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
