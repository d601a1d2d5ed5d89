"""``train_attention.py`` (or ``prefill.py``) with the kernels' work lists in another order.

    python benchmarks/work_order.py --fwd document --bwd cost -- --quick \\
        --workloads W5,W6 --passes fwd,bwd --impls flamia-mxfp8 --name work_order_doc_cost

``--fwd`` / ``--bwd`` set ``schedule.QUERY_WORK_ORDER`` (with ``--script prefill`` also
``EXTEND_WORK_ORDER``) / ``KEY_WORK_ORDER`` (``cost``: every
tile by its work, longest first; ``document``: documents by their longest tile, each one's
tiles together; ``--fwd-chunk`` / ``--bwd-chunk`` C: in rounds of C items per document);
the arguments after ``--`` go to ``train_attention.py`` (``--script prefill``: to
``prefill.py``, whose paged prefill takes the query-tile list). The question it
answers: do CTAs that run at the same time on different documents (the longest-first order
on packs of many documents) lose to L2 what FA4's order (tiles of one head and document
side by side) keeps. The backward's answer (H100, 2026-12-06) made ``document`` its default.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    ours, rest = (argv[: argv.index("--")], argv[argv.index("--") + 1 :]) if "--" in argv \
        else (argv, [])  # fmt: skip
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--fwd", choices=["cost", "document"], default=None)
    ap.add_argument("--bwd", choices=["cost", "document"], default=None)
    ap.add_argument("--fwd-chunk", type=int, default=None,
                    help="by document in rounds of this many items per document (0: whole)")
    ap.add_argument("--bwd-chunk", type=int, default=None, help="the same for the backward")
    ap.add_argument("--script", choices=["train_attention", "prefill"], default="train_attention",
                    help="the benchmark to run (prefill: the paged prefill's query-tile list)")
    args = ap.parse_args(ours)
    from flamia_serve.kernels import schedule

    # after --help: the benchmarks import the GPU's packages
    bench = importlib.import_module(f"benchmarks.{args.script}")

    schedule.QUERY_WORK_ORDER = args.fwd or schedule.QUERY_WORK_ORDER
    if args.script == "prefill":  # (the paged prefill's lists are extend lists)
        schedule.EXTEND_WORK_ORDER = args.fwd or schedule.EXTEND_WORK_ORDER
    schedule.KEY_WORK_ORDER = args.bwd or schedule.KEY_WORK_ORDER
    if args.fwd_chunk is not None:
        schedule.QUERY_ORDER_CHUNK = args.fwd_chunk
    if args.bwd_chunk is not None:
        schedule.KEY_ORDER_CHUNK = args.bwd_chunk
    print(f"work order: forward {schedule.QUERY_WORK_ORDER} ({schedule.QUERY_ORDER_CHUNK}), "
          f"extend {schedule.EXTEND_WORK_ORDER}, "
          f"backward {schedule.KEY_WORK_ORDER} ({schedule.KEY_ORDER_CHUNK})")
    return bench.main(rest)


if __name__ == "__main__":
    raise SystemExit(main())
