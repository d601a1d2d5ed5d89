"""Public FLAMIA attention entry points (kernel path): packed varlen and batched.

Differentiable (``flamia_serve.custom_ops``): eager calls run an autograd function, and
under ``torch.compile`` the same implementation runs as ``torch.library`` custom ops with a
registered autograd formula, so ``loss.backward()``, ``torch.compile(fullgraph=True)`` and
CUDA graphs work. The plain-PyTorch twin with the same numerics is
``flamia_serve.reference.attention``.
"""

from __future__ import annotations

import dataclasses
import os

import torch

from flamia_serve.custom_ops import AttnCall, attention_forward, eager_attention, op_arguments
from flamia_serve.kernels.attn_bwd.ops import (
    BwdConfig,
    attn_bwd,
    check_bwd_config,
    default_bwd_config,
)
from flamia_serve.kernels.attn_fwd.ops import FwdConfig, attn_fwd, default_config, window_limit
from flamia_serve.kernels.quant.ops import quantize_do, quantize_qkv
from flamia_serve.numerics import RECIPES, Recipe, resolve_recipe
from flamia_serve.numerics.checks import (
    check_batched_inputs,
    check_flag,
    check_softmax_scale,
    check_varlen_inputs,
)
from flamia_serve.numerics.formats import P_HAT_EXP
from flamia_serve.plan import VarlenPlan, plan_varlen


def _check_kernel_device(q: torch.Tensor) -> None:
    """The kernels run on CUDA GPUs, or on the CPU under Triton's interpreter (tests)."""
    if q.device.type == "cuda":
        return
    if q.device.type == "cpu" and os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        return
    raise RuntimeError(
        f"flamia_attn_varlen runs Triton kernels and needs CUDA tensors (got q on {q.device}); "
        "on a CPU use flamia_serve.reference.attention (same numerics), or set "
        "TRITON_INTERPRET=1 before importing flamia_serve to interpret the kernels (slow)"
    )


def _kernel_recipe(recipe: str | Recipe) -> Recipe:
    """The kernels implement the preset recipes (their scale blocks are compiled in)."""
    rec = resolve_recipe(recipe)
    if RECIPES.get(rec.name) != rec:
        raise ValueError(
            f"recipe: the kernel path runs the presets {sorted(RECIPES)}, got a custom "
            f"{rec!r}; use flamia_serve.reference.attention for custom recipes"
        )
    return rec


#: eager calls through the custom ops too (``FLAMIA_EAGER_CUSTOM_OPS=1`` when imported):
#: checks and host-time comparisons; read once (the environment costs ~2 µs a read)
EAGER_CUSTOM_OPS = os.environ.get("FLAMIA_EAGER_CUSTOM_OPS", "0") == "1"

_NO_REUSE = object()
#: checked calls a plan keeps (signatures: shapes, dtypes, options, stream); then it starts over
MAX_CALLS_PER_PLAN = 64


def _reuse_stream(q: torch.Tensor, plan: VarlenPlan | None, compiling: bool) -> object:
    """The stream key under which an eager call reuses its plan's checked call and buffers
    (``None`` off CUDA), or ``_NO_REUSE``: no plan, a plan that keeps no buffers, tracing,
    or a CUDA graph capture (whose buffers must stay the graph's)."""
    if plan is None or not plan.reuse or compiling:
        return _NO_REUSE
    if q.device.type != "cuda":
        return None
    if torch._C._cuda_isCurrentStreamCapturing():  # torch.cuda's, without its Python
        return _NO_REUSE
    # current_stream(device).cuda_stream took 5-8 µs of host time on the GPU hosts
    return torch._C._cuda_getCurrentRawStream(q.device.index)


def _attn_call(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor,
    max_seqlen: int,
    plan: VarlenPlan | None,
    compiling: bool,
    needs_grad: bool,
    causal: bool,
    recipe: str | Recipe,
    exact_causal: bool,
    softmax_scale: float | None,
    config: FwdConfig | None,
    bwd_config: BwdConfig | None,
    *,
    stream: object = _NO_REUSE,
) -> AttnCall:
    """Check a call and choose its kernels, schedules and (with ``stream``) buffers."""
    _check_kernel_device(q)
    shape = check_varlen_inputs(
        q, k, v, cu_seqlens, max_seqlen, check_values=plan is None and not compiling
    )
    rec = _kernel_recipe(recipe)
    scale = check_softmax_scale(softmax_scale, shape.head_dim)
    if plan is None:
        plan = plan_varlen(cu_seqlens, shape.total_tokens, max_seqlen, validate=False)
    docs = cu_seqlens.numel() - 1  # a shape: no host read
    mean_doc_len = shape.total_tokens / max(docs, 1)
    nvfp4 = rec.qk_format == "nvfp4"
    cfg = config or default_config(
        shape.head_dim, q.device, qk_nvfp4=nvfp4, mean_doc_len=mean_doc_len
    )
    bcfg = bwd_config or default_bwd_config(
        shape.head_dim, q.device, qk_nvfp4=nvfp4, mean_doc_len=mean_doc_len,
        grad_input=rec.grad_input,
    )
    causal = check_flag(causal, "causal")
    exact_causal = check_flag(exact_causal, "exact_causal")
    bwd_work = None
    # the backward quantizes into its own layout unless the forward's has its alignment
    own_layout = needs_grad and cfg.column_align % bcfg.column_align != 0
    if needs_grad:
        check_bwd_config(bcfg, rec)
        bwd_work = plan.key_work_list(bcfg.work_block_n, bcfg.block_m, causal)
    # the tokens' columns: the backward's copies and the forward's windows read them
    with_columns = not compiling and ((needs_grad and not own_layout) or cfg.windows)
    columns = plan.token_columns(cfg.column_align) if with_columns else None
    bwd_blocks = plan.token_blocks(bcfg.column_align) if own_layout else None
    bwd_columns = plan.token_columns(bcfg.column_align) if own_layout and not compiling else None
    workspace = None if stream is _NO_REUSE else plan.workspace(q.device, stream)
    return AttnCall(
        plan.token_blocks(cfg.column_align), cfg.column_align,
        plan.work_list(cfg.block_m, cfg.block_n, causal, window_limit(cfg)), bwd_work, causal, rec,
        exact_causal, scale, cfg, bcfg, columns, workspace, bwd_blocks, bwd_columns,
    )  # fmt: skip


#: device -> the plan of the last eager call made without one there
_VARLEN_PLANS: dict[torch.device, VarlenPlan] = {}


def _plan_of_last_pack(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor, max_seqlen: int
) -> VarlenPlan:
    """The plan of an eager call made without one, kept for the last ``cu_seqlens`` tensor
    per device (unchanged since, same T and ``max_seqlen``): every layer of a step passes the
    same tensor, so the pack is checked (one host read) and planned once, as with a plan."""
    plan = _VARLEN_PLANS.get(q.device)
    if (plan is not None and q.dim() and plan.cu_seqlens is cu_seqlens
            and plan.cu_version == cu_seqlens._version and plan.total_tokens == q.shape[0]
            and plan.max_seqlen == max_seqlen):  # fmt: skip
        return plan
    check_varlen_inputs(q, k, v, cu_seqlens, max_seqlen)  # raises, naming the argument
    plan = _VARLEN_PLANS[q.device] = plan_varlen(cu_seqlens, q.shape[0], max_seqlen,
                                                 validate=False)  # fmt: skip
    return plan


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
    bwd_config: BwdConfig | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """FLAMIA attention over packed documents (fused quantization + FP8 kernels),
    differentiable (FP8 backward kernel).

    Args:
        q: ``[T, Hq, d]`` BF16/FP16; k, v: ``[T, Hkv, d]``, same dtype and device,
            ``Hq % Hkv == 0``, d in {64, 128, 256}. Not modified.
        cu_seqlens: ``[B+1]`` int32 on the same device: 0, ..., T, non-decreasing.
        max_seqlen: int >= the longest document.
        causal: mask keys after the query inside its document.
        recipe: ``"mxfp8"`` (default), ``"mxfp8_grad_input"``, ``"mixed_nvfp4"``,
            ``"mixed_nvfp4_hadamard"``.
        exact_causal: per-token Q/K exponents, so no output depends on a later token.
        softmax_scale: defaults to ``1/sqrt(d)``.
        return_stats: also return ``M`` (integer row reference) and ``lse`` (base 2), both
            float32 ``[T, Hq]`` (not differentiable).
        plan: ``plan_varlen(cu_seqlens, T, max_seqlen)`` built once per microbatch: skips
            the host read that validates ``cu_seqlens`` and reuses the schedules (forward
            and backward). Without one, eager calls keep a plan for the last
            ``cu_seqlens`` tensor per device (validated once; ``release_kept_plans``
            drops it); inside ``torch.compile`` a missing plan is built unvalidated.
        config / bwd_config: kernel tiles (defaults per head dim and device).

    Eager calls run ``custom_ops.EagerAttention``, traced ones (``torch.compile``) the
    ``flamia::attn_varlen_fwd``/``_bwd`` custom ops: one implementation.
    ``FLAMIA_EAGER_CUSTOM_OPS=1`` at import (``attention.EAGER_CUSTOM_OPS``) sends eager calls
    through the custom ops too (checks, host-time comparisons).

    Returns:
        ``O [T, Hq, d]`` in the input dtype (and the statistics when asked). Gradients flow
        to q, k, v (dQ is accumulated with FP32 atomics: not bitwise repeatable).
    """
    tensor = torch.Tensor
    if not (isinstance(q, tensor) and isinstance(k, tensor) and isinstance(v, tensor)):
        check_varlen_inputs(q, k, v, cu_seqlens, max_seqlen)  # raises, naming the argument
    compiling = torch.compiler.is_compiling()
    if plan is None and not compiling and isinstance(cu_seqlens, tensor) \
            and type(max_seqlen) is int:  # fmt: skip
        plan = _plan_of_last_pack(q, k, v, cu_seqlens, max_seqlen)
    if plan is not None:
        plan.check_call(q.shape[0] if q.dim() else -1, cu_seqlens, max_seqlen, compiling)
    needs_grad = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)
    options = (causal, recipe, exact_causal, softmax_scale, config, bwd_config)
    stream = _reuse_stream(q, plan, compiling)
    if stream is _NO_REUSE:
        call = _attn_call(q, k, v, cu_seqlens, max_seqlen, plan, compiling, needs_grad, *options)
    else:  # eager, with a plan: the checked call of this signature, once per plan
        key = (q.shape, k.shape, v.shape, q.dtype, k.dtype, v.dtype, q.device, k.device,
               v.device, needs_grad, stream, *options)  # fmt: skip
        call = plan.calls.get(key)
        if call is None:
            if len(plan.calls) >= MAX_CALLS_PER_PLAN:
                plan.calls.clear()
            call = plan.calls[key] = _attn_call(q, k, v, cu_seqlens, max_seqlen, plan, compiling,
                                                needs_grad, *options, stream=stream)  # fmt: skip
    if compiling or EAGER_CUSTOM_OPS:
        stats = torch.ops.flamia.attn_varlen_fwd(q, k, v, cu_seqlens, *op_arguments(call))
    elif needs_grad:
        stats = eager_attention(q, k, v, cu_seqlens, call)
    else:
        stats = attention_forward(q, k, v, cu_seqlens, call)
    return stats if return_stats else stats[0]


#: device -> the plan of the last batched shape :func:`flamia_attn` ran there
_BATCHED_PLANS: dict[torch.device, VarlenPlan] = {}


def _batched_plan(batch: int, seq: int, device: torch.device) -> VarlenPlan:
    """The plan of ``batch`` documents of ``seq`` tokens, kept per device while the shape
    stays (eager calls): every layer and step of a batched model reuses its schedules,
    checked calls and kernel buffers, as a packed call with a plan does. Inside
    ``torch.compile`` a one-call plan (nothing kept)."""
    compiling = torch.compiler.is_compiling()
    plan = None if compiling else _BATCHED_PLANS.get(device)
    if plan is not None and (plan.total_tokens, plan.max_seqlen) == (batch * seq, seq):
        return plan
    cu = torch.arange(0, (batch + 1) * seq, seq, dtype=torch.int32, device=device)
    if compiling:
        return plan_varlen(cu, batch * seq, seq, validate=False, reuse=False)
    plan = _BATCHED_PLANS[device] = plan_varlen(cu, batch * seq, seq, validate=False)
    return plan


def release_kept_plans() -> None:
    """Drop the plans (and kernel buffers) that calls without a plan keep between calls
    (:func:`flamia_attn`'s last shape, :func:`flamia_attn_varlen`'s last pack)."""
    _BATCHED_PLANS.clear()
    _VARLEN_PLANS.clear()


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
    :func:`flamia_attn_varlen`. Eager calls keep the plan of the last ``[B, S]`` per device
    (schedules and the kernels' buffers for ``B·S`` tokens, shared by all layers, as a
    packed call's plan): a new shape replaces it, :func:`release_kept_plans` drops it.
    """
    batch, seq = check_batched_inputs(q, k, v)
    if batch * seq == 0:  # nothing to attend: an empty output (still in q's graph)
        return q.clone()
    plan = _batched_plan(batch, seq, q.device)
    out = flamia_attn_varlen(
        q.reshape(batch * seq, *q.shape[2:]),
        k.reshape(batch * seq, *k.shape[2:]),
        v.reshape(batch * seq, *v.shape[2:]),
        plan.cu_seqlens,
        seq,
        causal=causal,
        recipe=recipe,
        exact_causal=exact_causal,
        softmax_scale=softmax_scale,
        plan=plan,
    )
    return out.view(batch, seq, *out.shape[1:])


def debug_p_hat(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor,
    *,
    causal: bool = True,
    recipe: str | Recipe = "mxfp8",
    exact_causal: bool = False,
    softmax_scale: float | None = None,
    two_pass: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Debug hook (DESIGN N5): the forward's and the backward's P̂ of one small call.

    Runs the Triton forward (one pass with integer running maxima, or ``two_pass``) and
    the backward kernel with their debug outputs on. Returns two float32 ``[Hq, T, T]``
    tensors ``(forward, backward)`` of P̂ at ``[head, query, key]``, both expressed against
    the final row reference ``M`` (the forward's value rescaled by its exact power of two
    ``2^(m_running − M)``; zero where masked or across documents). They are bit-identical
    wherever the forward's running maximum had reached M, and otherwise differ only where
    ``P' < 2^-14`` (E4M3 subnormals) or where ``exp2`` rounds differently.
    """
    _check_kernel_device(q)
    shape = check_varlen_inputs(q, k, v, cu_seqlens, int(q.shape[0]))
    rec = _kernel_recipe(recipe)
    scale = check_softmax_scale(softmax_scale, shape.head_dim)
    total, heads_q = shape.total_tokens, shape.heads_q
    if total > 2048:
        raise ValueError(
            f"debug_p_hat allocates [Hq, T, T] buffers: T must be <= 2048, got {total}"
        )
    qkv = quantize_qkv(q, k, v, cu_seqlens, recipe=rec, exact_causal=exact_causal,
                       with_transposed=True)  # fmt: skip
    dense = torch.zeros(heads_q, total, total, dtype=torch.float32, device=q.device)
    fwd_p, fwd_m = dense.clone(), dense.clone()
    cfg = default_config(shape.head_dim, q.device, qk_nvfp4=rec.qk_format == "nvfp4",
                         kernel="triton")  # fmt: skip
    cfg = dataclasses.replace(cfg, two_pass=two_pass)
    out, m_rows, lse_rows = attn_fwd(
        qkv, cu_seqlens, heads_q=heads_q, causal=causal, softmax_scale=scale, out_dtype=q.dtype,
        config=cfg, debug_p=(fwd_p, fwd_m),
    )  # fmt: skip
    qdo = quantize_do(torch.randn_like(out), out, m_rows, lse_rows, cu_seqlens, recipe=rec)
    bwd_p = dense.clone()
    attn_bwd(
        qkv, qdo, m_rows, lse_rows, cu_seqlens, heads_q=heads_q, causal=causal,
        softmax_scale=scale, recipe=rec, out_dtype=q.dtype, debug_p=bwd_p,
    )  # fmt: skip
    final = m_rows.t()[..., None]  # [Hq, T, 1]
    fwd_final = fwd_p * torch.exp2(torch.where(fwd_p != 0, fwd_m - final, 0.0))
    return fwd_final, bwd_p


__all__ = [
    "P_HAT_EXP",
    "debug_p_hat",
    "flamia_attn",
    "flamia_attn_varlen",
    "release_kept_plans",
]
