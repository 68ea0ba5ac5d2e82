"""``dcp.load`` on pipeload's engine: what :func:`pipeload.dcp.install` puts in place of DCP's
``state_dict_loader._load_state_dict``.

DCP's ``load`` does three things: it replaces each top-level ``Stateful`` by its ``state_dict()``, calls
``_load_state_dict`` (the central plan and the reads), then hands the results back (``load_state_dict()``
of each ``Stateful``, ``state_dict[key] = value`` for the rest, so a dict subclass's ``__setitem__``
runs). Only the middle step is replaced, so the first and last stay DCP's own code, exactly.

Which path a call takes is decided from the call alone, alike on every rank (DCP requires every rank to
pass the same planner and reader):

- **the engine** (:func:`pipeload.load`: one compact exchange, no gather of plans on a coordinator,
  each shared box read once and broadcast while the next are read, the plan kept for the next load)
  when the planner is ``None`` or a plain ``DefaultLoadPlanner`` (any of its flags) and the reader is a
  file-system reader of DCP's layout or DCP's Hugging Face reader (pipeload's classes or DCP's own,
  not a subclass of either: a subclass may read differently) on a local path;
- **DCP's path** (its planner, pipeload's reader) for everything else: custom planners and readers,
  object storage through fsspec, rank-local metadata.

The engine then refuses, at planning and on every rank alike (nothing read, nothing written), what it
would not serve exactly as DCP does — a kind of tensor it cannot fill in place (the legacy
``ShardedTensor``, ``LocalShardsWrapper``, a DTensor on the meta device), a ``Stateful`` below the top
level (DCP stores it as an object), nested containers under ``flatten_state_dict=False``, stream
transforms (``ZStandard``), checkpoints pipeload does not read (overlapping chunks) — and the same call
then goes to DCP's path, which loads it or raises DCP's own error (a key missing from the checkpoint
reaches DCP's ``Missing key`` error this way). Nothing from a checkpoint is unpickled by DCP's code on
either path unless ``install(allow_pickle=True)`` said so (:mod:`pipeload.dcp.reader`).

Semantics kept: tensors filled in place, objects replaced in their containers, plain meta tensors
replaced by loaded CPU tensors (DCP's ``load`` then assigns them), keys the checkpoint has and nobody
loads ignored, missing keys an error unless ``allow_partial_load``, ``dtype`` converted as ``copy_``
does, ``no_dist=True`` (each rank alone), ``process_group=``. Failures raise
:class:`DCPLoadError`, a ``CheckpointException`` (what DCP raises) that is also a ``PipeloadError``.
"""

from __future__ import annotations

import dataclasses
import os
import traceback
from typing import Any, Callable

from torch.distributed.checkpoint import filesystem as _fs
from torch.distributed.checkpoint import hf_storage as _hf
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

from ..engine import stateful
from ..engine.loader import LoadStats
from ..errors import PipeloadError
from ..io.storage import is_url
from .reader import DCP_FILE_SYSTEM_READER, DCP_HF_READER, FileSystemReader, HuggingFaceStorageReader, StorageReader

_FS_READERS = (FileSystemReader, StorageReader, DCP_FILE_SYSTEM_READER)
_HF_READERS = (HuggingFaceStorageReader, DCP_HF_READER)


class DCPLoadError(CheckpointException, PipeloadError):
    """A ``dcp.load`` on pipeload's engine failed: DCP's ``CheckpointException`` (``failures`` maps each
    failing rank to its exception) and pipeload's error at once, raised on every rank of the load."""

    def __init__(self, error: BaseException, rank: int):
        failures = getattr(error, "failures", None)
        if isinstance(failures, dict) and failures:
            wrapped = {r: (PipeloadError(str(msg)), None) for r, msg in failures.items()}
        else:
            wrapped = {rank: (error, traceback.extract_tb(error.__traceback__))}
        super().__init__(str(error), wrapped)
        self.error = error

    def __str__(self) -> str:
        return str(self.error)


@dataclasses.dataclass
class SwitchStats:
    """What the last ``dcp.load`` under the switch did on this rank (:func:`pipeload.dcp.last_stats`).

    ``path``: ``"engine"`` (pipeload's planning and pipeline; ``load`` holds its :class:`LoadStats`) or
    ``"dcp"`` (DCP's planning with pipeload's reader; ``read`` holds the reader's statistics); ``why``:
    the reason a call went DCP's way (empty on the engine)."""

    path: str
    why: str = ""
    load: LoadStats | None = None
    read: Any = None


_last: SwitchStats | None = None


def last_load() -> SwitchStats | None:
    """What the last ``dcp.load`` under :func:`pipeload.dcp.install` did on this rank (None before one)."""
    return _last


def _directory(reader: Any) -> tuple[str | None, str]:
    """(the checkpoint's local path and format, or None and why the engine cannot take the reader)."""
    kind = type(reader)
    if kind in _FS_READERS:
        fmt = "dcp"
    elif kind in _HF_READERS:
        fmt = "hf"
    else:
        return None, f"reader {kind.__qualname__}"
    path = getattr(reader, "path", None)
    if path is None or (isinstance(path, str) and is_url(path)):
        return None, f"reader path {path!r}"
    return os.fspath(path), fmt


def _planner_options(planner: Any) -> tuple[dict | None, str]:
    """(pipeload.load options for DCP's planner, or None and why the engine does not serve it)."""
    if planner is None:
        return {"strict": "missing"}, ""
    if type(planner) is not DefaultLoadPlanner:
        return None, f"planner {type(planner).__qualname__}"
    return {"strict": False if planner.allow_partial_load else "missing",
            "_flat": bool(planner.flatten_state_dict)}, ""


def _refusal(state_dict: dict, flat: bool) -> str | None:
    """What the engine would load otherwise than DCP's planner: said at planning, on this rank."""
    if stateful.expand(state_dict)[1] is not None:
        return "a Stateful value below the top level of the state dict (DCP stores it as an object)"
    if not flat:
        for key, value in state_dict.items():
            if isinstance(value, (dict, list)) and value:
                return f"{key!r}: a container under flatten_state_dict=False (DCP stores it as one object)"
    return None


def engine_load_state_dict(original: Callable) -> Callable:
    """The replacement of ``state_dict_loader._load_state_dict``; ``original`` is DCP's, taken for
    every call the engine does not serve."""

    def _load_state_dict(state_dict: dict[str, Any], storage_reader: Any, process_group: Any = None,
                         coordinator_rank: int = 0, no_dist: bool = False, planner: Any = None) -> None:
        global _last
        directory, fmt = _directory(storage_reader)
        options, why = _planner_options(planner) if directory is not None else (None, fmt)
        if options is None:
            return _dcp_path(original, why, state_dict, storage_reader, process_group, coordinator_rank,
                             no_dist, planner)
        flat = options.pop("_flat", True)
        refusal = _refusal(state_dict, flat)
        try:
            stats = _engine(state_dict, directory, fmt, process_group, no_dist, options, refusal)
        except PipeloadError as e:
            if not e.planning:
                raise DCPLoadError(e, _rank(process_group, no_dist)) from e
            return _dcp_path(original, refusal or _first_line(e), state_dict, storage_reader, process_group,
                             coordinator_rank, no_dist, planner)
        _last = SwitchStats("engine", load=stats)

    _load_state_dict.__wrapped__ = original  # type: ignore[attr-defined]
    _load_state_dict.__doc__ = f"pipeload's engine in front of DCP's ``_load_state_dict`` ({__name__})."
    return _load_state_dict


def _engine(state_dict, directory, fmt, process_group, no_dist, options, refusal) -> LoadStats:
    from ..engine.loader import load

    return load(state_dict, directory, format=fmt, process_group=None if no_dist else process_group,
                use_collectives=not no_dist, cast=True, reuse_plan=refusal is None, _refusal=refusal,
                **options)


def _dcp_path(original, why, state_dict, storage_reader, process_group, coordinator_rank, no_dist, planner):
    """DCP's own ``_load_state_dict`` (its planner; the reader the call gave)."""
    global _last
    _last = SwitchStats("dcp", why=why)
    try:
        return original(state_dict, storage_reader, process_group=process_group,
                        coordinator_rank=coordinator_rank, no_dist=no_dist, planner=planner)
    finally:
        from .readonce import last_stats

        _last = SwitchStats("dcp", why=why, read=last_stats())


def _rank(process_group: Any, no_dist: bool) -> int:
    import torch.distributed as dist

    if no_dist or not dist.is_initialized():
        return 0
    return dist.get_rank(process_group)


def _first_line(error: BaseException) -> str:
    lines = str(error).strip().splitlines()
    return " ".join(line.strip() for line in lines[:3])
