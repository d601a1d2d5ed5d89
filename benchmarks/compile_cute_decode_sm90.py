"""Compile the CuTe DSL quantized-cache decodes for sm_90a on a CPU machine (fake tensors).

Same venv and environment as ``compile_cute_sm90.py`` (its docstring has the recipe):

    FLASH_ATTENTION_ARCH=sm_90 CUTE_DSL_ARCH=sm_90a PYTHONPATH=$PWD \\
        /tmp/cute312/bin/python benchmarks/compile_cute_decode_sm90.py [--keep DIR]

Prints one line per compiled configuration; ``--keep DIR`` keeps each cubin there;
``--ctas N`` compiles with ``min_blocks_per_mp=N`` (the register cap; its shared-memory
query of the device is answered with the H200's 228 KiB, since there is no driver here);
``--warps N`` compiles CTAs of N warps.

The decodes need ``nvidia-cutlass-dsl`` only, so they also compile in vLLM 0.26's pins
(checked 2026-12-01: same registers and SASS length as with 4.8.1):

    python3.12 -m venv /tmp/cute46
    /tmp/cute46/bin/pip install "nvidia-cutlass-dsl[cu13]==4.6.0" "apache-tvm-ffi==0.1.10" \
        "cuda-bindings>=13,<14" "numpy<2.3" torch==2.13.0
    FLASH_ATTENTION_ARCH=sm_90 CUTE_DSL_ARCH=sm_90a PYTHONPATH=$PWD \
        /tmp/cute46/bin/python benchmarks/compile_cute_decode_sm90.py
"""

from __future__ import annotations

import torch
from cutlass import Float32, Int32
from torch._subclasses.fake_tensor import FakeTensorMode

from benchmarks.compile_cute_sm90 import compile_and_keep, compile_parser
from flamia_serve.kernels.paged.cute_decode_sm90 import Fp8DecodeSm90, NvFP4DecodeSm90
from flamia_serve.numerics.kv_pages import KVPageFormat


def main() -> None:
    parser = compile_parser(__doc__)
    parser.add_argument("--ctas", type=int, default=0, help="min_blocks_per_mp (0: none)")
    parser.add_argument("--stages", default="0",
                        help="NVFP4 shared-memory ring stages to compile, e.g. 0,4,6 (0: none)")
    parser.add_argument("--warps", type=int, default=4, help="warps per CTA (2, 4 or 8)")
    args = parser.parse_args()
    keep, ctas, warps = args.keep, args.ctas, args.warps
    stage_counts = [int(x) for x in args.stages.split(",")]
    if ctas > 1:  # the launch asks the device for its shared memory: the H200's
        import cutlass.cutlass_dsl.cutlass as cutlass_dsl

        cutlass_dsl.cuda_helpers.get_device_attribute = lambda attribute: 228 * 1024
    with FakeTensorMode():
        torch.set_default_device("cuda")
        register_ring = [
            ("nvfp4", 128, 4, True, 1), ("nvfp4", 128, 4, False, 1), ("nvfp4", 128, 4, True, 2),
            ("nvfp4", 64, 8, True, 1), ("nvfp4", 128, 16, True, 1), ("fp8", 128, 4, True, 1),
            ("fp8", 128, 4, False, 1), ("fp8", 64, 8, True, 1), ("fp8", 128, 16, True, 1),
            ("fp8_static", 128, 4, True, 1), ("fp8", 128, 4, True, 2),
        ]  # fmt: skip
        shared_ring = [
            ("nvfp4", d, group, partial, 1, stages) for stages in stage_counts if stages
            for d, group, partial in ((128, 4, True), (128, 4, False), (64, 8, True),
                                      (128, 16, True), (256, 4, False))
        ]  # fmt: skip
        for dtype, d, group, partial, depth, stages in [(*c, 0) for c in register_ring] + \
                shared_ring:  # fmt: skip
            heads_kv, page, batch, pages = 8, 16, 4, 64
            fmt = KVPageFormat(dtype, d)
            tensors = [
                (torch.empty(batch, heads_kv * group, d, dtype=torch.bfloat16), 2),  # q
                (torch.empty(fmt.cache_shape(256, page, heads_kv), dtype=torch.uint8), 16),
                (torch.empty(batch, pages, dtype=torch.int32), 4),  # block table
                (torch.empty(batch, dtype=torch.int32), 4),  # seq lens
                (torch.empty(batch + 1, dtype=torch.int32), 4),  # query start loc
                (torch.empty(batch, heads_kv * group, d, dtype=torch.bfloat16), 2),  # out
                (torch.empty(1024), 4),  # partial O
                (torch.empty(1024), 4),  # partial (M, l)
            ]
            args = (d, heads_kv, group, page, partial, depth, ctas)
            if dtype == "nvfp4":
                kernel = NvFP4DecodeSm90(*args, stages=stages, warps=warps)
            else:
                kernel = Fp8DecodeSm90(*args, static=dtype == "fp8_static", warps=warps)
            ring = f"_stages{stages}" if stages else ""
            ring += f"_warps{warps}" if warps != 4 else ""
            name = (f"decode_{dtype}_d{d}_g{group}_p{int(partial)}_depth{depth}_ctas{ctas}"
                    f"{ring}.cubin")
            compile_and_keep(kernel, tensors, Float32(0.1), Float32(1.0), Int32(1), Int32(1),
                             Int32(1), keep=keep, name=name)  # fmt: skip
            print(f"cute {dtype} decode d={d} group={group} partial={partial} depth={depth} "
                  f"ctas={ctas} stages={stages}: compiled")


if __name__ == "__main__":
    main()
