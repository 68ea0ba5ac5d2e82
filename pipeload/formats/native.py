"""pipeload's own layout (docs/FORMAT.md): a JSON ``.metadata`` (formats 1 and 2) next to safetensors files."""

from __future__ import annotations

import json

from ..chunkindex import read_small_index
from ..metadata import Metadata, metadata_path, read_metadata_bytes


def read_payload(path: str) -> tuple[bytes, bytes | None]:
    """(``.metadata`` bytes, the format-2 chunk index's bytes when small, else None).

    Decoded on every rank (JSON and safetensors: no pickle); a large index is mapped by each rank.
    """
    data = read_metadata_bytes(path)
    index = None
    if data[:64].replace(b" ", b"").find(b'"version":2') >= 0:
        try:
            name = json.loads(data).get("index")
        except (ValueError, AttributeError, RecursionError):
            name = None  # the ranks' parse names what is wrong
        if isinstance(name, str) and "/" not in name and name not in ("", ".", ".."):
            index = read_small_index(path, name)
    return data, index


def from_payload(path: str, data):
    """(root, Metadata, opener, file metadata): the data files are safetensors, keyed by name."""
    md_bytes, index = data if isinstance(data, tuple) else (data, None)
    return path, Metadata.from_json(md_bytes, source=metadata_path(path), directory=path, index_data=index), None, {}
