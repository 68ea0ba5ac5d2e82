"""A synthetic transformer-MoE state dict whose every value can be checked after a load.

The shapes follow a scaled-down Qwen3-30B-A3B: token embeddings, per layer the q/k/v/o attention
projections with q/k norms, the two layer norms, a router gate and many small experts (gate/up/down
projections each), a final norm and an untied ``lm_head``. With the defaults (8 layers, 128 experts)
the model part has 3,147 tensors; ``size_mb`` scales the hidden sizes (vocabulary, hidden, head and
expert widths), never the tensor count.

Layout on a 2-D device mesh ``("dp", "tp")`` of the local world, the way tensor-parallel trainers
shard such a model:

- column-parallel (``Shard(0)`` on tp): embeddings, q/k/v projections, expert gate/up, ``lm_head``;
- row-parallel (``Shard(1)`` on tp): o projection, expert down;
- replicated: layer norms and the final norm as plain tensors; q/k norms and the router gate as
  DTensors with all-``Replicate`` placements;
- everything is ``Replicate`` on dp, so each shard has ``dp`` replicas;
- an optimizer-like part: a scalar float32 ``step`` tensor per non-expert parameter (the host-side
  scalars AdamW keeps) and plain Python values (a param group with ``lr``, ``betas``, ..., an int).

Every element is a function of ``(seed, fqn, global element index)`` only, so the values do not
depend on the layout: a checkpoint saved on one mesh and loaded on another (resharding) verifies the
same way. Each rank generates just its local shard, block by block, which keeps generation cheap at
several GiB. Tensor values are bfloat16 bit patterns with a bounded exponent (no NaN/inf, magnitudes in
[2^-7, 2)); comparisons are bitwise.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Iterator

import torch
import xxhash

# Qwen3-30B-A3B, the model the default shapes are scaled from.
_BASE = dict(vocab=151936, hidden=2048, heads=32, kv_heads=4, head_dim=128, moe_inter=768)
DEFAULT_LAYERS = 8
DEFAULT_EXPERTS = 128
_ALIGN = 8  # every scaled width is a multiple of this, so tp up to 8 shards it evenly
_BLOCK = 1 << 18  # elements generated per vectorised step: a few MiB of int64 temporaries
DTYPE = torch.bfloat16
MiB = 2**20


@dataclass(frozen=True)
class ModelSpec:
    """The widths and counts of the synthetic model."""

    vocab: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    moe_inter: int
    layers: int = DEFAULT_LAYERS
    experts: int = DEFAULT_EXPERTS

    def tensors(self) -> list[tuple[str, tuple[int, ...], str]]:
        """``(fqn, global shape, role)`` of every model tensor, in a fixed order.

        ``role`` is one of ``"col"`` (Shard(0) on tp), ``"row"`` (Shard(1) on tp), ``"replicate"``
        (a DTensor with all-Replicate placements) and ``"plain"`` (a plain replicated tensor).
        """
        h, q_out, kv_out = self.hidden, self.heads * self.head_dim, self.kv_heads * self.head_dim
        out: list[tuple[str, tuple[int, ...], str]] = [("model.embed_tokens.weight", (self.vocab, h), "col")]
        for i in range(self.layers):
            p = f"model.layers.{i}"
            out += [
                (f"{p}.input_layernorm.weight", (h,), "plain"),
                (f"{p}.self_attn.q_proj.weight", (q_out, h), "col"),
                (f"{p}.self_attn.k_proj.weight", (kv_out, h), "col"),
                (f"{p}.self_attn.v_proj.weight", (kv_out, h), "col"),
                (f"{p}.self_attn.o_proj.weight", (h, q_out), "row"),
                (f"{p}.self_attn.q_norm.weight", (self.head_dim,), "replicate"),
                (f"{p}.self_attn.k_norm.weight", (self.head_dim,), "replicate"),
                (f"{p}.post_attention_layernorm.weight", (h,), "plain"),
                (f"{p}.mlp.gate.weight", (self.experts, h), "replicate"),
            ]
            for e in range(self.experts):
                x = f"{p}.mlp.experts.{e}"
                out += [
                    (f"{x}.gate_proj.weight", (self.moe_inter, h), "col"),
                    (f"{x}.up_proj.weight", (self.moe_inter, h), "col"),
                    (f"{x}.down_proj.weight", (h, self.moe_inter), "row"),
                ]
        out += [("model.norm.weight", (h,), "plain"), ("lm_head.weight", (self.vocab, h), "col")]
        return out

    def step_fqns(self) -> list[str]:
        """The parameters that get an optimizer ``step`` scalar: every one that is not an expert's."""
        return [fqn for fqn, _, _ in self.tensors() if ".mlp.experts." not in fqn]

    @property
    def model_nbytes(self) -> int:
        return sum(math.prod(shape) for _, shape, _ in self.tensors()) * DTYPE.itemsize


def _spec_at(scale: float, layers: int, experts: int) -> ModelSpec:
    def w(x: int) -> int:
        return max(_ALIGN, int(round(x * scale / _ALIGN)) * _ALIGN)

    return ModelSpec(
        vocab=w(_BASE["vocab"]),
        hidden=w(_BASE["hidden"]),
        heads=_BASE["heads"],
        kv_heads=_BASE["kv_heads"],
        head_dim=w(_BASE["head_dim"]),
        moe_inter=w(_BASE["moe_inter"]),
        layers=layers,
        experts=experts,
    )


def model_spec(size_mb: float, *, layers: int = DEFAULT_LAYERS, experts: int = DEFAULT_EXPERTS) -> ModelSpec:
    """The spec whose model tensors come closest to ``size_mb`` MiB (every width scaled alike).

    Bytes grow with the square of the width scale, so the scale is ``sqrt(size / full size)``,
    refined once for the rounding of the widths to multiples of 8.
    """
    if size_mb <= 0:
        raise ValueError(f"size_mb must be positive, got {size_mb}")
    full = _spec_at(1.0, layers, experts).model_nbytes
    scale = math.sqrt(size_mb * MiB / full)
    best = _spec_at(scale, layers, experts)
    for _ in range(3):
        got = best.model_nbytes
        if got == 0:
            break
        scale *= math.sqrt(size_mb * MiB / got)
        cand = _spec_at(scale, layers, experts)
        if abs(cand.model_nbytes - size_mb * MiB) < abs(best.model_nbytes - size_mb * MiB):
            best = cand
    return best


# ----------------------------------------------------------------------------------------------------
# Deterministic values


def _key(seed: int, fqn: str) -> int:
    return xxhash.xxh3_64_intdigest(f"{seed}\x00{fqn}".encode()) & 0x7FFFFFFF


def _row_starts(global_shape: tuple[int, ...], offsets: tuple[int, ...], lengths: tuple[int, ...]) -> torch.Tensor:
    """Global flat index of the first element of each row (last dim) of the box, in C order."""
    starts = torch.zeros(1, dtype=torch.int64)
    stride = 1
    strides = []
    for s in reversed(global_shape):
        strides.append(stride)
        stride *= s
    strides.reverse()
    for d in range(len(global_shape) - 1):
        idx = torch.arange(offsets[d], offsets[d] + lengths[d], dtype=torch.int64) * strides[d]
        starts = (starts[:, None] + idx[None, :]).reshape(-1)
    return starts


def _blocks(
    seed: int, fqn: str, global_shape: tuple[int, ...], offsets: tuple[int, ...], lengths: tuple[int, ...]
) -> Iterator[tuple[slice, slice, torch.Tensor]]:
    """Yield ``(rows, cols, bits)``: int16 bfloat16 bit patterns of the box, a block at a time.

    ``rows``/``cols`` index the box viewed as ``(rows, last dim)``; a 0-d tensor is one 1x1 block.
    The buffer behind ``bits`` is reused: consume it before the next iteration.
    """
    key = _key(seed, fqn)
    if len(global_shape) == 0:
        row_starts = torch.zeros(1, dtype=torch.int64)
        c_off, ncols = 0, 1
    else:
        row_starts = _row_starts(global_shape, offsets, lengths)
        c_off, ncols = offsets[-1], lengths[-1]
    nrows = row_starts.numel() if ncols else 0
    if nrows == 0 or ncols == 0:
        return
    cb = min(ncols, _BLOCK)
    rb = max(1, _BLOCK // cb)
    cols_all = torch.arange(c_off, c_off + ncols, dtype=torch.int64)
    buf = torch.empty(rb * cb, dtype=torch.int64)
    tmp = torch.empty(rb * cb, dtype=torch.int64)
    bits = torch.empty(rb * cb, dtype=torch.int16)
    for r0 in range(0, nrows, rb):
        r1 = min(nrows, r0 + rb)
        for c0 in range(0, ncols, cb):
            c1 = min(ncols, c0 + cb)
            n = (r1 - r0) * (c1 - c0)
            v = buf[:n].view(r1 - r0, c1 - c0)
            torch.add(row_starts[r0:r1, None], cols_all[None, c0:c1], out=v)
            v = buf[:n]
            t = tmp[:n]
            # A 32-bit integer mix (multiply / xor-shift); products stay below 2**63.
            v.bitwise_xor_(key)
            v.mul_(0x2545F491).bitwise_and_(0xFFFFFFFF)
            torch.bitwise_right_shift(v, 15, out=t)
            v.bitwise_xor_(t)
            v.mul_(0x5BD1E995).bitwise_and_(0xFFFFFFFF)
            torch.bitwise_right_shift(v, 13, out=t)
            v.bitwise_xor_(t)
            # bfloat16 bits: sign from bit 16, exponent 120..127, 7 random mantissa bits.
            torch.bitwise_right_shift(v, 16, out=t)
            t.bitwise_and_(1).mul_(32768)
            v.bitwise_and_(0x3FF).add_(0x3C00).sub_(t)
            out = bits[:n]
            out.copy_(v)
            yield slice(r0, r1), slice(c0, c1), out.view(r1 - r0, c1 - c0)


def _as_rows(t: torch.Tensor) -> torch.Tensor:
    """``t`` (contiguous) as an int16 ``(rows, last dim)`` view of its bits."""
    flat = t.view(torch.int16)
    if t.dim() == 0:
        return flat.reshape(1, 1)
    return flat.reshape(-1, t.shape[-1]) if t.shape[-1] else flat.reshape(0, 0)


def fill_box(
    out: torch.Tensor, seed: int, fqn: str, global_shape: tuple[int, ...], offsets: tuple[int, ...]
) -> torch.Tensor:
    """Write the values of the box of ``fqn`` at ``offsets`` (its extent is ``out.shape``) into ``out``."""
    assert out.dtype == DTYPE and out.is_contiguous()
    rows = _as_rows(out)
    for rs, cs, bits in _blocks(seed, fqn, global_shape, tuple(offsets), tuple(out.shape)):
        rows[rs, cs] = bits
    return out


def box_mismatch(
    actual: torch.Tensor, seed: int, fqn: str, global_shape: tuple[int, ...], offsets: tuple[int, ...]
) -> str | None:
    """``None`` when ``actual`` holds exactly the values of its box, else a one-line description."""
    if actual.dtype != DTYPE:
        return f"{fqn}: dtype {actual.dtype}, expected {DTYPE}"
    rows = _as_rows(actual.contiguous())
    bad = 0
    first = None
    for rs, cs, bits in _blocks(seed, fqn, global_shape, tuple(offsets), tuple(actual.shape)):
        got = rows[rs, cs]
        if not torch.equal(got, bits):
            diff = (got != bits).nonzero()
            bad += diff.shape[0]
            if first is None:
                r, c = diff[0].tolist()
                first = (rs.start + r, cs.start + c)
    if bad:
        return (
            f"{fqn}: {bad} of {actual.numel()} elements differ in the box at {list(offsets)} "
            f"(first at local row {first[0]}, column {first[1]})"
        )
    return None


def step_value(seed: int, fqn: str) -> float:
    return float(1 + xxhash.xxh3_64_intdigest(f"{seed}\x00step\x00{fqn}".encode()) % 100_000)


def python_values(seed: int) -> dict[str, Any]:
    """The non-tensor part of the state dict (a fresh object each call)."""
    h = xxhash.xxh3_64_intdigest(f"{seed}\x00python".encode())
    return {
        "optim_param_groups": [
            {
                "lr": (1 + h % 997) * 1e-6,
                "betas": (0.9, 0.95),
                "eps": 1e-8,
                "weight_decay": 0.1,
                "amsgrad": False,
            }
        ],
        "iteration": int(h % 1_000_003),
        "run": {"seed": seed, "name": f"synth-{seed}"},
    }


# ----------------------------------------------------------------------------------------------------
# Layout


def make_mesh(world_size: int, tp: int, dp: int | None = None):
    """The ``("dp", "tp")`` CPU mesh over the default process group (``dp * tp`` must be the world)."""
    from torch.distributed.device_mesh import init_device_mesh

    dp = world_size // tp if dp is None else dp
    if dp * tp != world_size:
        raise ValueError(f"dp={dp} x tp={tp} does not match the world size {world_size}")
    return init_device_mesh("cpu", (dp, tp), mesh_dim_names=("dp", "tp"))


def _placements(role: str, fsdp: int = 0):
    """The DTensor placements of a tensor with ``role`` on the ``("dp", "tp")`` mesh: ``Replicate`` on dp,
    or with ``fsdp`` (the mesh's tp size; 0: off) FSDP2 over TP: the dp ranks split the TP shard's first
    dim (``Shard(0)`` on dp, written ``_StridedShard(0, split_factor=tp)`` when TP cuts dim 0 too, as
    FSDP2 writes it)."""
    from torch.distributed.tensor import Replicate, Shard

    tp = {"col": Shard(0), "row": Shard(1), "replicate": Replicate()}[role]
    if not fsdp:
        return (Replicate(), tp)
    if role == "col":
        from torch.distributed.tensor.placement_types import _StridedShard

        return (_StridedShard(0, split_factor=fsdp), tp)
    return (Shard(0), tp)


def _local_box(mesh, role: str, shape: tuple[int, ...], fsdp: int = 0) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """``(local shape, global offset)`` of this rank's shard of a tensor with ``role``."""
    if mesh is None or role == "plain":
        return shape, (0,) * len(shape)
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    local, offset = compute_local_shape_and_global_offset(shape, mesh, _placements(role, fsdp))
    return tuple(local), tuple(offset)


def _placeholder(v: Any) -> Any:
    """The same nesting of dicts and lists as ``v``, with ``None`` at every leaf."""
    if isinstance(v, dict):
        return {k: _placeholder(x) for k, x in v.items()}
    if isinstance(v, list):
        return [_placeholder(x) for x in v]
    return None


def build_state_dict(
    mesh,
    seed: int,
    size_mb: float,
    fill: bool = True,
    *,
    layers: int = DEFAULT_LAYERS,
    experts: int = DEFAULT_EXPERTS,
    fsdp: bool = False,
) -> dict[str, Any]:
    """This rank's part of the synthetic state dict on ``mesh`` (``None``: one process, plain tensors).

    ``fill=False`` gives destinations of the same layout to load into: zeroed tensors, zero steps,
    and the Python values' dicts and lists with ``None`` at every leaf. ``fsdp``: FSDP2 over TP, each
    DTensor's first dim also sharded over the mesh's dp dim (:func:`_placements`).
    """
    spec = model_spec(size_mb, layers=layers, experts=experts)
    model: dict[str, Any] = {}
    fsdp = mesh.size(1) if fsdp and mesh is not None else 0
    for fqn, shape, role in spec.tensors():
        local_shape, offset = _local_box(mesh, role, shape, fsdp)
        local = torch.zeros(local_shape, dtype=DTYPE) if not fill else torch.empty(local_shape, dtype=DTYPE)
        if fill:
            fill_box(local, seed, fqn, shape, offset)
        if mesh is not None and role != "plain":
            from torch.distributed.tensor import DTensor

            stride = tuple(math.prod(shape[d + 1:]) for d in range(len(shape)))
            local = DTensor.from_local(
                local, mesh, _placements(role, fsdp), run_check=False, shape=torch.Size(shape), stride=stride
            )
        model[fqn] = local
    state = {
        fqn: {"step": torch.tensor(step_value(seed, fqn) if fill else 0.0, dtype=torch.float32)}
        for fqn in spec.step_fqns()
    }
    py = python_values(seed) if fill else _placeholder(python_values(seed))
    return {
        "model": model,
        "optim": {"state": state, "param_groups": py["optim_param_groups"]},
        "iteration": py["iteration"],
        "run": py["run"],
    }


def zero_(sd: dict[str, Any]) -> None:
    """Reset a state dict from :func:`build_state_dict` to the ``fill=False`` state, in place."""
    for t in sd["model"].values():
        _local(t).zero_()
    for s in sd["optim"]["state"].values():
        s["step"].zero_()
    sd["optim"]["param_groups"] = _placeholder(sd["optim"]["param_groups"])
    sd["iteration"] = None
    sd["run"] = _placeholder(sd["run"])


def _local(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


def _box_of(t: torch.Tensor) -> tuple[tuple[int, ...], torch.Tensor, tuple[int, ...]]:
    """``(global shape, local tensor, global offset)`` of a tensor or DTensor as it is laid out."""
    from torch.distributed.tensor import DTensor

    if isinstance(t, DTensor):
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

        shape = tuple(t.shape)
        _, offset = compute_local_shape_and_global_offset(shape, t.device_mesh, t.placements)
        return shape, t.to_local(), tuple(offset)
    return tuple(t.shape), t, (0,) * t.dim()


def verify_state_dict(
    sd: dict[str, Any],
    seed: int,
    size_mb: float,
    *,
    layers: int = DEFAULT_LAYERS,
    experts: int = DEFAULT_EXPERTS,
) -> list[str]:
    """Every way ``sd`` differs from the synthetic values (empty when it is exact).

    Checks keys, dtypes, global shapes and every local element bitwise, whatever the layout of each
    tensor (any mesh, any placements), plus the step scalars and the Python values.
    """
    spec = model_spec(size_mb, layers=layers, experts=experts)
    problems: list[str] = []
    model = sd.get("model", {}) if isinstance(sd, dict) else {}
    expected = {fqn: shape for fqn, shape, _ in spec.tensors()}
    for fqn in sorted(expected.keys() - model.keys()):
        problems.append(f"model.{fqn}: missing")
    for fqn in sorted(model.keys() - expected.keys()):
        problems.append(f"model.{fqn}: unexpected key")
    for fqn, shape, _ in spec.tensors():
        t = model.get(fqn)
        if t is None:
            continue
        if not isinstance(t, torch.Tensor):
            problems.append(f"model.{fqn}: expected a tensor, got {type(t).__name__}")
            continue
        gshape, local, offset = _box_of(t)
        if gshape != shape:
            problems.append(f"model.{fqn}: global shape {list(gshape)}, expected {list(shape)}")
            continue
        msg = box_mismatch(local, seed, fqn, shape, offset)
        if msg:
            problems.append(f"model.{msg}")
    state = sd.get("optim", {}).get("state", {}) if isinstance(sd.get("optim"), dict) else {}
    for fqn in spec.step_fqns():
        step = state.get(fqn, {}).get("step") if isinstance(state.get(fqn), dict) else None
        want = step_value(seed, fqn)
        if not isinstance(step, torch.Tensor) or step.dtype != torch.float32 or step.dim() != 0:
            problems.append(f"optim.state.{fqn}.step: expected a 0-d float32 tensor, got {_describe(step)}")
        elif step.item() != want:
            problems.append(f"optim.state.{fqn}.step: {step.item()}, expected {want}")
    extra_steps = sorted(state.keys() - set(spec.step_fqns()))
    problems += [f"optim.state.{fqn}: unexpected key" for fqn in extra_steps]
    py = python_values(seed)
    got = {
        "optim.param_groups": sd.get("optim", {}).get("param_groups") if isinstance(sd.get("optim"), dict) else None,
        "iteration": sd.get("iteration"),
        "run": sd.get("run"),
    }
    want = {"optim.param_groups": py["optim_param_groups"], "iteration": py["iteration"], "run": py["run"]}
    for k in want:
        if not _same_value(got[k], want[k]):
            problems.append(f"{k}: {got[k]!r}, expected {want[k]!r}")
    return problems


def _same_value(a: Any, b: Any) -> bool:
    # Sequences compare by content: a tuple may come back as a list through some formats.
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same_value(x, y) for x, y in zip(a, b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same_value(a[k], b[k]) for k in a)
    return type(a) is type(b) and a == b


def _describe(v: Any) -> str:
    if isinstance(v, torch.Tensor):
        return f"{v.dtype} tensor of shape {list(v.shape)}"
    return type(v).__name__


def flatten(sd: Any, prefix: str = "") -> dict[str, Any]:
    """``{dotted path: leaf}`` of a nested dict/list state dict (tensors and Python values are leaves)."""
    out: dict[str, Any] = {}
    if isinstance(sd, dict):
        for k, v in sd.items():
            out.update(flatten(v, f"{prefix}{k}."))
    elif isinstance(sd, list):
        for i, v in enumerate(sd):
            out.update(flatten(v, f"{prefix}{i}."))
    else:
        out[prefix[:-1]] = sd
    return out


def unique_bytes(sd: dict[str, Any]) -> int:
    """Bytes of the distinct tensor data of a state dict: each global tensor once, however replicated.

    A DTensor counts its global size, a plain tensor its own size; Python values are not counted.
    """
    total = 0
    for v in flatten(sd).values():
        if isinstance(v, torch.Tensor):
            total += v.numel() * v.element_size()  # a DTensor's numel() is the global one
    return total


def local_bytes(sd: dict[str, Any]) -> int:
    """Bytes of the tensor data this rank holds (the local shards)."""
    return sum(_local(v).numel() * v.element_size() for v in flatten(sd).values() if isinstance(v, torch.Tensor))


def same_tensors(expected: dict[str, Any], actual: dict[str, Any]) -> list[str]:
    """Bitwise comparison of two state dicts of the same layout (fast: no regeneration).

    Used by the benchmark after every load against a reference built once with ``fill=True``.
    """
    problems: list[str] = []
    fe, fa = flatten(expected), flatten(actual)
    for k in sorted(fe.keys() - fa.keys()):
        problems.append(f"{k}: missing")
    for k, e in fe.items():
        if k not in fa:
            continue
        a = fa[k]
        if isinstance(e, torch.Tensor):
            if not isinstance(a, torch.Tensor):
                problems.append(f"{k}: expected a tensor, got {type(a).__name__}")
                continue
            el, al = _local(e), _local(a)
            if el.dtype != al.dtype or el.shape != al.shape:
                problems.append(f"{k}: {al.dtype} {list(al.shape)}, expected {el.dtype} {list(el.shape)}")
            elif not torch.equal(_bits(el), _bits(al)):
                problems.append(f"{k}: {int((_bits(el) != _bits(al)).sum())} of {el.numel()} elements differ")
        elif not _same_value(a, e):
            problems.append(f"{k}: {a!r}, expected {e!r}")
    return problems


def _bits(t: torch.Tensor) -> torch.Tensor:
    int_of = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
    return t.contiguous().view(int_of[t.element_size()]) if t.is_floating_point() else t
