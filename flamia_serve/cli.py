"""The ``flamia`` command line: ``probe`` (leakage and accuracy tables) and the demos
``serve-demo``, ``pretrain`` and ``rl``, imported only when called (they need extras).

Bad arguments exit with status 2 and a one-line message on stderr, never a traceback.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
import time
from collections.abc import Callable, Sequence
from importlib import metadata
from pathlib import Path

EPILOG = """examples:
  flamia probe                          tables on the GPU if there is one, else the CPU
  flamia probe --device cpu --json ''   on the CPU, no JSON file
  flamia serve-demo --help              the demo's own options (needs the vllm extra)

Bad arguments exit with status 2 and a one-line message on stderr."""

#: subcommand -> (module with ``main(argv)``, extra that brings its dependencies, help)
LAZY_COMMANDS: dict[str, tuple[str, str, str]] = {
    "serve-demo": (
        "flamia_serve.backend.demo",
        "vllm",
        "serve a small model through vLLM with the FLAMIA attention backend",
    ),
    "pretrain": (
        "flamia_serve.train.pretrain",
        "train",
        "pretraining demo through the FLAMIA autograd path",
    ),
    "rl": (
        "flamia_serve.train.rl",
        "train",
        "RL demo: rollouts and training with the same numerics",
    ),
}

#: imported module (top-level name) -> the extra that installs it
EXTRA_OF_MODULE = {
    "vllm": "vllm",
    "transformers": "train",
    "tokenizers": "train",
    "flash_attn": "cute",
    "cutlass": "cute",
    "matplotlib": "bench",
    "tqdm": "bench",
}

LEGEND_HEAD = "Legend: largest change when inputs change (0 = bit-identical)."
#: (column, explanation, backward only)
LEGEND: tuple[tuple[str, str, bool], ...] = (
    (
        "O future",
        """outputs at positions <= t when every later token of the same
document is replaced by values 1024x larger. mxfp8 without
exact_causal may be nonzero: Q and K share one exponent per
32-token block, so a row can depend on the rest of its own block
(up to 31 later tokens), never beyond it. exact_causal must be 0.""",
        False,
    ),
    (
        "dQ future",
        """dQ rows of the 32-token blocks that end by t, when q, k, v and dO
after t change: 0 for every recipe (rows of t's own block may
change: dO and dS share block exponents).""",
        True,
    ),
    ("O docs", "every other document of the pack replaced: 0 for every recipe.", False),
    (
        "grad docs",
        """the same for dQ, dK and dV of the probed document: 0 for every
recipe (scales never cross a document).""",
        True,
    ),
)
LEGEND_TAIL = "  per-tensor fp8 (leaky) is the comparison: one scale over the whole tensor."


class UsageError(Exception):
    """A bad command line: reported as one line on stderr, exit status 2."""


def _versions() -> str:
    def version(dist: str) -> str:
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            return "not installed"

    own = version("flamia-serve")
    if own == "not installed":
        from flamia_serve import __version__ as own
    return f"flamia {own} (torch {version('torch')}, triton {version('triton')})"


def _resolve_device(name: str | None) -> str:
    """``--device``: ``cpu``, ``cuda`` or ``cuda:N``; default: ``cuda`` when a GPU exists."""
    import torch

    from flamia_serve.numerics.checks import check_device

    if name is None:
        return "cuda" if torch.cuda.is_available() else "cpu"
    try:
        return str(check_device(name, "--device"))
    except (TypeError, ValueError) as err:
        raise UsageError(str(err)) from None


def _check_writable(path: str) -> Path:
    """Fail before the work if ``path`` cannot be written (``files.check_writable``)."""
    from flamia_serve.files import check_writable

    try:
        return check_writable(path)
    except ValueError as err:
        raise UsageError(str(err)) from None


def _fmt(x: float | None, spec: str) -> str:
    if x is None:
        return "-"
    return "0" if x == 0 else format(x, spec)


def _table(headers: Sequence[str], rows: Sequence[Sequence[str]], left: int = 1) -> list[str]:
    """Plain-text table: the first ``left`` columns left-aligned, the rest right-aligned."""
    widths = [max(len(r[i]) for r in (headers, *rows)) for i in range(len(headers))]

    def line(cells: Sequence[str]) -> str:
        return "  ".join(
            c.ljust(w) if i < left else c.rjust(w)
            for i, (c, w) in enumerate(zip(cells, widths, strict=True))
        ).rstrip()

    lines = [line(headers), "  ".join("-" * w for w in widths)]
    return lines + [line(r) for r in rows]


def format_probe(result: dict) -> str:
    """The text ``flamia probe`` prints for a :func:`flamia_serve.probes.probe` result."""
    lk, ac = result["setup"]["leakage"], result["setup"]["accuracy"]
    layouts = ", ".join(f"{name} {tuple(lens)}" for name, lens in lk["layouts"])
    cuts = ", ".join(str(t) if t >= 0 else f"L{t}" for t in lk["cuts"])
    out = [f"Probed attention: {result['attention']}", ""]
    out += [
        "Leakage of causal calls:",
        "  Hq={heads_q}, Hkv={heads_kv}, d={head_dim}, bf16, random normal inputs".format(**lk),
        f"  documents: {layouts}",
        f"  probed document {lk['doc']}, cuts t = {cuts} (L = its length)",
        "",
    ]
    grads = result["backward"]
    headers = ["method", "layout", "O future", "O docs"]
    headers += ["dQ future", "grad docs"] if grads else []
    rows = []
    for r in result["leakage"]:
        row = [r["method"], r["layout"], _fmt(r["future_leak"], ".3g"),
               _fmt(r["cross_doc_leak"], ".3g")]  # fmt: skip
        if grads:
            row += [_fmt(r["future_leak_dq"], ".3g"), _fmt(r["cross_doc_leak_grads"], ".3g")]
        rows.append(row)
    out += _table(headers, rows, left=2)
    out += ["", LEGEND_HEAD]
    for column, text, needs_grads in LEGEND:
        if grads or not needs_grads:
            lines = text.splitlines()
            out.append(f"  {column:<9}  {lines[0]}")
            out += [" " * 13 + line for line in lines[1:]]
    out += [LEGEND_TAIL, ""]
    out += [
        "Accuracy against float64 attention" + (" (gradients: float64 autograd)" if grads else ""),
        "  Hq={heads_q}, Hkv={heads_kv}, d={head_dim}, bf16, causal, ".format(**ac)
        + ("random normal q, k, v, dO" if grads else "random normal q, k, v"),
        f"  documents {tuple(ac['doc_lens'])}",
        "",
    ]
    rows = [
        [r["recipe"], r["tensor"], f"{r['cos_sim']:.5f}", f"{r['rel_err']:.4f}"]
        for r in result["accuracy"]
    ]
    out += _table(["recipe", "tensor", "cos-sim", "rel. error"], rows, left=2)
    return "\n".join(out)


def _probe(args: argparse.Namespace) -> int:
    device = _resolve_device(args.device)
    json_path = _check_writable(args.json) if args.json else None
    import torch

    from flamia_serve.probes import probe

    if args.impl == "kernel":
        import os

        from flamia_serve import flamia_attn_varlen as impl

        if device == "cpu" and os.environ.get("TRITON_INTERPRET", "0") in ("", "0"):
            raise UsageError(
                "--impl kernel runs the GPU kernels: use --device cuda, or set "
                "TRITON_INTERPRET=1 to interpret them on the CPU (slow)"
            )
    else:
        from flamia_serve.reference import attention as impl
    start = time.perf_counter()
    torch.manual_seed(args.seed)
    try:
        result = probe(seed=args.seed, device=device, impl=impl, backward=not args.forward_only)
    except NotImplementedError as err:
        raise UsageError(f"--impl {args.impl}: {err}") from None
    elapsed = time.perf_counter() - start
    if json_path is not None:
        payload = {"device": device, "seed": args.seed, "torch": torch.__version__, **result}
        json_path.write_text(json.dumps(payload, indent=2) + "\n")
    print(format_probe(result))
    where = f"; wrote {json_path}" if json_path is not None else ""
    print(f"\n{elapsed:.1f} s on {device}{where}")
    return 0


def _missing_extra(command: str, module: str, extra: str, err: ImportError) -> UsageError:
    missing = getattr(err, "name", None) or ""
    top = missing.split(".")[0]
    if missing and top == "flamia_serve":
        return UsageError(
            f"{command}: this installation of flamia_serve has no {missing} (needed by {module})"
        )
    need = EXTRA_OF_MODULE.get(top, extra)
    what = f"module {missing!r} is missing" if missing else f"import failed: {err}"
    return UsageError(
        f'{command} needs the {need!r} extra: pip install "flamia-serve[{need}]" ({what})'
    )


def _run_lazy(command: str, argv: list[str]) -> int:
    module, extra, _ = LAZY_COMMANDS[command]
    try:
        main: Callable[[list[str]], int | None] = importlib.import_module(module).main
    except ImportError as err:
        raise _missing_extra(command, module, extra, err) from None
    except AttributeError:
        raise UsageError(f"{command}: {module} has no main(argv)") from None
    return int(main(argv) or 0)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="flamia",
        description="Low-precision, causally safe attention (flamia_serve).",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=_versions())
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    p = sub.add_parser(
        "probe",
        help="leakage and accuracy tables of the recipes",
        description="Leakage (future -> earlier outputs and gradients, other documents -> "
        "this one) and accuracy (cos-sim, relative error of O, dQ, dK, dV against float64) "
        "of the recipes, printed as tables and written as JSON.",
    )
    p.add_argument("--json", default="flamia_probe.json", metavar="PATH",
                   help="where to write the JSON (default: %(default)s; '' = none)")  # fmt: skip
    p.add_argument("--seed", type=int, default=0, help="input seed (default: 0)")
    p.add_argument(
        "--device",
        default=None,
        help="cpu, cuda or cuda:N (default: cuda if a GPU exists, else cpu)",
    )
    p.add_argument(
        "--impl",
        choices=("reference", "kernel"),
        default="reference",
        help="probed attention: the reference (default) or the kernel path, "
        "flamia_attn_varlen (for a GPU)",
    )
    p.add_argument("--forward-only", action="store_true",
                   help="skip the backward rows and columns (faster)")  # fmt: skip
    p.set_defaults(func=_probe)
    for name, (module, extra, text) in LAZY_COMMANDS.items():
        sub.add_parser(
            name,
            help=f"{text} (extra: {extra})",
            description=f"{text}. Arguments are passed to {module}.main.",
            add_help=False,
        )
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``flamia``; returns the exit status."""
    args_list = list(sys.argv[1:] if argv is None else argv)
    try:
        try:
            if args_list and args_list[0] in LAZY_COMMANDS:
                return _run_lazy(args_list[0], args_list[1:])
            args = build_parser().parse_args(args_list)
            return args.func(args)
        except UsageError as err:
            print(f"flamia: error: {err}", file=sys.stderr)
            return 2
    except KeyboardInterrupt:
        print("flamia: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        # The reader went away (`flamia probe | head`): stop quietly; stdout is pointed at
        # devnull so the interpreter's final flush does not raise again.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 1


if __name__ == "__main__":
    sys.exit(main())
