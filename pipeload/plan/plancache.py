"""Plan reuse: a second load of the same checkpoint into the same layout on the same group skips planning.

Evaluation loops, weight refreshes in RL and retries load one checkpoint into one state dict again and
again. The first load keeps what it planned — the metadata, this rank's local plan, the global plan and
the process groups it created — under a *token*, a hash of every rank's exchange row. A later load offers
that token only if nothing it planned from has changed on this rank: the same ``.metadata`` file (inode,
size, mtime; for a Hugging Face checkpoint, its files), the same keys with the same dtypes, shapes,
devices and layouts (:func:`signature`: the containers' keys and each leaf's facts), the same options. A kept plan holds no reference to the state
dict: the load that reuses it points it at its own tensors and containers. Whether to reuse is then decided by one all-gather of
four words per rank (:func:`pipeload.engine.loader`): every rank reuses exactly when every rank offered the same
non-zero token, so every rank takes the same decision and the collectives that follow stay in one order.

Groups a load created stay alive while their plan is cached (at most :data:`CAPACITY` plans per
process); an evicted plan's groups are destroyed (best effort). :func:`clear` drops them all.
"""

from __future__ import annotations

import hashlib
import os
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from ._leafplan import match, walk
from .statedict import Leaf, check_top, is_container

CAPACITY = 2


@dataclass
class Entry:
    pg: Any  # the load's process group object (held: its id cannot be reused while cached)
    stat: tuple  # of .metadata
    signature: tuple  # of the state dict's leaves, after the load
    token: int
    state: Any  # what the loader needs to run the load again (its own dataclass)
    created: list  # groups the load created, destroyed on eviction


_cache: "OrderedDict[tuple, Entry]" = OrderedDict()


def _stat(path: str) -> tuple:
    try:
        st = os.stat(path)
    except OSError:
        return ()
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)


def checkpoint_stat(path: str) -> tuple:
    """What identifies this version of the checkpoint at ``path`` (any layout); () when unknown.

    pipeload and torch DCP rewrite ``.metadata`` on every save (a new inode by rename); a Hugging Face
    checkpoint is its ``*.safetensors`` files and index, each of which is checked.
    """
    if os.path.isfile(path):
        return _stat(path)
    md = _stat(os.path.join(path, ".metadata"))
    if md:
        return md
    try:
        names = sorted(n for n in os.listdir(path) if n.endswith((".safetensors", ".json")))
    except OSError:
        return ()
    return tuple((n, *_stat(os.path.join(path, n))) for n in names) if names else ()


def signature(state_dict: dict) -> tuple[tuple, list, dict[int, tuple]]:
    """(what a local plan is computed from, the leaf values in flatten order, ``{position: (container,
    key)}`` of the leaves that are not tensors).

    The first part is compared between loads: the containers as :func:`~pipeload.plan.statedict.flatten`
    visits them (a dict's keys with their types, a list's length, which children are containers
    themselves; a state dict built in another order does not reuse the plan: conservative, and no
    sort), and per leaf its facts: a DTensor's spec
    (mesh, placements, global shape, stride, dtype: its box on this rank and its device follow from
    them), a plain tensor's shape, dtype, device type, class and layout (a kept plan never copies into another kind of tensor), nothing for an object (objects are replaced in
    whatever container holds them at load time). Equal containers name every leaf alike, so the leaves
    are not named here: a plan kept with :func:`leaf_positions` finds its tensors and objects by position.

    Tensor identities are not part of it: a kept plan holds no reference to the state dict and is
    pointed at the tensors of the load that reuses it. A load that may reuse a plan does not build its
    signature: :func:`lookup` compares the state dict with the kept one as it walks it. A DTensor keeps
    its spec object while its layout is unchanged, and an unchanged dict its key objects, so comparing
    the same state dict again costs an address comparison per key and per leaf; a rebuilt state dict
    (new DTensors, new specs, new key strings) compares them by value.
    """
    check_top(state_dict)
    nodes, facts, values, homes = walk(state_dict, is_container)  # (compiled)
    return (tuple(nodes), tuple(facts)), values, homes


def leaf_positions(leaves: dict[str, Leaf], fqns) -> list[int]:
    """Where each of ``fqns`` lies among ``leaves`` (flatten's order: that of :func:`signature`'s leaves)."""
    at = {fqn: i for i, fqn in enumerate(leaves)}
    return [at[f] for f in fqns]


def token_of(rows: np.ndarray, options: tuple) -> int:
    h = hashlib.blake2b(np.ascontiguousarray(rows).tobytes() + repr(options).encode(), digest_size=8)
    t = int.from_bytes(h.digest(), "little", signed=True)
    return t if t not in (0, -1) else 1  # 0: no plan offered; -1: the loader's "contended" word


def key(global_ranks, directory: str, options: tuple) -> tuple:
    return (tuple(global_ranks), os.path.realpath(directory), options)


def holds(k: tuple) -> bool:
    """Whether a plan is kept under ``k`` (cheap: no signature needed to know there is none)."""
    return k in _cache


def lookup(k: tuple, pg: Any, stat: tuple, state_dict: dict) -> tuple[Entry, tuple[list, dict]] | None:
    """``(entry, (values, homes))`` when the plan cached under ``k`` was made on ``pg`` from this version of
    the checkpoint (``stat``) for a state dict of ``state_dict``'s :func:`signature` (then its token may be
    offered; ``values`` and ``homes`` are that signature's), else None. The state dict is compared as it
    is walked, nothing built for the comparison (``_leafplan.match``)."""
    e = _cache.get(k)
    if e is None or e.pg is not pg or not stat or e.stat != stat:
        return None
    check_top(state_dict)
    found = match(state_dict, is_container, *e.signature)
    if found is None:
        return None
    _cache.move_to_end(k)
    return e, found


def store(k: tuple, entry: Entry, destroy: Callable[[list], None]) -> None:
    old = _cache.pop(k, None)
    if old is not None and old.created and old.created is not entry.created:
        destroy(old.created)
    _cache[k] = entry
    while len(_cache) > CAPACITY:
        _, ev = _cache.popitem(last=False)
        if ev.created:
            destroy(ev.created)


def drop(k: tuple, destroy: Callable[[list], None]) -> None:
    e = _cache.pop(k, None)
    if e is not None and e.created:
        destroy(e.created)


def clear() -> None:
    """Forget every cached plan and destroy the process groups those loads created (best effort)."""
    from ..engine.comm import destroy_groups

    while _cache:
        _, e = _cache.popitem()
        if e.created:
            destroy_groups(e.created)
