"""The CuTe forward's key tile (``FwdConfig.block_n``) at d = 128: 128 against longer tiles.

    python benchmarks/fwd_tile_n_ab.py --tiles 128,160,192 --workloads W1,W3,W4,W7,P3 \\
        --rounds 3 --name fwd_tile_n_ab

A longer key tile spreads each tile's fixed work (row maxima and sums across a quad, the
reference update, the turn's barriers and pipeline waits, the factors' loads) over more
keys; it wastes more of the last (masked) tiles of a document. 160 and 192 keys are the
lengths that compile at 128 query rows (sm_90a: 192 spills 60 B, 256 serializes the
``wgmma``; FP8 ``wgmma`` K is 32, so 176 does not build).

1. Correctness, each tile against the reference twin (``reference.attention`` on the same
   quantization's operands: O's relative error, max |Δlse|, rows not finite) and against
   the 128-key tile (O's relative difference, the share of O's bits that are equal), on
   packs of the GPU tests' kinds: odd lengths, 1-token documents, GQA and MHA, causal and
   not, per-token exponents (``exact_causal``). A tile that reads past its masks shows as an
   error far above the 128-key tile's.
2. Times: the whole forward call (its quantization launch included) on each training
   workload, CUDA-graph replays, the tiles interleaved over ``--rounds`` rounds (reversed
   every other round), medians; JSON ``<name>.json``.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from benchmarks.common import graph_time, in_rounds, rel64, write_results
from benchmarks.workloads import training_workload

#: (lengths, Hq, Hkv, causal, exact_causal): the correctness packs (d = 128)
CHECK_PACKS = [
    ((1, 63, 100, 37, 0, 5, 700, 191, 193, 385), 4, 2, True, False),
    ((1, 300, 1000, 129, 2048, 31), 8, 8, True, False),
    ((1, 300, 1000, 129, 2048, 31), 8, 2, False, False),
    ((577, 3, 961, 192, 160, 320), 4, 1, True, True),
    ((4097,), 2, 2, True, False),
]


def tile_config(tile_n: int):
    """The default CuTe config at d = 128 with ``tile_n`` keys per tile."""
    from flamia_serve.kernels.attn_fwd.ops import default_config

    cfg = default_config(128, torch.device("cuda"), kernel="cute")
    return dataclasses.replace(cfg, block_n=tile_n)


def check(tiles: list[int]) -> list[dict]:
    """Rows of the correctness checks (module docstring, 1.)."""
    from flamia_serve import flamia_attn_varlen
    from flamia_serve.kernels.quant.ops import quantize_qkv
    from flamia_serve.probes import make_pack
    from flamia_serve.reference import attention_forward

    rows = []
    for lens, hq, hkv, causal, exact in CHECK_PACKS:
        q, k, v, cu, ms = make_pack(lens, hq, hkv, 128, seed=3, device="cuda")
        ref = quantize_qkv(q, k, v, cu, exact_causal=exact).to_reference()
        ref_o, _m, ref_lse = attention_forward(
            ref, cu, heads_q=hq, causal=causal, softmax_scale=128**-0.5
        )
        base = None
        for tile_n in tiles:
            out, _m, lse = flamia_attn_varlen(
                q, k, v, cu, ms, causal=causal, exact_causal=exact, config=tile_config(tile_n),
                return_stats=True,
            )  # fmt: skip
            base = out if base is None else base
            row = {
                "pack": f"{len(lens)} docs T={sum(lens)} Hq{hq}/Hkv{hkv} causal={causal} "
                f"exact={exact}",
                "tile_n": tile_n,
                "nonfinite_rows": int((~torch.isfinite(out)).any(-1).any(-1).sum()),
                "rel_vs_reference": rel64(out, ref_o),
                "max_dlse_vs_reference": float((lse - ref_lse).abs().max()),
                "rel_vs_tile_128": rel64(out, base),
                "same_bits_vs_tile_128": float(
                    (out.view(torch.int16) == base.view(torch.int16)).float().mean()
                ),
            }
            print(row)
            rows.append(row)
    return rows


def bench(workloads: list[str], tiles: list[int], rounds: int) -> list[dict]:
    """Rows of the timings (module docstring, 2.)."""
    from benchmarks.train_attention import make_inputs
    from flamia_serve import flamia_attn_varlen, plan_varlen

    rows = []
    for name in workloads:
        wl = training_workload(name)
        cu = wl.cu_seqlens(torch.device("cuda"))
        q, k, v = make_inputs(wl, seed=0, device=torch.device("cuda"))
        plan = plan_varlen(cu, wl.total_tokens, wl.max_seqlen)

        def one_round(order: list[int], wl=wl, cu=cu, q=q, k=k, v=v, plan=plan) -> list[dict]:
            out = []
            for tile_n in order:
                cfg = tile_config(tile_n)
                t = graph_time(lambda cfg=cfg: flamia_attn_varlen(
                    q, k, v, cu, wl.max_seqlen, plan=plan, config=cfg))  # fmt: skip
                out.append({"workload": wl.name, "pass": "fwd", "impl": f"cute-128x{tile_n}",
                            "tile_n": tile_n, **t,
                            "tflops": wl.flops() / (t["ms"] * 1e-3) / 1e12})  # fmt: skip
            return out

        got = in_rounds(one_round, tiles, rounds)
        for row in got:
            print(f"{row['workload']} {row['impl']}: {row['ms']:.4f} ms "
                  f"({row['tflops']:.0f} TFLOP/s) rounds {row.get('ms_rounds')}")  # fmt: skip
        rows += got
        torch.cuda.empty_cache()
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tiles", default="128,160,192", help="key tiles; the first is the base")
    ap.add_argument("--workloads", default="W1,W3,W4,W6,W7,W9,P3")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--no-check", action="store_true")
    ap.add_argument("--name", default="fwd_tile_n_ab")
    args = ap.parse_args(argv)
    tiles = [int(x) for x in args.tiles.split(",")]
    checks = [] if args.no_check else check(tiles)
    rows = bench(args.workloads.split(","), tiles, args.rounds)
    write_results(args.name, rows, {"checks": checks})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
