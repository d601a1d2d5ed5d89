"""Does accumulating P̂·V̂ inside the FP8 ``wgmma`` cost accuracy? (CuTe forward, H200)

Hopper's FP8 ``wgmma`` adds its products to the accumulator with fewer bits than FP32
(DESIGN "Mapping onto Hopper"). The CuTe forward can add each key tile's P̂·V̂ to O in FP32
(``FwdConfig.promote_pv=True``, a product accumulator per tile) or let it accumulate into O
inside the MMA (``False``: no product accumulator, shorter tensor-core turns). The error that
choice adds grows with the number of key tiles a row sums, so it is measured on long single
documents (and a pack), against:

* the reference twin on the same quantized operands (``reference.attention_forward``, FP32
  matmuls): isolates the kernel's own accumulation from the quantization;
* float64 attention on the BF16 inputs: the error a user sees (cos-sim, relative error, and
  ``|O|/|O64|``, which would show a bias toward zero from truncating additions).

Usage: ``python benchmarks/fwd_accumulation.py`` (sm_90 with the cute extra; writes
``results/fwd_accumulation.json``).
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from benchmarks.common import cos64, rel64, write_results
from flamia_serve.kernels.attn_fwd.ops import CUTE_CONFIG, CUTE_CONFIG_D256, attn_fwd
from flamia_serve.kernels.quant.ops import quantize_qkv
from flamia_serve.probes import make_pack
from flamia_serve.reference import attention_float64, attention_forward

CASES = [  # name, document lengths, Hq, Hkv, d, scale of q (sharper softmax when > 1)
    ("one doc 16384, d128", (16384,), 4, 1, 128, 1.0),
    ("one doc 16384, d128, q x4", (16384,), 4, 1, 128, 4.0),
    ("one doc 16384, d64", (16384,), 4, 1, 64, 1.0),
    ("one doc 8192, d256", (8192,), 4, 1, 256, 1.0),
    ("pack 4096+2048+700+300+24, d128", (4096, 2048, 700, 300, 24), 8, 2, 128, 1.0),
]
VARIANTS = {  # name: changes to the head dim's CuTe default
    "promote_pv": {"promote_pv": True, "overlap": False},
    "pv_in_mma": {"promote_pv": False, "overlap": False},
    "pv_in_mma_overlap": {"promote_pv": False, "overlap": True},
}


def main() -> int:
    dev = torch.device("cuda")
    rows = []
    for name, lens, hq, hkv, d, q_scale in CASES:
        q, k, v, cu, ms = make_pack(lens, hq, hkv, d, seed=7, device=dev)
        q = (q.float() * q_scale).to(q.dtype)
        exact = attention_float64(q, k, v, cu, ms, causal=True)
        base = CUTE_CONFIG_D256 if d >= 256 else CUTE_CONFIG
        qkv = quantize_qkv(q, k, v, cu, column_align=base.column_align)
        twin, _, _ = attention_forward(
            qkv.to_reference(), cu, heads_q=hq, causal=True, softmax_scale=d**-0.5
        )
        for variant, changes in VARIANTS.items():
            cfg = dataclasses.replace(base, **changes)
            out, _, _ = attn_fwd(qkv, cu, heads_q=hq, causal=True, softmax_scale=d**-0.5,
                                 config=cfg)  # fmt: skip
            rows.append({
                "workload": name, "pass": "fwd", "impl": f"flamia-mxfp8-{variant}",
                "ms": None, "tflops": None, "gbps": None,
                "config": dataclasses.asdict(cfg),
                "rel_vs_twin": rel64(out, twin), "cos_vs_twin": cos64(out, twin),
                "rel_vs_float64": rel64(out, exact), "cos_vs_float64": cos64(out, exact),
                "norm_ratio_vs_float64": float(out.double().norm() / exact.norm()),
            })  # fmt: skip
            r = rows[-1]
            print(f"{name:34s} {variant:18s} rel vs twin {r['rel_vs_twin']:.3e}  cos vs f64 "
                  f"{r['cos_vs_float64']:.6f}  rel vs f64 {r['rel_vs_float64']:.4e}  "
                  f"|O|/|O64| {r['norm_ratio_vs_float64']:.6f}")  # fmt: skip
        rows.append({
            "workload": name, "pass": "fwd", "impl": "reference-twin", "ms": None,
            "tflops": None, "gbps": None, "rel_vs_float64": rel64(twin, exact),
            "cos_vs_float64": cos64(twin, exact),
            "norm_ratio_vs_float64": float(twin.double().norm() / exact.norm()),
        })  # fmt: skip
        del exact, twin
        torch.cuda.empty_cache()
    write_results("fwd_accumulation", rows)
    return 0


if __name__ == "__main__":
    with torch.no_grad():
        sys.exit(main())
