"""vLLM tensor parallelism with ``--attention-backend flamia``: TP=1 vs TP=2 (issue 17).

GPU only (2 GPUs for TP=2; not yet run). For each config (backend, KV cache dtype) and each
``tensor_parallel_size`` in ``--tps``, one engine in its own process:

* accuracy — 8 prompts sharing a 1000-token prefix (``vllm_e2e``'s): 32 greedy tokens and
  the teacher-forced log-prob of every prompt token (``prompt_logprobs=1``);
* throughput — a warm-up, then ``--requests`` × ``--input-len`` / ``--output-len`` tokens
  submitted at once; output tokens/s.

Model: the demo Llama (``backend/demo.py``: 6 layers, hidden 1024, 8/2 heads of d=128,
vocab 32000) with random weights N(0, 0.02) and norms 1, as in ``vllm_e2e``. They are
written once as a real checkpoint (``model.safetensors``, transformers' parameter names)
and loaded normally: ``randomize_weights`` cannot be used here, because under TP every
worker would draw its own shard from the same seed — a different model than TP=1's.

Comparison, per config: TP=2 against TP=1 of the same backend and cache dtype (prompt
log-prob |Δ| mean / max, identical greedy requests, first divergence, token agreement).
TP=2 changes the numerics outside attention (the row-parallel projections sum two partial
products), so greedy tokens of a random-weight model diverge after some tokens under any
such change (``notes/vllm.md``): the log-probs are the measure, and ``flash_attn-auto``
(FlashAttention, BF16 cache) at TP=1 vs TP=2 is the yardstick of what TP alone does.
FLAMIA's scales are per key (token) and head or per token block within one head, so
sharding heads over ranks changes nothing inside attention.

    python benchmarks/vllm_tp.py [--configs flash_attn-auto,flamia-auto,...] [--tps 1,2]
    python benchmarks/vllm_tp.py --model DIR --prompts digits     # a trained digit model

``--model DIR`` serves an existing model directory instead (``config.json`` + weights, e.g.
the one ``flamia rl --model-dir DIR`` leaves, trained to reverse digit strings): greedy
tokens of a random-weight model diverge under TP for every backend, a trained model's peaked
outputs need not. ``--prompts digits`` then asks it the task's prompts
(``flamia_serve.train.rl``), compares the greedy answers up to their ``</s>`` and skips the
throughput run when the model's positions cannot hold ``--input-len`` + ``--output-len``.

Writes ``vllm_tp.json`` under ``$FLAMIA_RESULTS_DIR`` (default ``benchmarks/results``) after
every engine: rows ``{"workload": "tp", "pass": "e2e", "impl": "<config>-tp<N>", "ms",
"tflops": null, "gbps": null, "output_tok_s", "tensor_parallel_size", ...}``, ``engines``,
``accuracy[config]["tp2_vs_tp1"]``, ``errors``, ``skipped``.
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

from flamia_serve.backend.demo import SMALL_LLAMA as DEMO_LLAMA
from flamia_serve.backend.demo import write_model_config

ROOT = Path(__file__).resolve().parents[1]
MODEL = {**DEMO_LLAMA, "max_position_embeddings": 4096}
WEIGHT_STD = 0.02
#: config name -> (--attention-backend, --kv-cache-dtype); flash_attn-auto is the yardstick
CONFIGS = {
    "flash_attn-auto": ("FLASH_ATTN", "auto"),
    "flamia-auto": ("FLAMIA", "auto"),
    "flamia-fp8_per_token_head": ("FLAMIA", "fp8_per_token_head"),
    "flamia-nvfp4": ("FLAMIA", "nvfp4"),
    "flamia-fp8": ("FLAMIA", "fp8"),
}


def llama_state_dict(config: dict, seed: int, std: float = WEIGHT_STD) -> dict:
    """transformers ``LlamaForCausalLM`` parameter names -> BF16 CPU tensors: N(0, std)
    from ``seed`` (one generator, names in sorted order), norms 1. ``config`` is read only."""
    import torch

    h, inter, d = config["hidden_size"], config["intermediate_size"], config["head_dim"]
    hq, hkv = config["num_attention_heads"], config["num_key_value_heads"]
    shapes = {"model.embed_tokens.weight": (config["vocab_size"], h),
              "model.norm.weight": (h,), "lm_head.weight": (config["vocab_size"], h)}
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        shapes |= {p + "self_attn.q_proj.weight": (hq * d, h),
                   p + "self_attn.k_proj.weight": (hkv * d, h),
                   p + "self_attn.v_proj.weight": (hkv * d, h),
                   p + "self_attn.o_proj.weight": (h, hq * d),
                   p + "mlp.gate_proj.weight": (inter, h), p + "mlp.up_proj.weight": (inter, h),
                   p + "mlp.down_proj.weight": (h, inter),
                   p + "input_layernorm.weight": (h,),
                   p + "post_attention_layernorm.weight": (h,)}  # fmt: skip
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for name in sorted(shapes):
        if "norm" in name:
            out[name] = torch.ones(shapes[name], dtype=torch.bfloat16)
        else:
            w = torch.empty(shapes[name], dtype=torch.float32).normal_(0.0, std, generator=gen)
            out[name] = w.to(torch.bfloat16)
    return out


def write_checkpoint(path: Path, config: dict, seed: int) -> Path:
    """A model directory with ``config.json`` and random ``model.safetensors``."""
    from safetensors.torch import save_file

    write_model_config(path, config)
    save_file(llama_state_dict(config, seed), str(path / "model.safetensors"),
              metadata={"format": "pt"})  # fmt: skip
    return path


def digit_prompts(n: int, seed: int = 1) -> tuple[list[list[int]], int, int]:
    """``n`` prompts of the RL digit-reversal task, the answer-length limit and ``</s>``'s id
    (``flamia_serve.train.rl``'s tokenizer and the ``small`` preset's digit range)."""
    import torch

    from flamia_serve.train import rl

    preset = rl.PRESETS["small"]
    digits = rl.sample_digits(n, preset.min_digits, preset.max_digits,
                              torch.Generator().manual_seed(seed))  # fmt: skip
    tok = rl.DigitTokenizer()
    return [tok.prompt_ids(d) for d in digits], preset.max_digits + 1, rl.EOS


def until_eos(rows: list[dict], eos: int) -> list[dict]:
    """Greedy rows cut after their first ``eos`` (what follows an answer is not compared)."""
    out = []
    for r in rows:
        tokens = r["tokens"]
        end = tokens.index(eos) + 1 if eos in tokens else len(tokens)
        out.append({**r, "tokens": tokens[:end]})
    return out


def model_config(model: Path) -> dict:
    return json.loads((model / "config.json").read_text())


def run_one(config: str, tp: int, model: Path, args: argparse.Namespace) -> dict:
    """One engine (this process): accuracy rows, then the throughput row (when the model's
    positions hold the workload)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    import flamia_serve.backend

    flamia_serve.backend.register()
    import torch
    from vllm import LLM, SamplingParams

    from benchmarks.vllm_e2e import generate, prompts_shared_prefix, random_prompts

    backend, kv_dtype = CONFIGS[config]
    model_cfg = model_config(model)
    settings = dict(attention_backend=backend, kv_cache_dtype=kv_dtype,
                    tensor_parallel_size=tp, skip_tokenizer_init=True, seed=0,
                    gpu_memory_utilization=args.gpu_memory_utilization,
                    max_model_len=min(args.max_model_len, model_cfg["max_position_embeddings"]),
                    max_num_batched_tokens=1024,
                    enable_chunked_prefill=True, enable_prefix_caching=False,
                    max_num_seqs=args.max_num_seqs)  # fmt: skip
    if args.enforce_eager:
        settings["enforce_eager"] = True
    else:
        settings["compilation_config"] = {"mode": 0, "cudagraph_mode": "FULL_DECODE_ONLY"}
    t0 = time.time()
    llm = LLM(model=str(model), **settings)
    cfg = llm.llm_engine.vllm_config
    blocks = cfg.cache_config.num_gpu_blocks
    facts = {"impl": f"{config}-tp{tp}", "config": config, "tensor_parallel_size": tp,
             "startup_s": round(time.time() - t0, 1),
             "kv_tokens": blocks * cfg.cache_config.block_size if blocks else None,
             "cudagraph_mode": str(cfg.compilation_config.cudagraph_mode),
             "settings": settings}  # fmt: skip
    if args.prompts == "digits":
        prompts, max_tokens, eos = digit_prompts(64)
    else:
        prompts, max_tokens, eos = prompts_shared_prefix(8), 32, None
    acc = generate(llm, prompts, max_tokens, prompt_logprobs=True)
    again = generate(llm, prompts, max_tokens)  # repeatability within one engine
    if eos is not None:
        acc, again = until_eos(acc, eos), until_eos(again, eos)
    facts["repeat_identical_requests"] = sum(a["tokens"] == b["tokens"]
                                             for a, b in zip(acc, again, strict=True))  # fmt: skip
    if args.input_len + args.output_len > settings["max_model_len"]:
        print(f"{facts['impl']}: no throughput run (the model holds "
              f"{settings['max_model_len']} positions)", flush=True)  # fmt: skip
        return {"facts": facts, "acc": acc, "rows": []}
    vocab = model_cfg["vocab_size"]

    def token_prompts(n: int, length: int, seed: int) -> list[dict]:
        if vocab >= 31000:  # the demo model: vllm_e2e's prompts
            return [{"prompt_token_ids": p} for p in random_prompts(n, length, seed)]
        g = torch.Generator().manual_seed(seed)
        return [{"prompt_token_ids": torch.randint(0, vocab, (length,), generator=g).tolist()}
                for _ in range(n)]  # fmt: skip

    warm = SamplingParams(max_tokens=16, ignore_eos=True, detokenize=False, temperature=0.0)
    llm.generate(token_prompts(16, args.input_len, 99), warm, use_tqdm=False)
    sp = SamplingParams(max_tokens=args.output_len, ignore_eos=True, detokenize=False,
                        temperature=0.0)  # fmt: skip
    t = time.perf_counter()
    outs = llm.generate(token_prompts(args.requests, args.input_len, 3), sp, use_tqdm=False)
    dt = time.perf_counter() - t
    out_tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    row = {"workload": "tp", "pass": "e2e", "impl": facts["impl"], "ms": round(dt * 1e3, 1),
           "tflops": None, "gbps": None, "output_tok_s": round(out_tokens / dt, 1),
           "total_tok_s": round((out_tokens + args.requests * args.input_len) / dt, 1),
           "tensor_parallel_size": tp, "backend": backend, "kv_cache_dtype": kv_dtype,
           "kv_tokens": facts["kv_tokens"], "requests": args.requests,
           "input_len": args.input_len, "output_len": args.output_len,
           "output_tokens": out_tokens}  # fmt: skip
    print(row, flush=True)
    return {"facts": facts, "acc": acc, "rows": [row]}


def compare_tp(runs: dict[int, dict]) -> dict:
    """Every TP > 1 run of one config against its TP=1 run."""
    from benchmarks.vllm_e2e import compare_prompt_lp, compare_tokens

    out = {}
    if 1 not in runs:
        return out
    for tp, res in sorted(runs.items()):
        if tp != 1:
            out[f"tp{tp}_vs_tp1"] = compare_prompt_lp(res["acc"], runs[1]["acc"]) | (
                compare_tokens(res["acc"], runs[1]["acc"]))
    return out


def child_env(site: Path) -> dict:
    """The environment of an engine process: the repo and the plugin's entry point on
    ``PYTHONPATH``, so vLLM's TP workers (spawned or forked) load the FLAMIA backend."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(ROOT), str(site), env.get("PYTHONPATH", "")) if p)
    return env


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--configs", default=",".join(CONFIGS),
                   help=f"comma-separated, from {list(CONFIGS)}")
    p.add_argument("--tps", default="1,2", help="tensor_parallel_size values, comma-separated")
    p.add_argument("--requests", type=int, default=128)
    p.add_argument("--input-len", type=int, default=512)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--max-num-seqs", type=int, default=128)
    p.add_argument("--gpu-memory-utilization", type=float, default=0.4)
    p.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs")
    p.add_argument("--seed", type=int, default=0, help="weight seed")
    p.add_argument("--budget-s", type=float, default=1e9, help="skip engines past this")
    p.add_argument("--per-engine-s", type=float, default=240)
    p.add_argument("--name", default="vllm_tp", help="results file name (no suffix)")
    p.add_argument("--model", type=Path, help="serve this model directory instead of the "
                   "random-weight demo Llama (e.g. flamia rl --model-dir's)")
    p.add_argument("--prompts", choices=("shared-prefix", "digits"), default="shared-prefix",
                   help="accuracy prompts: 8 with a shared 1000-token prefix (32 greedy tokens), "
                        "or 64 of the RL digit task (greedy answers up to </s>)")
    p.add_argument("--one", help=argparse.SUPPRESS)
    p.add_argument("--tp", type=int, help=argparse.SUPPRESS)
    p.add_argument("--model-dir", type=Path, help=argparse.SUPPRESS)
    p.add_argument("--one-out", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    configs = [c for c in args.configs.split(",") if c]
    bad = [c for c in configs if c not in CONFIGS]
    if bad or not configs:
        p.error(f"--configs: unknown {bad}; choose from {list(CONFIGS)}")
    try:
        tps = sorted({int(t) for t in args.tps.split(",") if t})
    except ValueError:
        p.error(f"--tps: expected comma-separated integers, got {args.tps!r}")
    if not tps or min(tps) < 1:
        p.error(f"--tps: expected integers >= 1, got {args.tps!r}")
    for name in ("requests", "input_len", "output_len"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')}: must be >= 1")
    if args.model is not None and not (args.model / "config.json").is_file():
        p.error(f"--model {args.model}: no config.json there")
    if args.one:
        try:
            res = run_one(args.one, args.tp, args.model_dir, args)
        except Exception:
            res = {"error": traceback.format_exc()[-4000:]}
        Path(args.one_out).write_text(json.dumps(res))
        return 0

    import torch

    if torch.cuda.device_count() < max(tps):
        print(f"vllm_tp: --tps {args.tps} needs {max(tps)} CUDA GPUs, "
              f"{torch.cuda.device_count()} visible")  # fmt: skip
        return 2
    from benchmarks.common import env_info, results_dir
    from benchmarks.vllm_e2e import write_entry_point

    tmp = Path(tempfile.mkdtemp(prefix="vllm-tp-"))
    if args.model is None:
        model, weights = write_checkpoint(tmp / "demo-llama", MODEL, args.seed), {
            "weight_std": WEIGHT_STD, "weight_seed": args.seed}
    else:
        model, weights = args.model.resolve(), {"model_dir": str(args.model)}
    env = child_env(write_entry_point(tmp / "ep"))
    out = results_dir() / f"{args.name}.json"
    doc: dict = {"benchmark": args.name, **env_info(), "model": model_config(model), **weights,
                 "gpus": [torch.cuda.get_device_name(i) for i in
                                                    range(torch.cuda.device_count())],
                 "workload": {k: str(v) if isinstance(v, Path) else v
                              for k, v in vars(args).items()
                              if k not in ("one", "tp", "model_dir", "one_out")},
                 "rows": [], "engines": [], "accuracy": {}, "errors": {},
                 "skipped": []}  # fmt: skip
    try:
        doc["vllm"] = importlib.metadata.version("vllm")
    except importlib.metadata.PackageNotFoundError:
        doc["vllm"] = None
    t0 = time.time()
    for config in configs:
        runs: dict[int, dict] = {}
        for tp in tps:
            impl = f"{config}-tp{tp}"
            left = args.budget_s - (time.time() - t0)
            if left < args.per_engine_s * 0.6:
                doc["skipped"].append(impl)
                continue
            res_path = tmp / f"{impl}.json"
            cmd = [sys.executable, str(Path(__file__).resolve()), "--one", config,
                   "--tp", str(tp), "--model-dir", str(model), "--one-out", str(res_path),
                   *(argv if argv is not None else sys.argv[1:])]  # fmt: skip
            try:
                subprocess.run(cmd, env=env, timeout=min(left, args.per_engine_s * 1.5),
                               check=False)  # fmt: skip
                res = json.loads(res_path.read_text())
            except Exception:
                res = {"error": traceback.format_exc()[-2000:]}
            if "error" in res:
                doc["errors"][impl] = res["error"]
            else:
                runs[tp] = res
                doc["rows"] += res["rows"]
                doc["engines"].append(res["facts"])
            doc["accuracy"][config] = compare_tp(runs)
            out.write_text(json.dumps(doc, indent=1))
    doc["total_s"] = round(time.time() - t0, 1)
    out.write_text(json.dumps(doc, indent=1))
    for r in doc["rows"]:
        print(f"{r['impl']:36s} {r['output_tok_s']:>10.1f} output tok/s  kv {r['kv_tokens']}")
    for config, cmp in doc["accuracy"].items():
        print(config, json.dumps({k: {m: v[m] for m in ("mean_abs_dlogprob", "max_abs_dlogprob",
                                                         "identical_requests", "token_agreement")}
                                  for k, v in cmp.items()}))  # fmt: skip
    print("errors:", list(doc["errors"]), "skipped:", doc["skipped"])
    return 0 if not doc["errors"] else 1


if __name__ == "__main__":
    sys.exit(main())
