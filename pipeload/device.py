"""Everything pipeload asks torch about accelerators; no other module names one.

One device-generic layer over ``torch.accelerator``, ``torch.Stream`` / ``torch.Event`` and
``torch.get_device_module``, so that an NPU job over HCCL, an XPU job over XCCL and a CUDA job over
NCCL take the same paths:

- :func:`accelerator`: the device type present in this process (``"cuda"``, ``"npu"``, ...) or None;
- :func:`fillable`: whether pipeload can copy into and out of tensors of a device type (host memory, or
  a device whose module has streams, events and synchronisation), decided per type by capability;
- :func:`device_moving`: which device type a process group's backend moves, from its backend config
  (``"cpu:gloo,cuda:nccl"`` -> ``"cuda"``, ``"hccl"`` -> ``"npu"``, ``"gloo"`` -> None), a pure function
  of that string; :func:`broadcast_device` turns it into the device a load's broadcasts use;
- streams, events, page-locked host memory and synchronisation for one device;
- :class:`H2DRing`: host -> device copies through a bounded ring of page-locked slots.

The ring's invariant: a slot is rewritten by the CPU only after the event recorded behind its last
copy completed, and the destinations it writes are read by others only through a stream ordered after
the ring's side stream (:meth:`H2DRing.join`). A process without an accelerator never creates a
stream, an event or a page-locked buffer.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Any, Callable, Iterator

import torch

# Bare backend names (``pg._get_backend_name()``, older configs) -> the device type they move.
DEVICE_BACKENDS = {"nccl": "cuda", "hccl": "npu", "xccl": "xpu", "mccl": "musa", "cncl": "mlu"}
HOST_BACKENDS = ("gloo", "mpi", "ucc", "")  # bare names whose collectives run on host tensors

DEFAULT_H2D_RING_BYTES = 64 << 20  # load(h2d_ring_bytes=...): page-locked bytes per load and device
H2D_SLOTS = 4  # slots of the ring: while the device copies one, the CPU fills the next
MIN_SLOT_BYTES = 1 << 20
_ALIGN = 64  # pieces sharing a slot start at multiples of this (any dtype's view stays aligned)

_fillable: dict[str, bool] = {}
_present: list[str | None] = []  # accelerator(), once known


def accelerator() -> str | None:
    """The type of the accelerator this process can use (``"cuda"``, ``"npu"``, ``"xpu"``...), or None
    (asked once per process)."""
    if not _present:
        try:
            acc = torch.accelerator.current_accelerator() if torch.accelerator.is_available() else None
        except Exception:  # noqa: BLE001 - a broken runtime is no accelerator
            acc = None
        _present.append(acc.type if acc is not None else None)
    return _present[0]


def in_use() -> str | None:
    """:func:`accelerator`, only once its runtime was initialised in this process (a device tensor
    exists, or a stream was used): asking more of it would initialise it for a host-only job."""
    kind = accelerator()
    if kind is None:
        return None
    module = _module(kind)
    initialised = getattr(module, "is_initialized", None)
    return kind if initialised is None or initialised() else None


def _module(kind: str) -> Any:
    try:
        return torch.get_device_module(kind)
    except Exception:  # noqa: BLE001 - no module for that type (xla, lazy, meta...)
        return None


def fillable(kind: str) -> bool:
    """Whether pipeload copies bytes into and out of tensors on devices of type ``kind``: host memory,
    or a device whose module offers streams, events and synchronisation (what the ring and the
    background save's side stream need). ``meta`` is not (the planner handles it by itself)."""
    got = _fillable.get(kind)
    if got is None:
        module = None if kind in ("meta", "cpu") else _module(kind)
        got = kind == "cpu" or (module is not None and all(
            callable(getattr(module, name, None))
            for name in ("Stream", "Event", "synchronize", "current_stream", "is_available")))
        _fillable[kind] = got
    return got


def device_moving(config: str, present: str | None = None) -> str | None:
    """The device type whose tensors a group with backend ``config`` moves, None when its collectives
    run on host tensors.

    ``config`` is what ``dist.get_backend_config(pg)`` returns (``"cpu:gloo,cuda:nccl"``,
    ``"cpu:gloo,npu:hccl"``, ``"cpu:gloo,cuda:gloo"``) or a bare backend name (``"nccl"``, ``"hccl"``,
    ``"gloo"``). A device entry with a backend other than gloo is device-moving (gloo stages a device
    tensor through the host). A bare name is looked up in :data:`DEVICE_BACKENDS`; an unknown one that
    is not a host backend (:data:`HOST_BACKENDS`) moves ``present`` (the accelerator here).
    """
    config = str(config).strip().lower()
    if ":" not in config:
        if config in HOST_BACKENDS:
            return None
        return DEVICE_BACKENDS.get(config, present)
    for part in config.split(","):
        kind, _, backend = part.partition(":")
        kind, backend = kind.strip(), backend.strip()
        if kind and kind != "cpu" and backend and backend != "gloo":
            return kind
    return None


def broadcast_device(config: str) -> torch.device:
    """The device a group's collectives move tensors on: the current accelerator when the group's
    backend moves that device type, host memory otherwise (gloo stages through the host)."""
    present = accelerator()
    kind = device_moving(config, present)
    if kind is not None and kind == present:
        return torch.device(kind, torch.accelerator.current_device_index())
    return torch.device("cpu")


def set_current(device: torch.device) -> None:
    """Make ``device`` current in the calling thread (no-op for host memory)."""
    if device.type != "cpu" and device.index is not None:
        torch.accelerator.set_device_index(device.index)


def current_stream(device: torch.device) -> torch.Stream:
    return torch.accelerator.current_stream(device)


def new_stream(device: torch.device) -> torch.Stream:
    return torch.Stream(device=device)


def new_event(device: torch.device) -> torch.Event:
    return torch.Event(device=device)


def record(device: torch.device) -> torch.Event:
    """An event recorded on ``device``'s current stream (the work queued there so far)."""
    ev = new_event(device)
    ev.record(current_stream(device))
    return ev


@contextlib.contextmanager
def on_stream(stream: torch.Stream) -> Iterator[None]:
    """Queue the work of the block on ``stream`` (restoring the current stream after)."""
    with stream:
        yield


def synchronize(device: torch.device | None = None) -> None:
    """Wait until the accelerator finished everything queued (no-op without one, or before its runtime
    started: nothing can be queued then)."""
    if device is not None and device.type == "cpu":
        return
    if in_use() is not None:
        torch.accelerator.synchronize(device)


def pinnable(kind: str) -> bool:
    """Whether page-locked host memory for ``kind`` can be had here (the present accelerator's)."""
    return kind != "cpu" and kind == accelerator()


def host_buffer(nbytes: int, pinned: bool) -> torch.Tensor:
    """``nbytes`` of host memory, page-locked for the current accelerator when ``pinned`` (plain memory
    when page-locking is refused)."""
    if pinned:
        try:
            return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        except RuntimeError:
            pass
    return torch.empty(nbytes, dtype=torch.uint8)


def split_box(dst: torch.Tensor, src: torch.Tensor, limit: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """(destination view, source view) pairs of at most ``limit`` bytes each (``limit`` >= one element)
    covering ``dst`` / ``src`` (same shape): blocks of whole rows along the first dimension longer than
    one, and a row larger than ``limit`` split the same way, recursively."""
    n = dst.numel() * dst.element_size()
    if n <= limit or dst.dim() == 0:
        yield dst, src
        return
    d = next(i for i, s in enumerate(dst.shape) if s > 1)
    rows = dst.shape[d]
    row = n // rows
    if row <= limit:
        step = limit // row
        for a in range(0, rows, step):
            k = min(step, rows - a)
            yield dst.narrow(d, a, k), src.narrow(d, a, k)
        return
    for a in range(rows):
        yield from split_box(dst.select(d, a), src.select(d, a), limit)


class Slots:
    """Which slot of a ring is written next, and whether its last copy must be waited for first.

    Pure bookkeeping (no torch): slots are handed out in turn; a slot that has a pending copy is handed
    out only together with that copy's marker, which the caller waits for before writing the slot.
    """

    def __init__(self, count: int):
        self.pending: list[Any] = [None] * max(1, count)
        self.next = 0
        self.waits = 0  # slots handed out while a copy out of them was pending

    def take(self) -> tuple[int, Any]:
        """(the slot to write, the marker of its pending copy or None)."""
        i = self.next
        self.next = (i + 1) % len(self.pending)
        marker, self.pending[i] = self.pending[i], None
        if marker is not None:
            self.waits += 1
        return i, marker

    def submitted(self, i: int, marker: Any) -> None:
        self.pending[i] = marker

    def outstanding(self) -> list[Any]:
        """The markers still pending, oldest first; forgotten here."""
        order = [(i - self.next) % len(self.pending) for i in range(len(self.pending))]
        out = [self.pending[i] for i in sorted(range(len(self.pending)), key=order.__getitem__)]
        self.pending = [None] * len(self.pending)
        return [m for m in out if m is not None]


class H2DRing:
    """Copies into one device's tensors through ``slots`` host buffers of ``ring_bytes / slots`` each,
    page-locked where the accelerator allows it, reused in turn.

    :meth:`copy` fills a slot on the CPU (the caller's ``fill``: a guarded copy out of a file mapping,
    a copy out of a broadcast's staging buffer), queues its copy into the destination with
    ``non_blocking=True`` on a side stream and records an event behind it; the slot is filled again
    only once that event completed, so the CPU fills slot k + 1 while the device copies slot k. Pieces
    smaller than a slot's rest share it (its marker is then its newest copy's event).

    Ordering: the side stream first waits for the stream that was current where the ring was made (the
    work that produced the destinations); :meth:`join` makes that stream wait for every copy queued so
    far, so what it runs next (a broadcast, the caller's kernels) sees the data; :meth:`close` waits for
    the last copies (the slots' memory is freed after). Thread safe: the reads and a broadcast's unpack
    may copy from two threads. On a host device (tests) the copies are synchronous.
    """

    def __init__(self, device: torch.device | str, ring_bytes: int = DEFAULT_H2D_RING_BYTES,
                 slots: int = H2D_SLOTS):
        self.device = torch.device(device)
        self.slot_bytes = max(MIN_SLOT_BYTES, int(ring_bytes) // max(1, slots))
        self.buffers: list[torch.Tensor | None] = [None] * max(1, slots)
        self.slots = Slots(len(self.buffers))
        self.on_device = self.device.type != "cpu"
        self.pinned = self.on_device and pinnable(self.device.type)
        self.origin = current_stream(self.device) if self.on_device else None
        self.stream: torch.Stream | None = None  # made at the first copy
        self.lock = threading.Lock()
        self.copies = 0  # slot copies queued
        self.bytes = 0
        self._unjoined = False
        self._current: int | None = None  # the slot being filled, and its first free byte
        self._at = 0

    def copy(self, dst: torch.Tensor, src: torch.Tensor,
             fill: Callable[[torch.Tensor, torch.Tensor], None] | None = None) -> None:
        """``dst`` (on the ring's device) <- ``src`` (host, same shape and dtype), through the slots;
        ``fill(host_view, src_view)`` writes a slot (default ``host_view.copy_(src_view)``)."""
        fill = fill or (lambda h, s: h.copy_(s))
        with self.lock:
            for d, s in split_box(dst, src, self.slot_bytes):
                n = d.numel() * d.element_size()
                if n == 0:
                    continue
                i, at = self._space(n)
                buf = self.buffers[i]
                if buf is None:
                    buf = self.buffers[i] = host_buffer(self.slot_bytes, self.pinned)
                host = buf[at:at + n].view(d.dtype).view(d.shape)
                fill(host, s)
                # the slot's marker is its newest copy: copies on one stream complete in order
                self.slots.submitted(i, self._queue(d, host))
                self.copies += 1
                self.bytes += n

    def _space(self, n: int) -> tuple[int, int]:
        """(slot, offset) for ``n`` bytes: the rest of the slot being filled when they fit (small pieces
        share a slot), else the next slot, once its last copy completed."""
        if self._current is not None and self._at + n <= self.slot_bytes:
            at = self._at
            self._at += -(-n // _ALIGN) * _ALIGN
            return self._current, at
        i, marker = self.slots.take()
        if marker is not None:
            marker.synchronize()  # the slot's last copy has completed: the CPU may rewrite it
        self._current, self._at = i, -(-n // _ALIGN) * _ALIGN
        return i, 0

    def _queue(self, d: torch.Tensor, host: torch.Tensor) -> Any:
        """Queue ``d.copy_(host)`` behind the ring's ordering; the event of its completion (None: done)."""
        if not self.on_device:
            d.copy_(host)
            return None
        if self.stream is None:
            self.stream = new_stream(self.device)
            self.stream.wait_stream(self.origin)
        with on_stream(self.stream):
            d.copy_(host, non_blocking=self.pinned)
        ev = new_event(self.device)
        ev.record(self.stream)
        self._unjoined = True
        return ev

    def join(self) -> None:
        """Order the ring's origin stream after every copy queued so far (no CPU wait)."""
        with self.lock:
            if self._unjoined and self.stream is not None:
                ev = new_event(self.device)
                ev.record(self.stream)
                self.origin.wait_event(ev)
                self._unjoined = False

    def close(self) -> None:
        """:meth:`join`, then wait for the last copies and free the slots."""
        self.join()
        with self.lock:
            for marker in self.slots.outstanding():
                marker.synchronize()
            self.buffers = [None] * len(self.buffers)
            self._current = None


def ring_for(kind: str | None, ring_bytes: int = DEFAULT_H2D_RING_BYTES) -> H2DRing | None:
    """A ring for the accelerator ``kind`` of this load's destinations, None for host memory or when
    ``ring_bytes`` is 0 (copies then go straight from pageable memory, synchronously)."""
    if kind is None or kind == "cpu" or ring_bytes <= 0:
        return None
    return H2DRing(torch.device(kind, torch.accelerator.current_device_index()), ring_bytes)


__all__ = ["DEFAULT_H2D_RING_BYTES", "H2DRing", "accelerator", "broadcast_device", "device_moving", "fillable",
           "ring_for", "split_box", "synchronize"]
