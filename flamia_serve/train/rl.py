"""RL in one process: rollouts and GRPO training with the same attention numerics.

``python -m flamia_serve.train.rl --setup flamia-fp8 --json benchmarks/results/rl.json``
(or ``flamia rl ...``) trains a small ``transformers`` Llama to reverse digit strings. One
process holds the trainer and a rollout engine; every step

1. samples ``--prompts`` digit strings (the same strings for every setup: seeded per step),
   each prompt ``--group`` times, from the rollout engine at temperature 1, with the
   engine's log-prob of every sampled token;
2. scores each completion (:func:`reward`), turns rewards into group-normalised
   advantages (:func:`group_advantages`);
3. recomputes the completions' log-probs with the trainer (one packed forward, documents
   separated by ``position_ids`` / ``cu_seq_lens``), logs their mismatch against the
   engine's (:func:`mismatch_stats`), takes one on-policy policy-gradient step
   (:func:`policy_loss`, token mean) with AdamW — with ``--tis-cap C`` each token's term is
   weighted by the truncated importance ratio ``min(π_trainer / π_rollout, C)`` (detached),
   which corrects for rollouts that sample from a different distribution than the trainer
   computes (e.g. the NVFP4 cache);
4. pushes the new weights into the engine in-process.

Before RL a supervised warm-up (the same trainer attention) makes the model partly
competent, so the rollouts look like a policy, not noise, and the reward still has room to
rise: at most ``--sft-steps`` steps, stopped early once the exact-answer rate of sampled
answers to 64 fixed probe prompts (checked every ``SFT_CHECK_EVERY`` steps) reaches
``--sft-target``.

Task: prompt ``<s>`` + digits + ``=``; answer the digits reversed, then ``</s>``. Tokens:
``<pad> <s> </s> <unk> = ,`` and the ten digits (16 ids; :class:`DigitTokenizer`, saved as a
transformers tokenizer in the model directory that vLLM and transformers both load).

Rollout engines (:class:`RolloutEngine`):

* ``vllm`` (:class:`VllmEngine`, CUDA + vLLM 0.26): ``LLM(model=dir, attention_backend=...,
  kv_cache_dtype=...)`` on the model directory the trainer wrote after the warm-up;
  ``VLLM_ENABLE_V1_MULTIPROCESSING=0`` so the engine core runs in this process and
  ``LLM.apply_model`` reaches the worker's model: ``load_weights`` takes the trainer's
  parameters (rounded to BF16, what the engine runs), then the prefix cache is reset.
  Log-probs are vLLM's ``raw_logprobs`` of the sampled token (``logprobs=0``): with
  temperature 1 and no top-k/top-p they are the log-probs of the distribution sampled from.
* ``trainer`` (:class:`TrainerEngine`, any device, the CPU fallback): samples with the
  trainer model itself, recomputing the whole packed batch for every new token (the
  transformers FLAMIA hook takes no KV cache). With the trainer's own attention the
  mismatch is zero up to float rounding of the linear layers.

Setups (``--setup``, several run one after another; ``--trainer-attention``, ``--engine``,
``--vllm-backend``, ``--kv-cache-dtype``, ``--[no-]exact-causal`` override fields):

* ``flamia-fp8`` (a): trainer ``mxfp8``, ``exact_causal``; vLLM FLAMIA, ``fp8_per_token_head``
  cache (stores exactly the codes and exponents of that forward);
* ``flamia-nvfp4`` (b): the same trainer; vLLM FLAMIA, ``nvfp4`` cache;
* ``bf16-fa-fp8`` (c): trainer BF16 (``sdpa``); vLLM ``FLASH_ATTN`` with an ``fp8`` cache —
  the setup RL users run today;
* ``cpu``: trainer ``mxfp8`` ``exact_causal``, rollouts from the trainer (no vLLM, no GPU).

Model presets (``--model-size``): ``tiny`` (CPU tests; the default without a GPU), ``small``
(~13M parameters, 64 prompts x 8 samples per step; the default with one), ``demo`` (the
serve demo's Llama shape).

Several vLLM engines in one process keep their GPU memory after they are closed (vLLM
0.26, seen on the H200): keep ``--gpu-memory-utilization`` small, or run one process per
setup and combine the JSONs with ``--merge``.

JSON (``result_skeleton``): environment (GPU, versions, date), ``config``, ``task``,
``runs[name]`` with ``setup``, ``params``, ``engine``, ``sft`` (``loss`` per warm-up step,
``checks`` of the probe's exact rate, ``steps_done``),
``steps`` (per RL step: ``reward_mean``, ``exact_frac``, ``loss``, ``mismatch_abs_mean``,
``mismatch_abs_max``, ``kl_k3``, ... see :data:`STEP_KEYS`) and ``summary``;
``summary[name]`` repeats each run's summary. ``benchmarks/plot_rl.py`` draws the curves.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import gc
import importlib.util
import itertools
import json
import math
import os
import platform
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import ClassVar, Protocol

import torch

from flamia_serve.backend.demo import SMALL_LLAMA
from flamia_serve.files import check_writable
from flamia_serve.numerics.kv_pages import VLLM_KV_CACHE_DTYPES
from flamia_serve.train.pretrain import (
    ATTENTIONS,
    SetupError,
    _autocast,
    _progress,
    attention_setup,
    check_device,
    model_shape,
    read_json,
)

# ---------------------------------------------------------------- task and tokenizer

SPECIAL_TOKENS = ("<pad>", "<s>", "</s>", "<unk>")
CHAR_TOKENS = ("=", ",", *"0123456789")
VOCAB = SPECIAL_TOKENS + CHAR_TOKENS
PAD, BOS, EOS, UNK = range(4)
SEP = VOCAB.index("=")
VOCAB_SIZE = len(VOCAB)
#: how :func:`completion_text` renders a special token other than ``</s>`` (one character,
#: never a digit, so it can only lower a reward)
OTHER_CHAR = "?"


class DigitTokenizer:
    """Character-level tokenizer of the task: ids ``[0, 16)``, one id per character,
    specials ``<pad> <s> </s> <unk>`` = 0..3. ``encode`` maps every character (unknown ones
    to ``<unk>``); ``decode`` renders specials by name (as the saved transformers tokenizer
    does)."""

    vocab = VOCAB
    vocab_size = VOCAB_SIZE
    _ids: ClassVar[dict[str, int]] = {
        c: i for i, c in enumerate(CHAR_TOKENS, start=len(SPECIAL_TOKENS))
    }

    def encode(self, text: str) -> list[int]:
        return [self._ids.get(c, UNK) for c in text]

    def decode(self, ids: Sequence[int]) -> str:
        return "".join(VOCAB[_check_id(i)] for i in ids)

    def prompt_ids(self, digits: str) -> list[int]:
        """``<s>`` + digits + ``=`` (``digits``: a non-empty string of 0-9)."""
        if not digits or not digits.isdigit() or not digits.isascii():
            raise ValueError(f"digits: expected a non-empty string of 0-9, got {digits!r}")
        return [BOS, *self.encode(digits), SEP]

    def answer_ids(self, digits: str) -> list[int]:
        """The exact answer: ``digits`` reversed, then ``</s>``."""
        return [*self.encode(target_of(digits)), EOS]


def _check_id(i: int) -> int:
    if not 0 <= int(i) < VOCAB_SIZE:
        raise ValueError(f"token id {i} is outside the task's vocabulary [0, {VOCAB_SIZE})")
    return int(i)


def target_of(digits: str) -> str:
    """The task's answer to ``digits``: the string reversed."""
    return digits[::-1]


def completion_text(ids: Sequence[int]) -> tuple[str, bool]:
    """(text before the first ``</s>``, whether there was one). Characters render as
    themselves, other specials as ``OTHER_CHAR`` (one character each)."""
    chars = []
    for i in ids:
        i = _check_id(i)
        if i == EOS:
            return "".join(chars), True
        chars.append(VOCAB[i] if i >= len(SPECIAL_TOKENS) else OTHER_CHAR)
    return "".join(chars), False


def reward(completion: str, target: str, *, stopped: bool = True, partial: bool = True) -> float:
    """Verifiable reward of one completion (the text before ``</s>``).

    * 1.0 when ``completion == target`` and the model stopped (``stopped``: ``</s>`` seen);
    * otherwise, with ``partial``: ``0.5 * matches / max(len(completion), len(target))``,
      ``matches`` = positions ``i`` where both strings have the same character (so in
      [0, 0.5]; 0.5 only for the exact text without ``</s>``);
    * otherwise 0.0.
    """
    if not target:
        raise ValueError("target: must be a non-empty string")
    if stopped and completion == target:
        return 1.0
    if not partial:
        return 0.0
    matches = sum(a == b for a, b in zip(completion, target, strict=False))
    return 0.5 * matches / max(len(completion), len(target))


def hf_tokenizer():
    """The task tokenizer as a transformers fast tokenizer (``tokenizers`` WordLevel over
    single characters, specials ``<pad> <s> </s> <unk>``): the same ids as
    :class:`DigitTokenizer`."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({t: i for i, t in enumerate(VOCAB)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                                   pad_token="<pad>", unk_token="<unk>")  # fmt: skip


def sample_digits(n: int, min_digits: int, max_digits: int, gen: torch.Generator) -> list[str]:
    """``n`` random digit strings, lengths uniform in ``[min_digits, max_digits]``."""
    lengths = torch.randint(min_digits, max_digits + 1, (n,), generator=gen).tolist()
    return ["".join(map(str, torch.randint(0, 10, (k,), generator=gen).tolist())) for k in lengths]


# ---------------------------------------------------------------- GRPO pieces


def group_advantages(rewards: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """GRPO advantages: ``rewards`` ``[P, G]`` (P prompts, G samples each) ->
    ``(r - mean_g) / (std_g + eps)`` in float32, ``std_g`` the population standard deviation
    of the group (``correction=0``); a group of equal rewards gets exact zeros (float32
    rounding of its mean would otherwise leave up to ~1e-8 / ``eps``, same sign for all)."""
    if rewards.dim() != 2 or rewards.shape[1] < 1:
        raise ValueError(f"rewards: expected [prompts, group], got shape {tuple(rewards.shape)}")
    if not eps > 0:
        raise ValueError(f"eps: must be > 0, got {eps}")
    r = rewards.float()
    if not torch.isfinite(r).all():
        raise ValueError("rewards: must be finite")
    centered = r - r.mean(dim=1, keepdim=True)
    equal = r.amax(dim=1, keepdim=True) == r.amin(dim=1, keepdim=True)
    centered = torch.where(equal, torch.zeros_like(centered), centered)
    return centered / (r.std(dim=1, correction=0, keepdim=True) + eps)


def policy_loss(logprobs: torch.Tensor, advantages: torch.Tensor, lengths: Sequence[int],
                weights: torch.Tensor | None = None) -> torch.Tensor:  # fmt: skip
    """Policy-gradient loss, token mean: ``-Σ_i Σ_t w_it A_i logp_it / Σ_i len_i``.
    ``logprobs`` ``[N]`` (completions concatenated), ``advantages`` ``[n]`` (one per
    completion), ``lengths`` their token counts (sum N); ``weights`` ``[N]`` per-token
    importance weights (no gradient flows through them; None: all 1, on-policy)."""
    counts = torch.as_tensor(list(lengths), dtype=torch.long, device=logprobs.device)
    if counts.numel() != advantages.numel() or int(counts.sum()) != logprobs.numel():
        raise ValueError(f"lengths: {counts.numel()} completions of {int(counts.sum())} tokens "
                         f"do not match {advantages.numel()} advantages and "
                         f"{logprobs.numel()} log-probs")  # fmt: skip
    per_token = advantages.to(logprobs).repeat_interleave(counts)
    if weights is not None:
        if weights.shape != logprobs.shape:
            raise ValueError(f"weights: expected shape {tuple(logprobs.shape)}, got "
                             f"{tuple(weights.shape)}")  # fmt: skip
        per_token = per_token * weights.detach().to(logprobs)
    return -(per_token * logprobs).sum() / max(logprobs.numel(), 1)


def tis_weights(trainer: torch.Tensor, rollout: torch.Tensor, cap: float) -> torch.Tensor:
    """Truncated importance weights ``min(exp(trainer − rollout), cap)`` of sampled tokens
    (log-probs ``[N]``; detached, float32 on ``trainer``'s device)."""
    if not cap > 0:
        raise ValueError(f"cap: must be > 0, got {cap}")
    d = trainer.detach().float() - rollout.to(trainer.device).float()
    return d.exp().clamp(max=cap)


def mismatch_stats(rollout: torch.Tensor, trainer: torch.Tensor) -> dict[str, float]:
    """Per-token log-prob mismatch of the sampled tokens, ``Δ = trainer − rollout``:
    ``mismatch_abs_mean`` / ``mismatch_abs_max`` of ``|Δ|``, ``logprob_diff_mean`` (mean Δ;
    its negative is the k1 estimate of KL(rollout ‖ trainer)), ``kl_k3`` = mean of
    ``exp(Δ) − 1 − Δ`` (the non-negative k3 estimate of the same KL: tokens are sampled by
    the rollout engine), ``tokens``."""
    if rollout.shape != trainer.shape or rollout.dim() != 1:
        raise ValueError(f"rollout/trainer: expected two [N] tensors, got "
                         f"{tuple(rollout.shape)} and {tuple(trainer.shape)}")  # fmt: skip
    if rollout.numel() == 0:
        raise ValueError("rollout/trainer: no tokens")
    d = trainer.detach().double().cpu() - rollout.detach().double().cpu()
    return {
        "mismatch_abs_mean": float(d.abs().mean()),
        "mismatch_abs_max": float(d.abs().max()),
        "logprob_diff_mean": float(d.mean()),
        "kl_k3": float((torch.expm1(d) - d).mean()),
        "tokens": int(d.numel()),
    }


# ---------------------------------------------------------------- configuration


@dataclass(frozen=True)
class Preset:
    """Model shape (``pretrain.SHAPE_FIELDS``) and the RL defaults that go with it."""

    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    prompts: int
    group: int
    steps: int
    lr: float
    sft_steps: int
    sft_batch: int
    sft_lr: float
    sft_target: float
    min_digits: int
    max_digits: int


PRESETS = {
    # CPU smoke tests (reference path): d=64, ~0.3M parameters.
    "tiny": Preset(hidden=128, layers=2, heads=2, kv_heads=1, head_dim=64, intermediate=256,
                   prompts=4, group=4, steps=20, lr=1e-3, sft_steps=30, sft_batch=32,
                   sft_lr=3e-3, sft_target=0.0, min_digits=2, max_digits=4),
    # The H200 run: ~13M parameters, 64 prompts x 8 samples per step. On a CPU (BF16 SDPA)
    # the warm-up reached 8% exact answers after 120 steps; the target stops it at 30%.
    "small": Preset(hidden=512, layers=4, heads=4, kv_heads=2, head_dim=128, intermediate=1408,
                    prompts=64, group=8, steps=200, lr=3e-4, sft_steps=600, sft_batch=128,
                    sft_lr=1e-3, sft_target=0.3, min_digits=3, max_digits=8),
    # The serve demo's Llama shape (backend/demo.py: 6 layers, hidden 1024, 8/2 heads of 128).
    "demo": Preset(hidden=SMALL_LLAMA["hidden_size"], layers=SMALL_LLAMA["num_hidden_layers"],
                   heads=SMALL_LLAMA["num_attention_heads"],
                   kv_heads=SMALL_LLAMA["num_key_value_heads"], head_dim=SMALL_LLAMA["head_dim"],
                   intermediate=SMALL_LLAMA["intermediate_size"], prompts=64, group=8,
                   steps=200, lr=1e-4, sft_steps=600, sft_batch=128, sft_lr=5e-4,
                   sft_target=0.3, min_digits=3, max_digits=8),
}  # fmt: skip

ENGINES = ("vllm", "trainer")
VLLM_BACKENDS = ("FLAMIA", "FLASH_ATTN", "TRITON_ATTN", "FLASHINFER")


@dataclass(frozen=True)
class Setup:
    """Trainer attention and rollout engine of one run. ``trainer_attention``: ``bf16``
    (transformers ``sdpa``) or a FLAMIA recipe; ``exact_causal`` (FLAMIA only, else None);
    ``engine``: ``vllm`` or ``trainer``; ``vllm_backend`` / ``kv_cache_dtype``: vLLM's
    ``attention_backend`` / ``kv_cache_dtype`` (None with the trainer engine)."""

    trainer_attention: str
    exact_causal: bool | None
    engine: str
    vllm_backend: str | None = None
    kv_cache_dtype: str | None = None


SETUPS = {
    "flamia-fp8": Setup("mxfp8", True, "vllm", "FLAMIA", "fp8_per_token_head"),  # (a)
    "flamia-nvfp4": Setup("mxfp8", True, "vllm", "FLAMIA", "nvfp4"),  # (b)
    "bf16-fa-fp8": Setup("bf16", None, "vllm", "FLASH_ATTN", "fp8"),  # (c)
    "cpu": Setup("mxfp8", True, "trainer"),
}
OVERRIDES = ("trainer_attention", "exact_causal", "engine", "vllm_backend", "kv_cache_dtype")


def resolve_setup(name: str, **overrides: object) -> tuple[str, Setup]:
    """(run name, setup): preset ``name`` with the non-None ``overrides`` applied; the run
    name lists the overrides (``cpu+engine=vllm``). ``ValueError`` names a bad field."""
    if name not in SETUPS:
        raise ValueError(f"--setup: expected one of {tuple(SETUPS)}, got {name!r}")
    for key in overrides:
        if key not in OVERRIDES:
            raise ValueError(f"setup override: unknown field {key!r}")
    given = {k: v for k, v in overrides.items() if v is not None}
    setup = dataclasses.replace(SETUPS[name], **given)
    if setup.trainer_attention not in ATTENTIONS:
        raise ValueError(f"--trainer-attention: expected one of {ATTENTIONS}, "
                         f"got {setup.trainer_attention!r}")  # fmt: skip
    if setup.engine not in ENGINES:
        raise ValueError(f"--engine: expected one of {ENGINES}, got {setup.engine!r}")
    if setup.trainer_attention == "bf16":
        if given.get("exact_causal") is not None:
            raise ValueError("--exact-causal: only for a FLAMIA trainer attention, not bf16")
        setup = dataclasses.replace(setup, exact_causal=None)
    elif setup.exact_causal is None:
        setup = dataclasses.replace(setup, exact_causal=True)
    if setup.engine == "trainer":
        for key, flag in (("vllm_backend", "--vllm-backend"),
                          ("kv_cache_dtype", "--kv-cache-dtype")):  # fmt: skip
            if given.get(key) is not None:
                raise ValueError(f"{flag}: only with --engine vllm (setup {name!r} rolls out "
                                 "with the trainer)")  # fmt: skip
        setup = dataclasses.replace(setup, vllm_backend=None, kv_cache_dtype=None)
    else:
        if setup.vllm_backend is None:
            raise ValueError(f"--engine vllm: needs --vllm-backend (one of {VLLM_BACKENDS})")
        if setup.vllm_backend not in VLLM_BACKENDS:
            raise ValueError(f"--vllm-backend: expected one of {VLLM_BACKENDS}, "
                             f"got {setup.vllm_backend!r}")  # fmt: skip
        if setup.kv_cache_dtype is None:
            setup = dataclasses.replace(setup, kv_cache_dtype="auto")
        if setup.kv_cache_dtype not in VLLM_KV_CACHE_DTYPES:
            raise ValueError(f"--kv-cache-dtype: expected one of {tuple(VLLM_KV_CACHE_DTYPES)}, "
                             f"got {setup.kv_cache_dtype!r}")  # fmt: skip
    label = name + "".join(
        f"+{k}={'on' if v is True else 'off' if v is False else v}" for k, v in given.items()
    )
    return label, setup


@dataclass(frozen=True)
class RLConfig:
    """Everything a run depends on besides its setup (recorded in the JSON)."""

    model_size: str
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    prompts: int
    group: int
    steps: int
    lr: float
    weight_decay: float
    clip: float
    adv_eps: float
    sft_steps: int
    sft_batch: int
    sft_lr: float
    sft_target: float
    min_digits: int
    max_digits: int
    partial_credit: bool
    seed: int
    flamia_path: str = "auto"
    gpu_memory_utilization: float = 0.2
    enforce_eager: bool = True
    vllm_tokenizer: bool = True
    #: truncated importance sampling: cap C of the per-token weight min(π_trainer/π_rollout, C)
    #: in the policy loss (None: on-policy loss, no weights)
    tis_cap: float | None = None
    #: wall-clock seconds for the RL steps of one setup (None: no limit); when they run out
    #: the run ends early and records ``time_limited_at``
    time_limit: float | None = None

    @property
    def max_tokens(self) -> int:
        """Generation limit: the longest answer and its ``</s>``."""
        return self.max_digits + 1

    @property
    def max_model_len(self) -> int:
        """Positions a sequence can use (prompt + answer), rounded up to 16, at least 32."""
        longest = (self.max_digits + 2) + self.max_tokens
        return max(32, -(-longest // 16) * 16)


def check_config(cfg: RLConfig) -> RLConfig:
    """``ValueError`` naming the first bad field (as its command-line flag)."""
    def bad(name: str, rule: str) -> ValueError:
        return ValueError(f"--{name.replace('_', '-')}: must be {rule}, "
                          f"got {getattr(cfg, name)}")  # fmt: skip

    for name in ("steps", "prompts", "sft_batch", "min_digits"):
        if getattr(cfg, name) < 1:
            raise bad(name, ">= 1")
    if cfg.group < 2:
        raise bad("group", ">= 2 (GRPO compares samples of one prompt)")
    if cfg.sft_steps < 0:
        raise bad("sft_steps", ">= 0")
    if cfg.max_digits < cfg.min_digits:
        raise bad("max_digits", f">= --min-digits ({cfg.min_digits})")
    if cfg.max_digits > 64:
        raise bad("max_digits", "<= 64")
    if not 0 <= cfg.sft_target <= 1:
        raise bad("sft_target", "in [0, 1]")
    for name in ("lr", "sft_lr", "clip", "adv_eps"):
        if not getattr(cfg, name) > 0:
            raise bad(name, "> 0")
    if not cfg.weight_decay >= 0:
        raise bad("weight_decay", ">= 0")
    if not 0 < cfg.gpu_memory_utilization <= 1:
        raise bad("gpu_memory_utilization", "in (0, 1]")
    if cfg.time_limit is not None and not cfg.time_limit > 0:
        raise bad("time_limit", "> 0")
    if cfg.tis_cap is not None and not (math.isfinite(cfg.tis_cap) and cfg.tis_cap > 0):
        raise bad("tis_cap", "a finite number > 0")
    if cfg.flamia_path not in ("auto", "kernel", "reference"):
        raise ValueError(f"--flamia-path: expected auto, kernel or reference, "
                         f"got {cfg.flamia_path!r}")  # fmt: skip
    return cfg


# ---------------------------------------------------------------- model and packing


def hf_config(cfg: RLConfig) -> dict:
    """``config.json`` of the model directory: the serve demo's Llama fields with ``cfg``'s
    shape, the task's vocabulary and special ids, BF16 for vLLM."""
    return {**SMALL_LLAMA, "hidden_size": cfg.hidden, "intermediate_size": cfg.intermediate,
            "num_attention_heads": cfg.heads, "num_key_value_heads": cfg.kv_heads,
            "head_dim": cfg.head_dim, "num_hidden_layers": cfg.layers, "vocab_size": VOCAB_SIZE,
            "max_position_embeddings": cfg.max_model_len, "bos_token_id": BOS,
            "eos_token_id": EOS, "pad_token_id": PAD, "tie_word_embeddings": False,
            "torch_dtype": "bfloat16"}  # fmt: skip


def build_model(cfg: RLConfig, setup: Setup):
    """The trainer: ``LlamaForCausalLM`` from :func:`hf_config`, initialised from
    ``cfg.seed`` (the same weights for every setup), FP32 parameters, no KV cache, attention
    ``sdpa`` (bf16) or ``flamia`` with ``flamia_recipe`` / ``flamia_exact_causal``."""
    from transformers import LlamaConfig, LlamaForCausalLM

    impl, extra = attention_setup(setup.trainer_attention, bool(setup.exact_causal),
                                  cfg.flamia_path)  # fmt: skip
    fields = {k: v for k, v in hf_config(cfg).items()
              if k not in ("architectures", "model_type", "torch_dtype")}  # fmt: skip
    config = LlamaConfig(**fields, use_cache=False, attn_implementation=impl, **extra)
    torch.manual_seed(cfg.seed)
    return LlamaForCausalLM(config)


def write_model_dir(path: str | Path, model: torch.nn.Module, cfg: RLConfig) -> Path:
    """Write ``config.json`` (:func:`hf_config`), ``model.safetensors`` (the trainer's FP32
    weights) and the tokenizer: a directory that vLLM and transformers both load."""
    from safetensors.torch import save_file

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(hf_config(cfg), indent=1) + "\n")
    state = {k: v.detach().float().cpu().contiguous() for k, v in model.state_dict().items()}
    save_file(state, str(path / "model.safetensors"), metadata={"format": "pt"})
    hf_tokenizer().save_pretrained(str(path))
    return path


@dataclass(frozen=True)
class Packed:
    """Sequences packed into one row: ``input_ids`` / ``position_ids`` ``[T]`` int64
    (positions restart at 0 per sequence), ``cu_seqlens`` ``[B+1]`` int32, ``max_seqlen``."""

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    cu_seqlens: torch.Tensor
    max_seqlen: int


def pack(seqs: Sequence[Sequence[int]], device: torch.device | str = "cpu") -> Packed:
    """Pack non-empty token sequences (see :class:`Packed`)."""
    if not seqs or any(len(s) == 0 for s in seqs):
        raise ValueError("seqs: expected at least one sequence, none empty")
    lengths = [len(s) for s in seqs]
    ids = torch.tensor([t for s in seqs for t in s], dtype=torch.long)
    pos = torch.cat([torch.arange(n) for n in lengths])
    cu = torch.zeros(len(seqs) + 1, dtype=torch.int32)
    cu[1:] = torch.tensor(lengths).cumsum(0)
    return Packed(ids.to(device), pos.to(device), cu.to(device), max(lengths))


def packed_log_softmax(model: torch.nn.Module, packed: Packed) -> torch.Tensor:
    """Next-token log-probs ``[T, V]`` float32 of a packed row (documents from
    ``position_ids`` and, for FLAMIA, ``cu_seq_lens``: what pretraining passes), BF16
    autocast on CUDA."""
    device = packed.input_ids.device
    with _autocast(device):
        out = model(input_ids=packed.input_ids[None], position_ids=packed.position_ids[None],
                    use_cache=False, cu_seq_lens_q=packed.cu_seqlens,
                    cu_seq_lens_k=packed.cu_seqlens, max_length_q=packed.max_seqlen,
                    max_length_k=packed.max_seqlen)  # fmt: skip
    return out.logits[0].float().log_softmax(-1)


def completion_logprobs(
    model: torch.nn.Module,
    prompts: Sequence[Sequence[int]],
    completions: Sequence[Sequence[int]],
    device: torch.device,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Trainer log-probs of every completion token given its prompt and the completion's
    earlier tokens: one packed forward. Returns ``(logp [N], entropy [N])`` float32, N =
    total completion tokens in order; ``logp`` carries the graph, ``entropy`` (of the
    trainer's next-token distribution at those positions) does not."""
    if len(prompts) != len(completions):
        raise ValueError(f"prompts/completions: {len(prompts)} vs {len(completions)}")
    if any(len(c) == 0 for c in completions) or any(len(p) == 0 for p in prompts):
        raise ValueError("prompts/completions: every prompt and completion needs a token")
    seqs = [[*p, *c] for p, c in zip(prompts, completions, strict=True)]
    packed = pack(seqs, device)
    logp_all = packed_log_softmax(model, packed)
    starts = [0, *itertools.accumulate(len(x) for x in seqs)][:-1]  # host side: no sync
    rows = torch.cat([torch.arange(s + len(p) - 1, s + len(p) - 1 + len(c))
                      for s, p, c in zip(starts, prompts, completions, strict=True)])  # fmt: skip
    tokens = torch.tensor([t for c in completions for t in c], dtype=torch.long)
    rows, tokens = rows.to(device), tokens.to(device)
    picked = logp_all[rows]
    logp = picked.gather(1, tokens[:, None])[:, 0]
    with torch.no_grad():
        entropy = -(picked.exp() * picked).sum(-1)
    return logp, entropy


# ---------------------------------------------------------------- rollout engines


@dataclass(frozen=True)
class Completion:
    """One sampled completion: ``token_ids`` (``</s>`` included when produced), the engine's
    log-prob of each, ``stopped`` (ended by ``</s>``)."""

    token_ids: tuple[int, ...]
    logprobs: tuple[float, ...]
    stopped: bool


class RolloutEngine(Protocol):
    """What the loop needs from a rollout engine."""

    name: str

    def generate(self, prompts: Sequence[Sequence[int]], max_tokens: int,
                 seed: int) -> list[Completion]:  # fmt: skip
        """One completion per prompt (temperature 1, stop at ``</s>`` or ``max_tokens``)."""
        ...

    def update_weights(self, model: torch.nn.Module) -> None:
        """Make the engine sample from ``model``'s current weights."""
        ...

    def info(self) -> dict:
        """What to record about the engine in the JSON."""
        ...

    def close(self) -> None: ...


class TrainerEngine:
    """Rollouts from the trainer model itself (any device): every new token recomputes the
    packed batch of unfinished sequences (no KV cache). ``attention``: roll out with another
    attention choice than the trainer's (``bf16`` or a FLAMIA recipe, same ``exact_causal``
    field) — the mismatch then measures that difference; None = the trainer's own."""

    name = "trainer"

    def __init__(self, model: torch.nn.Module, attention: str | None = None) -> None:
        if attention is not None and attention not in ATTENTIONS:
            raise ValueError(f"attention: expected one of {ATTENTIONS}, got {attention!r}")
        self.model = model
        self.attention = attention

    @contextlib.contextmanager
    def _attention(self) -> Iterator[None]:
        if self.attention is None:
            yield
            return
        config = self.model.config
        impl, recipe = config._attn_implementation, getattr(config, "flamia_recipe", None)
        exact = bool(getattr(config, "flamia_exact_causal", True))
        new_impl, extra = attention_setup(self.attention, exact,
                                          getattr(config, "flamia_path", "auto"))  # fmt: skip
        try:
            self.model.set_attn_implementation(new_impl)
            for key, value in extra.items():
                setattr(config, key, value)
            yield
        finally:
            self.model.set_attn_implementation(impl)
            if recipe is not None:
                config.flamia_recipe = recipe

    def generate(self, prompts: Sequence[Sequence[int]], max_tokens: int,
                 seed: int) -> list[Completion]:  # fmt: skip
        if max_tokens < 1:
            raise ValueError(f"max_tokens: must be >= 1, got {max_tokens}")
        device = next(self.model.parameters()).device
        gen = torch.Generator().manual_seed(seed)
        seqs = [list(p) for p in prompts]
        out: list[list[int]] = [[] for _ in prompts]
        lps: list[list[float]] = [[] for _ in prompts]
        active = list(range(len(prompts)))
        was_training = self.model.training
        self.model.eval()
        try:
            with torch.no_grad(), self._attention():
                for _ in range(max_tokens):
                    if not active:
                        break
                    packed = pack([seqs[i] for i in active], device)
                    logp = packed_log_softmax(self.model, packed)
                    last = logp[packed.cu_seqlens[1:].long() - 1].cpu()  # [B, V]
                    picks = torch.multinomial(last.double().exp(), 1, generator=gen)[:, 0]
                    still = []
                    for row, i in enumerate(active):
                        t = int(picks[row])
                        seqs[i].append(t)
                        out[i].append(t)
                        lps[i].append(float(last[row, t]))
                        if t != EOS:
                            still.append(i)
                    active = still
        finally:
            self.model.train(was_training)
        return [Completion(tuple(o), tuple(lp), bool(o) and o[-1] == EOS)
                for o, lp in zip(out, lps, strict=True)]  # fmt: skip

    def update_weights(self, model: torch.nn.Module) -> None:
        if model is not self.model:
            raise ValueError("model: the trainer engine samples with the trainer model itself")

    def info(self) -> dict:
        return {"engine": "trainer", "rollout_attention": self.attention}

    def close(self) -> None:
        pass


def need_train_extra() -> None:
    """``SetupError`` naming the ``train`` extra when transformers>=5 / tokenizers are missing."""
    for module in ("transformers", "tokenizers", "safetensors"):
        if importlib.util.find_spec(module) is None:
            raise SetupError(f"flamia rl needs {module} (the 'train' extra): "
                             "pip install -e '.[train]'")  # fmt: skip
    if int(metadata.version("transformers").split(".")[0]) < 5:
        raise SetupError(f"flamia rl needs transformers>=5, found "
                         f"{metadata.version('transformers')}")  # fmt: skip


def vllm_missing() -> str | None:
    """None when vLLM is importable, else a one-line reason naming the extra."""
    if importlib.util.find_spec("vllm") is None:
        return ("rolls out with vLLM, which is not installed: pip install -e '.[vllm]' "
                "(the 'vllm' extra, vLLM 0.26)")  # fmt: skip
    return None


class VllmEngine:
    """vLLM ``LLM`` in this process on ``model_dir`` (BF16 model, prefix caching, eager by
    default), weights updated in place through ``LLM.apply_model`` + ``load_weights``."""

    name = "vllm"

    def __init__(self, model_dir: str | Path, *, backend: str, kv_cache_dtype: str, seed: int,
                 gpu_memory_utilization: float, max_model_len: int, max_num_seqs: int,
                 enforce_eager: bool = True, load_tokenizer: bool = True) -> None:  # fmt: skip
        if os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING", "0") != "0":
            raise SetupError("VLLM_ENABLE_V1_MULTIPROCESSING must be 0 (or unset): the "
                             "weight update reaches the engine's model in this process")
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        os.environ.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        missing = vllm_missing()
        if missing:
            raise SetupError(f"--engine vllm {missing}")
        try:
            from vllm import LLM, SamplingParams
            from vllm.inputs import TokensPrompt
        except ImportError as e:
            raise SetupError(f"--engine vllm: vLLM does not import ({e}); the 'vllm' extra "
                             "pins vLLM 0.26: pip install -e '.[vllm]'") from None
        if backend == "FLAMIA":
            from flamia_serve.backend import register

            register()
        self._sampling, self._prompt = SamplingParams, TokensPrompt
        self.backend, self.kv_cache_dtype = backend, kv_cache_dtype
        self._checked = False
        t0 = time.perf_counter()
        self.llm = LLM(model=str(model_dir), attention_backend=backend,
                       kv_cache_dtype=kv_cache_dtype, dtype="bfloat16", seed=seed,
                       gpu_memory_utilization=gpu_memory_utilization,
                       max_model_len=max_model_len, max_num_seqs=max_num_seqs,
                       enable_prefix_caching=True, enforce_eager=enforce_eager,
                       skip_tokenizer_init=not load_tokenizer)  # fmt: skip
        self.startup_s = time.perf_counter() - t0
        cache = self.llm.llm_engine.vllm_config.cache_config
        self.kv_tokens = (cache.num_gpu_blocks or 0) * cache.block_size
        self.settings = {"gpu_memory_utilization": gpu_memory_utilization,
                         "max_model_len": max_model_len, "max_num_seqs": max_num_seqs,
                         "enforce_eager": enforce_eager, "load_tokenizer": load_tokenizer,
                         "enable_prefix_caching": True, "dtype": "bfloat16"}  # fmt: skip

    def generate(self, prompts: Sequence[Sequence[int]], max_tokens: int,
                 seed: int) -> list[Completion]:  # fmt: skip
        params = [self._sampling(temperature=1.0, top_p=1.0, max_tokens=max_tokens, logprobs=0,
                                 stop_token_ids=[EOS], seed=seed + i, detokenize=False)
                  for i in range(len(prompts))]  # fmt: skip
        outs = self.llm.generate([self._prompt(prompt_token_ids=list(p)) for p in prompts],
                                 params, use_tqdm=False)  # fmt: skip
        result = []
        for o in outs:
            c = o.outputs[0]
            ids = tuple(int(t) for t in c.token_ids)
            if c.logprobs is None or len(c.logprobs) != len(ids):
                raise RuntimeError(f"vLLM returned {len(ids)} tokens but "
                                   f"{None if c.logprobs is None else len(c.logprobs)} "
                                   "log-prob entries")  # fmt: skip
            lps = tuple(float(d[t].logprob) for t, d in zip(ids, c.logprobs, strict=True))
            result.append(Completion(ids, lps, bool(ids) and ids[-1] == EOS))
        return result

    def update_weights(self, model: torch.nn.Module) -> None:
        """Copy the trainer's parameters (rounded to BF16) into the engine's model; the
        first call also checks that every engine parameter was written."""
        tensors = [(n, p.detach().to(torch.bfloat16)) for n, p in model.named_parameters()]
        check = not self._checked

        def load(engine_model: torch.nn.Module) -> list[str]:
            loaded = engine_model.load_weights(iter(tensors))
            if not check:
                return []
            names = {n for n, _ in engine_model.named_parameters()}
            return sorted(n for n in names - set(loaded or ()) if "scale" not in n)

        missing = self.llm.apply_model(load)[0]
        if missing:
            raise RuntimeError(f"weight update left {len(missing)} vLLM parameters unwritten, "
                               f"e.g. {missing[:3]}")  # fmt: skip
        self._checked = True
        self.llm.reset_prefix_cache()

    def info(self) -> dict:
        return {"engine": "vllm", "backend": self.backend, "kv_cache_dtype": self.kv_cache_dtype,
                "startup_s": round(self.startup_s, 1), "kv_tokens": self.kv_tokens,
                "logprobs_mode": "raw_logprobs", "settings": self.settings}  # fmt: skip

    def close(self) -> None:
        # The engine core runs in this process; its GPU memory is not all returned.
        del self.llm
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def make_engine(setup: Setup, model: torch.nn.Module, model_dir: Path,
                cfg: RLConfig) -> RolloutEngine:  # fmt: skip
    """The rollout engine of ``setup``. vLLM loads ``model_dir``, then takes one weight push
    (it checks that the trainer's parameters reach every engine parameter before step 1)."""
    if setup.engine == "trainer":
        return TrainerEngine(model)
    engine = VllmEngine(model_dir, backend=str(setup.vllm_backend),
                      kv_cache_dtype=str(setup.kv_cache_dtype), seed=cfg.seed,
                      gpu_memory_utilization=cfg.gpu_memory_utilization,
                      max_model_len=cfg.max_model_len,
                      max_num_seqs=min(cfg.prompts * cfg.group, 1024),
                      enforce_eager=cfg.enforce_eager,
                      load_tokenizer=cfg.vllm_tokenizer)  # fmt: skip
    try:
        engine.update_weights(model)
    except BaseException:
        engine.close()
        raise
    return engine


# ---------------------------------------------------------------- training

#: keys of every per-step record in ``runs[name]["steps"]``
STEP_KEYS = ("step", "reward_mean", "reward_std", "exact_frac", "loss", "grad_norm",
             "mismatch_abs_mean", "mismatch_abs_max", "logprob_diff_mean", "kl_k3", "tokens",
             "tis_weight_mean", "tis_capped_frac",
             "entropy", "completion_len_mean", "stopped_frac", "rollout_s", "train_s",
             "push_s")  # fmt: skip
#: keys of ``runs[name]["summary"]`` (and of the top-level ``summary[name]``)
SUMMARY_KEYS = ("reward_first", "reward_last", "exact_first", "exact_last",
                "mismatch_abs_mean", "mismatch_abs_max", "kl_k3", "steps_done")  # fmt: skip


def _prompt_gen(cfg: RLConfig, step: int) -> torch.Generator:
    return torch.Generator().manual_seed(cfg.seed * 1_000_003 + step)


#: warm-up steps between two probes of the exact-answer rate (``--sft-target``)
SFT_CHECK_EVERY = 25
#: probe prompts of the warm-up check
SFT_PROBES = 64


def probe_exact(model: torch.nn.Module, cfg: RLConfig) -> float:
    """Exact-answer rate of one sampled answer (temperature 1, the trainer rolls out) to each
    of ``SFT_PROBES`` fixed prompts."""
    tok = DigitTokenizer()
    gen = torch.Generator().manual_seed(cfg.seed + 104_729)
    digits = sample_digits(SFT_PROBES, cfg.min_digits, cfg.max_digits, gen)
    comps = TrainerEngine(model).generate([tok.prompt_ids(d) for d in digits], cfg.max_tokens,
                                          seed=cfg.seed)  # fmt: skip
    hits = [completion_text(c.token_ids) == (target_of(d), True)
            for c, d in zip(comps, digits, strict=True)]  # fmt: skip
    return sum(hits) / len(hits)


def sft_warmup(model: torch.nn.Module, cfg: RLConfig, device: torch.device,
               bar=None) -> dict:  # fmt: skip
    """Supervised warm-up: up to ``cfg.sft_steps`` AdamW steps on ``cfg.sft_batch`` random
    examples each (cross-entropy of the answer tokens, token mean); with ``cfg.sft_target``
    > 0 the probe (:func:`probe_exact`) runs every ``SFT_CHECK_EVERY`` steps and stops the
    warm-up once it reaches the target. Returns ``{"loss": [per step], "checks": [{"step",
    "exact_frac"}], "steps_done"}``."""
    tok = DigitTokenizer()
    gen = torch.Generator().manual_seed(cfg.seed + 7919)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.sft_lr, betas=(0.9, 0.99),
                            weight_decay=cfg.weight_decay)  # fmt: skip
    losses: list[float] = []
    checks: list[dict] = []
    model.train()
    for step in range(cfg.sft_steps):
        digits = sample_digits(cfg.sft_batch, cfg.min_digits, cfg.max_digits, gen)
        logp, _ = completion_logprobs(model, [tok.prompt_ids(d) for d in digits],
                                      [tok.answer_ids(d) for d in digits], device)  # fmt: skip
        loss = -logp.mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.clip)
        opt.step()
        losses.append(float(loss.detach()))
        postfix = {"sft_loss": f"{losses[-1]:.3f}"}
        done = step + 1
        if cfg.sft_target > 0 and done % SFT_CHECK_EVERY == 0:
            checks.append({"step": done, "exact_frac": probe_exact(model, cfg)})
            postfix["exact"] = f"{checks[-1]['exact_frac']:.2f}"
        if bar is not None:
            bar.set_postfix(postfix, refresh=False)
            bar.update(1)
        if checks and checks[-1]["step"] == done and checks[-1]["exact_frac"] >= cfg.sft_target:
            if bar is not None:
                bar.update(cfg.sft_steps - done)
            break
    return {"loss": losses, "checks": checks, "steps_done": len(losses)}


def rl_step(model: torch.nn.Module, engine: RolloutEngine, opt: torch.optim.Optimizer,
            cfg: RLConfig, step: int, device: torch.device) -> dict:  # fmt: skip
    """One GRPO step (rollouts, rewards, advantages, recomputed log-probs, mismatch, update,
    weight push); returns the step record (:data:`STEP_KEYS`)."""
    tok = DigitTokenizer()
    digits = sample_digits(cfg.prompts, cfg.min_digits, cfg.max_digits, _prompt_gen(cfg, step))
    prompts = [tok.prompt_ids(d) for d in digits for _ in range(cfg.group)]
    targets = [target_of(d) for d in digits for _ in range(cfg.group)]
    t0 = time.perf_counter()
    comps = engine.generate(prompts, cfg.max_tokens, seed=cfg.seed * 1_000_003 + step * 4099)
    t1 = time.perf_counter()
    rewards, exact = [], []
    for c, target in zip(comps, targets, strict=True):
        text, stopped = completion_text(c.token_ids)
        rewards.append(reward(text, target, stopped=c.stopped and stopped,
                              partial=cfg.partial_credit))  # fmt: skip
        exact.append(stopped and text == target)
    r = torch.tensor(rewards, dtype=torch.float32).view(cfg.prompts, cfg.group)
    adv = group_advantages(r, cfg.adv_eps).flatten()
    model.train()
    logp, entropy = completion_logprobs(model, prompts, [c.token_ids for c in comps], device)
    rollout_lp = torch.tensor([x for c in comps for x in c.logprobs], dtype=torch.float64)
    stats = mismatch_stats(rollout_lp, logp.detach())
    lengths = [len(c.token_ids) for c in comps]
    weights = None if cfg.tis_cap is None else tis_weights(logp, rollout_lp, cfg.tis_cap)
    loss = policy_loss(logp, adv.to(device), lengths, weights)
    opt.zero_grad(set_to_none=True)
    loss.backward()
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.clip)
    opt.step()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    t2 = time.perf_counter()
    engine.update_weights(model)
    t3 = time.perf_counter()
    return {
        "step": step + 1, "reward_mean": float(r.mean()),
        "reward_std": float(r.std(correction=0)), "exact_frac": sum(exact) / len(exact),
        "loss": float(loss.detach()), "grad_norm": float(grad_norm), **stats,
        "tis_weight_mean": None if weights is None else float(weights.mean()),
        "tis_capped_frac": None if weights is None else float(
            (weights >= cfg.tis_cap).float().mean()),
        "entropy": float(entropy.mean()), "completion_len_mean": sum(lengths) / len(lengths),
        "stopped_frac": sum(c.stopped for c in comps) / len(comps),
        "rollout_s": t1 - t0, "train_s": t2 - t1, "push_s": t3 - t2,
    }  # fmt: skip


def summarize_run(steps: Sequence[dict]) -> dict:
    """Run summary (:data:`SUMMARY_KEYS`): mean reward / exact fraction over the first and
    the last tenth of the steps (at least one step each), mismatch means over all steps
    (``mismatch_abs_max``: the largest)."""
    if not steps:
        return dict.fromkeys(SUMMARY_KEYS[:-1], None) | {"steps_done": 0}
    k = max(1, len(steps) // 10)

    def mean(key: str, part: Sequence[dict]) -> float:
        return sum(s[key] for s in part) / len(part)

    return {
        "reward_first": mean("reward_mean", steps[:k]),
        "reward_last": mean("reward_mean", steps[-k:]),
        "exact_first": mean("exact_frac", steps[:k]),
        "exact_last": mean("exact_frac", steps[-k:]),
        "mismatch_abs_mean": mean("mismatch_abs_mean", steps),
        "mismatch_abs_max": max(s["mismatch_abs_max"] for s in steps),
        "kl_k3": mean("kl_k3", steps),
        "steps_done": len(steps),
    }


def train_one(cfg: RLConfig, name: str, setup: Setup, device: torch.device, *,
              progress: bool = True, model_dir: str | Path | None = None) -> dict:  # fmt: skip
    """Warm up, write the model directory, start the engine, run ``cfg.steps`` RL steps;
    return the run record. Stops early, with ``diverged_at`` set, on a non-finite loss. A
    ``model_dir`` that is kept (given) ends up holding the trained model."""
    keep = model_dir is not None
    model = build_model(cfg, setup).to(device)
    bar = _progress(cfg.sft_steps + cfg.steps, name, progress)
    t_start = time.perf_counter()
    sft = sft_warmup(model, cfg, device, bar)
    with contextlib.ExitStack() as stack:
        if model_dir is None:
            model_dir = stack.enter_context(tempfile.TemporaryDirectory(prefix="flamia-rl-"))
        path = write_model_dir(Path(model_dir) / name, model, cfg)
        engine = make_engine(setup, model, path, cfg)
        stack.callback(engine.close)
        opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=(0.9, 0.99),
                                weight_decay=cfg.weight_decay)  # fmt: skip
        steps: list[dict] = []
        diverged_at = time_limited_at = None
        t_rl = time.perf_counter()
        for step in range(cfg.steps):
            rec = rl_step(model, engine, opt, cfg, step, device)
            steps.append(rec)
            if not math.isfinite(rec["loss"]):
                diverged_at = step + 1
                break
            if cfg.time_limit is not None and time.perf_counter() - t_rl > cfg.time_limit:
                time_limited_at = step + 1
                break
            if bar is not None:
                bar.set_postfix({"reward": f"{rec['reward_mean']:.3f}",
                                 "|dlp|": f"{rec['mismatch_abs_mean']:.2e}",
                                 "k3": f"{rec['kl_k3']:.1e}"}, refresh=False)  # fmt: skip
                bar.update(1)
        if keep:  # the trained weights (the engine has its own copy)
            write_model_dir(path, model, cfg)
        engine_info = engine.info()
    if bar is not None:
        bar.close()
    return {
        "setup": dataclasses.asdict(setup),
        "attn_implementation": model.config._attn_implementation,
        "params": sum(p.numel() for p in model.parameters()),
        "engine": engine_info,
        "sft": sft,
        "steps": steps,
        "diverged_at": diverged_at,
        "time_limit": cfg.time_limit,
        "tis_cap": cfg.tis_cap,
        "time_limited_at": time_limited_at,
        "seconds": time.perf_counter() - t_start,
        "summary": summarize_run(steps),
    }


def env_info(device: torch.device) -> dict:
    """Where the run happened: GPU, library versions, date."""
    def version(dist: str) -> str:
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            return "not installed"

    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    return {"gpu": gpu, "device": str(device), "torch": torch.__version__,
            "cuda": str(torch.version.cuda), "triton": version("triton"),
            "transformers": version("transformers"), "tokenizers": version("tokenizers"),
            "vllm": version("vllm"), "python": platform.python_version(),
            "date": datetime.date.today().isoformat()}  # fmt: skip


def task_info(cfg: RLConfig) -> dict:
    return {"name": "reverse digits", "vocab": list(VOCAB),
            "prompt": "<s> digits =", "answer": "reversed digits </s>",
            "min_digits": cfg.min_digits, "max_digits": cfg.max_digits,
            "max_tokens": cfg.max_tokens, "partial_credit": cfg.partial_credit,
            "reward": "1 exact (with </s>); else 0.5 * matching positions / longer length"
                      if cfg.partial_credit else "1 exact (with </s>), else 0",
            "temperature": 1.0}  # fmt: skip


def result_skeleton(cfg: RLConfig, env: dict) -> dict:
    """The JSON's shape: ``benchmark`` = ``"rl"``, the :func:`env_info` keys, ``config``
    (:class:`RLConfig`), ``task``, ``runs`` (name -> run record: ``setup``, ``params``,
    ``engine``, ``sft``, ``steps`` of :data:`STEP_KEYS`, ``diverged_at``, ``time_limit``,
    ``tis_cap``, ``time_limited_at``, ``seconds``, ``summary``) and ``summary`` (name -> the
    run's summary, :data:`SUMMARY_KEYS`)."""
    return {"benchmark": "rl", **env, "config": dataclasses.asdict(cfg), "task": task_info(cfg),
            "runs": {}, "summary": {}}  # fmt: skip


def write_json(result: dict, path: str | Path) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=1) + "\n")


def check_environment(setups: Sequence[tuple[str, Setup]], device: torch.device) -> None:
    """Before any work: every setup can run here (``SetupError`` / ``ValueError``)."""
    for name, setup in setups:
        attention_setup(setup.trainer_attention, bool(setup.exact_causal))
        if setup.engine == "vllm":
            missing = vllm_missing()
            if missing:
                raise SetupError(f"setup {name!r} {missing}")
            if device.type != "cuda" or not torch.cuda.is_available():
                raise SetupError(f"setup {name!r} rolls out with vLLM, which needs a CUDA GPU "
                                 f"(device {device}); on a CPU use --setup cpu")  # fmt: skip


def run(cfg: RLConfig, setups: Sequence[tuple[str, Setup]], *, device: str | torch.device,
        progress: bool = True, json_path: str | Path | None = None,
        model_dir: str | Path | None = None) -> dict:  # fmt: skip
    """Train one run per ``(name, setup)`` (same seed, prompts and initial weights); return
    the result dict, also written to ``json_path`` after every run. With ``cfg.tis_cap`` the
    runs are named ``<setup>+tis=<C>``."""
    check_config(cfg)
    if not setups:
        raise ValueError("--setup: give at least one setup")
    if cfg.tis_cap is not None:
        setups = [(f"{n}+tis={cfg.tis_cap:g}", s) for n, s in setups]
    names = [n for n, _ in setups]
    if len(set(names)) != len(names):
        raise ValueError(f"--setup: repeated setup in {names}")
    device = torch.device(device)
    check_environment(setups, device)
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
    result = result_skeleton(cfg, env_info(device))
    for name, setup in setups:
        record = train_one(cfg, name, setup, device, progress=progress, model_dir=model_dir)
        result["runs"][name] = record
        result["summary"][name] = record["summary"]
        s = record["summary"]
        print(f"rl: {name}: reward {s['reward_first']:.3f} -> {s['reward_last']:.3f}, "
              f"mean |dlogp| {s['mismatch_abs_mean']:.3g}, k3 {s['kl_k3']:.3g}",
              file=sys.stderr)  # fmt: skip
        if json_path is not None:
            write_json(result, json_path)
    return result


#: config fields that may differ between the runs of one merged result (kept per run)
RUN_SETTINGS = ("time_limit", "tis_cap")


def merge_results(paths: Sequence[str | Path]) -> dict:
    """One result from several JSONs of the same config (e.g. one process per setup). The
    run-level settings (:data:`RUN_SETTINGS`) may differ between the files: they move from
    ``config`` into each run record (whether the time limit cut a run short is that run's
    ``time_limited_at``)."""
    merged = None
    for path in paths:
        part = read_json(path, "--merge")
        if part.get("benchmark") != "rl":
            raise ValueError(f"--merge: {path} is not an rl result")
        settings = {k: part["config"].pop(k, None) for k in RUN_SETTINGS}
        for record in part["runs"].values():
            for k, v in settings.items():
                record.setdefault(k, v)
        if merged is None:
            merged = part
            continue
        if part["config"] != merged["config"]:
            raise ValueError(f"--merge: {path} has a different config than {paths[0]}")
        for name, record in part["runs"].items():
            if name in merged["runs"]:
                raise ValueError(f"--merge: run {name!r} appears twice ({path})")
            merged["runs"][name] = record
            merged["summary"][name] = record["summary"]
    if merged is None:
        raise ValueError("--merge: no files given")
    return merged


# ---------------------------------------------------------------- command line


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="flamia rl",
        description="GRPO on digit reversal with rollouts and training in one process; logs "
        "reward, loss and the rollout/trainer log-prob mismatch per step.",
        epilog="setups: flamia-fp8 (a: mxfp8 exact_causal trainer, vLLM FLAMIA "
        "fp8_per_token_head), flamia-nvfp4 (b: the same, nvfp4 cache), bf16-fa-fp8 (c: BF16 "
        "trainer, vLLM FLASH_ATTN fp8), cpu (rollouts from the trainer, no vLLM).")
    p.add_argument("--setup", nargs="+", choices=list(SETUPS),
                   help="setup(s), run one after another (default: the three vLLM setups "
                        "with a GPU, cpu without)")  # fmt: skip
    p.add_argument("--model-size", choices=list(PRESETS),
                   help="preset: tiny (CPU tests), small (~13M, the H200 run), demo (the "
                        "serve demo's Llama shape); default: small with a GPU, tiny "
                        "without")  # fmt: skip
    p.add_argument("--trainer-attention", choices=ATTENTIONS, help="override the trainer's "
                   "attention (bf16 = transformers sdpa)")  # fmt: skip
    p.add_argument("--exact-causal", action=argparse.BooleanOptionalAction, default=None,
                   help="override: FLAMIA per-token Q/K exponents (setups default on)")
    p.add_argument("--engine", choices=ENGINES, help="override the rollout engine")
    p.add_argument("--vllm-backend", choices=VLLM_BACKENDS, help="override vLLM's "
                   "attention backend")  # fmt: skip
    p.add_argument("--kv-cache-dtype", choices=list(VLLM_KV_CACHE_DTYPES),
                   help="override vLLM's KV cache dtype")
    p.add_argument("--flamia-path", choices=("auto", "kernel", "reference"), default="auto",
                   help="FLAMIA trainer: kernels (auto on CUDA) or the PyTorch twin")
    p.add_argument("--steps", type=int, help="RL steps (default: preset)")
    p.add_argument("--prompts", type=int, help="prompts per step (default: preset)")
    p.add_argument("--group", type=int, help="samples per prompt, >= 2 (default: preset)")
    p.add_argument("--lr", type=float, help="RL learning rate (default: preset)")
    p.add_argument("--sft-steps", type=int, help="supervised warm-up steps (default: preset)")
    p.add_argument("--sft-batch", type=int, help="warm-up examples per step (default: preset)")
    p.add_argument("--sft-lr", type=float, help="warm-up learning rate (default: preset)")
    p.add_argument("--sft-target", type=float, help="stop the warm-up once this share of "
                   "sampled probe answers is exact; 0 = run all --sft-steps (default: preset)")
    p.add_argument("--min-digits", type=int, help="shortest digit string (default: preset)")
    p.add_argument("--max-digits", type=int, help="longest digit string (default: preset)")
    p.add_argument("--no-partial-credit", action="store_true",
                   help="reward 1 for the exact answer, 0 otherwise")
    p.add_argument("--weight-decay", type=float, default=0.0)
    p.add_argument("--clip", type=float, default=1.0, help="gradient-norm clip")
    p.add_argument("--adv-eps", type=float, default=1e-6, help="advantage std epsilon")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--gpu-memory-utilization", type=float, default=0.2,
                   help="vLLM's share of the GPU per engine (default: %(default)s)")
    p.add_argument("--cuda-graphs", action="store_true",
                   help="vLLM: capture CUDA graphs (default: eager, faster start)")
    p.add_argument("--tis-cap", type=float, metavar="C",
                   help="weight each token of the policy loss by min(pi_trainer / pi_rollout, "
                        "C): truncated importance sampling for rollouts from another "
                        "distribution (default: off, on-policy)")
    p.add_argument("--time-limit", type=float, metavar="SECONDS",
                   help="end each setup's RL steps after this many seconds (recorded as "
                        "time_limited_at; default: no limit)")
    p.add_argument("--no-vllm-tokenizer", action="store_true",
                   help="vLLM: skip loading the tokenizer (token ids in and out)")
    p.add_argument("--device", help="cpu, cuda or cuda:N (default: cuda if there is a GPU)")
    p.add_argument("--model-dir", help="keep the model directories here, one per setup, each "
                   "holding the trained model at the end (default: temporary)")
    p.add_argument("--json", metavar="PATH", help="write the result JSON here")
    p.add_argument("--merge", nargs="+", metavar="JSON",
                   help="instead of training: merge results of one config into --json")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    return p


def config_from_args(args: argparse.Namespace) -> RLConfig:
    """The run config: preset values, overridden by the given arguments (checked)."""
    size = args.model_size or "small"
    preset = PRESETS[size]

    def pick(name: str):
        value = getattr(args, name)
        return getattr(preset, name) if value is None else value

    shape = model_shape(preset)
    picked = {k: pick(k) for k in ("prompts", "group", "steps", "lr", "sft_steps", "sft_batch",
                                   "sft_lr", "sft_target", "min_digits",
                                   "max_digits")}  # fmt: skip
    return check_config(RLConfig(
        model_size=size, **shape, **picked, weight_decay=args.weight_decay,
        clip=args.clip, adv_eps=args.adv_eps, partial_credit=not args.no_partial_credit,
        seed=args.seed, flamia_path=args.flamia_path,
        gpu_memory_utilization=args.gpu_memory_utilization, enforce_eager=not args.cuda_graphs,
        vllm_tokenizer=not args.no_vllm_tokenizer, tis_cap=args.tis_cap,
        time_limit=args.time_limit))  # fmt: skip


def setups_from_args(args: argparse.Namespace, device: torch.device) -> list[tuple[str, Setup]]:
    names = args.setup or (["flamia-fp8", "flamia-nvfp4", "bf16-fa-fp8"]
                           if device.type == "cuda" else ["cpu"])  # fmt: skip
    overrides = {k: getattr(args, k) for k in OVERRIDES}
    return [resolve_setup(n, **overrides) for n in names]


def _device(name: str | None) -> torch.device:
    """``--device`` (:func:`pretrain.check_device`), or CUDA where there is a GPU."""
    if name is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return check_device(name)


def main(argv: list[str] | None = None) -> int:
    """CLI entry point (``flamia rl``); returns 0, 1 when a run diverged, 2 on bad arguments
    or a missing dependency (one line on stderr)."""
    args = build_parser().parse_args(argv)
    try:
        if args.merge:
            if not args.json:
                raise ValueError("--merge: needs --json for the merged output")
            write_json(merge_results(args.merge), args.json)
            return 0
        device = _device(args.device)
        if args.model_size is None:
            args.model_size = "small" if device.type == "cuda" else "tiny"
        cfg = config_from_args(args)
        setups = setups_from_args(args, device)
        if args.json:
            check_writable(args.json, make_parents=True)
        need_train_extra()
        check_environment(setups, device)
    except (ValueError, SetupError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    try:
        result = run(cfg, setups, device=device, progress=not args.no_progress,
                     json_path=args.json, model_dir=args.model_dir)  # fmt: skip
    except SetupError as e:  # e.g. vLLM installed but not importable
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(json.dumps(result["summary"]))
    return 1 if any(r["diverged_at"] for r in result["runs"].values()) else 0


if __name__ == "__main__":
    raise SystemExit(main())
