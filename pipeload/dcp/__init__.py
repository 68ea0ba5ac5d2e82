"""pipeload inside ``torch.distributed.checkpoint``: DCP's API, planners and results, with each stored
box several ranks read fetched from storage by one of them and sent to the others.

Two ways in:

- ``pipeload.dcp.install()`` (or ``with pipeload.dcp.installed():``) — a process-wide switch that rebinds
  DCP's default readers (``FileSystemReader`` wherever DCP binds it, ``HuggingFaceStorageReader``) to
  pipeload's subclasses, so that code which never lets a user pass a reader — ``dcp.load(sd,
  checkpoint_id=path)`` in torchtitan and Lightning, ``FileSystemReader(dir)`` in Accelerate — reads each
  replicated box once. ``uninstall()`` restores DCP's classes (the same objects). See :mod:`.switch`.
- ``dcp.load(sd, storage_reader=pipeload.dcp.StorageReader(path))`` — the same reader, passed explicitly.

The switch also rebinds ``dcp.save`` and ``dcp.async_save``: calls with the default planner and DCP's
file-system writer are planned by pipeload's save (each replicated chunk written once, by the rank that
will read it; ``async_save`` as ``pipeload.save(background=True)``) and written in DCP's own layout;
every other call runs DCP's code. :func:`last_save_stats` says which path a call took (:mod:`.save`).

What stays DCP's: any ``LoadPlanner`` (the default, ``_EmptyStateDictLoadPlanner`` of
``dcp_to_torch_save``, planners that rename or skip keys), ``process_group=`` and ``no_dist=True``,
stream transforms (``ZStandard``, any registered ``StreamTransformExtension``: read by DCP's own code),
rank-local metadata, the checkpoint layout. Where pipeload cannot serve a call, DCP's reader (the parent
class) serves it. The readers issue no collective: sends go only between ranks that DCP's coordinator
reported as loading together, and only when there are two or more (:mod:`.readonce`). In place:
a tensor box of a plain ``.distcp`` blob is viewed in the mapped file and copied once into DCP's
destination (:mod:`.reader`).

What no reader can change, because ``dcp.load`` does it around the reader: every rank unpickles the
whole ``.metadata`` (O(total chunks) per rank: about a minute per rank for 1.9 M chunks, FSDP at 4,096
ranks) and its planner walks it into ``ReadItem`` objects; the coordinator gathers every rank's pickled
plan (O(W x S) Python objects on one rank, W ranks of S boxes), plans centrally — pipeload's read-once
planning runs there too, O(W x S) — and scatters the plans back. ``pipeload.load(state_dict, path)``
does none of these (one rank decodes the metadata into a chunk table, plans are exchanged as compact
rows, see :mod:`pipeload.formats.dcpmeta`); use it where the caller can.
"""

from __future__ import annotations

from .save import DcpSaveStats, last_save_stats
from .reader import FileSystemReader, HuggingFaceStorageReader, StorageReader
from .readonce import ReadStats, last_stats
from .switch import install, installed, is_installed, uninstall

__all__ = ["install", "uninstall", "installed", "is_installed", "StorageReader", "FileSystemReader",
           "HuggingFaceStorageReader", "ReadStats", "last_stats", "DcpSaveStats", "last_save_stats"]
