"""The fp8-cache prefill's operand layout kernel at other program shapes against 16 keys x one
head, bit for bit, on the serving workloads (GPU; what a default ``chunk`` change needs):

    python benchmarks/check_prefill_layouts.py [--layouts 32x1,64x1,128x1,64x2,16x8]

Prints one line per (workload, layout) and exits non-zero if any differs.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from benchmarks.prefill import WORKLOADS
from benchmarks.serving import fp8_prefill
from flamia_serve.kernels.paged.ops import prefill_operands


def _used_columns(offsets: torch.Tensor, count: int, align: int) -> torch.Tensor:
    """Every sequence's columns of the layout up to its ``align``-padded end."""
    cu, starts = offsets[1].tolist(), offsets[2].tolist()
    spans = [-(-(cu[j + 1] - cu[j]) // align) * align for j in range(count)]
    return torch.cat([starts[j] + torch.arange(spans[j]) for j in range(count)])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layouts", default="32x1,64x1,128x1,64x2,16x8")
    args = ap.parse_args(argv)
    layouts = [tuple(int(x) for x in v.split("x")) for v in args.layouts.split(",")]
    dev, different = torch.device("cuda"), 0
    for i, (name, (new, cached)) in enumerate(WORKLOADS.items()):
        prep = fp8_prefill(new, cached, dev, seed=i)
        batch, plan, schedule, keys = prep.batch, prep.plan, prep.schedule, prep.keys
        align = schedule.config.block_n
        args_ = (batch.q, batch.caches["fp8"], batch.block_table, batch.seq_lens, plan,
                 schedule.offsets, align)  # fmt: skip
        ref = prefill_operands(*args_, 16, 1)
        cols = _used_columns(schedule.offsets, plan.num_prefills, align).to(dev)
        for chunk, heads in layouts:
            got = prefill_operands(*args_, chunk, heads)
            k_a, k_b = (x.k_codes.view(torch.uint8)[:keys] for x in (got, ref))
            v_a, v_b = (x.v_t.view(torch.uint8)[:, :, cols] for x in (got, ref))
            same = (
                torch.equal(k_a, k_b) and torch.equal(v_a, v_b)
                and torch.equal(got.kv_factors[:, :, cols], ref.kv_factors[:, :, cols])
            )  # fmt: skip
            different += not same
            print(f"{name:28s} {chunk} keys x {heads} heads: {'equal' if same else 'DIFFERENT'}")
    print(f"layouts that differ: {different}")
    return 1 if different else 0


if __name__ == "__main__":
    sys.exit(main())
