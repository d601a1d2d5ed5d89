"""Element codecs: E4M3, E2M1, power-of-two exponents, E4M3 round-up, Hadamard.

Every rule here is written with float32 bit operations and exact comparisons only (no
float division, no log2), so a Triton kernel can repeat it instruction for instruction and
match bit for bit. A *scale exponent* ``e`` is an int8 in ``[EXP_MIN, EXP_MAX]`` and means
the factor ``2**e`` (the range of ``torch.float8_e8m0fnu``).
"""

from __future__ import annotations

import functools
import math

import torch

E4M3_MAX = 448.0
E2M1_MAX = 6.0
#: NVFP4 two-level maximum: largest E2M1 code times largest E4M3 block scale.
NVFP4_MAX = E2M1_MAX * E4M3_MAX
#: P̂ holds E4M3(P' * 2**P_HAT_EXP): the largest shift that keeps P̂ <= 448 for P' <= 1. It
#: moves E4M3's subnormal range to below 2^-14 of the row maximum, so a kernel quantizing
#: against a (smaller, integer) running maximum agrees with the final-maximum rule except on
#: probabilities under 2^-14, and fewer small probabilities round to zero (DESIGN N5 (b)).
P_HAT_EXP = 8
EXP_MIN = -127
EXP_MAX = 127
#: E2M1 magnitudes indexed by the 3-bit code.
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)

_MANT_MASK = 0x7FFFFF
_EXP_BIAS = 127


def _exponent_and_mantissa(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Unbiased float32 exponent field (−127 for zero/subnormal) and 23-bit mantissa."""
    bits = x.float().contiguous().view(torch.int32)
    return ((bits >> 23) & 0xFF) - _EXP_BIAS, bits & _MANT_MASK


def _split_constant(fmax: float) -> tuple[int, int]:
    m, k = math.frexp(fmax)  # fmax = m * 2**k, m in [0.5, 1)
    mant = round((2 * m - 1) * 2**23)
    return k - 1, mant


def pow2_exponent_ceil(amax: torch.Tensor, fmax: float) -> torch.Tensor:
    """Smallest ``e`` with ``amax <= fmax * 2**e`` (N1), clamped to [EXP_MIN, EXP_MAX], int8.

    Exact: compares exponent and mantissa fields, so no element scaled by ``2**-e`` can
    exceed ``fmax``. All-zero (and float32-subnormal) groups get ``EXP_MIN``.
    """
    ea, ma = _exponent_and_mantissa(amax)
    ef, mf = _split_constant(fmax)
    e = ea - ef + (ma > mf).to(torch.int32)
    e = torch.where(ea == -_EXP_BIAS, torch.full_like(e, EXP_MIN), e)
    return e.clamp(EXP_MIN, EXP_MAX).to(torch.int8)


def exp2i(e: torch.Tensor) -> torch.Tensor:
    """``2**e`` as float32 for an integer exponent tensor in [-149, 127] (exact)."""
    return torch.ldexp(torch.ones_like(e, dtype=torch.float32), e.to(torch.int32))


def e4m3_encode(x: torch.Tensor) -> torch.Tensor:
    """Round-to-nearest-even cast to ``float8_e4m3fn`` of |x| <= 448; ±Inf saturates to ±448
    and NaN stays NaN on every device (torch's own cast of Inf differs between CPU and CUDA;
    the GPU kernels' cast saturates)."""
    return x.float().clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)


def e4m3_ceil(y: torch.Tensor) -> torch.Tensor:
    """Smallest E4M3 value >= y for 0 <= y <= 448, as float32 (exact)."""
    ey, _ = _exponent_and_mantissa(y)
    step = exp2i(ey.clamp(min=-6) - 3)
    return torch.ceil(y.float() / step) * step


def _e4m3_next_up(c: torch.Tensor) -> torch.Tensor:
    ec, _ = _exponent_and_mantissa(c)
    return c + exp2i(ec.clamp(min=-6) - 3)


def e4m3_next_down(c: torch.Tensor) -> torch.Tensor:
    """Largest E4M3 value below ``c`` (E4M3 values in [2^-9, 448], float32, exact), never
    below the smallest subnormal 2^-9 (which maps to itself)."""
    ec, mc = _exponent_and_mantissa(c)
    step = exp2i(ec.clamp(min=-6) - 3)
    # below a power of two in the normal range the spacing halves
    step = torch.where((mc == 0) & (ec > -6), step * 0.5, step)
    return torch.clamp(c.float() - step, min=2.0**-9)


def nvfp4_block_scale(amax16: torch.Tensor) -> torch.Tensor:
    """E4M3 block scale for an NVFP4 group of 16: smallest E4M3 ``c`` with ``6*c >= amax16``.

    ``amax16`` is float32, already divided by the group's power-of-two second level, and
    <= 2688. Computed as round-up of ``amax16 * (1/6)`` nudged low, then one exact check
    (``6*c`` is exact: c has 4 significant bits), so the result never lets a code clamp.
    """
    t = amax16.float()
    low = e4m3_ceil(t * (1.0 / 6.0) * (1.0 - 2.0**-20))
    return torch.where(6.0 * low >= t, low, _e4m3_next_up(low))


#: the squared-error units of :func:`nvfp4_group_scale`: 2^-7 of the round-up scale's power
#: of two, each element's error capped at 2^12 units so a group's sum stays below 2^31
NVFP4_ERROR_BITS = 7
NVFP4_ERROR_CAP = 4096


def nvfp4_group_scale(groups: torch.Tensor, candidates: int = 1) -> torch.Tensor:
    """E4M3 block scale of each NVFP4 group of 16, ``groups`` ``[..., G, 16]`` float32 (already
    divided by the group's power-of-two second level; |values| <= 2688 unless saturating).

    Candidate 0 is :func:`nvfp4_block_scale` of the group's maximum (round-up: no code clamps);
    candidate ``i`` is :func:`e4m3_next_down` of candidate ``i - 1``. The group takes the
    candidate whose codes (``e2m1_encode`` of value / scale, clamped to ±6) have the smallest
    squared error, the earliest on a tie. The error is an exact integer, so every
    implementation ranks the same way whatever its summation order: each element's
    ``|scale·E2M1 − value|`` in units of ``2^(E0 − NVFP4_ERROR_BITS)`` (E0: candidate 0's
    power-of-two exponent), truncated to an integer and capped at ``NVFP4_ERROR_CAP`` (NaN
    too), squared and summed in int32. All-zero groups keep scale 0."""
    if candidates < 1:
        raise ValueError(f"candidates must be >= 1, got {candidates}")
    groups = groups.float()
    scale = nvfp4_block_scale(groups.abs().amax(dim=-1))
    if candidates == 1:
        return scale
    e0, _ = _exponent_and_mantissa(scale)
    unit = exp2i((NVFP4_ERROR_BITS - e0).clamp(max=127))[..., None]
    best, best_err, c = scale, None, scale
    for _ in range(candidates):
        values = e2m1_decode(e2m1_encode(e2m1_ratio(groups, c))) * c[..., None]
        units = (values - groups).abs() * unit
        cap = torch.full_like(units, NVFP4_ERROR_CAP)
        capped = torch.where(units < NVFP4_ERROR_CAP, units, cap)
        err = (capped.to(torch.int32) ** 2).sum(dim=-1, dtype=torch.int32)
        if best_err is None:
            best_err = err
        else:
            better = err < best_err
            best, best_err = torch.where(better, c, best), torch.where(better, err, best_err)
        c = torch.where(c > 0, e4m3_next_down(c), c)
    return best


def e2m1_ratio(groups: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``groups / scale`` clamped to ±6 (IEEE division, as the kernels' ``div_rn``); 0 where
    the scale is 0."""
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))[..., None]
    ratio = torch.where(scale[..., None] > 0, groups / safe, torch.zeros_like(groups))
    return ratio.clamp(-E2M1_MAX, E2M1_MAX)


def e2m1_encode(x: torch.Tensor) -> torch.Tensor:
    """Round-to-nearest-even E2M1 code (uint8 in [0, 15], bit 3 = sign); |x| must be <= 6."""
    x = x.float()
    v = x.abs()
    code = (
        (v > 0.25).to(torch.uint8)
        + (v >= 0.75).to(torch.uint8)
        + (v > 1.25).to(torch.uint8)
        + (v >= 1.75).to(torch.uint8)
        + (v > 2.5).to(torch.uint8)
        + (v >= 3.5).to(torch.uint8)
        + (v > 5.0).to(torch.uint8)
    )
    return code | ((x < 0).to(torch.uint8) << 3)


def e2m1_decode(code: torch.Tensor) -> torch.Tensor:
    """float32 value of E2M1 codes (uint8 in [0, 15])."""
    table = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=code.device)
    mag = table[(code & 7).long()]
    return torch.where((code & 8) != 0, -mag, mag)


def pack_e2m1(code: torch.Tensor) -> torch.Tensor:
    """Pack codes ``[..., n]`` (n even) into uint8 ``[..., n/2]``: low nibble = even element."""
    return (code[..., 0::2] | (code[..., 1::2] << 4)).contiguous()


def unpack_e2m1(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`pack_e2m1`: uint8 ``[..., n/2]`` -> codes ``[..., n]``."""
    low, high = packed & 0xF, packed >> 4
    return torch.stack((low, high), dim=-1).flatten(-2)


def hadamard_transform(x: torch.Tensor) -> torch.Tensor:
    """Unnormalized fast Walsh–Hadamard transform over the last dim (a power of two), float32.

    Butterfly stages of distance 1, 2, 4, … (``a + b``, ``a − b``) in float32: a kernel that
    runs the same stages in the same order matches bit for bit. Equals ``x @ (hadamard(d) *
    sqrt(d))``; rotating both Q and K multiplies their scores by exactly ``d``.
    """
    d = x.shape[-1]
    if d < 1 or d & (d - 1):
        raise ValueError(f"hadamard_transform: last dim must be a power of two, got {d}")
    lead = x.shape[:-1]
    y = x.float()
    dist = 1
    while dist < d:
        pairs = y.reshape(*lead, d // (2 * dist), 2, dist)
        a, b = pairs[..., 0, :], pairs[..., 1, :]
        y = torch.stack((a + b, a - b), dim=-2).reshape(*lead, d)
        dist *= 2
    return y


@functools.cache
def _hadamard_cpu(d: int) -> torch.Tensor:
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < d:
        h = torch.cat((torch.cat((h, h), 1), torch.cat((h, -h), 1)), 0)
    return h / math.sqrt(d)


def hadamard(d: int, *, device: torch.device | str = "cpu") -> torch.Tensor:
    """Orthonormal Sylvester–Hadamard matrix ``[d, d]`` (float32) for d a power of two.

    Rotating Q and K by the same matrix leaves ``Q @ K.T`` unchanged in exact arithmetic.
    """
    if d < 1 or d & (d - 1):
        raise ValueError(f"hadamard: d must be a power of two, got {d}")
    return _hadamard_cpu(d).float().to(device)
