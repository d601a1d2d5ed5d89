"""What dQ's FP32 atomics cost the Triton backward (H200): the kernel alone with and without
dQ (``with_dq=False``, timing only) at d = 256 (Hq 32 / Hkv 8, split and unsplit head dim)
and d = 128, one causal 8k document, operands prequantized on the default 16-column layout.

    python benchmarks/bwd_dq_share.py        # writes bwd_dq_share.json (results_dir)

Run on 2026-12-04 as ``scratch/d256_dq.py`` (the same measurement, which wrote its rows with
the GPU, torch and date in each): ``results/bwd_triton_dq_share_2026-12-04.json``.
"""

from __future__ import annotations

import sys
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from benchmarks.common import time_ms, write_results
from flamia_serve.kernels.attn_bwd.ops import BwdConfig, attn_bwd
from flamia_serve.kernels.attn_fwd.ops import attn_fwd
from flamia_serve.kernels.quant.ops import quantize_do, quantize_qkv
from flamia_serve.kernels.schedule import build_key_work_list

T = 8192


def main() -> int:
    rows = []
    cu = torch.tensor([0, T], dtype=torch.int32, device="cuda")
    for d, hq in ((256, 32), (128, 32)):
        q = torch.randn(T, hq, d, device="cuda", dtype=torch.bfloat16)
        k, v = (torch.randn(T, 8, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        qkv = quantize_qkv(q, k, v, cu, with_transposed=True)
        out, m, lse = attn_fwd(qkv, cu, heads_q=hq, causal=True, softmax_scale=d**-0.5)
        qdo = quantize_do(torch.randn_like(out), out, m, lse, cu)
        work = build_key_work_list(cu, T, block_n=64, block_m=32, causal=True)
        for warps, parts in ((4, 2), (8, 1)) if d == 256 else ((4, 1),):
            for with_dq in (True, False):
                cfg = BwdConfig(num_warps=warps, num_stages=2, head_dim_parts=parts)

                def run(cfg=cfg, with_dq=with_dq, d=d, hq=hq, qkv=qkv, qdo=qdo, m=m, lse=lse,
                        work=work) -> None:  # fmt: skip
                    attn_bwd(qkv, qdo, m, lse, cu, heads_q=hq, causal=True,
                             softmax_scale=d**-0.5, config=cfg, work=work,
                             with_dq=with_dq)  # fmt: skip

                run()
                ms = time_ms(run, warmup_ms=10, rep_ms=60)["ms"]
                row = dict(d=d, warps=warps, parts=parts, with_dq=with_dq, ms=ms)
                print(row, flush=True)
                rows.append(row)
    write_results("bwd_dq_share", rows, {"note": "Triton backward alone, 1 causal doc"})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
