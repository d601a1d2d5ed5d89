"""Launchers of the fused quantization kernels (``quantize_qkv_kernel``, ``quantize_do_kernel``)."""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch

from flamia_serve.kernels._common import BoundLaunch, TritonLaunch, interpreted, sm_count
from flamia_serve.kernels.columns import columns_from_rows_launch, pack_column_tokens
from flamia_serve.kernels.quant.triton import quantize_do_kernel, quantize_qkv_kernel
from flamia_serve.kernels.schedule import TokenBlocks, short_document_slots, token_block_table
from flamia_serve.kernels.workspace import PackWorkspace, pack_constant
from flamia_serve.numerics import NVFP4Tensor, Recipe, resolve_recipe
from flamia_serve.numerics.operands import (
    EXPONENT_DTYPE,
    V_T_ALIGN,
    KernelDO,
    KernelQKV,
    check_column_align,
    token_columns,
    v_t_length,
)

_LAUNCH_QKV = TritonLaunch(quantize_qkv_kernel)
_LAUNCH_DO = TritonLaunch(quantize_do_kernel)


def default_warps(head_dim: int, nvfp4: bool = False) -> int:
    """The quantizers' warps per program: 4, or 2 at d <= 64 without NVFP4 (sm_90a: NVFP4's
    item at two warps takes ~200 registers, not measured), where a 32-token block is half the
    values and two warps keep each thread's share (H100, P1 at d = 64, two calls of
    2026-12-06: the forward's K/V 49.9 / 49.6 µs against 52.1 / 52.4 at 4 warps,
    ``quantize_do`` 159.3 / 159.7 against 171.7 / 172.1, the backward's Q/K/V 149.5 / 161.4
    against 155.1 / 160.9; ``results/tune_quant_{prefetch,tma}_s31_h100_2026-12-06.json``;
    at d = 128 two warps were 1% faster to 4% slower)."""
    return 2 if head_dim <= 64 and not nvfp4 else 4


class _Buffers:
    """The quantizers' outputs: from a pack's workspace (reused call after call) or, without
    one, freshly allocated. ``column_align`` names the layout (the zeroed buffers' padding
    depends on it)."""

    def __init__(
        self, device: torch.device, workspace: PackWorkspace | None, column_align: int
    ) -> None:
        self.device, self.workspace, self.column_align = device, workspace, column_align

    def empty(self, name: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        if self.workspace is None:
            return torch.empty(shape, dtype=dtype, device=self.device)
        return self.workspace.empty(name, shape, dtype)

    def zeros(self, name: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """Zero where no call writes (a workspace's buffer was zeroed once: every call on
        its pack writes the same elements)."""
        if self.workspace is None:
            return torch.zeros(shape, dtype=dtype, device=self.device)
        return self.workspace.zeroed(f"{name}@{self.column_align}", shape, dtype)

    def head_major(
        self, name: str, total: int, heads: int, dtype: torch.dtype = EXPONENT_DTYPE
    ) -> torch.Tensor:
        """``[T, H]`` view of a ``[H, T]`` buffer."""
        return self.empty(name, (heads, total), dtype).t()

    def nvfp4(self, name: str, total: int, heads: int, d: int) -> NVFP4Tensor:
        return NVFP4Tensor(
            self.empty(f"{name}.codes", (total, heads, d // 2), torch.uint8),
            self.empty(f"{name}.scales", (total, heads, d // 16), torch.float8_e4m3fn),
            self.head_major(f"{name}.exponents", total, heads, torch.int8),
        )

    def column_codes(self, name: str, heads: int, d: int, t_pad: int, total: int) -> torch.Tensor:
        """E4M3 ``[heads, d, t_pad]`` for a quantization kernel to fill in the column layout,
        zero wherever the kernel does not write: the kernels zero each document's padding up
        to 16 columns, so with ``V_T_ALIGN`` only the columns past the last document need it
        (tiles that run past it read finite codes); a wider alignment leaves more of each
        document's span to zero, and kernels that load whole tiles read it."""
        shape, fp8 = (heads, d, t_pad), torch.float8_e4m3fn
        if self.column_align != V_T_ALIGN or self.workspace is not None:
            return self.zeros(name, shape, fp8)
        codes = torch.empty(shape, dtype=fp8, device=self.device)
        codes[:, :, total:].zero_()
        return codes

    def column_copy(
        self, name: str, codes: torch.Tensor, columns: torch.Tensor, t_pad: int
    ) -> tuple[torch.Tensor, Callable[[], None]]:
        """``[H, d, t_pad]`` E4M3 for ``codes`` ``[T, H, d]`` at their column-layout
        ``columns``, zeros in every other column (document padding, slack), and the copy
        that fills it (to run once ``codes`` hold their values)."""
        _total, heads, d = codes.shape
        out = self.zeros(name, (heads, d, t_pad), torch.uint8)
        tokens = pack_column_tokens(self.workspace, columns, self.column_align, t_pad)
        copy = columns_from_rows_launch(codes.view(torch.uint8), columns, out, tokens)
        return out.view(torch.float8_e4m3fn), copy


@dataclass(frozen=True)
class QKVLaunch:
    """The launches of :func:`quantize_qkv_launch`: ``launch(q=q, k=k, v=v)`` runs the
    quantization kernel (``quantize``; None: no token) on those inputs, then the column-layout
    copies of its codes (``copies``). :meth:`keep` before keeping it for other tensors."""

    quantize: BoundLaunch | None
    copies: tuple[Callable[[], None], ...] = ()

    def keep(self) -> bool:
        """``BoundLaunch.keep``: whether it can run again with other tensors."""
        return self.quantize is None or self.quantize.keep()

    def __call__(self, *, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        if self.quantize is not None:
            self.quantize(q=q, k=k, v=v)
        for copy in self.copies:
            copy()


@functools.cache
def _nvfp4_placeholder(device: torch.device) -> NVFP4Tensor:
    """Empty NVFP4 buffers for the kernel's NVFP4 pointers when it writes none (one per
    device, never read or written: saves six allocations per call)."""
    return _Buffers(device, None, V_T_ALIGN).nvfp4("placeholder", 0, 1, 16)


def _num_programs(device: torch.device, items: int, programs_per_sm: int) -> int:
    """Persistent grid: ``programs_per_sm`` per SM (2 under the CPU interpreter)."""
    if device.type != "cuda":
        return min(items, 2)
    return max(1, min(items, sm_count(device) * programs_per_sm))


def quantize_qkv(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor, **options: object
) -> KernelQKV:
    """:func:`quantize_qkv_launch`'s operands, written now (one launch)."""
    qkv, launch = quantize_qkv_launch(q, k, v, cu_seqlens, **options)
    launch(q=q, k=k, v=v)
    return qkv


def quantize_qkv_launch(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor,
    *,
    recipe: str | Recipe = "mxfp8",
    exact_causal: bool = False,
    blocks: TokenBlocks | None = None,
    with_transposed: bool = False,
    column_align: int = V_T_ALIGN,
    columns: torch.Tensor | None = None,
    num_warps: int | None = None,
    programs_per_sm: int | None = None,
    workspace: PackWorkspace | None = None,
    widen: bool = False,
    scores_only: bool = False,
    defer_q: bool = False,
    q_short: int = 0,
    q_transposed: bool = True,
    q_rows: bool = False,
    k_rows: bool = False,
) -> tuple[KernelQKV, QKVLaunch]:
    """Quantize packed Q ``[T, Hq, d]``, K/V ``[T, Hkv, d]`` (BF16/FP16) in one launch:
    ``(operands, launch)``, the operands written when ``launch(q=q, k=k, v=v)`` runs. With a
    ``workspace`` the launch may be kept and called again for other q/k/v of the same shapes,
    dtypes, strides and 16-byte alignment: it writes the same buffers (``QKVLaunch``); the
    operands' ``q_input`` is this call's ``q``.

    Same codes as ``flamia_serve.reference.quantize_qkv``, bit for bit. Inputs are assumed
    checked (public entry points do that); ``blocks`` may be passed to reuse a plan.
    ``num_warps`` / ``programs_per_sm`` (persistent grid) default to the H200's best for
    both Q/K formats (``benchmarks/tune_quant.py``): 4 warps (``default_warps``: 2 at
    d <= 64) and 32 programs per SM, or 8 and 16 for NVFP4 Q/K with a block-scale search
    (``Recipe.nvfp4_scale_candidates`` > 1: W3 1.25 ms against 2.32 at 4 warps; 0.65 ms
    without the search, ``results/tune_quant_nvfp4_search_2026-12-05.json``).
    ``with_transposed`` also builds ``q_t``/``k_t`` (the backward's column-layout copies of
    the Q/K codes) with a torch scatter: written from the kernel,
    per-token (``exact_causal``) codes came out scrambled in some head-dim columns on the
    H200 (Triton 3.6, FP8 tile stored transposed). ``column_align``: documents start at
    multiples of it in the column layout (``FwdConfig.column_align`` of the forward that
    will read it; ``blocks``, when given, must come from a table with the same one);
    ``columns``: the tokens' columns in that layout (``token_columns``; a plan caches them).
    ``workspace``: the pack's buffers to write into (``VarlenPlan.workspace``; the result is
    then valid until the next call on that workspace), else new ones. ``widen`` (NVFP4 Q/K
    recipes; no effect on E4M3 ones): also write ``q_wide``/``k_wide``, the NVFP4 values
    without their per-token power of two in BF16 (exact), the score operands of the CuTe
    kernels. With NVFP4 Q/K, ``kv_factors`` row 0 holds 2^ of K's NVFP4 second level.
    ``scores_only`` (NVFP4 Q/K with ``widen``, no ``with_transposed``): write only what the
    CuTe forward reads (``KernelQKV.scores_only``); the E4M3 Q/K codes and exponents and
    the packed NVFP4 codes and block scales are left unwritten.
    ``defer_q`` (E4M3 Q/K, no ``with_transposed``): Q is left to the CuTe forward, which
    quantizes it as it loads it with the same rule (``KernelQKV.q_input`` = ``q``; the E4M3 Q
    codes and exponents are left unwritten). ``q_short`` (with ``defer_q``): except those of
    documents of at most this many tokens, written as without ``defer_q`` (the forward's
    window kernel reads them, ``KernelQKV.q_short``). With ``with_transposed``, Q's codes for the
    backward's dK = dSᵀ·Q̂: ``q_t`` (the column copy, unless ``q_transposed=False``) and/or
    ``q_rows`` (``q_rows=True``: BF16 rows by column, written by the kernel; the CuTe
    backward's operand where it multiplies dK in BF16, ``KernelQKV.q_rows``). ``k_rows``: the
    same for K (dQ's operand). With ``recipe.grad_qk == "input"`` the rows hold the inputs'
    ``grad_operand`` instead of the codes' values (``KernelQKV.grad_input``).
    """
    rec = resolve_recipe(recipe)
    if rec.token_block % V_T_ALIGN:
        raise ValueError(
            f"recipe token_block {rec.token_block}: must be a multiple of {V_T_ALIGN} (the "
            "K-major V layout permutes keys inside 16-key groups)"
        )
    if scores_only and (rec.qk_format != "nvfp4" or not widen or with_transposed):
        raise ValueError(
            "scores_only writes the CuTe forward's operands only: it needs a recipe with NVFP4 "
            f"Q/K and widen=True, and no with_transposed (got recipe {rec.name}, widen={widen}, "
            f"with_transposed={with_transposed})"
        )
    if defer_q and (rec.qk_format != "e4m3" or with_transposed or scores_only):
        raise ValueError(
            "defer_q leaves Q to the CuTe forward: it needs a recipe with E4M3 Q/K and no "
            f"with_transposed or scores_only (got recipe {rec.name}, with_transposed="
            f"{with_transposed}, scores_only={scores_only})"
        )
    if isinstance(q_short, bool) or not isinstance(q_short, int) or q_short < 0:
        raise ValueError(f"q_short must be a number of tokens >= 0, got {q_short!r}")
    if q_short and not defer_q:
        raise ValueError(f"q_short={q_short} keeps some of Q's codes of a defer_q quantization: "
                         "it needs defer_q=True")  # fmt: skip
    if (q_rows or k_rows) and not with_transposed:
        raise ValueError("q_rows/k_rows are backward operands: they need with_transposed=True")
    total, heads_q, d = q.shape
    heads_kv = k.shape[1]
    dev = q.device
    check_column_align(column_align)
    searching = rec.qk_format == "nvfp4" and rec.nvfp4_scale_candidates > 1
    num_warps = num_warps or (8 if searching else default_warps(d, rec.qk_format == "nvfp4"))
    programs_per_sm = programs_per_sm or (16 if searching else 32)
    if blocks is None:
        blocks = token_block_table(cu_seqlens, total, rec.token_block, column_align)
    for name, x in (("q", q), ("k", k), ("v", v)):
        if x.stride(-1) != 1:
            raise ValueError(f"{name} must have a contiguous last dim (stride 1)")
    t_pad = v_t_length(total, cu_seqlens.numel() - 1, column_align)
    buf = _Buffers(dev, workspace, column_align)
    fp8 = torch.float8_e4m3fn
    q_codes = buf.empty("q_codes", (total, heads_q, d), fp8)
    k_codes = buf.empty("k_codes", (total, heads_kv, d), fp8)
    q_exp = buf.head_major("q_exp", total, heads_q)
    k_exp = buf.empty("k_exp", (heads_kv, t_pad), EXPONENT_DTYPE)
    v_t = buf.column_codes("v_t", heads_kv, d, t_pad, total)
    v_exp = buf.empty("v_exp", (heads_kv, t_pad), EXPONENT_DTYPE)
    kv_factors = buf.empty("kv_factors", (heads_kv, 3, t_pad), torch.float32)
    nvfp4 = rec.qk_format == "nvfp4"
    q4 = buf.nvfp4("q4", total, heads_q, d) if nvfp4 else _nvfp4_placeholder(dev)
    k4 = buf.nvfp4("k4", total, heads_kv, d) if nvfp4 else _nvfp4_placeholder(dev)
    widen = widen and nvfp4
    bf16 = torch.bfloat16
    q_wide = buf.empty("q_wide", (total, heads_q, d), bf16) if widen else None
    k_wide = buf.empty("k_wide", (total, heads_kv, d), bf16) if widen else None
    q_values = buf.zeros("q_rows", (t_pad, heads_q, d), bf16) if q_rows else None
    k_values = buf.zeros("k_rows", (t_pad, heads_kv, d), bf16) if k_rows else None
    q_slots = blocks.length  # never read without q_short
    if q_short:  # the short documents' slots (a pack constant)
        q_slots = pack_constant(
            workspace, ("q_short", rec.token_block, q_short),
            lambda: short_document_slots(cu_seqlens, total, rec.token_block, q_short),
        )  # fmt: skip
    launch = None
    if total > 0:
        heads = (0 if defer_q else heads_q) + 2 * heads_kv
        grid = (_num_programs(dev, blocks.num_slots * heads, programs_per_sm),)
        args = (
            q, k, v, blocks.start, blocks.length, blocks.v_t_start, q_slots,
            q_codes, q_exp, k_codes, k_exp, v_t, v_exp, kv_factors,
            q4.codes, q4.block_scales, q4.exponents, k4.codes, k4.block_scales, k4.exponents,
            q if q_wide is None else q_wide, k if k_wide is None else k_wide,
            q if q_values is None else q_values, k if k_values is None else k_values,
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
            t_pad, total, blocks.num_slots,
        )  # fmt: skip
        options = dict(
            HQ=heads_q, HKV=heads_kv, D=d, BLOCK=rec.token_block,
            PER_TOKEN_QK=bool(exact_causal), QK_NVFP4=nvfp4, HADAMARD=rec.hadamard,
            LOG2_D=d.bit_length() - 1, WIDE=widen, SCORES_ONLY=bool(scores_only),
            SKIP_Q=bool(defer_q and not q_short), Q_SHORT=bool(q_short), Q_ROWS=q_rows,
            K_ROWS=k_rows, GRAD_INPUT=rec.grad_input,
            SCALE_CANDIDATES=rec.nvfp4_scale_candidates if nvfp4 else 1,
            INTERPRET=interpreted(),
            num_warps=num_warps,
        )  # fmt: skip
        launch = BoundLaunch(_LAUNCH_QKV, grid, args, options, {"q": q, "k": k, "v": v})
    rescale = 1.0 / d if nvfp4 and rec.hadamard else 1.0
    q_t = k_t = None
    copies = []
    if with_transposed:
        if columns is None:
            columns = token_columns(cu_seqlens, blocks.doc_v_t_start, total)
        if q_transposed:
            q_t, copy = buf.column_copy("q_t", q_codes, columns, t_pad)
            copies.append(copy)
        k_t, copy = buf.column_copy("k_t", k_codes, columns, t_pad)
        copies.append(copy)
    qkv = KernelQKV(
        q_codes, q_exp, k_codes, k_exp, v_t, blocks.doc_v_t_start, cu_seqlens, v_exp, kv_factors,
        q4 if nvfp4 else None, k4 if nvfp4 else None, rescale,
        1 if exact_causal else rec.token_block,
        q_t, k_t, column_align, columns, q_wide, k_wide, bool(scores_only),
        q if defer_q else None, q_values, k_values, rec.grad_input, q_short,
    )  # fmt: skip
    return qkv, QKVLaunch(launch, tuple(copies))


def quantize_do(
    d_out: torch.Tensor,
    out: torch.Tensor,
    m_rows: torch.Tensor,
    lse_rows: torch.Tensor,
    cu_seqlens: torch.Tensor,
    **options: object,
) -> KernelDO:
    """:func:`quantize_do_launch`'s operands, written now (one launch)."""
    qdo, launch = quantize_do_launch(d_out, out, m_rows, lse_rows, cu_seqlens, **options)
    if launch is not None:
        launch(d_out=d_out, out=out, m=m_rows.contiguous(), lse=lse_rows.contiguous())
    return qdo


def quantize_do_launch(
    d_out: torch.Tensor,
    out: torch.Tensor,
    m_rows: torch.Tensor,
    lse_rows: torch.Tensor,
    cu_seqlens: torch.Tensor,
    *,
    recipe: str | Recipe = "mxfp8",
    blocks: TokenBlocks | None = None,
    column_align: int = V_T_ALIGN,
    num_warps: int | None = None,
    programs_per_sm: int = 32,
    workspace: PackWorkspace | None = None,
    g_columns: bool = True,
    g_rows: bool = False,
) -> tuple[KernelDO, BoundLaunch | None]:
    """The backward's dO operands in one launch (``quantize_do_kernel``): dÔ, Ĝ, D, as
    ``(operands, launch)``, written when ``launch(d_out=, out=, m=, lse=)`` runs (None: no
    token); with a ``workspace`` the launch may be kept for tensors of the same layouts
    (``quantize_qkv_launch``).

    ``d_out``/``out`` ``[T, Hq, d]`` BF16/FP16 (last dim contiguous); ``m_rows``/``lse_rows``
    ``[T, Hq]`` float32 contiguous, as the forward returns them. Same codes as
    ``flamia_serve.reference.quantize_do`` given the kernel's ``row_factor``. ``column_align``
    and ``workspace`` as in :func:`quantize_qkv` (the backward reads Ĝ's columns only inside
    documents). Ĝ goes to ``g_t`` (E4M3 codes in the column layout: the Triton backward's)
    with ``g_columns``, and to ``g_rows`` (``code·2^eG`` in BF16, exact, a row per column with
    the documents' tokens in order and zero padding: the CuTe backward's) with ``g_rows``; at
    least one of them. ``num_warps`` (None: ``default_warps``), ``programs_per_sm``: its
    persistent grid.
    """
    if not (g_columns or g_rows):
        raise ValueError("quantize_do: g_columns and g_rows are both False (Ĝ written nowhere)")
    rec = resolve_recipe(recipe)
    total, heads_q, d = d_out.shape
    dev = d_out.device
    num_warps = num_warps or default_warps(d)
    check_column_align(column_align)
    if blocks is None:
        blocks = token_block_table(cu_seqlens, total, rec.token_block, column_align)
    for name, x in (("d_out", d_out), ("out", out)):
        if x.stride(-1) != 1:
            raise ValueError(f"{name} must have a contiguous last dim (stride 1)")
    t_pad = v_t_length(total, cu_seqlens.numel() - 1, column_align)
    buf = _Buffers(dev, workspace, column_align)
    do_codes = buf.empty("do_codes", (total, heads_q, d), torch.float8_e4m3fn)
    do_exp = buf.head_major("do_exp", total, heads_q)
    g_t = buf.column_codes("g_t", heads_q, d, t_pad, total) if g_columns else None
    g_values = buf.zeros("g_rows", (t_pad, heads_q, d), torch.bfloat16) if g_rows else None
    g_exp = buf.empty("g_exp", (heads_q, t_pad), EXPONENT_DTYPE)
    delta = buf.head_major("delta", total, heads_q, torch.float32)
    row_factor = buf.head_major("row_factor", total, heads_q, torch.float32)
    launch = None
    if total > 0:
        grid = (_num_programs(dev, blocks.num_slots * heads_q, programs_per_sm),)
        m_rows, lse_rows = m_rows.contiguous(), lse_rows.contiguous()
        args = (
            d_out, out, m_rows, lse_rows,
            blocks.start, blocks.length, blocks.v_t_start,
            do_codes, do_exp, do_codes if g_t is None else g_t,
            do_codes if g_values is None else g_values, g_exp, delta, row_factor,
            d_out.stride(0), d_out.stride(1), out.stride(0), out.stride(1),
            t_pad, total, blocks.num_slots,
        )  # fmt: skip
        options = dict(
            HQ=heads_q, D=d, BLOCK=rec.token_block, INTERPRET=interpreted(),
            G_COLUMNS=g_columns, G_ROWS=g_rows, num_warps=num_warps,
        )  # fmt: skip
        slots = {"d_out": d_out, "out": out, "m": m_rows, "lse": lse_rows}
        launch = BoundLaunch(_LAUNCH_DO, grid, args, options, slots)
    qdo = KernelDO(
        do_codes, do_exp, g_t, g_exp, delta, row_factor, blocks.doc_v_t_start, cu_seqlens,
        column_align, g_values,
    )
    return qdo, launch
