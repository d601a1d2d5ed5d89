"""``flamia`` command line: ``flamia probe`` prints the leakage and accuracy tables."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch


def _print_tables(result: dict[str, list[dict]]) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console()
    leak = Table(title="Leakage: largest |ΔO| (0 = bit-identical)")
    for col in ("method", "layout", "future → earlier outputs", "other docs → this doc"):
        leak.add_column(col)
    for r in result["leakage"]:
        leak.add_row(
            r["method"], r["layout"], f"{r['future_leak']:.3g}", f"{r['cross_doc_leak']:.3g}"
        )
    acc = Table(title="Accuracy against float64")
    for col in ("recipe", "tensor", "cos-sim", "rel. error"):
        acc.add_column(col)
    for r in result["accuracy"]:
        acc.add_row(r["recipe"], r["tensor"], f"{r['cos_sim']:.5f}", f"{r['rel_err']:.4f}")
    console.print(leak)
    console.print(acc)


def _probe(args: argparse.Namespace) -> int:
    from flamia_serve.probes import probe

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    start = time.perf_counter()
    result = probe(seed=args.seed, device=device)
    _print_tables(result)
    payload = {"device": device, "seed": args.seed, "torch": torch.__version__, **result}
    Path(args.json).write_text(json.dumps(payload, indent=2))
    print(f"wrote {args.json} ({time.perf_counter() - start:.1f} s on {device})")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="flamia", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("probe", help="leakage and accuracy tables of the reference recipes")
    p.add_argument("--json", default="flamia_probe.json", help="where to write the JSON")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda if present)")
    p.set_defaults(func=_probe)
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
