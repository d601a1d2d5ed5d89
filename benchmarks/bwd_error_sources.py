"""Where the `mxfp8` backward's dQ/dK error comes from (issue 11's cos-sim target, DESIGN N6).

A float64 emulation of the recipe, one quantization source switched on or off at a time,
against float64 attention without any: Q̂/K̂ (token-block E4M3, in the scores *and* in the
gradient products), V̂ (per token), P̂ (E4M3 of ``2^(y − M + 8)``, rows normalized; the kernels
also fold V's exponent into y, left out here), dÔ (token-block E4M3, in dP, D and dV), dS
(E4M3 per 32×32 block for dK, 32×64 for dQ), O rounded to BF16. Two more switches replace
the E4M3 operand of one gradient product by the unquantized input: ``exact_q_in_dk``
(``dK = dŜᵀ·Q``) and ``exact_k_in_dq`` (``dQ = dŜ·K``); the scores keep Q̂/K̂.

Runs on the CPU (no kernel involved; ~2 minutes): ``python benchmarks/bwd_error_sources.py``
writes ``results/bwd_error_sources.json`` with ``1 − cos`` of dQ, dK, dV per row.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from benchmarks.common import cos64, write_results
from flamia_serve.numerics import P_HAT_EXP, RECIPES
from flamia_serve.numerics.scales import Granularity, quantize_blocks_2d, quantize_fp8
from flamia_serve.probes import make_pack

LENS = (2048, 1024, 700, 300, 24)  # bwd_numerics.py's pack
SOURCES = ("qk", "v", "p", "do", "ds", "o")
EXACT_OPERANDS = ("exact_q_in_dk", "exact_k_in_dq")
MXFP8 = RECIPES["mxfp8"]  # its token block and dS blocks


def _fp8(x: torch.Tensor, granularity: Granularity) -> torch.Tensor:
    """E4M3 with power-of-two exponents (token blocks of one document, or per token), as
    float64 values."""
    cu = torch.tensor([0, x.shape[0]], dtype=torch.int32)
    return quantize_fp8(x.float(), cu, granularity, MXFP8.token_block).dequantize().double()


def _ds_blocks(ds: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """dS in E4M3 with one power-of-two exponent per ``block`` (N6), as float64 values."""
    return quantize_blocks_2d(ds.float(), block).dequantize().double()


def gradients(q, k, v, d_out, cu, on: set[str]) -> dict[str, torch.Tensor]:
    """dQ, dK, dV (float64) of causal attention with the quantizations in ``on``."""
    group = q.shape[1] // k.shape[1]
    scale = q.shape[-1] ** -0.5
    out: dict[str, list[torch.Tensor]] = {"dq": [], "dk": [], "dv": []}
    for a, b in zip(cu[:-1].tolist(), cu[1:].tolist(), strict=True):
        qx, kx, vx, dox = (t[a:b].double() for t in (q, k, v, d_out))
        qd = _fp8(qx, Granularity.TOKEN_BLOCK) if "qk" in on else qx
        kd = _fp8(kx, Granularity.TOKEN_BLOCK) if "qk" in on else kx
        vd = _fp8(vx, Granularity.TOKEN) if "v" in on else vx
        dod = _fp8(dox, Granularity.TOKEN_BLOCK) if "do" in on else dox
        kq, vq = kd.repeat_interleave(group, 1), vd.repeat_interleave(group, 1)
        n = b - a
        x = torch.einsum("ihd,jhd->hij", qd, kq) * scale
        x = x.masked_fill(~torch.tril(torch.ones(n, n, dtype=torch.bool)), float("-inf"))
        if "p" in on:
            y = x / math.log(2.0)
            m = torch.ceil(y.amax(-1, keepdim=True))
            p_hat = torch.exp2(y - m + P_HAT_EXP).float().to(torch.float8_e4m3fn).double()
            p = p_hat / p_hat.sum(-1, keepdim=True)
        else:
            p = torch.softmax(x, -1)
        o = torch.einsum("hij,jhd->ihd", p, vq)
        if "o" in on:
            o = o.bfloat16().double()
        delta = (dod * o).sum(-1).t()[..., None]
        ds = p * (torch.einsum("ihd,jhd->hij", dod, vq) - delta)
        ds_k = _ds_blocks(ds, MXFP8.ds_block) if "ds" in on else ds
        ds_q = _ds_blocks(ds, MXFP8.dq_ds_block) if "ds" in on else ds
        k_dq = kx.repeat_interleave(group, 1) if "exact_k_in_dq" in on else kq
        q_dk = qx if "exact_q_in_dk" in on else qd
        out["dq"].append(torch.einsum("hij,jhd->ihd", ds_q, k_dq) * scale)
        for name, val in (
            ("dk", torch.einsum("hij,ihd->jhd", ds_k, q_dk) * scale),
            ("dv", torch.einsum("hij,ihd->jhd", p, dod)),
        ):
            out[name].append(val.view(n, k.shape[1], group, -1).sum(2))
    return {name: torch.cat(parts) for name, parts in out.items()}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--heads", default="8/2", help="Hq/Hkv (default 8/2)")
    ap.add_argument("--d", type=int, default=128)
    args = ap.parse_args(argv)
    hq, hkv = (int(x) for x in args.heads.split("/"))
    q, k, v, cu, _ = make_pack(LENS, hq, hkv, args.d, seed=3)
    d_out = make_pack(LENS, hq, hkv, args.d, seed=4)[0]
    exact = gradients(q, k, v, d_out, cu, set())
    every = set(SOURCES)
    cases = [("all", every)]
    cases += [(f"only {s}", {s}) for s in SOURCES]
    cases += [(f"all but {s}", every - {s}) for s in SOURCES]
    cases += [(f"all, {e}", every | {e}) for e in EXACT_OPERANDS]
    cases += [("all, both exact operands", every | set(EXACT_OPERANDS))]
    rows = []
    for name, on in cases:
        got = gradients(q, k, v, d_out, cu, on)
        row = {"case": name, "on": sorted(on)}
        row |= {f"one_minus_cos_{g}": 1.0 - cos64(got[g], exact[g]) for g in ("dq", "dk", "dv")}
        rows.append(row)
        print(f"{name:28s} " + " ".join(
            f"{g} {row[f'one_minus_cos_{g}']:.2e}" for g in ("dq", "dk", "dv")
        ), flush=True)  # fmt: skip
    extra = {"kind": "float64 emulation on the CPU (no kernel)", "lens": list(LENS),
             "hq": hq, "hkv": hkv, "d": args.d, "causal": True}  # fmt: skip
    print(f"wrote {write_results('bwd_error_sources', rows, extra)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
