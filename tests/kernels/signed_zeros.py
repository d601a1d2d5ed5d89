"""Inputs holding -0.0 and negatives that round to zero, for the kernel-vs-twin byte tests."""

from __future__ import annotations

import torch


def with_signed_zeros(x: torch.Tensor) -> torch.Tensor:
    """A copy of ``x`` ``[T, H, d]`` (T >= 4, d >= 32) with: -0.0 at every third element of
    token 0; token 1 all -0.0 (an all-zero scale group); every fourth element of token 2 a
    negative ~2^-20 of the token's maximum (zero in E4M3 under any exponent the token can
    get, and in E2M1 under its group's block scale); token 3's first 16 elements -0.0 (an
    all-zero NVFP4 group in a nonzero token)."""
    y = x.clone()
    y[0, :, ::3] = -0.0
    y[1] = -0.0
    tiny = y[2].float().abs().amax(-1, keepdim=True) * 2.0**-20
    y[2, :, 1::4] = (-tiny).to(y.dtype).expand_as(y[2, :, 1::4])
    y[3, :, :16] = -0.0
    return y


def negative_zero_bytes(codes: torch.Tensor, zero: int = 0x80) -> int:
    """How many bytes of ``codes`` (any 1-byte dtype) are ``zero`` (E4M3's negative zero)."""
    return int((codes.contiguous().view(torch.uint8) == zero).sum())
