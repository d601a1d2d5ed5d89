"""Sweep ``num_warps`` of the fused quantization kernel against the copy-bandwidth floor.

python benchmarks/tune_quant.py [--workloads W1,W3]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from benchmarks.common import time_ms
from benchmarks.workloads import HEAD_DIM, HKV, HQ, training_workload


def main() -> int:
    import flamia_serve
    from flamia_serve.kernels.quant.ops import quantize_qkv

    ap = argparse.ArgumentParser()
    ap.add_argument("--workloads", default="W1,W3")
    args = ap.parse_args()
    dev = torch.device("cuda")
    n = 1 << 29
    src = torch.randn(n, device=dev, dtype=torch.bfloat16)
    dst = torch.empty_like(src)
    copy_gbps = 4 * n / (time_ms(lambda: dst.copy_(src))["ms"] * 1e-3) / 1e9
    print(f"copy {copy_gbps:.0f} GB/s")
    for name in args.workloads.split(","):
        wl = training_workload(name)
        cu = wl.cu_seqlens(dev)
        blocks = flamia_serve.plan_varlen(cu, wl.total_tokens, wl.max_seqlen).blocks
        t = wl.total_tokens
        q = torch.randn(t, HQ, HEAD_DIM, device=dev, dtype=torch.bfloat16)
        k, v = (torch.randn(t, HKV, HEAD_DIM, device=dev, dtype=torch.bfloat16) for _ in "kv")
        moved = 3 * t * (HQ + 2 * HKV) * HEAD_DIM + t * (HQ + 2 * HKV)  # read 2 B, write 1 B
        for warps in (1, 2, 4, 8):
            args = (q, k, v, cu)
            ms = time_ms(
                lambda a=args, b=blocks, w=warps: quantize_qkv(
                    *a, recipe="mxfp8", blocks=b, num_warps=w
                )
            )["ms"]
            floor = moved / (copy_gbps * 1e9) * 1e3
            print(f"{name} warps={warps}: {ms * 1e3:.1f} us, floor {floor * 1e3:.1f} us, "
                  f"ratio {ms / floor:.2f}")  # fmt: skip
    return 0


if __name__ == "__main__":
    with torch.no_grad():
        sys.exit(main())
