"""One-hot softmax at huge logits (q, k ~ 1e4, BF16; tests/kernels/test_entry_adversarial.py
``test_huge_logits_match_twin``): O, dQ, dK, dV of the kernel path and of the twin against
float64, with each gradient's largest magnitude.

    python benchmarks/huge_logits_diag.py [--scale 1e4] [--device cuda]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from benchmarks.common import output_and_grads
from flamia_serve import flamia_attn_varlen
from flamia_serve.probes import make_pack
from flamia_serve.reference import attention, attention_float64


def _run(fn, q, k, v, d_out, cu, ms) -> list[torch.Tensor]:
    got = output_and_grads(lambda *x: fn(*x, cu, ms), q, k, v, d_out)
    return [x.double().cpu() for x in got]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--scale", type=float, default=1e4)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = ap.parse_args()
    lens = (12, 1, 15)
    q, k, v, cu, ms = make_pack(lens, 2, 1, 64, seed=13, device=args.device,
                                dtype=torch.float32)  # fmt: skip
    d_out = make_pack(lens, 2, 1, 64, seed=14, device=args.device, dtype=torch.float32)[0]
    q, k = (x * args.scale for x in (q, k))
    q, k, v, d_out = (x.to(torch.bfloat16) for x in (q, k, v, d_out))
    runs = {name: _run(fn, q, k, v, d_out, cu, ms) for name, fn in
            (("kernel", flamia_attn_varlen), ("twin", attention),
             ("float64", attention_float64))}  # fmt: skip
    for name in ("kernel", "twin"):
        for label, x, r in zip(("O", "dQ", "dK", "dV"), runs[name], runs["float64"],
                               strict=True):  # fmt: skip
            rel = float((x - r).norm() / r.norm()) if float(r.norm()) else float("nan")
            print(f"{name:7s} {label}: max |x| {float(x.abs().max()):10.4g}  float64 max "
                  f"{float(r.abs().max()):10.4g}  rel vs float64 {rel:.3e}  "
                  f"finite {bool(torch.isfinite(x).all())}")  # fmt: skip
    for name in ("kernel", "twin", "float64"):
        norms = runs[name][3].norm(dim=-1).flatten()
        print(f"{name:7s} dV row norms:", " ".join(f"{float(x):.3g}" for x in norms))


if __name__ == "__main__":
    main()
