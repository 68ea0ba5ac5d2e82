"""What ranks tell each other before a load: one fixed-size row per rank, then each distinct plan once.

Pure data formats and decisions; the collectives that move them are in :mod:`pipeload.engine.comm`.

A load's exchange has two steps, both over the load's group and taken by every rank:

1. **Rows.** An all-gather of one :data:`ROW_WORDS`-word int64 row per rank: a flag word (this rank has
   problems to report; some box of its is not exactly one stored chunk), a hash of the save id it read, the 128-bit digest and the byte length of its
   plan record, its host, its key-owner threshold (:mod:`pipeload.plan.keyowners`) and the digests of up
   to :data:`MAX_GROUPS` process groups it could reuse. ``W`` rows cost every rank ``W x 128`` bytes: 2 MiB at 16,384 ranks.
2. **Distinct records.** Ranks whose records have the same digest are replicas of one another (data
   parallelism makes most ranks byte-identical to others); only the lowest rank of each digest, its
   *owner*, sends its record. :func:`record_transfer` decides how, from the rows alone (so every rank
   decides alike): one broadcast per owner when there are few distinct records, one padded all-gather
   when nearly every rank is distinct (``R = 1`` layouts, where the records are also of nearly equal
   size, so padding costs little).

   When that would move many bytes to every rank (nearly every record distinct: ``R = 1``), the
   records stay home and shared keys are found through key owners instead (:mod:`pipeload.plan.keyowners`,
   chosen from the rows by :func:`pipeload.plan.keyowners.use_key_owners`).

Problem texts travel only when some row carries the problem flag (a third, rare all-gather).

A record is columnar: ``[version, n_shards, n_objects, width, itemsize, has_affinity]`` then the arrays
``index``, ``broadcastable``, ``affinity`` (only when ``has_affinity``), ``offsets`` (n x width),
``lengths`` (n x width), ``objects``, all int32 when every value fits, int64 otherwise. ``width`` is the
largest tensor rank of the checkpoint; shorter shapes are padded with zeros (a tensor's true rank comes
from the metadata). ``affinity`` is the rank the layout names as the writer of the file a shard is
stored in, or -1 (see :mod:`pipeload.plan.globalplan`); a record without it means -1 everywhere.
"""

from __future__ import annotations

import hashlib
import os
import socket
from typing import NamedTuple, Sequence

import numpy as np

ROW_WORDS = 16
MAX_GROUPS = 8  # reusable groups a rank can offer; more are ignored (the load then creates or reads privately)

# row layout
F_FLAGS, F_SAVE, F_DIGEST, F_NBYTES, F_HOST, F_KEYOWNER, F_NGROUPS, F_GROUPS = 0, 1, 2, 4, 5, 6, 7, 8
FLAG_PROBLEMS = 1
FLAG_RESHARDED = 2  # some box of this rank is not exactly one stored chunk (pipeload.plan.chunkunits)

_RECORD_VERSION = 2
_HEADER = 6
_I32_MAX = 2**31 - 1

# above this many distinct records, one padded all-gather replaces the per-owner broadcasts
MAX_RECORD_BROADCASTS = 64
# record bytes per rank from which a load finds shared keys through key owners (pipeload.plan.keyowners)
KEY_OWNER_BYTES = 8 << 20


def key_owner_threshold() -> int:
    """This rank's key-owner threshold (row word ``F_KEYOWNER``): ``PIPELOAD_KEY_OWNER_BYTES`` or
    :data:`KEY_OWNER_BYTES`. The smallest over the gathered rows decides, so ranks may disagree."""
    return int(os.environ.get("PIPELOAD_KEY_OWNER_BYTES", KEY_OWNER_BYTES))


def hash64(data: bytes) -> int:
    """A signed 64-bit hash (fits an int64 row word)."""
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little", signed=True)


def group_digest(global_ranks) -> int:
    """The identifier of a process group in rows: a hash of its sorted global ranks."""
    return hash64(np.asarray(sorted(global_ranks), dtype=np.int64).tobytes())


def host_id() -> int:
    """This process's host, as a hash. ``PIPELOAD_HOST_ID`` overrides it (emulating separate nodes)."""
    return hash64((os.environ.get("PIPELOAD_HOST_ID") or socket.gethostname()).encode())


class Record(NamedTuple):
    """A decoded plan record: the destination shards and objects one rank (and its replicas) load."""

    index: np.ndarray  # (n,) checkpoint key index of each shard
    broadcastable: np.ndarray  # (n,) bool
    affinity: np.ndarray | None  # (n,) the rank that wrote each shard's file, or -1; None: -1 for all
    offsets: np.ndarray  # (n, width)
    lengths: np.ndarray  # (n, width)
    objects: np.ndarray  # (m,) checkpoint key index of each object


def padded(shapes: Sequence[tuple[int, ...]], width: int) -> np.ndarray:
    """``shapes`` (offsets or lengths of several boxes) as one ``n x width`` int64 array, zero-padded."""
    pad = [(0,) * k for k in range(width + 1)]
    return np.array([s + pad[width - len(s)] for s in shapes], dtype=np.int64).reshape(len(shapes), width)


def encode_record(index, broadcastable, offsets, lengths, objects, width: int, affinity=None) -> bytes:
    """The record bytes of one rank's plan (see the module docstring); identical plans give identical bytes."""
    n, m = len(index), len(objects)
    index = np.asarray(index, dtype=np.int64).reshape(n)
    affinity = np.full(n, -1, dtype=np.int64) if affinity is None else np.asarray(affinity, dtype=np.int64).reshape(n)
    offsets = np.asarray(offsets, dtype=np.int64).reshape(n, width)
    lengths = np.asarray(lengths, dtype=np.int64).reshape(n, width)
    objects = np.asarray(objects, dtype=np.int64).reshape(m)
    big = max((int(a.max()) for a in (index, offsets, lengths, objects, affinity) if a.size), default=0)
    dtype = np.int32 if big <= _I32_MAX else np.int64
    has_affinity = bool(np.any(affinity >= 0))
    parts = [
        np.asarray([_RECORD_VERSION, n, m, width, np.dtype(dtype).itemsize, has_affinity], dtype=np.int64).tobytes(),
        index.astype(dtype).tobytes(),
        np.asarray(broadcastable, dtype=bool).reshape(n).astype(dtype).tobytes(),
        affinity.astype(dtype).tobytes() if has_affinity else b"",
        offsets.astype(dtype).tobytes(),
        lengths.astype(dtype).tobytes(),
        objects.astype(dtype).tobytes(),
    ]
    return b"".join(parts)


def decode_record(data: bytes | memoryview) -> Record:
    """Inverse of :func:`encode_record`: zero-copy int32 or int64 views of ``data`` (bool copied)."""
    head = np.frombuffer(data, dtype=np.int64, count=_HEADER)
    version, n, m, width, itemsize, has_affinity = (int(x) for x in head)
    if version != _RECORD_VERSION or itemsize not in (4, 8) or has_affinity not in (0, 1):
        raise ValueError(f"unknown plan record (version {version}, itemsize {itemsize})")
    body = np.frombuffer(data, dtype=np.int32 if itemsize == 4 else np.int64, offset=_HEADER * 8)
    if body.size != n * (2 + has_affinity + 2 * width) + m:
        raise ValueError("plan record has the wrong length")
    a = 0  # arrays stay views in the stored integer type; consumers widen what they compute with
    index = body[a : a + n]
    a += n
    bc = body[a : a + n].astype(bool)
    a += n
    if has_affinity:
        affinity = body[a : a + n]
        a += n
    else:
        affinity = None
    offsets = body[a : a + n * width].reshape(n, width)
    a += n * width
    lengths = body[a : a + n * width].reshape(n, width)
    a += n * width
    return Record(index, bc, affinity, offsets, lengths, body[a : a + m])


def record_digest(record: bytes) -> tuple[int, int]:
    d = hashlib.blake2b(record, digest_size=16).digest()
    return int.from_bytes(d[:8], "little", signed=True), int.from_bytes(d[8:], "little", signed=True)


def make_row(*, record: bytes, save_id: str | None, problems: bool, host: int,
             groups: list[int] = (), digest: tuple[int, int] | None = None,
             key_owner_bytes: int | None = None, resharded: bool = False) -> np.ndarray:
    """One rank's row; ``digest`` is :func:`record_digest` of ``record`` when the caller has it;
    ``key_owner_bytes``: the threshold this rank offers (None: :func:`key_owner_threshold`);
    ``resharded``: some box of this rank is not exactly one stored chunk."""
    row = np.zeros(ROW_WORDS, dtype=np.int64)
    row[F_FLAGS] = (FLAG_PROBLEMS if problems else 0) | (FLAG_RESHARDED if resharded else 0)
    row[F_SAVE] = hash64(save_id.encode()) if save_id else 0
    row[F_DIGEST : F_DIGEST + 2] = digest if digest is not None else record_digest(record)
    row[F_NBYTES] = len(record)
    row[F_HOST] = host
    row[F_KEYOWNER] = key_owner_threshold() if key_owner_bytes is None else key_owner_bytes
    groups = sorted(set(groups))[:MAX_GROUPS]
    row[F_NGROUPS] = len(groups)
    row[F_GROUPS : F_GROUPS + len(groups)] = groups
    return row


class Classes(NamedTuple):
    """Ranks grouped by identical records; classes are numbered by their owner (lowest rank)."""

    of_rank: np.ndarray  # (W,) class of each rank
    owners: np.ndarray  # (D,) owner rank of each class, ascending
    members: list[np.ndarray]  # per class, its ranks ascending
    nbytes: np.ndarray  # (D,) record length of each class


def classes(rows: np.ndarray) -> Classes:
    """Group the ranks of ``rows`` by record digest (a pure function of the rows)."""
    keys = np.ascontiguousarray(rows[:, F_DIGEST : F_DIGEST + 2]).view([("a", np.int64), ("b", np.int64)]).ravel()
    _, first, inverse = np.unique(keys, return_index=True, return_inverse=True)
    # renumber by owner so that class order does not depend on digest values
    by_owner = np.argsort(first, kind="stable")
    rank_of = np.empty_like(by_owner)
    rank_of[by_owner] = np.arange(len(by_owner))
    of_rank = rank_of[inverse.ravel()]
    owners = first[by_owner]
    order = np.argsort(of_rank, kind="stable")
    bounds = np.searchsorted(of_rank[order], np.arange(len(owners) + 1))
    members = [order[bounds[c] : bounds[c + 1]] for c in range(len(owners))]
    return Classes(of_rank, owners, members, rows[owners, F_NBYTES].copy())


class Transfer(NamedTuple):
    """How the distinct records move: ``"broadcast"`` one per owner in owner order, or ``"gather"``."""

    how: str
    owners: np.ndarray
    pad: int  # record length every rank sends in a padded all-gather


def record_transfer(cls: Classes, world: int) -> Transfer:
    if len(cls.owners) <= 1:
        return Transfer("none", cls.owners, 0)
    if len(cls.owners) > MAX_RECORD_BROADCASTS or world * int(cls.nbytes.max()) <= 2 * int(cls.nbytes.sum()):
        return Transfer("gather", cls.owners, int(cls.nbytes.max()))
    return Transfer("broadcast", cls.owners, 0)


def received_bytes(t: Transfer, cls: Classes, rank: int, world: int) -> int:
    """Record bytes ``rank`` receives in transfer ``t`` (what the simulation reports)."""
    if t.how == "gather":
        return (world - 1) * t.pad
    if t.how == "broadcast":
        mine = cls.of_rank[rank]
        return int(cls.nbytes.sum()) - int(cls.nbytes[mine])
    return 0
