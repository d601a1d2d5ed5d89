"""``flamia serve-demo``: generate with vLLM on the FLAMIA backend and report tokens/s.

Without ``--model`` it writes a small Llama ``config.json`` to a temporary directory and
serves it with random weights made on the fly (vLLM's dummy load, then N(0, 0.02) weights),
so it needs no download and no tokenizer. Needs a CUDA GPU (sm_90) and vLLM 0.26.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import tempfile
import time
from pathlib import Path

from flamia_serve.numerics.kv_pages import VLLM_KV_CACHE_DTYPES

SMALL_LLAMA = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 1024,
    "intermediate_size": 2816, "num_attention_heads": 8, "num_key_value_heads": 2,
    "head_dim": 128, "num_hidden_layers": 6, "vocab_size": 32000,
    "max_position_embeddings": 8192, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
    "torch_dtype": "bfloat16", "bos_token_id": 1, "eos_token_id": 2, "tie_word_embeddings": False,
}  # fmt: skip


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="flamia serve-demo",
        description="Generate with vLLM using --attention-backend flamia; print tokens/s and "
        "the KV cache capacity in tokens.",
    )
    p.add_argument("--model", type=Path, help="local model directory (default: a small "
                   "random-weight Llama made on the fly)")  # fmt: skip
    p.add_argument("--kv-cache-dtype", default="nvfp4", choices=list(VLLM_KV_CACHE_DTYPES))
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--input-len", type=int, default=512)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--gpu-memory-utilization", type=float, default=0.5)
    p.add_argument("--max-model-len", type=int, default=4096)
    p.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs (faster start)")
    p.add_argument("--seed", type=int, default=0)
    return p


def write_model_config(path: Path, config: dict) -> Path:
    """A model directory holding only ``config.json`` (vLLM loads it with dummy weights)."""
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config))
    return path


def randomize_weights(model: object, seed: int, std: float = 0.02) -> int:
    """Run on the worker's model (``LLM.apply_model``): replace the near-zero dummy weights
    by N(0, std), norms by 1; returns the number of parameters."""
    import torch

    gen = torch.Generator(device="cuda").manual_seed(seed)
    count = 0
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):  # type: ignore[attr-defined]
            if "norm" in name:
                p.fill_(1.0)
            else:
                p.normal_(0.0, std, generator=gen)
            count += p.numel()
    return count


def main(argv: list[str] | None = None) -> int:
    """Run the demo; returns a process exit code."""
    args = parser().parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        print("flamia serve-demo needs a CUDA GPU (the FLAMIA kernels run on sm_90).")
        return 2
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    try:
        from vllm import LLM, SamplingParams
        from vllm.inputs import TokensPrompt
    except ImportError:
        print("flamia serve-demo needs vLLM 0.26: pip install -e '.[vllm]'")
        return 2
    from flamia_serve.backend import register

    register()
    generated = args.model is None
    model = args.model
    if generated:
        model = write_model_config(Path(tempfile.mkdtemp()) / "flamia-demo-llama", SMALL_LLAMA)
    t0 = time.time()
    llm = LLM(model=str(model), attention_backend="FLAMIA", kv_cache_dtype=args.kv_cache_dtype,
              load_format="dummy" if generated else "auto", skip_tokenizer_init=generated,
              gpu_memory_utilization=args.gpu_memory_utilization, seed=args.seed,
              max_model_len=args.max_model_len, enforce_eager=args.enforce_eager)  # fmt: skip
    if generated:
        llm.apply_model(functools.partial(randomize_weights, seed=args.seed))
        llm.reset_prefix_cache()
    cache = llm.llm_engine.vllm_config.cache_config
    kv_tokens = (cache.num_gpu_blocks or 0) * cache.block_size
    print(f"engine ready in {time.time() - t0:.0f} s: backend FLAMIA, kv cache "
          f"{args.kv_cache_dtype}, {kv_tokens:,} KV tokens")  # fmt: skip
    gen = torch.Generator().manual_seed(args.seed)
    vocab = llm.llm_engine.vllm_config.model_config.get_vocab_size()
    ids = torch.randint(100, max(vocab - 100, 101), (args.num_prompts, args.input_len),
                        generator=gen)  # fmt: skip
    prompts = [TokensPrompt(prompt_token_ids=row.tolist()) for row in ids]
    params = SamplingParams(max_tokens=args.output_len, ignore_eos=True, temperature=0.0,
                            detokenize=not generated)  # fmt: skip
    t = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=True)
    dt = time.perf_counter() - t
    out_tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    print(f"{len(outs)} requests, {out_tokens:,} output tokens in {dt:.2f} s: "
          f"{out_tokens / dt:,.0f} output tok/s ({(out_tokens + ids.numel()) / dt:,.0f} total "
          f"tok/s); KV cache holds {kv_tokens:,} tokens")  # fmt: skip
    return 0
