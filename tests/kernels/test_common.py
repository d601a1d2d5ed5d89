"""Bit-level helpers of ``kernels._common`` against torch's own conversions."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from flamia_serve.kernels._common import (
    cdiv,
    e2m1_decode,
    e2m1_quantize,
    e2m1_round,
    e4m3_value,
    next_power_of_2,
)
from flamia_serve.numerics import formats


@triton.jit
def _e4m3_value_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + offs, mask=offs < n, other=0.0)
    tl.store(out_ptr + offs, e4m3_value(x), mask=offs < n)


def test_e4m3_value_is_torch_round_to_nearest_even(device) -> None:
    """Every E4M3 value, every midpoint between neighbours (ties go to the even code),
    points just beside each midpoint, random values in [0, 448], subnormals included, and
    values past 448 (saturated to 448, as the casts do; +Inf too)."""
    codes = torch.arange(0, 127, dtype=torch.uint8)  # +0 .. 448 (0x7E); 0x7F is NaN
    grid = codes.view(torch.float8_e4m3fn).float()
    mid = (grid[:-1] + grid[1:]) / 2
    beside = torch.cat([mid * (1 - 2**-20), mid * (1 + 2**-20)])
    gen = torch.Generator().manual_seed(0)
    rand = torch.exp2(torch.rand(4096, generator=gen) * 21 - 12).clamp(max=448)
    above = torch.tensor([464.0, 480.0, 1e4, 65536.0, 2.0**100, float("inf")])
    x = torch.cat([grid, mid, beside, rand, above]).to(device)
    out = torch.empty_like(x)
    _e4m3_value_kernel[(triton.cdiv(x.numel(), 256),)](x, out, x.numel(), BLOCK=256)
    want = x.clamp(max=448).to(torch.float8_e4m3fn).float()
    assert torch.equal(out.view(torch.int32), want.view(torch.int32))


@triton.jit
def _e2m1_kernel(x_ptr, code_ptr, value_ptr, round_ptr, decode_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + offs, mask=offs < n, other=0.0)
    code, value = e2m1_quantize(x)
    tl.store(code_ptr + offs, code, mask=offs < n)
    tl.store(value_ptr + offs, value, mask=offs < n)
    tl.store(round_ptr + offs, e2m1_round(tl.abs(x)), mask=offs < n)
    tl.store(decode_ptr + offs, e2m1_decode(code), mask=offs < n)


def test_e2m1_quantize_is_the_threshold_rule(device) -> None:
    """The kernels' E2M1 quantization (rounding by bits) against ``numerics.e2m1_encode``'s
    thresholds, code for code: every E2M1 value, every midpoint (ties to the even code) and
    its float32 neighbours a few ulps away, signed zeros, random values in [-6, 6], NaN; and
    ``e2m1_round``'s magnitude is the decoded code's bit for bit, and the value
    ``e2m1_quantize`` returns beside the code, and the kernels' ``e2m1_decode`` of it, are
    the twin's decoded code bit for bit (0x8, a negative that rounds to zero, is -0.0)."""
    grid = torch.tensor(formats.E2M1_VALUES, dtype=torch.float32)
    mid = (grid[:-1] + grid[1:]) / 2
    near = [torch.nextafter(mid, torch.full_like(mid, sign * 7.0)) for sign in (1, -1)]
    for _ in range(3):
        near += [torch.nextafter(x, torch.full_like(x, sign * 7.0)) for x, sign in
                 zip(near[-2:], (1, -1), strict=True)]  # fmt: skip
    gen = torch.Generator().manual_seed(1)
    rand = torch.rand(8192, generator=gen) * 6.0
    tiny = torch.exp2(-torch.rand(256, generator=gen) * 140)  # down to float32 subnormals
    mags = torch.cat([grid, mid, *near, rand, tiny, torch.tensor([6.0, 0.0])])
    x = torch.cat([mags, -mags, torch.tensor([float("nan")])]).to(device)
    n = x.numel()
    code = torch.empty(n, dtype=torch.uint8, device=device)
    value, rounded, decoded = torch.empty_like(x), torch.empty_like(x), torch.empty_like(x)
    _e2m1_kernel[(triton.cdiv(n, 256),)](x, code, value, rounded, decoded, n, BLOCK=256)
    want = formats.e2m1_encode(x.cpu())
    assert torch.equal(code.cpu(), want)
    finite = ~x.isnan().cpu()  # (NaN: code 0 as the thresholds give; its rounding is NaN)
    assert torch.equal(rounded.cpu()[finite], formats.e2m1_decode(want & 7)[finite])
    bits = formats.e2m1_decode(want).view(torch.int32)
    assert bool((want == 8).any())  # negative zero codes are there
    assert torch.equal(value.cpu().view(torch.int32)[finite], bits[finite])
    assert torch.equal(decoded.cpu().view(torch.int32), bits)


def test_host_cdiv_and_next_power_of_2_are_tritons() -> None:
    """The host helpers give Triton's values (they replace its constexpr functions, whose
    wrappers cost host time) for every size the launchers pass."""
    for a in range(0, 600):
        for b in (1, 2, 3, 16, 32, 64, 128):
            assert cdiv(a, b) == triton.cdiv(a, b), (a, b)
    for n in range(1, 2100):
        assert next_power_of_2(n) == triton.next_power_of_2(n), n
    assert next_power_of_2(0) == 1
