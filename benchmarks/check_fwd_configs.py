"""Correctness of every forward tile config on the GPU against the reference twin.

    python benchmarks/check_fwd_configs.py

Prints, per config and pack: non-finite outputs, relative error of O, max |Δlse|.
"""

from __future__ import annotations

import sys
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from flamia_serve.kernels.attn_fwd.ops import FwdConfig, attn_fwd
from flamia_serve.kernels.quant.ops import quantize_qkv
from flamia_serve.probes import make_pack
from flamia_serve.reference import attention_forward

CONFIGS = [
    FwdConfig(128, 64, 8, 3),
    FwdConfig(64, 64, 4, 3),
    FwdConfig(128, 64, 4, 3),
    FwdConfig(128, 64, 8, 3, two_pass=True),
]
PACKS = [((1, 63, 100, 37, 0, 5), 4, 2, 64), ((1, 300, 1000, 129, 2048, 31), 32, 8, 128)]


def main() -> int:
    for lens, hq, hkv, d in PACKS:
        q, k, v, cu, _ms = make_pack(lens, hq, hkv, d, seed=11, device="cuda")
        for recipe in ("mxfp8", "mixed_nvfp4"):
            qkv = quantize_qkv(q, k, v, cu, recipe=recipe)
            ref_o, _ref_m, ref_lse = attention_forward(
                qkv.to_reference(), cu, heads_q=hq, causal=True, softmax_scale=d**-0.5
            )
            for cfg in CONFIGS:
                out, _m, lse = attn_fwd(
                    qkv, cu, heads_q=hq, causal=True, softmax_scale=d**-0.5, config=cfg
                )
                bad = (~torch.isfinite(out)).any(-1).any(-1).nonzero().flatten()
                o, r = out.float(), ref_o.float()
                rel = float((o - r).nan_to_num().norm() / r.norm())
                dl = float((lse - ref_lse).abs().nan_to_num(1e9).max())
                print(f"T={sum(lens)} d={d} {recipe} {cfg}: nonfinite rows {bad.numel()} "
                      f"{bad[:6].tolist()} rel {rel:.4f} dlse {dl:.2e}")  # fmt: skip
    return 0


if __name__ == "__main__":
    with torch.no_grad():
        sys.exit(main())
