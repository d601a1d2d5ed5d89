"""The CuTe forward of this tree against another copy of its kernel module, in one process.

    python benchmarks/fwd_variant_ab.py --variant OLD/cute_sm90.py \\
        --workloads W1,W3,W4,W7,P3 --prefill S1-1x8192+0,S4-8x512+8192 --name fwd_ab

``--variant``: a copy of ``flamia_serve/kernels/attn_fwd/cute_sm90.py`` (e.g. ``git show
REV:flamia_serve/kernels/attn_fwd/cute_sm90.py``) that works with this tree's launchers; it
takes the kernel module's place while it runs (``bwd_variant_ab.kernel_module``): the
training forward (``attn_fwd``) and the FP8-cache prefill import it at each call.

1. Same results: O, M and lse the same bits from both kernels on one quantization, on small
   packs of the GPU tests' kinds (``bwd_variant_ab.CHECK_PACKS``) and on each workload, and
   the prefill's output on each prefill workload. ``--no-check`` skips it.
2. Times: the training forward on prequantized K/V with its work list built once (Q
   quantized in the kernel where the default config does) and the prefill's planned call
   (what a layer runs), CUDA-graph replays, this tree and the variant interleaved over
   ``--rounds`` rounds, each round's median; JSON ``<name>.json``.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from benchmarks.bwd_variant_ab import (
    check_packs,
    finish,
    interleaved,
    kernel_module,
    load_variant,
)
from benchmarks.common import graph_time, positive_int
from benchmarks.prefill import WORKLOADS as PREFILL_WORKLOADS
from benchmarks.prefill import workload_seed
from benchmarks.serving import fp8_prefill, planned_call
from benchmarks.workloads import training_workload
from flamia_serve.kernels.attn_fwd.ops import attn_fwd, default_config, q_options, window_limit
from flamia_serve.kernels.quant.ops import quantize_qkv
from flamia_serve.kernels.schedule import build_work_list
from flamia_serve.probes import make_pack

KERNEL_MODULE = "flamia_serve.kernels.attn_fwd.cute_sm90"


def forward_call(seqlens, hq: int, hkv: int, d: int, causal: bool, exact: bool):
    """The CuTe training forward of one pack (K/V quantized once; Q in the kernel where the
    default config quantizes it), as a call returning ``(O, M, lse)``."""
    q, k, v, cu, _ = make_pack(seqlens, hq, hkv, d, seed=5, device="cuda")
    cfg = default_config(d, q.device, kernel="cute")
    qkv = quantize_qkv(q, k, v, cu, exact_causal=exact, column_align=cfg.column_align,
                       **q_options(cfg, "e4m3", q))  # fmt: skip
    work = build_work_list(cu, q.shape[0], block_m=cfg.block_m, block_n=cfg.block_n,
                           causal=causal, window_limit=window_limit(cfg))  # fmt: skip
    return lambda: attn_fwd(qkv, cu, heads_q=hq, causal=causal, softmax_scale=d**-0.5,
                            config=cfg, work=work)  # fmt: skip


def prefill_call(name: str) -> Callable[[], tuple[torch.Tensor]]:
    """The FP8-cache prefill's planned call of prefill workload ``name`` (its output)."""
    prep = fp8_prefill(*PREFILL_WORKLOADS[name], torch.device("cuda"), workload_seed(name))
    call = planned_call(prep.batch, "fp8", prefill_keys=prep.keys)
    return lambda: (call(),)


def same_bits(run, variant, module: str) -> dict:
    """Both kernels' outputs of ``run``: each one's bits equal, and all finite."""
    ours = [t.clone() for t in run()]
    with kernel_module(variant, module):
        theirs = [t.clone() for t in run()]
    return {
        "same_bits": all(torch.equal(a, b) for a, b in zip(ours, theirs, strict=True)),
        "finite": all(bool(torch.isfinite(t.float()).all()) for t in ours),
    }


def same_output(row: dict) -> bool:
    return row["same_bits"] and row["finite"]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--variant", type=Path, required=True, help="a copy of cute_sm90.py")
    ap.add_argument("--workloads", default="W1,W3,W4,W7,P3")
    ap.add_argument("--prefill", default="S1-1x8192+0,S3-4x2048+8192,S4-8x512+8192",
                    help="prefill workloads (benchmarks/prefill.py), '' for none")
    ap.add_argument("--rounds", type=positive_int, default=5)
    ap.add_argument("--no-check", action="store_true")
    ap.add_argument("--name", default="fwd_variant_ab")
    args = ap.parse_args(argv)
    variant = load_variant(args.variant, KERNEL_MODULE)
    rows: list[dict] = []
    failed = 0
    if not args.no_check:
        rows, failed = check_packs(
            lambda *pack: same_bits(forward_call(*pack), variant, KERNEL_MODULE), same_output
        )  # fmt: skip
    cases = [("fwd", name) for name in args.workloads.split(",") if name]
    cases += [("prefill", name) for name in args.prefill.split(",") if name]
    for kind, name in cases:
        if kind == "fwd":
            w = training_workload(name)
            run = forward_call(list(w.seqlens), w.hq, w.hkv, w.head_dim, True, False)
        else:
            run = prefill_call(name)
        row = {"workload": name, "pass": kind}
        if not args.no_check:
            row |= same_bits(run, variant, KERNEL_MODULE)
            failed += not same_output(row)
        # CUDA-graph replays: no host time inside
        row |= interleaved(run, variant, args.rounds, graph_time, KERNEL_MODULE)
        print({k: row.get(k) for k in ("workload", "pass", "same_bits", "ms", "variant_ms",
                                       "speedup")}, flush=True)  # fmt: skip
        rows.append(row)
        del run
        torch.cuda.empty_cache()
    return finish(args.name, rows, args.variant, "cute forward", failed)


if __name__ == "__main__":
    sys.exit(main())
