"""Decode over a paged KV cache: flamia (BF16 / FP8 / NVFP4 cache × exp modes) vs FlashInfer.

Workloads (DESIGN.md §7): B ∈ {1, 16, 64} sequences × context L ∈ {1024, 8192, 32768},
Hq=32, Hkv=8, d=128, page 16, pages in random order; one new token per sequence. Every
call is timed as a CUDA-graph replay (median, L2 flushed before each call). ``gbps`` counts
the K/V bytes of the format read once; ``pct_copy`` = that over the measured copy
bandwidth. ``--clean-l2`` also times each call after a flush that leaves L2 clean
(``ms_clean_l2``, ``pct_copy_clean_l2``): the default flush leaves it dirty, and a short
decode then pays the write-back of someone else's data (``common.time_ms``).
``cos_vs_exact``: cosine similarity with FP32 attention over the BF16 K/V.

FlashInfer 0.6.14 baselines on the same tokens: BF16 KV (CUDA-core decode), FP8 KV
(CUDA-core and tensor-core ``fa2`` decode, scale 1 — the data fits E4M3 unscaled) and its
sm90 NVFP4 path (``fa2``, lookup-table dequant) fed our NVFP4 bytes.

    python benchmarks/decode.py [--workloads B64-L8192,...] [--quick]
"""

from __future__ import annotations

import argparse
import re
import sys
import traceback
from collections.abc import Callable
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from benchmarks.common import copy_bandwidth, plot_rows, positive_int, write_results
from benchmarks.serving import (
    HEAD_DIM,
    HKV,
    HQ,
    PAGE,
    ServingBatch,
    flamia_impls,
    flashinfer_nvfp4_cache,
    flashinfer_page_table,
    import_flashinfer,
    make_serving_batch,
    measure,
)
from flamia_serve.numerics.exp2 import P_E4M3, probabilities

WORKLOADS = [f"B{b}-L{n}" for b in (1, 16, 64) for n in (1024, 8192, 32768)]


def parse(name: str) -> tuple[int, int]:
    """``B16-L8192`` -> (16 sequences, 8192 keys each)."""
    match = re.fullmatch(r"B(\d+)-L(\d+)", name)
    if not match:
        raise ValueError(f"workload {name!r}: expected B<sequences>-L<keys>, e.g. B16-L8192")
    return int(match[1]), int(match[2])


def flashinfer_impls(batch: ServingBatch) -> dict[str, tuple[str, Callable[[], torch.Tensor]]]:
    flashinfer = import_flashinfer()
    if flashinfer is None:
        return {}
    dev = batch.q.device
    # every sequence's pages, the last one partly filled where L is not a multiple of PAGE
    indptr, indices, last = flashinfer_page_table(batch)
    fp8 = batch.kv_nhd.to(torch.float8_e4m3fn)
    nv_codes, nv_scales = flashinfer_nvfp4_cache(batch)
    variants = {
        "flashinfer-bf16": ("bf16", False, batch.kv_nhd, None, torch.bfloat16),
        "flashinfer-fp8-cudacore": ("fi-fp8", False, fp8, None, torch.float8_e4m3fn),
        "flashinfer-fp8-tc": ("fi-fp8", True, fp8, None, torch.float8_e4m3fn),
        "flashinfer-nvfp4-tc": ("nvfp4", True, nv_codes, nv_scales, torch.uint8),
    }
    impls = {}
    for name, (fmt, tensor_cores, cache, sf, kv_dtype) in variants.items():
        try:
            ws = torch.empty(256 << 20, dtype=torch.uint8, device=dev)
            wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
                ws, "NHD", use_tensor_cores=tensor_cores
            )
            wrapper.plan(indptr, indices, last, HQ, HKV, HEAD_DIM, PAGE,
                         pos_encoding_mode="NONE", q_data_type=torch.bfloat16,
                         kv_data_type=kv_dtype)  # fmt: skip

            def call(wrapper=wrapper, cache=cache, sf=sf) -> torch.Tensor:
                if sf is None:
                    return wrapper.run(batch.q, cache)
                return wrapper.run(batch.q, cache, kv_cache_sf=sf)

            call()
            impls[name] = (fmt, call)
        except Exception as exc:
            traceback.print_exc(limit=2)
            print(f"{name}: skipped ({type(exc).__name__}: {str(exc)[:200]})")
    return impls


def p_code_agreement(batch: ServingBatch) -> dict[str, float]:
    """Fraction of E4M3 P̂ codes equal to the exactly rounded code, over the real scores of
    the first sequence (Direct-P with Schraudolph vs Mitchell-P, DESIGN N9)."""
    length = batch.seq_lens_list[0]
    pages = batch.block_table[0, : -(-length // PAGE)].long()
    k = batch.kv_nhd[pages][:, 0].reshape(-1, HKV, HEAD_DIM)[:length].float()
    q = batch.q[:1].float().view(HKV, HQ // HKV, HEAD_DIM)
    x = torch.einsum("hgd,jhd->hgj", q, k) * HEAD_DIM**-0.5 * 1.4426950408889634
    t = x - torch.ceil(x.amax(-1, keepdim=True))
    exact, _ = probabilities(t, "exact", P_E4M3)
    out = {}
    for mode in ("schraudolph", "mitchell"):
        codes, _ = probabilities(t, mode, P_E4M3)
        out[mode] = float((codes == exact).float().mean())
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--workloads", default=",".join(WORKLOADS))
    ap.add_argument("--impls", default="", help="comma-separated substrings of impl names")
    ap.add_argument("--quick", action="store_true", help="50 ms of timing per call")
    ap.add_argument("--rounds", type=positive_int, default=1,
                    help="time the impls this many times, in reverse order every other round "
                    "(medians; serving.measure)")  # fmt: skip
    ap.add_argument("--clean-l2", action="store_true",
                    help="also time after an L2 flush that leaves clean lines")
    ap.add_argument("--name", default="decode")
    args = ap.parse_args(argv)
    dev = torch.device("cuda")
    rows: list[dict] = []
    copy_row = copy_bandwidth(dev)
    copy_clean = copy_bandwidth(dev, l2="clean")["gbps"] if args.clean_l2 else None
    extra: dict = {"copy_gbps": copy_row["gbps"], "copy_gbps_clean_l2": copy_clean,
                   "shape": {"hq": HQ, "hkv": HKV, "head_dim": HEAD_DIM, "page_size": PAGE},
                   "p_code_agreement": {}, "workloads": {}}  # fmt: skip
    for name in args.workloads.split(","):
        b, length = parse(name)
        extra["workloads"][name] = {"sequences": b, "seq_len": length, "new_tokens": 1,
                                    "seed": b + length}  # fmt: skip
        batch = make_serving_batch([1] * b, [length] * b, dev, seed=b + length)
        extra["p_code_agreement"][name] = p_code_agreement(batch)
        impls = {**flamia_impls(batch), **flashinfer_impls(batch)}
        for row in measure(name, "decode", batch, impls, impl_filter=args.impls,
                           quick=args.quick, clean_l2=args.clean_l2,
                           rounds=args.rounds):  # fmt: skip
            kv_bytes = batch.kv_bytes(row["kv_format"])
            gbps = kv_bytes / (row["ms"] * 1e-3) / 1e9
            row.update(tflops=None, gbps=gbps, pct_copy=gbps / copy_row["gbps"])
            clean = ""
            if "ms_clean_l2" in row:
                row["pct_copy_clean_l2"] = kv_bytes / (row["ms_clean_l2"] * 1e-3) / 1e9 / \
                    copy_clean  # fmt: skip
                clean = (f"  clean L2 {row['ms_clean_l2'] * 1e3:7.1f} us "
                         f"{100 * row['pct_copy_clean_l2']:5.1f}%")  # fmt: skip
            print(f"{name:10s} {row['impl']:28s} {row['ms'] * 1e3:9.1f} us {gbps:8.0f} GB/s "
                  f"{100 * row['pct_copy']:5.1f}% copy  cos {row['cos_vs_exact']:.5f}"
                  + clean)  # fmt: skip
            rows.append(row)
        del batch, impls
        torch.cuda.empty_cache()
    add_speedups(rows)
    rows.append(copy_row)
    write_results(args.name, rows, extra)
    plot_rows(args.name, [r for r in rows if r["pass"] == "decode"], metric="gbps")
    return 0


def add_speedups(rows: list[dict]) -> None:
    """``speedup_vs_flashinfer_fp8``: FlashInfer's fastest FP8-KV decode time over ours (and
    ``speedup_vs_flashinfer_fp8_clean_l2`` with the clean-L2 times, where measured)."""
    for key, suffix in (("ms", ""), ("ms_clean_l2", "_clean_l2")):
        for r in rows:
            fi = [x[key] for x in rows if x["workload"] == r["workload"] and key in x
                  and x["impl"].startswith("flashinfer-fp8")]  # fmt: skip
            if fi and key in r:
                r[f"speedup_vs_flashinfer_fp8{suffix}"] = min(fi) / r[key]


if __name__ == "__main__":
    sys.exit(main())
