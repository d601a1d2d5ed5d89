"""vLLM offline throughput of a Llama-3-8B-shaped model: flamia vs built-in backends.

Model: 32 layers, hidden 4096, 32/8 heads, d=128, FFN 14336, vocab 128256, BF16, dummy
weights (``load_format="dummy"``, no download). Within a workload every engine gets the
same KV cache memory (``--{a,b}-kv-gib``), so the cache dtype decides how many tokens fit;
full CUDA graphs for decode batches (``FULL_DECODE_ONLY``, no torch.compile) for every
backend alike.

Workloads (issue 12; the JSON records exactly what ran):

* ``a`` — ``--a-requests`` requests × ``--a-in`` input / ``--a-out`` output tokens, all
  submitted at once, with enough KV memory for all of them in every cache dtype
  (compute- and bandwidth-bound);
* ``b`` — ``--b-requests`` × ``--b-in`` / ``--b-out`` with a small KV memory: the cache, not
  compute, bounds the batch (KV-capacity-bound).

Each (config, workload) runs in its own process (one engine per process): start-up, a
warm-up with the workload's shapes (it compiles every kernel variant), then the timed run.
Triton JIT compiles and CuTe compiles during warm-up and timed run are counted (a compile
in the timed run is a stall a serving engine would see; ``compiles``), and for flamia which
kernels served (``launches``) and any CuTe fast-path failure (``cute_failures``).

Rows: ``{"workload", "pass": "e2e", "impl": "<backend>-<kv dtype>", "output_tok_s",
"kv_tokens", "ms", ...}``; configs past ``--budget-s`` are skipped and listed under
``skipped``.

    python benchmarks/vllm_throughput.py [--workloads a,b] [--configs flamia-nvfp4,...]
    python benchmarks/vllm_throughput.py --plot benchmarks/results/vllm_throughput.json
    python benchmarks/vllm_throughput.py --merge a.json b.json   # -> vllm_throughput.json
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

LLAMA3_8B = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096,
    "intermediate_size": 14336, "num_attention_heads": 32, "num_key_value_heads": 8,
    "head_dim": 128, "num_hidden_layers": 32, "vocab_size": 128256,
    "max_position_embeddings": 8192, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
    "torch_dtype": "bfloat16", "bos_token_id": 1, "eos_token_id": 2, "tie_word_embeddings": False,
}  # fmt: skip
#: impl name -> (--attention-backend, --kv-cache-dtype), in priority order
CONFIGS = {
    "flamia-nvfp4": ("FLAMIA", "nvfp4"),
    "flash_attn-fp8": ("FLASH_ATTN", "fp8"),
    "flamia-fp8_per_token_head": ("FLAMIA", "fp8_per_token_head"),
    "triton_attn-fp8_per_token_head": ("TRITON_ATTN", "fp8_per_token_head"),
    "flamia-auto": ("FLAMIA", "auto"),
    "flash_attn-auto": ("FLASH_ATTN", "auto"),
}
CAPTURE_SIZES = [1, 2, 4, 8, 16, 32, 64, 96, 128, 192, 256, 320, 384, 448, 512]
WORKLOAD_ARGS = ("requests", "in", "out", "kv_gib")


def _prompts(n: int, length: int, seed: int) -> list:
    import torch
    from vllm.inputs import TokensPrompt

    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1000, 120000, (n, length), generator=g)
    return [TokensPrompt(prompt_token_ids=row.tolist()) for row in ids]


def workload(args: argparse.Namespace, name: str) -> dict:
    """``{"requests", "in", "out", "kv_gib"}`` of workload ``name`` from the arguments."""
    return {k: getattr(args, f"{name}_{k}") for k in WORKLOAD_ARGS}


def run_one(impl: str, wl: str, args: argparse.Namespace) -> dict:
    """One engine for workload ``wl``: start-up, warm-up, the timed run; rows and facts."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    import flamia_serve.backend
    from benchmarks.common import JitCompiles, flamia_kernel_facts
    from flamia_serve.backend.demo import write_model_config

    flamia_serve.backend.register()
    from vllm import LLM, SamplingParams

    backend, kv_dtype = CONFIGS[impl]
    w = workload(args, wl)
    model = write_model_config(Path(tempfile.mkdtemp()) / "llama3-8b-shape", LLAMA3_8B)
    t0 = time.time()
    settings = dict(attention_backend=backend, kv_cache_dtype=kv_dtype, load_format="dummy",
                    skip_tokenizer_init=True, seed=0, max_model_len=w["in"] + w["out"] + 64,
                    max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.batched_tokens,
                    enable_prefix_caching=False, kv_cache_memory_bytes=int(w["kv_gib"] * 2**30),
                    gpu_memory_utilization=0.9,
                    compilation_config={"mode": 0, "cudagraph_mode": "FULL_DECODE_ONLY",
                                        "cudagraph_capture_sizes": CAPTURE_SIZES})  # fmt: skip
    with JitCompiles() as startup_jit:
        llm = LLM(model=str(model), **settings)
    cfg = llm.llm_engine.vllm_config
    kv_tokens = cfg.cache_config.num_gpu_blocks * cfg.cache_config.block_size
    facts = {"impl": impl, "workload": wl, "startup_s": round(time.time() - t0, 1),
             "kv_tokens": kv_tokens, "cudagraph_mode": str(cfg.compilation_config.cudagraph_mode),
             "settings": settings, "compiles": {"startup": startup_jit.summary()}}  # fmt: skip
    # warm-up with the workload's shapes: full prefill chunks, mixed steps, decode batches of
    # every size class (it JIT-compiles what the timed run needs)
    t1 = time.time()
    warm = SamplingParams(max_tokens=24, ignore_eos=True, detokenize=False, temperature=0.0)
    with JitCompiles() as warm_jit:
        llm.generate(_prompts(min(w["requests"], 48), w["in"], 99), warm, use_tqdm=False)
        llm.generate(_prompts(3, w["in"] // 3, 98), warm, use_tqdm=False)
    facts["warmup_s"] = round(time.time() - t1, 1)
    facts["compiles"]["warmup"] = warm_jit.summary()
    prompts = _prompts(w["requests"], w["in"], 1 if wl == "a" else 2)
    sp = SamplingParams(max_tokens=w["out"], ignore_eos=True, detokenize=False, temperature=0.0)
    with JitCompiles() as run_jit:
        t = time.perf_counter()
        outs = llm.generate(prompts, sp, use_tqdm=False)
        dt = time.perf_counter() - t
    facts["compiles"]["timed"] = run_jit.summary()
    facts |= flamia_kernel_facts()
    out_tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    n, lin = w["requests"], w["in"]
    row = {"workload": wl, "pass": "e2e", "impl": impl, "ms": round(dt * 1e3, 1),
           "tflops": None, "gbps": None, "output_tok_s": round(out_tokens / dt, 1),
           "total_tok_s": round((out_tokens + n * lin) / dt, 1), "kv_tokens": kv_tokens,
           "kv_gib": w["kv_gib"], "requests": n, "input_len": lin, "output_len": w["out"],
           "output_tokens": out_tokens, "kv_bound": kv_tokens < n * (lin + w["out"]),
           "timed_compiles": run_jit.total}  # fmt: skip
    print(row, flush=True)
    return {"facts": facts, "rows": [row]}


def plot(path: Path) -> Path | None:
    """Bars of output tok/s per workload and impl, each labelled with its KV tokens."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    doc = json.loads(path.read_text())
    rows = doc["rows"]
    if not rows:
        return None
    impls = list(dict.fromkeys(r["impl"] for r in rows))
    wls = sorted({r["workload"] for r in rows})
    fig, ax = plt.subplots(figsize=(10, 4.8))
    width = 0.8 / max(len(impls), 1)
    for i, impl in enumerate(impls):
        for j, w in enumerate(wls):
            row = next((r for r in rows if r["impl"] == impl and r["workload"] == w), None)
            if row is None:
                continue
            x = j + i * width
            ax.bar(x, row["output_tok_s"], width, color=f"C{i}", label=impl if j == 0 else None)
            ax.text(x, row["output_tok_s"], f"{row['kv_tokens'] / 1000:.0f}k", ha="center",
                    va="bottom", fontsize=6)  # fmt: skip
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(wls))])
    ax.set_xticklabels([f"({w}) " + next(f"{r['requests']}x{r['input_len']}/{r['output_len']}, "
                                         f"{r.get('kv_gib', '?')} GiB KV"
                                         for r in rows if r["workload"] == w) for w in wls])
    ax.set_ylabel("output tokens / s (bar label: KV tokens)")
    ax.set_title(f"vLLM {doc.get('vllm', '')} Llama-3-8B shape, {doc.get('gpu', '')}, "
                 f"{doc.get('date', '')}")  # fmt: skip
    ax.legend(fontsize=8)
    fig.tight_layout()
    out = path.with_suffix(".png")
    fig.savefig(out, dpi=120)
    return out


def merge(paths: list[Path]) -> dict:
    """One results document from runs of this script (e.g. one device call per workload):
    rows and engines concatenated in order, an error dropped where a later run measured
    that (impl, workload), environment and settings of each source kept under ``runs``."""
    docs = [json.loads(p.read_text()) for p in paths]
    env_keys = ("gpu", "torch", "triton", "cuda", "date", "vllm")
    out: dict = {"benchmark": "vllm_throughput", **{k: docs[0].get(k) for k in env_keys},
                 "model": docs[0]["model"], "workloads": {}, "rows": [], "engines": [],
                 "errors": {}, "skipped": [], "runs": []}  # fmt: skip
    for path, doc in zip(paths, docs, strict=True):
        if {k: doc.get(k) for k in env_keys[:4]} != {k: out[k] for k in env_keys[:4]}:
            raise ValueError(f"{path}: another GPU or versions than {paths[0]}")
        out["workloads"] |= doc["workloads"]
        out["rows"] += doc["rows"]
        out["engines"] += doc["engines"]
        out["errors"] |= doc["errors"]
        out["skipped"] += doc["skipped"]
        out["runs"].append({"file": path.name, "date": doc.get("date"),
                            "total_s": doc.get("total_s"), "settings": doc.get("settings")})
    measured = {f"{r['impl']}/{r['workload']}" for r in out["rows"]}
    out["errors"] = {k: v for k, v in out["errors"].items() if k not in measured}
    out["skipped"] = [k for k in out["skipped"] if k not in measured]
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--configs", default=",".join(CONFIGS))
    p.add_argument("--workloads", default="a,b")
    for name, (n, lin, lout, gib) in {"a": (256, 1024, 1024, 72.0),
                                      "b": (96, 4096, 1024, 8.0)}.items():  # fmt: skip
        p.add_argument(f"--{name}-requests", type=int, default=n)
        p.add_argument(f"--{name}-in", type=int, default=lin)
        p.add_argument(f"--{name}-out", type=int, default=lout)
        p.add_argument(f"--{name}-kv-gib", type=float, default=gib)
    p.add_argument("--max-num-seqs", type=int, default=512)
    p.add_argument("--batched-tokens", type=int, default=8192)
    p.add_argument("--budget-s", type=float, default=1e9, help="skip runs past this")
    p.add_argument("--per-run-s", type=float, default=150, help="time limit of one run")
    p.add_argument("--name", default="vllm_throughput", help="results file name (no suffix)")
    p.add_argument("--one", help=argparse.SUPPRESS)
    p.add_argument("--one-workload", help=argparse.SUPPRESS)
    p.add_argument("--one-out", help=argparse.SUPPRESS)
    p.add_argument("--plot", type=Path, help="only re-plot a results JSON")
    p.add_argument("--merge", type=Path, nargs="+", help="only merge results JSONs into "
                   "--name (same GPU and versions) and plot it")  # fmt: skip
    args = p.parse_args(argv)
    if args.plot:
        print(plot(args.plot))
        return 0
    if args.merge:
        from benchmarks.common import results_dir

        out = results_dir() / f"{args.name}.json"
        out.write_text(json.dumps(merge(args.merge), indent=1))
        print(out, plot(out))
        return 0
    if args.one:
        try:
            res = run_one(args.one, args.one_workload, args)
        except Exception:
            res = {"error": traceback.format_exc()[-4000:]}
        Path(args.one_out).write_text(json.dumps(res))
        return 0
    from benchmarks.common import env_info, results_dir

    workloads = args.workloads.split(",")
    doc: dict = {"benchmark": args.name, **env_info(), "model": LLAMA3_8B,
                 "workloads": {w: workload(args, w) for w in workloads},
                 "settings": {k: v for k, v in vars(args).items()
                              if k not in ("one", "one_workload", "one_out", "plot")},
                 "rows": [], "engines": [], "errors": {}, "skipped": []}  # fmt: skip
    out = results_dir() / f"{args.name}.json"
    t0 = time.time()
    for wl in workloads:
        for impl in args.configs.split(","):
            left = args.budget_s - (time.time() - t0)
            if left < args.per_run_s * 0.5:
                doc["skipped"].append(f"{impl}/{wl}")
                continue
            tmp = Path(tempfile.mkdtemp()) / "one.json"
            passed = argv if argv is not None else sys.argv[1:]
            cmd = [sys.executable, __file__, "--one", impl, "--one-workload", wl,
                   "--one-out", str(tmp), *passed]  # fmt: skip
            try:
                subprocess.run(cmd, timeout=min(left, args.per_run_s), check=False)
                res = json.loads(tmp.read_text())
            except Exception:
                res = {"error": traceback.format_exc()[-2000:]}
            if "error" in res:
                doc["errors"][f"{impl}/{wl}"] = res["error"]
            else:
                doc["rows"] += res["rows"]
                doc["engines"].append(res["facts"])
            try:
                doc["vllm"] = importlib.metadata.version("vllm")
            except importlib.metadata.PackageNotFoundError:
                pass
            out.write_text(json.dumps(doc, indent=1))
    doc["total_s"] = round(time.time() - t0, 1)
    out.write_text(json.dumps(doc, indent=1))
    plot(out)
    for r in doc["rows"]:
        print(f"{r['workload']} {r['impl']:34s} {r['output_tok_s']:>10.1f} tok/s  "
              f"kv {r['kv_tokens']}  timed compiles {r['timed_compiles']}")  # fmt: skip
    print("errors:", list(doc["errors"]), "skipped:", doc["skipped"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
