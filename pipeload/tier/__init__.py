"""A checkpoint tier in host memory: :class:`MemoryTier`, a location ``pipeload.save`` snapshots into.

The package is one room beside the engine and the saver: :mod:`.format` (the files under a host's
root), :mod:`.snapshot` (``pipeload.save(state_dict, tier, step=N)``). The engine and the saver reach
it only through the dispatch in ``pipeload.save`` / ``pipeload.load`` on ``isinstance(location,
MemoryTier)``.
"""

from __future__ import annotations

import os

from .format import check_job, default_job, list_steps


class MemoryTier:
    """A checkpoint location in host memory, replicated across hosts.

    ``root`` is this rank's host's directory of the tier, normally on a tmpfs (``/dev/shm/pipeload/<job>``,
    which survives the restart of the training processes on a healthy host). Every rank passes its own
    host's root; nothing requires the roots of two hosts to be equal or visible to each other. Hosts are
    ``socket.gethostname()`` (``PIPELOAD_HOST_ID`` overrides it, e.g. to emulate nodes on one machine).

    A snapshot (``pipeload.save(state_dict, tier, step=N)``) writes every rank's whole state (its local
    tensors, DTensor local shards and Python objects: no deduplication) into one file on its own host,
    and a copy of it on the next ``replicas - 1`` hosts of the ring of hosts (all hosts when there are
    fewer). The step becomes the tier's newest only once every rank of the snapshot wrote its file and
    its copies; then each host keeps its ``keep`` newest complete steps and removes the older ones.

    **Memory per host.** With ``S_h`` the bytes of host ``h``'s ranks' state (tensor bytes plus the
    ``torch.save`` bytes of objects), host ``h`` holds its own ``S_h`` and a copy of ``S_g`` for each of
    the ``replicas - 1`` hosts ``g`` before it in the ring: about ``replicas x S_h`` when hosts hold alike,
    times ``keep`` at rest and ``keep + 1`` while a snapshot is written (the previous complete step is
    removed only after the new one is complete everywhere).

    ``job`` (default ``PIPELOAD_JOB_ID``, else ``TORCHELASTIC_RUN_ID``, else ``"default"``) is recorded in
    the root's ``TIER.json``: a root of another job holds nothing for this one (a load warns and treats
    it as empty; a snapshot refuses it, never touching its files).
    """

    def __init__(self, root: str | os.PathLike, replicas: int = 2, job: str | None = None, keep: int = 1):
        if isinstance(root, (bytes, bytearray)) or not isinstance(root, (str, os.PathLike)):
            raise TypeError(f"MemoryTier root must be a str or os.PathLike, not {type(root).__name__}")
        path = os.fspath(root)
        if not isinstance(path, str) or not path:
            raise ValueError(f"MemoryTier root must be a non-empty path, not {path!r}")
        for name, value in (("replicas", replicas), ("keep", keep)):
            if type(value) is not int or value < 1:
                raise ValueError(f"MemoryTier {name} must be an integer >= 1, not {value!r}")
        self.root = os.path.abspath(path)
        self.replicas = replicas
        self.keep = keep
        self.job = check_job(default_job() if job is None else job)

    def steps(self) -> list[int]:
        """The complete steps this host's root holds for this job, oldest first (no collective)."""
        return [s for s, info in list_steps(self.root, self.job).items() if info["complete"]]

    def __repr__(self) -> str:
        return f"MemoryTier({self.root!r}, replicas={self.replicas}, job={self.job!r}, keep={self.keep})"


__all__ = ["MemoryTier"]
