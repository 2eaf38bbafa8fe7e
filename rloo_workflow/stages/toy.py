"""Stage `toy`: the single-prompt bandit experiment, written as a JSON summary and a PNG figure."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rloo.algo.bandit import plot_toy, run_toy
from rloo.io import atomic_path, write_json_atomic


def run(out_json: str, out_png: str, seed: int = 0) -> dict[str, Any]:
    """Run the toy experiment with its default sizes; write both outputs atomically and return the result."""
    result = run_toy(seed=seed)
    Path(out_json).parent.mkdir(parents=True, exist_ok=True)
    Path(out_png).parent.mkdir(parents=True, exist_ok=True)
    # The figure first: the JSON is the stage's completion marker, so it must not exist without its plot.
    with atomic_path(out_png) as tmp:
        plot_toy(result, str(tmp))
    write_json_atomic(out_json, result)
    return result
