"""Part delivery from an object store: *runs* instead of pages (the planning :mod:`pipeload.engine.delivery`
runs for a checkpoint under ``s3://``).

A GET costs a request, and the reader merges a rank's ranges of an object closer than 1 MiB into one:
pieces interleaved with other ranks' pieces fetch those ranks' bytes too. Each object's reads are cut
into a few contiguous runs, each fetched by one reader in large GETs, which sends every other reader its
bytes inside it (:class:`pipeload.plan.partdelivery.Delivery`, the same messages and patches as the page
owners'). Pure functions of every rank's spans: each reader of an object derives the same runs.
"""

from __future__ import annotations

import bisect
import math
from typing import Callable, Iterable

from .partdelivery import Delivery, spans_of

# Why runs: on an object store a page saves nothing: the cost is GETs and their bytes, and a rank's
# ranges of an object merge across the reader's 1 MiB gap, so pieces interleaved with other ranks' pieces (a load into another
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
    return sum(-(-(b - a) // size) for ranges in mine.values() for a, b in _joined(ranges, gap))


def _merged_bytes(ranges: list[tuple[int, int]], gap: int) -> int:
    """Bytes requested for ``ranges`` when merged across holes up to ``gap``."""
    return sum(b - a for a, b in _joined(ranges, gap))


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


def _joined(ranges: Iterable[tuple[int, int]], gap: int) -> list[tuple[int, int]]:
    """Sorted ``ranges`` merged across holes up to ``gap``."""
    return [(a, b - gap) for a, b in union((a, b + gap) for a, b in ranges)]


def run_deliveries(spans: list[tuple], cuts: list[tuple[int, int, int]], file: str) -> list[Delivery]:
    """Every delivery of one object's runs: each rank's bytes (``spans``: ``(first byte, end, rank, chunk
    key, chunk's first byte)``, file offsets) inside another rank's run, chunk-relative, one per span piece
    (a rank's spans of one chunk joined first: each byte is delivered once). Sorted."""
    out = []
    for (r, key, s), ranges in _per_chunk(spans).items():
        for a, b in union(ranges):
            for lo, hi, o in cuts:
                if o != r and lo < b and hi > a:
                    out.append(Delivery(o, r, file, key, max(a, lo) - s, min(b, hi) - s))
    return sorted(out)


def _per_chunk(spans: list[tuple]) -> dict[tuple[int, str, int], list[tuple[int, int]]]:
    """(rank, chunk key, chunk's first byte) -> that rank's spans ``(first byte, end, rank, chunk key,
    chunk's first byte)`` of the chunk, as ``(a, b)``."""
    per: dict[tuple[int, str, int], list] = {}
    for a, b, r, key, s in spans:
        per.setdefault((r, key, s), []).append((a, b))
    return per


def owned(spans: list[tuple], cuts: list[tuple[int, int, int]], me: int, gap: int = OWN_GAP) -> list[tuple[int, int]]:
    """The byte ranges ``me`` requests for its runs: the union of every rank's spans inside them, merged
    across holes up to ``gap`` (few GETs; a hole is bytes nobody reads)."""
    whole = union((a, b) for a, b, *_ in spans)
    return _joined(((max(a, lo), min(b, hi)) for lo, hi, o in cuts if o == me for a, b in whole
                    if min(b, hi) > max(a, lo)), gap)


def merged(spans: Iterable[tuple], gap: int = RUN_GAP) -> dict[int, list[tuple[int, int]]]:
    """rank -> its spans ``(a, b, rank, ...)`` merged across holes up to ``gap``: the ranges its own
    requests of an object fetch (the reader's rule), sorted."""
    return {r: _joined(ranges, gap) for r, ranges in by_rank(spans).items()}


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
    of: dict[int, list[tuple[int, int, int]]] = {}  # rank -> its nested ranges, sorted (disjoint)
    for lo, hi, r, o in inner:
        of.setdefault(r, []).append((lo, hi, o))
    out = []
    for (r, key, s), got in _per_chunk(spans).items():
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
