"""Stage `sweep`: the points of one sweep side by side (rloo.sweeps.table), best by validation; JSON + PNG."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from rloo.io import write_json_atomic
from rloo.sweeps import grid, table


def plot(tab: dict[str, Any], path: str | Path) -> str:
    """Validation and test accuracy (sampled) of each point; the best by validation marked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from rloo.plots import _save

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
    return _save(fig, Path(path))


def run(cfg: dict, name: str, result_files: dict[str, str | Path], policy: str, out_json: str | Path,
        out_png: str | Path) -> dict[str, Any]:
    """Table sweep `name` of `cfg` from its points' results files {point id: path}."""
    points = grid(cfg, name)
    missing = sorted(set(points) - set(result_files))
    if missing:
        raise ValueError(f"sweep {name}: no results for points {', '.join(missing)}")
    results = {pid: json.loads(Path(result_files[pid]).read_text()) for pid in points}
    tab = table(name, points, results, policy)
    tab["sources"] = {pid: str(result_files[pid]) for pid in points}
    tab["plot"] = plot(tab, out_png)  # the plot first: the JSON is the stage's completion marker
    write_json_atomic(out_json, tab)
    return tab
