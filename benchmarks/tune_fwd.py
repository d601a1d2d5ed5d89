"""Sweep forward-kernel tile configs (and persistent / two-pass) on a few workloads.

    python benchmarks/tune_fwd.py [--workloads W3,W6,W9] [--recipe mxfp8] [--kernel cute]

Prints TFLOP/s per config and writes ``tune_fwd.json``; the best goes into
``default_config`` (or ``FLAMIA_FWD_CONFIG``) by hand, with the numbers in the commit.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from benchmarks.common import Rotating, num_input_sets, tensor_bytes, time_ms, write_results
from benchmarks.workloads import training_workload

CONFIGS = [
    # block_m, block_n, num_warps, num_stages, persistent, two_pass, maxnreg, programs/SM
    (64, 64, 4, 3, True, False, None, 2),
    (64, 64, 4, 3, False, False, 168, 3),
    (64, 64, 4, 3, True, False, 168, 3),
    (64, 64, 4, 3, True, False, 168, 6),
    (64, 64, 4, 3, False, False, 128, 4),
]
NVFP4_CONFIGS = [  # mixed recipes: Q/K dequantized to BF16 in registers (more live values)
    (64, 64, 4, 3, False, False, 168, 3),
    (64, 64, 4, 3, False, False, None, 2),
    (64, 64, 4, 3, True, False, None, 2),
    (128, 64, 8, 3, False, False, None, 1),
    (128, 64, 4, 3, True, False, None, 2),
]

CUTE_CONFIGS = [  # block_m, block_n, num_stages, overlap, ticket, promote_pv (kernel="cute")
    (128, 128, 2, False, True, False),
    (128, 128, 2, False, True, True),
    (128, 128, 3, False, True, False),
    (192, 64, 2, False, True, False),
    (128, 64, 2, True, True, False),
]
CUTE_CONFIGS_D256 = [  # d = 256 (workload P2): the 64x256 output accumulator limits the tiles
    (128, 128, 2, False, True, True),
    (128, 64, 2, False, True, True),
    (128, 64, 2, False, True, False),
    (128, 64, 2, True, True, False),
    (128, 128, 2, True, True, False),
    (64, 128, 2, False, True, False),
]


def configs(recipe: str, kernel: str, head_dim: int = 128) -> list:
    """The ``FwdConfig`` list swept for a recipe, kernel and head dim."""
    from flamia_serve.kernels.attn_fwd.ops import FwdConfig, default_config

    if kernel == "cute":  # after the Triton default, which the others are compared with
        triton = default_config(head_dim, torch.device("cuda"), kernel="triton")
        return [triton] + [
            FwdConfig(
                bm, bn, num_stages=st, overlap=ov, persistent=ticket, kernel="cute", maxnreg=None,
                promote_pv=promote,
            )
            for bm, bn, st, ov, ticket, promote in (
                CUTE_CONFIGS_D256 if head_dim >= 256 else CUTE_CONFIGS
            )
        ]
    return [FwdConfig(*e) for e in (NVFP4_CONFIGS if recipe.startswith("mixed") else CONFIGS)]


def tune_workload(name: str, recipe: str, kernel: str = "triton") -> list[dict]:
    """Time every config of ``configs(recipe, kernel)`` on one workload (random BF16 inputs,
    rotated sets)."""
    import dataclasses

    import flamia_serve
    from flamia_serve.kernels.attn_fwd.ops import FwdConfig

    dev = torch.device("cuda")
    wl = training_workload(name)
    cu = wl.cu_seqlens(dev)
    plan = flamia_serve.plan_varlen(cu, wl.total_tokens, wl.max_seqlen)
    gen = torch.Generator(device=dev).manual_seed(0)

    def randn(heads: int) -> torch.Tensor:
        shape = (wl.total_tokens, heads, wl.head_dim)
        return torch.randn(shape, generator=gen, device=dev, dtype=torch.bfloat16)

    first = (randn(wl.hq), randn(wl.hkv), randn(wl.hkv))
    sets = [first] + [
        (randn(wl.hq), randn(wl.hkv), randn(wl.hkv))
        for _ in range(num_input_sets(tensor_bytes(first)) - 1)
    ]
    flops = wl.flops()
    rows = []
    reference = None
    for cfg in configs(recipe, kernel, wl.head_dim):

        def run(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cfg: FwdConfig = cfg):
            return flamia_serve.flamia_attn_varlen(
                q, k, v, cu, wl.max_seqlen, recipe=recipe, plan=plan, config=cfg
            )

        try:
            out = run(*first)
            if reference is None:
                reference = out.float()
            err = (out.float() - reference).abs().max().item()
            t = time_ms(Rotating(run, sets), warmup_ms=10, rep_ms=60)
        except Exception as exc:  # a config that does not compile is skipped
            print(f"{name} {cfg}: FAILED {type(exc).__name__}: {str(exc)[:120]}")
            continue
        tflops = flops / (t["ms"] * 1e-3) / 1e12
        print(f"{name} {cfg}: {t['ms']:.3f} ms {tflops:.0f} TFLOP/s, max|dO| vs first {err:.3g}")
        rows.append({"workload": name, "pass": "fwd", "impl": f"flamia-{recipe}",
                     "config": dataclasses.asdict(cfg), "max_abs_diff_vs_first_config": err,
                     **t, "tflops": tflops, "gbps": None})  # fmt: skip
    return rows


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--workloads", default="W3,W6,W9", help="W1..W9 or pack families P1..P5")
    ap.add_argument("--name", default=None, help="results file stem")
    ap.add_argument("--recipe", default="mxfp8")
    ap.add_argument("--kernel", default="triton", choices=("triton", "cute"))
    args = ap.parse_args()
    rows = []
    for name in args.workloads.split(","):
        rows += tune_workload(name, args.recipe, args.kernel)
    suffix = "_cute" if args.kernel == "cute" else ""
    write_results(args.name or f"tune_fwd_{args.recipe}{suffix}", rows)
    return 0


if __name__ == "__main__":
    with torch.no_grad():
        sys.exit(main())
