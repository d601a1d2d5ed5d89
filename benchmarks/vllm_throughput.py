"""vLLM offline throughput of a Llama-3-8B-shaped model: flamia vs built-in backends.

Model: 32 layers, hidden 4096, 32/8 heads, d=128, FFN 14336, vocab 128256, BF16, dummy
weights (``load_format="dummy"``, no download). Every engine gets the same KV cache memory
(``--kv-gib``), so the cache dtype decides how many tokens fit; full CUDA graphs for decode
batches (``FULL_DECODE_ONLY``, no torch.compile) for every backend alike.

Workloads (sized down from the issue's to fit the session's GPU budget; the JSON records
exactly what ran):

* ``a`` — ``--a-requests`` requests × ``--a-in`` input / ``--a-out`` output tokens, all
  submitted at once (compute-bound while the cache holds them all);
* ``b`` — ``--b-requests`` × ``--b-in`` / ``--b-out``: more tokens than the cache holds,
  so the cache bounds the batch (KV-capacity-bound).

Rows: ``{"workload", "pass": "e2e", "impl": "<backend>-<kv dtype>", "output_tok_s",
"kv_tokens", "ms", ...}``. Each config runs in its own process (one engine per process);
configs past ``--budget-s`` are skipped and listed under ``skipped``.

    python benchmarks/vllm_throughput.py [--configs flamia-nvfp4,flash_attn-fp8,...]
    python benchmarks/vllm_throughput.py --plot benchmarks/results/vllm_throughput.json
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
    "flamia-auto": ("FLAMIA", "auto"),
    "triton_attn-fp8_per_token_head": ("TRITON_ATTN", "fp8_per_token_head"),
    "flash_attn-auto": ("FLASH_ATTN", "auto"),
}
CAPTURE_SIZES = [1, 2, 4, 8, 16, 32, 64, 96, 128, 192, 256, 320, 384, 448, 512]


def _prompts(n: int, length: int, seed: int) -> list:
    import torch
    from vllm.inputs import TokensPrompt

    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1000, 120000, (n, length), generator=g)
    return [TokensPrompt(prompt_token_ids=row.tolist()) for row in ids]


def run_one(impl: str, args: argparse.Namespace) -> dict:
    """One engine, warm-up, then workloads a and b; returns rows and engine facts."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    import flamia_serve.backend
    from flamia_serve.backend.demo import write_model_config

    flamia_serve.backend.register()
    from vllm import LLM, SamplingParams

    backend, kv_dtype = CONFIGS[impl]
    model = write_model_config(Path(tempfile.mkdtemp()) / "llama3-8b-shape", LLAMA3_8B)
    t0 = time.time()
    settings = dict(attention_backend=backend, kv_cache_dtype=kv_dtype, load_format="dummy",
                    skip_tokenizer_init=True, seed=0, max_model_len=args.max_model_len,
                    max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.batched_tokens,
                    enable_prefix_caching=False, kv_cache_memory_bytes=int(args.kv_gib * 2**30),
                    gpu_memory_utilization=0.9,
                    compilation_config={"mode": 0, "cudagraph_mode": "FULL_DECODE_ONLY",
                                        "cudagraph_capture_sizes": CAPTURE_SIZES})  # fmt: skip
    llm = LLM(model=str(model), **settings)
    cfg = llm.llm_engine.vllm_config
    kv_tokens = cfg.cache_config.num_gpu_blocks * cfg.cache_config.block_size
    facts = {"impl": impl, "startup_s": round(time.time() - t0, 1), "kv_tokens": kv_tokens,
             "cudagraph_mode": str(cfg.compilation_config.cudagraph_mode),
             "settings": settings}  # fmt: skip
    # warm-up: JIT-compiles every kernel variant (prefill chunks, mixed steps, decodes)
    warm = SamplingParams(max_tokens=16, ignore_eos=True, detokenize=False, temperature=0.0)
    llm.generate(_prompts(16, 700, 99), warm, use_tqdm=False)
    rows = []
    for wl, n, lin, lout in (("a", args.a_requests, args.a_in, args.a_out),
                             ("b", args.b_requests, args.b_in, args.b_out)):  # fmt: skip
        prompts = _prompts(n, lin, 1 if wl == "a" else 2)
        sp = SamplingParams(max_tokens=lout, ignore_eos=True, detokenize=False, temperature=0.0)
        t = time.perf_counter()
        outs = llm.generate(prompts, sp, use_tqdm=False)
        dt = time.perf_counter() - t
        out_tokens = sum(len(o.outputs[0].token_ids) for o in outs)
        rows.append({"workload": wl, "pass": "e2e", "impl": impl, "ms": round(dt * 1e3, 1),
                     "tflops": None, "gbps": None,
                     "output_tok_s": round(out_tokens / dt, 1),
                     "total_tok_s": round((out_tokens + n * lin) / dt, 1),
                     "kv_tokens": kv_tokens, "requests": n, "input_len": lin, "output_len": lout,
                     "output_tokens": out_tokens,
                     "kv_bound": kv_tokens < n * (lin + lout)})  # fmt: skip
        print(rows[-1], flush=True)
    return {"facts": facts, "rows": rows}


def plot(path: Path) -> Path | None:
    """Bars of output tok/s per workload and impl, KV tokens in the legend."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    doc = json.loads(path.read_text())
    rows = doc["rows"]
    impls = list(dict.fromkeys(r["impl"] for r in rows))
    wls = sorted({r["workload"] for r in rows})
    fig, ax = plt.subplots(figsize=(9, 4.5))
    width = 0.8 / max(len(impls), 1)
    for i, impl in enumerate(impls):
        vals = [next((r["output_tok_s"] for r in rows if r["impl"] == impl
                      and r["workload"] == w), 0) for w in wls]  # fmt: skip
        kv = next(r["kv_tokens"] for r in rows if r["impl"] == impl)
        ax.bar([j + i * width for j in range(len(wls))], vals, width,
               label=f"{impl} ({kv / 1000:.0f}k KV tokens)")  # fmt: skip
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(wls))])
    ax.set_xticklabels([f"({w}) " + next(f"{r['requests']}x{r['input_len']}/{r['output_len']}"
                                         for r in rows if r["workload"] == w) for w in wls])
    ax.set_ylabel("output tokens / s")
    ax.set_title(f"vLLM {doc.get('vllm', '')} Llama-3-8B shape, {doc.get('gpu', '')}, "
                 f"{doc.get('date', '')}")  # fmt: skip
    ax.legend(fontsize=8)
    fig.tight_layout()
    out = path.with_suffix(".png")
    fig.savefig(out, dpi=120)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--configs", default="flamia-nvfp4,flash_attn-fp8,flamia-fp8_per_token_head,"
                   "flamia-auto")  # fmt: skip
    p.add_argument("--a-requests", type=int, default=256)
    p.add_argument("--a-in", type=int, default=512)
    p.add_argument("--a-out", type=int, default=128)
    p.add_argument("--b-requests", type=int, default=384)
    p.add_argument("--b-in", type=int, default=512)
    p.add_argument("--b-out", type=int, default=512)
    p.add_argument("--kv-gib", type=float, default=10.0)
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--max-num-seqs", type=int, default=512)
    p.add_argument("--batched-tokens", type=int, default=8192)
    p.add_argument("--budget-s", type=float, default=1e9, help="skip configs past this")
    p.add_argument("--per-config-s", type=float, default=150)
    p.add_argument("--one", help=argparse.SUPPRESS)
    p.add_argument("--one-out", help=argparse.SUPPRESS)
    p.add_argument("--plot", type=Path, help="only re-plot a results JSON")
    args = p.parse_args(argv)
    if args.plot:
        print(plot(args.plot))
        return 0
    if args.one:
        try:
            res = run_one(args.one, args)
        except Exception:
            res = {"error": traceback.format_exc()[-4000:]}
        Path(args.one_out).write_text(json.dumps(res))
        return 0
    from benchmarks.common import env_info, results_dir

    doc: dict = {"benchmark": "vllm_throughput", **env_info(), "model": LLAMA3_8B,
                 "workloads": {k: v for k, v in vars(args).items()
                               if k not in ("one", "one_out", "plot")},
                 "rows": [], "engines": [], "errors": {}, "skipped": []}  # fmt: skip
    out = results_dir() / "vllm_throughput.json"
    t0 = time.time()
    for impl in args.configs.split(","):
        left = args.budget_s - (time.time() - t0)
        if left < args.per_config_s * 0.6:
            doc["skipped"].append(impl)
            continue
        tmp = Path(tempfile.mkdtemp()) / "one.json"
        cmd = [sys.executable, __file__, "--one", impl, "--one-out", str(tmp),
               *[a for a in (argv if argv is not None else sys.argv[1:])]]  # fmt: skip
        try:
            subprocess.run(cmd, timeout=min(left, args.per_config_s * 1.5), check=False)
            res = json.loads(tmp.read_text())
        except Exception:
            res = {"error": traceback.format_exc()[-2000:]}
        if "error" in res:
            doc["errors"][impl] = res["error"]
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
              f"kv {r['kv_tokens']}")  # fmt: skip
    print("errors:", list(doc["errors"]), "skipped:", doc["skipped"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
