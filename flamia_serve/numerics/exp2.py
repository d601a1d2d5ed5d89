"""Serving exponentials (DESIGN N9) and the quantized probabilities they produce.

A serving kernel turns ``t = y − M <= 0`` (base-2 logit minus the integer row reference)
into a quantized probability ``P̂`` for the ``P·V`` product and a normaliser term:

* ``P`` format: E4M3 holding ``2^(t + P_HAT_EXP)`` (FP8 and NVFP4 caches, as training N5)
  or the 16-bit type holding ``2^t`` (BF16 / FP16 caches).
* ``exact`` — ``p = 2^t``; P̂ = RNE(p) in the P format; normaliser term ``p`` (unquantized,
  as N3).
* ``schraudolph`` — ``p`` = float32 whose bits are ``trunc((t + 127)·2^23) − C``: the
  exponent field takes t's integer part and the mantissa is linear in the fraction
  (``2^f ≈ 1 + f − σ``, ``C = σ·2^23`` with σ = ``SCHRAUDOLPH_SIGMA`` balancing the
  relative error); then as ``exact`` ("Direct-P" with a cheap exponential).
* ``mitchell`` — Mitchell-P: the P-format code itself is ``RNE(t'·2^m) + bias·2^m`` (t' =
  t + shift, m mantissa bits): integer part → exponent field, fraction → mantissa, one
  rounding, no exponential and no float→P conversion. Codes under the smallest normal are
  flushed to 0. The normaliser term is the code's own value (no unquantized p exists).

Training never uses the approximate modes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from flamia_serve.numerics.formats import P_HAT_EXP

ExpMode = Literal["exact", "schraudolph", "mitchell"]
EXP_MODES: tuple[ExpMode, ...] = ("exact", "schraudolph", "mitchell")
SCHRAUDOLPH_SIGMA = 0.0497
SCHRAUDOLPH_C = round(SCHRAUDOLPH_SIGMA * 2**23)
#: 1.5·2^23 and its float32 bits: adding it to |x| < 2^22 rounds x to an integer (RNE) held in
#: the sum's low mantissa bits, which kernels read with integer operations instead of a
#: float→int conversion (Mitchell-P's code)
RNE_MAGIC = 12582912.0
RNE_MAGIC_BITS = 0x4B400000


@dataclass(frozen=True)
class PFormat:
    """Format of P̂: mantissa bits, exponent bias, the power-of-two shift it carries and its
    torch dtype."""

    mant_bits: int
    bias: int
    shift: int
    dtype: torch.dtype


P_E4M3 = PFormat(3, 7, P_HAT_EXP, torch.float8_e4m3fn)
P_BF16 = PFormat(7, 127, 0, torch.bfloat16)
P_FP16 = PFormat(10, 15, 0, torch.float16)


def check_exp_mode(exp_mode: object) -> ExpMode:
    if exp_mode not in EXP_MODES:
        raise ValueError(f"exp_mode must be one of {EXP_MODES}, got {exp_mode!r}")
    return exp_mode  # type: ignore[return-value]


def schraudolph_exp2(t: torch.Tensor) -> torch.Tensor:
    """Schraudolph ``2^t`` for float32 ``t <= 0`` (0 below ~2^-127)."""
    u = (t.float() + 127.0) * float(2**23)
    u = torch.where(u > 0, u, torch.zeros_like(u))  # also maps -inf / NaN-free masked logits
    bits = (u.to(torch.int32) - SCHRAUDOLPH_C).clamp(min=0)
    return bits.view(torch.float32)


def mitchell_codes(t: torch.Tensor, fmt: PFormat) -> torch.Tensor:
    """Mitchell-P: int32 bit pattern of the P-format code of ``2^(t + shift)`` (0 = flushed)."""
    scaled = (t.float() + float(fmt.shift)).clamp(min=-256.0) * float(2**fmt.mant_bits)
    code = torch.round(scaled).to(torch.int32) + (fmt.bias << fmt.mant_bits)
    return torch.where(code >= (1 << fmt.mant_bits), code, torch.zeros_like(code))


def mitchell_value(code: torch.Tensor, fmt: PFormat) -> torch.Tensor:
    """float32 value of normal (or zero) P-format codes from :func:`mitchell_codes`."""
    bits = (code + ((127 - fmt.bias) << fmt.mant_bits)) << (23 - fmt.mant_bits)
    return torch.where(code > 0, bits, torch.zeros_like(bits)).view(torch.float32)


def probabilities(
    t: torch.Tensor, exp_mode: ExpMode, fmt: PFormat
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(P̂, p)`` for ``t = y − M`` (float32, ``-inf`` where masked): P̂ as float32 values of
    the P format (carrying ``2^shift``), ``p`` the normaliser term (without the shift): P̂
    itself for Mitchell-P and for E4M3 P̂ (as the training forward, DESIGN N3), the
    unrounded exponential for 16-bit P (whose rounding is 2^-9 or finer)."""
    if exp_mode == "mitchell":
        p_hat = mitchell_value(mitchell_codes(t, fmt), fmt)
        return p_hat, p_hat * 2.0**-fmt.shift
    p = torch.exp2(t.float()) if exp_mode == "exact" else schraudolph_exp2(t)
    p_hat = (p * 2.0**fmt.shift).to(fmt.dtype).float()
    if fmt.dtype == torch.float8_e4m3fn:  # the normaliser sums the E4M3 P̂ (DESIGN N3)
        return p_hat, p_hat * 2.0**-fmt.shift
    return p_hat, p
