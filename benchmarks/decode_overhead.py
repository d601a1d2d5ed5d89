"""Where a short decode's time goes (H200): the default decode (planned, CUDA graph) timed at
several cache lengths per batch size and cache format, after the benchmarks' usual L2 flush
(dirty lines) and after one that leaves L2 clean (``common.time_ms``); a line ``time =
fixed + per_key · L`` fitted to each (``fixed``: what does not shrink with the cache:
launches, the CTAs' start, the warps' merge, the split-K combine, the last wave's tail, the
write-back of a dirty L2), and the kernels of one call at ``--profile`` (B·L) with their GPU
times (``torch.profiler``, no graph, no flush). The first rows time one tiny kernel the same
way: what a graph replay costs the harness whatever it holds.

    python benchmarks/decode_overhead.py [--formats fp8,nvfp4] [--batches 16,64]
        [--lengths 512,2048,8192,32768] [--profile 16x8192] [--name decode_overhead]
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from benchmarks.common import copy_bandwidth, cuda_kernel_times, graph_time, write_results
from benchmarks.serving import make_serving_batch, planned_call


def fit_line(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """Least-squares ``(intercept, slope)`` of ``ys`` over ``xs``."""
    slope, intercept = statistics.linear_regression(xs, ys)
    return intercept, slope


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--formats", default="fp8,nvfp4")
    ap.add_argument("--batches", default="16,64")
    ap.add_argument("--lengths", default="512,2048,8192,32768")
    ap.add_argument("--profile", default="16x8192", help="BxL whose kernels are listed")
    ap.add_argument("--name", default="decode_overhead")
    args = ap.parse_args()
    dev = torch.device("cuda")
    copy_row = copy_bandwidth(dev)
    copy_clean = copy_bandwidth(dev, l2="clean")
    rows: list[dict] = [copy_row, {**copy_clean, "impl": "torch-copy-clean-l2"}]
    tiny = torch.zeros(32, device=dev)
    floor = {}  # the harness: one tiny kernel per graph replay (top level, not a row)
    for l2 in ("dirty", "clean"):
        floor[f"{l2}_l2"] = t = graph_time(tiny.zero_, rep_ms=50, l2=l2)
        print(f"harness floor ({l2} L2): {t['ms'] * 1e3:.1f} us per graph replay")
    formats = args.formats.split(",")
    lengths = [int(x) for x in args.lengths.split(",")]
    fits = {}
    for b in (int(x) for x in args.batches.split(",")):
        times: dict[tuple[str, str], list[float]] = {}
        for length in lengths:
            batch = make_serving_batch([1] * b, [length] * b, dev, seed=b + length)
            for dtype in formats:
                call = planned_call(batch, dtype)
                t = graph_time(call, rep_ms=50)
                clean = graph_time(call, rep_ms=50, l2="clean")["ms"]
                times.setdefault((dtype, "dirty"), []).append(t["ms"] * 1e3)
                times.setdefault((dtype, "clean"), []).append(clean * 1e3)
                kv_bytes = batch.kv_bytes(dtype)
                gbps = kv_bytes / (t["ms"] * 1e-3) / 1e9
                gbps_clean = kv_bytes / (clean * 1e-3) / 1e9
                row = {"workload": f"B{b}-L{length}", "pass": "decode",
                       "impl": f"flamia-{dtype}", **t, "tflops": None, "kv_format": dtype,
                       "gbps": gbps, "pct_copy": gbps / copy_row["gbps"],
                       "ms_clean_l2": clean,
                       "pct_copy_clean_l2": gbps_clean / copy_clean["gbps"]}  # fmt: skip
                if f"{b}x{length}" == args.profile:
                    row["kernels_us"] = cuda_kernel_times(call)
                    print(f"B{b}-L{length} {dtype} kernels:", {
                        k: round(v, 1) for k, v in row["kernels_us"].items()})
                rows.append(row)
                print(f"B{b}-L{length:<6d} {dtype:6s} {t['ms'] * 1e3:8.1f} us "
                      f"{100 * row['pct_copy']:5.1f}% copy; clean L2 {clean * 1e3:8.1f} us "
                      f"{100 * row['pct_copy_clean_l2']:5.1f}%")  # fmt: skip
            del batch
            torch.cuda.empty_cache()
        for (dtype, l2), ys in times.items():
            fixed, per_key = fit_line([float(x) for x in lengths], ys)
            fits[f"B{b}-{dtype}-{l2}-l2"] = {"fixed_us": fixed, "us_per_1k_keys": per_key * 1024}
            print(f"B{b} {dtype} {l2} L2: fixed {fixed:.1f} us, {per_key * 1024:.2f} us per 1k "
                  "keys")  # fmt: skip
    write_results(args.name, rows, {"copy_gbps": copy_row["gbps"],
                                    "copy_gbps_clean_l2": copy_clean["gbps"], "fits": fits,
                                    "harness_floor": floor})
    return 0


if __name__ == "__main__":
    sys.exit(main())
