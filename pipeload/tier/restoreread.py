"""What a restore reads from this rank's own tier root: the listing, the checks, the chunks.

A rank can read only its own host's root. It lists the newest complete steps there (``format.list_steps``)
and reports one entry per rank file from the file's summary alone (its first bytes: job, step, rank,
world, layout digest); a file whose summary names another job, step or rank, or does not parse, is
left out with a warning naming it: a missing copy. Files without a summary are parsed whole. The
record of a file (each chunk's box and checksum) is parsed only when this rank reads the file
(:func:`load_header`), and must agree with the summary it was planned with. Checksums are verified by
the rank that reads a file (:func:`verify`, or as it is read): a file that fails is a missing copy and
the restore's decision is re-taken.
"""

from __future__ import annotations

import json
import os
import warnings
from dataclasses import dataclass

import torch

from ..errors import PipeloadError, ReadError
from ..formats.chunks import torch_dtype
from ..io._fastio import SafetensorsFile, read_header
from ..io.checksum import hasher
from ..io.reader import copy_box, narrow
from . import format as tierformat
from .restoreplan import STEPS_LISTED, layout_digest


@dataclass
class TierFile:
    """One rank file of this rank's root, as its summary (listing) or its header describes it.

    Listed from the summary alone (:func:`.format.read_summary`), ``tensors``/``objects``/``spans`` are
    None until :func:`load_header` parsed the record (only for files this rank reads); ``layout`` is the
    summary's digest. A file without a summary is parsed whole when listed, as before summaries existed."""

    step: int
    rank: int  # saved rank
    world: int  # saved world
    path: str
    nbytes: int
    tensors: dict | None  # fqn -> (dtype name, global shape, offsets, lengths, checksum)
    objects: dict | None  # fqn -> (bytes, checksum)
    spans: dict | None  # fqn (tensor or object) -> (start, end): absolute byte offsets in the file
    layout: int | None = None  # the layout digest (the summary's, or computed from the record)
    summary_problem: str | None = None  # (parsed by load_header: how its summary disagrees with the record)
    validated: bool = False  # its record was validated field by field as it was parsed (load_header with a job)

    @property
    def digest(self) -> int:
        """The layout digest of what this file holds (empty chunks aside, as a state dict's boxes are)."""
        if self.layout is None:
            self.layout = _digest(self.tensors, self.objects)
        return self.layout

    @property
    def loaded(self) -> bool:
        return self.tensors is not None

    def entry(self) -> tuple[int, int, int, int, int]:
        return (self.step, self.rank, self.world, self.digest, self.nbytes)


def _digest(tensors: dict, objects: dict) -> int:
    return layout_digest(((f, d, s, o, n) for f, (d, s, o, n, _) in tensors.items() if all(n)), objects)


def list_root(root: str, job: str) -> dict[tuple[int, int], TierFile]:
    """Every usable rank file of the newest :data:`STEPS_LISTED` complete steps under ``root``: from each
    file's summary (its first bytes), or its whole header when it has none."""
    out: dict[tuple[int, int], TierFile] = {}
    try:
        steps = tierformat.list_steps(root, job)  # (another job's or a damaged root: empty, warned there)
    except (PipeloadError, OSError) as e:
        warnings.warn(f"pipeload: memory tier {root}: {e}; treated as holding nothing", RuntimeWarning, stacklevel=2)
        return out
    complete = sorted((s for s, v in steps.items() if v.get("complete")), reverse=True)[:STEPS_LISTED]
    for step in complete:
        for r in steps[step]["ranks"]:
            path = os.fspath(tierformat.rank_file(root, step, r))
            tf = _list_one(path, job, step, r)
            if tf is not None:
                out[(step, r)] = tf
    return out


def _list_one(path: str, job: str, step: int, rank: int) -> TierFile | None:
    try:
        got = tierformat.read_summary(path, job=job, step=step, rank=rank)
    except Exception as e:  # noqa: BLE001 - a damaged copy is a missing copy
        _unusable(path, e)
        return None
    if got is None:
        return _open(path, job, step, rank)
    doc, size = got
    return TierFile(step, rank, doc["world"], path, size, None, None, None, doc["layout"])


def _unusable(path: str, e: Exception) -> None:
    warnings.warn(f"pipeload: memory tier file {path} is not usable ({type(e).__name__}: {e}); treated as "
                  f"missing", RuntimeWarning, stacklevel=3)


def load_header(tf: TierFile, job: str | None = None) -> str | None:
    """Parse ``tf``'s record (a file listed from its summary) into it: None, or why the copy is unusable
    (its header does not parse, or disagrees with the summary it was listed and planned with). With
    ``job`` (a resharding restore, which offers the file's chunks to the plan), the record is validated
    field by field as it is parsed (:func:`.format.rank_header`): one parse of the header, before its
    chunks are offered to the plan."""
    if tf.loaded and (job is None or tf.validated):
        return None
    if job is not None:
        return _load_validated(tf, job)
    full = _open(tf.path, None, tf.step, tf.rank, warn=False)
    if isinstance(full, str):
        return full
    if full.summary_problem:
        return f"{tf.path}: {full.summary_problem}"
    if full.world != tf.world or (full.spans and full.nbytes != tf.nbytes):
        return f"{tf.path}: its header disagrees with its summary (world or size)"
    if full.digest != tf.layout:
        return f"{tf.path}: its summary disagrees with its record (layout)"
    tf.tensors, tf.objects, tf.spans = full.tensors, full.objects, full.spans
    return None


def _load_validated(tf: TierFile, job: str) -> str | None:
    """:func:`load_header` of a file a resharding restore offers: the full validation, once."""
    try:
        entries = read_header(tf.path)
        meta = entries.get("__metadata__") or {}
        h = tierformat.rank_header(tf.path, entries, job=job, step=tf.step, rank=tf.rank)
    except Exception as e:  # noqa: BLE001 - a damaged copy is a missing copy
        return f"{tf.path}: {type(e).__name__}: {e}"
    tensors = {f: (t.dtype, t.shape, t.offsets, t.lengths, t.checksum) for f, t in h.tensors.items()}
    objects = {f: (o.end - o.start, o.checksum) for f, o in h.objects.items()}
    spans = {f: (t.start, t.end) for f, t in h.tensors.items()} | {f: (o.start, o.end) for f, o in h.objects.items()}
    if h.world != tf.world or (spans and h.size != tf.nbytes):
        return f"{tf.path}: its header disagrees with its summary (world or size)"
    layout = _digest(tensors, objects)
    if tf.layout is not None and layout != tf.layout:
        return f"{tf.path}: its summary disagrees with its record (layout)"
    if tierformat.SUMMARY_KEY in meta:
        record = {"format": tierformat.FORMAT, "job": h.job, "step": h.step, "rank": h.rank, "world": h.world}
        why = tierformat.summary_problem(meta, record, layout)
        if why:
            return f"{tf.path}: {why}"
    elif not tf.loaded:  # listed from a summary that is gone now
        return f"{tf.path}: its summary is gone"
    tf.tensors, tf.objects, tf.spans, tf.validated = tensors, objects, spans, True
    return None


def _open(path: str, job: str | None, step: int, rank: int, warn: bool = True):
    """The file's header as the listing needs it, or None (warned) when it is not this job's step and
    rank's or does not parse (with ``warn=False``: why, a str). The safetensors layer is validated by the
    compiled parser; the tier record is only parsed here (each chunk's fields against the file's entries),
    not checked field by field as :func:`.format.read_rank_header` does: a copy is used only when its
    layout digest equals the one it is used with (:func:`.restoreplan.same_layout`) — the receiving rank's
    own boxes, or the lowest holder's — its checksums pass and, for a file a resharding restore offers,
    its record passes :func:`load_header`'s full validation."""
    try:
        entries = read_header(path)
        meta = entries.pop("__metadata__") or {}
        doc = json.loads(meta[tierformat.META_KEY])
        if (doc["format"], doc["step"], doc["rank"]) != (tierformat.FORMAT, step, rank) or (
                job is not None and doc["job"] != job):
            raise ValueError(f"records format {doc['format']!r:.20}, job {doc['job']!r:.80}, step "
                             f"{doc['step']!r:.20}, rank {doc['rank']!r:.20}")
        if set(doc["tensors"]) | set(doc["objects"]) != set(entries):
            raise ValueError("the tier record and the file's tensors differ")
        tensors, objects, spans = {}, {}, {}
        for fqn, t in doc["tensors"].items():
            dtype, lengths, start, end = entries[fqn]
            if t["dtype"] != dtype or len(t["shape"]) != len(lengths) or len(t["offsets"]) != len(lengths):
                raise ValueError(f"tensor {fqn!r}: its record disagrees with the file")
            tensors[fqn] = (dtype, tuple(t["shape"]), tuple(t["offsets"]), tuple(lengths), str(t["checksum"]))
            spans[fqn] = (start, end)
        for fqn, c in doc["objects"].items():
            spans[fqn] = entries[fqn][2:]
            objects[fqn] = (spans[fqn][1] - spans[fqn][0], str(c))
        size = max((e[3] for e in entries.values()), default=0)
        tf = TierFile(step, rank, int(doc["world"]), path, int(size), tensors, objects, spans)
        if tierformat.SUMMARY_KEY in meta:
            tf.summary_problem = tierformat.summary_problem(meta, doc, tf.digest)
        else:
            tf.summary_problem = None if job is not None else "its summary is gone"
        return tf
    except Exception as e:  # noqa: BLE001 - a damaged copy is a missing copy
        if not warn:
            return f"{path}: {type(e).__name__}: {e}"
        _unusable(path, e)
        return None


BLOCK = 16 << 20  # bytes read per call when checking a file


def verify(tf: TierFile) -> str | None:
    """Check every chunk's and object's xxh3 against the header: None, or why this copy is unusable.

    The file is read front to back with ``pread`` into one reused buffer (a file cut meanwhile is a
    short read, never a SIGBUS), each block feeding the hashes of the chunks it covers."""
    want = {f: t[4] for f, t in tf.tensors.items()} | {f: o[1] for f, o in tf.objects.items()}
    items = sorted((tf.spans[f][0], tf.spans[f][1], f) for f in want)
    if not items:
        return None
    buf = bytearray(BLOCK)
    view = memoryview(buf)
    try:
        fd = os.open(tf.path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError as e:
        return f"{tf.path}: {e.strerror or e}"
    try:
        if os.fstat(fd).st_size != tf.nbytes:
            return f"{tf.path}: changed size since it was listed"
        j, hashers = 0, {}
        lo, end = items[0][0], max(e for _, e, _ in items)
        while lo < end:
            n = os.preadv(fd, [view[: min(BLOCK, end - lo)]], lo)
            if n <= 0:
                return f"{tf.path}: file ended at byte {lo}"
            while j < len(items) and items[j][0] < lo + n:
                start, stop, fqn = items[j]
                h = hashers.setdefault(fqn, hasher())
                h.update(view[max(start, lo) - lo: min(stop, lo + n) - lo])
                if stop > lo + n:
                    break  # (continues in the next block)
                if h.hexdigest() != want[fqn]:
                    return f"{tf.path}: {fqn!r}: checksum {h.hexdigest()} != {want[fqn]} recorded"
                j += 1
            lo += n
        for start, stop, fqn in items[j:]:  # empty chunks at the end
            if start == stop and hasher().hexdigest() != want[fqn]:
                return f"{tf.path}: {fqn!r}: checksum of an empty chunk != {want[fqn]} recorded"
    except OSError as e:
        return f"{tf.path}: {e.strerror or e}"
    finally:
        os.close(fd)
    return None


def pread_into(fd: int, path: str, start: int, out: torch.Tensor) -> None:
    """Bytes [start, start + out.numel()) of the file into the flat uint8 tensor ``out`` (short: ReadError)."""
    view = memoryview(out.numpy())
    done, n = 0, out.numel()
    while done < n:
        got = os.preadv(fd, [view[done:]], start + done)
        if got <= 0:
            raise ReadError(f"{path}: file ended at byte {start + done} while a chunk was read")
        done += got


def chunk_view(sf: SafetensorsFile, tf: TierFile, fqn: str) -> torch.Tensor:
    """The stored chunk of ``fqn`` as a tensor over the file's mapping (no copy; copy it guarded)."""
    dtype, _, _, lengths, _ = tf.tensors[fqn]
    buf = sf.buffer(fqn)
    if buf.nbytes == 0:
        return torch.empty(lengths, dtype=torch_dtype(dtype))
    return torch.frombuffer(buf, dtype=torch_dtype(dtype)).view(lengths)


def copy_region(sf: SafetensorsFile, tf: TierFile, fqn: str, offsets, lengths, dst: torch.Tensor,
                ring=None) -> None:
    """The box (global ``offsets``/``lengths``) of the stored chunk into ``dst`` (of the box's shape):
    one compiled call (``pread`` for a contiguous box) for a host destination, else through torch."""
    dtype, _, coff, clen, _ = tf.tensors[fqn]
    src_off = tuple(o - c for o, c in zip(offsets, coff))
    if dst.device.type == "cpu" and not dst.is_conj() and not dst.is_neg() and dst.numel():
        zero = (0,) * dst.dim()
        sf.copy_box(fqn, dtype, clen, src_off, tuple(lengths), dst.data_ptr(), zero, dst.stride(), tuple(dst.shape))
        return
    copy_box(dst, narrow(chunk_view(sf, tf, fqn), src_off, tuple(lengths)), tf.path, ring)


def read_region(sf: SafetensorsFile, tf: TierFile, fqn: str, offsets, lengths) -> torch.Tensor:
    """A private contiguous copy of the box (global ``offsets``/``lengths``) of the stored chunk."""
    out = torch.empty(tuple(lengths), dtype=torch_dtype(tf.tensors[fqn][0]))
    copy_region(sf, tf, fqn, offsets, lengths, out)
    return out


