"""The CuTe backward of this tree against another copy of its kernel module, in one process.

    python benchmarks/bwd_variant_ab.py --variant OLD/cute_sm90.py \\
        --workloads W3,W5,W6,P3,E16 --name bwd_step_ab

``--variant``: a copy of ``flamia_serve/kernels/attn_bwd/cute_sm90.py`` (e.g. ``git show
REV:flamia_serve/kernels/attn_bwd/cute_sm90.py``) that works with this tree's launcher; it is
imported under another name and put in the kernel module's place while it runs.
(``bwd_variants.py`` times several copies, each in its own process, on single documents
against the Triton kernel's accuracy; this script compares one copy with this tree bit for
bit and times both on the workloads' packs, interleaved.)

1. Same results: on small packs of the GPU tests' kinds (1-token and empty documents, odd
   lengths, GQA and MHA, d 64 / 128 / 256, causal or not, ``exact_causal``) and on each
   workload, both kernels on one quantization: dK and dV must be the same bits when both
   compute the same P̂ and dŜ codes and factors (a CTA adds its own dK/dV in a fixed order);
   dQ (bulk adds in no fixed order) by relative difference. ``--no-check`` skips it.
2. Times: the kernel alone (``attn_bwd`` on ``check_bwd_kernels.operands``' prequantized
   operands),
   this tree and the variant interleaved over ``--rounds`` rounds, each round's median; the
   rows keep every round. JSON ``<name>.json`` (GPU, versions, date) under the results dir.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import statistics
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from benchmarks.check_bwd_kernels import backward, operands
from benchmarks.common import positive_int, rel64, time_ms, write_results
from benchmarks.workloads import training_workload
from flamia_serve.kernels.attn_bwd.ops import CUTE_BWD_CONFIG

KERNEL_MODULE = "flamia_serve.kernels.attn_bwd.cute_sm90"
#: (seqlens, hq, hkv, d, causal, exact_causal): the GPU tests' kinds of pack, with the
#: workloads' heads where they can share their compiled kernels (32/8 GQA, 16/16 MHA)
CHECK_PACKS = [
    ((1, 300, 1000, 129, 0, 31), 32, 8, 128, True, False),
    ((257, 64, 700), 16, 16, 128, True, False),
    ((2048, 1, 130), 32, 8, 128, True, True),
    ((100, 230, 1), 32, 8, 128, False, False),
    ((1, 300, 1000, 129, 0, 31), 32, 8, 64, True, False),
    ((257, 64, 700, 1), 32, 8, 256, True, False),
]


def load_variant(path: Path, module: str = KERNEL_MODULE) -> ModuleType:
    """The module at ``path``, imported as ``<module>_variant``."""
    spec = importlib.util.spec_from_file_location(f"{module}_variant", path)
    if spec is None or spec.loader is None:
        raise ValueError(f"--variant {path}: not a Python module")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@contextlib.contextmanager
def kernel_module(module: ModuleType | None, name: str = KERNEL_MODULE) -> Iterator[None]:
    """``attn_bwd`` (and the forward's callers, ``fwd_variant_ab.py``) import the launcher
    from ``sys.modules[name]`` at each call: ``module`` takes that place inside the block
    (None: this tree's)."""
    if module is None:
        yield
        return
    own = sys.modules.get(name)
    sys.modules[name] = module
    try:
        yield
    finally:
        if own is None:
            del sys.modules[name]
        else:
            sys.modules[name] = own


def interleaved(run, variant: ModuleType, rounds: int, timer=time_ms,
                module: str = KERNEL_MODULE) -> dict:  # fmt: skip
    """``rounds`` interleaved rounds of this tree's ``run`` and the variant's, timed by
    ``timer`` (its ``"ms"``): both medians, every round, and the variant's time over ours."""
    ours, theirs = [], []
    for _ in range(rounds):
        ours.append(timer(run)["ms"])
        with kernel_module(variant, module):
            theirs.append(timer(run)["ms"])
    row = {"ms": statistics.median(ours), "variant_ms": statistics.median(theirs),
           "ms_rounds": ours, "variant_ms_rounds": theirs}  # fmt: skip
    return row | {"speedup": row["variant_ms"] / row["ms"]}


def check_packs(compared, ok) -> tuple[list[dict], int]:
    """Rows of ``compared(seqlens, hq, hkv, d, causal, exact)`` on every ``CHECK_PACKS``
    pack (printed), and how many of them are not ``ok``."""
    rows = []
    for seqlens, hq, hkv, d, causal, exact in CHECK_PACKS:
        row = {"check": "pack", "seqlens": list(seqlens), "hq": hq, "hkv": hkv, "d": d,
               "causal": causal, "exact_causal": exact}  # fmt: skip
        row |= compared(seqlens, hq, hkv, d, causal, exact)
        print(row, flush=True)
        rows.append(row)
    return rows, sum(not ok(row) for row in rows)


def same_dkv(row: dict) -> bool:
    return row["dk_equal"] and row["dv_equal"] and row["finite"]


def cute_call(seqlens, hq: int, hkv: int, d: int, causal: bool, exact: bool):
    """The CuTe backward of one pack's prequantized operands, as a call."""
    ops = operands(seqlens, hq, hkv, d, causal, exact)
    return lambda: backward(ops, CUTE_BWD_CONFIG)


def compare(run, variant: ModuleType) -> dict:
    """Both kernels' gradients on one quantization: dK / dV bit-equal, dQ's difference."""
    ours = [g.clone() for g in run()]
    with kernel_module(variant):
        theirs = [g.clone() for g in run()]
    return {
        "dk_equal": bool(torch.equal(ours[1], theirs[1])),
        "dv_equal": bool(torch.equal(ours[2], theirs[2])),
        "dq_rel": rel64(ours[0], theirs[0]),
        "finite": all(bool(torch.isfinite(g).all()) for g in ours),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--variant", type=Path, required=True, help="a copy of cute_sm90.py")
    ap.add_argument("--workloads", default="W3,W5,W6,P3,E16")
    ap.add_argument("--rounds", type=positive_int, default=2)
    ap.add_argument("--no-check", action="store_true")
    ap.add_argument("--name", default="bwd_variant_ab")
    args = ap.parse_args(argv)
    variant = load_variant(args.variant)
    rows: list[dict] = []
    failed = 0
    if not args.no_check:
        rows, failed = check_packs(lambda *pack: compare(cute_call(*pack), variant), same_dkv)
    for name in args.workloads.split(","):
        w = training_workload(name)
        run = cute_call(list(w.seqlens), w.hq, w.hkv, w.head_dim, True, False)
        row = {"workload": name, "pass": "bwd", "total_tokens": w.total_tokens,
               "hq": w.hq, "hkv": w.hkv, "d": w.head_dim}  # fmt: skip
        if not args.no_check:
            row |= compare(run, variant)
            failed += not same_dkv(row)
        row |= interleaved(run, variant, args.rounds)
        print({k: row[k] for k in ("workload", "ms", "variant_ms", "speedup")}, flush=True)
        rows.append(row)
    return finish(args.name, rows, args.variant, "cute backward", failed)


def finish(name: str, rows: list[dict], variant: Path, kernel: str, failed: int) -> int:
    """Write the rows (``<name>.json``, the variant's path and the kernel beside them); the
    exit status: 1 when ``failed`` comparisons differ."""
    write_results(name, rows, {"variant": str(variant), "kernel": kernel})
    if failed:
        print(f"{failed} comparisons differ", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
