"""Backward kernel configs on the H200: time ``attn_bwd`` alone (operands quantized outside
timing) for warps/stages/register caps, on training workloads and other head dims.

Usage: ``python benchmarks/tune_bwd.py [--workloads W3,W6,P2] [--configs 8x2x1,8x2x2]
[--no-extra-shapes] [--name NAME]`` (writes ``results/tune_bwd.json``; a config is
``WARPSxSTAGESxHEAD_DIM_PARTS``). The ``fwd+bwd`` rows of ``train_attention.py`` time the default.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from benchmarks.common import parse_settings, time_ms, write_results
from benchmarks.workloads import training_workload
from flamia_serve.kernels.attn_bwd.ops import BwdConfig, attn_bwd
from flamia_serve.kernels.attn_fwd.ops import attn_fwd
from flamia_serve.kernels.quant.ops import quantize_do, quantize_qkv
from flamia_serve.kernels.schedule import build_key_work_list

CONFIGS = "4x2x1,8x2x1,8x3x1"  # num_warps x num_stages x head_dim_parts


def _shapes(workloads: list[str], extra: bool) -> list[tuple[str, list[int], int, int, int]]:
    """(name, document lengths, hq, hkv, d): the workloads' own heads and head dim, plus
    (``extra``) one 8k document at d=64/256."""
    shapes = []
    for w in workloads:
        wl = training_workload(w)
        shapes.append((w, wl.seqlens, wl.hq, wl.hkv, wl.head_dim))
    if extra:
        shapes += [("1x8192-d64", [8192], 32, 8, 64), ("1x8192-d256", [8192], 16, 8, 256)]
    return shapes


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--workloads", default="W3,W6")
    ap.add_argument("--configs", default=CONFIGS, help="WARPSxSTAGESxHEAD_DIM_PARTS,...")
    ap.add_argument("--no-extra-shapes", action="store_true", help="only --workloads")
    ap.add_argument("--name", default="tune_bwd", help="results file name")
    args = ap.parse_args(argv)
    configs = parse_settings(args.configs, "WARPSxSTAGESxHEAD_DIM_PARTS")
    rows = []
    for name, lens, hq, hkv, d in _shapes(args.workloads.split(","), not args.no_extra_shapes):
        total = sum(lens)
        cu = torch.zeros(len(lens) + 1, dtype=torch.int32)
        cu[1:] = torch.tensor(lens).cumsum(0)
        cu = cu.cuda()

        def randn(h: int, d: int = d, total: int = total) -> torch.Tensor:
            return torch.randn(total, h, d, device="cuda", dtype=torch.bfloat16)

        q, k, v, d_out = randn(hq), randn(hkv), randn(hkv), randn(hq)
        qkv = quantize_qkv(q, k, v, cu, with_transposed=True)
        out, m, lse = attn_fwd(qkv, cu, heads_q=hq, causal=True, softmax_scale=d**-0.5)
        qdo = quantize_do(d_out, out, m, lse, cu)
        flops = 2.5 * 4 * sum(n * n / 2 for n in lens) * hq * d
        for warps, stages, parts in configs:
            cfg = BwdConfig(num_warps=warps, num_stages=stages, head_dim_parts=parts)
            work = build_key_work_list(cu, total, block_n=64, block_m=32, causal=True)

            def run(cfg=cfg, work=work, hq=hq, d=d, qkv=qkv, qdo=qdo, m=m, lse=lse, cu=cu):
                attn_bwd(qkv, qdo, m, lse, cu, heads_q=hq, causal=True, softmax_scale=d**-0.5,
                         config=cfg, work=work)  # fmt: skip

            try:
                run()
                t = time_ms(run, warmup_ms=10, rep_ms=100)
            except Exception as exc:  # a config that does not compile is a result too
                print(f"{name} {cfg}: FAILED {type(exc).__name__}: {str(exc)[:120]}")
                continue
            tflops = flops / (t["ms"] * 1e-3) / 1e12
            rows.append({"workload": name, "pass": "bwd", "impl": "flamia-bwd-kernel",
                         "num_warps": warps, "num_stages": stages, "head_dim_parts": parts,
                         "hq": hq, "hkv": hkv, "d": d, **t, "tflops": tflops, "gbps": None})
            print(f"{name:12s} warps={warps} stages={stages} head_dim_parts={parts}: "
                  f"{t['ms']:.3f} ms {tflops:.1f} TFLOP/s")  # fmt: skip
        torch.cuda.empty_cache()
    write_results(args.name, rows, {"note": "attn_bwd kernel alone, operands prequantized"})
    return 0


if __name__ == "__main__":
    sys.exit(main())
