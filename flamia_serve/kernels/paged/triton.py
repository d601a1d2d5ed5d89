"""Serving kernels over the paged KV cache: cache write, paged attention, split combine.

Twins: ``flamia_serve.reference.paged`` (``write_kv_cache``, ``paged_attention``). Byte
layout: ``numerics.kv_pages``. Cache formats (``KV_FMT`` = ``KVCacheFormat.kernel_id``):
0 = bf16, 1 = fp8 (per token-head exponent), 2 = nvfp4, 3 = fp16, 4 = fp8_static.
Exponential modes (``EXP_MODE``): 0 = exact, 1 = schraudolph, 2 = mitchell
(``numerics.exp2``).
"""

from __future__ import annotations

import triton
import triton.language as tl

from flamia_serve.kernels._common import (
    e4m3_value,
    exp2i,
    fp8_rows,
    hadamard_rows,
    nvfp4_rows,
    pow2_exponent_ceil,
    to_bf16,
    to_e4m3,
    to_out,
    v_row_exponents,
)
from flamia_serve.numerics.exp2 import RNE_MAGIC as _RNE_MAGIC
from flamia_serve.numerics.exp2 import RNE_MAGIC_BITS as _RNE_MAGIC_BITS
from flamia_serve.numerics.exp2 import SCHRAUDOLPH_C
from flamia_serve.numerics.formats import P_HAT_EXP

BF16: tl.constexpr = tl.constexpr(0)
FP8: tl.constexpr = tl.constexpr(1)
NVFP4: tl.constexpr = tl.constexpr(2)
FP16: tl.constexpr = tl.constexpr(3)
FP8_STATIC: tl.constexpr = tl.constexpr(4)
EXACT: tl.constexpr = tl.constexpr(0)
SCHRAUDOLPH: tl.constexpr = tl.constexpr(1)
MITCHELL: tl.constexpr = tl.constexpr(2)
SCHRAUDOLPH_C_: tl.constexpr = tl.constexpr(SCHRAUDOLPH_C)
# P̂ = E4M3(2^(t + P_HAT_EXP)); Mitchell-P code = RNE(8 (t + P_HAT_EXP)) + 7·8; its FP16 bits
# are (code + 64) << 7 and the bits of its FP32 value · 2^-P_HAT_EXP are
# (code + 8 (120 − P_HAT_EXP)) << 20
P_SHIFT: tl.constexpr = tl.constexpr(float(P_HAT_EXP))
P_SCALE: tl.constexpr = tl.constexpr(float(2**P_HAT_EXP))
L_BITS_BASE: tl.constexpr = tl.constexpr(8 * (120 - P_HAT_EXP))
# 2**15 = 1.0 * 2**15: the FP16 row maximum of Q for the NVFP4 cache (reference.Q_FP16_MAX)
Q16_EXP: tl.constexpr = tl.constexpr(15)
RNE_MAGIC: tl.constexpr = tl.constexpr(_RNE_MAGIC)  # 1.5 * 2**23
MAGIC_BITS: tl.constexpr = tl.constexpr(_RNE_MAGIC_BITS)  # its float32 bits
NO_MAX: tl.constexpr = tl.constexpr(-1073741824.0)  # running-max sentinel (-2**30)


@triton.jit
def write_kv_cache_kernel(
    key_ptr, value_ptr, stride_kt, stride_kh, stride_vt, stride_vh, slot_ptr,
    codes_ptr, scales_ptr, k_inv_scale, v_inv_scale,
    HKV: tl.constexpr, HKV_P2: tl.constexpr, D: tl.constexpr, LOG2_D: tl.constexpr,
    PAGE: tl.constexpr, REGION_CODES: tl.constexpr, REGION_SCALES: tl.constexpr,
    SCALE_BASE: tl.constexpr, CODE_ROW: tl.constexpr, SCALE_ROW: tl.constexpr,
    V_ROW: tl.constexpr, V_COL: tl.constexpr,
    KV_FMT: tl.constexpr, HADAMARD: tl.constexpr, INTERPRET: tl.constexpr,
):  # fmt: skip
    """One new token per program: quantize its K and V heads into slot ``slot_mapping[t]``
    (skipped when −1). ``*_inv_scale``: 1 / the static scale (``fp8_static`` only). V codes
    go to ``off · V_ROW + j · V_COL`` (dim-major pages for the 8-bit formats)."""
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    if slot < 0:
        return
    blk = slot // PAGE
    off = slot % PAGE
    heads = tl.arange(0, HKV_P2)
    head_ok = heads < HKV
    cols = tl.arange(0, D)
    for half in tl.static_range(2):
        region = (blk * 2 + half) * HKV + heads
        if half == 0:
            src = key_ptr + t * stride_kt + heads * stride_kh
            code_row = codes_ptr + region * REGION_CODES + off * CODE_ROW
            code_cols = cols
        else:
            src = value_ptr + t * stride_vt + heads * stride_vh
            code_row = codes_ptr + region * REGION_CODES + off * V_ROW
            code_cols = cols * V_COL
        x = tl.load(src[:, None] + cols[None, :], mask=head_ok[:, None], other=0.0)
        x = x.to(tl.float32)
        if HADAMARD and half == 0:
            x = hadamard_rows(x, HKV_P2, D, LOG2_D)
        scale_row = scales_ptr + region * REGION_SCALES + SCALE_BASE + off * SCALE_ROW
        if KV_FMT == BF16:
            tl.store(
                code_row[:, None] + cols[None, :], to_bf16(x, INTERPRET), mask=head_ok[:, None]
            )
        elif KV_FMT == FP16:
            tl.store(code_row[:, None] + cols[None, :], x.to(tl.float16), mask=head_ok[:, None])
        elif KV_FMT == FP8_STATIC:
            if half == 0:
                y = x * k_inv_scale
            else:
                y = x * v_inv_scale
            y = tl.minimum(tl.maximum(y, -448.0), 448.0)
            codes = to_e4m3(y, INTERPRET)
            tl.store(code_row[:, None] + code_cols[None, :], codes, mask=head_ok[:, None])
        elif KV_FMT == FP8:
            codes, e = fp8_rows(x, True, INTERPRET)
            e = v_row_exponents(x, e)  # K rows too: a zero row's codes are zero
            tl.store(code_row[:, None] + code_cols[None, :], codes, mask=head_ok[:, None])
            tl.store(scale_row, e, mask=head_ok)
        else:
            packed, scale, _, _ = nvfp4_rows(x, HKV_P2, D, False, 1)
            half_cols = tl.arange(0, D // 2)
            groups = tl.arange(0, D // 16)
            tl.store(code_row[:, None] + half_cols[None, :], packed, mask=head_ok[:, None])
            scale_codes = to_e4m3(scale, INTERPRET).to(tl.uint8, bitcast=True)
            tl.store(scale_row[:, None] + groups[None, :], scale_codes, mask=head_ok[:, None])


@triton.jit
def _nvfp4_halves(
    codes, scale_codes, ROWS: tl.constexpr, D: tl.constexpr, INTERPRET: tl.constexpr
):
    """Exact FP16 values of packed NVFP4 rows: (even elements, odd elements), ``[ROWS, D/2]``.

    Each E2M1 nibble ``s e1 e0 m`` is re-encoded as the E4M3 byte ``s 0 0 e1 e0 m 0 0``
    (= value · 2^-6; subnormals map to subnormals), converted to FP16, and multiplied by
    its E4M3 block scale · 2^6 in FP16 — exact: ≤ 6 significant bits in [2^-10, 2688].
    On the GPU the re-encoding and conversion of four bytes is one opaque asm block, so
    Triton's layout pass cannot move a dot operand's layout change onto the 8-bit codes
    (which it would then read from shared memory byte by byte).
    """
    scale = (scale_codes.to(tl.float8e4nv, bitcast=True).to(tl.float32) * 64.0).to(tl.float16)
    if INTERPRET:
        lo8 = ((codes & 7) << 2) | ((codes & 8) << 4)
        hi8 = ((codes >> 2) & 0x1C) | (codes & 0x80)
        lo = lo8.to(tl.float8e4nv, bitcast=True).to(tl.float16)
        hi = hi8.to(tl.float8e4nv, bitcast=True).to(tl.float16)
    else:
        lo, hi = tl.inline_asm_elementwise(
            asm="""{
            .reg .b32 t0, t1, lo, hi;
            .reg .b16 a, b, c, d;
            shl.b32 t0, $4, 2;
            and.b32 t0, t0, 0x1C1C1C1C;
            shl.b32 t1, $4, 4;
            and.b32 t1, t1, 0x80808080;
            or.b32 lo, t0, t1;
            shr.b32 t0, $4, 2;
            and.b32 t0, t0, 0x1C1C1C1C;
            and.b32 t1, $4, 0x80808080;
            or.b32 hi, t0, t1;
            mov.b32 {a, b}, lo;
            cvt.rn.f16x2.e4m3x2 $0, a;
            cvt.rn.f16x2.e4m3x2 $1, b;
            mov.b32 {c, d}, hi;
            cvt.rn.f16x2.e4m3x2 $2, c;
            cvt.rn.f16x2.e4m3x2 $3, d;
            }""",
            constraints="=r,=r,=r,=r,r",
            args=[codes],
            dtype=(tl.float16, tl.float16),
            is_pure=False,
            pack=4,
        )
    lo = tl.reshape(tl.reshape(lo, (ROWS, D // 16, 8)) * scale[:, :, None], (ROWS, D // 2))
    hi = tl.reshape(tl.reshape(hi, (ROWS, D // 16, 8)) * scale[:, :, None], (ROWS, D // 2))
    return lo, hi


@triton.jit
def _dot(a, b, INTERPRET: tl.constexpr):
    """``a @ b`` with FP32 accumulation (FP32 operands under the interpreter, whose 16-bit
    dots are wrong; the operand values are exact either way)."""
    if INTERPRET:
        return tl.dot(a.to(tl.float32), b.to(tl.float32))
    return tl.dot(a, b)


@triton.jit
def _probabilities(t, ev_neg_pow2, KV_FMT: tl.constexpr, EXP_MODE: tl.constexpr,
                   INTERPRET: tl.constexpr):  # fmt: skip
    """(P̂ as the P·V operand, normaliser terms) for ``t = y − M`` (numerics.exp2). The
    operand is FP8 for the 8-bit caches (their V̂ codes multiply in FP8), FP16 for NVFP4.
    ``ev_neg_pow2``: ``2^-eV`` per key, broadcastable to ``t`` (``fp8`` only)."""
    P_FP8: tl.constexpr = KV_FMT == FP8 or KV_FMT == FP8_STATIC
    if EXP_MODE == MITCHELL:
        # RNE(scaled) as an integer straight from the bits of scaled + 1.5·2^23 (no float ->
        # int conversion instruction); the clamp keeps |scaled| < 2^22 for finite logits
        if KV_FMT == BF16:
            f = tl.maximum(t, -256.0) * 128.0 + RNE_MAGIC
            code = f.to(tl.int32, bitcast=True) - (MAGIC_BITS - 127 * 128)
            code = tl.where(code >= 128, code, 0)
            l_term = (code << 16).to(tl.float32, bitcast=True)
            p_op = code.to(tl.int16).to(tl.bfloat16, bitcast=True)
        elif KV_FMT == FP16:
            # FP16 code (E + 15) << 10 | m; its FP32 bits are (code + 112·2^10) << 13
            f = tl.maximum(t, -256.0) * 1024.0 + RNE_MAGIC
            code = f.to(tl.int32, bitcast=True) - (MAGIC_BITS - 15 * 1024)
            code = tl.where(code >= 1024, code, 0)
            l_term = tl.where(code > 0, (code + 112 * 1024) << 13, 0).to(tl.float32, bitcast=True)
            p_op = code.to(tl.int16).to(tl.float16, bitcast=True)
        else:
            # the E4M3 byte of P̂ is the code itself (exponent field code >> 3, bias 7)
            f = tl.maximum(t + P_SHIFT, -256.0) * 8.0 + RNE_MAGIC
            code = f.to(tl.int32, bitcast=True) - (MAGIC_BITS - 56)
            normal = code >= 8
            if P_FP8:
                p_op = tl.where(normal, code, 0).to(tl.uint8).to(tl.float8e4nv, bitcast=True)
            else:
                p_op = tl.where(normal, (code + 64) << 7, 0).to(tl.int16)
                p_op = p_op.to(tl.float16, bitcast=True)
            l_term = tl.where(normal, (code + L_BITS_BASE) << 20, 0).to(tl.float32, bitcast=True)
    else:
        if EXP_MODE == EXACT:
            p = tl.math.exp2(t)
        else:
            u = (t + 127.0) * 8388608.0
            u = tl.where(u > 0.0, u, 0.0)
            p = tl.maximum(u.to(tl.int32) - SCHRAUDOLPH_C_, 0).to(tl.float32, bitcast=True)
        l_term = p
        if KV_FMT == BF16:
            p_op = to_bf16(p, INTERPRET)
        elif KV_FMT == FP16:
            p_op = p.to(tl.float16)
        else:  # the normaliser sums the E4M3 P̂ itself, as the training forward (N3)
            p_op = to_e4m3(p * P_SCALE, INTERPRET)
            if not P_FP8:
                p_op = p_op.to(tl.float16)
            l_term = e4m3_value(p * P_SCALE) * (1.0 / P_SCALE)
    if KV_FMT == FP8:
        l_term = l_term * ev_neg_pow2
    return p_op, l_term


@triton.jit
def _tile_addresses(
    tile, bt_row, codes_ptr, scales_ptr, kvh, kv_lo, kv_hi,
    HKV: tl.constexpr, PAGE: tl.constexpr, REGION_CODES: tl.constexpr,
    REGION_SCALES: tl.constexpr, SCALE_BASE: tl.constexpr, CODE_ROW: tl.constexpr,
    SCALE_ROW: tl.constexpr, V_ROW: tl.constexpr, BLOCK_N: tl.constexpr, MASKED: tl.constexpr,
):  # fmt: skip
    """Keys ``n`` of a tile, which of them lie in ``[kv_lo, kv_hi)``, and the first code and
    scale of each key's K and V slot (``k_codes``, ``v_codes``, ``k_scales``, ``v_scales``).
    ``MASKED``: keys outside read a page of the sequence that holds keys of the range
    instead (the page index is clamped), so every load stays unmasked and 16 bytes wide
    without touching unallocated or evicted pages; the caller discards what those keys
    load."""
    n = tile * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = (n < kv_hi) & (n >= kv_lo)
    page = n // PAGE
    if MASKED:
        page = tl.minimum(tl.maximum(page, kv_lo // PAGE), (kv_hi - 1) // PAGE)
    k_region = tl.load(bt_row + page).to(tl.int64) * (2 * HKV) + kvh
    v_region = k_region + HKV
    off = n % PAGE
    k_codes = codes_ptr + k_region * REGION_CODES + off * CODE_ROW
    v_codes = codes_ptr + v_region * REGION_CODES + off * V_ROW
    k_scales = scales_ptr + k_region * REGION_SCALES + SCALE_BASE + off * SCALE_ROW
    v_scales = scales_ptr + v_region * REGION_SCALES + SCALE_BASE + off * SCALE_ROW
    return n, n_ok, k_codes, v_codes, k_scales, v_scales


@triton.jit
def _attend_tile(
    tile, m_i, l_i, acc, acc_odd, q_op, q_odd, row_scale, pos, bt_row, codes_ptr, scales_ptr,
    kvh, kv_lo, kv_hi, window,
    HKV: tl.constexpr, D: tl.constexpr, PAGE: tl.constexpr, REGION_CODES: tl.constexpr,
    REGION_SCALES: tl.constexpr, SCALE_BASE: tl.constexpr, CODE_ROW: tl.constexpr,
    SCALE_ROW: tl.constexpr, V_ROW: tl.constexpr, V_COL: tl.constexpr, BLOCK_N: tl.constexpr,
    HAS_WINDOW: tl.constexpr, KV_FMT: tl.constexpr, EXP_MODE: tl.constexpr,
    MASKED: tl.constexpr, ROW_MASK: tl.constexpr, INTERPRET: tl.constexpr,
):  # fmt: skip
    """One key tile of the online softmax: returns the updated ``(m, l, acc, acc_odd)``.

    ``MASKED`` (a tile that crosses ``kv_lo`` or ``kv_hi``): keys outside ``[kv_lo, kv_hi)``
    load other keys' bytes (:func:`_tile_addresses`), which never reach the result: their logits
    are replaced by −inf, their V rows and V exponents by 0 (unwritten slots may hold NaN).
    Otherwise every key of the tile is a written slot of the sequence. ``ROW_MASK``: some
    row must not see some key of ``[kv_lo, kv_hi)`` in the tile (causal diagonal, window);
    without it every row sees exactly those keys (a decode row always does).
    ``q_op``/``acc`` are the even halves for NVFP4 (``q_odd``/``acc_odd`` the odd ones).
    """
    n, n_ok, k_codes, v_codes, k_scales, v_scales = _tile_addresses(
        tile, bt_row, codes_ptr, scales_ptr, kvh, kv_lo, kv_hi, HKV, PAGE, REGION_CODES,
        REGION_SCALES, SCALE_BASE, CODE_ROW, SCALE_ROW, V_ROW, BLOCK_N, MASKED,
    )  # fmt: skip
    cols = tl.arange(0, D)
    half_cols = tl.arange(0, D // 2)
    groups = tl.arange(0, D // 16)

    if KV_FMT == NVFP4:
        kb = tl.load(k_codes[:, None] + half_cols[None, :])
        ks = tl.load(k_scales[:, None] + groups[None, :])
        k_even, k_odd = _nvfp4_halves(kb, ks, BLOCK_N, D, INTERPRET)
        s = _dot(q_op, tl.trans(k_even), INTERPRET)
        s += _dot(q_odd, tl.trans(k_odd), INTERPRET)
    else:  # K̂ᵀ [D, BLOCK_N] straight into the MMA (FP8 codes multiply in FP8)
        s = _dot(q_op, tl.load(k_codes[None, :] + cols[:, None]), INTERPRET)
    x = s * row_scale[:, None]
    ev_neg_pow2 = tl.zeros([BLOCK_N], dtype=tl.float32)
    if KV_FMT == FP8:
        ek = tl.load(k_scales)
        ev = tl.load(v_scales)
        if MASKED:
            ev = tl.where(n_ok, ev, 0)
        x = x * exp2i(ek)[None, :] + ev.to(tl.float32)[None, :]
        ev_neg_pow2 = exp2i(-ev)
    if ROW_MASK:
        allowed = n_ok[None, :] & (n[None, :] <= pos[:, None])
        if HAS_WINDOW:
            allowed &= n[None, :] > pos[:, None] - window
        y = tl.where(allowed, x, float("-inf"))
    elif MASKED:
        y = tl.where(n_ok[None, :], x, float("-inf"))
    else:
        y = x
    m_new = tl.maximum(m_i, tl.math.ceil(tl.max(y, axis=1)))
    alpha = exp2i(tl.maximum(m_i - m_new, -127.0).to(tl.int32))
    p_op, l_term = _probabilities(y - m_new[:, None], ev_neg_pow2[None, :], KV_FMT, EXP_MODE,
                                  INTERPRET)  # fmt: skip
    l_i = l_i * alpha + tl.sum(l_term, axis=1)
    if KV_FMT == NVFP4:
        vb = tl.load(v_codes[:, None] + half_cols[None, :])
        vs = tl.load(v_scales[:, None] + groups[None, :])
        if MASKED:
            vb = tl.where(n_ok[:, None], vb, 0)
            vs = tl.where(n_ok[:, None], vs, 0)
        v_even, v_odd = _nvfp4_halves(vb, vs, BLOCK_N, D, INTERPRET)
        acc = acc * alpha[:, None] + _dot(p_op, v_even, INTERPRET)
        acc_odd = acc_odd * alpha[:, None] + _dot(p_op, v_odd, INTERPRET)
    else:
        # [BLOCK_N, D]; the 8-bit caches' V̂ᵀ pages (V_COL = PAGE) make it K-major
        v = tl.load(v_codes[:, None] + cols[None, :] * V_COL)
        if MASKED:
            v = tl.where(n_ok[:, None], v, 0.0)
        acc = acc * alpha[:, None] + _dot(p_op, v, INTERPRET)
    return m_new, l_i, acc, acc_odd


@triton.jit
def _attend_tile_keys_on_m(
    tile, m_i, l_i, acc_t, q_op, row_scale, pos, bt_row, codes_ptr, scales_ptr, kvh, kv_lo,
    kv_hi, window,
    HKV: tl.constexpr, D: tl.constexpr, PAGE: tl.constexpr, REGION_CODES: tl.constexpr,
    REGION_SCALES: tl.constexpr, SCALE_BASE: tl.constexpr, CODE_ROW: tl.constexpr,
    SCALE_ROW: tl.constexpr, V_ROW: tl.constexpr, V_COL: tl.constexpr, BLOCK_N: tl.constexpr,
    HAS_WINDOW: tl.constexpr, KV_FMT: tl.constexpr, EXP_MODE: tl.constexpr,
    MASKED: tl.constexpr, ROW_MASK: tl.constexpr, INTERPRET: tl.constexpr,
):  # fmt: skip
    """:func:`_attend_tile` from an 8-bit cache with A and B swapped: the keys fill the
    MMA's M side (``Sᵀ = K̂·Q̂ᵀ``, ``Oᵀ += V̂ᵀ·P̂ᵀ``, both FP8 warpgroup MMAs reading K̂ and
    the V̂ᵀ page rows straight from shared memory; P̂ᵀ goes to shared memory as the B operand
    with no change of register layout) and the query rows its N side. ``acc_t`` is ``Oᵀ``
    ``[D, BLOCK_M]``; same numerics and masking as :func:`_attend_tile`."""
    n, n_ok, k_codes, v_codes, k_scales, v_scales = _tile_addresses(
        tile, bt_row, codes_ptr, scales_ptr, kvh, kv_lo, kv_hi, HKV, PAGE, REGION_CODES,
        REGION_SCALES, SCALE_BASE, CODE_ROW, SCALE_ROW, V_ROW, BLOCK_N, MASKED,
    )  # fmt: skip
    cols = tl.arange(0, D)
    s_t = _dot(tl.load(k_codes[:, None] + cols[None, :]), tl.trans(q_op), INTERPRET)
    x = s_t * row_scale[None, :]
    ev_neg_pow2 = tl.zeros([BLOCK_N], dtype=tl.float32)
    if KV_FMT == FP8:
        ek = tl.load(k_scales)
        ev = tl.load(v_scales)
        if MASKED:
            ev = tl.where(n_ok, ev, 0)
        x = x * exp2i(ek)[:, None] + ev.to(tl.float32)[:, None]
        ev_neg_pow2 = exp2i(-ev)
    if ROW_MASK:
        allowed = n_ok[:, None] & (n[:, None] <= pos[None, :])
        if HAS_WINDOW:
            allowed &= n[:, None] > pos[None, :] - window
        x = tl.where(allowed, x, float("-inf"))
    elif MASKED:
        x = tl.where(n_ok[:, None], x, float("-inf"))
    m_new = tl.maximum(m_i, tl.math.ceil(tl.max(x, axis=0)))
    alpha = exp2i(tl.maximum(m_i - m_new, -127.0).to(tl.int32))
    p_op, l_term = _probabilities(x - m_new[None, :], ev_neg_pow2[:, None], KV_FMT, EXP_MODE,
                                  INTERPRET)  # fmt: skip
    l_i = l_i * alpha + tl.sum(l_term, axis=0)
    vt = tl.load(v_codes[None, :] + cols[:, None] * V_COL)
    if MASKED:
        vt = tl.where(n_ok[None, :], vt, 0.0)
    acc_t = acc_t * alpha[None, :] + _dot(vt, p_op, INTERPRET)
    return m_new, l_i, acc_t


@triton.jit(do_not_specialize=("stride_bt", "part_tokens", "seq_begin", "num_seqs", "num_splits"))
def paged_attention_kernel(
    q_ptr, stride_qt, stride_qh,
    codes_ptr, scales_ptr, block_table_ptr, stride_bt, seq_lens_ptr, qsl_ptr,
    out_ptr, stride_ot, stride_oh, part_o_ptr, part_ml_ptr, part_tokens,
    seq_begin, num_seqs, num_splits, qk_scale, window, v_scale,
    HKV: tl.constexpr, GROUP: tl.constexpr, GROUP_P2: tl.constexpr, D: tl.constexpr,
    PAGE: tl.constexpr, REGION_CODES: tl.constexpr, REGION_SCALES: tl.constexpr,
    SCALE_BASE: tl.constexpr, CODE_ROW: tl.constexpr, SCALE_ROW: tl.constexpr,
    V_ROW: tl.constexpr, V_COL: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PARTIAL: tl.constexpr,
    DECODE: tl.constexpr, HAS_WINDOW: tl.constexpr, KV_FMT: tl.constexpr,
    EXP_MODE: tl.constexpr, KEYS_ON_M: tl.constexpr, INTERPRET: tl.constexpr,
):  # fmt: skip
    """Paged attention of sequences ``[seq_begin, seq_begin + num_seqs)``.

    Program ``(q block, kv head, split)``: ``BLOCK_M`` rows = ``BLOCK_M / GROUP_P2`` query
    tokens × the GQA group of ``kv head`` (every K/V tile is loaded once for the group).
    ``DECODE``: one query token per sequence, program ``i`` = sequence ``seq_begin + i``.
    Otherwise query blocks are numbered per sequence (``(qsl[s] − qsl[seq_begin]) //
    BLOCK_Q + (s − seq_begin)`` starts sequence ``s``) and found by binary search.
    ``num_splits`` (program axis 2) splits the key range; with ``PARTIAL`` partial (O, M, l)
    go to ``part_*`` (rows = the token's index, ``part_tokens`` rows per split) for
    ``combine_splits_kernel``, without it (``num_splits`` = 1) O goes to ``out``.
    ``qk_scale`` includes ``fp8_static``'s K scale; ``v_scale`` multiplies O (1 otherwise).
    Key tiles inside ``[kv_lo, kv_hi)`` run unmasked; at most one tile at each end is masked.
    ``KEYS_ON_M`` (8-bit caches): :func:`_attend_tile_keys_on_m`.
    """
    BLOCK_Q: tl.constexpr = BLOCK_M // GROUP_P2
    pid = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    if DECODE:
        seq = seq_begin + pid
        q_block = 0
    else:
        base = tl.load(qsl_ptr + seq_begin)
        lo = seq_begin
        hi = seq_begin + num_seqs
        while hi - lo > 1:
            mid = (lo + hi) // 2
            start = (tl.load(qsl_ptr + mid) - base) // BLOCK_Q + (mid - seq_begin)
            lo = tl.where(start <= pid, mid, lo)
            hi = tl.where(start <= pid, hi, mid)
        seq = lo
        q_block = pid - ((tl.load(qsl_ptr + seq) - base) // BLOCK_Q + (seq - seq_begin))
    q_start = tl.load(qsl_ptr + seq)
    q_len = tl.load(qsl_ptr + seq + 1) - q_start
    tok0 = q_block * BLOCK_Q
    if tok0 >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    ctx0 = seq_len - q_len

    rows = tl.arange(0, BLOCK_M)
    tok = tok0 + rows // GROUP_P2
    in_group = rows % GROUP_P2
    row_ok = (tok < q_len) & (in_group < GROUP)
    head = kvh * GROUP + in_group
    pos = ctx0 + tok
    cols = tl.arange(0, D)
    q_row = q_ptr + (q_start + tok).to(tl.int64) * stride_qt + head * stride_qh
    q = tl.load(q_row[:, None] + cols[None, :], mask=row_ok[:, None], other=0.0).to(tl.float32)
    row_scale = tl.zeros([BLOCK_M], dtype=tl.float32) + qk_scale
    q_odd = q  # used by NVFP4 only
    if KV_FMT == BF16:
        q_op = to_bf16(q, INTERPRET)
    elif KV_FMT == FP16:
        q_op = q.to(tl.float16)
    elif KV_FMT == FP8 or KV_FMT == FP8_STATIC:
        q_op, eq = fp8_rows(q, True, INTERPRET)  # E4M3: Q̂·K̂ᵀ is an FP8 MMA
        row_scale = row_scale * exp2i(eq)
    else:
        eq = pow2_exponent_ceil(tl.max(tl.abs(q), axis=1), Q16_EXP, 0)
        q16 = (q * exp2i(-eq)[:, None]).to(tl.float16)
        q_op, q_odd = tl.split(tl.reshape(q16, (BLOCK_M, D // 2, 2)))
        row_scale = row_scale * exp2i(eq)

    last_tok = tl.minimum(tok0 + BLOCK_Q, q_len) - 1
    kv_hi = ctx0 + last_tok + 1
    kv_lo = 0
    if HAS_WINDOW:
        kv_lo = tl.maximum(ctx0 + tok0 - window + 1, 0)
    tile_lo = kv_lo // BLOCK_N
    n_tiles = tl.cdiv(kv_hi, BLOCK_N) - tile_lo
    per_split = tl.cdiv(n_tiles, num_splits)
    t_begin = tile_lo + split * per_split
    t_end = tl.minimum(t_begin + per_split, tile_lo + n_tiles)
    # full tiles [full_lo, full_hi): inside [kv_lo, kv_hi)
    full_lo = t_begin
    if HAS_WINDOW:
        full_lo = tl.minimum(tl.maximum(t_begin, tl.cdiv(kv_lo, BLOCK_N)), t_end)
    full_hi = tl.maximum(tl.minimum(t_end, kv_hi // BLOCK_N), full_lo)

    m_i = tl.zeros([BLOCK_M], dtype=tl.float32) + NO_MAX
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    if KV_FMT == NVFP4:
        acc = tl.zeros([BLOCK_M, D // 2], dtype=tl.float32)
        acc_odd = tl.zeros([BLOCK_M, D // 2], dtype=tl.float32)
    else:
        acc = tl.zeros([BLOCK_M, D], dtype=tl.float32)
        acc_odd = tl.zeros([1], dtype=tl.float32)
    bt_row = block_table_ptr + seq.to(tl.int64) * stride_bt
    if KEYS_ON_M:
        acc = tl.zeros([D, BLOCK_M], dtype=tl.float32)  # Oᵀ
    # four runs of tiles: the masked head, full tiles every row sees whole (decodes: all of
    # them; prefill blocks: keys before the block's first token, still windowed), full
    # tiles on the causal diagonal, the masked tail
    free_hi = full_hi
    if not DECODE:
        free_hi = tl.minimum(tl.maximum((ctx0 + tok0 + 1) // BLOCK_N, full_lo), full_hi)
    WINDOWED: tl.constexpr = HAS_WINDOW and not DECODE
    # a decode row sees exactly [kv_lo, kv_hi): its tiles need no row mask
    for run in tl.static_range(4):
        if run == 0:
            lo, hi = t_begin, full_lo
        elif run == 1:
            lo, hi = full_lo, free_hi
        elif run == 2:
            lo, hi = free_hi, full_hi
        else:
            lo, hi = full_hi, t_end
        for tile in range(lo, hi):
            if KEYS_ON_M:
                m_i, l_i, acc = _attend_tile_keys_on_m(
                    tile, m_i, l_i, acc, q_op, row_scale, pos, bt_row, codes_ptr, scales_ptr,
                    kvh, kv_lo, kv_hi, window, HKV, D, PAGE, REGION_CODES, REGION_SCALES,
                    SCALE_BASE, CODE_ROW, SCALE_ROW, V_ROW, V_COL, BLOCK_N, HAS_WINDOW, KV_FMT,
                    EXP_MODE, run == 0 or run == 3, (run != 1 or WINDOWED) and not DECODE,
                    INTERPRET,
                )  # fmt: skip
            else:
                m_i, l_i, acc, acc_odd = _attend_tile(
                    tile, m_i, l_i, acc, acc_odd, q_op, q_odd, row_scale, pos, bt_row,
                    codes_ptr, scales_ptr, kvh, kv_lo, kv_hi, window, HKV, D, PAGE,
                    REGION_CODES, REGION_SCALES, SCALE_BASE, CODE_ROW, SCALE_ROW, V_ROW, V_COL,
                    BLOCK_N, HAS_WINDOW, KV_FMT, EXP_MODE, run == 0 or run == 3,
                    (run != 1 or WINDOWED) and not DECODE, INTERPRET,
                )  # fmt: skip
    if KEYS_ON_M:
        acc = tl.trans(acc)

    inv_l = 1.0 / tl.where(l_i > 0.0, l_i, 1.0)
    if KV_FMT != BF16 and KV_FMT != FP16:
        inv_l = inv_l / P_SCALE
    if KV_FMT == FP8_STATIC:
        inv_l = inv_l * v_scale
    tokens = (q_start + tok).to(tl.int64)
    if not PARTIAL:
        o_row = out_ptr + tokens * stride_ot + head * stride_oh
    else:
        o_row = part_o_ptr + ((split * part_tokens + tokens) * (HKV * GROUP) + head) * D
        ml_row = part_ml_ptr + ((split * part_tokens + tokens) * (HKV * GROUP) + head) * 2
        tl.store(ml_row, m_i, mask=row_ok)
        tl.store(ml_row + 1, l_i, mask=row_ok)
    half_cols = tl.arange(0, D // 2)
    if KV_FMT == NVFP4:
        o_even = to_out(acc * inv_l[:, None], o_row, INTERPRET)
        o_odd = to_out(acc_odd * inv_l[:, None], o_row, INTERPRET)
        tl.store(o_row[:, None] + 2 * half_cols[None, :], o_even, mask=row_ok[:, None])
        tl.store(o_row[:, None] + 2 * half_cols[None, :] + 1, o_odd, mask=row_ok[:, None])
    else:
        o = to_out(acc * inv_l[:, None], o_row, INTERPRET)
        tl.store(o_row[:, None] + cols[None, :], o, mask=row_ok[:, None])


@triton.jit(do_not_specialize=("part_tokens", "num_splits"))
def combine_splits_kernel(
    part_o_ptr, part_ml_ptr, out_ptr, stride_ot, stride_oh, part_tokens, heads, num_splits,
    D: tl.constexpr, INTERPRET: tl.constexpr,
):  # fmt: skip
    """Merge the ``num_splits`` partials of one (token, head): weights ``l_s · 2^(M_s − max
    M)``, summed in split order."""
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    m_max = NO_MAX
    for s in range(num_splits):
        m_max = tl.maximum(m_max, tl.load(part_ml_ptr + ((s * part_tokens + t) * heads + h) * 2))
    cols = tl.arange(0, D)
    total = 0.0
    acc = tl.zeros([D], dtype=tl.float32)
    for s in range(num_splits):
        row = (s * part_tokens + t) * heads + h
        m = tl.load(part_ml_ptr + row * 2)
        weight = tl.load(part_ml_ptr + row * 2 + 1) * exp2i(
            tl.maximum(m - m_max, -127.0).to(tl.int32))
        total += weight
        acc += tl.load(part_o_ptr + row * D + cols) * weight
    merged = acc / tl.where(total > 0.0, total, 1.0)
    tl.store(out_ptr + t * stride_ot + h * stride_oh + cols, to_out(merged, out_ptr, INTERPRET))


# ------------------------------------------------------------------ FP8-cache prefill operands
# The prefill of the fp8 cache runs the training forward's CuTe kernel (same numerics: per-token
# Q exponents, per-key K and V exponents). These kernels lay its operands out from the cache.


@triton.jit(do_not_specialize=("first", "count"))
def prefill_offsets_kernel(
    seq_lens_ptr, qsl_ptr, first, count, cu_q_ptr, cu_k_ptr, vt_start_ptr,
    B_P2: tl.constexpr, ALIGN: tl.constexpr,
):  # fmt: skip
    """One program, for the ``count`` sequences from ``first``: query and key prefix sums
    (``cu_q``, ``cu_k``, ``count + 1`` int32 each) and each sequence's first column in the
    column layout (key counts padded to ``ALIGN``)."""
    i = tl.arange(0, B_P2)
    ok = i < count
    keys = tl.load(seq_lens_ptr + first + i, mask=ok, other=0)
    q_end = tl.load(qsl_ptr + first + 1 + i, mask=ok, other=0) - tl.load(qsl_ptr + first)
    padded = (keys + ALIGN - 1) // ALIGN * ALIGN
    tl.store(cu_q_ptr + i, tl.zeros_like(i), mask=i == 0)
    tl.store(cu_k_ptr + i, tl.zeros_like(i), mask=i == 0)
    tl.store(cu_q_ptr + 1 + i, q_end, mask=ok)
    tl.store(cu_k_ptr + 1 + i, tl.cumsum(keys, 0), mask=ok)
    tl.store(vt_start_ptr + i, tl.cumsum(padded, 0) - padded, mask=ok)


@triton.jit
def _v_t_order(x):
    """``[R, G, 16]`` -> the same groups with their 16 columns in the column layout's order
    (column ``4b + 2a + c`` takes column ``8a + 2b + c``: ``operands.v_t_position``)."""
    rows: tl.constexpr = x.shape[0]
    groups: tl.constexpr = x.shape[1]
    x = tl.reshape(x, (rows, groups, 2, 4, 2))
    return tl.reshape(tl.permute(x, (0, 1, 3, 2, 4)), (rows, groups, 16))


# t_pad stays specialised: always a multiple of ALIGN >= 16 (one variant), and that lets the
# V̂ᵀ / factor stores be 16-byte vectors
@triton.jit(do_not_specialize=("stride_bt", "first"))
def prefill_operands_kernel(
    cache_ptr, scales_ptr, block_table_ptr, stride_bt, seq_lens_ptr, first, cu_k_ptr,
    vt_start_ptr, k_out_ptr, v_t_ptr, factors_ptr, t_pad,
    HKV: tl.constexpr, D: tl.constexpr, PAGE: tl.constexpr, REGION_CODES: tl.constexpr,
    REGION_SCALES: tl.constexpr, SCALE_BASE: tl.constexpr, CODE_ROW: tl.constexpr,
    SCALE_ROW: tl.constexpr, V_ROW: tl.constexpr, V_COL: tl.constexpr, ALIGN: tl.constexpr,
    CHUNK: tl.constexpr, HEADS: tl.constexpr,
):  # fmt: skip
    """``CHUNK`` keys (``CHUNK / 16`` groups of 16, each inside one page) of one sequence
    (``first + program 0``) and ``HEADS`` K/V heads (a power of two dividing ``HKV``, from
    ``HEADS · program 2``): K codes to token-major ``k_out`` ``[*, HKV, D]`` (row ``cu_k[b] +
    key``), V codes (dim-major pages, ``V_ROW`` = 1) to the column layout ``v_t`` ``[HKV, D,
    t_pad]`` and the factors ``2^eK``, ``eV``, ``2^-eV`` to ``factors`` ``[HKV, 3, t_pad]``
    (operands.KernelQKV). Every group's loads are one tile (all in flight at once; a group's
    page index is one value, so its 16 slots load as vectors) and its column-layout stores
    are ``CHUNK`` contiguous columns (the order is permuted in registers). Groups past the
    sequence up to its ``ALIGN``-padded end get zero codes and factors (the forward loads
    whole tiles)."""
    b = tl.program_id(0)
    seq = first + b
    k0 = tl.program_id(1) * CHUNK  # first key of the chunk
    length = tl.load(seq_lens_ptr + seq)
    padded = (length + ALIGN - 1) // ALIGN * ALIGN
    if k0 < padded:
        GROUPS: tl.constexpr = CHUNK // 16
        hh = tl.program_id(2) * HEADS + tl.arange(0, HEADS)
        k_base = tl.load(cu_k_ptr + b).to(tl.int64)
        col_base = tl.multiple_of(tl.load(vt_start_ptr + b).to(tl.int64), 16)  # ALIGN >= 16
        cols = tl.arange(0, D)
        r16 = tl.arange(0, 16)
        g0 = k0 + tl.arange(0, GROUPS) * 16  # first key of each group
        # past the sequence, page 0 stands in (loads stay in the cache; stores are masked)
        blk = tl.load(block_table_ptr + seq * stride_bt + g0 // PAGE, mask=g0 < length,
                      other=0).to(tl.int64)  # fmt: skip
        keys = g0[:, None] + r16[None, :]  # [GROUPS, 16]
        ok = keys < length
        off = tl.multiple_of(g0 % PAGE, 16)[:, None] + r16[None, :]
        k_region = blk[None, :] * 2 * HKV + hh[:, None]  # [HEADS, GROUPS]
        v_region = k_region + HKV
        k = tl.load(cache_ptr + (k_region * REGION_CODES)[:, :, None, None]
                    + (off * CODE_ROW)[None, :, :, None]
                    + cols[None, None, None, :])  # [HEADS, GROUPS, 16, D]  # fmt: skip
        k_rows = (k_base + keys) * HKV
        tl.store(k_out_ptr + (k_rows[None, :, :, None] + hh[:, None, None, None]) * D
                 + cols[None, None, None, :], k, mask=ok[None, :, :, None])  # fmt: skip
        v = tl.load(cache_ptr + (v_region * REGION_CODES)[:, None, :, None]
                    + cols[None, :, None, None] * V_COL
                    + (off * V_ROW)[None, None, :, :])  # [HEADS, D, GROUPS, 16]  # fmt: skip
        v = tl.where(ok[None, None, :, :], v, 0)
        v = tl.reshape(_v_t_order(tl.reshape(v, (HEADS * D, GROUPS, 16))), (HEADS, D, GROUPS, 16))
        v_rows = (hh[:, None] * D + cols[None, :]).to(tl.int64) * t_pad  # [HEADS, D]
        v_cols = col_base + keys  # [GROUPS, 16]
        live = (g0 < padded)[:, None]
        tl.store(v_t_ptr + v_rows[:, :, None, None] + v_cols[None, None, :, :], v,
                 mask=live[None, None, :, :])  # fmt: skip
        col = col_base + k0 + tl.arange(0, CHUNK)
        live = tl.reshape(tl.broadcast_to(live, (GROUPS, 16)), (CHUNK,))
        scale_at = SCALE_BASE + off * SCALE_ROW  # [GROUPS, 16]
        e_k = tl.load(scales_ptr + (k_region * REGION_SCALES)[:, :, None] + scale_at[None, :, :],
                      mask=ok[None, :, :], other=0)  # [HEADS, GROUPS, 16]  # fmt: skip
        e_v = tl.load(scales_ptr + (v_region * REGION_SCALES)[:, :, None] + scale_at[None, :, :],
                      mask=ok[None, :, :], other=0)  # fmt: skip
        factors = factors_ptr + (hh * 3 * t_pad)[:, None] + col[None, :]
        store_ok = live[None, :]
        tl.store(factors, _chunk_order(tl.where(ok[None, :, :], exp2i(e_k), 0.0)),
                 mask=store_ok)  # fmt: skip
        tl.store(factors + t_pad, _chunk_order(tl.where(ok[None, :, :], e_v.to(tl.float32), 0.0)),
                 mask=store_ok)  # fmt: skip
        tl.store(factors + 2 * t_pad, _chunk_order(tl.where(ok[None, :, :], exp2i(-e_v), 0.0)),
                 mask=store_ok)  # fmt: skip


@triton.jit
def _chunk_order(x):
    """``[HEADS, GROUPS, 16]`` -> ``[HEADS, GROUPS · 16]`` in the column layout's order."""
    return tl.reshape(_v_t_order(x), (x.shape[0], x.shape[1] * 16))


@triton.jit(do_not_specialize=("n_tokens",))
def quantize_q_tokens_kernel(
    q_ptr, stride_qt, stride_qh, n_tokens, codes_ptr, exp_ptr,
    HQ: tl.constexpr, D: tl.constexpr, BLOCK: tl.constexpr, INTERPRET: tl.constexpr,
):  # fmt: skip
    """Q per token (N1, as the fp8 cache's reference): E4M3 codes ``[T, HQ, D]`` and int16
    exponents ``[HQ, T]`` (head-major), ``BLOCK`` tokens of one head per program."""
    tok = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    h = tl.program_id(1)
    ok = tok < n_tokens
    cols = tl.arange(0, D)
    x = tl.load(q_ptr + tok.to(tl.int64)[:, None] * stride_qt + h * stride_qh + cols[None, :],
                mask=ok[:, None], other=0.0).to(tl.float32)  # fmt: skip
    codes, e = fp8_rows(x, True, INTERPRET)
    tl.store(codes_ptr + (tok.to(tl.int64) * HQ + h)[:, None] * D + cols[None, :], codes,
             mask=ok[:, None])  # fmt: skip
    tl.store(exp_ptr + h * n_tokens + tok, e.to(tl.int16), mask=ok)
