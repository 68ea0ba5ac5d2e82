"""pipeload.record_slices: an engine's destinations recorded from its own weight loader.

Each case runs a loader written as engines write them on storage-free probes, then checks the recorded
slices against the loader itself: filling every slice from full tensors must give, byte for byte,
what the loader gives on the same full tensors. Refused tensors name the parameter and the operation.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import pipeload
from pipeload.tools import engineshape as es


def _fill(slices, full):
    for sl in slices:
        region = full[sl.name]
        for d, (o, n) in enumerate(zip(sl.offsets, sl.lengths)):
            region = region.narrow(d, o, n)
        sl.view.copy_(region)


def _full(shapes, seed=0):
    g = torch.Generator().manual_seed(seed)
    return {n: torch.randn(shape, generator=g).to(dtype) for n, (shape, dtype) in shapes.items()}


def _check(loader_of, shapes, params_of, **kw):
    """Record on fresh params, fill from full tensors; the loader on other fresh params must agree."""
    params = params_of()
    rec = pipeload.record_slices(loader_of(params), shapes, params=params, **kw)
    full = _full(shapes)
    _fill(rec.slices, full)
    want = params_of()
    loader_of(want)([(n, t) for n, t in full.items() if n not in rec.refused])
    for name, t in want.items():
        assert torch.equal(params[name], t), name
    return rec


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_engine_loader_recorded_as_its_slices(tp):
    s = es.Shape(vocab=1000)
    shapes = {n: (sh, s.dtype) for n, sh in es.checkpoint_shapes(s).items()}
    for t in range(tp):
        params = es.engine_params(s, tp, t)
        before = {n: p.clone() for n, p in params.items()}
        rec = pipeload.record_slices(es.engine_loader(s, params, tp, t), shapes, params=params)
        assert rec.refused == {} and rec.unused == []
        for n, p in params.items():  # nothing was copied while recording
            assert torch.equal(p, before[n]), n
        key = lambda sl: (sl.name, sl.offsets, sl.lengths, sl.view.data_ptr(), sl.view.stride())  # noqa: E731
        assert sorted(map(key, rec.slices)) == sorted(map(key, es.engine_slices(s, params, tp, t)))
        _check(lambda p: es.engine_loader(s, p, tp, t), shapes, lambda: es.engine_params(s, tp, t))


def test_views_that_keep_the_order_are_regions():
    shapes = {"w": ((6, 8), torch.float32), "h": ((4, 2, 8), torch.bfloat16), "c": ((8, 6), torch.float32),
              "skip": ((3,), torch.float32)}

    def params_of():
        return {"flat": torch.zeros(2 * 8), "head": torch.zeros(2, 8, dtype=torch.bfloat16),
                "cols": torch.zeros(8, 3), "row": torch.zeros(8), "chunks": torch.zeros(3, 8)}

    def loader_of(p):
        def load(weights):
            for name, w in weights:
                if name == "w":
                    p["flat"].copy_(w[2:4].reshape(-1))                 # two whole rows, merged
                    p["row"].copy_(w[5])                                # one row, selected
                    p["chunks"].copy_(w.chunk(2, dim=0)[1].to(torch.float32).cpu())
                elif name == "h":
                    p["head"].view(2, 1, 8).copy_(w.view(8, 8)[2:4].view(2, 1, 8))
                elif name == "c":
                    p["cols"][:] = w[:, 3:].contiguous()                # a column block, copied first
        return load

    rec = _check(loader_of, shapes, params_of)
    assert rec.refused == {} and rec.unused == ["skip"]
    by = {(sl.name, sl.offsets, sl.lengths) for sl in rec.slices}
    assert by == {("w", (2, 0), (2, 8)), ("w", (5, 0), (1, 8)), ("w", (3, 0), (3, 8)),
                  ("h", (1, 0, 0), (1, 2, 8)), ("c", (0, 3), (8, 3))}


class _Engine(nn.Module):
    """An engine whose loader does what no region copy can: each tensor's refusal names its parameter."""

    def __init__(self):
        super().__init__()
        self.t = nn.Parameter(torch.zeros(8, 4))     # stored transposed
        self.f16 = nn.Parameter(torch.zeros(4, 8, dtype=torch.float16))
        self.q = nn.Parameter(torch.zeros(4, 8))
        self.cat = nn.Parameter(torch.zeros(8, 8))
        self.idx = nn.Parameter(torch.zeros(4, 8))
        self.ok = nn.Parameter(torch.zeros(2, 8))
        self.inplace = nn.Parameter(torch.zeros(4, 8))
        self.scale = nn.Parameter(torch.zeros(()))
        self.kept: dict[str, torch.Tensor] = {}

    def load_weights(self, weights):
        for name, w in weights:
            if name == "t":
                self.t.data.copy_(w.t().contiguous())
            elif name == "half":
                self.f16.data.copy_(w)                                  # float32 -> float16
            elif name == "q":
                self.q.data.copy_(w * 0.5)                               # a requantization
            elif name in ("a", "b"):
                self.kept[name] = w
                if len(self.kept) == 2:
                    self.cat.data.copy_(torch.cat([self.kept["a"], self.kept["b"]]))
            elif name == "idx":
                self.idx.data[torch.tensor([3, 2, 1, 0])] = w
            elif name == "ok":
                self.ok.data.copy_(w[1:3])
            elif name == "inplace":
                self.inplace.data.add_(w)
            elif name == "scalar":
                self.scale.data.fill_(w.item())                           # reads a value: raises on a probe
            elif name == "assigned":
                self.kept["assigned"] = w                                 # kept, never copied


def test_refusals_name_the_parameter():
    f32 = torch.float32
    shapes = {"t": ((4, 8), f32), "half": ((4, 8), f32), "q": ((4, 8), f32), "a": ((4, 8), f32),
              "b": ((4, 8), f32), "idx": ((4, 8), f32), "ok": ((4, 8), f32), "inplace": ((4, 8), f32),
              "scalar": ((), f32), "assigned": ((2,), f32)}
    eng = _Engine()
    rec = pipeload.record_slices(eng.load_weights, shapes)
    assert [(sl.name, sl.offsets, sl.lengths) for sl in rec.slices] == [("ok", (1, 0), (2, 8))]
    assert rec.unused == ["assigned"]
    assert set(rec.refused) == {"t", "half", "q", "a", "b", "idx", "inplace", "scalar"}
    assert "parameter 't'" in rec.refused["t"] and "transpose" in rec.refused["t"]
    assert "parameter 'f16'" in rec.refused["half"] and "dtype change" in rec.refused["half"]
    assert "parameter 'q'" in rec.refused["q"] and "mul" in rec.refused["q"]
    assert "parameter 'cat'" in rec.refused["a"] and "cat" in rec.refused["b"]
    assert "advanced index" in rec.refused["idx"] and "parameter 'idx'" in rec.refused["idx"]
    assert "add_" in rec.refused["inplace"] and "parameter 'inplace'" in rec.refused["inplace"]
    assert "the loader raised on it" in rec.refused["scalar"]
    for p in eng.parameters():  # recording wrote nothing
        assert not p.any()


def test_a_refused_tensor_drops_all_its_slices():
    params = {"good": torch.zeros(2, 4), "bad": torch.zeros(2, 4)}

    def load(weights):
        for _, w in weights:
            params["good"].copy_(w[:2])
            params["bad"].copy_(w[2:].t().t().t().t().clone().mul(1))

    rec = pipeload.record_slices(load, {"w": ((4, 4), torch.float32)}, params=params)
    assert rec.slices == [] and "parameter 'bad'" in rec.refused["w"]


def test_bad_arguments():
    with pytest.raises(pipeload.StateDictError, match="callable"):
        pipeload.record_slices(None, {})
    with pytest.raises(pipeload.StateDictError, match="not a torch.dtype"):
        pipeload.record_slices(lambda w: None, {"w": ((2,), "float32")})
    meta = {"w": torch.empty(3, 2, device="meta")}
    out = torch.zeros(3, 2)
    rec = pipeload.record_slices(lambda ws: [out.copy_(w) for _, w in ws], meta)
    assert [(sl.name, sl.shape) for sl in rec.slices] == [("w", (3, 2))]


def test_recorded_slices_load_from_a_checkpoint(tmp_path):
    """An engine's recorded destinations filled by pipeload.load from the trainer's checkpoint (one
    process), as its own loader would fill them from the full tensors."""
    s = es.Shape(vocab=1000)
    model = es.trainer_model(s, seed=4)
    pipeload.save(model.state_dict(), str(tmp_path / "ckpt"))
    shapes = {n: (sh, s.dtype) for n, sh in es.checkpoint_shapes(s).items()}
    for t in range(2):
        params = es.engine_params(s, 2, t)
        rec = pipeload.record_slices(es.engine_loader(s, params, 2, t), shapes, params=params)
        pipeload.load(rec.slices, str(tmp_path / "ckpt"))
        want = es.expected(s, model.state_dict(), 2, t)
        for name, p in params.items():
            assert torch.equal(p, want[name]), name
