"""Host time of one eager FLAMIA attention call with a prebuilt plan (tiny pack, so the
GPU work is negligible and the wall time per call is the host side: argument checks,
allocations, Triton/CuTe launch binding). Also forward+backward.

Usage: ``python benchmarks/host_time.py`` (writes ``results/host_time.json``).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from benchmarks.common import write_results
from flamia_serve import flamia_attn_varlen, plan_varlen
from flamia_serve.probes import make_pack


def _per_call_us(fn, n: int = 300) -> float:
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(n):
        fn()
    elapsed = time.perf_counter() - start
    torch.cuda.synchronize()
    return elapsed / n * 1e6


def main() -> int:
    q, k, v, cu, ms = make_pack((64, 64), 32, 8, 128, seed=0, device="cuda")
    plan = plan_varlen(cu, 128, ms)
    leaves = [x.detach().clone().requires_grad_() for x in (q, k, v)]
    d_out = torch.randn_like(q)

    def fwd() -> None:
        with torch.no_grad():
            flamia_attn_varlen(q, k, v, cu, ms, plan=plan)

    def fwd_bwd() -> None:
        flamia_attn_varlen(*leaves, cu, ms, plan=plan).backward(d_out)

    rows = []
    for name, fn in (("fwd", fwd), ("fwd+bwd", fwd_bwd)):
        us = _per_call_us(fn)
        rows.append({"workload": "2x64 tokens", "pass": name, "impl": "flamia-mxfp8-host",
                     "ms": us / 1e3, "host_us": us, "tflops": None, "gbps": None})  # fmt: skip
        print(f"{name}: {us:.1f} us per eager call (plan prebuilt)")
    write_results("host_time", rows, {"note": "wall time per eager call, tiny pack"})
    return 0


if __name__ == "__main__":
    sys.exit(main())
