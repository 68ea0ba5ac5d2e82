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
"""

from __future__ import annotations

import bisect
import math
from typing import Callable, Iterable, NamedTuple

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
    for private_pass in (False, True):  # unit pieces first: the chunks they cover
        for rank, key, private in boxes:
            if private != private_pass:
                continue
            idx = unit_index(key) if key[0] < 0 else key[0]
            isz = int(itemsize[idx])
            for chunk in md.chunks_for(names[idx], key[1], key[2]):
                hit = _intersect(chunk, key[1], key[2])
                if hit is None:
                    continue
                if key[0] < 0:
                    units.add((chunk.file, chunk.key))
                if (files is not None and chunk.file not in files) or (private and (chunk.file, chunk.key) in units):
                    continue
                lo, hi = box_span(chunk.lengths, hit[0], hit[2], isz)
                if hi - lo == math.prod(hit[2]) * isz and hi > lo:
                    out.setdefault(chunk.file, []).append((chunk.key, lo, hi, rank))
    return out


def decide(spans: list[tuple[int, int, int, str, int]], host: Callable[[int], int], file: str,
           page: int = PAGE) -> list[Delivery]:
    """The deliveries of one file. ``spans``: ``(first byte, end, rank, chunk key, chunk's first byte)``
    in file offsets. Candidate pages are those holding a span's first or last byte (an interior page is
    covered whole by its span's rank); for each, the ranks' bytes there decide owner and receivers (see
    the module docstring). Deterministic: the result depends only on the set of spans."""
    spans = sorted(spans)
    pages = sorted({a // page for a, *_ in spans} | {(b - 1) // page for _, b, *_ in spans})
    out: list[Delivery] = []
    active: list = []
    nxt = 0
    for p in pages:
        p0, p1 = p * page, (p + 1) * page
        while nxt < len(spans) and spans[nxt][0] < p1:
            active.append(spans[nxt])
            nxt += 1
        active = [s for s in active if s[1] > p0]
        if len(active) < 2:
            continue
        need: dict[int, int] = {}
        for a, b, r, *_ in active:
            need[r] = need.get(r, 0) + min(b, p1) - max(a, p0)
        if len({host(r) for r in need}) < 2:
            continue
        owner = min(need, key=lambda r: (-need[r], r))
        for a, b, r, key, start in active:
            if (host(r) == host(owner) or need[r] >= page or page * STORAGE_COST <= need[r] * WIRE_COST):
                continue
            out.append(Delivery(owner, r, file, key, max(a, p0) - start, min(b, p1) - start))
    return out


def plan(boxes: Iterable[tuple], md, names: list[str], itemsize, me: int, files: set[str],
         start_of: Callable[[str, str], int], layout_of: Callable[[str], tuple],
         host: Callable[[int], int], page: int = PAGE) -> list[Delivery]:
    """The deliveries this rank ``me`` sends or receives, sorted by (owner, receiver, file, key, lo): the
    order of the messages and of the parts packed in each.

    ``files``: the files ``me`` reads; ``start_of(file, key)``: a stored chunk's first byte in its file;
    ``layout_of(file)``: its chunks as ``(firsts, ends, keys)`` sorted by first byte (each range may hold
    more than the chunk), or None: the file's pages are decided per chunk, among the readers of that chunk
    only (a DCP blob, where learning a chunk's offset reads its zip headers: only a rank reading a chunk
    looks it up; every reader of the chunk sees all its spans, so they decide alike, and a page where two
    chunks meet is left to be read by each). Only the boxes of :func:`relevant` keys are expanded:
    the chunks overlapping a page ``me`` touches. Every other participant of such a page touches it too,
    so it expands every chunk overlapping it as well, and both decide the page from the same spans."""
    by_key: dict[int, list] = {}
    for b in boxes:
        k = b[1][0]
        by_key.setdefault(-1 - k if k < 0 else k, []).append(b)
    mine = {k for k, bs in by_key.items() if any(b[0] == me for b in bs)}
    spans = spans_of((b for k in sorted(mine) for b in by_key[k]), md, names, itemsize, files)
    keys, near = relevant(spans, me, start_of, layout_of, md.key_index(), page)
    if keys - mine:
        for file, extra in spans_of((b for k in sorted(keys - mine) for b in by_key.get(k, ())), md, names,
                                    itemsize, files).items():
            spans.setdefault(file, []).extend(extra)
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
        for group in absolute.values():
            out.extend(d for d in decide(group, host, file, page) if me in (d.owner, d.receiver))
    return sorted(out)


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
                    k = index.get(name)
                    if k is None and "@" in name:
                        k = index.get(name.rsplit("@", 1)[0])
                    if k is not None:
                        out.add(k)
                    j += 1
    return out, near
