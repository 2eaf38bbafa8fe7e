"""Stage `sweep`: the points of one sweep side by side (rloo_workflow.sweep_table), best by validation with its
margin over the runner-up, or a tie; JSON + PNG, and each point's line and the winner on the terminal and in
the sweep's log."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from rloo.console import console
from rloo.eval import plots
from rloo.eval.report import sweep_lines
from rloo.io import write_json_atomic
from rloo_workflow.pipeline import sweep_grid
from rloo_workflow.sweep_table import table

log = logging.getLogger("rloo.sweep")


def run(cfg: dict, name: str, result_files: dict[str, str | Path], policy: str, out_json: str | Path,
        out_png: str | Path) -> dict[str, Any]:
    """Table sweep `name` of `cfg` from its points' results files {point id: path}."""
    points = sweep_grid(cfg, name)
    missing = sorted(set(points) - set(result_files))
    if missing:
        raise ValueError(f"sweep {name}: no results for points {', '.join(missing)}")
    results = {pid: json.loads(Path(result_files[pid]).read_text()) for pid in points}
    tab = table(name, points, results, policy)
    tab["sources"] = {pid: str(result_files[pid]) for pid in points}
    tab["plot"] = plots.plot_sweep(tab, out_png)  # the plot first: the JSON is the stage's completion marker
    write_json_atomic(out_json, tab)
    for line in sweep_lines(tab):  # what won, and by how much, where the user looks: the terminal, the log
        console(line, log)
    return tab
