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

from ..storage import is_url, listdir, read_bytes, read_header
from ..errors import CheckpointFormatError
from ..metadata import ChunkMeta, Metadata, TensorMeta, plain_file_name, tiling_problem, torch_dtype

INDEX_FILE = "model.safetensors.index.json"
SUFFIX = ".safetensors"
SHARDING_KEY = "DCP_SHARDING_INFO"
MERGE_GAP = 4096  # prefetch: merge a rank's ranges only across a page (see Checkpoint.merge_gap)


def is_hf_dir(path: str) -> bool:
    try:
        names = listdir(path)
    except OSError:
        return False
    from ..saver import DATA_FILE_RE

    # pipeload's own files (data and chunk index) are not a Hugging Face checkpoint without .metadata
    return INDEX_FILE in names or any(n.endswith(SUFFIX) and not DATA_FILE_RE.match(n) for n in names)


def read_payload(path: str) -> dict[str, Any]:
    """Root, index and every referenced file's header, as plain data (read once, sent to all)."""
    weight_map = None
    if (path.endswith(SUFFIX) and is_url(path)) or os.path.isfile(path):
        root, files = _root(path, True), [os.path.basename(path)]
    else:
        root = path
        index_path = os.path.join(path, INDEX_FILE)
        try:
            if is_url(path):
                doc = json.loads(read_bytes(index_path, 1 << 30)) if INDEX_FILE in listdir(path) else None
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
            files = sorted(set(weight_map.values()))
        else:
            try:
                files = sorted(n for n in listdir(path) if n.endswith(SUFFIX))
            except OSError as e:
                raise CheckpointFormatError(f"{path}: cannot list the directory ({e.strerror or e})") from None
            if not files:
                raise CheckpointFormatError(f"{path}: no {INDEX_FILE} and no *{SUFFIX} files")
    headers = {}
    for name in files:
        try:
            headers[name] = read_header(os.path.join(root, name))
        except OSError as e:
            raise CheckpointFormatError(f"{os.path.join(root, name)}: {e.strerror or e}") from None
    single = (path.endswith(SUFFIX) and is_url(path)) or os.path.isfile(path)
    return {"single": single, "weight_map": weight_map, "headers": headers}


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


def from_payload(path: str, data: dict[str, Any]):
    """(root, Metadata, opener, file metadata) of the checkpoint at ``path`` (this rank's copy)."""
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
            try:
                torch_dtype(dtype)
            except KeyError:
                raise CheckpointFormatError(f"{fpath}: tensor {key!r} has dtype {dtype}, which torch cannot hold") from None
            shape = tuple(shape)
            offsets = (0,) * len(shape)
            if offsets_of is not None and key in offsets_of:
                off = offsets_of[key]
                if len(off) != len(shape) or not all(type(o) is int and o >= 0 for o in off):
                    raise CheckpointFormatError(f"{fpath}: tensor {key!r}: bad saved_offsets {off!r}")
                offsets = tuple(off)
                sharded.add(key)
            parts.setdefault(key, []).append((dtype, offsets, ChunkMeta(offsets, shape, name, key, "")))
    if weight_map is not None:
        absent = sorted(k for k in weight_map if k not in parts)
        if absent:
            raise CheckpointFormatError(
                f"{os.path.join(root, INDEX_FILE)}: tensor {absent[0]!r} is not in {weight_map[absent[0]]}"
                + (f" ({len(absent) - 1} more missing)" if len(absent) > 1 else "")
            )
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
            raise CheckpointFormatError(f"{path}: tensor {key!r}: {problem}")
        md.tensors[key] = TensorMeta(dtypes.pop(), shape, metas)
    return root, md, None, file_metadata
