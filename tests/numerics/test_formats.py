"""Codecs and scale rules against brute force over every representable value."""

from __future__ import annotations

import math

import pytest
import torch

from flamia_serve.numerics import (
    EXP_MIN,
    e2m1_decode,
    e2m1_encode,
    e4m3_ceil,
    hadamard,
    nvfp4_block_scale,
    pack_e2m1,
    pow2_exponent_ceil,
    unpack_e2m1,
)
from flamia_serve.numerics.formats import E2M1_VALUES

ALL_E4M3 = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
E4M3_GRID = torch.unique(ALL_E4M3[torch.isfinite(ALL_E4M3) & (ALL_E4M3 >= 0)])


@pytest.mark.parametrize(
    ("amax", "fmax", "expected"),
    [
        (448.0, 448.0, 0),
        (448.00003, 448.0, 1),
        (224.0, 448.0, -1),
        (224.00002, 448.0, 0),
        (1.0, 448.0, -8),
        (0.0, 448.0, EXP_MIN),
        (1e-40, 448.0, EXP_MIN),
        (3.0e38, 448.0, 120),
        (2688.0, 2688.0, 0),
        (2688.001, 2688.0, 1),
        (6.0, 2688.0, -8),
    ],
)
def test_pow2_exponent_ceil_hand_cases(amax: float, fmax: float, expected: int) -> None:
    e = pow2_exponent_ceil(torch.tensor([amax]), fmax)
    assert e.dtype == torch.int8
    assert int(e) == expected


def test_pow2_exponent_ceil_is_smallest_that_fits() -> None:
    amax = torch.exp(torch.empty(20000).uniform_(-60, 60))
    e = pow2_exponent_ceil(amax, 448.0).double()
    amax64 = amax.double()
    assert bool((amax64 <= 448.0 * torch.exp2(e)).all())
    assert bool((amax64 > 448.0 * torch.exp2(e - 1)).all())


def test_e4m3_ceil_matches_brute_force() -> None:
    y = torch.cat([E4M3_GRID, torch.rand(5000) * 448, torch.rand(2000) * 0.02])
    got = e4m3_ceil(y)
    idx = torch.searchsorted(E4M3_GRID, y, right=False)
    assert torch.equal(got, E4M3_GRID[idx])


def test_nvfp4_block_scale_is_smallest_e4m3_covering_amax() -> None:
    t = torch.cat([6.0 * E4M3_GRID, torch.rand(20000) * 2688, torch.rand(2000) * 0.05])
    t = torch.nextafter(t, torch.tensor(0.0)).clamp(min=0)  # just below grid multiples too
    t = torch.cat([t, 6.0 * E4M3_GRID, torch.nextafter(6.0 * E4M3_GRID, torch.tensor(3000.0))])
    t = t[t <= 2688]
    got = nvfp4_block_scale(t)
    ok = 6.0 * E4M3_GRID[None, :] >= t[:, None]
    expected = E4M3_GRID[ok.float().argmax(dim=1)]
    assert torch.equal(got, expected)


def test_e2m1_encode_round_to_nearest_even() -> None:
    grid = torch.tensor(E2M1_VALUES)
    x = torch.cat([torch.linspace(-6, 6, 4801), (grid[:-1] + grid[1:]) / 2])
    codes = e2m1_encode(x)
    dec = e2m1_decode(codes)
    err = (dec - x).abs()
    best = (grid[None, :] - x.abs()[:, None]).abs().min(dim=1).values
    assert torch.equal(err, best)
    # ties go to the even code (mantissa bit 0)
    mids = (grid[:-1] + grid[1:]) / 2
    assert bool(((e2m1_encode(mids) & 1) == 0).all())
    assert torch.equal(e2m1_decode(e2m1_encode(grid)), grid)
    assert int(e2m1_encode(torch.tensor([-1.5]))) == 0b1011


def test_e2m1_pack_roundtrip_low_nibble_even() -> None:
    codes = torch.randint(0, 16, (3, 5, 32), dtype=torch.uint8)
    packed = pack_e2m1(codes)
    assert packed.shape == (3, 5, 16)
    assert torch.equal(packed[..., 0] & 0xF, codes[..., 0])
    assert torch.equal(unpack_e2m1(packed), codes)


@pytest.mark.parametrize("d", [64, 128, 256])
def test_hadamard_orthonormal_keeps_scores(d: int) -> None:
    h = hadamard(d).double()
    assert torch.allclose(h @ h.t(), torch.eye(d, dtype=torch.float64), atol=1e-12)
    assert float(h.abs().max()) == pytest.approx(1 / math.sqrt(d))
    q, k = torch.randn(7, d, dtype=torch.float64), torch.randn(9, d, dtype=torch.float64)
    assert torch.allclose((q @ h) @ (k @ h).t(), q @ k.t(), atol=1e-10)


def test_hadamard_rejects_non_power_of_two() -> None:
    with pytest.raises(ValueError, match="power of two"):
        hadamard(96)
