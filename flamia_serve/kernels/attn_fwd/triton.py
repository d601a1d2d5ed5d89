"""FP8 attention forward for packed documents (Triton, Hopper ``wgmma`` via ``tl.dot``).

Twin: ``flamia_serve.reference.attention_forward``. Per score element: the Q/K exponents
are row/column factors of the ``Q̂·K̂ᵀ`` tile, the V exponent is added to the base-2 logit
(N3 fold), ``P̂ = E4M3(2^(y − m + 8))`` with an integer ``m`` feeds ``P̂·V̂``; the normaliser sums
the unquantized ``P' = 2^(y − m)`` times ``2^(−eV)``.

Row reference ``m`` (DESIGN N5): ``TWO_PASS`` first runs a max-only pass so every tile is
quantized against the final ``M = ceil(max y)`` (bit-compatible with the backward);
otherwise ``m`` is an integer running maximum and earlier tiles are rescaled by exact
powers of two (differs from the reference only where P lands in E4M3's subnormal range).
"""

from __future__ import annotations

import triton
import triton.language as tl

from flamia_serve.kernels._common import e4m3_value, exp2i, to_e4m3, v_t_key
from flamia_serve.kernels.attn_tiles import load_qk_tile
from flamia_serve.numerics import P_HAT_EXP as _P_HAT_EXP

P_HAT_EXP = tl.constexpr(_P_HAT_EXP)  # P̂ holds E4M3(P' * 2^8)
# a key tile's columns are v_t's (keys permuted inside 16-key groups): column c of a tile
# at key0 holds key key0 + v_t_key(c); K rows are loaded in that order too


@triton.jit
def _key_exponents(
    k_exp_ptr, k4_exp_ptr, v_exp_ptr, n_tok, doc_start, t_pad, v_t_start, key0, key_end, hk,
    BLOCK_N: tl.constexpr, QK_NVFP4: tl.constexpr, KE_BLOCK: tl.constexpr, MASK: tl.constexpr,
):  # fmt: skip
    """int32 K and V exponents of the key tile at ``key0`` (0 past ``key_end``): E4M3 ones
    in ``v_t``'s column layout (16-aligned document starts), NVFP4 ones per token.

    Full tiles (not ``MASK``) load unmasked: a mask along the keys would split the int16
    vectors, and Triton's pipeliner only stages loads of >= 4 bytes per thread.
    ``KE_BLOCK > 1``: K exponents are shared by document-local blocks of that many keys
    (token-block recipe), so one scalar load per block replaces a per-key vector load.
    """
    columns = tl.arange(0, BLOCK_N)
    offs_n = key0 + v_t_key(columns)
    key_ok = (offs_n < key_end) | (not MASK)
    at = hk * t_pad + v_t_start + key0 + columns
    if QK_NVFP4:
        ke = tl.load(k4_exp_ptr + hk * n_tok + doc_start + offs_n, mask=key_ok, other=0)
        ke = ke.to(tl.int32)
    elif KE_BLOCK > 1:
        ke = tl.zeros([BLOCK_N], tl.int32)
        for b in tl.static_range(BLOCK_N // KE_BLOCK):
            first = key0 + b * KE_BLOCK
            e_b = tl.load(k_exp_ptr + hk * t_pad + v_t_start + first, mask=first < key_end, other=0)
            ke = tl.where(tl.arange(0, BLOCK_N) // KE_BLOCK == b, e_b.to(tl.int32), ke)
    else:
        ke = tl.load(k_exp_ptr + at, mask=key_ok, other=0).to(tl.int32)
    ev = tl.load(v_exp_ptr + at, mask=key_ok, other=0).to(tl.int32)
    return ke, ev


@triton.jit
def _folded_logits(s, qfac, ke, ev):
    """Base-2 logits ``y = (Q̂·K̂ᵀ) qfac_i 2^eK_j + eV_j`` of a score tile ``s`` (the V
    exponent folded in, N3)."""
    return s * qfac[:, None] * exp2i(ke)[None, :] + ev.to(tl.float32)[None, :]


@triton.jit
def _quantized_probs(y, m_i, v_inv, INTERPRET: tl.constexpr):
    """``P'·2^8`` against the integer row reference ``m_i`` (the shift rides on it), its
    rows' sum of P̂·2^(−eV) (N3: l sums P̂ itself, so O is a convex combination of V̂ rows
    and the backward's dS rows sum to zero), and P̂ = E4M3 of it."""
    p = tl.math.exp2(y - (m_i[:, None] - P_HAT_EXP))
    return p, tl.sum(e4m3_value(p) * v_inv[None, :], axis=1), to_e4m3(p, INTERPRET)


@triton.jit
def _scores(
    q, qfac, ke, ev, k8_ptr, k4_ptr, k4_scale_ptr, doc_start, key0, key_end, offs_m,
    HKV: tl.constexpr, hk, D: tl.constexpr, BLOCK_N: tl.constexpr, QK_NVFP4: tl.constexpr,
    CAUSAL: tl.constexpr, MASK: tl.constexpr, INTERPRET: tl.constexpr,
):  # fmt: skip
    """Folded base-2 logits ``y = (Q̂·K̂ᵀ) qfac_i 2^eK_j + eV_j`` of one key tile, −inf where
    masked, and ``2^(−eV_j)``."""
    keys = v_t_key(tl.arange(0, BLOCK_N))
    offs_n = key0 + keys
    key_ok = offs_n < key_end
    # full tiles load unmasked (every key is inside the document)
    k = load_qk_tile(
        k8_ptr, k4_ptr, k4_scale_ptr, doc_start + key0, keys, key_ok | (not MASK), HKV, hk, D,
        BLOCK_N, QK_NVFP4, INTERPRET,
    )  # fmt: skip
    y = _folded_logits(tl.dot(q, tl.trans(k)), qfac, ke, ev)
    if MASK:
        ok = key_ok[None, :]
        if CAUSAL:
            ok = ok & (offs_n[None, :] <= offs_m[:, None])
        y = tl.where(ok, y, float("-inf"))
    return y, exp2i(-ev)


@triton.jit
def _row_max_pass(
    m_i, q, qfac, k8_ptr, k_exp_ptr, k4_ptr, k4_scale_ptr, k4_exp_ptr, v_exp_ptr, n_tok, t_pad,
    v_t_start, doc_start, lo, hi, key_end, offs_m, HKV: tl.constexpr, hk, D: tl.constexpr,
    BLOCK_N: tl.constexpr, QK_NVFP4: tl.constexpr, KE_BLOCK: tl.constexpr,
    CAUSAL: tl.constexpr, MASK: tl.constexpr, INTERPRET: tl.constexpr,
):  # fmt: skip
    for key0 in range(lo, hi, BLOCK_N):
        ke, ev = _key_exponents(
            k_exp_ptr, k4_exp_ptr, v_exp_ptr, n_tok, doc_start, t_pad, v_t_start, key0, key_end,
            hk, BLOCK_N, QK_NVFP4, KE_BLOCK, MASK,
        )  # fmt: skip
        y, _ = _scores(
            q, qfac, ke, ev, k8_ptr, k4_ptr, k4_scale_ptr, doc_start, key0, key_end, offs_m,
            HKV, hk, D, BLOCK_N, QK_NVFP4, CAUSAL, MASK, INTERPRET,
        )  # fmt: skip
        m_i = tl.maximum(m_i, tl.math.ceil(tl.max(y, axis=1)))
    return m_i


@triton.jit
def _store_debug_p(
    dbg_p_ptr, dbg_m_ptr, p8, m_i, h, doc_start, offs_m, length, key0, key_end, n_tok,
    BLOCK_N: tl.constexpr,
):  # fmt: skip
    """Debug hook: ``P'·2^8`` of one tile (float32, the value P̂ = E4M3 of it is rounded
    from) and the integer row reference it was computed against, at ``[h, query, key]`` of
    dense ``[H, T, T]`` buffers (small calls only). The E4M3 rounding is left to the caller:
    Triton 3.6 on sm_90 scrambles bytes when it widens these FP8 tiles back to FP32 for a
    store (not when they feed the MMA)."""
    offs_n = key0 + v_t_key(tl.arange(0, BLOCK_N))
    ok = (offs_m[:, None] < length) & (offs_n[None, :] < key_end)
    rows = (h * n_tok + doc_start + offs_m).to(tl.int64)
    at = rows[:, None] * n_tok + doc_start + offs_n[None, :]
    tl.store(dbg_p_ptr + at, p8, mask=ok)
    tl.store(dbg_m_ptr + at, m_i[:, None] + tl.zeros_like(p8), mask=ok)


@triton.jit
def _accumulate(
    acc, l_i, m_i, q, qfac, k8_ptr, k_exp_ptr, k4_ptr, k4_scale_ptr, k4_exp_ptr, vt_ptr,
    v_exp_ptr, n_tok, t_pad, v_t_start, doc_start, lo, hi, key_end, offs_m, HKV: tl.constexpr, hk,
    D: tl.constexpr, BLOCK_N: tl.constexpr, QK_NVFP4: tl.constexpr, KE_BLOCK: tl.constexpr,
    CAUSAL: tl.constexpr, MASK: tl.constexpr, TWO_PASS: tl.constexpr, INTERPRET: tl.constexpr,
    dbg_p_ptr, dbg_m_ptr, h, length, DEBUG_P: tl.constexpr,
):  # fmt: skip
    cols = tl.arange(0, D)
    for key0 in range(lo, hi, BLOCK_N):
        ke, ev = _key_exponents(
            k_exp_ptr, k4_exp_ptr, v_exp_ptr, n_tok, doc_start, t_pad, v_t_start, key0, key_end,
            hk, BLOCK_N, QK_NVFP4, KE_BLOCK, MASK,
        )  # fmt: skip
        y, v_inv = _scores(
            q, qfac, ke, ev, k8_ptr, k4_ptr, k4_scale_ptr, doc_start, key0, key_end, offs_m,
            HKV, hk, D, BLOCK_N, QK_NVFP4, CAUSAL, MASK, INTERPRET,
        )  # fmt: skip
        if not TWO_PASS:
            m_new = tl.maximum(m_i, tl.math.ceil(tl.max(y, axis=1)))
            alpha = tl.math.exp2(m_i - m_new)
            acc = acc * alpha[:, None]
            l_i = l_i * alpha
            m_i = m_new
        p, l_tile, p_hat = _quantized_probs(y, m_i, v_inv, INTERPRET)
        l_i += l_tile
        if DEBUG_P:  # P̂ and the row reference it was rounded against, dense [H, T, T]
            _store_debug_p(
                dbg_p_ptr, dbg_m_ptr, p, m_i, h, doc_start, offs_m, length, key0, key_end,
                n_tok, BLOCK_N,
            )  # fmt: skip
        columns = key0 + tl.arange(0, BLOCK_N)
        vt_ptrs = (
            vt_ptr + (hk * D + cols[:, None]).to(tl.int64) * t_pad + v_t_start + columns[None, :]
        )
        if MASK:  # the diagonal / tail tiles: keys past the document must read as 0
            key_ok = key0 + v_t_key(tl.arange(0, BLOCK_N)) < key_end
            vt = tl.load(vt_ptrs, mask=key_ok[None, :], other=0.0)
        else:  # a mask along the contiguous key axis would forbid 16-byte loads
            vt = tl.load(vt_ptrs)
        # Hopper's FP8 MMA accumulates with ~14 mantissa bits: each key tile's P̂·V̂ starts
        # from zero and is added in FP32 (promotion per tile; written out, because
        # ``max_num_imprecise_acc`` makes ptxas serialize the wgmma chain and spill)
        acc += tl.dot(p_hat, tl.trans(vt))
    return acc, l_i, m_i


@triton.jit
def _store_rows(
    out_ptr, m_ptr, lse_ptr, acc, l_i, m_i, rows, row_ok, h, HQ: tl.constexpr, D: tl.constexpr
):  # fmt: skip
    """O = acc / l, M and the base-2 lse of packed token ``rows`` of head ``h``."""
    flat = rows.to(tl.int64) * HQ + h
    cols = tl.arange(0, D)
    tl.store(
        out_ptr + flat[:, None] * D + cols[None, :],
        (acc / l_i[:, None]).to(out_ptr.dtype.element_ty),
        mask=row_ok[:, None],
    )
    tl.store(m_ptr + flat, m_i, mask=row_ok)
    tl.store(lse_ptr + flat, m_i - P_HAT_EXP + tl.math.log2(l_i), mask=row_ok)


@triton.jit
def _attn_item(
    work, q8_ptr, q_exp_ptr, k8_ptr, k_exp_ptr, q4_ptr, q4_scale_ptr, q4_exp_ptr,
    k4_ptr, k4_scale_ptr, k4_exp_ptr, vt_ptr, doc_v_t_ptr, v_exp_ptr, cu_ptr, item_doc_ptr,
    item_tile_ptr, out_ptr, m_ptr, lse_ptr, dbg_p_ptr, dbg_m_ptr, qk_scale, t_pad, n_tok,
    HQ: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr, QK_NVFP4: tl.constexpr,
    TWO_PASS: tl.constexpr, INTERPRET: tl.constexpr, KE_BLOCK: tl.constexpr,
    DEBUG_P: tl.constexpr,
):  # fmt: skip
    """One (document, query tile, head) work item."""
    pair = work // HQ
    h = work % HQ
    hk = h // (HQ // HKV)
    doc = tl.load(item_doc_ptr + pair)
    tile = tl.load(item_tile_ptr + pair)
    doc_start = tl.load(cu_ptr + doc)
    length = tl.load(cu_ptr + doc + 1) - doc_start
    v_t_start = tl.multiple_of(tl.load(doc_v_t_ptr + doc), 16)
    offs_m = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = offs_m < length
    rows = doc_start + offs_m
    q = load_qk_tile(
        q8_ptr, q4_ptr, q4_scale_ptr, doc_start + tile * BLOCK_M, tl.arange(0, BLOCK_M), row_ok,
        HQ, h, D, BLOCK_M, QK_NVFP4, INTERPRET,
    )  # fmt: skip
    if QK_NVFP4:
        qe = tl.load(q4_exp_ptr + h * n_tok + rows, mask=row_ok, other=0).to(tl.int32)
    else:
        qe = tl.load(q_exp_ptr + h * n_tok + rows, mask=row_ok, other=0).to(tl.int32)
    qfac = exp2i(qe) * qk_scale
    if CAUSAL:
        # key tiles wholly below the query tile need no mask; the rest is the diagonal
        full_end = tile * BLOCK_M
        key_end = tl.minimum((tile + 1) * BLOCK_M, length)
    else:
        full_end = (length // BLOCK_N) * BLOCK_N
        key_end = length
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D], tl.float32)
    if TWO_PASS:
        m_i = _row_max_pass(
            m_i, q, qfac, k8_ptr, k_exp_ptr, k4_ptr, k4_scale_ptr, k4_exp_ptr, v_exp_ptr, n_tok,
            t_pad, v_t_start, doc_start, 0, full_end, key_end, offs_m, HKV, hk, D, BLOCK_N,
            QK_NVFP4, KE_BLOCK, CAUSAL, False, INTERPRET,
        )  # fmt: skip
        m_i = _row_max_pass(
            m_i, q, qfac, k8_ptr, k_exp_ptr, k4_ptr, k4_scale_ptr, k4_exp_ptr, v_exp_ptr, n_tok,
            t_pad, v_t_start, doc_start, full_end, key_end, key_end, offs_m, HKV, hk, D,
            BLOCK_N, QK_NVFP4, KE_BLOCK, CAUSAL, True, INTERPRET,
        )  # fmt: skip
    acc, l_i, m_i = _accumulate(
        acc, l_i, m_i, q, qfac, k8_ptr, k_exp_ptr, k4_ptr, k4_scale_ptr, k4_exp_ptr, vt_ptr,
        v_exp_ptr, n_tok, t_pad, v_t_start, doc_start, 0, full_end, key_end, offs_m, HKV, hk, D,
        BLOCK_N,
        QK_NVFP4, KE_BLOCK, CAUSAL, False, TWO_PASS, INTERPRET, dbg_p_ptr, dbg_m_ptr, h, length,
        DEBUG_P,
    )  # fmt: skip
    acc, l_i, m_i = _accumulate(
        acc, l_i, m_i, q, qfac, k8_ptr, k_exp_ptr, k4_ptr, k4_scale_ptr, k4_exp_ptr, vt_ptr,
        v_exp_ptr, n_tok, t_pad, v_t_start, doc_start, full_end, key_end, key_end, offs_m, HKV,
        hk, D,
        BLOCK_N, QK_NVFP4, KE_BLOCK, CAUSAL, True, TWO_PASS, INTERPRET, dbg_p_ptr, dbg_m_ptr, h,
        length, DEBUG_P,
    )  # fmt: skip
    _store_rows(out_ptr, m_ptr, lse_ptr, acc, l_i, m_i, rows, row_ok, h, HQ, D)


@triton.jit
def attn_fwd_kernel(
    q8_ptr,  # [T, HQ, D] e4m3
    q_exp_ptr,  # [HQ, T] int16 (head-major)
    k8_ptr,  # [T, HKV, D] e4m3
    k_exp_ptr,  # [HKV, t_pad] int16, v_t's column layout
    q4_ptr,  # [T, HQ, D/2] uint8 (QK_NVFP4)
    q4_scale_ptr,  # [T, HQ, D/16] e4m3
    q4_exp_ptr,  # [HQ, T] int8
    k4_ptr,  # [T, HKV, D/2] uint8
    k4_scale_ptr,  # [T, HKV, D/16] e4m3
    k4_exp_ptr,  # [HKV, T] int8
    vt_ptr,  # [HKV, D, t_pad] e4m3, keys contiguous
    doc_v_t_ptr,  # [B] int32: first column of each document in vt (multiple of 16)
    v_exp_ptr,  # [HKV, t_pad] int16, v_t's column layout
    cu_ptr,  # [B+1] int32
    item_doc_ptr,  # [N] int32, work list (longest first)
    item_tile_ptr,  # [N] int32
    count_ptr,  # [1] int32 valid items
    ticket_ptr,  # [1] int32, zero before launch (persistent mode)
    out_ptr,  # [T, HQ, D] bf16/fp16
    m_ptr,  # [T, HQ] f32 integer row reference
    lse_ptr,  # [T, HQ] f32 base-2 log-sum-exp
    dbg_p_ptr,  # [HQ, T, T] f32 (DEBUG_P only): P̂ as quantized
    dbg_m_ptr,  # [HQ, T, T] f32 (DEBUG_P only): the row reference it was quantized against
    qk_scale,  # softmax_scale * log2(e) (* 1/d after Hadamard)
    t_pad,
    n_tokens,
    HQ: tl.constexpr,
    HKV: tl.constexpr,
    D: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr,
    QK_NVFP4: tl.constexpr,
    TWO_PASS: tl.constexpr,
    INTERPRET: tl.constexpr,
    PERSISTENT: tl.constexpr,
    KE_BLOCK: tl.constexpr,
    DEBUG_P: tl.constexpr,
):
    """Work items ``w = item * HQ + head``; persistent programs take them by atomic ticket."""
    n_work = tl.load(count_ptr) * HQ
    if PERSISTENT:
        work = tl.atomic_add(ticket_ptr, 1)
    else:
        work = tl.program_id(0)
    while work < n_work:
        _attn_item(
            work, q8_ptr, q_exp_ptr, k8_ptr, k_exp_ptr, q4_ptr, q4_scale_ptr, q4_exp_ptr,
            k4_ptr, k4_scale_ptr, k4_exp_ptr, vt_ptr, doc_v_t_ptr, v_exp_ptr, cu_ptr,
            item_doc_ptr, item_tile_ptr, out_ptr, m_ptr, lse_ptr, dbg_p_ptr, dbg_m_ptr, qk_scale,
            t_pad, n_tokens, HQ, HKV, D, BLOCK_M, BLOCK_N, CAUSAL, QK_NVFP4, TWO_PASS, INTERPRET,
            KE_BLOCK, DEBUG_P,
        )  # fmt: skip
        if PERSISTENT:
            work = tl.atomic_add(ticket_ptr, 1)
        else:
            work = n_work


@triton.jit
def attn_fwd_windows_kernel(
    q8_ptr,  # [T, HQ, D] e4m3
    q_exp_ptr,  # [HQ, T] int16 (head-major)
    k8_ptr,  # [T, HKV, D] e4m3
    k_exp_ptr,  # [HKV, t_pad] int16, v_t's column layout
    vt_ptr,  # [HKV, D, t_pad] e4m3, keys contiguous
    v_exp_ptr,  # [HKV, t_pad] int16, v_t's column layout
    column_ptr,  # [T] int64: each token's column in v_t's layout
    token_doc_ptr,  # [T] int32: each token's document
    win_start_ptr,  # [NW] int32: first token of each window
    win_end_ptr,  # [NW] int32: end of each window
    win_count_ptr,  # [1] int32: non-empty windows (the first ones)
    out_ptr,  # [T, HQ, D] bf16/fp16
    m_ptr,  # [T, HQ] f32 integer row reference
    lse_ptr,  # [T, HQ] f32 base-2 log-sum-exp
    qk_scale,  # softmax_scale * log2(e)
    t_pad,
    n_tokens,
    HQ: tl.constexpr,
    HKV: tl.constexpr,
    D: tl.constexpr,
    ROWS: tl.constexpr,
    CAUSAL: tl.constexpr,
    INTERPRET: tl.constexpr,
):
    """Persistent programs over (window, K/V head) items: a run of whole short documents
    (``ShortWindows``) as one ``ROWS x ROWS`` tile, scores across documents masked, so every
    row has its document's keys in one tile; the K̂ and V̂ tiles (V̂ gathered from the column
    layout) are loaded once per item for the ``HQ / HKV`` query heads that share them.
    Numerics of ``_attn_item`` on a document that fits one key tile, i.e. the reference's:
    ``M = ceil(max y)``, ``P̂ = E4M3(2^(y − M + 8))``, ``l = Σ P̂·2^(−eV)``, ``O = P̂·V̂ / l``.
    Other documents' V̂ rows meet zero weights in the same product, so a NaN code among them
    is taken out first, and each NaN put back where the document's own tile would have had
    it (0·NaN in every row of its document, at its head-dim column)."""
    group = HQ // HKV
    n_items = tl.load(win_count_ptr) * HKV
    for item in tl.range(tl.program_id(0), n_items, tl.num_programs(0), num_stages=1):
        win = item // HKV
        hk = item % HKV
        start = tl.load(win_start_ptr + win)
        end = tl.load(win_end_ptr + win)
        offs = tl.arange(0, ROWS)
        tok = start + offs
        ok = tok < end
        cols = tl.arange(0, D)
        k = load_qk_tile(
            k8_ptr, k8_ptr, k8_ptr, start, offs, ok, HKV, hk, D, ROWS, False, INTERPRET
        )  # fmt: skip
        column = tl.load(column_ptr + tok, mask=ok, other=0)
        ke = tl.load(k_exp_ptr + hk * t_pad + column, mask=ok, other=0).to(tl.int32)
        ev = tl.load(v_exp_ptr + hk * t_pad + column, mask=ok, other=0).to(tl.int32)
        doc = tl.load(token_doc_ptr + tok, mask=ok, other=-1)
        vt_ptrs = vt_ptr + (hk * D + cols[:, None]).to(tl.int64) * t_pad + column[None, :]
        vt = tl.load(vt_ptrs, mask=ok[None, :], other=0.0)
        bits = vt.to(tl.uint8, bitcast=True)
        nan = (bits & 0x7F) == 0x7F  # E4M3's NaN codes
        any_nan = tl.max(tl.max(nan.to(tl.int32), axis=1), axis=0)
        vt = tl.where(nan, 0, bits).to(vt.dtype, bitcast=True)
        for g in tl.range(0, group, num_stages=1):
            h = hk * group + g
            q = load_qk_tile(
                q8_ptr, q8_ptr, q8_ptr, start, offs, ok, HQ, h, D, ROWS, False, INTERPRET
            )  # fmt: skip
            qe = tl.load(q_exp_ptr + h * n_tokens + tok, mask=ok, other=0).to(tl.int32)
            y = _folded_logits(tl.dot(q, tl.trans(k)), exp2i(qe) * qk_scale, ke, ev)
            same = (doc[:, None] == doc[None, :]) & ok[None, :]
            allowed = same
            if CAUSAL:
                allowed = allowed & (offs[None, :] <= offs[:, None])
            y = tl.where(allowed, y, float("-inf"))
            m_i = tl.math.ceil(tl.max(y, axis=1))
            _, l_i, p_hat = _quantized_probs(y, m_i, exp2i(-ev), INTERPRET)
            acc = tl.dot(p_hat, tl.trans(vt))
            if any_nan > 0:  # [row, column]: a key of the row's document has NaN there
                raw = tl.load(vt_ptrs, mask=ok[None, :], other=0.0).to(tl.uint8, bitcast=True)
                nan_at = ((raw & 0x7F) == 0x7F).to(tl.float16)
                hit = tl.dot(same.to(tl.float16), tl.trans(nan_at))
                acc = tl.where(hit > 0, float("nan"), acc)
            _store_rows(out_ptr, m_ptr, lse_ptr, acc, l_i, m_i, tok, ok, h, HQ, D)
