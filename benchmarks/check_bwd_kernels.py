"""The two backward kernels side by side on the same quantized operands (H200).

``python benchmarks/check_bwd_kernels.py [--quick]``: for packs of several shapes it runs
the CuTe and the Triton backward (``attn_bwd`` with ``kernel="cute"`` / ``"triton"``) on one
quantization (column alignment 128, the CuTe forward's), and reports each kernel's relative
error against the reference backward (small packs), CuTe against Triton, whether the P̂ that
each rebuilds is the same (debug hook, a small pack), and the time of each kernel alone
(operands prequantized) with its TFLOP/s. Writes ``bwd_kernels.json``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from benchmarks.common import env_info, results_dir, time_ms
from flamia_serve.kernels.attn_bwd.ops import CUTE_BWD_CONFIG, BwdConfig, attn_bwd
from flamia_serve.kernels.attn_fwd.ops import attn_fwd
from flamia_serve.kernels.quant.ops import quantize_do, quantize_qkv
from flamia_serve.numerics import RECIPES
from flamia_serve.probes import make_pack
from flamia_serve.reference import attention_backward

CONFIGS = {"cute": CUTE_BWD_CONFIG, "triton": BwdConfig()}
#: accuracy packs: lens, hq, hkv, d, causal, exact_causal
ACCURACY_CASES = [
    ((1, 300, 1000, 129, 31), 4, 2, 64, True, False),
    ((1, 300, 1000, 129, 31), 4, 2, 128, True, False),
    ((257, 64, 700), 8, 1, 128, False, False),
    ((500, 3, 77), 4, 4, 64, True, True),
]


def _rel(x: torch.Tensor, ref: torch.Tensor) -> float:
    r = ref.to(x.dtype).float()
    return float((x.float() - r).norm() / ref.float().norm().clamp(min=1e-30))


def operands(lens, hq, hkv, d, causal, exact=False, seed=5):
    """Quantized operands of a pack on the GPU (forward run, dO quantized) for ``backward``."""
    q, k, v, cu, _ = make_pack(lens, hq, hkv, d, seed=seed, device="cuda")
    d_out = make_pack(lens, hq, hkv, d, seed=seed + 1, device="cuda")[0]
    # both backwards' operands: Q̂ and Ĝ in the column layout and as BF16 rows
    qkv = quantize_qkv(q, k, v, cu, exact_causal=exact, with_transposed=True, column_align=128,
                       q_rows=True)  # fmt: skip
    out, m, lse = attn_fwd(qkv, cu, heads_q=hq, causal=causal, softmax_scale=d**-0.5)
    qdo = quantize_do(d_out, out, m, lse, cu, column_align=128, g_rows=True)
    return dict(qkv=qkv, qdo=qdo, m=m, lse=lse, cu=cu, d_out=d_out, out=out, hq=hq, d=d,
                causal=causal)  # fmt: skip


def backward(ops, config, debug_p=None):
    """``attn_bwd`` of ``operands``' result with ``config``."""
    return attn_bwd(
        ops["qkv"], ops["qdo"], ops["m"], ops["lse"], ops["cu"], heads_q=ops["hq"],
        causal=ops["causal"], softmax_scale=ops["d"] ** -0.5, config=config,
        debug_p=debug_p,
    )  # fmt: skip


def accuracy(case) -> dict:
    lens, hq, hkv, d, causal, exact = case
    ops = operands(lens, hq, hkv, d, causal, exact)
    got = {k: backward(ops, cfg) for k, cfg in CONFIGS.items()}
    ref = attention_backward(
        ops["d_out"], ops["out"], ops["m"], ops["lse"], ops["qkv"].to_reference(), ops["cu"],
        RECIPES["mxfp8"], causal=causal, softmax_scale=d**-0.5, qdo=ops["qdo"].to_reference(),
    )  # fmt: skip
    row = dict(lens=list(lens), hq=hq, hkv=hkv, d=d, causal=causal, exact_causal=exact)
    for i, name in enumerate(("dq", "dk", "dv")):
        for k in CONFIGS:
            row[f"{k}_{name}_rel"] = _rel(got[k][i], ref[i])
            row[f"{k}_{name}_finite"] = bool(torch.isfinite(got[k][i]).all())
        row[f"cute_vs_triton_{name}_rel"] = _rel(got["cute"][i], got["triton"][i].float())
    return row


def debug_p_agreement() -> dict:
    lens, hq, hkv, d = (100, 1, 45, 130), 4, 2, 64
    ops = operands(lens, hq, hkv, d, True)
    t = sum(lens)
    bufs = {k: torch.zeros(hq, t, t, device="cuda") for k in CONFIGS}
    for k, cfg in CONFIGS.items():
        backward(ops, cfg, bufs[k])
    differ = (bufs["cute"] != bufs["triton"]).sum().item()
    nonzero = (bufs["triton"] != 0).sum().item()
    return dict(lens=list(lens), p_hat_codes_differ=differ, p_hat_nonzero=nonzero)


def speed(t: int, d: int, causal: bool, configs: dict, hq: int = 32, hkv: int = 8) -> list[dict]:
    """Time of each of ``configs`` (name -> ``BwdConfig``) on one T-token document."""
    ops = operands((t,), hq, hkv, d, causal)
    flops = 2.5 * 4 * (t * t / (2 if causal else 1)) * hq * d
    rows = []
    for k, cfg in configs.items():
        ms = time_ms(lambda cfg=cfg: backward(ops, cfg), warmup_ms=10, rep_ms=100)["ms"]
        rows.append(dict(kernel=k, tokens=t, d=d, causal=causal, hq=hq, hkv=hkv, ms=ms,
                         tflops=flops / ms / 1e9))  # fmt: skip
        print(f"  {k:8s} T={t} d={d} causal={causal}: {ms:.3f} ms {rows[-1]['tflops']:.1f} TFLOP/s")
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--stages", default="", help="extra CuTe stage counts to time, e.g. 3,4")
    args = ap.parse_args(argv)
    result: dict = {"env": env_info(), "accuracy": [], "speed": []}
    for case in ACCURACY_CASES:
        row = accuracy(case)
        print({k: (round(v, 5) if isinstance(v, float) else v) for k, v in row.items()})
        result["accuracy"].append(row)
    result["debug_p"] = debug_p_agreement()
    print(result["debug_p"])
    shapes = [(8192, 128, True)] if args.quick else [
        (8192, 128, True), (8192, 128, False), (8192, 64, True), (16384, 128, True),
    ]  # fmt: skip
    extra = {
        f"cute-s{n}": BwdConfig(num_stages=int(n), kernel="cute")
        for n in args.stages.split(",") if n
    }  # fmt: skip
    extra["cute-overlap"] = BwdConfig(kernel="cute", overlap=True)
    for t, d, causal in shapes:
        result["speed"] += speed(t, d, causal, {**CONFIGS, **extra})
    path = results_dir() / "bwd_kernels.json"
    path.write_text(__import__("json").dumps(result, indent=1))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
