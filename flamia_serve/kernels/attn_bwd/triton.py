"""FP8 attention backward for packed documents (Triton): dQ, dK, dV in one pass.

Twin: ``flamia_serve.reference.attention_backward`` (its docstring defines every product).
One program per (key tile of ``BLOCK_N`` keys, K/V head) from a longest-first work list:
it keeps the tile's K̂/V̂ and its dK/dV accumulators on chip and steps over the queries of
its document ``BLOCK_M`` (= one 32-token exponent block) at a time, for every query head of
the GQA group. Per step, with keys as rows:

* ``Sᵀ = K̂·Q̂ᵀ`` rebuilt as the forward built it: ``y = s·2^eK·2^eQ·c + eV``,
  ``p8 = 2^(y − M + 8)``, ``P̂ = E4M3(p8)`` (the forward's P̂: N5);
* ``dV += (P̂ᵀ·Ĝ)·2^eG``: Ĝ carries the forward's ``1/(2^8 l)`` per query, so the step's
  exponent is the only scale along the contraction (promotion to FP32 once per step);
* ``dPᵀ = V̂·dÔᵀ`` scaled by ``2^eV`` (rows) and ``2^eO`` (the step); ``dSᵀ = P ∘ (dP − D)``
  with ``P = P̂·2^−eV·f`` (``f = 2^(M − 8 − lse)``; the forward's l sums P̂, so every row
  of P sums to 1 and every row of dS to 0);
* ``dK += (E4M3(dSᵀ ∘ 2^eQ)·Q̂)·2^e``: one exponent per 32 keys × the step's 32 queries;
* ``dQ += (E4M3(dS ∘ 2^eK)·K̂)·2^e`` with one exponent per step × tile (its contraction over
  the tile's keys has one scale), computed transposed and added to an FP32 buffer with
  atomics.

``GRAD_INPUT`` (``Recipe(grad_qk="input")``): dK and dQ multiply the same dŜ codes by the
inputs' BF16 ``Q·2^-eQ`` / ``K·2^-eK`` (``KernelQKV.q_rows`` / ``k_rows``) instead of Q̂/K̂,
BF16 products with FP32 sums.

``D_OUT`` < ``D`` splits the head dim of the outputs over adjacent programs: each
program rebuilds Sᵀ and dPᵀ over the whole head dim (their contractions) and accumulates
dK, dV and dQ for its ``D_OUT`` columns only, so its accumulators fit in registers at
d = 256. Every code and exponent is the same as unsplit (dS's do not depend on the split).

Column-layout tiles that run past their document (the key tile's V̂/K̂, the last query
step's Q̂/Ĝ) read zeros there: the next document's codes must not enter an MMA even with
zero weight (0·NaN is NaN), and the arrays end ``COLUMN_SLACK`` columns after the last
document.

Validity rides on per-row/per-column vectors, not per-element masks: keys past the
document get ``eV = −inf`` (P̂ = 0) and zero V factors, queries past it ``M = +inf`` and
``f = 0``; only the causal diagonal compares positions.
"""

from __future__ import annotations

import triton
import triton.language as tl

from flamia_serve.kernels._common import (
    E4M3_EXP,
    E4M3_MANT,
    bf16_operand,
    e4m3_signed_value,
    e4m3_value,
    exp2i,
    pow2_exponent_ceil,
    to_e4m3,
    to_out,
    v_t_key,
)
from flamia_serve.kernels.attn_tiles import load_qk_tile
from flamia_serve.numerics import P_HAT_EXP as _P_HAT_EXP

P_HAT_EXP = tl.constexpr(_P_HAT_EXP)


@triton.jit
def _column_tile(
    t_ptr, h, col0, t_pad, ok, d0, D: tl.constexpr, DW: tl.constexpr, WIDTH: tl.constexpr
):
    """``[WIDTH, DW]`` view (K-major) of columns ``col0 ..`` of head ``h``, head-dim rows
    ``d0 .. d0 + DW``, of a column-layout array ``[H, D, t_pad]`` (loaded as ``[DW, WIDTH]``,
    contiguous along the tokens);
    columns whose token is not ``ok`` read as 0 — a step that runs past its document must
    not read the next one (0·NaN would carry its NaN over) or past the array. (A separate
    unmasked loop for the full steps measured more register spills in a local sm_90
    compile: 464 -> 1744 stack bytes at 4 warps.)"""
    cols = d0 + tl.arange(0, DW)
    rows = (h * D + cols[:, None]).to(tl.int64) * t_pad
    ptrs = t_ptr + rows + col0 + tl.arange(0, WIDTH)[None, :]
    return tl.trans(tl.load(ptrs, mask=ok[None, :], other=0.0))


@triton.jit
def _row_tile(
    rows_ptr, h, rows, ok, d0, H: tl.constexpr, D: tl.constexpr, DW: tl.constexpr,
    INTERPRET: tl.constexpr,
):  # fmt: skip
    """``[len(rows), DW]`` BF16 (``bf16_operand``: float32 under the interpreter):
    rows ``rows`` of head ``h`` of a rows-by-column array ``[t_pad, H, D]``
    (``KernelQKV.q_rows``/``k_rows``), head-dim columns ``d0 .. d0 + DW``; rows not ``ok``
    read as 0 (past the document: another document's row, or the array's end)."""
    cols = d0 + tl.arange(0, DW)
    ptrs = rows_ptr + (rows.to(tl.int64) * H + h)[:, None] * D + cols[None, :]
    return bf16_operand(tl.load(ptrs, mask=ok[:, None], other=0.0), INTERPRET)


@triton.jit
def _key_tile(
    t_ptr, h, col0, t_pad, ok, d0, D: tl.constexpr, DW: tl.constexpr, WIDTH: tl.constexpr
):
    """``_column_tile`` of the key tile: loaded whole (the arrays carry ``COLUMN_SLACK``
    zero columns, so the load stays inside them), then other documents' columns zeroed."""
    cols = d0 + tl.arange(0, DW)
    rows = (h * D + cols[:, None]).to(tl.int64) * t_pad
    tile = tl.load(t_ptr + rows + col0 + tl.arange(0, WIDTH)[None, :])
    return tl.trans(tl.where(ok[None, :], tile, 0.0))


@triton.jit
def _block_exponents(amax_rows, BLOCK_N: tl.constexpr, KEYS: tl.constexpr):
    """int32 ``[BLOCK_N]``: E4M3 exponent of each run of ``KEYS`` rows, from per-row amax."""
    amax = tl.max(tl.reshape(amax_rows, (BLOCK_N // KEYS, KEYS)), axis=1)
    e = pow2_exponent_ceil(amax, E4M3_EXP, E4M3_MANT)
    return tl.reshape(tl.broadcast_to(e[:, None], (BLOCK_N // KEYS, KEYS)), (BLOCK_N,))


@triton.jit
def _bwd_steps(
    dk_acc, dv_acc, lo, hi, k_tile, v_tile, kt_tile, kfac, k8fac, ev_add, v_inv, v_fac, kj,
    h, doc_start, length, v_t_start, d0,
    q8_ptr, q_exp_ptr, qt_ptr, q_rows_ptr, q4_ptr, q4_scale_ptr, q4_exp_ptr,
    do8_ptr, do_exp_ptr, gt_ptr, g_exp_ptr, delta_ptr, m_ptr, lse_ptr, dq_ptr, dbg_ptr,
    qk_scale, softmax_scale, t_pad, n_tok,
    HQ: tl.constexpr, D: tl.constexpr, D_OUT: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DK_KEYS: tl.constexpr, DIAGONAL: tl.constexpr, QK_NVFP4: tl.constexpr,
    DEBUG_P: tl.constexpr, WITH_DQ: tl.constexpr, GRAD_INPUT: tl.constexpr,
    INTERPRET: tl.constexpr,
):  # fmt: skip
    """Query steps ``[lo, hi)`` of head ``h`` against one key tile (module docstring),
    output head-dim columns ``d0 .. d0 + D_OUT``. ``DIAGONAL``: compare positions (causal
    diagonal)."""
    r = tl.arange(0, BLOCK_M)
    perm = v_t_key(r)  # query rows in the column layout's order, as the K tile's keys
    cols = tl.arange(0, D)
    for i0 in range(lo, hi, BLOCK_M):
        qi = i0 + perm
        q_ok = qi < length
        rows = doc_start + qi
        flat = rows.to(tl.int64) * HQ + h
        q = load_qk_tile(
            q8_ptr, q4_ptr, q4_scale_ptr, doc_start + i0, perm, q_ok, HQ, h, D, BLOCK_M,
            QK_NVFP4, INTERPRET,
        )  # fmt: skip
        eq8 = tl.load(q_exp_ptr + h * n_tok + rows, mask=q_ok, other=0).to(tl.int32)
        if QK_NVFP4:
            eqs = tl.load(q4_exp_ptr + h * n_tok + rows, mask=q_ok, other=0).to(tl.int32)
        else:
            eqs = eq8
        qfac = exp2i(eqs) * qk_scale
        m_row = tl.load(m_ptr + flat, mask=q_ok, other=float("inf"))
        lse_row = tl.load(lse_ptr + flat, mask=q_ok, other=0.0)
        f = tl.where(q_ok, tl.math.exp2(m_row - P_HAT_EXP - lse_row), 0.0)
        delta = tl.load(delta_ptr + h * n_tok + rows, mask=q_ok, other=0.0)
        # the step is one document-local 32-token block: one dÔ and one Ĝ exponent
        e_do = tl.load(do_exp_ptr + h * n_tok + doc_start + i0).to(tl.int32)
        e_g = tl.load(g_exp_ptr + h * t_pad + v_t_start + i0).to(tl.int32)
        d_o = tl.load(do8_ptr + flat[:, None] * D + cols[None, :], mask=q_ok[:, None], other=0.0)
        if GRAD_INPUT:  # Q·2^-eQ in BF16, rows in the step's order
            q_t = _row_tile(q_rows_ptr, h, v_t_start + qi, q_ok, d0, HQ, D, D_OUT, INTERPRET)
        else:
            q_t = _column_tile(qt_ptr, h, v_t_start + i0, t_pad, q_ok, d0, D, D_OUT, BLOCK_M)
        g_t = _column_tile(gt_ptr, h, v_t_start + i0, t_pad, q_ok, d0, D, D_OUT, BLOCK_M)

        s = tl.dot(k_tile, tl.trans(q))
        y = s * kfac[:, None] * qfac[None, :] + ev_add[:, None]
        if DIAGONAL:
            y = tl.where(qi[None, :] >= kj[:, None], y, float("-inf"))
        p8 = tl.math.exp2(y - (m_row[None, :] - P_HAT_EXP))
        p_hat = to_e4m3(p8, INTERPRET)
        if DEBUG_P:  # P'·2^8 as rebuilt here (the launcher rounds it to P̂; see the
            # forward's _store_debug_p), at [h, query, key] of a dense [HQ, T, T] buffer
            at = (h * n_tok + rows[None, :]).to(tl.int64) * n_tok + doc_start + kj[:, None]
            ok = q_ok[None, :] & (kj[:, None] < length)
            tl.store(dbg_ptr + at, p8, mask=ok)
        dv_acc += tl.dot(p_hat, g_t) * exp2i(e_g)
        dp = tl.dot(v_tile, tl.trans(d_o)) * (v_fac[:, None] * exp2i(e_do))
        ds = e4m3_value(p8) * v_inv[:, None] * f[None, :] * (dp - delta[None, :])
        # dK: dS ∘ 2^eQ, one exponent per DK_KEYS keys x the step
        dsk = ds * exp2i(eq8)[None, :]
        ek = _block_exponents(tl.max(tl.abs(dsk), axis=1), BLOCK_N, DK_KEYS)
        dsk8 = _ds_operand(dsk * exp2i(-ek)[:, None], GRAD_INPUT, INTERPRET)
        dk_acc += tl.dot(dsk8, q_t) * exp2i(ek)[:, None]
        if WITH_DQ:  # dQ: dS ∘ 2^eK, one exponent for the step x the tile
            _accumulate_dq(ds, k8fac, kt_tile, dq_ptr, flat, q_ok, softmax_scale, d0, D, D_OUT,
                           GRAD_INPUT, INTERPRET)  # fmt: skip
    return dk_acc, dv_acc


@triton.jit
def _ds_operand(x, GRAD_INPUT: tl.constexpr, INTERPRET: tl.constexpr):
    """dŜ = E4M3(x) (``|x| <= 448``, round to nearest even) as the MMA operand beside Q/K:
    the E4M3 codes, or for a product with the inputs' BF16 rows (``GRAD_INPUT``) their values
    in BF16 (exact; built from the float, not by widening the codes: ``e4m3_value``;
    ``bf16_operand``)."""
    if GRAD_INPUT:
        ds = bf16_operand(e4m3_signed_value(x), INTERPRET)
    else:
        ds = to_e4m3(x, INTERPRET)
    return ds


@triton.jit
def _accumulate_dq(ds, k8fac, kt_tile, dq_ptr, flat, q_ok, softmax_scale, d0, D: tl.constexpr,
                   D_OUT: tl.constexpr, GRAD_INPUT: tl.constexpr,
                   INTERPRET: tl.constexpr):  # fmt: skip
    """dQ += (E4M3(dS ∘ 2^eK)·K̂)·2^e of one step, one exponent per step x tile, FP32 atomics
    (head-dim columns ``d0 .. d0 + D_OUT``: ``kt_tile`` holds those rows of K̂ᵀ, E4M3 codes or
    BF16 ``K·2^-eK`` with ``GRAD_INPUT``)."""
    cols = d0 + tl.arange(0, D_OUT)
    dsq = ds * k8fac[:, None]
    eb = pow2_exponent_ceil(tl.max(tl.max(tl.abs(dsq), axis=1), axis=0), E4M3_EXP, E4M3_MANT)
    dsq8 = _ds_operand(dsq * exp2i(-eb), GRAD_INPUT, INTERPRET)
    # dQᵀ = K̂ᵀ·dŜᵀ: keys on the MMA's K, the head dim on its M (a 32-row step is too short
    # for a warpgroup MMA's M of 64)
    dq_t = tl.dot(kt_tile, dsq8) * (exp2i(eb) * softmax_scale)
    tl.atomic_add(dq_ptr + flat[None, :] * D + cols[:, None], dq_t, mask=q_ok[None, :],
                  sem="relaxed")  # fmt: skip


@triton.jit
def attn_bwd_kernel(
    q8_ptr,  # [T, HQ, D] e4m3
    q_exp_ptr,  # [HQ, T] int16 (head-major)
    qt_ptr,  # [HQ, D, t_pad] e4m3, column layout (unless GRAD_INPUT)
    q_rows_ptr,  # [t_pad, HQ, D] bf16: Q·2^-eQ, rows by column (GRAD_INPUT)
    k8_ptr,  # [T, HKV, D] e4m3
    k_exp_ptr,  # [HKV, t_pad] int16, column layout
    kt_ptr,  # [HKV, D, t_pad] e4m3, column layout (unless GRAD_INPUT)
    k_rows_ptr,  # [t_pad, HKV, D] bf16: K·2^-eK, rows by column (GRAD_INPUT)
    q4_ptr,  # [T, HQ, D/2] uint8 (QK_NVFP4)
    q4_scale_ptr,  # [T, HQ, D/16] e4m3
    q4_exp_ptr,  # [HQ, T] int8
    k4_ptr,  # [T, HKV, D/2] uint8
    k4_scale_ptr,  # [T, HKV, D/16] e4m3
    k4_exp_ptr,  # [HKV, T] int8
    vt_ptr,  # [HKV, D, t_pad] e4m3, column layout
    v_exp_ptr,  # [HKV, t_pad] int16, column layout
    doc_v_t_ptr,  # [B] int32: each document's first column (multiple of 16)
    do8_ptr,  # [T, HQ, D] e4m3: dÔ
    do_exp_ptr,  # [HQ, T] int16
    gt_ptr,  # [HQ, D, t_pad] e4m3: Ĝ, column layout
    g_exp_ptr,  # [HQ, t_pad] int16, column layout
    delta_ptr,  # [HQ, T] f32
    m_ptr,  # [T, HQ] f32: the forward's integer row reference
    lse_ptr,  # [T, HQ] f32
    cu_ptr,  # [B+1] int32
    item_doc_ptr,  # [N] int32: key-tile work list (longest first)
    item_tile_ptr,  # [N] int32
    count_ptr,  # [1] int32 valid items
    dq_ptr,  # [T, HQ, D] f32, zeroed: dQ accumulated atomically
    dk_ptr,  # [T, HKV, D] bf16/fp16
    dv_ptr,  # [T, HKV, D] bf16/fp16
    dbg_ptr,  # [HQ, T, T] f32 (DEBUG_P only)
    qk_scale,  # softmax_scale * log2(e) (* 1/d after Hadamard)
    softmax_scale,
    t_pad,
    n_tokens,
    HQ: tl.constexpr,
    HKV: tl.constexpr,
    D: tl.constexpr,
    D_OUT: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DK_KEYS: tl.constexpr,
    CAUSAL: tl.constexpr,
    QK_NVFP4: tl.constexpr,
    DEBUG_P: tl.constexpr,
    WITH_DQ: tl.constexpr,
    GRAD_INPUT: tl.constexpr,
    INTERPRET: tl.constexpr,
):
    """Program ``(item * HKV + kv_head) * (D // D_OUT) + head-dim part`` (a tile's parts
    launch together, in the work list's longest-first order); see the module docstring.
    ``WITH_DQ=False`` leaves dQ out (profiling)."""
    n_parts: tl.constexpr = D // D_OUT
    work = tl.program_id(0) // n_parts
    d0 = (tl.program_id(0) % n_parts) * D_OUT
    if work >= tl.load(count_ptr) * HKV:
        return
    pair = work // HKV
    hk = work % HKV
    doc = tl.load(item_doc_ptr + pair)
    key0 = tl.load(item_tile_ptr + pair) * BLOCK_N
    doc_start = tl.load(cu_ptr + doc)
    length = tl.load(cu_ptr + doc + 1) - doc_start
    v_t_start = tl.multiple_of(tl.load(doc_v_t_ptr + doc), 16)
    c = tl.arange(0, BLOCK_N)
    kj = key0 + v_t_key(c)  # the tile's keys, in the column layout's order
    key_ok = kj < length
    k_tile = load_qk_tile(
        k8_ptr, k4_ptr, k4_scale_ptr, doc_start + key0, v_t_key(c), key_ok, HKV, hk, D, BLOCK_N,
        QK_NVFP4, INTERPRET,
    )  # fmt: skip
    at = hk * t_pad + v_t_start + key0 + c
    ek8 = tl.load(k_exp_ptr + at, mask=key_ok, other=0).to(tl.int32)
    ev = tl.load(v_exp_ptr + at, mask=key_ok, other=0).to(tl.int32)
    if QK_NVFP4:
        eks = tl.load(k4_exp_ptr + hk * n_tokens + doc_start + kj, mask=key_ok, other=0)
        eks = eks.to(tl.int32)
    else:
        eks = ek8
    kfac = exp2i(eks)
    k8fac = exp2i(ek8)
    ev_add = tl.where(key_ok, ev.to(tl.float32), float("-inf"))
    v_inv = tl.where(key_ok, exp2i(-ev), 0.0)
    v_fac = tl.where(key_ok, exp2i(ev), 0.0)
    # loaded once per program: masked, so a tile past its document reads zeros
    v_tile = _key_tile(vt_ptr, hk, v_t_start + key0, t_pad, key_ok, 0, D, D, BLOCK_N)
    if GRAD_INPUT:  # K·2^-eK in BF16, rows in the tile's order
        kt_tile = _row_tile(k_rows_ptr, hk, v_t_start + kj, key_ok, d0, HKV, D, D_OUT,
                            INTERPRET)  # fmt: skip
    else:
        kt_tile = _key_tile(kt_ptr, hk, v_t_start + key0, t_pad, key_ok, d0, D, D_OUT, BLOCK_N)
    kt_tile = tl.trans(kt_tile)  # [D_OUT, BN]
    dk_acc = tl.zeros([BLOCK_N, D_OUT], tl.float32)
    dv_acc = tl.zeros([BLOCK_N, D_OUT], tl.float32)
    for g in range(HQ // HKV):
        h = hk * (HQ // HKV) + g
        if CAUSAL:  # the diagonal
            lo = tl.minimum(key0 + BLOCK_N, length)
            dk_acc, dv_acc = _bwd_steps(
                dk_acc, dv_acc, key0, lo, k_tile, v_tile, kt_tile, kfac, k8fac, ev_add,
                v_inv, v_fac, kj, h, doc_start, length, v_t_start, d0,
                q8_ptr, q_exp_ptr, qt_ptr, q_rows_ptr, q4_ptr, q4_scale_ptr, q4_exp_ptr,
                do8_ptr, do_exp_ptr, gt_ptr, g_exp_ptr, delta_ptr, m_ptr, lse_ptr, dq_ptr, dbg_ptr,
                qk_scale, softmax_scale, t_pad, n_tokens,
                HQ, D, D_OUT, BLOCK_M, BLOCK_N, DK_KEYS, True, QK_NVFP4, DEBUG_P, WITH_DQ,
                GRAD_INPUT, INTERPRET,
            )  # fmt: skip
        else:
            lo = 0
        dk_acc, dv_acc = _bwd_steps(
            dk_acc, dv_acc, lo, length, k_tile, v_tile, kt_tile, kfac, k8fac, ev_add,
            v_inv, v_fac, kj, h, doc_start, length, v_t_start, d0,
            q8_ptr, q_exp_ptr, qt_ptr, q_rows_ptr, q4_ptr, q4_scale_ptr, q4_exp_ptr,
            do8_ptr, do_exp_ptr, gt_ptr, g_exp_ptr, delta_ptr, m_ptr, lse_ptr, dq_ptr, dbg_ptr,
            qk_scale, softmax_scale, t_pad, n_tokens,
            HQ, D, D_OUT, BLOCK_M, BLOCK_N, DK_KEYS, False, QK_NVFP4, DEBUG_P, WITH_DQ,
            GRAD_INPUT, INTERPRET,
        )  # fmt: skip
    cols = d0 + tl.arange(0, D_OUT)
    out_at = ((doc_start + kj).to(tl.int64) * HKV + hk)[:, None] * D + cols[None, :]
    tl.store(dk_ptr + out_at, to_out(dk_acc * softmax_scale, dk_ptr, INTERPRET),
             mask=key_ok[:, None])  # fmt: skip
    tl.store(dv_ptr + out_at, to_out(dv_acc * v_inv[:, None], dv_ptr, INTERPRET),
             mask=key_ok[:, None])  # fmt: skip
