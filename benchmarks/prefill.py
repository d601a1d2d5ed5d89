"""Prefill / extend over a paged KV cache: flamia (BF16 / FP8 / NVFP4 cache × exp modes) vs
FlashInfer's paged prefill.

Workloads (DESIGN.md §7: 1–8 sequences of 512–8192 new tokens on 0–8192 cached ones), plus a
mixed batch of decodes and prefills through the one entry point. Hq=32, Hkv=8, d=128,
page 16, random page order; CUDA-graph replay, median. FLOPs count the causal
(query, key) pairs: ``4·Hq·d·Σ_seq Σ_i (cached + i + 1)``. ``cos_vs_exact``: cosine
similarity with FP32 attention over the BF16 K/V.

    python benchmarks/prefill.py [--workloads S1,S2] [--quick]
"""

from __future__ import annotations

import argparse
import sys
import traceback
from collections.abc import Callable
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from benchmarks.common import plot_rows, positive_int, write_results
from benchmarks.serving import (
    HEAD_DIM,
    HKV,
    HQ,
    PAGE,
    ServingBatch,
    flamia_impls,
    flashinfer_page_table,
    import_flashinfer,
    make_serving_batch,
    measure,
)

# name -> (new tokens per sequence, cached tokens per sequence)
WORKLOADS: dict[str, tuple[list[int], list[int]]] = {
    "S1-1x8192+0": ([8192], [0]),
    "S2-2x4096+4096": ([4096] * 2, [4096] * 2),
    "S3-4x2048+8192": ([2048] * 4, [8192] * 4),
    "S4-8x512+8192": ([512] * 8, [8192] * 8),
    "S5-8x1024+0": ([1024] * 8, [0] * 8),
    "MIX-32dec@4096+2x2048+1024": ([1] * 32 + [2048] * 2, [4095] * 32 + [1024] * 2),
}


def workload_seed(name: str) -> int:
    """The seed of workload ``name``'s batch: its place in :data:`WORKLOADS`, so a workload
    gets the same tokens and page order however ``--workloads`` lists it (it was the place
    in that list); ``SystemExit`` names the choices otherwise."""
    if name not in WORKLOADS:
        raise SystemExit(f"unknown workload {name!r}; choose from {', '.join(WORKLOADS)}")
    return list(WORKLOADS).index(name)


def flops(batch: ServingBatch) -> float:
    """Causal (query, key) pairs x 4·Hq·d: each new token sees the cached ones and the new
    ones up to itself."""
    pairs = 0
    for n, length in zip(batch.q_lens, batch.seq_lens_list, strict=True):
        cached = length - n
        pairs += n * cached + n * (n + 1) // 2
    return 4.0 * HQ * HEAD_DIM * pairs


def flashinfer_impls(batch: ServingBatch) -> dict[str, tuple[str, Callable[[], torch.Tensor]]]:
    flashinfer = import_flashinfer()
    if flashinfer is None:
        return {}
    dev = batch.q.device
    kv_indptr, indices, last = flashinfer_page_table(batch)
    variants = {
        "flashinfer-bf16": (batch.kv_nhd, torch.bfloat16, "auto"),
        "flashinfer-fp8-fa2": (batch.kv_nhd.to(torch.float8_e4m3fn), torch.float8_e4m3fn, "fa2"),
    }
    impls = {}
    for name, (cache, kv_dtype, backend) in variants.items():
        try:
            ws = torch.empty(256 << 20, dtype=torch.uint8, device=dev)
            wrapper = flashinfer.BatchPrefillWithPagedKVCacheWrapper(ws, "NHD", backend=backend)
            wrapper.plan(batch.query_start_loc, kv_indptr, indices, last, HQ, HKV, HEAD_DIM,
                         PAGE, causal=True, q_data_type=torch.bfloat16,
                         kv_data_type=kv_dtype)  # fmt: skip

            def call(wrapper=wrapper, cache=cache) -> torch.Tensor:
                return wrapper.run(batch.q, cache)

            call()
            impls[name] = ("bf16" if kv_dtype == torch.bfloat16 else "fi-fp8", call)
        except Exception as exc:
            traceback.print_exc(limit=2)
            print(f"{name}: skipped ({type(exc).__name__}: {str(exc)[:200]})")
    return impls


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--workloads", default=",".join(WORKLOADS))
    ap.add_argument("--impls", default="", help="comma-separated substrings of impl names")
    ap.add_argument("--quick", action="store_true", help="50 ms of timing per call")
    ap.add_argument("--rounds", type=positive_int, default=1,
                    help="time the impls this many times, in reverse order every other round "
                    "(medians; serving.measure)")  # fmt: skip
    ap.add_argument("--name", default="prefill")
    args = ap.parse_args(argv)
    dev = torch.device("cuda")
    rows: list[dict] = []
    names = args.workloads.split(",")
    seeds = {name: workload_seed(name) for name in names}
    for name in names:
        new, cached = WORKLOADS[name]
        batch = make_serving_batch(new, [c + n for c, n in zip(cached, new, strict=True)], dev,
                                   seed=seeds[name])  # fmt: skip
        impls = {**flamia_impls(batch), **flashinfer_impls(batch)}
        for row in measure(name, "prefill", batch, impls, impl_filter=args.impls,
                           quick=args.quick, rounds=args.rounds):  # fmt: skip
            row.update(tflops=flops(batch) / (row["ms"] * 1e-3) / 1e12, gbps=None)
            print(f"{name:28s} {row['impl']:28s} {row['ms']:8.3f} ms {row['tflops']:7.1f} "
                  f"TFLOP/s cos {row['cos_vs_exact']:.5f}")  # fmt: skip
            rows.append(row)
        del batch, impls
        torch.cuda.empty_cache()
    for r in rows:
        same = [x for x in rows if x["workload"] == r["workload"]]
        exact_ms = [x["ms"] for x in same if x["impl"] == r["impl"].rsplit("-", 1)[0] + "-exact"]
        if r["impl"].startswith("flamia") and exact_ms:
            r["speedup_vs_exact_exp"] = exact_ms[0] / r["ms"]
        fi = [x["ms"] for x in same if x["impl"].startswith("flashinfer")]
        if fi:
            r["speedup_vs_best_baseline"] = min(fi) / r["ms"]
    definitions = {name: {"new": WORKLOADS[name][0], "cached": WORKLOADS[name][1],
                          "seed": seeds[name]} for name in names}  # fmt: skip
    shape = {"hq": HQ, "hkv": HKV, "head_dim": HEAD_DIM, "page_size": PAGE}
    write_results(args.name, rows, {"shape": shape, "workloads": definitions})
    plot_rows(args.name, rows, metric="tflops")
    return 0


if __name__ == "__main__":
    sys.exit(main())
