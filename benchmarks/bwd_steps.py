"""The CuTe backward's work shape per pack, counted on a CPU (no GPU, no timing).

One CTA per (128-key tile, K/V head); each takes 64-query steps from its tile's diagonal to
the document's end, for every query head of the GQA group (``attn_bwd/cute_sm90.py``).
Printed per workload: documents, CTAs, steps per CTA (mean), and the fraction of the steps'
query x key pairs that are causal pairs of the document (the rest is the diagonal's masked
half and the last step's rows past the document). Beside it the same count for 128 x 128
tiles per query head, the shape of a backward without GQA reuse, for comparison.

    python benchmarks/bwd_steps.py [--workloads W3,W5,W6,P3,E1,E16,E128]
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.workloads import training_workload


def work_shape(lens: list[int], keys: int, queries: int, heads: int) -> tuple[int, float, float]:
    """(CTAs per K/V head, mean steps per CTA, useful fraction) of ``keys``-key tiles taking
    ``queries``-query steps for ``heads`` query heads each."""
    useful = done = ctas = steps = 0
    for n in lens:
        for j in range(math.ceil(n / keys)):
            k0, k1 = keys * j, min(n, keys * (j + 1))
            useful += sum(n - k for k in range(k0, k1))
            st = math.ceil((n - k0) / queries)
            done += st * keys * queries
            ctas += 1
            steps += st * heads
    return ctas, steps / ctas, useful / done


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--workloads", default="W3,W5,W6,W7,P3,P4,E1,E16,E64,E128")
    for name in ap.parse_args().workloads.split(","):
        w = training_workload(name)
        ctas, steps, useful = work_shape(w.seqlens, 128, 64, w.hq // w.hkv)
        _, steps_1, useful_1 = work_shape(w.seqlens, 128, 128, 1)
        print(f"{name:5s} docs {w.num_docs:5d}  CTAs {ctas * w.hkv:6d}  steps/CTA {steps:7.1f}  "
              f"useful {useful:.3f}  |  128x128 per query head: steps/CTA {steps_1:6.1f}  "
              f"useful {useful_1:.3f}")  # fmt: skip


if __name__ == "__main__":
    main()
