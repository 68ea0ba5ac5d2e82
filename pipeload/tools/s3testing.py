"""A real S3 server on 127.0.0.1 and a fault-injecting proxy in front of it (tests and the S3 bench).

- :class:`LocalS3` starts ``moto``'s server (``pip install 'pipeload[test]'``) on a free loopback port
  and stops it; :meth:`LocalS3.bucket` creates a bucket; :meth:`LocalS3.options` gives the
  ``storage_options`` that reach it.
- :class:`FaultProxy` forwards HTTP/1.1 to it from one or more loopback ports ("links": one per
  emulated node) and injects, per request: latency, a bandwidth cap per connection and per link, 503
  SlowDown answers, connection resets, short bodies. Every request is logged (link, method, path,
  range, status, body bytes sent, fault), so a test can count bytes and requests per rank.

Only loopback addresses are ever bound or connected to.
"""

from __future__ import annotations

import asyncio
import hashlib
import socket
import struct
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

HOST = "127.0.0.1"


def free_port() -> int:
    """A loopback port free now. Another process may take it before the caller binds it: a caller that
    can bind port 0 itself (and read its port back) should; :class:`LocalS3` retries on a new port."""
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


def _die_with_parent() -> None:
    """In the child, before exec: SIGTERM when the process that started it dies (Linux), so a crashed
    test run never leaves a server behind."""
    import ctypes
    import signal

    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


class LocalS3:
    """moto's S3 server (``python -m moto.server``) in a process of its own on 127.0.0.1:<free port>.

    Its own process: moto copies every object it serves in Python, and sharing a GIL with the proxy
    (or a test) would make the server the bottleneck. A context manager; stopped on exit."""

    def __init__(self, port: int | None = None):
        """``port``: a server already running there (another process's): only its client is used."""
        self._chosen = port is None
        self.port = port or free_port()
        self._proc = None

    def start(self, tries: int = 3) -> "LocalS3":
        """Start the server; when it exits at once (its free port was taken meanwhile by another
        process) start it again on another port, ``tries`` times in all."""
        for _ in range(tries):
            if self._start_once():
                return self
            if not self._chosen:
                break
            self.port = free_port()
        raise RuntimeError(f"moto server did not start on {HOST}:{self.port}")

    def _start_once(self) -> bool:
        import subprocess
        import sys

        self._proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", HOST, "-p", str(self.port)],
                                      stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                      preexec_fn=_die_with_parent)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and self._proc.poll() is None:
            try:
                with socket.create_connection((HOST, self.port), timeout=1):
                    if self._proc.poll() is None:  # ours answered, not another process on that port
                        return True
            except OSError:
                time.sleep(0.1)
        self.stop()
        return False

    def stop(self) -> None:
        if self._proc is not None:
            self._proc.terminate()
            try:
                self._proc.wait(10)
            except Exception:  # noqa: BLE001 - it would not stop: kill it
                self._proc.kill()
                self._proc.wait(10)
            self._proc = None

    def __enter__(self) -> "LocalS3":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    @property
    def url(self) -> str:
        return f"http://{HOST}:{self.port}"

    def client(self):
        """A boto3 client of the server itself (boto3 comes with moto), bypassing any proxy."""
        import boto3

        return boto3.client("s3", endpoint_url=self.url, aws_access_key_id="testing",
                            aws_secret_access_key="testing", region_name="us-east-1")

    def bucket(self, name: str) -> None:
        self.client().create_bucket(Bucket=name)

    def upload(self, local_dir: str, bucket: str, prefix: str) -> list[str]:
        """Copy the files of ``local_dir`` (not its subdirectories) to ``s3://bucket/prefix/``."""
        import os

        c, names = self.client(), []
        for name in sorted(os.listdir(local_dir)):
            path = os.path.join(local_dir, name)
            if os.path.isfile(path):
                c.upload_file(path, bucket, f"{prefix}/{name}")
                names.append(name)
        return names

    @staticmethod
    def options(endpoint: str, **extra) -> dict:
        """storage_options for a moto endpoint (any credentials: moto does not check them)."""
        return {"endpoint": endpoint, "access_key_id": "testing", "secret_access_key": "testing",
                "region": "us-east-1", "allow_http": True, **extra}


@dataclass
class Request:
    link: int
    method: str
    path: str
    range: str | None
    status: int = 0
    sent: int = 0  # body bytes sent to the client
    fault: str = ""
    start: float = 0.0  # time.time() when the request arrived
    end: float = 0.0  # when its answer was sent


class _Bucket:
    """A token bucket of ``rate`` bytes/s: ``take(n)`` waits until n more bytes may pass.

    A wake-up later than asked (a busy machine) is made up for within ``BURST`` seconds, so the
    average rate is the cap, not the cap less every oversleep."""

    BURST = 0.25

    def __init__(self, rate: float | None):
        self.rate, self.t = rate, time.monotonic()  # no burst credit at the start

    async def take(self, n: int) -> None:
        if not self.rate:
            return
        now = time.monotonic()
        self.t = max(self.t, now - self.BURST) + n / self.rate
        if self.t - now > 0.0005:
            await asyncio.sleep(self.t - now)


@dataclass
class Faults:
    latency: float = 0.0  # seconds before each request is forwarded
    conn_rate: float | None = None  # bytes/s per connection
    link_rate: float | None = None  # bytes/s per link (all its connections)
    p503: float = 0.0  # share of GETs answered 503 SlowDown
    preset: float = 0.0  # share of GETs whose connection is reset before an answer
    pshort: float = 0.0  # share of GETs whose body is cut in half (then the connection closes)
    only: str = ""  # faults only for paths containing this (e.g. ".safetensors")
    # (path prefix, {"p503": .., "preset": .., "pshort": .., "first": "503"}): the first rule whose prefix
    # starts the request's path sets its fault shares instead of the ones above; "first" gives the first
    # GET of each object that fault ("503", "reset" or "short"), whatever the draws (a test that must
    # meet one does, however its requests fall)
    rules: list[tuple[str, dict]] = field(default_factory=list)
    seed: int = 0
    hook: Callable[[Request], None] | None = field(default=None, repr=False)  # runs before forwarding


class FaultProxy:
    """HTTP/1.1 forwarding proxy with injected faults, on ``links`` loopback ports, in its own thread."""

    def __init__(self, upstream_port: int, links: int = 1, faults: Faults | None = None):
        self.upstream = upstream_port
        self.faults = faults or Faults()
        self.ports: list[int] = []  # bound at start(), on ports the kernel picks (no race for them)
        self._n = links
        self.log: list[Request] = []
        self._attempts: dict[tuple[str, str], int] = {}  # (path, range) -> times asked for
        self._first_done: set[str] = set()  # objects whose first GET met its rule's "first" fault
        self._links = [_Bucket(self.faults.link_rate) for _ in range(links)]
        self._loop = asyncio.new_event_loop()
        self._servers: list = []
        self._thread = threading.Thread(target=self._loop.run_forever, name="fault-proxy", daemon=True)

    def url(self, link: int = 0) -> str:
        return f"http://{HOST}:{self.ports[link]}"

    def start(self) -> "FaultProxy":
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self._listen(), self._loop).result(10)
        return self

    async def _listen(self) -> None:
        for i in range(self._n):
            srv = await asyncio.start_server(lambda r, w, i=i: self._client(r, w, i), HOST, 0)
            self._servers.append(srv)
            self.ports.append(srv.sockets[0].getsockname()[1])

    def stop(self) -> None:
        async def close():
            for s in self._servers:
                s.close()
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

        asyncio.run_coroutine_threadsafe(close(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)

    def __enter__(self) -> "FaultProxy":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def set(self, **kw) -> None:
        """Change faults from now on (e.g. ``set(p503=0.1)``)."""
        for k, v in kw.items():
            setattr(self.faults, k, v)
        if "link_rate" in kw:
            self._links = [_Bucket(self.faults.link_rate) for _ in self.ports]
        if "seed" in kw:
            self._attempts, self._first_done = {}, set()

    def clear(self) -> None:
        self.log = []

    def requests(self, method: str = "GET", link: int | None = None, contains: str = "") -> list[Request]:
        return [r for r in self.log if r.method == method and (link is None or r.link == link)
                and contains in r.path]

    def _fault(self, method: str, path: str, range_: str | None = None) -> str:
        """The fault of one request. Drawn from (seed, path, range, how many times that range was asked
        for), not from arrival order: the same requests meet the same faults however the ranks' requests
        interleave, and a retry of a range draws afresh."""
        f = self.faults
        if method != "GET" or (f.only and f.only not in path):
            return ""
        shares = {"p503": f.p503, "preset": f.preset, "pshort": f.pshort}
        first = ""
        for prefix, rule in f.rules:
            if path.startswith(prefix):
                shares = {k: rule.get(k, 0.0) for k in shares}
                first = rule.get("first", "")
                break
        if first and path not in self._first_done:
            self._first_done.add(path)
            return first
        key = (path, range_ or "")
        attempt = self._attempts[key] = self._attempts.get(key, 0) + 1
        digest = hashlib.blake2b(f"{f.seed}\0{path}\0{range_ or ''}\0{attempt}".encode(), digest_size=8).digest()
        x = int.from_bytes(digest, "little") / 2.0**64
        for name, p in (("503", shares["p503"]), ("reset", shares["preset"]), ("short", shares["pshort"])):
            if x < p:
                return name
            x -= p
        return ""

    async def _client(self, reader, writer, link: int) -> None:
        up = None
        try:
            while True:
                try:
                    head = await reader.readuntil(b"\r\n\r\n")
                except (asyncio.IncompleteReadError, ConnectionError):
                    return
                method, path, headers = _parse_head(head)
                body = await _read_body(reader, headers)
                rec = Request(link, method, path, headers.get("range"), start=time.time())
                self.log.append(rec)
                if self.faults.latency:
                    await asyncio.sleep(self.faults.latency)
                rec.fault = self._fault(method, path, rec.range)
                if self.faults.hook is not None:
                    self.faults.hook(rec)
                if rec.fault == "503":
                    rec.status = 503
                    msg = (b"<?xml version=\"1.0\" encoding=\"UTF-8\"?><Error><Code>SlowDown</Code>"
                           b"<Message>Please reduce your request rate.</Message></Error>")
                    writer.write(b"HTTP/1.1 503 Slow Down\r\nContent-Type: application/xml\r\n"
                                 b"Content-Length: %d\r\n\r\n%s" % (len(msg), msg))
                    await writer.drain()
                    continue
                if rec.fault == "reset":
                    _reset(writer)
                    return
                if up is None:
                    up = await asyncio.open_connection(HOST, self.upstream)
                up[1].write(head + body)
                await up[1].drain()
                ok = await self._answer(up[0], writer, rec, link)
                rec.end = time.time()
                if not ok:
                    return
        except (ConnectionError, asyncio.IncompleteReadError):
            return
        finally:
            for w in (writer, up[1] if up else None):
                if w is not None:
                    w.close()

    async def _answer(self, up_reader, writer, rec: Request, link: int) -> bool:
        """Relay one response; False when the connection is to be closed (a short body)."""
        head = await up_reader.readuntil(b"\r\n\r\n")
        status_line, headers = _parse_response(head)
        rec.status = int(status_line.split()[1])
        writer.write(head)
        conn = _Bucket(self.faults.conn_rate)
        if rec.method == "HEAD" or rec.status in (204, 304):
            await writer.drain()
            return True
        if headers.get("transfer-encoding", "").lower() == "chunked":
            raw = await _read_chunked(up_reader)
            writer.write(raw)
            rec.sent += len(raw)
            await writer.drain()
            return True
        left = int(headers.get("content-length", "0"))
        cut = left // 2 if rec.fault == "short" else left
        while left > 0:
            data = await up_reader.read(min(left, 256 << 10))
            if not data:
                raise ConnectionError("upstream closed")
            left -= len(data)
            send = data[: max(0, cut)]
            cut -= len(data)
            if send:
                await conn.take(len(send))
                await self._links[link].take(len(send))
                writer.write(send)
                rec.sent += len(send)
                await writer.drain()
            if cut <= 0 and rec.fault == "short":
                while left > 0:  # drain upstream, then drop the client
                    left -= len(await up_reader.read(min(left, 1 << 20)) or b"x" * left)
                _reset(writer)
                return False
        return True


def _reset(writer) -> None:
    sock = writer.get_extra_info("socket")
    if sock is not None:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    writer.transport.abort()


def _parse_head(head: bytes) -> tuple[str, str, dict[str, str]]:
    lines = head.decode("latin-1").split("\r\n")
    method, path, _ = lines[0].split(" ", 2)
    return method, path, _headers(lines[1:])


def _parse_response(head: bytes) -> tuple[str, dict[str, str]]:
    lines = head.decode("latin-1").split("\r\n")
    return lines[0], _headers(lines[1:])


def _headers(lines: list[str]) -> dict[str, str]:
    out = {}
    for line in lines:
        if ":" in line:
            k, v = line.split(":", 1)
            out[k.strip().lower()] = v.strip()
    return out


async def _read_body(reader, headers: dict[str, str]) -> bytes:
    if headers.get("transfer-encoding", "").lower() == "chunked":
        return await _read_chunked(reader)
    n = int(headers.get("content-length", "0"))
    return await reader.readexactly(n) if n else b""


async def _read_chunked(reader) -> bytes:
    """A chunked body, returned raw (sizes and trailer included) to be relayed as is."""
    parts = []
    while True:
        line = await reader.readuntil(b"\r\n")
        parts.append(line)
        size = int(line.split(b";")[0].strip(), 16)
        if size == 0:
            parts.append(await reader.readuntil(b"\r\n"))
            return b"".join(parts)
        parts.append(await reader.readexactly(size + 2))
