"""The memory tier's files (format 1) under one host's root ``R`` (roots may differ between hosts).

- ``R/TIER.json``: ``{"format": 1, "job": "<job id>"}``. A root whose ``TIER.json`` names another job
  or format, or cannot be read, holds nothing for this job (:func:`list_steps` warns once per root).
- ``R/step-<N:012d>/rank-<r:06d>.safetensors``: saved rank ``r``'s whole state at step ``N``, a plain
  safetensors file. Each local tensor (a DTensor's local shard) is one contiguous tensor named by its
  fqn; each Python object is a 1-D ``U8`` tensor of its ``torch.save`` bytes (decoded with
  ``weights_only=True``, as pipeload's own format does). ``__metadata__["pipeload.tier"]`` is JSON:
  ``{"format": 1, "job", "step", "rank", "world", "tensors": {fqn: {"shape": global shape, "offsets",
  "dtype", "checksum"}}, "objects": {fqn: checksum}}``; checksums are xxh3-64 of the stored bytes
  (:mod:`pipeload.io.checksum`). ``__metadata__["pipeload.tier.summary"]``, written *first* (so the
  header begins ``{"__metadata__":{"pipeload.tier.summary":"...``), is a small JSON summary of the record:
  ``{"format", "job", "step", "rank", "world", "layout"}``, ``layout`` being the layout digest of the
  file's non-empty chunks and its objects (:func:`pipeload.tier.restoreplan.layout_digest`). A restore
  lists a file from its first bytes alone (:func:`read_summary`) and parses the record only for the files
  it reads, checking then that the summary agrees with it. Files written before the summary existed
  lack the key: they are read through their whole header, as before. Written as ``*.tmp`` and renamed
  into place (fsync'd first unless the root is a tmpfs, where fsync does nothing).
- ``R/step-<N:012d>/COMPLETE.json``: ``{"step", "world", "job", "ranks": [saved ranks whose files this
  host holds], "replicas", "hosts"}``, written only after every rank of the snapshot agreed that all
  files and copies were written. A step directory without it is unfinished: never restored from.

Everything read here is untrusted: :func:`read_rank_header` validates the safetensors header through
the compiled parser (:func:`pipeload.io._fastio.read_header`), then every field of the tier's record,
against the file's own entries and against the step, rank and job the caller expects.
"""

from __future__ import annotations

import json
import os
import re
import threading
import warnings
from dataclasses import dataclass
from typing import Any, Mapping

import torch

from ..errors import CheckpointFormatError, ChecksumError
from ..formats.metadata import NAMES_OF_DTYPES
from ..io._fastio import read_header
from ..io.checksum import checksum
from .restoreplan import layout_digest

FORMAT = 1
TIER_FILE = "TIER.json"
COMPLETE_FILE = "COMPLETE.json"
META_KEY = "pipeload.tier"
SUMMARY_KEY = "pipeload.tier.summary"
SUMMARY_FIELDS = ("format", "job", "step", "rank", "world", "layout")
_SUMMARY_HEAD = b'{"__metadata__":{"' + SUMMARY_KEY.encode() + b'":"'
_SUMMARY_READ = 8192  # bytes of a file's head read for its summary (a job id of 256 characters escaped fits)
MAX_JOB_CHARS = 256
STEP_RE = re.compile(r"^step-(\d{12})$")
RANK_RE = re.compile(r"^rank-(\d{6})\.safetensors$")
_HEX16 = re.compile(r"^[0-9a-f]{16}$")
_MAX_JSON = 1 << 20  # TIER.json / COMPLETE.json larger than this are not ours


def default_job() -> str:
    """The job id a tier records when none is given: ``PIPELOAD_JOB_ID``, else ``TORCHELASTIC_RUN_ID``,
    else ``"default"``."""
    return os.environ.get("PIPELOAD_JOB_ID") or os.environ.get("TORCHELASTIC_RUN_ID") or "default"


def check_job(job: Any) -> str:
    """``job`` if it is a usable job id (a non-empty str of printable characters); ``ValueError`` otherwise."""
    if not isinstance(job, str) or not job or len(job) > MAX_JOB_CHARS or not job.isprintable():
        raise ValueError(f"a tier's job id must be a non-empty printable str of at most {MAX_JOB_CHARS} "
                         f"characters, not {job!r:.80}")
    return job


def step_dir(root: str | os.PathLike, step: int) -> str:
    """The directory of step ``step`` under ``root``."""
    return os.path.join(os.fspath(root), f"step-{int(step):012d}")


def rank_file(root: str | os.PathLike, step: int, rank: int) -> str:
    """The file of saved rank ``rank`` at step ``step`` under ``root``."""
    return os.path.join(step_dir(root, step), f"rank-{int(rank):06d}.safetensors")


# -- writing --------------------------------------------------------------------------------------------


def host_view(t: torch.Tensor) -> tuple[memoryview, Any]:
    """(a contiguous host byte view of ``t``'s values, what keeps it alive); copies only when needed."""
    t = t.detach()
    if t.device.type != "cpu" or not t.is_contiguous() or t.is_conj() or t.is_neg():
        t = t.to("cpu").resolve_conj().resolve_neg().contiguous()
    if t.numel() == 0:
        return memoryview(b""), t
    return memoryview(t.reshape(-1).view(torch.uint8).numpy()), t


def encode(step: int, rank: int, world: int, job: str,
           tensors: Mapping[str, tuple[torch.Tensor, tuple[int, ...], tuple[int, ...]]],
           objects: Mapping[str, bytes]) -> tuple[bytes, list[memoryview], list[Any]]:
    """(the file's first bytes: length word and header; the data views in file order; their owners).

    The file is these bytes followed by the views, back to back: what :func:`write_rank_file` writes
    and what a copy to another host sends. Tensors come first (by fqn), then objects (by fqn).
    """
    _check_ids(step, rank, world, job)
    entries, views, owners, record_t, record_o = [], [], [], {}, {}
    start = 0
    for fqn in sorted(tensors):
        local, shape, offsets = tensors[fqn]
        dtype = NAMES_OF_DTYPES.get(local.dtype)
        if dtype is None:
            raise ValueError(f"{fqn!r}: dtype {local.dtype} has no safetensors name")
        if len(shape) != local.dim() or len(offsets) != local.dim():
            raise ValueError(f"{fqn!r}: global shape {list(shape)} / offsets {list(offsets)} do not match the "
                             f"local tensor's {local.dim()} dims")
        view, owner = host_view(local)
        record_t[fqn] = {"shape": [int(x) for x in shape], "offsets": [int(x) for x in offsets],
                         "dtype": dtype, "checksum": checksum(view)}
        entries.append((fqn, dtype, list(local.shape), view.nbytes))
        views.append(view)
        owners.append(owner)
    for fqn in sorted(objects):
        if fqn in record_t:
            raise ValueError(f"{fqn!r} is both a tensor and an object")
        view = memoryview(objects[fqn])
        record_o[fqn] = checksum(view)
        entries.append((fqn, "U8", [view.nbytes], view.nbytes))
        views.append(view)
        owners.append(objects[fqn])
    record = {"format": FORMAT, "job": job, "step": step, "rank": rank, "world": world,
              "tensors": record_t, "objects": record_o}
    layout = layout_digest(((f, r["dtype"], r["shape"], r["offsets"], n)  # (entries start with the tensors)
                            for (f, _, n, _), r in zip(entries, record_t.values()) if all(n)), record_o)
    summary = {"format": FORMAT, "job": job, "step": step, "rank": rank, "world": world, "layout": layout}
    header: dict[str, Any] = {"__metadata__": {SUMMARY_KEY: json.dumps(summary, separators=(",", ":")),
                                               META_KEY: json.dumps(record, separators=(",", ":"))}}
    for fqn, dtype, shape, n in entries:
        if fqn == "__metadata__":
            raise ValueError("'__metadata__' cannot be a key of a tier file")
        header[fqn] = {"dtype": dtype, "shape": shape, "data_offsets": [start, start + n]}
        start += n
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-(8 + len(raw)) % 8)
    return len(raw).to_bytes(8, "little") + raw, views, owners


def write_rank_file(path: str | os.PathLike, step: int, rank: int, world: int, job: str,
                    tensors: Mapping[str, tuple[torch.Tensor, tuple[int, ...], tuple[int, ...]]],
                    objects: Mapping[str, bytes]) -> int:
    """Write saved rank ``rank``'s state at ``step`` to ``path`` (``*.tmp``, then renamed); its size.

    ``tensors``: {fqn: (local tensor, global shape, offsets)}; ``objects``: {fqn: ``torch.save`` bytes
    that ``torch.load(weights_only=True)`` restores}. On failure the temporary file is removed and the
    error (an ``OSError`` naming the path) propagates; ``path`` itself is untouched.
    """
    head, views, owners = encode(step, rank, world, job, tensors, objects)
    return write_parts(path, [memoryview(head)] + views)


def write_parts(path: str | os.PathLike, parts: list[memoryview]) -> int:
    """Write ``parts`` back to back as ``path`` (``path.tmp``, fsync unless on a tmpfs, rename); its size."""
    path = os.fspath(path)
    tmp = path + ".tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
    total = 0
    try:
        try:
            views = [p.cast("B") if p.format != "B" or p.ndim != 1 else p for p in parts if p.nbytes]
            for lo in range(0, len(views), _IOV_MAX):  # small tensors: one system call per batch, not each
                total += _writev_all(fd, views[lo:lo + _IOV_MAX])
            if not on_tmpfs(path):
                os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    return total


_IOV_MAX = 1024  # views per writev (Linux's IOV_MAX)


def _writev_all(fd: int, views: list[memoryview]) -> int:
    """Write ``views`` back to back (``writev``; after a short write, the rest); the bytes written."""
    total = sum(v.nbytes for v in views)
    done = os.writev(fd, views)
    for v in views:
        if done >= v.nbytes:
            done -= v.nbytes
            continue
        v, done = v[done:], 0
        while v.nbytes:
            v = v[os.write(fd, v):]
    return total


_fs_kinds: dict[str, bool] = {}


def on_tmpfs(path: str) -> bool:
    """Whether ``path`` lies on a memory file system (tmpfs, ramfs), where fsync is not needed."""
    directory = os.path.dirname(os.path.abspath(path))
    got = _fs_kinds.get(directory)
    if got is None:
        best, kind = "", ""
        try:
            with open("/proc/self/mounts") as f:
                for line in f:
                    fields = line.split()
                    if len(fields) >= 3:
                        point = fields[1].replace("\\040", " ")
                        inside = directory == point or directory.startswith(point.rstrip("/") + "/")
                        if inside and len(point) >= len(best):
                            best, kind = point, fields[2]
        except OSError:
            pass
        got = _fs_kinds[directory] = kind in ("tmpfs", "ramfs")
    return got


def write_json(path: str, doc: dict) -> None:
    """``doc`` as ``path``, atomically (temporary name, rename)."""
    write_parts(path, [memoryview(json.dumps(doc, sort_keys=True).encode())])


# -- reading --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TensorEntry:
    """One stored local chunk: ``offsets``/``lengths`` in a global tensor of ``shape``; its bytes are
    ``[start, end)`` of the file (absolute offsets)."""

    dtype: str
    shape: tuple[int, ...]
    offsets: tuple[int, ...]
    lengths: tuple[int, ...]
    checksum: str
    start: int
    end: int


@dataclass(frozen=True)
class ObjectEntry:
    """One stored Python object: ``torch.save`` bytes at ``[start, end)`` of the file."""

    checksum: str
    start: int
    end: int


@dataclass(frozen=True)
class RankHeader:
    """The validated header of one rank file."""

    path: str
    job: str
    step: int
    rank: int
    world: int
    tensors: dict[str, TensorEntry]
    objects: dict[str, ObjectEntry]
    size: int  # bytes of the whole file (the data section ends there)


def read_rank_header(path: str | os.PathLike, *, job: str | None = None, step: int | None = None,
                     rank: int | None = None) -> RankHeader:
    """The validated header of the rank file ``path``.

    The safetensors header is validated by the compiled parser first (sizes, JSON, dtypes, offsets
    covering the file), then the tier's record: format, ids and every chunk's fields, each agreeing
    with the file's own entries, every entry described once. ``step``/``rank`` default to what the
    file's name and its directory's say (a file moved under another name is refused); ``job``, when
    given, must match. Raises :class:`CheckpointFormatError` (:class:`HeaderError` for the safetensors
    layer) naming the path; ``OSError`` from opening it unchanged.
    """
    path = os.fspath(path)
    if step is None or rank is None:
        m_rank = RANK_RE.match(os.path.basename(path))
        m_step = STEP_RE.match(os.path.basename(os.path.dirname(path)))
        rank = rank if rank is not None or not m_rank else int(m_rank.group(1))
        step = step if step is not None or not m_step else int(m_step.group(1))
    return rank_header(path, read_header(path), job=job, step=step, rank=rank)


def rank_header(path: str, entries: dict, *, job: str | None, step: int | None, rank: int | None) -> RankHeader:
    """:func:`read_rank_header`'s checks on the file's safetensors ``entries`` already read (with their
    ``__metadata__``, which is taken out of ``entries``)."""
    meta = entries.pop("__metadata__", None)
    text = meta.get(META_KEY) if isinstance(meta, dict) else None
    if not isinstance(text, str):
        raise CheckpointFormatError(f"{path}: not a pipeload tier file (no {META_KEY!r} in its __metadata__)")
    try:
        doc = json.loads(text, object_pairs_hook=_no_duplicates)
    except ValueError as e:
        raise CheckpointFormatError(f"{path}: the tier record is not valid JSON ({e})") from None
    if not isinstance(doc, dict) or set(doc) != {"format", "job", "step", "rank", "world", "tensors", "objects"}:
        raise CheckpointFormatError(f"{path}: the tier record must be an object with exactly the keys format, "
                                    f"job, step, rank, world, tensors, objects")
    _check_doc(path, doc)
    for name, want in (("job", job), ("step", step), ("rank", rank)):
        if want is not None and doc[name] != want:
            raise CheckpointFormatError(f"{path}: the file records {name} {doc[name]!r:.80}, expected {want!r:.80}")
    tensors, objects = _entries(path, doc, entries)
    size = max((e[3] for e in entries.values()), default=0)
    return RankHeader(path, doc["job"], doc["step"], doc["rank"], doc["world"], tensors, objects, size)


def _check_doc(path: str, doc: dict) -> None:
    """A record's or summary's format and ids (step, rank below world, job), or the error naming ``path``."""
    if not _is_int(doc["format"]) or doc["format"] != FORMAT:
        raise CheckpointFormatError(f"{path}: tier format {doc['format']!r:.40}, this pipeload reads {FORMAT}")
    try:
        _check_ids(doc["step"], doc["rank"], doc["world"], doc["job"])
    except ValueError as e:
        raise CheckpointFormatError(f"{path}: {e}") from None


def read_summary(path: str | os.PathLike, *, job: str, step: int, rank: int) -> tuple[dict, int] | None:
    """(the summary of the rank file ``path``, the file's size) read from its first bytes only, or None
    when the file has no summary (written before it existed: read its whole header instead).

    The summary must be an object with exactly :data:`SUMMARY_FIELDS`, of this format, naming ``job``,
    ``step`` and ``rank`` (a rank below its world), with a layout digest (an int64); otherwise
    :class:`CheckpointFormatError` naming the path. Nothing here proves that the record agrees with it:
    whoever reads the file parses the record and checks (:func:`summary_problem`)."""
    path = os.fspath(path)
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        size = os.fstat(fd).st_size
        head = os.pread(fd, _SUMMARY_READ, 0)
    finally:
        os.close(fd)
    if len(head) < 8 or not head.startswith(_SUMMARY_HEAD, 8):
        return None
    n = int.from_bytes(head[:8], "little")
    try:
        text = head[8: 8 + min(n, len(head) - 8)].decode("utf-8", "replace")
        value, _ = json.JSONDecoder().raw_decode(text, len(_SUMMARY_HEAD) - 1)
        doc = json.loads(value, object_pairs_hook=_no_duplicates)
    except ValueError as e:
        raise CheckpointFormatError(f"{path}: the tier summary does not parse ({e})") from None
    if not isinstance(doc, dict) or set(doc) != set(SUMMARY_FIELDS):
        raise CheckpointFormatError(f"{path}: the tier summary must have exactly the keys {', '.join(SUMMARY_FIELDS)}")
    _check_doc(path, doc)
    if (doc["job"], doc["step"], doc["rank"]) != (job, step, rank):
        raise CheckpointFormatError(f"{path}: the summary records job {doc['job']!r:.80}, step {doc['step']}, "
                                    f"rank {doc['rank']}, expected {job!r:.80}, {step}, {rank}")
    if not _is_int(doc["layout"]) or not -(1 << 63) <= doc["layout"] < (1 << 63):
        raise CheckpointFormatError(f"{path}: the summary's layout must be a 64-bit integer")
    return doc, size


def summary_problem(meta: Any, record: dict, layout: int) -> str | None:
    """Why a file's summary (``meta[SUMMARY_KEY]`` as stored) disagrees with its parsed ``record`` and the
    ``layout`` digest computed from it, or None."""
    text = meta.get(SUMMARY_KEY) if isinstance(meta, dict) else None
    try:
        doc = json.loads(text)
    except (TypeError, ValueError):
        return "its summary does not parse"
    if not isinstance(doc, dict):
        return "its summary is not an object"
    got = {k: record.get(k) for k in SUMMARY_FIELDS if k != "layout"} | {"layout": layout}
    odd = [k for k in SUMMARY_FIELDS if doc.get(k) != got[k]]
    return f"its summary disagrees with its record ({', '.join(odd)})" if odd else None


def _entries(path: str, doc: dict, entries: dict) -> tuple[dict[str, TensorEntry], dict[str, ObjectEntry]]:
    """The record's chunks and objects checked against the file's safetensors entries."""
    rec_t, rec_o = doc["tensors"], doc["objects"]
    if not isinstance(rec_t, dict) or not isinstance(rec_o, dict):
        raise CheckpointFormatError(f"{path}: 'tensors' and 'objects' of the tier record must be objects")
    both = set(rec_t) & set(rec_o)
    described = set(rec_t) | set(rec_o)
    if both or described != set(entries):
        odd = sorted(both or (described ^ set(entries)))[:3]
        raise CheckpointFormatError(f"{path}: the tier record and the file's tensors differ (e.g. {odd})")
    tensors, objects = {}, {}
    for fqn, r in rec_t.items():
        dtype, lengths, start, end = entries[fqn]
        where = f"{path}: tensor {fqn!r}"
        if not isinstance(r, dict) or set(r) != {"shape", "offsets", "dtype", "checksum"}:
            raise CheckpointFormatError(f"{where}: its record must have exactly shape, offsets, dtype, checksum")
        shape, offsets = r["shape"], r["offsets"]
        if (not _int_list(shape) or not _int_list(offsets) or len(shape) != len(lengths)
                or len(offsets) != len(lengths)):
            raise CheckpointFormatError(f"{where}: shape and offsets must be lists of {len(lengths)} "
                                        f"non-negative integers")
        if any(o + n > s for o, n, s in zip(offsets, lengths, shape)):
            raise CheckpointFormatError(f"{where}: the chunk at {offsets} of {list(lengths)} does not fit the "
                                        f"global shape {shape}")
        if r["dtype"] != dtype:
            raise CheckpointFormatError(f"{where}: the record says dtype {r['dtype']!r:.20}, the file {dtype}")
        if not isinstance(r["checksum"], str) or not _HEX16.match(r["checksum"]):
            raise CheckpointFormatError(f"{where}: the checksum must be 16 lowercase hex digits")
        tensors[fqn] = TensorEntry(dtype, tuple(shape), tuple(offsets), tuple(lengths), r["checksum"], start, end)
    for fqn, csum in rec_o.items():
        dtype, shape, start, end = entries[fqn]
        if dtype != "U8" or len(shape) != 1:
            raise CheckpointFormatError(f"{path}: object {fqn!r} must be stored as 1-D U8, not {dtype} {list(shape)}")
        if not isinstance(csum, str) or not _HEX16.match(csum):
            raise CheckpointFormatError(f"{path}: object {fqn!r}: the checksum must be 16 lowercase hex digits")
        objects[fqn] = ObjectEntry(csum, start, end)
    return tensors, objects


def _check_ids(step: Any, rank: Any, world: Any, job: Any) -> None:
    if not (_is_int(step) and _is_int(rank) and _is_int(world)) or step < 0 or world < 1 or not 0 <= rank < world:
        raise ValueError(f"step {step!r:.40}, rank {rank!r:.40}, world {world!r:.40}: need integers with "
                         f"step >= 0 and 0 <= rank < world")
    check_job(job)


def _is_int(x: Any) -> bool:
    return type(x) is int


def _int_list(x: Any) -> bool:
    return isinstance(x, list) and all(_is_int(v) and v >= 0 for v in x)


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict:
    out = dict(pairs)
    if len(out) != len(pairs):
        raise ValueError("duplicate keys")
    return out


def load_json(path: str) -> Any:
    """A small JSON file of ours; ``CheckpointFormatError`` naming it if it is not one, ``FileNotFoundError``
    if it is absent."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
    except OSError as e:
        if isinstance(e, FileNotFoundError):
            raise
        raise CheckpointFormatError(f"{path}: cannot be opened ({e.strerror})") from None
    try:
        with os.fdopen(fd, "rb") as f:
            if not os.path.isfile(path):
                raise CheckpointFormatError(f"{path}: not a regular file")
            raw = f.read(_MAX_JSON + 1)
    except OSError as e:
        raise CheckpointFormatError(f"{path}: cannot be read ({e.strerror})") from None
    if len(raw) > _MAX_JSON:
        raise CheckpointFormatError(f"{path}: larger than {_MAX_JSON} bytes")
    try:
        return json.loads(raw.decode("utf-8"), object_pairs_hook=_no_duplicates)
    except ValueError as e:
        raise CheckpointFormatError(f"{path}: not valid JSON ({e})") from None


# -- the root ------------------------------------------------------------------------------------------


def tier_problem(root: str | os.PathLike, job: str) -> str | None:
    """Why ``root`` holds nothing of ``job`` (it names another job or format, or its ``TIER.json`` is
    damaged), or None: it is ``job``'s, or new (no ``TIER.json`` yet)."""
    path = os.path.join(os.fspath(root), TIER_FILE)
    try:
        doc = load_json(path)
    except FileNotFoundError:
        return None
    except CheckpointFormatError as e:
        return str(e)
    if not isinstance(doc, dict) or set(doc) != {"format", "job"}:
        return f"{path}: not a pipeload tier record (keys format, job expected)"
    if doc["format"] != FORMAT or not _is_int(doc["format"]):
        return f"{path}: tier format {doc['format']!r:.40}, this pipeload writes {FORMAT}"
    if doc["job"] != job:
        return f"{path}: the tier of job {doc['job']!r:.80}, not of this job {job!r:.80}"
    return None


def claim(root: str | os.PathLike, job: str) -> None:
    """Make ``root`` ``job``'s tier (create it and its ``TIER.json``); ``CheckpointFormatError`` naming the
    root when it is another job's or damaged (its files are never touched then)."""
    problem = tier_problem(root, job)
    if problem:
        raise CheckpointFormatError(f"{problem}; remove it or give this job a root of its own")
    root = os.fspath(root)
    os.makedirs(root, exist_ok=True)
    if not os.path.exists(os.path.join(root, TIER_FILE)):
        write_json(os.path.join(root, TIER_FILE), {"format": FORMAT, "job": job})


_warned: set[tuple[str, str]] = set()
_warned_lock = threading.Lock()


def _warn_once(root: str, problem: str) -> None:
    with _warned_lock:
        if (root, problem) in _warned:
            return
        _warned.add((root, problem))
    warnings.warn(f"pipeload tier {root}: treated as holding nothing: {problem}", RuntimeWarning, stacklevel=3)


def list_steps(root: str | os.PathLike, job: str) -> dict[int, dict[str, Any]]:
    """The steps ``root`` holds for ``job``: ``{step: {"complete": bool, "ranks": [saved ranks]}}``.

    ``ranks`` are the rank files present (for a complete step, those ``COMPLETE.json`` lists that are
    present); a complete step also carries ``"world"``, ``"replicas"`` and ``"hosts"`` from
    ``COMPLETE.json``. A root of another job or format, or with a damaged ``TIER.json``, holds nothing
    (warned once per root, naming it); so does a missing root. A step whose ``COMPLETE.json`` is damaged
    or disagrees with its directory is listed as not complete (warned). Nothing is read but directory
    entries and the small JSON files: rank files are validated when read (:func:`read_rank_header`).
    """
    root = os.fspath(root)
    problem = tier_problem(root, job)
    if problem:
        _warn_once(root, problem)
        return {}
    try:
        names = os.listdir(root)
    except FileNotFoundError:
        return {}
    out: dict[int, dict[str, Any]] = {}
    for name in names:
        m = STEP_RE.match(name)
        if not m or not os.path.isdir(os.path.join(root, name)):
            continue
        step = int(m.group(1))
        try:
            present = sorted(int(r.group(1)) for r in map(RANK_RE.match, os.listdir(os.path.join(root, name))) if r)
        except OSError:
            continue
        out[step] = _step_entry(root, step, job, present)
    return dict(sorted(out.items()))


def _step_entry(root: str, step: int, job: str, present: list[int]) -> dict[str, Any]:
    path = os.path.join(step_dir(root, step), COMPLETE_FILE)
    try:
        doc = load_json(path)
    except FileNotFoundError:
        return {"complete": False, "ranks": present}
    except CheckpointFormatError as e:
        _warn_once(root, str(e))
        return {"complete": False, "ranks": present}
    problem = complete_problem(doc, step, job)
    if problem:
        _warn_once(root, f"{path}: {problem}")
        return {"complete": False, "ranks": present}
    have = set(present)
    return {"complete": True, "ranks": [r for r in doc["ranks"] if r in have], "world": doc["world"],
            "replicas": doc["replicas"], "hosts": doc["hosts"]}


def complete_problem(doc: Any, step: int, job: str) -> str | None:
    """What is wrong with a ``COMPLETE.json`` document for ``step`` of ``job``, or None."""
    keys = {"step", "world", "job", "ranks", "replicas", "hosts"}
    if not isinstance(doc, dict) or set(doc) != keys:
        return f"must be an object with exactly the keys {', '.join(sorted(keys))}"
    if doc["job"] != job:
        return f"records job {doc['job']!r:.80}, not {job!r:.80}"
    if not _is_int(doc["step"]) or doc["step"] != step:
        return f"records step {doc['step']!r:.40}, its directory says {step}"
    w = doc["world"]
    if not _is_int(w) or w < 1 or not _is_int(doc["replicas"]) or doc["replicas"] < 1 \
            or not _is_int(doc["hosts"]) or doc["hosts"] < 1:
        return "world, replicas and hosts must be positive integers"
    ranks = doc["ranks"]
    if not _int_list(ranks) or any(r >= w for r in ranks) or ranks != sorted(set(ranks)):
        return f"ranks must be distinct sorted integers below the world {w}"
    return None


def verify_chunk(header: RankHeader, fqn: str, data) -> None:
    """Check one chunk's bytes (``fqn`` of ``header``) against its recorded checksum: :class:`ChecksumError`
    naming the file and key on a mismatch."""
    entry = header.tensors.get(fqn) or header.objects.get(fqn)
    if entry is None:
        raise CheckpointFormatError(f"{header.path}: no chunk {fqn!r}")
    got = checksum(data)
    if got != entry.checksum:
        raise ChecksumError(f"{header.path}: {fqn!r}: checksum {got}, recorded {entry.checksum}")


__all__ = ["FORMAT", "TIER_FILE", "COMPLETE_FILE", "RankHeader", "TensorEntry", "read_summary", "summary_problem", "SUMMARY_KEY", "ObjectEntry", "default_job", "check_job", "step_dir", "rank_file", "write_rank_file", "read_rank_header",
           "list_steps", "claim", "tier_problem", "encode", "write_parts", "complete_problem", "verify_chunk"]
