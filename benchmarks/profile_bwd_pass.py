"""Where a training backward's (or forward's) GPU time goes, kernel by kernel (H200).

``python benchmarks/profile_bwd_pass.py [--workloads W3,W6,W7] [--iters 5] [--pass fwd]``
runs ``flamia_attn_varlen``'s backward (``torch.autograd.grad``, a plan built outside, as
``train_attention.py --passes bwd`` times it; ``--pass fwd``: the forward with gradients
enabled) under ``torch.profiler`` and prints, per workload, each CUDA kernel's GPU time per
call and its share of the pass (the re-quantization of Q/K/V, dO's quantization, the
backward kernel, the dQ read-back and copies), and writes ``profile_bwd_pass.json``
(``profile_fwd_pass.json``) to ``FLAMIA_RESULTS_DIR``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from benchmarks.common import cuda_kernel_times, write_results
from benchmarks.train_attention import make_inputs
from benchmarks.workloads import training_workload


def kernel_times(workload_name: str, iters: int, recipe: str, pass_: str = "bwd") -> dict:
    """GPU µs per backward (``pass_="fwd"``: forward) call by kernel name (averaged over
    ``iters`` calls)."""
    import flamia_serve

    wl = training_workload(workload_name)
    dev = torch.device("cuda")
    cu = wl.cu_seqlens(dev)
    q, k, v = (x.detach().requires_grad_() for x in make_inputs(wl, seed=0, device=dev))
    plan = flamia_serve.plan_varlen(cu, wl.total_tokens, wl.max_seqlen)

    def forward() -> torch.Tensor:
        return flamia_serve.flamia_attn_varlen(
            q, k, v, cu, wl.max_seqlen, causal=True, recipe=recipe, plan=plan
        )

    out = forward()
    d_out = torch.randn_like(out)

    def one_call() -> None:
        if pass_ == "fwd":
            forward()
        else:
            torch.autograd.grad(out, (q, k, v), d_out, retain_graph=True)

    one_call()  # compile outside the profile
    per_kernel = cuda_kernel_times(one_call, iters)
    total = sum(per_kernel.values())
    return {
        "workload": workload_name,
        "tokens": wl.total_tokens,
        "docs": wl.num_docs,
        "total_us": total,
        "kernels_us": dict(sorted(per_kernel.items(), key=lambda kv: -kv[1])),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workloads", default="W3,W6,W7")
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--recipe", default="mxfp8")
    ap.add_argument("--pass", dest="pass_", choices=["bwd", "fwd"], default="bwd")
    args = ap.parse_args(argv)
    rows = []
    for name in args.workloads.split(","):
        row = kernel_times(name, args.iters, args.recipe, args.pass_)
        rows.append(row)
        print(f"{name}: {row['total_us']:.0f} µs GPU per {args.pass_}, {row['docs']} documents")
        for kname, us in row["kernels_us"].items():
            print(f"  {us:9.1f} µs {100 * us / row['total_us']:5.1f}%  {kname}")
    extra = {"recipe": args.recipe, "iters": args.iters, "pass": args.pass_}
    write_results(f"profile_{args.pass_}_pass", rows, extra)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
