"""``torch.library`` custom ops of the kernel path, with a registered autograd formula.

``flamia::attn_varlen_fwd`` quantizes Q/K/V and runs the forward kernel; its backward is
``flamia::attn_varlen_bwd``, which quantizes Q/K/V again (the same kernel on the same
inputs: the same codes, bit for bit, now with the column-layout copies the backward
reads), quantizes dO (dÔ, Ĝ, D in one launch) and runs the backward kernel. Saving BF16
Q/K/V instead of their FP8 copies keeps the saved state that of any attention op; the
re-quantization costs one memory-bound launch.

Both ops have fake implementations, so ``torch.compile(fullgraph=True)`` traces a model
that calls them, forward and backward. Schedules (token blocks, work lists) arrive as
tensors from a ``VarlenPlan`` and kernel configs as int lists, so nothing here reads the
GPU on the host. Callers go through ``flamia_serve.attention``, which validates.
"""

from __future__ import annotations

import torch

from flamia_serve.kernels.attn_bwd.ops import BwdConfig, attn_bwd
from flamia_serve.kernels.attn_fwd.ops import FwdConfig, attn_fwd
from flamia_serve.kernels.quant.ops import quantize_do, quantize_qkv
from flamia_serve.kernels.schedule import TokenBlocks, WorkList
from flamia_serve.numerics import RECIPES

Tensors = list[torch.Tensor]


def _work(tensors: Tensors, block_m: int, block_n: int, causal: bool, by_keys: bool) -> WorkList:
    doc, tile, count = tensors
    return WorkList(doc, tile, count, block_m, block_n, causal, by_keys)


@torch.library.custom_op("flamia::attn_varlen_fwd", mutates_args=())
def attn_varlen_fwd(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor,
    blocks: Tensors,
    work: Tensors,
    bwd_work: Tensors,
    causal: bool,
    recipe: str,
    exact_causal: bool,
    softmax_scale: float,
    config: list[int],
    bwd_config: list[int],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(O [T, Hq, d], M [T, Hq], lse [T, Hq])``; ``bwd_work``/``bwd_config`` are carried
    for the backward only."""
    cfg = FwdConfig.from_ints(config)
    qkv = quantize_qkv(
        q, k, v, cu_seqlens, recipe=RECIPES[recipe], exact_causal=exact_causal,
        blocks=TokenBlocks(*blocks), column_align=cfg.column_align,
    )  # fmt: skip
    return attn_fwd(
        qkv, cu_seqlens, heads_q=q.shape[1], causal=causal, softmax_scale=softmax_scale,
        out_dtype=q.dtype, config=cfg, work=_work(work, cfg.block_m, cfg.block_n, causal, False),
    )  # fmt: skip


@attn_varlen_fwd.register_fake
def _(q, k, v, cu_seqlens, blocks, work, bwd_work, causal, recipe, exact_causal, softmax_scale,
      config, bwd_config):  # fmt: skip
    rows = q.new_empty(q.shape[:2], dtype=torch.float32)
    return torch.empty_like(q), rows, torch.empty_like(rows)


@torch.library.custom_op("flamia::attn_varlen_bwd", mutates_args=())
def attn_varlen_bwd(
    d_out: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    m_rows: torch.Tensor,
    lse_rows: torch.Tensor,
    cu_seqlens: torch.Tensor,
    blocks: Tensors,
    work: Tensors,
    causal: bool,
    recipe: str,
    exact_causal: bool,
    softmax_scale: float,
    config: list[int],
    column_align: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(dQ, dK, dV)`` in the input dtype (``flamia_serve.reference.attention_backward``);
    ``blocks`` and ``column_align`` are the forward's (its ``FwdConfig.column_align``)."""
    rec = RECIPES[recipe]
    cfg = BwdConfig.from_ints(config)
    token_blocks = TokenBlocks(*blocks)
    qkv = quantize_qkv(
        q, k, v, cu_seqlens, recipe=rec, exact_causal=exact_causal, blocks=token_blocks,
        with_transposed=True, column_align=column_align,
    )  # fmt: skip
    qdo = quantize_do(d_out.contiguous(), out, m_rows, lse_rows, cu_seqlens, recipe=rec,
                      blocks=token_blocks, column_align=column_align)  # fmt: skip
    return attn_bwd(
        qkv, qdo, m_rows, lse_rows, cu_seqlens, heads_q=q.shape[1], causal=causal,
        softmax_scale=softmax_scale, recipe=rec, out_dtype=q.dtype, config=cfg,
        work=_work(work, cfg.block_m, cfg.block_n, causal, True),
    )  # fmt: skip


@attn_varlen_bwd.register_fake
def _(d_out, q, k, v, out, m_rows, lse_rows, cu_seqlens, blocks, work, causal, recipe,
      exact_causal, softmax_scale, config, column_align):  # fmt: skip
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _setup_context(ctx, inputs, output) -> None:
    (q, k, v, cu_seqlens, blocks, _work_fwd, bwd_work, causal, recipe, exact_causal,
     softmax_scale, config, bwd_config) = inputs  # fmt: skip
    out, m_rows, lse_rows = output
    ctx.save_for_backward(q, k, v, out, m_rows, lse_rows, cu_seqlens, *blocks, *bwd_work)
    ctx.n_blocks = len(blocks)
    ctx.n_work = len(_work_fwd)
    column_align = FwdConfig.from_ints(config).column_align
    ctx.args = (causal, recipe, exact_causal, softmax_scale, bwd_config, column_align)
    ctx.mark_non_differentiable(m_rows, lse_rows)


def _backward(ctx, d_out, _d_m, _d_lse):
    q, k, v, out, m_rows, lse_rows, cu_seqlens, *rest = ctx.saved_tensors
    blocks, bwd_work = rest[: ctx.n_blocks], rest[ctx.n_blocks :]
    if not bwd_work:
        raise RuntimeError("flamia attention: the forward ran without gradients enabled")
    causal, recipe, exact_causal, softmax_scale, bwd_config, column_align = ctx.args
    dq, dk, dv = attn_varlen_bwd(
        d_out, q, k, v, out, m_rows, lse_rows, cu_seqlens, list(blocks), list(bwd_work),
        causal, recipe, exact_causal, softmax_scale, bwd_config, column_align,
    )  # fmt: skip
    # tensor-list inputs take a list of Nones; every other non-tensor input one None
    lists = [[None] * ctx.n_blocks, [None] * ctx.n_work, [None] * len(bwd_work)]
    return dq, dk, dv, None, *lists, None, None, None, None, None, None


torch.library.register_autograd(
    "flamia::attn_varlen_fwd", _backward, setup_context=_setup_context
)
