"""The Lightning, Accelerate and transformers integrations with the real frameworks, on 2-rank gloo worlds.

Two worlds in all (the frameworks import slowly: every sub-case shares them). Each rank joins the world
through ``run_world`` and the frameworks find it already initialised: Lightning's environment variables
(``LOCAL_RANK`` set: processes are launched externally) make its DDP strategy join, not spawn, and
Accelerate reads the same variables. Each rank is its own emulated host, so ``load_file`` broadcasts.

World 1, Lightning then Accelerate:
- a ``Trainer`` (DDP, CPU) trains two steps with stock Lightning and saves; another with
  ``PipeloadCheckpointIO``; a fresh ``Trainer`` resumes each through the plug-in and one resumes the
  plug-in's file stock: what ``on_train_start`` sees (weights, optimizer state, global step) is what the
  saving run ended with, and the plug-in's ``last_stats`` show the file read by one rank;
- the same, save and resume, with the plug-in wrapped in ``AsyncCheckpointIO``;
- ModelParallel (which loads with ``dcp.load``, never through a ``CheckpointIO``) resumed under
  ``pipeload.dcp.installed()``: restored exactly, boxes both ranks need read by one;
- Fabric ``save``/``load`` through the plug-in, plain and wrapped in ``AsyncCheckpointIO``;
- a load only rank 0 makes: it reads the file itself after ``agree_timeout``, no hang, and the next load
  every rank makes is collective again;
- an ``Accelerator`` trains one step and ``save_state``s, keeping what it holds as the reference.
World 2, fresh processes (where ``import pipeload`` and ``import pipeload.integrations`` are checked not
to have imported Lightning or Accelerate): ``enable(accelerator)``, ``load_state`` of that directory
restores the reference exactly, each shared file read by one rank, ``torch.load`` and safetensors'
``load_file`` are the originals again afterwards; ``disable`` restores stock, which loads it too. Then a
transformers ``Trainer`` (DDP) trains and checkpoints, and a fresh ``Trainer`` resumes inside
``reading_once``: what it holds when training begins is what the first one ended with, each shared file
of the checkpoint read by one rank, the per-rank ``rng_state_<rank>.pth`` by its own.
"""

from __future__ import annotations

import os
from importlib.util import find_spec

import pytest
import torch

from pipeload.tools._world import run_world

# find_spec, not importorskip: the ranks import this module and must not have imported the frameworks yet
pytestmark = pytest.mark.skipif(find_spec("lightning") is None or find_spec("accelerate") is None,
                                reason="needs lightning and accelerate (the test extra)")

WORLD_TIMEOUT = 150
STEPS = 2


def _env(rank: int, world: int) -> None:
    os.environ.update({"LOCAL_RANK": str(rank), "RANK": str(rank), "NODE_RANK": "0", "WORLD_SIZE": str(world),
                       "LOCAL_WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29400",
                       "OMP_NUM_THREADS": "1", "PL_DISABLE_FORK": "1"})


# ---- Lightning -------------------------------------------------------------------------------------

def _lightning_classes():
    import lightning as L
    from torch.utils.data import DataLoader, TensorDataset

    class Tiny(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.layer = torch.nn.Linear(4, 3)

        def training_step(self, batch, batch_idx):
            return self.layer(batch[0]).pow(2).mean()

        def configure_optimizers(self):
            return torch.optim.Adam(self.parameters(), lr=0.1)

        def train_dataloader(self):
            g = torch.Generator().manual_seed(0)
            return DataLoader(TensorDataset(torch.randn(16, 4, generator=g)), batch_size=2)

    class Record(L.Callback):
        """What the run starts from (after a resume: what it restored) and ends with; saves at the end."""

        def __init__(self, save_to=None):
            self.save_to, self.start, self.end = save_to, None, None

        def on_train_start(self, trainer, pl_module):
            self.start = _snapshot(trainer, pl_module)

        def on_train_end(self, trainer, pl_module):
            self.end = _snapshot(trainer, pl_module)
            if self.save_to:
                trainer.save_checkpoint(self.save_to)

    return L, Tiny, Record


def _snapshot(trainer, pl_module) -> dict:
    import copy

    return {"model": {k: v.detach().clone() for k, v in pl_module.state_dict().items()},
            "optimizer": copy.deepcopy(trainer.optimizers[0].state_dict()), "step": trainer.global_step}


def _equal(a, b, what: str) -> None:
    if isinstance(a, dict):
        assert a.keys() == b.keys(), what
        for k in a:
            _equal(a[k], b[k], f"{what}.{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), what
        for i, (x, y) in enumerate(zip(a, b)):
            _equal(x, y, f"{what}[{i}]")
    elif isinstance(a, torch.Tensor):
        a, b = (t.to_local() if hasattr(t, "to_local") else t for t in (a, b))  # DTensor: this rank's shard
        assert a.dtype == b.dtype and torch.equal(a, b), what
    else:
        assert a == b, what


def _fit(L, Tiny, Record, root, *, plugins=(), steps=STEPS, save_to=None, ckpt_path=None, strategy="ddp"):
    rec = Record(save_to)
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=strategy, max_steps=steps, plugins=list(plugins),
                        callbacks=[rec], logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, num_sanity_val_steps=0, default_root_dir=root)
    trainer.fit(Tiny(), ckpt_path=ckpt_path)
    return rec


def _stats_row(stats) -> dict | None:
    """The numbers of a load's statistics the parent checks (plain values: they cross the process boundary)."""
    if stats is None:
        return None
    return {"bytes_read": int(stats.bytes_read), "bytes_received": int(stats.bytes_received)}


def _lightning_trainer_cases(root: str) -> dict:
    from lightning.pytorch.plugins.io import AsyncCheckpointIO

    from pipeload.integrations.lightning import PipeloadCheckpointIO

    L, Tiny, Record = _lightning_classes()
    out = {}
    stock_ckpt, plugin_ckpt, async_ckpt = (os.path.join(root, n) for n in ("stock.ckpt", "plugin.ckpt", "async.ckpt"))
    trained_stock = _fit(L, Tiny, Record, root, save_to=stock_ckpt).end
    trained_plugin = _fit(L, Tiny, Record, root, plugins=[PipeloadCheckpointIO()], save_to=plugin_ckpt).end
    for name, ckpt, trained, io in [
        ("plugin<-plugin", plugin_ckpt, trained_plugin, PipeloadCheckpointIO()),
        ("plugin<-stock", stock_ckpt, trained_stock, PipeloadCheckpointIO()),
        ("stock<-plugin", plugin_ckpt, trained_plugin, None),
    ]:
        rec = _fit(L, Tiny, Record, root, plugins=[io] if io else [], steps=STEPS + 1, ckpt_path=ckpt)
        _equal(rec.start, trained, name)
        out[name] = {"stats": _stats_row(io.last_stats) if io else None, "size": os.path.getsize(ckpt)}
    trained_async = _fit(L, Tiny, Record, root, plugins=[AsyncCheckpointIO(PipeloadCheckpointIO())],
                         save_to=async_ckpt).end
    wrapped = AsyncCheckpointIO(PipeloadCheckpointIO())
    rec = _fit(L, Tiny, Record, root, plugins=[wrapped], steps=STEPS + 1, ckpt_path=async_ckpt)
    _equal(rec.start, trained_async, "async")
    out["async"] = {"stats": _stats_row(wrapped.checkpoint_io.last_stats), "size": os.path.getsize(async_ckpt)}
    assert trained_async["step"] == STEPS and rec.end["step"] == STEPS + 1
    return out


def _model_parallel_case(root: str) -> dict:
    """ModelParallel (tensor parallel over both ranks) saves a DCP checkpoint and loads it with
    ``dcp.load(checkpoint_id=)``, never through a ``CheckpointIO``: resumed under the DCP switch (on
    pipeload's engine), what it restores is what it saved, and boxes both ranks need were received."""
    import pipeload.dcp
    from lightning.pytorch.strategies import ModelParallelStrategy

    L, Tiny, Record = _lightning_classes()

    class Parallel(Tiny):
        def __init__(self):
            super().__init__()
            self.layer, self.out = torch.nn.Linear(4, 6), torch.nn.Linear(6, 2)  # even shards over 2 ranks

        def configure_model(self):
            from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

            parallelize_module(self, self.device_mesh["tensor_parallel"],
                               {"layer": ColwiseParallel(), "out": RowwiseParallel()})

        def training_step(self, batch, batch_idx):
            return self.out(self.layer(batch[0])).pow(2).mean()

    def strategy():
        return ModelParallelStrategy(data_parallel_size=1, tensor_parallel_size=2)

    path = os.path.join(root, "model-parallel.ckpt")
    trained = _fit(L, Parallel, Record, root, strategy=strategy(), save_to=path).end
    with pipeload.dcp.installed():
        rec = _fit(L, Parallel, Record, root, strategy=strategy(), steps=STEPS + 1, ckpt_path=path)
    _equal(rec.start, trained, "model parallel")
    last = pipeload.dcp.last_load()  # Lightning's own dcp.load, on pipeload's engine
    return {"path": last.path, "bytes_received": last.load.bytes_received, "bytes_read": last.load.bytes_read}


def _fabric_case(root: str, wrap: bool) -> dict:
    import lightning as L
    from lightning.pytorch.plugins.io import AsyncCheckpointIO

    from pipeload.integrations.lightning import PipeloadCheckpointIO

    def setup(seed):
        torch.manual_seed(seed)
        model = torch.nn.Linear(4, 3)
        return fabric.setup(model, torch.optim.Adam(model.parameters(), lr=0.1))

    plugin = PipeloadCheckpointIO()
    io = AsyncCheckpointIO(plugin) if wrap else plugin
    fabric = L.Fabric(accelerator="cpu", devices=2, strategy="ddp", plugins=[io])
    fabric.launch()
    model, opt = setup(1)
    fabric.backward(model(torch.randn(2, 4)).pow(2).mean())
    opt.step()
    path = os.path.join(root, f"fabric-{int(wrap)}.ckpt")
    fabric.save(path, {"model": model, "optimizer": opt, "step": 7})
    if wrap:
        io.teardown()  # waits for the save thread (Fabric's strategy does this at its own teardown)
    fabric.barrier()
    saved = {"model": {k: v.clone() for k, v in model.state_dict().items()}, "optimizer": opt.state_dict()}
    model2, opt2 = setup(2)
    state = {"model": model2, "optimizer": opt2, "step": 0}
    fabric.load(path, state)
    _equal({"model": model2.state_dict(), "optimizer": opt2.state_dict()}, saved, f"fabric wrap={wrap}")
    assert state["step"] == 7
    return {"stats": _stats_row(plugin.last_stats), "size": os.path.getsize(path)}


def _one_rank_only(rank: int, root: str) -> dict:
    import torch.distributed as dist

    from pipeload.integrations.lightning import PipeloadCheckpointIO

    path = os.path.join(root, "plugin.ckpt")
    io = PipeloadCheckpointIO(agree_timeout=1.0)
    out = {}
    if rank == 0:
        ckpt = io.load_checkpoint(path)
        _equal(ckpt["state_dict"], torch.load(path, weights_only=True)["state_dict"], "one rank")
        out["alone"] = _stats_row(io.last_stats)
    dist.barrier()
    io.load_checkpoint(os.path.join(root, "stock.ckpt"))  # every rank again: collective
    out["after"] = _stats_row(io.last_stats)
    out["size"] = os.path.getsize(os.path.join(root, "stock.ckpt"))
    return out


# ---- Accelerate ------------------------------------------------------------------------------------

class _Custom:
    """An object registered for checkpointing: Accelerate loads its file with ``weights_only=False``."""

    def __init__(self):
        self.state = {"seen": 0, "scale": torch.zeros(2)}

    def state_dict(self):
        return self.state

    def load_state_dict(self, state):
        self.state = state


def _accelerate_objects(seed: int):
    from accelerate import Accelerator

    torch.manual_seed(seed)
    accelerator = Accelerator(cpu=True)
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    model, opt, sched = accelerator.prepare(model, opt, sched)
    accelerator.register_for_checkpointing(custom := _Custom())
    return accelerator, model, opt, sched, custom


def _accelerate_state(accelerator, model, opt, sched, custom) -> dict:
    import copy

    return {"model": {k: v.clone() for k, v in accelerator.unwrap_model(model).state_dict().items()},
            "optimizer": copy.deepcopy(opt.state_dict()), "scheduler": sched.state_dict(),
            "custom": copy.deepcopy(custom.state), "step": accelerator.step}


def _accelerate_save(rank: int, root: str) -> None:
    accelerator, model, opt, sched, custom = _accelerate_objects(3)
    accelerator.backward(model(torch.randn(2, 4)).pow(2).mean())
    opt.step()
    sched.step()
    opt.zero_grad()
    custom.state = {"seen": 5, "scale": torch.arange(2.0)}
    accelerator.save_state(os.path.join(root, "acc"))
    torch.save(_accelerate_state(accelerator, model, opt, sched, custom),
               os.path.join(root, f"acc-reference-{rank}.pt"))


# ---- the transformers Trainer ----------------------------------------------------------------------

class _Regression(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.layer = torch.nn.Linear(4, 1)

    def forward(self, x, labels=None):
        out = self.layer(x).squeeze(-1)
        return {"loss": (out - labels).pow(2).mean(), "logits": out}


class _Data(torch.utils.data.Dataset):
    def __init__(self):
        g = torch.Generator().manual_seed(0)
        self.x, self.y = torch.randn(16, 4, generator=g), torch.randn(16, generator=g)

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return {"x": self.x[i], "labels": self.y[i]}


def _hf_trainer(root: str, steps: int, callbacks=()):
    from transformers import Trainer, TrainingArguments

    args = TrainingArguments(output_dir=os.path.join(root, "hf"), max_steps=steps, per_device_train_batch_size=2,
                             save_strategy="steps", save_steps=STEPS, report_to="none", use_cpu=True,
                             logging_strategy="no", disable_tqdm=True, ddp_backend="gloo", seed=0,
                             dataloader_num_workers=0, learning_rate=0.1)
    return Trainer(model=_Regression(), args=args, train_dataset=_Data(), callbacks=list(callbacks))


def _hf_snapshot(model, optimizer) -> dict:
    import copy

    return {"model": {k: v.detach().clone() for k, v in model.state_dict().items()},
            "optimizer": copy.deepcopy(optimizer.state_dict())}


def _hf_save(rank: int, root: str) -> None:
    trainer = _hf_trainer(root, STEPS)
    trainer.train()  # writes hf/checkpoint-2
    torch.save(_hf_snapshot(trainer.model, trainer.optimizer), os.path.join(root, f"hf-reference-{rank}.pt"))


def _hf_resume(rank: int, root: str) -> dict:
    """The README's recipe: ``trainer.train(resume_from_checkpoint=...)`` inside ``reading_once``; what the
    Trainer holds when training begins (after its loads) is what the saving run ended with."""
    from transformers import TrainerCallback

    from pipeload.integrations.accelerate import reading_once

    seen = {}

    class Begin(TrainerCallback):
        def on_train_begin(self, args, state, control, model=None, optimizer=None, **kwargs):
            seen.update(_hf_snapshot(model, optimizer))

    trainer = _hf_trainer(root, STEPS + 1, [Begin()])
    checkpoint = os.path.join(root, "hf", f"checkpoint-{STEPS}")
    with reading_once(trainer.accelerator, checkpoint) as scope:
        trainer.train(resume_from_checkpoint=checkpoint)
    _equal(seen, torch.load(os.path.join(root, f"hf-reference-{rank}.pt"), weights_only=True), "transformers")
    return {"stats": {name: _stats_row(s) for name, s in scope.last_stats.items()},
            "sizes": {name: os.path.getsize(os.path.join(checkpoint, name)) for name in scope.last_stats}}


def world_save(rank: int, world: int, root: str) -> dict:
    _env(rank, world)
    out = {"trainer": _lightning_trainer_cases(root)}
    out["fabric"] = _fabric_case(root, wrap=False)
    out["fabric-async"] = _fabric_case(root, wrap=True)
    out["one-rank"] = _one_rank_only(rank, root)
    out["model-parallel"] = _model_parallel_case(root)
    _accelerate_save(rank, root)
    return out


def world_load(rank: int, world: int, root: str) -> dict:
    import sys

    import pipeload.integrations  # noqa: F401  (the rank's fork server imported pipeload itself)

    assert not {"lightning", "accelerate"} & set(sys.modules), "import pipeload imported a framework"
    import safetensors.torch

    from pipeload.integrations import accelerate as pl_accelerate

    _env(rank, world)
    reference = torch.load(os.path.join(root, f"acc-reference-{rank}.pt"), weights_only=True)
    accelerator, model, opt, sched, custom = _accelerate_objects(4)
    handle = pl_accelerate.enable(accelerator)
    assert pl_accelerate.enable(accelerator) is handle
    originals = (torch.load, safetensors.torch.load_file)
    accelerator.load_state(os.path.join(root, "acc"))
    assert (torch.load, safetensors.torch.load_file) == originals, "the routers outlived load_state"
    _equal(_accelerate_state(accelerator, model, opt, sched, custom), reference, "accelerate")
    stats = {name: _stats_row(s) for name, s in handle.last_stats.items()}
    pl_accelerate.disable(accelerator)
    assert "load_state" not in vars(accelerator)
    accelerator, model, opt, sched, custom = _accelerate_objects(5)
    accelerator.load_state(os.path.join(root, "acc"))  # stock again
    _equal(_accelerate_state(accelerator, model, opt, sched, custom), reference, "accelerate, stock")
    sizes = {name: os.path.getsize(os.path.join(root, "acc", name)) for name in stats}
    _hf_save(rank, root)  # here, not in the first world: transformers is imported by one world only
    return {"stats": stats, "sizes": sizes, "transformers": _hf_resume(rank, root)}


@pytest.fixture(scope="module")
def worlds(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("integrations"))
    saved = run_world(world_save, 2, root, timeout=WORLD_TIMEOUT, separate_hosts=True)
    loaded = run_world(world_load, 2, root, timeout=WORLD_TIMEOUT, separate_hosts=True)
    return saved, loaded


def _read_once(rows: list, size: int) -> None:
    """One rank read the whole file, the other read nothing and received it."""
    assert sorted(r["bytes_read"] for r in rows) == [0, size], rows
    assert sorted(r["bytes_received"] for r in rows) == [0, size], rows


@pytest.mark.parametrize("case", ["plugin<-plugin", "plugin<-stock", "stock<-plugin", "async"])
def test_lightning_trainer_resumes_through_the_plugin(worlds, case):
    rows = [r["trainer"][case] for r in worlds[0]]
    if case == "stock<-plugin":
        assert all(r["stats"] is None for r in rows)
    else:
        _read_once([r["stats"] for r in rows], rows[0]["size"])


@pytest.mark.parametrize("case", ["fabric", "fabric-async"])
def test_fabric_save_load_through_the_plugin(worlds, case):
    rows = [r[case] for r in worlds[0]]
    _read_once([r["stats"] for r in rows], rows[0]["size"])


def test_lightning_model_parallel_resumes_under_the_dcp_switch(worlds):
    rows = [r["model-parallel"] for r in worlds[0]]
    assert all(r["path"] == "engine" for r in rows), rows
    assert sum(r["bytes_received"] for r in rows) > 0, rows  # a box both ranks load was read by one


def test_a_load_one_rank_skips_is_read_locally_and_does_not_hang(worlds):
    rank0, rank1 = (r["one-rank"] for r in worlds[0])
    assert rank0["alone"] is None and "alone" not in rank1  # read by rank 0's own torch.load
    _read_once([rank0["after"], rank1["after"]], rank0["size"])


def test_accelerate_load_state_reads_each_shared_file_once(worlds):
    rows = worlds[1]
    names = set(rows[0]["stats"])
    assert {"model.safetensors", "optimizer.bin", "scheduler.bin", "custom_checkpoint_0.pkl"} <= names, names
    assert not any(n.startswith("random_states") for n in names)
    for name in names:
        _read_once([r["stats"][name] for r in rows], rows[0]["sizes"][name])


def test_transformers_trainer_resumes_through_reading_once(worlds):
    rows = [r["transformers"] for r in worlds[1]]
    names = set(rows[0]["stats"])
    assert {"model.safetensors", "optimizer.pt", "scheduler.pt"} <= names, names
    assert not any(n.startswith("rng_state") for n in names)
    for name in names:
        _read_once([r["stats"][name] for r in rows], rows[0]["sizes"][name])


def test_reading_once_routes_only_this_threads_shared_files_of_its_directory(tmp_path):
    """Without a process group (a world of one) the routing itself: which calls reach ``load_file``."""
    import threading
    from types import SimpleNamespace

    import safetensors.torch

    from pipeload.integrations.accelerate import reading_once

    ckpt, other = tmp_path / "ckpt", tmp_path / "other"
    for d in (ckpt, other):
        d.mkdir()
        for name in ("optimizer.pt", "rng_state_0.pth"):
            torch.save({"x": torch.arange(3)}, d / name)
        safetensors.torch.save_file({"w": torch.ones(2)}, str(d / "model.safetensors"))
    originals = (torch.load, safetensors.torch.load_file)
    seen = {}
    with reading_once(SimpleNamespace(distributed_type="MULTI_CPU"), str(ckpt)) as scope:
        worker = threading.Thread(target=lambda: seen.update(t=torch.load(ckpt / "optimizer.pt", weights_only=True)))
        worker.start()
        worker.join()
        assert torch.equal(torch.load(str(ckpt / "optimizer.pt"), weights_only=True)["x"], torch.arange(3))
        assert torch.equal(safetensors.torch.load_file(str(ckpt / "model.safetensors"))["w"], torch.ones(2))
        torch.load(ckpt / "rng_state_0.pth", weights_only=True)  # a per-rank file: each rank its own
        torch.load(other / "optimizer.pt", weights_only=True)  # another directory
        with open(ckpt / "optimizer.pt", "rb") as f:
            torch.load(f, weights_only=True)  # a file object
        torch.load(ckpt / "optimizer.pt", weights_only=True, mmap=True)  # an argument load_file does not take
    assert torch.equal(seen["t"]["x"], torch.arange(3))  # the other thread: the original torch.load
    assert sorted(scope.last_stats) == ["model.safetensors", "optimizer.pt"]
    assert all(s.bytes_read == os.path.getsize(ckpt / n) for n, s in scope.last_stats.items())
    assert (torch.load, safetensors.torch.load_file) == originals
    with reading_once(SimpleNamespace(distributed_type="FSDP"), str(ckpt)) as scope:
        torch.load(ckpt / "optimizer.pt", weights_only=True)  # under FSDP only rank 0 may read it: not routed
    assert scope.last_stats == {}
