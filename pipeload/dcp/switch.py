"""The process-wide switch: DCP's default readers rebound to pipeload's.

DCP has no registry of readers. ``dcp.load(sd, checkpoint_id=path)`` picks its reader in
``torch.distributed.checkpoint._storage_utils._storage_setup``, which looks up that module's global
``FileSystemReader`` at call time; trainers that build a reader themselves look up
``torch.distributed.checkpoint.FileSystemReader`` (Accelerate), ``...filesystem.FileSystemReader``, or
``HuggingFaceStorageReader`` (torchtitan's initial load), and ``format_utils`` (``dcp_to_torch_save``)
binds its own. :func:`install` rebinds every such name a module of ``torch.distributed.checkpoint`` holds
to pipeload's subclass of the same class; :func:`uninstall` puts back the very objects it replaced.
Code that took a reference before ``install()`` (``from ... import FileSystemReader`` at import time)
keeps DCP's class: install before such imports, or pass a reader.

It also rebinds the functions of :data:`_FUNCTIONS` — ``dcp.save`` and ``dcp.async_save``, in the package
and in ``state_dict_saver`` — to :mod:`pipeload.dcp.save`'s, and puts back the very objects it found on
:func:`uninstall`. (``save_state_dict``, deprecated, calls DCP's internals directly and stays DCP's.)
"""

from __future__ import annotations

import contextlib
import importlib
import sys
import threading
from typing import Any, Iterator

from . import save as dcp_save
from .reader import DCP_FILE_SYSTEM_READER, DCP_HF_READER, FileSystemReader, HuggingFaceStorageReader

_PACKAGE = "torch.distributed.checkpoint"
# where DCP binds the readers (imported by install() so that each is rebound now, not missed later)
_MODULES = ("", ".filesystem", "._storage_utils", ".format_utils", ".hf_storage", "._hf_storage")
_NAMES = ("FileSystemReader", "HuggingFaceStorageReader")
_OURS = ((DCP_FILE_SYSTEM_READER, FileSystemReader), (DCP_HF_READER, HuggingFaceStorageReader))

# (module, name, pipeload's function): DCP functions rebound while installed
_FUNCTIONS = ((_PACKAGE, "save", dcp_save.save), (_PACKAGE, "async_save", dcp_save.async_save),
              (_PACKAGE + ".state_dict_saver", "save", dcp_save.save),
              (_PACKAGE + ".state_dict_saver", "async_save", dcp_save.async_save))

_lock = threading.RLock()
_replaced: dict[tuple[str, str], Any] = {}  # (module, name) -> the object install() found there
_on = False


def _dcp_modules() -> list[tuple[str, Any]]:
    return [(n, m) for n, m in list(sys.modules.items())
            if m is not None and (n == _PACKAGE or n.startswith(_PACKAGE + "."))]


def install() -> None:
    """Rebind DCP's default file-system and Hugging Face readers, process-wide, to pipeload's subclasses
    (:class:`~pipeload.dcp.FileSystemReader`, :class:`~pipeload.dcp.HuggingFaceStorageReader`).

    After it, ``dcp.load(sd, checkpoint_id=path)`` and ``dcp.load(sd, storage_reader=FileSystemReader(path))``
    read each box several ranks of the load need once and send it; ``isinstance`` checks against DCP's
    classes hold. Idempotent. Every rank should install (a rank without it reads for itself, which is
    correct but its boxes are not shared)."""
    global _on
    with _lock:
        if _on:
            return
        for suffix in _MODULES:
            try:
                importlib.import_module(_PACKAGE + suffix)
            except ImportError:
                pass
        for modname, mod in _dcp_modules():
            for name in _NAMES:
                found = mod.__dict__.get(name)
                for dcp_class, ours in _OURS:
                    if found is dcp_class:
                        _replaced[(modname, name)] = found
                        setattr(mod, name, ours)
        _rebind_functions()
        _on = True


def _rebind_functions() -> None:
    for modname, name, ours in _FUNCTIONS:
        mod = importlib.import_module(modname)
        found = mod.__dict__.get(name)
        if found is not None and found is not ours:
            _replaced[(modname, name)] = found
            setattr(mod, name, ours)


def uninstall() -> None:
    """Put back, in every module of DCP, exactly the objects :func:`install` replaced (DCP modules first
    imported while installed, which bound pipeload's classes, get DCP's). A no-op when not installed."""
    global _on
    with _lock:
        for (modname, name), original in _replaced.items():
            mod = sys.modules.get(modname)
            if mod is not None:
                setattr(mod, name, original)
        for _, mod in _dcp_modules():
            for name in _NAMES:
                found = mod.__dict__.get(name)
                for dcp_class, ours in _OURS:
                    if found is ours:
                        setattr(mod, name, dcp_class)
        _replaced.clear()
        _on = False


def is_installed() -> bool:
    """Whether :func:`install` is in effect."""
    return _on


@contextlib.contextmanager
def installed() -> Iterator[None]:
    """``with installed():`` — :func:`install` for the block. A block entered while the switch was already
    on leaves it on at exit (nested blocks and an outer ``install()`` keep theirs)."""
    with _lock:
        was_on = _on
        install()
    try:
        yield
    finally:
        if not was_on:
            uninstall()
