"""PNG plots for the results: policies side by side, and proxy reward against judge accuracy."""

from __future__ import annotations

import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

from rloo.io import atomic_path


def _save(fig, path: Path) -> str:
    path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_path(path) as tmp:
        fig.savefig(tmp, format="png", dpi=110, bbox_inches="tight")
    plt.close(fig)
    return str(path)


def plot_policies(reports: dict[str, dict], path: Path) -> str:
    """Greedy and sampled accuracy, KL and length for every policy."""
    names = list(reports)
    fig, axes = plt.subplots(1, 3, figsize=(12, 3.6))
    x = range(len(names))
    w = 0.38
    axes[0].bar([i - w / 2 for i in x], [reports[n]["accuracy"] for n in names], w, label="greedy")
    axes[0].bar([i + w / 2 for i in x], [reports[n]["accuracy_sampled"] for n in names], w, label="sampled T=1")
    axes[0].set_title("verifier accuracy (held out)")
    axes[0].set_ylim(0, 1)
    axes[0].legend()
    axes[1].bar(x, [reports[n]["kl"] for n in names], color="tab:red")
    axes[1].set_title("sequence KL to the reference (nats)")
    axes[2].bar(x, [reports[n]["mean_length"] for n in names], color="tab:gray")
    axes[2].set_title("mean response length (tokens)")
    for ax in axes:
        ax.set_xticks(list(x), names, rotation=20)
    return _save(fig, path)


def plot_proxy_vs_judge(steps_files: dict[str, Path], path: Path) -> str:
    """Proxy reward and held-out accuracy over training: the reward-hacking check at a glance."""
    fig, ax = plt.subplots(figsize=(7, 4))
    ax2 = ax.twinx()
    for name, f in steps_files.items():
        rows = [json.loads(line) for line in Path(f).read_text().splitlines()] if Path(f).exists() else []
        ev = [r for r in rows if "eval/proxy_reward" in r]
        if not ev:
            continue
        steps = [r["step"] + 1 for r in ev]
        ax.plot(steps, [r["eval/proxy_reward"] for r in ev], "-o", color="tab:orange", label=f"{name}: proxy reward")
        ax2.plot(steps, [r["eval/accuracy_sampled"] for r in ev], "-s", color="tab:blue",
                 label=f"{name}: judge accuracy")
    ax.set_xlabel("RLOO step")
    ax.set_ylabel("proxy reward (reward model)", color="tab:orange")
    ax2.set_ylabel("held-out accuracy by the verifier", color="tab:blue")
    ax.set_title("proxy rising while the judge flattens = reward hacking")
    h1, l1 = ax.get_legend_handles_labels()
    h2, l2 = ax2.get_legend_handles_labels()
    if h1 or h2:
        ax.legend(h1 + h2, l1 + l2, loc="lower right", fontsize=8)
    return _save(fig, path)
