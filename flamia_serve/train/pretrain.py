"""Pretraining through FLAMIA attention vs BF16: a Llama-style model on the standard library.

``python -m flamia_serve.train.pretrain --attention bf16 mxfp8 mixed_nvfp4 --json
benchmarks/results/pretrain.json`` trains one freshly initialised model per attention
choice, with the same seed, the same tokenizer and the same microbatches, and writes the
per-step training loss, the held-out loss every ``--eval-every`` steps and
``"final_eval_loss": {choice: loss}`` to one JSON (shape in ``result_skeleton``).
``benchmarks/plot_pretrain.py`` draws the curves.

Model: ``transformers.LlamaForCausalLM`` (random init under ``--seed``), no KV cache
(transformers only builds its per-document mask from packed ``position_ids`` when there
is no cache). Attention choices:

* ``bf16``: transformers' ``"sdpa"``; the packed ``position_ids`` make transformers build
  a block-diagonal causal mask (one block per document).
* ``mxfp8`` / ``mixed_nvfp4`` / ``mixed_nvfp4_hadamard``: ``attn_implementation="flamia"``
  (``flamia_serve.train.hf.register``) with config ``flamia_recipe`` and
  ``flamia_exact_causal`` (``--exact-causal``); documents come from the same
  ``position_ids``.

Training: AdamW (betas 0.9/0.95, weight decay on matrices only), linear warmup then cosine
decay to ``--min-lr-ratio`` of ``--lr``, gradient clipping, BF16 autocast on CUDA (FP32 on
CPU), ``--micro-batches`` packed microbatches of ``--seq-len`` tokens per step (gradients
accumulated, loss averaged over all predicted tokens of the step).

Sizing the GPU preset (``small``, ~63M parameters: 8 layers, hidden 768, 6 query / 2 KV
heads of d=128, MLP 2048, vocab 8192; 4 × 4096 = 16384 tokens per step). Per step:
6·N·tokens ≈ 6 · 57M (without the input embedding) · 16384 ≈ 5.6 TFLOP in the linear
layers. Attention: FLAMIA computes only the causal per-document part
(≈ 4·Σ L²/2 · Hq·d · 3.5 for forward + backward; ~1.5 TFLOP per step at the stdlib's
~2–4k-token documents); transformers' SDPA receives a dense [T, T] mask and computes all
T² scores (4·T²·Hq·d·3.5 · layers · microbatches ≈ 5.8 TFLOP per step). At 150–250
TFLOP/s achieved (small matmuls, eager launches) that is ~40–80 ms per step for BF16 and
~30–60 ms for FLAMIA (host overhead of ~32 attention calls per step included), i.e.
2000 steps in ~1.5–2.7 minutes per choice, plus ~20 held-out evaluations (32 × 4096
tokens each, forward only, a few seconds in all), data preparation once (tokenizer
training and encoding: ~2 min for CPython 3.11's 31.5 MB of stdlib sources on 2 busy CPU
cores; cached). Data: that stdlib gives 8.2M training tokens (3.6 bytes per token), so
2000 steps of 16384 tokens are ~4 epochs; a stdlib without its ``test`` package (e.g. a
distribution's Python) has about half. ``--source`` (repeatable) adds more local
sources, e.g. the installed ``torch`` package's ~50 MB of Python.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import math
import platform
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from flamia_serve.files import check_writable
from flamia_serve.train import data as pdata

ATTENTIONS = ("bf16", "mxfp8", "mxfp8_grad_input", "mixed_nvfp4", "mixed_nvfp4_hadamard")
FLAMIA_RECIPES = ATTENTIONS[1:]


class SetupError(RuntimeError):
    """A run cannot start: a package or the FLAMIA integration is missing."""


#: the Llama shape fields of a preset and of a run config (pretraining, RL, data parallel)
SHAPE_FIELDS = ("hidden", "layers", "heads", "kv_heads", "head_dim", "intermediate")


def model_shape(preset: object) -> dict[str, int]:
    """The :data:`SHAPE_FIELDS` of a preset, as keyword arguments of a run config."""
    return {k: getattr(preset, k) for k in SHAPE_FIELDS}


@dataclass(frozen=True)
class Preset:
    """Model shape (:data:`SHAPE_FIELDS`) and the training defaults that go with it."""

    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab_size: int
    seq_len: int
    micro_batches: int
    steps: int
    lr: float
    warmup: int
    eval_every: int
    eval_batches: int


PRESETS = {
    # CPU smoke test: d=64 so the FLAMIA reference accepts it; ~0.4M parameters.
    "tiny": Preset(hidden=128, layers=2, heads=2, kv_heads=1, head_dim=64, intermediate=256,
                   vocab_size=512, seq_len=256, micro_batches=2, steps=20, lr=3e-3, warmup=2,
                   eval_every=10, eval_batches=2),
    # The H200 run: ~63M parameters, 16384 tokens per step (sizing in the module docstring).
    "small": Preset(hidden=768, layers=8, heads=6, kv_heads=2, head_dim=128, intermediate=2048,
                    vocab_size=8192, seq_len=4096, micro_batches=4, steps=2000, lr=1e-3,
                    warmup=100, eval_every=100, eval_batches=32),
    # ~130M parameters, for a longer run.
    "base": Preset(hidden=1024, layers=10, heads=8, kv_heads=2, head_dim=128, intermediate=2816,
                   vocab_size=8192, seq_len=4096, micro_batches=4, steps=4000, lr=6e-4,
                   warmup=200, eval_every=200, eval_batches=32),
}


@dataclass(frozen=True)
class TrainConfig:
    """Everything a run depends on besides the attention choice (recorded in the JSON)."""

    model_size: str
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab_size: int
    seq_len: int
    micro_batches: int
    steps: int
    lr: float
    min_lr_ratio: float
    warmup: int
    weight_decay: float
    clip: float
    eval_every: int
    eval_batches: int
    eval_fraction: float
    exact_causal: bool
    seed: int
    flamia_path: str = "auto"


def _need_train_extra() -> None:
    try:
        import tokenizers  # noqa: F401
        import transformers
    except ImportError as e:
        raise SetupError(f"pretraining needs transformers>=5 and tokenizers "
                           f"(pip install -e '.[train]'): {e}") from None
    major = int(transformers.__version__.split(".")[0])
    if major < 5:
        raise SetupError(f"pretraining needs transformers>=5, found {transformers.__version__}")


def attention_setup(
    attention: str, exact_causal: bool, flamia_path: str = "auto"
) -> tuple[str, dict]:
    """(transformers ``attn_implementation``, extra config attributes) for a choice;
    ``flamia_path``: ``auto`` (kernels on CUDA), ``kernel`` or ``reference`` (the PyTorch
    twin, same numerics: tells a kernel bug from a numerics effect)."""
    if attention == "bf16":
        return "sdpa", {}
    if attention not in FLAMIA_RECIPES:
        raise ValueError(f"attention: expected one of {ATTENTIONS}, got {attention!r}")
    try:
        from flamia_serve.train.hf import register
    except ImportError as e:
        raise SetupError(f"attention {attention!r} needs flamia_serve.train.hf (the FLAMIA "
                           f"transformers integration), which does not import: {e}") from None
    register()
    return "flamia", {"flamia_recipe": attention, "flamia_exact_causal": exact_causal,
                      "flamia_path": flamia_path}  # fmt: skip


def build_model(cfg: TrainConfig, attention: str, vocab_size: int):
    """A ``LlamaForCausalLM`` with ``cfg``'s shape, initialised from ``cfg.seed`` (the same
    weights for every attention choice), FP32 parameters, no KV cache."""
    from transformers import LlamaConfig, LlamaForCausalLM

    impl, extra = attention_setup(attention, cfg.exact_causal, cfg.flamia_path)
    config = LlamaConfig(
        vocab_size=vocab_size, hidden_size=cfg.hidden, intermediate_size=cfg.intermediate,
        num_hidden_layers=cfg.layers, num_attention_heads=cfg.heads,
        num_key_value_heads=cfg.kv_heads, head_dim=cfg.head_dim,
        max_position_embeddings=cfg.seq_len, tie_word_embeddings=False, use_cache=False,
        attn_implementation=impl, **extra)
    torch.manual_seed(cfg.seed)
    return LlamaForCausalLM(config)


def count_params(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def token_losses(model, batch: pdata.PackedBatch) -> torch.Tensor:
    """Per-token next-token loss of one packed microbatch (FP32, ``[T - 1]``; entry t is
    the loss of predicting token t+1, 0 where token t+1 starts a document)."""
    # The document boundaries also go in as transformers' FlashAttentionKwargs (what its
    # DataCollatorWithFlattening passes), so an attention function can skip deriving them
    # from position_ids; SDPA ignores them and masks by position_ids.
    out = model(input_ids=batch.input_ids[None], position_ids=batch.position_ids[None],
                use_cache=False, cu_seq_lens_q=batch.cu_seqlens, cu_seq_lens_k=batch.cu_seqlens,
                max_length_q=batch.max_seqlen, max_length_k=batch.max_seqlen)
    logits = out.logits[0, :-1].float()
    return F.cross_entropy(logits, batch.labels()[1:], ignore_index=pdata.IGNORE_INDEX,
                           reduction="none")


def n_targets(batch: pdata.PackedBatch) -> int:
    """How many tokens of ``batch`` are predicted (all but document starts)."""
    return int((batch.position_ids[1:] != 0).sum())


def _autocast(device: torch.device):
    if device.type == "cuda":
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return torch.autocast("cpu", enabled=False)


def evaluate(model, batches: Sequence[pdata.PackedBatch], device: torch.device) -> float:
    """Mean next-token loss over ``batches`` (every predicted token weighted equally)."""
    was_training = model.training
    model.eval()
    total = torch.zeros((), dtype=torch.float64, device=device)
    count = 0
    with torch.no_grad(), _autocast(device):
        for b in batches:
            total += token_losses(model, b.to(device)).sum(dtype=torch.float64)
            count += n_targets(b)
    model.train(was_training)
    return float(total) / max(count, 1)


def lr_lambda(cfg: TrainConfig):
    """Linear warmup over ``cfg.warmup`` steps, then cosine to ``cfg.min_lr_ratio``."""
    def f(step: int) -> float:
        if step < cfg.warmup:
            return (step + 1) / cfg.warmup
        span = max(cfg.steps - cfg.warmup, 1)
        progress = min((step - cfg.warmup) / span, 1.0)
        return cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))
    return f


def make_optimizer(model: torch.nn.Module, cfg: TrainConfig, device: torch.device):
    decay = [p for p in model.parameters() if p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.ndim < 2]
    groups = [{"params": decay, "weight_decay": cfg.weight_decay},
              {"params": no_decay, "weight_decay": 0.0}]
    opt = torch.optim.AdamW(groups, lr=cfg.lr, betas=(0.9, 0.95), eps=1e-8,
                            fused=device.type == "cuda")
    return opt, torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(cfg))


def _progress(total: int, desc: str, enabled: bool):
    try:
        from tqdm.auto import tqdm
    except ImportError:
        return None
    return tqdm(total=total, desc=desc, disable=not enabled, dynamic_ncols=True,
                mininterval=1.0 if sys.stderr.isatty() else 15.0, file=sys.stderr)


def train_one(cfg: TrainConfig, corpus: pdata.Corpus, attention: str, device: torch.device,
              *, progress: bool = True, log_every: int = 10) -> dict:
    """Train a fresh model with one attention choice; return its run record (see
    ``result_skeleton``). Stops early on a non-finite loss (checked every ``log_every``
    steps and at evaluations), with ``"diverged_at"`` the first step whose loss is not
    finite."""
    model = build_model(cfg, attention, corpus.vocab_size).to(device)
    model.train()
    opt, sched = make_optimizer(model, cfg, device)
    batches = pdata.train_batches(corpus.train_docs, cfg.seq_len, cfg.seed)
    held_out = [b.to(device) for b in
                pdata.eval_batches(corpus.eval_docs, cfg.seq_len, cfg.eval_batches)]
    params = [p for p in model.parameters()]
    losses: list[torch.Tensor] = []
    grad_norms: list[torch.Tensor] = []
    lrs: list[float] = []
    evals: list[dict] = []
    diverged_at = None
    eval_seconds = 0.0
    bar = _progress(cfg.steps, attention, progress)

    def run_eval(step: int) -> float:
        nonlocal eval_seconds
        t = time.perf_counter()
        loss = evaluate(model, held_out, device)
        eval_seconds += time.perf_counter() - t
        evals.append({"step": step, "loss": loss})
        return loss

    warm_steps = min(10, cfg.steps - 1)
    warm_mark = None
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    for step in range(cfg.steps):
        micro = [next(batches) for _ in range(cfg.micro_batches)]
        n_total = sum(n_targets(b) for b in micro)
        if device.type == "cuda":  # copies that do not wait for the previous step's kernels
            micro = [b.pin_memory().to(device, non_blocking=True) for b in micro]
        step_loss = torch.zeros((), dtype=torch.float32, device=device)
        for b in micro:
            with _autocast(device):
                loss_sum = token_losses(model, b.to(device)).sum()
            (loss_sum / n_total).backward()
            step_loss += loss_sum.detach() / n_total
        grad_norms.append(torch.nn.utils.clip_grad_norm_(params, cfg.clip))
        lrs.append(sched.get_last_lr()[0])
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        losses.append(step_loss)
        done = step + 1
        eval_now = done % cfg.eval_every == 0 or done == cfg.steps
        if done % log_every == 0 or eval_now:
            current = float(step_loss)
            if not math.isfinite(current):  # checked every log_every steps: find the first
                finite = torch.isfinite(torch.stack(losses)).tolist()
                diverged_at = finite.index(False) + 1
                break
            postfix = {"loss": f"{current:.4f}"}
            if eval_now:
                postfix["eval"] = f"{run_eval(done):.4f}"
            if bar is not None:
                bar.set_postfix(postfix, refresh=False)
        if bar is not None:
            bar.update(1)
        if done == warm_steps:  # the first steps include kernel compilation
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            warm_mark = (time.perf_counter(), eval_seconds)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    seconds = time.perf_counter() - start
    if bar is not None:
        bar.close()
    steps_done = len(losses)
    train_seconds = seconds - eval_seconds
    record = {
        "attention": attention,
        "attn_implementation": model.config._attn_implementation,
        "exact_causal": cfg.exact_causal if attention != "bf16" else None,
        "params": count_params(model),
        "loss": [float(x) for x in torch.stack(losses).tolist()] if losses else [],
        "grad_norm": [float(x) for x in torch.stack(grad_norms).tolist()] if grad_norms else [],
        "lr": lrs,
        "eval": evals,
        "final_eval_loss": evals[-1]["loss"] if evals and diverged_at is None else None,
        "diverged_at": diverged_at,
        "steps_done": steps_done,
        "seconds": seconds,
        "eval_seconds": eval_seconds,
        "ms_per_step": 1e3 * train_seconds / max(steps_done, 1),
        "tokens_per_s": steps_done * cfg.micro_batches * cfg.seq_len / max(train_seconds, 1e-9),
        "ms_per_step_after_10": None,
    }
    if warm_mark is not None and steps_done > warm_steps:
        later = (start + seconds - warm_mark[0]) - (eval_seconds - warm_mark[1])
        record["ms_per_step_after_10"] = 1e3 * later / (steps_done - warm_steps)
    if device.type == "cuda":
        record["max_memory_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
    if attention != "bf16" and diverged_at is None:
        # Cross-check: the same weights evaluated with BF16 SDPA attention. A model that
        # learnt to read the future through shared block scales would lose here.
        model.set_attn_implementation("sdpa")
        record["final_eval_loss_sdpa"] = evaluate(model, held_out, device)
    return record


def env_info(device: torch.device) -> dict:
    """Where the run happened: GPU, library versions, date."""
    import tokenizers
    import transformers

    try:
        import triton
        triton_version = triton.__version__
    except ImportError:
        triton_version = "n/a"
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    return {
        "gpu": gpu,
        "device": str(device),
        "torch": torch.__version__,
        "cuda": str(torch.version.cuda),
        "triton": triton_version,
        "transformers": transformers.__version__,
        "tokenizers": tokenizers.__version__,
        "python": platform.python_version(),
        "date": datetime.date.today().isoformat(),
    }


def result_skeleton(cfg: TrainConfig, corpus_info: dict, env: dict) -> dict:
    """The JSON's shape: ``runs[choice]`` holds ``loss`` (one per step), ``eval``
    (``[{"step", "loss"}]``), ``final_eval_loss``, timing; ``final_eval_loss`` maps each
    choice to its last held-out loss and ``final_eval_loss_rel_to_bf16`` to
    ``loss / bf16 - 1``."""
    return {"benchmark": "pretrain", **env, "params": None,
            "config": dataclasses.asdict(cfg), "data": corpus_info, "runs": {},
            "final_eval_loss": {}, "final_eval_loss_rel_to_bf16": {}}


def summarize(result: dict) -> dict:
    """Fill ``final_eval_loss`` and the relative differences from ``runs`` (in place)."""
    result["final_eval_loss"] = {k: r["final_eval_loss"] for k, r in result["runs"].items()}
    base = result["final_eval_loss"].get("bf16")
    result["final_eval_loss_rel_to_bf16"] = {
        k: (v / base - 1.0 if base and v is not None else None)
        for k, v in result["final_eval_loss"].items() if k != "bf16"}
    return result


def merge_results(paths: Sequence[str | Path]) -> dict:
    """One result from several single-choice JSONs of the same config and data (e.g. one
    GPU command per attention choice)."""
    merged = None
    for path in paths:
        part = read_json(path, "--merge")
        if part.get("benchmark") != "pretrain":
            raise ValueError(f"merge: {path} is not a pretrain result")
        if merged is None:
            merged = part
            continue
        for key in ("config", "data", "params"):
            if part[key] != merged[key]:
                raise ValueError(f"merge: {path} has a different {key!r} than {paths[0]}")
        for name, run in part["runs"].items():
            if name in merged["runs"]:
                raise ValueError(f"merge: attention {name!r} appears twice ({path})")
            merged["runs"][name] = run
    if merged is None:
        raise ValueError("merge: no files given")
    return summarize(merged)


def pretrain(cfg: TrainConfig, attentions: Sequence[str], *, device: str | torch.device,
             roots: Sequence[str] | None = None, cache_dir: str | None = None,
             max_files: int | None = None, progress: bool = True,
             json_path: str | Path | None = None) -> dict:
    """Prepare the corpus once, train one model per attention choice, return (and write
    after each run, so a crash keeps the finished runs) the result dict."""
    _need_train_extra()
    if not attentions:
        raise ValueError("attentions: give at least one attention choice")
    for a in attentions:
        if a not in ATTENTIONS:
            raise ValueError(f"attentions: expected values in {ATTENTIONS}, got {a!r}")
    if len(set(attentions)) != len(attentions):
        raise ValueError(f"attentions: repeated choice in {list(attentions)}")
    for a in attentions:  # fail before the first run, not after it
        attention_setup(a, cfg.exact_causal, cfg.flamia_path)
    device = torch.device(device)
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    corpus = pdata.load_corpus(roots, vocab_size=cfg.vocab_size, eval_fraction=cfg.eval_fraction,
                               cache_dir=cache_dir, max_files=max_files)
    result = result_skeleton(cfg, corpus.info, env_info(device))
    print(f"pretrain: {cfg.model_size} model, {corpus.info['tokens_train']:,} train / "
          f"{corpus.info['tokens_eval']:,} held-out tokens, "
          f"{cfg.micro_batches * cfg.seq_len:,} tokens per step, {cfg.steps} steps",
          file=sys.stderr)
    for a in attentions:
        result["runs"][a] = train_one(cfg, corpus, a, device, progress=progress)
        summarize(result)
        run = result["runs"][a]
        result["params"] = run["params"]
        print(f"pretrain: {a}: final held-out loss {run['final_eval_loss']}, "
              f"{run['ms_per_step']:.1f} ms/step", file=sys.stderr)
        if json_path is not None:
            write_json(result, json_path)
    return result


def write_json(result: dict, path: str | Path) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=1) + "\n")


def read_json(path: str | Path, flag: str) -> dict:
    """A JSON file given as ``flag``; ``ValueError`` naming both when it cannot be read."""
    try:
        return json.loads(Path(path).read_text())
    except OSError as e:
        raise ValueError(f"{flag} {path}: cannot read ({e.strerror or e})") from None
    except ValueError as e:
        raise ValueError(f"{flag} {path}: not JSON ({e})") from None


def check_device(name: str) -> torch.device:
    """``--device``: cpu, cuda or cuda:N that exists here (``ValueError`` naming the flag)."""
    from flamia_serve.numerics.checks import check_device as check

    try:
        return check(name, "--device")
    except (TypeError, ValueError) as e:
        raise ValueError(str(e)) from None


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m flamia_serve.train.pretrain",
        description="Pretrain a Llama-style model on the Python standard library with BF16 "
                    "or FLAMIA attention; several --attention values compare them.")
    p.add_argument("--attention", nargs="+", choices=ATTENTIONS, default=["bf16"],
                   help="attention choice(s); several run one after another, same seed/data")
    p.add_argument("--model-size", choices=sorted(PRESETS), default="small",
                   help="preset: tiny (CPU smoke), small (~63M, the H200 run), base (~130M)")
    p.add_argument("--flamia-path", choices=("auto", "kernel", "reference"), default="auto",
                   help="FLAMIA: GPU kernels (auto on CUDA) or the PyTorch twin (same numerics)")
    p.add_argument("--exact-causal", action="store_true",
                   help="FLAMIA: per-token Q/K exponents (no dependence on later tokens)")
    p.add_argument("--steps", type=int, help="optimizer steps (default: preset)")
    p.add_argument("--seq-len", type=int, help="tokens per packed microbatch (default: preset)")
    p.add_argument("--micro-batches", type=int, help="microbatches per step (default: preset)")
    p.add_argument("--lr", type=float, help="peak learning rate (default: preset)")
    p.add_argument("--min-lr-ratio", type=float, default=0.1)
    p.add_argument("--warmup", type=int, help="warmup steps (default: preset)")
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--clip", type=float, default=1.0, help="gradient-norm clip")
    p.add_argument("--eval-every", type=int, help="held-out eval period in steps")
    p.add_argument("--eval-batches", type=int, help="held-out microbatches per eval")
    p.add_argument("--eval-fraction", type=float, default=0.05,
                   help="share of files held out (by path hash)")
    p.add_argument("--vocab-size", type=int, help="BPE vocabulary (default: preset)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--source", action="append", metavar="DIR",
                   help="directory of .py documents (repeatable; default: the stdlib)")
    p.add_argument("--max-files", type=int, help="use only the first N files (tests)")
    p.add_argument("--cache-dir", help=f"tokenizer/corpus cache (default {pdata.DEFAULT_CACHE})")
    p.add_argument("--json", metavar="PATH", help="write the result JSON here")
    p.add_argument("--merge", nargs="+", metavar="JSON",
                   help="instead of training: merge single-choice results into --json")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    return p


def config_from_args(args: argparse.Namespace) -> TrainConfig:
    """The run config: preset values, overridden by the given arguments (checked)."""
    preset = PRESETS[args.model_size]

    def pick(name: str):
        value = getattr(args, name)
        return getattr(preset, name) if value is None else value

    cfg = TrainConfig(
        model_size=args.model_size, **model_shape(preset), vocab_size=pick("vocab_size"),
        seq_len=pick("seq_len"), micro_batches=pick("micro_batches"), steps=pick("steps"),
        lr=pick("lr"), min_lr_ratio=args.min_lr_ratio, warmup=pick("warmup"),
        weight_decay=args.weight_decay, clip=args.clip, eval_every=pick("eval_every"),
        eval_batches=pick("eval_batches"), eval_fraction=args.eval_fraction,
        exact_causal=args.exact_causal, seed=args.seed, flamia_path=args.flamia_path)
    for name in ("steps", "seq_len", "micro_batches", "eval_every", "eval_batches"):
        if getattr(cfg, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')}: must be >= 1, "
                             f"got {getattr(cfg, name)}")
    if cfg.seq_len < 2:  # one token per microbatch predicts nothing: the loss is 0/0
        raise ValueError(f"--seq-len: must be >= 2 (a microbatch predicts seq_len - 1 "
                         f"tokens), got {cfg.seq_len}")
    if cfg.warmup < 0:
        raise ValueError(f"--warmup: must be >= 0, got {cfg.warmup}")
    if not cfg.lr > 0:
        raise ValueError(f"--lr: must be > 0, got {cfg.lr}")
    if not 0 <= cfg.min_lr_ratio <= 1:
        raise ValueError(f"--min-lr-ratio: must be in [0, 1], got {cfg.min_lr_ratio}")
    if not cfg.clip > 0:
        raise ValueError(f"--clip: must be > 0, got {cfg.clip}")
    if not cfg.weight_decay >= 0:
        raise ValueError(f"--weight-decay: must be >= 0, got {cfg.weight_decay}")
    if not 0 < cfg.eval_fraction < 1:
        raise ValueError(f"--eval-fraction: must be in (0, 1), got {cfg.eval_fraction}")
    if cfg.seed < 0:  # numpy's data-order generator takes no negative seed
        raise ValueError(f"--seed: must be >= 0, got {cfg.seed}")
    return cfg


def main(argv: list[str] | None = None) -> int:
    """CLI entry point; returns 0, or 1 when a run diverged, 2 on bad arguments."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        if args.merge:
            if not args.json:
                raise ValueError("--merge: needs --json for the merged output")
            result = merge_results(args.merge)
            write_json(result, args.json)
        else:
            cfg = config_from_args(args)
            device = check_device(args.device)
            if args.json:
                check_writable(args.json, make_parents=True)
            result = pretrain(cfg, args.attention, device=device, roots=args.source,
                              cache_dir=args.cache_dir, max_files=args.max_files,
                              progress=not args.no_progress, json_path=args.json)
    except (ValueError, SetupError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(json.dumps({"final_eval_loss": result["final_eval_loss"],
                      "final_eval_loss_rel_to_bf16": result["final_eval_loss_rel_to_bf16"]}))
    return 1 if any(r.get("diverged_at") for r in result["runs"].values()) else 0


if __name__ == "__main__":
    raise SystemExit(main())
