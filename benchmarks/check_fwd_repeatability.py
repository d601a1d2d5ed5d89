"""Does the CuTe forward give the same bits on every run, with Q quantized in the kernel and by
the launch? (H200; the early release of Q raced without its fix: ``benchmarks/NOTES.md``.)

For each pack and config: the forward on the launch's Q codes once, then ``--runs`` times on
operands whose Q the kernel quantizes (``defer_q``). Prints, per case, the row-heads that
differ from the launch path and between runs, and where they sit in their 128-row tile (by
warpgroup: rows 0-63, 64-127), and writes ``<name>.json`` (default ``fwd_repeatability``) to
``$FLAMIA_RESULTS_DIR`` (default ``benchmarks/results``). Exit status 1 if any case differs.

    python benchmarks/check_fwd_repeatability.py [--runs 4] [--name NAME]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from benchmarks.common import write_results
from flamia_serve.kernels.attn_fwd.ops import CUTE_CONFIG, FwdConfig, attn_fwd
from flamia_serve.kernels.quant.ops import quantize_qkv
from flamia_serve.probes import make_pack

SHORT_AND_LONG = (1, 300, 1000, 129, 0, 2048, 31)
CASES = {
    # name: (document lengths, Hq, Hkv, d, exact_causal, config)
    "short+long token-block 128x128": (SHORT_AND_LONG, 32, 8, 128, False, CUTE_CONFIG),
    "short+long exact 128x128": (SHORT_AND_LONG, 32, 8, 128, True, CUTE_CONFIG),
    "short+long token-block 192x64": (
        SHORT_AND_LONG, 32, 8, 128, False,
        FwdConfig(192, 64, num_stages=2, kernel="cute", overlap=False),
    ),
    "one 4096-token document": ((4096,), 32, 8, 128, False, CUTE_CONFIG),
}  # fmt: skip


def _rows(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``[T, H]`` bool: the row-heads of two ``[T, H, d]`` outputs that differ anywhere."""
    return (a != b).any(-1)


def check(name: str, lens, hq, hkv, d, exact, cfg, runs: int) -> dict:
    q, k, v, cu, _ms = make_pack(lens, hq, hkv, d, seed=41, device="cuda")

    def forward(defer_q: bool) -> torch.Tensor:
        qkv = quantize_qkv(q, k, v, cu, exact_causal=exact, column_align=cfg.column_align,
                           defer_q=defer_q)  # fmt: skip
        return attn_fwd(qkv, cu, heads_q=hq, causal=True, softmax_scale=d**-0.5,
                        config=cfg)[0].clone()  # fmt: skip

    launch = forward(False)
    fused = [forward(True) for _ in range(runs)]
    differ = [_rows(launch, f) for f in fused]
    starts = cu.long()
    tok = torch.cat([x.nonzero()[:, 0] for x in differ])
    doc = torch.searchsorted(starts[1:], tok, right=True)
    tile_row = (tok - starts[doc]) % 128
    return {
        "case": name, "hq": hq, "hkv": hkv, "d": d, "exact_causal": exact,
        "config": [cfg.block_m, cfg.block_n], "docs": len(lens),
        "rows_vs_launch": [int(x.sum()) for x in differ],
        "rows_between_runs": [int(_rows(fused[0], f).sum()) for f in fused[1:]],
        "rows_by_warpgroup": [int((tile_row < 64).sum()), int((tile_row >= 64).sum())],
        "row_heads": int(launch.shape[0] * launch.shape[1]),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=4)
    ap.add_argument("--name", default="fwd_repeatability", help="results file name")
    args = ap.parse_args()
    rows, bad = [], False
    for name, (lens, hq, hkv, d, exact, cfg) in CASES.items():
        res = check(name, lens, hq, hkv, d, exact, cfg, args.runs)
        rows.append(res)
        bad |= any(res["rows_vs_launch"]) or any(res["rows_between_runs"])
        print(f"{name}: differing row-heads vs the launch path {res['rows_vs_launch']}, "
              f"between runs {res['rows_between_runs']}, by warpgroup "
              f"{res['rows_by_warpgroup']} (of {res['row_heads']})", flush=True)  # fmt: skip
    write_results(args.name, rows, {"runs": args.runs})
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
