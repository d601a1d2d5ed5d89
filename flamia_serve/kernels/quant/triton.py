"""Fused Q/K/V quantization kernel: one launch writes every code, scale and layout.

Twin: ``flamia_serve.reference.quantize_qkv`` (itself built on ``numerics.scales``).
"""

from __future__ import annotations

import triton
import triton.language as tl

from flamia_serve.kernels._common import (
    e2m1_encode,
    exp2i,
    nvfp4_block_scale,
    pow2_exponent_ceil,
    to_e4m3,
)

# ceil(log2(amax / FMAX)) constants: FMAX = (1 + MANT / 2**23) * 2**EXP
E4M3_EXP = tl.constexpr(8)  # 448 = 1.75 * 2**8
E4M3_MANT = tl.constexpr(0x600000)
NVFP4_EXP = tl.constexpr(11)  # 2688 = 6 * 448 = 1.3125 * 2**11
NVFP4_MANT = tl.constexpr(0x280000)


@triton.jit
def _fp8_rows(x, PER_TOKEN: tl.constexpr, INTERPRET: tl.constexpr):
    """E4M3 codes and int32 exponents of a ``[BLOCK, D]`` fp32 tile: one exponent per row
    (PER_TOKEN) or one for the whole tile (token block)."""
    amax = tl.max(tl.abs(x), axis=1)
    if not PER_TOKEN:
        amax = tl.zeros_like(amax) + tl.max(amax, axis=0)
    e = pow2_exponent_ceil(amax, E4M3_EXP, E4M3_MANT)
    codes = to_e4m3(x * exp2i(-e)[:, None], INTERPRET)
    return codes, e


@triton.jit
def _hadamard_rows(x, BLOCK: tl.constexpr, D: tl.constexpr, LOG2_D: tl.constexpr):
    """Unnormalized Walsh–Hadamard transform of each row (numerics.hadamard_transform)."""
    for i in tl.static_range(LOG2_D):
        # pairs at distance 2**i: [BLOCK, D / 2**(i+1), 2, 2**i]
        y = tl.reshape(x, (BLOCK, D // (2 << i), 2, 1 << i))
        y = tl.permute(y, (0, 1, 3, 2))
        a, b = tl.split(y)
        y = tl.permute(tl.join(a + b, a - b), (0, 1, 3, 2))
        x = tl.reshape(y, (BLOCK, D))
    return x


@triton.jit
def _nvfp4_rows(x, BLOCK: tl.constexpr, D: tl.constexpr):
    """NVFP4 of a ``[BLOCK, D]`` fp32 tile: packed codes ``[BLOCK, D/2]`` uint8, E4M3 block
    scales ``[BLOCK, D/16]`` (float32 values) and per-row int32 exponents."""
    x16 = tl.reshape(x, (BLOCK, D // 16, 16))
    amax16 = tl.max(tl.abs(x16), axis=2)
    e = pow2_exponent_ceil(tl.max(amax16, axis=1), NVFP4_EXP, NVFP4_MANT)
    p2 = exp2i(-e)
    scale = nvfp4_block_scale(tl.minimum(amax16 * p2[:, None], 2688.0))
    safe = tl.where(scale > 0, scale, 1.0)
    ratio = tl.math.div_rn(x16 * p2[:, None, None], safe[:, :, None])
    ratio = tl.where(scale[:, :, None] > 0, ratio, 0.0)
    codes = e2m1_encode(tl.minimum(tl.maximum(ratio, -6.0), 6.0))
    low, high = tl.split(tl.reshape(codes, (BLOCK, D // 2, 2)))
    return low | (high << 4), scale, e


@triton.jit
def _quantize_qk_head(
    x_ptr, stride_t, stride_h, h, tok, row_ok, out8, out_exp, out4, out4_scale, out4_exp, n_tok,
    N_HEADS: tl.constexpr, D: tl.constexpr, BLOCK: tl.constexpr, PER_TOKEN: tl.constexpr,
    QK_NVFP4: tl.constexpr, HADAMARD: tl.constexpr, LOG2_D: tl.constexpr,
    INTERPRET: tl.constexpr,
):  # fmt: skip
    """One block of one Q or K head: E4M3 codes + exponents, and NVFP4 when asked."""
    cols = tl.arange(0, D)
    x_ptrs = x_ptr + tok[:, None] * stride_t + h * stride_h + cols[None, :]
    x = tl.load(x_ptrs, mask=row_ok[:, None], other=0.0).to(tl.float32)
    codes, e = _fp8_rows(x, PER_TOKEN, INTERPRET)
    row_off = tok * N_HEADS + h
    tl.store(out8 + row_off[:, None] * D + cols[None, :], codes, mask=row_ok[:, None])
    tl.store(out_exp + h * n_tok + tok, e.to(tl.int8), mask=row_ok)
    if QK_NVFP4:
        if HADAMARD:
            x = _hadamard_rows(x, BLOCK, D, LOG2_D)
        packed, scale, e4 = _nvfp4_rows(x, BLOCK, D)
        half = tl.arange(0, D // 2)
        groups = tl.arange(0, D // 16)
        tl.store(out4 + row_off[:, None] * (D // 2) + half[None, :], packed, mask=row_ok[:, None])
        scale_ptrs = out4_scale + row_off[:, None] * (D // 16) + groups[None, :]
        tl.store(scale_ptrs, to_e4m3(scale, INTERPRET), mask=row_ok[:, None])
        tl.store(out4_exp + h * n_tok + tok, e4.to(tl.int8), mask=row_ok)


@triton.jit
def quantize_qkv_kernel(
    q_ptr,  # [T, HQ, D] bf16/fp16, strides (stride_qt, stride_qh, 1)
    k_ptr,  # [T, HKV, D]
    v_ptr,  # [T, HKV, D]
    block_start_ptr,  # [NB] int32: first token of each document-local 32-token block
    block_len_ptr,  # [NB] int32: tokens in the block (0 = unused slot)
    block_v_t_ptr,  # [NB] int32: column of the block's first key in v_t (16-aligned doc starts)
    q8_ptr,  # [T, HQ, D] e4m3
    q_exp_ptr,  # [HQ, T] int8 (head-major: contiguous loads per key tile)
    k8_ptr,  # [T, HKV, D] e4m3
    k_exp_ptr,  # [HKV, T] int8
    vt_ptr,  # [HKV, D, t_pad] e4m3: V codes, keys contiguous (K-major for P·V)
    v_exp_ptr,  # [HKV, T] int8
    q4_ptr,  # [T, HQ, D/2] uint8 (QK_NVFP4 only)
    q4_scale_ptr,  # [T, HQ, D/16] e4m3
    q4_exp_ptr,  # [HQ, T] int8
    k4_ptr,  # [T, HKV, D/2] uint8
    k4_scale_ptr,  # [T, HKV, D/16] e4m3
    k4_exp_ptr,  # [HKV, T] int8
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    t_pad,
    n_tokens,
    HQ: tl.constexpr,
    HKV: tl.constexpr,
    D: tl.constexpr,
    BLOCK: tl.constexpr,
    PER_TOKEN_QK: tl.constexpr,
    QK_NVFP4: tl.constexpr,
    HADAMARD: tl.constexpr,
    LOG2_D: tl.constexpr,
    INTERPRET: tl.constexpr,
):
    """Program (block slot, head of Q|K|V): quantizes one 32-token block of one head."""
    slot = tl.program_id(0)
    head = tl.program_id(1)
    n_rows = tl.load(block_len_ptr + slot)
    if n_rows > 0:
        start = tl.load(block_start_ptr + slot).to(tl.int64)
        rows = tl.arange(0, BLOCK)
        cols = tl.arange(0, D)
        row_ok = rows < n_rows
        tok = start + rows
        if head < HQ:
            _quantize_qk_head(
                q_ptr, stride_qt, stride_qh, head, tok, row_ok, q8_ptr, q_exp_ptr,
                q4_ptr, q4_scale_ptr, q4_exp_ptr, n_tokens,
                HQ, D, BLOCK, PER_TOKEN_QK, QK_NVFP4, HADAMARD, LOG2_D, INTERPRET,
            )  # fmt: skip
        elif head < HQ + HKV:
            _quantize_qk_head(
                k_ptr, stride_kt, stride_kh, head - HQ, tok, row_ok, k8_ptr, k_exp_ptr,
                k4_ptr, k4_scale_ptr, k4_exp_ptr, n_tokens,
                HKV, D, BLOCK, PER_TOKEN_QK, QK_NVFP4, HADAMARD, LOG2_D, INTERPRET,
            )  # fmt: skip
        else:
            h = head - HQ - HKV
            x_ptrs = v_ptr + tok[:, None] * stride_vt + h * stride_vh + cols[None, :]
            x = tl.load(x_ptrs, mask=row_ok[:, None], other=0.0).to(tl.float32)
            codes, e = _fp8_rows(x, True, INTERPRET)
            col = tl.load(block_v_t_ptr + slot).to(tl.int64) + rows
            vt_ptrs = vt_ptr + (h * D + cols[:, None]).to(tl.int64) * t_pad + col[None, :]
            tl.store(vt_ptrs, tl.trans(codes), mask=row_ok[None, :])
            tl.store(v_exp_ptr + h * n_tokens + tok, e.to(tl.int8), mask=row_ok)
