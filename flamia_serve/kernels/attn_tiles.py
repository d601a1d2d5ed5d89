"""Tile loaders shared by the attention kernels (forward and backward): score operands
(E4M3 codes, or NVFP4 widened exactly to BF16) of a run of tokens of one head."""

from __future__ import annotations

import triton
import triton.language as tl

from flamia_serve.kernels._common import bf16_operand, nvfp4_values


@triton.jit
def load_nvfp4_tile(
    codes_ptr, scale_ptr, row0, offs, row_ok, H: tl.constexpr, h, D: tl.constexpr,
    ROWS: tl.constexpr, INTERPRET: tl.constexpr,
):  # fmt: skip
    """Dequantize the NVFP4 ``[ROWS, D]`` tile of tokens ``row0 + offs`` to BF16 (exact: <= 6
    significant bits), without its per-token power of two (float32 under the interpreter,
    whose BF16 dot is broken)."""
    half = tl.arange(0, D // 2)
    groups = tl.arange(0, D // 16)
    first = row0.to(tl.int64) * H + h
    codes = codes_ptr + first * (D // 2) + offs[:, None] * (H * D // 2) + half[None, :]
    packed = tl.load(codes, mask=row_ok[:, None], other=0)
    scales = scale_ptr.to(tl.pointer_type(tl.uint8)) + first * (D // 16)
    scales += offs[:, None] * (H * D // 16) + groups[None, :]
    scale = tl.load(scales, mask=row_ok[:, None], other=0).to(tl.float8e4nv, bitcast=True)
    return bf16_operand(nvfp4_values(packed, scale.to(tl.float32), ROWS, D), INTERPRET)


@triton.jit
def load_qk_tile(
    x8_ptr, x4_ptr, x4_scale_ptr, row0, offs, row_ok, H: tl.constexpr, h, D: tl.constexpr,
    ROWS: tl.constexpr, QK_NVFP4: tl.constexpr, INTERPRET: tl.constexpr,
):  # fmt: skip
    """Score operand tile of tokens ``row0 + offs`` (``offs`` int32 ``[ROWS]``, small): E4M3
    codes, or NVFP4 dequantized to BF16 (without its exponents). One 64-bit base per tile
    and 32-bit offsets keep the address registers few."""
    if QK_NVFP4:
        tile = load_nvfp4_tile(
            x4_ptr, x4_scale_ptr, row0, offs, row_ok, H, h, D, ROWS, INTERPRET
        )
    else:
        cols = tl.arange(0, D)
        base = x8_ptr + (row0.to(tl.int64) * H + h) * D
        tile = tl.load(
            base + offs[:, None] * (H * D) + cols[None, :], mask=row_ok[:, None], other=0.0
        )
    return tile
