"""Checkpoint metadata: the dataclasses of ``.metadata`` and their JSON (de)serialisation.

This module holds data only: no file I/O policy, no torch.distributed. The on-disk layout is
documented in ``docs/FORMAT.md``; the JSON is validated field by field on load because a checkpoint is
untrusted input (never pickle).
"""

from __future__ import annotations

import json
import os
import re
import stat
from dataclasses import dataclass, field
from typing import Any


from ..errors import CheckpointFormatError
from .chunkindex import open_index
from .chunks import (_DTYPE_NAMES, NAMES_OF_DTYPES, dtype_name, torch_dtype, dtype_itemsize, storable_dtype,
                     ChunkMeta, TensorMeta, Boxes, tiling_problem, _any_overlap, chunk_key)  # noqa: F401 - re-exported

FORMAT_NAME = "pipeload"
FORMAT_VERSION = 2  # what save() writes; 1 and 2 are read
METADATA_FILE = ".metadata"
OBJECT_ENCODING = "torch.save/weights_only"

@dataclass(frozen=True)
class ObjectMeta:
    """A non-tensor value, stored as a U8 tensor holding its safe serialisation."""

    file: str
    key: str
    nbytes: int
    checksum: str
    encoding: str = OBJECT_ENCODING


@dataclass
class Metadata:
    """The whole ``.metadata``: every fqn of the checkpoint and where its bytes live.

    ``tensors`` is a dict for format 1 (every chunk parsed from JSON) and a lazy mapping over the mapped
    chunk index for format 2 (:mod:`pipeload.formats.chunkindex`); planning goes through :meth:`tensor_columns`,
    :meth:`chunks_for` and :meth:`key_arrays`, which never decode more than the chunks a box needs.
    """

    save_id: str
    world_size: int
    tensors: dict[str, TensorMeta] = field(default_factory=dict)
    objects: dict[str, ObjectMeta] = field(default_factory=dict)
    version: int = 1
    index_file: str | None = None  # format 2: the chunk index's file name
    data_files: list[str] | None = None  # format 2: the data files, as listed in .metadata
    _key_index: dict[str, int] | None = field(default=None, init=False, repr=False, compare=False)

    @property
    def indexed(self) -> bool:
        return self.index_file is not None

    @property
    def files(self) -> list[str]:
        if self.indexed:
            names = set(self.data_files or ())
        else:
            names = {c.file for t in self.tensors.values() for c in t.chunks}
        names.update(o.file for o in self.objects.values())
        return sorted(names)

    def key_index(self) -> dict[str, int]:
        """Position of every checkpoint key (tensors and objects) in sorted order: the compact name used in
        the exchange. Computed once per Metadata (a load builds its Metadata and never changes it)."""
        if self._key_index is None:
            names = sorted([*self.tensors, *self.objects])
            self._key_index = dict(zip(names, range(len(names))))
        return self._key_index

    def tensor_columns(self) -> tuple | None:
        """Format 2: the tensor table as columns, for a loop over many keys: (row of each tensor key, dtype
        names, ranks, shapes as a T x k int64 array, zero-padded). None for format 1: use :attr:`tensors`."""
        if not self.indexed:
            return None
        t = self.tensors
        return t.pos, t.dtypes, t.ndims, t.index.a["shape"]

    def chunks_for(self, fqn: str, offsets: tuple[int, ...], lengths: tuple[int, ...]):
        """The stored chunks a box of tensor ``fqn`` may need (format 2: exactly those that overlap it)."""
        if self.indexed:
            t = self.tensors
            i = t.pos[fqn]
            return t.index.overlapping(i, fqn, t.ndims[i], t.files, offsets, lengths)
        return self.tensors[fqn].chunks

    def exact_chunks(self, fqns: list[str], offsets, lengths) -> list:
        """Per box of tensor ``fqns[j]``: ``(file, checksum)`` of the one stored chunk that is exactly that box
        (format 2, looked up for all boxes at once), or None: resolve it with :meth:`chunks_for`.

        ``offsets``/``lengths``: a tuple per box, or the boxes as n x k int64 arrays, zero-padded."""
        if not self.indexed or not fqns:
            return [None] * len(fqns)
        import numpy as np

        pos = self.tensors.pos
        return self.exact_rows(np.fromiter((pos[f] for f in fqns), dtype=np.int64, count=len(fqns)), offsets,
                               lengths)

    def exact_rows(self, rows, offsets, lengths, inside: bool = False) -> list:
        """:meth:`exact_chunks` of boxes given by their tensors' rows in the format-2 table (an int64 array).
        ``inside``: a box that lies inside its tensor's one whole chunk without being all of it (a Hugging
        Face tensor loaded into tensor parallelism) gets ``(file, checksum, chunk shape)``: its one read is
        that box of the chunk, built when the read runs."""
        import numpy as np

        t = self.tensors
        offsets, lengths = _at_width(offsets, t.index.width), _at_width(lengths, t.index.width)
        found = t.index.exact(rows, offsets, lengths)
        hit = found >= 0
        r = found[hit]
        files = t.index.a["chunk_file"][r].tolist()
        names = t.files
        out: list = [None] * len(rows)
        sums = self._checksums(r)
        for k, (j, f) in enumerate(zip(np.flatnonzero(hit).tolist(), files)):
            out[j] = (names[f], sums[k])
        if inside and not hit.all() and len(rows):
            self._inside_rows(rows, offsets, lengths, ~hit, out)
        return out

    def _checksums(self, chunks) -> list[str]:
        """The recorded checksums of chunk rows, 16 hex digits each ("" for a layout that records none)."""
        if not self.tensors.index.checksums:
            return [""] * len(chunks)
        # every checksum as 16 hex digits in one conversion (big-endian bytes -> one hex string)
        sums = self.tensors.index.a["chunk_checksum"][chunks].astype(">u8").tobytes().hex()
        return [sums[16 * k : 16 * k + 16] for k in range(len(chunks))]

    def _inside_rows(self, rows, offsets, lengths, todo, out: list) -> None:
        """Fill ``out[j]`` for the boxes ``todo`` selects that lie inside their tensor's one whole chunk."""
        import numpy as np

        t = self.tensors
        idx = t.index
        whole = np.asarray(idx.whole_rows(), dtype=np.int64)[rows]
        nd = np.asarray(t.ndims, dtype=np.int64)[rows]
        shape = idx.a["shape"][rows]
        width = shape.shape[1] if shape.ndim == 2 else 0
        real = np.arange(width)[None, :] < nd[:, None]
        inside = todo & (whole >= 0) & (nd > 0) & np.all(
            ~real | ((lengths > 0) & (offsets >= 0) & (offsets + lengths <= shape)), axis=1)
        pick = np.flatnonzero(inside)
        if not len(pick):
            return
        chunks = whole[pick]
        files = idx.a["chunk_file"][chunks].tolist()
        sums = self._checksums(chunks)
        shapes: dict[int, tuple] = {}
        for k, (j, f, row) in enumerate(zip(pick.tolist(), files, rows[pick].tolist())):
            sh = shapes.get(row)
            if sh is None:
                sh = shapes[row] = tuple(shape[j, : nd[j]].tolist())
            out[j] = (t.files[f], sums[k], sh)

    def key_arrays(self, names: list[str]):
        """(tensor rank, item size) per key of ``names`` as int64 arrays (0 for objects)."""
        import numpy as np

        ndim = np.zeros(len(names), dtype=np.int64)
        itemsize = np.zeros(len(names), dtype=np.int64)
        if self.indexed:
            t = self.tensors
            sizes = {d: dtype_itemsize(d) for d in set(t.dtypes)}
            pos = np.fromiter((t.pos.get(n, -1) for n in names), dtype=np.int64, count=len(names))
            have = pos >= 0
            ndim[have] = t.ndim[pos[have]]
            itemsize[have] = [sizes[t.dtypes[i]] for i in pos[have].tolist()]
            return ndim, itemsize
        for i, n in enumerate(names):
            m = self.tensors.get(n)
            if m is not None:
                ndim[i] = len(m.shape)
                itemsize[i] = m.itemsize
        return ndim, itemsize

    def width(self) -> int:
        """The largest tensor rank in the checkpoint."""
        if self.indexed:
            return int(self.tensors.ndim.max()) if len(self.tensors) else 0
        return max((len(t.shape) for t in self.tensors.values()), default=0)

    def to_json_v2(self, index_file: str) -> str:
        """Format 2 ``.metadata``: tensor-level facts only; the chunks go to ``index_file``, written by
        :func:`pipeload.formats.chunkindex.build_arrays` with the same file list (:attr:`files`)."""
        names = sorted(self.tensors)
        doc = {
            "format": FORMAT_NAME,
            "version": 2,
            "save_id": self.save_id,
            "world_size": self.world_size,
            "index": index_file,
            "files": self.files,  # chunk_file in the index counts in this list
            "tensors": {
                "names": names,
                "dtypes": [self.tensors[n].dtype for n in names],
                "ndims": [len(self.tensors[n].shape) for n in names],
            },
            "objects": self._objects_json(),
        }
        return json.dumps(doc, indent=None, separators=(",", ":"))

    def _objects_json(self) -> dict:
        return {
            fqn: {"file": o.file, "key": o.key, "nbytes": o.nbytes, "checksum": o.checksum, "encoding": o.encoding}
            for fqn, o in sorted(self.objects.items())
        }

    def to_json(self) -> str:
        """Format 1 ``.metadata`` (every chunk in JSON)."""
        doc = {
            "format": FORMAT_NAME,
            "version": 1,
            "save_id": self.save_id,
            "world_size": self.world_size,
            "tensors": {
                fqn: {
                    "dtype": t.dtype,
                    "shape": list(t.shape),
                    "chunks": [
                        {
                            "offsets": list(c.offsets),
                            "lengths": list(c.lengths),
                            "file": c.file,
                            "key": c.key,
                            "checksum": c.checksum,
                        }
                        for c in t.chunks
                    ],
                }
                for fqn, t in sorted(self.tensors.items())
            },
            "objects": self._objects_json(),
        }
        return json.dumps(doc, indent=None, separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str | bytes, source: str = "<metadata>", directory: str | None = None,
                  index_data: tuple[str, bytes] | None = None) -> "Metadata":
        """Parse and validate; every failure is a CheckpointFormatError naming ``source`` and the key.

        Refused besides the schema: a key given twice in one JSON object (JSON leaves it undefined;
        a last-one-wins parser would hide a conflict), nesting deeper than Python's recursion allows,
        and strings holding a lone UTF-16 surrogate (no UTF-8 encoding: nothing could print them).
        Format 2 maps its chunk index from ``directory`` (default: the directory of ``source``), or
        decodes ``index_data``: (name, bytes) of the index file read by another rank, used when the name
        is the one this metadata gives.
        """
        try:
            doc = json.loads(text, object_pairs_hook=_unique_keys)
        except _DuplicateKey as e:
            raise CheckpointFormatError(f"{source}: metadata has the key {e.key!r} twice in one object") from None
        except RecursionError:
            raise CheckpointFormatError(f"{source}: metadata is nested too deeply") from None
        except (ValueError, UnicodeDecodeError) as e:
            raise CheckpointFormatError(f"{source}: metadata is not valid JSON ({e})") from None
        if isinstance(doc, dict) and doc.get("format") == FORMAT_NAME and doc.get("version") == 2:
            md = _parse_v2(doc, source, directory if directory is not None else os.path.dirname(source), index_data)
        else:
            md = _parse(doc, source)
        pattern, escape = (_SURROGATE_ESCAPE, "\\u") if isinstance(text, str) else (_SURROGATE_ESCAPE_B, b"\\u")
        if escape in text and pattern.search(text):  # (a substring scan first: the regex is ~10x slower)
            _refuse_lone_surrogates(md, source)
        return md

    def validate_geometry(self, source: str = "<metadata>") -> None:
        """Check that each tensor's chunks lie inside its shape and exactly tile it (no gap, no overlap)."""
        for fqn, t in self.tensors.items():
            problem = tiling_problem(t.shape, [(c.offsets, c.lengths) for c in t.chunks])
            if problem:
                raise CheckpointFormatError(f"{source}: tensor {fqn!r}: {problem}")


class _DuplicateKey(ValueError):
    def __init__(self, key: str):
        super().__init__(key)
        self.key = key


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    d = dict(pairs)
    if len(d) != len(pairs):
        seen: set[str] = set()
        for k, _ in pairs:
            if k in seen:
                raise _DuplicateKey(k)
            seen.add(k)
    return d


_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")  # a \uD800-\uDFFF escape somewhere in the text
_SURROGATE_ESCAPE_B = re.compile(rb"\\u[dD][89a-fA-F]")


def _refuse_lone_surrogates(md: "Metadata", source: str) -> None:
    def check(s: str, what: str) -> None:
        try:
            s.encode("utf-8")
        except UnicodeEncodeError:
            raise CheckpointFormatError(
                f"{source}: {what} {s.encode('utf-8', 'backslashreplace').decode()!r} holds a lone "
                f"UTF-16 surrogate (not valid Unicode)"
            ) from None

    check(md.save_id, "save_id")
    for fqn, t in md.tensors.items():
        check(fqn, "key")
        for c in t.chunks:
            check(c.key, f"tensor {fqn!r}: chunk key")
            check(c.file, f"tensor {fqn!r}: file")
    for fqn, o in md.objects.items():
        check(fqn, "key")
        check(o.key, f"object {fqn!r}: key")
        check(o.file, f"object {fqn!r}: file")


def _req(d: Any, key: str, typ: type | tuple[type, ...], where: str) -> Any:
    if not isinstance(d, dict) or key not in d:
        raise CheckpointFormatError(f"{where}: missing field {key!r}")
    v = d[key]
    if not isinstance(v, typ) or (typ is int and isinstance(v, bool)):
        raise CheckpointFormatError(f"{where}: field {key!r} has the wrong type ({type(v).__name__})")
    return v


def _int_list(v: Any, where: str) -> tuple[int, ...]:
    # type() is exact: bool (an int subclass) is refused, as JSON true/false are not sizes.
    if type(v) is not list or not all(type(x) is int and x >= 0 for x in v):
        raise CheckpointFormatError(f"{where}: expected a list of non-negative integers")
    return tuple(v)


_HEX16 = re.compile(r"[0-9a-f]{16}")


def _checksum(v: Any, where: str) -> str:
    if type(v) is not str or not _HEX16.fullmatch(v):
        raise CheckpointFormatError(f"{where}: checksum must be 16 lowercase hex digits")
    return v


def _at_width(boxes, width: int):
    """Boxes (a tuple each, or an n x k zero-padded array) as an n x ``width`` int64 array.

    A box of more dimensions than ``width`` keeps them as a non-zero column would: it then matches no
    stored chunk (those columns are zero there), never one of a lower rank."""
    import numpy as np

    from ..plan.exchange import padded

    if not isinstance(boxes, np.ndarray):
        return padded(boxes, width)
    k = boxes.shape[1]
    if k == width:
        return boxes
    if k < width:
        return np.pad(boxes, ((0, 0), (0, width - k)))
    extra = np.any(boxes[:, width:] != 0, axis=1)
    out = boxes[:, :width].copy()
    out[extra] = -1  # no stored chunk has a negative offset or length
    return out


def plain_file_name(v: Any, where: str) -> str:
    """``v`` if it names a file directly inside the checkpoint directory; CheckpointFormatError otherwise."""
    if not isinstance(v, str) or not v or "/" in v or "\\" in v or v in (".", "..") or "\x00" in v:
        raise CheckpointFormatError(f"{where}: file must be a plain file name inside the checkpoint")
    return v


def _uints(v: Any) -> bool:
    return type(v) is list and all(type(x) is int and x >= 0 for x in v)


def _tensor_fast(t: Any, files: dict[str, str]) -> TensorMeta | None:
    """A well-formed tensor entry, parsed with the fewest checks that still refuse every bad one.

    Returns None at the first doubt: the caller then re-validates field by field for the message.
    """
    if type(t) is not dict:
        return None
    dtype, shape, chunks = t.get("dtype"), t.get("shape"), t.get("chunks")
    if type(dtype) is not str or dtype not in _DTYPE_NAMES or not _uints(shape) or type(chunks) is not list:
        return None
    out = []
    for c in chunks:
        if type(c) is not dict:
            return None
        offsets, lengths, file, key, csum = (
            c.get("offsets"), c.get("lengths"), c.get("file"), c.get("key"), c.get("checksum")
        )
        if not (_uints(offsets) and _uints(lengths) and type(key) is str and type(csum) is str
                and _HEX16.fullmatch(csum)):
            return None
        if type(file) is not str:
            return None
        if file not in files:
            try:
                files[file] = plain_file_name(file, "")
            except CheckpointFormatError:
                return None
        out.append(ChunkMeta(tuple(offsets), tuple(lengths), file, key, csum))
    return TensorMeta(dtype, tuple(shape), tuple(out))


def _parse(doc: Any, source: str) -> Metadata:
    if not isinstance(doc, dict):
        raise CheckpointFormatError(f"{source}: metadata must be a JSON object")
    if doc.get("format") != FORMAT_NAME:
        raise CheckpointFormatError(f"{source}: not a pipeload checkpoint (format={doc.get('format')!r})")
    version = _req(doc, "version", int, source)
    if version not in (1, 2):
        raise CheckpointFormatError(
            f"{source}: format version {version} is not supported (this pipeload reads 1 and 2)"
        )
    md = Metadata(
        save_id=_req(doc, "save_id", str, source),
        world_size=_req(doc, "world_size", int, source),
        version=version,
    )
    files: dict[str, str] = {}  # validated file names (a checkpoint has few; each is checked once)
    for fqn, t in _req(doc, "tensors", dict, source).items():
        fast = _tensor_fast(t, files)
        if fast is not None:
            md.tensors[fqn] = fast
            continue
        where = f"{source}: tensor {fqn!r}"  # the thorough path names what is wrong
        dtype = _req(t, "dtype", str, where)
        try:
            torch_dtype(dtype)
        except KeyError:
            raise CheckpointFormatError(f"{where}: unsupported dtype {dtype!r}") from None
        shape = _int_list(_req(t, "shape", list, where), f"{where} shape")
        chunks = []
        for i, c in enumerate(_req(t, "chunks", list, where)):
            cw = f"{where} chunk {i}"
            chunks.append(
                ChunkMeta(
                    offsets=_int_list(_req(c, "offsets", list, cw), f"{cw} offsets"),
                    lengths=_int_list(_req(c, "lengths", list, cw), f"{cw} lengths"),
                    file=plain_file_name(_req(c, "file", str, cw), cw),
                    key=_req(c, "key", str, cw),
                    checksum=_checksum(_req(c, "checksum", str, cw), cw),
                )
            )
        md.tensors[fqn] = TensorMeta(dtype=dtype, shape=shape, chunks=tuple(chunks))
    _parse_objects(doc, md, source)
    clash = md.tensors.keys() & md.objects.keys()
    if clash:
        raise CheckpointFormatError(f"{source}: keys are both tensor and object: {sorted(clash)[:5]}")
    md.validate_geometry(source)
    return md


def _parse_objects(doc: Any, md: Metadata, source: str) -> None:
    for fqn, o in _req(doc, "objects", dict, source).items():
        where = f"{source}: object {fqn!r}"
        enc = _req(o, "encoding", str, where)
        if enc != OBJECT_ENCODING:
            raise CheckpointFormatError(f"{where}: unknown object encoding {enc!r}")
        nbytes = _req(o, "nbytes", int, where)
        if nbytes < 0:
            raise CheckpointFormatError(f"{where}: negative nbytes")
        md.objects[fqn] = ObjectMeta(
            file=plain_file_name(_req(o, "file", str, where), where),
            key=_req(o, "key", str, where),
            nbytes=nbytes,
            checksum=_checksum(_req(o, "checksum", str, where), where),
            encoding=enc,
        )


def _parse_v2(doc: dict, source: str, directory: str, index_data: tuple[str, bytes] | None = None) -> Metadata:
    """Format 2: tensor-level facts from JSON, chunks from the mapped index (read where looked at)."""
    md = Metadata(save_id=_req(doc, "save_id", str, source), world_size=_req(doc, "world_size", int, source),
                  version=2)
    md.index_file = plain_file_name(_req(doc, "index", str, source), f"{source}: index")
    files = _req(doc, "files", list, source)
    md.data_files = [plain_file_name(f, f"{source}: files") for f in files]
    t = _req(doc, "tensors", dict, source)
    names = _req(t, "names", list, f"{source}: tensors")
    dtypes = _req(t, "dtypes", list, f"{source}: tensors")
    ndims = _req(t, "ndims", list, f"{source}: tensors")
    # (each check is one C-level pass: a checkpoint lists thousands of tensors, and every rank parses it)
    if not (len(names) == len(dtypes) == len(ndims)) or not set(map(type, names)) <= {str} \
            or not set(map(type, ndims)) <= {int} or (ndims and not 0 <= min(ndims) <= max(ndims) <= 64):
        raise CheckpointFormatError(f"{source}: tensors: names, dtypes and ndims must be lists of equal length")
    if not set(map(type, dtypes)) <= {str} or not set(dtypes) <= _DTYPE_NAMES.keys():
        for n, d in zip(names, dtypes):  # name the first offender
            if type(d) is not str or d not in _DTYPE_NAMES:
                raise CheckpointFormatError(f"{source}: tensor {n!r}: unsupported dtype {d!r}")
    if names != sorted(names) or len(set(names)) != len(names):
        raise CheckpointFormatError(f"{source}: tensors: names must be sorted and unique")
    _parse_objects(doc, md, source)
    clash = set(names) & md.objects.keys()
    if clash:
        raise CheckpointFormatError(f"{source}: keys are both tensor and object: {sorted(clash)[:5]}")
    data = index_data[1] if index_data is not None and index_data[0] == md.index_file else None
    md.tensors = open_index(resolve_inside(directory, md.index_file), names, dtypes, ndims, md.data_files, data)
    return md


def metadata_path(directory: str) -> str:
    return os.path.join(directory, METADATA_FILE)


MAX_METADATA_BYTES = 1 << 30  # a .metadata larger than this is refused before it is read


def resolve_inside(directory: str, name: str) -> str:
    """``directory/name``, refused (CheckpointFormatError) when it resolves outside ``directory``.

    A checkpoint's files may be symlinks, but only to files inside the checkpoint directory itself
    (after resolving every link): a link elsewhere would make the checkpoint silently read another
    checkpoint's data or an unrelated file.
    """
    path = os.path.join(directory, name)
    if _is_url(directory):  # an object store has no links: a plain name stays under its prefix
        plain_file_name(name, path)
        return path
    root = os.path.realpath(directory)
    real = os.path.realpath(path)
    if os.path.dirname(real) != root:
        raise CheckpointFormatError(
            f"{path}: is a link that resolves outside the checkpoint directory ({real}); "
            f"pipeload reads only files inside it"
        )
    return path


def _is_url(path: str) -> bool:
    from ..io.storage import is_url

    return is_url(path)


def _read_object(directory: str, path: str) -> bytes:
    """``.metadata`` of a checkpoint in object storage, at the version its snapshot pinned."""
    from ..io.storage import read_bytes

    try:
        return read_bytes(path, MAX_METADATA_BYTES)
    except FileNotFoundError:
        raise CheckpointFormatError(f"{directory}: not a pipeload checkpoint (no {METADATA_FILE})") from None


def read_metadata_bytes(directory: str) -> bytes:
    """The raw ``.metadata`` of a checkpoint directory; CheckpointFormatError naming it otherwise.

    It must be a regular file (a FIFO or a device would block or never end), inside the directory
    (:func:`resolve_inside`), and at most :data:`MAX_METADATA_BYTES` long.
    """
    path = metadata_path(directory)
    if _is_url(directory):
        return _read_object(directory, path)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK)
    except FileNotFoundError:
        raise CheckpointFormatError(f"{directory}: not a pipeload checkpoint (no {METADATA_FILE})") from None
    except OSError as e:
        raise CheckpointFormatError(f"{path}: cannot read metadata ({e.strerror or e})") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise CheckpointFormatError(f"{path}: metadata is not a regular file")
        resolve_inside(directory, METADATA_FILE)
        if st.st_size > MAX_METADATA_BYTES:
            raise CheckpointFormatError(
                f"{path}: metadata is {st.st_size} bytes, over the {MAX_METADATA_BYTES}-byte limit"
            )
        parts, left = [], MAX_METADATA_BYTES + 1
        while left > 0:
            b = os.read(fd, min(left, max(st.st_size, 1 << 16)))
            if not b:
                break
            parts.append(b)
            left -= len(b)
        if left <= 0:
            raise CheckpointFormatError(f"{path}: metadata grew past the {MAX_METADATA_BYTES}-byte limit")
        return b"".join(parts)
    except OSError as e:
        raise CheckpointFormatError(f"{path}: cannot read metadata ({e.strerror or e})") from None
    finally:
        os.close(fd)


def read_metadata(directory: str | os.PathLike) -> Metadata:
    """Read, parse and validate ``<directory>/.metadata``."""
    directory = os.fspath(directory)
    return Metadata.from_json(read_metadata_bytes(directory), source=metadata_path(directory), directory=directory)

