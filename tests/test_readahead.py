"""How a rank requests each file's bytes: exactly where its share is scattered, in long runs otherwise.

The decision (``pipeload.io.reader.scattered``) is a function of the ranges this rank's plan reads from
one file; the reader applies it per file once the plan is known (``ChunkReader.expect``). Local I/O
only: nothing here changes which rank reads what.
"""

from __future__ import annotations

import os

import torch
from safetensors.torch import save_file

from pipeload.formats.dcp import DistcpFile
from pipeload.io import reader as R
from pipeload.io.reader import ChunkReader, holes, scattered
from pipeload.plan.planner import ReadItem

PAGE = R._PAGE
KIB = 1024


def test_holes_merge_across_a_page_and_count_what_lies_between():
    assert holes([]) == (0, 0)
    assert holes([(0, 100), (100, 300), (50, 120)]) == (300, 0)  # overlapping and adjacent: one run
    assert holes([(0, 100), (100 + PAGE, 200 + PAGE)]) == (200 + PAGE, 0)  # a hole inside a page is read
    assert holes([(0, 100), (101 + PAGE, 201 + PAGE)]) == (200, PAGE + 1)
    assert holes([(10, 10), (20, 5)]) == (0, 0)  # empty ranges read nothing


def test_a_share_interleaved_with_other_ranks_pieces_is_scattered():
    piece = 100 * KIB
    mine = [(2 * i * piece, (2 * i + 1) * piece) for i in range(16)]  # every other piece: a 2-way split
    assert scattered(mine)
    assert scattered(mine[::4])  # a few pieces far apart
    # order does not matter: the decision is the ranges', not the plan's order
    assert scattered(list(reversed(mine))) == scattered(mine)


def test_a_run_with_small_holes_or_one_piece_is_read_in_runs():
    assert not scattered([(0, 64 << 20)])  # a whole file
    assert not scattered([(0, 1 << 20)])  # one piece: nothing to interleave
    run = [(i * 256 * KIB, (i + 1) * 256 * KIB) for i in range(64)]  # 16 MiB, contiguous
    assert not scattered(run)
    # holes of at most 1/32 of what is read: still a run (a 1 MiB gap merges them, reading the holes)
    with_holes = [(a, b - 2 * KIB) for a, b in run]  # 2 KiB holes, under a page: not holes at all
    assert not scattered(with_holes)
    sparse = [(a, b - 8 * KIB) for a, b in run]  # 8 KiB holes in 248 KiB: 1/31 of the bytes
    assert scattered(sparse)
    just = [(a, b - 7 * KIB) for a, b in run]  # 7 KiB in 249 KiB: under 1/32
    assert not scattered(just)


def _file(tmp_path, n: int = 16, rows: int = 64) -> tuple[str, dict]:
    tensors = {f"t{i:02d}": torch.full((rows, 256), float(i)) for i in range(n)}  # 64 KiB each
    save_file(tensors, os.path.join(tmp_path, "data.safetensors"))
    return "data.safetensors", tensors


def _whole(name: str, key: str, t: torch.Tensor) -> ReadItem:
    shape = tuple(t.shape)
    return ReadItem(name, key, "", shape, (0,) * len(shape), (0,) * len(shape), shape, t.nbytes)


def _rows(name: str, key: str, t: torch.Tensor, lo: int, hi: int) -> ReadItem:
    shape = tuple(t.shape)
    return ReadItem(name, key, "", shape, (lo, 0), (0, 0), (hi - lo, shape[1]), (hi - lo) * t[0].nbytes)


def test_the_reader_merges_only_across_a_page_in_a_file_read_scattered(tmp_path):
    name, tensors = _file(tmp_path)
    with ChunkReader(str(tmp_path)) as reader:
        f = reader.file(name)
        assert reader.merge_gap_of(name, f) == R._MERGE_GAP  # no plan yet (an early request): the default
        reader.expect([_whole(name, k, t) for k, t in list(tensors.items())[::2]])  # every other tensor
        assert reader.merge_gap_of(name, f) == PAGE
        reader.expect([_whole(name, k, t) for k, t in tensors.items()])  # the whole file
        assert reader.merge_gap_of(name, f) == R._MERGE_GAP
        # the first half of every tensor's rows: the other halves are another rank's
        reader.expect([_rows(name, k, t, 0, 32) for k, t in tensors.items()])
        assert reader.merge_gap_of(name, f) == PAGE
        reader.expect([])  # a file this rank does not read in this load: the layout's gap
        assert reader.merge_gap_of(name, f) == R._MERGE_GAP


class _Recorder:
    """A file that records the requests a prefetch makes (entry() from the real file)."""

    def __init__(self, f):
        self.f, self.calls = f, []

    def entry(self, key):
        return self.f.entry(key)

    def willneed_tensors(self, keys, gap):
        self.calls.append(("tensors", len(list(keys)), gap))

    def advise(self, advice, lo, hi):
        self.calls.append((advice, lo, hi))


def test_prefetch_requests_a_scattered_share_piece_by_piece(tmp_path):
    name, tensors = _file(tmp_path)
    with ChunkReader(str(tmp_path)) as reader:
        rec = _Recorder(reader.file(name))
        reader.file = lambda n: rec  # noqa: E731 - the prefetch's requests, recorded
        halves = [_rows(name, k, t, 0, 32) for k, t in tensors.items()]
        reader.expect(halves)
        reader.prefetch(halves)
        assert len(rec.calls) == len(halves)  # 32 KiB pieces 32 KiB apart: never merged
        assert sum(hi - lo for _, lo, hi in rec.calls) == sum(it.nbytes for it in halves)
        rec.calls.clear()
        whole = [_whole(name, k, t) for k, t in tensors.items()]
        reader.expect(whole)
        reader.prefetch(whole)
        assert rec.calls == [("tensors", len(whole), R._MERGE_GAP)]  # read in runs: one merged request


def test_expect_leaves_object_stores_as_they_are():
    reader = ChunkReader("s3://bucket/ckpt")
    reader.expect([ReadItem("a.safetensors", "k", "", (8,), (0,), (0,), (4,), 16)])
    assert reader._expected == {}  # requests there are coalesced by parts (pipeload.io.objstore)


class _Raw:
    def __init__(self):
        self.calls = []
        self.size = 1 << 20

    def willneed(self, lo, hi):
        self.calls.append((lo, hi))


def test_a_dcp_willneed_over_part_of_a_blob_asks_for_its_head_not_the_rest():
    """A hint over part of an unlocated blob's tensor also covers what locating it reads (the blob's
    head: the local headers), and the header's shift (slack) at its end, never the rest of the blob
    (another rank's part); once the item is located (here or by another reader), the hint is exact."""
    f = object.__new__(DistcpFile)
    f.raw = _Raw()
    f._blobs = [(0, 100_000, "a"), (100_000, 200_000, "b")]
    f._blob_starts = [0, 100_000]
    f._slack = 900
    f._resolved, f.located = {}, {}
    f.advise("willneed", 0, 40_000)  # the first rows of the first blob's tensor: the head is in the range
    assert f.raw.calls == [(0, 40_900)]
    f.raw.calls.clear()
    f.advise("willneed", 60_000, 99_000)  # its last rows: the head on its own, the end up to the blob's
    assert f.raw.calls == [(0, 900), (60_000, 99_900)]
    f.raw.calls.clear()
    f.advise("willneed", 100_000, 199_500)  # up to within a header of the end: the whole blob
    assert f.raw.calls == [(100_000, 200_000)]
    f.raw.calls.clear()
    f.located = {"a": (704, 99_500)}  # another reader located "a"
    f.advise("willneed", 60_000, 80_000)
    assert f.raw.calls == [(60_000, 80_000)]
