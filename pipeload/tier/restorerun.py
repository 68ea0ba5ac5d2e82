"""The two kinds of restore job, as decided by :mod:`.restoreplan`: what a rank reads, sends and receives.

- :class:`SameJob` (the saved layout): rank ``r`` copies saved rank ``r``'s file from its own root,
  or receives it from the file's source; a source reads the files it sends. A file travels as its
  tensors in sorted fqn order (each cut into parts), then its objects' sizes, then their bytes.
- :class:`pipeload.tier.reshard.ReshardJob` (any other layout): planned by :mod:`pipeload.move.plan`
  and moved by :mod:`pipeload.move.run`, with the tier files as the source (see that module).

``run`` returns (the decoded Python objects as ``(leaf, value)``, this rank's error or None): a failed
read still sends (zeros), so no peer waits for ever; the error is raised at the agreement.
"""

from __future__ import annotations

import os

import torch

from ..io._fastio import SafetensorsFile
from ..io.reader import decode_object
from ..io.checksum import checksum, hasher
from .restoreread import pread_into
from ..move.mover import Transfers, batches, host_bytes, staged_into, unpack_into


class _Files:
    """This rank's open tier files of the chosen step (closed by :meth:`close`)."""

    def __init__(self, files: dict, step: int):
        self.files, self.step, self.open, self.fds = files, step, {}, {}

    def get(self, f: int):
        tf = self.files[(self.step, f)]
        if f not in self.open:
            self.open[f] = SafetensorsFile(tf.path)
        return tf, self.open[f]

    def fd(self, f: int) -> int:
        if f not in self.fds:
            self.fds[f] = os.open(self.files[(self.step, f)].path, os.O_RDONLY | os.O_CLOEXEC)
        return self.fds[f]

    def close(self) -> None:
        for sf in self.open.values():
            sf.close()
        for fd in self.fds.values():
            os.close(fd)


class _Errors:
    def __init__(self):
        self.items: list[str] = []

    def guard(self, fn, fallback):
        """``fn()``, or ``fallback()`` with the error recorded (a read failing still sends something)."""
        try:
            return fn()
        except Exception as e:  # noqa: BLE001 - reported at the agreement
            self.items.append(f"{type(e).__name__}: {e}")
            return fallback()

    def text(self) -> str | None:
        return "\n".join(self.items) if self.items else None


_copier: tuple | None = None  # (pid, executor): a forked child makes its own


def _pool():
    """One thread per process for a rank's local copies while its transfers run."""
    global _copier
    if _copier is None or _copier[0] != os.getpid():
        from concurrent.futures import ThreadPoolExecutor

        _copier = (os.getpid(), ThreadPoolExecutor(max_workers=1, thread_name_prefix="pipeload-tier-copy"))
    return _copier[1]


class _Hashes:
    """The checksums of a same-layout job, computed on the bytes as they are read (each chunk's parts in
    order): a copy that fails is reported after the transfers, and the decision is re-taken then."""

    def __init__(self):
        self.of: dict[tuple[str, str], object] = {}  # a hasher fed in parts, or the hex digest of the whole

    def whole(self, tf, fqn: str, data) -> None:
        """The checksum of ``fqn``'s bytes, all of them in ``data`` (a bytes-like object)."""
        self.of[(tf.path, fqn)] = checksum(data)

    def feed(self, tf, fqn: str, data: torch.Tensor) -> None:
        h = self.of.get((tf.path, fqn))
        if h is None:
            h = self.of[(tf.path, fqn)] = hasher()
        if data.numel():
            h.update(data.numpy())

    def bad(self, tf) -> str | None:
        """Why ``tf`` (read whole) is unusable, or None."""
        want = {f: t[4] for f, t in tf.tensors.items()} | {f: o[1] for f, o in tf.objects.items()}
        for fqn, csum in want.items():
            h = self.of.get((tf.path, fqn))
            got = h if type(h) is str else h.hexdigest() if h is not None else _EMPTY
            if got != csum:
                return f"{tf.path}: {fqn!r}: checksum {got} != {csum} recorded"
        return None


_EMPTY = checksum(b"")


def _part(tf, fd: int, fqn: str, errors: _Errors, hashes: _Hashes, take=None):
    """``part(lo, hi)``: bytes [lo, hi) of the stored chunk (or object) ``fqn``, read with ``pread``
    (parts asked for in order: each is hashed as it is read) into ``take(n)`` (a transfer's buffer)."""
    start = tf.spans[fqn][0]
    take = take or (lambda n: torch.empty(n, dtype=torch.uint8))

    def part(lo: int, hi: int) -> torch.Tensor:
        def read():
            out = take(hi - lo)
            pread_into(fd, tf.path, start + lo, out)
            hashes.feed(tf, fqn, out)
            return out

        return errors.guard(read, lambda: torch.zeros(hi - lo, dtype=torch.uint8))

    return part


def _size(tf, fqn: str) -> int:
    return tf.spans[fqn][1] - tf.spans[fqn][0]


def _slices(buf: torch.Tensor):
    return lambda lo, hi: buf[lo:hi]


class SameJob:
    """Same layout: this rank's own file (local or received) and the files it sends."""

    ring = None  # a pipeload.device.H2DRing for accelerator destinations, set by the restore

    def __init__(self, planned, rank: int):
        self.plan, self.choice, self.rank = planned.same_plan, planned.choice, rank
        self.local = bool(self.plan.local[rank])
        self.reads: set[int] = set()  # (checked while read: see run)
        self.files = sorted(set(self.plan.sends(rank)) | ({rank} if self.local else set()))

    def run(self, comm, files: dict, want, stats, what: str) -> tuple[list, str | None, list]:
        """(decoded objects, this rank's error, the copies it read that failed their checksums). The
        checksums are computed on the bytes as they are read and sent or copied: one pass over the tier.
        A failed copy has already reached a destination; the decision re-taken then rewrites every
        destination from one step (another copy, an older step, or the fallback)."""
        x, errors, opened, hashes = Transfers(comm, what), _Errors(), _Files(files, self.choice.step), _Hashes()
        decoded: list = []
        step = self.choice.step
        mine, own_errors, own_hashes = None, _Errors(), _Hashes()
        try:
            if self.local:  # its own file meanwhile, in a thread: a copy needs no other rank
                tf, fd = opened.files[(step, self.rank)], opened.fd(self.rank)
                mine = _pool().submit(_copy_file, tf, fd, want, own_errors, stats, own_hashes, self.ring)
            ops = [(f, True) for f in self.plan.sends(self.rank)] + ([] if self.local else [(self.rank, False)])
            for f, sending in sorted(ops):
                if sending:
                    _send_file(x, opened.files[(step, f)], opened.fd(f), f, errors, hashes)
                else:
                    decoded = _recv_file(x, self.plan.source[self.rank], want, errors, what, self.ring)
            x.drain()
        finally:
            if mine is not None:
                decoded = mine.result()
            opened.close()
        errors.items += own_errors.items
        hashes.of.update(own_hashes.of)
        stats.bytes_read += x.sent
        stats.bytes_received, stats.broadcasts = x.received, x.messages
        stats.shared_shards = 0 if self.local else len(want.tensors)
        stats.objects = len(want.objects)
        bad = [(step, f, why) for f in self.files if (why := hashes.bad(files[(step, f)])) is not None]
        return decoded, errors.text(), bad


def _send_file(x: Transfers, tf, fd: int, peer: int, errors: _Errors, hashes: _Hashes) -> None:
    for batch in batches([(fqn, _size(tf, fqn)) for fqn in sorted(tf.tensors)]):
        if len(batch) == 1:
            x.send(peer, batch[0][1], _part(tf, fd, batch[0][0], errors, hashes, x.buffer))
            continue
        buf = x.buffer(sum(n for _, n in batch))
        view = host_bytes(buf.data_ptr(), buf.numel())
        spans = [tf.spans[fqn] for fqn, _ in batch]
        if all(a[1] == b[0] for a, b in zip(spans, spans[1:])):  # (back to back in the file: one read)
            errors.guard(lambda: pread_into(fd, tf.path, spans[0][0], buf), lambda: None)
        else:
            at = 0
            for (fqn, n), (start, _) in zip(batch, spans):
                errors.guard(lambda: pread_into(fd, tf.path, start, buf[at: at + n]), lambda: None)
                at += n
        at = 0
        for fqn, n in batch:
            hashes.whole(tf, fqn, view[at: at + n])
            at += n
        x.send(peer, buf.numel(), _slices(buf))
    names = sorted(tf.objects)
    if names:
        sizes = torch.tensor([_size(tf, n) for n in names], dtype=torch.int64)
        x.send(peer, sizes.numel() * 8, _slices(sizes.view(torch.uint8)))
        data = torch.cat([_part(tf, fd, n, errors, hashes)(0, _size(tf, n)) for n in names])
        x.send(peer, data.numel(), _slices(data))


def _recv_file(x: Transfers, peer: int, want, errors: _Errors, what: str, ring=None) -> list:
    dst = {fqn: want.tensors[fqn][1].local for fqn in want.tensors}
    for batch in batches([(fqn, dst[fqn].numel() * dst[fqn].element_size()) for fqn in sorted(dst)]):
        if len(batch) == 1:
            buf, then = staged_into(dst[batch[0][0]], ring)
        else:
            buf = x.buffer(sum(n for _, n in batch))
            then = unpack_into(buf, [dst[fqn] for fqn, _ in batch], ring)
        x.recv(peer, buf, then)
    names = sorted(want.objects)
    if not names:
        return []
    sizes = torch.empty(len(names), dtype=torch.int64)
    x.recv(peer, sizes.view(torch.uint8))
    x.drain()  # (waiting on the oldest: every older message first)
    data = torch.empty(int(sizes.sum()), dtype=torch.uint8)
    x.recv(peer, data)
    x.drain()
    out, at = [], 0
    for n, size in zip(names, sizes.tolist()):
        blob = data[at: at + size].numpy().tobytes()
        at += size
        value = errors.guard(lambda: decode_object(blob, f"{what}: object {n!r} from rank {peer}"), lambda: None)
        out.append((want.objects[n], value))
    return out


def _copy_file(tf, fd: int, want, errors: _Errors, stats, hashes: _Hashes, ring=None) -> list:
    """This rank's own file into its destinations: ``preadv`` straight into the destination tensors, many
    chunks back to back in the file a call (a large one in pieces), each hashed while it is in the cache."""
    items = []
    for fqn, (_, box, _) in want.tensors.items():
        buf, then = staged_into(box.local, ring)
        items.append((tf.spans[fqn][0], fqn, buf, then))
        stats.bytes_read += buf.numel()
    items.sort(key=lambda item: item[0])
    group: list = []
    total = 0
    for item in items:
        start, _, buf, _ = item
        n = buf.numel()
        if group and (start != group[-1][0] + group[-1][2].numel() or len(group) >= _IOV_MAX
                      or total + n > _HASH_PIECE):
            _read_group(fd, tf, group, errors, hashes)
            group, total = [], 0
        if n >= _HASH_PIECE:
            errors.guard(lambda: (_pread_hashed(fd, tf, item[1], buf, hashes), item[3]()), lambda: None)
            continue
        group.append(item)
        total += n
    if group:
        _read_group(fd, tf, group, errors, hashes)
    stats.private_shards = len(want.tensors)
    out = []
    for fqn, leaf in want.objects.items():
        blob = torch.empty(_size(tf, fqn), dtype=torch.uint8)
        errors.guard(lambda: _pread_hashed(fd, tf, fqn, blob, hashes), lambda: None)
        stats.bytes_read += blob.numel()
        data = blob.numpy().tobytes()
        out.append((leaf, errors.guard(lambda: decode_object(data, f"{tf.path}: object {fqn!r}"), lambda: None)))
    return out


_IOV_MAX = 1024  # buffers per preadv (Linux's IOV_MAX)


def _read_group(fd: int, tf, group: list, errors: _Errors, hashes: _Hashes) -> None:
    """Chunks back to back in the file (``group``: (start, fqn, flat uint8 destination, then)) with one
    ``preadv`` (a short read: each again on its own, which names where the file ended); hashed, then
    copied on where the destination is staged."""
    views = [host_bytes(buf.data_ptr(), buf.numel()) for _, _, buf, _ in group if buf.numel()]

    def read() -> None:
        if os.preadv(fd, views, group[0][0]) != sum(v.nbytes for v in views):
            for start, _, buf, _ in group:
                pread_into(fd, tf.path, start, buf)

    ok = errors.guard(lambda: (read(), True)[1], lambda: False)
    at = iter(views)
    for _, fqn, buf, then in group:
        hashes.whole(tf, fqn, next(at) if buf.numel() else b"")
        if ok:
            then()


_HASH_PIECE = 4 << 20


def _pread_hashed(fd: int, tf, fqn: str, out: torch.Tensor, hashes: _Hashes) -> None:
    start = tf.spans[fqn][0]
    for lo in range(0, out.numel(), _HASH_PIECE):
        piece = out[lo: lo + _HASH_PIECE]
        pread_into(fd, tf.path, start + lo, piece)
        hashes.feed(tf, fqn, piece)
    if not out.numel():
        hashes.feed(tf, fqn, out)
