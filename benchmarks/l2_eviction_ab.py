"""The training forward with and without an L2 evict-first policy on the quantizer's input
loads (``quant.ops.INPUT_EVICTION``), next to FA4, in one process.

    python benchmarks/l2_eviction_ab.py [--workloads P3,W7,P1,P4,W3] [--rounds 3]
        [--settings ,evict_first] [--no-fa4] [--quant-only] [--name l2_eviction_ab]

Each setting gets its own plan, whose prepared launches keep the setting they were prepared
with. Per workload: O of every setting the same bits (the policy moves no value); then every
impl timed as ``train_attention.py`` times it (eager call over rotating input sets, L2
flushed before each call — dirty, as every table — and a CUDA-graph replay), in
``--rounds`` rounds in alternating order. ``--quant-only``: the forward's K/V quantization
alone instead (Q left to the kernel, as the CuTe forward's default; Triton only, no CuTe
needed), CUDA-graph replays with the L2 flushed dirty. Writes ``<name>.json``: one row per
(workload, impl, round), and the medians printed.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import sys
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from benchmarks.common import (
    Rotating,
    graph_time,
    num_input_sets,
    positive_int,
    tensor_bytes,
    time_ms,
    write_results,
)
from benchmarks.train_attention import _first_tensor, _flamia_loader, _load_fa4, make_inputs
from benchmarks.workloads import training_workload
from flamia_serve.kernels.quant import ops as quant_ops


def _label(setting: str) -> str:
    return f"flamia-mxfp8-{setting or 'normal'}"


def bench(name: str, settings: list[str], fa4: bool, rounds: int) -> list[dict]:
    """Rows of one workload: each impl once per round, the order reversed every other one."""
    dev = torch.device("cuda")
    wl = training_workload(name)
    cu = wl.cu_seqlens(dev)
    raw0 = make_inputs(wl, seed=0, device=dev)
    raw = [raw0] + [make_inputs(wl, seed=i, device=dev)
                    for i in range(1, num_input_sets(tensor_bytes(raw0)))]  # fmt: skip
    runs = {}
    outs = {}
    for setting in settings:
        quant_ops.INPUT_EVICTION = setting
        try:
            prep, run = _flamia_loader("mxfp8")()(wl, cu, raw0)
            args = [prep(*s) for s in raw]
            outs[setting] = _first_tensor(run(*args[0])).clone()  # prepared with the setting
        finally:
            quant_ops.INPUT_EVICTION = ""
        runs[_label(setting)] = (run, args)
    if fa4:
        prep, run = _load_fa4()(wl, cu, raw0)
        runs["fa4"] = (run, [prep(*s) for s in raw])
    first = outs[settings[0]]
    same = {_label(s): bool(torch.equal(outs[s], first)) for s in settings}
    print(f"{name}: O the same bits as {_label(settings[0])}: {same}")
    rows = []
    for r in range(rounds):
        order = list(runs.items())
        for impl, (run, args) in order if r % 2 == 0 else order[::-1]:
            t = time_ms(Rotating(run, args))
            g = graph_time(functools.partial(run, *args[0]))
            rows.append({
                "workload": name, "pass": "fwd", "impl": impl, "round": r, **t,
                "graph_ms": g["ms"], "tflops": wl.flops() / (t["ms"] * 1e-3) / 1e12,
                "same_bits_as_first_setting": same.get(impl),
            })  # fmt: skip
    for impl in runs:
        ms = statistics.median(x["ms"] for x in rows if x["impl"] == impl)
        gms = statistics.median(x["graph_ms"] for x in rows if x["impl"] == impl)
        print(f"  {name} {impl:28s} {1e3 * ms:9.1f} µs eager  {1e3 * gms:9.1f} µs graph  "
              f"{wl.flops() / (ms * 1e-3) / 1e12:6.1f} TFLOP/s")  # fmt: skip
    return rows


def bench_quant(name: str, settings: list[str], rounds: int) -> list[dict]:
    """Rows of the forward's K/V quantization alone on one workload, per setting and round."""
    from flamia_serve.kernels.quant.ops import quantize_qkv

    dev = torch.device("cuda")
    wl = training_workload(name)
    cu = wl.cu_seqlens(dev)
    q, k, v = make_inputs(wl, seed=0, device=dev)
    codes = {}
    for setting in settings:
        quant_ops.INPUT_EVICTION = setting
        try:
            got = quantize_qkv(q, k, v, cu, defer_q=True)
            codes[setting] = [got.k_codes.view(torch.uint8).clone(),
                              got.v_t.view(torch.uint8).clone()]  # fmt: skip
        finally:
            quant_ops.INPUT_EVICTION = ""
    same = {s: all(torch.equal(a, b) for a, b in zip(codes[s], codes[settings[0]],
                                                     strict=True)) for s in settings}  # fmt: skip
    print(f"{name}: K/V codes the same bits as {_label(settings[0])}: {same}")
    rows = []
    for r in range(rounds):
        for setting in settings if r % 2 == 0 else settings[::-1]:
            quant_ops.INPUT_EVICTION = setting
            try:
                t = graph_time(lambda: quantize_qkv(q, k, v, cu, defer_q=True))
            finally:
                quant_ops.INPUT_EVICTION = ""
            rows.append({"workload": name, "pass": "quant_kv", "impl": _label(setting),
                         "round": r, **t, "same_bits_as_first_setting": same[setting]})  # fmt: skip
    for setting in settings:
        ms = statistics.median(x["ms"] for x in rows if x["impl"] == _label(setting))
        print(f"  {name} K/V quantization {_label(setting):28s} {1e3 * ms:8.1f} µs")
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--workloads", default="P3,W7,P1,P4,W3")
    ap.add_argument("--settings", default=",evict_first",
                    help="INPUT_EVICTION values ('' = none), the first the bits' reference")
    ap.add_argument("--rounds", type=positive_int, default=3)
    ap.add_argument("--no-fa4", action="store_true")
    ap.add_argument("--quant-only", action="store_true",
                    help="the forward's K/V quantization alone (Triton, no CuTe needed)")
    ap.add_argument("--name", default="l2_eviction_ab")
    args = ap.parse_args(argv)
    settings = args.settings.split(",")
    rows = []
    for name in args.workloads.split(","):
        if args.quant_only:
            rows += bench_quant(name, settings, args.rounds)
        else:
            rows += bench(name, settings, not args.no_fa4, args.rounds)
        torch.cuda.empty_cache()
    write_results(args.name, rows, {"settings": settings})
    return 0


if __name__ == "__main__":
    sys.exit(main())
