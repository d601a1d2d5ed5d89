"""Several versions of the CuTe backward in one device call (H200).

``python benchmarks/bwd_variants.py NAME=PATH [NAME=PATH ...]``: each PATH is a copy of
``flamia_serve/kernels/attn_bwd/cute_sm90.py`` with one change (keep the copies in the work
tree, e.g. under a scratch folder, so the device call carries them); the package's own
module is timed too, as ``current``. Every version runs in its own process: it compiles and
checks its dQ/dK/dV against the Triton kernel on ``check_bwd_kernels``' packs (these
processes run at once: compiling is CPU-bound and the machine has 16 cores), then waits
for a file lock and times T = 8192 and 16384 at d = 128 and T = 8192 at d = 64, causal,
so timings never overlap (``--shapes 8192x256``: other shapes; a d = 256 one adds d = 256
accuracy packs). Writes ``bwd_variants.json`` (one entry per version:
accuracy rows, speed rows, or the error; a version still running after ``--timeout``
seconds, e.g. one whose barriers never meet, is killed and reported as such). Five
versions took ~90 s of device time on 2026-12-01.

``--ablate all`` (or ``noadd,nodq,...``) adds copies of the package's kernel with one part of
the step removed (``ABLATIONS``; their gradients are wrong, their accuracy rows say so): how
much of the step's time each part costs, in the same call. Six of them and the current
kernel took ~110 s on 2026-12-02 (``results/bwd_ablations_2026-12-02.json``).
"""

from __future__ import annotations

import argparse
import fcntl
import importlib.util
import json
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import env_info, parse_settings, results_dir

MODULE = "flamia_serve.kernels.attn_bwd.cute_sm90"
KERNEL = Path(__file__).resolve().parents[1] / "flamia_serve/kernels/attn_bwd/cute_sm90.py"

# the kernel's text that the ablations change (each must occur exactly once); the step has
# two forms of the dK/dV products (``FlamiaBwdSm90.bf16_kv``: BF16 at d = 128, E4M3 promoted
# per half at d = 64) and two of dQ (``joint_dq``: once per CTA step at d = 128, per
# warpgroup at d = 64), and each ablation changes both
_BULK_ADD = '        if ctx["t"] == 0:\n            copy_utils.cpasync_reduce_bulk_add_f32(\n'
# (the one-kernel step's: inside its ``do_dv`` branch)
_DV_BF16 = '                self.accumulate_kv(ctx, ctx["acc_dv"], frag_p, ctx["tVrG"], stage)\n'
_DK_BF16 = '            self.accumulate_kv(ctx, ctx["acc_dk"], frag_ds, ctx["tKrQ"], stage)\n'
_DV_FP8 = "            dv_order = [(hb, hf) for hb in range(n_halves) for hf in range(halves)]\n"
_ORDER_FP8 = """\
            order = [
                item
                for hf in range(halves)
                for item in [("k", 0, hf), ("q", 0, hf)]
                + [("k", hb, hf) for hb in range(1, n_halves)]
            ]
"""
_K_ONLY = '            order = [("k", hb, hf) for hf in range(halves) for hb in range(n_halves)]\n'
_CTA_BARRIER = "cute.arch.barrier(barrier_id=_BAR_DS_CTA, number_of_threads=256)\n"
_JOINT_CALL = "self.dq_joint(ctx, h, i0, mDQ, parity)\n"
_JOINT_IN_STEP = f"            {_CTA_BARRIER}            {_JOINT_CALL}"
_JOINT_IN_DQ_ONLY = f"        {_CTA_BARRIER}        {_JOINT_CALL}"
_DS_WORD_STORE = """\
                ctx["sDSflat"][at + n * 8 * per_row] = word
"""


def _never(text: str) -> str:
    """``text`` (a statement's first lines) behind a branch never taken (i0 >= 0)."""
    indent = text[: len(text) - len(text.lstrip())]
    return f"{indent}if i0 < 0:\n    {text}"


_NO_ADD = (_BULK_ADD, _BULK_ADD.replace(" == 0:", " < 0:"))
_NO_DQ = [
    (_JOINT_IN_STEP, f"            {_CTA_BARRIER}"),  # the barriers stay
    (_JOINT_IN_DQ_ONLY, f"        {_CTA_BARRIER}"),
    (_ORDER_FP8, _K_ONLY),
    _NO_ADD,
]
#: name -> (text, replacement) pairs applied to the CuTe backward's source: timing-only
#: versions without one part of the step (H200, T=8192 d=128 causal, TFLOP/s; 2026-12-02, E4M3
#: dK/dV: current 277, noadd 323, nodq 389, nodq_nods 419, noamaxbar 279, nodv 288, nodk 315;
#: 2026-12-03, BF16 dK/dV with byte dŜ stores: current 288, noadd 333, nodq 410, nodv 338,
#: nodk 323; 2026-12-03, pipelined wgmma, one dQ piece in flight: current 341, noadd 383, nodq
#: 497, nodq_nods 501, noamaxbar 341, nodv 349, nodk 358)
ABLATIONS: dict[str, list[tuple[str, str]]] = {
    # dQ staged, never added to dq_acc (the bulk reduce-adds)
    "noadd": [_NO_ADD],
    # no dQ products, staging or adds
    "nodq": _NO_DQ,
    # and no dŜ to shared memory (its barriers stay)
    "nodq_nods": [*_NO_DQ, (_DS_WORD_STORE, _never(_DS_WORD_STORE))],
    # the barrier of both warpgroups before the joint dQ (each then reads the other's dŜ
    # tile whenever it gets there: the cost of the lockstep, an upper bound for a stagger)
    "nocta": [
        (_JOINT_IN_STEP, f"            {_JOINT_CALL}"),
        (_JOINT_IN_DQ_ONLY, f"        {_JOINT_CALL}"),
    ],
    # the warpgroup barrier of the dS exponent exchange (exponents then read early)
    "noamaxbar": [
        ("        cute.arch.barrier(barrier_id=_BAR_AMAX + wg, number_of_threads=128)\n", ""),
    ],
    # no dV products
    "nodv": [(_DV_BF16, _never(_DV_BF16)), (_DV_FP8, "            dv_order = []\n")],
    # no dK products
    "nodk": [
        (_DK_BF16, _never(_DK_BF16)),
        (_ORDER_FP8, '            order = [("q", 0, hf) for hf in range(halves)]\n'),
    ],
}


def ablated_source(name: str, source: str) -> str:
    """``source`` (the CuTe backward's) with ablation ``name`` applied; ``ValueError`` naming
    the text when the kernel no longer holds it exactly once."""
    for old, new in ABLATIONS[name]:
        if source.count(old) != 1:
            raise ValueError(f"ablation {name!r}: the kernel holds {source.count(old)} copies "
                             f"of {old.strip().splitlines()[0]!r} (expected one)")  # fmt: skip
        source = source.replace(old, new)
    return source


#: timed shapes (tokens x head dim, one causal document, Hq/Hkv 32/8) unless ``--shapes``
SHAPES = "8192x128,16384x128,8192x64"
#: accuracy packs added when a timed shape has d = 256 (lens, hq, hkv, d, causal, exact)
D256_CASES = [
    ((1, 300, 1000, 129, 31), 4, 2, 256, True, False),
    ((257, 64, 700), 8, 1, 256, False, True),
]


def run_one(name: str, path: str | None, lock_path: str, out_path: str, shapes: str) -> None:
    """Check and time one version (``path`` None: the package's module) in this process."""
    import benchmarks.check_bwd_kernels as cbk

    result: dict = {"path": path or MODULE, "accuracy": [], "speed": []}
    try:
        if path is not None:  # ops.attn_bwd imports the module by name at each call
            spec = importlib.util.spec_from_file_location(f"{MODULE}_{name}", path)
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
            sys.modules[MODULE] = module
        timed = parse_settings(shapes, "TOKENSxHEAD_DIM")
        head_dims = sorted({d for _t, d in timed})
        cases = cbk.ACCURACY_CASES + (D256_CASES if 256 in head_dims else [])
        for case in cases:
            result["accuracy"].append(cbk.accuracy(case))
        configs = {"cute": cbk.CONFIGS["cute"]}
        for d in head_dims:  # compile before taking the lock
            cbk.backward(cbk.operands((1024,), 32, 8, d, True), configs["cute"])
        with open(lock_path, "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            for t, d in timed:
                result["speed"] += cbk.speed(t, d, True, configs)
    except Exception:
        result["error"] = traceback.format_exc()[-3000:]
    Path(out_path).write_text(json.dumps(result))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("variants", nargs="*", help="NAME=PATH of a copy of cute_sm90.py")
    ap.add_argument("--ablate", default="", help=f"'all' or some of {', '.join(ABLATIONS)}")
    ap.add_argument("--timeout", type=float, default=400.0,
                    help="seconds for all versions; one still running then is killed")  # fmt: skip
    ap.add_argument("--shapes", default=SHAPES,
                    help="TOKENSxHEAD_DIM,... to time (d = 256 adds d = 256 checks)")  # fmt: skip
    ap.add_argument("--one", nargs=5, metavar=("NAME", "PATH", "LOCK", "OUT", "SHAPES"),
                    help=argparse.SUPPRESS)  # fmt: skip
    args = ap.parse_args(argv)
    if args.one:
        name, path, lock, out, shapes = args.one
        run_one(name, None if path == "-" else path, lock, out, shapes)
        return 0
    parse_settings(args.shapes, "TOKENSxHEAD_DIM")  # a bad --shapes fails here, not per version
    versions = {"current": "-"}
    for item in args.variants:
        name, sep, path = item.partition("=")
        if not sep or not Path(path).is_file():
            ap.error(f"variant {item!r}: expected NAME=PATH of an existing file")
        versions[name] = str(Path(path).resolve())
    tmp = Path(tempfile.mkdtemp(prefix="bwd_variants_"))
    names = list(ABLATIONS) if args.ablate == "all" else [x for x in args.ablate.split(",") if x]
    kernel = KERNEL.read_text() if names else ""
    for name in names:
        if name not in ABLATIONS:
            ap.error(f"--ablate {name!r}: expected 'all' or some of {', '.join(ABLATIONS)}")
        path = tmp / f"ablation_{name}.py"
        path.write_text(ablated_source(name, kernel))
        versions[name] = str(path)
    lock = str(tmp / "lock")
    procs = {
        name: subprocess.Popen(
            [sys.executable, __file__, "--one", name, path, lock, str(tmp / f"{name}.json"),
             args.shapes]
        )
        for name, path in versions.items()
    }
    result: dict = {"env": env_info(), "variants": {}}
    deadline = time.monotonic() + args.timeout
    for name, proc in procs.items():
        try:
            proc.wait(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:  # a version that hangs (a barrier never met)
            proc.kill()
            proc.wait()
        out = tmp / f"{name}.json"
        row = json.loads(out.read_text()) if out.exists() else {"error": f"exit {proc.returncode}"}
        result["variants"][name] = row
        worst = max(
            (v for a in row.get("accuracy", []) for k, v in a.items() if k.startswith("cute_vs")),
            default=float("nan"),
        )
        speeds = ", ".join(
            f"{s['kernel']} T={s['tokens']} d={s['d']} {s['tflops']:.1f}"
            for s in row.get("speed", [])
        )
        print(f"{name}: vs Triton ≤ {worst:.1e}; {speeds or row.get('error', '')[-300:]}")
    path = results_dir() / "bwd_variants.json"
    path.write_text(json.dumps(result, indent=1))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
