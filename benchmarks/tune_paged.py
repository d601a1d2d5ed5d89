"""Tile configs of the paged attention kernel on the GPU: decode at B64-L8192 and prefill at
S3 (4×2048 new on 8192 cached), every cache format, exact exp. Prints and writes JSON.

    python benchmarks/tune_paged.py
"""

from __future__ import annotations

import functools
import itertools
import sys
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from benchmarks.common import graph_time, write_results
from benchmarks.serving import HEAD_DIM, make_serving_batch
from flamia_serve.kernels.paged import PagedConfig, paged_attention
from flamia_serve.numerics.kv_pages import KV_CACHE_DTYPES, KVPageFormat


def _grid(kind: str, fmt: KVPageFormat) -> list[tuple[PagedConfig, int]]:
    """(config, decode splits) candidates: the 8-bit caches also try the swapped operands
    (``keys_on_m``), their decodes deeper pipelines."""
    if kind == "prefill":
        shapes = ((64, 64, 4, 2), (64, 64, 4, 3), (64, 64, 4, 4), (128, 64, 8, 2),
                  (128, 64, 8, 3), (128, 128, 8, 2), (64, 128, 4, 2), (64, 32, 4, 2))
        grid = [(PagedConfig(*c), 1) for c in shapes]
        if fmt.dtype.v_dim_major:
            swapped = ((64, 64, 8, 2), (64, 128, 8, 2), (32, 128, 4, 2), (64, 64, 4, 2),
                       (128, 64, 8, 2))  # 8 warps: no spills in the local sm_90 compile
            grid += [(PagedConfig(*c, keys_on_m=True), 1) for c in swapped]
        return grid
    if fmt.dtype.v_dim_major:
        return [(PagedConfig(16, bn, 4, st, keys_on_m=km), sp) for km, bn, st, sp in
                itertools.product((False, True), (64, 128), (2, 3, 4), (4, 8, 16))]  # fmt: skip
    return [(PagedConfig(16, bn, 4, st), sp) for bn, st, sp in
            itertools.product((32, 64, 128), (1, 2), (4, 8, 16))]  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    import argparse

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cases", default="decode,prefill")
    ap.add_argument("--formats", default=",".join(KV_CACHE_DTYPES))
    ap.add_argument("--name", default="tune_paged", help="results file name")
    args = ap.parse_args(argv)
    dev = torch.device("cuda")
    rows = []
    cases = {
        "B64-L8192": ([1] * 64, [8192] * 64, "decode"),
        "S3-4x2048+8192": ([2048] * 4, [10240] * 4, "prefill"),
    }
    for name, (new, lens, kind) in cases.items():
        if kind not in args.cases.split(","):
            continue
        batch = make_serving_batch(new, lens, dev)
        for dtype in args.formats.split(","):
            fmt = KVPageFormat(dtype, HEAD_DIM)
            grid = _grid(kind, fmt)
            for cfg, splits in grid:
                call = functools.partial(
                    paged_attention, batch.q, batch.caches[dtype], fmt, batch.block_table,
                    batch.seq_lens, batch.query_start_loc,
                    num_decodes=len(new) if kind == "decode" else 0, max_seq_len=max(lens),
                    validate=False, num_splits=splits,
                    **{f"{kind}_config": cfg},
                )  # fmt: skip

                try:
                    t = graph_time(call, rep_ms=40)
                except Exception as exc:
                    print(f"{name} {dtype} {cfg}: failed {type(exc).__name__}: {exc}"[:300])
                    continue
                gbps = batch.kv_bytes(dtype) / (t["ms"] * 1e-3) / 1e9
                us = t["ms"] * 1e3
                print(f"{name} {dtype:5s} {cfg} splits={splits} {us:8.1f} us {gbps:6.0f} GB/s")
                rows.append({"workload": name, "pass": kind, "impl": f"flamia-{dtype}-exact",
                             "config": cfg.__dict__, "splits": splits, **t, "tflops": None,
                             "gbps": gbps})
        del batch
        torch.cuda.empty_cache()
    write_results(args.name, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
