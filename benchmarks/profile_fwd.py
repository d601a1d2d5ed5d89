"""One forward of a standard workload, for a profiler (H200):

    ncu -k regex:FlamiaFwdSm90 --launch-skip 1 --launch-count 1 \\
        --section WarpStateStats --section SchedulerStats --section SpeedOfLight \\
        python benchmarks/profile_fwd.py W3

The first call compiles (skipped by ``--launch-skip 1``), the second is profiled.
"""

from __future__ import annotations

import sys
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

import flamia_serve
from benchmarks.workloads import training_workload


def main(name: str = "W3") -> None:
    """Two forwards of workload ``name`` with its own heads and head dim (W1-W9: 32/8, 128;
    the pack families theirs, e.g. P3 MHA 16/16)."""
    dev = torch.device("cuda")
    wl = training_workload(name)
    cu = wl.cu_seqlens(dev)
    gen = torch.Generator(device=dev).manual_seed(0)
    q, k, v = (
        torch.randn(wl.total_tokens, h, wl.head_dim, generator=gen, device=dev,
                    dtype=torch.bfloat16)
        for h in (wl.hq, wl.hkv, wl.hkv)
    )  # fmt: skip
    for _ in range(2):
        flamia_serve.flamia_attn_varlen(q, k, v, cu, wl.max_seqlen)
    torch.cuda.synchronize()


if __name__ == "__main__":
    main(*sys.argv[1:2])
