"""pipeload's exceptions: one flat hierarchy under :class:`PipeloadError`.

Every message names what a user needs to find the problem: the file, the key (fqn or safetensors
tensor name) and, for distributed failures, the rank(s). Messages are one short sentence each.
"""

from __future__ import annotations

import pickle
from typing import Mapping


class PipeloadError(Exception):
    """Base class of every error pipeload raises on purpose.

    ``planning`` is True on an error a load raised alike on every rank while planning, before anything
    was read or any destination written (the state dict or the checkpoint refused); a caller may then
    take another path with the same state dict (the DCP switch does).
    """

    planning: bool = False


class CheckpointFormatError(PipeloadError):
    """A checkpoint file is malformed: bad ``.metadata``, bad safetensors header, wrong sizes."""


class HeaderError(CheckpointFormatError):
    """A safetensors header violates the format (raised by ``pipeload.io._fastio``)."""


class TensorNotFoundError(CheckpointFormatError, KeyError):
    """A safetensors file does not contain the tensor the metadata points at."""

    def __str__(self) -> str:  # KeyError would repr() the message
        return str(self.args[0]) if self.args else ""


class ChecksumError(CheckpointFormatError):
    """A chunk's bytes do not match the checksum recorded when it was written."""


class StateDictError(PipeloadError):
    """The state dict given to save()/load() cannot be used (bad values, missing keys, mismatches).

    ``problems`` lists every problem found, so one run reports all of them at once.
    """

    def __init__(self, message: str, problems: list[str] | None = None):
        self.problems = list(problems or [])
        if self.problems:
            message = message + "\n  - " + "\n  - ".join(self.problems)
        super().__init__(message)


class UnpicklingError(CheckpointFormatError, pickle.UnpicklingError):
    """``torch.load`` refused a file's pickle (``weights_only=True`` and a global it does not allow, or
    bytes that are no pickle): :func:`pipeload.load_file`'s form of torch's own error, which it chains.
    Catching ``pickle.UnpicklingError`` (what ``torch.load`` raises) still catches it."""


class ReadError(PipeloadError):
    """Reading a chunk from a checkpoint file failed (I/O error, file vanished or changed)."""


class DistributedError(PipeloadError):
    """One or more ranks failed; raised alike on every rank of the group.

    ``failures`` maps the group rank that failed to its error message.
    """

    def __init__(self, what: str, failures: Mapping[int, str]):
        self.failures = dict(sorted(failures.items()))
        ranks = ", ".join(str(r) for r in self.failures)
        lines = [f"{what} failed on rank(s) {ranks}:"]
        for rank, msg in self.failures.items():
            body = msg.rstrip().replace("\n", "\n    ")
            lines.append(f"  [rank {rank}] {body}")
        super().__init__("\n".join(lines))


class SaveTimeoutError(PipeloadError, TimeoutError):
    """A background save's ``wait(timeout)`` gave up before the save finished (the save goes on)."""
