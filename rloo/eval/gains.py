"""Each trained policy's gain in accuracy over SFT on the same problems, with a 95 % interval and a
p-value (the maths: rloo.eval.stats), for the results JSON; rloo.eval.report shows them, rloo_workflow.tracking logs them."""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from rloo.eval.at_k import completion_figures
from rloo.eval.stats import mcnemar_exact, paired_bootstrap, sign_flip_test, wilson_interval
from rloo.progress import Progress
from rloo.reward.judges import PairwiseJudge, VerifierJudge, agreement, win_rate
from rloo.reward.verifier import is_correct

# Enough that the interval's ends and a p-value near 0.05 move by well under a point from one seed to
# the next; 500 problems x 10,000 resamples take a fraction of a second.
RESAMPLES = 10_000


def correctness(texts: dict[str, list], golds: list[str]) -> dict[str, np.ndarray]:
    """A policy's per-problem correctness (the verifier, strict) from evaluate_policy's completions:
    `greedy` of shape (problems,), `sampled` of shape (problems, draws)."""
    return {
        "greedy": np.array([is_correct(t, g) for t, g in zip(texts["greedy"], golds, strict=True)], dtype=bool),
        "sampled": np.array([[is_correct(t, g) for t in draws] for draws, g in zip(texts["draws"], golds, strict=True)],
                            dtype=bool).reshape(len(golds), -1),
    }


def gain(policy: dict[str, np.ndarray], sft: dict[str, np.ndarray], seed: int, resamples: int = RESAMPLES) -> dict:
    """`policy` − `sft` in accuracy (a fraction; points are 100 x), sampled and greedy, on the same
    problems: the paired bootstrap's 95 % interval, and the p-value of no difference (sampled: sign-flip
    permutation of the per-problem mean differences; greedy: exact McNemar)."""
    a, b = policy["sampled"], sft["sampled"]
    per_problem = a.mean(axis=1) - b.mean(axis=1)
    p_greedy, a_only, b_only = mcnemar_exact(policy["greedy"], sft["greedy"])
    return {
        "sampled": {
            "gain": float(per_problem.mean()),
            "ci95": list(paired_bootstrap(a, b, resamples, seed)),
            "p_value": sign_flip_test(per_problem, resamples, seed),
            "test": "paired sign-flip permutation of per-problem mean accuracy differences",
        },
        "greedy": {
            "gain": float(policy["greedy"].mean() - sft["greedy"].mean()),
            "ci95": list(paired_bootstrap(policy["greedy"], sft["greedy"], resamples, seed)),
            "p_value": p_greedy,
            "test": "exact McNemar (two-sided binomial on discordant problems)",
            "discordant": {"policy_only": a_only, "sft_only": b_only},
        },
        "n_problems": len(per_problem),
        "draws": int(a.shape[1]),
        "bootstrap": {"resamples": resamples, "seed": seed, "resampled": "problems"},
    }


def add_tool_figures(figures: dict, texts: dict[str, Any], correct: dict[str, np.ndarray], golds: list[str],
                     seed: int) -> None:
    """Where a policy was also decoded without the tools (`texts["without_tools"]`:
    rloo.eval.evaluation.evaluate_with_records), add to its `figures` what the report adds to any
    policy's, for that pass (`without_tools`: the accuracies' intervals, pass@k, maj@k, the solution
    checker's figures), and `tool_gain`: with the tools − without, on the same problems and noise, the
    paired gain of `gain` (`correct`: the policy's correctness with the tools). The report and
    rloo.api.evaluate share it."""
    if "without_tools" not in texts:
        return
    without = correctness(texts["without_tools"], golds)
    figures["without_tools"] = {**figures.get("without_tools", {}),
                                **completion_figures(texts["without_tools"], without, golds)}
    figures["tool_gain"] = gain(correct, without, seed)


def judged_win_rate(judge: PairwiseJudge, questions: list[str], golds: list[str], candidate: list[str],
                    baseline: list[str], progress: Progress | None = None) -> dict:
    """`candidate`'s win rate against `baseline` by `judge`, both presentation orders (rloo.reward.judges):
    wins, losses, ties, invalid verdicts, the value (null without a valid verdict: NaN is not JSON) and its
    95 % interval; for a judge other than the verifier, how often its verdicts agree with the verifier's on
    the pairs the verifier decides (how far to trust it). `progress` counts the judge's problems."""
    judged = win_rate(judge, questions, golds, candidate, baseline, progress)
    detail = judged.as_dict()
    detail["ci95"] = win_rate_ci95(detail)
    if judge.name != VerifierJudge.name:
        reference = win_rate(VerifierJudge(), questions, golds, candidate, baseline)
        agree = agreement(judged.scores, reference.scores)
        interval = wilson_interval(agree["agree"], agree["judged"])
        detail["agreement_with_verifier"] = {**agree, "ci95": list(interval) if interval else None}
    if isinstance(detail["value"], float) and math.isnan(detail["value"]):
        detail["value"] = None
    return detail


def win_rate_ci95(detail: dict) -> list[float] | None:
    """Wilson 95 % interval of a win rate (judges.WinRate.as_dict), counting a tie as half a win as its
    value does; None without a valid verdict. Here, not in rloo.reward.judges, which training imports."""
    interval = wilson_interval(detail["wins"] + 0.5 * detail["ties"], detail["wins"] + detail["losses"] + detail["ties"])
    return list(interval) if interval else None
