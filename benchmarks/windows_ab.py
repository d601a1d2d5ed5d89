"""The forward's window kernel (short documents, ``FwdConfig.windows``) of this tree against
another copy of its Triton module and at other warp counts, in one process.

    python benchmarks/windows_ab.py --variant OLD/triton.py --warps 4,8 --workloads P4,P1

``--variant``: a copy of ``flamia_serve/kernels/attn_fwd/triton.py`` (e.g. ``git show
REV:flamia_serve/kernels/attn_fwd/triton.py``) whose ``attn_fwd_windows_kernel`` takes the
same arguments; its kernel replaces this tree's while a plan prepares its launches.
``--warps``: this tree's kernel at each count (``attn_fwd.ops.WINDOW_NUM_WARPS``).

Each variant runs the default eager forward of each workload (``flamia_attn_varlen`` with a
plan and the default config for its mean document length: windows where that picks them);
O, M and lse compared bit for bit with this tree's kernel at its default warps, then the
calls' CUDA-graph times interleaved over ``--rounds`` rounds (medians); JSON ``<name>.json``.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from benchmarks.bwd_variant_ab import finish, load_variant
from benchmarks.common import graph_time, positive_int
from benchmarks.workloads import training_workload
from flamia_serve import flamia_attn_varlen, plan_varlen
from flamia_serve.kernels._common import TritonLaunch
from flamia_serve.kernels.attn_fwd import ops as fwd_ops
from flamia_serve.kernels.attn_fwd.ops import default_config

MODULE = "flamia_serve.kernels.attn_fwd.triton"


@contextlib.contextmanager
def windows_kernel(kernel=None, warps: int | None = None) -> Iterator[None]:
    """Launches prepared inside the block use ``kernel`` (None: this tree's) at ``warps``."""
    own = fwd_ops._LAUNCH_WINDOWS, fwd_ops.WINDOW_NUM_WARPS
    if kernel is not None:
        fwd_ops._LAUNCH_WINDOWS = TritonLaunch(kernel)
    if warps is not None:
        fwd_ops.WINDOW_NUM_WARPS = warps
    try:
        yield
    finally:
        fwd_ops._LAUNCH_WINDOWS, fwd_ops.WINDOW_NUM_WARPS = own


def forward_run(name: str, setup: Callable[[], contextlib.AbstractContextManager]):
    """The default no-grad forward of workload ``name`` with its own plan, its launches
    prepared under ``setup()`` (and kept by the plan)."""
    w = training_workload(name)
    dev = torch.device("cuda")
    cu, m, t = w.cu_seqlens(dev), w.max_seqlen, w.total_tokens
    gen = torch.Generator(device=dev).manual_seed(7)

    def rand(heads: int) -> torch.Tensor:
        return torch.randn(t, heads, w.head_dim, device=dev, dtype=torch.bfloat16, generator=gen)

    q, k, v = rand(w.hq), rand(w.hkv), rand(w.hkv)
    cfg = default_config(w.head_dim, dev, mean_doc_len=t / w.num_docs)
    plan = plan_varlen(cu, t, m)

    def run() -> tuple[torch.Tensor, ...]:
        with torch.no_grad():
            return flamia_attn_varlen(q, k, v, cu, m, plan=plan, config=cfg, return_stats=True)

    with setup():
        run()
    return run, cfg


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--variant", type=Path, help="a copy of attn_fwd/triton.py")
    ap.add_argument("--warps", default="4,8", help="this tree's kernel at these warp counts")
    ap.add_argument("--workloads", default="P4,P1")
    ap.add_argument("--rounds", type=positive_int, default=5)
    ap.add_argument("--name", default="windows_ab")
    args = ap.parse_args(argv)
    setups: dict[str, Callable[[], contextlib.AbstractContextManager]] = {}
    for warps in (int(x) for x in args.warps.split(",") if x):
        setups[f"tree-{warps}warps"] = lambda warps=warps: windows_kernel(warps=warps)
    if args.variant is not None:
        variant = load_variant(args.variant, MODULE).attn_fwd_windows_kernel
        setups["variant"] = lambda: windows_kernel(variant)
    rows, failed = [], 0
    for name in (x for x in args.workloads.split(",") if x):
        runs = {label: forward_run(name, setup) for label, setup in setups.items()}
        first = next(iter(runs))
        base = [x.clone() for x in runs[first][0]()]
        times: dict[str, list[float]] = {label: [] for label in runs}
        for _ in range(args.rounds):
            for label, (run, _cfg) in runs.items():
                with setups[label]():  # a graph capture prepares its own launches
                    times[label].append(graph_time(run)["ms"])
        for label, (run, cfg) in runs.items():
            same = all(torch.equal(a, b) for a, b in zip(base, run(), strict=True))
            failed += not same
            row = {"workload": name, "pass": "fwd", "impl": label, "windows": cfg.windows,
                   "kernel": cfg.kernel, "same_bits_as": first, "same_bits": same,
                   "ms": statistics.median(times[label]), "ms_rounds": times[label]}  # fmt: skip
            print({k: row[k] for k in ("workload", "impl", "same_bits", "ms")}, flush=True)
            rows.append(row)
        del runs
        torch.cuda.empty_cache()
    return finish(args.name, rows, args.variant or Path("-"), "forward windows", failed)


if __name__ == "__main__":
    sys.exit(main())
