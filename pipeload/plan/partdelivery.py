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


# Object stores: part delivery by contiguous runs (the page form above is for files on a device).
#
# There a page saves nothing: the cost is GETs and their bytes, and a rank's ranges of an object merge
# across the reader's 1 MiB gap, so pieces interleaved with other ranks' pieces (a load into another
# layout than the save's) fetch the other ranks' bytes too (1.8-2.6x the objects: docs/BENCH.md). Here
# the union of the bytes every rank reads in an object is cut into a few contiguous *runs*, each of one
# reader (its owner), which fetches it in large GETs; every byte another rank needs inside it is a
# Delivery from the owner. A rank's remaining reads then lie inside its own run: every byte is fetched
# once. Cost model: storage is the scarce resource (a GET costs a round trip and its bytes cross the
# store's link once per rank that asks), the wire between ranks is not: a run is worth it whenever the
# ranks' own merged requests would fetch over 1/RUN_SLACK more than the union.
RUN_BYTES = 8 << 20  # a run's size target: pipeload.io.objstore.PART_SIZE, a constant (a rank's part_size
#                      option may differ from another's, and every reader of an object must cut it alike)
RUN_GAP = 1 << 20  # the gap across which a rank's own requests of an object merge (the reader's merge gap)
RUN_SLACK = 64  # runs when the ranks' own requests would fetch over 1/64 more than the union of their bytes
OWN_GAP = 64 << 10  # an owner requests its run's needed bytes merged across holes up to this


def union(ranges: Iterable[tuple]) -> list[tuple[int, int]]:
    """The sorted union of byte ranges ``(a, b, ...)`` as disjoint ``(a, b)``, touching ones joined."""
    out: list[list[int]] = []
    for a, b, *_ in sorted(ranges):
        if b <= a:
            continue
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return [(a, b) for a, b in out]


def _gets(mine: dict[int, list[tuple[int, int]]], gap: int, size: int) -> int:
    """GETs the readers' own requests take: each rank's ranges merged across ``gap``, in parts of ``size``."""
    return sum(-(-(b - a) // size) for ranges in mine.values() for a, b in union((a, b + gap) for a, b in ranges))


def _merged_bytes(ranges: list[tuple[int, int]], gap: int) -> int:
    """Bytes requested for ``ranges`` (sorted, disjoint) when merged across holes up to ``gap``."""
    total, lo, hi = 0, None, None
    for a, b in ranges:
        if hi is not None and a - hi <= gap:
            hi = max(hi, b)
            continue
        if hi is not None:
            total += hi - lo
        lo, hi = a, b
    return total + (hi - lo if hi is not None else 0)


def by_rank(spans: Iterable[tuple]) -> dict[int, list[tuple[int, int]]]:
    """rank -> the union of its spans ``(a, b, rank, ...)`` (file offsets)."""
    out: dict[int, list] = {}
    for s in spans:
        out.setdefault(s[2], []).append(s)
    return {r: union(v) for r, v in sorted(out.items())}


def cut(whole: list[tuple[int, int]], n: int) -> list[tuple[int, int]]:
    """``n`` contiguous runs ``[lo, hi)`` tiling ``whole`` (sorted disjoint ranges) from its first byte to its
    last, each holding ``total / n`` of its bytes (rounded down; the last takes the rest)."""
    total = sum(b - a for a, b in whole)
    bounds, at, k = [whole[0][0]], 0, 1
    for a, b in whole:
        while k < n and at + (b - a) > total * k // n:
            bounds.append(a + total * k // n - at)
            k += 1
        at += b - a
    bounds.append(whole[-1][1])
    return [(bounds[i], bounds[i + 1]) for i in range(len(bounds) - 1) if bounds[i + 1] > bounds[i]]


def runs(spans: list[tuple], order: int = 0, size: int = RUN_BYTES, gap: int = RUN_GAP) -> list[tuple[int, int, int]]:
    """The runs ``(lo, hi, owner)`` of one object, or ``[]`` (its readers read as they are). ``spans``:
    ``(first byte, end, rank, ...)`` in file offsets, every rank's; ``order``: the object's position among
    the checkpoint's files (turns the owners from one object to the next, so the runs spread over ranks).

    Runs are planned when two or more ranks read the object and their own requests (merged across
    ``gap``) would fetch over 1/:data:`RUN_SLACK` more than the union of their bytes, or take more than
    one GET over the fewest parts of ``size`` the union needs (readers of small interleaved regions: a
    box spanning two objects, read by the member of its holder set whose run of storage holds its first
    byte, makes every member read a region of each object). The union is cut
    into ``n = min(readers, ceil(union / size))`` runs of equal bytes (:func:`cut`); each run's owner is
    the reader needing most of it, ties to the reader first in the rotated order (``order x n`` places
    on), each reader owning at most one run per object. Deterministic: a function of the set of spans."""
    mine = by_rank(spans)
    whole = union((a, b) for r in mine.values() for a, b in r)
    total = sum(b - a for a, b in whole)
    twice = sum(_merged_bytes(r, gap) for r in mine.values()) * RUN_SLACK > total * (RUN_SLACK + 1)
    if len(mine) < 2 or not (twice or _gets(mine, gap, size) > -(-total // size) + 1):
        return []
    readers = sorted(mine)
    n = min(len(readers), max(1, -(-total // size)))
    tiles = cut(whole, n)
    turn = {r: (i - order * len(tiles)) % len(readers) for i, r in enumerate(readers)}
    need = sorted((-_inside(mine[r], lo, hi), turn[r], j, r) for j, (lo, hi) in enumerate(tiles) for r in readers)
    owner: dict[int, int] = {}
    for _, _, j, r in need:
        if j not in owner and r not in owner.values():
            owner[j] = r
    return [(lo, hi, owner[j]) for j, (lo, hi) in enumerate(tiles)]


def _inside(ranges: list[tuple[int, int]], lo: int, hi: int) -> int:
    return sum(max(0, min(b, hi) - max(a, lo)) for a, b in ranges)


def blob_runs(spans: list[tuple], blobs: dict[str, tuple[int, int]], me: int, file: str,
              order: int = 0) -> tuple[list[Delivery], list[tuple[int, int]]]:
    """(``me``'s deliveries, the ranges ``me`` requests) for an object whose chunks are located by their
    own heads (a DCP object: where a tensor starts is known only once its blob's head is read). Runs are
    cut as :func:`runs` cuts them, from each reader's chunks taken as whole blobs (``blobs``: key -> first
    byte, end), and a chunk belongs to the run holding its blob's first byte: its owner fetches the whole
    blob (head, tensor, trailer) and sends each other reader its bytes (``spans``: ``(key, lo, hi, rank)``,
    chunk-relative), so a receiver needs neither the blob's head nor its position. Without runs each rank
    requests its own blobs whole. A function of the spans and the blobs: alike on every reader."""
    wide = [(blobs[key][0], blobs[key][1], r) for key, _, _, r in spans if key in blobs]
    cuts = runs(wide, order)
    keys = sorted({key for key, *_ in spans if key in blobs}, key=lambda k: blobs[k])
    if not cuts:
        return [], union((blobs[k][0], blobs[k][1]) for k, _, _, r in spans if r == me and k in blobs)
    firsts = [lo for lo, _, _ in cuts]
    owner = {k: cuts[max(0, bisect.bisect_right(firsts, blobs[k][0]) - 1)][2] for k in keys}
    per: dict[tuple[int, str], list] = {}
    for key, lo, hi, r in spans:
        if key in owner and owner[key] != r:
            per.setdefault((r, key), []).append((lo, hi))
    out = [Delivery(owner[key], r, file, key, a, b) for (r, key), ranges in per.items() for a, b in union(ranges)
           if me in (owner[key], r)]
    return sorted(out), _joined([blobs[k] for k in keys if owner[k] == me], OWN_GAP)


def _joined(ranges: list[tuple[int, int]], gap: int) -> list[tuple[int, int]]:
    """Sorted ``ranges`` merged across holes up to ``gap``."""
    out: list[list[int]] = []
    for a, b in sorted(ranges):
        if out and a - out[-1][1] <= gap:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return [(a, b) for a, b in out]


def run_deliveries(spans: list[tuple], cuts: list[tuple[int, int, int]], file: str) -> list[Delivery]:
    """Every delivery of one object's runs: each rank's bytes (``spans``: ``(first byte, end, rank, chunk
    key, chunk's first byte)``, file offsets) inside another rank's run, chunk-relative, one per span piece
    (a rank's spans of one chunk joined first: each byte is delivered once). Sorted."""
    per: dict[tuple[int, str, int], list] = {}
    for a, b, r, key, s in spans:
        per.setdefault((r, key, s), []).append((a, b))
    out = []
    for (r, key, s), ranges in per.items():
        for a, b in union(ranges):
            for lo, hi, o in cuts:
                if o != r and lo < b and hi > a:
                    out.append(Delivery(o, r, file, key, max(a, lo) - s, min(b, hi) - s))
    return sorted(out)


def owned(spans: list[tuple], cuts: list[tuple[int, int, int]], me: int, gap: int = OWN_GAP) -> list[tuple[int, int]]:
    """The byte ranges ``me`` requests for its runs: the union of every rank's spans inside them, merged
    across holes up to ``gap`` (few GETs; a hole is bytes nobody reads)."""
    whole = union((a, b) for a, b, *_ in spans)
    out: list[tuple[int, int]] = []
    for lo, hi, o in cuts:
        if o != me:
            continue
        for a, b in whole:
            a, b = max(a, lo), min(b, hi)
            if b <= a:
                continue
            if out and a - out[-1][1] <= gap:
                out[-1] = (out[-1][0], b)
            else:
                out.append((a, b))
    return out


def merged(spans: Iterable[tuple], gap: int = RUN_GAP) -> dict[int, list[tuple[int, int]]]:
    """rank -> its spans ``(a, b, rank, ...)`` merged across holes up to ``gap``: the ranges its own
    requests of an object fetch (the reader's rule), sorted."""
    out = {}
    for r, ranges in by_rank(spans).items():
        joined = union((a, b + gap) for a, b in ranges)
        out[r] = [(a, b - gap) for a, b in joined]
    return out


def nested(spans: list[tuple], gap: int = RUN_GAP) -> list[tuple[int, int, int, int]]:
    """``(lo, hi, rank, owner)``: each of a rank's own ranges (:func:`merged`) of an object without runs
    that lies inside a larger range of another rank, ``owner`` the rank whose range is the largest of those
    holding it (ties to the lower rank). The owner fetches its range anyway: it sends the rank its bytes
    there, one GET saved (a small tensor several ranks read, each for itself).
    An owner's own range is never nested (it is the largest holding it). Sorted; a function of the spans.
    One sort and a bisection per range: the ranges nested in no other, by first byte, end in order too."""
    tops: list[tuple[int, int, int]] = []
    inner, reach = [], -1
    for lo, nhi, r in sorted((lo, -hi, r) for r, rs in merged(spans, gap).items() for lo, hi in rs):
        if -nhi <= reach:  # inside an earlier range (longer, or equal and of a lower rank)
            inner.append((lo, -nhi, r))
        else:
            tops.append((lo, -nhi, r))
            reach = -nhi
    firsts, ends = [a for a, _, _ in tops], [b for _, b, _ in tops]
    out = []
    for lo, hi, r in inner:
        holding = tops[bisect.bisect_left(ends, hi) : bisect.bisect_right(firsts, lo)]
        out.append((lo, hi, r, min((a - b, o) for a, b, o in holding)[1]))
    return sorted(out)


def nested_deliveries(spans: list[tuple], inner: list[tuple[int, int, int, int]], file: str) -> list[Delivery]:
    """The deliveries of :func:`nested` ranges: each rank's spans (``(first byte, end, rank, chunk key,
    chunk's first byte)``) inside one, from its owner, chunk-relative (a chunk's spans joined first). Sorted."""
    per: dict[tuple[int, str, int], list] = {}
    for a, b, r, key, s in spans:
        per.setdefault((r, key, s), []).append((a, b))
    of: dict[int, list[tuple[int, int, int]]] = {}  # rank -> its nested ranges, sorted (disjoint)
    for lo, hi, r, o in inner:
        of.setdefault(r, []).append((lo, hi, o))
    out = []
    for (r, key, s), got in per.items():
        mine = of.get(r, [])
        for a, b in union(got):
            i = bisect.bisect_right(mine, (a, math.inf, 0)) - 1  # (a span lies inside one range of its rank)
            if i >= 0 and mine[i][0] <= a and b <= mine[i][1]:
                out.append(Delivery(mine[i][2], r, file, key, a - s, b - s))
    return sorted(out)


def plan_runs(every, md, names: list[str], itemsize, me: int, files: set[str],
              start_of: Callable[[str, str], int], keys_in: Callable[[str], set[int]],
              order_of: Callable[[str], int], objects: dict[str, list[tuple]] | None = None,
              blobs_of: Callable[[str], dict | None] = lambda file: None,
              ) -> tuple[list[Delivery], dict[str, list[tuple[int, int]]]]:
    """(the deliveries ``me`` sends or receives, sorted as :func:`plan`'s; file -> the ranges ``me`` requests
    at once, before any read: as the owner of runs there, or, in an object without runs, its own spans
    merged across :data:`RUN_GAP` less those inside another rank's (:func:`nested`: delivered from there):
    few GETs of whole parts, instead of one per phase and window) for
    objects. ``keys_in(file)``: the checkpoint key indices stored in a
    file ``me`` reads (from its header). Every reader of an object expands the boxes of every key stored
    in it, so all of them see the same spans there and cut it alike (:func:`runs`): an owner and each of
    its receivers derive the same deliveries, from nothing but the files they both read. ``objects``:
    file -> ``(stored key, 0, bytes, rank)`` of the Python objects every rank reads there (from the
    gathered records): spans like the tensors', so a record every rank reads is fetched once.
    ``blobs_of(file)``: ``key -> (first byte, end)`` of each chunk's blob in a file whose chunks are
    located by their own heads (a DCP object), else None: such a file's runs hold whole blobs
    (:func:`blob_runs`)."""
    keys: set[int] = set()
    for f in sorted(files):
        keys |= keys_in(f)
    spans = spans_of(every.boxes(keys), md, names, itemsize, files) if keys else {}
    for file, more in sorted((objects or {}).items()):
        if file in files:
            spans.setdefault(file, []).extend(more)
    out: list[Delivery] = []
    mine: dict[str, list[tuple[int, int]]] = {}
    for file, fs in sorted(spans.items()):
        if not any(r == me for *_, r in fs):
            continue
        blobs = blobs_of(file)
        if blobs is not None:
            more, mine[file] = blob_runs(fs, blobs, me, file, order_of(file))
            out.extend(more)
            continue
        absolute = [(s + lo, s + hi, r, key, s) for key, lo, hi, r in fs for s in (start_of(file, key),)]
        cuts = runs(absolute, order_of(file))
        if cuts:
            out.extend(d for d in run_deliveries(absolute, cuts, file) if me in (d.owner, d.receiver))
            mine[file] = owned(absolute, cuts, me)
        else:  # its own requests fetch nothing twice: asked for at once, merged as the reader merges them,
            inner = nested(absolute)  # but for ranges inside another rank's: delivered from there
            out.extend(d for d in nested_deliveries(absolute, inner, file) if me in (d.owner, d.receiver))
            gone = {(lo, hi) for lo, hi, r, _ in inner if r == me}
            mine[file] = [x for x in merged(absolute).get(me, []) if x not in gone]
    return sorted(out), mine
