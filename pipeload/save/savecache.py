"""Save plan reuse: a job saves the same layout every N steps; after the first, planning is one gather.

A save that planned keeps, per process group, what it decided for this rank (:class:`Entry`): its
items (storage key, dtype, lengths and the position of the leaf among the state dict's leaves), the
commit rows, the key table, and the state dict's :func:`pipeload.plan.plancache.signature` (containers,
keys, per tensor its spec, shape, dtype, device). It is kept under a *token*, a hash of every rank's
row of the exchange, so every rank of one save keeps the same token.

The next save offers that token only if its state dict still matches the signature (compared while
walking it, ``_leafplan.match``) and every Python object it holds still serialises safely (objects may
change value between saves: each is re-encoded and rechecked unless it pickles to the bytes it did at
the previous save; their values take no part in the plan). Every rank then sends two words (its offer;
rank 0 also a fresh save id): every rank reuses exactly when every rank offered the same non-zero
token, so all take the same branch, and any rank whose layout changed (offer 0) makes every rank plan
afresh. A kept plan holds no reference to the state dict's values (it keeps the objects' pickles, each
up to :data:`OBJECT_MEMO_BYTES`). At most :data:`CAPACITY` plans are kept per process, several per group
when a job saves several layouts on one group (a full checkpoint and a weights-only export, or
``pipeload.save`` beside ``dcp.save`` under the switch, whose flattened dict is another layout): each
save offers the most recently used plan of its group that its state dict matches. Two layouts may
share a token (a nested dict and its flattened form send equal exchange rows, so they plan the same
table): the token decides only whether every rank reuses, and each rank binds its own matched entry.
"""

from __future__ import annotations

import os
import pickle
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np

from ..plan._leafplan import bind, match
from ..plan.exchange import hash64
from ..formats.metadata import chunk_key
from ..plan.plancache import leaf_positions, signature
from .saveplan import KIND_OBJECT, R_NAMES, R_RECORD, LocalRecord, Plan, _key_columns
from ..plan.statedict import is_container

CAPACITY = 6


@dataclass
class Entry:
    """One rank's decisions of a save, without the state dict: ``specs[i]`` is item ``i``'s
    ``(storage key, dtype, lengths, fqn)``, ``rows[i]`` its commit row; ``objects`` are the fqns of
    every Python object this rank holds (all revalidated at each save)."""

    table: Plan
    specs: list[tuple[str, str, tuple[int, ...], str]]
    rows: list[tuple]
    objects: list[str]
    token: int
    pg: Any = None
    signature: tuple = ()
    positions: dict[str, int] | None = None
    spec_positions: list[int] = field(default_factory=list)  # positions[specs[i].fqn]
    encoded: dict[str, tuple[bytes, bytes]] = field(default_factory=dict)  # fqn -> (pickle, encode_object)
    memo: dict = field(default_factory=dict)  # the plan's derived values, see saver.SavePlan.memo

    @classmethod
    def of(cls, p: Plan, rec: LocalRecord, rank: int, rows: np.ndarray) -> "Entry":
        """This rank's entry from the plan ``p`` (its writers in key order, then its objects by name)."""
        specs, out = [], []
        mine = np.flatnonzero(p.writer == rank)
        mine = mine[np.lexsort(_key_columns(p.chunk_index[mine], p.chunk_offsets[mine], p.chunk_lengths[mine]))]
        for g in mine.tolist():  # in key order
            k = int(p.chunk_index[g])
            d = int(p.ndim[k])
            off = tuple(p.chunk_offsets[g, :d].tolist())
            ln = tuple(p.chunk_lengths[g, :d].tolist())
            fqn = p.names[k]
            specs.append((chunk_key(fqn, off, ln == p.shape_of(k)), p.dtype_name(k), ln, fqn))
            out.append((k, off, ln))
        for k, r in p.object_writer.items():
            if r == rank:
                fqn = p.names[k]
                data = rec.payload[fqn]
                specs.append((f"{fqn}#object", "U8", (len(data),), fqn))
                out.append((k,))
        table = Plan(p.names, p.kind, p.dtype, p.ndim, p.shape)  # the key table only, no chunk arrays
        objects = [e[0] for e in rec.entries if e[1] == KIND_OBJECT]
        return cls(table, specs, out, objects, token_of(rows))


def token_of(rows: np.ndarray) -> int:
    """The same on every rank of one save: a hash of every rank's layout digests."""
    cols = np.ascontiguousarray(np.column_stack([rows[:, R_RECORD : R_RECORD + 2], rows[:, R_NAMES : R_NAMES + 2]]))
    t = hash64(cols.tobytes())
    return t if t != 0 else 1


def items_of(entry: Entry, payload: dict[str, Any]) -> list[tuple[str, str, tuple[int, ...], Any]]:
    """The plan's items with this save's tensors and object bytes."""
    return [(key, dtype, (len(payload[fqn]),) if len(row) == 1 else shape, payload[fqn])
            for (key, dtype, shape, fqn), row in zip(entry.specs, entry.rows)]


class Offer(NamedTuple):
    token: int
    entry: Entry
    items: list


_cache: "OrderedDict[tuple, Entry]" = OrderedDict()  # (group ranks, store count) -> entry, LRU order
_stored = 0


def _key(comm) -> tuple:
    """The group's part of a kept plan's key."""
    return tuple(comm.global_ranks)


def offer(comm, state_dict: dict) -> Offer | None:
    """The kept plan this rank may offer for ``state_dict``, with its items bound to this save's values;
    None when there is none, the layout changed, or an object no longer serialises safely."""
    if not isinstance(state_dict, dict):
        return None
    group = _key(comm)
    for key in reversed([k for k in _cache if k[0] == group]):  # the most recently used first
        e = _cache[key]
        if e.pg is not comm.pg:
            continue
        try:
            found = match(state_dict, is_container, *e.signature)
        except Exception:  # noqa: BLE001 - a leaf whose facts cannot be read (a nested tensor): the full
            return None  # path refuses it, naming the key
        if found is not None:
            return _bound(key, e, found[0])
    return None


def _bound(key: tuple, e: Entry, values: list) -> Offer | None:
    """The offer of the kept plan ``e`` with this save's ``values`` (its leaves, matched)."""
    payload: dict[str, Any] = {}
    try:
        for fqn in e.objects:
            payload[fqn] = encode_again(e.encoded, fqn, values[e.positions[fqn]])
    except ValueError:
        return None  # the full path reports it, naming the key
    _cache.move_to_end(key)
    return Offer(e.token, e, bind(e.specs, e.spec_positions, values, payload))


OBJECT_MEMO_BYTES = 1 << 20  # an object pickling to more is re-encoded at every save, not remembered


def encode_again(memo: dict[str, tuple[bytes, bytes]], fqn: str, value: Any) -> bytes:
    """``encode_object(value)``; the previous save's bytes when ``value`` pickles as it did then
    (``memo``: fqn -> (pickle, encoded bytes) of the previous save, updated here).

    Equal pickles are equal values with the same classes: the bytes and the safety check of the
    previous encoding hold for this one (a ``torch.save`` round trip costs ~0.5 ms an object).
    """
    from .saveplan import encode_object

    try:
        now = pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)
    except Exception:  # noqa: BLE001 - encode_object says what is wrong with it
        now = None
    kept = memo.get(fqn)
    if now is not None and kept is not None and kept[0] == now:
        return kept[1]
    data = encode_object(value)
    if now is not None and len(now) <= OBJECT_MEMO_BYTES:
        memo[fqn] = (now, data)
    return data


def store(comm, state_dict: dict, leaves, entry: Entry) -> None:
    """Keep ``entry`` for the next save on this group (``leaves``: ``flatten(state_dict)``)."""
    entry.pg = comm.pg
    entry.signature = signature(state_dict)[0]
    fqns = sorted({*(s[3] for s in entry.specs), *entry.objects})
    entry.positions = dict(zip(fqns, leaf_positions(leaves, fqns)))
    entry.spec_positions = [entry.positions[s[3]] for s in entry.specs]
    group = _key(comm)
    for k in [k for k, e in _cache.items() if k[0] == group and e.signature == entry.signature]:
        del _cache[k]  # the plan this one replaces (the layout's token may be another's too, see above)
    global _stored
    _stored += 1
    _cache[(group, _stored)] = entry
    while len(_cache) > CAPACITY:
        _cache.popitem(last=False)


def new_save_word() -> int:
    """Rank 0's fresh save id, as the int64 word that carries it."""
    return int.from_bytes(os.urandom(8), "little", signed=True)


def save_id_of(word: int) -> str:
    return f"{word & ((1 << 64) - 1):016x}"


def all_reuse(tokens: np.ndarray) -> bool:
    return bool(tokens[0] != 0 and np.all(tokens == tokens[0]))


def clear() -> None:
    """Forget every kept save plan."""
    _cache.clear()
