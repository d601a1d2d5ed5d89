"""Unquantized references: float64 softmax attention, and per-tensor-scaled FP8 (leaky)."""

from __future__ import annotations

import torch

from flamia_serve.numerics import E4M3_MAX, document_slices
from flamia_serve.numerics.checks import check_flag, check_softmax_scale, check_varlen_inputs


def _doc_probs(q: torch.Tensor, k: torch.Tensor, causal: bool, scale: float) -> torch.Tensor:
    """Softmax probabilities ``[Hq, L, L]`` of one document (k per kv head, GQA expanded)."""
    k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
    s = torch.einsum("ihd,jhd->hij", q, k) * scale
    if causal:
        length = q.shape[0]
        future = torch.ones(length, length, dtype=torch.bool, device=q.device).triu(1)
        s = s.masked_fill(future, float("-inf"))
    return torch.softmax(s, dim=-1)


def _doc_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float
) -> torch.Tensor:
    v = v.repeat_interleave(q.shape[1] // v.shape[1], dim=1)
    return torch.einsum("hij,jhd->ihd", _doc_probs(q, k, causal, scale), v)


def _varlen(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor,
    causal: bool,
    scale: float,
) -> torch.Tensor:
    outs = [
        _doc_attention(q[sl], k[sl], v[sl], causal, scale) for sl in document_slices(cu_seqlens)
    ]
    return torch.cat(outs) if outs else q.new_zeros(q.shape)


def attention_float64(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor,
    max_seqlen: int,
    *,
    causal: bool = True,
    softmax_scale: float | None = None,
) -> torch.Tensor:
    """Exact softmax attention in float64 for packed documents (differentiable by autograd).

    Same arguments as :func:`flamia_serve.reference.attention`; returns float64 ``[T, Hq, d]``.
    Inputs are upcast inside (gradients flow back to them in their dtype).
    """
    shape = check_varlen_inputs(q, k, v, cu_seqlens, max_seqlen)
    scale = check_softmax_scale(softmax_scale, shape.head_dim)
    causal = check_flag(causal, "causal")
    return _varlen(q.double(), k.double(), v.double(), cu_seqlens, causal, scale)


def _per_tensor_fp8(x: torch.Tensor) -> torch.Tensor:
    scale = x.float().abs().amax().clamp(min=1e-30) / E4M3_MAX
    return (x.float() / scale).to(torch.float8_e4m3fn).float() * scale


def per_tensor_fp8_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor,
    max_seqlen: int,
    *,
    causal: bool = True,
    softmax_scale: float | None = None,
) -> torch.Tensor:
    """The known-leaky comparison: Q, K, V each E4M3 with one scale from the current amax
    over the whole packed tensor (future tokens and other documents included), P in E4M3.

    Forward only; returns ``[T, Hq, d]`` in the input dtype.
    """
    shape = check_varlen_inputs(q, k, v, cu_seqlens, max_seqlen)
    scale = check_softmax_scale(softmax_scale, shape.head_dim)
    causal = check_flag(causal, "causal")
    qd, kd, vd = (_per_tensor_fp8(t) for t in (q, k, v))
    group = shape.heads_q // shape.heads_kv
    outs = []
    for sl in document_slices(cu_seqlens):
        p = _doc_probs(qd[sl], kd[sl], causal, scale)
        vs = vd[sl].repeat_interleave(group, dim=1)
        p_hat = (p * E4M3_MAX).to(torch.float8_e4m3fn).float() / E4M3_MAX
        outs.append(torch.einsum("hij,jhd->ihd", p_hat, vs) / p.sum(-1).t()[..., None])
    out = torch.cat(outs) if outs else q.new_zeros(q.shape, dtype=torch.float32)
    return out.to(q.dtype)
