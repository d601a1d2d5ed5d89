"""Data-parallel training with FLAMIA attention: DDP and FSDP2 against one process.

The check: the Llama of ``flamia pretrain`` (its presets and ``build_model``; ``tiny`` on a
CPU) with FLAMIA attention (``--flamia-path reference`` on a CPU, ``auto``, i.e. the
kernels, on CUDA) trains ``--steps`` steps under data parallelism — (a) DDP, (b) FSDP2
(``torch.distributed.fsdp.fully_shard`` on every decoder layer and the root) — and once in
a single process on the same global batches. Rank 0 compares the per-step losses and,
after step 1's backward (before clipping), every parameter's gradient, and writes one JSON.

    torchrun --nproc-per-node 2 -m flamia_serve.train.distributed --mode ddp fsdp2
    python -m flamia_serve.train.distributed --spawn 2 --mode both      # CPU, gloo

Why the two runs are the same computation (so the tolerance can be tight):

* Global batch: each step takes ``--global-micro-batches`` (G) packed microbatches of
  ``--seq-len`` tokens from one stream; rank ``r`` of ``W`` gets microbatches
  ``[r·G/W, (r+1)·G/W)`` (documents are packed first, then split at microbatch
  boundaries, so every microbatch — its documents, its FLAMIA token blocks and scales — is
  the same tensor in both runs). G must be divisible by W.
* Loss: the token mean over the whole global batch. Rank ``r`` back-propagates
  ``Σ_its tokens loss / N_global · W`` (N_global, the predicted tokens of the step, is
  known to every rank); DDP and FSDP2 average gradients over ranks, which divides the W
  back out. For W a power of two the scaling is exact, so the data-parallel gradient
  differs from the single run's only in the order the microbatch gradients are summed
  (float32 on a CPU: ~1e-7 relative). Gradients sync once per step (``no_sync`` /
  ``set_requires_gradient_sync(False)`` for all but the last local microbatch).
* Optimizer: the pretraining AdamW and warmup/cosine schedule, gradient clipping (a
  DTensor norm under FSDP2); the steps after the first compare whole trajectories.

Data: ``synthetic`` (default, no files): documents of random length (``seq_len/8`` to
``2·seq_len``) that repeat a random pattern of 2–16 tokens, so the loss falls only when
attention copies from earlier in the document; ``stdlib``: the pretraining corpus
(tokenizer trained and cached by rank 0 first).

Devices: CPU processes use gloo (FP32, the reference attention: bitwise the same forward per
microbatch); CUDA processes use NCCL, one GPU per rank (``LOCAL_RANK``), BF16 autocast as
in pretraining.

Tolerances (relative; defaults CPU / CUDA): ``loss_rtol`` step 1's loss (1e-6 / 1e-5: the
same forward, only the sum over microbatches reordered); ``grad_rtol`` every parameter's
step-1 gradient, ``‖g_dp − g_1‖ / ‖g_1‖`` (1e-6 / 1e-2: on CUDA BF16 autocast and the
backward's FP32 dQ atomics are not repeatable run to run); ``curve_rtol`` the loss curves
compared as running means over ``CURVE_WINDOW`` = 10 steps (1e-3 / 1e-2; single steps are
reported as ``loss_max_rel_diff``). After step 1 two trajectories drift apart from ~1e-7:
AdamW's first steps divide by √v, which turns rounding noise in near-zero gradients into
full-size updates, and FP8 roundings and power-of-two scales can flip (CPU, tiny, 8 steps:
3.4e-5 by step 6). On CUDA rank 0 trains the single run twice (``--repeat-single``, default
there) and records the two's difference as ``single_repeat``: the run-to-run noise that the
data-parallel differences are read against. Measured on 2 H200s (``small``, stdlib, 150
steps, mxfp8; DDP / FSDP2 / the single run repeated): step-1 loss bit-equal; gradients
0.88% / 0.86% / 0.81% on layer 0's k_proj, falling to ~1e-10 at the last layer; 10-step
means 0.67% / 0.55% / 0.50%; single steps up to 3.4% / 3.5% / 2.1% after the learning-rate
peak. ``--normalisation local`` (each rank's own token mean) is a negative control: its
gradients are off by ~1e-2 and the check fails. Exit code 0 when every comparison is within
tolerance, 1 when one is not, 2 on bad arguments.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import math
import os
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from flamia_serve.files import check_writable
from flamia_serve.train import data as pdata
from flamia_serve.train import pretrain
from flamia_serve.train.module import PATHS

MODES: tuple[str, ...] = ("ddp", "fsdp2")
DATA: tuple[str, ...] = ("synthetic", "stdlib")
#: default (loss_rtol, grad_rtol, curve_rtol) per device type (see the module docstring)
TOLERANCES = {"cpu": (1e-6, 1e-6, 1e-3), "cuda": (1e-5, 1e-2, 1e-2)}
#: the curve is compared as running means over this many steps (fewer when the run is shorter)
CURVE_WINDOW = 10


@dataclass(frozen=True)
class CheckConfig:
    """What one check runs (recorded in the JSON). ``None`` fields take the preset's value
    (``seq_len``, ``global_micro_batches``, ``lr``, ``warmup``) or the device's default
    (``flamia_path``: ``reference`` on a CPU, ``auto`` on CUDA; tolerances: ``TOLERANCES``;
    ``threads``: CPU cores / world size)."""

    modes: tuple[str, ...] = MODES
    model_size: str = "tiny"
    attention: str = "mxfp8"
    flamia_path: str | None = None
    exact_causal: bool = False
    steps: int = 3
    seq_len: int | None = None
    global_micro_batches: int | None = None
    lr: float | None = None
    warmup: int | None = None
    clip: float = 1.0
    data: str = "synthetic"
    source: tuple[str, ...] = ()
    max_files: int | None = None
    seed: int = 0
    device: str = "auto"
    loss_rtol: float | None = None
    grad_rtol: float | None = None
    curve_rtol: float | None = None
    threads: int | None = None
    #: ``global`` (the check); ``local``: each rank's own token mean, the usual mistake with
    #: packed documents (ranks predict different token counts) — a negative control
    normalisation: str = "global"
    #: rank 0 trains the single-process run twice and reports how far the two differ (the
    #: run-to-run noise the data-parallel differences are read against); None: on CUDA only
    repeat_single: bool | None = None


def _device_type(cfg: CheckConfig) -> str:
    if cfg.device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return cfg.device


def resolve(cfg: CheckConfig, world_size: int) -> CheckConfig:
    """``cfg`` with its defaults filled in and every field checked for ``world_size``
    processes; ``ValueError`` names the offending argument (CLI spelling)."""
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world size: must be an int >= 1, got {world_size!r}")
    modes = tuple(cfg.modes)
    if not modes or any(m not in MODES for m in modes):
        raise ValueError(f"--mode: expected values in {MODES} (or 'both'), got {list(modes)}")
    if len(set(modes)) != len(modes):
        raise ValueError(f"--mode: repeated value in {list(modes)}")
    if cfg.model_size not in pretrain.PRESETS:
        raise ValueError(f"--model-size: expected one of {sorted(pretrain.PRESETS)}, "
                         f"got {cfg.model_size!r}")
    if cfg.attention not in pretrain.ATTENTIONS:
        raise ValueError(f"--attention: expected one of {pretrain.ATTENTIONS}, "
                         f"got {cfg.attention!r}")
    if cfg.normalisation not in ("global", "local"):
        raise ValueError(f"--normalisation: expected global or local, got {cfg.normalisation!r}")
    if cfg.data not in DATA:
        raise ValueError(f"--data: expected one of {DATA}, got {cfg.data!r}")
    if cfg.device not in ("auto", "cpu", "cuda"):
        raise ValueError(f"--device: expected auto, cpu or cuda, got {cfg.device!r}")
    device = _device_type(cfg)
    if device == "cuda":
        if not torch.cuda.is_available():
            raise ValueError("--device cuda: no CUDA GPU is visible")
        if torch.cuda.device_count() < world_size:
            raise ValueError(f"world size {world_size}: needs one GPU per process, "
                             f"{torch.cuda.device_count()} visible")
    preset = pretrain.PRESETS[cfg.model_size]
    path = cfg.flamia_path or ("auto" if device == "cuda" else "reference")
    if path not in PATHS:
        raise ValueError(f"--flamia-path: expected one of {PATHS}, got {path!r}")
    if path == "kernel" and device == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError("--flamia-path kernel on a CPU needs TRITON_INTERPRET=1 "
                         "(use reference there)")
    loss_rtol, grad_rtol, curve_rtol = TOLERANCES[device]
    out = dataclasses.replace(
        cfg, modes=modes, flamia_path=path,
        seq_len=preset.seq_len if cfg.seq_len is None else cfg.seq_len,
        global_micro_batches=(preset.micro_batches if cfg.global_micro_batches is None
                              else cfg.global_micro_batches),
        lr=preset.lr if cfg.lr is None else cfg.lr,
        warmup=preset.warmup if cfg.warmup is None else cfg.warmup,
        loss_rtol=loss_rtol if cfg.loss_rtol is None else cfg.loss_rtol,
        grad_rtol=grad_rtol if cfg.grad_rtol is None else cfg.grad_rtol,
        curve_rtol=curve_rtol if cfg.curve_rtol is None else cfg.curve_rtol,
        repeat_single=device == "cuda" if cfg.repeat_single is None else cfg.repeat_single,
        threads=(max(1, (os.cpu_count() or 1) // world_size) if cfg.threads is None
                 else cfg.threads),
        source=tuple(cfg.source))  # fmt: skip
    for name in ("steps", "seq_len", "global_micro_batches", "threads"):
        value = getattr(out, name)
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"--{name.replace('_', '-')}: must be an int >= 1, got {value!r}")
    if out.seq_len < 2:
        raise ValueError(f"--seq-len: must be >= 2 (a microbatch predicts seq_len - 1 "
                         f"tokens), got {out.seq_len}")
    if out.global_micro_batches % world_size:
        raise ValueError(f"--global-micro-batches: {out.global_micro_batches} microbatches do "
                         f"not split evenly over world size {world_size}")
    if out.warmup < 0:
        raise ValueError(f"--warmup: must be >= 0, got {out.warmup}")
    for name in ("lr", "clip", "loss_rtol", "grad_rtol", "curve_rtol"):
        value = getattr(out, name)
        if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
            raise ValueError(f"--{name.replace('_', '-')}: must be a finite number > 0, "
                             f"got {value!r}")
    if out.data == "stdlib" and out.max_files is not None and out.max_files < 2:
        raise ValueError(f"--max-files: need at least 2, got {out.max_files}")
    if out.data != "stdlib":
        for name, value in (("source", out.source), ("max_files", out.max_files)):
            if value:
                raise ValueError(f"--{name.replace('_', '-')}: only with --data stdlib "
                                 f"(--data {out.data} would ignore it)")
    for src in out.source:
        if not Path(src).is_dir():
            raise ValueError(f"--source {src!r}: not a directory")
    if not isinstance(out.seed, int) or out.seed < 0:  # numpy's generators: no negative seed
        raise ValueError(f"--seed: must be an int >= 0, got {out.seed!r}")
    return out


def train_config(cfg: CheckConfig, vocab_size: int) -> pretrain.TrainConfig:
    """The pretraining config of a resolved check (model shape from the preset)."""
    p = pretrain.PRESETS[cfg.model_size]
    return pretrain.TrainConfig(
        model_size=cfg.model_size, **pretrain.model_shape(p), vocab_size=vocab_size,
        seq_len=cfg.seq_len, micro_batches=cfg.global_micro_batches,
        steps=cfg.steps, lr=cfg.lr, min_lr_ratio=0.1, warmup=cfg.warmup, weight_decay=0.1,
        clip=cfg.clip, eval_every=cfg.steps, eval_batches=1, eval_fraction=0.05,
        exact_causal=cfg.exact_causal, seed=cfg.seed, flamia_path=cfg.flamia_path)  # fmt: skip


def synthetic_documents(n_tokens: int, vocab_size: int, seq_len: int, seed: int
                        ) -> list[np.ndarray]:  # fmt: skip
    """Documents totalling at least ``n_tokens``: each of ``seq_len // 8`` to ``2·seq_len``
    tokens (so some cross microbatch ends) repeating a random pattern of 2–16 token ids in
    ``[1, vocab_size)``; int32 arrays."""
    rng = np.random.default_rng([seed, 17])
    docs, total = [], 0
    while total < n_tokens:
        length = int(rng.integers(max(2, seq_len // 8), 2 * seq_len + 1))
        pattern = rng.integers(1, vocab_size, size=int(rng.integers(2, 17)))
        docs.append(np.tile(pattern, -(-length // len(pattern)))[:length].astype(np.int32))
        total += length
    return docs


def global_batches(cfg: CheckConfig, corpus: pdata.Corpus | None, vocab_size: int
                   ) -> list[list[pdata.PackedBatch]]:  # fmt: skip
    """``steps`` lists of ``global_micro_batches`` packed microbatches (the same on every
    rank: a pure function of the config and the corpus)."""
    need = cfg.steps * cfg.global_micro_batches
    if corpus is None:
        docs = synthetic_documents((need + 1) * cfg.seq_len, vocab_size, cfg.seq_len, cfg.seed)
        stream = pdata.pack_documents(docs, cfg.seq_len)
    else:
        stream = pdata.train_batches(corpus.train_docs, cfg.seq_len, cfg.seed)
    flat = [next(stream) for _ in range(need)]
    g = cfg.global_micro_batches
    return [flat[s * g:(s + 1) * g] for s in range(cfg.steps)]


def rank_share(micro: Sequence[pdata.PackedBatch], rank: int, world_size: int
               ) -> list[pdata.PackedBatch]:  # fmt: skip
    """Rank ``rank``'s contiguous share of one global batch."""
    per = len(micro) // world_size
    return list(micro[rank * per:(rank + 1) * per])


def _full_grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter's full gradient as an FP32 CPU tensor (FSDP2's DTensor gradients are
    gathered: a collective, so every rank calls it); a missing gradient reads as zeros."""
    out = {}
    for name, p in model.named_parameters():
        g = p.grad
        if g is None:
            g = torch.zeros(p.shape, dtype=p.dtype, device=p.device)
        if hasattr(g, "full_tensor"):
            g = g.full_tensor()
        out[name.removeprefix("module.")] = g.detach().float().cpu().clone()
    return out


def train_run(model: torch.nn.Module, steps: Sequence[Sequence[pdata.PackedBatch]],
              n_global: Sequence[int], tcfg: pretrain.TrainConfig, device: torch.device, *,
              world_size: int = 1, mode: str | None = None, local_mean: bool = False
              ) -> dict:  # fmt: skip
    """Train ``model`` (already wrapped for ``mode``: ``None`` single process, ``ddp``,
    ``fsdp2``) on this rank's microbatches ``steps[s]``. Loss of step ``s``: the token mean
    over ``n_global[s]`` predicted tokens of the global batch (summed over ranks);
    ``local_mean``: over this rank's tokens instead (the negative control). Returns
    ``{"loss": [...], "grads": {name: step-1 gradient} (rank 0 of a group, else empty),
    "seconds"}``."""
    opt, sched = pretrain.make_optimizer(model, tcfg, device)
    params = list(model.parameters())
    scale = float(world_size)  # DDP / FSDP2 average over ranks: undo it (exact for 2^k)
    losses, grads = [], {}
    t0 = time.perf_counter()
    for s, micro in enumerate(steps):
        n = n_global[s]
        if local_mean:
            n, scale = sum(pretrain.n_targets(b) for b in micro), 1.0
        step_loss = torch.zeros((), dtype=torch.float32, device=device)
        for i, b in enumerate(micro):
            last = i == len(micro) - 1
            if mode == "fsdp2":
                model.set_requires_gradient_sync(last)
            sync = model.no_sync() if mode == "ddp" and not last else contextlib.nullcontext()
            with sync:
                with pretrain._autocast(device):
                    loss_sum = pretrain.token_losses(model, b.to(device)).sum()
                (loss_sum / n * scale).backward()
            step_loss += loss_sum.detach() / n
        if mode is not None:
            dist.all_reduce(step_loss)
            if local_mean:
                step_loss /= world_size
        if s == 0:
            g = _full_grads(model)
            if mode is None or dist.get_rank() == 0:
                grads = g
        torch.nn.utils.clip_grad_norm_(params, tcfg.clip)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        losses.append(float(step_loss))
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return {"loss": losses, "grads": grads, "seconds": time.perf_counter() - t0}


def wrap(model: torch.nn.Module, mode: str, device: torch.device) -> torch.nn.Module:
    """DDP, or FSDP2 with one ``fully_shard`` per decoder layer and one at the root."""
    if mode == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        ids = [device.index] if device.type == "cuda" else None
        return DistributedDataParallel(model, device_ids=ids)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def running_mean(x: np.ndarray, window: int) -> np.ndarray:
    """Means of every ``window`` consecutive entries (``len(x) - window + 1`` of them)."""
    return np.convolve(x, np.ones(window) / window, mode="valid")


def compare(single: dict, run: dict, loss_rtol: float, grad_rtol: float, curve_rtol: float
            ) -> dict:  # fmt: skip
    """Loss and step-1 gradient differences of a data-parallel run against the single one.
    Gradient: per parameter ``max |Δ|`` and ``‖Δ‖ / ‖g_single‖``. Passes when step 1's
    relative loss difference is within ``loss_rtol``, every parameter's relative gradient
    norm within ``grad_rtol`` and the curves' running means over ``CURVE_WINDOW`` steps
    (``curve_max_rel_diff``) within ``curve_rtol``; ``loss_max_rel_diff`` is the largest
    single-step difference."""
    a, b = np.asarray(single["loss"]), np.asarray(run["loss"])
    rel = np.abs(b - a) / np.maximum(np.abs(a), 1e-30)
    window = min(CURVE_WINDOW, len(a))
    ma, mb = running_mean(a, window), running_mean(b, window)
    curve_rel = np.abs(mb - ma) / np.maximum(np.abs(ma), 1e-30)
    per_param = {}
    for name, g1 in single["grads"].items():
        g2 = run["grads"][name]
        d = (g2 - g1).double()
        norm = float(g1.double().norm())
        per_param[name] = {"max_abs_diff": float(d.abs().max()),
                           "rel_norm_diff": float(d.norm()) / norm if norm else float(d.norm()),
                           "grad_norm": norm}  # fmt: skip
    worst = max(per_param, key=lambda k: per_param[k]["rel_norm_diff"])
    whole = math.sqrt(sum((run["grads"][k] - g).double().square().sum().item()
                          for k, g in single["grads"].items()))  # fmt: skip
    whole_norm = math.sqrt(sum(g.double().square().sum().item() for g in single["grads"].values()))
    res = {
        "loss": run["loss"],
        "loss_max_abs_diff": float(np.abs(b - a).max()),
        "loss_max_rel_diff": float(rel.max()),
        "loss_step1_rel_diff": float(rel[0]),
        "curve_window": window,
        "curve_max_rel_diff": float(curve_rel.max()),
        "grad_max_abs_diff": max(v["max_abs_diff"] for v in per_param.values()),
        "grad_max_rel_norm_diff": per_param[worst]["rel_norm_diff"],
        "grad_worst_param": worst,
        "grad_total_rel_norm_diff": whole / whole_norm if whole_norm else whole,
        "grads": per_param,
        "seconds": run["seconds"],
    }
    res["passed_step1_loss"] = bool(res["loss_step1_rel_diff"] <= loss_rtol)
    res["passed_grads"] = bool(res["grad_max_rel_norm_diff"] <= grad_rtol)
    res["passed_curve"] = bool(res["curve_max_rel_diff"] <= curve_rtol)
    res["passed"] = res["passed_step1_loss"] and res["passed_grads"] and res["passed_curve"]
    return res


def _load_corpus(cfg: CheckConfig, rank: int, device: torch.device) -> pdata.Corpus:
    """The pretraining corpus; rank 0 trains and caches the tokenizer before the others read
    it (no duplicate work)."""
    def load():
        return pdata.load_corpus(cfg.source or None, vocab_size=pretrain.PRESETS[
            cfg.model_size].vocab_size, max_files=cfg.max_files)
    corpus = load() if rank == 0 else None
    dist.barrier(device_ids=[device.index] if device.type == "cuda" else None)
    return corpus if corpus is not None else load()


def env_info(device: torch.device, world_size: int, backend: str) -> dict:
    """Pretraining's environment record plus the process group's facts."""
    env = pretrain.env_info(device)
    if device.type == "cuda":
        env["gpus"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
        version = torch.cuda.nccl.version()
        env["nccl"] = ".".join(map(str, version)) if isinstance(version, tuple) else str(version)
    return env | {"world_size": world_size, "backend": backend}


def run_rank(rank: int, world_size: int, local_rank: int, cfg: CheckConfig) -> dict | None:
    """One rank's part (the process group is initialised): every data-parallel mode, then, on
    rank 0, the single-process run and the comparison. Returns the result on rank 0."""
    device = torch.device(_device_type(cfg), local_rank if _device_type(cfg) == "cuda" else None)
    if device.type == "cpu":
        torch.set_num_threads(cfg.threads)
    corpus = _load_corpus(cfg, rank, device) if cfg.data == "stdlib" else None
    vocab = corpus.vocab_size if corpus is not None else pretrain.PRESETS[cfg.model_size].vocab_size
    tcfg = train_config(cfg, vocab)
    steps = global_batches(cfg, corpus, vocab)
    n_global = [sum(pretrain.n_targets(b) for b in micro) for micro in steps]
    runs = {}
    for mode in cfg.modes:
        model = pretrain.build_model(tcfg, cfg.attention, vocab).to(device)
        model.train()
        wrapped = wrap(model, mode, device)
        runs[mode] = train_run(wrapped, [rank_share(m, rank, world_size) for m in steps],
                               n_global, tcfg, device, world_size=world_size, mode=mode,
                               local_mean=cfg.normalisation == "local")
        del wrapped, model
    if rank != 0:
        return None
    model = pretrain.build_model(tcfg, cfg.attention, vocab).to(device)
    model.train()
    single = train_run(model, steps, n_global, tcfg, device)
    repeat = None
    if cfg.repeat_single:
        del model
        model = pretrain.build_model(tcfg, cfg.attention, vocab).to(device)
        model.train()
        repeat = train_run(model, steps, n_global, tcfg, device)
    backend = dist.get_backend()
    result = {
        "benchmark": "train_distributed", **env_info(device, world_size, backend),
        "modes": list(cfg.modes), "check": dataclasses.asdict(cfg),
        "config": dataclasses.asdict(tcfg), "params": pretrain.count_params(model),
        "attn_implementation": model.config._attn_implementation,
        "data": corpus.info if corpus is not None else {"synthetic": True},
        "global_batch": {
            "micro_batches": cfg.global_micro_batches,
            "micro_batches_per_rank": cfg.global_micro_batches // world_size,
            "seq_len": cfg.seq_len, "tokens": cfg.global_micro_batches * cfg.seq_len,
            "predicted_tokens": n_global,
            "split": "rank r takes microbatches [r*G/W, (r+1)*G/W) of each step"},
        "loss_normalisation": (
            "token mean over the global batch: each rank back-propagates sum(token losses) / "
            "N_global * W; DDP/FSDP2 average over W" if cfg.normalisation == "global" else
            "NEGATIVE CONTROL: each rank's own token mean, averaged over ranks"),
        "tolerances": {"loss_rtol": cfg.loss_rtol, "grad_rtol": cfg.grad_rtol,
                       "curve_rtol": cfg.curve_rtol,
                       "loss": "step 1: |loss_dp - loss_1| / |loss_1| <= loss_rtol",
                       "grad": "max over parameters of ||g_dp - g_1|| / ||g_1|| after step 1's "
                               "backward (before clipping) <= grad_rtol",
                       "curve": f"max over the running means of {CURVE_WINDOW} steps of "
                                "|loss_dp - loss_1| / |loss_1| <= curve_rtol"},
        "single": {"loss": single["loss"], "seconds": single["seconds"]},
        "runs": {m: compare(single, runs[m], cfg.loss_rtol, cfg.grad_rtol, cfg.curve_rtol)
                 for m in cfg.modes},
    }  # fmt: skip
    if repeat is not None:  # the same single run again: run-to-run noise, not a check
        noise = compare(single, repeat, cfg.loss_rtol, cfg.grad_rtol, cfg.curve_rtol)
        result["single_repeat"] = {k: v for k, v in noise.items() if not k.startswith("passed")}
    result["passed"] = all(r["passed"] for r in result["runs"].values())
    return result


def summary(result: dict) -> dict:
    """The JSON's headline numbers (no per-parameter table)."""
    keys = ("loss_max_rel_diff", "curve_max_rel_diff", "loss_step1_rel_diff",
            "grad_max_abs_diff", "grad_max_rel_norm_diff", "grad_worst_param", "passed")
    noise = {k: v for k, v in result.get("single_repeat", {}).items() if k in keys}
    return {"single_repeat": noise, "world_size": result["world_size"],
            "backend": result["backend"],
            "tolerances": {k: result["tolerances"][k]
                           for k in ("loss_rtol", "grad_rtol", "curve_rtol")},
            "single_loss": result["single"]["loss"],
            "runs": {m: {"loss": r["loss"], **{k: r[k] for k in keys}}
                     for m, r in result["runs"].items()}, "passed": result["passed"]}


def write_json(result: dict, path: str | Path) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=1) + "\n")


def _backend(cfg: CheckConfig) -> str:
    return "nccl" if _device_type(cfg) == "cuda" else "gloo"


def _spawned(rank: int, world_size: int, init_method: str, cfg: CheckConfig, out: str) -> None:
    """``torch.multiprocessing.spawn`` target: one rank; rank 0 writes the result to ``out``."""
    device_type = _device_type(cfg)
    kw = {}
    if device_type == "cuda":
        torch.cuda.set_device(rank)
        kw["device_id"] = torch.device("cuda", rank)
    dist.init_process_group(_backend(cfg), init_method=init_method, rank=rank,
                            world_size=world_size, **kw)  # fmt: skip
    try:
        result = run_rank(rank, world_size, rank, cfg)
        if result is not None:
            write_json(result, out)
    finally:
        dist.destroy_process_group()


def spawn_check(cfg: CheckConfig, world_size: int) -> dict:
    """Run the check in ``world_size`` local processes (``torch.multiprocessing.spawn``; gloo
    on a CPU, NCCL with one GPU per process on CUDA); returns rank 0's result.
    ``ValueError`` for bad arguments, before any process starts."""
    cfg = resolve(cfg, world_size)
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory(prefix="flamia-dp-") as tmp:
        out = os.path.join(tmp, "result.json")
        init = "file://" + os.path.join(tmp, "store")
        mp.spawn(_spawned, args=(world_size, init, cfg, out), nprocs=world_size, join=True)
        return json.loads(Path(out).read_text())


def _torchrun_check(cfg: CheckConfig) -> dict | None:
    """Under ``torchrun`` (``RANK``/``WORLD_SIZE``/``LOCAL_RANK`` set): this rank's part;
    rank 0 returns the result."""
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local = int(os.environ.get("LOCAL_RANK", rank))
    cfg = resolve(cfg, world)
    kw = {}
    if _device_type(cfg) == "cuda":
        torch.cuda.set_device(local)
        kw["device_id"] = torch.device("cuda", local)
    dist.init_process_group(_backend(cfg), **kw)
    try:
        return run_rank(rank, world, local, cfg)
    finally:
        dist.destroy_process_group()


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m flamia_serve.train.distributed",
        description="Data-parallel training (DDP, FSDP2) with FLAMIA attention against a "
                    "single-process run on the same global batches: per-step losses and "
                    "step-1 gradients. Launch with torchrun, or --spawn N local processes.")
    p.add_argument("--mode", nargs="+", default=["both"],
                   help="ddp, fsdp2, or both (several run one after another)")
    p.add_argument("--spawn", type=int, metavar="N",
                   help="start N local processes (not under torchrun); without it and "
                        "without torchrun: world size 1")
    p.add_argument("--model-size", default="tiny", help="pretraining preset: tiny, small, base")
    p.add_argument("--attention", default="mxfp8",
                   help=f"one of {pretrain.ATTENTIONS} (bf16: SDPA, no FLAMIA)")
    p.add_argument("--flamia-path", help="auto, kernel or reference (default: reference on a "
                                         "CPU, auto on CUDA)")
    p.add_argument("--exact-causal", action="store_true")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--seq-len", type=int, help="tokens per microbatch (default: preset)")
    p.add_argument("--global-micro-batches", type=int,
                   help="microbatches per step over all ranks (default: preset); divisible "
                        "by the world size")
    p.add_argument("--lr", type=float, help="peak learning rate (default: preset)")
    p.add_argument("--warmup", type=int, help="warmup steps (default: preset)")
    p.add_argument("--clip", type=float, default=1.0)
    p.add_argument("--data", default="synthetic", help="synthetic (default) or stdlib")
    p.add_argument("--source", action="append", default=[], metavar="DIR",
                   help="--data stdlib: directory of .py documents (repeatable)")
    p.add_argument("--max-files", type=int, help="--data stdlib: first N files only")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="auto", help="auto, cpu or cuda")
    p.add_argument("--loss-rtol", type=float,
                   help="step-1 loss, relative (default: 1e-6 CPU, 1e-5 CUDA)")
    p.add_argument("--grad-rtol", type=float,
                   help="step-1 gradient of each parameter, relative norm (default: 1e-6 CPU, "
                        "1e-2 CUDA)")
    p.add_argument("--curve-rtol", type=float,
                   help="the loss curves' running means over 10 steps, relative (default: "
                        "1e-3 CPU, 1e-2 CUDA)")
    p.add_argument("--repeat-single", action=argparse.BooleanOptionalAction, default=None,
                   help="train the single-process run twice and report their difference (the "
                        "run-to-run noise; default: on CUDA)")
    p.add_argument("--threads", type=int, help="CPU threads per process (default: cores / N)")
    p.add_argument("--normalisation", default="global",
                   help="global (the check) or local: per-rank token mean, a negative control "
                        "that should fail")
    p.add_argument("--json", metavar="PATH", help="write the full result JSON here")
    return p


def config_from_args(args: argparse.Namespace) -> CheckConfig:
    modes = tuple(MODES if args.mode == ["both"] else args.mode)
    return CheckConfig(
        modes=modes, model_size=args.model_size, attention=args.attention,
        flamia_path=args.flamia_path, exact_causal=args.exact_causal, steps=args.steps,
        seq_len=args.seq_len, global_micro_batches=args.global_micro_batches, lr=args.lr,
        warmup=args.warmup, clip=args.clip, data=args.data, source=tuple(args.source),
        max_files=args.max_files, seed=args.seed, device=args.device, loss_rtol=args.loss_rtol,
        grad_rtol=args.grad_rtol, curve_rtol=args.curve_rtol, threads=args.threads,
        repeat_single=args.repeat_single,
        normalisation=args.normalisation)  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    """CLI entry point: 0 when every comparison is within tolerance, 1 when one is not, 2 on
    bad arguments or a missing package."""
    args = build_parser().parse_args(argv)
    torchrun = "RANK" in os.environ and "WORLD_SIZE" in os.environ
    try:
        pretrain._need_train_extra()
        cfg = config_from_args(args)
        if args.json and (not torchrun or os.environ["RANK"] == "0"):
            check_writable(args.json, make_parents=True)  # before the run, not after it
        if args.spawn is not None and torchrun:
            raise ValueError("--spawn: not under torchrun (torchrun already started the ranks)")
        if torchrun:
            result = _torchrun_check(cfg)
        else:
            n = 1 if args.spawn is None else args.spawn
            if n < 1:
                raise ValueError(f"--spawn: must be >= 1, got {n}")
            result = spawn_check(cfg, n)
    except (ValueError, pretrain.SetupError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if result is None:  # ranks other than 0
        return 0
    if args.json:
        write_json(result, args.json)
    print(json.dumps(summary(result), indent=1))
    return 0 if result["passed"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
