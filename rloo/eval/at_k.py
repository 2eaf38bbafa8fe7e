"""More from the completions the evaluation already makes: pass@k (any of a problem's k draws is right)
and maj@k (the most common answer among them is right), each a share of problems with a 95 % Wilson
interval (verl logs the same pair as best@N and maj@N); the accuracies' own intervals; and, in
`completion_figures`, all of them with the solution checker's figures: what the report adds to a
policy's evaluation (rloo_workflow/stages/report.py, rloo.api.evaluate)."""

from __future__ import annotations

from collections import Counter
from decimal import Decimal

import numpy as np

from rloo.eval.stats import wilson_interval
from rloo.reward.solution_check import summarize as check_solutions
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


def accuracy_intervals(correct: dict[str, np.ndarray]) -> dict:
    """95 % Wilson intervals over problems of the greedy accuracy (`accuracy_ci95`) and of the sampled one
    (`accuracy_sampled_ci95`: each problem counts its share of right draws as its success, as a win rate
    counts a tie as half a win; a problem's draws are not independent, so problems, not draws, are the n).
    `correct`: rloo.eval.gains.correctness of one policy."""
    n = len(correct["greedy"])
    greedy = wilson_interval(float(correct["greedy"].sum()), n)
    sampled = wilson_interval(float(correct["sampled"].mean(axis=1).sum()), n)
    return {"accuracy_ci95": list(greedy) if greedy else None, "accuracy_sampled_ci95": list(sampled) if sampled else None}


def completion_figures(texts: dict[str, list], correct: dict[str, np.ndarray], golds: list[str]) -> dict:
    """What the report adds to one policy's evaluation figures, read from its completions (`texts`:
    evaluate_policy's, or rloo.eval.records.PolicyRecords.texts) and their correctness
    (rloo.eval.gains.correctness): the accuracies' intervals, the solution checker's figures, pass@k and
    maj@k of the same draws."""
    return {**accuracy_intervals(correct), "solution_check": check_solutions(texts["draws"], texts["greedy"], golds),
            "pass_at_k": pass_at_k(correct["sampled"]), "maj_at_k": maj_at_k(texts["draws"], golds)}
