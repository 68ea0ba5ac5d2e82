"""pipeload's own layout (docs/FORMAT.md): a JSON ``.metadata`` (formats 1 and 2) next to safetensors files."""

from __future__ import annotations

import os
import re
import stat

from ..errors import CheckpointFormatError
from .chunkindex import INLINE_INDEX
from .metadata import Metadata, metadata_path, read_metadata_bytes, resolve_inside


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


def read_small_index(directory: str, name: str) -> bytes | None:
    """The whole index file when it is at most :data:`INLINE_INDEX` bytes (else None: map it per rank).

    A load's rank 0 sends a small index with ``.metadata``, so no rank touches storage while planning
    (where its reads would queue behind the data other ranks already prefetch). Errors are left to the
    ranks' own open of the file, which names them.
    """
    from ..io.storage import is_url, join, snapshot_size, read_bytes

    if is_url(directory):  # the size pinned by the snapshot says whether it is small
        size = snapshot_size(join(directory, name))
        return read_bytes(join(directory, name), INLINE_INDEX) if size is not None and size <= INLINE_INDEX else None
    try:
        fd = os.open(resolve_inside(directory, name), os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except (OSError, ValueError, CheckpointFormatError):  # ValueError: a NUL in a hostile name
        return None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_size > INLINE_INDEX:
            return None
        chunks, left = [], st.st_size
        while left > 0:
            b = os.read(fd, left)
            if not b:
                return None
            chunks.append(b)
            left -= len(b)
        return b"".join(chunks)
    except OSError:
        return None
    finally:
        os.close(fd)
