"""What pipeload does with each kind of tensor it is handed, as a load destination or a save source.

pipeload copies bytes straight between a file mapping (or a broadcast buffer) and a tensor's memory.
That is right only for a tensor whose values *are* one strided block of host or CUDA memory. Every
other kind is sorted here, before the first collective of a load or a save (validation before
mutation), into one of:

- **plain** (a ``torch.Tensor`` or ``nn.Parameter``, or a subclass over real storage, dense, on the
  CPU or a CUDA device): copied into / out of in place. A conjugate or negative view is plain too: its
  memory is one block, but it does not hold its values, so every copy into one goes through torch's
  ``copy_`` (the reader, the broadcast staging and the saver check :func:`lazy_view` per tensor);
- **materialised** (load only, a plain tensor on the ``meta`` device, as a model built on meta has):
  as ``dcp.load`` does, a CPU tensor of its shape and dtype is loaded and put in the tensor's place in
  its container once the load has succeeded (the meta tensor itself has no memory to fill);
- **refused**, with a ``StateDictError`` naming the key: tensors of another layout (sparse, nested,
  MKL-DNN), quantized tensors, wrapper subclasses without storage of their own (``LocalShardsWrapper``,
  float8 training tensors, ``_make_wrapper_subclass`` types, also as a DTensor's local tensor), the
  legacy ``ShardedTensor``, and devices pipeload does not copy to (anything but CPU, CUDA and, for a
  load destination, meta).

The hot path (:func:`pipeload.plan._leafplan.resolve`) tests the common kind with a few attribute reads
and calls :func:`adopt` only for the rest, so a state dict of plain tensors and DTensors pays ~0.2 us a
leaf for this.
"""

from __future__ import annotations

import torch

from ..device import fillable

try:
    from torch.distributed.tensor import DTensor
except ImportError:  # pragma: no cover - older torch
    from torch.distributed._tensor import DTensor  # type: ignore

_PYTHON_KEY = torch._C.DispatchKey.Python


def lazy_view(t: torch.Tensor) -> bool:
    """Whether ``t`` is a conjugate or negative view: its memory holds other values than it reads as."""
    return t.is_conj() or t.is_neg()


def refusal(t: torch.Tensor, *, load: bool) -> str | None:
    """Why pipeload cannot copy into (``load``) or out of ``t`` in place, or None when it can.

    ``t`` is a plain tensor or a DTensor's local tensor; a meta tensor is accepted for a load (the caller
    materialises it) and refused for a save (it has no data).
    """
    name = f"{type(t).__module__}.{type(t).__qualname__}"
    if type(t).__name__ == "ShardedTensor":
        return ("a legacy ShardedTensor: pipeload loads and saves DTensors (convert it with "
                "DTensor.from_local, or load it with dcp.load)")
    if isinstance(t, DTensor):
        return "a DTensor nested in a DTensor"
    if t.is_nested or t.layout != torch.strided:
        kind = "a nested tensor" if t.is_nested else f"a tensor of layout {t.layout}"
        return f"{kind}: only dense tensors are {'loaded' if load else 'saved'}; convert it to dense"
    if t.is_quantized:
        return f"a quantized tensor ({t.dtype}): store its dequantized values or its int representation"
    device = t.device.type
    if device == "meta" and not load:
        return "a tensor on the meta device has no data to store"
    if device != "meta" and not fillable(device):
        return (f"a tensor on device {t.device}: pipeload copies into host memory and into "
                f"accelerators whose device module has streams and events (CUDA, XPU, NPU...) only; move "
                f"it to the CPU or such a device first")
    if type(t) not in _PLAIN and _is_wrapper(t):
        return (f"a {name}, a tensor subclass without memory of its own: pipeload copies bytes into a "
                f"tensor's memory and cannot {'fill' if load else 'read'} it; use a plain tensor or a DTensor "
                f"(or dcp.{'load' if load else 'save'}, which goes through the subclass's own hooks)")
    return None


def _is_wrapper(t: torch.Tensor) -> bool:
    """A subclass that dispatches to Python (``_make_wrapper_subclass``) or whose storage has no memory."""
    if torch._C._dispatch_keys(t).has(_PYTHON_KEY):
        return True
    try:
        return t.numel() > 0 and t.untyped_storage().data_ptr() == 0
    except Exception:  # noqa: BLE001 - a storage it cannot show is no memory to copy into
        return True


def source_refusal(value: torch.Tensor) -> str | None:
    """Why a save cannot store ``value`` (a tensor or a DTensor) from its memory, or None when it can."""
    local = value._local_tensor if isinstance(value, DTensor) else value
    if (type(local) in _PLAIN and (local.is_cpu or local.is_cuda) and local.layout is torch.strided
            and not local.is_nested and not local.is_quantized):
        return None
    why = refusal(local, load=False)
    return None if why is None else why + (" (the DTensor's local tensor)" if local is not value else "")


_PLAIN = (torch.Tensor, torch.nn.Parameter)


def adopt(fqn: str, value, local: torch.Tensor) -> torch.Tensor:
    """The tensor a load copies ``fqn``'s box into, for a ``local`` that is not of the common kind:
    ``local`` itself, or a new CPU tensor standing in for a meta one (the caller puts it in place after
    the load). Raises ``ValueError`` naming ``fqn`` for a kind pipeload refuses (see the module doc)."""
    why = refusal(local, load=True)
    if why is not None:
        where = " (the DTensor's local tensor)" if local is not value else ""
        raise ValueError(f"{fqn!r}: {why}{where}")
    if local.device.type != "meta":
        return local
    if local is not value:
        raise ValueError(f"{fqn!r}: a DTensor on the meta device; materialise the model first "
                         f"(module.to_empty(device=...)) so the load has memory to fill")
    out = torch.empty(local.shape, dtype=local.dtype)
    return torch.nn.Parameter(out, requires_grad=local.requires_grad) if isinstance(local, torch.nn.Parameter) else out


def problem(fqn: str, value, error: Exception) -> str:
    """The problem line for a leaf whose box could not be resolved: its kind's refusal when it has one
    (a nested tensor fails on ``.shape`` before anything else asks), else ``error``'s text."""
    local = getattr(value, "_local_tensor", value)
    why = refusal(local, load=True) if isinstance(local, torch.Tensor) else None
    if why is not None:
        return f"{fqn!r}: {why}"
    return str(error) if isinstance(error, ValueError) else f"{fqn!r}: {type(error).__name__}: {error}"
