"""Plot an RL run written by ``python -m flamia_serve.train.rl`` (``flamia rl``).

``python benchmarks/plot_rl.py [benchmarks/results/rl.json] [--out PNG]`` draws, for every
run in the JSON, the mean reward per step (raw, faint, and smoothed) with the exact-answer
fraction, and the per-token log-prob mismatch between the rollout engine and the trainer:
mean |Δ log-prob| and the k3 KL estimate per step (log scale); prints a table of the runs.
The PNG goes beside the JSON unless ``--out`` names another file. Needs matplotlib.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

DEFAULT_JSON = Path(__file__).resolve().parent / "results" / "rl.json"
COLORS = {"flamia-fp8": "tab:blue", "flamia-nvfp4": "tab:orange", "bf16-fa-fp8": "black",
          "cpu": "tab:green"}  # fmt: skip
FALLBACK = ("tab:red", "tab:purple", "tab:brown", "tab:pink", "tab:olive", "tab:cyan")


def smooth(values: list[float], alpha: float = 0.1) -> list[float]:
    """Exponential moving average (bias-corrected, so the first values are not pulled to 0)."""
    out, acc, weight = [], 0.0, 0.0
    for v in values:
        acc = (1 - alpha) * acc + alpha * v
        weight = (1 - alpha) * weight + alpha
        out.append(acc / weight)
    return out


def describe(run: dict) -> str:
    """``trainer X / rollout Y`` of a run record."""
    s = run.get("setup", {})
    trainer = s.get("trainer_attention", "?")
    if s.get("exact_causal"):
        trainer += " exact_causal"
    if s.get("engine") == "vllm":
        rollout = f"vLLM {s.get('vllm_backend')} {s.get('kv_cache_dtype')}"
    else:
        rollout = "trainer model"
    return f"trainer {trainer} / rollout {rollout}"


def _fmt(x: float | None, spec: str) -> str:
    return "—" if x is None else format(x, spec)


def table(result: dict) -> str:
    """One row per run: setup, reward first → last tenth, exact fraction, mismatch."""
    lines = ["| run | trainer / rollout | reward (first → last 10%) | exact (first → last) | "
             "mean abs Δ log-prob | max abs Δ | k3 KL |",
             "|---|---|---|---|---|---|---|"]  # fmt: skip
    for name, run in result["runs"].items():
        s = run.get("summary", {})
        lines.append(
            f"| {name} | {describe(run)} | {_fmt(s.get('reward_first'), '.3f')} → "
            f"{_fmt(s.get('reward_last'), '.3f')} | {_fmt(s.get('exact_first'), '.2f')} → "
            f"{_fmt(s.get('exact_last'), '.2f')} | {_fmt(s.get('mismatch_abs_mean'), '.3g')} | "
            f"{_fmt(s.get('mismatch_abs_max'), '.3g')} | {_fmt(s.get('kl_k3'), '.3g')} |")
    return "\n".join(lines)


def plot(result: dict, out: Path) -> Path:
    """Write the three-panel figure (reward, mean |Δ log-prob|, k3) to ``out``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_r, ax_d, ax_k) = plt.subplots(1, 3, figsize=(16, 4.5))
    spare = iter(FALLBACK)
    log_d = log_k = False
    for name, run in result["runs"].items():
        steps = run.get("steps") or []
        if not steps:
            continue
        color = COLORS.get(name) or next(spare, None)
        x = [s["step"] for s in steps]
        reward = [s["reward_mean"] for s in steps]
        ax_r.plot(x, reward, color=color, alpha=0.2, linewidth=0.7)
        ax_r.plot(x, smooth(reward), color=color, linewidth=1.4, label=f"{name} reward (EMA)")
        ax_r.plot(x, smooth([s["exact_frac"] for s in steps]), color=color, linestyle="--",
                  linewidth=1.0, label=f"{name} exact (EMA)")  # fmt: skip
        d = [s["mismatch_abs_mean"] for s in steps]
        k = [s["kl_k3"] for s in steps]
        ax_d.plot(x, d, color=color, linewidth=1.2, label=name)
        ax_k.plot(x, k, color=color, linewidth=1.2, label=name)
        log_d |= any(v > 0 for v in d)
        log_k |= any(v > 0 for v in k)
    ax_r.set_ylabel("reward (mean over rollouts)")
    ax_d.set_ylabel("mean |Δ log-prob| per sampled token")
    ax_k.set_ylabel("KL(rollout ‖ trainer), k3 estimate")
    for ax, log in ((ax_r, False), (ax_d, log_d), (ax_k, log_k)):
        ax.set_xlabel("RL step")
        if log:
            ax.set_yscale("log")
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize="small")
    cfg = result.get("config", {})
    fig.suptitle(f"RL (reverse digits), {result.get('gpu', '?')}, {result.get('date', '?')}: "
                 f"model {cfg.get('model_size', '?')}, {cfg.get('prompts', '?')} prompts × "
                 f"{cfg.get('group', '?')} samples/step, seed {cfg.get('seed', '?')}",
                 fontsize="medium")  # fmt: skip
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("json", nargs="?", default=str(DEFAULT_JSON), help="rl result JSON")
    p.add_argument("--out", help="PNG path (default: the JSON's path with .png)")
    args = p.parse_args(argv)
    path = Path(args.json)
    if not path.is_file():
        print(f"error: json: no file {path}", file=sys.stderr)
        return 2
    result = json.loads(path.read_text())
    if result.get("benchmark") != "rl" or not result.get("runs"):
        print(f"error: json: {path} is not an rl result with runs", file=sys.stderr)
        return 2
    print(table(result))
    out = plot(result, Path(args.out) if args.out else path.with_suffix(".png"))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
