"""Reference twin of the FLAMIA attention core: plain PyTorch, float32 math (DESIGN.md §2).

Definitions, per document and query row ``i`` (keys ``j`` in the same document, ``j <= i``
when causal), with ``c = softmax_scale * log2(e)``:

* scores ``x_ij = (Q̂_i · K̂_j) 2^(eQ_i + eK_j) c`` from the stored codes (base-2 logits);
  with the Hadamard option Q and K are rotated by the unnormalized transform and ``c`` also
  carries the exact ``1/d`` that restores the scores;
* V fold (N3): ``y_ij = x_ij + eV_j``; row reference ``M_i = ceil(max_j y_ij)`` (an integer,
  so a kernel with integer running maxima differs only in E4M3's subnormal range);
* ``P'_ij = 2^(y_ij − M_i)`` in (0, 1]; ``P̂ = E4M3(P' 2^8)`` (N5; ``P_HAT_EXP``: the shift
  keeps P̂ <= 448 and pushes E4M3's subnormal range below 2^-14 of the row max);
  ``l_i = Σ_j P̂_ij 2^(−eV_j − 8)`` (the quantized P̂ itself, N3); ``O_i = Σ_j P̂_ij V̂_j /
  (2^8 l_i)`` is then a convex combination of V̂ rows, and the backward's dS rows sum to
  zero (an unquantized l left each row a bias of up to P's E4M3 rounding, 6%, which the
  mean key direction amplified into Q/K gradients that drifted from BF16 as training
  sharpened attention: ``benchmarks/results/grad_fidelity_bf16.json``);
  row statistics: ``M`` and ``lse = M + log2(l)`` (log2 Σ_j 2^x_ij up to P̂'s rounding),
  float32 ``[T, Hq]``.

Backward (N5, N6; ``attention_backward``, twin of the backward kernels):

* dO: ``dÔ`` E4M3 with token-block exponents; ``D_i = rowsum(dÔ_i ∘ O_i)`` (the same dÔ
  that dP uses); ``Ĝ`` = E4M3 of ``G_i = f_i dO_i`` with token-block exponents, where
  ``f_i = 2^(M_i − 8 − lse_i) = 1 / (2^8 l_i)`` is the forward's normaliser (``quantize_do``).
* P̂ is rebuilt from the stored codes exactly as above; ``dV_j = 2^(−eV_j) Σ_i P̂_ij Ĝ_i``
  (P̂·V̂ of the forward, transposed; folding ``f`` into G keeps every scale of this product
  constant along its contraction over 32-query blocks);
* ``dP = dÔ·V̂ᵀ``; ``dS = P ∘ (dP − D)`` with ``P_ij = P̂_ij 2^(−eV_j) f_i`` (the forward's
  quantized, normalized probabilities: each row sums to 1; straight-through);
* ``dK = scale · Σ_i Ŝᴷ_ij Q̂_i`` with ``Ŝᴷ`` = dS ∘ 2^(eQ_i) quantized to E4M3 with one
  exponent per ``recipe.ds_block`` (32 queries × 32 keys, document-local): the paper's dS
  blocks (bit-identical to quantizing dS and scaling by Q's token-block exponent);
* ``dQ = scale · Σ_j Ŝᵠ_ij K̂_j`` with ``Ŝᵠ`` = dS ∘ 2^(eK_j) quantized with one exponent per
  ``recipe.dq_ds_block`` (32 queries × 64 keys): on Hopper an MMA needs its scale constant
  along the contraction (keys), so one exponent spans a whole 64-key tile (DESIGN N6).
  With per-token Q/K exponents (``exact_causal``) the folds are what make both products
  MMA-shaped; Q̂/K̂ here are the E4M3 codes (also in the mixed recipe), or with
  ``recipe.grad_qk == "input"`` the unquantized Q/K over the same exponents
  (``QuantizedQKV.q_grad``/``k_grad``, BF16 ``Q·2^-eQ``): the same dŜ, a better operand.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch
from torch.autograd.function import once_differentiable

from flamia_serve.numerics import (
    P_HAT_EXP,
    V_ZERO_EXPONENT,
    Granularity,
    Recipe,
    document_slices,
    e4m3_encode,
    exp2i,
    grad_operand,
    hadamard_transform,
    quantize_blocks_2d,
    quantize_fp8,
    quantize_nvfp4,
    resolve_recipe,
)
from flamia_serve.numerics.checks import check_flag, check_softmax_scale, check_varlen_inputs
from flamia_serve.numerics.operands import QuantizedDO, QuantizedQKV

LOG2E = math.log2(math.e)


def quantize_qkv(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor,
    recipe: Recipe,
    exact_causal: bool,
) -> QuantizedQKV:
    """Quantize Q, K, V for ``recipe`` (reference twin of the fused quantization kernel)."""
    qk_gran = Granularity.TOKEN if exact_causal else Granularity.TOKEN_BLOCK
    q8 = quantize_fp8(q, cu_seqlens, qk_gran, recipe.token_block)
    k8 = quantize_fp8(k, cu_seqlens, qk_gran, recipe.token_block)
    v8 = quantize_fp8(v, cu_seqlens, Granularity.TOKEN, zero_exponent=V_ZERO_EXPONENT)
    grads = {}
    if recipe.grad_input:
        grads = dict(q_grad=grad_operand(q, q8.exponents), k_grad=grad_operand(k, k8.exponents))
    if recipe.qk_format == "e4m3":
        return QuantizedQKV(q8, k8, v8, **grads)
    nvfp4 = functools.partial(quantize_nvfp4, scale_candidates=recipe.nvfp4_scale_candidates)
    if not recipe.hadamard:
        return QuantizedQKV(q8, k8, v8, nvfp4(q), nvfp4(k), **grads)
    qr, kr = hadamard_transform(q), hadamard_transform(k)
    return QuantizedQKV(q8, k8, v8, nvfp4(qr), nvfp4(kr), 1.0 / q.shape[-1], **grads)


def _qk_operands(
    qkv: QuantizedQKV,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Score operands without their per-token power of two, and those exponents."""
    if qkv.q4 is not None and qkv.k4 is not None:
        return (
            qkv.q4.dequantize(second_level=False),
            qkv.k4.dequantize(second_level=False),
            qkv.q4.exponents,
            qkv.k4.exponents,
        )
    return qkv.q8.codes.float(), qkv.k8.codes.float(), qkv.q8.exponents, qkv.k8.exponents


def _per_q_head(x: torch.Tensor, group: int) -> torch.Tensor:
    """``[L, Hkv, ...]`` -> ``[L, Hq, ...]`` (query head h reads kv head h // group)."""
    return x.repeat_interleave(group, dim=1) if group > 1 else x


@dataclass(frozen=True)
class _DocProbs:
    mask: torch.Tensor  # [L, L] bool, key allowed
    x: torch.Tensor  # [Hq, L, L] base-2 logits, -inf where masked
    p_hat: torch.Tensor  # [Hq, L, L] E4M3 P̂ = E4M3(2^(y − M + 8)) as float32, 0 where masked
    m: torch.Tensor  # [Hq, L] integer row reference
    ev: torch.Tensor  # [Hq, L] V exponents per key (float)


def p_hat_values(y: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """P̂ as float32: ``E4M3(2^(y − (m − P_HAT_EXP)))`` for base-2 logits ``y`` and their row
    reference ``m`` (broadcast), the kernels' operations. The cast saturates at 448, as the
    kernels' conversion does: past 448 only where ``m − P_HAT_EXP`` is not a float32
    (|logits| ≳ 2^27 round it to a multiple of 16; 2^16 would cast to NaN)."""
    return e4m3_encode(torch.exp2(y - (m - P_HAT_EXP))).float()


def _doc_probs(
    qkv: QuantizedQKV,
    operands: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor],
    sl: slice,
    group: int,
    causal: bool,
    softmax_scale: float,
) -> _DocProbs:
    """Scores, row references and P̂ of document ``sl``, per query head (``operands`` from
    ``_qk_operands``)."""
    qs_all, ks_all, eq_all, ek_all = operands
    qs, eq = qs_all[sl], eq_all[sl]
    ks, ek = _per_q_head(ks_all[sl], group), _per_q_head(ek_all[sl], group)
    ev = _per_q_head(qkv.v8.exponents[sl], group)
    scale = softmax_scale * qkv.qk_rescale
    length = qs.shape[0]
    dots = torch.einsum("ihd,jhd->hij", qs, ks)
    row = exp2i(eq.int()).t()[:, :, None]  # [Hq, L, 1]
    col = exp2i(ek.int()).t()[:, None, :]  # [Hq, 1, L]
    x = dots * row * col * (scale * LOG2E)
    mask = torch.ones(length, length, dtype=torch.bool, device=qs.device)
    if causal:
        mask = torch.tril(mask)
    x = x.masked_fill(~mask, float("-inf"))
    evf = ev.float().t()  # [Hq, L]
    y = x + evf[:, None, :]
    m = torch.ceil(y.amax(dim=-1))
    p_hat = p_hat_values(y, m[..., None])
    return _DocProbs(mask, x, p_hat, m, evf)


def attention_forward(
    qkv: QuantizedQKV,
    cu_seqlens: torch.Tensor,
    *,
    heads_q: int,
    causal: bool,
    softmax_scale: float,
    out_dtype: torch.dtype = torch.bfloat16,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Forward from quantized operands: ``(O [T, Hq, d] out_dtype, M [T, Hq], lse [T, Hq])``.

    ``M`` is the integer row reference and ``lse`` the base-2 log-sum-exp (float32).
    """
    operands = _qk_operands(qkv)
    total, _, d = qkv.v8.codes.shape
    group = heads_q // qkv.v8.codes.shape[1]
    dev = qkv.v8.codes.device
    out = torch.zeros(total, heads_q, d, dtype=torch.float32, device=dev)
    m_all = torch.zeros(total, heads_q, dtype=torch.float32, device=dev)
    lse_all = torch.zeros_like(m_all)
    for sl in document_slices(cu_seqlens):
        vc = _per_q_head(qkv.v8.codes[sl].float(), group)
        probs = _doc_probs(qkv, operands, sl, group, causal, softmax_scale)
        # l sums P̂ itself (N3), in units of 2^-8: O is a convex combination of V̂ rows
        l_row = (probs.p_hat * exp2i(-probs.ev.int())[:, None, :]).sum(-1) / 2.0**P_HAT_EXP
        pv = torch.einsum("hij,jhd->ihd", probs.p_hat, vc)
        o = pv / (l_row.t()[..., None] * 2.0**P_HAT_EXP)
        out[sl] = o
        m_all[sl] = probs.m.t()
        lse_all[sl] = (probs.m + torch.log2(l_row)).t()
    return out.to(out_dtype), m_all, lse_all


def quantize_do(
    d_out: torch.Tensor,
    out: torch.Tensor,
    m_rows: torch.Tensor,
    lse_rows: torch.Tensor,
    cu_seqlens: torch.Tensor,
    recipe: Recipe,
    *,
    row_factor: torch.Tensor | None = None,
) -> QuantizedDO:
    """dÔ, Ĝ and D of the backward (twin of the fused dO kernel, module docstring).

    ``row_factor`` ``[T, Hq]`` float32 replaces ``f = 2^(M − 8 − lse)`` (tests pass the
    kernel's, whose ``exp2`` may differ in the last bit, to compare the codes bit for bit).
    """
    do8 = quantize_fp8(d_out, cu_seqlens, Granularity.TOKEN_BLOCK, recipe.token_block)
    delta = (do8.dequantize() * out.float()).sum(-1)
    f = torch.exp2(m_rows - P_HAT_EXP - lse_rows) if row_factor is None else row_factor
    g8 = quantize_fp8(d_out.float() * f[..., None], cu_seqlens, Granularity.TOKEN_BLOCK,
                      recipe.token_block)  # fmt: skip
    return QuantizedDO(do8, g8, delta)


def _fold_quantize(ds: torch.Tensor, factor: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """``E4M3(ds ∘ factor)`` with one exponent per ``block``, dequantized (float32)."""
    return quantize_blocks_2d(ds * factor, block).dequantize()


def backward_probs(
    qkv: QuantizedQKV,
    cu_seqlens: torch.Tensor,
    m_rows: torch.Tensor,
    *,
    heads_q: int,
    causal: bool,
    softmax_scale: float,
) -> list[torch.Tensor]:
    """P̂ per document as the backward rebuilds it: float32 ``[Hq, L, L]`` each (debug)."""
    operands = _qk_operands(qkv)
    group = heads_q // qkv.v8.codes.shape[1]
    return [
        _doc_probs(qkv, operands, sl, group, causal, softmax_scale).p_hat
        for sl in document_slices(cu_seqlens)
    ]


def _backward_documents(
    d_out: torch.Tensor,
    out: torch.Tensor,
    m_rows: torch.Tensor,
    lse_rows: torch.Tensor,
    qkv: QuantizedQKV,
    cu_seqlens: torch.Tensor,
    qdo: QuantizedDO,
    *,
    causal: bool,
    softmax_scale: float,
):
    """Per document: ``(slice, probs, v_inv [Hq, 1, L], dS [Hq, L, L])`` (unquantized dS)."""
    operands = _qk_operands(qkv)
    heads_q = d_out.shape[1]
    group = heads_q // qkv.v8.codes.shape[1]
    do_q = qdo.do8.dequantize()
    v_deq = qkv.v8.dequantize()
    for sl in document_slices(cu_seqlens):
        probs = _doc_probs(qkv, operands, sl, group, causal, softmax_scale)
        f = torch.exp2(m_rows[sl].t() - P_HAT_EXP - lse_rows[sl].t())  # [Hq, L]
        v_inv = exp2i(-probs.ev.int())[:, None, :]  # [Hq, 1, L]
        dp = torch.einsum("ihd,jhd->hij", do_q[sl], _per_q_head(v_deq[sl], group))
        # P̂ normalized (each row sums to 1); the two factors first: a zero V row has 2^-eV =
        # 2^127, which times P̂ alone could overflow
        p = probs.p_hat * (v_inv * f[..., None])
        yield sl, probs, v_inv, p * (dp - qdo.delta[sl].t()[..., None])


def backward_ds(
    d_out: torch.Tensor,
    out: torch.Tensor,
    m_rows: torch.Tensor,
    lse_rows: torch.Tensor,
    qkv: QuantizedQKV,
    cu_seqlens: torch.Tensor,
    recipe: Recipe,
    *,
    causal: bool,
    softmax_scale: float,
) -> list[torch.Tensor]:
    """Unquantized dS per document, float32 ``[Hq, L, L]`` each (for ablations of N6)."""
    qdo = quantize_do(d_out, out, m_rows, lse_rows, cu_seqlens, recipe)
    docs = _backward_documents(d_out, out, m_rows, lse_rows, qkv, cu_seqlens, qdo, causal=causal,
                               softmax_scale=softmax_scale)  # fmt: skip
    return [ds for _sl, _probs, _v_inv, ds in docs]


def _grad_operands(qkv: QuantizedQKV, recipe: Recipe) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 Q and K operands of dK/dQ in the codes' units: the codes, or the inputs'
    ``grad_operand`` (``recipe.grad_qk == "input"``)."""
    if not recipe.grad_input:
        return qkv.q8.codes.float(), qkv.k8.codes.float()
    if qkv.q_grad is None or qkv.k_grad is None:
        raise ValueError(
            f"recipe {recipe.name} multiplies dS by the unquantized Q/K: qkv lacks q_grad/k_grad "
            "(quantize with that recipe)"
        )
    return qkv.q_grad.float(), qkv.k_grad.float()


def attention_backward(
    d_out: torch.Tensor,
    out: torch.Tensor,
    m_rows: torch.Tensor,
    lse_rows: torch.Tensor,
    qkv: QuantizedQKV,
    cu_seqlens: torch.Tensor,
    recipe: Recipe,
    *,
    causal: bool,
    softmax_scale: float,
    qdo: QuantizedDO | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """float32 ``(dQ [T, Hq, d], dK [T, Hkv, d], dV [T, Hkv, d])`` (module docstring).

    ``qdo`` reuses quantized dO operands (default: ``quantize_do`` here).
    """
    total, heads_q, d = d_out.shape
    heads_kv = qkv.v8.codes.shape[1]
    group = heads_q // heads_kv
    if qdo is None:
        qdo = quantize_do(d_out, out, m_rows, lse_rows, cu_seqlens, recipe)
    g_q = qdo.g8.dequantize()
    q_ops, k_ops = _grad_operands(qkv, recipe)
    dq = torch.zeros(total, heads_q, d, dtype=torch.float32, device=d_out.device)
    dk_q = torch.zeros_like(dq)
    dv_q = torch.zeros_like(dq)
    docs = _backward_documents(d_out, out, m_rows, lse_rows, qkv, cu_seqlens, qdo, causal=causal,
                               softmax_scale=softmax_scale)  # fmt: skip
    for sl, probs, v_inv, ds in docs:
        dv_q[sl] = torch.einsum("hij,ihd->jhd", probs.p_hat, g_q[sl]) * v_inv.permute(2, 0, 1)
        eq = exp2i(qkv.q8.exponents[sl].int()).t()[..., None]  # [Hq, L, 1]
        ek = exp2i(_per_q_head(qkv.k8.exponents[sl], group).int()).t()[:, None, :]  # [Hq, 1, L]
        ds_k = _fold_quantize(ds, eq, recipe.ds_block)
        ds_q = _fold_quantize(ds, ek, recipe.dq_ds_block)
        dq[sl] = softmax_scale * torch.einsum(
            "hij,jhd->ihd", ds_q, _per_q_head(k_ops[sl], group)
        )
        dk_q[sl] = softmax_scale * torch.einsum("hij,ihd->jhd", ds_k, q_ops[sl])
    dk = dk_q.view(total, heads_kv, group, d).sum(2)
    dv = dv_q.view(total, heads_kv, group, d).sum(2)
    return dq, dk, dv


class _ReferenceAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, cu_seqlens, causal, recipe, exact_causal, softmax_scale):
        qkv = quantize_qkv(q, k, v, cu_seqlens, recipe, exact_causal)
        out, m_rows, lse_rows = attention_forward(
            qkv,
            cu_seqlens,
            heads_q=q.shape[1],
            causal=causal,
            softmax_scale=softmax_scale,
            out_dtype=q.dtype,
        )
        ctx.qkv = qkv
        ctx.save_for_backward(out, m_rows, lse_rows, cu_seqlens)
        ctx.args = (recipe, causal, softmax_scale, q.dtype)
        return out

    @staticmethod
    @once_differentiable  # a second derivative would silently miss the quantized path
    def backward(ctx, d_out):
        out, m_rows, lse_rows, cu_seqlens = ctx.saved_tensors
        recipe, causal, softmax_scale, dtype = ctx.args
        dq, dk, dv = attention_backward(
            d_out,
            out,
            m_rows,
            lse_rows,
            ctx.qkv,
            cu_seqlens,
            recipe,
            causal=causal,
            softmax_scale=softmax_scale,
        )
        return dq.to(dtype), dk.to(dtype), dv.to(dtype), None, None, None, None, None


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor,
    max_seqlen: int,
    *,
    causal: bool = True,
    recipe: str | Recipe = "mxfp8",
    exact_causal: bool = False,
    softmax_scale: float | None = None,
) -> torch.Tensor:
    """Reference FLAMIA attention for packed documents, differentiable.

    Args:
        q: ``[T, Hq, d]`` BF16/FP16; k, v: ``[T, Hkv, d]``, same dtype, ``Hq % Hkv == 0``,
            d in {64, 128, 256}.
        cu_seqlens: ``[B+1]`` int32, 0 first, non-decreasing, T last.
        max_seqlen: an int >= the longest document.
        causal: mask keys after the query (within its document).
        recipe: ``"mxfp8"``, ``"mxfp8_grad_input"``, ``"mixed_nvfp4"``,
            ``"mixed_nvfp4_hadamard"`` or a Recipe.
        exact_causal: per-token Q/K exponents, so no output depends on a later token.
        softmax_scale: defaults to ``1/sqrt(d)``.

    Returns:
        O ``[T, Hq, d]`` in the input dtype. The backward is the manual one the kernels
        implement (module docstring), not autograd through the quantizers.
    """
    shape = check_varlen_inputs(q, k, v, cu_seqlens, max_seqlen)
    rec = resolve_recipe(recipe)
    scale = check_softmax_scale(softmax_scale, shape.head_dim)
    return _ReferenceAttention.apply(
        q, k, v, cu_seqlens, check_flag(causal, "causal"), rec,
        check_flag(exact_causal, "exact_causal"), scale,
    )
