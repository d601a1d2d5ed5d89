"""Launcher of the backward kernel (``attn_bwd_kernel``)."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from flamia_serve.kernels._common import (
    BoundCall,
    BoundLaunch,
    TritonLaunch,
    interpreted,
    round_debug_p_,
)
from flamia_serve.kernels.attn_bwd.triton import attn_bwd_kernel
from flamia_serve.kernels.attn_fwd.ops import _cute_available, cute_available
from flamia_serve.kernels.schedule import WorkList, build_key_work_list
from flamia_serve.kernels.workspace import PackWorkspace, zeroed_accumulator
from flamia_serve.numerics import Recipe, resolve_recipe
from flamia_serve.numerics.operands import V_T_ALIGN, KernelDO, KernelQKV

LOG2E = math.log2(math.e)
_LAUNCH = TritonLaunch(attn_bwd_kernel)


@dataclass(frozen=True)
class BwdConfig:
    """Tile shape and launch options of the backward kernel.

    ``block_m`` queries per step must equal the recipe's token block (one dÔ/Ĝ/Q exponent
    per step) and ``block_n`` keys per tile the width of ``recipe.dq_ds_block`` (one dS
    exponent per step and tile in dQ = dS·K̂).

    ``kernel="triton"``: the portable kernel (CPU interpreter), one program per ``block_n``
    keys. ``kernel="cute"`` (sm_90, d 64, 128 or 256, a layout whose column alignment is a
    multiple of 128; NVFP4 Q/K from ``quantize_qkv(..., widen=True)``): the CuTe DSL
    kernel of ``cute_sm90.py``, one CTA per 128 keys (at d = 256 two launches, a dK/dQ
    pass and a dV pass, or with NVFP4 Q/K two CTAs each with half the head dim of
    dK/dV/dQ: ``cute_sm90.bwd_modes``; two warpgroups of ``block_n`` = 64
    keys; query steps of two ``block_m`` blocks, one for NVFP4 Q/K at d = 128 and at
    d = 256, ``cute_sm90.STEP_FOR_D``), ``num_stages`` query steps in flight;
    ``num_warps``/``maxnreg`` are Triton's. ``head_dim_parts`` (Triton): programs that share
    a key tile, each accumulating dK/dV/dQ for ``head_dim / head_dim_parts`` columns (each
    rebuilds the scores and dP over the whole head dim; the results are the same).
    """

    block_m: int = 32
    block_n: int = 64
    num_warps: int = 4
    num_stages: int = 2
    maxnreg: int | None = None
    kernel: str = "triton"  # "triton" | "cute"
    head_dim_parts: int = 1

    @property
    def column_align(self) -> int:
        """Column alignment of the layout this backward reads (``quantize_qkv``/
        ``quantize_do(column_align=...)``): the CuTe kernel loads whole 128-key tiles by TMA,
        the Triton kernel masks its loads (``V_T_ALIGN``). It need not be the forward's: the
        layout moves columns, not codes, so P̂ is rebuilt bit for bit either way."""
        return CUTE_BWD_COLUMN_ALIGN if self.kernel == "cute" else V_T_ALIGN

    @property
    def work_block_n(self) -> int:
        """Keys per item of the key work list this backward reads."""
        return 2 * self.block_n if self.kernel == "cute" else self.block_n

    def to_ints(self) -> list[int]:
        """The config as ints (what the custom op carries)."""
        return [self.block_m, self.block_n, self.num_warps, self.num_stages, self.maxnreg or 0,
                int(self.kernel == "cute"), self.head_dim_parts]  # fmt: skip

    @classmethod
    def from_ints(cls, xs: list[int]) -> BwdConfig:
        bm, bn, warps, stages, maxnreg, cute, parts = xs
        kernel = "cute" if cute else "triton"
        return cls(bm, bn, warps, stages, maxnreg or None, kernel, parts)


#: the CuTe backward's default on sm_90 (``results/bwd_kernels.json``; at d = 256 three
#: stages ran as fast as two, 8.86 vs 8.88 ms on P2, and 64-query steps with one stage
#: slower, 11.1 ms: ``results/bwd_d256_stages_2026-12-04.log``)
CUTE_BWD_CONFIG = BwdConfig(num_stages=2, kernel="cute")
#: documents start at multiples of this many columns in the CuTe backward's layout
CUTE_BWD_COLUMN_ALIGN = 128
#: packs of documents shorter than this on average take the Triton backward: padded to 128
#: columns each, the CuTe backward's layout (its FP32 dQ accumulator, the Q/Ĝ copies) would
#: hold more than ~16 columns per token (``v_t_length``: T + 127 per document; P1's 1200
#: documents in 16k tokens: ~169k columns, a 1.4 GB accumulator at d = 64 by its shape). A
#: memory guard, not a speed rule: P1 (mean 14 tokens, d = 64) ran faster on the CuTe
#: backward, fwd+bwd 2.72 ms against 3.26 on Triton (H200,
#: ``results/train_attention_own_layout_2026-12-04.json``)
CUTE_BWD_MIN_MEAN_DOCUMENT = 8

#: head dims at which the CuTe backward multiplies dK/dV in BF16 (E4M3 values times powers
#: of two are exact in BF16; the products accumulate in FP32 across steps, no per-step
#: promotion) from ``KernelQKV.q_rows`` and ``KernelDO.g_rows``; at the others it multiplies
#: the E4M3 codes of ``q_t``/``g_t`` and promotes each half (H200, causal, TFLOP/s, same call:
#: d = 128 271.9 / 292.6 -> 292.5 / 316.8 at T = 8192 / 16384,
#: ``results/bwd_variants_bf16_kv_d128_2026-12-03.json``; at d = 64 BF16 lost, 246 -> 228,
#: ``results/bwd_variants_bf16_kv_2026-12-03.json``)
CUTE_BF16_KV_HEAD_DIMS = frozenset({128, 256})


def bwd_reads_rows(config: BwdConfig, head_dim: int, grad_input: bool = False) -> bool:
    """Whether the backward of ``config`` reads Q's codes and Ĝ as BF16 rows by column
    (quantize with ``quantize_qkv(q_rows=True, q_transposed=False)`` and
    ``quantize_do(g_rows=True, g_columns=False)``) instead of the E4M3 column layout: the
    CuTe kernel at ``CUTE_BF16_KV_HEAD_DIMS``, and at every head dim for a recipe with
    ``grad_qk="input"`` (``grad_input``; its ``q_rows`` hold Q's input, and the Triton kernel
    reads them too, but Ĝ from the column layout)."""
    return config.kernel == "cute" and (head_dim in CUTE_BF16_KV_HEAD_DIMS or grad_input)


def cute_bwd_runs(head_dim: int, column_align: int = CUTE_BWD_COLUMN_ALIGN) -> bool:
    """The CuTe backward's operand limits (the device aside; NVFP4 Q/K also need the
    quantizer's widened values)."""
    return head_dim in (64, 128, 256) and column_align % CUTE_BWD_COLUMN_ALIGN == 0


def default_bwd_config(
    head_dim: int,
    device: torch.device,
    *,
    qk_nvfp4: bool = False,
    kernel: str | None = None,
    mean_doc_len: float | None = None,
    grad_input: bool = False,
) -> BwdConfig:
    """The CuTe kernel where it runs (``cute_bwd_runs`` on an sm_90 GPU with the ``cute``
    extra), whichever kernel ran the forward (the backward quantizes into its own layout,
    ``BwdConfig.column_align``), unless documents are under ``CUTE_BWD_MIN_MEAN_DOCUMENT``
    tokens on average (when ``mean_doc_len`` is given); ``grad_input`` (the recipe's
    ``grad_qk == "input"``) runs there too, as the CuTe kernel's BF16 dQ form (H200, W3
    backward 65.1 ms against the Triton kernel's 310, ``results/train_attention_grad_input_
    2026-12-05.json``). Else the Triton kernel: one warpgroup; at d=256 two programs per
    key tile, each with 128 columns of dK/dV/dQ (H200, P2's shape: 63.5 ms against 69.3
    for 8 warps unsplit, ``results/tune_bwd_d256_2026-12-04.json``; the CuTe kernel 8.9
    ms). H200, T=8192 causal, d=128: 4 warps 15.5 ms, 8 warps 20.3 ms
    (``benchmarks/profile_bwd.py``) although 4 warps spill a little
    (``tests/kernels/sm90_compile.py -v``).
    ``kernel="triton"`` forces Triton."""
    del qk_nvfp4  # both Q/K formats run on both kernels (NVFP4 widened for the CuTe one)
    if kernel not in (None, "triton"):
        raise ValueError(f"kernel must be None or 'triton', got {kernel!r}")
    if device.type != "cuda":
        return BwdConfig(num_warps=4, num_stages=1)
    short = mean_doc_len is not None and mean_doc_len < CUTE_BWD_MIN_MEAN_DOCUMENT
    del grad_input  # both gradient-operand forms run on both kernels
    cute = kernel is None and not short and cute_bwd_runs(head_dim)
    if cute and _cute_available(device):
        return CUTE_BWD_CONFIG
    return BwdConfig(num_warps=4, head_dim_parts=1 if head_dim <= 128 else 2)


def check_bwd_config(cfg: BwdConfig, recipe: Recipe) -> None:
    """The tile shape must match the recipe's scale blocks (``ValueError`` says which)."""
    if cfg.block_m != recipe.token_block or recipe.ds_block[0] != cfg.block_m:
        raise ValueError(
            f"backward block_m ({cfg.block_m}) must equal the recipe's token block "
            f"({recipe.token_block}) and ds_block rows ({recipe.ds_block[0]})"
        )
    if recipe.dq_ds_block != (cfg.block_m, cfg.block_n):
        raise ValueError(
            f"backward tile (block_m, block_n) = ({cfg.block_m}, {cfg.block_n}) must equal "
            f"the recipe's dq_ds_block {recipe.dq_ds_block}"
        )
    if cfg.kernel not in ("triton", "cute"):
        raise ValueError(f"backward config.kernel must be 'triton' or 'cute', got {cfg.kernel!r}")
    if cfg.kernel == "cute" and (cfg.block_m, cfg.block_n) != (32, 64):
        raise ValueError(
            f"backward config.kernel='cute' takes (block_m, block_n) = (32, 64), got "
            f"({cfg.block_m}, {cfg.block_n})"
        )
    if cfg.block_n % recipe.ds_block[1]:
        raise ValueError(
            f"backward block_n ({cfg.block_n}) must be a multiple of ds_block keys "
            f"({recipe.ds_block[1]})"
        )
    if cfg.head_dim_parts not in (1, 2, 4) or (cfg.kernel == "cute" and cfg.head_dim_parts != 1):
        raise ValueError(
            "backward config.head_dim_parts must be 1, 2 or 4 (1 with kernel='cute'), got "
            f"{cfg.head_dim_parts}"
        )


def _cute_refusal(
    d: int,
    heads_q: int,
    total: int,
    qkv: KernelQKV,
    with_dq: bool,
    device: torch.device,
) -> str | None:
    """Why the CuTe backward cannot run this call (``None``: it can)."""
    if heads_q * total * d >= 2**31:  # the kernel addresses its dQ buffer with int32
        return f"takes heads_q·T·head_dim < 2^31, got {heads_q}·{total}·{d}"
    if not with_dq:
        return "always computes dQ (with_dq=False is Triton's)"
    if not cute_bwd_runs(d, qkv.column_align):
        return (
            "runs head_dim 64, 128 or 256 on a layout with a column alignment that is a multiple "
            f"of 128 (got head_dim {d}, column_align {qkv.column_align})"
        )
    if qkv.unwidened:
        return "runs NVFP4 Q/K (mixed recipes) from quantize_qkv(..., widen=True)"
    if not cute_available(device):
        return (
            "needs an sm_90 GPU with nvidia-cutlass-dsl and flash-attn-4 (pip install "
            '"flamia-serve[cute]")'
        )
    return None


def attn_bwd(
    qkv: KernelQKV,
    qdo: KernelDO,
    m_rows: torch.Tensor,
    lse_rows: torch.Tensor,
    cu_seqlens: torch.Tensor,
    **options: object,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`attn_bwd_launch`, launched now: ``(dQ [T, Hq, d], dK [T, Hkv, d], dV [T, Hkv,
    d])``."""
    m_rows, lse_rows = m_rows.contiguous(), lse_rows.contiguous()
    launch = attn_bwd_launch(qkv, qdo, m_rows, lse_rows, cu_seqlens, **options)
    return launch(m=m_rows, lse=lse_rows)


@dataclass
class BwdLaunch:
    """The launches of :func:`attn_bwd_launch`: ``launch(m=, lse=)`` (the forward's ``[T,
    Hq]`` statistics, contiguous) zeroes the dQ accumulator ``dq_acc``, allocates dK/dV
    (``kv_shape``, ``out_dtype``), runs ``gather`` (the CuTe kernels' token-major V codes)
    and ``kernels`` into them and returns ``(finish(), dK, dV)`` (``finish``: dQ in the
    output dtype from ``dq_acc``). The first call takes the accumulator, dK/dV and gathered
    V as prepared (``first``). ``keepable``: False when preparing computed something from
    this call's operands (it cannot run again: :meth:`keep` says so)."""

    kv_shape: tuple[int, int, int]
    out_dtype: torch.dtype
    device: torch.device
    dq_acc: torch.Tensor
    gather: Callable[[], object] | None
    kernels: list[BoundLaunch | BoundCall]
    finish: Callable[[], torch.Tensor]
    debug_p: torch.Tensor | None
    first: tuple[torch.Tensor, torch.Tensor] | None
    keepable: bool = True

    def keep(self) -> bool:
        """Bind its kernels' slots (``BoundLaunch.keep``): whether later calls can run it."""
        return all([kernel.keep() for kernel in self.kernels]) and self.keepable

    def __call__(
        self, *, m: torch.Tensor, lse: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        if self.first is not None:
            (dk, dv), self.first = self.first, None
        else:
            self.dq_acc.zero_()
            dk = torch.empty(self.kv_shape, dtype=self.out_dtype, device=self.device)
            dv = torch.empty_like(dk)
            if self.gather is not None:
                self.gather()
        for kernel in self.kernels:
            kernel(m=m, lse=lse, dk=dk, dv=dv)
        if self.debug_p is not None:
            round_debug_p_(self.debug_p)
        return self.finish(), dk, dv


def attn_bwd_launch(
    qkv: KernelQKV,
    qdo: KernelDO,
    m_rows: torch.Tensor,
    lse_rows: torch.Tensor,
    cu_seqlens: torch.Tensor,
    *,
    heads_q: int,
    causal: bool,
    softmax_scale: float,
    recipe: str | Recipe = "mxfp8",
    out_dtype: torch.dtype = torch.bfloat16,
    config: BwdConfig | None = None,
    work: WorkList | None = None,
    debug_p: torch.Tensor | None = None,
    with_dq: bool = True,
    workspace: PackWorkspace | None = None,
) -> BwdLaunch:
    """The backward, prepared: ``launch(m=m_rows, lse=lse_rows)`` returns ``(dQ [T, Hq, d],
    dK [T, Hkv, d], dV [T, Hkv, d])`` in ``out_dtype``. With a ``workspace`` the launch may
    be kept (``BwdLaunch.keep``) and called again for operands written into the same
    buffers, with other statistics of the same layout.

    Same contract as ``flamia_serve.reference.attention_backward`` (accumulation order
    aside; dQ is summed with FP32 atomics, so it is not bitwise repeatable run to run).
    ``qkv`` must carry the column-layout copies (``quantize_qkv(..., with_transposed=True)``),
    ``qdo`` comes from ``quantize_do``, ``m_rows``/``lse_rows`` ``[T, Hq]`` float32 from the
    forward. ``work``: a key-tile list from the plan (built here otherwise). ``debug_p``: a
    float32 ``[Hq, T, T]`` buffer that receives every P̂ as rebuilt (small calls only).
    ``with_dq=False`` skips dQ (returned as zeros; profiling only). ``workspace``: the
    pack's (``VarlenPlan.workspace``), for the dQ accumulator and layout copies.
    """
    rec = resolve_recipe(recipe)
    if qkv.grad_input != rec.grad_input:
        raise ValueError(
            f"recipe {rec.name} has grad_qk={rec.grad_qk!r}, qkv was quantized for "
            f"grad_qk={'input' if qkv.grad_input else 'codes'}: quantize with the recipe the "
            "backward runs"
        )
    if qkv.grad_input and (qkv.q_rows is None or qkv.k_rows is None):
        raise ValueError(
            f"recipe {rec.name} multiplies dS by the unquantized Q/K: quantize with "
            "with_transposed=True, q_rows=True and k_rows=True"
        )
    if qkv.k_t is None and not qkv.grad_input:
        raise ValueError("qkv lacks k_t: quantize with with_transposed=True for the backward")
    if qdo.column_align != qkv.column_align or qdo.g_exp.shape[-1] != qkv.v_t.shape[-1]:
        raise ValueError(
            f"qdo's column layout (column_align {qdo.column_align}, {qdo.g_exp.shape[-1]} columns) "
            f"is not qkv's ({qkv.column_align}, {qkv.v_t.shape[-1]}): pass quantize_do the "
            "column_align (or blocks) that quantize_qkv used"
        )
    total, heads_kv, d = qkv.k_codes.shape
    dev = qkv.k_codes.device
    nvfp4 = qkv.q4 is not None and qkv.k4 is not None
    cfg = config or default_bwd_config(d, dev, qk_nvfp4=nvfp4, grad_input=qkv.grad_input)
    check_bwd_config(cfg, rec)
    refusal = None
    if cfg.kernel == "cute":
        refusal = _cute_refusal(d, heads_q, total, qkv, with_dq, dev)
    if refusal:
        if config is not None:
            raise ValueError(f"backward config.kernel='cute' {refusal}; use kernel='triton'")
        cfg = default_bwd_config(d, dev, kernel="triton")
    if work is None or (work.block_m, work.block_n, work.causal, work.by_keys) != (
        cfg.block_m, cfg.work_block_n, causal, True,
    ):  # fmt: skip
        work = build_key_work_list(
            cu_seqlens, total, block_n=cfg.work_block_n, block_m=cfg.block_m, causal=causal
        )
    if cfg.kernel == "cute":
        from flamia_serve.kernels.attn_bwd.cute_sm90 import attn_bwd_sm90_launch

        dq_acc, gather, kernels, finish, dk, dv, keepable = attn_bwd_sm90_launch(
            qkv, qdo, m_rows, lse_rows, cu_seqlens, work, heads_q=heads_q, causal=causal,
            softmax_scale=softmax_scale, qk_scale=softmax_scale * LOG2E * qkv.qk_rescale,
            dk_keys=rec.ds_block[1], out_dtype=out_dtype,
            bf16_kv=bwd_reads_rows(cfg, d, qkv.grad_input),
            debug_p=debug_p,
            num_stages=cfg.num_stages, workspace=workspace,
        )  # fmt: skip
        return BwdLaunch(dk.shape, out_dtype, dev, dq_acc, gather, kernels, finish, debug_p,
                         (dk, dv), keepable)  # fmt: skip
    if (qkv.q_t is None and not qkv.grad_input) or qdo.g_t is None:
        raise ValueError(
            "the Triton backward reads qkv.q_t and qdo.g_t: quantize with q_transposed=True "
            "and quantize_do(..., g_columns=True) (the defaults)"
        )
    dq_acc = zeroed_accumulator(workspace, (total, heads_q, d), dev)
    dk = torch.empty(total, heads_kv, d, dtype=out_dtype, device=dev)
    dv = torch.empty_like(dk)
    launch = BwdLaunch(
        dk.shape, out_dtype, dev, dq_acc, None, [],
        lambda: dq_acc.to(out_dtype, copy=True), debug_p, (dk, dv),
    )  # fmt: skip
    if total == 0:
        return launch
    q4_args, k4_args = qkv.nvfp4_kernel_args()
    if d // cfg.head_dim_parts < 32:
        raise ValueError(
            f"backward config.head_dim_parts ({cfg.head_dim_parts}) leaves "
            f"{d // cfg.head_dim_parts} head-dim columns per program at head_dim {d}; "
            "each part needs at least 32"
        )
    grid = (work.num_slots * heads_kv * cfg.head_dim_parts,)
    # the operands a call does not read get placeholders of their dtypes
    q_t = qkv.q_t if qkv.q_t is not None else qkv.q_codes
    k_t = qkv.k_t if qkv.k_t is not None else qkv.k_codes
    q_rows = qkv.q_rows if qkv.grad_input else dq_acc.view(torch.bfloat16)
    k_rows = qkv.k_rows if qkv.grad_input else q_rows
    m, lse = m_rows.contiguous(), lse_rows.contiguous()
    args = (
        qkv.q_codes, qkv.q_exp, q_t, q_rows, qkv.k_codes, qkv.k_exp, k_t, k_rows, *q4_args,
        *k4_args,
        qkv.v_t, qkv.v_exp, qkv.doc_v_t_start,
        qdo.do_codes, qdo.do_exp, qdo.g_t, qdo.g_exp, qdo.delta,
        m, lse,
        cu_seqlens, work.doc, work.tile, work.count,
        dq_acc, dk, dv, debug_p if debug_p is not None else dq_acc,
        softmax_scale * LOG2E * qkv.qk_rescale, softmax_scale, qkv.v_t.shape[-1], total,
    )  # fmt: skip
    options = dict(
        HQ=heads_q, HKV=heads_kv, D=d, D_OUT=d // cfg.head_dim_parts, BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n,
        DK_KEYS=rec.ds_block[1], CAUSAL=bool(causal), QK_NVFP4=nvfp4,
        DEBUG_P=debug_p is not None, WITH_DQ=with_dq, GRAD_INPUT=qkv.grad_input,
        INTERPRET=interpreted(),
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        **({"maxnreg": cfg.maxnreg} if cfg.maxnreg else {}),
    )  # fmt: skip
    slots = {"m": m, "lse": lse, "dk": dk, "dv": dv}
    launch.kernels.append(BoundLaunch(_LAUNCH, grid, args, options, slots))
    return launch
