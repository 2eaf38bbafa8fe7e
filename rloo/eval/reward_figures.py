"""The training reward in an evaluation (`reward.source` function or http): each part's mean over a
policy's sampled completions, and their weighted sum's (the reward RLOO trains on), each with a 95 %
interval over problems. A problem's figure is the mean over its draws that got a reward; the interval
is Student's t over those per-problem means (problems are independent, a problem's draws are not)."""

from __future__ import annotations

import math

import numpy as np

from rloo.eval.stats import t_interval
from rloo.reward.functions import weighted_sum


def _figure(draws: list[list[float | None]]) -> dict:
    """{mean, ci95, missing} of per-draw reward lists (draws x problems; None or NaN: missing)."""
    per_problem = []
    missing = 0
    for values in zip(*draws, strict=True):
        got = [v for v in values if v is not None and not math.isnan(v)]
        missing += len(values) - len(got)
        if got:
            per_problem.append(float(np.mean(got)))
    interval = t_interval(per_problem)
    return {"mean": float(np.mean(per_problem)) if per_problem else None,
            "ci95": list(interval) if interval else None, "missing": missing}


def reward_figures(per_draw: list[dict[str, list[float | None]]], weights: dict[str, float]) -> dict:
    """The figures of `per_draw` (one {part: rewards of every problem} per sampled draw), parts weighted by
    `weights` into the training reward."""
    parts = {name: {"weight": w, **_figure([d[name] for d in per_draw])} for name, w in weights.items()}
    total = _figure([weighted_sum(d, weights) for d in per_draw])
    completions = sum(len(next(iter(d.values()))) for d in per_draw)
    return {"parts": parts, "weighted_sum": total, "completions": completions,
            "interval": "t over problems of each problem's mean over its draws"}
