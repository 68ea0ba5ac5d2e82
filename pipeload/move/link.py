"""A live transfer's view of its process group, through the group object's own methods.

RL frameworks join their trainer ranks and their engine ranks in a group of its own, often built from
a store beside each side's default world (``ProcessGroupGloo(store, rank, size)``, NCCL's likewise):
such a group is not registered with ``torch.distributed``, whose module-level calls (``dist.isend``,
``dist.all_gather_into_tensor``) then refuse it. Every call here goes through the object itself
(``pg.send``, ``pg._allgather_base``, ``pg.alltoall_base``) with group ranks, which works for a bare
group and for one of the default world alike. ``group=None`` is the default world when one is
initialised, else a world of one (every collective a local no-op).

The methods are the ones :class:`pipeload.move.mover.Transfers` and the transfer's planning ask of a
:class:`pipeload.engine.comm.Comm`, with the same failure contract: a failed or timed-out call raises
:class:`pipeload.PipeloadError` naming the call, the group's size and this rank; the group's own
timeout (set by whoever built it) bounds every wait.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from .. import device as devices
from ..errors import DistributedError, PipeloadError


ONE_ROUND_BYTES = 16 << 20  # gathers up to this size go through gloo's all-to-all (as Comm's do)


class Link:
    """Rank, size and the collectives of one process group object (see the module docstring)."""

    def __init__(self, group: Any = None):
        if group is None and dist.is_available() and dist.is_initialized():
            group = dist.group.WORLD
        self.pg = group
        if group is None:
            self.rank, self.size, self.global_ranks = 0, 1, [("local", 0)]
            self.device = torch.device("cpu")
            return
        if not all(hasattr(group, m) for m in ("rank", "size", "send", "recv", "alltoall_base")):
            raise TypeError(f"group must be a torch.distributed ProcessGroup (or a backend such as "
                            f"ProcessGroupGloo built on a store), got {type(group).__qualname__}")
        self.rank, self.size = int(group.rank()), int(group.size())
        self.global_ranks = _identity(group, self.size)
        self.device = devices.broadcast_device(_backend(group))
        # gloo's all-gather is a ring (a dead member stalls its successors until the timeout); its
        # all-to-all talks to every peer directly, so every rank sees a dead peer at once
        self.one_round = self.device.type == "cpu"

    # -- point to point ------------------------------------------------------------------------------

    def isend(self, buf: torch.Tensor, peer: int):
        return self.pg.send([buf], peer, 0)

    def irecv(self, buf: torch.Tensor, peer: int):
        return self.pg.recv([buf], peer, 0)

    # -- collectives ---------------------------------------------------------------------------------

    def gather_rows(self, row: np.ndarray, what: str, call: str = "all-gather of transfer rows") -> np.ndarray:
        """Every rank's fixed-size int64 ``row``, stacked (``W x len(row)``)."""
        row = np.ascontiguousarray(row, dtype=np.int64)
        if self.size == 1:
            return row.reshape(1, -1).copy()
        mine = torch.from_numpy(row).to(self.device)
        out = torch.empty(self.size * len(row), dtype=torch.int64, device=self.device)
        if self.one_round and out.numel() * 8 <= ONE_ROUND_BYTES:
            every = torch.from_numpy(np.tile(row, self.size))
            self._run(lambda: self.pg.alltoall_base(out, every, [], []), what, call)
        else:
            self._run(lambda: self.pg._allgather_base(out, mine), what, call)
        return out.cpu().numpy().reshape(self.size, len(row))

    def all_to_all(self, counts: np.ndarray, words: np.ndarray, what: str,
                   call: str = "all-to-all of transfer boxes") -> tuple[np.ndarray, np.ndarray]:
        """``counts[d]`` int64 words of ``words`` (in destination order) to rank ``d``; returns (words
        received from each source, the words in source order). Two all-to-alls: counts, then words."""
        counts = np.ascontiguousarray(counts, dtype=np.int64)
        if self.size == 1:
            return counts.copy(), np.asarray(words, dtype=np.int64).copy()
        got = torch.empty(self.size, dtype=torch.int64, device=self.device)
        send = torch.from_numpy(counts).to(self.device)
        self._run(lambda: self.pg.alltoall_base(got, send, [], []), what, call)
        got_counts = got.cpu().numpy()
        data = torch.from_numpy(np.ascontiguousarray(words, dtype=np.int64)).to(self.device)
        out = torch.empty(int(got_counts.sum()), dtype=torch.int64, device=self.device)
        self._run(lambda: self.pg.alltoall_base(out, data, got_counts.tolist(), counts.tolist()), what, call)
        return got_counts, out.cpu().numpy()

    def agree(self, what: str, error: str | None, call: str = "final agreement") -> None:
        """Raise one :class:`pipeload.DistributedError` on every rank if any rank passes an error: one
        gather of two words per rank, and only when some rank failed, a second one of the texts."""
        text = (error or "").encode()[:65536]
        rows = self.gather_rows(np.array([error is not None, len(text)], dtype=np.int64), what, call)
        if not rows[:, 0].any():
            return
        width = -(-int(rows[:, 1].max()) // 8)
        mine = np.zeros(width * 8, dtype=np.uint8)
        mine[: len(text)] = np.frombuffer(text, dtype=np.uint8)
        every = self.gather_rows(mine.view(np.int64), what, "all-gather of failures").view(np.uint8)
        failures = {r: bytes(every[r, : rows[r, 1]]).decode(errors="replace")
                    for r in range(self.size) if rows[r, 0]}
        raise DistributedError(what, failures)

    def _run(self, post, what: str, call: str) -> None:
        try:
            post().wait()
        except Exception as e:  # noqa: BLE001 - a peer died or timed out: raised naming the call
            raise self._fail(what, call, e) from e

    def _fail(self, what: str, call: str, e: Exception) -> PipeloadError:
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        return PipeloadError(f"{what}: the {call} over {self.size} ranks failed on rank {self.rank} "
                             f"({type(e).__name__}: {first}); every rank of the group must make the same call")


def _identity(group, size: int) -> list:
    """The group's members as the one-operation-per-group guard keys them
    (:mod:`pipeload.engine._busy`): global ranks for a group of the default world, else keys of this
    group object alone (a bare group shares no communicator with any other)."""
    try:
        if dist.is_initialized():
            return list(dist.get_process_group_ranks(group))
    except Exception:  # noqa: BLE001 - not registered with the default world
        pass
    return [("group", id(group), r) for r in range(size)]


def _backend(group) -> str:
    try:
        return str(dist.get_backend_config(group))
    except Exception:  # noqa: BLE001 - a bare group: its backend's own name
        return str(group.name())
