"""The CuTe decodes' knobs on the GPU (H200): prefetch depth, register cap (CTAs per SM),
the NVFP4 decode's shared-memory ring (stages; 0: the register ring) and split-K count,
against the Triton decode, at B16-L8192, B16-L32768, B64-L8192 and B64-L32768 or any
``B<sequences>-L<keys>`` (Hq 32 / Hkv 8, d 128, page 16), NVFP4 and FP8 caches. Prints and writes
``<name>.json`` (rate over the K/V bytes of the cache read once, and its fraction of the
copy bandwidth of the same run).

    python benchmarks/tune_decode_cute.py [--quick] [--formats nvfp4,fp8] [--depths 1,2]
        [--ctas 0,4] [--stages 0,4] [--edge 0,1] [--warps 4,8] [--splits 2,3,4]
        [--l2 dirty,clean] [--rounds 3] [--default-only]
        [--workloads B16-L8192] [--name tune_decode_cute]

A variant with stages ≥ 2 takes its tiles through the shared-memory ring (``depth`` then
does not apply: it runs once, labelled ``depth1``), with or without the edge split
(``--edge``; the register ring has none). ``--warps``: warps per CTA (labelled ``-warps8``
when not four; the decode config's ``num_warps``). ``--l2``: the flush before each timed call
(``common.time_ms``: dirty, as every table, or clean); ``--rounds``: the variants timed that
many times in turn (each row keeps its round); ``--default-only``: only the Triton decode and
the plan's default.
"""

from __future__ import annotations

import argparse
import itertools
import sys
from dataclasses import replace
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from benchmarks.common import copy_bandwidth, graph_time, write_results
from benchmarks.decode import parse
from benchmarks.serving import HEAD_DIM, HKV, HQ, make_serving_batch
from flamia_serve.kernels.paged import cute_decode_sm90 as cute_decode
from flamia_serve.kernels.paged import paged_attention, plan_paged, triton_decode_config
from flamia_serve.kernels.paged.ops import decode_splits
from flamia_serve.numerics.kv_pages import KVPageFormat

WORKLOADS = ("B16-L8192", "B16-L32768", "B64-L8192", "B64-L32768")


def _tune(batch, name: str, b: int, length: int, dtype: str, depths: list[int],
          ctas_options: list[int], copy_row: dict, quick: bool,
          split_counts: list[int] | None = None, stage_counts: tuple[int, ...] = (0,),
          edge_options: tuple[int, ...] = (0,),
          warp_counts: tuple[int, ...] = (cute_decode.WARPS,),
          l2_modes: tuple[str, ...] = ("dirty",), rounds: int = 1,
          grid: bool = True) -> list[dict]:  # fmt: skip
    """Rows of the Triton decode and the CuTe variants on one workload and cache format."""
    dev = batch.q.device
    rows = []
    fmt = KVPageFormat(dtype, HEAD_DIM)
    triton_decode = triton_decode_config(fmt, HQ, HKV)
    cache = batch.caches[dtype]
    kv_bytes = batch.kv_bytes(dtype)
    triton_splits = decode_splits(b, HKV, length, 128, dev, waves=8)
    cute_splits = decode_splits(b, HKV, length, 128, dev, waves=4)

    def call(splits, decode_config=None, batch=batch, cache=cache, length=length, b=b,
             fmt=fmt):
        return paged_attention(
            batch.q, cache, fmt, batch.block_table, batch.seq_lens, batch.query_start_loc,
            num_decodes=b, max_seq_len=length, validate=False, num_splits=splits,
            decode_config=decode_config,
        )  # fmt: skip

    variants = {f"{dtype}-triton-splits{triton_splits}": (None, triton_splits, triton_decode)}
    plan = plan_paged(fmt, HQ, HKV, batch.query_start_loc.cpu(), length, device=dev)
    # what paged_attention runs when given nothing (the module's knobs, the plan's shape)
    variants[f"{dtype}-default-{plan.decode.kernel}-warps{plan.decode.num_warps}"
             f"-splits{plan.num_splits}"] = (None, None, None)
    counts = split_counts or sorted({max(1, min(64, int(cute_splits * m))) for m in (0.5, 1, 2)})
    for stages in (stage_counts if dtype == "nvfp4" else (0,)) if grid else ():
        # the shared-memory ring has no register depth (labelled 1), the register ring no edge
        # split
        ring = ((e, 1) for e in edge_options) if stages else ((0, d) for d in depths)
        for (edge, depth), ctas, warps, splits in itertools.product(ring, ctas_options,
                                                                     warp_counts, counts):
            tag = f"-stages{stages}" + ("-edge" if edge else "") if stages else ""
            tag += f"-warps{warps}" if warps != cute_decode.WARPS else ""
            label = f"{dtype}-cute-depth{depth}-ctas{ctas}{tag}-splits{splits}"
            cfg = replace(triton_decode, kernel="cute", num_warps=warps)
            variants[label] = ((depth, ctas, stages, edge), splits, cfg)
    reference = call(triton_splits, triton_decode).float()
    knobs = ("DEPTH", "CTAS_PER_SM", "STAGES", "SPLIT_EDGE")
    defaults = tuple(getattr(cute_decode, k) for k in knobs)
    rel_diff: dict[str, float] = {}
    for rnd, (impl, (values, splits, cfg)), l2 in itertools.product(
            range(rounds), variants.items(), l2_modes):  # fmt: skip
        for k, value in zip(knobs, values or defaults, strict=True):
            setattr(cute_decode, k, value)
        try:
            if impl not in rel_diff:
                out = call(splits, cfg).float()
                rel_diff[impl] = float((out - reference).norm() / reference.norm())
            t = graph_time(lambda splits=splits, cfg=cfg: call(splits, cfg),
                           rep_ms=50 if quick else 200, l2=l2)  # fmt: skip
        except Exception as exc:  # recorded; the other variants still run
            print(f"{name} {impl}: failed: {type(exc).__name__}: {exc}"[:300])
            continue
        gbps = kv_bytes / (t["ms"] * 1e-3) / 1e9
        rel = rel_diff[impl]
        rows.append({"workload": name, "pass": "decode", "impl": impl, **t, "tflops": None,
                     "kv_format": dtype, "l2": l2, "round": rnd,
                     "gbps": gbps, "pct_copy": gbps / copy_row["gbps"],
                     "rel_diff_vs_triton": rel})  # fmt: skip
        pct = 100 * gbps / copy_row["gbps"]
        print(f"{name:10s} {impl:40s} {l2:5s} r{rnd} {t['ms'] * 1e3:8.1f} us {pct:5.1f}% copy  "
              f"rel diff vs triton {rel:.2e}")  # fmt: skip
    for k, value in zip(knobs, defaults, strict=True):
        setattr(cute_decode, k, value)
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="50 ms of timing per call")
    ap.add_argument("--formats", default="nvfp4,fp8")
    ap.add_argument("--depths", default="1,2")
    ap.add_argument("--ctas", default="0")
    ap.add_argument("--stages", default="0", help="NVFP4 ring stages (0: register ring)")
    ap.add_argument("--edge", default="1",
                    help="NVFP4 ring: interior tiles without masks (0,1; default 1, as the kernel)")
    ap.add_argument("--warps", default=str(cute_decode.WARPS), help="warps per CTA, e.g. 4,8")
    ap.add_argument("--splits", default="",
                    help="split-K counts to time (default: half, once and twice the default's)")
    ap.add_argument("--l2", default="dirty", help="flush before each call: dirty, clean or both")
    ap.add_argument("--rounds", type=int, default=1, help="times each variant is timed, in turn")
    ap.add_argument("--default-only", action="store_true",
                    help="no grid of knobs: the Triton decode and the plan's default")
    ap.add_argument("--workloads", default=",".join(WORKLOADS))
    ap.add_argument("--name", default="tune_decode_cute")
    args = ap.parse_args()
    dev = torch.device("cuda")
    depths = [int(x) for x in args.depths.split(",")]
    ctas_options = [int(x) for x in args.ctas.split(",")]
    stage_counts = tuple(int(x) for x in args.stages.split(","))
    edge_options = tuple(int(x) for x in args.edge.split(","))
    warp_counts = tuple(int(x) for x in args.warps.split(","))
    copy_row = copy_bandwidth(dev)
    rows: list[dict] = [copy_row]
    split_counts = [int(x) for x in args.splits.split(",") if x]
    for name in args.workloads.split(","):
        b, length = parse(name)
        batch = make_serving_batch([1] * b, [length] * b, dev, seed=b + length)
        for dtype in args.formats.split(","):
            rows += _tune(batch, name, b, length, dtype, depths, ctas_options, copy_row,
                          args.quick, split_counts, stage_counts, edge_options,
                          warp_counts, tuple(args.l2.split(",")), args.rounds,
                          not args.default_only)  # fmt: skip
        del batch
        torch.cuda.empty_cache()
    write_results(args.name, rows, {"copy_gbps": copy_row["gbps"]})
    return 0


if __name__ == "__main__":
    sys.exit(main())
