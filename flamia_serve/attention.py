"""Public FLAMIA attention entry points (kernel path): packed varlen and batched.

Forward only for now: the backward kernel is a later issue, so calls that need gradients
raise instead of silently returning a non-differentiable output. For a differentiable
path with the same numerics use ``flamia_serve.reference.attention``.
"""

from __future__ import annotations

import torch

from flamia_serve.kernels.attn_fwd.ops import FwdConfig, attn_fwd, default_config
from flamia_serve.kernels.quant.ops import quantize_qkv
from flamia_serve.numerics import Recipe, resolve_recipe
from flamia_serve.numerics.checks import (
    INPUT_DTYPES,
    check_softmax_scale,
    check_tensor,
    check_varlen_inputs,
)
from flamia_serve.plan import VarlenPlan, plan_varlen


def flamia_attn_varlen(
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
    return_stats: bool = False,
    plan: VarlenPlan | None = None,
    config: FwdConfig | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """FLAMIA attention over packed documents (fused quantization + FP8 forward kernel).

    Args:
        q: ``[T, Hq, d]`` BF16/FP16; k, v: ``[T, Hkv, d]``, same dtype and device,
            ``Hq % Hkv == 0``, d in {64, 128, 256}. Not modified.
        cu_seqlens: ``[B+1]`` int32 on the same device: 0, ..., T, non-decreasing.
        max_seqlen: int >= the longest document.
        causal: mask keys after the query inside its document.
        recipe: ``"mxfp8"`` (default), ``"mixed_nvfp4"``, ``"mixed_nvfp4_hadamard"``.
        exact_causal: per-token Q/K exponents, so no output depends on a later token.
        softmax_scale: defaults to ``1/sqrt(d)``.
        return_stats: also return ``M`` (integer row reference) and ``lse`` (base 2), both
            float32 ``[T, Hq]``, which the backward needs.
        plan: ``plan_varlen(cu_seqlens, T, max_seqlen)`` built once per microbatch: skips
            the host read that validates ``cu_seqlens`` and reuses the schedules.
        config: kernel tile shape (default per head dim; ``FLAMIA_FWD_CONFIG`` overrides).

    Returns:
        ``O [T, Hq, d]`` in the input dtype (and the statistics when asked).
    """
    if plan is not None and plan.cu_seqlens is not cu_seqlens:
        raise ValueError("plan was built for another cu_seqlens tensor")
    shape = check_varlen_inputs(q, k, v, cu_seqlens, max_seqlen, check_values=plan is None)
    rec = resolve_recipe(recipe)
    scale = check_softmax_scale(softmax_scale, shape.head_dim)
    if torch.is_grad_enabled() and any(x.requires_grad for x in (q, k, v)):
        raise NotImplementedError(
            "flamia_attn_varlen has no backward kernel yet: call it under torch.no_grad(), "
            "or use flamia_serve.reference.attention for gradients"
        )
    if plan is None:
        plan = plan_varlen(cu_seqlens, shape.total_tokens, max_seqlen)
    cfg = config or default_config(shape.head_dim, q.device, qk_nvfp4=rec.qk_format == "nvfp4")
    qkv = quantize_qkv(
        q, k, v, cu_seqlens, recipe=rec, exact_causal=exact_causal, blocks=plan.blocks
    )
    out, m_rows, lse_rows = attn_fwd(
        qkv,
        cu_seqlens,
        heads_q=shape.heads_q,
        causal=bool(causal),
        softmax_scale=scale,
        out_dtype=q.dtype,
        config=cfg,
        work=plan.work_list(cfg.block_m, cfg.block_n, bool(causal)),
    )
    return (out, m_rows, lse_rows) if return_stats else out


def flamia_attn(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool = True,
    recipe: str | Recipe = "mxfp8",
    exact_causal: bool = False,
    softmax_scale: float | None = None,
) -> torch.Tensor:
    """Batched FLAMIA attention: q ``[B, S, Hq, d]``, k/v ``[B, S, Hkv, d]`` -> ``[B, S, Hq, d]``.

    Each batch row is one document (scales never cross rows); same options as
    :func:`flamia_attn_varlen`.
    """
    for name, x in (("q", q), ("k", k), ("v", v)):
        check_tensor(x, name, ndim=4, dtypes=INPUT_DTYPES)
    batch, seq = q.shape[:2]
    if k.shape[:2] != (batch, seq) or v.shape[:2] != (batch, seq):
        raise ValueError(
            f"q, k, v must share [B, S], got {tuple(q.shape[:2])}, {tuple(k.shape[:2])}, "
            f"{tuple(v.shape[:2])}"
        )
    cu = torch.arange(0, (batch + 1) * seq, seq, dtype=torch.int32, device=q.device)
    out = flamia_attn_varlen(
        q.reshape(batch * seq, *q.shape[2:]),
        k.reshape(batch * seq, *k.shape[2:]),
        v.reshape(batch * seq, *v.shape[2:]),
        cu,
        seq,
        causal=causal,
        recipe=recipe,
        exact_causal=exact_causal,
        softmax_scale=softmax_scale,
    )
    return out.view(batch, seq, *out.shape[1:])
