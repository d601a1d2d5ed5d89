"""Two launches of the paged attention kernel on one serving batch, for ``ncu``:

    ncu -k regex:paged --launch-skip 1 --launch-count 1 --section ... \\
        python benchmarks/profile_paged.py --dtype fp8 --config 64,128,4,2

``--case prefill`` (default; S3: 4×2048 new tokens on 8192 cached) or ``decode``
(B64-L8192); ``--config block_m,block_n,num_warps,num_stages[,keys_on_m]`` (default: the
launcher's); ``--splits`` decode split-K; ``--ring`` / ``--ctas`` the CuTe NVFP4
decode's shared-memory ring stages and CTAs-per-SM cap.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from benchmarks.serving import HEAD_DIM, make_serving_batch
from flamia_serve.kernels.paged import PagedConfig, paged_attention
from flamia_serve.numerics.kv_pages import KVPageFormat

CASES = {"prefill": ([2048] * 4, [10240] * 4), "decode": ([1] * 64, [8192] * 64)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--case", choices=sorted(CASES), default="prefill")
    ap.add_argument("--dtype", default="fp8")
    ap.add_argument("--config", default="", help="block_m,block_n,num_warps,num_stages[,1]")
    ap.add_argument("--splits", type=int, default=None)
    ap.add_argument("--ring", type=int, default=None,
                    help="CuTe NVFP4 decode: shared-memory ring stages (0: register ring)")
    ap.add_argument("--ctas", type=int, default=None, help="CuTe decode: CTAs per SM cap")
    args = ap.parse_args(argv)
    new, lens = CASES[args.case]
    batch = make_serving_batch(new, lens, torch.device("cuda"))
    fmt = KVPageFormat(args.dtype, HEAD_DIM)
    if args.ring is not None or args.ctas is not None:
        from flamia_serve.kernels.paged import cute_decode_sm90

        if args.ring is not None:
            cute_decode_sm90.STAGES = args.ring
        if args.ctas is not None:
            cute_decode_sm90.CTAS_PER_SM = args.ctas
    extra = {}
    if args.config:
        bm, bn, warps, stages, *swap = (int(x) for x in args.config.split(","))
        cfg = PagedConfig(bm, bn, warps, stages, keys_on_m=bool(swap and swap[0]))
        extra[f"{args.case}_config"] = cfg
    for _ in range(2):
        paged_attention(
            batch.q, batch.caches[args.dtype], fmt, batch.block_table, batch.seq_lens,
            batch.query_start_loc, num_decodes=len(new) if args.case == "decode" else 0,
            max_seq_len=max(lens), validate=False, num_splits=args.splits, **extra,
        )  # fmt: skip
    torch.cuda.synchronize()
    print("done")
    return 0


if __name__ == "__main__":
    sys.exit(main())
