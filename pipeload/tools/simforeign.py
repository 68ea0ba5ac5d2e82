"""``pipeload simulate --format dcp|hf``: the planning path on a foreign checkpoint's metadata.

For a :class:`pipeload.tools.simulate.Layout` this writes the metadata another tool would have written for it
and measures what a load of it costs:

- ``dcp``: a ``.metadata`` pickled from torch's own classes as ``dcp.save``'s ``FileSystemWriter``
  writes it (``TensorStorageMetadata`` with one ``ChunkStorageMetadata`` per distinct box,
  ``storage_data`` mapping each ``MetadataIndex`` to a ``_StorageInfo`` byte range of
  ``__<rank>_0.distcp``, the writer being the lowest rank holding the box; the optimizer's
  ``param_groups`` a ``BytesStorageMetadata``); byte lengths are the chunk's bytes plus a torch.save
  blob's headers. No data file is written.
- ``hf``: whole tensors (the checkpoint key names) packed in key order into files of at most 5 GiB,
  with the index's weight map; the headers the HF reader would read from those files are built in
  memory. Objects have no place in the layout and are left out of the state dicts.

Rank 0 (the rank that reads the metadata) is measured on its own: ``rank0_decode_s`` (process time of
:func:`pipeload.formats.read_payload`'s decode into the chunk table) and ``rank0_peak_mb`` (tracemalloc),
beside ``rank0_pickle_loads_s``, a plain ``pickle.loads`` of the same ``.metadata`` (what ``dcp.load``
runs on every rank), and, for DCP, ``rank0_sidecar_s``: the same read when the sidecar is present, and
``rank0_rss_mb``: how far the decode raised the resident set's high-water mark. For DCP each of the big
things lives in a process of its own (:func:`_prepare_dcp`): DCP's objects and their pickling, the plain
``pickle.loads``, the timed decode; this process holds only the table, so peaks are of one thing at a time.
Every sampled rank then runs the loader's planning path from the bytes rank 0 broadcasts
(``pickle.loads`` of them, :func:`pipeload.formats.from_payload`, local plan, exchange, global plan).
"""

from __future__ import annotations

import gc
import math
import os
import pickle
import time
import tracemalloc
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, Callable

from ..engine._gcpause import paused_gc
from ._measure import timed
from .simdcp import coordinator_cost

BLOB_OVERHEAD = 1100  # bytes of a torch.save zip around one tensor's data (headers, data.pkl, directory)
HF_FILE_BYTES = 5 << 30


def writer(lay, t, rank: int) -> int:
    """The lowest rank holding the same box of ``t`` as ``rank`` (the box depends only on the mesh
    coordinates its placement shards over); for a layout stored whole (``tp-from-whole``), the lowest
    rank holding any box of ``t``, which wrote its one chunk."""
    if lay.whole:
        return min(_box_writer(lay, t, r) for r in lay.reps)
    return _box_writer(lay, t, rank)


def _box_writer(lay, t, rank: int) -> int:
    pp, dp, tp = lay.coords(rank)
    dp2 = dp if lay.name == "fsdp" and t.role != "step" and t.shape else 0
    tp2 = tp if t.role in ("col", "row") or t.expert >= 0 else 0
    return pp * lay.dp * lay.tp + dp2 * lay.tp + tp2


def _distinct(lay, t):
    """{box: writer rank} of tensor ``t`` over the layout's distinct ranks (each class once)."""
    seen: dict = {}
    for r in lay.reps:
        b = lay.box(t, r)
        if b is not None and math.prod(b[1]) > 0 and b not in seen:
            seen[b] = _box_writer(lay, t, r)
    if not seen or lay.whole:  # zero-size everywhere (or stored whole: tp-from-whole): one chunk
        seen = {((0,) * len(t.shape), t.shape): min(seen.values(), default=0)}
    return seen


def write_dcp(lay, directory: str) -> tuple[int, int]:
    """Pickle the layout's DCP ``.metadata`` into ``directory``; (its bytes, the chunks it lists)."""
    import torch
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import (BytesStorageMetadata, ChunkStorageMetadata, Metadata,
                                                       MetadataIndex, StorageMeta, TensorProperties,
                                                       TensorStorageMetadata)

    dtypes = {"BF16": torch.bfloat16, "F32": torch.float32}
    sdm, storage, at, names = {}, {}, defaultdict(int), {}
    n_chunks = 0
    for t in lay.tensors:
        chunks = []
        for (o, n), r in sorted(_distinct(lay, t).items()):
            chunks.append(ChunkStorageMetadata(offsets=torch.Size(o), sizes=torch.Size(n)))
            ln = math.prod(n) * dtypes[t.dtype].itemsize + BLOB_OVERHEAD
            name = names.get(r) or names.setdefault(r, f"__{r}_0.distcp")  # one string per file, as DCP's
            storage[MetadataIndex(t.fqn, o)] = _StorageInfo(name, at[r], ln)
            at[r] += ln
        n_chunks += len(chunks)
        sdm[t.fqn] = TensorStorageMetadata(TensorProperties(dtype=dtypes[t.dtype]), torch.Size(t.shape), chunks)
    for o in lay.objects:
        sdm[o] = BytesStorageMetadata()
        storage[MetadataIndex(o)] = _StorageInfo(names.setdefault(0, "__0_0.distcp"), at[0], 1024)
        at[0] += 1024
    md = Metadata(state_dict_metadata=sdm, planner_data={k: (k,) for k in sdm}, storage_data=storage,
                  storage_meta=StorageMeta(checkpoint_id=directory, save_id="0123456789abcdef"), version="1.0.0")
    path = os.path.join(directory, ".metadata")
    with open(path, "wb") as f:
        pickle.dump(md, f)
    return os.path.getsize(path), n_chunks


def hf_raw(lay) -> dict[str, Any]:
    """What the HF reader reads for the layout's checkpoint: the weight map and every file's header."""
    from ..formats.metadata import dtype_itemsize

    headers: dict[str, dict] = {}
    weight_map: dict[str, str] = {}
    files: list[tuple[str, dict]] = []
    size = HF_FILE_BYTES
    for t in sorted(lay.tensors, key=lambda t: t.fqn):
        n = math.prod(t.shape) * dtype_itemsize(t.dtype)
        if size + n > HF_FILE_BYTES or not files:
            files.append((f"model-{len(files) + 1:05d}", {}))
            size = 0
        files[-1][1][t.fqn] = (t.dtype, list(t.shape), size, size + n)
        size += n
    for i, (stem, header) in enumerate(files):
        name = f"{stem}-of-{len(files):05d}.safetensors"
        headers[name] = {**header, "__metadata__": {"format": "pt"}}
        for k in header:
            weight_map[k] = name
    return {"single": False, "weight_map": weight_map, "headers": headers}


@dataclass
class Foreign:
    """The foreign checkpoint of a simulation: how a rank opens it, and rank 0's measured costs."""

    open_ckpt: Callable[[], Any]  # a sampled rank's path from the broadcast bytes to its Checkpoint
    md: Any
    metadata_bytes: int
    result: dict[str, Any] = field(default_factory=dict)


def prepare(lay, directory: str, format: str, memory: bool, log) -> Foreign:
    """Write the layout's ``format`` metadata into ``directory`` and measure rank 0's part."""
    from .. import formats
    from ..formats import hf

    lay.reps = sorted({lay.class_of(r): r for r in range(lay.world)}.values())
    if format == "hf":
        lay.objects = []  # no place for them in the layout
        lay.names = sorted(t.fqn for t in lay.tensors)
        lay.index = {n: i for i, n in enumerate(lay.names)}
    if format == "dcp":
        result = _prepare_dcp(lay, directory, memory, log)
        payload, plain, cpu = result.pop("blob"), result["rank0_pickle_loads_s"], result["rank0_decode_s"]
        md_bytes = result.pop("metadata_bytes")
    else:
        raw = hf_raw(lay)
        md_bytes = len(pickle.dumps(raw))
        t0 = time.process_time()
        pickle.loads(pickle.dumps(raw))
        plain = time.process_time() - t0
        payload, cpu, peak = timed(lambda: hf.table_of(raw, directory), memory)
        result = {"rank0_pickle_loads_s": plain, "rank0_decode_s": cpu, "rank0_peak_mb": peak,
                  "chunks": len(lay.tensors)}
    sent = pickle.dumps((format, payload), protocol=pickle.HIGHEST_PROTOCOL)  # what the broadcast carries
    result["broadcast_bytes"] = len(sent)
    log(f"rank 0: decode {cpu:.2f} s (plain pickle.loads {plain:.2f} s), broadcast {len(sent) / 2**20:.1f} MiB")
    ckpt = formats.from_payload(pickle.loads(sent), directory)
    return Foreign(lambda: formats.from_payload(pickle.loads(sent), directory), ckpt.metadata, md_bytes, result)


def _prepare_dcp(lay, directory: str, memory: bool, log) -> dict[str, Any]:
    """Rank 0's costs for a DCP checkpoint, one thing in memory at a time: DCP's objects are built and
    pickled in a child process, the plain ``pickle.loads`` baseline runs in another, and the decode's
    time and resident-set growth in a third; this process keeps only the table (traced, second pass)."""
    from .. import formats
    from ..formats import dcpmeta

    md_bytes, n_chunks = _forked(lambda: write_dcp(lay, directory))
    log(f"dcp .metadata: {md_bytes / 2**20:.1f} MiB, {n_chunks} chunks")
    md_path = os.path.join(directory, ".metadata")
    plain = _forked(lambda: _plain_loads(md_path))
    side = os.path.join(directory, dcpmeta.SIDECAR)
    fresh = lambda: (_unlink(side), formats.read_payload(directory, "dcp")[1])[1]  # noqa: E731
    cpu, rss = _forked(lambda: _cost(fresh))
    gc.collect()
    peak = None
    if memory:
        tracemalloc.start()
    with paused_gc():
        blob = fresh()
    if memory:
        peak = tracemalloc.get_traced_memory()[1] / 2**20
        tracemalloc.stop()
    _, side_cpu, _ = timed(lambda: formats.read_payload(directory, "dcp")[1], False)
    central = _forked(lambda: coordinator_cost(lay, memory))  # what stock dcp.load's planning costs instead
    log(f"DCP's coordinator: {central['dcp_coordinator_cpu_s']:.2f} s CPU")
    return {**central, "rank0_pickle_loads_s": plain, "rank0_decode_s": cpu, "rank0_peak_mb": peak, "rank0_rss_mb": rss,
            "rank0_sidecar_s": side_cpu, "chunks": n_chunks, "blob": blob, "metadata_bytes": md_bytes}


def _plain_loads(path: str) -> float:
    """Process time of a plain ``pickle.loads`` of ``path`` (the GC on, as ``dcp.load`` runs it)."""
    with open(path, "rb") as f:
        raw = f.read()
    gc.collect()
    t0 = time.process_time()
    md = pickle.loads(raw)
    out = time.process_time() - t0
    del md  # (not timed; the child exits)
    return out


def _cost(fn) -> tuple[float, float | None]:
    """(process time of fn(), MB the resident set's high-water mark rose above the RSS before it, None where
    /proc cannot reset the mark); the GC paused as in a load."""
    from .bench.system import reset_peak_rss, status_kib

    gc.collect()
    before = status_kib("VmRSS") if reset_peak_rss() else None
    with paused_gc():
        t0 = time.process_time()
        fn()
        cpu = time.process_time() - t0
    return cpu, None if not before else (status_kib("VmHWM") - before) / 1024


def _forked(fn):
    """fn() in a forked child, its memory returned to the system when it exits; its (pickled) result."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        code = 1
        try:
            os.close(r)
            try:
                out, code = ("ok", fn()), 0
            except BaseException as e:  # noqa: BLE001 - reported by the parent
                out = ("error", f"{type(e).__name__}: {e}")
            with os.fdopen(w, "wb") as f:
                pickle.dump(out, f)
        finally:
            os._exit(code)
    os.close(w)
    with os.fdopen(r, "rb") as f:
        data = f.read()
    _, status = os.waitpid(pid, 0)
    if not data:
        raise RuntimeError(f"simulate: a measuring child process died (wait status {status}; out of memory?)")
    kind, value = pickle.loads(data)
    if kind != "ok":
        raise RuntimeError(f"simulate: a measuring child process failed: {value}")
    return value


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
