"""Launcher of the forward attention kernel (``attn_fwd_kernel``)."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

import torch

from flamia_serve.kernels._common import interpreted
from flamia_serve.kernels.attn_fwd.triton import attn_fwd_kernel
from flamia_serve.kernels.quant.ops import KernelQKV
from flamia_serve.kernels.schedule import WorkList, build_work_list

LOG2E = math.log2(math.e)


@dataclass(frozen=True)
class FwdConfig:
    """Tile shape and launch options (``block_m % block_n == 0``). The defaults are the
    H200's best for d <= 128 (``benchmarks/tune_fwd.py`` on W1/W3/W6/W9): one program per
    work item, registers capped at 168 so three programs share an SM. ``persistent=True``
    takes the work list through an atomic ticket with ``programs_per_sm`` programs per SM
    (measured 10-15% slower under the same cap: the item loop keeps more values live)."""

    block_m: int = 64
    block_n: int = 64
    num_warps: int = 4
    num_stages: int = 3
    persistent: bool = False
    two_pass: bool = False
    maxnreg: int | None = 168  # register cap per thread (None: the compiler's choice)
    programs_per_sm: int = 2  # persistent grid: programs per SM


def default_config(head_dim: int, device: torch.device, *, qk_nvfp4: bool = False) -> FwdConfig:
    """Tiles per head dim and Q/K format; small tiles under the CPU interpreter (fast tests).

    ``FLAMIA_FWD_CONFIG="block_m,block_n,num_warps,num_stages"`` overrides (tuning runs).
    """
    if device.type != "cuda":
        return FwdConfig(block_m=32, block_n=16, num_warps=4, num_stages=1, persistent=True)
    override = os.environ.get("FLAMIA_FWD_CONFIG")
    if override:
        bm, bn, warps, stages = (int(x) for x in override.split(","))
        return FwdConfig(bm, bn, warps, stages)
    if head_dim >= 256:  # two warpgroups split the 256 output columns: no register spills
        return FwdConfig(64, 64, num_warps=8, num_stages=2, persistent=True, maxnreg=None)
    if qk_nvfp4:  # NVFP4 Q/K dequantized in registers: two warpgroups, no cap (tune_fwd.py)
        return FwdConfig(128, 64, num_warps=8, num_stages=3, maxnreg=None)
    return FwdConfig()


def _persistent_programs(device: torch.device, cfg: FwdConfig) -> int:
    if device.type != "cuda":
        return 2
    return torch.cuda.get_device_properties(device).multi_processor_count * cfg.programs_per_sm


def attn_fwd(
    qkv: KernelQKV,
    cu_seqlens: torch.Tensor,
    *,
    heads_q: int,
    causal: bool,
    softmax_scale: float,
    out_dtype: torch.dtype = torch.bfloat16,
    config: FwdConfig | None = None,
    work: WorkList | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Forward from quantized operands: ``(O [T, Hq, d], M [T, Hq], lse [T, Hq])``.

    Same contract as ``flamia_serve.reference.attention_forward`` (M integer row reference,
    lse base 2). ``work`` comes from a ``VarlenPlan``; without one it is built here.
    """
    total, heads_kv, d = qkv.k_codes.shape
    dev = qkv.k_codes.device
    cfg = config or default_config(d, dev, qk_nvfp4=qkv.q4 is not None)
    if cfg.block_m % cfg.block_n:
        raise ValueError(f"block_m ({cfg.block_m}) must be a multiple of block_n ({cfg.block_n})")
    if work is None or (work.block_m, work.block_n, work.causal) != (
        cfg.block_m,
        cfg.block_n,
        causal,
    ):
        work = build_work_list(
            cu_seqlens, total, block_m=cfg.block_m, block_n=cfg.block_n, causal=causal
        )
    out = torch.empty(total, heads_q, d, dtype=out_dtype, device=dev)
    m_rows = torch.empty(total, heads_q, dtype=torch.float32, device=dev)
    lse_rows = torch.empty_like(m_rows)
    if total == 0:
        return out, m_rows, lse_rows
    q4, k4 = qkv.q4, qkv.k4
    nvfp4 = q4 is not None and k4 is not None
    if nvfp4:
        q4_args = (q4.codes, q4.block_scales, q4.exponents)
        k4_args = (k4.codes, k4.block_scales, k4.exponents)
    else:  # placeholders of the right dtypes, never read
        q4_args = k4_args = (qkv.q_codes.view(torch.uint8), qkv.q_codes, qkv.q_exp)
    # K exponents shared by aligned key blocks are read once per block (scalar loads)
    ke_block = qkv.k_exp_block if not nvfp4 and cfg.block_n % qkv.k_exp_block == 0 else 1
    ticket = torch.zeros(1, dtype=torch.int32, device=dev)
    grid = (_persistent_programs(dev, cfg) if cfg.persistent else work.num_slots * heads_q,)
    attn_fwd_kernel[grid](
        qkv.q_codes, qkv.q_exp, qkv.k_codes, qkv.k_exp,
        *q4_args, *k4_args, qkv.v_t, qkv.doc_v_t_start, qkv.v_exp,
        cu_seqlens, work.doc, work.tile, work.count, ticket,
        out, m_rows, lse_rows,
        softmax_scale * LOG2E * qkv.qk_rescale, qkv.v_t.shape[-1], total,
        HQ=heads_q, HKV=heads_kv, D=d, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
        CAUSAL=causal, QK_NVFP4=nvfp4, TWO_PASS=cfg.two_pass, INTERPRET=interpreted(),
        PERSISTENT=cfg.persistent, KE_BLOCK=ke_block,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        **({"maxnreg": cfg.maxnreg} if cfg.maxnreg else {}),
    )  # fmt: skip
    return out, m_rows, lse_rows
