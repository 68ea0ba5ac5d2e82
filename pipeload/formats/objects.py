"""Python objects in a checkpoint: ``torch.save`` bytes that load back under ``weights_only=True``.

A checkpoint is untrusted input, so an object record is decoded by torch's ``weights_only`` unpickler
and nothing else: no code from the file runs. Trainers keep numpy values in their state (the tuple
``np.random.get_state()`` returns holds a uint32 array; loggers keep numpy scalars), which that
unpickler refuses by default; pipeload's own loads (:func:`load_object`) also allow exactly the
globals that rebuild numpy arrays, scalars and dtypes of plain dtypes (bool, integers, floating,
complex), through checking wrappers:

- ``numpy.dtype`` makes only a dtype spelled as a string of a plain dtype (what a pickle of a dtype
  holds); an object, structured, string or datetime dtype is refused with the unpickler's error;
- ``numpy._core.multiarray._reconstruct`` (and numpy 1's ``numpy.core`` name) makes only a bare
  ``numpy.ndarray``, whose state then needs one of those dtypes;
- ``numpy._core.multiarray.scalar`` makes only scalars of those dtypes;
- the plain dtypes' classes (``numpy.dtypes.UInt32DType``, ...) and ``numpy.ndarray`` are allowed as
  the unpickler requires of any class it restores state into.

The extra names are added to torch's allow-list only for the duration of one of pipeload's loads,
under a lock, and only where the user has not allowed a global of the same name (the user's choice
wins, so ``torch.serialization.add_safe_globals`` still decides what else loads); torch's list is as
the user left it afterwards. A ``torch.load`` in another thread during that window also accepts plain
numpy arrays, nothing more. What a crafted pickle could still build (``ndarray.__new__`` of dtype
object holds only ``None``) is refused after decoding by a walk of the containers.

:func:`encode_object` accepts a value only if :func:`load_object` restores it, so what a save refuses
and what a load refuses are one rule with one message (:func:`refusal`).
"""

from __future__ import annotations

import contextlib
import functools
import io
import pickle
import threading
from typing import Any

import numpy as np
import torch

try:
    from numpy._core import multiarray as _multiarray  # numpy 2
except ImportError:  # pragma: no cover - numpy 1
    from numpy.core import multiarray as _multiarray

PLAIN_DTYPE_CHARS = "?bBhHiIlLqQefdgFDG"  # bool, signed and unsigned integers, floating, complex
_PLAIN = frozenset(PLAIN_DTYPE_CHARS)
_LOCK = threading.Lock()


def _is_plain(dt: np.dtype) -> bool:
    return dt.char in _PLAIN and dt.fields is None and dt.subdtype is None


def _refuse_dtype(dt: Any) -> pickle.UnpicklingError:
    cls = f"numpy.dtypes.{type(dt).__name__}" if isinstance(dt, np.dtype) else type(dt).__qualname__
    return pickle.UnpicklingError(
        f"numpy dtype {dt!s} ({cls}) is not one pipeload restores: only numpy arrays and scalars of bool, "
        f"integer, floating and complex dtypes load without trusting the file (an object array's items "
        f"are arbitrary objects). Convert it (e.g. `.tolist()`), or if you trust the file use "
        f"`torch.serialization.add_safe_globals([numpy.dtype, {cls}])`"
    )


def _dtype(spec, align=False, copy=True) -> np.dtype:
    """``numpy.dtype`` as a pickle calls it, for plain dtypes only."""
    if type(spec) is not str or type(align) is not bool or type(copy) is not bool:
        raise pickle.UnpicklingError(f"numpy.dtype called with {type(spec).__name__}: a pickle of a dtype "
                                     f"spells it as a string")
    dt = np.dtype(spec, align, copy)
    if not _is_plain(dt):
        raise _refuse_dtype(dt)
    return dt


def _reconstruct(subtype, shape, dtype):
    """numpy's ``_reconstruct``, making a bare ``numpy.ndarray`` only (its state brings the dtype)."""
    if subtype is not np.ndarray:
        raise pickle.UnpicklingError(f"numpy _reconstruct of {subtype!r}: only numpy.ndarray is restored")
    return _multiarray._reconstruct(subtype, shape, dtype)


def _scalar(dtype, data=None):
    """numpy's ``scalar`` (how a numpy scalar pickles), for plain dtypes and their bytes only."""
    if not isinstance(dtype, np.dtype) or not _is_plain(dtype):
        raise _refuse_dtype(dtype)
    if type(data) is not bytes:
        raise pickle.UnpicklingError(f"numpy scalar of {dtype} from {type(data).__name__}, not bytes")
    return _multiarray.scalar(dtype, data)


@functools.lru_cache(maxsize=1)
def _numpy_globals() -> tuple:
    """The (callable, pickled name) pairs torch's unpickler needs for plain numpy values."""
    pairs: list = [(_dtype, "numpy.dtype"), (np.ndarray, "numpy.ndarray")]
    for mod in ("numpy._core.multiarray", "numpy.core.multiarray"):  # numpy 2's name, numpy 1's
        pairs += [(_reconstruct, f"{mod}._reconstruct"), (_scalar, f"{mod}.scalar")]
    for c in PLAIN_DTYPE_CHARS:
        cls = type(np.dtype(c))
        pairs.append((cls, f"{cls.__module__}.{cls.__qualname__}"))
    return tuple(pairs)


def _name(entry) -> str:
    return entry[1] if isinstance(entry, tuple) else f"{entry.__module__}.{entry.__qualname__}"


@contextlib.contextmanager
def numpy_allowed():
    """Within: torch's ``weights_only`` unpickler also rebuilds plain numpy values (see module).
    Entries named like one the user allowed are left out; exactly those added are removed after."""
    with _LOCK:
        taken = {_name(g) for g in torch.serialization.get_safe_globals()}
        with torch.serialization.safe_globals([p for p in _numpy_globals() if p[1] not in taken]):
            yield


def load_object(data: bytes | bytearray | memoryview, map_location=None) -> Any:
    """``torch.load(weights_only=True)`` of an object record, plain numpy values allowed; raises what
    the unpickler raises (:func:`refusal` words it), or ``pickle.UnpicklingError`` for an array of a
    dtype that is not plain found in the result."""
    with numpy_allowed():
        value = torch.load(io.BytesIO(data), map_location=map_location, weights_only=True)
        user = set(torch.serialization.get_safe_globals())
    _check_arrays(value, user)
    return value


def _check_arrays(value: Any, user: set) -> None:
    """Refuse a numpy array, scalar or dtype whose dtype is not plain (unless the user allowed its
    class) anywhere in the containers the unpickler built; iterative, each container visited once."""
    stack, seen = [value], set()
    while stack:
        v = stack.pop()
        if isinstance(v, (np.ndarray, np.generic, np.dtype)):
            dt = v if isinstance(v, np.dtype) else v.dtype
            if not _is_plain(dt) and type(dt) not in user:
                raise _refuse_dtype(dt)
        elif isinstance(v, (dict, list, tuple, set, frozenset)) and id(v) not in seen:
            seen.add(id(v))
            stack.extend(v.items() if isinstance(v, dict) else v)


def refusal(e: BaseException) -> str:
    """What an unpickler's refusal says was refused (and, where torch allows it, how to allow it), on
    one line: torch's text without its general advice about ``weights_only``; else the first line."""
    text = str(e)
    if text.startswith("Weights only load failed"):
        why = text.split("WeightsUnpickler error:", 1)[1] if "WeightsUnpickler error:" in text else \
            text.split("\n\n", 1)[-1]
        why = " ".join(why.split("Check the documentation of torch.load", 1)[0].split())
        if why:
            return why
    first = text.strip().splitlines()[0] if text.strip() else ""
    return f"{type(e).__name__}: {first}" if first else type(e).__name__


def encode_object(value: Any) -> bytes:
    """``torch.save``'s bytes of ``value``, accepted only if :func:`load_object` restores them (exactly
    what a load will do); ``ValueError`` naming the value's class and the refusal otherwise."""
    buf = io.BytesIO()
    try:
        torch.save(value, buf)
    except Exception as e:  # noqa: BLE001 - unpicklable values
        raise ValueError(f"value of type {type(value).__name__} cannot be serialised ({e})") from None
    data = buf.getvalue()
    try:
        load_object(data)
    except Exception as e:  # noqa: BLE001 - the unpickler's refusal is the user's answer
        raise ValueError(
            f"value of type {type(value).__name__} cannot be restored with torch.load(weights_only=True) "
            f"({refusal(e)}); store plain Python types, numpy arrays of plain dtypes and tensors, or "
            f"convert it first"
        ) from None
    return data
