"""Stage `seeds`: the per-seed results of the `seeds` target side by side, and their mean with a
t-interval across seeds (rloo.seeds); JSON + PNG."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from rloo.io import write_json_atomic
from rloo.seeds import aggregate


def plot(table: dict[str, Any], path: str | Path) -> str:
    """Each seed's gain (points, with its paired interval) and the mean across seeds with its t-interval."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from rloo.plots import _save

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
    return _save(fig, Path(path))


def run(result_files: dict[int, str | Path], policy: str, out_json: str | Path, out_png: str | Path) -> dict[str, Any]:
    """Aggregate the results files {seed: path} of `policy` (the trained policy's name in them)."""
    results = {int(s): json.loads(Path(f).read_text()) for s, f in result_files.items()}
    table = aggregate(results, policy, {int(s): str(f) for s, f in result_files.items()})
    table["sources"] = {str(s): str(f) for s, f in sorted(result_files.items())}
    table["plot"] = plot(table, out_png)  # the plot first: the JSON is the stage's completion marker
    write_json_atomic(out_json, table)
    return table
