"""What a work item costs the forward beside its key tiles (H200; issue 16's short documents).

``python benchmarks/fwd_items.py [--workloads W1,W3,E1,E4,E16,E64,E128] [--ablate noepi,noqq]``
runs the default ``flamia-mxfp8`` forward (plan prebuilt) and FA4's varlen forward on packs
of 16k tokens cut into n equal documents (``workloads.EQUAL_PACKS``; W1 and W3, one document
of 8k / 32k tokens, vary the item count, which is 4096 on every E pack), takes each kernel's GPU
time per call (``torch.profiler``), and fits the attention kernel's time as
``a·tiles + b·items + c``: ``tiles`` are the (query tile, key tile) pairs at or below the
causal diagonal of 128 x 128 tiles, ``items`` the (query tile, head) pairs. The same
regressors are used for FA4 (its tiles are not ours: its fit is a comparison, not its
anatomy).

``--ablate``: copies of the CuTe forward with one part of an item left out, timing only (their
outputs are wrong): ``noepi`` stores no O in the epilogue (M and lse only), ``noqq`` does not
quantize the Q tile inside the kernel (the consumers only meet at its barrier). Writes
``<--name>.json`` (default ``fwd_items.json``).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from benchmarks.common import cuda_kernel_times, write_results
from benchmarks.train_attention import IMPLS, make_inputs
from benchmarks.workloads import EQUAL_PACKS, Workload, training_workload

TILE = 128
ABLATIONS = ("noepi", "noqq")


def tiles_and_items(wl: Workload) -> tuple[int, int]:
    """Causal (query tile, key tile) pairs and (query tile, head) pairs of 128-token tiles."""
    tiles = items = 0
    for n in wl.seqlens:
        t = -(-n // TILE)
        tiles += t * (t + 1) // 2 * wl.hq
        items += t * wl.hq
    return tiles, items


def fit(rows: list[dict], key: str) -> dict[str, float] | None:
    """Least squares ``us = a·tiles + b·items + c`` over ``rows`` (µs per tile, item, call)."""
    pts = [r for r in rows if r.get(key) is not None]
    if len(pts) < 3:
        return None
    x = torch.tensor([[r["tiles"], r["items"], 1.0] for r in pts], dtype=torch.float64)
    y = torch.tensor([r[key] for r in pts], dtype=torch.float64)
    a, b, c = torch.linalg.lstsq(x, y).solution.tolist()
    resid = (x @ torch.tensor([a, b, c], dtype=torch.float64) - y).abs().max().item()
    return {"us_per_tile": a, "us_per_item": b, "us_per_call": c, "max_residual_us": resid}


def ablated_class(name: str):
    """A subclass of the CuTe forward with part ``name`` of an item left out."""
    import cutlass
    import cutlass.cute as cute

    from flamia_serve.kernels.attn_fwd import cute_sm90

    base = cute_sm90.FlamiaFwdSm90

    # (the kernel's name carries the class's: "FlamiaFwd" in it keeps it apart from the
    # quantization launch in ``kernel_us``)
    class FlamiaFwdSm90Ablated(base):  # type: ignore[misc, valid-type]
        if name == "noepi":

            @cute.jit
            def epilogue(self, acc_O, thr_mma_pv, ctx, mO, mM, mLSE, w):
                for r in cutlass.range_constexpr(cute.size(ctx.m_run)):
                    if ctx.row[r] < w.seqlen:
                        mM[w.q_base + ctx.row[r], w.head] = ctx.m_run[r] + ctx.l_run[r]

        elif name == "noqq":

            @cute.jit
            def quantize_q_rows(self, ctx, w):
                self.wg_sync(ctx.wg)

    return FlamiaFwdSm90Ablated


def kernel_times(run, q, k, v) -> dict[str, float]:
    """GPU µs per call by kernel name."""
    return cuda_kernel_times(lambda: run(q, k, v), reps=20)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--workloads", default=",".join(("W1", "W3", *EQUAL_PACKS)))
    ap.add_argument("--ablate", default="", help=f"some of {', '.join(ABLATIONS)}")
    ap.add_argument("--no-fa4", action="store_true")
    ap.add_argument("--name", default="fwd_items", help="results file stem")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("fwd_items needs a CUDA GPU")
    ablate = [x for x in args.ablate.split(",") if x]
    for name in ablate:
        if name not in ABLATIONS:
            ap.error(f"--ablate {name!r}: expected some of {', '.join(ABLATIONS)}")
    dev = torch.device("cuda")
    flamia_build = IMPLS["flamia-mxfp8"][1]()
    fa4_build = None if args.no_fa4 else IMPLS["fa4"][1]()
    from flamia_serve.kernels.attn_fwd import cute_sm90

    original = cute_sm90.FlamiaFwdSm90
    variants = [("current", original)] + [(n, ablated_class(n)) for n in ablate]
    rows = []
    for name in args.workloads.split(","):
        wl = training_workload(name)
        cu = wl.cu_seqlens(dev)
        q, k, v = make_inputs(wl, seed=0, device=dev)
        tiles, items = tiles_and_items(wl)
        row = {"workload": name, "docs": wl.num_docs, "doc_len": wl.seqlens[0], "tiles": tiles,
               "items": items, "flops": wl.flops()}  # fmt: skip
        for vname, cls in variants:
            cute_sm90.FlamiaFwdSm90 = cls
            cute_sm90._COMPILED.clear()
            try:
                _, run = flamia_build(wl, cu, (q, k, v))
                times = kernel_times(run, q, k, v)
            except Exception as exc:  # an ablation that does not build: say so, go on
                row[f"{vname}_error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
                print(vname, row[f"{vname}_error"], flush=True)
                continue
            finally:
                cute_sm90.FlamiaFwdSm90 = original
                cute_sm90._COMPILED.clear()
            attn = sum(t for n, t in times.items() if "FlamiaFwd" in n)
            row[f"{vname}_kernel_us"] = attn
            row[f"{vname}_total_us"] = sum(times.values())
            if vname == "current":
                row["flamia_kernels_us"] = {n[:60]: round(t, 2) for n, t in times.items()}
        if fa4_build is not None:
            _, run = fa4_build(wl, cu, (q, k, v))
            times = kernel_times(run, q, k, v)
            row["fa4_total_us"] = sum(times.values())
            row["fa4_kernels_us"] = {n[:60]: round(t, 2) for n, t in times.items()}
        rows.append(row)
        print({k_: (round(v_, 2) if isinstance(v_, float) else v_) for k_, v_ in row.items()
               if not k_.endswith("kernels_us")}, flush=True)  # fmt: skip
    fits = {key: fit(rows, key) for key in
            [f"{n}_kernel_us" for n, _ in variants] + ["current_total_us", "fa4_total_us"]}
    for key, f in fits.items():
        print(key, f)
    write_results(args.name, rows, {"fits": fits, "tile": TILE})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
