"""Compile the CuTe DSL training forward for sm_90a on a CPU machine (no GPU, fake tensors).

Catches DSL errors before device time is spent. The CuTe DSL wheels are cp312, so this runs
in a throwaway Python 3.12 venv (the project venv is 3.11), which
``bash benchmarks/cute_venv.sh`` builds; by hand:

    python3.12 -m venv /tmp/cute312      # e.g. ~/.pyenv/versions/3.12.1/bin/python
    /tmp/cute312/bin/pip install --no-deps ~/.cache/flamia-stage/fa4/*.whl  # stage.sh fa4
    /tmp/cute312/bin/pip install "cuda-bindings>=13,<14" protobuf einops "numpy<2.3" \\
        torch==2.13.0
    FLASH_ATTENTION_ARCH=sm_90 CUTE_DSL_ARCH=sm_90a PYTHONPATH=$PWD \\
        /tmp/cute312/bin/python benchmarks/compile_cute_sm90.py

Prints one line per compiled configuration, and under it ``ptxas -v``'s verdict on the
kernel's PTX (``ptxas_report``: wgmma pipelined or serialized, registers, spills; needs a
``ptxas``, e.g. CUDA 13's, on PATH or in ``$PTXAS``); ``--keep DIR`` keeps each cubin there (for
``cuobjdump -res-usage`` and ``-sass``).
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch
from cutlass import Float32, Int32
from torch._subclasses.fake_tensor import FakeTensorMode

from flamia_serve.kernels.cute_sm90_common import TVM_FFI, compile_kernel


def _fake_args(total: int, heads_q: int, heads_kv: int, d: int, wide: bool = False) -> list:
    """(fake CUDA tensor, byte alignment) pairs with the launcher's shapes, dtypes, strides
    and alignments (``wide``: NVFP4 Q/K widened to BF16, int8 second-level exponents)."""
    t_pad = total + 16 + 64
    u8, i32 = torch.uint8, torch.int32
    qk = torch.bfloat16 if wide else u8
    tensors = [
        (torch.empty(total, heads_q, d, dtype=qk), 16),  # Q codes (or widened values)
        (torch.empty(total, heads_kv, d, dtype=qk), 16),  # K codes
        (torch.empty(heads_kv, d, t_pad, dtype=u8).permute(1, 2, 0), 16),  # v_t
        (torch.empty(heads_q, total, dtype=torch.int8 if wide else torch.int16), 4),  # Q exp
        (torch.empty(heads_kv, 3, t_pad), 16),  # K/V factors
        (torch.empty(3, dtype=i32), 4),  # cu_seqlens (queries)
        (torch.empty(3, dtype=i32), 4),  # cu_seqlens_k (keys, extend only)
        (torch.empty(2, dtype=i32), 4),  # document column starts
        (torch.empty(64, dtype=i32), 4),  # work list: documents
        (torch.empty(64, dtype=i32), 4),  # work list: tiles
        (torch.empty(1, dtype=i32), 4),  # work count
        (torch.empty(1, dtype=i32), 4),  # ticket
        (torch.empty(total, heads_q, d, dtype=torch.bfloat16), 16),  # O
        (torch.empty(total, heads_q), 4),  # M
        (torch.empty(total, heads_q), 4),  # lse
    ]
    return tensors


def compile_and_keep(kernel, fake_args: list, *scalars, keep: Path | None, name: str):
    """Compile ``kernel`` for sm_90a; with ``keep``, its cubin is moved to ``keep/name``.
    Prints ``ptxas_report`` of its PTX when a ``ptxas`` is found."""
    options = TVM_FFI + " --keep-ptx" + (" --keep-cubin" if keep else "")
    compiled = compile_kernel(kernel, fake_args, *scalars, options=options)
    for ptx in Path(".").glob("*.ptx"):
        print(f"  {name}: {ptxas_report(ptx)}")
        ptx.unlink()
    if keep:
        keep.mkdir(parents=True, exist_ok=True)
        for cubin in Path(".").glob("*.cubin"):
            shutil.move(str(cubin), keep / name)
    return compiled


#: PTX ISA the local ptxas accepts (CUDA 13.0); the CuTe DSL writes a newer header
PTXAS_ISA = "9.0"


def ptxas_report(ptx: Path) -> str:
    """One line from ``ptxas -v`` on ``ptx`` for sm_90a: whether its ``wgmma`` run as a
    pipeline or ptxas serializes them (C7512: a wait after every ``wgmma`` of the kernel, seen
    on the d = 128 backward on 2026-12-03), registers and spills. ``$PTXAS`` or the ``ptxas``
    on PATH; the PTX header's ISA version is lowered to ``PTXAS_ISA`` for it (the report only:
    the kernel itself is the DSL's own compile)."""
    ptxas = os.environ.get("PTXAS") or shutil.which("ptxas")
    if ptxas is None:
        return "no ptxas found (set PTXAS): wgmma pipelining not checked"
    text = re.sub(r"^\.version \d+\.\d+", f".version {PTXAS_ISA}", ptx.read_text(), count=1,
                  flags=re.M)  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "kernel.ptx"
        src.write_text(text)
        out = subprocess.run(
            [ptxas, "-arch=sm_90a", "-v", str(src), "-o", str(Path(tmp) / "kernel.cubin")],
            capture_output=True, text=True, check=False,
        ).stderr  # fmt: skip
    serialized = re.search(r"C7512\).*serialized due to (.*?) for the function", out)
    wgmma = f"wgmma SERIALIZED ({serialized.group(1)})" if serialized else "wgmma pipelined"
    usage = re.search(r"Used (\d+) registers", out)
    spill = re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores", out)
    if usage is None or spill is None:
        return f"ptxas failed: {out.strip().splitlines()[-1] if out.strip() else '?'}"
    return (f"{wgmma}; {usage.group(1)} registers, {spill.group(1)} B stack, "
            f"{spill.group(2)} B spill stores")  # fmt: skip


def compile_parser(doc: str) -> argparse.ArgumentParser:
    """The compile scripts' command line (``doc``: the script's docstring): ``--keep DIR``;
    a script adds its own options before parsing."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--keep", type=Path, default=None, help="keep each cubin in DIR")
    return parser


def main() -> None:
    from flamia_serve.kernels.attn_fwd.cute_sm90 import FlamiaFwdSm90  # needs flash-attn-4

    keep = compile_parser(__doc__).parse_args().keep
    with FakeTensorMode():
        torch.set_default_device("cuda")
        # then the FP8-cache prefill's (per-key K exponents, queries after cached keys), with
        # exact exponentials and with Mitchell-P; last the mixed recipes' (BF16 scores)
        # (promote: each tile's P̂·V̂ added to O in FP32; False: accumulated in the wgmma)
        for d, causal, tile_n, overlap, k_exp_block, extend, exp_mode, wide, promote in (
            (128, True, 128, False, 32, False, "exact", False, True),
            (128, True, 128, True, 32, False, "exact", False, True),
            (128, True, 128, False, 32, False, "exact", False, False),
            (128, True, 128, True, 32, False, "exact", False, False),
            (64, True, 128, False, 32, False, "exact", False, True),
            (64, True, 128, True, 32, False, "exact", False, False),
            (128, False, 128, False, 32, False, "exact", False, True),
            (256, True, 64, False, 32, False, "exact", False, True),
            (256, True, 128, False, 32, False, "exact", False, True),
            (256, True, 128, False, 32, False, "exact", False, False),
            (256, True, 128, True, 32, False, "exact", False, False),
            (128, True, 128, False, 1, True, "exact", False, True),
            (128, True, 128, True, 1, True, "exact", False, False),
            (128, True, 128, False, 1, True, "mitchell", False, True),
            (128, True, 128, False, 1, True, "mitchell", False, False),
            (64, True, 128, False, 32, False, "mitchell", False, False),
            (64, True, 128, False, 1, True, "exact", False, False),
            (64, True, 128, False, 1, True, "mitchell", False, False),
            (128, True, 128, False, 32, False, "mitchell", False, False),
            (128, True, 128, False, 1, False, "exact", True, True),
            (128, True, 128, True, 1, False, "exact", True, False),
            (64, False, 128, False, 1, False, "exact", True, True),
            (256, True, 64, False, 1, False, "exact", True, True),
        ):  # fmt: skip
            kernel = FlamiaFwdSm90(
                d, 8, 2, causal, k_exp_block, 128, tile_n, 2, overlap, True, extend, exp_mode,
                wide, promote,
            )  # fmt: skip
            name = f"fwd_d{d}_causal{int(causal)}_n{tile_n}_overlap{int(overlap)}"
            name += "" if promote else "_into_o"
            name += f"_extend_{exp_mode}" if extend else ""
            name += "_mitchell" if exp_mode == "mitchell" and not extend else ""
            name += "_wide.cubin" if wide else ".cubin"
            compile_and_keep(
                kernel, _fake_args(1024, 8, 2, d, wide), Float32(0.1), Int32(1), keep=keep,
                name=name,
            )  # fmt: skip
            print(f"cute forward d={d} causal={causal} 128x{tile_n} overlap={overlap} "
                  f"promote_pv={promote} extend={extend} {exp_mode} wide={wide}")  # fmt: skip
        # Q quantized in the kernel from its BF16/FP16 input (one exponent per 32 rows of a
        # document, or per row), on the default configs and the warpgroup counts; the last
        # two: the FP8-cache prefill's (extend, per-token Q)
        for d, tile_m, tile_n, overlap, promote, q_block, dtype, extend, exp_mode in (
            (128, 128, 128, False, False, 32, torch.bfloat16, False, "exact"),
            (128, 128, 128, False, False, 1, torch.float16, False, "exact"),
            (64, 128, 128, False, False, 32, torch.bfloat16, False, "exact"),
            (128, 128, 64, True, True, 32, torch.bfloat16, False, "exact"),
            (128, 64, 64, False, True, 1, torch.bfloat16, False, "exact"),
            (64, 192, 64, False, True, 32, torch.float16, False, "exact"),
            (128, 128, 128, False, False, 1, torch.bfloat16, True, "exact"),
            (128, 128, 128, False, False, 1, torch.float16, True, "mitchell"),
        ):  # fmt: skip
            kernel = FlamiaFwdSm90(
                d, 8, 2, True, q_block, tile_m, tile_n, 2, overlap, True, extend, exp_mode,
                promote_pv=promote, q_block=q_block,
            )  # fmt: skip
            args = _fake_args(1024, 8, 2, d)
            args[0] = (torch.empty(1024, 8, d, dtype=dtype), 16)  # Q as given
            name = f"fwd_d{d}_{tile_m}x{tile_n}_overlap{int(overlap)}_promote{int(promote)}"
            name += f"_extend_{exp_mode}" if extend else ""
            name += f"_qblock{q_block}_{str(dtype)[6:]}.cubin"
            compile_and_keep(kernel, args, Float32(0.1), Int32(1), keep=keep, name=name)
            print(f"cute forward d={d} {tile_m}x{tile_n} overlap={overlap} promote_pv={promote} "
                  f"extend={extend} {exp_mode} Q quantized in the kernel: q_block={q_block} "
                  f"{dtype}")  # fmt: skip
        # three consumer warpgroups (192 rows) at d = 64, training and prefill (extend): more
        # warps per scheduler for a forward that ncu finds latency-bound there
        for tile_n, extend, k_exp_block in ((128, False, 32), (128, True, 1), (64, True, 1)):
            kernel = FlamiaFwdSm90(64, 8, 2, True, k_exp_block, 192, tile_n, 2, False, True,
                                   extend, "exact", False, False)  # fmt: skip
            name = f"fwd_d64_192x{tile_n}_into_o" + ("_extend.cubin" if extend else ".cubin")
            compile_and_keep(kernel, _fake_args(1024, 8, 2, 64), Float32(0.1), Int32(1),
                             keep=keep, name=name)  # fmt: skip
            print(f"cute forward d=64 192x{tile_n} promote_pv=False extend={extend}")


if __name__ == "__main__":
    main()
