"""More from the sampled draws the evaluation already makes: pass@k (any of a problem's k draws is
right) and maj@k (the most common answer among them is right), each a share of problems with a 95 %
Wilson interval; verl logs the same pair as best@N and maj@N."""

from __future__ import annotations

from collections import Counter
from decimal import Decimal

import numpy as np

from rloo.eval.stats import wilson_interval
from rloo.reward.verifier import extract_answer, gold_answer


def _share(hits: np.ndarray) -> dict:
    ci = wilson_interval(float(hits.sum()), len(hits))
    return {"value": float(hits.mean()) if len(hits) else 0.0, "ci95": list(ci) if ci else None}


def pass_at_k(sampled: np.ndarray) -> dict:
    """pass@k with k = all draws: 1[any draw of a problem is correct], over problems (n = k, so the
    unbiased estimator 1 − C(n−c, k)/C(n, k) is exactly this indicator). `sampled`: (problems, k) bool."""
    return {"k": int(sampled.shape[1]), **_share(sampled.any(axis=1))}


def majority_answer(completions: list[str]) -> str | None:
    """The most common strict-mode final answer among the completions (numbers compared as numbers; a
    tie goes to the answer reached first); None if none of them gives one."""
    votes = Counter(Decimal(a).normalize() for a in (extract_answer(c, "strict") for c in completions) if a)
    return str(votes.most_common(1)[0][0]) if votes else None


def maj_at_k(draws: list[list[str]], golds: list[str]) -> dict:
    """maj@k: 1[the majority answer of a problem's k draws equals its gold answer], over problems."""
    hits = []
    for completions, gold in zip(draws, golds, strict=True):
        vote, target = majority_answer(completions), gold_answer(gold)
        hits.append(vote is not None and target is not None and Decimal(vote) == Decimal(target))
    return {"k": len(draws[0]) if draws else 0, **_share(np.array(hits, dtype=bool))}
