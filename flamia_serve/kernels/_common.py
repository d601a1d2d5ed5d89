"""``@triton.jit`` helpers shared by kernels: the bit-level rules of ``numerics.formats``.

Each helper repeats its ``numerics`` twin operation for operation so results match bit
for bit (tests compare them).
"""

from __future__ import annotations

import os

import triton
import triton.language as tl


def interpreted() -> bool:
    """True under Triton's CPU interpreter (3.6), which needs two workarounds: its float ->
    E4M3 cast rounds wrongly (see ``to_e4m3``) and its BF16 ``tl.dot`` returns garbage."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


@triton.jit
def pow2_exponent_ceil(amax, FMAX_EXP: tl.constexpr, FMAX_MANT: tl.constexpr):
    """int32 ``ceil(log2(amax / fmax))`` clamped to [-127, 127] (numerics.pow2_exponent_ceil)."""
    bits = amax.to(tl.int32, bitcast=True)
    ea = ((bits >> 23) & 0xFF) - 127
    ma = bits & 0x7FFFFF
    e = ea - FMAX_EXP + (ma > FMAX_MANT).to(tl.int32)
    e = tl.where(ea == -127, -127, e)
    return tl.minimum(tl.maximum(e, -127), 127)


@triton.jit
def exp2i(e):
    """float32 ``2**e`` for int32 ``e`` in [-126, 127] (built from the exponent field)."""
    return ((e + 127) << 23).to(tl.float32, bitcast=True)


@triton.jit
def to_e4m3(x, INTERPRET: tl.constexpr):
    """Round-to-nearest-even cast of float32 |x| <= 448 to E4M3.

    The hardware cast (GPU) is exact RNE. Triton's CPU interpreter rounds wrongly (ties away,
    a mantissa carry is lost: 7.875 -> 4, and -0 becomes +0), so with INTERPRET the code is
    built from bits: round |x| to its E4M3 quantum 2^(max(E, -6) - 3) with the magic-number
    RNE add, then assemble sign, exponent field and mantissa.
    """
    if INTERPRET:
        e = ((x.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127
        shift = tl.maximum(e, -6) - 3
        mag = ((tl.abs(x) * exp2i(-shift) + 12582912.0) - 12582912.0) * exp2i(shift)
        mag_bits = mag.to(tl.int32, bitcast=True)
        e_mag = ((mag_bits >> 23) & 0xFF) - 127
        normal = ((e_mag + 7) << 3) | ((mag_bits >> 20) & 7)
        sub = (mag * 512.0).to(tl.int32)  # subnormal: multiples of 2^-9 below 2^-6
        code = tl.where(e_mag >= -6, normal, sub) | tl.where(x < 0, 128, 0)
        return code.to(tl.uint8).to(tl.float8e4nv, bitcast=True)
    return x.to(tl.float8e4nv)


@triton.jit
def e4m3_ceil(y):
    """Smallest E4M3 value >= y for 0 <= y <= 448 (numerics.e4m3_ceil)."""
    ey = ((y.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127
    shift = tl.maximum(ey, -6) - 3
    return tl.math.ceil(y * exp2i(-shift)) * exp2i(shift)


@triton.jit
def nvfp4_block_scale(t):
    """Smallest E4M3 ``c`` with ``6*c >= t`` (numerics.nvfp4_block_scale), float32."""
    low = e4m3_ceil(t * (1.0 / 6.0) * (1.0 - 1.0 / 1048576.0))
    el = ((low.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127
    up = low + exp2i(tl.maximum(el, -6) - 3)
    return tl.where(6.0 * low >= t, low, up)


@triton.jit
def e2m1_encode(x):
    """Round-to-nearest-even E2M1 code (uint8, bit 3 = sign) of float32 |x| <= 6."""
    v = tl.abs(x)
    code = (
        (v > 0.25).to(tl.uint8)
        + (v >= 0.75).to(tl.uint8)
        + (v > 1.25).to(tl.uint8)
        + (v >= 1.75).to(tl.uint8)
        + (v > 2.5).to(tl.uint8)
        + (v >= 3.5).to(tl.uint8)
        + (v > 5.0).to(tl.uint8)
    )
    return code | ((x < 0).to(tl.uint8) << 3)


@triton.jit
def e2m1_decode(code):
    """float32 value of E2M1 codes (uint8 in [0, 15])."""
    c = code.to(tl.int32)
    exp_field = (c >> 1) & 3
    mant = (c & 1).to(tl.float32)
    normal = (1.0 + 0.5 * mant) * exp2i(exp_field - 1)
    mag = tl.where(exp_field == 0, 0.5 * mant, normal)
    return tl.where((c & 8) != 0, -mag, mag)
