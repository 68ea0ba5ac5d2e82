"""pipeload's own layout (docs/FORMAT.md): a JSON ``.metadata`` (formats 1 and 2) next to safetensors files."""

from __future__ import annotations

from ..metadata import Metadata, metadata_path, read_metadata_bytes


def read_payload(path: str) -> bytes:
    """The raw ``.metadata`` bytes (decoded on every rank: JSON, no pickle)."""
    return read_metadata_bytes(path)


def from_payload(path: str, data: bytes):
    """(root, Metadata, opener, file metadata): the data files are safetensors, keyed by name."""
    return path, Metadata.from_json(data, source=metadata_path(path)), None, {}
