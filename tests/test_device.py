"""The device layer (``pipeload.device``): which backends move device tensors, which device kinds pipeload
fills, the host -> device ring, and ``pipeload bench --device`` on a machine without an accelerator.

The routing is tested on its pure inputs (backend config strings, device type strings); the ring's
slot logic and its callers (the reader's guarded copy, the broadcast's unpack, ``load_file``'s
``map_location``) on host tensors for real, the ring's host mode copying synchronously. The tests that
need an accelerator are skipped without one.
"""

from __future__ import annotations

import io
import os

import pytest
import torch

import pipeload
from pipeload import device as devices
from pipeload.engine.scheduler import unpack
from pipeload.engine.wholefile import _StorageRing, _tensors_via_ring
from pipeload.errors import StateDictError
from pipeload.io.reader import copy_box
from pipeload.plan.tensorkinds import refusal

needs_accelerator = pytest.mark.skipif(not torch.accelerator.is_available(), reason="no accelerator")


# -- routing ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("config, moves", [
    ("nccl", "cuda"), ("hccl", "npu"), ("xccl", "xpu"), ("mccl", "musa"),
    ("cpu:gloo,cuda:nccl", "cuda"), ("cpu:gloo,npu:hccl", "npu"), ("cpu:gloo,xpu:xccl", "xpu"),
    ("cuda:nccl", "cuda"), (" CPU:gloo , CUDA:nccl ", "cuda"),
    ("gloo", None), ("cpu:gloo", None), ("cpu:gloo,cuda:gloo", None), ("mpi", None), ("", None),
])
def test_backend_configs_route_device_moving_or_host(config, moves):
    assert devices.device_moving(config) == moves
    assert devices.device_moving(config, present="npu") == moves  # an accelerator present changes no known name


def test_an_unknown_bare_backend_moves_the_accelerator_present():
    assert devices.device_moving("someccl", present="npu") == "npu"
    assert devices.device_moving("someccl", present=None) is None


def test_broadcast_device_is_the_host_without_that_accelerator():
    present = devices.accelerator()
    for config in ("cpu:gloo,npu:hccl", "hccl", "gloo", "cpu:gloo,cuda:gloo"):
        assert devices.broadcast_device(config) == torch.device("cpu")
    if present is None:
        assert devices.broadcast_device("cpu:gloo,cuda:nccl") == torch.device("cpu")


@pytest.mark.parametrize("kind, ok", [("cpu", True), ("cuda", True), ("xpu", True), ("mps", False), ("xla", False),
                                      ("lazy", False), ("meta", False), ("hpu", False), ("no-such", False)])
def test_device_kinds_are_fillable_by_capability(kind, ok):
    """cuda and xpu have streams and events in every build; mps has no Stream; xla, lazy, hpu no module
    here; meta is the planner's own case."""
    assert devices.fillable(kind) is ok


class _OnDevice(torch.Tensor):
    """A tensor that reports a device of the caller's choice (a wrapper subclass: no memory)."""

    @staticmethod
    def __new__(cls, shape, device):
        return torch.Tensor._make_wrapper_subclass(cls, shape, dtype=torch.float32, device=device)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        raise NotImplementedError(f"{func} on a stand-in device tensor")


@pytest.mark.parametrize("kind", ["xla", "lazy", "mps"])
def test_a_kind_pipeload_cannot_fill_is_refused_by_name_before_anything_is_written(tmp_path, kind):
    sd = {"a": torch.arange(6.0), "odd": torch.ones(2, 3)}
    pipeload.save(sd, tmp_path / "ck")
    assert refusal(_OnDevice((2, 3), torch.device(kind)), load=True).startswith(f"a tensor on device {kind}")
    dest = {"a": torch.full((6,), -1.0), "odd": _OnDevice((2, 3), torch.device(kind))}
    with pytest.raises(StateDictError, match=f"'odd'.*device {kind}"):
        pipeload.load(dest, tmp_path / "ck")
    assert torch.equal(dest["a"], torch.full((6,), -1.0))  # nothing written
    with pytest.raises(StateDictError, match=f"device {kind}"):
        pipeload.save({"odd": _OnDevice((2, 3), torch.device(kind))}, tmp_path / "other")
    assert not os.path.exists(tmp_path / "other" / ".metadata")


# -- the ring, on host tensors ---------------------------------------------------------------------------


def test_slots_hand_out_a_pending_slot_only_with_its_marker():
    slots = devices.Slots(3)
    handed = []
    for step in range(7):
        i, marker = slots.take()
        handed.append((i, marker))
        slots.submitted(i, f"copy{step}")
    assert [i for i, _ in handed] == [0, 1, 2, 0, 1, 2, 0]
    assert [m for _, m in handed] == [None, None, None, "copy0", "copy1", "copy2", "copy3"]
    assert slots.waits == 4
    assert slots.outstanding() == ["copy4", "copy5", "copy6"]  # oldest first
    assert slots.outstanding() == []


@pytest.mark.parametrize("shape, limit", [((4096,), 1000), ((64, 300), 4000), ((3, 5, 7000), 9000), ((1, 1, 10), 4),
                                          ((5, 1, 3), 8), ((), 1)])
def test_split_box_covers_every_element_once_within_the_limit(shape, limit):
    dst = torch.zeros(shape, dtype=torch.int32)
    src = torch.arange(dst.numel(), dtype=torch.int32).reshape(shape)
    n = 0
    for d, s in devices.split_box(dst, src, limit):
        assert d.shape == s.shape and (d.numel() * 4 <= limit or d.dim() == 0)
        d.add_(s + 1)
        n += d.numel()
    assert n == dst.numel() and torch.equal(dst, src + 1)


def test_ring_on_host_memory_copies_strided_boxes_through_its_slots():
    ring = devices.H2DRing("cpu", ring_bytes=3 << 20, slots=3)  # slots of 1 MiB
    assert ring.slot_bytes == 1 << 20 and not ring.pinned and ring.stream is None
    base = torch.randn(1024, 2048)  # 8 MiB
    dst = torch.zeros(2048, 1024).t()  # a strided destination
    ring.copy(dst[100:900], base[100:900])
    ring.copy(dst[900:], base[900:], fill=lambda h, s: h.copy_(s))
    assert torch.equal(dst[100:], base[100:]) and not dst[:100].any()
    assert ring.copies >= 7 and ring.bytes == 924 * 2048 * 4
    assert sum(b is not None for b in ring.buffers) == 3  # never more slots than the ring has
    ring.close()
    assert all(b is None for b in ring.buffers)


def test_small_pieces_share_a_slot():
    ring = devices.H2DRing("cpu", ring_bytes=2 << 20, slots=2)
    srcs = [torch.randn(100 + i) for i in range(300)]  # ~150 KiB in all
    dsts = [torch.zeros_like(t) for t in srcs]
    for d, t in zip(dsts, srcs):
        ring.copy(d, t)
    assert all(torch.equal(d, t) for d, t in zip(dsts, srcs))
    assert ring.copies == 300 and sum(b is not None for b in ring.buffers) == 1 and ring.slots.waits == 0
    big = torch.randn(300_000)  # 1.1 MiB: past the first slot's rest, then the next slot
    out = torch.zeros_like(big)
    ring.copy(out, big)
    assert torch.equal(out, big) and sum(b is not None for b in ring.buffers) == 2


def test_guarded_copy_and_unpack_go_through_a_ring(tmp_path):
    ring = devices.H2DRing("cpu", ring_bytes=2 << 20, slots=2)
    src = torch.arange(3 << 18, dtype=torch.float32).reshape(768, 1024)  # 3 MiB
    out = torch.zeros(768, 1024)
    copy_box(out, src, "a file", ring)
    assert torch.equal(out, src) and ring.copies == 3
    conj = torch.zeros(4, dtype=torch.complex64).conj()  # a lazy view is left to torch's copy_
    pairs = [(torch.zeros(768, 1024), src), (conj, torch.ones(4, dtype=torch.complex64))]
    unpack(pairs, ring)
    assert torch.equal(pairs[0][0], src) and ring.copies == 6
    assert torch.equal(conj.resolve_conj(), torch.ones(4, dtype=torch.complex64))


def test_tier_restore_copies_go_through_a_ring():
    from pipeload.move.mover import staged_into, unpack_into

    ring = devices.H2DRing("cpu", ring_bytes=2 << 20, slots=2)
    dst = torch.zeros(64, 32).t()  # not one block: staged, then copied
    buf, then = staged_into(dst, ring)
    want = torch.randn(32, 64)
    buf.copy_(want.contiguous().view(-1).view(torch.uint8))
    then()
    assert torch.equal(dst, want) and ring.copies == 1
    packed = torch.arange(12, dtype=torch.float32)
    a, b = torch.zeros(4, 2).t(), torch.zeros(4)  # a strided (through the ring), b one block (memmove)
    unpack_into(packed.view(torch.uint8), [a, b], ring)()
    assert torch.equal(a, packed[:8].view(2, 4)) and torch.equal(b, packed[8:]) and ring.copies == 2


def test_load_file_storages_through_a_ring_keep_sharing(tmp_path):
    a = torch.arange(20000.0).reshape(100, 200)
    sd = {"a": a, "view": a[10:20], "i": torch.arange(7, dtype=torch.int16)}
    torch.save(sd, tmp_path / "f.pt")
    place = _StorageRing.__new__(_StorageRing)
    place.ring = devices.H2DRing("cpu", ring_bytes=1 << 20, slots=2)
    with place:
        got = torch.load(tmp_path / "f.pt", map_location=place, weights_only=True, mmap=True)
    assert torch.equal(got["a"], a) and torch.equal(got["view"], a[10:20]) and torch.equal(got["i"], sd["i"])
    assert got["view"].untyped_storage().data_ptr() == got["a"].untyped_storage().data_ptr()
    assert torch.equal(_tensors_via_ring(sd, torch.device("cpu"))["view"], a[10:20])


def test_no_ring_without_an_accelerator_in_use(tmp_path):
    assert devices.ring_for(None) is None and devices.ring_for("cpu") is None and devices.ring_for("cuda", 0) is None
    if devices.in_use() is None:
        sd = {"w": torch.randn(64, 64)}
        pipeload.save(sd, tmp_path / "ck")
        dest = {"w": torch.zeros(64, 64)}
        pipeload.load(dest, tmp_path / "ck", h2d_ring_bytes=0)
        assert torch.equal(dest["w"], sd["w"])
    with pytest.raises(ValueError, match="h2d_ring_bytes"):
        pipeload.load({"w": torch.zeros(1)}, tmp_path / "ck", h2d_ring_bytes=-1)


# -- the command ---------------------------------------------------------------------------------------


@pytest.mark.skipif(torch.accelerator.is_available(), reason="an accelerator is present")
def test_bench_device_without_an_accelerator_says_so_and_exits_0(capsys):
    from pipeload.tools.cli import main

    assert main(["bench", "--device"]) == 0
    assert "no accelerator found" in capsys.readouterr().out


def test_bench_device_rehearsed_on_the_host(tmp_path, capsys):
    """Every case's code on host tensors, the gloo world of two included (one spawned world for its
    sub-cases): a bench that a person with one accelerator runs once must not fail on its own code."""
    from pipeload.tools.bench import device as bench_device

    assert bench_device.run(2, 150, 2, str(tmp_path), device=torch.device("cpu")) == 0
    out = capsys.readouterr().out
    assert "0 not exact, 0 failed, 0 skipped" in out and out.count(" exact ") >= 16


# -- on an accelerator -----------------------------------------------------------------------------------


@needs_accelerator
def test_loads_into_accelerator_tensors_through_the_ring(tmp_path):
    kind = devices.accelerator()
    dev = torch.device(kind, torch.accelerator.current_device_index())
    sd = {"w": torch.randn(1024, 1536), "b": torch.randn(77).to(torch.bfloat16), "s": torch.tensor(3)}
    pipeload.save(sd, tmp_path / "ck")
    for ring_bytes in (4 << 20, 0):
        dest = {k: torch.zeros_like(v, device=dev) for k, v in sd.items()}
        pipeload.load(dest, tmp_path / "ck", h2d_ring_bytes=ring_bytes)
        assert all(torch.equal(dest[k].cpu(), v) for k, v in sd.items())
    buf = io.BytesIO()
    torch.save(sd, buf)
    (tmp_path / "f.pt").write_bytes(buf.getvalue())
    got = pipeload.load_file(tmp_path / "f.pt", map_location=str(dev))
    assert all(got[k].device == dev and torch.equal(got[k].cpu(), v) for k, v in sd.items())
    from safetensors.torch import save_file

    save_file(sd, tmp_path / "f.safetensors")
    got = pipeload.load_file(tmp_path / "f.safetensors", map_location=str(dev))  # through a ring
    assert all(got[k].device == dev and torch.equal(got[k].cpu(), v) for k, v in sd.items())


@needs_accelerator
def test_the_ring_on_an_accelerator_waits_for_a_slot_before_reusing_it():
    dev = torch.device(devices.accelerator(), torch.accelerator.current_device_index())
    ring = devices.H2DRing(dev, ring_bytes=4 << 20, slots=4)
    assert ring.pinned
    src = torch.randn(4096, 1024)  # 16 MiB through 1 MiB slots: each slot reused four times
    dst = torch.zeros(1024, 4096, device=dev).t()
    ring.copy(dst, src)
    ring.close()
    assert torch.equal(dst.cpu(), src) and ring.slots.waits >= 12


def test_move_run_unpacks_through_a_ring():
    """A packed message (a live transfer's, a resharding restore's) lands in a strided destination view
    through the H2D ring, in a contiguous host one with a memmove."""
    from pipeload.move.plan import Op
    from pipeload.move.run import CODES, copies, layout

    ring = devices.H2DRing("cpu", ring_bytes=2 << 20, slots=2)
    a, b = torch.zeros(4, 2).t(), torch.zeros(4)
    f32 = CODES[torch.float32]
    msg = [Op(1, 0, 1, 0, 0, f32, (0, 0), (2, 4)), Op(2, 0, 1, 0, 1, f32, (0,), (4,))]
    starts, n = layout(msg)
    buf = torch.zeros(n, dtype=torch.uint8)
    want_a, want_b = torch.arange(8.0).view(2, 4), torch.arange(4.0) + 10
    buf[starts[0]: starts[0] + 32].view(torch.float32).copy_(want_a.view(-1))
    buf[starts[1]: starts[1] + 16].view(torch.float32).copy_(want_b)
    copies(msg, [a, b], starts, buf, into_buffer=False, ring=ring)
    assert torch.equal(a, want_a) and torch.equal(b, want_b) and ring.copies == 1
