"""Stage `seeds`: the per-seed results of the `seeds` target side by side, and their mean with a
t-interval across seeds (rloo_workflow.seed_table); JSON + PNG."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from rloo.eval import plots
from rloo.io import write_json_atomic
from rloo_workflow.seed_table import aggregate


def run(result_files: dict[int, str | Path], policy: str, out_json: str | Path, out_png: str | Path) -> dict[str, Any]:
    """Aggregate the results files {seed: path} of `policy` (the trained policy's name in them)."""
    results = {int(s): json.loads(Path(f).read_text()) for s, f in result_files.items()}
    table = aggregate(results, policy, {int(s): str(f) for s, f in result_files.items()})
    table["sources"] = {str(s): str(f) for s, f in sorted(result_files.items())}
    table["plot"] = plots.plot_seed_gains(table, out_png)  # the plot first: the JSON is the stage's completion marker
    write_json_atomic(out_json, table)
    return table
