"""Did every rank of the group make this call? Asked before a collective load a framework may skip on some ranks.

A trainer decides per rank whether it loads (Lightning resolves ``ckpt_path="last"`` from each rank's own
view of the file system, Accelerate and transformers test ``os.path.exists`` per rank). A rank that skips a
collective the others entered leaves them waiting for good. So before an integration issues
:func:`pipeload.load_file` its ranks meet in the process group's *store* (the key-value store the group
was created with; it is not a collective and no rank waits on a rank that is not there):

- each caller adds one to ``<key>/arrived``; the caller that brings it to the group's size proposes
  ``all``, a caller that waited ``timeout`` seconds without a decision proposes ``some``;
- the store's ``compare_set`` keeps the first proposal, and every caller follows that one.

Hence the invariant: the answer is the same on every rank that asks, and ``all`` is only ever answered
when every rank of the group asked, so the collective that follows has all its members. A rank that asks
late gets the decision already taken. ``some`` costs the callers ``timeout`` seconds and sends them to a
local read: slower, never wrong, never a hang.

Keys are ``pipeload/integrations/<site>/<digest of what is loaded>/<n>``, ``n`` counting this process's
questions about that object: ranks that load the same files in the same order meet on the same keys (the
callers pass the absolute path: ranks that name one file differently never meet, and read it locally). A
rank that skipped a load stays one question behind for that object, so its later loads go the local way
(each after a ``timeout``); other objects are not affected. The keys assume the store belongs to this
job: ``init_process_group`` makes a fresh one, and torchrun's agent a new one for every restart; a store
that already held another job's keys could answer for ranks that are gone.
"""

from __future__ import annotations

import hashlib
import os
from collections import Counter
from datetime import timedelta
from typing import Optional

import torch.distributed as dist

_asked: Counter = Counter()

ALL = "all"
SOME = "some"


def _store(group):
    from torch.distributed import distributed_c10d as c10d

    if group is None:
        return c10d._get_default_store()
    return c10d._get_process_group_store(group)


def every_rank_calls(site: str, what: str, *, group=None, timeout: float = 60.0) -> bool:
    """True when every rank of ``group`` (default: the world) asked this question about ``what``.

    Without an initialised process group, or in a group of one, there is nobody to wait for: True.
    """
    if not (dist.is_available() and dist.is_initialized()):
        return True
    size = dist.get_world_size(group)
    if size == 1:
        return True
    digest = hashlib.sha1(what.encode()).hexdigest()[:16]
    _asked[(site, digest)] += 1
    key = f"pipeload/integrations/{site}/{digest}/{_asked[(site, digest)]}"
    store = _store(group)
    if store.add(f"{key}/arrived", 1) == size:
        return store.compare_set(f"{key}/decision", "", ALL).decode() == ALL
    try:
        store.wait([f"{key}/decision"], timedelta(seconds=timeout))
    except RuntimeError:  # DistStoreError (TCPStore) and RuntimeError (FileStore) on a timeout
        pass
    return store.compare_set(f"{key}/decision", "", SOME).decode() == ALL


def load_once(site: str, path: str, fallback, *, group=None, timeout: float = 60.0, **load_kwargs):
    """``(obj, stats)``: ``path`` through :func:`pipeload.load_file` when every rank of ``group`` asked for it
    (one read for the group; ``stats`` its :class:`pipeload.FileStats`), else ``(fallback(), None)``: the
    framework's own read, on this rank alone."""
    if not every_rank_calls(site, os.path.abspath(path), group=group, timeout=timeout):
        return fallback(), None
    from ..engine.wholefile import FileStats, load_file

    stats = FileStats()
    return load_file(path, process_group=group, stats=stats, **load_kwargs), stats


def weights_only_of(weights_only: Optional[bool]) -> bool:
    """``torch.load``'s reading of ``weights_only=None``: True unless ``TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD``
    says otherwise (``TORCH_FORCE_WEIGHTS_ONLY_LOAD`` wins over an explicit False, as in torch)."""
    truthy = ("1", "y", "yes", "true")
    if os.getenv("TORCH_FORCE_WEIGHTS_ONLY_LOAD", "0").lower() in truthy:
        return True
    if weights_only is None:
        return os.getenv("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", "0").lower() not in truthy
    return weights_only
