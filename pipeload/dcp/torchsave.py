"""``torch.save``'s exact bytes of one tensor, without ``torch.save``'s cost per call.

DCP's ``FileSystemWriter`` stores each tensor item as ``torch.save(tensor)`` (a zip archive). That costs
~0.2-0.3 ms per call here (pickling, the zip writer, its records), more than writing most tensors of
a model, and ``torch.save``'s CRC-32 runs at ~0.75 GB/s. Around the tensor's bytes the archive depends
only on the dtype, the shape and ``torch.save``'s options, and on the data only through four fields:
the data record's CRC-32 (in its local header and in the central directory) and the archive's
serialization id — 20 digits fixed per writer, then 20 digits combining every record's CRC-32
(``c10::hash_combine``, in record order, empty records left out) — whose own CRC-32 sits in the same two places.

So a :class:`Template` is made once per (dtype, shape, CRC option) by ``torch.save`` of a zero tensor of
that shape: the bytes before the data and after it, and where those fields are. :meth:`Template.parts`
gives, for a tensor's bytes, ``(head, tail)`` such that ``head + bytes + tail`` is what ``torch.save``
writes for that tensor (``tests/test_dcp_torchsave.py`` compares them byte for byte), with the CRC-32
from ISA-L (``isal``; ``zlib``'s where it is missing), without the GIL. Archives that need zip64 (over
4 GiB), or tensors over :data:`MAX_TEMPLATE_BYTES` (a template's zero tensor would cost that much memory
once), are not templated: :func:`template` returns None and the caller uses ``torch.save`` itself.
"""

from __future__ import annotations

import io
import struct
import threading
from collections import OrderedDict

import torch

try:  # ISA-L's CRC-32 (folding with carry-less multiplies): ~30 GB/s against zlib 1.2's ~7 GB/s here
    from isal.isal_zlib import crc32
except ImportError:  # a platform without its wheel: the same values, slower
    from zlib import crc32

MAX_TEMPLATE_BYTES = 64 << 20
_CACHE_SIZE = 4096
_M64 = (1 << 64) - 1
_U32 = struct.Struct("<I")
_DATA = "data/0"
_SID = ".data/serialization_id"

_lock = threading.Lock()
_cache: "OrderedDict[tuple, Template | None]" = OrderedDict()


def _hash_combine(seed: int, value: int) -> int:
    """``c10::hash_combine`` on 64-bit words, as torch's zip writer folds each record's CRC-32."""
    return (seed ^ ((value + 0x9E3779B9 + ((seed << 6) & _M64) + (seed >> 2)) & _M64)) & _M64


class _Record:
    """One record: its CRC-32, where its bytes start and end, and where its CRC-32 is written — the
    central directory, and the local header or (flag bit 3, as torch writes) the data descriptor after
    the bytes (after its optional signature)."""

    __slots__ = ("name", "crc", "central", "data", "size", "crc_at")

    def __init__(self, raw: bytes, name: str, crc: int, local: int, central: int, size: int) -> None:
        n, e = struct.unpack_from("<HH", raw, local + 26)
        self.name, self.crc, self.central, self.size = name, crc, central + 16, size
        self.data = local + 30 + n + e
        end = self.data + size
        descriptor = struct.unpack_from("<H", raw, local + 6)[0] & 0x8
        self.crc_at = (end + 4 if raw[end : end + 4] == b"PK\x07\x08" else end) if descriptor else local + 14


def _records(raw: bytes) -> list[_Record] | None:
    """The archive's records from its central directory; None if it uses zip64 or a comment."""
    if raw[-22:-18] != b"PK\x05\x06":
        return None
    count, _, cd_at = struct.unpack_from("<HII", raw, len(raw) - 12)
    if cd_at == 0xFFFFFFFF or count == 0xFFFF:
        return None
    out, at = [], cd_at
    for _ in range(count):
        if raw[at : at + 4] != b"PK\x01\x02":
            return None
        crc, csize, usize, n, e, c = struct.unpack_from("<IIIHHH", raw, at + 16)
        local = struct.unpack_from("<I", raw, at + 42)[0]
        name = raw[at + 46 : at + 46 + n].decode("utf-8")
        if csize != usize or 0xFFFFFFFF in (csize, local):
            return None
        out.append(_Record(raw, name, crc, local, at, usize))
        at += 46 + n + e + c
    return out


class Template:
    """``torch.save``'s archive of one (dtype, shape) around the tensor's bytes (see the module)."""

    def __init__(self, raw: bytes, records: list[_Record], nbytes: int, crc: bool) -> None:
        data = next(r for r in records if r.name.endswith("/" + _DATA))
        sid = next(r for r in records if r.name.endswith("/" + _SID))
        if data.size != nbytes or sid.data < data.data:
            raise ValueError("unexpected torch.save archive")
        self.crc = crc
        self.head = raw[: data.data]
        self.tail = raw[data.data + nbytes :]
        folded = [r for r in records if r is not sid and (r.size or r is data)]  # torch skips empty records
        i = folded.index(data)
        self._before = 0  # the fold of the records before the data's, and the CRC-32s after it
        for r in folded[:i]:
            self._before = _hash_combine(self._before, r.crc)
        self._after = [r.crc for r in folded[i + 1 :]]
        base = data.data + nbytes  # offsets below are into ``tail``, but the first one's may be into ``head``
        self._data_crc, self._data_central = data.crc_at - (base if data.crc_at >= base else 0), data.central - base
        self._data_crc_in_tail = data.crc_at >= base
        self._sid_crc, self._sid_central = sid.crc_at - base, sid.central - base
        self._sid_at, self._sid_size = sid.data - base, sid.size
        self._sid_fixed_crc = crc32(self.tail[self._sid_at : self._sid_at + sid.size - 20])

    def parts(self, data: memoryview) -> tuple[bytes | bytearray, bytes | bytearray]:
        """``(head, tail)`` of ``torch.save`` of a tensor of this template whose bytes are ``data``."""
        if not self.crc or not data.nbytes:  # CRC-32s all 0, or no data: nothing depends on it
            return self.head, self.tail
        crc = crc32(data)
        combined = _hash_combine(self._before, crc)
        for c in self._after:
            combined = _hash_combine(combined, c)
        digits = b"%020d" % combined
        sid_crc = crc32(digits, self._sid_fixed_crc)
        head, tail = self.head, bytearray(self.tail)
        if self._data_crc_in_tail:
            _U32.pack_into(tail, self._data_crc, crc)
        else:
            head = bytearray(head)
            _U32.pack_into(head, self._data_crc, crc)
        _U32.pack_into(tail, self._data_central, crc)
        _U32.pack_into(tail, self._sid_crc, sid_crc)
        _U32.pack_into(tail, self._sid_central, sid_crc)
        at = self._sid_at + self._sid_size - 20
        tail[at : at + 20] = digits
        return head, tail


def options() -> tuple[bool, int]:
    """``torch.save``'s options that shape its archive (CRC-32 on, storage alignment), read once per file."""
    return torch.serialization.get_crc32_options(), torch.serialization._get_storage_alignment()


def template(dtype: torch.dtype, shape: tuple[int, ...], opts: tuple[bool, int]) -> Template | None:
    """The :class:`Template` of a contiguous tensor of ``dtype`` and ``shape`` under ``torch.save``'s
    options ``opts`` (:func:`options`, as they are now: the template is made under them); kept, at most
    :data:`_CACHE_SIZE`. None where ``torch.save`` itself must write the tensor."""
    key = (dtype, shape, opts)
    with _lock:
        got = _cache.get(key, _cache)
        if got is not _cache:
            return got
    made, nbytes = None, torch.empty((), dtype=dtype).element_size()
    for n in shape:
        nbytes *= n
    if nbytes <= MAX_TEMPLATE_BYTES:
        buf = io.BytesIO()
        torch.save(torch.zeros(shape, dtype=dtype), buf)
        raw = buf.getvalue()
        records = _records(raw)
        if records is not None:
            try:
                made = Template(raw, records, nbytes, opts[0])
            except (ValueError, StopIteration):
                made = None
    with _lock:
        _cache[key] = made
        while len(_cache) > _CACHE_SIZE:
            _cache.popitem(last=False)
    return made
