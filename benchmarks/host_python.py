"""Our Python around the launches of eager attention calls with a plan, on a CPU.

Every Triton launch is stubbed (``TritonLaunch`` hands back a runner that does nothing) and
the tensors stay on the CPU (the interpreter's device rules), so what is timed is the
Python of the Triton path's launchers (``--cute``: the CuTe kernels', with ``cute.compile``
stubbed too, in the CuTe venv) and of the entry point: argument checks, the plan's checked
call, prepared launches, output allocations, autograd. It cannot replace ``host_time.py``
on the GPU (no driver launch, no CuTe call, another CPU), but it compares variants of our
own Python where no GPU is lent.

Steps of ``--layers`` calls on a 2 x 64-token pack (Hq 32 / Hkv 8, d 128), as
``host_time.py`` (``--lens``/``--heads`` for others: the backward's CPU arithmetic on these
tensors, e.g. the dQ accumulator's cast, weighs in at this size; ``--lens 8,8 --heads 2,1``
leaves mostly Python); variants interleaved over rounds, medians per call (µs, printed only:
no results file, these are not GPU measurements):

* ``eager``: as shipped (prepared launches kept per input layout, ``AttnCall.prepared``);
* ``eager-unprepared``: launches prepared anew at every call (``KEEP_PREPARED = False``).

Usage: ``python benchmarks/host_python.py [--layers 8] [--rounds 5] [--lens 64,64]
[--heads 32,8] [--cute]``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported
if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from benchmarks.check_cute_plumbing import cute_configs, stub_cute, stub_triton_launches
from flamia_serve import custom_ops, flamia_attn_varlen, plan_varlen
from flamia_serve.kernels import _common
from flamia_serve.probes import make_pack


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=8, help="attention calls per step")
    parser.add_argument("--rounds", type=int, default=5, help="interleaved rounds")
    parser.add_argument("--steps", type=int, default=40, help="timed steps per round")
    parser.add_argument("--lens", default="64,64",
                        help="document lengths (tiny ones leave the CPU's own arithmetic out)")
    parser.add_argument("--heads", default="32,8", help="query and key/value heads")
    parser.add_argument("--cute", action="store_true",
                        help="the CuTe kernels' launchers (needs the CuTe DSL, e.g. the CuTe "
                        "venv; cute.compile stubbed as in check_cute_plumbing.py)")
    args = parser.parse_args()
    if not _common.interpreted():
        raise SystemExit("host_python.py runs on a CPU under TRITON_INTERPRET=1")
    stub_triton_launches()
    options = {}
    if args.cute:
        stub_cute()
        options = cute_configs("mxfp8", 128)
    torch.set_num_threads(1)
    lens = tuple(int(n) for n in args.lens.split(","))
    heads_q, heads_kv = (int(n) for n in args.heads.split(","))
    q, k, v, cu, ms = make_pack(lens, heads_q, heads_kv, 128, seed=0, device="cpu")
    plan = plan_varlen(cu, q.shape[0], ms)
    leaves = [x.detach().clone().requires_grad_() for x in (q, k, v)]

    def layers(q, k, v):
        for _ in range(args.layers):
            q = flamia_attn_varlen(q, k, v, cu, ms, plan=plan, **options)
        return q

    def fwd() -> None:
        with torch.no_grad():
            layers(q, k, v)

    def fwd_bwd() -> None:
        layers(*leaves).float().sum().backward()

    variants = {(impl, name): (fn, impl == "eager") for impl in ("eager", "eager-unprepared")
                for name, fn in (("fwd", fwd), ("fwd+bwd", fwd_bwd))}  # fmt: skip
    samples: dict[tuple[str, str], list[float]] = {key: [] for key in variants}
    for round_ in range(args.rounds + 1):  # the first round warms up, untimed
        for key, (fn, keep) in variants.items():
            custom_ops.KEEP_PREPARED = keep
            times = []
            for _ in range(args.steps):
                start = time.perf_counter()
                fn()
                times.append(time.perf_counter() - start)
            if round_:
                samples[key] += times
    custom_ops.KEEP_PREPARED = True
    for (impl, name), times in samples.items():
        us = statistics.median(times) * 1e6 / args.layers
        print(f"{impl:18s} {name:8s} {us:7.1f} us of Python per attention call (CPU, stubbed)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
