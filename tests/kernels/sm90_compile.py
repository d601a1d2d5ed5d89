"""Compile every kernel variant for Hopper (sm_90) without a GPU; prints one line each.

Run as a script with TRITON_INTERPRET unset (``test_compile_sm90.py`` does): Triton lowers
the kernels through TTIR/TTGIR/LLVM/PTX to a cubin with its bundled ptxas, so errors that
the CPU interpreter cannot see (constexpr rules, layouts, dtypes) show up in CI.
"""

from __future__ import annotations

import inspect
import sys
from pathlib import Path

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from flamia_serve.kernels.attn_bwd.triton import attn_bwd_kernel
from flamia_serve.kernels.attn_fwd.triton import attn_fwd_kernel, attn_fwd_windows_kernel
from flamia_serve.kernels.paged.ops import PagedLayout
from flamia_serve.kernels.paged.triton import (
    combine_splits_kernel,
    paged_attention_kernel,
    prefill_offsets_kernel,
    prefill_operands_kernel,
    quantize_q_tokens_kernel,
    write_kv_cache_kernel,
)
from flamia_serve.kernels.quant.triton import quantize_do_kernel, quantize_qkv_kernel
from flamia_serve.numerics.kv_pages import KVPageFormat

TARGET = GPUTarget("cuda", 90, 32)
FP8, I8, I16, I32, U8, BF16, F32 = "*fp8e4nv", "*i8", "*i16", "*i32", "*u8", "*bf16", "*fp32"


def _compile(
    kernel: triton.JITFunction, ptrs: dict[str, str], consts: dict, warps: int
) -> triton.compiler.CompiledKernel:
    """Compile as the JIT would for 16-byte aligned tensors and 16-divisible ``t_pad``."""
    sig, attrs = {}, {}
    for i, name in enumerate(inspect.signature(kernel.fn).parameters):
        sig[name] = ptrs.get(name) or ("constexpr" if name in consts else "i32")
        if name in ptrs or name == "t_pad":
            attrs[(i,)] = [["tt.divisibility", 16]]
    for name in ("qk_scale", "softmax_scale", "k_inv_scale", "v_inv_scale", "v_scale"):
        if name in sig:
            sig[name] = "fp32"
    source = ASTSource(kernel, sig, consts, attrs)
    return triton.compile(source, target=TARGET, options={"num_warps": warps})


def resource_usage(kernel: triton.compiler.CompiledKernel) -> str:
    """``REG``/``STACK``/``SHARED`` of a compiled kernel (``cuobjdump``; '' without it)."""
    import shutil
    import subprocess
    import tempfile

    bundled = Path(triton.__file__).parent / "backends/nvidia/bin/cuobjdump"
    tool = shutil.which("cuobjdump") or (str(bundled) if bundled.exists() else None)
    if tool is None:
        return ""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(kernel.asm["cubin"])
        f.flush()
        out = subprocess.run([tool, "-res-usage", f.name], capture_output=True, text=True).stdout
    return " ".join(w for w in out.split() if w.startswith(("REG:", "STACK:", "SHARED:")))


def quant_variants() -> None:
    ptrs = {
        "q_ptr": BF16, "k_ptr": BF16, "v_ptr": BF16, "block_start_ptr": I32,
        "block_len_ptr": I32, "block_v_t_ptr": I32, "q_slots_ptr": I32, "q8_ptr": FP8,
        "q_exp_ptr": I16,
        "k8_ptr": FP8, "k_exp_ptr": I16,
        "vt_ptr": FP8, "v_exp_ptr": I16, "kv_factor_ptr": F32, "q4_ptr": U8,
        "q4_scale_ptr": FP8, "q4_exp_ptr": I8, "k4_ptr": U8, "k4_scale_ptr": FP8,
        "k4_exp_ptr": I8, "q_wide_ptr": BF16, "k_wide_ptr": BF16, "q_rows_ptr": BF16,
        "k_rows_ptr": BF16,
    }  # fmt: skip
    # (exact, NVFP4, Hadamard, widened NVFP4 values for the CuTe kernels, only those, no Q,
    # the gradient operands as BF16 rows: Q's codes for the CuTe backward; Q and K's inputs
    # for grad_qk="input"; Q of the short documents only)
    for d in (64, 128, 256):
        for exact, nvfp4, had, wide, scores_only, skip_q, q_rows, grad_input, q_short in (
            (False, False, False, False, False, False, False, False, False),
            (True, True, False, True, False, False, False, False, False),
            (False, True, True, False, False, False, False, False, False),
            (False, True, False, True, True, False, False, False, False),
            (False, False, False, False, False, True, False, False, False),
            (False, False, False, False, False, False, True, False, False),
            (True, True, True, True, False, False, True, False, False),
            (False, False, False, False, False, False, True, True, False),
            (True, False, False, False, False, False, True, True, False),
            (False, False, False, False, False, False, False, False, True),
        ):  # fmt: skip
            consts = dict(HQ=32, HKV=8, D=d, BLOCK=32, PER_TOKEN_QK=exact, QK_NVFP4=nvfp4,
                          HADAMARD=had, LOG2_D=d.bit_length() - 1, WIDE=wide,
                          SCORES_ONLY=scores_only, SKIP_Q=skip_q, Q_SHORT=q_short, Q_ROWS=q_rows,
                          K_ROWS=grad_input, GRAD_INPUT=grad_input,
                          SCALE_CANDIDATES=3 if nvfp4 else 1,
                          INTERPRET=False)  # fmt: skip
            _compile(quantize_qkv_kernel, ptrs, consts, 4)
            print(f"quant d={d} exact={exact} nvfp4={nvfp4} hadamard={had} wide={wide} "
                  f"scores_only={scores_only} skip_q={skip_q} q_rows={q_rows} "
                  f"grad_input={grad_input} q_short={q_short}: ok")  # fmt: skip


def fwd_variants() -> None:
    ptrs = {
        "q8_ptr": FP8, "q_exp_ptr": I16, "k8_ptr": FP8, "k_exp_ptr": I16, "q4_ptr": U8,
        "q4_scale_ptr": FP8, "q4_exp_ptr": I8, "k4_ptr": U8, "k4_scale_ptr": FP8,
        "k4_exp_ptr": I8, "vt_ptr": FP8, "doc_v_t_ptr": I32, "v_exp_ptr": I16, "cu_ptr": I32,
        "item_doc_ptr": I32,
        "item_tile_ptr": I32, "count_ptr": I32, "ticket_ptr": I32, "out_ptr": BF16,
        "m_ptr": F32, "lse_ptr": F32, "dbg_p_ptr": F32, "dbg_m_ptr": F32,
    }  # fmt: skip
    for d, bm, bn, warps in ((64, 64, 64, 4), (128, 64, 64, 4), (256, 64, 64, 8)):
        for causal, nvfp4, two_pass, persistent in (
            (True, False, False, True),
            (False, False, True, False),
            (True, True, False, True),
        ):
            consts = dict(HQ=32, HKV=8, D=d, BLOCK_M=bm, BLOCK_N=bn, CAUSAL=causal,
                          QK_NVFP4=nvfp4, TWO_PASS=two_pass, INTERPRET=False,
                          PERSISTENT=persistent, KE_BLOCK=1 if causal else 32,
                          DEBUG_P=False)  # fmt: skip
            _compile(attn_fwd_kernel, ptrs, consts, warps)
            print(f"attn_fwd d={d} causal={causal} nvfp4={nvfp4} two_pass={two_pass}: ok")


def window_variants(verbose: bool = False) -> None:
    """The forward's short-document window kernel (``-v``: its registers and stack, the
    figure that sets how many of its programs an SM holds)."""
    ptrs = {
        "q8_ptr": FP8, "q_exp_ptr": I16, "k8_ptr": FP8, "k_exp_ptr": I16, "vt_ptr": FP8,
        "v_exp_ptr": I16, "column_ptr": "*i64", "token_doc_ptr": I32, "win_start_ptr": I32,
        "win_end_ptr": I32, "win_count_ptr": I32, "out_ptr": BF16, "m_ptr": F32, "lse_ptr": F32,
    }  # fmt: skip
    for d in (64, 128):
        for causal in (True, False):
            consts = dict(HQ=32, HKV=8, D=d, ROWS=64, CAUSAL=causal, INTERPRET=False)
            kernel = _compile(attn_fwd_windows_kernel, ptrs, consts, 4)
            extra = f" {resource_usage(kernel)}" if verbose else ""
            print(f"attn_fwd_windows d={d} causal={causal}: ok{extra}")


def do_quant_variants() -> None:
    ptrs = {
        "do_ptr": BF16, "o_ptr": BF16, "m_ptr": F32, "lse_ptr": F32, "block_start_ptr": I32,
        "block_len_ptr": I32, "block_v_t_ptr": I32, "do8_ptr": FP8, "do_exp_ptr": I16,
        "gt_ptr": FP8, "g_rows_ptr": BF16, "g_exp_ptr": I16, "delta_ptr": F32, "f_ptr": F32,
    }  # fmt: skip
    for d in (64, 128, 256):
        for cols, rows in ((True, False), (False, True)):  # the Triton / the CuTe backward's Ĝ
            consts = dict(HQ=32, D=d, BLOCK=32, INTERPRET=False, G_COLUMNS=cols, G_ROWS=rows)
            _compile(quantize_do_kernel, ptrs, consts, 4)
            print(f"quant_do d={d} g_columns={cols} g_rows={rows}: ok")


def bwd_variants(verbose: bool = False) -> None:
    ptrs = {
        "q8_ptr": FP8, "q_exp_ptr": I16, "qt_ptr": FP8, "q_rows_ptr": BF16, "k8_ptr": FP8,
        "k_exp_ptr": I16, "kt_ptr": FP8, "k_rows_ptr": BF16, "q4_ptr": U8, "q4_scale_ptr": FP8,
        "q4_exp_ptr": I8, "k4_ptr": U8,
        "k4_scale_ptr": FP8, "k4_exp_ptr": I8, "vt_ptr": FP8, "v_exp_ptr": I16,
        "doc_v_t_ptr": I32, "do8_ptr": FP8, "do_exp_ptr": I16, "gt_ptr": FP8, "g_exp_ptr": I16,
        "delta_ptr": F32, "m_ptr": F32, "lse_ptr": F32, "cu_ptr": I32, "item_doc_ptr": I32,
        "item_tile_ptr": I32, "count_ptr": I32, "dq_ptr": F32, "dk_ptr": BF16, "dv_ptr": BF16,
        "dbg_ptr": F32,
    }  # fmt: skip
    for d, warps, parts in ((64, 4, 1), (128, 4, 1), (128, 8, 1), (256, 4, 2)):
        for causal, nvfp4, grad_input in (
            (True, False, False), (False, False, False), (True, True, False), (True, False, True),
            (False, True, True),
        ):  # fmt: skip
            consts = dict(HQ=32, HKV=8, D=d, D_OUT=d // parts, BLOCK_M=32, BLOCK_N=64,
                          DK_KEYS=32, CAUSAL=causal,
                          QK_NVFP4=nvfp4, DEBUG_P=False, WITH_DQ=True, GRAD_INPUT=grad_input,
                          INTERPRET=False)  # fmt: skip
            k = _compile(attn_bwd_kernel, ptrs, consts, warps)
            extra = f" {resource_usage(k)}" if verbose else ""
            print(f"attn_bwd d={d} parts={parts} warps={warps} causal={causal} "
                  f"nvfp4={nvfp4} grad_input={grad_input}: ok{extra}")


_PTR = {torch.uint8: U8, torch.bfloat16: BF16, torch.int32: I32, torch.float8_e4m3fn: FP8}


def _paged_layout(fmt_id: int) -> tuple[str, str, dict]:
    """(codes pointer type, scales pointer type, layout constexprs) of a d=128, page-16
    cache, as the launcher computes them."""
    fmt = KVPageFormat(("bf16", "fp8", "nvfp4")[fmt_id], 128)
    cache = torch.zeros(fmt.cache_shape(1, 16, 8), dtype=torch.uint8)
    layout = PagedLayout.of(cache, fmt)
    return _PTR[layout.codes.dtype], _PTR[layout.scales.dtype], layout.kernel_args()


def paged_variants() -> None:
    for fmt in (0, 1, 2):
        codes, scales, layout = _paged_layout(fmt)
        ptrs = {"key_ptr": BF16, "value_ptr": BF16, "slot_ptr": I32, "codes_ptr": codes,
                "scales_ptr": scales}  # fmt: skip
        consts = dict(HKV=8, HKV_P2=8, D=128, LOG2_D=7, KV_FMT=fmt, HADAMARD=fmt == 2,
                      INTERPRET=False, **layout)  # fmt: skip
        _compile(write_kv_cache_kernel, ptrs, consts, 4)
        print(f"write_kv_cache fmt={fmt}: ok")
        ptrs = {"q_ptr": BF16, "codes_ptr": codes, "scales_ptr": scales, "block_table_ptr": I32,
                "seq_lens_ptr": I32, "qsl_ptr": I32, "out_ptr": BF16, "part_o_ptr": F32,
                "part_ml_ptr": F32}  # fmt: skip
        variants = [(True, 16, 64, 4, 0, False), (False, 128, 64, 1, 2, False)]
        if fmt == 1:
            variants += [(True, 16, 64, 4, 2, True), (False, 64, 128, 1, 0, True)]
        for decode, bm, bn, splits, mode, keys_on_m in variants:
            consts = dict(HKV=8, GROUP=4, GROUP_P2=4, D=128, BLOCK_M=bm, BLOCK_N=bn,
                          PARTIAL=splits > 1, DECODE=decode, HAS_WINDOW=not decode, KV_FMT=fmt,
                          EXP_MODE=mode, KEYS_ON_M=keys_on_m, INTERPRET=False,
                          **layout)  # fmt: skip
            _compile(paged_attention_kernel, ptrs, consts, 4 if decode else 8)
            print(f"paged_attention fmt={fmt} decode={decode} exp_mode={mode} "
                  f"keys_on_m={keys_on_m}: ok")  # fmt: skip
    ptrs = {"part_o_ptr": F32, "part_ml_ptr": F32, "out_ptr": BF16}
    _compile(combine_splits_kernel, ptrs, dict(D=128, INTERPRET=False), 4)
    print("combine_splits: ok")
    prefill_operand_variants()


def prefill_operand_variants(verbose: bool = False) -> dict:
    """The fp8-cache prefill's operand kernels; returns them compiled (for PTX checks)."""
    _, scales, layout = _paged_layout(1)
    offsets = {"seq_lens_ptr": I32, "qsl_ptr": I32, "cu_q_ptr": I32, "cu_k_ptr": I32,
               "vt_start_ptr": I32}  # fmt: skip
    compiled = {"offsets": _compile(prefill_offsets_kernel, offsets,
                                    dict(B_P2=16, ALIGN=128), 1)}  # fmt: skip
    ptrs = {"cache_ptr": U8, "scales_ptr": scales, "block_table_ptr": I32, "seq_lens_ptr": I32,
            "cu_k_ptr": I32, "vt_start_ptr": I32, "k_out_ptr": U8, "v_t_ptr": U8,
            "factors_ptr": F32}  # fmt: skip
    for heads, name in ((8, "operands, 8 heads per program"), (1, "operands")):
        consts = dict(HKV=8, D=128, ALIGN=128, CHUNK=16, HEADS=heads, **layout)
        compiled[name] = _compile(prefill_operands_kernel, ptrs, consts, 4)
    ptrs = {"q_ptr": BF16, "codes_ptr": FP8, "exp_ptr": I16}
    consts = dict(HQ=32, D=128, BLOCK=64, INTERPRET=False)
    compiled["quantize_q"] = _compile(quantize_q_tokens_kernel, ptrs, consts, 4)
    for name, kernel in compiled.items():
        extra = f" {resource_usage(kernel)}" if verbose else ""
        print(f"prefill {name}: ok{extra}")
    return compiled


if __name__ == "__main__":
    quant_variants()
    do_quant_variants()
    fwd_variants()
    window_variants(verbose="-v" in sys.argv)
    bwd_variants(verbose="-v" in sys.argv)
    paged_variants()
    sys.exit(0)
