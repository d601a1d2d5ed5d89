"""How the CuTe backward's dK/dV sums hold up on long documents (GPU).

A key tile's dK and dV sum over every query of every head of its GQA group: 65k products on
a 16k-token document with four query heads per K/V head. So the adder's precision shows
here: an FP8 ``wgmma`` adds into its accumulator with fewer bits than FP32 (a truncation
bias, |g|/|g64| < 1), a BF16 ``wgmma`` or a per-step FP32 promotion does not. For each case
and version: dQ/dK/dV relative error against the reference twin (``reference.attention``,
FP32, same quantization) and cos-sim, relative error and norm ratio against float64
autograd.

Usage: ``python benchmarks/bwd_accumulation.py [NAME=PATH ...]``: PATH is a copy of
``flamia_serve/kernels/attn_bwd/cute_sm90.py`` (as for ``bwd_variants.py``); the package's
module runs as ``current``. Writes ``results/bwd_accumulation.json``.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from benchmarks.common import cos64, output_and_grads, rel64, write_results
from flamia_serve.kernels.attn_bwd.ops import CUTE_BWD_CONFIG, attn_bwd
from flamia_serve.kernels.attn_fwd.ops import attn_fwd
from flamia_serve.kernels.quant.ops import quantize_do, quantize_qkv
from flamia_serve.probes import make_pack
from flamia_serve.reference import attention, attention_float64

MODULE = "flamia_serve.kernels.attn_bwd.cute_sm90"
HQ, HKV = 4, 1
#: (documents, head dim)
CASES = [((16384,), 128), ((16384,), 64), ((4096, 2048, 700, 300, 24), 128)]


def _kernel_grads(q, k, v, d_out, cu, d) -> list[torch.Tensor]:
    """The CuTe backward on quantized operands carrying both dK/dV operand forms."""
    qkv = quantize_qkv(q, k, v, cu, with_transposed=True, column_align=128, q_rows=True)
    out, m, lse = attn_fwd(qkv, cu, heads_q=HQ, causal=True, softmax_scale=d**-0.5)
    qdo = quantize_do(d_out, out, m, lse, cu, column_align=128, g_rows=True)
    return list(attn_bwd(qkv, qdo, m, lse, cu, heads_q=HQ, causal=True, softmax_scale=d**-0.5,
                         config=CUTE_BWD_CONFIG))  # fmt: skip


def _load(name: str, path: str):
    spec = importlib.util.spec_from_file_location(f"{MODULE}_{name}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("variants", nargs="*", help="NAME=PATH copies of the CuTe backward")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("bwd_accumulation needs a CUDA GPU")
    import flamia_serve.kernels.attn_bwd.cute_sm90 as current

    versions = {"current": current}
    for spec in args.variants:
        name, path = spec.split("=", 1)
        versions[name] = _load(name, path)
    rows = []
    for lens, d in CASES:
        total = sum(lens)
        q, k, v, cu, ms = make_pack(lens, HQ, HKV, d, seed=31, device="cuda")
        d_out = make_pack(lens, HQ, HKV, d, seed=32, device="cuda")[0]
        exact = output_and_grads(
            lambda *a, c=cu, m=ms: attention_float64(*a, c, m), q, k, v, d_out
        )[1:]  # dQ, dK, dV
        twin = output_and_grads(lambda *a, c=cu, m=ms: attention(*a, c, m), q, k, v, d_out)[1:]
        case = f"{'+'.join(map(str, lens))} tokens, d={d}"
        for name, module in versions.items():
            sys.modules[MODULE] = module  # ops.attn_bwd imports it at each call
            got = _kernel_grads(q, k, v, d_out, cu, d)
            for tensor, g, t, e in zip(("dQ", "dK", "dV"), got, twin, exact, strict=True):
                row = {
                    "case": case, "tokens": total, "d": d, "hq": HQ, "hkv": HKV,
                    "version": name, "tensor": tensor, "rel_vs_twin": rel64(g, t),
                    "cos_vs_f64": cos64(g, e), "rel_vs_f64": rel64(g, e),
                    "norm_ratio_f64": float(g.double().norm() / e.double().norm()),
                }  # fmt: skip
                rows.append(row)
                print(f"{case:34s} {name:10s} {tensor}: rel vs twin {row['rel_vs_twin']:.3e}  "
                      f"cos vs f64 {row['cos_vs_f64']:.6f}  rel vs f64 {row['rel_vs_f64']:.4e}  "
                      f"|g|/|g64| {row['norm_ratio_f64']:.6f}", flush=True)  # fmt: skip
        sys.modules[MODULE] = current
        del exact, twin
        torch.cuda.empty_cache()
    path = write_results("bwd_accumulation", rows, {"causal": True, "versions": list(versions)})
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
