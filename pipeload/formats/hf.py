"""The Hugging Face safetensors layout.

Accepted forms:

- one file (``model.safetensors``);
- a directory with ``model.safetensors.index.json`` (``{"weight_map": {name: file}}``): the index
  says which file holds each tensor, and only those tensors are part of the checkpoint;
- a directory of ``*.safetensors`` files without an index: every tensor of every file.

Every tensor of a file is one whole chunk (offsets all 0) — except in files written by torch's
``HuggingFaceStorageWriter(save_distributed=True)``, whose ``__metadata__["DCP_SHARDING_INFO"]``
records where each stored tensor starts in the global one (``saved_offsets``): those become chunks of
a larger tensor. Each file's ``__metadata__`` is kept on the Checkpoint. No checksums are recorded.
"""

from __future__ import annotations

import json
import os
from typing import Any

from ..io.storage import is_url, join, listdir, open_safetensors, read_bytes, read_header, read_object_header
from ..errors import CheckpointFormatError
from .metadata import ChunkMeta, Metadata, TensorMeta, plain_file_name, tiling_problem, torch_dtype

INDEX_FILE = "model.safetensors.index.json"
SUFFIX = ".safetensors"
SHARDING_KEY = "DCP_SHARDING_INFO"
HEADER_READS = 16  # files whose headers rank 0 reads at once
MERGE_GAP = 4096  # prefetch: merge a rank's ranges only across a page (see Checkpoint.merge_gap)


def is_hf_dir(path: str) -> bool:
    try:
        names = listdir(path)
    except OSError:
        return False
    from ..save.saver import DATA_FILE_RE

    # pipeload's own files (data and chunk index) are not a Hugging Face checkpoint without .metadata
    return INDEX_FILE in names or any(n.endswith(SUFFIX) and not DATA_FILE_RE.match(n) for n in names)


def read_payload(path: str, names: dict | None = None):
    """The chunk table (:mod:`pipeload.formats.table`) of the checkpoint, decoded here from its index and
    headers: what every other rank receives. ``names``: the listing of an object prefix, already taken
    (:func:`pipeload.io.storage.snapshot`): the prefix is not listed again."""
    return table_of(read_raw(path, names), path)


def read_raw(path: str, names: dict | None = None) -> dict[str, Any]:
    """Root, index and every referenced file's header, as plain data (the reads of :func:`read_payload`).

    Objects also give ``objects``: per file, (size, ETag, first ``8 + n`` bytes) of the version whose
    header was read, which the table carries so that no other rank sends a header GET.
    """
    single = (path.endswith(SUFFIX) and is_url(path)) or os.path.isfile(path)
    root = _root(path, single)
    weight_map, files = (None, [os.path.basename(path)]) if single else _files_of(path, names)
    headers, objects = {}, {}
    for name, (header, version) in zip(files, _read_headers([os.path.join(root, n) for n in files])):
        headers[name] = header
        if version is not None:
            objects[name] = version
    out = {"single": single, "weight_map": weight_map, "headers": headers}
    if objects:
        out["objects"] = objects
    return out


def _read_headers(paths: list[str]) -> list[tuple[dict, tuple | None]]:
    """(header, object version or None) of each file, read up to HEADER_READS at a time: on an object
    store or a network file system each is a round trip, and a checkpoint of 160 files would otherwise
    pay 160 of them one after another before any rank can plan. The first failing file in order is raised."""
    def one(fpath: str):
        try:
            return read_object_header(fpath) if is_url(fpath) else (read_header(fpath), None)
        except OSError as e:
            return CheckpointFormatError(f"{fpath}: {e.strerror or e}")

    if len(paths) > 1:
        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(min(HEADER_READS, len(paths)), thread_name_prefix="pipeload-headers") as pool:
            out = list(pool.map(one, paths))
    else:
        out = [one(p) for p in paths]
    for r in out:
        if isinstance(r, Exception):
            raise r
    return out


def _files_of(path: str, names: dict | None) -> tuple[dict | None, list[str]]:
    """(the index's weight map or None, the files to read) of the checkpoint directory ``path``."""
    index_path = os.path.join(path, INDEX_FILE)
    listing = (lambda: names) if names is not None else (lambda: listdir(path))
    try:
        if is_url(path):
            doc = json.loads(read_bytes(index_path, 1 << 30)) if INDEX_FILE in listing() else None
        else:
            with open(index_path, "rb") as f:
                doc = json.loads(f.read())
    except FileNotFoundError:
        doc = None
    except (OSError, ValueError) as e:
        raise CheckpointFormatError(f"{index_path}: cannot read the index ({e})") from None
    if doc is not None:
        weight_map = doc.get("weight_map") if isinstance(doc, dict) else None
        if not isinstance(weight_map, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in weight_map.items()
        ):
            raise CheckpointFormatError(f"{index_path}: 'weight_map' must map tensor names to file names")
        for v in set(weight_map.values()):
            _check_name(v, index_path)
        return weight_map, sorted(set(weight_map.values()))
    try:
        files = sorted(n for n in listing() if n.endswith(SUFFIX))
    except OSError as e:
        raise CheckpointFormatError(f"{path}: cannot list the directory ({e.strerror or e})") from None
    if not files:
        raise CheckpointFormatError(f"{path}: no {INDEX_FILE} and no *{SUFFIX} files")
    return None, files


def _check_name(name: str, where: str) -> None:
    plain_file_name(name, f"{where}: {name!r}")


def _saved_offsets(meta: dict | None, path: str) -> dict[str, list[int]] | None:
    if not meta or SHARDING_KEY not in meta:
        return None
    try:
        info = json.loads(meta[SHARDING_KEY])
        return {k: list(v["saved_offsets"]) for k, v in info.items()}
    except (ValueError, TypeError, KeyError, AttributeError):
        raise CheckpointFormatError(f"{path}: __metadata__[{SHARDING_KEY!r}] is malformed") from None


def _root(path: str, single: bool) -> str:
    return (os.path.dirname(path) or ".") if single else path


def _decode_raw(path: str, data: dict[str, Any]):
    """(root, Metadata with every chunk, file metadata) of what :func:`read_raw` read."""
    root, weight_map, headers = _root(path, data["single"]), data["weight_map"], data["headers"]
    parts: dict[str, list[tuple[str, tuple[int, ...], ChunkMeta]]] = {}
    file_metadata: dict[str, dict[str, str]] = {}
    sharded: set[str] = set()
    for name, header in headers.items():
        fpath = os.path.join(root, name)
        meta = header.get("__metadata__")
        file_metadata[name] = dict(meta or {})
        offsets_of = _saved_offsets(meta, fpath)
        for key, entry in header.items():
            if key == "__metadata__":
                continue
            if weight_map is not None and weight_map.get(key) != name:
                continue  # the index names another file (or none) for this tensor
            dtype, shape, _, _ = entry
            _check_dtype(fpath, key, dtype)
            shape = tuple(shape)
            offsets = (0,) * len(shape)
            if offsets_of is not None and key in offsets_of:
                off = offsets_of[key]
                if len(off) != len(shape) or not all(type(o) is int and o >= 0 for o in off):
                    raise CheckpointFormatError(f"{fpath}: tensor {key!r}: bad saved_offsets {off!r}")
                offsets = tuple(off)
                sharded.add(key)
            parts.setdefault(key, []).append((dtype, offsets, ChunkMeta(offsets, shape, name, key, "")))
    _check_index_covered(root, weight_map, parts)
    md = Metadata(save_id="", world_size=0)
    for key, chunks in parts.items():
        dtypes = {d for d, _, _ in chunks}
        if len(dtypes) > 1:
            raise CheckpointFormatError(f"{path}: tensor {key!r} is stored with several dtypes {sorted(dtypes)}")
        if len(chunks) > 1 and key not in sharded:
            files = ", ".join(c.file for _, _, c in chunks)
            raise CheckpointFormatError(f"{path}: tensor {key!r} is in several files ({files})")
        metas = tuple(sorted((c for _, _, c in chunks), key=lambda c: c.offsets))
        if len({len(c.lengths) for c in metas}) > 1:
            raise CheckpointFormatError(f"{path}: tensor {key!r} is stored with chunks of different ranks")
        shape = tuple(max(c.offsets[d] + c.lengths[d] for c in metas) for d in range(len(metas[0].lengths)))
        problem = tiling_problem(shape, [(c.offsets, c.lengths) for c in metas])
        if problem:
            raise CheckpointFormatError(f"{path}: tensor {key!r}: {problem}{_where(metas)}")
        md.tensors[key] = TensorMeta(dtypes.pop(), shape, metas)
    return root, md, file_metadata


def _where(metas: tuple[ChunkMeta, ...]) -> str:
    """The files behind a tensor's chunks that do not tile it: the first two that overlap (two saves
    into one directory leave such pairs), else every file holding a chunk."""
    metas = tuple(c for c in metas if all(c.lengths))  # (an empty chunk overlaps nothing)
    for i, a in enumerate(metas):
        for b in metas[i + 1 :]:
            if all(x < y + m and y < x + n for x, n, y, m in zip(a.offsets, a.lengths, b.offsets, b.lengths)):
                return (f": {a.file} holds {list(a.lengths)} at {list(a.offsets)}, which overlaps {list(b.lengths)} "
                        f"at {list(b.offsets)} in {b.file} (the files of two saves in one directory?)")
    return f" (chunks in {', '.join(sorted({c.file for c in metas}))})"


def _check_dtype(fpath: str, key: str, dtype: str) -> None:
    try:
        torch_dtype(dtype)
    except KeyError:
        raise CheckpointFormatError(f"{fpath}: tensor {key!r} has dtype {dtype}, which torch cannot hold") from None


def _check_index_covered(root: str, weight_map: dict | None, found) -> None:
    """Every tensor the index names was found in the file it names (``found``: the tensors found)."""
    if weight_map is None:
        return
    absent = sorted(k for k in weight_map if k not in found)
    if absent:
        raise CheckpointFormatError(
            f"{os.path.join(root, INDEX_FILE)}: tensor {absent[0]!r} is not in {weight_map[absent[0]]}"
            + (f" ({len(absent) - 1} more missing)" if len(absent) > 1 else ""))


def table_of(raw: dict[str, Any], path: str):
    """The table blob of what :func:`read_raw` read: tensors sorted by name, their chunks, the files."""
    if not any(SHARDING_KEY in (h.get("__metadata__") or {}) for h in raw["headers"].values()):
        return _whole_table(raw, path)
    return _chunked_table(raw, path)


def _chunked_table(raw: dict[str, Any], path: str):
    """:func:`table_of` through the parsed chunks: any file, also those recording ``saved_offsets``."""
    import numpy as np

    from .chunkindex import build_arrays
    from . import table

    _, md, file_metadata = _decode_raw(path, raw)
    names = sorted(md.tensors)
    files = md.files
    arrays = build_arrays(names, {n: md.tensors[n]._replace(chunks=tuple(c._replace(checksum="0" * 16)
                                                                          for c in md.tensors[n].chunks))
                                  for n in names}, files)
    del arrays["chunk_checksum"]
    heads = raw["headers"]
    arrays["chunk_pos"] = np.array([heads[c.file][c.key][2] for n in names  # (build_arrays' row order)
                                    for c in sorted(md.tensors[n].chunks, key=lambda c: c.offsets)], dtype=np.int64)
    partial = {n: [list(c.offsets) for c in md.tensors[n].chunks] for n in names
               if any(c.lengths != md.tensors[n].shape for c in md.tensors[n].chunks)}
    facts = {"layout": "hf", "single": bool(raw["single"]), "names": names,
             "dtypes": [md.tensors[n].dtype for n in names], "ndims": [len(md.tensors[n].shape) for n in names],
             "files": files, "file_metadata": file_metadata, "partial": partial}
    if raw.get("objects"):
        arrays.update(_header_columns(raw["objects"], files, facts))
    return table.encode({k: np.asarray(v) for k, v in arrays.items()}, facts)


def _whole_table(raw: dict[str, Any], path: str):
    """:func:`table_of` of files that store every tensor whole (no ``DCP_SHARDING_INFO``): one chunk
    per tensor, the arrays built column by column — the same table, and the same errors, as the general
    path, in a fraction of its time (rank 0 decodes while every other rank waits for the table)."""
    import numpy as np

    from . import table

    root, weight_map, headers = _root(path, raw["single"]), raw["weight_map"], raw["headers"]
    where: dict[str, str] = {}
    entries: dict[str, tuple[str, tuple]] = {}
    begin: dict[str, int] = {}
    known: set[str] = set()
    for name, header in headers.items():
        for key, entry in header.items():
            if key == "__metadata__" or (weight_map is not None and weight_map.get(key) != name):
                continue
            dtype, shape, begin[key] = entry[0], tuple(entry[1]), entry[2]
            if dtype not in known:
                _check_dtype(os.path.join(root, name), key, dtype)
                known.add(dtype)
            if key in where:
                raise CheckpointFormatError(f"{path}: tensor {key!r} is in several files ({where[key]}, {name})")
            where[key], entries[key] = name, (dtype, shape)
    _check_index_covered(root, weight_map, where)
    names = sorted(entries)
    files = sorted(set(where.values()))
    file_ix = {f: i for i, f in enumerate(files)}
    ndims = [len(entries[n][1]) for n in names]
    width = max(ndims, default=0)
    shape = np.array([entries[n][1] + (0,) * (width - d) for n, d in zip(names, ndims)], dtype=np.int64)
    shape = shape.reshape(len(names), width)
    arrays = {"shape": shape, "chunk_start": np.arange(len(names) + 1, dtype=np.int64),
              "max_rows": shape[:, 0].copy() if width else np.zeros(len(names), dtype=np.int64),
              "chunk_offsets": np.zeros_like(shape), "chunk_lengths": shape.copy(),
              "chunk_file": np.array([file_ix[where[n]] for n in names], dtype=np.int32),
              "chunk_pos": np.array([begin[n] for n in names], dtype=np.int64)}
    facts = {"layout": "hf", "single": bool(raw["single"]), "names": names,
             "dtypes": [entries[n][0] for n in names], "ndims": ndims, "files": files,
             "file_metadata": {f: dict(h.get("__metadata__") or {}) for f, h in headers.items()}, "partial": {}}
    if raw.get("objects"):
        arrays.update(_header_columns(raw["objects"], files, facts))
    return table.encode(arrays, facts)


def _header_columns(objects: dict, files: list[str], facts: dict) -> dict:
    """The table's record of the object versions rank 0 read: ``file_header`` (every file's first
    ``8 + n`` bytes end to end, ``file_header_start`` their F + 1 offsets) and ``facts["objects"]`` (per
    file [size, ETag]). Each rank opens a file from these (:class:`_SharedHeaders`): O(files) to check
    here, one header parsed per file a rank opens, as a header GET would have it parsed."""
    import numpy as np

    heads = [objects[f][2] for f in files]
    start = np.zeros(len(files) + 1, dtype=np.int64)
    np.cumsum([len(h) for h in heads], out=start[1:])
    facts["objects"] = [[int(objects[f][0]), objects[f][1]] for f in files]
    return {"file_header": np.frombuffer(b"".join(heads), dtype=np.uint8), "file_header_start": start}


def from_payload(path: str, blob):
    """(root, Metadata, opener, file metadata) of the table rank 0 sent, viewed in place on this rank."""
    import numpy as np

    from .chunkindex import ChunkIndex, IndexedTensors
    from . import table

    source = os.path.join(path, INDEX_FILE) if not os.path.isfile(path) else path
    arrays, facts = table.decode(blob, source)
    if facts.get("layout") != "hf" or type(facts.get("single")) is not bool:
        raise CheckpointFormatError(f"{source}: not a Hugging Face table")
    names = table.str_list(facts.get("names"), "names", source)
    dtypes = table.str_list(facts.get("dtypes"), "dtypes", source)
    files = [plain_file_name(f, f"{source}: files") for f in table.str_list(facts.get("files"), "files", source)]
    ndims, partial, file_metadata = facts.get("ndims"), facts.get("partial"), facts.get("file_metadata")
    if type(ndims) is not list or type(partial) is not dict or type(file_metadata) is not dict:
        raise CheckpointFormatError(f"{source}: table facts are malformed")
    idx = ChunkIndex(source, len(names), len(files), arrays=arrays, checksums=False)
    md = Metadata(save_id="", world_size=0)
    md.tensors = IndexedTensors(idx, names, dtypes, ndims, files)
    md.index_file, md.data_files = INDEX_FILE, files
    pos = arrays.get("chunk_pos")  # where each chunk's bytes begin in its file (only a preference rests on it)
    if pos is not None and pos.dtype == np.int64 and pos.shape == idx.a["chunk_file"].shape:
        md.storage_pos = pos
    root = _root(path, facts["single"])
    opener = None
    if is_url(root) and "objects" in facts:
        opener = _SharedHeaders(root, files, arrays, facts["objects"], source)
    if partial:
        opener = _Stored(partial, opener)
    return root, md, opener, file_metadata


class _SharedHeaders:
    """Opener of an object-store checkpoint's objects from the headers rank 0 read: no header GET per rank.

    Invariants: object ``files[i]`` is opened at the size and ETag rank 0 read its header at, with those
    bytes, validated by ``_fastio.read_header`` as a fetched header is; every GET of it carries If-Match
    that ETag, so an object replaced since rank 0 read it fails its first read with a ReadError naming
    it (never bytes of one version under the header of another). An object without an ETag, or a path
    outside the table, is opened as before (its header fetched). Checking the table costs O(files).
    """

    def __init__(self, root: str, files: list[str], arrays: dict, objects: Any, source: str):
        import numpy as np

        heads, start = arrays.get("file_header"), arrays.get("file_header_start")
        n = len(files)
        if (heads is None or start is None or heads.dtype != np.uint8 or heads.ndim != 1
                or start.dtype != np.int64 or start.shape != (n + 1,) or start[0] != 0
                or np.any(np.diff(start) < 0) or start[-1] != len(heads)
                or type(objects) is not list or len(objects) != n
                or not all(type(o) is list and len(o) == 2 and type(o[0]) is int and o[0] >= 0
                           and (o[1] is None or type(o[1]) is str) for o in objects)):
            raise CheckpointFormatError(f"{source}: the table's object headers are malformed")
        self.heads, self.start, self.objects = heads, start, objects
        self.at = {join(root, f): i for i, f in enumerate(files)}

    def __call__(self, path: str):
        i = self.at.get(path)
        if i is None or not self.objects[i][1]:
            return open_safetensors(path)
        size, etag = self.objects[i]
        head = self.heads[int(self.start[i]) : int(self.start[i + 1])].tobytes()
        return open_safetensors(path, size=size, etag=etag, header=head)


class _Stored:
    """Opener for files holding parts of a tensor (``saved_offsets``): a chunk's key ``name@offsets``
    (the engine's name of a part) is the file's tensor ``name``. ``opener``: how a file is opened
    (default :func:`pipeload.io.storage.open_safetensors`)."""

    def __init__(self, partial: dict, opener=None):
        from .metadata import chunk_key

        self.stored = {chunk_key(n, tuple(o), False): n for n, offs in partial.items() for o in offs}
        self.opener = opener or open_safetensors

    def __call__(self, path: str):
        return _Renamed(self.opener(path), self.stored)


class _Renamed:
    """A SafetensorsFile whose tensors are also found by the engine's chunk keys."""

    def __init__(self, f, stored: dict):
        self._f, self._stored = f, stored

    def __getattr__(self, name):
        return getattr(self._f, name)

    def entry(self, key):
        return self._f.entry(self._stored.get(key, key))

    def buffer(self, key):
        return self._f.buffer(self._stored.get(key, key))

    def copy_box(self, key, *args, **kwargs):
        return self._f.copy_box(self._stored.get(key, key), *args, **kwargs)

    def willneed_tensors(self, keys, *args, **kwargs):
        return self._f.willneed_tensors([self._stored.get(k, k) for k in keys], *args, **kwargs)
