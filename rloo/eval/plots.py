"""PNG plots for the results: policies side by side, proxy reward against judge accuracy, a run's curves."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

from rloo.io import atomic_path

# Curves drawn by plot_curves, in this order (then any other metric with a history).
CURVE_PRIORITY = [
    "train/reward_mean", "train/kl", "train/zero_adv_frac", "train/response_length", "train/entropy",
    "train/loss", "train/grad_norm", "train/clip_frac", "eval/accuracy_sampled", "eval/proxy_reward",
    "time/step_s", "sft/loss", "sft/grad_norm", "sft/lr", "reward/loss", "reward/train_accuracy",
]
MAX_CURVES = 12


def save_figure(fig, path: Path, dpi: int = 110) -> str:
    """Write `fig` as a PNG at `path` atomically (a reader never sees half a file) and close it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_path(path) as tmp:
        fig.savefig(tmp, format="png", dpi=dpi, bbox_inches="tight")
    plt.close(fig)
    return str(path)


def plot_policies(reports: dict[str, dict], path: Path) -> str:
    """Greedy and sampled accuracy, the reward model's proxy score, KL and length for every policy."""
    names = list(reports)
    fig, axes = plt.subplots(1, 4, figsize=(16, 3.6))
    x = range(len(names))
    w = 0.38
    axes[0].bar([i - w / 2 for i in x], [reports[n]["accuracy"] for n in names], w, label="greedy")
    axes[0].bar([i + w / 2 for i in x], [reports[n]["accuracy_sampled"] for n in names], w, label="sampled T=1")
    axes[0].set_title("verifier accuracy (held out)")
    axes[0].set_ylim(0, 1)
    axes[0].legend()
    proxy = [reports[n].get("proxy_reward") for n in names]
    axes[1].bar(x, [p if p is not None else 0.0 for p in proxy], color="tab:orange")
    axes[1].set_title("reward model's score (proxy)" if any(p is not None for p in proxy) else "no reward model")
    axes[2].bar(x, [reports[n]["kl"] for n in names], color="tab:red")
    axes[2].set_title("sequence KL to the reference (nats)")
    axes[3].bar(x, [reports[n]["mean_length"] for n in names], color="tab:gray")
    axes[3].set_title("mean response length (tokens)")
    for ax in axes:
        ax.set_xticks(list(x), names, rotation=20)
    return save_figure(fig, path)


def plot_proxy_vs_judge(evals: dict[str, list[dict]], path: Path) -> str:
    """Training reward and validation accuracy at each evaluation of a run (`metrics.json`'s `evals`):
    the reward-hacking check at a glance."""
    fig, ax = plt.subplots(figsize=(7, 4))
    ax2 = ax.twinx()
    for name, ev in evals.items():
        if not ev:
            continue
        steps = [r["step"] for r in ev]
        ax.plot(steps, [r["eval/proxy_reward"] for r in ev], "-o", color="tab:orange", label=f"{name}: training reward")
        ax2.plot(steps, [r["eval/accuracy_sampled"] for r in ev], "-s", color="tab:blue",
                 label=f"{name}: validation accuracy")
    ax.set_xlabel("RLOO step")
    ax.set_ylabel("training reward on validation samples", color="tab:orange")
    ax2.set_ylabel("validation accuracy by the verifier", color="tab:blue")
    ax.set_title("proxy rising while the judge flattens = reward hacking")
    h1, l1 = ax.get_legend_handles_labels()
    h2, l2 = ax2.get_legend_handles_labels()
    if h1 or h2:
        ax.legend(h1 + h2, l1 + l2, loc="lower right", fontsize=8)
    return save_figure(fig, path)


def plot_curves(history: dict[str, list[tuple[int, float]]], title: str, path: Path) -> str | None:
    """A grid of a stage's metric curves (every metric logged at two or more steps); None if none is."""
    names = [k for k, v in history.items() if len({s for s, _ in v}) >= 2]
    if not names:
        return None
    order = {k: i for i, k in enumerate(CURVE_PRIORITY)}
    names = sorted(names, key=lambda k: (order.get(k, len(order)), k))[:MAX_CURVES]
    cols = min(3, len(names))
    rows = math.ceil(len(names) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4 * cols, 2.8 * rows), squeeze=False)
    for ax, name in zip(axes.flat, names, strict=False):
        pts = sorted(history[name])
        ax.plot([s for s, _ in pts], [v for _, v in pts], marker="." if len(pts) < 50 else None)
        ax.set_title(name, fontsize=9)
        ax.set_xlabel("step", fontsize=8)
        ax.tick_params(labelsize=7)
    for ax in list(axes.flat)[len(names):]:
        ax.set_visible(False)
    fig.suptitle(f"{title}: metric curves", fontsize=10)
    fig.tight_layout()
    return save_figure(fig, path, dpi=90)


def plot_seed_gains(table: dict[str, Any], path: str | Path) -> str:
    """Each seed's gain (points, with its paired interval) and the mean across seeds with its t-interval."""
    fig, axes = plt.subplots(1, 2, figsize=(8, 3.2), sharey=True)
    for ax, mode in zip(axes, ("sampled", "greedy"), strict=True):
        seeds = list(table["seeds"])
        for i, seed in enumerate(seeds):
            row = table["seeds"][seed]
            lo, hi = row[f"gain_{mode}_ci95"]
            g = row[f"gain_{mode}"]
            ax.errorbar(i, 100 * g, yerr=[[100 * (g - lo)], [100 * (hi - g)]], fmt="o", color="tab:blue", capsize=3)
        agg = table["aggregate"][f"gain_{mode}"]
        x = len(seeds)
        if agg["ci95"]:
            lo, hi = agg["ci95"]
            ax.errorbar(x, 100 * agg["mean"], yerr=[[100 * (agg["mean"] - lo)], [100 * (hi - agg["mean"])]],
                        fmt="s", color="tab:red", capsize=4)
        else:
            ax.plot(x, 100 * agg["mean"], "s", color="tab:red")
        ax.axhline(0, color="grey", lw=0.8)
        ax.set_xticks(range(x + 1), [f"seed {s}" for s in seeds] + ["mean"])
        ax.set_title(f"{mode}: {table['policy']} − SFT (points)", fontsize=9)
    fig.suptitle("gain per seed (paired bootstrap 95 %) and across seeds (t 95 %)", fontsize=10)
    return save_figure(fig, Path(path))


def plot_sweep(tab: dict[str, Any], path: str | Path) -> str:
    """Validation and test accuracy (sampled) of each point; the best by validation marked."""
    rows = tab["rows"]
    fig, ax = plt.subplots(figsize=(max(4.0, 1.2 * len(rows) + 2), 3.4))
    x = range(len(rows))
    ax.plot(x, [r["val_accuracy_sampled"] if r["val_accuracy_sampled"] is not None else float("nan") for r in rows],
            "o-", label="validation (selects)")
    ax.plot(x, [r["test"]["rloo_sampled"] for r in rows], "s--", label="test")
    if tab["best"]:
        i = [r["point"] for r in rows].index(tab["best"]["point"])
        ax.axvline(i, color="tab:green", lw=1, ls=":", label="best by validation")
    ax.set_xticks(list(x), [r["label"] for r in rows], rotation=30, ha="right", fontsize=7)
    ax.set_ylabel("sampled accuracy")
    ax.set_title(f"sweep {tab['sweep']}", fontsize=10)
    ax.legend(fontsize=7)
    return save_figure(fig, Path(path))
