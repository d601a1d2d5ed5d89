"""Host time of FLAMIA attention calls with a prebuilt plan (tiny pack): argument checks,
allocations, Triton launch binding, autograd. Forward, and forward+backward.

Each timed step starts on an idle GPU (synchronised before, not after, the timed call), so
no launch waits for the GPU: the time from call to return is the host side alone. Steps
of ``LAYERS`` attention calls (each layer's output is the next one's queries), per
attention call (``host_us``, median over interleaved rounds: the machine's host speed
drifts by tens of percent between runs, so variants are compared inside one run):

* ``eager``: the eager path (``custom_ops.EagerAttention``, an autograd function), with a
  plan that keeps its checked calls, kernel buffers (``VarlenPlan.workspace``) and
  prepared launches (``AttnCall.prepared``);
* ``eager-unprepared``: the same, its launches prepared anew at every call (the eager
  path before 2026-12-05, ``custom_ops.KEEP_PREPARED = False``);
* ``eager-fresh-buffers``: the same with a plan that keeps neither (``reuse=False``);
* ``eager-batched``: the same pack as ``[2, 64]`` rows through ``flamia_attn`` (no plan
  passed: the plan it keeps for its last shape, 2026-12-05; before, a one-call plan);
* ``eager-custom-op``: the eager call through the ``torch.library`` custom ops
  (``attention.EAGER_CUSTOM_OPS``; the eager path before 2026-12-01);
* ``compiled-cudagraphs``: the step through ``torch.compile(mode="reduce-overhead",
  fullgraph=True)`` (the custom ops, replayed from CUDA graphs): what a training loop that
  needs the host out of the way runs.

Usage: ``python benchmarks/host_time.py [--layers 8,32] [--breakdown] [--profile] [--impls
A,B]`` (writes ``results/host_time.json``; ``--layers``: calls per step, default ``LAYERS``;
with two counts also the ``marginal`` host time one more call adds, which leaves out what a
step costs once whatever its depth, e.g. a CUDA graph's launch and torch.compile's guards;
``--breakdown`` prints the host time of each piece of one call alone, ``--profile`` writes
cProfile's top functions of the eager steps to ``host_time_profile_<pass>.txt``;
``--impls``: only those variants, e.g. ``eager,eager-batched``).

A floor of the eager path, measured on a CPU (2026-12-05, launches stubbed): an
``autograd.Function.apply`` with this call's inputs and saved tensors alone takes ~21 µs
there, our Python around the two launches ~60 µs without gradients.
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import io
import pstats
import statistics
import sys
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from benchmarks.common import graph_time, results_dir, write_results
from flamia_serve import attention, custom_ops, flamia_attn, flamia_attn_varlen, plan_varlen
from flamia_serve.probes import make_pack

LAYERS = 8
ROUNDS = 5


def _host_times(fn, n: int) -> list[float]:
    """Seconds from call to return of ``n`` calls that each start on an idle GPU."""
    times = []
    for _ in range(n):
        torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    torch.cuda.synchronize()
    return times


@contextlib.contextmanager
def _mode(mode: str):
    """``"custom-op"``: eager calls through the custom ops; ``"unprepared"``: launches
    prepared anew at every call (``custom_ops.KEEP_PREPARED = False``); else as shipped."""
    old = attention.EAGER_CUSTOM_OPS, custom_ops.KEEP_PREPARED
    attention.EAGER_CUSTOM_OPS = mode == "custom-op"
    custom_ops.KEEP_PREPARED = mode != "unprepared"
    try:
        yield
    finally:
        attention.EAGER_CUSTOM_OPS, custom_ops.KEEP_PREPARED = old


def _profile(name: str, fn, n: int = 100) -> None:
    """cProfile of ``n`` calls of ``fn``, top functions by own and cumulative time."""
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(n):
        fn()
    torch.cuda.synchronize()
    profiler.disable()
    text = io.StringIO()
    stats = pstats.Stats(profiler, stream=text)
    stats.sort_stats("tottime").print_stats(45)
    stats.sort_stats("cumulative").print_stats(45)
    path = results_dir() / f"host_time_profile_{name.replace('+', '_')}.txt"
    path.write_text(f"{n} calls\n" + text.getvalue())
    print(f"wrote {path}")


def _breakdown(q, k, v, cu, ms, plan, d_out) -> None:
    """Host time of each piece of a forward+backward, called alone (printed)."""
    from flamia_serve.kernels.attn_bwd.ops import attn_bwd, bwd_reads_rows, default_bwd_config
    from flamia_serve.kernels.attn_fwd.ops import attn_fwd, default_config
    from flamia_serve.kernels.quant.ops import quantize_do, quantize_qkv

    cfg, bcfg = default_config(128, q.device), default_bwd_config(128, q.device)
    align = cfg.column_align  # the layout the default forward reads
    blocks, columns = plan.token_blocks(align), plan.token_columns(align)
    work = plan.work_list(cfg.block_m, cfg.block_n, True)
    bwork = plan.key_work_list(bcfg.work_block_n, bcfg.block_m, True)
    ws = plan.workspace(q.device, torch.cuda.current_stream().cuda_stream)
    # the operand forms the eager backward quantizes for this backward (custom_ops)
    rows = bwd_reads_rows(bcfg, q.shape[2])

    def quantize(transposed: bool = False, workspace=None):
        forms = dict(q_transposed=not rows, q_rows=rows) if transposed else {}
        return quantize_qkv(q, k, v, cu, blocks=blocks, column_align=align, columns=columns,
                            with_transposed=transposed, workspace=workspace, **forms)  # fmt: skip

    def forward(qkv, workspace=None):
        return attn_fwd(qkv, cu, heads_q=32, causal=True, softmax_scale=0.088, config=cfg,
                        work=work, workspace=workspace)  # fmt: skip

    def quantize_grad(workspace=None):
        return quantize_do(d_out, out, m, lse, cu, blocks=blocks, column_align=align,
                           workspace=workspace, g_columns=not rows, g_rows=rows)  # fmt: skip

    def backward(workspace=None):
        return attn_bwd(qkv, qdo, m, lse, cu, heads_q=32, causal=True, softmax_scale=0.088,
                        config=bcfg, work=bwork, workspace=workspace)  # fmt: skip

    qkv = quantize(True)
    out, m, lse = forward(qkv)
    qdo = quantize_grad()
    x = torch.zeros(8, device="cuda", requires_grad=True)
    pieces = {
        "quantize_qkv": quantize,
        "quantize_qkv(with_transposed)": lambda: quantize(True),
        "quantize_qkv(with_transposed, workspace)": lambda: quantize(True, ws),
        "attn_fwd": lambda: forward(qkv),
        "attn_fwd(workspace)": lambda: forward(qkv, ws),
        "quantize_do": quantize_grad,
        "quantize_do(workspace)": lambda: quantize_grad(ws),
        "attn_bwd": backward,
        "attn_bwd(workspace)": lambda: backward(ws),
        "torch.empty": lambda: torch.empty(128, 32, 128, device="cuda"),
        "autograd backward of x.sum()": lambda: x.sum().backward(),
    }
    for name, fn in pieces.items():
        print(f"  piece {name}: host {statistics.median(_host_times(fn, 100)) * 1e6:.1f} us")
    try:  # the eager path with a plan, piece by piece (new 2026-12-05: not yet run on a GPU)
        _breakdown_prepared(q, k, v, cu, ms, plan)
    except Exception as exc:  # printed; the rest of the run still counts
        print(f"  pieces of the prepared forward: failed: {type(exc).__name__}: {exc}"[:400])


def _breakdown_prepared(q, k, v, cu, ms, plan) -> None:
    """Host time of the eager no-grad call with a plan and of its kept launches, alone."""
    with torch.no_grad():
        flamia_attn_varlen(q, k, v, cu, ms, plan=plan)
        flamia_attn_varlen(q, k, v, cu, ms, plan=plan)  # the kept launches' runners
    call = next(c for c in plan.calls.values() if c.bwd_work is None)
    prepared = next(p for p in call.prepared.values() if isinstance(p, custom_ops.ForwardLaunch))
    quantize, attend = prepared.quantize.quantize, prepared.attend
    q_slot = q if prepared.defer_q else None
    pieces = {
        "eager flamia_attn_varlen (no grad, kept launches)": lambda: flamia_attn_varlen(
            q, k, v, cu, ms, plan=plan),
        "custom_ops.attention_forward (kept)": lambda: custom_ops.attention_forward(
            q, k, v, cu, call),
        "ForwardLaunch (kept)": lambda: prepared(q, k, v),
        "kept quantize BoundLaunch (Triton runner)": lambda: quantize(q=q, k=k, v=v),
        "kept FwdLaunch (3 allocations, ticket, launch)": lambda: attend(q=q_slot),
        "torch.cuda.current_stream()": torch.cuda.current_stream,
    }  # fmt: skip
    with torch.no_grad():
        for name, fn in pieces.items():
            print(f"  piece {name}: host "
                  f"{statistics.median(_host_times(fn, 100)) * 1e6:.1f} us")  # fmt: skip


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--breakdown", action="store_true", help="time each piece alone")
    parser.add_argument("--profile", action="store_true", help="write cProfile breakdowns")
    parser.add_argument("--layers", default=str(LAYERS),
                        help="attention calls per step, e.g. 8,32 (two counts: also what one "
                        "more call adds, the fixed per-step cost taken out)")
    parser.add_argument("--impls", default="",
                        help="only these variants, e.g. eager,eager-batched (default: all)")
    args = parser.parse_args()
    q, k, v, cu, ms = make_pack((64, 64), 32, 8, 128, seed=0, device="cuda")
    plan = plan_varlen(cu, 128, ms)
    leaves = [x.detach().clone().requires_grad_() for x in (q, k, v)]
    d_out = torch.randn_like(q)
    fresh = plan_varlen(cu, 128, ms, reuse=False)
    counts = sorted({int(n) for n in args.layers.split(",")})

    def no_grad(fn, *extra):
        def run() -> None:
            with torch.no_grad():
                fn(q, k, v, *extra)

        return run

    def steps(n: int) -> dict:
        """(impl, pass) -> (step of ``n`` attention calls, ``_mode``)."""

        def layers(q, k, v, plan=plan):
            for _ in range(n):
                q = flamia_attn_varlen(q, k, v, cu, ms, plan=plan)
            return q

        def loss(q, k, v, plan=plan):
            return layers(q, k, v, plan).float().square().mean()

        def batched_layers(q, k, v, *_plan):  # the same pack as [2, 64] rows, flamia_attn
            q, k, v = (x.view(2, 64, *x.shape[1:]) for x in (q, k, v))
            for _ in range(n):
                q = flamia_attn(q, k, v)
            return q

        def batched_loss(q, k, v):
            return batched_layers(q, k, v).float().square().mean()

        compiled_layers = torch.compile(layers, mode="reduce-overhead", fullgraph=True)
        compiled_loss = torch.compile(loss, mode="reduce-overhead", fullgraph=True)
        return {
            ("eager", "fwd"): (no_grad(layers), ""),
            ("eager", "fwd+bwd"): (lambda: loss(*leaves).backward(), ""),
            ("eager-unprepared", "fwd"): (no_grad(layers), "unprepared"),
            ("eager-unprepared", "fwd+bwd"): (lambda: loss(*leaves).backward(), "unprepared"),
            ("eager-fresh-buffers", "fwd"): (no_grad(layers, fresh), ""),
            ("eager-fresh-buffers", "fwd+bwd"): (lambda: loss(*leaves, fresh).backward(), ""),
            ("eager-batched", "fwd"): (no_grad(batched_layers), ""),
            ("eager-batched", "fwd+bwd"): (lambda: batched_loss(*leaves).backward(), ""),
            ("eager-custom-op", "fwd"): (no_grad(layers), "custom-op"),
            ("eager-custom-op", "fwd+bwd"): (lambda: loss(*leaves).backward(), "custom-op"),
            ("compiled-cudagraphs", "fwd"): (no_grad(compiled_layers), ""),
            ("compiled-cudagraphs", "fwd+bwd"): (
                lambda: compiled_loss(*leaves).backward(), ""),
        }

    chosen = set(filter(None, args.impls.split(",")))
    known = {impl for impl, _pass in steps(counts[0])}
    if chosen - known:
        parser.error(f"--impls: unknown {sorted(chosen - known)}; known: {sorted(known)}")
    variants = {(*key, n): value for n in counts for key, value in steps(n).items()
                if not chosen or key[0] in chosen}  # fmt: skip
    if args.breakdown:
        _breakdown(q, k, v, cu, ms, plan, d_out)
    samples: dict[tuple[str, str, int], list[float]] = {key: [] for key in variants}
    for key, (step, mode) in list(variants.items()):
        try:
            with _mode(mode):
                for _ in range(5):  # compile, record and warm up the CUDA graphs
                    step()
        except Exception as exc:  # recorded; the other variants still count
            print(f"{key}: failed: {type(exc).__name__}: {exc}"[:400])
            del variants[key], samples[key]
    for _ in range(ROUNDS):  # interleaved: every variant sees the same host conditions
        for key, (step, mode) in variants.items():
            with _mode(mode):
                samples[key] += _host_times(step, 30)
    rows = []
    step_us = {key: statistics.median(times) * 1e6 for key, times in samples.items()}
    for (impl, pass_name, n), total in step_us.items():
        us = total / n
        rows.append({"workload": f"2x64 tokens, {n} layers", "pass": pass_name,
                     "impl": f"flamia-mxfp8-{impl}", "ms": us / 1e3, "host_us": us,
                     "layers": n, "tflops": None, "gbps": None})  # fmt: skip
        print(f"{impl:20s} {pass_name:8s} {n:3d} layers: host {us:7.1f} us per attention call")
    for (impl, pass_name, n), total in step_us.items():  # what one more layer costs
        top = counts[-1]
        if n != counts[0] or top == n or (impl, pass_name, top) not in step_us:
            continue
        marginal = (step_us[(impl, pass_name, top)] - total) / (top - n)
        rows.append({"workload": f"2x64 tokens, {n} -> {top} layers", "pass": pass_name,
                     "impl": f"flamia-mxfp8-{impl}", "ms": marginal / 1e3,
                     "host_us": marginal, "marginal": True, "tflops": None, "gbps": None})
        print(f"{impl:20s} {pass_name:8s} host {marginal:7.1f} us per extra attention call "
              f"({n} -> {top} layers)")
    layers = steps(counts[0])[("eager", "fwd")][0]
    gpu = graph_time(layers, rep_ms=50)["ms"] * 1e3 / counts[0]
    print(f"GPU time of the forward (graph replay): {gpu:.1f} us per attention call")
    if args.profile:
        for key in (("eager", "fwd"), ("eager", "fwd+bwd")):
            _profile("_".join(key), variants[(*key, counts[0])][0])
    write_results("host_time", rows, {
        "note": "host time per attention call (median over interleaved rounds of steps of "
                f"{args.layers} calls, each starting on an idle GPU); plan prebuilt; "
                "'marginal' rows: the host time one more layer adds",
        "gpu_us_per_forward_call": gpu,
    })  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
