"""``pipeload.record_slices``: an engine's destinations, found by running its own weight loader once.

An inference engine knows its fused layout only through its loader: ``load_weights`` takes full
checkpoint tensors and, per parameter, narrows the tensor to this rank's share and copies it into a
region of a fused parameter (``q``/``k``/``v`` into ``qkv_proj``, with KV heads replicated past their
count; ``gate``/``up`` into ``gate_up_proj``; expert ``e``'s rows into ``w13[e]``; a vocabulary shard into
the unpadded rows). Writing those rules a second time outside the engine is how wrong weights get
served. Instead the loader runs once on *probes*: storage-free tensors (meta device) standing for each
checkpoint tensor, which remember which region of which global tensor they are. Every view the loader
takes of a probe (``narrow``, indexing, ``chunk``, ``split``, ``view`` and ``reshape`` that keep the
order of the elements) stays a probe of a region; every ``dst.copy_(probe)`` or ``dst[i] = probe`` into a
real tensor records a :class:`pipeload.Slice` of ``dst``. Nothing is copied: the engine's parameters
keep their values (the loader's other writes, such as zeroing a padding tail, run as they would).

The invariant: a recorded slice is exactly the copy the loader would have made — the destination's
elements in row-major order are the region's elements in row-major order, of one dtype. Anything else
(a transpose, a dtype change, arithmetic such as a requantization, concatenation, a write other than a
copy, a value read such as ``.item()``) is *refused* for the checkpoint tensor it touched, naming the
parameter and the operation: such a tensor has all its slices dropped and goes to the engine's loader
whole (:func:`pipeload.stream`). A loader that raises on a probe (it read a value) is run again without
the tensor it had taken last, so one tensor's failure refuses that tensor only.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from ..errors import StateDictError
from ..slices import Slice
from .stream import specs

WHAT = "pipeload.record_slices"
_MOVES = ("to", "cpu", "cuda")  # a probe on another device is the same probe
_HARMLESS = ("requires_grad_", "share_memory_", "pin_memory", "retain_grad")
_READS = ("item", "tolist", "numpy", "__bool__", "__float__", "__int__", "__index__")


@dataclass
class Recorded:
    """What :func:`record_slices` found. ``slices``: the destinations of every tensor the loader copies
    into regions, in the loader's order. ``refused``: checkpoint name -> why its copy is not a region
    copy (stream those whole). ``unused``: names the loader copied nowhere (skipped, or stored in
    another way than a copy)."""

    slices: list[Slice] = field(default_factory=list)
    refused: dict[str, str] = field(default_factory=dict)
    unused: list[str] = field(default_factory=list)


class _Source:
    """The global tensor a probe's storage frame lies in: the frame (a contiguous box of ``lengths`` at
    ``origin``) is the whole tensor for a fresh probe, or a box of it for a ``contiguous()`` copy."""

    __slots__ = ("name", "shape", "origin", "frame")

    def __init__(self, name: str, shape: tuple[int, ...], origin: tuple[int, ...], frame: tuple[int, ...]):
        self.name, self.shape, self.origin, self.frame = name, shape, origin, frame


class _Recorder:
    """The probes' side effects during one run of the loader."""

    def __init__(self, names: dict[int, str]):
        self.names = names  # storage data_ptr -> parameter name, for messages
        self.slices: list[Slice] = []
        self.refused: dict[str, str] = {}
        self.copied: set[str] = set()

    def param(self, t: torch.Tensor) -> str:
        try:
            name = self.names.get(t.untyped_storage().data_ptr())
        except (RuntimeError, NotImplementedError):
            name = None
        return f"parameter {name!r}" if name else f"a tensor {tuple(t.shape)} {t.dtype}"

    def refuse(self, name: str, why: str) -> None:
        self.refused.setdefault(name, why)

    def copy(self, dst: torch.Tensor, src: Any, how: str) -> None:
        """Record ``dst`` <- ``src`` (a probe), or refuse ``src``'s tensor naming the parameter."""
        if not isinstance(src, _Probe) or src.numel() == 0:
            return
        if isinstance(dst, _Probe) or dst.device.type == "meta":
            why = f"copied into an intermediate tensor ({how}), not into a parameter"
        else:
            why = src._pl_why or _dtype_change(dst, src)
            box = None if why else _box(src)
            if box is None:
                why = why or "its elements are reordered (a transpose or a permutation), not a region"
            view = None if why else _shaped(dst, box[1])
            if view is not None:
                self.copied.add(src._pl_source.name)
                self.slices.append(Slice(view.detach(), src._pl_source.name, box[0], src._pl_source.shape))
                return
            why = f"{how} into {self.param(dst)}: " + (
                why or f"the destination's shape {tuple(dst.shape)} holds another region than {box[1]}")
        for n in src._pl_names:
            self.refuse(n, why)


_active: list[_Recorder] = []


class _Probe(torch.Tensor):
    """A meta tensor standing for a region of a checkpoint tensor (``_pl_source``), or for something
    derived from one that is not a region (``_pl_why`` says what made it so)."""

    _pl_source: _Source
    _pl_why: str | None
    _pl_names: tuple[str, ...]  # every checkpoint tensor it was derived from

    @classmethod
    def make(cls, meta: torch.Tensor, source: _Source, why: str | None = None,
             names: tuple[str, ...] | None = None) -> "_Probe":
        p = torch.Tensor._make_subclass(cls, meta)
        p._pl_source, p._pl_why, p._pl_names = source, why, names or (source.name,)
        return p

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        rec = _active[-1] if _active else None
        fname = getattr(func, "__name__", str(func))
        if rec is not None:
            handled = _side_effect(rec, func, fname, args, kwargs)
            if handled is not _NOT:
                return handled
        with torch._C.DisableTorchFunctionSubclass():
            out = func(*args, **kwargs)
        return _wrap(out, args, kwargs, fname)


_NOT = object()


def _side_effect(rec: _Recorder, func, fname: str, args, kwargs):
    """What a call that writes outside the probes does: a copy is recorded (never run), another
    in-place write of a real tensor from a probe refuses the probe's tensor; ``_NOT`` for the rest."""
    dst = args[0] if args else None
    if func is torch.Tensor.copy_:
        rec.copy(dst, args[1] if len(args) > 1 else kwargs.get("src"), "copy_")
        return dst
    if func is torch.Tensor.__setitem__:
        if isinstance(dst, _Probe):
            return _refuse_all(rec, args, "an item assignment into an intermediate tensor")
        with torch._C.DisableTorchFunctionSubclass():
            target = dst[args[1]]
        if not torch._C._is_alias_of(target, dst):
            return _refuse_all(rec, args, f"an assignment through an advanced index into {rec.param(dst)}")
        rec.copy(target, args[2], "an item assignment")
        return None
    in_place = fname.endswith("_") and not fname.startswith("__") and fname not in _HARMLESS
    if (in_place or fname == "__set__") and isinstance(dst, torch.Tensor) and not isinstance(dst, _Probe):
        return _refuse_all(rec, args[1:] + tuple(kwargs.values()), f"{fname} into {rec.param(dst)}") or dst
    if in_place and isinstance(dst, _Probe):
        dst._pl_why = dst._pl_why or f"changed in place by {fname}"
    elif fname in _MOVES and isinstance(dst, _Probe):
        return _moved(dst, args[1:], kwargs)
    elif fname in _READS:
        raise _ValueRead(f"the loader reads its values ({fname})")
    return _NOT


def _moved(p: "_Probe", args, kwargs) -> "_Probe":
    """``p.to(...)`` / ``.cpu()`` / ``.cuda()``: ``p`` itself unless the dtype changes."""
    dtype = kwargs.get("dtype")
    for a in args:
        if isinstance(a, torch.dtype):
            dtype = a
        elif isinstance(a, torch.Tensor):
            dtype = a.dtype
    if dtype is None or dtype == p.dtype:
        return p
    meta = torch.empty(p.shape, dtype=dtype, device="meta")
    return _Probe.make(meta, p._pl_source, p._pl_why or f"a dtype change ({p.dtype} -> {dtype})", p._pl_names)


def _refuse_all(rec: _Recorder, args, how: str):
    for a in _flat(args):
        if isinstance(a, _Probe):
            for n in a._pl_names:
                rec.refuse(n, f"{how}: not a region copy")
    return None


def _flat(args):
    for a in args:
        if isinstance(a, (list, tuple)):
            yield from _flat(a)
        else:
            yield a


class _ValueRead(RuntimeError):
    """A loader asked for a probe's values, which do not exist."""


def _wrap(out, args, kwargs, fname: str):
    """The outputs of ``fname`` as probes: a view of one probe stays a region of its source; anything
    else is derived (refused if copied into a parameter)."""
    probes = [a for a in _flat(tuple(args) + tuple(kwargs.values())) if isinstance(a, _Probe)]
    if isinstance(out, (list, tuple)):
        return type(out)(_wrap(o, args, kwargs, fname) for o in out)
    if not isinstance(out, torch.Tensor) or isinstance(out, _Probe) or not probes:
        return out
    first = probes[0]
    if len(probes) == 1 and out.dtype == first.dtype and torch._C._is_alias_of(out, first):
        return _Probe.make(out, first._pl_source, first._pl_why, first._pl_names)
    copy = fname in ("contiguous", "clone") and len(probes) == 1 and out.dtype == first.dtype
    if copy and not first._pl_why:
        box = _box(first)
        if box is not None:  # a copy of a region: a new frame, the same region
            src = first._pl_source
            return _Probe.make(out, _Source(src.name, src.shape, box[0], box[1]))
    why = first._pl_why or (f"a dtype change ({first.dtype} -> {out.dtype})" if out.dtype != first.dtype
                            else "its elements are reordered (a transpose or a permutation), not a region"
                            if copy else f"derived by {fname}, not a view")
    names = tuple(dict.fromkeys(n for p in probes for n in p._pl_names))
    return _Probe.make(out, first._pl_source, why, names)


def _dtype_change(dst: torch.Tensor, src: "_Probe") -> str | None:
    if dst.dtype != src.dtype:
        return f"a dtype change ({src.dtype} -> {dst.dtype}; pass cast=True to the transfer instead)"
    return None


def _box(p: "_Probe") -> tuple[tuple[int, ...], tuple[int, ...]] | None:
    """(global offsets, lengths) of the region ``p`` views, when its elements in row-major order are
    exactly a box's in row-major order; else None. Sizes and strides are matched against the frame's
    contiguous strides, innermost first: a run of stride ``s`` covers the frame dimension whose
    contiguous stride is ``s``, and may continue into outer dimensions only from index 0 across whole
    rows (a ``view`` that merges dimensions)."""
    src = p._pl_source
    frame = src.frame
    if p.numel() == 0:
        return None
    cstride = [1] * len(frame)
    for d in range(len(frame) - 2, -1, -1):
        cstride[d] = cstride[d + 1] * frame[d + 1]
    start = _unravel(p.storage_offset(), frame)
    lengths = [1] * len(frame)
    d_next = len(frame) - 1  # the innermost frame dimension a run may still cover
    for n, s in reversed([(n, s) for n, s in zip(p.shape, p.stride()) if n > 1]):
        d = next((k for k in range(d_next, -1, -1) if cstride[k] == s), None)
        if d is None:
            return None
        while n > 1:
            if n <= frame[d] - start[d]:
                lengths[d] = n
                break
            if start[d] != 0 or n % frame[d] or d == 0:
                return None
            lengths[d], n, d = frame[d], n // frame[d], d - 1
        d_next = d - 1
    offsets = tuple(o + a for o, a in zip(start, src.origin))
    return offsets, tuple(lengths)


def _unravel(offset: int, frame: tuple[int, ...]) -> list[int]:
    out = [0] * len(frame)
    for d in range(len(frame) - 1, -1, -1):
        out[d] = offset % frame[d] if frame[d] else 0
        offset //= max(frame[d], 1)
    return out


def _shaped(dst: torch.Tensor, lengths: tuple[int, ...]) -> torch.Tensor | None:
    """``dst`` as a view of ``lengths`` (the region's rank), or None when it is not one."""
    if tuple(dst.shape) == lengths:
        return dst
    if dst.numel() != _prod(lengths):
        return None
    try:
        return dst.view(lengths)
    except RuntimeError:  # not viewable without a copy: the copy would land elsewhere
        return None


def _prod(xs) -> int:
    n = 1
    for x in xs:
        n *= int(x)
    return n


def record_slices(load_weights: Callable[[Any], Any], tensors: Any, *,
                  params: dict[str, torch.Tensor] | None = None) -> Recorded:
    """Run ``load_weights`` once on storage-free stand-ins of ``tensors`` and return the
    :class:`pipeload.Slice` destinations its copies make (see the module's docstring).

    ``tensors``: the checkpoint tensors the loader takes — name -> ``(shape, dtype)`` or a tensor (its
    shape and dtype; a meta tensor will do), or an iterable of ``(name, shape, dtype)``.
    ``load_weights`` is called with an iterable of ``(name, tensor)``, as engines' loaders are.
    ``params`` (name -> tensor) names the parameters in messages; by default those of the module
    ``load_weights`` is a method of, if any. Nothing is copied into the parameters; the slices hold
    views of them, filled later by :func:`pipeload.transfer` or :func:`pipeload.load`.
    """
    if not callable(load_weights):
        raise StateDictError(f"{WHAT}: load_weights must be callable, got {type(load_weights).__name__}")
    wanted = specs(tensors, WHAT)
    names = _param_names(load_weights, params)
    raised: dict[str, str] = {}
    while True:
        rec = _run(load_weights, [w for w in wanted if w[0] not in raised], names, raised)
        if rec is not None:
            break
    for k, v in raised.items():
        rec.refuse(k, v)
    return _result(rec, wanted)


def _run(load_weights, wanted, names: dict[int, str], raised: dict[str, str]) -> _Recorder | None:
    """One run of the loader over ``wanted``'s probes, or None when it raised: the tensor it had taken
    last is then put in ``raised`` (the caller runs it again without that one, so a loader that keeps
    state across tensors still sees all the others in one run)."""
    rec = _Recorder(names)
    taken: list[str] = []

    def probes():
        for n, shape, dtype in wanted:
            taken.append(n)
            meta = torch.empty(shape, dtype=dtype, device="meta")
            yield n, _Probe.make(meta, _Source(n, shape, (0,) * len(shape), shape))

    _active.append(rec)
    try:
        with torch.no_grad():
            load_weights(probes())
    except Exception as e:  # noqa: BLE001 - any failure on a probe refuses its tensor, never the caller
        why = f"the loader raised on it: {type(e).__name__}: {e}"
        if not taken:
            raise StateDictError(f"{WHAT}: the loader raised before it took a tensor: {type(e).__name__}: {e}") \
                from e
        raised[taken[-1]] = why
        return None
    finally:
        _active.pop()
    return rec


def _result(rec: _Recorder, wanted) -> Recorded:
    out = Recorded(refused=dict(rec.refused))
    out.slices = [s for s in rec.slices if s.name not in rec.refused]
    out.unused = [n for n, _, _ in wanted if n not in rec.copied and n not in rec.refused]
    return out


def _param_names(load_weights, params: dict[str, torch.Tensor] | None) -> dict[int, str]:
    if params is None:
        owner = getattr(load_weights, "__self__", None)
        if isinstance(owner, torch.nn.Module):
            params = dict(owner.named_parameters())
            params.update(owner.named_buffers())
    out: dict[int, str] = {}
    for name, t in (params or {}).items():
        if isinstance(t, torch.Tensor) and t.device.type != "meta":
            out.setdefault(t.untyped_storage().data_ptr(), name)
    return out
