"""A MoE-shaped model in Hugging Face naming and an inference engine's fused layout of it.

The trainer side is an ``nn.Module`` whose state dict has the names a Hugging Face checkpoint has
(``model.layers.{i}.self_attn.q_proj.weight``, ``...mlp.experts.{e}.gate_proj.weight``, ...). The
engine side is what a vLLM-style worker of tensor-parallel rank ``t`` of ``T`` holds: fused
``qkv_proj`` (KV heads replicated when ``T`` exceeds them), ``gate_up_proj``, experts stacked into
``w13`` / ``w2``, row-parallel ``o_proj`` / ``down_proj`` (column blocks), and a vocabulary padded to a
multiple of 64 per rank whose padding rows hold :data:`PAD`. Two ways to fill it:

- :func:`engine_slices`: the :class:`pipeload.Slice` destinations of each parameter region;
- :func:`engine_loader`: the engine's own ``load_weights(iterable of (name, full tensor))``, slicing
  and fusing as engines do (what the frameworks' rank-0 broadcast feeds, and what
  :func:`pipeload.record_slices` can record).

Used by ``pipeload bench --transfer`` and the tests; both sides are derived from one :class:`Shape`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterable, NamedTuple

import torch
from torch import nn

from ..slices import Slice

PAD = -7.0  # what an engine's padding rows hold (never written by a transfer)


@dataclass(frozen=True)
class Shape:
    layers: int = 2
    hidden: int = 64
    heads: int = 4
    kv_heads: int = 2
    head_dim: int = 16
    inter: int = 128  # each expert's MLP (and the dense MLP's, unless ``dense_inter``)
    experts: int = 4
    vocab: int = 1000
    dtype: torch.dtype = torch.float32
    dense_layers: int = -1  # the first ``dense_layers`` layers dense, the rest MoE; -1: even layers dense
    dense_inter: int = 0  # the dense MLP's width (0: ``inter``)

    def q_rows(self) -> int:
        return self.heads * self.head_dim

    def kv_rows(self) -> int:
        return self.kv_heads * self.head_dim

    def dense(self, i: int) -> bool:
        """Whether layer ``i`` has a dense MLP (else experts)."""
        return i % 2 == 0 if self.dense_layers < 0 else i < self.dense_layers

    def mlp_inter(self) -> int:
        return self.dense_inter or self.inter


def _layer_names(s: Shape, i: int) -> dict[str, tuple[int, ...]]:
    p = f"model.layers.{i}."
    out = {p + "self_attn.q_proj.weight": (s.q_rows(), s.hidden), p + "self_attn.k_proj.weight": (s.kv_rows(), s.hidden),
           p + "self_attn.v_proj.weight": (s.kv_rows(), s.hidden), p + "self_attn.o_proj.weight": (s.hidden, s.q_rows()),
           p + "input_layernorm.weight": (s.hidden,)}
    if s.dense(i):
        m = s.mlp_inter()
        out.update({p + "mlp.gate_proj.weight": (m, s.hidden), p + "mlp.up_proj.weight": (m, s.hidden),
                    p + "mlp.down_proj.weight": (s.hidden, m)})
    else:  # MoE
        out[p + "mlp.gate.weight"] = (s.experts, s.hidden)
        for e in range(s.experts):
            q = f"{p}mlp.experts.{e}."
            out.update({q + "gate_proj.weight": (s.inter, s.hidden), q + "up_proj.weight": (s.inter, s.hidden),
                        q + "down_proj.weight": (s.hidden, s.inter)})
    return out


def checkpoint_shapes(s: Shape) -> dict[str, tuple[int, ...]]:
    """Every tensor of the trainer's state dict: name -> global shape."""
    out = {"model.embed_tokens.weight": (s.vocab, s.hidden)}
    for i in range(s.layers):
        out.update(_layer_names(s, i))
    out["model.norm.weight"] = (s.hidden,)
    out["lm_head.weight"] = (s.vocab, s.hidden)
    return out


class _Leaf(nn.Module):
    def __init__(self, shape, dtype):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(shape, dtype=dtype))


def trainer_model(s: Shape, seed: int = 0) -> nn.Module:
    """An ``nn.Module`` whose ``state_dict()`` keys are :func:`checkpoint_shapes`' names, filled from ``seed``
    (every rank builds the same values). Leaf modules are what ``fully_shard`` wraps."""
    root = nn.Module()
    g = torch.Generator().manual_seed(seed)
    for name, shape in checkpoint_shapes(s).items():
        *path, leaf, _ = name.split(".")
        node = root
        for part in path:
            if not hasattr(node, part):
                node.add_module(part, nn.Module())
            node = getattr(node, part)
        m = _Leaf(shape, s.dtype)
        with torch.no_grad():
            m.weight.copy_(torch.randn(shape, generator=g, dtype=torch.float32).to(s.dtype))
        node.add_module(leaf, m)
    return root


def leaf_modules(model: nn.Module) -> list[nn.Module]:
    return [m for m in model.modules() if isinstance(m, _Leaf)]


# -- the engine side ---------------------------------------------------------------------------------

def _split(n: int, tp: int, t: int) -> tuple[int, int]:
    k = n // tp
    return k * t, k


def _kv(s: Shape, tp: int, t: int) -> tuple[int, int]:
    """(first KV row, rows) of rank ``t``: split when there are at least ``tp`` heads, else replicated."""
    if s.kv_heads >= tp:
        return _split(s.kv_rows(), tp, t)
    head = t * s.kv_heads // tp
    return head * s.head_dim, s.head_dim


def _vocab(s: Shape, tp: int, t: int) -> tuple[int, int, int]:
    """(first row, rows held, rows allocated) of a vocabulary shard padded to a multiple of 64 per rank."""
    per = -(-s.vocab // tp)
    per = -(-per // 64) * 64
    lo = per * t
    return lo, max(0, min(per, s.vocab - lo)), per


def engine_params(s: Shape, tp: int, t: int) -> dict[str, torch.Tensor]:
    """The engine's parameters on TP rank ``t``, vLLM names, padding rows :data:`PAD`, the rest zero."""
    out: dict[str, torch.Tensor] = {}
    z = lambda *shape: torch.zeros(shape, dtype=s.dtype)  # noqa: E731
    _, v, per = _vocab(s, tp, t)
    for name in ("model.embed_tokens.weight", "lm_head.weight"):
        out[name] = z(per, s.hidden)
        out[name][v:] = PAD
    for i in range(s.layers):
        p = f"model.layers.{i}."
        _, kvn = _kv(s, tp, t)
        out[p + "self_attn.qkv_proj.weight"] = z(s.q_rows() // tp + 2 * kvn, s.hidden)
        out[p + "self_attn.o_proj.weight"] = z(s.hidden, s.q_rows() // tp)
        out[p + "input_layernorm.weight"] = z(s.hidden)
        if s.dense(i):
            out[p + "mlp.gate_up_proj.weight"] = z(2 * s.mlp_inter() // tp, s.hidden)
            out[p + "mlp.down_proj.weight"] = z(s.hidden, s.mlp_inter() // tp)
        else:
            out[p + "mlp.gate.weight"] = z(s.experts, s.hidden)
            out[p + "mlp.experts.w13_weight"] = z(s.experts, 2 * s.inter // tp, s.hidden)
            out[p + "mlp.experts.w2_weight"] = z(s.experts, s.hidden, s.inter // tp)
    out["model.norm.weight"] = z(s.hidden)
    return out


class Region(NamedTuple):
    """One checkpoint region an engine parameter holds: rows ``row ..`` of ``param`` (of its expert
    ``expert`` when >= 0) hold the box ``offsets .. offsets + lengths`` of the tensor ``name``."""

    param: str
    expert: int
    row: int
    name: str
    offsets: tuple[int, ...]
    lengths: tuple[int, ...]


def engine_regions(s: Shape, tp: int, t: int) -> list[Region]:
    """Every region TP rank ``t`` of ``tp`` holds, in :func:`engine_slices`' order (arithmetic only: no
    tensor, so a simulation of any size can take an engine rank's destination boxes from it). Experts
    are split by rows: every rank holds every expert's ``1/tp`` of ``gate``/``up`` rows and ``down``
    columns (vLLM's fused MoE under tensor parallelism, without expert parallelism)."""
    out: list[Region] = []
    h = s.hidden
    lo, v, _ = _vocab(s, tp, t)
    for name in ("model.embed_tokens.weight", "lm_head.weight"):
        if v:
            out.append(Region(name, -1, 0, name, (lo, 0), (v, h)))
    for name in ("model.norm.weight",) + tuple(f"model.layers.{i}.input_layernorm.weight" for i in range(s.layers)):
        out.append(Region(name, -1, 0, name, (0,), (h,)))
    for i in range(s.layers):
        p = f"model.layers.{i}."
        a = p + "self_attn."
        qkv, (q0, qn), (k0, kn) = a + "qkv_proj.weight", _split(s.q_rows(), tp, t), _kv(s, tp, t)
        out += [Region(qkv, -1, 0, a + "q_proj.weight", (q0, 0), (qn, h)),
                Region(qkv, -1, qn, a + "k_proj.weight", (k0, 0), (kn, h)),
                Region(qkv, -1, qn + kn, a + "v_proj.weight", (k0, 0), (kn, h)),
                Region(a + "o_proj.weight", -1, 0, a + "o_proj.weight", (0, q0), (h, qn))]
        if s.dense(i):
            i0, n = _split(s.mlp_inter(), tp, t)
            gu = p + "mlp.gate_up_proj.weight"
            out += [Region(gu, -1, 0, p + "mlp.gate_proj.weight", (i0, 0), (n, h)),
                    Region(gu, -1, n, p + "mlp.up_proj.weight", (i0, 0), (n, h)),
                    Region(p + "mlp.down_proj.weight", -1, 0, p + "mlp.down_proj.weight", (0, i0), (h, n))]
            continue
        i0, n = _split(s.inter, tp, t)
        out.append(Region(p + "mlp.gate.weight", -1, 0, p + "mlp.gate.weight", (0, 0), (s.experts, h)))
        w13, w2 = p + "mlp.experts.w13_weight", p + "mlp.experts.w2_weight"
        for e in range(s.experts):
            q = f"{p}mlp.experts.{e}."
            out += [Region(w13, e, 0, q + "gate_proj.weight", (i0, 0), (n, h)),
                    Region(w13, e, n, q + "up_proj.weight", (i0, 0), (n, h)),
                    Region(w2, e, 0, q + "down_proj.weight", (0, i0), (h, n))]
    return out


def engine_slices(s: Shape, params: dict[str, torch.Tensor], tp: int, t: int) -> list[Slice]:
    """Every region of ``params`` (TP rank ``t``) as the checkpoint region it holds."""
    shapes = checkpoint_shapes(s)
    out: list[Slice] = []
    for r in engine_regions(s, tp, t):
        view = params[r.param]
        if r.expert >= 0:
            view = view[r.expert]
        out.append(Slice(view.narrow(0, r.row, r.lengths[0]), r.name, r.offsets, shapes[r.name]))
    return out


def engine_loader(s: Shape, params: dict[str, torch.Tensor], tp: int, t: int) -> Callable[[Iterable], None]:
    """The engine's ``load_weights(weights)``: full checkpoint tensors in, its own shard fused in place,
    written as vLLM's loaders are (stacked parameter mapping, per-parameter weight loaders narrowing by
    the TP rank, KV heads replicated past their count, fused-MoE expert loaders, a vocabulary shard
    padded per rank) and independent of :func:`engine_slices`, so that each checks the other."""
    q_size = s.q_rows() // tp
    kv_replicas = max(1, tp // s.kv_heads)
    kv_size = max(1, s.kv_heads // tp) * s.head_dim
    stacked = [("qkv_proj", "q_proj", "q"), ("qkv_proj", "k_proj", "k"), ("qkv_proj", "v_proj", "v"),
               ("gate_up_proj", "gate_proj", 0), ("gate_up_proj", "up_proj", 1)]

    def qkv(param, w, shard):
        offset, size = {"q": (0, q_size), "k": (q_size, kv_size), "v": (q_size + kv_size, kv_size)}[shard]
        index = t if shard == "q" else t // kv_replicas
        param.data.narrow(0, offset, size).copy_(w.narrow(0, index * size, size))

    def merged(param, w, shard):
        size = param.shape[0] // 2
        param.data.narrow(0, shard * size, size).copy_(w.narrow(0, t * size, size))

    def row_parallel(param, w):
        size = param.shape[1]
        param.data.copy_(w.narrow(1, t * size, size))

    def vocab(param, w):
        start = t * param.shape[0]
        n = max(0, min(param.shape[0], w.shape[0] - start))
        if n:
            param[:n].data.copy_(w.narrow(0, start, n))

    def expert(param, w, e, shard):
        data = param.data[e]
        if shard == "w2":
            size = data.shape[1]
            data.copy_(w.narrow(1, t * size, size))
        else:
            size = data.shape[0] // 2
            data.narrow(0, 0 if shard == "w1" else size, size).copy_(w.narrow(0, t * size, size))

    def load_weights(weights: Iterable) -> None:
        for name, w in weights:
            if ".mlp.experts." in name:
                prefix, rest = name.split(".mlp.experts.")
                e, proj, _ = rest.split(".")
                fused = "w2_weight" if proj == "down_proj" else "w13_weight"
                expert(params[f"{prefix}.mlp.experts.{fused}"], w, int(e),
                       {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}[proj])
                continue
            for fused, part, shard in stacked:
                if part in name:
                    (qkv if fused == "qkv_proj" else merged)(params[name.replace(part, fused)], w, shard)
                    break
            else:
                if name in ("model.embed_tokens.weight", "lm_head.weight"):
                    vocab(params[name], w)
                elif name.endswith(("o_proj.weight", "down_proj.weight")):
                    row_parallel(params[name], w)
                else:
                    assert params[name].shape == w.shape, name
                    params[name].data.copy_(w)

    return load_weights


def expected(s: Shape, full: dict[str, torch.Tensor], tp: int, t: int) -> dict[str, torch.Tensor]:
    """What rank ``t``'s parameters hold after a refresh from the full tensors ``full``."""
    params = engine_params(s, tp, t)
    engine_loader(s, params, tp, t)(full.items())
    return params
