"""Everything pipeload asks of ``torch.distributed`` on groups of the default world; no other module
calls it but :mod:`pipeload.move.link` (a live transfer's group, which need not lie in the default world).

:class:`Comm` is one save's or load's view of its process group. Without an initialised process group
it is a world of one (evaluation, conversion, inspection) and every collective is a local no-op.

Rules kept here (see docs/ARCHITECTURE.md, "Why this cannot deadlock"):

- every rank of the group calls the same collectives in the same order, decided by data all ranks
  share (the gathered plan), never by local state;
- a process group is created only by a decision every rank takes alike from gathered data; groups are
  created in one global order, with the load's timeout;
- a failure on one rank is gathered and raised on every rank (:meth:`Comm.agree`).
"""

from __future__ import annotations

import asyncio
import warnings
from datetime import timedelta
from typing import Any, Callable, Iterable

import numpy as np
import torch
import torch.distributed as dist

from .. import device as devices
from ..errors import DistributedError, PipeloadError
from ..plan.exchange import Classes, Transfer, group_digest
from ..plan.globalplan import contains


# torch 2.13 renamed all_gather_into_tensor (the old name warns); older releases only have the old one
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def backend_config(pg) -> str:
    """A group's backend config: ``"cpu:gloo,cuda:nccl"``, ``"cpu:gloo,npu:hccl"``, or a bare name."""
    try:
        return str(dist.get_backend_config(pg))
    except Exception:  # noqa: BLE001 - a backend registered without a config: its name
        return str(pg._get_backend_name())


def _backends_by_device(config: str) -> dict[str, str]:
    """Device type -> backend name of a group's ``config``, e.g. {"cpu": "gloo", "cuda": "nccl"}."""
    if ":" not in config:
        return {devices.device_moving(config) or "cpu": config}
    return dict(part.split(":", 1) for part in config.split(",") if ":" in part)


ONE_ROUND_BYTES = 16 << 20  # gathers up to this size go through gloo's all-to-all (see Comm._all_gather)
PROBE_SECONDS = 2.0  # how long a rank whose collective failed waits for its peers to check in
_PROBE_NAMING_LIMIT = 256  # groups larger than this are probed by count only (one store key per rank)
_probes: dict[str, int] = {}  # group key -> failure probes this process ran on it


def _silent_peers(comm: "Comm") -> str:
    """After a failed collective: which ranks of the group stopped answering, as a sentence ('' if unknown).

    Every rank that sees a collective of the group fail checks in on the job's store (the one
    ``init_process_group`` made; nothing of pipeload's own) and waits up to PROBE_SECONDS for the
    others. A rank that never checks in is dead or stuck outside pipeload. Best effort: a store that
    died with its host rank, or a survivor that noticed the failure much later, makes this say less.
    """
    try:
        store = dist.distributed_c10d._get_default_store()
        import hashlib
        import time

        group = hashlib.sha1((comm.probe_tag + ",".join(map(str, comm.global_ranks))).encode()).hexdigest()[:16]
        gen = _probes[group] = _probes.get(group, 0) + 1
        prefix = f"pipeload/alive/{group}/{gen}/"
        me = dist.get_rank()
        store.set(prefix + str(me), b"1")
        arrived = store.add(prefix + "n", 1)
        deadline = time.monotonic() + min(PROBE_SECONDS, comm.timeout.total_seconds())
        while arrived < comm.size and time.monotonic() < deadline:
            time.sleep(0.05)
            arrived = store.add(prefix + "n", 0)
        if arrived >= comm.size:
            return ""
        if comm.size > _PROBE_NAMING_LIMIT:
            return (f"; {comm.size - arrived} of the group's {comm.size} ranks stopped answering (dead, or "
                    f"stuck outside this call)")
        silent = [r for r, g in enumerate(comm.global_ranks) if g != me and not store.check([prefix + str(g)])]
        comm.silent_ranks = silent
        if not silent:
            return ""
        return f"; rank(s) {', '.join(map(str, silent))} stopped answering (dead, or stuck outside this call)"
    except Exception:  # noqa: BLE001 - the probe only adds detail to an error already being raised
        return ""


class Comm:
    """A group's rank, size and collectives, plus the broadcast groups one load uses."""

    def __init__(self, process_group=None, timeout: timedelta | float | None = None):
        self.active = dist.is_available() and dist.is_initialized()
        if not self.active:
            if process_group is not None:
                raise PipeloadError("process_group was given but torch.distributed is not initialised")
            self.pg = None
            self.rank, self.size, self.global_ranks = 0, 1, [0]
            self.is_world = True
            self.broadcast_device = torch.device("cpu")
            self.timeout = timedelta(seconds=float(timeout or 1800))
            return
        self._silent: str | None = None
        self.silent_ranks: list[int] = []  # filled by the probe after a failed collective
        self.probe_tag = ""  # sets apart the probes of two groups of the same ranks (a save's own group)
        self.pg = process_group if process_group is not None else dist.group.WORLD
        self.rank = dist.get_rank(self.pg)
        if self.rank < 0:
            raise PipeloadError(
                f"global rank {dist.get_rank()} is not a member of the process_group passed to pipeload"
            )
        self.size = dist.get_world_size(self.pg)
        self.global_ranks = list(dist.get_process_group_ranks(self.pg))
        self.is_world = self.global_ranks == list(range(dist.get_world_size()))
        config = backend_config(self.pg)
        backends = _backends_by_device(config)
        # One device type for every broadcast of the load: the accelerator when the group has a backend
        # that moves its tensors (NCCL, HCCL, XCCL...), host memory otherwise (gloo stages through the
        # host). The loader's first gather checks that every rank chose the same type.
        self.broadcast_device = devices.broadcast_device(config)
        if timeout is None:
            try:
                timeout = self.pg._get_backend(self.broadcast_device).options._timeout
            except Exception:  # noqa: BLE001 - fall back to torch's default for the backend
                timeout = timedelta(minutes=30)
        self.timeout = timeout if isinstance(timeout, timedelta) else timedelta(seconds=float(timeout))
        # gloo's all-gather is a ring: W - 1 hops, each waiting for the one before; its all-to-all sends
        # every peer its block at once over the full mesh of pairs gloo connected at initialisation.
        self.one_round = self.broadcast_device.type == "cpu" and backends.get("cpu") == "gloo"

    def _all_gather(self, out: torch.Tensor, mine: torch.Tensor, async_op: bool = False):
        """``out`` = every rank's ``mine`` in rank order (1-D, the same size on every rank).

        Under gloo, while the gathered bytes are few, an all-to-all whose every block is ``mine``: one
        round instead of the ring's ``W - 1`` (the same bytes leave each rank: the ring forwards ``W - 1``
        blocks, the all-to-all sends its own ``W - 1`` times; the price is an input as large as ``out``,
        hence the bound). Otherwise the backend's all-gather (NCCL's is pipelined on the device, and an
        all-to-all would connect every pair of ranks). Every rank takes the same branch: the sizes are
        the group's.
        """
        if self.one_round and out.numel() * out.element_size() <= ONE_ROUND_BYTES:
            every = torch.from_numpy(np.tile(mine.numpy(), self.size))
            return dist.all_to_all_single(out, every, group=self.pg, async_op=async_op)
        return _all_gather_single(out, mine, group=self.pg, async_op=async_op)

    def silent_peers(self) -> str:
        """``_silent_peers`` once per operation: the sentence naming the ranks that stopped answering."""
        if self._silent is None:
            self._silent = _silent_peers(self) if self.active and self.size > 1 else ""
        return self._silent

    # -- collectives over the whole group ------------------------------------------------------------

    def all_gather_object(self, obj: Any, what: str = "pipeload") -> list[Any]:
        if self.size == 1:
            return [obj]
        out: list[Any] = [None] * self.size
        try:
            dist.all_gather_object(out, obj, group=self.pg)
        except Exception as e:  # noqa: BLE001 - typically a timeout: some rank never joined
            raise self._fail(what, "all-gather", e) from e
        return out

    def broadcast_bytes(self, data: bytes | None, size: int, what: str = "pipeload") -> bytes:
        """Rank 0's ``data`` of ``size`` bytes (a size every rank already holds) on every rank: one
        broadcast (torch's ``broadcast_object_list`` sends the size first: two)."""
        if self.size == 1:
            return data
        if self.rank == 0:
            t = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        else:
            t = torch.empty(size, dtype=torch.uint8)
        try:
            t = t.to(self.broadcast_device)
            dist.broadcast(t, src=self.global_ranks[0], group=self.pg)
        except Exception as e:  # noqa: BLE001
            raise self._fail(what, "broadcast from rank 0", e) from e
        return t.cpu().numpy().tobytes()

    def broadcast_row(self, row: np.ndarray, src: int, what: str = "pipeload",
                      call: str = "broadcast") -> np.ndarray:
        """Group rank ``src``'s int64 ``row`` on every rank (every rank passes a row of the same length)."""
        if self.size == 1:
            return np.asarray(row, dtype=np.int64).copy()
        t = torch.from_numpy(np.ascontiguousarray(row, dtype=np.int64)).to(self.broadcast_device)
        try:
            dist.broadcast(t, src=self.global_ranks[src], group=self.pg)
        except Exception as e:  # noqa: BLE001 - typically a timeout: some rank never joined
            raise self._fail(what, call, e) from e
        return t.cpu().numpy()

    def post_broadcast(self, tensor: torch.Tensor, src: int, what: str = "pipeload", call: str = "broadcast"):
        """Issue a broadcast of ``tensor`` from group rank ``src`` over the whole group; return its work.

        Its place in the group's order of collectives is where it was issued; complete it with
        :meth:`wait` (which raises this operation's error naming the call)."""
        try:
            return dist.broadcast(tensor, src=self.global_ranks[src], group=self.pg, async_op=True)
        except Exception as e:  # noqa: BLE001
            raise self._fail(what, call, e) from e

    def wait(self, work, what: str = "pipeload", call: str = "broadcast") -> None:
        """Wait for a work of :meth:`post_broadcast` (and order the current device stream after it)."""
        try:
            work.wait()
        except Exception as e:  # noqa: BLE001 - a peer died or timed out
            raise self._fail(what, call, e) from e

    def isend(self, buf: torch.Tensor, peer: int):
        """Post a send of ``buf`` to group rank ``peer`` (:class:`pipeload.move.mover.Transfers`' messages)."""
        return dist.isend(buf, dst=self.global_ranks[peer], group=self.pg)

    def irecv(self, buf: torch.Tensor, peer: int):
        """Post a receive into ``buf`` from group rank ``peer``."""
        return dist.irecv(buf, src=self.global_ranks[peer], group=self.pg)

    def _fail(self, what: str, call: str, e: Exception) -> PipeloadError:
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        return PipeloadError(
            f"{what}: the {call} over {self.size} ranks failed on rank {self.rank} ({type(e).__name__}: "
            f"{first}){self.silent_peers()}; every rank of the group must make the same call"
        )

    def gather_rows(self, row: np.ndarray, what: str = "pipeload", call: str = "all-gather of plan rows") -> np.ndarray:
        """Every rank's fixed-size int64 row, stacked (one all-gather of ``W x len(row)`` words)."""
        return self.start_gather_rows(row, what, call)()

    def start_gather_rows(self, row: np.ndarray, what: str = "pipeload",
                          call: str = "all-gather of plan rows") -> Callable[[], np.ndarray]:
        """:meth:`gather_rows`, issued now and completed by calling the function it returns.

        The collective is in flight (in the backend's own thread) while this rank does other work: its
        place in the group's order of collectives is where it was issued. The returned function must be
        called before the next collective of the group; a failure is raised there.
        """
        if self.size == 1:
            rows = row.reshape(1, -1).copy()
            return lambda: rows
        mine = torch.from_numpy(np.ascontiguousarray(row, dtype=np.int64)).to(self.broadcast_device)
        out = torch.empty(self.size * len(row), dtype=torch.int64, device=self.broadcast_device)
        try:
            work = self._all_gather(out, mine, async_op=True)
        except Exception as e:  # noqa: BLE001 - typically a timeout: some rank never joined
            raise self._fail(what, call, e) from e

        def finish() -> np.ndarray:
            try:
                work.wait()
            except Exception as e:  # noqa: BLE001 - typically a timeout: some rank never joined
                raise self._fail(what, call, e) from e
            return out.cpu().numpy().reshape(self.size, len(row))

        return finish

    def union(self, flags: np.ndarray, what: str = "pipeload") -> np.ndarray:
        """Element-wise maximum of every rank's ``flags`` (uint8): one all-reduce of ``len(flags)`` bytes."""
        if self.size == 1:
            return flags
        t = torch.from_numpy(np.ascontiguousarray(flags, dtype=np.uint8)).to(self.broadcast_device)
        try:
            if self.one_round and self.size * t.numel() <= ONE_ROUND_BYTES:
                # gloo's all-reduce is a ring too (2 (W - 1) hops): every rank's flags in one round, the
                # maximum taken here
                every = torch.empty(self.size * t.numel(), dtype=torch.uint8)
                self._all_gather(every, t)
                return every.view(self.size, -1).amax(0).numpy()
            dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.pg)
        except Exception as e:  # noqa: BLE001 - typically a timeout: some rank never joined
            raise self._fail(what, "all-reduce of requested keys", e) from e
        return t.cpu().numpy()

    def gather_to_first(self, data: bytes, sizes: np.ndarray, what: str = "pipeload") -> list[bytes] | None:
        """Every rank's ``data`` on rank 0 (``sizes``: every rank's length, known to all); None elsewhere.

        One gather (not an all-gather) of blocks padded to the largest size: rank 0 receives
        ``W x max(sizes)`` bytes, every other rank only sends its own.
        """
        if self.size == 1:
            return [data]
        pad = max(1, int(np.max(sizes)))
        buf = torch.zeros(pad, dtype=torch.uint8)
        if data:
            buf[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        buf = buf.to(self.broadcast_device)
        out = [torch.empty(pad, dtype=torch.uint8, device=self.broadcast_device) for _ in range(self.size)] \
            if self.rank == 0 else None
        try:
            dist.gather(buf, out, dst=self.global_ranks[0], group=self.pg)
        except Exception as e:  # noqa: BLE001 - typically a timeout: some rank never joined
            raise self._fail(what, "gather of chunk rows to rank 0", e) from e
        if out is None:
            return None
        return [t.cpu().numpy().tobytes()[: int(n)] for t, n in zip(out, sizes)]

    def transfer_records(self, t: Transfer, cls: Classes, mine: bytes, what: str = "pipeload") -> list[bytes]:
        """The record of every class (``cls``), moved as ``t`` says; this rank's own class costs nothing."""
        me = int(cls.of_rank[self.rank])
        out: list[bytes] = [b""] * len(cls.owners)
        out[me] = mine
        try:
            if t.how == "gather":
                buf = torch.zeros(t.pad, dtype=torch.uint8)
                if mine:
                    buf[: len(mine)] = torch.frombuffer(bytearray(mine), dtype=torch.uint8)
                buf = buf.to(self.broadcast_device)
                got = torch.empty(self.size * t.pad, dtype=torch.uint8, device=self.broadcast_device)
                self._all_gather(got, buf)
                raw = got.cpu().numpy().tobytes()
                for c, owner in enumerate(cls.owners.tolist()):
                    if c != me:
                        out[c] = raw[owner * t.pad : owner * t.pad + int(cls.nbytes[c])]
            elif t.how == "broadcast":
                for c, owner in enumerate(cls.owners.tolist()):
                    n = int(cls.nbytes[c])
                    if c == me:
                        buf = torch.frombuffer(bytearray(mine), dtype=torch.uint8).to(self.broadcast_device)
                    else:
                        buf = torch.empty(n, dtype=torch.uint8, device=self.broadcast_device)
                    dist.broadcast(buf, src=self.global_ranks[owner], group=self.pg)
                    if c != me:
                        out[c] = buf.cpu().numpy().tobytes()
        except Exception as e:  # noqa: BLE001
            raise self._fail(what, "exchange of plan records", e) from e
        return out

    def all_to_all(self, counts: np.ndarray, words: np.ndarray, what: str = "pipeload") -> tuple[np.ndarray, np.ndarray]:
        """Variable-sized int64 parts: ``counts[d]`` words of ``words`` (in destination order) to rank
        ``d``; returns (words received from each source, the words in source order). Two all-to-alls:
        the counts (``W`` words each way), then the parts; a rank's part to itself stays here."""
        if self.size == 1:
            return np.asarray(counts, dtype=np.int64).copy(), np.asarray(words, dtype=np.int64).copy()
        dev = self.broadcast_device
        try:
            send = torch.from_numpy(np.ascontiguousarray(counts, dtype=np.int64)).to(dev)
            got = torch.empty(self.size, dtype=torch.int64, device=dev)
            dist.all_to_all_single(got, send, group=self.pg)
            got_counts = got.cpu().numpy()
            data = torch.from_numpy(np.ascontiguousarray(words, dtype=np.int64)).to(dev)
            out = torch.empty(int(got_counts.sum()), dtype=torch.int64, device=dev)
            dist.all_to_all_single(out, data, output_split_sizes=got_counts.tolist(),
                                   input_split_sizes=np.asarray(counts, dtype=np.int64).tolist(), group=self.pg)
        except Exception as e:  # noqa: BLE001 - typically a timeout: some rank never joined
            raise self._fail(what, "all-to-all of shard keys", e) from e
        return got_counts, out.cpu().numpy()

    def agree(self, what: str, error: str | None) -> None:
        """Gather every rank's error (None = success); raise one DistributedError on every rank if any.

        One word per rank says whether it failed; only then are the texts gathered (a second collective
        that every rank takes, since every rank saw the same words). A successful load or save thus costs
        ``W`` words per rank here, not ``W`` pickled objects to unpickle.
        """
        self._agree(np.array([error is not None], dtype=np.int64), error, what, "final agreement")

    def agree_on(self, value: int, error: str | None, what: str, call: str) -> np.ndarray:
        """:meth:`agree`, carrying one int per rank in the same gather: every rank's ``value`` (one
        collective when no rank failed)."""
        return self._agree(np.array([error is not None, value], dtype=np.int64), error, what, call)[:, 1]

    def _agree(self, row: np.ndarray, error: str | None, what: str, call: str) -> np.ndarray:
        rows = self.gather_rows(row, what, call)
        if rows[:, 0].any():
            errors = self.all_gather_object(error, what)
            raise DistributedError(what, {r: e for r, e in enumerate(errors) if e is not None})
        return rows

    def broadcastable(self, tensor: torch.Tensor) -> bool:
        """Whether this rank can take part in a broadcast of ``tensor``'s data through the group's backend.

        Under gloo everything is staged through host memory, so every destination qualifies. Under an
        accelerator-only backend, host destinations cannot be broadcast (and are too small to be worth it).
        """
        if self.broadcast_device.type == "cpu":
            return True
        return tensor.device.type == self.broadcast_device.type

    # -- broadcast groups ----------------------------------------------------------------------------

    def reusable_groups(self, groups: Iterable[Any]) -> dict[int, Any]:
        """Map the digest (:func:`pipeload.plan.exchange.group_digest`) of each candidate group to the group.

        Only groups this rank is a member of, all of whose members belong to the load's group, can
        serve the load; the others are skipped.
        """
        if not self.active:
            return {}
        inside = set(self.global_ranks)
        out: dict[int, Any] = {}
        for g in groups:
            if g is None or g == dist.GroupMember.NON_GROUP_MEMBER:
                continue
            members = dist.get_process_group_ranks(g)
            if dist.get_rank() not in members or any(m not in inside for m in members):
                continue
            out.setdefault(group_digest(members), g)
        return out

    def make_groups(self, sets: dict[int, Any], reusable: dict[int, Any]) -> tuple[dict[int, Any], list[Any]]:
        """Resolve every holder set of the plan to a process group: ({set id: group}, groups created here).

        ``sets`` (set id -> :class:`pipeload.plan.globalplan.HolderSet`) comes from the global plan, the same on
        every rank. Set 0 is the load's own group. Creating is a world-wide collective (``new_group`` on
        every rank of the default group, members or not), in sorted member order, so it is only planned
        when the load's group is the world.
        """
        resolved: dict[int, Any] = {0: self.pg}
        created: list[Any] = []
        for sid, hs in sorted(sets.items(), key=lambda kv: kv[1].members):
            if sid == 0:
                continue
            mine = contains(hs.members, self.rank)
            if hs.create:
                g = dist.new_group([self.global_ranks[r] for r in hs.members], timeout=self.timeout)
                if mine:
                    resolved[sid] = g
                    created.append(g)
            elif mine:
                resolved[sid] = reusable[group_digest([self.global_ranks[r] for r in hs.members])]
        return resolved, created

    def destroy(self, groups: list[Any]) -> None:
        """Destroy groups this load created (see :func:`destroy_groups`)."""
        destroy_groups(groups)

    # -- asynchronous broadcast ----------------------------------------------------------------------

    def broadcast(self, tensor: torch.Tensor, group: Any, src: int) -> asyncio.Future:
        """Post a broadcast of ``tensor`` from load-rank ``src`` and return an asyncio future of it.

        Completion comes from the work's own future (a callback from the backend's thread), never from
        polling. The future's result is the ``Work``; call :func:`finish` on it before using the data.
        """
        loop = asyncio.get_running_loop()
        fut: asyncio.Future = loop.create_future()
        work = dist.broadcast(tensor, src=self.global_ranks[src], group=group, async_op=True)

        def _settle(exc: BaseException | None) -> None:
            if fut.done():
                return
            if exc is None:
                fut.set_result(work)
            else:
                fut.set_exception(exc)

        def _done(tfut) -> None:
            try:
                tfut.value()
                exc = None
            except BaseException as e:  # noqa: BLE001 - carried to the awaiting task
                exc = e
            try:
                loop.call_soon_threadsafe(_settle, exc)
            except RuntimeError:  # loop already closed: the load has failed elsewhere
                pass

        work.get_future().add_done_callback(_done)
        return fut


def destroy_groups(groups: list[Any]) -> None:
    """Destroy process groups a load created, after draining the device (best effort: warn, never fail).

    A queued transfer on a destroyed communicator can be cancelled, leaving receivers with stale data,
    so the device is synchronized first.
    """
    if not groups:
        return
    devices.synchronize()
    for g in groups:
        try:
            dist.destroy_process_group(g)
        except Exception as e:  # noqa: BLE001
            warnings.warn(f"pipeload: destroying a broadcast group failed: {e}", RuntimeWarning, stacklevel=2)


def finish(work) -> None:
    """Order the current device stream after a completed broadcast (a no-op for host collectives)."""
    work.wait()
