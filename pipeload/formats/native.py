"""pipeload's own layout (docs/FORMAT.md): a JSON ``.metadata`` (formats 1 and 2) next to safetensors files."""

from __future__ import annotations

import os
import re
import stat

from ..errors import CheckpointFormatError
from .chunkindex import INLINE_INDEX
from .metadata import Metadata, metadata_path, read_metadata_bytes, resolve_inside


def read_payload(path: str, versions: dict | None = None) -> tuple:
    """(``.metadata`` bytes, (name, bytes) of the format-2 chunk index when it is small, else None), and
    given an object prefix's snapshot (``versions``, rank 0's), the data objects' headers
    (:func:`object_headers`).

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
    if versions is None:
        return data, index
    return data, index, object_headers(path, data, versions)


_HEAD = 4096  # .metadata format 2 names its index among its first keys (Metadata.to_json_v2)
_INDEX_NAME = re.compile(rb'"index"\s*:\s*"([^"\\/]{1,255})"')
_SAVE_ID = re.compile(rb'"save_id"\s*:\s*"([0-9A-Za-z_.-]{1,64})"')
SHARED_HEADERS = 64  # objects: rank 0 sends the headers of at most this many data objects with .metadata
HEADER_READS = 16  # headers rank 0 fetches at once


def object_headers(path: str, md_bytes: bytes, versions: dict) -> dict[str, tuple[int, str, bytes]]:
    """name -> (size, ETag, first ``8 + n`` bytes) of each data object of this save (``data-SAVEID-*``,
    from rank 0's snapshot ``versions``), fetched by rank 0 at once (one GET each, up to
    :data:`HEADER_READS` in flight), so that the ranks open them without a header GET each (R x files
    GETs become files). Only up to :data:`SHARED_HEADERS` objects (at scale each rank opens a few of
    thousands: every rank receiving every header would cost more than it saves); an object whose header
    fails here, or that has no ETag, is left out (its readers fetch it and report what is wrong)."""
    from ..io.storage import join, read_object_header

    m = _SAVE_ID.search(md_bytes, 0, _HEAD)
    if m is None:
        return {}
    first = f"data-{m.group(1).decode()}-"
    names = sorted(n for n in versions if n.startswith(first) and n.endswith(".safetensors"))
    if not names or len(names) > SHARED_HEADERS:
        return {}

    def one(name: str):
        try:
            return read_object_header(join(path, name))[1]
        except Exception:  # noqa: BLE001 - left to the object's readers
            return None

    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(min(HEADER_READS, len(names)), thread_name_prefix="pipeload-headers") as pool:
        got = list(pool.map(one, names))
    return {n: v for n, v in zip(names, got) if v is not None and v[1]}


class _SharedHeaders:
    """Opener of a checkpoint's data objects from the headers rank 0 read (:func:`object_headers`): each is
    opened at the size and ETag rank 0 read its header at, with those bytes, validated as a fetched header
    is; every GET of it carries If-Match that ETag, so an object replaced since fails its first read (a
    ReadError naming it). Another path is opened as before (its header fetched)."""

    def __init__(self, root: str, headers: dict[str, tuple[int, str, bytes]]):
        from ..io.storage import join

        self.at = {join(root, name): version for name, version in headers.items()}

    def __call__(self, path: str):
        from ..io.storage import open_safetensors

        hit = self.at.get(path)
        return open_safetensors(path) if hit is None else open_safetensors(path, *hit)


def from_payload(path: str, data):
    """(root, Metadata, opener, file metadata): the data files are safetensors, keyed by name."""
    md_bytes, index = data[:2]
    headers = data[2] if len(data) > 2 else None
    opener = _SharedHeaders(path, headers) if headers else None
    md = Metadata.from_json(md_bytes, source=metadata_path(path), directory=path, index_data=index)
    return path, md, opener, {}


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
