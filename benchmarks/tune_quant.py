"""Sweep the fused quantization kernel (warps, persistent programs per SM) against the
copy-bandwidth floor, per recipe.

    python benchmarks/tune_quant.py [--workloads W1,W3,W4,W7]
        [--recipes mxfp8,mixed_nvfp4,mixed_nvfp4:1]
(``name:N``: the preset with ``nvfp4_scale_candidates=N``)

GPU time is the kernel replayed from a CUDA graph; ``eager`` adds the host-side launch
(allocations, argument binding), which hides behind the attention kernel in training.
Each recipe is quantized as its default CuTe forward reads it (128-column layout; the mixed
recipes with their widened BF16 copy, ``widen=True``; ``--no-widen`` leaves it out).
Writes ``tune_quant.json``; the best goes into ``quantize_qkv``'s defaults by hand.
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
import sys
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from benchmarks.common import copy_bandwidth, graph_time, time_ms, write_results
from benchmarks.workloads import HEAD_DIM, HKV, HQ, training_workload
from flamia_serve.numerics import Recipe, resolve_recipe

SWEEP = [  # num_warps, persistent programs per SM
    (4, 7), (4, 16), (4, 32), (2, 16), (2, 32), (8, 8), (8, 16), (16, 4),
]


def quant_bytes(total_tokens: int, heads: int, d: int) -> int:
    """Bytes the quantization must move: BF16 read, E4M3 codes + int16 exponents written."""
    return 3 * total_tokens * heads * d + 2 * total_tokens * heads


def main() -> int:
    import flamia_serve
    from flamia_serve.kernels.quant.ops import quantize_qkv

    ap = argparse.ArgumentParser()
    ap.add_argument("--workloads", default="W1,W3,W4,W7")
    ap.add_argument("--recipes", default="mxfp8")
    ap.add_argument("--no-widen", action="store_true", help="mixed recipes: no BF16 copy")
    ap.add_argument("--scores-only", action="store_true",
                    help="mixed recipes: also time scores_only (the CuTe forward's operands)")
    ap.add_argument("--name", default="tune_quant", help="results file stem")
    args = ap.parse_args()
    dev = torch.device("cuda")
    copy = copy_bandwidth(dev)
    rows = [copy]
    for name in args.workloads.split(","):
        wl = training_workload(name)
        cu = wl.cu_seqlens(dev)
        blocks = flamia_serve.plan_varlen(cu, wl.total_tokens, wl.max_seqlen).token_blocks(128)
        t = wl.total_tokens
        q = torch.randn(t, HQ, HEAD_DIM, device=dev, dtype=torch.bfloat16)
        k, v = (torch.randn(t, HKV, HEAD_DIM, device=dev, dtype=torch.bfloat16) for _ in "kv")
        moved = quant_bytes(t, HQ + 2 * HKV, HEAD_DIM)
        floor_ms = moved / (copy["gbps"] * 1e9) * 1e3
        for label in args.recipes.split(","):
            recipe = _recipe(label)
            widen = recipe.qk_format == "nvfp4" and not args.no_widen
            for warps, per_sm, scores_only in [
                (w, p, s) for s in ((False, True) if widen and args.scores_only else (False,))
                for w, p in SWEEP
            ]:  # fmt: skip
                run = functools.partial(
                    quantize_qkv, q, k, v, cu, recipe=recipe, blocks=blocks, column_align=128,
                    num_warps=warps, programs_per_sm=per_sm, widen=widen, scores_only=scores_only,
                )  # fmt: skip
                gpu = graph_time(run)
                eager = time_ms(run)
                print(f"{name} {label} widen={widen} scores_only={scores_only} warps={warps} "
                      f"programs/SM={per_sm}: "
                      f"GPU {gpu['ms'] * 1e3:.1f} us "
                      f"(mxfp8 floor {floor_ms * 1e3:.1f} us, ratio {gpu['ms'] / floor_ms:.2f}), "
                      f"eager {eager['ms'] * 1e3:.1f} us")  # fmt: skip
                rows.append({"workload": name, "pass": "quant", "impl": f"flamia-{label}-quant",
                             "recipe": label, "widen": widen, "scores_only": scores_only,
                             "num_warps": warps, "programs_per_sm": per_sm,
                             **gpu, "eager_ms": eager["ms"], "tflops": None,
                             "gbps": moved / (gpu["ms"] * 1e-3) / 1e9,
                             "floor_ratio": gpu["ms"] / floor_ms})  # fmt: skip
    write_results(args.name, rows)
    return 0


def _recipe(label: str) -> Recipe:
    """A preset name, or ``name:N`` for the preset with ``nvfp4_scale_candidates=N``."""
    name, _, candidates = label.partition(":")
    recipe = resolve_recipe(name)
    if candidates:
        recipe = dataclasses.replace(recipe, nvfp4_scale_candidates=int(candidates))
    return recipe


if __name__ == "__main__":
    with torch.no_grad():
        sys.exit(main())
