"""Fused quantization kernels: one launch writes every code, scale and layout of Q/K/V
(forward), one those of dO (backward).

Twins: ``flamia_serve.reference.quantize_qkv`` / ``quantize_do`` (built on ``numerics.scales``).
"""

from __future__ import annotations

import triton
import triton.language as tl

from flamia_serve.kernels._common import (
    exp2i,
    fp8_rows,
    hadamard_rows,
    nvfp4_rows,
    to_bf16,
    to_e4m3,
    v_row_exponents,
    v_t_key,
)
from flamia_serve.numerics.formats import P_HAT_EXP as _P_HAT_EXP
from flamia_serve.numerics.operands import V_T_ALIGN as _V_T_ALIGN

V_T_ALIGN = tl.constexpr(_V_T_ALIGN)
P_HAT_EXP = tl.constexpr(_P_HAT_EXP)


@triton.jit
def _quantize_qk_head(
    x_ptr, stride_t, stride_h, h, tok, row_ok, out8, out_exp, exp_at, out4, out4_scale, out4_exp,
    out_wide, n_tok, N_HEADS: tl.constexpr, D: tl.constexpr, BLOCK: tl.constexpr,
    PER_TOKEN: tl.constexpr, QK_NVFP4: tl.constexpr, HADAMARD: tl.constexpr,
    LOG2_D: tl.constexpr, WIDE: tl.constexpr, SCORES_ONLY: tl.constexpr,
    GRAD_INPUT: tl.constexpr, SCALE_CANDIDATES: tl.constexpr, INTERPRET: tl.constexpr,
):  # fmt: skip
    """One block of one Q or K head: E4M3 codes + exponents (stored at ``out_exp + exp_at``)
    and NVFP4 when asked (``WIDE``: also its values without the per-token power of two, BF16,
    at ``out_wide``; ``SCORES_ONLY``: only those and the second level); returns the exponents
    of the score operand (int32 per row: E4M3's, or NVFP4's second level) and the gradient
    products' operand in BF16: the E4M3 codes' values, or with ``GRAD_INPUT`` the input over
    the E4M3 exponents (``numerics.grad_operand``)."""
    cols = tl.arange(0, D)
    x_ptrs = x_ptr + tok[:, None] * stride_t + h * stride_h + cols[None, :]
    x = tl.load(x_ptrs, mask=row_ok[:, None], other=0.0).to(tl.float32)
    codes, e = fp8_rows(x, PER_TOKEN, INTERPRET)
    if GRAD_INPUT:
        grad = to_bf16(x * exp2i(-e)[:, None], INTERPRET)
    else:
        grad = codes.to(tl.float32).to(tl.bfloat16)
    row_off = tok * N_HEADS + h
    if not SCORES_ONLY:
        tl.store(out8 + row_off[:, None] * D + cols[None, :], codes, mask=row_ok[:, None])
        tl.store(out_exp + exp_at, e.to(out_exp.dtype.element_ty), mask=row_ok)
    if QK_NVFP4:
        if HADAMARD:
            x = hadamard_rows(x, BLOCK, D, LOG2_D)
        packed, scale, e4, values = nvfp4_rows(x, BLOCK, D, True, SCALE_CANDIDATES)
        if not SCORES_ONLY:
            half = tl.arange(0, D // 2)
            groups = tl.arange(0, D // 16)
            codes4 = out4 + row_off[:, None] * (D // 2) + half[None, :]
            tl.store(codes4, packed, mask=row_ok[:, None])
            scale_ptrs = out4_scale + row_off[:, None] * (D // 16) + groups[None, :]
            tl.store(scale_ptrs, to_e4m3(scale, INTERPRET), mask=row_ok[:, None])
        tl.store(out4_exp + h * n_tok + tok, e4.to(tl.int8), mask=row_ok)
        if WIDE:
            wide = to_bf16(values, INTERPRET)
            tl.store(out_wide + row_off[:, None] * D + cols[None, :], wide, mask=row_ok[:, None])
        e = e4
    return e, grad


@triton.jit
def _slot_entry(block_start_ptr, block_len_ptr, block_v_t_ptr, slot):
    """Block ``slot``'s table entry: first token (int64), tokens, first v_t column (int64)."""
    start = tl.load(block_start_ptr + slot).to(tl.int64)
    return start, tl.load(block_len_ptr + slot), tl.load(block_v_t_ptr + slot).to(tl.int64)


@triton.jit
def _block_rows(start, length, col0, rows):
    """Tokens of a block (int64) taken in v_t's key order (row ``r`` is the block's token
    ``v_t_key(r)``: ``v_t`` columns, exponents and factors are then stored as contiguous
    vectors), which of them exist, and their v_t columns. Quantization is per row or per
    block, so the row order does not change any code."""
    keys = v_t_key(rows)
    return start + keys, keys < length, col0 + rows


@triton.jit
def _padded_rows(length, rows):
    """Rows of a block of ``length`` tokens to store in a column layout: its tokens and the
    document's padding up to the next 16-aligned column, which get zero codes (the values
    load as 0 there), so whole tiles read past a document's end stay finite."""
    return rows < (length + V_T_ALIGN - 1) // V_T_ALIGN * V_T_ALIGN


@triton.jit
def quantize_qkv_kernel(
    q_ptr,  # [T, HQ, D] bf16/fp16, strides (stride_qt, stride_qh, 1)
    k_ptr,  # [T, HKV, D]
    v_ptr,  # [T, HKV, D]
    block_start_ptr,  # [NB] int32: first token of each document-local 32-token block
    block_len_ptr,  # [NB] int32: tokens in the block (0 = unused slot)
    block_v_t_ptr,  # [NB] int32: column of the block's first key in v_t (16-aligned doc starts)
    q_slots_ptr,  # [1 + NB] int32 (Q_SHORT): n, then the n slots whose Q is quantized
    q8_ptr,  # [T, HQ, D] e4m3
    q_exp_ptr,  # [HQ, T] int16 (head-major: contiguous loads per key tile)
    k8_ptr,  # [T, HKV, D] e4m3
    k_exp_ptr,  # [HKV, t_pad] int16, in v_t's column layout
    vt_ptr,  # [HKV, D, t_pad] e4m3: V codes, keys contiguous (K-major for P·V)
    v_exp_ptr,  # [HKV, t_pad] int16, in v_t's column layout
    kv_factor_ptr,  # [HKV, 3, t_pad] float32: 2^eK (scores), eV, 2^-eV in v_t's column layout
    q4_ptr,  # [T, HQ, D/2] uint8 (QK_NVFP4 only)
    q4_scale_ptr,  # [T, HQ, D/16] e4m3
    q4_exp_ptr,  # [HQ, T] int8
    k4_ptr,  # [T, HKV, D/2] uint8
    k4_scale_ptr,  # [T, HKV, D/16] e4m3
    k4_exp_ptr,  # [HKV, T] int8
    q_wide_ptr,  # [T, HQ, D] bf16 (WIDE): NVFP4 Q values without the per-token power of two
    k_wide_ptr,  # [T, HKV, D] bf16 (WIDE)
    q_rows_ptr,  # [t_pad, HQ, D] bf16 (Q_ROWS): Q's gradient operand by column, tokens in order
    k_rows_ptr,  # [t_pad, HKV, D] bf16 (K_ROWS): K's
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    t_pad,
    n_tokens,
    n_slots,
    HQ: tl.constexpr,
    HKV: tl.constexpr,
    D: tl.constexpr,
    BLOCK: tl.constexpr,
    PER_TOKEN_QK: tl.constexpr,
    QK_NVFP4: tl.constexpr,
    HADAMARD: tl.constexpr,
    LOG2_D: tl.constexpr,
    WIDE: tl.constexpr,
    SCORES_ONLY: tl.constexpr,
    SKIP_Q: tl.constexpr,
    Q_SHORT: tl.constexpr,
    Q_ROWS: tl.constexpr,
    K_ROWS: tl.constexpr,
    GRAD_INPUT: tl.constexpr,
    SCALE_CANDIDATES: tl.constexpr,
    INTERPRET: tl.constexpr,
):
    """Persistent programs stride over (head, block slot) items, Q heads then K then V; each
    item quantizes one 32-token block of one head. Empty slots (length 0) store nothing.
    ``SKIP_Q``: no Q item (the CuTe forward quantizes Q as it loads it). ``Q_SHORT``: Q items
    only for the slots ``q_slots`` lists (``schedule.short_document_slots``: short documents,
    whose Q the window kernel reads while the CuTe forward quantizes the rest). ``Q_ROWS`` /
    ``K_ROWS``: the gradient products' Q / K operand in BF16 (the E4M3 codes' values, exact,
    or with ``GRAD_INPUT`` the inputs over their E4M3 exponents), one row per column of the
    layout with each document's tokens in order (``v_t_key`` of the column), the padding left
    as it is (zero).

    Not software-pipelined (``num_stages=1``): staging the next items' tiles through shared
    memory measured 2-3x slower on the H200 than many resident programs each streaming its
    own items (``benchmarks/results/tune_quant_persistent_stages.json``); nor are K's and V's
    tiles of a block loaded together (one item for both measured the same on the H200 and
    took 128 registers, 64 separately: ``benchmarks/NOTES.md``)."""
    pid = tl.program_id(0)
    n_prog = tl.num_programs(0)
    rows = tl.arange(0, BLOCK)
    cols = tl.arange(0, D)
    q_slots = n_slots  # slots with Q items (with Q_SHORT those q_slots_ptr lists)
    if Q_SHORT:
        q_slots = tl.load(q_slots_ptr)
    for item in tl.range(pid, 0 if SKIP_Q else HQ * q_slots, n_prog, num_stages=1):
        h = item // q_slots
        slot = item % q_slots
        if Q_SHORT:
            slot = tl.load(q_slots_ptr + 1 + slot)
        start, length, col0 = _slot_entry(block_start_ptr, block_len_ptr, block_v_t_ptr, slot)
        if length > 0:  # empty slots skipped
            tok, row_ok, col = _block_rows(start, length, col0, rows)
            _e, grad = _quantize_qk_head(
                q_ptr, stride_qt, stride_qh, h, tok, row_ok, q8_ptr, q_exp_ptr,
                h * n_tokens + tok, q4_ptr, q4_scale_ptr, q4_exp_ptr, q_wide_ptr, n_tokens,
                HQ, D, BLOCK, PER_TOKEN_QK, QK_NVFP4, HADAMARD, LOG2_D, WIDE, SCORES_ONLY,
                GRAD_INPUT, SCALE_CANDIDATES, INTERPRET,
            )  # fmt: skip
            if Q_ROWS:
                q_at = q_rows_ptr + (v_t_key(col) * HQ + h)[:, None] * D + cols[None, :]
                tl.store(q_at, grad, mask=row_ok[:, None])
    for item in tl.range(pid, HKV * n_slots, n_prog, num_stages=1):
        h = item // n_slots
        start, length, col0 = _slot_entry(
            block_start_ptr, block_len_ptr, block_v_t_ptr, item % n_slots
        )
        tok, row_ok, col = _block_rows(start, length, col0, rows)
        e, grad = _quantize_qk_head(
            k_ptr, stride_kt, stride_kh, h, tok, row_ok, k8_ptr, k_exp_ptr, h * t_pad + col,
            k4_ptr, k4_scale_ptr, k4_exp_ptr, k_wide_ptr, n_tokens,
            HKV, D, BLOCK, PER_TOKEN_QK, QK_NVFP4, HADAMARD, LOG2_D, WIDE, SCORES_ONLY,
            GRAD_INPUT, SCALE_CANDIDATES, INTERPRET,
        )  # fmt: skip
        if K_ROWS:
            k_at = k_rows_ptr + (v_t_key(col) * HKV + h)[:, None] * D + cols[None, :]
            tl.store(k_at, grad, mask=row_ok[:, None])
        # the score operand's K factor (E4M3: a token block's exponent; NVFP4: per token)
        factor_at = kv_factor_ptr + h * 3 * t_pad + col
        tl.store(factor_at, exp2i(e) + tl.zeros([BLOCK], tl.float32), mask=row_ok)
    for item in tl.range(pid, HKV * n_slots, n_prog, num_stages=1):
        h = item // n_slots
        start, length, col0 = _slot_entry(
            block_start_ptr, block_len_ptr, block_v_t_ptr, item % n_slots
        )
        tok, row_ok, col = _block_rows(start, length, col0, rows)
        x_ptrs = v_ptr + tok[:, None] * stride_vt + h * stride_vh + cols[None, :]
        x = tl.load(x_ptrs, mask=row_ok[:, None], other=0.0).to(tl.float32)
        codes, e = fp8_rows(x, True, INTERPRET)
        e = v_row_exponents(x, e)
        vt_ptrs = vt_ptr + (h * D + cols[:, None]).to(tl.int64) * t_pad + col[None, :]
        pad_ok = _padded_rows(length, rows)
        tl.store(vt_ptrs, tl.trans(codes), mask=pad_ok[None, :])
        tl.store(v_exp_ptr + h * t_pad + col, e.to(v_exp_ptr.dtype.element_ty), mask=row_ok)
        factor_at = kv_factor_ptr + (h * 3 + 1) * t_pad + col
        tl.store(factor_at, e.to(tl.float32), mask=row_ok)
        tl.store(factor_at + t_pad, exp2i(-e), mask=row_ok)


@triton.jit
def quantize_do_kernel(
    do_ptr,  # [T, HQ, D] bf16/fp16, strides (stride_dt, stride_dh, 1)
    o_ptr,  # [T, HQ, D] bf16/fp16 (the forward's output), strides (stride_ot, stride_oh, 1)
    m_ptr,  # [T, HQ] f32: the forward's integer row reference
    lse_ptr,  # [T, HQ] f32: the forward's base-2 log-sum-exp
    block_start_ptr,  # [NB] int32 (token-block table, as in quantize_qkv_kernel)
    block_len_ptr,  # [NB] int32
    block_v_t_ptr,  # [NB] int32
    do8_ptr,  # [T, HQ, D] e4m3: dÔ codes
    do_exp_ptr,  # [HQ, T] int16
    gt_ptr,  # [HQ, D, t_pad] e4m3: Ĝ codes in the column layout (G_COLUMNS)
    g_rows_ptr,  # [t_pad, HQ, D] bf16: Ĝ·2^eG by column, tokens in order (G_ROWS)
    g_exp_ptr,  # [HQ, t_pad] int16, column layout
    delta_ptr,  # [HQ, T] f32: rowsum(dÔ ∘ O)
    f_ptr,  # [HQ, T] f32: f = 2^(M − 8 − lse)
    stride_dt,
    stride_dh,
    stride_ot,
    stride_oh,
    t_pad,
    n_tokens,
    n_slots,
    HQ: tl.constexpr,
    D: tl.constexpr,
    BLOCK: tl.constexpr,
    INTERPRET: tl.constexpr,
    G_COLUMNS: tl.constexpr = True,
    G_ROWS: tl.constexpr = False,
):
    """The backward's dO operands in one pass (twin: ``reference.quantize_do``): per item
    (head, 32-token block) dÔ = E4M3 with a token-block exponent, ``D = rowsum(dÔ ∘ O)``
    from the same dÔ, and Ĝ = E4M3 of ``f ∘ dO`` (token-block exponent) for the dV product:
    its codes in the column layout (``G_COLUMNS``: the Triton backward's FP8 operand) and/or
    its values ``code·2^eG`` in BF16 (``G_ROWS``, exact: the CuTe backward's BF16 operand), one
    row per column of the layout with each document's tokens in order (``v_t_key`` of the
    column: no permutation) and the padding left as it is (zero). Persistent programs stride over
    the items."""
    pid = tl.program_id(0)
    n_prog = tl.num_programs(0)
    rows = tl.arange(0, BLOCK)
    cols = tl.arange(0, D)
    for item in tl.range(pid, HQ * n_slots, n_prog, num_stages=1):
        h = item // n_slots
        start, length, col0 = _slot_entry(
            block_start_ptr, block_len_ptr, block_v_t_ptr, item % n_slots
        )
        tok, row_ok, col = _block_rows(start, length, col0, rows)
        pad_ok = _padded_rows(length, rows)
        mask2 = row_ok[:, None]
        row_off = tok * HQ + h
        # every load first (the stores below could alias them for the compiler: loads
        # issued after a store wait for it, so the item's bytes would arrive in two trips)
        d_out = tl.load(do_ptr + tok[:, None] * stride_dt + h * stride_dh + cols[None, :],
                        mask=mask2, other=0.0).to(tl.float32)  # fmt: skip
        out = tl.load(o_ptr + tok[:, None] * stride_ot + h * stride_oh + cols[None, :],
                      mask=mask2, other=0.0).to(tl.float32)  # fmt: skip
        m_row = tl.load(m_ptr + row_off, mask=row_ok, other=0.0)
        lse_row = tl.load(lse_ptr + row_off, mask=row_ok, other=0.0)
        codes, e = fp8_rows(d_out, False, INTERPRET)
        tl.store(do8_ptr + row_off[:, None] * D + cols[None, :], codes, mask=mask2)
        tl.store(do_exp_ptr + h * n_tokens + tok, e.to(do_exp_ptr.dtype.element_ty), mask=row_ok)
        delta = tl.sum(codes.to(tl.float32) * exp2i(e)[:, None] * out, axis=1)
        tl.store(delta_ptr + h * n_tokens + tok, delta, mask=row_ok)
        f = tl.math.exp2(m_row - P_HAT_EXP - lse_row)
        tl.store(f_ptr + h * n_tokens + tok, f, mask=row_ok)
        g_codes, g_e = fp8_rows(d_out * f[:, None], False, INTERPRET)
        if G_COLUMNS:
            gt_ptrs = gt_ptr + (h * D + cols[:, None]).to(tl.int64) * t_pad + col[None, :]
            tl.store(gt_ptrs, tl.trans(g_codes), mask=pad_ok[None, :])
        if G_ROWS:
            # 2^eG exact for every eG the codes can have (-127: a subnormal; +127 unreachable)
            g_values = g_codes.to(tl.float32) * (exp2i(g_e + 1) * 0.5)[:, None]
            g_row = v_t_key(col) * HQ + h
            tl.store(g_rows_ptr + g_row[:, None] * D + cols[None, :],
                     g_values.to(g_rows_ptr.dtype.element_ty), mask=mask2)  # fmt: skip
        tl.store(g_exp_ptr + h * t_pad + col, g_e.to(g_exp_ptr.dtype.element_ty), mask=row_ok)
