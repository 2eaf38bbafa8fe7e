"""pass@k and maj@k from a policy's sampled draws (rloo.eval.at_k), on hand-made completions."""

from __future__ import annotations

import numpy as np
import pytest

from rloo.eval.at_k import maj_at_k, majority_answer, pass_at_k
from rloo.eval.gains import correctness
from rloo.eval.stats import wilson_interval

DRAWS = [
    ["#### 4", "#### 5", "#### 4", "no answer"],     # majority 4, gold 4: both right
    ["#### 7", "#### 8", "#### 8", "#### 9"],        # one right (7), majority 8: pass, not maj
    ["#### 1", "#### 1", "#### 2", "#### 2"],        # a tie: the answer reached first (1), gold 2
    ["nothing", "still nothing", "...", "?"],        # no answer at all
    ["#### 3.0", "#### 3", "#### 6", "#### 6"],      # 3.0 and 3 are one vote of 2, first reached: 3
]
GOLDS = ["x\n#### 4", "x\n#### 7", "x\n#### 2", "x\n#### 5", "x\n#### 3"]


def test_pass_at_k_is_any_draw_right_over_problems():
    sampled = correctness({"greedy": [d[0] for d in DRAWS], "draws": DRAWS}, GOLDS)["sampled"]
    got = pass_at_k(sampled)
    assert got["k"] == 4
    assert got["value"] == pytest.approx(4 / 5)  # every problem but the one with no answer
    assert got["ci95"] == pytest.approx(list(wilson_interval(4, 5)))


def test_majority_vote_compares_numbers_and_breaks_ties_by_first_answer():
    assert majority_answer(DRAWS[0]) == "4"
    assert majority_answer(DRAWS[2]) == "1"
    assert majority_answer(DRAWS[3]) is None
    assert majority_answer(DRAWS[4]) == "3"
    got = maj_at_k(DRAWS, GOLDS)
    assert got["k"] == 4
    assert got["value"] == pytest.approx(2 / 5)  # problems 1 and 5
    assert got["ci95"] == pytest.approx(list(wilson_interval(2, 5)))


def test_maj_at_k_is_at_most_pass_at_k_and_equals_accuracy_for_one_draw():
    rng = np.random.default_rng(0)
    draws = [[f"#### {v}" for v in rng.integers(0, 3, size=1)] for _ in range(50)]
    golds = [f"#### {v}" for v in rng.integers(0, 3, size=50)]
    sampled = correctness({"greedy": [d[0] for d in draws], "draws": draws}, golds)["sampled"]
    assert maj_at_k(draws, golds)["value"] == pass_at_k(sampled)["value"] == sampled.mean()
