"""Gradient fidelity during pretraining: FLAMIA kernels vs their PyTorch twin vs BF16 SDPA.

Trains the pretraining model (``flamia_serve.train.pretrain``, same data and schedule)
with one attention choice and, every ``--check-every`` steps, computes the gradient of one
fixed held-out microbatch three ways on the same weights: BF16 SDPA, FLAMIA through the
kernels, FLAMIA through the reference twin (same numerics, plain PyTorch). It reports the
loss of each and the cosine similarity / norm ratio of the gradients (all parameters, and
the attention projections per layer). Kernel ≈ twin but both ≠ BF16 points at the
numerics; kernel ≠ twin at a kernel bug. (How it found the normaliser bias of DESIGN N3:
``benchmarks/results/grad_fidelity_*.json``.)

    python benchmarks/grad_fidelity.py --train-with mxfp8 --steps 900 --check-every 150
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import sys
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

import flamia_serve.reference.quantized as rq
from benchmarks.common import env_info, results_dir
from flamia_serve.train import data as pdata
from flamia_serve.train import pretrain


def _set_attention(model, attention: str, path: str) -> None:
    impl, extra = pretrain.attention_setup(attention, False, path)
    for key, value in extra.items():
        setattr(model.config, key, value)
    model.set_attn_implementation(impl)


@contextlib.contextmanager
def _reference_variant(variant: str | None):
    """Numerics variants of the reference twin (diagnosis only): ``exact_ds`` — dS is not
    quantized; ``smooth_k`` — K minus its per-document mean before quantization
    (softmax-invariant; not causally safe: a probe of K's common component)."""
    saved = (rq._fold_quantize, rq.quantize_qkv)
    if variant == "smooth_k":

        def quantize_smoothed(q, k, v, cu, *a, **kw):
            k = k.float().clone()
            for a0, b0 in zip(cu[:-1].tolist(), cu[1:].tolist(), strict=True):
                k[a0:b0] -= k[a0:b0].mean(0, keepdim=True)
            return saved[1](q, k.to(q.dtype), v, cu, *a, **kw)

        rq.quantize_qkv = quantize_smoothed
    elif variant == "exact_ds":
        rq._fold_quantize = lambda ds, factor, block: ds * factor
    elif variant is not None:
        raise ValueError(f"variant {variant!r}")
    try:
        yield
    finally:
        rq._fold_quantize, rq.quantize_qkv = saved


MODES = {  # name: (attention choice or "recipe", path, reference variant)
    "bf16": ("bf16", "auto", None),
    "kernel": ("recipe", "kernel", None),
    "reference": ("recipe", "reference", None),
    "reference-exact-ds": ("recipe", "reference", "exact_ds"),
    "reference-smooth-k": ("recipe", "reference", "smooth_k"),
}


def _grads(model, batch, attention: str, path: str) -> tuple[float, dict[str, torch.Tensor]]:
    _set_attention(model, attention, path)
    model.zero_grad(set_to_none=True)
    with pretrain._autocast(batch.input_ids.device):
        loss = pretrain.token_losses(model, batch).sum() / pretrain.n_targets(batch)
    loss.backward()
    grads = {n: p.grad.detach().float().clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    return float(loss.detach()), grads


def _compare(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> dict:
    def cos(x, y):
        return float(torch.nn.functional.cosine_similarity(x.flatten(), y.flatten(), dim=0))

    flat_a = torch.cat([g.flatten() for g in a.values()])
    flat_b = torch.cat([g.flatten() for g in b.values()])
    out = {"all_cos": cos(flat_a, flat_b), "all_norm_ratio": float(flat_a.norm() / flat_b.norm())}
    per = {}
    for name in a:
        if any(p in name for p in ("q_proj", "k_proj", "v_proj", "o_proj")):
            short = (
                name.replace("model.layers.", "L")
                .replace(".self_attn.", ".")
                .replace(".weight", "")
            )
            per[short] = [
                round(cos(a[name], b[name]), 5),
                round(float(a[name].norm() / b[name].norm().clamp(min=1e-30)), 4),
            ]
    out["attn_proj_cos_norm_ratio"] = per
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--train-with", default="mxfp8", choices=pretrain.ATTENTIONS)
    p.add_argument("--recipe", default="mxfp8", help="FLAMIA recipe compared at each check")
    p.add_argument("--steps", type=int, default=900, help="steps trained (schedule of 2000)")
    p.add_argument("--schedule-steps", type=int, default=2000)
    p.add_argument("--check-every", type=int, default=150)
    p.add_argument("--model-size", default="small", choices=sorted(pretrain.PRESETS))
    p.add_argument("--max-files", type=int, default=None, help="smoke tests: fewer files")
    p.add_argument(
        "--modes",
        default="bf16,kernel,reference",
        help=f"comma-separated gradients to compare, of {', '.join(MODES)}",
    )
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    modes = args.modes.split(",")
    for tag in modes:
        if tag not in MODES:
            p.error(f"--modes: unknown {tag!r} (choose from {', '.join(MODES)})")
    pa = pretrain.build_parser().parse_args(
        ["--attention", args.train_with, "--steps", str(args.schedule_steps),
         "--micro-batches", "2", "--model-size", args.model_size])  # fmt: skip
    cfg = pretrain.config_from_args(pa)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.backends.cuda.matmul.allow_tf32 = True
    corpus = pdata.load_corpus(vocab_size=cfg.vocab_size, eval_fraction=cfg.eval_fraction,
                               max_files=args.max_files)  # fmt: skip
    model = pretrain.build_model(cfg, args.train_with, corpus.vocab_size).to(device)
    opt, sched = pretrain.make_optimizer(model, cfg, device)
    batches = pdata.train_batches(corpus.train_docs, cfg.seq_len, cfg.seed)
    probe = pdata.eval_batches(corpus.eval_docs, cfg.seq_len, 1)[0].to(device)
    params = list(model.parameters())
    checks = []
    start = time.perf_counter()
    for step in range(args.steps + 1):
        if step % args.check_every == 0:
            losses, grads = {}, {}
            for tag in modes:
                att, path, variant = MODES[tag]
                with _reference_variant(variant):
                    att = args.recipe if att == "recipe" else att
                    losses[tag], grads[tag] = _grads(model, probe, att, path)
            rec = {"step": step, "loss": losses}
            line = [f"step {step}"]
            for tag in modes[1:]:
                rec[f"{tag}_vs_{modes[0]}"] = cmp = _compare(grads[tag], grads[modes[0]])
                line.append(f"{tag}: cos {cmp['all_cos']:.4f} norm {cmp['all_norm_ratio']:.3f}")
            if "kernel" in modes and "reference" in modes:
                rec["kernel_vs_reference"] = cmp = _compare(grads["kernel"], grads["reference"])
                line.append(f"kernel~reference: cos {cmp['all_cos']:.4f}")
            checks.append(rec)
            print(" | ".join(line), f"{time.perf_counter() - start:.0f}s", file=sys.stderr,
                  flush=True)  # fmt: skip
            _set_attention(model, args.train_with, "auto")
        if step == args.steps:
            break
        micro = [next(batches).to(device) for _ in range(cfg.micro_batches)]
        n_total = sum(pretrain.n_targets(b) for b in micro)
        for b in micro:
            with pretrain._autocast(device):
                loss = pretrain.token_losses(model, b).sum() / n_total
            loss.backward()
        torch.nn.utils.clip_grad_norm_(params, cfg.clip)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
    result = {
        "benchmark": "grad_fidelity",
        **env_info(),
        "train_with": args.train_with,
        "recipe": args.recipe,
        "modes": modes,
        "config": dataclasses.asdict(cfg),
        "checks": checks,
    }
    out = Path(args.json) if args.json else results_dir() / f"grad_fidelity_{args.train_with}.json"
    out.write_text(json.dumps(result, indent=1, default=str) + "\n")
    print(f"wrote {out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
