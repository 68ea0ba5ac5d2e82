"""The one checksum pipeload records per stored chunk: xxh3-64 of the stored bytes, as 16 hex digits."""

from __future__ import annotations

import xxhash


def checksum(data) -> str:
    """xxh3-64 of a bytes-like object (memoryview, bytes, numpy array) as 16 lowercase hex digits."""
    return xxhash.xxh3_64_hexdigest(data)


def hasher() -> "xxhash.xxh3_64":
    """An incremental hasher whose ``hexdigest()`` equals :func:`checksum` of the concatenated input."""
    return xxhash.xxh3_64()
