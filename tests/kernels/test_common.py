"""Bit-level helpers of ``kernels._common`` against torch's own conversions."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from flamia_serve.kernels._common import e4m3_value


@triton.jit
def _e4m3_value_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + offs, mask=offs < n, other=0.0)
    tl.store(out_ptr + offs, e4m3_value(x), mask=offs < n)


def test_e4m3_value_is_torch_round_to_nearest_even(device) -> None:
    """Every E4M3 value, every midpoint between neighbours (ties go to the even code),
    points just beside each midpoint, and random values in [0, 448], subnormals included."""
    codes = torch.arange(0, 127, dtype=torch.uint8)  # +0 .. 448 (0x7E); 0x7F is NaN
    grid = codes.view(torch.float8_e4m3fn).float()
    mid = (grid[:-1] + grid[1:]) / 2
    beside = torch.cat([mid * (1 - 2**-20), mid * (1 + 2**-20)])
    gen = torch.Generator().manual_seed(0)
    rand = torch.exp2(torch.rand(4096, generator=gen) * 21 - 12).clamp(max=448)
    x = torch.cat([grid, mid, beside, rand]).to(device)
    out = torch.empty_like(x)
    _e4m3_value_kernel[(triton.cdiv(x.numel(), 256),)](x, out, x.numel(), BLOCK=256)
    want = x.to(torch.float8_e4m3fn).float()
    assert torch.equal(out.view(torch.int32), want.view(torch.int32))
