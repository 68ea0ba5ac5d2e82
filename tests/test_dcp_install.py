"""``pipeload.dcp``: the reader never issues a collective DCP did not ask for, and the process-wide switch.

One real gloo world of 4 ranks (each its own emulated host) runs every sub-case; each compares with
DCP's own reader on the same checkpoint, bit for bit:

- the reader where ``dcp.load`` does not run on the world (issue 33): each rank loads its own
  checkpoint (same keys, saved in another order on each rank) with ``no_dist=True``, then with
  ``process_group=`` a group of its own, then rank 0 alone with ``no_dist=True`` while the others go on;
- under ``install()``: a TP x DP checkpoint written by stock ``dcp.save`` (a ``Stateful`` wrapper of a
  tensor-parallel model and its Adam state from ``get_state_dict``, DTensors on a 2 x 2 mesh, a plain
  tensor, an int) loads through ``checkpoint_id=`` and through ``FileSystemReader(path)``, each
  replicated box read by one rank; ``dcp_to_torch_save`` (``no_dist``, ``_EmptyStateDictLoadPlanner``)
  on rank 0 alone; a subgroup of two ranks; a planner that renames a key and skips one; a ZStandard
  checkpoint (transformed boxes read by DCP's code, tensors still shared); the Hugging Face reader;
  ``load_sharded_optimizer_state_dict`` with the installed ``FileSystemReader``; saved in one layout and
  loaded in another (1-D and 2-D meshes, uneven and column shards); a file cut short raises on every rank.

The switch itself (identity restored, idempotent, nested) is checked in this process.
"""

from __future__ import annotations

import math
import os
import warnings

import pytest
import torch
import torch.distributed as dist

from pipeload.tools._world import run_world

WORLD_TIMEOUT = 150


def _leaves(sd, prefix=""):
    from torch.distributed.tensor import DTensor

    out = {}
    for k, v in sd.items():
        if isinstance(v, dict):
            out.update(_leaves(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v.to_local() if isinstance(v, DTensor) else v
    return out


def _same(a, b, what: str) -> int:
    """Bit-for-bit equality of two (nested) state dicts; the number of tensors compared."""
    a, b = _leaves(a), _leaves(b)
    assert a.keys() == b.keys(), f"{what}: keys {sorted(a.keys() ^ b.keys())}"
    n = 0
    for k, x in a.items():
        y = b[k]
        if isinstance(x, torch.Tensor):
            assert x.dtype == y.dtype and x.shape == y.shape and torch.equal(x, y), f"{what}: {k}"
            n += 1
        else:
            assert x == y, f"{what}: {k}: {x!r} != {y!r}"
    return n


# -- issue 33: the reader off the world -----------------------------------------------------------


def _own_checkpoint(rank: int, root: str) -> tuple[str, dict]:
    import torch.distributed.checkpoint as dcp

    own = os.path.join(root, f"own{rank}")
    values = {"a": torch.full((4,), 1.0 + 10 * rank), "b": torch.full((4,), 2.0 + 10 * rank)}
    order = ["b", "a"] if rank % 2 else ["a", "b"]
    dcp.save({k: values[k] for k in order}, storage_writer=dcp.FileSystemWriter(own), no_dist=True)
    return own, values


def _load_own(reader, **kw) -> dict:
    import torch.distributed.checkpoint as dcp

    dest = {"a": torch.zeros(4), "b": torch.zeros(4)}
    dcp.load(dest, storage_reader=reader, **kw)
    return dest


def _off_the_world_case(rank: int, world: int, root: str, out: dict) -> None:
    from pipeload.dcp import StorageReader
    from pipeload.dcp.reader import DCP_FILE_SYSTEM_READER

    own, values = _own_checkpoint(rank, root)
    ref = _load_own(DCP_FILE_SYSTEM_READER(own), no_dist=True)
    _same(ref, values, "DCP's reader, no_dist")
    _same(_load_own(StorageReader(own), no_dist=True), ref, "no_dist")
    groups = [dist.new_group([r]) for r in range(world)]  # every rank creates every group, in one order
    _same(_load_own(StorageReader(own), process_group=groups[rank]), ref, "a group of one")
    dist.barrier()
    if rank == 0:  # alone: the others go on to the barrier; a collective here would never complete
        _same(_load_own(StorageReader(own), no_dist=True), ref, "rank 0 alone")
    dist.barrier()
    out["off_the_world"] = True


# -- the switch: a TP x DP checkpoint written by stock dcp.save -------------------------------------


class _App:
    """DCP's ``Stateful`` protocol over a model and its optimizer (``get_state_dict``/``set_state_dict``)."""

    def __init__(self, model, optim):
        self.model, self.optim = model, optim

    def state_dict(self):
        from torch.distributed.checkpoint.state_dict import get_state_dict

        m, o = get_state_dict(self.model, self.optim)
        return {"model": m, "optim": o}

    def load_state_dict(self, sd):
        from torch.distributed.checkpoint.state_dict import set_state_dict

        set_state_dict(self.model, self.optim, model_state_dict=sd["model"], optim_state_dict=sd["optim"])


def _trained(mesh, seed: int, steps: int) -> _App:
    """A tensor-parallel MLP (the ``tp`` dim; replicas along ``dp``) and Adam after ``steps`` steps."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 8))
    parallelize_module(model, mesh["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()})
    optim = torch.optim.Adam(model.parameters(), lr=0.1)
    for i in range(steps):
        model(torch.full((2, 8), float(i + seed))).sum().backward()
        optim.step()
        optim.zero_grad()
    return _App(model, optim)


def _tp_dp_state(mesh, seed: int, steps: int) -> dict:
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    torch.manual_seed(100 + seed)
    grid, rep, plain = torch.randn(8, 6), torch.randn(6, 4).to(torch.bfloat16), torch.randn(5)
    fill = (lambda t: t) if steps else torch.zeros_like
    return {"app": _trained(mesh, seed, steps),
            "extra": {"grid": distribute_tensor(fill(grid), mesh, [Shard(0), Shard(1)]),
                      "tp_only": distribute_tensor(fill(rep), mesh, [Replicate(), Shard(0)]),
                      "plain": fill(plain), "step": 7 if steps else 0}}


def _plain(sd: dict) -> dict:
    """What a state dict holds after a load: ``Stateful`` values as their ``state_dict()``."""
    return {k: (v.state_dict() if isinstance(v, _App) else _plain(v) if isinstance(v, dict) else v)
            for k, v in sd.items()}


def _read_once(stats, world: int, *, tensors_only: bool = False) -> dict:
    """Each rank's boxes read and received, gathered: every box (every tensor box) read by one rank only."""
    from torch.distributed.checkpoint.planner import LoadItemType

    got: list = [None] * world
    dist.all_gather_object(got, (stats.items_read, stats.items_received, stats.messages_received))
    reads = [k for r in got for k in r[0] if not (tensors_only and k[4] == LoadItemType.BYTE_IO.value)]
    assert len(reads) == len(set(reads)), "a box was read by two ranks"
    return {"read": len(reads), "received": sum(r[1] for r in got), "messages": sum(r[2] for r in got)}


def _unique_bytes(path: str, readers: int, prefixes: tuple = ("",)) -> int:
    """The bytes a load of every key under ``prefixes`` reads: each tensor box once, each stored object
    by each of ``readers`` ranks (objects are read by the ranks that load them, in the private phase)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    md = dcp.FileSystemReader(path).read_metadata()
    n = 0
    for fqn, meta in md.state_dict_metadata.items():
        if not fqn.startswith(prefixes):
            continue
        if isinstance(meta, BytesStorageMetadata):
            n += readers * sum(info.length for idx, info in md.storage_data.items() if idx.fqn == fqn)
        else:
            n += meta.properties.dtype.itemsize * math.prod(meta.size)
    return n


def _on_engine(world: int, unique: int | None = None) -> dict:
    """The last ``dcp.load`` ran on pipeload's engine on every rank; with ``unique``, the bytes the ranks
    read from storage add up to it (each box read once)."""
    import pipeload.dcp as pd

    last = pd.last_load()
    assert last is not None and last.path == "engine", last
    got: list = [None] * world
    dist.all_gather_object(got, (last.load.bytes_read, last.load.bytes_received, last.load.plan_reused))
    read = sum(g[0] for g in got)
    if unique is not None:
        assert read == unique, (read, unique)
    return {"read": read, "received": sum(g[1] for g in got), "reused": all(g[2] for g in got)}


def _switch_case(rank: int, world: int, root: str, out: dict) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh

    import pipeload.dcp as pd
    from pipeload.dcp.reader import DCP_FILE_SYSTEM_READER

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    path = os.path.join(root, "tpdp")
    saved = _tp_dp_state(mesh, 1, 2)
    dcp.save(saved, checkpoint_id=path)
    expect = _plain(saved)
    ref = _tp_dp_state(mesh, 2, 0)
    dcp.load(ref, checkpoint_id=path)
    out["stock_tensors"] = _same(_plain(ref), expect, "stock dcp.load")
    with pd.installed():
        by_id = _tp_dp_state(mesh, 3, 0)
        dcp.load(by_id, checkpoint_id=path)
        out["by_id"] = _on_engine(world, _unique_bytes(path, world))
        _same(_plain(by_id), _plain(ref), "install(), checkpoint_id=")
        reader = dcp.FileSystemReader(path)
        assert type(reader) is pd.FileSystemReader and isinstance(reader, DCP_FILE_SYSTEM_READER)
        explicit = _tp_dp_state(mesh, 4, 0)
        dcp.load(explicit, storage_reader=reader)
        out["explicit"] = _on_engine(world, _unique_bytes(path, world))
        _same(_plain(explicit), _plain(ref), "install(), FileSystemReader(path)")
    out["tp_dp_tensors"] = out["stock_tensors"]
    _dcp_to_torch_save_alone(rank, path, out)
    _subgroup_and_planner(rank, world, path, out)


def _dcp_to_torch_save_alone(rank: int, path: str, out: dict) -> None:
    """``dcp_to_torch_save`` (``no_dist``, ``_EmptyStateDictLoadPlanner``) on rank 0 while the others go on."""
    import pipeload.dcp as pd
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dist.barrier()
    if rank == 0:
        dcp_to_torch_save(path, path + ".stock.pt")
        with pd.installed():
            dcp_to_torch_save(path, path + ".ours.pt")
            # format_utils binds _load_state_dict by name: the switch reaches it there too
            assert pd.last_load().path == "dcp" and "_EmptyStateDictLoadPlanner" in pd.last_load().why, pd.last_load()
        stock, ours = (torch.load(path + s, weights_only=False) for s in (".stock.pt", ".ours.pt"))
        out["to_torch_save_tensors"] = _same(ours, stock, "dcp_to_torch_save under install()")
        assert pd.last_stats().items_received == 0
    dist.barrier()


class _Rename:
    """A planner that loads checkpoint key ``extra.plain`` into the state dict's ``renamed``."""

    def __new__(cls):
        from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

        class Rename(DefaultLoadPlanner):
            def set_up_planner(self, state_dict, metadata=None, is_coordinator=False):
                state_dict = {("extra.plain" if k == "renamed" else k): v for k, v in state_dict.items()}
                super().set_up_planner(state_dict, metadata, is_coordinator)

        return Rename(allow_partial_load=True)


def _subgroup_and_planner(rank: int, world: int, path: str, out: dict) -> None:
    """Ranks {0, 1} and {2, 3} load on their own group; then a renaming, skipping planner on the world."""
    import torch.distributed.checkpoint as dcp

    import pipeload.dcp as pd

    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    stock = {"extra": {"plain": torch.zeros(5), "step": 0}}
    dcp.load(stock, checkpoint_id=path, process_group=pairs[rank // 2])
    with pd.installed():
        ours = {"extra": {"plain": torch.zeros(5), "step": 0}}
        dcp.load(ours, checkpoint_id=path, process_group=pairs[rank // 2])
        last = pd.last_load()
        out["pair"] = (last.path, last.load.bytes_received, last.load.bytes_read)
        _same(ours, stock, "install(), a subgroup")
        renamed = {"renamed": torch.zeros(5), "absent": torch.ones(2)}
        dcp.load(renamed, checkpoint_id=path, planner=_Rename())
        assert pd.last_load().path == "dcp" and "Rename" in pd.last_load().why, pd.last_load()
        out["renamed"] = _read_once(pd.last_stats(), world)
    assert torch.equal(renamed["renamed"], stock["extra"]["plain"]) and torch.equal(renamed["absent"], torch.ones(2))


def _batched_case(rank: int, world: int, root: str, out: dict) -> None:
    """Many small replicated tensors through a planner of the user's (DCP's planning, pipeload's reader):
    each read by one rank, and what a receiver gets from one reader comes in one message."""
    import torch.distributed.checkpoint as dcp

    import pipeload.dcp as pd

    path = os.path.join(root, "small")
    torch.manual_seed(11)
    saved = {f"t{i}": torch.randn(3, i + 1) for i in range(24)}
    dcp.save(saved, checkpoint_id=path)
    dest = {k: torch.zeros_like(v) for k, v in saved.items()}
    with pd.installed():
        dcp.load(dest, checkpoint_id=path, planner=_Rename())
    assert pd.last_load().path == "dcp"
    _same(dest, saved, "small boxes, batched")
    out["batched"] = _read_once(pd.last_stats(), world)


class _Recording(dict):
    """A dict subclass whose ``__setitem__`` records the keys DCP's ``load`` assigns back."""

    def __setitem__(self, key, value):
        self.__dict__.setdefault("assigned", []).append(key)
        super().__setitem__(key, value)


def _other_destinations_case(rank: int, world: int, root: str, out: dict) -> None:
    """What the engine hands to DCP's path under the switch, each loaded as stock DCP loads it: a
    ``ShardedTensor`` destination, a nested dict under ``flatten_state_dict=False``; and the top-level
    re-assignment through a dict subclass's ``__setitem__`` on the engine."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed._shard.sharded_tensor import empty as sharded_empty
    from torch.distributed._shard.sharding_spec import ChunkShardingSpec
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner

    import pipeload.dcp as pd

    spec = ChunkShardingSpec(dim=0, placements=[f"rank:{r}/cpu" for r in range(world)])
    st = sharded_empty(spec, 8, 3)
    st.local_shards()[0].tensor.copy_(torch.full((2, 3), float(rank)))
    path = os.path.join(root, "sharded")
    dcp.save({"st": st, "step": 5}, checkpoint_id=path)
    dest = sharded_empty(spec, 8, 3)
    dest.local_shards()[0].tensor.zero_()
    with pd.installed():
        dcp.load({"st": dest}, checkpoint_id=path)
        got = [pd.last_load().path, torch.equal(dest.local_shards()[0].tensor, torch.full((2, 3), float(rank)))]
        nested = os.path.join(root, "unflat")
        dcp.save({"n": {"a": torch.arange(4.0)}}, checkpoint_id=nested,
                 planner=DefaultSavePlanner(flatten_state_dict=False))
        sd = {"n": {"a": torch.zeros(4)}}
        dcp.load(sd, checkpoint_id=nested, planner=DefaultLoadPlanner(flatten_state_dict=False))
        got.append(pd.last_load().path)
    stock = {"n": {"a": torch.zeros(4)}}  # (DCP's planner leaves this one as it was: so must the switch)
    dcp.load(stock, checkpoint_id=nested, planner=DefaultLoadPlanner(flatten_state_dict=False))
    got.append(torch.equal(sd["n"]["a"], stock["n"]["a"]))
    with pd.installed():
        rec = _Recording(step=0)
        dcp.load(rec, checkpoint_id=path)
        got += [pd.last_load().path, rec["step"], rec.__dict__.get("assigned")]
    out["other_destinations"] = got


def _zstd_and_hf_case(rank: int, world: int, root: str, out: dict) -> None:
    """A ZStandard checkpoint and a safetensors directory, under install(), against DCP's readers."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint._extension import ZStandard
    from torch.distributed.device_mesh import init_device_mesh
    from safetensors.torch import save_file

    import pipeload.dcp as pd
    from pipeload.dcp.reader import DCP_HF_READER

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    path = os.path.join(root, "zstd")
    saved = _tp_dp_state(mesh, 5, 1)
    dcp.save(saved["extra"], storage_writer=dcp.FileSystemWriter(path, _extensions=[ZStandard()]))
    ref = _tp_dp_state(mesh, 6, 0)["extra"]
    dcp.load(ref, checkpoint_id=path)
    _same(ref, saved["extra"], "stock dcp.load, ZStandard")
    with pd.installed():
        ours = _tp_dp_state(mesh, 7, 0)["extra"]
        dcp.load(ours, checkpoint_id=path)
        # refused by the engine at planning (transforms): DCP's planning, pipeload's reader; a compressed
        # object's size is not in the metadata: each rank reads it through DCP's code
        assert pd.last_load().path == "dcp" and "transforms" in pd.last_load().why, pd.last_load()
        out["zstd"] = _read_once(pd.last_stats(), world, tensors_only=True)
        _same(ours, ref, "install(), ZStandard")
    hf = os.path.join(root, "hf")
    if rank == 0:
        os.makedirs(hf)
        torch.manual_seed(9)
        save_file({"w": torch.randn(6, 4), "v": torch.randn(3).to(torch.bfloat16)}, os.path.join(hf, "model.safetensors"))
    dist.barrier()
    stock = {"w": torch.zeros(6, 4), "v": torch.zeros(3, dtype=torch.bfloat16)}
    dcp.load(stock, storage_reader=DCP_HF_READER(hf))
    with pd.installed():
        reader = dcp.HuggingFaceStorageReader(hf)
        assert type(reader) is pd.HuggingFaceStorageReader and isinstance(reader, DCP_HF_READER)
        ours = {"w": torch.zeros(6, 4), "v": torch.zeros(3, dtype=torch.bfloat16)}
        dcp.load(ours, storage_reader=reader)
        out["hf"] = _on_engine(world)
    out["hf_tensors"] = _same(ours, stock, "install(), HuggingFaceStorageReader")


def _sharded_optimizer_case(rank: int, world: int, root: str, out: dict) -> None:
    """``load_sharded_optimizer_state_dict`` (its own metadata read, its offset planner, ShardedTensors over
    the world) with an installed ``FileSystemReader``, against DCP's reader."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.optimizer import load_sharded_optimizer_state_dict

    import pipeload.dcp as pd
    from pipeload.dcp.reader import DCP_FILE_SYSTEM_READER

    torch.manual_seed(3)
    path = os.path.join(root, "optim")
    dcp.save({"model": {"w": torch.randn(8, 4)},
              "optim": {"state": {"w": {"exp_avg": torch.randn(8, 4), "step": torch.tensor(3.0)}},
                        "param_groups": [{"lr": 0.1, "params": ["w"]}]}}, checkpoint_id=path)
    model = {"w": torch.zeros(8, 4)}
    stock = load_sharded_optimizer_state_dict(model, "optim", DCP_FILE_SYSTEM_READER(path))
    with pd.installed():
        reader = dcp.FileSystemReader(path)
        ours = load_sharded_optimizer_state_dict(model, "optim", reader)
    a, b = stock["optim"]["state"]["w"], ours["optim"]["state"]["w"]
    mine = [(s.tensor, t.tensor) for s, t in zip(a["exp_avg"].local_shards(), b["exp_avg"].local_shards())]
    assert mine and all(torch.equal(x, y) for x, y in mine) and torch.equal(a["step"], b["step"])
    assert ours["optim"]["param_groups"] == stock["optim"]["param_groups"]
    out["sharded_optimizer"] = _read_once(reader.stats, world)


def _resharding_case(rank: int, world: int, root: str, out: dict) -> None:
    """Saved in one layout, loaded under ``install()`` in another (1-D and 2-D meshes, uneven and column
    shards, replicas): every pair equal to the saved tensor, replicated boxes received."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor, zeros

    import pipeload.dcp as pd

    m1, m2 = init_device_mesh("cpu", (world,)), init_device_mesh("cpu", (2, world // 2))
    layouts = [(m1, [Shard(0)]), (m1, [Replicate()]), (m2, [Shard(1), Shard(0)]), (m2, [Replicate(), Shard(1)])]
    full = torch.arange(60, dtype=torch.float).view(6, 10)  # 6 rows, 10 columns: uneven over 4 and 2
    received = 0
    for i, (mesh, placements) in enumerate(layouts):
        path = os.path.join(root, f"reshard{i}")
        dcp.save({"t": distribute_tensor(full, mesh, placements)}, checkpoint_id=path)
        for mesh2, placements2 in layouts:
            dest = {"t": zeros([6, 10], device_mesh=mesh2, placements=placements2)}
            with pd.installed():
                dcp.load(dest, checkpoint_id=path)
            assert torch.equal(dest["t"].full_tensor(), full), (placements, placements2)
            assert pd.last_load().path == "engine", pd.last_load()
            received += pd.last_load().load.bytes_received
    out["reshard_received"] = received


def _failed_read_case(rank: int, world: int, root: str, out: dict) -> None:
    """One of the TP x DP checkpoint's files cut short: every rank's ``dcp.load`` under ``install()`` raises
    (the reader that fails still sends, DCP gathers the outcome), none hangs."""
    import shutil

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.device_mesh import init_device_mesh

    import pipeload.dcp as pd

    path = os.path.join(root, "cut")
    if rank == 0:
        shutil.copytree(os.path.join(root, "tpdp"), path)
        with open(os.path.join(path, "__1_0.distcp"), "r+b") as f:
            f.truncate(100)
    dist.barrier()
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    with pd.installed():
        try:
            dcp.load(_tp_dp_state(mesh, 8, 0), checkpoint_id=path)
        except CheckpointException as e:  # DCP's (a BaseException): every rank's error, by rank
            out["cut_raised"] = "__1_0.distcp" in str(e) or str(e)[-300:]
        else:
            out["cut_raised"] = False


class _Hostile:
    """Unpickling it would create ``path`` (a stand-in for any command a checkpoint could run)."""

    def __init__(self, path: str):
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


def _semantics_case(rank: int, world: int, root: str, out: dict) -> None:
    """DCP's rules under the switch, on the engine: missing keys (DCP's error; none with
    ``allow_partial_load``), ``no_dist``, a second load reusing the plan; and no code from a checkpoint
    runs, neither from a hostile ``.metadata`` nor from a saved object, unless ``allow_pickle=True``."""
    import pickle

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

    import pipeload.dcp as pd

    path = os.path.join(root, "tpdp")
    with pd.installed():
        again = {"extra": {"plain": torch.zeros(5), "step": 0}}
        for _ in range(2):
            dcp.load(again, checkpoint_id=path)
        out["reused"] = _on_engine(world)["reused"]
        try:
            dcp.load({"extra": {"plain": torch.zeros(5)}, "nope": torch.zeros(2)}, checkpoint_id=path)
        except CheckpointException as e:
            out["missing"] = "Missing key" in str(e) and "nope" in str(e)
        partial = {"extra": {"plain": torch.zeros(5)}, "nope": torch.ones(2)}
        dcp.load(partial, checkpoint_id=path, planner=DefaultLoadPlanner(allow_partial_load=True))
        out["partial"] = (pd.last_load().path, torch.equal(partial["nope"], torch.ones(2)),
                          torch.equal(partial["extra"]["plain"], again["extra"]["plain"]))
        # dtypes other than the stored ones (float32 -> bfloat16, bfloat16 -> float64): converted as copy_
        # does, on the engine (the cast metadata had lost the chunk index's fields: a refusal, DCP's path)
        cast = {"extra": {"plain": torch.zeros(5, dtype=torch.bfloat16),
                          "tp_only": torch.zeros(6, 4, dtype=torch.float64)}}
        dcp.load(cast, checkpoint_id=path, planner=DefaultLoadPlanner(allow_partial_load=True))
        out["cast"] = (pd.last_load().path, pd.last_load().why, cast["extra"]["plain"].dtype == torch.bfloat16 and
                       torch.equal(cast["extra"]["plain"], again["extra"]["plain"].to(torch.bfloat16)))
        own, values = _own_checkpoint(rank, root)
        mine = _load_own(dcp.FileSystemReader(own), no_dist=True)
        out["no_dist"] = (pd.last_load().path, _same(mine, values, "no_dist under install()"))
    marker = os.path.join(root, f"ran{rank}")
    hostile = os.path.join(root, f"hostile{rank}")
    dcp.save({"t": torch.ones(3), "obj": _Hostile(marker)}, checkpoint_id=hostile, no_dist=True)
    refusals = []
    with pd.installed():
        try:
            dcp.load({"t": torch.zeros(3), "obj": None}, checkpoint_id=hostile, no_dist=True)
        except CheckpointException as e:
            refusals.append("'obj'" in str(e))
        with open(os.path.join(hostile, ".metadata"), "wb") as f:
            pickle.dump(_Hostile(marker), f)
        try:
            dcp.load({"t": torch.zeros(3)}, checkpoint_id=hostile, no_dist=True)
        except CheckpointException as e:
            refusals.append("refusing to unpickle" in str(e))
        out["refused"], out["ran"] = refusals, os.path.exists(marker)
    with pd.installed(allow_pickle=True):
        try:
            dcp.load({"t": torch.zeros(3)}, checkpoint_id=hostile, no_dist=True)
        except BaseException:  # noqa: BLE001 - what the trusted pickle returns is no Metadata
            pass
    out["ran_when_allowed"] = os.path.exists(marker)


def world(rank: int, size: int, root: str) -> dict:
    warnings.filterwarnings("ignore")
    out: dict = {}
    _off_the_world_case(rank, size, root, out)
    _switch_case(rank, size, root, out)
    _semantics_case(rank, size, root, out)
    _batched_case(rank, size, root, out)
    _other_destinations_case(rank, size, root, out)
    _zstd_and_hf_case(rank, size, root, out)
    _sharded_optimizer_case(rank, size, root, out)
    _resharding_case(rank, size, root, out)
    _failed_read_case(rank, size, root, out)
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    pytest.importorskip("zstandard")
    root = str(tmp_path_factory.mktemp("dcp_install"))
    return run_world(world, 4, root, timeout=WORLD_TIMEOUT, pg_timeout=60, separate_hosts=True)


def test_reader_off_the_world_equals_dcps_reader(results):
    """no_dist, a group of one, one rank alone: each rank gets its own checkpoint's values, no hang."""
    assert all(r["off_the_world"] for r in results)


def test_install_loads_a_tp_dp_checkpoint_as_stock_dcp_and_reads_each_box_once(results):
    assert all(r["tp_dp_tensors"] >= 10 for r in results)  # weights, Adam's moments and steps, extras
    for how in ("by_id", "explicit"):
        got = results[0][how]
        assert got["received"] > 0 and got["read"] > 0, how  # replicas along dp received, not read


def test_install_no_dist_subgroup_and_planners(results):
    assert results[0]["to_torch_save_tensors"] >= 10
    # each pair shares its two boxes (the tensor and the int): each read by one rank, received by the other
    for pair in (results[:2], results[2:]):  # the tensor (5 float32) read by one, received by the other
        assert all(r["pair"][0] == "engine" for r in pair) and sum(r["pair"][1] for r in pair) == 20, pair
    assert results[0]["renamed"]["received"] == 3 and results[0]["renamed"]["read"] == 1


def test_the_reader_sends_small_boxes_in_one_message_per_pair(results):
    got = results[0]["batched"]
    assert got["read"] == 24 and got["received"] == 24 * 3, got
    assert got["messages"] <= 4 * 3, got  # at most one per (reader, receiver) pair


def test_install_hands_what_the_engine_would_load_otherwise_to_dcps_path(results):
    for r in results:
        assert r["other_destinations"] == ["dcp", True, "dcp", True, "engine", 5, ["step"]], r


def test_install_reshards_as_dcp_does(results):
    assert sum(r["reshard_received"] for r in results) > 0


def test_install_a_failed_read_raises_on_every_rank(results):
    assert all(r["cut_raised"] is True for r in results), [r["cut_raised"] for r in results]


def test_install_load_sharded_optimizer_state_dict(results):
    assert results[0]["sharded_optimizer"]["received"] > 0  # the step and param_groups: read once, sent


def test_install_zstandard_and_hugging_face(results):
    zstd = results[0]["zstd"]
    assert zstd["received"] > 0  # compressed tensors shared too (read by DCP's code on one rank)

    # 96 + 6 bytes, read once, received by the three other ranks
    assert results[0]["hf"]["read"] == 102 and results[0]["hf"]["received"] == 306, results[0]["hf"]
    assert all(r["hf_tensors"] == 2 for r in results)


def test_install_keeps_dcps_rules_on_the_engine(results):
    for r in results:
        assert r["reused"] and r["missing"] is True, r
        assert r["partial"] == ("engine", True, True) and r["no_dist"] == ("engine", 2), r
        assert r["cast"] == ("engine", "", True), r["cast"]


def test_install_runs_no_code_from_a_checkpoint_unless_allowed(results):
    for r in results:
        assert r["refused"] == [True, True] and r["ran"] is False, r
        assert r["ran_when_allowed"] is True, r


def test_install_loads_a_checkpoint_of_dcps_older_tensor_properties(tmp_path):
    """A ``.metadata`` whose tensors carry ``_shard.sharded_tensor.metadata.TensorProperties`` (what DCP
    wrote before its own class; stock ``dcp.load`` reads it): the allow-list admits it, the engine loads."""
    from unittest.mock import patch

    import torch.distributed.checkpoint as dcp
    from torch.distributed._shard.sharded_tensor.metadata import TensorProperties

    import pipeload.dcp as pd

    value = torch.arange(12.0).view(3, 4)
    with patch("torch.distributed.checkpoint.metadata.TensorProperties", TensorProperties), \
            warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"a": value}, storage_writer=dcp.FileSystemWriter(str(tmp_path)), no_dist=True)
    with pd.installed():
        for reader in (None, dcp.FileSystemReader(str(tmp_path))):
            sd = {"a": torch.zeros(3, 4)}
            dcp.load(sd, checkpoint_id=None if reader else str(tmp_path), storage_reader=reader, no_dist=True)
            assert torch.equal(sd["a"], value) and pd.last_load().path == "engine", pd.last_load()
        md = dcp.FileSystemReader(str(tmp_path)).read_metadata()
        assert type(md.state_dict_metadata["a"].properties) is TensorProperties


def test_installed_readers_driven_without_set_up_read_as_dcps(tmp_path):
    """Code that drives a reader itself — ``storage_data`` set by hand, no ``set_up_storage_reader`` —
    gets DCP's reads from the installed ``FileSystemReader`` and ``HuggingFaceStorageReader``."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

    import pipeload.dcp as pd
    from pipeload.dcp.reader import DCP_FILE_SYSTEM_READER, DCP_HF_READER

    pytest.importorskip("safetensors")
    value = {"w": torch.arange(20.0).view(4, 5), "b": torch.arange(3, dtype=torch.int64)}
    fs_dir, hf_dir = str(tmp_path / "fs"), str(tmp_path / "hf")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(value, checkpoint_id=fs_dir, no_dist=True)
        dcp.save(value, storage_writer=dcp.HuggingFaceStorageWriter(hf_dir), no_dist=True)
    with pd.installed():
        for ours, theirs, path in ((dcp.FileSystemReader, DCP_FILE_SYSTEM_READER, fs_dir),
                                   (dcp.HuggingFaceStorageReader, DCP_HF_READER, hf_dir)):
            md = theirs(path).read_metadata()
            reader = ours(path)
            reader.storage_data = md.storage_data
            sd = {k: torch.zeros_like(v) for k, v in value.items()}
            planner = DefaultLoadPlanner()
            planner.set_up_planner(sd, md, True)
            reader.read_data(planner.create_local_plan(), planner).wait()
            assert all(torch.equal(sd[k], v) for k, v in value.items()), ours
            assert len(pd.last_stats().items_read) == 2


def test_uninstall_restores_dcps_objects_exactly():
    import importlib
    import sys

    import torch.distributed.checkpoint as dcp
    import torch.distributed.checkpoint._storage_utils as su
    import torch.distributed.checkpoint.filesystem as fs
    import torch.distributed.checkpoint.hf_storage as hfs

    import pipeload.dcp as pd

    import torch.distributed.checkpoint.state_dict_loader as sdl

    names = [(dcp, "FileSystemReader"), (su, "FileSystemReader"), (fs, "FileSystemReader"),
             (dcp, "HuggingFaceStorageReader"), (hfs, "HuggingFaceStorageReader"), (sdl, "_load_state_dict")]
    before = [getattr(m, n) for m, n in names]
    pd.install()
    pd.install()  # idempotent
    assert pd.is_installed() and dcp.FileSystemReader is su.FileSystemReader is fs.FileSystemReader is pd.FileSystemReader
    assert sdl._load_state_dict is not before[5] and sdl._load_state_dict.__wrapped__ is before[5]
    assert dcp.HuggingFaceStorageReader is hfs.HuggingFaceStorageReader is pd.HuggingFaceStorageReader
    assert issubclass(pd.FileSystemReader, before[0]) and issubclass(pd.HuggingFaceStorageReader, before[3])
    sys.modules.pop("torch.distributed.checkpoint.format_utils", None)  # imported while installed
    fu = importlib.import_module("torch.distributed.checkpoint.format_utils")
    assert fu.FileSystemReader is pd.FileSystemReader and fu._load_state_dict is sdl._load_state_dict
    with pd.installed():  # nested in an install(): leaves it on
        pass
    assert pd.is_installed()
    pd.uninstall()
    pd.uninstall()
    assert [getattr(m, n) for m, n in names] == before and all(getattr(m, n) is b for (m, n), b in zip(names, before))
    assert fu.FileSystemReader is before[0] and fu._load_state_dict is before[5] and not pd.is_installed()
    with pd.installed():
        with pd.installed(allow_pickle=True):
            assert dcp.FileSystemReader is pd.FileSystemReader and pd.FileSystemReader._allow_pickle
        assert dcp.FileSystemReader is pd.FileSystemReader  # the inner block left the outer's switch on
        assert not pd.FileSystemReader._allow_pickle  # and its allow_pickle
    assert dcp.FileSystemReader is before[0] and su.FileSystemReader is before[0]


def _item(fqn: str, row: int, rows: int = 4):
    from torch.distributed.checkpoint.metadata import MetadataIndex
    from torch.distributed.checkpoint.planner import LoadItemType, ReadItem

    idx = MetadataIndex(fqn, (row, 0))
    return ReadItem(LoadItemType.TENSOR, idx, torch.Size([0, 0]), idx, torch.Size([0, 0]), torch.Size([rows, 8]))


def test_plan_shared_prefers_the_files_writer_then_the_least_loaded_holder():
    """Four boxes held by ranks 10 and 11 (global ranks, plans in another order): a box goes to the rank
    that wrote its file while that rank stays within 11/10 of the mean; the greedy places the rest; one
    holder alone, or holders on one host under the host-aware policy, read for themselves."""
    from torch.distributed.checkpoint.planner import LoadPlan

    from pipeload.dcp.readonce import _Tag, plan_shared

    boxes = [_item(f"w{i}", 0) for i in range(4)]
    plans = [LoadPlan(list(boxes) + [_item("own", 0)]), LoadPlan(list(reversed(boxes)))]
    tags = [_Tag(11, 1, True), _Tag(10, 2, True)]
    writer = {"w0": 10, "w1": 10, "w2": 10, "w3": 11}
    nbytes = lambda item: 100
    ops = plan_shared(plans, tags, nbytes, lambda item: True, lambda item: writer[item.storage_index.fqn],
                      same_host_private=True)
    readers = {op[1][0]: op[2] for op in ops[0]}
    # the cap is 1.1 x (100 alone + 400 shared) / 2 = 275: rank 10 takes w0 and w1 (200), w2 would pass it
    assert readers == {"w0": 10, "w1": 10, "w3": 11, "w2": 11}
    assert ops[0] == ops[1] and [op[0] for op in ops[0]] == [0, 1, 2, 3]  # one numbering, in key order
    assert all(op[3] == (11, 10) for op in ops[0])  # holders in plan order
    same_host = [_Tag(11, 1, True), _Tag(10, 1, True)]
    assert plan_shared(plans, same_host, nbytes, lambda i: True, lambda i: -1, same_host_private=True) == [[], []]
    assert len(plan_shared(plans, same_host, nbytes, lambda i: True, lambda i: -1, same_host_private=False)[0]) == 4
