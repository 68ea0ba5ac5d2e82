"""The two kinds of restore job, as decided by :mod:`.restoreplan`: what a rank reads, sends and receives.

- :class:`SameJob` (the saved layout): rank ``r`` copies saved rank ``r``'s file from its own root,
  or receives it from the file's source; a source reads the files it sends. A file travels as its
  tensors in sorted fqn order (each cut into parts), then its objects' sizes, then their bytes.
- :class:`ReshardJob` (any other layout): the pieces of stored chunks each destination box needs,
  read locally where the rank lists the file, else sent by the file's source, in the global order of
  :func:`.restoreplan.transfer_order`; objects after the tensors, sorted likewise.

``run`` returns (the decoded Python objects as ``(leaf, value)``, this rank's error or None): a failed
read still sends (zeros), so no peer waits for ever; the error is raised at the agreement.
"""

from __future__ import annotations

import os

import numpy as np
import torch

from ..errors import DistributedError, StateDictError
from ..formats.chunks import torch_dtype
from ..io._fastio import SafetensorsFile
from ..io.reader import decode_object
from ..io.checksum import checksum, hasher
from . import restoreplan
from .restoreread import copy_region, pread_into, read_region, validated_table
from ..move.mover import Transfers, batches, host_bytes, staged_into, unpack_into
from ..move.regions import dest_region


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


# -- resharding ------------------------------------------------------------------------------------

def reshard_job(comm, planned, files: dict, want, strict: bool, what: str, job: str) -> "ReshardJob":
    """Gather the step's chunk tables and every rank's requests, then this rank's part of the plan."""
    c, rank = planned.choice, comm.rank
    mine, failed = {}, []
    for f in range(c.world):
        if int(c.holders(f)[0]) == rank:
            try:
                mine[f] = validated_table(files[(c.step, f)], job)
            except Exception as e:  # noqa: BLE001 - raised on every rank below
                failed.append(f"{type(e).__name__}: {e}")
    tables: dict[int, dict] = {}
    gathered = comm.all_gather_object((mine, failed), what)
    problems = {r: "\n".join(p) for r, (_, p) in enumerate(gathered) if p}
    if problems:
        raise DistributedError(f"{what}: chunk tables", problems)
    for part, _ in gathered:
        tables.update(part)
    chunks = restoreplan.chunk_tables({f: t["tensors"] for f, t in tables.items()})
    local = {f for f in range(c.world) if c.holds(rank, f)}
    boxes = [(fqn, b.offsets, b.lengths) for fqn, (_, b, _) in sorted(want.tensors.items())]
    pieces, missing = restoreplan.pieces_for(boxes, chunks, rank, local)
    problems = [f"{p.fqn}: stored as {chunks[p.fqn][0].dtype}, loaded into {want.tensors[p.fqn][2]}"
                for p in pieces if chunks[p.fqn][0].dtype != want.tensors[p.fqn][2]]
    objs = []
    for fqn in sorted(want.objects):
        have = [f for f in sorted(tables) if fqn in tables[f]["objects"]]
        if not have:
            missing.append(fqn)
            continue
        f = min(set(have) & local, default=have[0])
        objs.append((f, fqn, rank, int(tables[f]["objects"][fqn])))
    requests = comm.all_gather_object((pieces, objs, sorted(set(problems)), missing), what)
    _refuse(requests, tables, strict, what)
    return ReshardJob(c, rank, requests, restoreplan.reshard_sources(c), sorted(set(missing)))


def _refuse(requests: list, tables: dict, strict: bool, what: str) -> None:
    """Raise on every rank alike (all hold the same requests): dtype mismatches; with ``strict``, keys
    no stored chunk covers and stored keys no rank loads."""
    failures = {r: "\n".join(p) for r, (_, _, p, _) in enumerate(requests) if p}
    if strict:
        for r, (_, _, _, m) in enumerate(requests):
            if m:
                failures[r] = "\n".join([failures.get(r, ""), *(f"{k}: not in step (or not covered)" for k in m)]).strip()
    if failures:
        raise DistributedError(f"{what}: validation", failures) if len(requests) > 1 else StateDictError(
            f"{what}: cannot load", list(failures.values()))
    if strict:
        stored = {k for t in tables.values() for k in (*t["tensors"], *t["objects"])}
        asked = {p.fqn for ps, _, _, _ in requests for p in ps} | {o[1] for _, os_, _, _ in requests for o in os_}
        if stored - asked:
            raise StateDictError(f"{what}: keys in the tier's step that no rank loads (strict=True)",
                                 sorted(stored - asked))


class ReshardJob:
    """Another layout: pieces of stored chunks, local or sent by each file's source."""

    ring = None  # as SameJob's

    def __init__(self, c, rank: int, requests: list, sources: dict, missing: list):
        self.c, self.rank, self.sources, self.missing = c, rank, sources, missing
        every = [p for ps, _, _, _ in requests for p in ps]
        self.transfers = restoreplan.transfer_order(every, c, sources)
        self.local = [p for p in requests[rank][0] if c.holds(rank, p.f)]
        objs = [o for _, os_, _, _ in requests for o in os_]
        self.obj_moves = sorted(o for o in objs if not c.holds(o[2], o[0]))
        self.obj_local = [o for o in requests[rank][1] if c.holds(rank, o[0])]
        self.reads = ({p.f for p in self.local} | {o[0] for o in self.obj_local}
                      | {p.f for p, s in self.transfers if s == rank}
                      | {o[0] for o in self.obj_moves if sources[o[0]] == rank})

    def run(self, comm, files: dict, want, stats, what: str) -> tuple[list, str | None]:
        x, errors, opened = Transfers(comm, what), _Errors(), _Files(files, self.c.step)
        try:
            for batch, s in self._batches(want, opened):
                receiver = batch[0].receiver
                if s == self.rank:
                    flat = torch.cat([read_piece(opened, p, errors).reshape(-1).view(torch.uint8) for p in batch])
                    x.send(receiver, flat.numel(), _slices(flat))
                elif receiver == self.rank:
                    dsts = [dest_region(want.tensors[p.fqn][1], p.offsets, p.lengths) for p in batch]
                    if len(dsts) == 1:
                        buf, then = staged_into(dsts[0], self.ring)
                    else:
                        buf = x.buffer(sum(d.numel() * d.element_size() for d in dsts))
                        then = unpack_into(buf, dsts, self.ring)
                    x.recv(s, buf, then)
                    stats.shared_shards += len(batch)
            decoded = self._objects(x, opened, want, errors, what)
            x.drain()
            for p in self.local:
                tf, sf = opened.get(p.f)
                dst = dest_region(want.tensors[p.fqn][1], p.offsets, p.lengths)
                errors.guard(lambda: copy_region(sf, tf, p.fqn, p.offsets, p.lengths, dst, self.ring), lambda: None)
                stats.bytes_read += dst.numel() * dst.element_size()
                stats.private_shards += 1
        finally:
            opened.close()
        stats.bytes_read += x.sent
        stats.bytes_received, stats.broadcasts = x.received, x.messages
        stats.objects, stats.missing_keys = len(decoded), list(self.missing)
        return decoded, errors.text(), []  # (its copies were checked before: see reads)

    def _batches(self, want, opened: _Files):
        """This rank's transfers (as sender or receiver), consecutive small pieces between the same two
        ranks packed into one message (:func:`pipeload.move.mover.batches`, alike on both ends)."""
        runs: dict[tuple[int, int], list] = {}
        order = []
        for p, s in self.transfers:
            if self.rank not in (s, p.receiver):
                continue
            key = (p.f, p.receiver)
            if key not in runs:
                runs[key] = []
                order.append((key, s))
            runs[key].append(p)
        for key, s in order:
            pieces = runs[key]
            itemsize = [_itemsize(p, s == self.rank, want, opened) for p in pieces]
            sizes = [(i, int(np.prod(p.lengths, dtype=np.int64)) * k) for i, (p, k) in enumerate(zip(pieces, itemsize))]
            for batch in batches(sizes):
                yield [pieces[i] for i, _ in batch], s

    def _objects(self, x: Transfers, opened: _Files, want, errors: _Errors, what: str) -> list:
        """Objects moved (in the global order, after every tensor piece), then this rank's local ones."""
        got = []
        for f, fqn, receiver, n in self.obj_moves:
            if self.sources[f] == self.rank:
                x.send(receiver, n, _part(opened.files[(self.c.step, f)], opened.fd(f), fqn, errors, _Hashes()))
            elif receiver == self.rank:
                buf = torch.empty(n, dtype=torch.uint8)
                x.recv(self.sources[f], buf)
                got.append((fqn, buf, f"{what}: object {fqn!r} from rank {self.sources[f]}"))
        x.drain()
        for f, fqn, _, n in self.obj_local:
            tf, buf = opened.files[(self.c.step, f)], torch.empty(n, dtype=torch.uint8)
            errors.guard(lambda: pread_into(opened.fd(f), tf.path, tf.spans[fqn][0], buf), lambda: None)
            got.append((fqn, buf, f"{tf.path}: {fqn!r}"))
        out = []
        for fqn, buf, where in got:
            blob = buf.numpy().tobytes()
            out.append((want.objects[fqn], errors.guard(lambda: decode_object(blob, where), lambda: None)))
        return out


def _itemsize(p, sending: bool, want, opened: _Files) -> int:
    """Bytes per element of piece ``p``: the stored dtype's (sender), the destination's (receiver): equal,
    the dtypes were checked on every rank before any transfer."""
    if sending:
        return torch_dtype(opened.files[(opened.step, p.f)].tensors[p.fqn][0]).itemsize
    return want.tensors[p.fqn][1].local.element_size()


def read_piece(opened: _Files, p, errors: _Errors) -> torch.Tensor:
    """A private contiguous copy of piece ``p`` out of its file (zeros, the error recorded, if it fails)."""
    tf, sf = opened.get(p.f)
    dtype = torch_dtype(tf.tensors[p.fqn][0])
    return errors.guard(lambda: read_region(sf, tf, p.fqn, p.offsets, p.lengths),
                        lambda: torch.zeros(tuple(p.lengths), dtype=dtype))
