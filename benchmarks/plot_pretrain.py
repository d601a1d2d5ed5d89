"""Plot a pretraining comparison written by ``python -m flamia_serve.train.pretrain``.

``python benchmarks/plot_pretrain.py [benchmarks/results/pretrain.json] [--out PNG]``
draws, for every attention choice in the JSON, the training loss per step (raw, faint,
and smoothed) with the held-out losses, and the held-out loss relative to BF16 in
percent; prints a table of final held-out losses. The PNG goes beside the JSON unless
``--out`` names another file. Needs matplotlib.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

DEFAULT_JSON = Path(__file__).resolve().parent / "results" / "pretrain.json"
COLORS = {"bf16": "black", "mxfp8": "tab:blue", "mxfp8_grad_input": "tab:purple",
          "mixed_nvfp4": "tab:orange", "mixed_nvfp4_hadamard": "tab:green"}


def smooth(values: list[float], alpha: float = 0.02) -> list[float]:
    """Exponential moving average (bias-corrected, so the first values are not pulled to 0)."""
    out, acc, weight = [], 0.0, 0.0
    for v in values:
        acc = (1 - alpha) * acc + alpha * v
        weight = (1 - alpha) * weight + alpha
        out.append(acc / weight)
    return out


def table(result: dict) -> str:
    """Final held-out loss per choice, relative to BF16, BF16-attention cross-check, speed."""
    lines = ["| attention | final held-out loss | vs bf16 | same weights, SDPA eval | "
             "ms/step |", "|---|---|---|---|---|"]
    rel = result.get("final_eval_loss_rel_to_bf16", {})
    for name, run in result["runs"].items():
        loss = run.get("final_eval_loss")
        r = rel.get(name)
        sdpa = run.get("final_eval_loss_sdpa")
        lines.append(
            f"| {name} | {'diverged' if loss is None else f'{loss:.4f}'} | "
            f"{'—' if r is None else f'{100 * r:+.2f}%'} | "
            f"{'—' if sdpa is None else f'{sdpa:.4f}'} | {run.get('ms_per_step', 0):.1f} |")
    return "\n".join(lines)


def plot(result: dict, out: Path) -> Path:
    """Write the two-panel figure to ``out``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = result["runs"]
    fig, (ax, ax_rel) = plt.subplots(1, 2, figsize=(12, 4.5))
    lows, starts = [], []
    for name, run in runs.items():
        color = COLORS.get(name)
        loss = run["loss"]
        if not loss:
            continue
        steps = range(1, len(loss) + 1)
        ax.plot(steps, loss, color=color, alpha=0.15, linewidth=0.6)
        smoothed = smooth(loss)
        ax.plot(steps, smoothed, color=color, linewidth=1.2, label=f"{name} train (EMA)")
        if run["eval"]:
            ax.plot([e["step"] for e in run["eval"]], [e["loss"] for e in run["eval"]],
                    color=color, linestyle="--", marker="o", markersize=3,
                    label=f"{name} held-out")
        lows.append(min([*smoothed, *(e["loss"] for e in run["eval"])]))
        starts.append(smoothed[min(len(smoothed) - 1, max(len(smoothed) // 20, 1))])
    if lows:
        ax.set_ylim(0.97 * min(lows), max(starts))
    ax.set_xlabel("step")
    ax.set_ylabel("next-token loss (nats)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize="small")

    base = {e["step"]: e["loss"] for e in runs.get("bf16", {}).get("eval", [])}
    for name, run in runs.items():
        if name == "bf16" or not base:
            continue
        pts = [(e["step"], 100 * (e["loss"] / base[e["step"]] - 1))
               for e in run["eval"] if e["step"] in base]
        if pts:
            ax_rel.plot(*zip(*pts, strict=True), color=COLORS.get(name), marker="o",
                        markersize=3, label=name)
    ax_rel.axhline(0.0, color="black", linewidth=0.8)
    for bound in (-0.5, 0.5):
        ax_rel.axhline(bound, color="gray", linestyle=":", linewidth=0.8)
    ax_rel.set_xlabel("step")
    ax_rel.set_ylabel("held-out loss vs bf16 (%)")
    ax_rel.grid(alpha=0.3)
    if ax_rel.get_legend_handles_labels()[0]:
        ax_rel.legend(fontsize="small")

    cfg = result.get("config", {})
    params = result.get("params")
    tokens = cfg.get("seq_len", 0) * cfg.get("micro_batches", 0)
    fig.suptitle(f"pretraining, {result.get('gpu', '?')}, {result.get('date', '?')}: "
                 f"{(params or 0) / 1e6:.3g}M params, {tokens:,} tokens/step, "
                 f"seed {cfg.get('seed', '?')}"
                 + (", exact_causal" if cfg.get("exact_causal") else ""), fontsize="medium")
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("json", nargs="?", default=str(DEFAULT_JSON), help="pretrain result JSON")
    p.add_argument("--out", help="PNG path (default: the JSON's path with .png)")
    args = p.parse_args(argv)
    path = Path(args.json)
    if not path.is_file():
        print(f"error: json: no file {path}", file=sys.stderr)
        return 2
    result = json.loads(path.read_text())
    if result.get("benchmark") != "pretrain" or not result.get("runs"):
        print(f"error: json: {path} is not a pretrain result with runs", file=sys.stderr)
        return 2
    print(table(result))
    out = plot(result, Path(args.out) if args.out else path.with_suffix(".png"))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
