"""Accelerate (and the transformers ``Trainer``): a state directory's shared files read once per group.

::

    from pipeload.integrations import accelerate as pl_accelerate

    accelerator = Accelerator()
    handle = pl_accelerate.enable(accelerator)   # load_state reads each shared file once per group
    accelerator.load_state("ckpt/step-1000")     # every rank, as before
    handle.last_stats                            # {"model.safetensors": stats, "optimizer.bin": stats, ...}
    pl_accelerate.disable(accelerator)           # back to stock

    # transformers: the Trainer loads the files itself, with torch.load / safetensors' load_file
    with pl_accelerate.reading_once(trainer.accelerator, "out/checkpoint-500"):
        trainer.train(resume_from_checkpoint="out/checkpoint-500")

How: ``Accelerator.load_state`` has no hook that sees the optimizer, scheduler or sampler files, and the
Trainer reads its own. So for the length of the call, on the calling thread only, ``torch.load`` and
``safetensors.torch.load_file`` are routed: a call naming a file every rank loads (:data:`SHARED_FILES`:
``model.safetensors``, ``pytorch_model.bin``, ``optimizer.bin``/``.pt``, ``scheduler.bin``/``.pt``,
``sampler.bin``, ``dl_state_dict.bin``, ``scaler.pt``, ``custom_checkpoint_<n>.pkl``) goes to
:func:`pipeload.load_file` after the ranks agreed in the group's store that each of them made it
(:mod:`pipeload.integrations._agree`); everything else (the per-rank ``random_states_<rank>.pkl`` and
``rng_state_<rank>.pth``, file objects, other threads, other directories, calls with arguments
``load_file`` does not take) is the original function, untouched. Both names are restored when the call
returns or raises; ``save_state`` is not touched.

Under FSDP the model and optimizer go through ``torch.distributed.checkpoint`` (a ``FileSystemReader``
Accelerate builds): the call runs under :func:`pipeload.dcp.installed` and no file is routed (with a
full state dict only rank 0 reads ``optimizer.bin``, so routing it would wait on ranks that never come).
DeepSpeed, Megatron-LM and XLA load with their own engines and are left alone.
"""

from __future__ import annotations

import contextlib
import functools
import os
import re
import threading
from typing import Any, Iterator

try:
    from accelerate.utils import DistributedType
except ImportError as e:  # pragma: no cover - exercised only without accelerate installed
    raise ImportError("pipeload.integrations.accelerate needs the `accelerate` package") from e

from ..device import accelerator
from ._agree import load_once, weights_only_of

__all__ = ["enable", "disable", "reading_once", "ReadOnce", "SHARED_FILES"]

SHARED_FILES = re.compile(
    r"(model|pytorch_model)(_\d+)?\.(safetensors|bin)"
    r"|(optimizer|scheduler|sampler|dl_state_dict)(_\d+)?\.(bin|pt)"
    r"|scaler\.pt|custom_checkpoint_\d+\.pkl"
)
_NOT_ROUTED = ("FSDP", "DEEPSPEED", "MEGATRON_LM", "XLA")
_ATTR = "_pipeload_read_once"


class ReadOnce:
    """What :func:`enable` and :func:`reading_once` route; ``last_stats`` maps each file name read through
    :func:`pipeload.load_file` during the last call to its statistics (a file read rank by rank: ``None``)."""

    def __init__(self, accelerator: Any, directory: str | None, agree_timeout: float) -> None:
        self.accelerator = accelerator
        self.directory = os.path.realpath(directory) if directory is not None else None
        self.agree_timeout = agree_timeout
        self.last_stats: dict[str, Any] = {}
        kind = getattr(accelerator, "distributed_type", DistributedType.NO)
        self.sharded = str(getattr(kind, "name", kind)) == "FSDP"
        self.routes_files = str(getattr(kind, "name", kind)) not in _NOT_ROUTED

    def takes(self, f: Any, extra: dict) -> bool:
        """Whether a ``torch.load``/``load_file`` call goes to :func:`pipeload.load_file`."""
        if not self.routes_files or extra or not isinstance(f, (str, os.PathLike)):
            return False
        path = os.fspath(f)
        if "://" in path or not SHARED_FILES.fullmatch(os.path.basename(path)):
            return False
        return self.directory is None or os.path.realpath(os.path.dirname(path) or ".") == self.directory

    def load(self, path: Any, fallback, **load_kwargs: Any) -> Any:
        path = os.fspath(path)
        _local.scope = None  # what load_file calls inside is not routed again
        try:
            obj, stats = load_once("accelerate", path, fallback, timeout=self.agree_timeout, **load_kwargs)
        finally:
            _local.scope = self
        self.last_stats[os.path.basename(path)] = stats
        return obj

    @contextlib.contextmanager
    def active(self) -> Iterator["ReadOnce"]:
        """Route this thread's loads for the length of the block (and switch DCP under FSDP)."""
        self.last_stats = {}
        with contextlib.ExitStack() as stack:
            if self.sharded:
                from .. import dcp

                stack.enter_context(dcp.installed())
            stack.enter_context(_routing(self))
            yield self


def enable(accelerator: Any, *, agree_timeout: float = 60.0) -> ReadOnce:
    """Make ``accelerator.load_state`` read each shared file of the state directory once per group.

    Every rank calls ``load_state`` as before. Idempotent; returns the :class:`ReadOnce` whose
    ``last_stats`` describe the last ``load_state``. Undone by :func:`disable`.
    """
    existing = accelerator.__dict__.get(_ATTR)
    if existing is not None:
        return existing
    state = ReadOnce(accelerator, None, agree_timeout)
    original = accelerator.load_state

    @functools.wraps(original)
    def load_state(*args: Any, **kwargs: Any) -> Any:
        with state.active():
            return original(*args, **kwargs)

    accelerator.load_state = load_state
    setattr(accelerator, _ATTR, state)
    return state


def disable(accelerator: Any) -> None:
    """Undo :func:`enable`: ``accelerator.load_state`` is the class's method again."""
    if accelerator.__dict__.pop(_ATTR, None) is not None:
        accelerator.__dict__.pop("load_state", None)


def reading_once(accelerator: Any, directory: str, *, agree_timeout: float = 60.0):
    """A context in which this thread's loads of ``directory``'s shared files are read once per group.

    For code that reads an Accelerate-style state directory itself, such as the transformers
    ``Trainer`` resuming from a checkpoint (``accelerator`` gives the distributed type: files are routed
    under DDP, DCP is switched under FSDP). Every rank must enter it.
    """
    return ReadOnce(accelerator, directory, agree_timeout).active()


# --- routing torch.load and safetensors.torch.load_file --------------------------------------------

_local = threading.local()
_lock = threading.Lock()
_depth = 0
_originals: dict[str, Any] = {}


def _routed_torch_load(f: Any, map_location: Any = None, *args: Any, **kwargs: Any) -> Any:
    original = _originals["torch.load"]
    scope = getattr(_local, "scope", None)
    extra = {k: v for k, v in kwargs.items() if k != "weights_only"}
    if args or scope is None or not scope.takes(f, extra):
        return original(f, map_location, *args, **kwargs)
    return scope.load(f, lambda: original(f, map_location, **kwargs), map_location=map_location,
                      weights_only=weights_only_of(kwargs.get("weights_only")))


def _routed_load_file(filename: Any, device: Any = "cpu", **kwargs: Any) -> Any:
    # ``backend=`` (safetensors >= 0.6: mmap or pread) says how bytes are read, not what is returned
    original = _originals["safetensors.load_file"]
    scope = getattr(_local, "scope", None)
    if scope is None or not scope.takes(filename, {k: v for k, v in kwargs.items() if k != "backend"}):
        return original(filename, device=device, **kwargs)
    # an int is an accelerator index (safetensors: a CUDA one; here whichever accelerator is present)
    where = f"{accelerator() or 'cuda'}:{device}" if isinstance(device, int) else device
    return scope.load(filename, lambda: original(filename, device=device, **kwargs), map_location=where)


@contextlib.contextmanager
def _routing(scope: ReadOnce) -> Iterator[None]:
    """Install the two routers (once for all threads; the first entry saves the originals, the last exit
    puts them back unless someone replaced them since) and make ``scope`` this thread's."""
    global _depth
    import safetensors.torch
    import torch

    with _lock:
        if _depth == 0:
            _originals["torch.load"] = torch.load
            _originals["safetensors.load_file"] = safetensors.torch.load_file
            torch.load = _routed_torch_load
            safetensors.torch.load_file = _routed_load_file
        _depth += 1
    previous = getattr(_local, "scope", None)
    _local.scope = scope
    try:
        yield
    finally:
        _local.scope = previous
        with _lock:
            _depth -= 1
            if _depth == 0:
                if torch.load is _routed_torch_load:
                    torch.load = _originals["torch.load"]
                if safetensors.torch.load_file is _routed_load_file:
                    safetensors.torch.load_file = _originals["safetensors.load_file"]
