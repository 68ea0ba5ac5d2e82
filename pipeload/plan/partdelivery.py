"""Part delivery by page ownership: each page where two nodes' reads meet is read once, by an owner.

A load into another layout than the save's cuts stored chunks between ranks (a ``Shard(0)`` tensor saved
whole and loaded in halves): the page where one rank's part ends and the next rank's begins is read by
both, on two nodes, so storage serves it twice (1.06-1.15x the unique bytes; docs/BENCH.md, 2026-12-07,
"what issue 41 still misses"). Here each such page gets one *owner*, the reader needing most of it (ties
to the lower rank), and every other reader's bytes of that page become a :class:`Delivery`: the owner,
which reads the page anyway, sends them point to point, and the receiver no longer asks storage for it.

Inputs, all alike on every participant of a page:

- every box every rank reads (:func:`pipeload.plan.globalplan.every_read`, from the gathered rows and
  records: the global plan of every component), turned into stored-chunk byte spans by the metadata;
- the byte offset of each stored chunk in its file, from the file's own header (every reader of a page
  has that file open: pages are decided per file, by the ranks reading it).

Rules (a pure function of those inputs, so an owner and a receiver derive the same delivery):

- only spans contiguous in their chunk take part (a strided box's span has holes: whether it touches a
  page is not known from its ends); a page is *shared* when contiguous spans of ranks on two or more
  hosts touch it (ranks on one host read one page cache: nothing to save there);
- a reader whose spans cover the whole page reads it itself (no saving, and replicas reading a private
  shard each stay as they are); so a delivered part is always the head or the tail of a span, and what
  the receiver still reads starts and ends on page boundaries;
- cost model: deliver when ``page x STORAGE_COST > bytes x WIRE_COST`` (separate hosts on shared
  storage: 1 against 0.2 under gloo, so every shared page qualifies: a delivered side is under a page).

Cost: one sort of the spans of the files this rank reads, ``O(S log S)``; the boxes are expanded into
spans only for checkpoint keys stored in those files.

Objects (a checkpoint in object storage) are planned by contiguous runs instead of pages (:func:`runs`,
:func:`plan_runs`, below): there a page saves nothing, a GET and its bytes do.
"""

from __future__ import annotations

import bisect
import math
from typing import Callable, Iterable, NamedTuple

import numpy as np

from ..formats.chunks import box_span
from .chunkunits import unit_index
from .planner import _intersect

PAGE = 4096
STORAGE_COST = 1.0  # relative cost of a page read from storage on separate hosts
WIRE_COST = 0.2  # relative cost of a byte sent point to point (gloo ~1 GiB/s against 200 MiB/s of storage)


class Delivery(NamedTuple):
    """Bytes ``[lo, hi)`` of stored chunk ``key`` of ``file`` (offsets inside the chunk) that ``owner``
    reads from its page and sends to ``receiver``."""

    owner: int
    receiver: int
    file: str
    key: str
    lo: int
    hi: int


def spans_of(boxes: Iterable[tuple], md, names: list[str], itemsize, files: set[str] | None = None) -> dict:
    """file -> ``[(key, lo, hi, rank)]``: the contiguous byte spans (inside stored chunk ``key``) of every
    box in ``boxes`` (``(rank, shard key, private)``, :func:`~pipeload.plan.globalplan.every_read`), only
    files in ``files`` (None: all). Private boxes skip the chunks a unit piece reads (the unit delivers
    them, as the private phase skips them). Strided spans are left out (see the module docstring)."""
    boxes = list(boxes)
    out: dict[str, list] = {}
    units: set[tuple[str, str]] = set()
    whole: dict[int, object] = {}  # key index -> its one stored chunk (None: stored in several)
    cols = md.tensor_columns()
    if cols is not None:
        cols = (*cols, md.tensors.index.a["chunk_start"])
    for private_pass in (False, True):  # unit pieces first: the chunks they cover
        for rank, key, private in boxes:
            if private != private_pass:
                continue
            idx = unit_index(key) if key[0] < 0 else key[0]
            isz = int(itemsize[idx])
            if idx not in whole:
                whole[idx] = _one_chunk(md, names[idx], cols)
            one = whole[idx]
            hits = ([(one, (key[1], None, key[2]))] if one is not None else
                    [(c, h) for c in md.chunks_for(names[idx], key[1], key[2])
                     if (h := _intersect(c, key[1], key[2])) is not None])
            for chunk, hit in hits:
                if key[0] < 0:
                    units.add((chunk.file, chunk.key))
                if (files is not None and chunk.file not in files) or (private and (chunk.file, chunk.key) in units):
                    continue
                lo, hi = box_span(chunk.lengths, hit[0], hit[2], isz)
                if hi - lo == math.prod(hit[2]) * isz and hi > lo:
                    out.setdefault(chunk.file, []).append((chunk.key, lo, hi, rank))
    return out


def _one_chunk(md, name: str, cols):
    """The one stored chunk of tensor ``name`` when it is stored whole (any box of it lies in that chunk,
    at its own offsets), else None. ``cols``: ``md.tensor_columns()``."""
    if cols is not None:
        j = cols[0][name]
        if cols[4][j + 1] - cols[4][j] != 1:  # chunks tile the tensor (checked geometry): one is the whole
            return None
        shape = tuple(cols[3][j, : cols[2][j]].tolist())
    else:
        shape = tuple(md.tensors[name].shape)
    chunks = md.chunks_for(name, (0,) * len(shape), shape)
    if len(chunks) == 1 and tuple(chunks[0].lengths) == shape and not any(chunks[0].offsets):
        return chunks[0]
    return None


def decide(spans: list[tuple[int, int, int, str, int]], host: Callable[[int], int], file: str,
           page: int = PAGE, forced: Callable[[int], int | None] | None = None) -> list[Delivery]:
    """The deliveries of one file. ``spans``: ``(first byte, end, rank, chunk key, chunk's first byte)``
    in file offsets. For each page two ranks' spans touch, the ranks' bytes there decide its owner and
    receivers (:func:`_page`). Deterministic: the result depends only on the set of spans. Spans that do
    not overlap (each byte read by one rank: the usual case) are grouped by the page two neighbours share,
    in numpy; overlapping ones go through a sweep over the pages holding a span's first or last byte."""
    spans = sorted(spans)
    if len(spans) < 2:
        return []
    a = np.fromiter((x[0] for x in spans), dtype=np.int64, count=len(spans))
    b = np.fromiter((x[1] for x in spans), dtype=np.int64, count=len(spans))
    groups = _neighbours(spans, a, b, page) if np.all(b[:-1] <= a[1:]) else _sweep(spans, page)
    out: list[Delivery] = []
    for p, touching in groups:
        out.extend(_page(p, touching, host, file, page, forced(p) if forced is not None else None))
    return out


def _neighbours(spans: list, a: np.ndarray, b: np.ndarray, page: int):
    """(page, spans touching it) of each page where neighbouring spans of two ranks meet; ``spans``
    sorted and disjoint, so the spans touching a page are consecutive."""
    r = np.fromiter((x[2] for x in spans), dtype=np.int64, count=len(spans))
    link = np.flatnonzero((b[:-1] - 1) // page == a[1:] // page)  # span i and i + 1 share a page
    if not len(link):
        return
    pg = a[link + 1] // page
    cut = np.flatnonzero((np.diff(pg) != 0) | (np.diff(link) != 1)) + 1
    starts = np.concatenate([[0], cut])
    mixed = np.add.reduceat((r[link] != r[link + 1]).astype(np.int64), starts) > 0  # two ranks meet there
    ends = np.concatenate([cut, [len(link)]])
    for lo, hi, p in zip(starts[mixed].tolist(), ends[mixed].tolist(), pg[starts[mixed]].tolist()):
        yield p, spans[int(link[lo]) : int(link[hi - 1]) + 2]


def _sweep(spans: list, page: int):
    """(page, spans touching it) of each page holding a span's first or last byte and touched by two
    ranks (an interior page is covered whole by its span's rank); ``spans`` sorted, possibly overlapping."""
    pages = sorted({x[0] // page for x in spans} | {(x[1] - 1) // page for x in spans})
    active: list = []
    nxt = 0
    for p in pages:
        p0, p1 = p * page, (p + 1) * page
        while nxt < len(spans) and spans[nxt][0] < p1:
            active.append(spans[nxt])
            nxt += 1
        active = [x for x in active if x[1] > p0]
        if len(active) >= 2 and any(x[2] != active[0][2] for x in active):
            yield p, list(active)


def _page(p: int, touching: list, host: Callable[[int], int], file: str, page: int,
          forced: int | None = None) -> list[Delivery]:
    """One page's deliveries: its owner is ``forced`` when that rank touches it (a chunk's locator, which
    reads the page anyway), else the rank needing most of it (ties to the lower rank); every other rank
    on another host whose spans cover only part of it, and for which the cost model says so, gets its
    bytes of it (one delivery per span, chunk-relative)."""
    p0, p1 = p * page, (p + 1) * page
    need: dict[int, int] = {}
    for a, b, r, *_ in touching:
        need[r] = need.get(r, 0) + min(b, p1) - max(a, p0)
    if len({host(r) for r in need}) < 2:
        return []
    owner = forced if forced in need else min(need, key=lambda r: (-need[r], r))
    return [Delivery(owner, r, file, key, max(a, p0) - start, min(b, p1) - start)
            for a, b, r, key, start in touching
            if host(r) != host(owner) and need[r] < page and page * STORAGE_COST > need[r] * WIRE_COST]


def plan(every, md, names: list[str], itemsize, me: int, files: set[str],
         start_of: Callable[[str, str], int], layout_of: Callable[[str], tuple],
         host: Callable[[int], int], page: int = PAGE, spans: dict | None = None,
         expanded: set[int] | None = None, blob_files: Iterable[str] = ()) -> list[Delivery]:
    """The deliveries this rank ``me`` sends or receives, sorted by (owner, receiver, file, key, lo): the
    order of the messages and of the parts packed in each.

    ``every``: the boxes every rank reads (:class:`~pipeload.plan.globalplan.EveryRead`); ``files``: the
    files ``me`` reads; ``start_of(file, key)``: a stored chunk's first byte in its file;
    ``layout_of(file)``: its chunks as ``(firsts, ends, keys)`` sorted by first byte (each range may hold
    more than the chunk), or None: the file's pages are decided per chunk, among the readers of that chunk
    only (a DCP blob, where learning a chunk's offset reads its zip headers: only a rank reading a chunk
    looks it up; every reader of the chunk sees all its spans, so they decide alike, and a page where two
    chunks meet is left to be read by each). Only the boxes of :func:`relevant` keys are expanded:
    the chunks overlapping a page ``me`` touches. Every other participant of such a page touches it too,
    so it expands every chunk overlapping it as well, and both decide the page from the same spans.
    ``spans``: :func:`my_spans` when the caller has them, holding the boxes of the keys ``expanded``
    (default: those ``me`` reads). ``blob_files``: files whose chunks are located by reading their own
    head (DCP blobs, with the blobs as their layout): a page holding a chunk's head is owned by the
    chunk's locator (:func:`locators`), which reads it to locate the chunk, when it touches that page."""
    spans = my_spans(every, md, names, itemsize, me, files) if spans is None else spans
    have = every.keys_of(me) if expanded is None else expanded
    keys, near = relevant(spans, me, start_of, layout_of, md.key_index(), page)
    if keys - have:
        for file, extra in spans_of(every.boxes(keys - have), md, names, itemsize, files).items():
            spans.setdefault(file, []).extend(extra)
    blob_files = set(blob_files)
    out = []
    for file, fs in sorted(spans.items()):
        fs = [x for x in fs if (file, x[0]) in near]  # (only these chunks' offsets are looked up)
        if not any(r == me for *_, r in fs):
            continue
        starts: dict[str, int] = {}
        absolute: dict = {}
        per_chunk = layout_of(file) is None  # pages decided per chunk, among its readers only
        for key, lo, hi, r in fs:
            s = starts.get(key)
            if s is None:
                s = starts[key] = start_of(file, key)
            absolute.setdefault(key if per_chunk else "", []).append((s + lo, s + hi, r, key, s))
        forced = _head_owner(file, fs, layout_of(file), starts, page) if file in blob_files else None
        for group in absolute.values():
            out.extend(d for d in decide(group, host, file, page, forced) if me in (d.owner, d.receiver))
    return sorted(out)


def _head_owner(file: str, fs: list, layout: tuple, starts: dict[str, int], page: int) -> Callable[[int], int | None]:
    """page -> the locator of a chunk whose head (its blob's bytes before the tensor's) lies in it, the
    chunk of the lowest blob first; None if no chunk with spans here has its head there. From the
    blob layout, the chunks' starts and their spans: what every participant of the page holds."""
    first_of = dict(zip(layout[2], layout[0]))
    who = locators({file: fs})
    heads = sorted((first_of[k], starts[k], who[(file, k)]) for k in starts if (file, k) in who and k in first_of)
    owner: dict[int, int] = {}
    for b0, s0, r in heads:
        for p in range(b0 // page, (s0 - 1) // page + 1) if s0 > b0 else ():
            owner.setdefault(p, r)
    return owner.get


def my_spans(every, md, names: list[str], itemsize, me: int, files: set[str]) -> dict:
    """:func:`spans_of` every box of the checkpoint keys ``me`` reads (every rank's boxes of those keys),
    in ``files``."""
    return spans_of(every.boxes(every.keys_of(me)), md, names, itemsize, files)


def with_heads(every, md, names: list[str], itemsize, me: int, files: set[str], blobs: list[str],
               layout_of: Callable[[str], tuple], host: Callable[[int], int]) -> tuple[dict, set[int], tuple]:
    """(spans, keys expanded, (sends, receives)): :func:`my_spans`, with, for the files in ``blobs``
    (located by their heads), the boxes of the chunks next to this rank's (:func:`neighbours`) and the
    position messages (:func:`heads`). The input of :func:`plan` (``spans``, ``expanded``)."""
    spans = my_spans(every, md, names, itemsize, me, files)
    expanded = every.keys_of(me)
    if not blobs:
        return spans, expanded, ({}, {})
    extra = neighbours(spans, me, layout_of, blobs, md.key_index()) - expanded
    for file, more in spans_of(every.boxes(extra), md, names, itemsize, files).items():
        spans.setdefault(file, []).extend(more)
    return spans, expanded | extra, heads(spans, me, host, blobs, layout_of)


def locators(spans: dict) -> dict[tuple[str, str], int]:
    """``(file, key)`` -> the rank that locates a chunk read by its own header: the reader of its lowest
    byte (ties to the lower rank), whose page holding the head is one it reads anyway."""
    best: dict[tuple[str, str], tuple[int, int]] = {}
    for file, fs in spans.items():
        for key, lo, _, r in fs:
            k = (file, key)
            if k not in best or (lo, r) < best[k]:
                best[k] = (lo, r)
    return {k: v[1] for k, v in best.items()}


def neighbours(spans: dict, me: int, layout_of: Callable[[str], tuple], files: Iterable[str],
               index: dict[str, int]) -> set[int]:
    """Checkpoint key indices of the chunks stored next to (before or after, in the layout of ``files``)
    a chunk ``me`` reads: their locators tell ``me`` where they start (:func:`heads`)."""
    out: set[int] = set()
    for file in set(files) & set(spans):
        blobs = _blobs(layout_of(file))
        for key in {x[0] for x in spans[file] if x[3] == me}:
            i = blobs.at.get(key)
            for j in (i - 1, i + 1) if i is not None else ():
                for name in blobs.keys[j] if 0 <= j < len(blobs.keys) else ():
                    k = key_of(index, name)
                    if k is not None:
                        out.add(k)
    return out


def heads(spans: dict, me: int, host: Callable[[int], int], files: Iterable[str],
          layout_of: Callable[[str], tuple]) -> tuple[dict, dict]:
    """Who tells whom where a chunk's bytes start, for the chunks of ``files`` whose position in the file
    is learnt by reading the chunk's own head (a DCP blob: the local headers before the tensor).

    Each chunk is located by its locator (:func:`locators`); every rank on another host reading that
    chunk or one stored next to it (the pages where two chunks meet are decided from both chunks'
    positions) receives the position instead of reading the head. Returns (``{receiver: [(file, key)]}``
    this rank sends, ``{locator: [(file, key)]}`` it receives), each list sorted: the order of the values
    in one message. ``spans`` must hold every box of the chunks ``me`` reads and of their neighbours
    (:func:`neighbours`): both ends of a message derive it from the same spans. A chunk stored under
    several keys (aliases in the layout, one blob) is one chunk, named by the key its spans use."""
    sends: dict[int, list] = {}
    recvs: dict[int, list] = {}
    for file in sorted(set(files) & set(spans)):
        blobs = _blobs(layout_of(file))
        who = locators({file: spans[file]})
        readers: dict[int, set[int]] = {}  # blob -> its readers
        named: dict[int, str] = {}  # blob -> the key its spans use
        for key, _, _, r in spans[file]:
            i = blobs.at.get(key)
            if i is not None:
                readers.setdefault(i, set()).add(r)
                named[i] = min(key, named.get(i, key))
        for i, key in sorted(named.items()):
            first = who[(file, key)]
            near = set().union(*(readers.get(j, ()) for j in (i - 1, i, i + 1)))
            others = {r for r in near if host(r) != host(first)}
            if first == me:
                for r in others:
                    sends.setdefault(r, []).append((file, key))
            elif me in others:
                recvs.setdefault(first, []).append((file, key))
    return ({r: sorted(v) for r, v in sends.items()}, {r: sorted(v) for r, v in recvs.items()})


class _Blobs(NamedTuple):
    keys: list[tuple[str, ...]]  # each blob's keys (aliases), in storage order
    at: dict[str, int]  # key -> its blob's index


def _blobs(layout: tuple) -> _Blobs:
    """A blob layout ``(firsts, ends, keys)`` with the keys naming one blob (same first byte) together."""
    keys: list[tuple[str, ...]] = []
    at: dict[str, int] = {}
    last = None
    for first, key in zip(layout[0], layout[2]):
        if first != last:
            keys.append(())
            last = first
        keys[-1] = (*keys[-1], key)
        at[key] = len(keys) - 1
    return _Blobs(keys, at)


def key_of(index: dict[str, int], name: str) -> int | None:
    """The checkpoint key index a chunk key names (``fqn`` or ``fqn@offsets``), or None."""
    k = index.get(name)
    if k is None and "@" in name:
        k = index.get(name.rsplit("@", 1)[0])
    return k


def relevant(spans: dict, me: int, start_of, layout_of, index: dict[str, int],
             page: int = PAGE) -> tuple[set[int], set[tuple[str, str]]]:
    """(checkpoint key indices, ``(file, key)``) of the chunks overlapping the first or last page of a
    span of ``me`` (the other pages of its spans lie inside its own chunks): only these chunks' spans
    can touch a page ``me`` touches, and only their offsets are looked up (a DCP item's costs a read of
    its local header: one inside or next to the page). A chunk key names its tensor (``fqn`` or
    ``fqn@offsets``, :func:`pipeload.formats.chunks.chunk_key`); a key naming none is left out alike on
    every rank."""
    out: set[int] = set()
    near: set[tuple[str, str]] = set()
    for file, fs in spans.items():
        layout = layout_of(file)
        if layout is None:  # pages decided per chunk: this rank's own chunks only
            near.update((file, key) for key, _, _, r in fs if r == me)
            continue
        firsts, ends, keys = layout
        for key, lo, hi, r in fs:
            if r != me:
                continue
            s = start_of(file, key)
            for p in {(s + lo) // page, (s + hi - 1) // page}:
                j = bisect.bisect_left(ends, p * page + 1)
                while j < len(firsts) and firsts[j] < (p + 1) * page:
                    name = keys[j]
                    near.add((file, name))
                    k = key_of(index, name)
                    if k is not None:
                        out.add(k)
                    j += 1
    return out, near
