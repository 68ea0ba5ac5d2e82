"""A restore into another layout (resharding), planned and moved by :mod:`pipeload.move`.

The tier files are the source side of the live transfer's planner (:mod:`pipeload.move.plan`): every
rank offers, as *source boxes*, the stored chunks of the chosen step's files its own root lists (the
copies the decision kept), and
asks, as *destination boxes*, for the boxes of its state dict. The names' owners (a hash of the name
modulo the group) match them in two all-to-alls of int64 words: every destination box is cut into one
piece per stored chunk it meets, each piece sent by one rank that lists a file holding that chunk —
the rank itself when it does (a local copy), else the least loaded of its holders (the same balanced
greedy as a live transfer's, over every copy of every file holding the chunk: a chunk replicated
across saved ranks and a file with two copies on two hosts are both "several holders"). The data
moves through :func:`pipeload.move.run.run`: the live transfer's messages, order, packing and
receiving; only the source differs (:class:`TierSource`: the guarded compiled copy of a region out of
the file, or ``pread`` of a contiguous run as it is sent, instead of a view of a tensor).

**Python objects** travel as one more kind of box. An object ``fqn`` is a name of its own (a hash of
``"\\0object\\0" + fqn``) whose "global tensor" is a ``uint8`` table of ``(saved world, 2**40)``: the file
of saved rank ``f`` holds the row ``(f, 0)`` of lengths ``(1, its bytes)``. A needer does not know the
size: it asks with :data:`pipeload.move.plan.F_ROW`, and the owner gives it the row of its own saved
rank when the saved world had its rank, else the lowest saved rank's that holds the object, and the
answer's lengths carry the size (no second round, no per-object gather). So a rank keeps its
own saved rank's step counter, RNG state or data loader state when the world is unchanged, and every
rank beyond the saved world takes the lowest saved rank's.

**Validation before mutation**, on every rank alike from the owners' answers (one agreement): a
destination whose name no file holds or whose region the chunks do not cover is a missing key
(``strict``: an error; else listed in ``LoadStats.missing_keys``); another global shape or dtype, or
files disagreeing among themselves, is an error; with ``strict`` a stored name no rank asks for is an
error (its lowest holder hears of it). Every record a rank offers was validated field by field as it was
parsed, before the plan; the files it will read (its local copies and its sends) then have every checksum
checked before any transfer; a file that fails either is a failed copy and the restore's decision is
re-taken without it.

Cost per rank: its own boxes (the chunks of the files it lists, its destination boxes) out, its owned
names' records in (``O(S + R·S)`` words: its share of the names, each with its holders and needers) and
one answer row per piece it sends or receives — never every rank's requests or every file's chunk
table. One extra gather of one word per rank (the widest tensor rank) sizes the records.
"""

from __future__ import annotations

import numpy as np
import torch

from ..errors import StateDictError
from ..formats.chunks import torch_dtype
from ..io.reader import decode_object
from ..move import plan as moveplan
from ..move.mover import Transfers
from ..move.plan import F_NEEDED, F_ROW, Box, Op
from ..move.run import CODES, DTYPES, Progress, run as move_run, schedule
from ..plan.exchange import hash64
from .restoreplan import E_RANK
from .restoreread import copy_region, pread_into
from .restorerun import _Errors, _Files

OBJECT_WIDTH = 1 << 40  # an object's row: (saved rank, 0) of lengths (1, its bytes) in a (world, this) table
U8 = CODES[torch.uint8]
NO_CODE = -1  # a stored dtype no box code names: never equal to a destination's (E_DTYPE)
MISSING = (moveplan.E_MISSING, moveplan.E_UNCOVERED)


def tensor_name(fqn: str) -> int:
    return hash64(fqn.encode())


def object_name(fqn: str) -> int:
    return hash64(b"\0object\0" + fqn.encode())


def source_boxes(files: dict, step: int, world: int, strict: bool, usable=None) -> tuple[list[Box], list]:
    """(this rank's source boxes, per box its (saved rank, fqn, is an object)): every non-empty stored
    chunk and every object of the files of ``step`` it lists (their records parsed), sorted; only the
    saved ranks in ``usable`` when given (the copies the decision kept: a copy of another layout is not
    one of them)."""
    boxes, held = [], []
    flags = F_NEEDED if strict else 0
    for f in sorted(f for s, f in files if s == step and (usable is None or f in usable)):
        tf = files[(step, f)]
        for fqn, (dtype, shape, off, ln, _) in sorted(tf.tensors.items()):
            if all(ln):
                boxes.append(Box(tensor_name(fqn), CODES.get(torch_dtype(dtype), NO_CODE), shape, off, ln, flags))
                held.append((f, fqn, False))
        for fqn, (n, _) in sorted(tf.objects.items()):
            boxes.append(Box(object_name(fqn), U8, (world, OBJECT_WIDTH), (f, 0), (1, int(n)), flags))
            held.append((f, fqn, True))
    return boxes, held


class Dests:
    """This rank's destination boxes (tensors by fqn, then objects by fqn) and their views; an object's
    box and view are set from its answer (:meth:`fill_objects`)."""

    def __init__(self, want, world: int):
        self.names, self.boxes, self.views, self.problems = [], [], [], []
        for fqn, (_, box, _) in sorted(want.tensors.items()):
            code = CODES.get(box.local.dtype)
            if code is None:
                self.problems.append(f"{fqn}: dtype {box.local.dtype} cannot be restored into another layout")
                continue
            self.names.append(fqn)
            self.boxes.append(Box(tensor_name(fqn), code, tuple(box.global_shape), tuple(box.offsets),
                                  tuple(box.lengths)))
            self.views.append(box.local)
        self.tensors = len(self.names)
        for fqn in sorted(want.objects):
            self.names.append(fqn)
            self.boxes.append(Box(object_name(fqn), U8, (world, OBJECT_WIDTH), (0, 0), (0, 0), F_ROW))
            self.views.append(None)

    def fill_objects(self, ops: list[Op]) -> None:
        """Each object's box and buffer from the one piece that brings it (its row: the size)."""
        for op in ops:
            if op.dst >= self.tensors:
                self.boxes[op.dst] = self.boxes[op.dst]._replace(offsets=op.offsets, lengths=op.lengths)
                self.views[op.dst] = torch.empty(op.lengths, dtype=torch.uint8)


def ndim(boxes: list[Box]) -> int:
    return max((len(b.shape) for b in boxes), default=0)


def plan(comm, src: list[Box], dst: Dests, what: str) -> moveplan.Answers:
    """The owners' planning: the widest tensor rank (one word per rank), the records to the names'
    owners, the answers back (two all-to-alls); every rank's answers in the one global order."""
    own = max(ndim(src), ndim(dst.boxes))
    nd = int(comm.gather_rows(np.array([own], dtype=np.int64), what, "all-gather of tensor ranks").max())
    rec = moveplan.widen(moveplan.records(src, dst.boxes, own), own, nd)
    counts, words = moveplan.by_owner(rec, comm.size)
    got, received = comm.all_to_all(counts, words, what)
    acounts, awords = moveplan.answer(got, received, nd, comm.size)  # (no relays: sides None)
    _, mine = comm.all_to_all(acounts, awords, what)
    return moveplan.decode(mine, nd, comm.rank)


def problems(answers: moveplan.Answers, dst: Dests, held: list, strict: bool) -> tuple[list[str], list[str]]:
    """(this rank's problems, its missing keys) from the owners' answers."""
    out, missing = list(dst.problems), []
    for i, code in answers.problems:
        if i < 0:
            f, fqn, _ = held[-1 - i]
            out.append(f"{fqn}: in the tier's step (saved rank {f}'s file) but no rank loads it (strict=True)")
        elif code in MISSING:
            missing.append(dst.names[i])
            if strict:
                out.append(f"{dst.names[i]}: not in step (or not covered)")
        else:
            out.append(f"{dst.names[i]}: {moveplan.PROBLEMS[code]}")
    return out, sorted(set(missing))


def refuse(comm, lines: list[str], what: str) -> None:
    """Raise on every rank alike when any rank found a problem (before anything is written)."""
    text = "\n".join(lines) if lines else None
    if comm.size == 1:
        if text:
            raise StateDictError(f"{what}: cannot load", lines)
        return
    comm.agree(f"{what}: validation", text)  # (a DistributedError naming every rank's problems)


def reshard_job(comm, planned, files: dict, want, strict: bool, what: str) -> "ReshardJob":
    """Plan this rank's part of a resharding restore (collectives every rank takes alike)."""
    c = planned.choice
    usable = set(c.entries[c.entries[:, 0] == comm.rank, 1 + E_RANK].tolist())  # (the copies kept, of this rank)
    src, held = source_boxes(files, c.step, c.world, strict, usable)
    dst = Dests(want, c.world)
    answers = plan(comm, src, dst, what)
    lines, missing = problems(answers, dst, held, strict)
    refuse(comm, lines, what)
    return ReshardJob(c, answers, held, dst, missing)


class ReshardJob:
    """Another layout: this rank's sends, receives and local copies, as the owners answered."""

    ring = None  # as SameJob's

    def __init__(self, c, answers: moveplan.Answers, held: list, dst: Dests, missing: list):
        self.c, self.answers, self.held, self.dst, self.missing = c, answers, held, dst, missing
        self.reads = {held[op.src][0] for op in answers.sends + answers.local}
        dst.fill_objects(answers.recvs + answers.local)

    def run(self, comm, files: dict, want, stats, what: str) -> tuple[list, str | None, list]:
        x, errors, opened = Transfers(comm, what), _Errors(), _Files(files, self.c.step)
        source = TierSource(opened, self.held, errors, self.ring)
        a = self.answers
        try:
            sched = schedule(a)
            copied = move_run(x, sched, source, self.dst, Progress(sched, len(self.dst.boxes)), torch.device("cpu"),
                              self.ring)
        finally:
            opened.close()
        errors.items += x.errors
        stats.bytes_read += x.sent + copied
        stats.bytes_received, stats.broadcasts = x.received, x.messages
        stats.shared_shards, stats.private_shards = len(a.recvs), len(a.local)
        decoded = self._objects(want, errors, what)
        stats.objects, stats.missing_keys = len(decoded), list(self.missing)
        return decoded, errors.text(), []  # (its copies were checked before: see reads)

    def _objects(self, want, errors, what: str) -> list:
        """The objects received or copied, decoded (a failure recorded, the value None)."""
        peer = {op.dst: op.peer for op in self.answers.recvs}
        out = []
        for i in range(self.dst.tensors, len(self.dst.names)):
            fqn, buf = self.dst.names[i], self.dst.views[i]
            if buf is None and fqn in self.missing:
                continue  # (not strict)
            where = f"{what}: object {fqn!r}" + (f" from rank {peer[i]}" if i in peer else "")
            blob = b"" if buf is None else buf.numpy().tobytes()  # (no bytes stored: decoding says so)
            out.append((want.objects[fqn], errors.guard(lambda: decode_object(blob, where), lambda: None)))
        return out


class TierSource:
    """The stored chunks of this rank's tier files as a :class:`pipeload.move.run.Source`: a region is
    copied out of the file's mapping by the compiled guarded copy (a SIGBUS is a ReadError); a lone
    piece that is one run of the file is read with ``pread`` a part at a time as it is sent. A read
    that fails sends zeros and is reported at the agreement."""

    def __init__(self, opened, held: list, errors, ring=None):
        self.opened, self.held, self.errors, self.ring = opened, held, errors, ring

    def bases(self) -> None:
        return None  # (regions of files: packed and copied here)

    def base_of(self, op: Op):
        raise NotImplementedError

    def sender(self, x: Transfers, msg: list[Op], wire: torch.device):
        if len(msg) != 1 or wire.type != "cpu":
            return None
        op = msg[0]
        f, fqn, _ = self.held[op.src]
        tf = self.opened.files[(self.opened.step, f)]
        start = _run_start(tf, fqn, op)
        if start is None:
            return None
        fd = self.opened.fd(f)

        def part(lo: int, hi: int) -> torch.Tensor:
            out = x.buffer(hi - lo)
            return self.errors.guard(lambda: (pread_into(fd, tf.path, start + lo, out), out)[1],
                                     lambda: out.zero_())

        return part

    def pack(self, msg: list[Op], starts: list[int], buf: torch.Tensor) -> None:
        for op, at in zip(msg, starts):
            n = DTYPES[op.dtype].itemsize * int(np.prod(op.lengths, dtype=np.int64))
            out = buf[at: at + n].view(DTYPES[op.dtype]).view(op.lengths)
            self.errors.guard(lambda: self._read(op, out), lambda: out.zero_())

    def copy(self, op: Op, out: torch.Tensor) -> None:
        self.errors.guard(lambda: self._read(op, out), lambda: None)

    def _read(self, op: Op, out: torch.Tensor) -> None:
        f, fqn, obj = self.held[op.src]
        tf, sf = self.opened.get(f)
        if obj:
            pread_into(self.opened.fd(f), tf.path, tf.spans[fqn][0], out.reshape(-1))
        else:
            copy_region(sf, tf, fqn, op.offsets, op.lengths, out, self.ring)


def _run_start(tf, fqn: str, op: Op) -> int | None:
    """The file offset of piece ``op`` of ``fqn`` when its bytes are one run of the file (row-major: every
    dimension after the first one it cuts is whole, every one before it is 1), else None."""
    start = tf.spans[fqn][0]
    if fqn in tf.objects:
        return start
    dtype, _, coff, clen, _ = tf.tensors[fqn]
    local = [o - c for o, c in zip(op.offsets, coff)]
    cut = max((d for d in range(len(clen)) if op.lengths[d] != clen[d]), default=0)
    if any(op.lengths[d] != 1 for d in range(cut)):
        return None
    linear = 0
    for d in range(len(clen)):
        linear = linear * clen[d] + local[d]
    return start + linear * torch_dtype(dtype).itemsize


__all__ = ["reshard_job", "ReshardJob", "TierSource", "source_boxes", "Dests"]
