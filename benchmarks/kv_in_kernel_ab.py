"""The CuTe forward quantizing K/V itself (``attn_fwd_sm90_quantizing_kv``) against the
quantization launch + forward it replaces, in one process (GPU; needs the ``cute`` extra).

    python benchmarks/kv_in_kernel_ab.py --workloads P3,W5,W3 --rounds 3 --name kv_ab

1. Same bits: on small packs (odd lengths with 1-token documents, MHA and GQA, d 64/128,
   FP16, a NaN in one token of K and of V) and on each workload, the kernel's K codes,
   ``v_t`` (whole, padding included), and K/V exponents and factors at the tokens' columns
   equal ``quantize_qkv(defer_q=True, column_align=128)``'s, and O, M, lse equal the CuTe
   forward's on those operands; three runs each (a race would show as a difference).
2. Times: per workload, CUDA-graph replays of (a) the quantization launch (K/V) + the
   forward, as a planned eager call runs them, (b) the forward quantizing K/V itself (its
   flag/ticket memsets included) per ``--variants`` (``parse_variants``), (c)
   the forward alone on K/V quantized beforehand (what (b) would take if its quantization
   cost nothing), and FA4 BF16 when installed, interleaved over ``--rounds`` rounds;
   medians; JSON ``<name>.json``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from benchmarks.common import graph_time, positive_int, write_results
from benchmarks.workloads import training_workload
from flamia_serve.kernels.attn_fwd.cute_sm90 import attn_fwd_sm90_quantizing_kv
from flamia_serve.kernels.attn_fwd.ops import CUTE_CONFIG, attn_fwd
from flamia_serve.kernels.quant.ops import quantize_qkv_launch
from flamia_serve.kernels.schedule import build_work_list
from flamia_serve.numerics.operands import token_columns
from flamia_serve.probes import make_pack

#: (lengths, Hq, Hkv, d, dtype, NaN token or None)
CHECK_PACKS = (
    ((1, 33, 300, 1, 4097, 17, 64), 16, 16, 128, torch.bfloat16, None),
    ((129, 1, 700, 2, 31, 32, 33), 8, 2, 128, torch.bfloat16, 40),
    ((1000, 5, 257), 8, 8, 64, torch.float16, None),
)


def reference(q, k, v, cu, launch_kv: bool = True):
    """The launch's operands (K/V) and the CuTe forward on them (Q in the kernel); the
    call runs the launch first (``launch_kv``), or only the forward."""
    qkv, launch = quantize_qkv_launch(q, k, v, cu, defer_q=True,
                                      column_align=CUTE_CONFIG.column_align)  # fmt: skip
    work = build_work_list(cu, q.shape[0], block_m=128, block_n=128, causal=True)
    launch(q=q, k=k, v=v)

    def run():
        if launch_kv:
            launch(q=q, k=k, v=v)
        scale = q.shape[2] ** -0.5
        return attn_fwd(qkv, cu, heads_q=q.shape[1], causal=True, softmax_scale=scale,
                        out_dtype=q.dtype, config=CUTE_CONFIG, work=work)  # fmt: skip

    return qkv, run


def compare(name, q, k, v, cu) -> dict:
    """Bits of the in-kernel quantization and the outputs against the reference path."""
    ref_qkv, ref_run = reference(q, k, v, cu)
    ref_out = [t.clone() for t in ref_run()]
    run, qkv = attn_fwd_sm90_quantizing_kv(q, k, v, cu)
    cols = token_columns(cu, qkv.doc_v_t_start, q.shape[0]).long()
    row = {"pack": name, "runs": []}
    for _ in range(3):
        out = [t.clone() for t in run()]
        torch.cuda.synchronize()
        u8, i32 = torch.uint8, torch.int32
        checks = {
            "k_codes": torch.equal(qkv.k_codes.view(u8), ref_qkv.k_codes.view(u8)),
            "v_t": torch.equal(qkv.v_t.view(u8), ref_qkv.v_t.view(u8)),
            "k_exp": torch.equal(qkv.k_exp[:, cols], ref_qkv.k_exp[:, cols]),
            "v_exp": torch.equal(qkv.v_exp[:, cols], ref_qkv.v_exp[:, cols]),
            "kv_factors": torch.equal(
                qkv.kv_factors[:, :, cols].view(i32), ref_qkv.kv_factors[:, :, cols].view(i32)
            ),
            "O": torch.equal(out[0].view(torch.int16), ref_out[0].view(torch.int16)),
            "M": torch.equal(out[1].view(i32), ref_out[1].view(i32)),
            "lse": torch.equal(out[2].view(i32), ref_out[2].view(i32)),
        }
        row["runs"].append(checks)
    row["all_equal"] = all(all(c.values()) for c in row["runs"])
    print(name, "all equal" if row["all_equal"] else row["runs"], flush=True)
    return row


def checks(workloads: list[str]) -> list[dict]:
    rows = []
    for i, (lens, hq, hkv, d, dtype, nan_at) in enumerate(CHECK_PACKS):
        q, k, v, cu, _ = make_pack(lens, hq, hkv, d, seed=10 + i, device="cuda")
        q, k, v = (x.to(dtype) for x in (q, k, v))
        if nan_at is not None:
            k[nan_at, 0, 3] = float("nan")
            v[nan_at + 1, 1 % hkv, 5] = float("nan")
        rows.append(compare(f"check{i}", q, k, v, cu))
    for name in workloads:
        q, k, v, cu = inputs(name)
        rows.append(compare(name, q, k, v, cu))
    return rows


def inputs(name: str):
    wl = training_workload(name)
    q, k, v, cu, _ = make_pack(tuple(wl.seqlens), wl.hq, wl.hkv, wl.head_dim, seed=3,
                               device="cuda")  # fmt: skip
    return q, k, v, cu


def fa4_call(q, k, v, cu, max_len):
    try:
        from flash_attn.cute import flash_attn_varlen_func
    except ImportError:
        return None
    return lambda: flash_attn_varlen_func(q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu,
                                          max_seqlen_q=max_len, max_seqlen_k=max_len,
                                          causal=True)  # fmt: skip


def parse_variants(text: str) -> dict[str, tuple[int, tuple]]:
    """``g4,g4:reg,g4:reg:c8:np,g4:trace``: K/V heads per group, then ``reg`` rows loaded
    from global memory into registers (else staged in shared memory by bulk copies),
    ``c<n>`` K's tokens per register load pass, ``np`` no L2 prefetch of the next task's
    rows, ``trace`` the kernel's timers (``cute_kv_quant.TRACE_FIELDS``, printed once per
    workload, not timed) -> name: (group, (k_chunk, prefetch, stage, trace))."""
    out = {}
    for name in text.split(","):
        parts = name.split(":")
        chunk, prefetch, stage, trace = 16, True, True, False
        for part in parts[1:]:
            if part == "np":
                prefetch = False
            elif part == "reg":
                stage = False
            elif part == "trace":
                trace = True
            else:
                chunk = int(part.removeprefix("c"))
        out[name] = (int(parts[0].removeprefix("g")), (chunk, prefetch, stage, trace))
    return out


def traced(name: str, q, k, v, cu, group: int, options: tuple) -> dict:
    """One run of a ``trace`` variant: the kernel's timers (``TRACE_FIELDS``), per task and
    per CTA."""
    from flamia_serve.kernels._common import sm_count
    from flamia_serve.kernels.attn_fwd.cute_kv_quant import TRACE_FIELDS, TRACE_WORDS

    run, _qkv = attn_fwd_sm90_quantizing_kv(q, k, v, cu, group_heads=group, options=options)
    run()
    torch.cuda.synchronize()
    raw = run.trace().tolist()
    words = dict(zip(TRACE_FIELDS[:4], raw[:4], strict=True))
    start = (raw[4] & 0xFFFFFFFF) | (raw[5] << 32)
    end = (raw[6] & 0xFFFFFFFF) | (raw[7] << 32)
    ctas = sm_count(q.device)
    row = {
        "workload": name, "trace": words, "trace_words": TRACE_WORDS,
        "task_us": words["task_ns"] / max(words["tasks"], 1) / 1e3,
        "tma_wait_us_per_cta": words["tma_wait_ns"] / ctas / 1e3,
        "quantization_span_us": (end - start) / 1e3,
    }  # fmt: skip
    print(f"{name} trace: {row}", flush=True)
    return row


def times(workloads: list[str], rounds: int, variants: dict) -> list[dict]:
    rows = []
    for name in workloads:
        wl = training_workload(name)
        q, k, v, cu = inputs(name)
        _qkv, launch_then_fwd = reference(q, k, v, cu)
        _qkv, forward_only = reference(q, k, v, cu, launch_kv=False)
        impls = {"launch+forward": launch_then_fwd, "forward_kv_given": forward_only}
        for variant, (g, options) in variants.items():
            if wl.hkv % g == 0 and options[3]:
                rows.append(traced(name, q, k, v, cu, g, options))
            elif wl.hkv % g == 0:
                impls[f"kv_in_kernel_{variant}"] = attn_fwd_sm90_quantizing_kv(
                    q, k, v, cu, group_heads=g, options=options
                )[0]
        fa4 = fa4_call(q, k, v, cu, wl.max_seqlen)
        if fa4 is not None:
            impls["fa4"] = fa4
        samples: dict[str, list[float]] = {impl: [] for impl in impls}
        for r in range(rounds):
            order = list(impls) if r % 2 == 0 else list(reversed(impls))
            for impl in order:
                samples[impl].append(graph_time(impls[impl])["ms"])
        for impl, ms in samples.items():
            med = statistics.median(ms)
            rows.append({"workload": name, "impl": impl, "pass": "fwd", "ms": med,
                         "ms_rounds": ms, "tflops": wl.flops() / (med * 1e-3) / 1e12})  # fmt: skip
            print(f"{name:4s} {impl:16s} {med:8.3f} ms  {rows[-1]['tflops']:6.1f} TFLOP/s "
                  f"rounds {[round(x, 3) for x in ms]}", flush=True)  # fmt: skip
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workloads", default="P3,W5,W3")
    parser.add_argument("--rounds", type=positive_int, default=3)
    parser.add_argument("--name", default="kv_in_kernel_ab")
    parser.add_argument("--variants", default="g4",
                        help="in-kernel variants (parse_variants): K/V heads per group of the "
                        "order (the number of K/V heads: the work list's own), K's load "
                        "chunk, no prefetch")
    parser.add_argument("--no-check", action="store_true")
    parser.add_argument("--no-time", action="store_true")
    args = parser.parse_args()
    workloads = [w for w in args.workloads.split(",") if w]
    rows = [] if args.no_check else checks(workloads)
    if not args.no_time:
        rows += times(workloads, args.rounds, parse_variants(args.variants))
    write_results(args.name, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
