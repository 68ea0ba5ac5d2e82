"""Every kind of tensor a trainer can hand pipeload, as a load destination and as a save source.

Each kind is either loaded (saved) exactly or refused with a ``StateDictError`` naming the key before
any destination (file) is written — never a signal, never a silent no-op (see
``pipeload.plan.tensorkinds``): meta tensors are materialised on the CPU as ``dcp.load`` does;
conjugate and negative views are filled through torch's copy; sparse, nested, quantized tensors,
subclasses without memory of their own (``LocalShardsWrapper``, also as a DTensor's local tensor), the
legacy ``ShardedTensor`` and meta DTensors are refused. A world of one covers each kind and random
mixes; one 2-rank world (separate hosts, so replicated shards go through the broadcast path) covers
DTensors and the kinds that need a process group.
"""

from __future__ import annotations

import os
import random
import warnings

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor._shards_wrapper import LocalShardsWrapper

import pipeload
from pipeload.errors import PipeloadError, StateDictError
from pipeload.tools._world import run_world

import layouts as L

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")  # (nested and quantized tensors are prototypes)


def _values(n: int, dtype=torch.float32, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if dtype.is_complex:
        return torch.complex(torch.randn(n, generator=g), torch.randn(n, generator=g)).to(dtype)
    return torch.randn(n, generator=g).to(dtype)


class Tagged(torch.Tensor):
    """A subclass over real storage (``as_subclass``), as users tag tensors: loaded and saved in place."""


class Scaled(torch.Tensor):
    """A wrapper subclass holding its data in an inner tensor, as float8 training tensors do: no memory of
    its own (``data_ptr() == 0``)."""

    @staticmethod
    def __new__(cls, data: torch.Tensor):
        return torch.Tensor._make_wrapper_subclass(cls, data.shape, dtype=data.dtype, device=data.device)

    def __init__(self, data: torch.Tensor):
        self.data_ = data

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        unwrap = lambda x: x.data_ if isinstance(x, Scaled) else x  # noqa: E731
        return func(*[unwrap(a) for a in args], **{k: unwrap(v) for k, v in (kwargs or {}).items()})


# kind -> (how the destination is made from the stored values v, whether pipeload loads it)
DESTS = {
    "plain": (lambda v: torch.zeros_like(v), True),
    "param": (lambda v: torch.nn.Parameter(torch.zeros_like(v)), True),
    "strided": (lambda v: torch.zeros(v.numel() * 2, dtype=v.dtype)[::2], True),
    "conj": (lambda v: torch.zeros_like(v).conj(), True),
    "neg": (None, True),  # see _kind_dest
    "meta": (lambda v: torch.empty(v.shape, dtype=v.dtype, device="meta"), True),
    "sparse": (lambda v: torch.zeros_like(v).to_sparse(), False),
    "nested": (lambda v: torch.nested.nested_tensor([torch.zeros_like(v)]), False),
    "quantized": (lambda v: torch.quantize_per_tensor(torch.zeros(v.shape), 0.1, 0, torch.qint8), False),
    "wrapper": (lambda v: LocalShardsWrapper([torch.zeros_like(v)], [(0,)]), False),
    "tagged": (lambda v: torch.zeros_like(v).as_subclass(Tagged), True),
    "scaled": (lambda v: Scaled(torch.zeros_like(v)), False),
}


def _kind_dest(kind: str, v: torch.Tensor) -> torch.Tensor:
    if kind == "neg":  # a negative view: of a complex tensor, or the imaginary part of a conjugate one
        t = torch.zeros_like(v)._neg_view() if v.is_complex() else torch.zeros(v.shape, dtype=torch.complex64).conj().imag
        assert t.is_neg()
        return t
    return DESTS[kind][0](v)


def _snapshot(sd: dict) -> dict:
    """What each destination holds now (meta and refused kinds: their identity)."""
    out = {}
    for k, t in sd.items():
        if t.device.type == "meta" or t.layout != torch.strided or t.is_nested or t.is_quantized \
                or isinstance(t, (LocalShardsWrapper, Scaled)):
            out[k] = t
        else:
            out[k] = t.detach().clone()
    return out


def _unchanged(sd: dict, before: dict) -> None:
    for k, t in sd.items():
        b = before[k]
        if isinstance(b, torch.Tensor) and b.device.type != "meta" and b.layout == torch.strided \
                and not b.is_nested and not b.is_quantized and not isinstance(b, (LocalShardsWrapper, Scaled)):
            assert torch.equal(t, b), f"{k!r} was written by a refused load"
        else:
            assert t is b, f"{k!r} was replaced by a refused load"


def _check_load(sd: dict, stored: dict, path: str, kinds: dict) -> None:
    """Load ``path`` into ``sd`` (``kinds``: key -> kind); exact, or refused naming a refused key with
    every destination unchanged."""
    refused = [k for k, kind in kinds.items() if not DESTS[kind][1]]
    before = _snapshot(sd)
    if refused:
        with pytest.raises(StateDictError) as e:
            pipeload.load(sd, path)
        assert any(repr(k) in str(e.value) for k in refused), str(e.value)
        _unchanged(sd, before)
        return
    pipeload.load(sd, path)
    for k, v in stored.items():
        got = sd[k]
        assert got.device.type == "cpu", f"{k!r} ({kinds[k]}) left on {got.device}"
        assert torch.equal(got.resolve_conj().resolve_neg(), v), f"{k!r} ({kinds[k]}) loaded wrong values"


@pytest.mark.parametrize("kind", sorted(DESTS))
def test_each_destination_kind_loads_exactly_or_is_refused_untouched(tmp_path, kind):
    dtype = torch.complex64 if kind == "conj" else torch.float32
    stored = {"a": _values(8, dtype, 1), "b": _values(8, torch.float32, 2)}
    pipeload.save(stored, str(tmp_path))
    sd = {"a": _kind_dest(kind, stored["a"]), "b": torch.zeros(8)}
    _check_load(sd, stored, str(tmp_path), {"a": kind, "b": "plain"})


def test_a_model_built_on_meta_loads_as_dcp_does(tmp_path):
    """``nn.Module.state_dict()`` of a model built on meta: the dict gets CPU tensors, which the model
    takes with ``load_state_dict(assign=True)``; the meta tensors themselves are not touched."""
    torch.manual_seed(0)
    src = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.LayerNorm(8))
    pipeload.save(src.state_dict(), str(tmp_path))
    with torch.device("meta"):
        model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.LayerNorm(8))
    sd = model.state_dict()
    stats = pipeload.load(sd, str(tmp_path))
    assert stats.bytes_read == sum(t.nbytes for t in src.state_dict().values())
    assert all(t.device.type == "cpu" for t in sd.values())
    model.load_state_dict(sd, assign=True)
    for (k, a), b in zip(model.state_dict().items(), src.state_dict().values()):
        assert torch.equal(a, b), k
    # a second load into meta tensors again is planned afresh (a kept plan would copy into meta)
    with torch.device("meta"):
        again = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.LayerNorm(8)).state_dict()
    assert not pipeload.load(again, str(tmp_path)).plan_reused
    assert all(t.device.type == "cpu" for t in again.values())


SOURCES = {
    "plain": (lambda v: v.clone(), True),
    "strided": (lambda v: torch.stack([v, v], 1)[:, 0], True),
    "conj": (lambda v: v.conj().resolve_conj().conj(), True),  # a conj view whose values are v
    "neg": (lambda v: v.neg()._neg_view(), True),  # a negative view whose values are v
    "meta": (lambda v: torch.empty(v.shape, dtype=v.dtype, device="meta"), False),
    "sparse": (lambda v: v.to_sparse(), False),
    "nested": (lambda v: torch.nested.nested_tensor([v]), False),
    "quantized": (lambda v: torch.quantize_per_tensor(v.real.float(), 0.1, 0, torch.qint8), False),
    "wrapper": (lambda v: LocalShardsWrapper([v.clone()], [(0,)]), False),
    "tagged": (lambda v: v.clone().as_subclass(Tagged), True),
    "scaled": (lambda v: Scaled(v.clone()), False),
}


@pytest.mark.parametrize("background", [False, True])
def test_random_mixes_save_and_load_exactly_or_refuse(tmp_path, background):
    """Random state dicts mixing every kind, saved (blocking or in the background) and loaded: each run
    either exact or one ``StateDictError`` naming a refused key, with nothing committed or written."""
    rng = random.Random(1234 + background)
    good = sorted(k for k, (_, ok) in SOURCES.items() if ok)
    bad = sorted(k for k, (_, ok) in SOURCES.items() if not ok)
    exact = 0
    for run in range(24):
        path = str(tmp_path / f"run{run}")
        kinds = {f"t{i}": rng.choice(good if rng.random() < 0.85 else bad) for i in range(rng.randint(2, 5))}
        dtypes = {k: rng.choice([torch.float32, torch.complex64] if kind in ("conj", "neg", "plain")
                                else [torch.float32]) for k, kind in kinds.items()}
        stored = {k: _values(6, dtypes[k], seed=run * 10 + i) for i, k in enumerate(kinds)}
        sd = {k: SOURCES[kind][0](stored[k]) for k, kind in kinds.items()}
        refused = [k for k, kind in kinds.items() if not SOURCES[kind][1]]
        if refused:
            with pytest.raises(StateDictError) as e:
                h = pipeload.save(sd, path, background=background)
                if background:
                    h.wait()
            assert any(repr(k) in str(e.value) for k in refused), str(e.value)
            assert not os.path.exists(os.path.join(path, ".metadata")), "a refused save committed"
            continue
        h = pipeload.save(sd, path, background=background)
        if background:
            h.wait()
        dest_kinds = {k: rng.choice(sorted(DESTS) if dtypes[k] == torch.float32
                                    else ["plain", "conj", "neg", "meta", "tagged", "wrapper", "scaled"])
                      for k in kinds}
        dest = {k: _kind_dest(dk, stored[k]) for k, dk in dest_kinds.items()}
        _check_load(dest, stored, path, dest_kinds)
        exact += 1
    assert exact >= 6, "too few runs saved anything: the mix no longer tests loading"


# -- a real world: DTensors, ShardedTensor, the broadcast path ----------------------------------------------


def _dtensor_cases(rank: int, root: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (2,))
    full = _values(16, seed=7).reshape(4, 4)
    path = os.path.join(root, "dt")
    pipeload.save({"d": distribute_tensor(full, mesh, [Shard(0)]), "r": full.clone(),
                   "c": _values(8, torch.complex64, 3)}, path)
    plain = torch.zeros(4, 4)
    # a DTensor over a LocalShardsWrapper (TorchRec, DCP's uneven shards): refused, nothing written
    local = LocalShardsWrapper([torch.zeros(2, 4)], [(2 * rank, 0)])
    wrapped = DTensor.from_local(local, mesh, [Shard(0)], run_check=False, shape=(4, 4), stride=(4, 1))
    L.expect_error(lambda: pipeload.load({"d": wrapped, "r": plain}, path, strict=False), "'d'", "LocalShardsWrapper")
    assert not plain.any(), "a refused load wrote a destination"
    L.expect_error(lambda: pipeload.save({"d": wrapped}, os.path.join(root, "w")), "'d'", "local tensor")
    # a DTensor on meta: refused; a replicated meta tensor: loaded on every rank (broadcast path)
    with torch.device("meta"):
        meta_dt = distribute_tensor(torch.empty(4, 4), mesh, [Shard(0)])
    L.expect_error(lambda: pipeload.load({"d": meta_dt}, path, strict=False), "'d'", "meta")
    sd = {"r": torch.empty(4, 4, device="meta"), "c": torch.zeros(8, dtype=torch.complex64).conj(),
          "d": distribute_tensor(torch.zeros(4, 4), mesh, [Shard(0)])}
    stats = pipeload.load(sd, path)
    assert stats.shared_shards >= 1, "the replicated shards were not broadcast"
    assert torch.equal(sd["r"], full) and torch.equal(sd["d"].full_tensor(), full)
    assert torch.equal(sd["c"].resolve_conj(), _values(8, torch.complex64, 3))


def _sharded_tensor_case(rank: int, root: str) -> None:
    from torch.distributed._shard import sharded_tensor
    from torch.distributed._shard.sharding_spec import ChunkShardingSpec

    spec = ChunkShardingSpec(dim=0, placements=["rank:0/cpu", "rank:1/cpu"])
    st = sharded_tensor.zeros(spec, 4, 4)
    path = os.path.join(root, "dt")
    plain = torch.zeros(4, 4)
    L.expect_error(lambda: pipeload.load({"d": st, "r": plain}, path, strict=False), "'d'", "ShardedTensor")
    assert not plain.any(), "a refused load wrote a destination"
    L.expect_error(lambda: pipeload.save({"d": st}, os.path.join(root, "st")), "'d'", "ShardedTensor")


def kinds_world(rank: int, world: int, root: str) -> str:
    _dtensor_cases(rank, root)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _sharded_tensor_case(rank, root)
    dist.barrier()
    return "ok"


def test_world2_dtensor_wrapper_sharded_and_meta_kinds(tmp_path):
    assert run_world(kinds_world, 2, str(tmp_path), timeout=120, separate_hosts=True) == ["ok", "ok"]
