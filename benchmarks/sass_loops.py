"""The step loops of a compiled kernel's SASS, with their instruction mix (CPU, no GPU).

    python benchmarks/sass_loops.py CUBIN [--top 4] [--path 912:944,944:2030,3649:3665]
        [--against CUBIN2 --against-path 1548:1989]

Disassembles ``CUBIN`` with the ``cuobjdump`` that Triton ships (or ``$CUOBJDUMP``), finds
its loops (backward branches) and prints the ``--top`` smallest ones that hold ``wgmma``
(``HGMMA``/``QGMMA``): index range, size, and opcode counts — the per-step body of an
attention kernel. Branches inside the loop are listed, so a path through one of its
variants (e.g. unmasked steps) can be summed with ``--path`` (instruction index ranges,
end exclusive) and set beside another kernel's (``--against``, ``--against-path``). Static
counts: how often each path runs is the GPU's to say. First use (2026-12-06,
``benchmarks/NOTES.md``): our d = 128 backward step against FA4's sm_90 one, compiled by
``compile_cute_bwd_sm90.py --keep`` and ``compile_fa4_bwd_sm90.py --keep``.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
from collections import Counter
from pathlib import Path

_LINE = re.compile(r"\s+/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;")
_TARGET = re.compile(r"BRA(?:\.\w+)*\s+(?:`\(\S+\)\s*)?0x([0-9a-f]+)")


def cuobjdump() -> str:
    """``$CUOBJDUMP``, else the one in Triton's NVIDIA backend."""
    if os.environ.get("CUOBJDUMP"):
        return os.environ["CUOBJDUMP"]
    import triton

    return str(Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump")


def instructions(cubin: Path) -> list[tuple[int, str]]:
    """``(address, text)`` of every SASS instruction of ``cubin``'s kernels, in order."""
    sass = subprocess.run([cuobjdump(), "-sass", str(cubin)], capture_output=True, text=True,
                          check=True).stdout  # fmt: skip
    return [(int(m.group(1), 16), m.group(2)) for m in map(_LINE.match, sass.splitlines()) if m]


def opcode(text: str) -> str:
    """The opcode without predicate and modifiers (``@!P0 FMUL.FTZ R1, ...`` -> ``FMUL``)."""
    words = [w for w in text.split() if not w.startswith("@")]
    return words[0].split(".")[0] if words else "?"


def branches(ins: list[tuple[int, str]], lo: int = 0, hi: int | None = None) -> list[tuple]:
    """``(index, target index or None, text)`` of the branches in ``ins[lo:hi]``."""
    at = {addr: i for i, (addr, _) in enumerate(ins)}
    out = []
    for i in range(lo, len(ins) if hi is None else hi):
        text = ins[i][1]
        if "BRA" in text:
            m = _TARGET.search(text)
            out.append((i, at.get(int(m.group(1), 16)) if m else None, text))
    return out


def loops(ins: list[tuple[int, str]]) -> list[tuple[int, int]]:
    """``(first, last)`` instruction index of each backward branch's loop."""
    return [(tgt, i) for i, tgt, _ in branches(ins) if tgt is not None and tgt <= i]


def mix(texts: list[str], top: int = 24) -> str:
    counts = Counter(opcode(t) for t in texts)
    return ", ".join(f"{op} {n}" for op, n in counts.most_common(top))


def path_texts(ins: list[tuple[int, str]], spec: str) -> list[str]:
    """The instructions of ``spec`` (``a:b,c:d``: index ranges, end exclusive)."""
    texts = []
    for part in spec.split(","):
        a, b = (int(x) for x in part.split(":"))
        texts += [t for _, t in ins[a:b]]
    return texts


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("cubin", type=Path)
    ap.add_argument("--top", type=int, default=3, help="smallest wgmma loops to show")
    ap.add_argument("--path", default="", help="index ranges a:b,c:d to sum (one step)")
    ap.add_argument("--against", type=Path, default=None, help="another cubin")
    ap.add_argument("--against-path", default="", help="its ranges")
    args = ap.parse_args(argv)
    ins = instructions(args.cubin)
    found = sorted(loops(ins), key=lambda lo_hi: lo_hi[1] - lo_hi[0])
    shown = 0
    for lo, hi in found:
        body = [t for _, t in ins[lo : hi + 1]]
        if shown == args.top or not any("GMMA" in t for t in body):
            continue
        shown += 1
        print(f"loop [{lo}..{hi}] {len(body)} instructions: {mix(body)}")
        for i, tgt, text in branches(ins, lo, hi + 1):
            print(f"    {i}: {text[:60]} -> {tgt}")
    if not args.path:
        return 0
    ours = path_texts(ins, args.path)
    print(f"path {args.path}: {len(ours)} instructions")
    if args.against is None:
        print("  " + mix(ours, 40))
        return 0
    other = path_texts(instructions(args.against), args.against_path)
    print(f"against {args.against.name} {args.against_path}: {len(other)} instructions")
    a, b = Counter(map(opcode, ours)), Counter(map(opcode, other))
    for op in sorted(set(a) | set(b), key=lambda o: -(a[o] + b[o]))[:40]:
        print(f"  {op:10s} {a[op]:6d} {b[op]:6d}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
