"""One backward kernel launch of a pack, for ``ncu`` and variant timing.

``python benchmarks/profile_bwd.py [--tokens 8192] [--d 128] [--warps 8] [--stages 2]
[--no-dq] [--full] [--kernel cute] [--step 64] [--workload W6]`` times ``attn_bwd``
(operands prequantized, on the CuTe forward's 128-column layout; Hq/Hkv 32/8, one causal
document, or ``--workload``'s pack, heads and head dim) and prints ms and TFLOP/s
(``--step``: the CuTe kernel's queries per step at ``--d``, ``STEP_FOR_D``); under
``ncu -k regex:attn_bwd_kernel --launch-skip 1 --launch-count 1`` (CuTe:
``regex:FlamiaBwd``) profile the second launch.
"""

from __future__ import annotations

import argparse
import itertools
import sys
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from benchmarks.common import time_ms
from benchmarks.workloads import training_workload
from flamia_serve.kernels.attn_bwd.ops import BwdConfig, attn_bwd
from flamia_serve.kernels.attn_fwd.ops import attn_fwd
from flamia_serve.kernels.quant.ops import quantize_do, quantize_qkv


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--d", type=int, default=128)
    ap.add_argument("--warps", type=int, default=8)
    ap.add_argument("--stages", type=int, default=2)
    ap.add_argument("--no-dq", action="store_true")
    ap.add_argument("--full", action="store_true", help="non-causal")
    ap.add_argument("--once", action="store_true", help="two launches only (for ncu)")
    ap.add_argument("--kernel", choices=["triton", "cute"], default="triton")
    ap.add_argument("--step", type=int, default=0, help="CuTe queries per step (0: default)")
    ap.add_argument("--workload", default="",
                    help="a pack of benchmarks/workloads.py (W1..W9, P1..P5, E1..E128) instead "
                    "of one document of --tokens")  # fmt: skip
    args = ap.parse_args(argv)
    t, d, hq, hkv = args.tokens, args.d, 32, 8
    seqlens = [t]
    if args.workload:
        w = training_workload(args.workload)
        t, d, hq, hkv, seqlens = w.total_tokens, w.head_dim, w.hq, w.hkv, list(w.seqlens)
    if args.step:
        from flamia_serve.kernels.attn_bwd import cute_sm90

        cute_sm90.STEP_FOR_D[d] = args.step
    causal = not args.full
    cu = torch.tensor([0, *itertools.accumulate(seqlens)], dtype=torch.int32, device="cuda")

    def randn(h: int) -> torch.Tensor:
        return torch.randn(t, h, d, device="cuda", dtype=torch.bfloat16)

    q, k, v, d_out = randn(hq), randn(hkv), randn(hkv), randn(hq)
    qkv = quantize_qkv(q, k, v, cu, with_transposed=True, column_align=128, q_rows=True)
    out, m, lse = attn_fwd(qkv, cu, heads_q=hq, causal=causal, softmax_scale=d**-0.5)
    qdo = quantize_do(d_out, out, m, lse, cu, column_align=128, g_rows=True)
    cfg = BwdConfig(num_warps=args.warps, num_stages=args.stages, kernel=args.kernel)

    def run() -> None:
        attn_bwd(qkv, qdo, m, lse, cu, heads_q=hq, causal=causal, softmax_scale=d**-0.5,
                 config=cfg, with_dq=not args.no_dq)  # fmt: skip

    run()
    if args.once:
        run()
        torch.cuda.synchronize()
        return 0
    ms = time_ms(run, warmup_ms=10, rep_ms=100)["ms"]
    flops = 2.5 * 4 * sum(n * n for n in seqlens) / (2 if causal else 1) * hq * d
    print(f"{args.kernel} {args.workload or 'one document'} T={t} d={d} causal={causal} "
          f"warps={args.warps} stages={args.stages} "
          f"step={args.step or 'default'} "
          f"dq={not args.no_dq}: {ms:.3f} ms {flops / ms / 1e9:.1f} TFLOP/s")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
