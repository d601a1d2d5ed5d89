"""Schedule simulation of a forward whose producer warps quantize K/V while it runs
(``cute-fwd-kv-in-kernel.patch``; NOTES, thirty-third session). CPU only, no kernels.

132 CTAs take work items (query tile, head) by ticket; an item costs ``a`` µs plus ``b`` µs
per key tile (causal; its key tiles from the last down), and a key tile may start only once
its 32-token blocks' K and V are written. 396 warps (three per CTA) write the blocks, eight
tasks per 128-key tile, ``tau`` µs each, in the order the items first need them. The items
run group by group of ``group`` K/V heads (the work list's longest-first order inside a
group). Prints the simulated forward (µs) per workload, group and ``tau``; ``tau`` ~0 is
the forward alone (a = 2.7, b = 1.47 give P3 ~290 and W5 ~591 µs: measured 297 / 578 on an
H100).

    python benchmarks/experiments/kv_in_kernel_schedule_sim.py [--workloads P3,W5]
"""

from __future__ import annotations

import argparse
import heapq
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.workloads import training_workload


def simulate(name: str, group: int, tau: float, a: float = 2.7, b: float = 1.47,
             ctas: int = 132, warps: int = 3) -> float:  # fmt: skip
    """The simulated forward of workload ``name`` in µs."""
    wl = training_workload(name)
    per_kv = wl.hq // wl.hkv
    items = sorted(
        ((t + 1, d) for d, n in enumerate(wl.seqlens) for t in range(math.ceil(n / 128))),
        key=lambda x: -x[0],
    )
    work = [(cost, d, h) for g0 in range(0, wl.hkv, group) for cost, d in items
            for h in range(g0 * per_kv, (g0 + group) * per_kv)]  # fmt: skip
    first_need: dict[tuple[int, int, int], int] = {}
    for pos, (cost, d, h) in enumerate(work):
        for j in range(cost):
            first_need.setdefault((d, h // per_kv, j), pos)
    tiles = sorted(first_need, key=lambda key: (first_need[key], key[2]))
    n_warps = ctas * warps
    ready = {key: ((8 * i + 7) // n_warps + 1) * tau for i, key in enumerate(tiles)}
    free = [(0.0, c) for c in range(ctas)]
    end = 0.0
    for cost, d, h in work:
        now, cta = heapq.heappop(free)
        now += a
        for j in range(cost - 1, -1, -1):
            now = max(now, ready[(d, h // per_kv, j)]) + b
        end = max(end, now)
        heapq.heappush(free, (now, cta))
    return end


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workloads", default="P3,W5")
    parser.add_argument("--groups", default="1,2,4,16")
    parser.add_argument("--taus", default="0.001,3,5,6,10")
    args = parser.parse_args()
    taus = [float(t) for t in args.taus.split(",")]
    for name in args.workloads.split(","):
        hkv = training_workload(name).hkv
        for group in (int(g) for g in args.groups.split(",")):
            if hkv % group == 0:
                times = [round(simulate(name, group, tau)) for tau in taus]
                print(f"{name} group {group:2d}: " + ", ".join(
                    f"tau {t:g} -> {us} us" for t, us in zip(taus, times, strict=True)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
