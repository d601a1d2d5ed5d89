"""Exact ``exp2`` against Mitchell-P in the CuTe forward where the exponential unit could
limit it (H200): causal packs at head dim 64 and 128 (Hq 32 / Hkv 8, the default tiles), in
the FP8-cache prefill's configuration (per-token Q and per-key K/V exponents, the extend
mode, each document's queries its own keys). At d = 64 a 128×128 tile's MMAs take half the
tensor-core time of d = 128 while its 16k exponentials stay, so ``MUFU.EX2`` (16 per clock
and SM) needs about twice the tile's FP8 MMA time there. Times each mode (CUDA graph, median) and
compares Mitchell-P's output with exact's (cos-sim; the issue's bar is 0.999). Writes
``exp_bound.json``.

    python benchmarks/exp_bound.py [--dims 64,128] [--packs 8192,4x2048] [--quick] [--tile-m 192]
    ncu -k regex:FlamiaFwd --launch-count 1 ... python benchmarks/exp_bound.py --dims 64 \
        --packs 8192 --modes mitchell --once      # one launch per mode, nothing timed
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from benchmarks.common import graph_time, write_results
from benchmarks.workloads import causal_flops
from flamia_serve.kernels.attn_fwd.ops import LOG2E, default_config
from flamia_serve.kernels.quant.ops import quantize_qkv
from flamia_serve.kernels.schedule import build_work_list
from flamia_serve.probes import make_pack

HQ, HKV = 32, 8
EXP_MODES = ("exact", "mitchell")


def parse_pack(text: str) -> list[int]:
    """``8192`` -> [8192]; ``4x2048`` -> [2048] * 4."""
    count, _, length = text.rpartition("x")
    return [int(length)] * (int(count) if count else 1)


def measure(pack: str, d: int, quick: bool, modes: tuple[str, ...] = EXP_MODES,
            once: bool = False, tile_m: int = 0) -> list[dict]:  # fmt: skip
    """Rows of ``modes`` on one pack at head dim ``d`` (``once``: one launch each, no rows;
    ``tile_m``: query rows per tile instead of the default config's, e.g. 192 for three
    consumer warpgroups)."""
    from flamia_serve.kernels.attn_fwd.cute_sm90 import attn_fwd_sm90  # needs the cute extra

    dev = torch.device("cuda")
    lens = parse_pack(pack)
    q, k, v, cu, _ = make_pack(lens, HQ, HKV, d, seed=d, device=dev)
    cfg = default_config(d, dev)
    if tile_m:
        cfg = dataclasses.replace(cfg, block_m=tile_m)
    qkv = quantize_qkv(q, k, v, cu, exact_causal=True, column_align=cfg.column_align)
    total = q.shape[0]
    work = build_work_list(cu, total, block_m=cfg.block_m, block_n=cfg.block_n, causal=True,
                           cu_seqlens_k=cu)  # fmt: skip
    outs, rows = {}, []
    for mode in modes:
        out = torch.empty(total, HQ, d, dtype=torch.bfloat16, device=dev)
        m_rows = torch.empty(total, HQ, dtype=torch.float32, device=dev)
        lse_rows = torch.empty_like(m_rows)

        def call(mode=mode, out=out, m_rows=m_rows, lse_rows=lse_rows) -> None:
            attn_fwd_sm90(qkv, cu, work, out, m_rows, lse_rows, heads_q=HQ, causal=True,
                          qk_scale=d**-0.5 * LOG2E * qkv.qk_rescale,
                          tile_m=cfg.block_m, tile_n=cfg.block_n, num_stages=cfg.num_stages,
                          overlap=cfg.overlap, ticket=cfg.persistent, cu_seqlens_k=cu,
                          exp_mode=mode, promote_pv=cfg.promote_pv)  # fmt: skip

        call()
        if once:
            continue
        outs[mode] = out.clone()
        t = graph_time(call, rep_ms=50 if quick else 200)
        tflops = causal_flops(lens, HQ, d) / (t["ms"] * 1e-3) / 1e12
        rows.append({"workload": f"{pack}-d{d}", "pass": "prefill",
                     "impl": f"flamia-cute-{cfg.block_m}x{cfg.block_n}-{mode}", **t,
                     "tflops": tflops,
                     "head_dim": d})  # fmt: skip
    if once or "exact" not in outs:
        return rows
    exact = outs["exact"].double().flatten()
    exact_ms = rows[modes.index("exact")]["ms"]
    for row, mode in zip(rows, modes, strict=True):
        cos = torch.nn.functional.cosine_similarity(outs[mode].double().flatten(), exact, dim=0)
        row["cos_vs_exact_exp"] = float(cos)
        row["speedup_vs_exact"] = exact_ms / row["ms"]
        print(f"{row['workload']:14s} {row['impl']:14s} {row['ms']:8.3f} ms "
              f"{row['tflops']:7.1f} TFLOP/s  x{row['speedup_vs_exact']:.3f}  "
              f"cos vs exact {row['cos_vs_exact_exp']:.6f}")  # fmt: skip
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dims", default="64,128")
    ap.add_argument("--packs", default="8192,4x2048,16x512")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--modes", default=",".join(EXP_MODES))
    ap.add_argument("--once", action="store_true", help="one launch per mode (for ncu)")
    ap.add_argument("--tile-m", type=int, default=0, help="query rows per tile (default: config's)")
    ap.add_argument("--name", default="exp_bound")
    args = ap.parse_args()
    rows: list[dict] = []
    for d in (int(x) for x in args.dims.split(",")):
        for pack in args.packs.split(","):
            rows += measure(pack, d, args.quick, tuple(args.modes.split(",")), args.once,
                            args.tile_m)  # fmt: skip
    if args.once:
        return 0
    write_results(args.name, rows, {"shape": {"hq": HQ, "hkv": HKV}})
    return 0


if __name__ == "__main__":
    sys.exit(main())
