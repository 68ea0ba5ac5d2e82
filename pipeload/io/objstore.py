"""Object-store backend of :mod:`pipeload.io.storage`: ranged GETs through ``obstore``, many in flight.

An object is read as the reader reads a mapped file, through two classes with the local files' API:

- :class:`ObjectBlob` is ``_fastio.RawFile`` for an object (``view``, ``willneed``, ``copy_box``);
- :class:`ObjectSafetensors` is ``_fastio.SafetensorsFile`` for one (``entry``, ``buffer``,
  ``copy_box``, ``advise``, ``willneed_tensors``), its header fetched with one GET in the common case
  (or given: the bytes another rank fetched at the same pinned version) and validated by
  ``_fastio.read_header`` itself (same verdict as for a local file).

``willneed`` is where the bytes are requested: the range is cut into parts of ``part_size`` (8 MiB)
staged in one buffer per range, and each part is one GET issued on this process's I/O loop, at most
``max_requests`` in flight. A later ``view``/``copy_box`` waits for just the parts it covers. So the
reader's prefetch (which already merges a rank's neighbouring ranges) becomes a stream of large
parallel GETs, and the copies wait only on what they use.

Invariants:

- every GET carries ``If-Match`` with the ETag pinned when the checkpoint was planned (rank 0's LIST,
  sent to every rank with the metadata): a replaced object fails with :class:`ReadError`, bytes of two
  versions are never combined;
- a failed GET is retried (503/500, resets, short bodies) with full-jitter exponential backoff, at most
  ``retries`` times and within ``retry_timeout`` seconds; then :class:`ReadError` naming the object,
  the byte range and the last cause; a 404 or 412 is never retried;
- bytes staged for an object stay until the object is closed (the reader's LRU of open files).
"""

from __future__ import annotations

import asyncio
import atexit
import bisect
import concurrent.futures
import math
import os
import random
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Iterable

from ..errors import CheckpointFormatError, HeaderError, PipeloadError, ReadError, TensorNotFoundError

EXTRA_HINT = "object storage needs obstore: pip install 'pipeload[s3]'"

PART_SIZE = 8 << 20  # bytes per ranged GET
MAX_REQUESTS = 16  # GETs in flight per process
HEADER_GET = 64 << 10  # the first GET of a safetensors object: its header, in one request almost always
RETRIES = 8
RETRY_BASE = 0.05  # seconds; attempt k waits uniform(0, min(RETRY_MAX, RETRY_BASE * 2**k))
RETRY_MAX = 2.0
RETRY_TIMEOUT = 60.0  # seconds of retrying one request before giving up

# storage_options keys pipeload itself reads; everything else goes to obstore
OWN_OPTIONS = ("part_size", "max_requests", "retries", "retry_base", "retry_max", "retry_timeout", "header_get")
CLIENT_OPTIONS = ("allow_http", "allow_invalid_certificates", "connect_timeout", "timeout", "user_agent",
                  "pool_idle_timeout", "pool_max_idle_per_host", "http1_only", "http2_only", "proxy_url")


def obstore_module():
    """``obstore``, or a PipeloadError naming the extra that installs it."""
    try:
        import obstore
    except ImportError:
        raise PipeloadError(EXTRA_HINT) from None
    return obstore


@dataclass
class Counters:
    """Requests of one process to object storage (all stores); :func:`snapshot` copies them."""

    requests: int = 0  # GET, HEAD, LIST and PUT requests sent (retries included)
    bytes_fetched: int = 0  # body bytes of successful GETs
    retries: int = 0
    throttled: int = 0  # answers 503 / SlowDown
    inflight: int = 0
    max_inflight: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def snapshot(self) -> dict[str, int]:
        with self.lock:
            return {"requests": self.requests, "bytes_fetched": self.bytes_fetched, "retries": self.retries,
                    "throttled": self.throttled, "max_inflight": self.max_inflight}

    def reset_peak(self) -> None:
        with self.lock:
            self.max_inflight = self.inflight


COUNTERS = Counters()


class _IOLoop:
    """One daemon thread running an asyncio loop for every GET/PUT of this process."""

    def __init__(self):
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="pipeload-objstore", daemon=True)
        self.thread.start()

    def submit(self, coro) -> concurrent.futures.Future:
        return asyncio.run_coroutine_threadsafe(coro, self.loop)


_LOOP: _IOLoop | None = None
_LOOP_LOCK = threading.Lock()


def io_loop() -> _IOLoop:
    global _LOOP
    with _LOOP_LOCK:
        if _LOOP is None or not _LOOP.thread.is_alive() or _LOOP_PID != os.getpid():
            _set_loop(_IOLoop())
        return _LOOP


_LOOP_PID = -1


def _set_loop(loop: _IOLoop) -> None:
    global _LOOP, _LOOP_PID
    _LOOP, _LOOP_PID = loop, os.getpid()


@atexit.register
def _stop_loop() -> None:
    """At exit, before the interpreter finalizes: stop this process's I/O loop and wait for its thread.

    A daemon thread still running the loop when finalization starts is stopped inside whatever it
    runs: in the object store's native code (a request's callback), that unwinds through frames that
    cannot be unwound and aborts the process — after a save or load that had completed (seen as a
    SIGABRT in 2 of 185 processes that saved to S3; 0 of 200 with this)."""
    loop = _LOOP
    if loop is None or _LOOP_PID != os.getpid() or not loop.thread.is_alive():
        return
    loop.loop.call_soon_threadsafe(loop.loop.stop)
    loop.thread.join(timeout=10)


_FATAL = ("NotFoundError", "PreconditionError", "PermissionDeniedError", "UnauthenticatedError",
          "InvalidPathError", "NotSupportedError", "AlreadyExistsError")


def _throttled(e: BaseException) -> bool:
    text = str(e)
    return "503" in text or "SlowDown" in text or "Slow Down" in text


def split_url(url: str) -> tuple[str, str]:
    """("s3://bucket", "key/inside") of an object URL."""
    scheme, _, rest = url.partition("://")
    bucket, _, key = rest.partition("/")
    if not bucket:
        raise PipeloadError(f"{url}: an object URL needs a bucket (s3://bucket/prefix)")
    return f"{scheme}://{bucket}", key.strip("/")


class Store:
    """One bucket's client, its request policy and the versions pinned for its objects."""

    def __init__(self, base: str, options: dict[str, Any] | None = None):
        ob = obstore_module()
        from obstore.store import from_url

        options = dict(options or {})
        own = {k: options.pop(k) for k in OWN_OPTIONS if k in options}
        client = {k: options.pop(k) for k in CLIENT_OPTIONS if k in options}
        if "allow_http" not in client and os.environ.get("AWS_ALLOW_HTTP", "").lower() in ("1", "true"):
            client["allow_http"] = True
        self.base = base
        self.part_size = max(1 << 20, int(own.get("part_size", PART_SIZE)))
        self.max_requests = max(1, int(own.get("max_requests", MAX_REQUESTS)))
        self.retries = max(0, int(own.get("retries", RETRIES)))
        self.retry_base = float(own.get("retry_base", RETRY_BASE))
        self.retry_max = float(own.get("retry_max", RETRY_MAX))
        self.retry_timeout = float(own.get("retry_timeout", RETRY_TIMEOUT))
        self.header_get = max(4096, int(own.get("header_get", HEADER_GET)))
        # pipeload retries itself (to count and bound retries): the client's own retries are off
        self.store = from_url(base, config=options or None, client_options=client or None,
                              retry_config={"max_retries": 0, "retry_timeout": _td(self.retry_timeout)})
        self.ob = ob
        self.pins: dict[str, tuple[int, str | None]] = {}  # key -> (size, etag)
        self._sem: asyncio.Semaphore | None = None

    def url(self, key: str) -> str:
        return f"{self.base}/{key}"

    def _semaphore(self) -> asyncio.Semaphore:
        if self._sem is None:  # created on the I/O loop, used only there
            self._sem = asyncio.Semaphore(self.max_requests)
        return self._sem

    async def _attempts(self, what: str, key: str, op):
        """``await op()`` with the retry policy; ReadError naming the object and the cause at the end."""
        deadline = time.monotonic() + self.retry_timeout
        attempt = 0
        while True:
            async with self._semaphore():
                with COUNTERS.lock:
                    COUNTERS.requests += 1
                    COUNTERS.inflight += 1
                    COUNTERS.max_inflight = max(COUNTERS.max_inflight, COUNTERS.inflight)
                try:
                    return await op()
                except Exception as e:  # noqa: BLE001 - classified below
                    error = e
                finally:
                    with COUNTERS.lock:
                        COUNTERS.inflight -= 1
            name = type(error).__name__
            if name in _FATAL or isinstance(error, (PipeloadError, FileNotFoundError, PermissionError)):
                raise ReadError(f"{self.url(key)}: {what}: {_cause(error)}") from None
            if _throttled(error):
                with COUNTERS.lock:
                    COUNTERS.throttled += 1
            wait = random.uniform(0, min(self.retry_max, self.retry_base * 2 ** attempt))
            if attempt >= self.retries or time.monotonic() + wait > deadline:
                raise ReadError(f"{self.url(key)}: {what} failed after {attempt + 1} attempt(s): "
                                f"{_cause(error)}") from None
            attempt += 1
            with COUNTERS.lock:
                COUNTERS.retries += 1
            await asyncio.sleep(wait)

    async def get_into(self, key: str, start: int, end: int, etag: str | None, out: memoryview) -> None:
        """Bytes [start, end) of ``key`` (version ``etag``) into ``out``; retried, counted."""

        async def op():
            opts: dict[str, Any] = {"range": (start, end)}
            if etag:
                opts["if_match"] = etag
            res = await self.ob.get_async(self.store, key, options=opts)
            data = await res.bytes_async()
            if len(data) != end - start:  # a short body: retried like a reset
                raise ConnectionError(f"short body: {len(data)} of {end - start} bytes")
            out[:] = memoryview(data)
            with COUNTERS.lock:
                COUNTERS.bytes_fetched += len(data)

        await self._attempts(f"GET bytes {start}-{end}", key, op)

    async def get_all(self, key: str, etag: str | None, limit: int) -> bytes:
        """The whole object ``key`` (at most ``limit`` bytes, else ReadError); one GET."""

        async def op():
            opts = {"if_match": etag} if etag else {}
            res = await self.ob.get_async(self.store, key, options=opts)
            size = int(res.meta["size"])
            if size > limit:
                raise PipeloadError(f"{size} bytes, over the {limit}-byte limit")
            data = bytes(await res.bytes_async())
            if len(data) != size:
                raise ConnectionError(f"short body: {len(data)} of {size} bytes")
            with COUNTERS.lock:
                COUNTERS.bytes_fetched += len(data)
            return data

        return await self._attempts("GET", key, op)

    async def head(self, key: str) -> tuple[int, str | None]:
        meta = await self._attempts("HEAD", key, lambda: self.ob.head_async(self.store, key))
        return int(meta["size"]), meta.get("e_tag")

    async def list(self, prefix: str) -> list[dict]:
        async def op():
            out = []
            async for batch in self.ob.list(self.store, prefix=prefix or None):
                out.extend(batch)
            return out

        return await self._attempts("LIST", prefix, op)

    async def put(self, key: str, data, **kw) -> None:
        await self._attempts("PUT", key, lambda: self.ob.put_async(self.store, key, data, **kw))

    async def delete(self, key: str) -> None:
        await self._attempts("DELETE", key, lambda: self.ob.delete_async(self.store, key))

    def run(self, coro):
        """Run ``coro`` on the I/O loop and wait for it (from any thread but the I/O loop's)."""
        return io_loop().submit(coro).result()

    def version(self, key: str) -> tuple[int, str | None]:
        """(size, etag) of ``key``: the pinned one, else a HEAD (then pinned)."""
        hit = self.pins.get(key)
        if hit is None:
            hit = self.pins[key] = self.run(self.head(key))
        return hit


def _td(seconds: float):
    import datetime

    return datetime.timedelta(seconds=seconds)


def _cause(e: BaseException) -> str:
    name = type(e).__name__
    text = " ".join(str(e).split())
    if name == "PreconditionError" or "412" in text[:200] or "PreconditionFailed" in text:
        return "the object was replaced since the load was planned (ETag no longer matches)"
    if name == "NotFoundError" or isinstance(e, FileNotFoundError):
        return "the object does not exist (deleted or replaced since the load was planned)"
    return f"{name}: {text[:300]}"


class _Span:
    """Bytes [lo, hi) of one object staged in ``buf``, filled by one GET per part."""

    __slots__ = ("lo", "hi", "buf", "parts")

    def __init__(self, lo: int, hi: int):
        self.lo, self.hi = lo, hi
        self.buf = bytearray(hi - lo)
        self.parts: list[tuple[int, int, concurrent.futures.Future]] = []

    def wait(self, a: int, b: int) -> None:
        """Block until every part overlapping [a, b) has landed; raise its ReadError otherwise."""
        for lo, hi, fut in self.parts:
            if hi > a and lo < b:
                fut.result()


class ObjectBlob:
    """``_fastio.RawFile`` for one object: byte ranges fetched by ranged GETs into staging buffers."""

    def __init__(self, store: Store, key: str, size: int | None = None, etag: str | None = None):
        self.store, self.key = store, key
        self.path = store.url(key)
        if size is None:
            size, etag = store.version(key)
        self.size, self.etag = size, etag
        self.closed = False
        self._spans: list[_Span] = []  # sorted by lo, disjoint
        self._lock = threading.Lock()

    def close(self) -> None:
        self.closed = True
        self._spans = []  # views handed out keep their buffers

    def check_unchanged(self) -> None:
        """Nothing to stat: every GET carries If-Match with the pinned ETag instead."""

    def _gaps(self, start: int, end: int) -> list[tuple[int, int]]:
        out, pos = [], start
        i = max(0, bisect.bisect_right([s.lo for s in self._spans], start) - 1)
        for s in self._spans[i:]:
            if s.lo >= end:
                break
            if s.hi <= pos:
                continue
            if s.lo > pos:
                out.append((pos, s.lo))
            pos = max(pos, s.hi)
        if pos < end:
            out.append((pos, end))
        return out

    def willneed(self, start: int, end: int) -> None:
        """Request [start, end) (clipped to the object) now, as parts of ``part_size``; never blocks."""
        start, end = max(0, start), min(self.size, end)
        if end <= start or self.closed:
            return
        loop, part = io_loop(), self.store.part_size
        with self._lock:
            for lo, hi in self._gaps(start, end):
                span = _Span(lo, hi)
                mv = memoryview(span.buf)
                n = max(1, math.ceil((hi - lo) / part))
                step = math.ceil((hi - lo) / n)  # even parts, each <= part_size
                for a in range(lo, hi, step):
                    b = min(hi, a + step)
                    fut = loop.submit(self.store.get_into(self.key, a, b, self.etag, mv[a - lo : b - lo]))
                    span.parts.append((a, b, fut))
                bisect.insort(self._spans, span, key=lambda s: s.lo)

    def view(self, offset: int, length: int) -> memoryview:
        """Bytes [offset, offset + length), zero-copy when one staged range holds them all."""
        if offset < 0 or length < 0:
            raise ValueError(f"{self.path}: bad range ({offset}, {length})")
        end = offset + length
        if end > self.size:
            raise ReadError(f"{self.path}: bytes {offset}-{end} lie past the end of the object ({self.size} bytes)")
        if length == 0:
            return memoryview(bytearray(0))
        self.willneed(offset, end)
        with self._lock:
            spans = [s for s in self._spans if s.hi > offset and s.lo < end]
        if len(spans) == 1:
            s = spans[0]
            s.wait(offset, end)
            return memoryview(s.buf)[offset - s.lo : end - s.lo]
        out = bytearray(length)
        for s in spans:
            a, b = max(offset, s.lo), min(end, s.hi)
            s.wait(a, b)
            out[a - offset : b - offset] = memoryview(s.buf)[a - s.lo : b - s.lo]
        return memoryview(out)

    def copy_box(self, name: str, start: int, itemsize: int, chunk_shape: tuple, src_offsets: tuple,
                 lengths: tuple, dst: int, dst_offsets: tuple, dst_strides: tuple, dst_shape: tuple,
                 willneed: bool = False) -> int:
        """``RawFile.copy_box``: the box of a C-contiguous chunk stored at byte ``start``; fetches only the
        bytes between the box's first and last element."""
        return _copy_box(self, name, start, itemsize, chunk_shape, src_offsets, lengths, dst, dst_offsets,
                         dst_strides, dst_shape)


def _copy_box(blob: ObjectBlob, name, start, itemsize, chunk_shape, src_offsets, lengths, dst, dst_offsets,
              dst_strides, dst_shape) -> int:
    """Copy box (src_offsets, lengths) of the chunk at ``start`` to the host tensor at address ``dst``."""
    from ._fastio import guarded_copy

    for off, n, full in (*zip(src_offsets, lengths, chunk_shape), *zip(dst_offsets, lengths, dst_shape)):
        if off < 0 or n < 0 or off + n > full:
            raise ValueError(f"{blob.path}: box of {name!r} does not fit its tensor")
    if len(src_offsets) != len(chunk_shape) or len(dst_offsets) != len(dst_shape):
        raise ValueError(f"{blob.path}: box of {name!r} has the wrong number of dimensions")
    numel = math.prod(lengths)
    if numel == 0:
        return 0
    strides, acc = [], itemsize
    for n in reversed(chunk_shape):
        strides.append(acc)
        acc *= n
    strides.reverse()
    first = sum(o * s for o, s in zip(src_offsets, strides))
    last = sum((o + n - 1) * s for o, n, s in zip(src_offsets, lengths, strides)) + itemsize
    view = blob.view(start + first, last - first)
    import torch

    src = torch.frombuffer(view, dtype=torch.uint8)  # keeps the staging buffer alive for the copy
    dst0 = dst + sum(o * s for o, s in zip(dst_offsets, dst_strides)) * itemsize
    guarded_copy(dst0, tuple(s * itemsize for s in dst_strides), src.data_ptr(), tuple(strides), tuple(lengths),
                 itemsize, blob.path)
    return numel * itemsize


class ObjectSafetensors(ObjectBlob):
    """``_fastio.SafetensorsFile`` for one object: the header from one GET, validated by ``_fastio``.

    ``header``: the object's first ``8 + n`` bytes (length prefix and JSON header) as they were read
    earlier at version ``etag`` of ``size`` bytes (rank 0's header GET, sent with a checkpoint's table).
    They are validated exactly as fetched ones would be and no GET is sent; since every later GET
    carries If-Match ``etag``, an object replaced meanwhile fails its first read (ReadError naming it)
    instead of being read through a stale header. Without both ``etag`` and ``size`` the header is
    fetched: bytes read earlier could not be tied to the version read now.
    """

    def __init__(self, store: Store, key: str, size: int | None = None, etag: str | None = None,
                 header: bytes | None = None):
        if header is not None and (not etag or size is None):
            header = None
        super().__init__(store, key, size, etag)
        self.header, self.header_bytes = parse_header(self, header)
        self.data_offset = len(self.header_bytes)
        self.metadata = self.header.pop("__metadata__", None)
        self._names = list(self.header)

    def __len__(self) -> int:
        return len(self._names)

    def __contains__(self, name: object) -> bool:
        return name in self.header

    def __iter__(self):
        return iter(self._names)

    def keys(self) -> list[str]:
        return list(self._names)

    def entry(self, name: str) -> tuple[str, tuple, int, int]:
        hit = self.header.get(name)
        if hit is None:
            raise TensorNotFoundError(f"{self.path}: no tensor named {name!r}")
        dtype, shape, start, end = hit
        return dtype, tuple(shape), start, end

    def buffer(self, name: str) -> memoryview:
        _, _, start, end = self.entry(name)
        return self.view(start, end - start)

    def span(self, start: int, end: int) -> memoryview:
        if start < 0 or end < start:
            raise ValueError(f"{self.path}: bad span ({start}, {end})")
        return self.view(start, end - start)

    def advise(self, advice: str, start: int = 0, end: int | None = None) -> None:
        if advice == "willneed":
            self.willneed(start, self.size if end is None else end)

    def willneed_tensors(self, names: Iterable[str], merge_gap: int = 1 << 20) -> int:
        ranges = sorted(self.entry(n)[2:] for n in names)
        total = 0
        if not ranges:
            return 0
        lo, hi = ranges[0]
        for a, b in ranges[1:]:
            if a - hi > merge_gap:
                self.willneed(lo, hi)
                total += hi - lo
                lo = a
            hi = max(hi, b)
        self.willneed(lo, hi)
        return total + hi - lo

    def copy_box(self, name: str, dtype: str, chunk_shape: tuple, src_offsets: tuple, lengths: tuple, dst: int,
                 dst_offsets: tuple, dst_strides: tuple, dst_shape: tuple, willneed: bool = False) -> int:
        """``SafetensorsFile.copy_box``: checks the stored dtype and shape, then copies only the box."""
        stored, shape, start, end = self.entry(name)
        if stored != dtype or tuple(shape) != tuple(chunk_shape):
            raise CheckpointFormatError(f"{self.path}: tensor {name!r} is {stored} {list(shape)}, "
                                        f"the metadata says {dtype} {list(chunk_shape)}")
        numel = math.prod(chunk_shape)
        itemsize = (end - start) // numel if numel else 1
        return _copy_box(self, name, start, itemsize, tuple(chunk_shape), src_offsets, lengths, dst, dst_offsets,
                         dst_strides, dst_shape)


def fetch_header(blob: ObjectBlob) -> bytes:
    """The object's first ``8 + n`` bytes (length prefix and header): one GET of ``header_get`` bytes,
    a second one only when the header is longer. Its length is checked (:func:`_header_length`)."""
    if blob.size < 8:
        raise HeaderError(f"{blob.path}: file is shorter than 8 bytes")
    first = min(blob.size, blob.store.header_get)
    head = bytes(blob.view(0, first))
    n = _header_length(blob, head)
    if 8 + n > first:
        head += bytes(blob.view(first, 8 + n - first))
    return head[: 8 + n]


def _header_length(blob: ObjectBlob, head: bytes) -> int:
    """The header length ``n`` that ``head`` starts with, checked against the limit and the object's size."""
    n = int.from_bytes(head[:8], "little")
    if n > 100_000_000:
        raise HeaderError(f"{blob.path}: header is {n} bytes, over the 100000000-byte limit")
    if 8 + n > blob.size:
        raise HeaderError(f"{blob.path}: header length {n} runs past the end of the file")
    return n


def parse_header(blob: ObjectBlob, head: bytes | None = None) -> tuple[dict, bytes]:
    """(``_fastio.read_header`` of an object, its first ``8 + n`` bytes).

    ``head``: those bytes, read before at the blob's version (else fetched, :func:`fetch_header`). They
    are laid into a sparse memory file of the object's size, so every rule that checks a local file
    checks the object (sizes, offsets, exact coverage, dtypes and shapes): the verdict is the same
    whether this process fetched the bytes or another one did.
    """
    from ._fastio import read_header

    if head is None:
        head = fetch_header(blob)
    elif blob.size < 8 or len(head) < 8 or len(head) != 8 + _header_length(blob, head):
        raise HeaderError(f"{blob.path}: the header recorded for this object ({len(head)} bytes) is truncated")
    fd = os.memfd_create("pipeload-header", os.MFD_CLOEXEC)
    try:
        os.write(fd, head)
        os.ftruncate(fd, blob.size)
        try:
            return read_header(f"/proc/self/fd/{fd}"), head
        except HeaderError as e:
            raise HeaderError(str(e).replace(f"/proc/self/fd/{fd}", blob.path)) from None
    finally:
        os.close(fd)
