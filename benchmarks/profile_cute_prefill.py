"""Where the fp8 cache's CuTe prefill spends its time (H200): per prefill workload, the
planned call (operand layout + forward, what a layer runs), the operand layout alone, the
forward alone, the per-batch schedule (outside a layer's call), and the forward with other
tile configs on the same operands. CUDA-graph replay, medians; writes
``profile_cute_prefill.json``.

    python benchmarks/profile_cute_prefill.py [--workloads S1-1x8192+0,...] [--quick]
"""

from __future__ import annotations

import argparse
import math
import sys
from functools import partial
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from benchmarks.common import graph_time, write_results
from benchmarks.prefill import WORKLOADS, flops
from benchmarks.serving import HEAD_DIM, HKV, HQ, fp8_prefill, planned_call
from flamia_serve.kernels.attn_fwd.cute_sm90 import attn_fwd_sm90
from flamia_serve.kernels.paged import plan_prefill_schedule
from flamia_serve.kernels.paged.ops import prefill_operands
from flamia_serve.kernels.schedule import WorkList, build_work_list

#: (keys, K/V heads) per program of the operand layout kernel
LAYOUT_VARIANTS = ((16, 1), (16, 8), (32, 8))
#: (tile_m, num_stages, overlap) of the forward; tile_n stays 128 (the operands' alignment)
FWD_VARIANTS = ((128, 2, False), (128, 3, False), (128, 2, True), (192, 2, False))


def _profile(
    name: str,
    seed: int,
    rep: int,
    layouts: list[tuple[int, ...]],
    fwd_variants: tuple[tuple[int, int, bool], ...],
) -> list[dict]:
    """Rows of one workload: the planned call, its parts (the layout kernel as each of
    ``layouts``, (keys, heads) per program) and the forward variants."""
    qk_scale = HEAD_DIM**-0.5 * math.log2(math.e)
    dev = torch.device("cuda")
    prep = fp8_prefill(*WORKLOADS[name], dev, seed)
    batch, plan, schedule, decodes, keys = (
        prep.batch, prep.plan, prep.schedule, prep.decodes, prep.keys
    )
    offsets, cfg = schedule.offsets, schedule.config
    cache = batch.caches["fp8"]
    qkv = prefill_operands(batch.q, cache, batch.block_table, batch.seq_lens, plan, offsets,
                           cfg.block_n)  # fmt: skip
    rows_q = plan.num_prefill_tokens
    out = torch.empty_like(batch.q)
    stats = torch.empty(2, rows_q, HQ, dtype=torch.float32, device=dev)

    def layout(chunk: int, heads: int) -> None:
        prefill_operands(batch.q, cache, batch.block_table, batch.seq_lens, plan, offsets,
                         cfg.block_n, chunk, heads)  # fmt: skip

    def forward(tile_m: int, stages: int, overlap: bool, work: WorkList) -> None:
        attn_fwd_sm90(qkv, offsets[0], work, out[decodes:], stats[0], stats[1], heads_q=HQ,
                      causal=True, qk_scale=qk_scale, tile_m=tile_m, tile_n=cfg.block_n,
                      num_stages=stages, overlap=overlap, ticket=cfg.persistent,
                      cu_seqlens_k=offsets[1])  # fmt: skip

    parts = {
        "planned call": planned_call(batch, "fp8", prefill_keys=keys),
        **{f"operand layout, {c} keys x {h} heads per program": partial(layout, c, h)
           for c, h in layouts},
        "schedule (per batch)": partial(plan_prefill_schedule, plan, batch.seq_lens,
                                        batch.query_start_loc),
    }  # fmt: skip
    for tile_m, stages, overlap in fwd_variants:
        work = schedule.work
        if tile_m != cfg.block_m:
            work = build_work_list(offsets[0], rows_q, block_m=tile_m, block_n=cfg.block_n,
                                   causal=True, cu_seqlens_k=offsets[1])  # fmt: skip
        label = f"forward {tile_m}x{cfg.block_n} stages {stages} overlap {int(overlap)}"
        parts[label] = partial(forward, tile_m, stages, overlap, work)
    rows = []
    for part, fn in parts.items():
        try:
            t = graph_time(fn, rep_ms=rep)
        except Exception as exc:  # a config that does not compile or run: reported
            print(f"{name:18s} {part:40s} failed: {type(exc).__name__}: {str(exc)[:200]}")
            continue
        tflops = flops(batch) / (t["ms"] * 1e-3) / 1e12
        rows.append({"workload": name, "pass": "prefill", "impl": f"flamia-fp8 {part}", **t,
                     "tflops": tflops})  # fmt: skip
        print(f"{name:18s} {part:40s} {t['ms']:8.3f} ms {tflops:7.1f} TFLOP/s")
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--workloads", default="S1-1x8192+0,S2-2x4096+4096,S3-4x2048+8192,"
                    "S4-8x512+8192,S5-8x1024+0")  # fmt: skip
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--layouts", default=",".join(f"{c}x{h}" for c, h in LAYOUT_VARIANTS),
                    help="layout kernel programs to time, KEYSxHEADS,... (chunk, heads)")
    ap.add_argument("--no-forward-variants", action="store_true",
                    help="time the planned call, the layouts and the schedule only")
    ap.add_argument("--name", default="profile_cute_prefill")
    args = ap.parse_args(argv)
    layouts = [tuple(int(x) for x in v.split("x")) for v in args.layouts.split(",")]
    fwd = () if args.no_forward_variants else FWD_VARIANTS
    rows = []
    for i, name in enumerate(args.workloads.split(",")):
        rows += _profile(name, i, 50 if args.quick else 200, layouts, fwd)
        torch.cuda.empty_cache()
    shape = {"hq": HQ, "hkv": HKV, "head_dim": HEAD_DIM, "page_size": 16}
    write_results(args.name, rows, {"shape": shape})
    return 0


if __name__ == "__main__":
    sys.exit(main())
