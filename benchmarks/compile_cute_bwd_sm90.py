"""Compile the CuTe DSL training backward for sm_90a on a CPU machine (no GPU, fake tensors).

Same setup as ``compile_cute_sm90.py`` (a Python 3.12 venv with the CuTe DSL / FA4 wheels):

    FLASH_ATTENTION_ARCH=sm_90 CUTE_DSL_ARCH=sm_90a PYTHONPATH=$PWD \\
        /tmp/cute312/bin/python benchmarks/compile_cute_bwd_sm90.py [--keep DIR]

Prints one line per compiled configuration (with ``$PTXAS``: whether its ``wgmma`` are
pipelined, registers, spills); ``--keep DIR`` keeps each cubin there (for ``cuobjdump``);
``--variant PATH`` compiles the ``FlamiaBwdSm90`` of a copy of ``cute_sm90.py`` instead (a
patched experiment, e.g. ``experiments/cute-bwd-stagger.patch`` applied to a copy) before
its device time is spent. ``--d 256 --stages 3 --step 64`` compiles only that head dim's
default recipe with another number of stages / queries per step (``STEP_FOR_D``), as
``profile_bwd.py --kernel cute`` times them. Each config compiles the kernels the launcher
runs for it (``bwd_modes``: the d = 256 E4M3 config two passes, ``dkdq`` and ``dv``);
``--mode parts|dkdq|dv`` (with ``--d``) compiles only that ``FlamiaBwdSm90`` mode.
"""

from __future__ import annotations

import importlib.util

import torch
from cutlass import Float32, Int32
from torch._subclasses.fake_tensor import FakeTensorMode

from benchmarks.compile_cute_sm90 import compile_and_keep, compile_parser
from flamia_serve.kernels.attn_bwd import cute_sm90
from flamia_serve.kernels.attn_bwd.ops import CUTE_BF16_KV_HEAD_DIMS


def _fake_args(
    total: int, heads_q: int, heads_kv: int, d: int, wide: bool = False, grad_input: bool = False
) -> list:
    """(fake CUDA tensor, byte alignment) pairs with the launcher's shapes, dtypes, strides
    and alignments (``wide``: NVFP4 Q/K widened to BF16 for Sᵀ; ``grad_input``: Q/K rows of
    ``grad_qk="input"``, a BF16 dQ product)."""
    t_pad = total + 128 + 64
    step = cute_sm90.step_queries(d, wide, grad_input)
    u8, i16, i32 = torch.uint8, torch.int16, torch.int32
    qk = torch.bfloat16 if wide else u8
    if grad_input:  # dQ's A: K·2^-eK, BF16 rows by column
        k_a = (torch.empty(t_pad, heads_kv, d, dtype=torch.bfloat16), 16)
    else:  # k_t: E4M3 codes in the column layout
        k_a = (torch.empty(heads_kv, d, t_pad, dtype=u8).permute(1, 2, 0), 16)
    if d in CUTE_BF16_KV_HEAD_DIMS or grad_input:  # dK's / dV's B: BF16 rows by column
        q_b = g_b = (torch.empty(t_pad, heads_q, d, dtype=torch.bfloat16), 16)
    else:  # q_t / g_t: E4M3 codes in the column layout
        q_b = g_b = (torch.empty(heads_q, d, t_pad, dtype=u8).permute(1, 2, 0), 16)
    tensors = [
        (torch.empty(total, heads_q, d, dtype=qk), 16),  # Q codes (or widened values)
        (torch.empty(total, heads_kv, d, dtype=qk), 16),  # K codes
        (torch.empty(total, heads_kv, d, dtype=u8), 16),  # V codes
        (torch.empty(total, heads_q, d, dtype=u8), 16),  # dO codes
        q_b,
        k_a,
        g_b,
        (torch.empty(heads_q, total, dtype=i16), 4),  # Q exponents
        (torch.empty(heads_q, total, dtype=torch.int8 if wide else i16), 4),  # scores' Q exp
        (torch.empty(heads_kv, t_pad, dtype=i16), 4),  # K exponents (column layout)
        (torch.empty(heads_kv, 3, t_pad), 16),  # K/V factors
        (torch.empty(heads_q, total, dtype=i16), 4),  # dO exponents
        (torch.empty(heads_q, t_pad, dtype=i16), 4),  # G exponents
        (torch.empty(heads_q, total), 4),  # delta
        (torch.empty(total, heads_q), 4),  # M
        (torch.empty(total, heads_q), 4),  # lse
        (torch.empty(3, dtype=i32), 4),  # cu_seqlens
        (torch.empty(2, dtype=i32), 4),  # document column starts
        (torch.empty(64, dtype=i32), 4),  # work list: documents
        (torch.empty(64, dtype=i32), 4),  # work list: tiles
        (torch.empty(1, dtype=i32), 4),  # work count
        (torch.empty(heads_q, t_pad // step, step * d), 16),  # dQ accumulator, step blocks
        (torch.empty(total, heads_kv, d, dtype=torch.bfloat16), 16),  # dK
        (torch.empty(total, heads_kv, d, dtype=torch.bfloat16), 16),  # dV
        (torch.empty(1, 1, 1), 4),  # debug P
    ]
    return tensors


def main() -> None:
    parser = compile_parser(__doc__)
    parser.add_argument("--variant", default=None, help="a copy of cute_sm90.py to compile")
    parser.add_argument("--d", type=int, default=0, help="only this head dim, causal (0: all)")
    parser.add_argument("--stages", type=int, default=2, help="query steps in flight")
    parser.add_argument("--step", type=int, default=0, help="queries per step (0: STEP_FOR_D)")
    parser.add_argument("--mode", default="", help="only this FlamiaBwdSm90 mode (with --d): "
                        "parts, dkdq or dv")
    parser.add_argument("--grad-input", action="store_true",
                        help="with --d: the grad_qk='input' form (BF16 dQ product)")
    args = parser.parse_args()
    keep, module = args.keep, cute_sm90
    if args.variant:
        spec = importlib.util.spec_from_file_location("cute_sm90_variant", args.variant)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    if args.step:
        module.STEP_FOR_D[args.d] = args.step
    # (d, causal, wide, block exponents, grad_input)
    cases = (
        (128, True, False, True, False), (64, True, False, True, False),
        (128, False, False, True, False), (128, True, False, False, False),
        (128, True, True, True, False), (64, False, True, True, False),
        (256, True, False, True, False), (256, False, False, False, False),
        (256, True, True, True, False), (64, True, False, True, True),
        (128, True, False, True, True), (128, False, False, False, True),
        (256, True, False, True, True),
    )  # fmt: skip
    if args.d:
        cases = ((args.d, True, False, True, args.grad_input),)
    with FakeTensorMode():
        torch.set_default_device("cuda")
        # the default config (block exponents) at d = 128 / 64, causal or not, and with
        # per-token exponents (exact_causal); then the mixed recipes' (BF16 Sᵀ)
        for d, causal, wide, block, grad_input in cases:
            bf16_kv = d in CUTE_BF16_KV_HEAD_DIMS or grad_input
            # the kernels the launcher runs for this config (d = 256: two passes), or --mode
            modes = (
                (args.mode,) if args.mode else module.bwd_modes(d, wide, bf16_kv, grad_input)
            )
            for mode in modes:
                kernel = module.FlamiaBwdSm90(
                    d, 8, 2, causal, 32, args.stages, False, wide, bf16_kv=bf16_kv,
                    block_exponents=block, mode=mode, bf16_dq=grad_input,
                )  # fmt: skip
                tag = ("_wide" if wide else "") + ("" if block else "_exact") + f"_{mode}"
                tag += "_grad_input" if grad_input else ""
                name = f"bwd_d{d}_causal{int(causal)}{tag}_s{args.stages}.cubin"
                compiled = compile_and_keep(
                    kernel, _fake_args(1024, 8, 2, d, wide, grad_input), Float32(0.1),
                    Float32(0.1), Int32(1), keep=keep, name=name,
                )  # fmt: skip
                print(f"cute backward d={d} causal={causal} wide={wide} block={block} "
                      f"grad_input={grad_input} stages={args.stages} step={kernel.step_q} "
                      f"mode={mode}: compiled, {kernel.smem_bytes} B of shared memory")
                del compiled


if __name__ == "__main__":
    main()
