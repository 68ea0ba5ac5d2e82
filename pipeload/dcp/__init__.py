"""pipeload inside ``torch.distributed.checkpoint``: DCP's API and results, on pipeload's engine.

Two ways in:

- ``pipeload.dcp.install()`` (or ``with pipeload.dcp.installed():``) — a process-wide switch. Every
  ``dcp.load`` (``state_dict_loader.load``, the deprecated ``load_state_dict``) that pipeload can serve
  exactly runs :func:`pipeload.load`'s planning and pipeline: one compact exchange instead of DCP's
  gather of every rank's plan on a coordinator, each box several ranks need read once and broadcast
  while the next are read (small boxes batched), the plan kept for the next load. The rest stays on
  DCP's planning with pipeload's readers, which DCP's default ``FileSystemReader`` and
  ``HuggingFaceStorageReader`` are rebound to (each shared box read once and sent). Which calls take
  which path: :mod:`.load`; which path the last one took: :func:`last_load`. ``uninstall()`` restores
  DCP's objects (the same objects). See :mod:`.switch`.
- ``dcp.load(sd, storage_reader=pipeload.dcp.StorageReader(path))`` — the reader alone, passed
  explicitly: DCP's planning, each shared box read once (:mod:`.readonce`, :mod:`.reader`).

Safety, on both: nothing from a checkpoint is unpickled by code that runs what the pickle names — the
``.metadata`` through an allow-list of DCP's classes, saved objects only if ``torch.load(weights_only=True)``
accepts them — unless ``install(allow_pickle=True)`` trusts the files.

The switch also rebinds ``dcp.save`` and ``dcp.async_save``: calls with the default planner and DCP's
file-system writer are planned by pipeload's save (each replicated chunk written once, by the rank that
will read it; ``async_save`` as ``pipeload.save(background=True)``) and written in DCP's own layout;
every other call runs DCP's code. :func:`last_save_stats` says which path a call took (:mod:`.save`).

What DCP's path cannot avoid (calls that stay there): every rank unpickles the whole ``.metadata``
(O(total chunks) per rank), the coordinator gathers every rank's pickled plan (O(W x S) objects on one
rank) and scatters the plans back. On the engine one rank decodes the metadata into a chunk table the
others receive, and plans travel as compact rows (:mod:`pipeload.formats.dcpmeta`).
"""

from __future__ import annotations

from .save import DcpSaveStats, last_save_stats
from .reader import FileSystemReader, HuggingFaceStorageReader, StorageReader
from .load import DCPLoadError, SwitchStats, last_load
from .readonce import ReadStats, last_stats
from .switch import install, installed, is_installed, uninstall

__all__ = ["install", "uninstall", "installed", "is_installed", "StorageReader", "FileSystemReader",
           "HuggingFaceStorageReader", "ReadStats", "last_stats", "last_load", "SwitchStats", "DCPLoadError",
           "DcpSaveStats", "last_save_stats"]
