"""Backward numerics on the GPU: accuracy against float64, the dS-block ablation (DESIGN
N6), P̂ of forward vs backward (N5) and dQ repeatability.

* ``accuracy``: cos-sim and relative error of O, dQ, dK, dV of the kernel path
  (``flamia_attn_varlen`` + ``backward()``) against float64 autograd, per recipe;
* ``ds_blocks``: for dS block candidates (dK's, dQ's), the fraction of nonzero dS entries
  that round to zero and the cos-sim of dQ/dK against float64 (reference twin; only the
  chosen candidate has a Hopper kernel, its speed is in ``train_attention.json``);
* ``p_hat``: ``debug_p_hat`` on a 2k-token pack: the fraction of P̂ that differ between the
  online forward and the backward, and whether all of them are E4M3 subnormals;
* ``repeat``: two identical backward calls, max |ΔdQ| / max |dQ| (FP32 atomics).

Usage: ``python benchmarks/bwd_numerics.py [--d 256] [--accuracy-only] [--name NAME]``
(writes ``results/bwd_numerics.json``; ``--d``: the head dim of the pack, 128 by default;
``--accuracy-only``: the first part alone).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from benchmarks.common import cos64, output_and_grads, rel64, write_results
from flamia_serve import flamia_attn_varlen
from flamia_serve.attention import debug_p_hat
from flamia_serve.numerics import RECIPES, exp2i, quantize_blocks_2d
from flamia_serve.probes import make_pack
from flamia_serve.reference import attention, attention_float64
from flamia_serve.reference.quantized import backward_ds, quantize_qkv

LENS = (2048, 1024, 700, 300, 24)  # 4096 tokens: long and short documents, odd lengths
HQ, HKV, D = 32, 8, 128
CANDIDATES = {  # name: (ds_block for dK, dq_ds_block for dQ)
    "paper 32x32 / 32x32 (no Hopper kernel)": ((32, 32), (32, 32)),
    "chosen 32x32 / 32x64": ((32, 32), (32, 64)),
    "32x64 / 32x64": ((32, 64), (32, 64)),
    "64x64 / 64x64": ((64, 64), (64, 64)),
    "32x128 / 32x128": ((32, 128), (32, 128)),
}


def accuracy(q, k, v, cu, ms, d_out, exact) -> list[dict]:
    """Per recipe (the library's default kernels), and ``mxfp8_grad_input`` also on the CuTe
    backward (``backward: "cute"``) where it runs."""
    from flamia_serve.kernels.attn_bwd.ops import CUTE_BWD_CONFIG
    from flamia_serve.kernels.attn_fwd.ops import cute_available

    runs = [(r, None) for r in ("mxfp8", "mxfp8_grad_input", "mixed_nvfp4",
                                "mixed_nvfp4_hadamard")]  # fmt: skip
    if cute_available(q.device):
        runs.insert(2, ("mxfp8_grad_input", CUTE_BWD_CONFIG))
    rows = []
    for recipe, bcfg in runs:
        got = output_and_grads(
            lambda *a, r=recipe, b=bcfg: flamia_attn_varlen(*a, cu, ms, recipe=r, bwd_config=b),
            q, k, v, d_out,
        )  # fmt: skip
        label = recipe + (" (CuTe backward)" if bcfg is not None else "")
        for name, g, e in zip(("O", "dQ", "dK", "dV"), got, exact, strict=True):
            row = {"recipe": recipe, "tensor": name, "cos": cos64(g, e), "rel_err": rel64(g, e)}
            if bcfg is not None:
                row["backward"] = "cute"
            rows.append(row)
            print(f"  {label:38s} {name}: cos {row['cos']:.6f} rel {row['rel_err']:.4f}")
    return rows


def ds_blocks(q, k, v, cu, ms, d_out, exact) -> list[dict]:
    rec0 = RECIPES["mxfp8"]
    qkv = quantize_qkv(q, k, v, cu, rec0, False)
    from flamia_serve.reference import attention_forward

    out, m, lse = attention_forward(qkv, cu, heads_q=HQ, causal=True, softmax_scale=D**-0.5)
    ds_docs = backward_ds(d_out, out, m, lse, qkv, cu, rec0, causal=True, softmax_scale=D**-0.5)
    rows = []
    for name, (dk_block, dq_block) in CANDIDATES.items():
        zero, nonzero = {"dK": 0, "dQ": 0}, 0
        start = 0
        for ds in ds_docs:
            length = ds.shape[-1]
            sl = slice(start, start + length)
            start += length
            eq = exp2i(qkv.q8.exponents[sl]).t()[..., None]
            ek = exp2i(qkv.k8.exponents[sl]).t()[:, None, :].repeat_interleave(HQ // HKV, dim=0)
            live = ds != 0
            nonzero += int(live.sum())
            for which, x, block in (("dK", ds * eq, dk_block), ("dQ", ds * ek, dq_block)):
                codes = quantize_blocks_2d(x, block).codes.float()
                zero[which] += int((live & (codes == 0)).sum())
        rec = dataclasses.replace(rec0, ds_block=dk_block, dq_ds_block=dq_block)
        got = output_and_grads(lambda *a, r=rec: attention(*a, cu, ms, recipe=r), q, k, v, d_out)
        row = {
            "candidate": name, "dk_block": list(dk_block), "dq_block": list(dq_block),
            "zero_frac_dk": zero["dK"] / nonzero, "zero_frac_dq": zero["dQ"] / nonzero,
            "cos_dq": cos64(got[1], exact[1]), "cos_dk": cos64(got[2], exact[2]),
        }  # fmt: skip
        rows.append(row)
        print(f"  {name:40s} zero dK {row['zero_frac_dk']:.4%} dQ {row['zero_frac_dq']:.4%} "
              f"cos dQ {row['cos_dq']:.6f} dK {row['cos_dk']:.6f}")  # fmt: skip
    return rows


def p_hat_mismatch() -> list[dict]:
    q, k, v, cu, _ms = make_pack((1024, 700, 300, 24), HQ, HKV, D, seed=21, device="cuda")
    rows = []
    for two_pass in (False, True):
        fwd, bwd = debug_p_hat(q, k, v, cu, two_pass=two_pass)
        live = (fwd != 0) | (bwd != 0)
        differ = fwd != bwd
        row = {
            "forward": "two_pass" if two_pass else "online", "live": int(live.sum()),
            "differ": int(differ.sum()), "differ_frac": float(differ.sum() / live.sum()),
            "all_subnormal": bool((bwd[differ] <= 2**-6).all()),
            "max_abs_diff": float((fwd - bwd).abs().max()),
        }  # fmt: skip
        rows.append(row)
        print(f"  P̂ {row['forward']}: {row['differ']} of {row['live']} differ "
              f"({row['differ_frac']:.2e}), all subnormal: {row['all_subnormal']}")  # fmt: skip
    return rows


def repeatability(q, k, v, cu, ms, d_out) -> dict:
    a = output_and_grads(lambda *x: flamia_attn_varlen(*x, cu, ms), q, k, v, d_out)
    b = output_and_grads(lambda *x: flamia_attn_varlen(*x, cu, ms), q, k, v, d_out)
    res = {name: float((x.float() - y.float()).abs().max() / y.float().abs().max())
           for name, x, y in zip(("O", "dQ", "dK", "dV"), a, b, strict=True)}  # fmt: skip
    print(f"  repeat: {res}")
    return res


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--d", type=int, default=D, help="head dim of the pack")
    ap.add_argument("--accuracy-only", action="store_true", help="skip the ablation and P̂")
    ap.add_argument("--name", default="bwd_numerics", help="results file name")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("bwd_numerics needs a CUDA GPU")
    q, k, v, cu, ms = make_pack(LENS, HQ, HKV, args.d, seed=20, device="cuda")
    d_out = make_pack(LENS, HQ, HKV, args.d, seed=22, device="cuda")[0]
    exact = output_and_grads(lambda *a: attention_float64(*a, cu, ms), q, k, v, d_out)
    print(f"accuracy vs float64 (kernel path, d = {args.d}):")
    acc = accuracy(q, k, v, cu, ms, d_out, exact)
    extra = {"lens": list(LENS), "heads": {"hq": HQ, "hkv": HKV, "d": args.d}, "accuracy": acc}
    if not args.accuracy_only:
        if args.d != D:
            raise SystemExit(f"the ablation and P̂ parts run at d = {D}: add --accuracy-only")
        print("dS block candidates (reference twin):")
        extra["ds_blocks"] = ds_blocks(q, k, v, cu, ms, d_out, exact)
        print("P̂ forward vs backward:")
        extra["p_hat"] = p_hat_mismatch()
        extra["repeat_max_rel"] = repeatability(q, k, v, cu, ms, d_out)
    write_results(args.name, [], extra)
    return 0


if __name__ == "__main__":
    sys.exit(main())
