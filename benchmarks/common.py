"""Shared benchmark helpers: environment, timing, input rotation, results, tables, plots.

Results go to ``benchmarks/results/<name>.json`` (+ ``.png``) unless the environment
variable ``FLAMIA_RESULTS_DIR`` names another directory (e.g. ``$OUT`` on the device).

Re-plot a results file where matplotlib is installed:
``python -m benchmarks.common plot benchmarks/results/train_attention.json``.
"""

from __future__ import annotations

import datetime
import json
import math
import os
import statistics
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

L2_BYTES = 50 * 1024 * 1024  # H200 L2
RESULTS_ENV = "FLAMIA_RESULTS_DIR"
TABLE_COLUMNS = ("workload", "pass", "impl", "ms", "tflops", "speedup")


def results_dir() -> Path:
    """Directory results are written to (``$FLAMIA_RESULTS_DIR`` or benchmarks/results)."""
    override = os.environ.get(RESULTS_ENV)
    path = Path(override) if override else Path(__file__).resolve().parent / "results"
    path.mkdir(parents=True, exist_ok=True)
    return path


#: distributions whose versions every results file records where installed (the
#: baselines' libraries and ours): ``importlib.metadata`` names
LIBRARIES = ("flamia-serve", "flash-attn-4", "flash-attn", "nvidia-cutlass-dsl",
             "flashinfer-python", "flashinfer-cubin", "vllm", "transformers")  # fmt: skip


def library_versions() -> dict[str, str]:
    """Installed versions of :data:`LIBRARIES` (absent ones left out) and, where CUDA runs,
    cuDNN's (``"cudnn"``: the SDPA baseline's backend)."""
    from importlib import metadata

    import torch

    versions = {}
    for name in LIBRARIES:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    if torch.cuda.is_available() and torch.backends.cudnn.is_available():
        versions["cudnn"] = str(torch.backends.cudnn.version())
    return versions


def env_info() -> dict[str, str]:
    """GPU name, torch / triton / CUDA versions and today's date (YYYY-MM-DD)."""
    import torch

    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = "n/a"
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    return {
        "gpu": gpu,
        "torch": torch.__version__,
        "triton": triton_version,
        "cuda": str(torch.version.cuda),
        "date": datetime.date.today().isoformat(),
    }


def flamia_kernel_facts() -> dict:
    """Which FLAMIA serving kernels ran so far in this process (``paged.ops.LAUNCHES``,
    cumulative) and why a CuTe fast path stopped, if one did (``CUTE_FAILURES``); empty
    when the serving kernels were never imported."""
    if "flamia_serve.kernels.paged.ops" not in sys.modules:
        return {}
    from flamia_serve.kernels.paged import ops

    return {"launches": dict(ops.LAUNCHES), "cute_failures": dict(ops.CUTE_FAILURES)}


class JitCompiles:
    """Counts Triton JIT compiles (disk-cache loads included) and the seconds they took, per
    kernel name, while active: ``with JitCompiles() as jit: ...; jit.summary()``. Also counts
    the CuTe DSL kernels FLAMIA compiled (its modules' compile caches), where imported."""

    CUTE_CACHES = ("flamia_serve.kernels.attn_fwd.cute_sm90",
                   "flamia_serve.kernels.attn_bwd.cute_sm90",
                   "flamia_serve.kernels.paged.cute_decode_sm90")  # fmt: skip

    def __init__(self) -> None:
        self.counts: dict[str, int] = {}
        self.seconds: dict[str, float] = {}
        self._started: dict[str, float] = {}
        self._cute_before = 0
        self._cute_after: int | None = None  # set on exit

    @classmethod
    def _cute_compiled(cls) -> int:
        return sum(len(getattr(sys.modules[m], "_COMPILED", ())) for m in cls.CUTE_CACHES
                   if m in sys.modules)  # fmt: skip

    def _before(self, *, key: object, fn: object, **_: object) -> None:
        self._started[str(key)] = time.perf_counter()

    def _after(self, *, key: object, fn: object, **_: object) -> None:
        name = getattr(fn, "name", str(fn))
        self.counts[name] = self.counts.get(name, 0) + 1
        t0 = self._started.pop(str(key), None)
        if t0 is not None:
            self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - t0

    def __enter__(self) -> JitCompiles:
        from triton import knobs

        self._saved = (knobs.runtime.jit_cache_hook, knobs.runtime.jit_post_compile_hook)
        knobs.runtime.jit_cache_hook = self._before
        knobs.runtime.jit_post_compile_hook = self._after
        self._cute_before = self._cute_compiled()
        return self

    def __exit__(self, *exc: object) -> None:
        from triton import knobs

        knobs.runtime.jit_cache_hook, knobs.runtime.jit_post_compile_hook = self._saved
        self._cute_after = self._cute_compiled()

    @property
    def cute(self) -> int:
        """CuTe kernels compiled while active (so far, inside the block)."""
        after = self._cute_compiled() if self._cute_after is None else self._cute_after
        return after - self._cute_before

    @property
    def total(self) -> int:
        """Triton and CuTe compiles together."""
        return sum(self.counts.values()) + self.cute

    def summary(self) -> dict:
        """``{"triton": {name: count}, "triton_s": total seconds, "cute": count}``."""
        return {"triton": dict(self.counts), "triton_s": round(sum(self.seconds.values()), 2),
                "cute": self.cute}  # fmt: skip


#: the fewest timed calls behind a median (a pass longer than rep_ms / 5 gets more time)
MIN_TIMED_CALLS = 5


def time_ms(fn: Callable[[], Any], *, warmup_ms: float = 25, rep_ms: float = 200,
            l2: str = "dirty") -> dict:
    """Median / p20 / p80 milliseconds of ``fn()`` with L2 flushed before every timed call,
    over at least ``MIN_TIMED_CALLS`` calls (``rep_ms`` is stretched for long calls);
    ``n_timed``: how many.

    ``l2="dirty"``: ``triton.testing.do_bench``, whose flush writes zeros over 256 MB, so the
    timed call starts with L2 full of dirty lines and pays their write-back (H200: the FP8
    decode at B16-L8192 84.8 vs 76.5 µs, ``benchmarks/NOTES.md``). ``l2="clean"``: the flush
    reads 256 MB instead (L2 holds clean lines, as after a GEMM reading its weights). Keys
    match result rows.
    """
    if l2 not in ("dirty", "clean"):
        raise ValueError(f"l2 must be 'dirty' or 'clean', got {l2!r}")
    import torch

    if l2 == "dirty":
        from triton.testing import do_bench

        # do_bench times rep_ms / (its estimate) calls: one call of a 60 ms pass at rep 50
        # ms; a median needs at least MIN_TIMED_CALLS (the estimate's margin: do_bench
        # estimates again)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        rep = max(rep_ms, 1.5 * MIN_TIMED_CALLS * start.elapsed_time(end))
        times = list(do_bench(fn, warmup=warmup_ms, rep=rep, return_mode="all"))
        while len(times) < MIN_TIMED_CALLS:  # do_bench's own estimate came out longer
            times += do_bench(fn, warmup=0, rep=rep, return_mode="all")
        return timing_summary(times)

    flush = torch.ones(256 << 18, dtype=torch.int32, device="cuda")
    sink = torch.empty((), dtype=torch.int64, device="cuda")

    def timed(n: int) -> list[float]:
        events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                  for _ in range(n)]  # fmt: skip
        for start, end in events:
            torch.sum(flush, dim=0, out=sink)
            start.record()
            fn()
            end.record()
        torch.cuda.synchronize()
        return sorted(start.elapsed_time(end) for start, end in events)

    first = timed(5)
    per_call = max(first[len(first) // 2], 1e-3)
    timed(max(1, int(warmup_ms / per_call)))
    times = timed(max(MIN_TIMED_CALLS, min(10000, int(rep_ms / per_call))))
    return timing_summary(times)


def timing_summary(times: Sequence[float]) -> dict:
    """``ms`` (median), ``ms_p20``, ``ms_p80`` (linear interpolation, as ``do_bench``'s
    quantiles) and ``n_timed`` of per-call milliseconds."""
    if not times:
        raise ValueError("timing_summary needs at least one time")
    ordered = sorted(float(t) for t in times)

    def at(q: float) -> float:
        point = q * (len(ordered) - 1)
        lo, hi = math.floor(point), math.ceil(point)
        return (1 - (point - lo)) * ordered[lo] + (point - lo) * ordered[hi]

    return {"ms": at(0.5), "ms_p20": at(0.2), "ms_p80": at(0.8), "n_timed": len(ordered)}


def graph_time(fn: Callable[[], Any], *, rep_ms: float = 200, l2: str = "dirty") -> dict:
    """Median time of ``fn`` replayed from a CUDA graph (eager when capture fails); ``l2``:
    how L2 is flushed before each call (:func:`time_ms`)."""
    import torch

    fn()
    torch.cuda.synchronize()
    try:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            fn()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
        return {**time_ms(graph.replay, rep_ms=rep_ms, l2=l2), "cuda_graph": True}
    except Exception:
        traceback.print_exc(limit=1)
        torch.cuda.synchronize()
        return {**time_ms(fn, rep_ms=rep_ms, l2=l2), "cuda_graph": False}


def copy_bandwidth(device: Any, gib: float = 2.0, l2: str = "dirty") -> dict:
    """Device-to-device copy: GB/s counting bytes read + written (the memory ceiling);
    ``l2``: the flush before each call (:func:`time_ms`)."""
    import torch

    n = int(gib * (1 << 30)) // 2
    src = torch.randn(n, device=device, dtype=torch.bfloat16)
    dst = torch.empty_like(src)
    t = time_ms(lambda: dst.copy_(src), l2=l2)
    gbps = 2 * n * 2 / (t["ms"] * 1e-3) / 1e9
    print(f"device copy {2 * n * 2 / 1e9:.2f} GB moved: {t['ms']:.3f} ms = {gbps:.0f} GB/s")
    return {"workload": "copy", "pass": "copy", "impl": "torch-copy", **t,
            "tflops": None, "gbps": gbps}  # fmt: skip


def cos64(a: Any, b: Any) -> float:
    """Cosine similarity of two tensors, flattened, in float64."""
    import torch

    return float(torch.nn.functional.cosine_similarity(
        a.double().flatten(), b.double().flatten(), dim=0
    ))  # fmt: skip


def rel64(a: Any, b: Any) -> float:
    """``|a − b| / |b|`` (Frobenius norms) in float64."""
    return float((a.double() - b.double()).norm() / b.double().norm())


def output_and_grads(fn: Callable[..., Any], q: Any, k: Any, v: Any, d_out: Any) -> list:
    """``[O, dQ, dK, dV]`` of ``O = fn(q, k, v)`` with ``d_out`` as O's gradient, run on fresh
    leaf copies of q, k, v (the inputs are left as they are); O detached."""
    leaves = [x.detach().clone().requires_grad_() for x in (q, k, v)]
    out = fn(*leaves)
    out.backward(d_out.to(out.dtype))
    return [out.detach(), *(x.grad for x in leaves)]


def tensor_bytes(obj: Any) -> int:
    """Bytes held by the tensors in ``obj`` (tensors, sequences, dicts, dataclasses)."""
    if hasattr(obj, "element_size") and hasattr(obj, "numel"):
        return int(obj.numel() * obj.element_size())
    if isinstance(obj, dict):
        return sum(tensor_bytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(tensor_bytes(v) for v in obj)
    if hasattr(obj, "__dataclass_fields__"):
        return sum(tensor_bytes(getattr(obj, f)) for f in obj.__dataclass_fields__)
    return 0


def num_input_sets(
    bytes_per_set: int,
    *,
    l2_bytes: int = L2_BYTES,
    factor: float = 2.0,
    min_sets: int = 2,
    max_sets: int = 64,
    cap_bytes: int = 8 << 30,
) -> int:
    """How many input sets to rotate so they total more than ``factor`` x L2.

    At least ``min_sets``; at most ``max_sets`` and never more than fit in ``cap_bytes``.
    """
    need = math.ceil(factor * l2_bytes / max(bytes_per_set, 1)) + 1
    fit = max(1, cap_bytes // max(bytes_per_set, 1))
    return max(1, min(max(need, min_sets), max_sets, fit))


class Rotating:
    """Zero-argument callable that calls ``fn(*arg_sets[i])``, cycling ``i`` each call.

    Pre-build several input sets (see :func:`num_input_sets`) so consecutive timed calls
    read different memory and L2 does not flatter.
    """

    def __init__(self, fn: Callable[..., Any], arg_sets: Sequence[Sequence[Any]]) -> None:
        if not arg_sets:
            raise ValueError("Rotating needs at least one argument set")
        self.fn = fn
        self.arg_sets = list(arg_sets)
        self.i = 0

    def __call__(self) -> Any:
        args = self.arg_sets[self.i]
        self.i = (self.i + 1) % len(self.arg_sets)
        return self.fn(*args)


def parse_settings(text: str, form: str) -> list[tuple[int, ...]]:
    """``"4x32,8x8"`` -> [(4, 32), (8, 8)]: comma-separated settings of as many ``x``-joined
    integers as ``form`` (e.g. ``"WARPSxPROGRAMS_PER_SM"``) names; ``ValueError`` names the
    form otherwise."""
    fields = len(form.split("x"))
    out = []
    for item in text.split(","):
        values = item.split("x")
        if len(values) != fields or not all(v.isdigit() for v in values):
            raise ValueError(f"{item!r} is not {form}")
        out.append(tuple(int(v) for v in values))
    return out


#: DESIGN.md section 8: what a row's ``pass`` may be
PASSES = ("fwd", "bwd", "fwd+bwd", "quant", "decode", "prefill", "e2e", "copy")


def write_results(name: str, rows: list[dict], extra: dict | None = None) -> Path:
    """Write ``<results_dir>/<name>.json`` in the DESIGN.md section-8 shape; return path.

    Top level: ``benchmark, gpu, torch, triton, date, rows`` plus ``cuda``, ``libraries``
    (:func:`library_versions`: the baselines' and ours) and ``extra``. A row with a ``pass``
    that is not one of :data:`PASSES` is refused before anything is written (rows without
    one, e.g. the numerics scripts' accuracy rows, are not timings).
    """
    for row in rows:
        if "pass" in row and row["pass"] not in PASSES:
            raise ValueError(f"{name}: row pass {row['pass']!r} is not one of {PASSES}")
    env = env_info()
    doc: dict[str, Any] = {
        "benchmark": name,
        "gpu": env["gpu"],
        "torch": env["torch"],
        "triton": env["triton"],
        "date": env["date"],
        "cuda": env["cuda"],
        "libraries": library_versions(),
    }
    doc.update(extra or {})
    doc["rows"] = [_json_safe(r) for r in rows]
    path = results_dir() / f"{name}.json"
    path.write_text(json.dumps(doc, indent=1) + "\n")
    print(f"wrote {path}")
    return path


def cuda_kernel_times(call: Callable[[], object], reps: int = 20) -> dict[str, float]:
    """Mean GPU microseconds per call of each CUDA kernel ``call`` launches (torch.profiler,
    no CUDA graph; one call first, outside the profile), by kernel name (``per_launch``)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    call()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            call()
        torch.cuda.synchronize()
    launches = [
        (event.time_range.start, event.name, event.device_time)
        for event in prof.events()
        if event.device_type == torch.autograd.DeviceType.CUDA
    ]
    return per_launch([(name, us) for _, name, us in sorted(launches)], reps)


def per_launch(launches: list[tuple[str, float]], reps: int) -> dict[str, float]:
    """Mean microseconds per call by kernel name (its first 90 characters), from ``(name,
    µs)`` in launch order over ``reps`` calls; a kernel launched n > 1 times per call (the
    same name, e.g. the two passes of the d = 256 CuTe backward) is split by launch order
    within the call: ``name #1`` .. ``name #n``."""
    counts: dict[str, int] = {}
    for name, _ in launches:
        counts[name[:90]] = counts.get(name[:90], 0) + 1
    seen: dict[str, int] = {}
    totals: dict[str, float] = {}
    for name, us in launches:
        name = name[:90]
        per_call = counts[name] // reps if counts[name] % reps == 0 else 1
        index = seen.get(name, 0)
        seen[name] = index + 1
        key = f"{name} #{index % per_call + 1}" if per_call > 1 else name
        totals[key] = totals.get(key, 0.0) + us / reps
    return totals


def _json_safe(obj: Any) -> Any:
    """Replace NaN / inf floats by None (strict JSON), recursively."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if isinstance(obj, dict):
        return {k: _json_safe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_json_safe(v) for v in obj]
    return obj


def _fmt(value: Any, digits: int) -> str:
    """Format a table cell: floats with ``digits`` decimals, None as '-'."""
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.{digits}f}"
    return str(value)


def print_table(rows: list[dict]) -> None:
    """Print rows as a plain-text table: workload/pass/impl/ms/tflops/speedup."""
    cells = [
        [
            _fmt(r.get("workload"), 0),
            _fmt(r.get("pass"), 0),
            _fmt(r.get("impl"), 0),
            _fmt(r.get("ms"), 4),
            _fmt(r.get("tflops"), 1),
            _fmt(r.get("speedup_vs_best_baseline"), 3),
        ]
        for r in rows
    ]
    widths = [max(len(h), *(len(c[i]) for c in cells)) for i, h in enumerate(TABLE_COLUMNS)]
    line = "  ".join(h.ljust(w) for h, w in zip(TABLE_COLUMNS, widths, strict=True))
    print(line)
    print("-" * len(line))
    for c in cells:
        print(
            "  ".join(
                v.rjust(w) if i >= 3 else v.ljust(w)
                for i, (v, w) in enumerate(zip(c, widths, strict=True))
            )
        )


def plot_rows(name: str, rows: list[dict], metric: str = "tflops") -> Path | None:
    """Grouped bar chart ``<results_dir>/<name>.png``: a group per workload, a bar per impl.

    Rows whose ``metric`` is None are left out. Returns None if matplotlib is missing.
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        print(f"plot skipped ({exc}); re-plot later with: python -m benchmarks.common plot")
        return None

    kept = [r for r in rows if r.get(metric) is not None]
    workloads = list(dict.fromkeys(r["workload"] for r in kept))
    passes = {r["impl"]: set() for r in kept}
    for r in kept:
        passes[r["impl"]].add(r["pass"])
    labels = list(dict.fromkeys(_bar_label(r, passes) for r in kept))
    value = {(r["workload"], _bar_label(r, passes)): r[metric] for r in kept}

    width = 0.8 / max(len(labels), 1)
    fig, ax = plt.subplots(figsize=(max(6.0, 1.2 * len(workloads) * max(len(labels), 1) / 3), 4.5))
    for j, label in enumerate(labels):
        xs = [i + (j - (len(labels) - 1) / 2) * width for i in range(len(workloads))]
        ys = [value.get((w, label), 0.0) for w in workloads]
        ax.bar(xs, ys, width=width, label=label)
    ax.set_xticks(range(len(workloads)))
    ax.set_xticklabels(workloads)
    ax.set_ylabel(metric)
    ax.set_title(name)
    top = max((r[metric] for r in kept), default=1.0)
    ax.set_ylim(0, 1.3 * top)  # headroom so the legend does not cover bars
    ax.legend(fontsize="small", ncol=3, loc="upper left")
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    path = results_dir() / f"{name}.png"
    fig.savefig(path, dpi=120)
    plt.close(fig)
    print(f"wrote {path}")
    return path


def _bar_label(row: dict, passes: dict[str, set]) -> str:
    """Impl name, with the pass appended when one impl appears under several passes."""
    if len(passes[row["impl"]]) > 1:
        return f"{row['impl']} ({row['pass']})"
    return row["impl"]


def _main(argv: list[str]) -> int:
    """``plot FILE.json [metric]``: re-draw a results file's PNG into :func:`results_dir`."""
    if len(argv) < 2 or argv[0] != "plot":
        print("usage: python -m benchmarks.common plot RESULTS.json [metric]")
        return 2
    doc = json.loads(Path(argv[1]).read_text())
    plot_rows(doc["benchmark"], doc["rows"], argv[2] if len(argv) > 2 else "tflops")
    return 0


def positive_int(text: str) -> int:
    """argparse ``type`` of a count of at least 1 (``--rounds``): a clear error otherwise."""
    import argparse

    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {value}")
    return value


def in_rounds(bench: Callable[[list], list[dict]], items: list, rounds: int) -> list[dict]:
    """``bench(items)`` ``rounds`` times, the items (impls) in reverse order every other
    round, rows merged by :func:`merge_rounds`. Whichever impl is timed first right after a
    long call runs slower for a while (H100, 2026-12-06: W4 after W3 12–17% for both flamia
    and FA4, the 700 W power cap; ``benchmarks/NOTES.md``): with two or more rounds each impl
    is also timed last."""
    return merge_rounds([bench(items if r % 2 == 0 else items[::-1]) for r in range(rounds)])


def merge_rounds(rounds: list[list[dict]]) -> list[dict]:
    """One row per (workload, pass, impl) of several rounds' rows: ``ms``, ``graph_ms`` and
    ``ms_clean_l2`` the medians over rounds (``ms_rounds`` keeps each ``ms``), ``ms_p20`` /
    ``ms_p80`` the lowest and highest of the rounds', TFLOP/s and GB/s rescaled to the median
    ``ms``; the other fields are the first round's. One round: its rows as they are."""
    if len(rounds) == 1:
        return rounds[0]
    groups: dict[tuple, list[dict]] = {}
    for rows in rounds:
        for row in rows:
            groups.setdefault((row["workload"], row["pass"], row["impl"]), []).append(row)
    merged = []
    for same in groups.values():
        row = dict(same[0])
        row["ms"] = statistics.median(r["ms"] for r in same)
        row["ms_rounds"] = [r["ms"] for r in same]
        row["ms_p20"] = min(r.get("ms_p20", r["ms"]) for r in same)
        row["ms_p80"] = max(r.get("ms_p80", r["ms"]) for r in same)
        for key in ("tflops", "gbps"):
            if row.get(key):
                row[key] *= same[0]["ms"] / row["ms"]
        for key in ("graph_ms", "ms_clean_l2"):
            values = [r[key] for r in same if r.get(key)]
            if values:
                row[key] = statistics.median(values)
        if row.get("graph_tflops"):
            row["graph_tflops"] *= same[0]["graph_ms"] / row["graph_ms"]
        merged.append(row)
    return merged


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
