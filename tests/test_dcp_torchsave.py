"""``pipeload.dcp.torchsave``: a template's head + the tensor's bytes + its tail is ``torch.save``'s
archive of that tensor, byte for byte, for every dtype a save stores, empty and 0-d tensors, with and
without ``torch.save``'s CRC-32; tensors a template cannot serve get none."""

from __future__ import annotations

import io

import pytest
import torch

from pipeload.dcp import torchsave

DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64, torch.int32, torch.int16,
          torch.int8, torch.uint8, torch.bool)
SHAPES = ((), (0,), (1,), (3,), (5, 7), (2, 0, 3), (33, 65), (4, 3, 2, 5))


def _torch_save(t: torch.Tensor) -> bytes:
    buf = io.BytesIO()
    torch.save(t, buf)
    return buf.getvalue()


def _bytes(t: torch.Tensor) -> memoryview:
    return memoryview(t.contiguous().reshape(-1).view(torch.uint8).numpy()) if t.numel() else memoryview(b"")


@pytest.mark.parametrize("crc", [True, False])
def test_template_bytes_are_torch_saves(crc):
    before = torch.serialization.get_crc32_options()
    torch.serialization.set_crc32_options(crc)
    try:
        opts = torchsave.options()
        gen = torch.Generator().manual_seed(3)
        for dtype in DTYPES:
            for shape in SHAPES:
                tpl = torchsave.template(dtype, shape, opts)
                assert tpl is not None, (dtype, shape)
                for _ in range(2):  # two values through one template
                    t = (torch.randn(shape, generator=gen) * 50).to(dtype)
                    head, tail = tpl.parts(_bytes(t))
                    assert head + bytes(_bytes(t)) + tail == _torch_save(t), (dtype, shape, crc)
                    loaded = torch.load(io.BytesIO(head + bytes(_bytes(t)) + tail), weights_only=True)
                    assert torch.equal(loaded, t)
    finally:
        torch.serialization.set_crc32_options(before)


def test_large_tensors_get_no_template():
    n = torchsave.MAX_TEMPLATE_BYTES // 4 + 1
    assert torchsave.template(torch.float32, (n,), torchsave.options()) is None
