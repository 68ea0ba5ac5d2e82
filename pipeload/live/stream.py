"""``pipeload.stream``: full Hugging Face-named tensors into an engine's own ``load_weights``.

For an engine whose only way in is ``load_weights(iterable of (name, tensor))`` (or for the parameters
:func:`pipeload.record_slices` refused: a transpose, a requantization), each engine rank names the
tensors it wants (``want``: name -> shape and dtype, in the order it wants them). They are cut into
buckets of about ``bucket_mb``; each bucket is one :func:`pipeload.transfer` into whole tensors
allocated for it on the engine rank, so every tensor is assembled *on the engine rank that consumes
it*, its pieces sent by the balanced holders of the trainer's shards (not gathered on trainer rank 0:
no trainer rank holds more than its own shards, none sends much more than the others).

Each bucket is handed to ``load_weights`` on a thread of the stream's own while the next bucket's
transfer runs (``overlap=True``, the default), one call at a time and in bucket order; the call on
bucket k is waited for before bucket k + 1 is handed over, so an engine rank holds at most two
buckets (or its two largest tensors) beyond its parameters: the one being consumed and the one being
received. With ``overlap=False`` the calls are the caller's own, and one bucket is alive at a time. On
an accelerator the call runs on the stream that was current when the transfer completed (the transfer
ordered it after its receives). After a ``load_weights`` raised, that rank calls it no more.

Collectives, in order: one gather of the bucket counts (every rank then makes the same number of
transfers, a rank without bucket ``k`` taking part with no destination), the transfers (each keeps
its plan under its own slot: a later stream with the same wants plans nothing), and a final agreement
on the callbacks: a ``load_weights`` that raised on some rank makes every rank raise, after every
transfer ran (no rank is left waiting in one).
"""

from __future__ import annotations

import contextlib
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Iterable

import numpy as np
import torch

from .. import device
from ..errors import StateDictError
from ..move.link import Link
from .api import TransferStats, run_transfer

DEFAULT_BUCKET_MB = 512.0


def stream(src: Any, want: Any, load_weights: Callable[[list], Any] | None, *, group: Any = None,
           bucket_mb: float = DEFAULT_BUCKET_MB, version: int | None = None, cast: bool = False,
           device: Any = "cpu", overlap: bool = True) -> TransferStats:
    """Hand every engine rank the full tensors it ``want``\\ s, in buckets, through ``load_weights``.
    A collective over ``group`` (every rank calls it with the same group and ``bucket_mb``).

    ``src``: this rank's part of the trainer's state dict (``None`` on an engine-only rank). ``want``:
    name -> ``(shape, dtype)`` or a tensor (a meta tensor will do: its shape and dtype), or an iterable
    of ``(name, shape, dtype)``; ``None`` on a trainer-only rank. ``load_weights`` is called once per
    bucket with a list of ``(name, tensor)`` (the tensors are this call's own, on ``device``), on the
    stream's thread while the next bucket arrives unless ``overlap=False`` (see the module).
    Returns this rank's stats summed over the buckets; raises as :func:`pipeload.transfer` does, and
    :class:`pipeload.DistributedError` on every rank when a ``load_weights`` raised.
    """
    what = "pipeload.stream"
    link = Link(group)
    buckets, error = [], None
    try:
        buckets = _buckets(_wants(want, load_weights), bucket_mb)
    except (StateDictError, TypeError, ValueError) as e:  # carried into the gather: every rank raises
        error = str(e)
    rows = link.gather_rows(np.array([len(buckets), error is not None], dtype=np.int64), what,
                            "all-gather of bucket counts")
    if rows[:, 1].any():
        link.agree(what, error, "agreement on the wants")
    n = int(rows[:, 0].max())
    total = TransferStats(version=version, planned=False)
    feed = _Feed(load_weights, overlap and n > 1 and error is None)
    try:
        for k in range(n):
            bucket = buckets[k] if k < len(buckets) and error is None else None
            dst = {name: torch.empty(shape, dtype=dtype, device=device) for name, shape, dtype in bucket} \
                if bucket else None
            _add(total, run_transfer(link, src, dst, version, cast, what, slot=k + 1))
            if dst:
                feed.hand(k, dst)
            del dst
    finally:
        error = feed.finish() or error
    link.agree(what, error, "agreement on the engines' load_weights")
    total.complete = True
    return total


class _Feed:
    """Buckets into ``load_weights`` in bucket order, one call at a time: on a thread of its own when
    ``overlap`` (a bucket is handed over once the call on the one before it returned), else in the
    caller's. The first failure is kept (as the text every rank raises) and ends the calls."""

    def __init__(self, load_weights, overlap: bool) -> None:
        self.load_weights, self.error, self.pending = load_weights, None, None
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="pipeload-stream") if overlap else None

    def hand(self, k: int, dst: dict) -> None:
        self._settle()
        if self.error is not None:
            return
        if self.pool is None:
            self.error = self._call(k, dst, None)
            return
        on = next((device.current_stream(t.device) for t in dst.values() if t.device.type not in ("cpu", "meta")), None)
        self.pending = self.pool.submit(self._call, k, dst, on)

    def _call(self, k: int, dst: dict, on) -> str | None:
        try:
            with device.on_stream(on) if on is not None else contextlib.nullcontext():
                self.load_weights(list(dst.items()))
        except Exception as e:  # noqa: BLE001 - every rank must learn of it, after every transfer
            return f"pipeload.stream: load_weights raised on bucket {k} ({', '.join(list(dst)[:3])}...): " \
                   f"{type(e).__name__}: {e}"
        return None

    def _settle(self) -> None:
        if self.pending is not None:
            self.error, self.pending = self.error or self.pending.result(), None

    def finish(self) -> str | None:
        """Wait for the last call; the first failure's text, or None."""
        try:
            self._settle()
        finally:
            if self.pool is not None:
                self.pool.shutdown(wait=True)
        return self.error


def _wants(want: Any, load_weights) -> list[tuple[str, tuple[int, ...], torch.dtype]]:
    """``want`` as (name, shape, dtype) in its order; each name once."""
    if want is None:
        return []
    if not callable(load_weights):
        raise TypeError("pipeload.stream: an engine rank (want given) needs a callable load_weights")
    return specs(want, "pipeload.stream")


def specs(want: Any, what: str) -> list[tuple[str, tuple[int, ...], torch.dtype]]:
    """Named tensor specifications as (name, shape, dtype), in their order, each name once: from a
    mapping name -> ``(shape, dtype)`` or a tensor (its shape and dtype; a meta tensor will do), or from
    an iterable of ``(name, shape, dtype)``."""
    items: Iterable = want.items() if isinstance(want, dict) else want
    out, seen = [], set()
    for item in items:
        if isinstance(want, dict):
            name, spec = item
            shape, dtype = (spec.shape, spec.dtype) if isinstance(spec, torch.Tensor) else spec
        else:
            name, shape, dtype = item
        if not isinstance(name, str) or name in seen:
            raise StateDictError(f"{what}: names {name!r} twice, or not as a string")
        if not isinstance(dtype, torch.dtype):
            raise StateDictError(f"{what}: {name!r}: dtype {dtype!r} is not a torch.dtype")
        seen.add(name)
        out.append((name, tuple(int(x) for x in shape), dtype))
    return out


def _buckets(wanted: list, bucket_mb: float) -> list[list]:
    """Runs of ``wanted`` of at most ``bucket_mb`` MiB each (a larger tensor alone)."""
    if bucket_mb <= 0:
        raise ValueError(f"pipeload.stream: bucket_mb must be positive, got {bucket_mb}")
    limit = int(bucket_mb * (1 << 20))
    out: list[list] = []
    size = 0
    for name, shape, dtype in wanted:
        n = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        if not out or size + n > limit:
            out.append([])
            size = 0
        out[-1].append((name, shape, dtype))
        size += n
    return out


def _add(total: TransferStats, st: TransferStats) -> None:
    total.version = st.version
    total.planned = total.planned or st.planned
    total.bytes_sent += st.bytes_sent
    total.bytes_received += st.bytes_received
    total.bytes_copied += st.bytes_copied
    total.messages += st.messages
    total.destinations += st.destinations
    total.written.extend(st.written)
    for key, value in st.timings.items():
        total.timings[key] = total.timings.get(key, 0.0) + value
