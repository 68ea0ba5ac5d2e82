"""Plug-ins for the trainers that load checkpoints themselves.

- :mod:`pipeload.integrations.lightning` — ``PipeloadCheckpointIO`` for ``Trainer(plugins=[...])`` and
  ``Fabric(plugins=[...])``;
- :mod:`pipeload.integrations.accelerate` — ``enable(accelerator)`` for ``Accelerator.load_state``, and
  ``reading_once(accelerator, directory)`` for the transformers ``Trainer``'s resume.

Each is imported by name, on first use: ``import pipeload`` imports neither, and pipeload works without
Lightning or Accelerate installed. The sharded loads of these frameworks (FSDP, ModelParallel) go through
``torch.distributed.checkpoint``, which :func:`pipeload.dcp.installed` switches.
"""
