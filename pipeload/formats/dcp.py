"""torch.distributed.checkpoint's ``FileSystemWriter`` layout (torch 2.5 - 2.13).

A checkpoint is a pickled ``.metadata`` (``torch.distributed.checkpoint.metadata.Metadata``) and
``__<rank>_<i>.distcp`` files. ``storage_data`` maps each item (fqn, chunk offsets) to a byte range
(``_StorageInfo``: relative_path, offset, length, optional transform descriptors) of one file:

- a tensor chunk is a whole ``torch.save`` blob: a zip archive whose members are stored
  uncompressed (``<archive>/data.pkl``, ``<archive>/data/<key>``, ...). Its bytes are read in place:
  the local headers are walked from the blob's start to the storage record (the central directory at
  its end when the walk does not apply: :func:`locate_tensor`), ``data.pkl`` is read by a restricted
  unpickler that only records (storage, offset, size, stride) and admits no other global, the sizes
  are checked, and the record's bytes are viewed zero-copy through ``_fastio.RawFile``. Anything else
  (a compressed member, a strided or non-little-endian tensor, a transform such as compression) is
  decoded with ``torch.load(weights_only=True)`` instead;
- a non-tensor item is the ``torch.save`` bytes of the object: loaded with ``weights_only=True``.

``.metadata`` itself is untrusted input: it is unpickled with an allow-list of the DCP metadata
classes and the few types they hold (torch.Size, dtypes, layouts, pathlib paths, containers). Any
other global is refused with a CheckpointFormatError naming it; no code from the file runs. Only the rank
that reads it unpickles it, into a chunk table (:mod:`pipeload.formats.dcpmeta`, kept beside the
checkpoint as a sidecar when the directory is writable); the other ranks receive the table and look
their boxes up in it. DCP records no checksums.
"""

from __future__ import annotations

import bisect
import collections
import functools
import io
import math
import os
import pickle
import re
import struct
import warnings
from typing import Any

import numpy as np
import torch

from ..io.storage import is_url, open_raw, read_bytes
from ..errors import CheckpointFormatError, TensorNotFoundError
from .metadata import METADATA_FILE
from .metadata import chunk_key as metadata_chunk_key

_DCP_MD = "torch.distributed.checkpoint.metadata"
_ALLOWED = {
    (_DCP_MD, n)
    for n in (
        "Metadata",
        "MetadataIndex",
        "TensorStorageMetadata",
        "BytesStorageMetadata",
        "ChunkStorageMetadata",
        "TensorProperties",
        "StorageMeta",
        "_MEM_FORMAT_ENCODING",
    )
} | {
    # what DCP wrote as a tensor's properties before its own TensorProperties (torch <= 2.1): older
    # checkpoints hold these, and DCP loads them (plain dataclass and enum, no code of their own)
    ("torch.distributed._shard.sharded_tensor.metadata", "TensorProperties"),
    ("torch.distributed._shard.sharded_tensor.metadata", "MEM_FORMAT_ENCODING"),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch.distributed.checkpoint.filesystem", "_StoragePrefix"),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),
    ("collections", "OrderedDict"),
    ("pathlib", "Path"),
    ("pathlib", "PosixPath"),
    ("pathlib", "PurePosixPath"),
    ("pathlib", "WindowsPath"),
    ("pathlib", "PureWindowsPath"),
}


class _MetadataUnpickler(pickle.Unpickler):
    def __init__(self, data, source: str):
        """``data``: the pickle's bytes, or a binary file positioned at its start."""
        super().__init__(io.BytesIO(data) if isinstance(data, (bytes, bytearray, memoryview)) else data)
        self.source = source

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _ALLOWED:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), (torch.dtype, torch.layout, torch.memory_format)):
            return getattr(torch, name)
        raise CheckpointFormatError(
            f"{self.source}: refusing to unpickle {module}.{name}: not a torch.distributed.checkpoint "
            f"metadata type"
        )

    def persistent_load(self, pid: Any) -> Any:
        raise CheckpointFormatError(f"{self.source}: unexpected persistent id in the metadata pickle")


def read_payload(path: str) -> bytes | bytearray:
    """Rank 0's part: the checkpoint's chunk table (:mod:`pipeload.formats.dcpmeta`), from the sidecar
    or decoded from the pickle; what every other rank receives instead of the pickle. In object storage
    the pickle is fetched in one GET and decoded (no sidecar is kept there)."""
    from .dcpmeta import read_table, table_of_pickle

    if not is_url(path):
        return read_table(path, _MetadataUnpickler)
    md_path = os.path.join(path, METADATA_FILE)
    try:
        data = read_bytes(md_path, 1 << 30)
    except OSError as e:
        raise CheckpointFormatError(f"{md_path}: cannot read metadata ({e.strerror or e})") from None
    return table_of_pickle(data, md_path, _MetadataUnpickler)


def load_dcp_metadata(data: bytes, source: str) -> Any:
    """The DCP ``Metadata`` object of a ``.metadata`` file, unpickled with the allow-list."""
    try:
        md = _MetadataUnpickler(data, source).load()
    except CheckpointFormatError:
        raise
    except Exception as e:  # noqa: BLE001 - any malformed pickle
        raise CheckpointFormatError(f"{source}: not a valid torch.distributed.checkpoint metadata ({type(e).__name__}: {e})") from None
    from torch.distributed.checkpoint.metadata import Metadata as DcpMetadata

    if not isinstance(md, DcpMetadata):
        raise CheckpointFormatError(f"{source}: holds a {type(md).__name__}, not a DCP Metadata")
    return md


def chunk_key(fqn: str, offsets: tuple[int, ...]) -> str:
    """The key of a tensor chunk inside a ``.distcp`` file (names it in messages): ``fqn@o0,o1``."""
    return metadata_chunk_key(fqn, offsets, False)


def from_payload(path: str, data):
    """(root, Metadata, opener, file metadata) of the table rank 0 sent, viewed in place on this rank."""
    from .dcpmeta import open_table

    md, opener = open_table(data, os.path.join(path, METADATA_FILE))
    transformed = _transformed(opener)
    if transformed:
        # refused at planning, on every rank alike (a read would fail after destinations were written)
        raise CheckpointFormatError(
            f"{os.path.join(path, METADATA_FILE)}: {transformed} uses stream transforms (e.g. ZStandard), "
            "which pipeload does not decode; load it with torch.distributed.checkpoint")
    opener.file_class = DistcpFile
    return path, md, opener, {}


def _transformed(opener) -> str | None:
    """A name for what the checkpoint stores through transforms (the first found), or None."""
    if opener.transforms:
        row = min(int(r) for r in opener.transforms)
        tensor = int(np.searchsorted(opener.a["chunk_start"], row, side="right")) - 1
        return f"tensor {opener.tensors.names[tensor]!r}"
    for items in opener.objects.values():
        for fqn, item in items.items():
            if item[5]:
                return f"object {fqn!r}"
    return None


_WRITER = re.compile(r"__(\d+)_\d+\.distcp")


def writer_of(file: str) -> int:
    """The rank that wrote a ``.distcp`` file (FileSystemWriter names them ``__<rank>_<i>.distcp``), or -1."""
    m = _WRITER.fullmatch(file)
    return int(m.group(1)) if m else -1


# -- torch.save blobs ----------------------------------------------------------------------------------


class _Unexpected(Exception):
    """The blob is not the plain layout read in place: decode it with torch.load instead."""


def _storage_dtypes() -> dict[str, torch.dtype]:
    out = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for name in dir(torch):
            cls = getattr(torch, name, None)
            if name.endswith("Storage") and isinstance(cls, type) and name != "UntypedStorage":
                try:
                    dt = cls.dtype
                except Exception:  # noqa: BLE001
                    continue
                if isinstance(dt, torch.dtype):
                    out[name] = dt
    return out


_STORAGE_DTYPES = _storage_dtypes()


class _StorageRef(tuple):
    pass


def _rebuild_tensor(storage, storage_offset, size, stride, requires_grad=False, hooks=None, metadata=None):
    return ("tensor", storage, storage_offset, tuple(size), tuple(stride))


class _TensorPickle(pickle.Unpickler):
    """Reads a torch.save ``data.pkl`` of one plain tensor into (storage, offset, size, stride).

    Admits only the rebuild function (replaced by a recorder), typed storage names (never called)
    and OrderedDict; anything else means "not the plain layout" (torch.load decides then).
    """

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) == ("torch._utils", "_rebuild_tensor_v2"):
            return _rebuild_tensor
        if module == "torch" and name in _STORAGE_DTYPES:
            return ("storage_type", name)
        if (module, name) == ("collections", "OrderedDict"):
            return collections.OrderedDict
        raise _Unexpected(f"{module}.{name}")

    def persistent_load(self, pid: Any) -> Any:
        if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage"):
            raise _Unexpected("persistent id")
        _, stype, key, _location, numel = pid
        if not (isinstance(stype, tuple) and stype[0] == "storage_type") or type(numel) is not int:
            raise _Unexpected("storage type")
        return _StorageRef((_STORAGE_DTYPES[stype[1]], str(key), numel))


_EOCD = 0x06054B50
_EOCD64 = 0x06064B50
_LOC64 = 0x07064B50
_CDIR = 0x02014B50
_LOCAL = 0x04034B50
_EOCD_REC = struct.Struct("<IHHHHIIH")  # end of central directory (22 bytes, then the archive comment)
_CDIR_REC = struct.Struct("<IHHHHHHIIIHHHHHII")  # central directory entry (46 bytes, then name/extra/comment)
_LOCAL_REC = struct.Struct("<I22xHH")  # local header: signature ... name and extra lengths (30 bytes)
_LOCAL_FULL = struct.Struct("<I2xHH8xIIHH")  # local header: signature, flags, method, sizes, name/extra lengths
_DESCRIPTOR_SIG = struct.pack("<I", 0x08074B50)
_WALK_WINDOW = 64 << 10  # the local headers before a tensor's storage record lie in its blob's first KiBs


def zip_members(blob: memoryview) -> dict[str, tuple[int, int]]:
    """{member name: (local header offset, size)} of an uncompressed zip held in ``blob`` (offsets in
    blob); :func:`zip_member` finds where a member's data starts.

    Reads the end-of-central-directory record (zip64 too) and the central directory. Raises
    _Unexpected for anything but stored (method 0) members.

    torch.save writes no archive comment, so the end record is the blob's last 22 bytes: only the pages
    of the records are touched (searching the last 64 KiB for it, as a general reader must, cost
    ~30 us an item and faulted that much of every cold blob in). Other archives are searched for it.
    """
    n = len(blob)
    at = n - 22
    if at < 0 or _EOCD_REC.unpack_from(blob, at)[0] != _EOCD:
        lo = max(0, n - 22 - 65535)
        found = bytes(blob[lo:]).rfind(struct.pack("<I", _EOCD))
        if found < 0 or lo + found + 22 > n:
            raise _Unexpected("no end of central directory")
        at = lo + found
    _, _, _, _, count, cd_size, cd_off, _ = _EOCD_REC.unpack_from(blob, at)
    if count == 0xFFFF or cd_size == 0xFFFFFFFF or cd_off == 0xFFFFFFFF:
        loc = at - 20
        if loc < 0 or struct.unpack_from("<I", blob, loc)[0] != _LOC64:
            raise _Unexpected("no zip64 locator")
        e64 = struct.unpack_from("<Q", blob, loc + 8)[0]
        if e64 + 56 > n or struct.unpack_from("<I", blob, e64)[0] != _EOCD64:
            raise _Unexpected("bad zip64 end record")
        count, cd_size, cd_off = struct.unpack_from("<QQQ", blob, e64 + 32)
    if cd_off + cd_size > n:
        raise _Unexpected("central directory outside the blob")
    out = {}
    p = cd_off
    for _ in range(count):
        if p + 46 > n:
            raise _Unexpected("bad central directory entry")
        sig, _, _, _, method, _, _, _, csize, usize, nlen, elen, clen, _, _, _, lho = _CDIR_REC.unpack_from(blob, p)
        if sig != _CDIR:
            raise _Unexpected("bad central directory entry")
        name = bytes(blob[p + 46 : p + 46 + nlen]).decode("utf-8", "replace")
        if 0xFFFFFFFF in (csize, usize, lho):
            vals = _zip64_extra(bytes(blob[p + 46 + nlen : p + 46 + nlen + elen]))
            if usize == 0xFFFFFFFF:
                usize = vals.pop(0)
            if csize == 0xFFFFFFFF:
                csize = vals.pop(0)
            if lho == 0xFFFFFFFF:
                lho = vals.pop(0)
        if method != 0 or csize != usize:
            raise _Unexpected(f"member {name} is compressed")
        out[name] = (lho, usize)
        p += 46 + nlen + elen + clen
    return out


def zip_member(blob: memoryview, members: dict[str, tuple[int, int]], name: str) -> tuple[int, int] | None:
    """(data start, size) in ``blob`` of member ``name`` of :func:`zip_members`, or None if there is none.

    Reads the member's local header (its own name/extra lengths: only the members a reader uses are
    looked at). Raises _Unexpected when the header or the data lie outside the blob.
    """
    hit = members.get(name)
    if hit is None:
        return None
    lho, size = hit
    n = len(blob)
    if lho + 30 > n:
        raise _Unexpected("bad local header")
    sig, nlen, elen = _LOCAL_REC.unpack_from(blob, lho)
    if sig != _LOCAL:
        raise _Unexpected("bad local header")
    start = lho + 30 + nlen + elen
    if start + size > n:
        raise _Unexpected(f"member {name} runs past the blob")
    return start, size


def _zip64_extra(extra: bytes) -> list[int]:
    i = 0
    while i + 4 <= len(extra):
        hid, size = struct.unpack_from("<HH", extra, i)
        if hid == 1:
            return list(struct.unpack_from(f"<{size // 8}Q", extra, i + 4))
        i += 4 + size
    raise _Unexpected("no zip64 extra field")


def locate_tensor(blob: memoryview, dtype: torch.dtype, lengths: tuple[int, ...]) -> tuple[int, int]:
    """(start, end) inside ``blob`` of the C-contiguous bytes of the one tensor a torch.save wrote.

    Raises _Unexpected unless the tensor is plain, of ``dtype`` and shape ``lengths``, contiguous,
    little-endian, and its storage record is stored uncompressed with the size its numel implies.

    The records are found walking the local headers from the blob's start (:func:`_walk_records`): only
    the pages before the tensor's bytes are touched, the first of which the reader of the tensor's head
    reads anyway. The zip directory at the blob's end, a page only the reader of the tensor's tail needs,
    is read only when the walk does not apply (an archive not laid out as torch.save lays it out).
    """
    try:
        return _walk_records(blob, dtype, lengths)
    except _Unexpected:
        return _locate_by_directory(blob, dtype, lengths)


def _walk_records(blob: memoryview, dtype: torch.dtype, lengths: tuple[int, ...]) -> tuple[int, int]:
    """:func:`locate_tensor` by the local headers: ``data.pkl`` first, then small records, until the
    storage record data.pkl names. A record written with a data descriptor (sizes after the data, as
    torch.save writes them) is sized by the descriptor that follows it: the first one whose size fields
    equal its distance from the data (signature, CRC, two sizes). Walks a copy of the blob's first KiB
    (torch.save's records before a tensor's bytes take ~700), four times more while it falls short, up
    to ``_WALK_WINDOW``: only the pages before the tensor's bytes are touched."""
    size, limit = 1024, min(len(blob), _WALK_WINDOW)
    while True:
        head = bytes(blob[: min(size, limit)])
        try:
            return _walk(head, len(blob), dtype, lengths)
        except _Short:
            if len(head) >= limit:
                raise _Unexpected("storage record not found by the local headers") from None
            size *= 4


class _Short(Exception):
    """The walk needs bytes past the copy of the blob's head it was given."""


def _walk(head: bytes, total: int, dtype: torch.dtype, lengths: tuple[int, ...]) -> tuple[int, int]:
    """:func:`_walk_records` over ``head``, the first bytes of a blob of ``total`` bytes; raises
    :class:`_Short` when it needs more of them."""
    p, prefix, want, got = 0, None, None, None
    while True:
        if p + 30 > len(head):
            raise _Short
        sig, flags, method, csize, usize, nlen, elen = _LOCAL_FULL.unpack_from(head, p)
        if sig != _LOCAL or method != 0:
            raise _Unexpected("not a stored local header")
        start = p + 30 + nlen + elen
        if start > len(head):
            raise _Short
        name = head[p + 30 : p + 30 + nlen].decode("utf-8", "replace")
        if want is not None and name == want:
            return _storage_range(total, start, csize, got, dtype)
        if csize == 0xFFFFFFFF:
            raise _Unexpected("a zip64 record before the storage")
        if csize != usize and not (flags & 8):
            raise _Unexpected(f"member {name} is compressed")
        size = csize if not (flags & 8) else _described_size(head, start)
        if start + size > len(head):
            raise _Short
        if prefix is None:
            if not name.endswith("data.pkl"):
                raise _Unexpected("data.pkl is not the first record")
            prefix = name[: -len("data.pkl")]
            got = _tensor_pickle(head[start : start + size], dtype, lengths)
            want = f"{prefix}data/{got[0][1]}"
        elif name == prefix + "byteorder" and head[start : start + size] != b"little":
            raise _Unexpected("big-endian")
        p = start + size + (_descriptor_length(head, start + size) if flags & 8 else 0)


def _described_size(head: bytes, start: int) -> int:
    """The size of a record whose local header defers it to a data descriptor: the distance from
    ``start`` to the first descriptor in ``head`` whose size fields equal it (:class:`_Short` if none
    is there yet)."""
    q = head.find(_DESCRIPTOR_SIG, start)
    while q >= 0:
        d = q - start
        if q + 24 > len(head):
            raise _Short  # its fields may lie past the copy
        if struct.unpack_from("<II", head, q + 8) == (d, d) or struct.unpack_from("<QQ", head, q + 8) == (d, d):
            return d
        q = head.find(_DESCRIPTOR_SIG, q + 1)
    raise _Short


def _descriptor_length(head: bytes, at: int) -> int:
    """Bytes of the data descriptor at ``at`` (signature, CRC and 32- or 64-bit sizes): the one
    :func:`_described_size` matched, so the next local header follows it."""
    if at + 28 > len(head):
        raise _Short
    if head[at : at + 4] != _DESCRIPTOR_SIG:
        raise _Unexpected("no data descriptor")
    for length in (16, 24):
        if head[at + length : at + length + 4] == struct.pack("<I", _LOCAL):
            return length
    raise _Unexpected("no local header after a data descriptor")


def _tensor_pickle(data: memoryview, dtype: torch.dtype, lengths: tuple[int, ...]) -> tuple:
    """data.pkl of one plain tensor: ((storage dtype, key, numel), offset, size, stride), checked
    against ``dtype`` and shape ``lengths`` (contiguous, non-negative offset)."""
    try:
        got = _TensorPickle(io.BytesIO(bytes(data))).load()
    except _Unexpected:
        raise
    except Exception as e:  # noqa: BLE001
        raise _Unexpected(f"data.pkl: {type(e).__name__}") from None
    if not (isinstance(got, tuple) and len(got) == 5 and got[0] == "tensor" and isinstance(got[1], _StorageRef)):
        raise _Unexpected("not one tensor")
    _, ref, offset, size, stride = got
    if ref[0] != dtype or size != tuple(lengths) or type(offset) is not int or offset < 0:
        raise _Unexpected("dtype, shape or offset differs")
    expect = 1
    for dim in reversed(range(len(size))):
        if size[dim] != 1 and stride[dim] != expect:
            raise _Unexpected("not contiguous")
        expect *= size[dim]
    return ref, offset, expect


def _storage_range(total: int, start: int, csize: int, got: tuple, dtype: torch.dtype) -> tuple[int, int]:
    """(start, end) of the tensor's bytes in a storage record whose data begins at ``start`` of a blob of
    ``total`` bytes; ``csize``: the local header's size (0 when a descriptor carries it: the storage's
    numel sizes it then)."""
    (_, _, snumel), offset, numel = got
    nbytes = snumel * dtype.itemsize
    if (csize and csize != 0xFFFFFFFF and csize != nbytes) or offset + numel > snumel or start + nbytes > total:
        raise _Unexpected("storage record size")
    first = start + offset * dtype.itemsize
    return first, first + numel * dtype.itemsize


def _locate_by_directory(blob: memoryview, dtype: torch.dtype, lengths: tuple[int, ...]) -> tuple[int, int]:
    """:func:`locate_tensor` by the zip's central directory (any member order)."""
    members = zip_members(blob)
    pkl = [k for k in members if k.endswith("/data.pkl") or k == "data.pkl"]
    if len(pkl) != 1:
        raise _Unexpected("no data.pkl")
    prefix = pkl[0][: -len("data.pkl")]
    order = zip_member(blob, members, prefix + "byteorder")
    if order is not None and bytes(blob[order[0] : order[0] + order[1]]) != b"little":
        raise _Unexpected("big-endian")
    s, n = zip_member(blob, members, pkl[0])
    got = _tensor_pickle(blob[s : s + n], dtype, lengths)
    rec = zip_member(blob, members, f"{prefix}data/{got[0][1]}")
    if rec is None:
        raise _Unexpected("storage record size")
    return _storage_range(len(blob), rec[0], rec[1], got, dtype)


class DistcpFile:
    """One ``.distcp`` file seen as the reader sees a safetensors file: entry(), buffer(), advise().

    Tensor items resolve lazily, on the first ``buffer()`` (zip + data.pkl parse, once per item), to
    a byte range read in place; ``fallbacks`` counts items decoded with torch.load instead.

    ``entry()`` touches no page of the file: the reader calls it to plan prefetches well before it
    copies, and a page fault there would be a synchronous read queued behind the prefetches already
    issued. Until an item is resolved its start is the blob's (the tensor's bytes begin a header
    later); ``advise("willneed")`` therefore extends a range by the largest header (within its blob) and
    asks for the head of the blob its first byte lies in, so a hint computed from that start still
    covers the tensor's bytes and the local headers that locate them (:func:`locate_tensor`), and not
    the rest of the blob (another rank's part).
    """

    def __init__(self, path: str, items: dict[str, tuple]):
        self.path = path
        self.raw = open_raw(path)
        self._items = items
        self._resolved: dict[str, tuple] = {}
        self.located: dict[str, tuple[int, int]] = {}  # key -> (start, end) another reader found (locate)
        self.fallbacks = 0
        # blob (start, end, key) of every item, sorted: a hint's end is extended to the end of its blob
        self._blobs = sorted((off, off + ln, key) for key, (_, _, _, off, ln, _) in items.items())
        self._blob_starts = [a for a, _, _ in self._blobs]
        slack = 0  # bytes of a blob that are not its tensor's data (zip headers, pickle, trailer)
        for kind, dtype, lengths, _, ln, _ in items.values():
            if kind == "tensor":
                n = 1
                for x in lengths:
                    n *= x
                slack = max(slack, ln - n * _torch_dtype(dtype).itemsize)
        # ChunkReader.prefetch merges this rank's ranges closer than this into one request. DCP's
        # writer and pipeload's reader assignment differ, so the blobs between two of this rank's are
        # often another rank's: merge only across one blob's headers (plus a page), never over a blob.
        self.merge_gap = slack + 4096
        self._slack = slack

    @property
    def closed(self) -> bool:
        return self.raw.closed

    def close(self) -> None:
        self.raw.close()

    def check_unchanged(self) -> None:
        self.raw.check_unchanged()

    def advise(self, advice: str, start: int = 0, end: int | None = None) -> None:
        if advice != "willneed":
            return
        if end is None:
            end = self.raw.size
        else:
            # A range computed from an unresolved item's blob start lies up to a header (< slack) before
            # the tensor's bytes: extend it by that much, within the blob its last byte lies in (a range
            # of a located item is exact: extending it would read a page delivered here). Locating
            # the tensor reads its blob's head (the local headers): asked for on its own when the range
            # starts past it. The rest of the blob is another part of the tensor, maybe another rank's (a
            # load into another layout): never asked for here.
            i = bisect.bisect_right(self._blob_starts, start) - 1
            if i >= 0 and self._blobs[i][0] + self._slack < start < self._blobs[i][1] and self._head_needed(i):
                self.raw.willneed(self._blobs[i][0], self._blobs[i][0] + self._slack)
            j = bisect.bisect_right(self._blob_starts, max(start, end - 1)) - 1
            if j >= 0 and self._blobs[j][1] > end and self._head_needed(j):  # (a located chunk's range is exact)
                end = min(end + self._slack, self._blobs[j][1])
        self.raw.willneed(start, end)

    @property
    def blobs(self) -> list[tuple[int, int, str]]:
        """``(first byte, end, key)`` of every item's blob, by first byte (from the metadata: no read; a
        blob named by its fqn and by its chunk key appears under both)."""
        return self._blobs

    def position(self, key: str) -> tuple[int, int] | None:
        """``(start, end)`` of item ``key``'s tensor bytes in the file, locating it (its blob's head) if
        needed; None for an item decoded by torch.load (not stored in place)."""
        _, _, a, b, decoded = self._resolve(key)
        return (a, b) if decoded is None else None

    def positions(self) -> dict[str, tuple[int, int]]:
        """Every item located so far and stored in place: key -> ``(start, end)``."""
        return {k: (a, b) for k, (_, _, a, b, decoded) in self._resolved.items() if decoded is None}

    def locate(self, table: dict[str, tuple[int, int]]) -> None:
        """Take where other readers found items' tensor bytes (``key -> (start, end)`` in the file, from
        the heads of their blobs, which this rank then never reads). A location that does not fit its
        item (outside the blob, or not the tensor's size) is ignored: the item is located here."""
        self.located = table

    def willneed_heads(self, keys: list[str]) -> None:
        """Ask for the heads of the blobs of ``keys`` (what locating them reads), neighbours merged."""
        ranges = sorted((off, off + min(ln, self._slack)) for key in keys if key not in self._resolved
                        for _, _, _, off, ln, _ in (self._items[key],))
        lo = hi = None
        for a, b in ranges:
            if lo is not None and a > hi:
                self.raw.willneed(lo, hi)
                lo = None
            lo, hi = (a, b) if lo is None else (lo, max(hi, b))
        if lo is not None:
            self.raw.willneed(lo, hi)

    def _head_needed(self, i: int) -> bool:
        """Whether blob ``i``'s chunk is still to be located (under any of its keys: one blob may be
        named by its fqn and by its chunk key)."""
        at = self._blobs[i][0]
        j = bisect.bisect_left(self._blob_starts, at)
        while j < len(self._blobs) and self._blobs[j][0] == at:
            key = self._blobs[j][2]
            if key in self._resolved or key in self.located:
                return False
            j += 1
        return True

    def _resolve(self, key: str) -> tuple:
        hit = self._resolved.get(key)
        if hit is not None:
            return hit
        info = self._items.get(key)
        if info is None:
            raise TensorNotFoundError(f"{self.path}: no item {key!r} in the checkpoint metadata for this file")
        kind, dtype, lengths, off, ln, transforms = info
        given = self.located.get(key)
        if given is not None and kind == "tensor" and not transforms and off <= given[0] <= given[1] <= off + ln \
                and given[1] - given[0] == math.prod(lengths) * _torch_dtype(dtype).itemsize:
            hit = self._resolved[key] = (dtype, lengths, given[0], given[1], None)
            return hit
        if kind == "object":  # a Python object's torch.save bytes, decoded by the reader
            if transforms:
                raise CheckpointFormatError(f"{self.path}: item {key!r} uses transforms {list(transforms)}, not supported")
            hit = (dtype, lengths, off, off + ln, None)
        else:
            blob = self.raw.view(off, ln)
            tdt = _torch_dtype(dtype)
            try:
                if transforms:
                    raise _Unexpected("transforms")
                a, b = locate_tensor(blob, tdt, lengths)
                hit = (dtype, lengths, off + a, off + b, None)
            except _Unexpected:
                hit = (dtype, lengths, off, off + ln, self._fallback(key, blob, tdt, lengths, transforms))
        self._resolved[key] = hit
        return hit

    def _fallback(self, key, blob, dtype, lengths, transforms) -> memoryview:
        if transforms:
            raise CheckpointFormatError(
                f"{self.path}: item {key!r} uses DCP transforms {list(transforms)}, which pipeload does not decode"
            )
        try:
            t = torch.load(io.BytesIO(bytes(blob)), map_location="cpu", weights_only=True)
        except Exception as e:  # noqa: BLE001
            raise CheckpointFormatError(f"{self.path}: item {key!r}: cannot decode the torch.save blob ({type(e).__name__}: {e})") from None
        if not isinstance(t, torch.Tensor) or t.dtype != dtype or tuple(t.shape) != tuple(lengths):
            raise CheckpointFormatError(
                f"{self.path}: item {key!r} holds {type(t).__name__} "
                f"{getattr(t, 'dtype', '')} {list(getattr(t, 'shape', []))}, the metadata says {dtype} {list(lengths)}"
            )
        self.fallbacks += 1
        return memoryview(t.contiguous().reshape(-1).view(torch.uint8).numpy())

    def entry(self, key: str) -> tuple[str, tuple[int, ...], int, int]:
        """(dtype, shape, start, end); exact once resolved, the blob's start until then (see class)."""
        hit = self._resolved.get(key)
        if hit is None and key in self.located:  # (another reader's location: no page read)
            hit = self._resolve(key)
        if hit is not None:
            return hit[:4]
        info = self._items.get(key)
        if info is None:
            raise TensorNotFoundError(f"{self.path}: no item {key!r} in the checkpoint metadata for this file")
        kind, dtype, lengths, off, ln, _ = info
        return dtype, lengths, off, off + ln

    def copy_box(self, key: str, dtype: str, chunk_shape: tuple, src_offsets: tuple, lengths: tuple, dst: int,
                 dst_offsets: tuple, dst_strides: tuple, dst_shape: tuple, willneed: bool = False):
        """The reader's one-call copy (see ``SafetensorsFile.copy_box``) of an item stored in place;
        ``NotImplemented`` for one decoded by torch.load (the reader then copies from ``buffer()``)."""
        stored, lengths_, start, end, decoded = self._resolve(key)
        if decoded is not None:
            return NotImplemented
        if stored != dtype or tuple(lengths_) != chunk_shape:
            raise CheckpointFormatError(f"{self.path}: item {key!r} is {stored} {list(lengths_)}, "
                                        f"the metadata says {dtype} {list(chunk_shape)}")
        return self.raw.copy_box(key, start, _torch_dtype(dtype).itemsize, chunk_shape, src_offsets, lengths, dst,
                                 dst_offsets, dst_strides, dst_shape, willneed)

    def span(self, start: int, end: int) -> memoryview:
        """Bytes ``[start, end)`` of the file (an object's: only the parts they lie in are fetched)."""
        return self.raw.view(start, end - start)

    def buffer(self, key: str) -> memoryview:
        _, _, start, end, decoded = self._resolve(key)
        if decoded is not None:
            return decoded
        return self.raw.view(start, end - start)


@functools.lru_cache(maxsize=None)
def _torch_dtype(name: str) -> torch.dtype:
    from .metadata import torch_dtype

    return torch_dtype(name)
