"""Running part delivery (:mod:`pipeload.plan.partdelivery`): the owners' page bytes, point to point.

From an object store the owners' bytes are those of their runs instead of pages (:func:`_plan_runs`):
before anything else a rank asks for its planned ranges at once (:func:`fetch_runs`: its runs, in
large GETs), then the messages go as below.

Before the shared phase, for each (owner, receiver) pair of this rank in the order (owner, receiver),
the owner reads its deliveries' bytes (from pages it reads anyway) into one packed message and sends it
on the load's :class:`~pipeload.engine.comm.Comm`; the receiver posts one receive per pair. Every
message is posted before any is waited on (an owner's reads need no peer), then all are awaited, oldest
first (:class:`pipeload.move.mover.Transfers` with no in-flight bound). The messages travel on the
load's broadcast device (an accelerator under NCCL: packed on the host, copied to it and back at the
ends). Why it cannot deadlock: the delivery messages come before every broadcast in the one global
order, and both ends of each derive it from the same plan; the lowest incomplete message has both ends
posted, so it completes, and the broadcasts follow in the plan's order, unchanged.

A DCP chunk's position in its file is learnt from its blob's head (its local headers): at planning,
the reader of each blob's lowest byte (its locator) sends the chunk's (start, end) to the readers on
other hosts of that blob and of the blobs next to it (:func:`_locate`: one message per (sender,
receiver) pair, 16 bytes a chunk, in the same order of pairs), so each head page is read once, by the
rank that reads that page anyway. From an object store a DCP object's runs hold whole blobs: no
position is needed there (:func:`pipeload.plan.partruns.blob_runs`).

An owner whose read fails still sends (zeros where the bytes failed) and records the error: the load's
agreement then fails on every rank. A dead peer fails the transfer by name, as a failed broadcast does.
A rank whose planning raised cannot take part in messages it never planned: one gather after the local
steps (DCP) and one after the pages are decided tell every rank, and all then drop part delivery for
the load (:func:`_attempt`, :func:`_everyone`).
The received bytes become the reader's patches (:meth:`pipeload.io.reader.ChunkReader.set_patches`):
the reads of this load take a delivered head or tail from there and never ask storage for its page.
"""

from __future__ import annotations

import warnings
from typing import Any, Callable, NamedTuple

import numpy as np
import torch

from ..io import storage
from ..io.reader import chunk_start, copy_box
from ..move.mover import Transfers
from ..plan import partdelivery, partruns
from ..plan.exchange import F_HOST
from ..plan.partdelivery import Delivery


class Planned(NamedTuple):
    """This rank's part delivery: its deliveries, and where the DCP chunks it reads start (``(file, key,
    start, end)``, located by other readers or by itself: the reader's ``located`` table when the plan
    is reused)."""

    deliveries: list[Delivery]
    located: list[tuple[str, str, int, int]]


def plan(gp, md, names: list[str], reader, comm, rows: np.ndarray, my_items) -> Planned:
    """This rank's deliveries (sent or received), from the plan of every component (``gp.every``), the
    gathered rows' hosts and the headers of the files this rank reads (``my_items``: its ReadItems).
    Every reader of a file decides alike from its header; a DCP item that is not stored in place (decoded
    by torch.load) gives its blob's start: its pages are then misjudged alike on every rank (no saving),
    and the bytes still exact (parts are chunk-relative, from ``buffer()`` on both ends). Objects (a
    checkpoint in object storage) are planned by runs instead (:func:`pipeload.plan.partruns.plan_runs`):
    the ranges this rank fetches as an owner are left in ``reader.runs`` for :func:`deliver`.

    A DCP chunk's position is learnt from its blob's head: before deciding pages, the first reader of
    each chunk read on several hosts sends its position to the other readers (:func:`_locate`), the only
    messages of this step, point to point, planned from the same data on both ends."""
    me, hosts = comm.rank, rows[:, F_HOST].tolist()
    files = {item.file for item in my_items if item.nbytes}
    reader.runs = {}
    if storage.is_url(reader.directory):
        runs = _attempt(comm, lambda: _object_runs(gp.every(), md, names, reader, me, files))
        if not _everyone(comm, runs is not None):
            reader.runs, runs = {}, []
        return Planned(runs, [])
    heads = _attempt(comm, lambda: _heads(md, names, reader, me, files, gp.every(), hosts))
    if reader.format == "dcp" and not _everyone(comm, heads is not None):  # (only DCP blobs send positions)
        return Planned([], [])
    located = _locate(comm, reader, heads.sends, heads.recvs) if heads and (heads.sends or heads.recvs) else []

    def pages() -> Planned:
        found = [*located, *_found(reader, heads.blobs, {(f, k) for f, k, _, _ in located})]
        if not heads.files:
            return Planned([], found)
        return Planned(partdelivery.plan(heads.every, md, names, heads.itemsize, me, heads.files, heads.start_of,
                                         heads.layout_of, hosts.__getitem__, spans=heads.spans,
                                         expanded=heads.expanded, blob_files=heads.blobs), found)

    planned = _attempt(comm, pages) if heads is not None else None
    if not _everyone(comm, planned is not None):  # (a rank failed: none plans a delivery its peers would miss)
        return Planned([], planned.located if planned is not None else located)
    return planned


class _Heads(NamedTuple):
    """A rank's local planning before the position messages: what it reads in place, the blobs' spans,
    and the positions it sends and receives."""

    every: Any
    itemsize: Any
    files: set
    blobs: list
    spans: dict
    expanded: Any
    sends: dict
    recvs: dict
    start_of: Callable
    layout_of: Callable


def _heads(md, names: list[str], reader, me: int, files: set, every, hosts: list) -> _Heads:
    files = {name for name in files if _in_place(reader, name)}
    _, itemsize = md.key_arrays(names)
    starts: dict[tuple[str, str], int] = {}  # (a DCP item's start costs a read of its local header)
    layouts: dict[str, Any] = {}  # (each a sort of the file's header entries)

    def start_of(file: str, key: str) -> int:
        s = starts.get((file, key))
        if s is None:
            s = starts[file, key] = chunk_start(reader.file(file), key)
        return s

    def layout_of(file: str):
        if file not in layouts:
            layouts[file] = _layout(reader.file(file))
        return layouts[file]

    if not files:
        return _Heads(every, itemsize, files, [], {}, None, {}, {}, start_of, layout_of)
    blobs = sorted(f for f in files if _is_blobs(reader.file(f)))
    spans, expanded, (sends, recvs) = partdelivery.with_heads(every, md, names, itemsize, me, files, blobs, layout_of,
                                                              hosts.__getitem__)
    _request_heads(reader, me, spans, blobs, recvs)
    return _Heads(every, itemsize, files, blobs, spans, expanded, sends, recvs, start_of, layout_of)


def _attempt(comm, step: Callable):
    """``step()``, or None when it raised: part delivery only saves reads, so a failure in planning it
    (a header that does not parse, a file that does not open) drops it for this load on every rank (see
    :func:`_everyone`) and the reads meet the same cause, by name, through the load's own agreement."""
    try:
        return step()
    except Exception as e:  # noqa: BLE001
        warnings.warn(f"pipeload.load: rank {comm.rank}: part delivery not planned ({type(e).__name__}: {e}); "
                      f"every rank reads its own pages", RuntimeWarning, stacklevel=2)
        return None


def _everyone(comm, ok: bool) -> bool:
    """Whether every rank's local step succeeded: one gather of a word per rank. A rank that failed
    cannot send or receive the messages its peers planned with it, so all of them must learn of it
    before the first message instead of waiting for it until the group's timeout."""
    return bool(comm.gather_rows(np.array([ok], dtype=np.int64), "pipeload.load",
                                 "all-gather of part delivery's planning").all())


def _found(reader, files: list[str], given: set) -> list[tuple[str, str, int, int]]:
    """The positions this rank located itself in ``files`` (kept with the plan: a load reusing it
    requests exact ranges from its first prefetch, as this one did after planning)."""
    out = []
    for name in files:
        for key, (a, b) in sorted(reader.file(name).positions().items()):
            if (name, key) not in given:
                out.append((name, key, a, b))
    return out


def _request_heads(reader, me: int, spans: dict, blobs: list[str], recvs: dict) -> None:
    """Ask storage at once for the heads of the blobs this rank locates itself (those it reads and is not
    told about): locating them one by one would wait for each page in turn."""
    told = {x for items in recvs.values() for x in items}
    for name in blobs:
        keys = sorted({key for key, _, _, r in spans.get(name, ()) if r == me and (name, key) not in told})
        if keys:
            reader.file(name).willneed_heads(keys)


def _locate(comm, reader, sends: dict, recvs: dict) -> list[tuple[str, str, int, int]]:
    """Send each receiver the (start, end) of the chunks this rank located for it ((-1, -1) for one it
    could not locate in place: the receiver then reads the head itself, and meets any error by name), and
    receive those located for this rank; install them as ``reader.located`` and return them."""
    t, wire = Transfers(comm, "pipeload.load: chunk positions", limit=1 << 62), comm.broadcast_device
    got: dict[int, torch.Tensor] = {}
    # in the one order of (sender, receiver) pairs, as the deliveries: both ends post alike (NCCL too)
    for a, b in sorted([(comm.rank, r) for r in sends] + [(r, comm.rank) for r in recvs]):
        if a == comm.rank:
            msg = torch.tensor([x for file, key in sends[b] for x in _located(reader, file, key)], dtype=torch.int64)
            msg = msg.view(torch.uint8).to(wire)
            t.send(b, msg.numel(), lambda lo, hi, m=msg: m[lo:hi])
        else:
            got[a] = torch.empty(16 * len(recvs[a]), dtype=torch.uint8, device=wire)
            t.recv(a, got[a])
    t.drain()
    out = [(file, key, int(x), int(y)) for peer, buf in sorted(got.items())
           for (file, key), (x, y) in zip(recvs[peer], buf.cpu().view(torch.int64).view(-1, 2).tolist()) if x >= 0]
    install(reader, out)
    return out


def _located(reader, file: str, key: str) -> tuple[int, int]:
    try:
        got = reader.file(file).position(key)
    except Exception:  # noqa: BLE001 - the receiver locates it itself and reports what is wrong
        return -1, -1
    return got if got is not None else (-1, -1)


def install(reader, located: list[tuple[str, str, int, int]]) -> None:
    """Make ``located`` (:attr:`Planned.located`) the reader's table of chunk positions found elsewhere."""
    table: dict[str, dict[str, tuple[int, int]]] = {}
    for file, key, a, b in located:
        table.setdefault(file, {})[key] = (a, b)
    reader.located = table


def _object_runs(every, md, names: list[str], reader, me: int, files: set) -> list[Delivery]:
    objects = _object_spans(every, md, names, reader)
    files = files | {f for f, spans in objects.items() if any(s[3] == me for s in spans)}  # (a rank reading
    files = {name for name in files if _in_place(reader, name)}  # only an object of a file takes part there)
    return _plan_runs(every, md, names, reader, me, files, objects) if files else []


def _object_spans(every, md, names: list[str], reader) -> dict[str, list[tuple[str, int, int, int]]]:
    """file -> ``(stored key, 0, bytes, rank)`` of each Python object each rank reads (``every.objects``),
    for the objects stored in their file's header as a U8 chunk of the recorded size (decided from that
    header: alike on every reader of the file; any other is left out, its readers fetch it themselves)."""
    out: dict[str, list[tuple[str, int, int, int]]] = {}
    ok: dict[tuple[str, str], bool] = {}
    for rank, k in every.objects.tolist():
        meta = md.objects.get(names[k])
        if meta is None:
            continue
        if (meta.file, meta.key) not in ok:
            try:
                dtype, _, a, b = reader.file(meta.file).entry(meta.key)
                ok[meta.file, meta.key] = dtype == "U8" and b - a == meta.nbytes > 0
            except Exception:  # noqa: BLE001 - left to its readers: the read reports what is wrong
                ok[meta.file, meta.key] = False
        if ok[meta.file, meta.key]:
            out.setdefault(meta.file, []).append((meta.key, 0, meta.nbytes, rank))
    return out


def _plan_runs(every, md, names: list[str], reader, me: int, files: set[str], objects: dict) -> list[Delivery]:
    """Objects: this rank's deliveries by runs; the ranges it fetches as an owner go to ``reader.runs``.
    Each object's chunk offsets and keys come from its header, which every reader of it holds; the Python
    objects each rank reads (``objects``, :func:`_object_spans`) count as spans too."""
    index, order = md.key_index(), {name: i for i, name in enumerate(md.files)}
    _, itemsize = md.key_arrays(names)

    def keys_in(file: str) -> set[int]:
        f = reader.file(file)
        return {k for name in ([b[2] for b in f.blobs] if _is_blobs(f) else f.keys())
                if (k := partdelivery.key_of(index, name)) is not None}

    out, reader.runs = partruns.plan_runs(
        every, md, names, itemsize, me, files, lambda file, key: chunk_start(reader.file(file), key), keys_in,
        lambda file: order.get(file, 0), objects, lambda file: _blob_ranges(reader.file(file)))
    return out


def _layout(f: Any) -> tuple[list[int], list[int], list[str]] | None:
    """The chunks of an open file as (first bytes, ends, keys), by first byte, from its header (a DCP
    file: its blobs, from the checkpoint's metadata, each holding its chunk's head and tail too); None for
    a file with neither (its pages are decided per chunk, see partdelivery.plan)."""
    if _is_blobs(f):
        return [b[0] for b in f.blobs], [b[1] for b in f.blobs], [b[2] for b in f.blobs]
    if not hasattr(f, "keys"):
        return None
    rows = sorted((int(e[2]), int(e[3]), k) for k in f.keys() for e in (f.entry(k),))
    return [r[0] for r in rows], [r[1] for r in rows], [r[2] for r in rows]


def _blob_ranges(f: Any) -> dict[str, tuple[int, int]] | None:
    """key -> (first byte, end) of each chunk's blob in a DCP file (from the metadata: no read), else None."""
    if not _is_blobs(f):
        return None
    return {key: (a, b) for a, b, key in f.blobs}


def _is_blobs(f: Any) -> bool:
    """A file whose chunks are located by reading their own head (a DCP ``.distcp``)."""
    return hasattr(f, "locate") and hasattr(f, "blobs")


def _in_place(reader, name: str) -> bool:
    try:
        f = reader.file(name)
    except Exception:  # noqa: BLE001 - the read itself reports it
        return False
    return hasattr(f, "entry") and hasattr(f, "buffer")


def _pairs(deliveries: list[Delivery]) -> dict[tuple[int, int], list[Delivery]]:
    out: dict[tuple[int, int], list[Delivery]] = {}
    for d in deliveries:  # (sorted by owner, receiver, file, key, lo: the message order, and the packing)
        out.setdefault((d.owner, d.receiver), []).append(d)
    return out


def _pack(reader, parts: list[Delivery], counters) -> torch.Tensor:
    """One message: the bytes of ``parts`` read from this rank's files, back to back; a part whose read
    fails stays zero and the failure is recorded (the agreement fails the load on every rank)."""
    msg = torch.zeros(sum(d.hi - d.lo for d in parts), dtype=torch.uint8)
    objects = storage.is_url(reader.directory)  # (an object's buffer() would fetch its whole chunk)
    starts: dict[tuple[str, str], int] = {}
    for d in parts:  # every page asked for at once: storage serves them while the first are copied
        try:
            f = reader.file(d.file)
            start = starts[d.file, d.key] = chunk_start(f, d.key)
            f.advise("willneed", start + d.lo, start + d.hi)
        except Exception:  # noqa: BLE001 - a hint only: the copy below reports what is wrong
            pass
    at = 0
    for d in parts:
        n = d.hi - d.lo
        try:
            f = reader.file(d.file)
            if objects:
                start = starts.get((d.file, d.key))
                start = chunk_start(f, d.key) if start is None else start  # (raises what the hint met)
                src = torch.frombuffer(f.span(start + d.lo, start + d.hi), dtype=torch.uint8) if n else msg[:0]
            else:
                src = torch.frombuffer(reader._bytes(f, d.key, ""), dtype=torch.uint8)[d.lo : d.hi]
            copy_box(msg[at : at + n], src, f.path)
        except Exception as e:  # noqa: BLE001 - still sent: the receiver waits for it
            counters.fail(d.key, d.file, e)
        at += n
    return msg


def own_ranges(reader, items) -> dict[str, list[tuple[int, int]]]:
    """Objects, a load without a plan of every rank's reads (in the layout it was saved in): file -> the
    ranges this rank's reads (``items``) span, merged across the reader's 1 MiB gap, for
    :func:`fetch_runs` to ask for at once (each phase and window asked for its own, a GET each). A DCP
    object's items are left to their reads (where a tensor starts is known once its blob's head is read)."""
    spans: dict[str, list[tuple[int, int, int]]] = {}
    for item in items:
        if not item.nbytes:
            continue
        try:
            f = reader.file(item.file)
            if not _is_blobs(f):
                spans.setdefault(item.file, []).append((*reader._span(f, item), 0))
        except Exception:  # noqa: BLE001 - a hint only: the read reports what is wrong
            continue
    return {name: partruns.merged(ranges).get(0, []) for name, ranges in spans.items()}


def fetch_runs(reader) -> None:
    """Objects: request this rank's runs (``reader.runs``) now, in large GETs, before any part is packed
    from them (a part's own request would then be a GET of its few KiB) and before any read (the
    phases' and windows' requests then find the bytes staged). Never blocks."""
    for name, ranges in sorted(getattr(reader, "runs", {}).items()):
        try:
            f = reader.file(name)
            for lo, hi in ranges:
                f.advise("willneed", lo, hi)
        except Exception:  # noqa: BLE001 - a hint only: the parts' reads report what is wrong
            pass


def deliver(comm, reader, deliveries: list[Delivery], counters, what: str) -> None:
    """Send and receive this rank's deliveries (see the module docstring), then install the received
    bytes as the reader's patches. Counts ``counters.pages_delivered`` (deliveries this rank took part
    in), ``part_bytes_sent`` and ``part_bytes_received``."""
    me, wire = comm.rank, comm.broadcast_device  # (under NCCL the messages are device tensors)
    pairs = _pairs(deliveries)
    t = Transfers(comm, what, limit=1 << 62)
    received: list[tuple[list[Delivery], torch.Tensor]] = []
    for (owner, receiver), parts in sorted(pairs.items()):
        if owner == me:
            msg = _pack(reader, parts, counters).to(wire)
            t.send(receiver, msg.numel(), lambda lo, hi, m=msg: m[lo:hi])
            counters.part_bytes_sent += msg.numel()
        elif receiver == me:
            buf = torch.empty(sum(d.hi - d.lo for d in parts), dtype=torch.uint8, device=wire)
            t.recv(owner, buf)
            received.append((parts, buf))
            counters.part_bytes_received += buf.numel()
        else:
            continue
        counters.pages_delivered += len(parts)
    t.drain()
    patches = []
    for parts, buf in received:
        buf, at = buf.cpu(), 0  # (the patches are copied into host reads)
        for d in parts:
            patches.append((d.file, d.key, d.lo, d.hi, buf[at : at + d.hi - d.lo]))
            at += d.hi - d.lo
    reader.set_patches(patches)
