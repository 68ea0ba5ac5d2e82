"""pipeload's own layout (docs/FORMAT.md): a JSON ``.metadata`` (formats 1 and 2) next to safetensors files."""

from __future__ import annotations

import re

from ..chunkindex import read_small_index
from ..metadata import Metadata, metadata_path, read_metadata_bytes


def read_payload(path: str) -> tuple[bytes, tuple[str, bytes] | None]:
    """(``.metadata`` bytes, (name, bytes) of the format-2 chunk index when it is small, else None).

    Decoded on every rank (JSON and safetensors: no pickle); a large index is mapped by each rank. The
    index's name is found without parsing the JSON here (rank 0 would parse it twice per load: the
    decode does it anyway); the decode uses the bytes only if the name is the one the JSON gives.
    """
    data = read_metadata_bytes(path)
    m = _INDEX_NAME.search(data, 0, _HEAD)
    index = None
    if m is not None:
        name = m.group(1).decode("utf-8", "replace")
        raw = read_small_index(path, name)
        index = (name, raw) if raw is not None else None
    return data, index


_HEAD = 4096  # .metadata format 2 names its index among its first keys (Metadata.to_json_v2)
_INDEX_NAME = re.compile(rb'"index"\s*:\s*"([^"\\/]{1,255})"')


def from_payload(path: str, data):
    """(root, Metadata, opener, file metadata): the data files are safetensors, keyed by name."""
    md_bytes, index = data
    return path, Metadata.from_json(md_bytes, source=metadata_path(path), directory=path, index_data=index), None, {}
