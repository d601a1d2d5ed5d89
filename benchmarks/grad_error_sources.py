"""Where the mxfp8 backward's dQ/dK error comes from (reference twin, CPU, a few minutes).

Cos-sim of O, dQ, dK, dV against float64 autograd on a 1860-token pack (1024/512/300/24,
Hq=8/Hkv=2, d=128), for the recipe as it is and with one quantization taken out at a time
(the twin's functions patched in this process only): per-token Q/K exponents
(``exact_causal``), dS unquantized, dÔ unquantized in dP and D, dÔ with per-token
exponents. Prints one line per variant.

    python benchmarks/grad_error_sources.py
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import flamia_serve.reference.quantized as rq
from benchmarks.common import output_and_grads
from flamia_serve.numerics.scales import Granularity, quantize_fp8
from flamia_serve.probes import make_pack
from flamia_serve.reference import attention, attention_float64

LENS = (1024, 512, 300, 24)


class _Exact:
    """Stands in for a quantized tensor whose dequantized value is exact."""

    def __init__(self, x: torch.Tensor) -> None:
        self.x = x

    def dequantize(self) -> torch.Tensor:
        return self.x


def main() -> None:
    q, k, v, cu, ms = make_pack(LENS, 8, 2, 128, seed=3)
    d_out = make_pack(LENS, 8, 2, 128, seed=4)[0]

    def grads(fn):
        return [x.double() for x in output_and_grads(fn, q, k, v, d_out)]

    ref = grads(lambda a, b, c: attention_float64(a, b, c, cu, ms, causal=True))

    def run(label, **kw):
        got = grads(lambda a, b, c: attention(a, b, c, cu, ms, causal=True, **kw))
        cos = [
            float(torch.nn.functional.cosine_similarity(x.flatten(), y.flatten(), dim=0))
            for x, y in zip(got, ref, strict=True)
        ]
        names = ("O", "dQ", "dK", "dV")
        print(f"{label:32s}", " ".join(f"{n} {c:.6f}" for n, c in zip(names, cos, strict=True)))

    fold, qdo = rq._fold_quantize, rq.quantize_do
    run("mxfp8 as it is")
    run("per-token Q/K (exact_causal)", exact_causal=True)
    rq._fold_quantize = lambda ds, factor, block: ds * factor
    run("dS unquantized")
    rq._fold_quantize = fold

    def do_exact(d_out_, out, m_rows, lse_rows, cu_seqlens, recipe, *, row_factor=None):
        r = qdo(d_out_, out, m_rows, lse_rows, cu_seqlens, recipe, row_factor=row_factor)
        delta = (d_out_.float() * out.float()).sum(-1)
        return rq.QuantizedDO(_Exact(d_out_.float()), r.g8, delta)

    def do_per_token(d_out_, out, m_rows, lse_rows, cu_seqlens, recipe, *, row_factor=None):
        r = qdo(d_out_, out, m_rows, lse_rows, cu_seqlens, recipe, row_factor=row_factor)
        do8 = quantize_fp8(d_out_, cu_seqlens, Granularity.TOKEN, recipe.token_block)
        delta = (do8.dequantize() * out.float()).sum(-1)
        return rq.QuantizedDO(do8, r.g8, delta)

    for label, fn in (("dO unquantized in dP and D", do_exact),
                      ("dO per-token exponents", do_per_token)):  # fmt: skip
        rq.quantize_do = fn
        run(label)
    rq.quantize_do = qdo


if __name__ == "__main__":
    main()
