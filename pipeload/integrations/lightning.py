"""Lightning: a ``CheckpointIO`` whose loads read the checkpoint file once for the whole process group.

::

    from pipeload.integrations.lightning import PipeloadCheckpointIO

    trainer = Trainer(strategy="ddp", plugins=[PipeloadCheckpointIO()])
    trainer = Trainer(strategy="ddp", plugins=[AsyncCheckpointIO(PipeloadCheckpointIO())])
    fabric = Fabric(strategy="ddp", plugins=[PipeloadCheckpointIO()])

What it covers, exactly (Lightning 2.6):

- **Saving** is Lightning's own: :class:`PipeloadCheckpointIO` is a ``TorchCheckpointIO`` and does not
  override ``save_checkpoint`` or ``remove_checkpoint``. The strategy calls them on global rank 0 only, and
  the file is the ``torch.save`` file stock Lightning writes. Checkpoints are interchangeable with stock
  Lightning in both directions; with ``AsyncCheckpointIO`` the save runs in its thread, as it always does.
- **Loading** under the strategies whose ``load_checkpoint`` goes through the plug-in (DDP and its
  spawn/fork variants, single device): ``Trainer.fit/validate/test/predict(ckpt_path=...)`` and Fabric's
  ``load``/``load_raw`` call ``load_checkpoint`` on every rank. The ranks first agree, in the process
  group's store, that all of them made the call (:mod:`pipeload.integrations._agree`); then
  :func:`pipeload.load_file` reads the file on one rank and broadcasts its bytes, and every rank returns
  what ``torch.load`` returns. A rank that does not make the call (``ckpt_path="last"`` resolved to
  nothing on one node, a file missing on one node) is not waited for: after ``agree_timeout`` seconds the
  ranks that did call read the file themselves, as stock Lightning does. Paths with a scheme (fsspec URLs)
  are read by Lightning's own loader.
- **Not covered: FSDP and ModelParallel loads.** Their ``load_checkpoint`` never calls the
  ``CheckpointIO`` (the Trainer strategies override it; Fabric's refuse a ``CheckpointIO`` plug-in
  outright): a sharded checkpoint is read with ``torch.distributed.checkpoint.load(...,
  checkpoint_id=path)`` (and FSDP's optimizer through a ``FileSystemReader(path)``), a full one with
  ``torch.load`` or Lightning's lazy loader, on every rank. Only their full-state-dict *saves* reach the
  plug-in (rank 0, Lightning's own file). For the sharded loads, run the call under pipeload's DCP
  switch, which those calls reach by name (tested with ModelParallel, tensor parallel on CPU)::

      with pipeload.dcp.installed():
          trainer.fit(model, ckpt_path="ckpt/")

  DeepSpeed and XLA load with their own engines.

Requires the ``lightning`` package (not the standalone ``pytorch_lightning``).
"""

from __future__ import annotations

import os
from typing import Any, Callable, Optional

try:
    from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO
except ImportError as e:  # pragma: no cover - exercised only without lightning installed
    raise ImportError("pipeload.integrations.lightning needs the `lightning` package") from e

from ._agree import load_once, weights_only_of

__all__ = ["PipeloadCheckpointIO"]


def _keep_storage(storage, location):  # TorchCheckpointIO's default: tensors stay where torch.load puts them
    return storage


class PipeloadCheckpointIO(TorchCheckpointIO):
    """Lightning's ``TorchCheckpointIO``, loading through :func:`pipeload.load_file` (one read per group).

    Args:
        process_group: the ranks that load together (default: the world, the group of Lightning's DDP).
        agree_timeout: how long a rank that called ``load_checkpoint`` waits for the others before reading
            the file on its own (seconds).

    ``last_stats`` holds the statistics of the last load (``None`` before the first one, and after a load
    that was read rank by rank). Saving and removing are ``TorchCheckpointIO``'s, unchanged.
    """

    def __init__(self, *, process_group: Any = None, agree_timeout: float = 60.0) -> None:
        super().__init__()
        self.process_group = process_group
        self.agree_timeout = agree_timeout
        self.last_stats: Any = None

    def load_checkpoint(
        self,
        path: Any,
        map_location: Optional[Callable] = _keep_storage,
        weights_only: Optional[bool] = None,
    ) -> dict[str, Any]:
        """What ``TorchCheckpointIO.load_checkpoint`` returns, the file read once for the group."""
        stock = lambda: super(PipeloadCheckpointIO, self).load_checkpoint(path, map_location, weights_only)  # noqa: E731
        self.last_stats = None
        local = os.fspath(path)
        if "://" in local:
            return stock()
        if not os.path.isfile(local):  # before any agreement: a rank without the file raises alone
            raise FileNotFoundError(f"Checkpoint file not found: {path}")
        checkpoint, self.last_stats = load_once(
            "lightning", local, stock, group=self.process_group, timeout=self.agree_timeout,
            map_location=map_location, weights_only=weights_only_of(weights_only),
        )
        return checkpoint

