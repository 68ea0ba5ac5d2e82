"""Copying ReadItems out of checkpoint files: the torch-facing side of ``pipeload.io._fastio``.

A stored chunk is viewed in place (``torch.frombuffer`` over the file's mapping, no copy) and the
ReadItem's box is copied from that view straight into its destination region: one copy per byte.
Nothing is pre-checked that the next call checks anyway: a missing file or key surfaces from the
open or lookup itself, with the file name and key in the message.
"""

from __future__ import annotations

import io
import math
import mmap
import os
import zipfile
from typing import Any, Iterable

import torch

from ._fastio import FileCache, SafetensorsFile, guarded_copy
from .checksum import hasher
from ..errors import ChecksumError, CheckpointFormatError, ReadError
from ..formats.metadata import _DTYPE_NAMES as _STORED  # safetensors dtype name -> torch dtype
from ..formats.chunks import box_span
from ..formats.metadata import ObjectMeta, dtype_name, resolve_inside
from ..formats.objects import load_object, refusal
from ..plan.planner import ReadItem
from . import storage


def narrow(t: torch.Tensor, offsets: tuple[int, ...], lengths: tuple[int, ...]) -> torch.Tensor:
    """The box (offsets, lengths) of ``t`` as a view."""
    for dim, (o, n) in enumerate(zip(offsets, lengths)):
        if o != 0 or n != t.shape[dim]:
            t = t.narrow(dim, o, n)
    return t


_MERGE_GAP = 1 << 20  # prefetch ranges closer than this are requested as one (a file this rank reads in runs)
_PAGE = mmap.PAGESIZE
# A file this rank reads in runs: the holes between its ranges (merged across a page) are at most 1/32 of
# the bytes it reads there. Its requests may then run over holes (up to the merge gap): at most 1/32 more.
_RUN_HOLES = 32
_OBJECTS_OPEN = 64  # objects of a checkpoint in object storage kept open (and their staged bytes)


def holes(ranges: Iterable[tuple[int, int]], page: int = _PAGE) -> tuple[int, int]:
    """(bytes in ``ranges``, bytes of the holes between them), ranges ``[lo, hi)`` of one file merged
    where they overlap or are at most ``page`` apart (a hole inside a page shares it: not counted)."""
    spans = sorted((a, b) for a, b in ranges if b > a)
    if not spans:
        return 0, 0
    read = hole = 0
    lo, hi = spans[0]
    for a, b in spans[1:]:
        if a - hi > page:
            read += hi - lo
            hole += a - hi
            lo = a
        hi = max(hi, b)
    return read + hi - lo, hole


def scattered(ranges: Iterable[tuple[int, int]], page: int = _PAGE) -> bool:
    """Whether this rank's ``ranges`` of one file are scattered: interleaved with bytes it does not read,
    holes over 1/:data:`_RUN_HOLES` of what it reads. Such a file is requested exactly (ranges merged
    across a page only): a request spanning a hole would read bytes another rank (another node) reads,
    once more. A pure function of the ranges: this rank's local I/O only, never a collective decision."""
    read, hole = holes(ranges, page)
    return hole * _RUN_HOLES > read


def copy_box(dst: torch.Tensor, src: torch.Tensor, source: str, ring=None) -> None:
    """``dst.copy_(src)`` for a ``src`` that views a file mapping, safe against the file changing.

    Host destinations get one guarded strided copy (memcpy per contiguous run, without the GIL): a
    page fault the kernel cannot serve — ``source`` truncated mid-copy, a storage error surfacing as
    SIGBUS — raises :class:`ReadError` for this copy instead of killing the process. Other devices,
    and a destination of another dtype (converted on the copy), go through a host buffer filled the
    same way (a device copy or a conversion cannot be guarded), and so does a conjugate or negative view.
    ``ring`` (a :class:`pipeload.device.H2DRing`): a destination on its device of the same dtype is
    filled through its page-locked slots, each slot by the same guarded copy.
    """
    if dst.shape != src.shape:
        raise ValueError(f"copy_box: {dst.dtype} {list(dst.shape)} <- {src.dtype} {list(src.shape)}")
    if (ring is not None and dst.device == ring.device and dst.dtype == src.dtype and not dst.is_conj()
            and not dst.is_neg()):
        ring.copy(dst, src, lambda host, part: copy_box(host, part, source))
        return
    if dst.device.type != "cpu" or dst.dtype != src.dtype or dst.is_conj() or dst.is_neg():
        # (another dtype: load(cast=True) converts; a conjugate or negative view holds other values than
        # its memory: torch's copy_ writes them)
        host = torch.empty(src.shape, dtype=src.dtype)
        copy_box(host, src, source)
        dst.copy_(host)
        return
    if not dst.data_ptr() and dst.numel():
        raise ValueError(f"copy_box: the destination ({type(dst).__name__}) has no memory of its own")
    if dst.is_contiguous() and src.is_contiguous():
        n = dst.nbytes
        if n:
            guarded_copy(dst.data_ptr(), _ONE, src.data_ptr(), _ONE, (n,), 1, source)
        return
    if dst.numel() == 0:
        return
    isz = dst.element_size()
    guarded_copy(dst.data_ptr(), tuple(s * isz for s in dst.stride()),
                 src.data_ptr(), tuple(s * isz for s in src.stride()), tuple(dst.shape), isz, source)


_ONE = (1,)


_PIECE = 64 << 20  # guarded hashing copies through a buffer of at most this many bytes


def guarded_read(f: SafetensorsFile, buf: memoryview, keep: bool = False) -> tuple[str, bytearray | None]:
    """(xxh3 checksum of ``buf``, a private copy of it when ``keep``), ``buf`` being a view of ``f``'s
    mapping, read through :func:`copy_box`'s guard in pieces: a file cut or failing meanwhile raises
    ReadError, never SIGBUS."""
    n = buf.nbytes
    h = hasher()
    kept = bytearray(n) if keep else None
    if n == 0:
        return h.hexdigest(), kept
    src = torch.frombuffer(buf, dtype=torch.uint8)
    if kept is not None:
        copy_box(torch.frombuffer(kept, dtype=torch.uint8), src, f.path)
        h.update(kept)
        return h.hexdigest(), kept
    piece = bytearray(min(_PIECE, n))
    dst = torch.frombuffer(piece, dtype=torch.uint8)
    for lo in range(0, n, _PIECE):
        k = min(_PIECE, n - lo)
        copy_box(dst[:k], src[lo : lo + k], f.path)
        h.update(memoryview(piece)[:k])
    return h.hexdigest(), None


def check_object_archive(data: bytes | bytearray, where: str) -> None:
    """Refuse an object record that is not what ``torch.save`` writes: a zip of STORED members.

    ``torch.save`` never compresses, but its reader inflates DEFLATE members: a small hostile record
    could otherwise decode to a thousand times its size in memory. Both the central directory and
    each member's local header must say "stored", with equal stored and decoded sizes.
    """
    try:
        with zipfile.ZipFile(io.BytesIO(data)) as z:
            infos = z.infolist()
    except (zipfile.BadZipFile, ValueError, OSError, EOFError) as e:
        raise CheckpointFormatError(f"{where}: not a torch.save archive ({e})") from None
    for info in infos:
        local = data[info.header_offset : info.header_offset + 30]
        if (
            info.compress_type != zipfile.ZIP_STORED
            or info.file_size != info.compress_size
            or len(local) < 30
            or local[:4] != b"PK\x03\x04"
            or int.from_bytes(local[8:10], "little") != zipfile.ZIP_STORED
        ):
            raise CheckpointFormatError(
                f"{where}: an archive member is compressed or its sizes disagree; "
                f"torch.save writes stored members only"
            )


def decode_object(data: bytes | bytearray, where: str) -> Any:
    """An object record after :func:`check_object_archive`, decoded by torch's ``weights_only`` unpickler
    with plain numpy values allowed (:func:`pipeload.formats.objects.load_object`): no code runs."""
    check_object_archive(data, where)
    try:
        return load_object(data)
    except Exception as e:  # noqa: BLE001 - any refusal of the unpickler is a format problem
        raise CheckpointFormatError(f"{where}: does not load with torch.load(weights_only=True): {refusal(e)}") from None


def chunk_start(f: Any, key: str) -> int:
    """A stored chunk's first byte in its open file ``f`` (a DCP item: once its blob's head located it)."""
    resolve = getattr(f, "_resolve", None)
    return int(resolve(key)[2]) if resolve is not None else int(f.entry(key)[2])


class ChunkReader:
    """Reads chunks of one checkpoint directory through one LRU of open files."""

    def __init__(self, directory: str, *, cache_size: int = 8, verify_checksums: bool = False):
        self.directory = directory
        self.cache = FileCache(cache_size)
        self.verify = verify_checksums
        self._verified: set[tuple[str, str]] = set()
        self._paths: dict[str, str] = {}  # data file name -> its path, once found inside the checkpoint
        self.bytes_read = 0
        self.cast = False  # view chunks in their stored dtype and convert while copying
        self.format = ""  # the attached checkpoint's layout
        self.merge_gap = _MERGE_GAP  # prefetch ranges of one file closer than this are requested as one
        self.ring = None  # a pipeload.device.H2DRing: how bytes reach accelerator destinations
        # the plan's reads of this rank, per file (see expect()), and each file's merge gap once decided
        self._expected: dict[str, list[ReadItem]] = {}
        self._gaps: dict[str, int] = {}
        # part delivery (pipeload.plan.partdelivery): (file, key) -> [(lo, hi, bytes)], byte ranges of stored
        # chunks another rank read from its page and sent here; this load's reads take them from here
        self.patches: dict[tuple[str, str], list[tuple[int, int, torch.Tensor]]] = {}
        # file -> {key: (start, end)}: where another reader found chunks whose position is learnt from
        # their own header (a DCP blob's head, pipeload.engine.delivery.plan): this rank skips reading it
        self.located: dict[str, dict[str, tuple[int, int]]] = {}
        # objects: file -> byte ranges this rank fetches as the owner of runs (pipeload.engine.delivery)
        self.runs: dict[str, list[tuple[int, int]]] = {}

    def attach(self, ckpt, *, cast: bool = False) -> None:
        """Serve the chunks of ``ckpt`` (a :class:`pipeload.formats.Checkpoint` of any layout).

        Its data files are opened by the layout's opener (safetensors files when it has none) and
        its file names are relative to its root. Call before the first read.
        """
        self.directory = ckpt.root
        self._paths = {}
        self.format = ckpt.format
        self.cast = cast
        self.merge_gap = _MERGE_GAP if ckpt.merge_gap is None else ckpt.merge_gap
        self._expected, self._gaps = {}, {}
        self.patches, self.located, self.runs = {}, {}, {}
        opener, capacity = ckpt.opener, self.cache.capacity
        if storage.is_url(ckpt.root):  # objects: reopening one drops what it staged (and may cost a header GET)
            opener = opener or storage.open_safetensors
            capacity = max(capacity, _OBJECTS_OPEN)
        if opener is not None:
            self.cache.close()
            self.cache = FileCache(capacity, opener=opener)

    def file(self, name: str) -> SafetensorsFile:
        """The open data file ``name`` of the attached checkpoint, checked unchanged since it was opened."""
        # Files open with readahead off (see _fastio); every range is requested exactly
        # (MADV_WILLNEED) before it is copied. Sequential reads run as fast as with readahead;
        # scattered ones (another rank's file, resharding) no longer pull in neighbours nobody on this
        # node needs.
        path = self._paths.get(name)
        if path is None:
            resolve_inside(self.directory, name)  # a data file resolving outside the checkpoint is refused
            path = self._paths[name] = storage.join(self.directory, name)
        f = self.cache.get(path)
        f.check_unchanged()  # a truncated mapping would SIGBUS: refuse it with a ReadError instead
        if self.located:
            table = self.located.get(name)
            if table is not None and getattr(f, "located", None) is not table:
                f.locate(table)  # (also after the file was closed and opened again)
        return f

    def expect(self, items: Iterable[ReadItem]) -> None:
        """Every ReadItem this rank will read in this load (its plan, once known): what decides, per file,
        whether its prefetches may run over holes (:meth:`merge_gap_of`). Local I/O only: nothing here
        changes which rank reads what, or any collective. Object stores are left as they are: there
        the cost is requests, and their ranges are coalesced by parts (pipeload.io.objstore)."""
        self._expected, self._gaps = {}, {}
        if storage.is_url(self.directory):
            return
        for item in items:
            if item.nbytes:
                self._expected.setdefault(item.file, []).append(item)

    def merge_gap_of(self, name: str, f: Any) -> int:
        """The gap across which this rank's prefetch ranges of file ``name`` (open as ``f``) are merged.

        A file the plan has this rank read scattered (:func:`scattered`: pieces interleaved with other
        ranks' pieces, as a load into another layout than the save's reads them) is requested exactly,
        across a page at most; a file it reads in runs (its own file, a whole file) keeps the layout's
        gap: few large requests. Before :meth:`expect` (an early request made while the plan is
        exchanged) the layout's gap. Decided once per file and load, on first use."""
        default = getattr(f, "merge_gap", self.merge_gap)  # a layout may hold other ranks' items closer
        gap = self._gaps.get(name)
        if gap is None:
            items = self._expected.get(name)
            gap = default
            if items is not None and hasattr(f, "entry"):
                gap = min(default, _PAGE) if scattered(self._span(f, it) for it in items) else default
            self._gaps[name] = gap
        return gap

    def _span(self, f: Any, item: ReadItem) -> tuple[int, int]:
        """The file bytes ``[lo, hi)`` ``item`` reads (a strided box: from its first to its last byte), less
        a delivered head or tail (:meth:`_trimmed`): storage is never asked for a delivered page."""
        start = f.entry(item.key)[2]
        lo, hi = self._trimmed(item, *self._chunk_span(item))
        return start + lo, start + hi

    @staticmethod
    def _chunk_span(item: ReadItem) -> tuple[int, int]:
        """Bytes ``[lo, hi)`` of its stored chunk that ``item`` spans."""
        itemsize = item.nbytes // math.prod(item.lengths)
        return box_span(item.chunk_lengths, item.src_offsets, item.lengths, itemsize)

    def _trimmed(self, item: ReadItem, lo: int, hi: int) -> tuple[int, int]:
        """``[lo, hi)`` less the delivered ranges at its ends (a delivered part is always a span's head or
        tail: see pipeload.plan.partdelivery); ``lo == hi`` when all of it was delivered. Only a contiguous
        span is trimmed (a strided item is read whole)."""
        parts = self.patches.get((item.file, item.key)) if self.patches else None
        if not parts or hi - lo != item.nbytes:
            return lo, hi
        moved = True
        while moved and lo < hi:
            moved = False
            for a, b, _ in parts:
                if a <= lo < b:
                    lo, moved = min(b, hi), True
                if a < hi <= b:
                    hi, moved = max(a, lo), True
        return lo, max(lo, hi)

    def set_patches(self, parts: Iterable[tuple[str, str, int, int, torch.Tensor]]) -> None:
        """This load's delivered bytes: ``(file, key, lo, hi, uint8 tensor of hi - lo bytes)``."""
        self.patches = {}
        for file, key, lo, hi, data in parts:
            self.patches.setdefault((file, key), []).append((lo, hi, data))

    def _read_patched(self, item: ReadItem, out: torch.Tensor, f: Any) -> bool:
        """Copy ``item`` into ``out`` taking its delivered bytes from :attr:`patches` and the rest from
        the file (a byte-range copy; through a staging buffer when the destination box is strided); False
        (nothing done: the caller reads the item whole, still exact) unless the item has delivered parts,
        is contiguous in its chunk, its destination is of the stored dtype, in host memory (objects: any
        device, staged on the host: a run's owner sent the rest, and reading the item whole would fetch
        it again), and no checksum is pending."""
        parts = self.patches.get((item.file, item.key))
        if not parts or self.cast or (self.verify and item.checksum and (f.path, item.key) not in self._verified):
            return False
        lo, hi = self._chunk_span(item)
        dst = narrow(out, item.dest_offsets, item.lengths)
        objects = storage.is_url(self.directory)  # (an object's buffer() would fetch its whole chunk)
        host = dst.device.type == "cpu"
        if (hi - lo != item.nbytes or not (host or objects) or dst.is_conj() or dst.is_neg()
                or not hasattr(f, "buffer") or item.nbytes != dst.nbytes):
            return False
        staged = not dst.is_contiguous() or not host
        flat = (torch.empty(item.nbytes, dtype=torch.uint8) if staged else
                dst.view(-1).view(torch.uint8) if dst.numel() else dst.view(torch.uint8))
        cuts = sorted(((max(a, lo), min(b, hi), data[max(a, lo) - a : min(b, hi) - a]) for a, b, data in parts
                       if a < hi and b > lo), key=lambda c: c[:2])
        at, source = lo, os.path.join(self.directory, item.file)
        buf = None
        first = None  # (where the item starts: a DCP item's once its head is read, so only when needed)
        for a, b, data in [*cuts, (hi, hi, None)]:
            if a > at:  # a run this rank reads itself
                if objects:
                    if first is None:
                        first = chunk_start(f, item.key)
                    copy_box(flat[at - lo : a - lo], torch.frombuffer(f.span(first + at, first + a),
                                                                      dtype=torch.uint8), source)
                else:
                    if buf is None:
                        buf = torch.frombuffer(self._bytes(f, item.key, item.checksum), dtype=torch.uint8)
                        first = f.entry(item.key)[2]
                        f.advise("willneed", first + at, first + self._trimmed(item, lo, hi)[1])
                    copy_box(flat[at - lo : a - lo], buf[at:a], source)
            if data is not None and b > a:
                flat[a - lo : b - lo].copy_(data)
            at = max(at, b)
        if staged and host:
            dst.copy_(flat.view(dst.dtype).view(dst.shape))
        elif staged:
            copy_box(dst, flat.view(dst.dtype).view(dst.shape), source, self.ring)
        return True

    def _bytes(self, f: SafetensorsFile, key: str, expect_checksum: str) -> memoryview:
        buf = f.buffer(key)
        # "" = the layout records no checksum (HF, DCP): nothing to check
        if self.verify and expect_checksum and (f.path, key) not in self._verified:
            self._checked(f.path, "tensor", key, guarded_read(f, buf)[0], expect_checksum)
        return buf

    def _checked(self, path: str, kind: str, key: str, got: str, expect: str) -> None:
        """Raise :class:`ChecksumError` naming the file and key unless ``got`` is ``expect``; else
        remember the chunk as verified."""
        if got != expect:
            raise ChecksumError(f"{path}: {kind} {key!r} has checksum {got}, the metadata recorded {expect}")
        self._verified.add((path, key))

    def prefetch(self, items: Iterable[ReadItem], whole: dict[str, list[str]] | None = None) -> None:
        """Ask the kernel for the bytes of ``items`` now, as few large requests (adjacent ranges merged).

        ``whole``: file -> names of stored chunks wanted whole, besides ``items`` (a plan's exact boxes,
        named without building their ReadItems). Asynchronous: the reads proceed while this rank copies
        what is already there.
        """
        spans: dict[str, list[tuple[int, int]]] = {}
        whole = {k: list(v) for k, v in whole.items()} if whole else {}  # names of chunks read whole
        files: dict[str, Any] = {}
        try:
            for name in whole:
                f = files[name] = self.file(name)
                if not hasattr(f, "willneed_tensors"):  # a safetensors file or object
                    raise TypeError(f"{name}: whole chunks are prefetched from safetensors files only")
            for item in items:
                if item.nbytes == 0:
                    continue
                f = files.get(item.file)
                if f is None:
                    f = files[item.file] = self.file(item.file)
                if (item.lengths == item.chunk_lengths and hasattr(f, "willneed_tensors")  # a load in the saved layout
                        and (item.file, item.key) not in self.patches):
                    whole.setdefault(item.file, []).append(item.key)
                    continue
                lo, hi = self._span(f, item)
                if hi > lo:
                    spans.setdefault(item.file, []).append((lo, hi))
            for name, keys in whole.items():
                files[name].willneed_tensors(keys, self.merge_gap_of(name, files[name]))
            for name, ranges in spans.items():
                f = files[name]
                gap = self.merge_gap_of(name, f)
                ranges.sort()
                lo, hi = ranges[0]
                for a, b in ranges[1:]:
                    if a - hi > gap:
                        f.advise("willneed", lo, hi)
                        lo = a
                    hi = max(hi, b)
                f.advise("willneed", lo, hi)
        except Exception:  # noqa: BLE001 - a hint only; the read itself reports what is wrong
            pass

    def chunk(self, item: ReadItem, dtype: torch.dtype, advise: bool = True) -> torch.Tensor:
        """A zero-copy tensor view of the whole stored chunk ``item`` reads from."""
        f = self.file(item.file)
        stored_dtype, shape, start, _ = f.entry(item.key)
        if self.cast and stored_dtype in _STORED:
            dtype = _STORED[stored_dtype]  # copy_box converts into the destination's dtype
        if tuple(shape) != item.chunk_lengths or stored_dtype != dtype_name(dtype):
            raise CheckpointFormatError(
                f"{f.path}: tensor {item.key!r} is {stored_dtype} {list(shape)}, "
                f"the metadata says {dtype_name(dtype)} {list(item.chunk_lengths)}"
            )
        buf = self._bytes(f, item.key, item.checksum)
        if buf.nbytes == 0:
            return torch.empty(item.chunk_lengths, dtype=dtype)
        if advise:
            lo, hi = box_span(item.chunk_lengths, item.src_offsets, item.lengths, dtype.itemsize)
            f.advise("willneed", start + lo, start + hi)
        return torch.frombuffer(buf, dtype=torch.uint8).view(dtype).view(item.chunk_lengths)

    def read_into(self, item: ReadItem, out: torch.Tensor, advise: bool = True, file=None) -> None:
        """Copy ``item``'s box into ``out`` (the destination shard, or its staging view).

        ``file``: ``item.file`` as :meth:`file` returned it moments ago (a caller copying many items of
        one file checks it once); otherwise it is looked up and checked here.
        """
        if item.nbytes == 0:
            return
        try:
            f = file if file is not None else self.file(item.file)
            done = NotImplemented
            if self.patches and self._read_patched(item, out, f):
                done = None
            elif (not self.cast and out.device.type == "cpu" and hasattr(f, "copy_box") and out.data_ptr()
                    and not out.is_conj() and not out.is_neg()
                    and (not self.verify or not item.checksum or (f.path, item.key) in self._verified)):
                # the common case in one call: no tensor views, no per-item torch calls
                done = f.copy_box(item.key, dtype_name(out.dtype), item.chunk_lengths, item.src_offsets, item.lengths,
                                  out.data_ptr(), item.dest_offsets, out.stride(), tuple(out.shape), advise)
            if done is NotImplemented:
                src = narrow(self.chunk(item, out.dtype, advise), item.src_offsets, item.lengths)
                copy_box(narrow(out, item.dest_offsets, item.lengths), src, os.path.join(self.directory, item.file),
                         self.ring)
        except (CheckpointFormatError, ReadError):
            raise
        except OSError as e:
            raise ReadError(f"{os.path.join(self.directory, item.file)}: {type(e).__name__}: {e.strerror or e}") from e
        self.bytes_read += item.nbytes

    def read_object(self, meta: ObjectMeta) -> Any:
        """A Python object, decoded by :func:`decode_object` (``weights_only=True``): it cannot execute code."""
        f = self.file(meta.file)
        stored_dtype, _, start, end = f.entry(meta.key)
        if stored_dtype != "U8":
            raise CheckpointFormatError(f"{f.path}: object {meta.key!r} is stored as {stored_dtype}, not U8")
        parts = self.patches.get((meta.file, meta.key)) if self.patches else None
        if parts and storage.is_url(self.directory):  # (delivered by the owner of a run: pipeload.engine.delivery)
            buf = self._patched_object(f, meta, start, end, parts)
        else:
            f.advise("willneed", start, end)
            buf = self._bytes(f, meta.key, meta.checksum)
        if buf.nbytes != meta.nbytes:
            raise CheckpointFormatError(
                f"{f.path}: object {meta.key!r} has {buf.nbytes} bytes, the metadata says {meta.nbytes}"
            )
        _, data = guarded_read(f, buf, keep=True)
        self.bytes_read += buf.nbytes
        return decode_object(data, f"{f.path}: object {meta.key!r}")

    def _patched_object(self, f: Any, meta: ObjectMeta, start: int, end: int, parts: list) -> memoryview:
        """An object record's bytes from its delivered parts (``(lo, hi, bytes)``, record-relative) and, for
        any part not delivered, from storage; its checksum checked as :meth:`_bytes` checks it."""
        out = bytearray(end - start)
        at = 0
        for a, b, data in [*sorted(parts, key=lambda p: p[:2]), (end - start, end - start, None)]:
            if a > at:  # (a part of the record in this rank's own range)
                out[at:a] = bytes(f.span(start + at, start + a))
            if data is not None and b > a:
                out[a:b] = data.numpy().tobytes()
            at = max(at, b)
        if self.verify and meta.checksum and (f.path, meta.key) not in self._verified:
            h = hasher()
            h.update(out)
            self._checked(f.path, "object", meta.key, h.hexdigest(), meta.checksum)
        return memoryview(out)

    def close(self) -> None:
        self.cache.close()

    def __enter__(self) -> "ChunkReader":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
