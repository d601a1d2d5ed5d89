"""Launcher of the forward attention kernel (``attn_fwd_kernel``)."""

from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass

import torch

from flamia_serve.kernels._common import (
    BoundCall,
    BoundLaunch,
    TritonLaunch,
    cute_available,
    interpreted,
    round_debug_p_,
    sm_count,
)
from flamia_serve.kernels.attn_fwd.triton import attn_fwd_kernel, attn_fwd_windows_kernel
from flamia_serve.kernels.schedule import WorkList, build_work_list
from flamia_serve.kernels.workspace import PackWorkspace, zero_counter
from flamia_serve.numerics.operands import V_T_ALIGN, KernelQKV

LOG2E = math.log2(math.e)
_LAUNCH = TritonLaunch(attn_fwd_kernel)
_LAUNCH_WINDOWS = TritonLaunch(attn_fwd_windows_kernel)


@dataclass(frozen=True)
class FwdConfig:
    """Kernel, tile shape and launch options.

    ``kernel="triton"`` (portable; CPU interpreter; ``block_m % block_n == 0``): the
    defaults are the H200's best for
    d <= 128 (``benchmarks/tune_fwd.py`` on W1/W3/W6/W9): one program per work item,
    registers capped at 168 so three programs share an SM. ``persistent=True`` takes the
    work list through an atomic ticket with ``programs_per_sm`` programs per SM (measured
    10-15% slower under the same cap: the item loop keeps more values live).

    ``kernel="cute"`` (sm_90, d in {64, 128, 256}; NVFP4 Q/K from the quantizer's widened
    values, at d = 256 with ``block_n`` 64; one pass): the warp-specialized CuTe DSL kernel
    of ``cute_sm90.py``, one CTA per SM taking items after its first by atomic ticket
    (``persistent=True``) or by a static stride of the grid size (``False``);
    ``block_m`` = 64 rows per consumer warpgroup (64, 128 or 192), ``block_n`` 64 or 128
    keys, ``num_stages`` K/V stages, ``overlap`` issues each key tile's Q̂·K̂ᵀ before the
    previous tile's P̂·V̂ finishes, ``promote_pv`` adds each key tile's P̂·V̂ to O in FP32
    (False: it accumulates into O inside the FP8 ``wgmma``, whose additions keep fewer
    bits). ``quantize_q``: the kernel quantizes Q itself as it loads its BF16/FP16 tile (E4M3
    Q/K, d <= 128: see :func:`quantizes_q`), so the quantization launch skips Q.
    ``num_warps``/``maxnreg``/``programs_per_sm`` do not apply.

    ``windows`` (either kernel; E4M3 Q/K, d <= 128): documents of at most ``WINDOW_LIMIT``
    tokens skip the work list; runs of them are computed as single tiles with a
    block-diagonal mask by ``attn_fwd_windows_kernel`` (``schedule.ShortWindows``), one
    launch more.
    """

    block_m: int = 64
    block_n: int = 64
    num_warps: int = 4
    num_stages: int = 3
    persistent: bool = False
    two_pass: bool = False
    maxnreg: int | None = 168  # register cap per thread (None: the compiler's choice)
    programs_per_sm: int = 2  # persistent grid: programs per SM
    kernel: str = "triton"  # "triton" | "cute"
    overlap: bool = True  # cute: overlap Q̂·K̂ᵀ of one key tile with P̂·V̂ of the previous
    promote_pv: bool = True  # cute: each key tile's P̂·V̂ added to O in FP32
    quantize_q: bool = True  # cute: Q quantized inside the forward kernel (quantizes_q)
    windows: bool = False  # short documents in block-diagonal windows (window_limit)

    @property
    def column_align(self) -> int:
        """Column alignment of the layout this forward reads: the CuTe kernel loads whole
        ``block_n``-key V̂ tiles by TMA, so documents start at multiples of ``block_n`` there
        and a tile never holds another document's codes (a NaN there would cross over
        through 0·NaN in P̂·V̂); the Triton kernel masks its loads: ``V_T_ALIGN``."""
        return self.block_n if self.kernel == "cute" else V_T_ALIGN

    def to_ints(self) -> list[int]:
        """The config as ints (what the custom op carries)."""
        return [
            self.block_m, self.block_n, self.num_warps, self.num_stages, int(self.persistent),
            int(self.two_pass), self.maxnreg or 0, self.programs_per_sm,
            int(self.kernel == "cute"), int(self.overlap), int(self.promote_pv),
            int(self.quantize_q), int(self.windows),
        ]  # fmt: skip

    @classmethod
    def from_ints(cls, xs: list[int]) -> FwdConfig:
        (bm, bn, warps, stages, persistent, two_pass, maxnreg, per_sm, cute, overlap, promote, q,
         win) = xs  # fmt: skip
        return cls(
            bm, bn, warps, stages, bool(persistent), bool(two_pass), maxnreg or None, per_sm,
            "cute" if cute else "triton", bool(overlap), bool(promote), bool(q), bool(win),
        )  # fmt: skip


#: the CuTe forward's default on sm_90 (``benchmarks/tune_fwd.py --kernel cute``); P̂·V̂
#: accumulates into O inside the wgmma (H200, ``results/train_attention_pv.json``: W1-W9
#: 1.06-1.34x the per-tile promotion, cos-sim vs float64 equal to 6 digits,
#: ``results/fwd_accumulation.json``)
CUTE_CONFIG = FwdConfig(
    128, 128, num_stages=2, persistent=True, kernel="cute", maxnreg=None, overlap=False,
    promote_pv=False,
)
#: its default at d = 256: P̂·V̂ in two 128-column chunks accumulated in the wgmma, each key
#: tile's Q̂·K̂ᵀ issued before the previous tile's P̂·V̂ (H200, P2, three runs of 2026-12-02:
#: 901-903 TFLOP/s against 853-900 with the per-tile promotion, ``results/
#: tune_fwd_mxfp8_cute_pv_in_mma.json``, ``train_attention_p2_d256_pv.json``; serially
#: accumulated: 753-837)
CUTE_CONFIG_D256 = FwdConfig(
    128, 128, num_stages=2, persistent=True, kernel="cute", maxnreg=None, overlap=True,
    promote_pv=False,
)

#: its default at d = 256 with NVFP4 Q/K: the BF16 score tiles take twice the shared memory
#: of E4M3 ones, so 64-key tiles
CUTE_CONFIG_D256_NVFP4 = FwdConfig(
    128, 64, num_stages=2, persistent=True, kernel="cute", maxnreg=None, overlap=False
)

#: the Triton kernel's default at d = 256: two warpgroups split the 256 output columns (no
#: register spills)
TRITON_CONFIG_D256 = FwdConfig(64, 64, num_warps=8, num_stages=2, persistent=True, maxnreg=None)


def _cute_config(head_dim: int, qk_nvfp4: bool) -> FwdConfig:
    if head_dim >= 256:
        return CUTE_CONFIG_D256_NVFP4 if qk_nvfp4 else CUTE_CONFIG_D256
    return CUTE_CONFIG


@torch.compiler.assume_constant_result
def _cute_available(device: torch.device) -> bool:
    return cute_available(device)


#: mean document length (tokens) below which the Triton kernel runs a pack with E4M3 Q/K:
#: the CuTe kernel's 128-row tiles and 128-column document alignment then do mostly padding
#: (H200, ``train_attention_packs*.json``: 1200 documents of 14 tokens on average, T=16k,
#: d=64: Triton 0.83 ms, CuTe 1.36 ms; 521 documents of 63 on average, T=32k: CuTe 1.10x
#: faster). NVFP4 Q/K (mixed recipes) stay on the CuTe kernel: there the Triton kernel's
#: in-register dequantization costs more (same pack, 1.73 ms CuTe against 2.65 Triton,
#: ``results/train_attention_mixed_short_2026-12-04.json``)
SHORT_DOCUMENTS = 32

#: mean document length (tokens) below which the CuTe forward leaves Q to the quantization
#: launch (``FwdConfig.quantize_q=False``): an item is then mostly one masked tile, and
#: loading the BF16 Q tile and quantizing it at the item's start costs more than the launch
#: saves (H200, ``train_attention_fused_q*.json``, GPU time: P4, 63 tokens on average,
#: -3.7% in two runs; W7-W9, ~350, +2.1 to +2.7%; W1-W6 +0.6 to +4.5%)
FUSED_Q_MIN_DOCUMENT = 128

#: documents of at most this many tokens go to the window kernel (``FwdConfig.windows``):
#: its tiles are twice that (64 rows), so a window holds every document starting in a
#: 32-token chunk
WINDOW_LIMIT = 32
#: the window kernel's persistent programs per SM and warps per program (at 64-row tiles;
#: 8 at 128 rows)
WINDOW_PROGRAMS_PER_SM = 8
WINDOW_NUM_WARPS = 4
#: mean document length (tokens) below which the default config uses windows
WINDOWS_MEAN_DOCUMENT = 128
#: with windows, the CuTe forward still quantizes the Q of the documents it runs (those
#: over ``WINDOW_LIMIT`` tokens) and the quantization launch only the windows' Q
#: (``quantize_qkv(q_short=WINDOW_LIMIT)``), instead of the launch quantizing all of Q
#: (``FUSED_Q_MIN_DOCUMENT`` was measured before windows, with every short document an item)
WINDOWS_FUSED_Q = True


def default_config(
    head_dim: int,
    device: torch.device,
    *,
    qk_nvfp4: bool = False,
    kernel: str | None = None,
    mean_doc_len: float | None = None,
) -> FwdConfig:
    """Kernel and tiles per head dim and Q/K format; small tiles under the CPU interpreter.

    ``kernel=None`` picks the CuTe kernel where it runs (sm_90, d in {64, 128, 256},
    packages installed; with E4M3 Q/K, documents of at least ``SHORT_DOCUMENTS`` tokens on
    average when ``mean_doc_len`` is given; ``FLAMIA_FWD_KERNEL=triton`` opts
    out), quantizing Q itself unless documents are under ``FUSED_Q_MIN_DOCUMENT`` tokens on
    average, else Triton; ``kernel="triton"`` forces the Triton kernel. ``FLAMIA_FWD_CONFIG=
    "block_m,block_n,num_warps,num_stages"`` overrides the Triton tiles (tuning runs).
    With ``kernel=None``, packs of documents under ``WINDOWS_MEAN_DOCUMENT`` tokens on average
    (E4M3 Q/K, d <= 128, on a GPU) also get ``windows`` (the CuTe kernel then quantizes Q
    itself as ``WINDOWS_FUSED_Q`` says: the launch keeps the windows' Q, :func:`q_options`).
    """
    cfg = _default_config(head_dim, device, qk_nvfp4, kernel, mean_doc_len)
    if (
        kernel is None and device.type == "cuda" and not qk_nvfp4 and head_dim <= 128
        and mean_doc_len is not None and mean_doc_len < WINDOWS_MEAN_DOCUMENT
    ):  # fmt: skip
        cfg = dataclasses.replace(cfg, windows=True, quantize_q=WINDOWS_FUSED_Q)
    return cfg


def _default_config(
    head_dim: int,
    device: torch.device,
    qk_nvfp4: bool,
    kernel: str | None,
    mean_doc_len: float | None,
) -> FwdConfig:
    if kernel not in (None, "triton", "cute"):
        raise ValueError(f"kernel must be None, 'triton' or 'cute', got {kernel!r}")
    if kernel == "cute":
        return _cute_config(head_dim, qk_nvfp4)
    if device.type != "cuda":
        return FwdConfig(block_m=32, block_n=16, num_warps=4, num_stages=1, persistent=True)
    override = os.environ.get("FLAMIA_FWD_CONFIG")
    if override:
        bm, bn, warps, stages = (int(x) for x in override.split(","))
        return FwdConfig(bm, bn, warps, stages)
    prefer_triton = os.environ.get("FLAMIA_FWD_KERNEL", "") == "triton"
    short = mean_doc_len is not None and mean_doc_len < SHORT_DOCUMENTS and not qk_nvfp4
    if kernel is None and not (prefer_triton or short) and head_dim in (64, 128, 256):
        if _cute_available(device):
            cfg = _cute_config(head_dim, qk_nvfp4)
            if mean_doc_len is not None and mean_doc_len < FUSED_Q_MIN_DOCUMENT:
                cfg = dataclasses.replace(cfg, quantize_q=False)
            return cfg
    if qk_nvfp4:  # NVFP4 Q/K dequantized in registers: two warpgroups, no cap (tune_fwd.py)
        return TRITON_CONFIG_D256 if head_dim >= 256 else FwdConfig(128, 64, 8, 3, maxnreg=None)
    return TRITON_CONFIG_D256 if head_dim >= 256 else FwdConfig()


def quantizes_q(cfg: FwdConfig, qk_format: str, q: torch.Tensor) -> bool:
    """Whether the forward of ``cfg`` quantizes Q itself (``quantize_qkv(defer_q=True)``):
    the CuTe kernel with ``quantize_q``, E4M3 Q/K, d <= 128 (the BF16/FP16 tile's shared
    memory), and a ``q`` its TMA can load (16-byte aligned start and token/head strides)."""
    if cfg.kernel != "cute" or not cfg.quantize_q or qk_format != "e4m3" or q.shape[-1] > 128:
        return False
    row_elems = 16 // q.element_size()
    return (
        q.stride(-1) == 1 and q.data_ptr() % 16 == 0
        and q.stride(0) % row_elems == 0 and q.stride(1) % row_elems == 0
    )  # fmt: skip


def q_options(cfg: FwdConfig, qk_format: str, q: torch.Tensor) -> dict[str, bool | int]:
    """``quantize_qkv``'s Q options for the forward of ``cfg``: ``defer_q`` where it
    :func:`quantizes_q`, then with windows also ``q_short`` (the window kernel reads the
    codes of the documents it runs)."""
    defer_q = quantizes_q(cfg, qk_format, q)
    return {"defer_q": defer_q, "q_short": window_limit(cfg) if defer_q else 0}


def window_limit(cfg: FwdConfig) -> int:
    """Documents of at most this many tokens go to the window kernel under ``cfg`` (0:
    none): the ``window_limit`` of its work list."""
    return WINDOW_LIMIT if cfg.windows else 0


def _persistent_programs(device: torch.device, cfg: FwdConfig) -> int:
    if device.type != "cuda":
        return 2
    return sm_count(device) * cfg.programs_per_sm


def attn_fwd(
    qkv: KernelQKV, cu_seqlens: torch.Tensor, **options: object
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`attn_fwd_launch`, launched now: ``(O [T, Hq, d], M [T, Hq], lse [T, Hq])``."""
    return attn_fwd_launch(qkv, cu_seqlens, **options)(q=qkv.q_input)


def row_stats(total: int, heads_q: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """``M`` and ``lse``, float32 ``[T, Hq]`` each. Two allocations, not halves of one: the
    custom op ``flamia::attn_varlen_fwd`` returns both, and a custom op's outputs must not
    alias each other."""
    m_rows = torch.empty(total, heads_q, dtype=torch.float32, device=device)
    return m_rows, torch.empty_like(m_rows)


@dataclass
class FwdLaunch:
    """The launches of :func:`attn_fwd_launch`: ``launch(q=...)`` allocates ``O`` ``[T, Hq,
    d]`` (``out_dtype``), ``M``/``lse`` ``[T, Hq]`` float32, draws the persistent grid's
    counter (``ticketed``) and runs the window kernel (``windows``) and the main kernel
    (``main``, None: no token) into them; ``q``: the operands' ``q_input`` (Q left to the
    CuTe kernel) of this call. The first call fills the outputs made while preparing."""

    out_shape: tuple[int, int, int]
    out_dtype: torch.dtype
    device: torch.device
    main: BoundLaunch | BoundCall | None
    windows: BoundLaunch | None
    ticketed: bool
    workspace: PackWorkspace | None
    debug_p: torch.Tensor | None
    first: tuple[torch.Tensor, ...] | None

    def keep(self) -> bool:
        """Bind its launches' slots (``BoundLaunch.keep``): whether a later call with other
        tensors of the same kind can run it."""
        return all([x is None or x.keep() for x in (self.main, self.windows)])

    def __call__(
        self, *, q: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        if self.first is not None:
            (out, m_rows, lse_rows, ticket), self.first = self.first, None
        else:
            out = torch.empty(self.out_shape, dtype=self.out_dtype, device=self.device)
            m_rows, lse_rows = row_stats(*self.out_shape[:2], self.device)
            ticket = zero_counter(self.workspace, self.device) if self.ticketed else None
        if self.windows is not None:
            self.windows(out=out, m=m_rows, lse=lse_rows)
        if self.main is not None:
            self.main(q=q, out=out, m=m_rows, lse=lse_rows, ticket=ticket)
        if self.debug_p is not None:
            round_debug_p_(self.debug_p)
        return out, m_rows, lse_rows


def attn_fwd_launch(
    qkv: KernelQKV,
    cu_seqlens: torch.Tensor,
    *,
    heads_q: int,
    causal: bool,
    softmax_scale: float,
    out_dtype: torch.dtype = torch.bfloat16,
    config: FwdConfig | None = None,
    work: WorkList | None = None,
    debug_p: tuple[torch.Tensor, torch.Tensor] | None = None,
    workspace: PackWorkspace | None = None,
) -> FwdLaunch:
    """Forward from quantized operands, prepared: ``launch(q=qkv.q_input)`` returns ``(O [T,
    Hq, d], M [T, Hq], lse [T, Hq])``. With a ``workspace`` the launch may be kept and called
    again for operands written into the same buffers (``quantize_qkv_launch``), with
    another ``q_input`` of the same dtype, strides and alignment.

    Same contract as ``flamia_serve.reference.attention_forward`` (M integer row reference,
    lse base 2). ``work`` comes from a ``VarlenPlan``; without one it is built here. Without
    ``config`` the CuTe kernel runs only on a layout quantized with its ``column_align``
    and, with NVFP4 Q/K, widened operands (else the Triton kernel does); an explicit CuTe
    config on other operands is an error.
    ``debug_p`` (Triton kernel, small calls): two float32 ``[Hq, T, T]`` buffers that receive
    every P̂ as quantized and the row reference it was quantized against. ``workspace``: the
    pack's (``VarlenPlan.workspace``), for the persistent grid's item counter.
    """
    total, heads_kv, d = qkv.k_codes.shape
    dev = qkv.k_codes.device
    cfg = config or default_config(d, dev, qk_nvfp4=qkv.q4 is not None)
    if config is None and (qkv.column_align % cfg.column_align or qkv.unwidened):  # the operands
        cfg = default_config(d, dev, qk_nvfp4=qkv.q4 is not None, kernel="triton")
    if cfg.kernel == "triton" and cfg.block_m % cfg.block_n:
        raise ValueError(f"block_m ({cfg.block_m}) must be a multiple of block_n ({cfg.block_n})")
    if cfg.kernel not in ("triton", "cute"):
        raise ValueError(f"config.kernel must be 'triton' or 'cute', got {cfg.kernel!r}")
    if cfg.kernel == "cute" and (cfg.two_pass or d not in (64, 128, 256)):
        raise ValueError("config.kernel='cute' runs one pass, head_dim 64, 128 or 256")
    if cfg.kernel == "cute" and qkv.unwidened:
        raise ValueError(
            "config.kernel='cute' runs NVFP4 Q/K (mixed recipes) from quantize_qkv(..., "
            "widen=True)"
        )
    if cfg.kernel == "cute" and qkv.q4 is not None and d > 128 and cfg.block_n > 64:
        raise ValueError(
            f"config.kernel='cute' with NVFP4 Q/K at head_dim {d} takes block_n 64 (the BF16 "
            f"score tiles' shared memory), got {cfg.block_n}"
        )
    if cfg.kernel == "cute" and d > 128 and cfg.overlap and cfg.promote_pv:
        raise ValueError(
            f"config.kernel='cute' at head_dim {d} overlaps Q̂·K̂ᵀ with P̂·V̂ only with "
            "promote_pv=False (promoted, both P̂·V̂ chunks' products would be in flight)"
        )
    if cfg.kernel == "cute" and (cfg.block_m not in (64, 128, 192) or cfg.block_n not in (64, 128)):
        raise ValueError(
            f"config.kernel='cute' takes block_m in (64, 128, 192) and block_n in (64, 128), "
            f"got {cfg.block_m}, {cfg.block_n}"
        )
    if cfg.kernel == "cute" and qkv.column_align % cfg.column_align:
        raise ValueError(
            f"config.kernel='cute' loads whole {cfg.block_n}-key V tiles: quantize with "
            f"column_align={cfg.column_align} (config.column_align), got a layout aligned to "
            f"{qkv.column_align} (a tile would hold the next document's values)"
        )
    if debug_p is not None and cfg.kernel != "triton":
        raise ValueError("debug_p needs the Triton forward (config.kernel='triton')")
    if cfg.kernel == "cute" and not cute_available(dev):
        raise RuntimeError(
            "config.kernel='cute' needs an sm_90 GPU with nvidia-cutlass-dsl and flash-attn-4 "
            '(pip install "flamia-serve[cute]"); use the default config or kernel="triton"'
        )
    short_q_missing = qkv.q_input is not None and qkv.q_short < window_limit(cfg)
    if cfg.windows and (qkv.q4 is not None or short_q_missing or d > 128):
        raise ValueError(
            "config.windows runs E4M3 Q/K at head_dim <= 128 from the short documents' Q "
            "codes (not NVFP4 Q/K; with Q left to the CuTe forward, quantize with q_short="
            f"{window_limit(cfg)}); got head_dim {d}, NVFP4 {qkv.q4 is not None}, Q deferred "
            f"{qkv.q_input is not None} with q_short={qkv.q_short}"
        )
    if cfg.windows and debug_p is not None:
        raise ValueError("debug_p needs config.windows=False (the window kernel has no hook)")
    limit = window_limit(cfg)
    if work is None or (work.block_m, work.block_n, work.causal, work.window_limit) != (
        cfg.block_m, cfg.block_n, causal, limit,
    ):  # fmt: skip
        work = build_work_list(
            cu_seqlens, total, block_m=cfg.block_m, block_n=cfg.block_n, causal=causal,
            window_limit=limit,
        )  # fmt: skip
    out = torch.empty(total, heads_q, d, dtype=out_dtype, device=dev)
    m_rows, lse_rows = row_stats(total, heads_q, dev)
    cute = cfg.kernel == "cute"
    # the persistent grid's item counter (never read otherwise)
    ticket = zero_counter(workspace, dev) if total and (cute or cfg.persistent) else None
    launch = FwdLaunch(
        (total, heads_q, d), out_dtype, dev, None, None, ticket is not None, workspace, None,
        (out, m_rows, lse_rows, ticket),
    )  # fmt: skip
    if total == 0:
        return launch
    slots = {"q": qkv.q_input, "out": out, "m": m_rows, "lse": lse_rows, "ticket": ticket}
    scale_log2 = softmax_scale * LOG2E * qkv.qk_rescale
    if work.windows is not None:
        launch.windows = _windows_launch(qkv, work, slots, heads_q, causal, scale_log2)
    if cute:
        from flamia_serve.kernels.attn_fwd.cute_sm90 import attn_fwd_sm90_call

        launch.main = attn_fwd_sm90_call(
            qkv, cu_seqlens, work, out, m_rows, lse_rows, ticket, heads_q=heads_q,
            causal=causal, qk_scale=scale_log2, tile_m=cfg.block_m, tile_n=cfg.block_n,
            num_stages=cfg.num_stages, overlap=cfg.overlap, persistent=cfg.persistent,
            promote_pv=cfg.promote_pv,
        )  # fmt: skip
        return launch
    nvfp4 = qkv.q4 is not None and qkv.k4 is not None
    q4_args, k4_args = qkv.nvfp4_kernel_args()
    # K exponents shared by aligned key blocks are read once per block (scalar loads)
    ke_block = qkv.k_exp_block if not nvfp4 and cfg.block_n % qkv.k_exp_block == 0 else 1
    dbg_p, dbg_m = debug_p if debug_p is not None else (m_rows, m_rows)
    launch.debug_p = debug_p[0] if debug_p is not None else None  # rounded after the launch
    grid = (_persistent_programs(dev, cfg) if cfg.persistent else work.num_slots * heads_q,)
    args = (
        qkv.q_codes, qkv.q_exp, qkv.k_codes, qkv.k_exp,
        *q4_args, *k4_args, qkv.v_t, qkv.doc_v_t_start, qkv.v_exp,
        cu_seqlens, work.doc, work.tile, work.count, work.count if ticket is None else ticket,
        out, m_rows, lse_rows, dbg_p, dbg_m,
        scale_log2, qkv.v_t.shape[-1], total,
    )  # fmt: skip
    options = dict(
        HQ=heads_q, HKV=heads_kv, D=d, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
        CAUSAL=causal, QK_NVFP4=nvfp4, TWO_PASS=cfg.two_pass, INTERPRET=interpreted(),
        PERSISTENT=cfg.persistent, KE_BLOCK=ke_block, DEBUG_P=debug_p is not None,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        **({"maxnreg": cfg.maxnreg} if cfg.maxnreg else {}),
    )  # fmt: skip
    launch.main = BoundLaunch(_LAUNCH, grid, args, options, slots)
    return launch


def _windows_launch(
    qkv: KernelQKV,
    work: WorkList,
    slots: dict[str, torch.Tensor | None],
    heads_q: int,
    causal: bool,
    scale_log2: float,
) -> BoundLaunch:
    """The short documents of ``work.windows``: persistent programs over (window, K/V head)
    items (each for the query heads of its group), writing into ``slots``' ``out``/``m``/
    ``lse``."""
    windows = work.windows
    total, heads_kv, d = qkv.k_codes.shape
    rows = windows.rows
    out = slots["out"]
    programs = 2 if interpreted() else sm_count(out.device) * WINDOW_PROGRAMS_PER_SM
    args = (
        qkv.q_codes, qkv.q_exp, qkv.k_codes, qkv.k_exp, qkv.v_t, qkv.v_exp, qkv.key_columns(),
        windows.token_doc, windows.start, windows.end, windows.count, out, slots["m"],
        slots["lse"], scale_log2, qkv.v_t.shape[-1], total,
    )  # fmt: skip
    options = dict(
        HQ=heads_q, HKV=heads_kv, D=d, ROWS=rows, CAUSAL=causal, INTERPRET=interpreted(),
        num_warps=8 if rows >= 128 else WINDOW_NUM_WARPS, num_stages=1,
    )  # fmt: skip
    grid = (min(programs, windows.start.numel() * heads_kv),)
    return BoundLaunch(_LAUNCH_WINDOWS, grid, args, options, slots)
