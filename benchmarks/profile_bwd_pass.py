"""Where a training backward's (or forward's) GPU time goes, kernel by kernel (H200).

``python benchmarks/profile_bwd_pass.py [--workloads W3,W6,W7] [--iters 5]
[--pass bwd|fwd|fwd+bwd]`` runs ``flamia_attn_varlen``'s backward (``torch.autograd.grad``,
a plan built outside, as ``train_attention.py --passes bwd`` times it; ``fwd``: the forward
with gradients enabled; ``fwd+bwd``: forward then ``backward()`` into ``.grad``, as
``--passes fwd+bwd`` times it) under ``torch.profiler`` and prints, per workload, each CUDA
kernel's GPU time per call and its share of the pass (the re-quantization of Q/K/V, dO's
quantization, the backward kernel, the dQ read-back and copies). Beside the kernels' sum:
``wall_us``, the call timed back to back as the training benchmark times it (L2 flushed), so
``wall_us - total_us`` is time the GPU waited for the host; and ``host_us``, the host time
per call of calls queued behind a busy GPU (a host read inside the call shows up here as
the GPU's backlog). Writes ``profile_<pass>_pass.json`` to ``FLAMIA_RESULTS_DIR``.
``--once``: two calls per workload and nothing else (the second one for ``ncu``).
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from benchmarks.common import cuda_kernel_times, time_ms, write_results
from benchmarks.train_attention import make_inputs
from benchmarks.workloads import training_workload


def make_call(workload_name: str, recipe: str, pass_: str) -> Callable[[], None]:
    """One backward (``pass_``: ``"fwd"``, ``"fwd+bwd"``) call on the workload's inputs, a
    plan built outside."""
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
        elif pass_ == "fwd+bwd":
            torch.autograd.backward(forward(), d_out)
        else:
            torch.autograd.grad(out, (q, k, v), d_out, retain_graph=True)

    return one_call


def kernel_times(workload_name: str, iters: int, recipe: str, pass_: str = "bwd") -> dict:
    """GPU µs per backward (``pass_``: ``"fwd"``, ``"fwd+bwd"``) call by kernel name
    (averaged over ``iters`` calls), with the call's wall and host time."""
    wl = training_workload(workload_name)
    one_call = make_call(workload_name, recipe, pass_)
    one_call()  # compile outside the timings
    host = host_us(one_call)  # before the profiler: CUPTI left attached slows launches
    wall = 1e3 * time_ms(one_call)["ms"]
    per_kernel = cuda_kernel_times(one_call, iters)
    total = sum(per_kernel.values())
    return {
        "workload": workload_name,
        "tokens": wl.total_tokens,
        "docs": wl.num_docs,
        "total_us": total,
        "wall_us": wall,
        "host_us": host,
        "kernels_us": dict(sorted(per_kernel.items(), key=lambda kv: -kv[1])),
    }


def host_us(call: Callable[[], object], reps: int = 10) -> float:
    """Host µs per call of ``reps`` calls in a row, queued behind ~0.1 s of GPU sleep (no
    launch waits for the GPU unless the call reads it on the host)."""
    torch.cuda.synchronize()
    torch.cuda._sleep(200_000_000)  # cycles: 0.1 s at 2 GHz
    start = time.perf_counter()
    for _ in range(reps):
        call()
    elapsed = time.perf_counter() - start
    torch.cuda.synchronize()
    return 1e6 * elapsed / reps


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workloads", default="W3,W6,W7")
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--recipe", default="mxfp8")
    ap.add_argument("--pass", dest="pass_", choices=["bwd", "fwd", "fwd+bwd"], default="bwd")
    ap.add_argument("--once", action="store_true",
                    help="two calls per workload, nothing timed (a driver for ncu)")  # fmt: skip
    args = ap.parse_args(argv)
    if args.once:
        for name in args.workloads.split(","):
            one_call = make_call(name, args.recipe, args.pass_)
            one_call()
            one_call()
            torch.cuda.synchronize()
        return 0
    rows = []
    for name in args.workloads.split(","):
        row = kernel_times(name, args.iters, args.recipe, args.pass_)
        rows.append(row)
        print(
            f"{name}: {row['total_us']:.0f} µs GPU per {args.pass_} (wall {row['wall_us']:.0f}, "
            f"host {row['host_us']:.0f}), {row['docs']} documents"
        )
        for kname, us in row["kernels_us"].items():
            print(f"  {us:9.1f} µs {100 * us / row['total_us']:5.1f}%  {kname}")
    extra = {"recipe": args.recipe, "iters": args.iters, "pass": args.pass_}
    write_results(f"profile_{args.pass_.replace('+', '_')}_pass", rows, extra)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
