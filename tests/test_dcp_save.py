"""``dcp.save`` / ``dcp.async_save`` under ``pipeload.dcp.install()``: pipeload's planner, DCP's layout.

One real gloo world of 4 ranks (a 2 x 2 mesh, ``dp`` x ``tp``) runs every sub-case:

- ``dcp.save`` of a tensor-parallel model and its AdamW state (``get_state_dict`` inside an
  ``AppState``-style ``Stateful``), DTensors on the mesh, a plain tensor and an int: the engine path;
  stock ``dcp.load`` (switch off) and pipeload's DCP reader (switch on) read it bit for bit; its
  ``.metadata`` holds the chunks stock ``dcp.save`` records for the same state, each written once;
- ``dcp.async_save`` of the same: a ``Future`` of the ``Metadata``; tensors changed in place after the
  call returned do not reach the checkpoint; ``no_dist=True`` on one rank alone, ``process_group=``;
- a custom planner and a ``ZStandard`` writer go to DCP's own code and still load;
- an unwritable directory on one rank: ``CheckpointException`` on every rank (blocking and from the
  future), no hang;
- a save into the last checkpoint's directory whose write fails on one rank after the others wrote:
  that checkpoint still loads with its own values;
- nothing to save (a ``Stateful`` whose ``state_dict()`` is ``{}``): the engine commits DCP's empty
  ``Metadata``, read by the engine and by stock ``dcp.load``.

The parent process then loads the engine's checkpoint with stock ``dcp.load`` (``no_dist``, no switch)
into whole tensors. ``uninstall()`` restoring DCP's function objects is checked in this process.
"""

from __future__ import annotations

import io
import os
import pickle
import warnings

import pytest
import torch
import torch.distributed as dist

from pipeload.formats.dcpmeta import SIDECAR
from pipeload.tools._world import run_world

WORLD_TIMEOUT = 240


class AppState:
    """DCP's ``Stateful`` protocol over a model and its optimizer."""

    def __init__(self, model, optim):
        self.model, self.optim = model, optim

    def state_dict(self):
        from torch.distributed.checkpoint.state_dict import get_state_dict

        m, o = get_state_dict(self.model, self.optim)
        return {"model": m, "optim": o}

    def load_state_dict(self, sd):
        from torch.distributed.checkpoint.state_dict import set_state_dict

        set_state_dict(self.model, self.optim, model_state_dict=sd["model"], optim_state_dict=sd["optim"])


def _state(mesh, seed: int, steps: int) -> dict:
    """A TP x DP model (tensor-parallel along ``tp``, replicas along ``dp``) with AdamW after ``steps``
    steps, a plain tensor and an int (zeros / 0 with ``steps=0``: a destination)."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 8))
    parallelize_module(model, mesh["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()})
    optim = torch.optim.AdamW(model.parameters(), lr=0.1)
    for i in range(steps):
        model(torch.full((2, 8), float(i + seed))).sum().backward()
        optim.step()
        optim.zero_grad()
    if not steps:
        with torch.no_grad():
            for p in model.parameters():
                p.zero_()
    plain = torch.randn(5) if steps else torch.zeros(5)
    return {"app": AppState(model, optim), "plain": plain, "step": 7 if steps else 0}


def _leaves(sd, prefix=""):
    from torch.distributed.tensor import DTensor

    out = {}
    for k, v in sd.items():
        if isinstance(v, AppState):
            v = v.state_dict()
        if isinstance(v, dict):
            out.update(_leaves(v, f"{prefix}{k}."))
        elif isinstance(v, list):
            out.update(_leaves(dict(enumerate(v)), f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v.to_local().clone() if isinstance(v, DTensor) else (
                v.clone() if isinstance(v, torch.Tensor) else v)
    return out


def _same(a: dict, b: dict, what: str) -> int:
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


def _stock_load(mesh, path: str, **kw) -> dict:
    import torch.distributed.checkpoint as dcp

    import pipeload.dcp as pd

    assert not pd.is_installed()
    dest = _state(mesh, 99, 0)
    dcp.load(dest, checkpoint_id=path, **kw)
    return _leaves(dest)


def _chunks(path: str) -> dict:
    with open(os.path.join(path, ".metadata"), "rb") as f:
        md = pickle.load(f)
    return {k: sorted((tuple(c.offsets), tuple(c.sizes)) for c in v.chunks) if hasattr(v, "chunks") else "bytes"
            for k, v in md.state_dict_metadata.items()}, len(md.storage_data)


def _ranges(md) -> dict:
    """Each item's writer rank, offset and length (its file's name without the index)."""
    return {k: (v.relative_path.rsplit("_", 1)[0], v.offset, v.length) for k, v in md.storage_data.items()}


def _engine_case(rank: int, world: int, root: str, mesh, out: dict) -> None:
    """dcp.save through the engine, read by stock dcp.load and by pipeload's reader; DCP's chunks."""
    import torch.distributed.checkpoint as dcp

    import pipeload
    import pipeload.dcp as pd

    path, stock = os.path.join(root, "engine"), os.path.join(root, "stock")
    saved = _state(mesh, 1, 2)
    expect = _leaves(saved)
    dcp.save(saved, checkpoint_id=stock)  # switch off: DCP's own, for the layout comparison
    with pd.installed():
        md = dcp.save(saved, checkpoint_id=path)
        stats = pd.last_save_stats()
        assert stats.path == "engine", stats
        out["engine_items"] = stats.items_written
        ours = _state(mesh, 3, 0)
        dcp.load(ours, checkpoint_id=path)  # pipeload's DCP reader
        out["reader_tensors"] = _same(_leaves(ours), expect, "pipeload's reader")
        md2 = dcp.save(saved, checkpoint_id=path)  # a second save of the same layout reuses the plan
        out["reused"] = pd.last_save_stats().plan_reused
        # another layout saved on the same group in between (pipeload.save of the nested dict: another
        # signature, the same exchange rows) keeps both plans: each reuses its own the next time
        nested = {"app": saved["app"].state_dict(), "plain": saved["plain"], "step": saved["step"]}
        reused = [pipeload.save(nested, os.path.join(root, f"nested{i}")).plan_reused for i in range(2)]
        md3 = dcp.save(saved, checkpoint_id=path)
        out["alternating_reused"] = reused + [pd.last_save_stats().plan_reused]
        assert md3.state_dict_metadata == md.state_dict_metadata
    # every rank returns the committed Metadata; the second (its rows unchanged) is the first's but its save
    # id and its files: a save into the last one's directory writes beside its files (__<rank>_1), never over
    assert md2.state_dict_metadata == md.state_dict_metadata and _ranges(md2) == _ranges(md)
    assert {v.relative_path.rsplit("_", 1)[1] for v in md.storage_data.values()} == {"0.distcp"}
    assert {v.relative_path.rsplit("_", 1)[1] for v in md2.storage_data.values()} == {"1.distcp"}
    assert md3.storage_data == md.storage_data
    assert len({md.storage_meta.save_id, md2.storage_meta.save_id, md3.storage_meta.save_id}) == 3
    with open(os.path.join(path, ".metadata"), "rb") as f:
        assert pickle.load(f).storage_meta.save_id == md3.storage_meta.save_id
    out["stock_tensors"] = _same(_stock_load(mesh, path), expect, "stock dcp.load")
    assert _chunks(path) == _chunks(stock), "the chunks differ from stock dcp.save's"
    assert md.planner_data == pickle.load(open(os.path.join(stock, ".metadata"), "rb")).planner_data
    from pipeload.save import saver

    saver.wait_cleanup()  # the files the second save replaced are deleted by a thread
    dist.barrier()
    # nothing but DCP's (and the chunk table a load on the engine keeps beside .metadata): no temporary
    # or replaced file left
    out["files"] = sorted(f for f in os.listdir(path) if f != SIDECAR)
    full = {k: v.full_tensor() if hasattr(v, "full_tensor") else v  # (a collective: every rank, one order)
            for k, v in _leaves_raw(saved["app"].state_dict()).items()}
    if rank == 0:  # as bytes: tensors in a result would travel as shared memory of an exited process
        buf = io.BytesIO()
        torch.save(full, buf)
        out["full"] = buf.getvalue()


def _leaves_raw(sd, prefix=""):
    out = {}
    for k, v in sd.items():
        if isinstance(v, dict):
            out.update(_leaves_raw(v, f"{prefix}{k}."))
        elif isinstance(v, torch.Tensor):
            out[f"{prefix}{k}"] = v
    return out


def _async_case(rank: int, world: int, root: str, mesh, out: dict) -> None:
    """async_save: a Future; in-place writes after it returned do not reach the checkpoint."""
    from concurrent.futures import Future

    import torch.distributed.checkpoint as dcp

    import pipeload.dcp as pd

    path = os.path.join(root, "async")
    saved = _state(mesh, 2, 2)
    expect = _leaves(saved)
    with pd.installed():
        fut = dcp.async_save(saved, checkpoint_id=path)
        assert isinstance(fut, Future) and pd.last_save_stats().path == "engine"
        with torch.no_grad():  # the trainer goes on: the checkpoint keeps the values at the call
            for p in saved["app"].model.parameters():
                p.add_(1.0)
            saved["plain"].fill_(-1.0)
        md = fut.result(timeout=60)
        out["async_blocked_s"] = pd.last_save_stats().blocked_s
    assert "plain" in md.state_dict_metadata
    out["async_tensors"] = _same(_stock_load(mesh, path), expect, "async_save, stock dcp.load")
    alone = os.path.join(root, f"alone{rank}")
    if rank == 0:  # no_dist=True on one rank, while the others go on
        with pd.installed():
            dcp.save({"x": torch.arange(4.0), "y": 3}, checkpoint_id=alone, no_dist=True)
            assert pd.last_save_stats().path == "engine"
        got = {"x": torch.zeros(4), "y": 0}
        dcp.load(got, checkpoint_id=alone, no_dist=True)
        out["alone"] = torch.equal(got["x"], torch.arange(4.0)) and got["y"] == 3
    _subgroup_case(rank, root, out)


def _subgroup_case(rank: int, root: str, out: dict) -> None:
    """process_group=: each pair of ranks saves its own checkpoint through the engine."""
    import torch.distributed.checkpoint as dcp

    import pipeload.dcp as pd

    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    pg = pairs[rank // 2]
    path = os.path.join(root, f"pair{rank // 2}")
    value = torch.full((4,), float(rank // 2))
    with pd.installed():
        dcp.save({"v": value, "mine": torch.full((2,), float(rank))}, checkpoint_id=path, process_group=pg)
        out["pair_path"] = pd.last_save_stats().path
    got = {"v": torch.zeros(4), "mine": torch.zeros(2)}
    dcp.load(got, checkpoint_id=path, process_group=pg)
    assert torch.equal(got["v"], value)
    out["pair_files"] = len([f for f in os.listdir(path) if f.endswith(".distcp")])


def _stock_paths_case(rank: int, world: int, root: str, mesh, out: dict) -> None:
    """A custom planner and a ZStandard writer: DCP's own code, which still saves and loads."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint._extension import ZStandard
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

    import pipeload.dcp as pd

    class Planner(DefaultSavePlanner):
        pass

    saved = _state(mesh, 4, 1)
    expect = _leaves(saved)
    with pd.installed():
        dcp.save(saved, checkpoint_id=os.path.join(root, "planner"), planner=Planner())
        out["planner_path"] = pd.last_save_stats().path
        zstd = os.path.join(root, "zstd")
        dcp.save(saved, storage_writer=dcp.FileSystemWriter(zstd, _extensions=[ZStandard()]))
        out["zstd_path"] = pd.last_save_stats().path
        fut = dcp.async_save(saved, storage_writer=dcp.FileSystemWriter(os.path.join(root, "azstd"),
                                                                         _extensions=[ZStandard()]))
        out["async_zstd_path"] = pd.last_save_stats().path
        fut.result(timeout=60)
        # one rank's call only DCP's code can save: every rank takes DCP's (in the plan's first collective)
        mine = {"planner": Planner()} if rank == 2 else {}
        dcp.save(saved, checkpoint_id=os.path.join(root, "one-planner"), **mine)
        out["one_refusal"] = [(pd.last_save_stats().path, pd.last_save_stats().reason)]
        fut = dcp.async_save(saved, checkpoint_id=os.path.join(root, "a-one-planner"), **mine)
        out["one_refusal"].append((pd.last_save_stats().path, pd.last_save_stats().reason))
        fut.result(timeout=60)
        dcp.save(saved, checkpoint_id=os.path.join(root, "after-refusal"))  # and the next call is the engine's
        out["one_refusal"].append((pd.last_save_stats().path, ""))
    for name in ("planner", "zstd", "azstd", "one-planner", "a-one-planner", "after-refusal"):
        _same(_stock_load(mesh, os.path.join(root, name)), expect, name)


def _failure_case(rank: int, world: int, root: str, mesh, out: dict) -> None:
    """Rank 1 cannot create its directory: CheckpointException on every rank, blocking and async."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    import pipeload.dcp as pd

    blocker = os.path.join(root, "a-file")
    if rank == 1:
        open(blocker, "w").close()
    dist.barrier()
    path = os.path.join(blocker, "ckpt") if rank == 1 else os.path.join(root, "failed")
    saved = _state(mesh, 5, 1)
    raised = []
    with pd.installed():
        try:
            dcp.save(saved, checkpoint_id=path)
        except CheckpointException as e:
            raised.append(sorted(e.failures))
        fut = dcp.async_save(saved, checkpoint_id=path)
        try:
            fut.result(timeout=60)
        except CheckpointException as e:
            raised.append(sorted(e.failures))
    out["failed"] = raised
    out["failed_committed"] = os.path.exists(os.path.join(root, "failed", ".metadata"))


class _Nothing:
    """A ``Stateful`` with nothing to save (a component whose ``state_dict()`` is ``{}``)."""

    loaded = False

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state_dict: dict) -> None:
        self.loaded = True


def _failed_save_keeps_last_case(rank: int, world: int, root: str, mesh, out: dict) -> None:
    """A save into the last checkpoint's directory that fails on rank 1 after every other rank wrote its
    file leaves that checkpoint whole (stock ``dcp.load`` reads its values); the next save succeeds and
    leaves no file its ``.metadata`` does not name."""
    import errno

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    import pipeload.dcp as pd
    from pipeload.dcp.savelayout import DcpPhases
    from pipeload.save import saver

    path = os.path.join(root, "kept")
    first, second = _state(mesh, 11, 1), _state(mesh, 12, 1)
    real = DcpPhases.write_phase

    def full_disk(self, plan, directory, comm):  # rank 1's disk is full once the others have written
        dist.barrier()
        return f"writing: {OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))}", []

    def others_first(self, plan, directory, comm):
        got = real(self, plan, directory, comm)
        dist.barrier()
        return got

    raised = None
    with pd.installed():
        dcp.save(first, checkpoint_id=path)
        DcpPhases.write_phase = full_disk if rank == 1 else others_first
        try:
            dcp.save(second, checkpoint_id=path)
        except CheckpointException as e:
            raised = sorted(e.failures)
        finally:
            DcpPhases.write_phase = real
    out["kept_raised"] = raised
    out["kept_tensors"] = _same(_stock_load(mesh, path), _leaves(first), "the checkpoint before the failed save")
    with pd.installed():
        md = dcp.save(second, checkpoint_id=path)
    saver.wait_cleanup()
    dist.barrier()
    out["kept_files"] = (sorted(f for f in os.listdir(path) if f not in (".metadata", SIDECAR)),
                         sorted({v.relative_path for v in md.storage_data.values()}))
    out["kept_second"] = _same(_stock_load(mesh, path), _leaves(second), "the save after the failed one")


def _empty_case(rank: int, root: str, out: dict) -> None:
    """Nothing to save (a ``Stateful`` whose ``state_dict()`` is ``{}``; ``{}``): the engine commits an
    empty ``Metadata``, blocking and async, which the engine and stock ``dcp.load`` read."""
    import torch.distributed.checkpoint as dcp

    import pipeload.dcp as pd

    path = os.path.join(root, "empty")
    with pd.installed():
        md = dcp.save({"foo": _Nothing()}, checkpoint_id=path)
        paths = [pd.last_save_stats().path]
        fut = dcp.async_save({}, checkpoint_id=os.path.join(root, "empty-async"))
        paths.append(pd.last_save_stats().path)
        fut.result(timeout=60)
        ours = _Nothing()
        dcp.load({"foo": ours}, checkpoint_id=path)
        paths.append(pd.last_load().path)
    stock = _Nothing()
    dcp.load({"foo": stock}, checkpoint_id=path)
    out["empty"] = (paths, md.state_dict_metadata, ours.loaded, stock.loaded)


def world(rank: int, size: int, root: str) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    warnings.filterwarnings("ignore")
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    out: dict = {}
    _engine_case(rank, size, root, mesh, out)
    _async_case(rank, size, root, mesh, out)
    _stock_paths_case(rank, size, root, mesh, out)
    _failure_case(rank, size, root, mesh, out)
    _failed_save_keeps_last_case(rank, size, root, mesh, out)
    _empty_case(rank, root, out)
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    pytest.importorskip("zstandard")
    root = str(tmp_path_factory.mktemp("dcp_save"))
    return root, run_world(world, 4, root, timeout=WORLD_TIMEOUT, pg_timeout=60)


def test_dcp_save_through_the_engine_is_read_by_stock_dcp_and_pipeload(results):
    _, r = results
    assert all(x["stock_tensors"] >= 10 and x["reader_tensors"] == x["stock_tensors"] for x in r)
    assert [x["engine_items"] for x in r] != [0] * 4 and all(x["reused"] for x in r)
    assert all(x["alternating_reused"] == [False, True, True] for x in r), [x["alternating_reused"] for x in r]
    assert r[0]["files"] == [".metadata", "__0_0.distcp", "__1_0.distcp", "__2_0.distcp", "__3_0.distcp"]


def test_the_checkpoint_loads_in_another_process_with_stock_dcp(results):
    import torch.distributed.checkpoint as dcp

    import pipeload.dcp as pd

    root, r = results
    assert not pd.is_installed()
    full = torch.load(io.BytesIO(r[0]["full"]))
    dest = {"app": {"model": {k[len("model."):]: torch.zeros_like(v) for k, v in full.items() if k.startswith("model.")},
                    "optim": {"state": {}}},
            "plain": torch.zeros(5), "step": 0}
    for k, v in full.items():
        if k.startswith("optim.state."):
            fqn, name = k[len("optim.state."):].rsplit(".", 1)
            dest["app"]["optim"]["state"].setdefault(fqn, {})[name] = torch.zeros_like(v)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(dest, checkpoint_id=os.path.join(root, "engine"), no_dist=True)
    n = 0
    for k, v in full.items():
        head, rest = k.split(".", 1)
        got = dest["app"][head]
        if head == "optim":
            fqn, name = rest[len("state."):].rsplit(".", 1)
            got = got["state"][fqn][name]
        else:
            got = got[rest]
        assert torch.equal(got, v), k
        n += 1
    assert n >= 10 and dest["step"] == 7


def test_async_save_snapshots_at_the_call(results):
    _, r = results
    assert all(x["async_tensors"] >= 10 for x in r)
    assert r[0]["alone"] is True
    assert all(x["pair_path"] == "engine" and x["pair_files"] == 2 for x in r)


def test_custom_planners_and_extensions_stay_stock_dcp(results):
    _, r = results
    assert all(x["planner_path"] == x["zstd_path"] == x["async_zstd_path"] == "dcp" for x in r)
    for rank, x in enumerate(r):
        why = "planner Planner" if rank == 2 else "rank(s) [2] cannot save through the engine"
        assert [p for p, _ in x["one_refusal"]] == ["dcp", "dcp", "engine"], x["one_refusal"]
        assert why in x["one_refusal"][0][1], (rank, x["one_refusal"])  # (async_save's is DCP's executor's)


def test_a_failure_on_one_rank_raises_checkpoint_exception_everywhere(results):
    _, r = results
    assert all(x["failed"] == [[1], [1]] for x in r), [x["failed"] for x in r]
    assert not r[0]["failed_committed"]


def test_a_failed_save_leaves_the_last_checkpoint_whole(results):
    _, r = results
    assert all(x["kept_raised"] == [1] for x in r), [x["kept_raised"] for x in r]
    assert all(x["kept_tensors"] >= 10 and x["kept_second"] == x["kept_tensors"] for x in r)
    on_disk, named = r[0]["kept_files"]
    assert on_disk == named and len(named) >= 2, r[0]["kept_files"]


def test_an_empty_state_dict_saves_through_the_engine(results):
    _, r = results
    assert all(x["empty"] == (["engine", "engine", "engine"], {}, True, True) for x in r), [x["empty"] for x in r]


def test_uninstall_restores_dcps_functions_exactly():
    import torch.distributed.checkpoint as dcp
    import torch.distributed.checkpoint.state_dict_saver as sds

    import pipeload.dcp as pd
    from pipeload.dcp import save as ours

    before = (dcp.save, dcp.async_save, sds.save, sds.async_save, dcp.save_state_dict)
    pd.install()
    pd.install()
    assert dcp.save is sds.save is ours.save and dcp.async_save is sds.async_save is ours.async_save
    assert dcp.save_state_dict is before[4]
    pd.uninstall()
    assert all(a is b for a, b in zip((dcp.save, dcp.async_save, sds.save, sds.async_save, dcp.save_state_dict),
                                      before))


def test_async_save_returns_what_dcp_returns_for_the_call(tmp_path):
    """One process (no_dist): a Future by default, DCP's AsyncSaveResponse for a DefaultStager with
    async staging — as stock DCP returns for the same calls — both through the engine."""
    from concurrent.futures import Future

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import Metadata
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

    import pipeload.dcp as pd

    sd = {"a": torch.arange(6.0), "n": {"k": 3}}
    stager = DefaultStager(StagingOptions(False, False, True, False))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pd.installed():
            resp = dcp.async_save(sd, checkpoint_id=str(tmp_path / "a"), no_dist=True, async_stager=stager)
            assert pd.last_save_stats().path == "engine" and resp.staging_completion.done()
            sd["a"].fill_(-1.0)
            assert isinstance(resp.upload_completion.result(timeout=60), Metadata)
            fut = dcp.async_save(sd, checkpoint_id=str(tmp_path / "b"), no_dist=True)
            assert isinstance(fut, Future) and pd.last_save_stats().path == "engine"
            fut.result(timeout=60)
        stager.close()
        stock = DefaultStager(StagingOptions(False, False, True, False))
        theirs = dcp.async_save(sd, checkpoint_id=str(tmp_path / "c"), no_dist=True, async_stager=stock)
        theirs.upload_completion.result(timeout=60)
        stock.close()
        assert type(theirs) is type(resp)
        got = {"a": torch.zeros(6), "n": {"k": 0}}
        dcp.load(got, checkpoint_id=str(tmp_path / "a"), no_dist=True)
    assert torch.equal(got["a"], torch.arange(6.0)) and got["n"]["k"] == 3
