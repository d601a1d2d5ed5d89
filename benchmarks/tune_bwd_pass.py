"""Sweep the memory-bound launches around the CuTe backward kernel (H200): the backward's
Q/K/V re-quantization, dO's quantization, the dQ accumulator's fill and its read-back; and
the forward's K/V quantization (its only launch beside the attention kernel).

    python benchmarks/tune_bwd_pass.py [--workloads W3,W7,P3]

Each launch is timed replayed from a CUDA graph (L2 flushed before each call, median), as
the backward calls it (the pack's workspace, the CuTe backward's operand forms), with GB/s
counting the bytes it must read and write, next to the copy bandwidth of the same run.
Writes ``tune_bwd_pass.json``; the best goes into the launchers' defaults by hand.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from benchmarks.common import copy_bandwidth, graph_time, parse_settings, write_results
from benchmarks.train_attention import make_inputs
from benchmarks.workloads import training_workload

QUANT_SWEEP = [(4, 32), (4, 16), (2, 32), (8, 8)]  # num_warps, programs per SM
DQ_SWEEP = [(32, 32), (32, 8), (32, 4), (32, 2), (16, 4), (64, 4), (64, 2), (128, 1)]


def tune_workload(
    name: str,
    copy_gbps: float,
    quant_sweep: list[tuple[int, int]] = QUANT_SWEEP,
    dq: bool = True,
    rows_form: bool = False,
) -> list[dict]:
    """Rows of every setting (``quant_sweep``: the quantizers') of every launch on workload
    ``name`` (``dq``: with the dQ read-back's sweep; ``rows_form``: the quantizers in the CuTe
    backward's operand forms whatever the installed backward is)."""
    import flamia_serve
    from flamia_serve.kernels.attn_bwd.dq_layout import dq_fragment_index
    from flamia_serve.kernels.attn_bwd.ops import bwd_reads_rows, default_bwd_config
    from flamia_serve.kernels.attn_fwd.ops import default_config
    from flamia_serve.kernels.columns import dq_from_fragments
    from flamia_serve.kernels.quant.ops import quantize_do, quantize_qkv
    from flamia_serve.numerics import operands

    dev = torch.device("cuda")
    wl = training_workload(name)
    cu = wl.cu_seqlens(dev)
    q, k, v = make_inputs(wl, seed=0, device=dev)
    plan = flamia_serve.plan_varlen(cu, wl.total_tokens, wl.max_seqlen)
    cfg = default_config(wl.head_dim, dev, mean_doc_len=wl.total_tokens / wl.num_docs)
    bcfg = default_bwd_config(wl.head_dim, dev, mean_doc_len=wl.total_tokens / wl.num_docs)
    # the backward's layout: the forward's when its alignment suits (AttnCall.backward_layout)
    align = cfg.column_align if cfg.column_align % bcfg.column_align == 0 else bcfg.column_align
    # rows_form: the CuTe backward's operand forms where its config is not the default
    reads_rows = rows_form or bwd_reads_rows(bcfg, wl.head_dim)
    blocks, columns = plan.token_blocks(align), plan.token_columns(align)
    ws = plan.workspace(dev, -1)
    out, m, lse = flamia_serve.flamia_attn_varlen(
        q, k, v, cu, wl.max_seqlen, plan=plan, return_stats=True
    )
    d_out = torch.randn_like(out)
    t, hq, d = q.shape
    hkv = k.shape[1]
    rows = []

    def record(piece: str, setting: str, fn, nbytes: int) -> None:
        us = 1e3 * graph_time(fn)["ms"]
        gbps = nbytes / (us * 1e-6) / 1e9
        rows.append({"workload": name, "piece": piece, "setting": setting, "us": us,
                     "gbps": gbps, "of_copy": gbps / copy_gbps})  # fmt: skip
        print(f"{name} {piece:15s} {setting:28s} {us:8.1f} µs {gbps:6.0f} GB/s "
              f"({100 * gbps / copy_gbps:.0f}% of copy)")  # fmt: skip

    def quant(warps: int, per_sm: int):
        return quantize_qkv(
            q, k, v, cu, blocks=blocks, with_transposed=True, column_align=align,
            columns=columns, workspace=ws, widen=True, q_transposed=not reads_rows,
            q_rows=reads_rows, num_warps=warps, programs_per_sm=per_sm,
        )  # fmt: skip

    def quant_fwd(warps: int, per_sm: int):
        return quantize_qkv(
            q, k, v, cu, blocks=blocks, column_align=align, columns=columns, workspace=ws,
            widen=True, defer_q=True, num_warps=warps, programs_per_sm=per_sm,
        )  # fmt: skip

    def quant_do(warps: int, per_sm: int):
        return quantize_do(
            d_out, out, m, lse, cu, blocks=blocks, column_align=align, workspace=ws,
            g_columns=not reads_rows, g_rows=reads_rows, num_warps=warps, programs_per_sm=per_sm,
        )  # fmt: skip

    # Q/K/V read (BF16); K codes, V̂ᵀ and K̂ᵀ written (E4M3), Q as BF16 rows (else E4M3)
    wide = 2 if reads_rows else 1
    qkv_bytes = 2 * t * (hq + 2 * hkv) * d + 3 * t * hkv * d + wide * t * hq * d
    # the forward's (Q left to the CuTe forward): K/V read, K codes and V̂ᵀ written
    fwd_bytes = 2 * 2 * t * hkv * d + 2 * t * hkv * d
    # dO and O read (BF16); dÔ (E4M3) and Ĝ (BF16 rows, else E4M3 columns) written
    do_bytes = 4 * t * hq * d + t * hq * d + wide * t * hq * d
    for warps, per_sm in quant_sweep:
        setting = f"warps {warps}, {per_sm}/SM"
        for piece, fn, nbytes in (("quantize_qkv", quant, qkv_bytes),
                                  ("quantize_kv fwd", quant_fwd, fwd_bytes),
                                  ("quantize_do", quant_do, do_bytes)):  # fmt: skip
            record(piece, setting, lambda f=fn, w=warps, p=per_sm: f(w, p), nbytes)
    if not dq:
        return rows
    from flamia_serve.kernels.attn_bwd.cute_sm90 import step_queries  # the CuTe DSL

    qkv = quant(4, 32)
    step = step_queries(d, qk_wide=False)  # the CuTe backward's dq_acc blocks (mxfp8)
    acc = torch.randn(hq, qkv.v_t.shape[2] // step, step * d, device=dev)
    at = dq_fragment_index(operands.v_t_key(qkv.key_columns()), step, d)
    record("dq_acc fill", "zero_()", acc.zero_, 4 * acc.numel())
    for block_t, heads in DQ_SWEEP:
        record(
            "dq read-back", f"{block_t} tokens x {heads} heads",
            lambda b=block_t, h=heads: dq_from_fragments(acc, at, d, q.dtype, block_t=b,
                                                         heads_per_program=h),
            4 * t * hq * d + 2 * t * hq * d + 4 * t * d,
        )  # fmt: skip
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workloads", default="W3,W7,P3")
    ap.add_argument("--quant-sweep", default=",".join(f"{w}x{p}" for w, p in QUANT_SWEEP),
                    help="the quantizers' settings, WARPSxPROGRAMS_PER_SM,...")  # fmt: skip
    ap.add_argument("--no-dq", action="store_true", help="skip the dQ read-back sweep")
    ap.add_argument(
        "--rows",
        action="store_true",
        help="the CuTe backward's operand forms (BF16 rows) without its extra",
    )
    ap.add_argument("--name", default="tune_bwd_pass", help="results file name")
    args = ap.parse_args(argv)
    sweep = parse_settings(args.quant_sweep, "WARPSxPROGRAMS_PER_SM")
    copy_gbps = copy_bandwidth(torch.device("cuda"))["gbps"]
    rows = []
    for name in args.workloads.split(","):
        rows += tune_workload(name, copy_gbps, sweep, dq=not args.no_dq, rows_form=args.rows)
        torch.cuda.empty_cache()
    write_results(args.name, rows, {"copy_gbps": copy_gbps})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
