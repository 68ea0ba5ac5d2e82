"""The one storage interface under the reader: local files or object-store URLs, same calls.

Everything that opens, lists or writes a checkpoint's files goes through these functions; a path is a
local path or a URL (``s3://bucket/prefix``, ``gs://``, ``az://``, ``memory://``). Local paths take
exactly the code they took before (``_fastio`` mapped files, ``os`` calls): nothing is added on their
path. URLs go to :mod:`pipeload.io.objstore`. The planner, the scheduler and the error handling never
call this module: they see files with ``entry``/``buffer``/``copy_box``/``advise`` either way.

Invariants:

- :func:`open_safetensors` and :func:`open_raw` return objects with the API of
  ``_fastio.SafetensorsFile`` / ``_fastio.RawFile`` (docs/READER.md), errors included
  (:class:`~pipeload.errors.ReadError` / ``HeaderError`` naming the file or object);
- a URL's objects are read at the version :func:`snapshot` saw when the checkpoint was planned
  (:func:`pin` records it on every rank); a replaced object fails the read;
- :func:`configure` applies ``storage_options`` to the bucket of a URL before its first use; without it
  the client is configured from the standard environment (``AWS_ENDPOINT_URL``, ``AWS_REGION``,
  ``AWS_ACCESS_KEY_ID``, ``AWS_SECRET_ACCESS_KEY``, ``AWS_ALLOW_HTTP``, ...).
"""

from __future__ import annotations

import os
import re
import threading
from typing import Any

from ..errors import CheckpointFormatError

_URL = re.compile(r"^(s3|s3a|gs|az|abfs|abfss|azure|memory)://", re.IGNORECASE)


def is_url(path: Any) -> bool:
    """True when ``path`` names object storage rather than a local file."""
    return isinstance(path, str) and _URL.match(path) is not None


_STORES: dict[str, Any] = {}
_OPTIONS: dict[str, dict] = {}
_LOCK = threading.Lock()


def configure(path: str, options: dict | None) -> None:
    """Use ``options`` (obstore config keys plus pipeload's own, see objstore.OWN_OPTIONS) for the
    bucket of ``path``; a no-op for local paths and for ``None``. A changed set makes a new client."""
    if options is None or not is_url(path):
        return
    from .objstore import split_url

    base, _ = split_url(path)
    with _LOCK:
        if _OPTIONS.get(base) != options:
            _OPTIONS[base] = dict(options)
            _STORES.pop(base, None)


def store_of(url: str):
    """(the bucket's :class:`objstore.Store`, the key of ``url`` in it)."""
    from .objstore import Store, split_url

    base, key = split_url(url)
    with _LOCK:
        store = _STORES.get(base)
        if store is None:
            store = _STORES[base] = Store(base, _OPTIONS.get(base))
    return store, key


def join(root: str, name: str) -> str:
    return f"{root.rstrip('/')}/{name}" if is_url(root) else os.path.join(root, name)


# -- reading -------------------------------------------------------------------------------------------


def open_safetensors(path: str, size: int | None = None, etag: str | None = None, header: bytes | None = None):
    """A safetensors file or object: ``_fastio.SafetensorsFile`` or its object-store twin.

    An object is read at version (``size``, ``etag``), else at its pinned one; ``header``: its first
    ``8 + n`` bytes as read before at that version (:func:`read_object_header`), validated without a
    GET (see :class:`objstore.ObjectSafetensors`). A local file reads its own header (nothing to save)."""
    if not is_url(path):
        from ._fastio import SafetensorsFile

        return SafetensorsFile(path)
    from .objstore import ObjectSafetensors

    store, key = store_of(path)
    return ObjectSafetensors(store, key, size, etag, header)


def open_raw(path: str):
    """A file or object of any layout: ``_fastio.RawFile`` or :class:`objstore.ObjectBlob`."""
    if not is_url(path):
        from ._fastio import RawFile

        return RawFile(path)
    from .objstore import ObjectBlob

    store, key = store_of(path)
    return ObjectBlob(store, key)


def read_header(path: str) -> dict:
    """``_fastio.read_header`` of a file or object (an object: one GET in the common case)."""
    if not is_url(path):
        from ._fastio import read_header as local

        return local(path)
    f = open_safetensors(path)
    return {**f.header, "__metadata__": f.metadata}


def read_object_header(path: str) -> tuple[dict, tuple[int, str | None, bytes]]:
    """(:func:`read_header` of the object ``path``, (size, ETag, first ``8 + n`` bytes) of the version
    read): what lets another rank open the same version without a header GET (:func:`open_safetensors`)."""
    f = open_safetensors(path)
    try:
        return {**f.header, "__metadata__": f.metadata}, (f.size, f.etag, f.header_bytes)
    finally:
        f.close()


def read_bytes(path: str, limit: int, keep: bool = False) -> bytes:
    """A whole object (at most ``limit`` bytes) at its pinned version; FileNotFoundError if absent.

    ``keep``: the next read of the same version is served from memory (layout detection peeks at a
    ``.metadata`` that is read right after)."""
    store, key = store_of(path)
    if key not in store.pins and not exists(path):
        raise FileNotFoundError(2, "no such object", path)
    size, etag = store.pins.get(key, (None, None))
    data = _KEPT.pop((path, etag), None) if etag else None
    if data is None:
        data = store.run(store.get_all(key, etag, limit))
    if keep and etag:
        _KEPT[(path, etag)] = data
    return data


_KEPT: dict[tuple[str, str], bytes] = {}


def listdir(path: str) -> list[str]:
    """Names directly under ``path`` (a directory, or a URL prefix: the objects LIST shows)."""
    if not is_url(path):
        return os.listdir(path)
    return sorted(snapshot(path))


def exists(path: str) -> bool:
    """Whether the object ``path`` exists (a HEAD, pinning its version); local: os.path.exists."""
    if not is_url(path):
        return os.path.exists(path)
    store, key = store_of(path)
    if key in store.pins:
        return True
    try:
        store.version(key)
    except Exception:  # noqa: BLE001 - absent (or unreadable: the read that follows says which)
        return False
    return True


def isfile(path: str) -> bool:
    """A local regular file, or an object whose URL ends in a file name of its own (``.safetensors``)."""
    if not is_url(path):
        return os.path.isfile(path)
    return path.endswith(".safetensors") and exists(path)


def snapshot(root: str) -> dict[str, tuple[int, str | None]]:
    """{name: (size, etag)} of the objects directly under the prefix ``root``: one LIST, pinned."""
    store, prefix = store_of(root)
    entries = store.run(store.list(prefix + "/" if prefix else ""))
    out = {}
    for e in entries:
        key = e["path"]
        name = key[len(prefix) + 1 :] if prefix else key
        if "/" in name or not name:
            continue
        out[name] = (int(e["size"]), e.get("e_tag"))
    pin(root, out)
    return out


def snapshot_size(path: str) -> int | None:
    """The pinned size of the object ``path``, or None when no snapshot listed it."""
    store, key = store_of(path)
    hit = store.pins.get(key)
    return None if hit is None else hit[0]


def pin(root: str, versions: dict[str, tuple[int, str | None]]) -> None:
    """Read the objects under ``root`` at these versions (rank 0's :func:`snapshot`, on every rank)."""
    store, prefix = store_of(root)
    for name, version in versions.items():
        store.pins[f"{prefix}/{name}" if prefix else name] = tuple(version)


def counters(reset_peak: bool = False) -> dict[str, int]:
    """This process's object-store request counters (requests, bytes_fetched, retries, throttled,
    max_inflight); all zero when no URL was used. ``reset_peak``: max_inflight restarts from now."""
    import sys

    if "pipeload.io.objstore" not in sys.modules:  # never imported: nothing was requested
        return {"requests": 0, "bytes_fetched": 0, "retries": 0, "throttled": 0, "max_inflight": 0}
    from .objstore import COUNTERS

    if reset_peak:
        COUNTERS.reset_peak()
    return COUNTERS.snapshot()


# -- writing -------------------------------------------------------------------------------------------


def create(path: str, buffering: int):
    """A new file (``open(path, "wb")``) or object, written through ``write``; closing it completes it.

    An object is uploaded by multipart upload in parts of the bucket's ``part_size`` (at least
    5 MiB, S3's minimum), a small one by a single PUT; it becomes visible whole when closed, never
    partly written."""
    if not is_url(path):
        return open(path, "wb", buffering=buffering)
    store, key = store_of(path)
    return _ObjectWriter(store, key)


class _ObjectWriter:
    def __init__(self, store, key: str):
        self.store, self.key = store, key
        self._w = store.ob.open_writer(store.store, key, buffer_size=max(5 << 20, store.part_size))

    def write(self, data) -> int:
        return self._w.write(data)

    def flush(self) -> None:
        pass

    def close(self) -> None:
        self._w.close()

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
        else:  # an upload that failed is abandoned, never completed
            try:
                self._w.abort()
            except Exception:  # noqa: BLE001
                pass


def durable(f) -> None:
    """Make what was written to ``f`` durable before it is closed (fsync; objects: on completion)."""
    if isinstance(f, _ObjectWriter):
        return
    f.flush()
    os.fsync(f.fileno())


def makedirs(path: str) -> None:
    """``os.makedirs(path, exist_ok=True)``; nothing for a prefix (object stores have no directories)."""
    if not is_url(path):
        os.makedirs(path, exist_ok=True)


def remove(path: str) -> None:
    """Delete a file or object; OSError when that fails (a missing object is not an error)."""
    if not is_url(path):
        os.unlink(path)
        return
    store, key = store_of(path)
    try:
        store.run(store.delete(key))
    except Exception as e:  # noqa: BLE001 - reported as the local call would
        raise OSError(str(e)) from None
    store.pins.pop(key, None)


def put_bytes(path: str, data: bytes) -> None:
    """One object written whole by a single PUT (atomic: readers see the old object or this one)."""
    store, key = store_of(path)
    store.run(store.put(key, data))
    store.pins.pop(key, None)


def size_of(path: str) -> int:
    """Size of a file or object (an object's pinned size, else a HEAD); OSError when absent."""
    if not is_url(path):
        return os.stat(path).st_size
    store, key = store_of(path)
    try:
        return store.version(key)[0]
    except Exception as e:  # noqa: BLE001 - reported as os.stat would
        raise OSError(str(e)) from None


def commit_objects(directory: str, md, write_index, previous_files, metadata_file: str) -> None:
    """The commit of a save into object storage: the chunk index, then ``.metadata`` PUT last.

    A PUT replaces an object atomically: a load that lists the prefix before this PUT sees the
    previous ``.metadata`` and reads the previous data objects (kept until after the PUT); after it,
    the new ones. Raises only before the PUT (a data object of this save missing). The previous
    checkpoint's data objects are deleted after it, best effort.
    """
    METADATA_FILE = metadata_file
    names = snapshot(directory)  # also drops stale pins of an earlier load of this prefix
    missing = [n for n in md.files if n not in names]
    if missing:
        raise FileNotFoundError(f"data object(s) of this save missing before the commit: {', '.join(missing[:3])}")
    previous = previous_files(directory)
    index = write_index(directory, md)
    put_bytes(join(directory, METADATA_FILE), md.to_json_v2(index).encode())  # the commit point
    for name in sorted(previous - {*md.files, index}):
        try:
            remove(join(directory, name))
        except OSError:
            pass


def plain_name(name: str, where: str) -> str:
    """``name`` when it names an object directly under a checkpoint's prefix."""
    if not name or "/" in name or name in (".", ".."):
        raise CheckpointFormatError(f"{where}: {name!r} is not a plain name inside the checkpoint")
    return name
