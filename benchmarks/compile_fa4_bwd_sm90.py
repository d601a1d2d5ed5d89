"""Compile FA4's sm_90 backward (``flash_attn.cute``) on a CPU machine and keep its cubins.

    FLASH_ATTENTION_ARCH=sm_90 CUTE_DSL_ARCH=sm_90a PYTHONPATH=$PWD \\
        /tmp/cute312/bin/python benchmarks/compile_fa4_bwd_sm90.py --keep /tmp/fa4_bwd

Same venv as ``compile_cute_sm90.py`` (the staged FA4 / CUTLASS DSL wheels). FA4's own entry
``_flash_attn_bwd`` runs under ``FakeTensorMode``: it compiles its preprocess, main and
postprocess kernels (a causal varlen pack, Hq/Hkv 8/2, d = 128, its default sm_90 tiles)
and, with fake tensors, launches nothing. ``cute.compile`` is wrapped to keep the PTX and
cubins, which land in ``--keep``; ``benchmarks/sass_loops.py`` then compares its step loop
with ours (``compile_cute_bwd_sm90.py --d 128 --keep DIR``).
"""

from __future__ import annotations

import argparse
import re
import shutil
from pathlib import Path

import torch
from torch._subclasses.fake_tensor import FakeTensorMode


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--keep", type=Path, required=True, help="directory for the cubins")
    ap.add_argument("--d", type=int, default=128)
    args = ap.parse_args()
    import cutlass.cute as cute
    import flash_attn.cute.interface as fa4

    compile_ = cute.compile

    def compile_keeping(*a, **kw):
        kw["options"] = ((kw.get("options") or "") + " --keep-ptx --keep-cubin").strip()
        return compile_(*a, **kw)

    cute.compile = compile_keeping
    tokens, heads_q, heads_kv, d = 1024, 8, 2, args.d
    before = set(Path(".").glob("*.cubin")) | set(Path(".").glob("*.ptx"))
    with FakeTensorMode():
        torch.set_default_device("cuda")
        q, out, d_out = (torch.empty(tokens, heads_q, d, dtype=torch.bfloat16) for _ in range(3))
        k, v = (torch.empty(tokens, heads_kv, d, dtype=torch.bfloat16) for _ in range(2))
        lse = torch.empty(heads_q, tokens)
        cu = torch.empty(3, dtype=torch.int32)
        fa4._flash_attn_bwd(q, k, v, out, d_out, lse, causal=True, cu_seqlens_q=cu,
                            cu_seqlens_k=cu, max_seqlen_q=512, max_seqlen_k=512)  # fmt: skip
    args.keep.mkdir(parents=True, exist_ok=True)
    for path in sorted((set(Path(".").glob("*.cubin")) | set(Path(".").glob("*.ptx"))) - before):
        kind = re.search(r"FlashAttentionBackward(\w*?)_object", path.name)
        name = f"fa4_bwd_{(kind.group(1) if kind else 'kernel').lower()}_d{d}{path.suffix}"
        shutil.move(str(path), args.keep / name)
        print(f"kept {args.keep / name}")


if __name__ == "__main__":
    main()
