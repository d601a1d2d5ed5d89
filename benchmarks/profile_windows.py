"""GPU time per kernel of the default forward, with and without short-document windows
(``FwdConfig.windows``), from ``torch.profiler`` (H200):

    python benchmarks/profile_windows.py P1 P4

Prints, per workload and mode, the host time per call (a loop of eager calls), the wall
time per call, and the average GPU time of each kernel of the call (quantization, the
window kernel, the per-document kernel).
"""

from __future__ import annotations

import dataclasses
import functools
import sys
import time
from collections.abc import Callable
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
from torch.profiler import ProfilerActivity, profile

import flamia_serve
from benchmarks.workloads import training_workload
from flamia_serve.kernels.attn_fwd.ops import default_config


def _profile(label: str, call: Callable[[], object]) -> None:
    """Host and wall time per call of ``call``, then the GPU time of each of its kernels."""
    for _ in range(3):
        call()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(20):
        call()
    host = (time.perf_counter() - start) / 20
    torch.cuda.synchronize()
    wall = (time.perf_counter() - start) / 20
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            call()
        torch.cuda.synchronize()
    print(f"== {label}: host {host * 1e6:.0f} us, wall {wall * 1e6:.0f} us per call")
    for e in sorted(prof.key_averages(), key=lambda e: -e.device_time_total)[:6]:
        if e.device_time_total > 0:
            per_call = e.device_time_total / e.count
            print(f"   {e.key[:70]:70s} x{e.count:<3d} {per_call:9.1f} us")


def main(names: list[str]) -> None:
    dev = torch.device("cuda")
    for name in names:
        wl = training_workload(name)
        cu, m, t = wl.cu_seqlens(dev), wl.max_seqlen, wl.total_tokens
        q = torch.randn(t, wl.hq, wl.head_dim, device=dev, dtype=torch.bfloat16)
        k, v = (torch.randn(t, wl.hkv, wl.head_dim, device=dev, dtype=torch.bfloat16) for _ in "kv")
        plan = flamia_serve.plan_varlen(cu, t, m)
        base = default_config(wl.head_dim, dev, mean_doc_len=t / wl.num_docs)
        for cfg in (base, dataclasses.replace(base, windows=False)):
            _profile(
                f"{name} kernel={cfg.kernel} windows={cfg.windows}",
                functools.partial(
                    flamia_serve.flamia_attn_varlen, q, k, v, cu, m, plan=plan, config=cfg
                ),
            )


if __name__ == "__main__":
    main(sys.argv[1:] or ["P1", "P4"])
