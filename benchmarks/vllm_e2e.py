"""End-to-end checks of ``--attention-backend flamia`` in vLLM 0.26 on the GPU (issue 12).

One process, engines one after another (``VLLM_ENABLE_V1_MULTIPROCESSING=0``), a small
Llama (6 layers, 8/2 heads, d=128, hidden 1024) whose dummy weights are replaced by random
normal weights (std 0.02, norms 1) with a fixed seed, chunked prefill with a 1024-token
budget, prompts sharing a 1000-token prefix (the setup of ``notes/vllm.md``):

* ``accuracy`` — teacher-forced prompt log-probs and 32 greedy tokens of flamia (``auto``,
  ``fp8_per_token_head``, ``nvfp4``, ``fp8``) against FLASH_ATTN with a BF16 cache, and of
  TRITON_ATTN with a BF16 cache beside them (how far two built-in backends differ);
* ``copy`` — greedy tokens of a trained model whose next token is certain and comes from
  attention over the whole context (``benchmarks/copy_model.py``: trained here, ~10 s):
  every backend and cache against FLASH_ATTN ``auto`` and against the correct continuation;
* ``prefix`` — prefix caching on: the same greedy batch twice (the second hits the cache),
  identical-output rate for flamia and FLASH_ATTN;
* ``preemption`` — a KV cache of 80 blocks and 24 requests of 200 + 96 tokens: every request
  finishes with all its tokens; tokens against an unconstrained engine;
* ``cudagraph`` — full CUDA graphs for decode batches (``FULL_DECODE_ONLY``) against eager;
* ``serve`` — ``vllm serve --attention-backend flamia`` answers a completion on loopback
  (needs the ``vllm-serve`` bundle; the plugin is found through its entry point).

    python benchmarks/vllm_e2e.py [--parts accuracy,copy,prefix,preemption,cudagraph,serve]

Writes ``vllm_e2e.json`` under ``$FLAMIA_RESULTS_DIR`` (default ``benchmarks/results``)
after every part; each flamia engine's entry says which kernels served (``flamia``:
launches by kind, CuTe fast-path failures).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import subprocess
import sys
import tempfile
import time
import traceback
import urllib.request
from collections.abc import Callable
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

from benchmarks.common import flamia_kernel_facts
from flamia_serve.backend.demo import SMALL_LLAMA as DEMO_LLAMA
from flamia_serve.backend.demo import randomize_weights, write_model_config

ROOT = Path(__file__).resolve().parents[1]
# the demo's model with 4k positions
SMALL_LLAMA = {**DEMO_LLAMA, "max_position_embeddings": 4096}
WEIGHT_STD = 0.02


def write_entry_point(site: Path) -> Path:
    """A dist-info directory declaring the ``vllm.general_plugins`` entry point, so vLLM's
    subprocesses find the plugin without installing the package (put ``site`` and the repo
    root on ``PYTHONPATH``)."""
    info = site / "flamia_serve_plugin-0.0.0.dist-info"
    info.mkdir(parents=True, exist_ok=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: flamia-serve-plugin\n"
                                   "Version: 0.0.0\n")  # fmt: skip
    (info / "entry_points.txt").write_text(
        "[vllm.general_plugins]\nflamia = flamia_serve.backend:register\n")
    return site


class Engines:
    """Builds engines with common settings and keeps their outputs."""

    def __init__(self, model: Path) -> None:
        self.model = model
        self.results: dict = {"engines": {}}

    def make(self, name: str, backend: str, kv_cache_dtype: str, *,
             weights: Callable[[object], object] | None = None, **kw: object):  # fmt: skip
        """An engine whose dummy weights ``weights(model)`` replaces on the worker (default:
        N(0, ``WEIGHT_STD``) with a fixed seed)."""
        from vllm import LLM

        t0 = time.time()
        args = dict(model=str(self.model), attention_backend=backend,
                    kv_cache_dtype=kv_cache_dtype, load_format="dummy", skip_tokenizer_init=True,
                    seed=0, gpu_memory_utilization=0.08, max_model_len=2048,
                    max_num_batched_tokens=1024, enable_chunked_prefill=True,
                    enable_prefix_caching=True, enforce_eager=True, max_num_seqs=64,
                    disable_log_stats=False) | kw  # fmt: skip
        llm = LLM(**args)
        weights = weights or functools.partial(randomize_weights, seed=0, std=WEIGHT_STD)
        params = llm.apply_model(weights)
        llm.reset_prefix_cache()
        cfg = llm.llm_engine.vllm_config
        blocks = cfg.cache_config.num_gpu_blocks
        self.results["engines"][name] = {
            "backend": backend, "kv_cache_dtype": kv_cache_dtype,
            "settings": {k: v for k, v in args.items() if k != "model"},
            "startup_s": round(time.time() - t0, 1), "params": params[0] if params else None,
            "kv_tokens": blocks * cfg.cache_config.block_size if blocks else None,
            "cudagraph_mode": str(cfg.compilation_config.cudagraph_mode),
        }  # fmt: skip
        return llm


def prompts_shared_prefix(n: int, seed: int = 1) -> list[list[int]]:
    import torch

    g = torch.Generator().manual_seed(seed)
    prefix = torch.randint(100, 31000, (1000,), generator=g).tolist()
    lens = torch.randint(24, 200, (n,), generator=g).tolist()
    return [prefix + torch.randint(100, 31000, (k,), generator=g).tolist() for k in lens]


def random_prompts(n: int, length: int, seed: int) -> list[list[int]]:
    import torch

    g = torch.Generator().manual_seed(seed)
    return [torch.randint(100, 31000, (length,), generator=g).tolist() for _ in range(n)]


def generate(llm, prompts: list[list[int]], max_tokens: int, *, prompt_logprobs: bool = False,
             logprobs: bool = False) -> list[dict]:  # fmt: skip
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, detokenize=False,
                        prompt_logprobs=1 if prompt_logprobs else None,
                        logprobs=1 if logprobs else None)  # fmt: skip
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], sp, use_tqdm=False)
    rows = []
    for p, o in zip(prompts, outs, strict=True):
        c = o.outputs[0]
        row = {"tokens": list(c.token_ids), "finish": c.finish_reason,
               "cached": getattr(o, "num_cached_tokens", None)}  # fmt: skip
        if prompt_logprobs:
            row["prompt_lp"] = [None if d is None else float(d[t].logprob)
                                for t, d in zip(p, o.prompt_logprobs, strict=True)]  # fmt: skip
        if logprobs:
            row["lp"] = [float(d[t].logprob) for t, d in zip(c.token_ids, c.logprobs,
                                                             strict=True)]  # fmt: skip
        rows.append(row)
    return rows


def compare_tokens(a: list[dict], b: list[dict]) -> dict:
    """Token agreement of greedy outputs: identical requests, first divergence, agreement."""
    same, first, agree, total = 0, [], 0, 0
    for x, y in zip(a, b, strict=True):
        tx, ty = x["tokens"], y["tokens"]
        same += tx == ty
        pairs = list(zip(tx, ty, strict=False))
        div = next((i for i, (u, v) in enumerate(pairs) if u != v), len(pairs))
        first.append(div)
        agree += sum(u == v for u, v in zip(tx, ty, strict=False))
        total += max(len(tx), len(ty))
    return {"identical_requests": same, "requests": len(a), "first_divergence": first,
            "token_agreement": round(agree / max(total, 1), 4)}  # fmt: skip


def compare_prompt_lp(a: list[dict], b: list[dict]) -> dict:
    diffs = [abs(u - v) for x, y in zip(a, b, strict=True)
             for u, v in zip(x["prompt_lp"], y["prompt_lp"], strict=True)
             if u is not None and v is not None]  # fmt: skip
    return {"mean_abs_dlogprob": round(sum(diffs) / len(diffs), 5),
            "max_abs_dlogprob": round(max(diffs), 5), "positions": len(diffs)}  # fmt: skip


def compare_lp(a: list[dict], b: list[dict]) -> dict:
    """Log-prob differences of generated tokens up to each pair's first divergence."""
    diffs = []
    for x, y in zip(a, b, strict=True):
        for u, v, tu, tv in zip(x["lp"], y["lp"], x["tokens"], y["tokens"], strict=False):
            if tu != tv:
                break
            diffs.append(abs(u - v))
    if not diffs:
        return {"mean_abs_dlogprob": None, "max_abs_dlogprob": None, "positions": 0}
    return {"mean_abs_dlogprob": round(sum(diffs) / len(diffs), 5),
            "max_abs_dlogprob": round(max(diffs), 5), "positions": len(diffs)}  # fmt: skip


def preemptions(llm) -> float | None:
    try:
        for m in llm.get_metrics():
            if m.name.endswith("num_preemptions"):
                return float(getattr(m, "value", 0.0))
    except Exception:
        return None
    return None


def run_engines(parts: set[str], results: dict, save) -> None:
    model = write_model_config(Path(tempfile.mkdtemp()) / "small-llama", SMALL_LLAMA)
    eng = Engines(model)
    results["engines"] = eng.results["engines"]
    shared = prompts_shared_prefix(8)
    out: dict[str, dict] = {}

    def step(name: str, fn) -> None:
        t0 = time.time()
        try:
            fn()
            results.setdefault("status", {})[name] = "ok"
        except Exception:
            results.setdefault("status", {})[name] = traceback.format_exc()[-3000:]
            print(results["status"][name], flush=True)
        results.setdefault("seconds", {})[name] = round(time.time() - t0, 1)
        save()

    def baseline_and_flamia(name: str, backend: str, dtype: str, **kw: object) -> None:
        llm = eng.make(name, backend, dtype, **kw)
        res = out[name] = {}
        if "accuracy" in parts:
            res["acc"] = generate(llm, shared, 32, prompt_logprobs=True)
        if "prefix" in parts:
            first = generate(llm, shared, 32)
            second = generate(llm, shared, 32)
            results.setdefault("prefix", {})[name] = compare_tokens(first, second) | {
                "cached_tokens_second_pass": sum(r["cached"] or 0 for r in second)}
        if name == "flamia-nvfp4" and {"preemption", "cudagraph"} & parts:
            res["preempt_ref"] = generate(llm, random_prompts(24, 200, 7), 96)
            res["graph_ref"] = generate(llm, random_prompts(4, 128, 9), 48, logprobs=True)
        eng.results["engines"][name]["flamia"] = flamia_kernel_facts()
        del llm

    order = [("flash_attn-auto", "FLASH_ATTN", "auto"), ("flamia-auto", "FLAMIA", "auto"),
             ("flamia-fp8_per_token_head", "FLAMIA", "fp8_per_token_head"),
             ("flamia-nvfp4", "FLAMIA", "nvfp4"), ("flamia-fp8", "FLAMIA", "fp8")]  # fmt: skip
    if {"accuracy", "prefix", "preemption", "cudagraph"} & parts:
        for name, backend, dtype in order[:4]:
            step(name, lambda n=name, b=backend, d=dtype: baseline_and_flamia(n, b, d))
    if "accuracy" in parts:  # two built-in backends against each other, for scale
        step("triton_attn-auto", lambda: baseline_and_flamia("triton_attn-auto", "TRITON_ATTN",
                                                             "auto"))  # fmt: skip
    if "accuracy" in parts and "acc" in out.get("flash_attn-auto", {}):
        acc = results["accuracy"] = {}
        for name in out:
            if name != "flash_attn-auto" and "acc" in out[name]:
                base = out["flash_attn-auto"]["acc"]
                acc[name] = compare_prompt_lp(out[name]["acc"], base) | compare_tokens(
                    out[name]["acc"], base)
        save()

    def graphs_and_preemption() -> None:
        llm = eng.make("flamia-nvfp4-cudagraph-small-kv", "FLAMIA", "nvfp4", enforce_eager=False,
                       compilation_config={"mode": 0, "cudagraph_mode": "FULL_DECODE_ONLY"},
                       num_gpu_blocks_override=80, max_model_len=1024)  # fmt: skip
        ref = out.get("flamia-nvfp4", {})
        if "cudagraph" in parts:
            got = generate(llm, random_prompts(4, 128, 9), 48, logprobs=True)
            cmp = {"requests": len(got)}
            if "graph_ref" in ref:
                cmp |= compare_tokens(got, ref["graph_ref"]) | compare_lp(got, ref["graph_ref"])
            results["cudagraph_vs_eager"] = cmp
            save()
        if "preemption" in parts:
            before = preemptions(llm)
            got = generate(llm, random_prompts(24, 200, 7), 96)
            after = preemptions(llm)
            res = {"requests": len(got), "finished_with_all_tokens":
                   sum(len(r["tokens"]) == 96 and r["finish"] == "length" for r in got),
                   "preemptions": None if after is None else after - (before or 0.0)}  # fmt: skip
            if "preempt_ref" in ref:
                res |= compare_tokens(got, ref["preempt_ref"])
            results["preemption"] = res
        del llm

    if {"preemption", "cudagraph"} & parts:
        step("graphs_and_preemption", graphs_and_preemption)
    if "accuracy" in parts:

        def static_fp8() -> None:
            baseline_and_flamia(*order[4])
            base = out["flash_attn-auto"]["acc"]
            results["accuracy"]["flamia-fp8"] = compare_prompt_lp(
                out["flamia-fp8"]["acc"], base) | compare_tokens(out["flamia-fp8"]["acc"], base)

        step("flamia-fp8", static_fp8)


COPY_ENGINES = [("flash_attn-auto", "FLASH_ATTN", "auto"),
                ("triton_attn-auto", "TRITON_ATTN", "auto"), ("flamia-auto", "FLAMIA", "auto"),
                ("flamia-fp8_per_token_head", "FLAMIA", "fp8_per_token_head"),
                ("flamia-nvfp4", "FLAMIA", "nvfp4"), ("flamia-fp8", "FLAMIA", "fp8"),
                ("flash_attn-fp8", "FLASH_ATTN", "fp8")]  # fmt: skip


def run_copy(results: dict, save) -> None:
    """Train the copy model, then greedy continuations of long periodic prompts (chunked
    prefill, many pages) from every engine: against FLASH_ATTN ``auto`` and the truth."""
    import torch

    from benchmarks.copy_model import COPY_LLAMA, copy_prompts, train_copy_model

    state, log = train_copy_model(device="cuda")
    torch.cuda.empty_cache()  # the trainer's memory, for the engines
    res = results["copy"] = {"model": COPY_LLAMA, "training": log, "engines": {}}
    save()
    prompts, expected = copy_prompts(12, min_length=200, max_length=1900, generate=96)
    res["prompt_lengths"] = [len(p) for p in prompts]
    model = write_model_config(Path(tempfile.mkdtemp()) / "copy-llama", COPY_LLAMA)
    eng = Engines(model)

    def load(m: object) -> int:
        m.load_weights(iter(state.items()))  # type: ignore[attr-defined]
        return sum(v.numel() for v in state.values())

    truth = [{"tokens": e} for e in expected]
    outs = {}
    for name, backend, dtype in COPY_ENGINES:
        try:
            # a tiny model: a small memory share each (engines keep theirs after del)
            llm = eng.make(name, backend, dtype, weights=load, max_model_len=2048,
                           gpu_memory_utilization=0.03)  # fmt: skip
            outs[name] = generate(llm, prompts, len(expected[0]))
            res["engines"][name] = {"vs_truth": compare_tokens(outs[name], truth),
                                    **eng.results["engines"][name], "flamia": flamia_kernel_facts()}
            del llm
            torch.cuda.empty_cache()
        except Exception:
            res["engines"][name] = {"error": traceback.format_exc()[-3000:]}
        if name != "flash_attn-auto" and "flash_attn-auto" in outs and name in outs:
            res["engines"][name]["vs_flash_attn_auto"] = compare_tokens(
                outs[name], outs["flash_attn-auto"])
        save()


def run_serve(results: dict, save, kv_cache_dtype: str = "nvfp4") -> None:
    """``vllm serve`` in a subprocess, one completion on 127.0.0.1."""
    tmp = Path(tempfile.mkdtemp())
    model = write_model_config(tmp / "small-llama", SMALL_LLAMA)
    site = write_entry_point(tmp / "ep")
    env = dict(os.environ)
    env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(site), env.get("PYTHONPATH", "")])
    port = 8771
    cmd = [sys.executable, "-m", "vllm.entrypoints.cli.main", "serve", str(model),
           "--attention-backend", "flamia", "--kv-cache-dtype", kv_cache_dtype,
           "--load-format", "dummy", "--skip-tokenizer-init", "--enforce-eager",
           "--gpu-memory-utilization", "0.1", "--max-model-len", "1024",
           "--host", "127.0.0.1", "--port", str(port)]  # fmt: skip
    log = tmp / "serve.log"
    t0 = time.time()
    res: dict = {"command": " ".join(cmd[3:])}
    with open(log, "w") as fh:
        proc = subprocess.Popen(cmd, env=env, stdout=fh, stderr=subprocess.STDOUT)
    try:
        url = f"http://127.0.0.1:{port}"
        while time.time() - t0 < 240:
            if proc.poll() is not None:
                raise RuntimeError(f"server exited with {proc.returncode}")
            try:
                urllib.request.urlopen(url + "/health", timeout=2)
                break
            except Exception:
                time.sleep(2)
        res["startup_s"] = round(time.time() - t0, 1)
        body = json.dumps({"model": str(model), "prompt": list(range(100, 164)), "max_tokens": 16,
                           "temperature": 0.0, "ignore_eos": True,
                           "return_token_ids": True}).encode()  # fmt: skip
        req = urllib.request.Request(url + "/v1/completions", data=body,
                                     headers={"Content-Type": "application/json"})  # fmt: skip
        with urllib.request.urlopen(req, timeout=60) as r:
            answer = json.loads(r.read())
        choice = answer["choices"][0]
        res |= {"ok": True, "finish_reason": choice.get("finish_reason"),
                "completion_tokens": answer.get("usage", {}).get("completion_tokens"),
                "token_ids": choice.get("token_ids")}  # fmt: skip
        backend_lines = [ln.strip() for ln in log.read_text().splitlines()
                         if "backend" in ln.lower() and "attention" in ln.lower()][:3]  # fmt: skip
        res["log_backend_lines"] = backend_lines
    except Exception:
        res |= {"ok": False, "error": traceback.format_exc()[-1500:],
                "log_tail": log.read_text()[-3000:]}  # fmt: skip
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
    results["serve"] = res
    save()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--parts", default="accuracy,copy,prefix,preemption,cudagraph,serve")
    parser.add_argument("--name", default="vllm_e2e", help="results file name (no suffix)")
    args = parser.parse_args(argv)
    parts = set(args.parts.split(","))
    from benchmarks.common import env_info, results_dir

    path = results_dir() / f"{args.name}.json"
    results: dict = {"benchmark": args.name, **env_info(), "parts": sorted(parts),
                     "model": SMALL_LLAMA, "weight_std": WEIGHT_STD}  # fmt: skip

    def save() -> None:
        path.write_text(json.dumps(results, indent=1))

    import flamia_serve.backend

    flamia_serve.backend.register()
    import vllm

    results["vllm"] = vllm.__version__
    t0 = time.time()
    run_engines(parts, results, save)
    if "copy" in parts:
        t1 = time.time()
        try:
            run_copy(results, save)
        except Exception:
            results["copy_error"] = traceback.format_exc()[-3000:]
        results.setdefault("seconds", {})["copy"] = round(time.time() - t1, 1)
        save()
    if "serve" in parts:
        run_serve(results, save)
    results["total_s"] = round(time.time() - t0, 1)
    save()
    print(json.dumps({k: v for k, v in results.items() if k not in ("model",)}, indent=1)[:6000])
    return 0


if __name__ == "__main__":
    sys.exit(main())
