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
    e4m3_next_down,
    hadamard,
    nvfp4_block_scale,
    nvfp4_group_scale,
    pack_e2m1,
    pow2_exponent_ceil,
    unpack_e2m1,
)
from flamia_serve.numerics.formats import E2M1_VALUES, NVFP4_ERROR_BITS, NVFP4_ERROR_CAP

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


def test_e4m3_next_down_is_the_previous_grid_value() -> None:
    grid = E4M3_GRID[E4M3_GRID > 0]
    below = e4m3_next_down(grid)
    assert torch.equal(below[1:], grid[:-1])
    assert float(below[0]) == 2.0**-9  # the smallest subnormal maps to itself


def _integer_error(group: list[float], scale: float, e0: int) -> int:
    """The rule of ``nvfp4_group_scale`` written out in Python, element by element."""
    total = 0
    for x in group:
        ratio = max(-6.0, min(6.0, x / scale)) if scale > 0 else 0.0
        code = int(e2m1_encode(torch.tensor([ratio]))[0])
        value = float(e2m1_decode(torch.tensor([code], dtype=torch.uint8))[0]) * scale
        units = abs(value - x) * 2.0 ** (NVFP4_ERROR_BITS - e0)
        total += int(min(units, NVFP4_ERROR_CAP)) ** 2
    return total


def test_nvfp4_group_scale_hand_case() -> None:
    """Sixteen 5.0s: the round-up scale 0.875 codes them as 6 x 0.875 = 5.25; one E4M3 step
    down, 0.8125, clamps them to 6 x 0.8125 = 4.875 (error 0.125 against 0.25): it wins;
    0.75 (4.5) does not."""
    g = torch.full((1, 16), 5.0)
    assert float(nvfp4_group_scale(g, 1)) == 0.875
    assert float(nvfp4_group_scale(g, 3)) == 0.8125
    assert float(nvfp4_group_scale(torch.zeros(1, 16), 3)) == 0.0


def test_nvfp4_group_scale_takes_the_least_error_earliest_on_ties() -> None:
    gen = torch.Generator().manual_seed(3)
    groups = torch.randn(300, 16, generator=gen) * torch.exp(torch.randn(300, 1, generator=gen) * 3)
    groups[:5] = groups[:5].sign() * 2.0 ** torch.randint(-12, 8, (5, 16), generator=gen).float()
    groups[5, :8] = 0.0
    round_up = nvfp4_block_scale(groups.abs().amax(-1))
    assert torch.equal(nvfp4_group_scale(groups, 1), round_up)
    for candidates in (2, 3, 5):
        chosen = nvfp4_group_scale(groups, candidates)
        for g, c0, c in zip(groups.tolist(), round_up.tolist(), chosen.tolist(), strict=True):
            e0 = math.frexp(c0)[1] - 1
            scales, s = [], c0
            for _ in range(candidates):
                scales.append(s)
                s = float(e4m3_next_down(torch.tensor(s)))
            errors = [_integer_error(g, x, e0) for x in scales]
            assert c == scales[errors.index(min(errors))]


def test_nvfp4_group_scale_lowers_the_error_of_normal_data() -> None:
    x = torch.randn(4096, 16, generator=torch.Generator().manual_seed(0))

    def rel(candidates: int) -> float:
        scale = nvfp4_group_scale(x, candidates)[:, None]
        values = e2m1_decode(e2m1_encode((x / scale).clamp(-6, 6))) * scale
        return float((values - x).norm() / x.norm())

    one, three = rel(1), rel(3)
    assert one > 0.095 and three < 0.089, (one, three)
    with pytest.raises(ValueError, match="candidates"):
        nvfp4_group_scale(x, 0)
