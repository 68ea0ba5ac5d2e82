"""What a restore reads from this rank's own tier root: the listing, the checks, the chunks.

A rank can read only its own host's root. It lists the newest complete steps there (``format.list_steps``),
reads each rank file's header (validated: a file whose header names another job, step or rank, or
that does not parse, is left out, with a warning naming it: a missing copy), and reports one entry per
file. Checksums are verified by the rank that will read a file, before any destination is written
(:func:`verify`): a file that fails is a missing copy and the restore's decision is re-taken.
"""

from __future__ import annotations

import os
import warnings
from dataclasses import dataclass

import numpy as np
import torch

from ..errors import PipeloadError
from ..formats.chunks import torch_dtype
from ..io._fastio import SafetensorsFile
from ..io.reader import copy_box, guarded_read, narrow
from . import format as tierformat
from .restoreplan import STEPS_LISTED, layout_digest


@dataclass
class TierFile:
    """One rank file of this rank's root, as its header describes it."""

    step: int
    rank: int  # saved rank
    world: int  # saved world
    path: str
    nbytes: int
    tensors: dict  # fqn -> (dtype name, global shape, offsets, lengths, checksum)
    objects: dict  # fqn -> (bytes, checksum)

    @property
    def digest(self) -> int:
        return layout_digest(((f, d, s, o, n) for f, (d, s, o, n, _) in self.tensors.items()), self.objects)

    def entry(self) -> tuple[int, int, int, int, int]:
        return (self.step, self.rank, self.world, self.digest, self.nbytes)

    def table(self) -> dict:
        """The chunk table other ranks plan a resharding restore with (JSON-able)."""
        return {"tensors": {f: {"dtype": d, "shape": list(s), "offsets": list(o), "lengths": list(n)}
                            for f, (d, s, o, n, _) in self.tensors.items()},
                "objects": {f: int(b) for f, (b, _) in self.objects.items()}}


def list_root(root: str, job: str) -> dict[tuple[int, int], TierFile]:
    """Every readable rank file of the newest :data:`STEPS_LISTED` complete steps under ``root``."""
    out: dict[tuple[int, int], TierFile] = {}
    try:
        steps = tierformat.list_steps(root, job)
    except PipeloadError as e:
        warnings.warn(f"pipeload: memory tier {root}: {e}; treated as holding nothing", RuntimeWarning, stacklevel=2)
        return out
    complete = sorted((s for s, v in steps.items() if v.get("complete")), reverse=True)[:STEPS_LISTED]
    for step in complete:
        for r in steps[step]["ranks"]:
            path = os.fspath(tierformat.rank_file(root, step, r))
            tf = _open(path, job, step, r)
            if tf is not None:
                out[(step, r)] = tf
    return out


def _open(path: str, job: str, step: int, rank: int) -> TierFile | None:
    """The file's header, checked against where it lies; None (warned) when it is not this job's step and
    rank's, or does not parse."""
    try:
        h = tierformat.read_rank_header(path, job=job, step=step, rank=rank)
        with SafetensorsFile(path) as sf:
            tensors = {fqn: (t["dtype"], tuple(t["shape"]), tuple(t["offsets"]), tuple(sf.entry(fqn)[1]),
                             t["checksum"]) for fqn, t in h.tensors.items()}
            objects = {fqn: (int(sf.entry(fqn)[3] - sf.entry(fqn)[2]), c) for fqn, c in h.objects.items()}
            return TierFile(step, rank, int(h.world), path, int(sf.size), tensors, objects)
    except Exception as e:  # noqa: BLE001 - a damaged copy is a missing copy
        warnings.warn(f"pipeload: memory tier file {path} is not usable ({type(e).__name__}: {e}); treated as "
                      f"missing", RuntimeWarning, stacklevel=2)
        return None


def verify(tf: TierFile) -> str | None:
    """Check every chunk's and object's xxh3 against the header: None, or why this copy is unusable."""
    try:
        with SafetensorsFile(tf.path) as sf:
            for fqn, want in [*((f, t[4]) for f, t in tf.tensors.items()), *((f, o[1]) for f, o in tf.objects.items())]:
                got, _ = guarded_read(sf, sf.buffer(fqn))
                if got != want:
                    return f"{tf.path}: tensor {fqn!r}: checksum {got} != {want} recorded"
    except Exception as e:  # noqa: BLE001 - a copy that cannot be read is as unusable as a corrupt one
        return f"{tf.path}: {type(e).__name__}: {e}"
    return None


def chunk_view(sf: SafetensorsFile, tf: TierFile, fqn: str) -> torch.Tensor:
    """The stored chunk of ``fqn`` as a tensor over the file's mapping (no copy; copy it guarded)."""
    dtype, _, _, lengths, _ = tf.tensors[fqn]
    buf = sf.buffer(fqn)
    if buf.nbytes == 0:
        return torch.empty(lengths, dtype=torch_dtype(dtype))
    return torch.frombuffer(buf, dtype=torch_dtype(dtype)).view(lengths)


def read_region(sf: SafetensorsFile, tf: TierFile, fqn: str, offsets, lengths) -> torch.Tensor:
    """A private contiguous copy of the box (global ``offsets``/``lengths``) of the stored chunk."""
    _, _, coff, _, _ = tf.tensors[fqn]
    src = narrow(chunk_view(sf, tf, fqn), tuple(o - c for o, c in zip(offsets, coff)), tuple(lengths))
    out = torch.empty(tuple(lengths), dtype=src.dtype)
    copy_box(out, src, tf.path)
    return out


def read_object(sf: SafetensorsFile, fqn: str) -> bytes:
    return bytes(sf.buffer(fqn))


def object_bytes(data: np.ndarray | bytes) -> bytes:
    return bytes(data)
