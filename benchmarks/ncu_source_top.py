"""Summarise an ``ncu`` report's source page: stall samples by opcode and the hottest SASS lines.

    ncu --set full -k regex:FlamiaBwd --launch-skip 1 --launch-count 1 -o /tmp/bwd \\
        python benchmarks/profile_bwd.py --kernel cute --once
    python benchmarks/ncu_source_top.py /tmp/bwd.ncu-rep [--top 70]

Runs ``ncu -i REPORT --page source --csv --print-source sass``, keeps that CSV beside the
report (``REPORT.source.csv``) and prints the share of "Warp Stall Sampling (All Samples)" per
opcode and the ``--top`` lines with the most samples, in program order. First run on the
H200 on 2026-12-03 (``results/ncu_cute_bwd_joint_source_top_2026-12-03.txt``); the CSV also
has one column per stall reason (``stall_barrier``, ``stall_wait``, ...), which that
session's summary of the backward read (``benchmarks/NOTES.md``). The CuTe kernels carry no
line info, so lines are SASS only.
"""

from __future__ import annotations

import argparse
import csv
import io
import subprocess
from collections import Counter

SAMPLES = "Warp Stall Sampling (All Samples)"


def _number(text: str) -> float:
    try:
        return float(text.replace(",", ""))
    except ValueError:
        return 0.0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("report")
    ap.add_argument("--top", type=int, default=70)
    args = ap.parse_args(argv)
    out = subprocess.run(
        ["ncu", "-i", args.report, "--page", "source", "--csv", "--print-source", "sass"],
        capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    with open(args.report + ".source.csv", "w") as f:
        f.write(out)
    rows = list(csv.reader(io.StringIO(out)))
    head = next(i for i, r in enumerate(rows) if "Source" in r)
    header = rows[head]
    print("columns:", header)
    body = [r for r in rows[head + 1 :] if len(r) == len(header)]
    src = header.index("Source")
    samples = next(i for i, c in enumerate(header) if c.startswith(SAMPLES.split(" (")[0]))
    total = sum(_number(r[samples]) for r in body) or 1.0
    by_op: Counter[str] = Counter()
    for r in body:
        words = [w for w in r[src].split() if not w.startswith("@")]
        by_op[words[0].split(".")[0] if words else "?"] += _number(r[samples])
    print(f"{total:.0f} samples over {len(body)} SASS lines; by opcode (%):")
    print(", ".join(f"{op} {100 * n / total:.1f}" for op, n in by_op.most_common(20)))
    hottest = sorted(range(len(body)), key=lambda i: -_number(body[i][samples]))[: args.top]
    for i in sorted(hottest):
        print(f"{i:5d} {100 * _number(body[i][samples]) / total:5.2f}%  {body[i][src][:100]}")
    # stall reasons (all samples, issued or not): shares, then each large one's top lines
    reasons = [i for i, c in enumerate(header) if c.startswith("stall_") and "(" not in c]
    by_reason = {header[i]: sum(_number(r[i]) for r in body) for i in reasons}
    n_all = sum(by_reason.values()) or 1.0
    ranked = sorted(by_reason.items(), key=lambda kv: -kv[1])
    print("stall reasons (%):", ", ".join(f"{k[6:]} {100 * v / n_all:.1f}" for k, v in ranked))
    for name, _n in ranked[:5]:
        col = header.index(name)
        top = sorted(range(len(body)), key=lambda i: -_number(body[i][col]))[:6]
        print(f"== {name}")
        for i in sorted(top):
            print(f"{i:5d} {100 * _number(body[i][col]) / n_all:5.2f}%  {body[i][src][:90]}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
