"""``dcp.save`` and ``dcp.async_save`` under :func:`pipeload.dcp.install`: DCP's API and layout, pipeload's
save planner.

Which path a call takes (:func:`last_save_stats` says which one it took, ``path`` = ``"engine"`` or
``"dcp"``, and why):

- **engine** — ``state_dict`` (keywords as DCP takes them) with ``checkpoint_id=`` a local path or
  ``storage_writer=`` DCP's own ``FileSystemWriter`` with its default options (``sync_files`` honoured),
  ``planner=None`` or a ``DefaultSavePlanner()`` with its defaults, any ``process_group=``, ``no_dist=``;
  for ``async_save`` also the thread checkpointer, no stager or a ``DefaultStager``, and a group that is
  the world (the background save's own group is created by every rank of the world). Every tensor is a
  plain tensor or a DTensor the save accepts (``pipeload.save``'s kinds and dtypes).
  DCP's ``Stateful`` handling (``state_dict()`` of each top-level value, before anything else) and
  ``flatten_state_dict`` run as in DCP; then pipeload's save plans (one compact exchange, each chunk
  written once, by the rank the load's greedy will make read it) and :mod:`.savelayout` writes DCP's
  files and ``.metadata``. Non-tensor values become DCP's bytes (``torch.save`` into a ``BytesIO``), one
  rank's value stored. Failures raise DCP's ``CheckpointException`` on every rank.
- **dcp** — everything else (custom planners or subclasses, writers with extensions such as
  ``ZStandard``, other options or storages, the process checkpointer, custom stagers,
  ``use_collectives=False``, positional arguments), and calls made by DCP's own async executors: DCP's
  original function, unchanged.

The decision is taken alike on every rank before anything is written, without a collective of its own:
each rank's verdict is a word of the save plan's first all-gather on the call's group (a rank that
refuses takes part in that one collective only, :func:`pipeload.save.saver.decline`), and one refusal
sends every rank there. Every rank must have the switch installed (a rank without it runs DCP's
collectives against the others' gather).

``async_save`` on the engine path is ``pipeload.save(background=True)``: the caller's thread plans and
copies what this rank writes into staging (blocked only for that share), and returns; the writes,
the agreement and the commit run on the save's worker thread with collectives on a group of their own.
It returns a ``concurrent.futures.Future`` whose result is the ``Metadata`` — or, when the call passed a
``DefaultStager`` with ``use_async_staging``, DCP's ``AsyncSaveResponse`` whose ``staging_completion`` is
already done. Every failure after the arguments were accepted is that future's exception, on every rank.
"""

from __future__ import annotations

import os
import sys
import time
import warnings
from concurrent.futures import Future
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint.state_dict_saver as dcp_saver
from torch.distributed.checkpoint import filesystem as dcp_fs
from torch.distributed.checkpoint._storage_utils import _storage_setup
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.staging import DefaultStager
from torch.distributed.tensor import DTensor, Replicate, Shard

from ..engine._busy import Guard
from ..engine._gcpause import paused_gc
from ..engine.comm import Comm
from ..errors import DistributedError
from ..formats.chunks import storable_dtype
from ..plan.statedict import tensor_box
from ..plan.tensorkinds import source_refusal
from ..save import background as bg
from ..save import savecache, saver
from .flatten import flatten_state_dict
from .savelayout import DcpPhases, object_bytes

DCP_SAVE = dcp_saver.save
DCP_ASYNC_SAVE = dcp_saver.async_save
_KEYWORDS = {"checkpoint_id", "storage_writer", "planner", "process_group", "no_dist", "use_collectives"}
_ASYNC_KEYWORDS = _KEYWORDS | {"async_checkpointer_type", "async_stager"}
_DCP_EXECUTORS = ("torch.distributed.checkpoint._async_thread_executor",
                  "torch.distributed.checkpoint._async_process_executor")


@dataclass
class DcpSaveStats:
    """This rank's view of the last ``dcp.save`` / ``dcp.async_save`` made under the switch.

    ``path``: ``"engine"`` (pipeload's planner, DCP's layout) or ``"dcp"`` (DCP's own code; ``reason``
    says why). ``blocked_s``: seconds the call kept the caller (for ``async_save``, planning and the
    copy into staging); of it ``prepare_s`` at the door (``Stateful``, flattening, the path's
    agreement), ``plan_s`` planning, and for ``save`` ``write_s`` writing this rank's file and
    ``commit_s`` the agreements, rank 0's ``.metadata`` and its broadcast; ``items_written``: items in
    this rank's file; ``plan_reused``: planned by an earlier save of the same layout. All but
    ``call``, ``path`` and ``reason`` are the engine path's."""

    call: str
    path: str
    reason: str | None = None
    blocked_s: float = 0.0
    prepare_s: float = 0.0
    plan_s: float = 0.0
    write_s: float = 0.0
    commit_s: float = 0.0
    items_written: int = 0
    staged_bytes: int = 0
    plan_reused: bool = False


_last: DcpSaveStats | None = None


def last_save_stats() -> DcpSaveStats | None:
    """The :class:`DcpSaveStats` of this process's last save call under the switch (None before one)."""
    return _last


def _record(stats: DcpSaveStats) -> None:
    global _last
    _last = stats


@dataclass
class _Call:
    """One call's arguments, checked: ``reason`` is None when the engine can take them."""

    kw: dict
    reason: str | None = None
    writer: Any = None
    comm: Comm | None = None
    directory: str = ""
    converted: bool = False  # Stateful values already replaced by their state_dict()
    offer: Any = saver.ASK  # the kept plan that matched the flattened dict (saver.plan_phase's offer)


def _writer_refusal(writer) -> str | None:
    if type(writer) is not dcp_fs.FileSystemWriter or type(writer.fs) is not dcp_fs.FileSystem:
        return f"storage writer {type(writer).__name__} (only DCP's FileSystemWriter on local files)"
    if writer.transforms.extensions:
        return "a FileSystemWriter with stream extensions"
    defaults = {"single_file_per_rank": True, "thread_count": 1, "overwrite": True,
                "serialization_format": dcp_fs.SerializationFormat.TORCH_SAVE, "cache_staged_state_dict": False}
    changed = [k for k, v in defaults.items() if getattr(writer, k, v) != v]
    return f"a FileSystemWriter with {', '.join(changed)} not at its default" if changed else None


def _planner_refusal(planner) -> str | None:
    if planner is None:
        return None
    plain = (type(planner) is DefaultSavePlanner and planner.flatten_state_dict and planner.flatten_sharded_tensors
             and not planner.dedup_save_to_lowest_rank and not getattr(planner, "_enable_plan_caching", False))
    return None if plain else f"planner {type(planner).__name__} (only a DefaultSavePlanner with its defaults)"


def _local_comm(timeout: timedelta | None = None) -> Comm:
    """A world of one whatever ``torch.distributed`` says (``no_dist=True`` inside a world)."""
    comm = Comm.__new__(Comm)
    comm.active, comm.pg, comm.rank, comm.size, comm.global_ranks = False, None, 0, 1, [0]
    comm.is_world, comm.broadcast_device = True, torch.device("cpu")
    comm.timeout = timeout or timedelta(minutes=30)
    return comm


def _check(kw: dict, asynchronous: bool) -> _Call:
    """The call's writer, group and whether the engine can take its arguments (no collective)."""
    call = _Call(kw)
    if kw.get("use_collectives", True) is not True:
        call.reason = "use_collectives=False"
        return call
    no_dist = kw.get("no_dist", False) or not dist.is_available() or not dist.is_initialized()
    try:
        call.comm = _local_comm() if no_dist else Comm(kw.get("process_group"))
    except Exception as e:  # noqa: BLE001 - DCP's own code gives this call its answer
        call.reason = f"process group: {e}"
        return call
    call.reason = _planner_refusal(kw.get("planner"))
    if asynchronous and call.reason is None:
        call.reason = _async_refusal(kw, call.comm)
    if call.reason is None:
        try:
            call.writer = _storage_setup(kw.get("storage_writer"), kw.get("checkpoint_id"), reader=False)
            call.reason = _writer_refusal(call.writer)
            call.directory = os.fspath(call.writer.path)
        except Exception as e:  # noqa: BLE001
            call.reason = f"storage: {type(e).__name__}: {e}"
    return call


def _async_refusal(kw: dict, comm: Comm) -> str | None:
    kind = kw.get("async_checkpointer_type", dcp_saver.AsyncCheckpointerType.THREAD)
    if kind != dcp_saver.AsyncCheckpointerType.THREAD:
        return f"async_checkpointer_type={kind}"
    stager = kw.get("async_stager")
    if stager is not None and type(stager) is not DefaultStager:
        return f"async_stager {type(stager).__name__}"
    if comm.size > 1 and not comm.is_world:
        return "a process group that is not the world (the background save's own group needs every rank)"
    return None


def _content_refusal(flat: dict) -> str | None:
    """Why a tensor of the flattened state dict is one pipeload's save refuses (DCP's code saves it).

    DTensors whose placements are all ``Shard`` or ``Replicate`` need no more than their local tensor's
    kind; other placements (``Partial``, strided shards) are resolved as the save will resolve them.
    The common kinds (a plain CPU or CUDA tensor, or a DTensor of one, of a storable dtype) are
    recognised with a few attribute reads a tensor and a verdict kept per dtype: this runs in
    ``dcp.async_save``'s blocked time, once per key."""
    cache: dict = {}
    dtypes: dict = {}  # dtype -> storable
    for fqn, v in flat.items():
        kind = type(v)
        if kind is DTensor:
            local, plain = v._local_tensor, _plain_placements(v._spec.placements)
        elif kind in _PLAIN_KINDS:
            local, plain = v, True
        elif isinstance(v, torch.Tensor):
            local, plain = v, False
        else:
            continue
        storable = dtypes.get(local.dtype)
        if storable is None:
            storable = dtypes[local.dtype] = bool(storable_dtype(local.dtype))
        if (plain and storable and type(local) in _PLAIN_KINDS and local.layout is torch.strided
                and (local.is_cpu or local.is_cuda) and not local.is_nested and not local.is_quantized):
            continue
        why = _tensor_refusal(fqn, v, cache)
        if why:
            return f"{fqn!r}: {why}"
    return None


_PLAIN_KINDS = (torch.Tensor, torch.nn.Parameter)
_PLAIN_PLACEMENTS = (Shard, Replicate)


def _plain_placements(placements) -> bool:
    for p in placements:
        if type(p) not in _PLAIN_PLACEMENTS:
            return False
    return True


def _tensor_refusal(fqn: str, v: torch.Tensor, cache: dict) -> str | None:
    """The full check of one tensor the common-kind test did not pass."""
    why = source_refusal(v) or (None if storable_dtype(v.dtype) else f"dtype {v.dtype}")
    if why is None and type(v) is not torch.Tensor and not (
            type(v) is DTensor and _plain_placements(v.placements)):
        try:
            tensor_box(fqn, v, cache)
        except ValueError as e:
            why = str(e)
    return why


def _decline(call: _Call) -> None:
    """A rank that cannot take the engine answers the engine ranks' first collective
    (:func:`pipeload.save.saver.decline`): every rank then takes DCP's code. No collective without a
    group (``use_collectives=False``, a group that could not be read) or alone."""
    if call.comm is not None and call.comm.size > 1:
        saver.decline(call.comm, call.directory or str(call.kw.get("checkpoint_id")))


def _declined_reason(e: saver.Declined) -> str:
    return f"rank(s) {e.ranks} cannot save through the engine"


def _split(flat: dict, mappings: dict) -> tuple[dict, dict[str, bytes]]:
    """(the planner's dict: tensors as they are, each object as DCP's bytes; the objects' bytes)."""
    leaves, objects = {}, {}
    for fqn, v in flat.items():
        if isinstance(v, torch.Tensor):
            leaves[fqn] = v
        else:
            leaves[fqn] = objects[fqn] = object_bytes(v)
    return leaves, objects


def _checkpoint_exception(e: BaseException, rank: int) -> CheckpointException:
    """DCP's exception for a failure pipeload raised alike on every rank, naming the failing ranks."""
    if isinstance(e, DistributedError):
        failures = {r: (RuntimeError(m), None) for r, m in e.failures.items()}
    else:
        failures = {rank: (e, None)}
    return CheckpointException(str(e), failures)


def _prepare(kw: dict, state_dict, asynchronous: bool):
    """(call, state dict, flattened dict, objects, mappings): the arguments checked, ``Stateful`` values
    replaced by their ``state_dict()`` and the dict flattened as DCP does. No collective: the ranks'
    verdicts meet in the plan phase's first one (a rank that refuses calls :func:`_decline`, and every
    engine rank's plan phase raises :class:`~pipeload.save.saver.Declined`)."""
    call = _check(kw, asynchronous)
    flat = objects = mappings = None
    if call.reason is None:
        state_dict = dcp_saver._stateful_to_state_dict(state_dict)
        call.converted = True
        try:
            flat, mappings = flatten_state_dict(state_dict)
            leaves, objects = _split(flat, mappings)
            call.offer = savecache.offer(call.comm, leaves)
            if call.offer is None:  # a kept plan that matched was made from tensors of the kinds checked here
                call.reason = _content_refusal(flat)
            flat = leaves
        except Exception as e:  # noqa: BLE001 - DCP's code raises it (or saves it) its own way
            call.reason = f"state dict: {type(e).__name__}: {e}"
    return call, state_dict, flat, objects, mappings


def _stock_save(call: _Call, state_dict, kw: dict):
    """DCP's own save for a call the engine does not take (with ``state_dict`` already converted when
    ``_prepare`` converted it: ``state_dict()`` is called once)."""
    if not call.converted:
        return DCP_SAVE(state_dict, **kw)
    return dcp_saver._save_state_dict(state_dict=state_dict, storage_writer=call.writer,
                                      process_group=kw.get("process_group"),
                                      no_dist=call.comm is None or not call.comm.active or kw.get("no_dist", False),
                                      planner=kw.get("planner"), use_collectives=kw.get("use_collectives", True))


def save(state_dict, *args, **kwargs):
    """``torch.distributed.checkpoint.save`` under the switch: the engine path or DCP's (see the module);
    returns DCP's ``Metadata`` on every rank either way."""
    caller = sys._getframe(1).f_globals.get("__name__")
    if args or not set(kwargs) <= _KEYWORDS or caller in _DCP_EXECUTORS:
        _record(DcpSaveStats("save", "dcp", "called by DCP's executor" if caller in _DCP_EXECUTORS else "arguments"))
        return DCP_SAVE(state_dict, *args, **kwargs)
    t0 = time.perf_counter()
    with paused_gc():  # flattening allocates an object per key: no cycle search over the trainer's heap
        call, state_dict, flat, objects, mappings = _prepare(kwargs, state_dict, False)
    if call.reason is not None:
        _decline(call)
    else:
        stats = DcpSaveStats("save", "engine", prepare_s=time.perf_counter() - t0)
        phases = DcpPhases(objects, mappings, call.writer)
        try:
            with paused_gc():
                _engine_save(flat, call, phases, stats)
        except saver.Declined as e:  # another rank refused: before anything was planned or written
            call.reason = _declined_reason(e)
        except CheckpointException:
            raise
        except Exception as e:  # noqa: BLE001 - raised alike on every rank: DCP's exception type
            raise _checkpoint_exception(e, call.comm.rank) from e
        finally:
            if call.reason is None:
                stats.blocked_s = time.perf_counter() - t0
                _record(stats)
    if call.reason is not None:
        _record(DcpSaveStats("save", "dcp", call.reason))
        return _stock_save(call, state_dict, kwargs)
    return phases.metadata


def _engine_save(flat: dict, call: _Call, phases: DcpPhases, stats: DcpSaveStats) -> None:
    """The blocking save's phases (as ``pipeload.save``'s), the write and commit in DCP's layout."""
    directory, comm = call.directory, call.comm
    what = f"dcp.save into {directory}"
    bg.wait_previous(comm)
    lock: list[int] = []
    with paused_gc(), Guard() as guard, warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="pipeload.save: Python objects differ")  # DCP keeps one
        contended = guard.enter_sync(comm, comm.size > 1, what, comm.timeout.total_seconds())
        try:
            t0 = time.perf_counter()
            plan = saver.plan_phase(flat, directory, comm, contended, offer=call.offer)
            plan.locks = lock
            t1 = time.perf_counter()
            stats.plan_s, stats.plan_reused, stats.items_written = t1 - t0, plan.reused, len(plan.items)
            error, done = phases.write_phase(plan, directory, comm)
            t2 = time.perf_counter()
            phases.commit_phase(plan, directory, comm, error or guard.late(comm), done)
            stats.write_s, stats.commit_s = t2 - t1, time.perf_counter() - t2
        finally:
            for fd in lock:
                os.close(fd)


def async_save(state_dict, *args, **kwargs):
    """``torch.distributed.checkpoint.async_save`` under the switch: the engine path or DCP's (see the
    module); returns what DCP returns for the call (a ``Future`` of the ``Metadata``, or an
    ``AsyncSaveResponse``)."""
    if args or not set(kwargs) <= _ASYNC_KEYWORDS:
        _record(DcpSaveStats("async_save", "dcp", "arguments"))
        return DCP_ASYNC_SAVE(state_dict, *args, **kwargs)
    t0 = time.perf_counter()
    with paused_gc():
        call, state_dict, flat, objects, mappings = _prepare(kwargs, state_dict, True)
    if call.reason is not None:
        _decline(call)
        _record(DcpSaveStats("async_save", "dcp", call.reason))
        return DCP_ASYNC_SAVE(state_dict, **kwargs)
    stats = DcpSaveStats("async_save", "engine", prepare_s=time.perf_counter() - t0)
    phases = DcpPhases(objects, mappings, call.writer)
    future: Future = Future()
    try:
        handle = _engine_async(flat, call, phases)
    except saver.Declined as e:  # another rank refused: before anything was planned or staged
        _record(DcpSaveStats("async_save", "dcp", _declined_reason(e)))
        return DCP_ASYNC_SAVE(state_dict, **kwargs)
    except Exception as e:  # noqa: BLE001 - every failure is the future's, on every rank alike
        future.set_exception(_checkpoint_exception(e, call.comm.rank))
    else:
        stats.plan_s, stats.staged_bytes = handle.plan_seconds, handle.staged_bytes
        handle._on_finish(lambda: _settle(future, handle, phases, call.comm.rank))
    stats.blocked_s = time.perf_counter() - t0
    _record(stats)
    stager = kwargs.get("async_stager")
    if stager is not None and stager._config.use_async_staging:
        staged: Future = Future()
        staged.set_result(None)
        return dcp_saver.AsyncSaveResponse(staging_completion=staged, upload_completion=future)
    return future


def _engine_async(flat: dict, call: _Call, phases: DcpPhases):
    bg.wait_previous(call.comm)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="pipeload.save: Python objects differ")
        return bg.save(flat, call.directory, call.comm, None, phases=phases, offer=call.offer)


def _settle(future: Future, handle, phases: DcpPhases, rank: int) -> None:
    error = handle._error
    if error is None:
        future.set_result(phases.metadata)
    else:
        future.set_exception(_checkpoint_exception(error, rank))
