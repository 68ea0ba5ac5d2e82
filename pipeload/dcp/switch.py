"""The process-wide switch: ``dcp.load`` on pipeload's engine, DCP's default readers rebound to pipeload's.

``dcp.load`` calls ``state_dict_loader._load_state_dict`` through that module's global at call time:
:func:`install` puts :func:`pipeload.dcp.load.engine_load_state_dict`'s function there (and
:func:`uninstall` DCP's own back), so every ``dcp.load`` / ``load_state_dict`` reaches the engine; so
does every DCP module that bound the function by name at import (``format_utils``: ``dcp_to_torch_save``),
and :func:`pipeload.dcp.last_load` tells what those calls did too.

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
from .reader import DCP_FILE_SYSTEM_READER, DCP_HF_READER, FileSystemReader, HuggingFaceStorageReader, StorageReader

_PACKAGE = "torch.distributed.checkpoint"
# where DCP binds the readers (imported by install() so that each is rebound now, not missed later)
_MODULES = ("", ".filesystem", "._storage_utils", ".format_utils", ".hf_storage", "._hf_storage")
_NAMES = ("FileSystemReader", "HuggingFaceStorageReader")
_OURS = ((DCP_FILE_SYSTEM_READER, FileSystemReader), (DCP_HF_READER, HuggingFaceStorageReader))

# DCP's load runs on pipeload's engine: (module, name, factory of the replacement from DCP's function)
_LOAD_DOORS = ((".state_dict_loader", "_load_state_dict", "pipeload.dcp.load:engine_load_state_dict"),)
# (module, name, pipeload's function): DCP functions rebound while installed
_FUNCTIONS = ((_PACKAGE, "save", dcp_save.save), (_PACKAGE, "async_save", dcp_save.async_save),
              (_PACKAGE + ".state_dict_saver", "save", dcp_save.save),
              (_PACKAGE + ".state_dict_saver", "async_save", dcp_save.async_save))

_lock = threading.RLock()
_replaced: dict[tuple[str, str], Any] = {}  # (module, name) -> the object install() found there
_ours: dict[Any, Any] = {}  # each replacement function install() made -> DCP's function it replaced
_on = False
_allow_pickle = False


def _dcp_modules() -> list[tuple[str, Any]]:
    return [(n, m) for n, m in list(sys.modules.items())
            if m is not None and (n == _PACKAGE or n.startswith(_PACKAGE + "."))]


def install(*, allow_pickle: bool = False) -> None:
    """Put pipeload's engine under ``dcp.load``, process-wide: DCP's ``_load_state_dict`` (what
    ``dcp.load``, ``state_dict_loader.load`` and ``load_state_dict`` call) runs :func:`pipeload.load` for
    the calls it can serve exactly (:mod:`pipeload.dcp.load` says which), and DCP's default
    file-system and Hugging Face readers are rebound to pipeload's subclasses
    (:class:`~pipeload.dcp.FileSystemReader`, :class:`~pipeload.dcp.HuggingFaceStorageReader`), which
    read each box several ranks need once on the calls that stay on DCP's planning. ``isinstance``
    checks against DCP's classes hold.

    ``allow_pickle``: ``False`` (default): no code from a checkpoint runs — a ``.metadata`` outside the
    allow-list of DCP's classes, or a saved object ``torch.load(weights_only=True)`` refuses, is refused
    naming the file, the key and the class. ``True`` restores DCP's unpickling of them (for checkpoints
    you trust). Idempotent (a second call sets ``allow_pickle``). Every rank must install alike: the
    engine and DCP's planning issue different collectives."""
    global _on, _allow_pickle
    with _lock:
        _allow_pickle = StorageReader._allow_pickle = bool(allow_pickle)
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
        StorageReader._allow_pickle = _allow_pickle
        _on = True


def _rebind_functions() -> None:
    """Each load door of :data:`_LOAD_DOORS` replaced in its module and in every DCP module that bound it
    by name at import (``format_utils`` holds ``_load_state_dict`` itself: ``dcp_to_torch_save`` calls
    it); then the save functions of :data:`_FUNCTIONS`."""
    for suffix, name, factory in _LOAD_DOORS:
        mod = importlib.import_module(_PACKAGE + suffix)
        original = mod.__dict__[name]
        where, _, attr = factory.partition(":")
        ours = getattr(importlib.import_module(where), attr)(original)
        _ours[ours] = original
        for modname, other in _dcp_modules():
            if other.__dict__.get(name) is original:
                _replaced[(modname, name)] = original
                setattr(other, name, ours)
    for modname, name, ours in _FUNCTIONS:
        mod = importlib.import_module(modname)
        found = mod.__dict__.get(name)
        if found is not None and found is not ours:
            _replaced[(modname, name)] = found
            setattr(mod, name, ours)


def uninstall() -> None:
    """Put back, in every module of DCP, exactly the objects :func:`install` replaced (DCP modules first
    imported while installed, which bound pipeload's classes or functions, get DCP's). A no-op when not
    installed."""
    global _on, _allow_pickle
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
            for _, name, _ in _LOAD_DOORS:  # bound by a DCP module first imported while installed
                found = mod.__dict__.get(name)
                if found is not None and found in _ours:
                    setattr(mod, name, _ours[found])
        _replaced.clear()
        _ours.clear()
        _on = _allow_pickle = StorageReader._allow_pickle = False


def is_installed() -> bool:
    """Whether :func:`install` is in effect."""
    return _on


@contextlib.contextmanager
def installed(*, allow_pickle: bool = False) -> Iterator[None]:
    """``with installed():`` — :func:`install` for the block. A block entered while the switch was already
    on leaves it on at exit, with the ``allow_pickle`` it had (nested blocks and an outer ``install()``
    keep theirs)."""
    with _lock:
        was_on, was_allowed = _on, _allow_pickle
        install(allow_pickle=allow_pickle)
    try:
        yield
    finally:
        if was_on:
            install(allow_pickle=was_allowed)
        else:
            uninstall()
