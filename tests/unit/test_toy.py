"""The bandit experiment: reference numbers, shrinkage, variance reduction and training end points.

The full default run takes well under a second of compute, so the tests use it as is (seed 0,
20,000 estimates, 10 training seeds); every check is deterministic given the seeds.
"""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

from rloo.algo.bandit import (
    exact_gradient,
    expected_success,
    make_bandit,
    run_toy,
    sample_actions,
    sample_rewards,
    score_function_gradients,
)
from rloo.algo.estimators import rloo_advantages
from rloo_workflow.stages import toy as toy_stage

KS = (2, 4, 8)


@pytest.fixture(scope="module")
def result():
    torch.set_num_threads(1)
    return run_toy()


def _row(result, method, k):
    (row,) = [r for r in result["estimators"] if r["method"] == method and r["k"] == k]
    return row


def _train(result, method):
    (row,) = [r for r in result["training"] if r["method"] == method]
    return row


def test_problem_matches_reference(result):
    assert result["start_success"] == pytest.approx(0.304, abs=5e-4)
    assert result["true_grad_norm"] == pytest.approx(0.052, abs=5e-4)
    assert result["best_q"] == pytest.approx(0.693, abs=5e-4)


def test_exact_gradient_matches_finite_differences():
    b = make_bandit(0)
    h = 1e-6
    fd = np.array(
        [
            (expected_success(b.logits + h * e, b.q) - expected_success(b.logits - h * e, b.q)) / (2 * h)
            for e in np.eye(len(b.logits))
        ]
    )
    np.testing.assert_allclose(exact_gradient(b.logits, b.q), fd, atol=1e-9)


def test_result_structure_is_json_ready(result):
    json.dumps(result, allow_nan=False)
    assert {tuple(sorted(r)) for r in result["estimators"]} == {("bias", "k", "method", "ratio", "variance")}
    assert {tuple(sorted(r)) for r in result["training"]} == {
        ("final_mean", "final_std", "k", "method", "seeds")
    }
    methods = {(r["method"], r["k"]) for r in result["estimators"]}
    for k in KS:
        assert {("reinforce", k), ("rloo", k), ("grpo", k), ("oracle", k)} <= methods


@pytest.mark.parametrize("k", KS)
def test_group_mean_shrinks_gradient_by_k_minus_1_over_k(result, k):
    assert _row(result, "grpo", k)["ratio"] == pytest.approx((k - 1) / k, abs=0.02)


@pytest.mark.parametrize("k", KS)
@pytest.mark.parametrize("method", ["rloo", "reinforce", "oracle"])
def test_unbiased_estimators_have_ratio_one(result, method, k):
    # Standard error of the ratio from a fresh, independent sample: the spread of each estimate's
    # projection on the true gradient, with the gradient formed here without the package's helpers.
    # A correct estimator lands within 4 standard errors of 1.
    b = make_bandit(0)
    rng = np.random.default_rng(99)
    n = 20000
    pi = np.exp(b.logits - b.logits.max())
    pi /= pi.sum()
    true = exact_gradient(b.logits, b.q)
    actions = sample_actions(pi, (n, k), rng)
    rewards = sample_rewards(b.q, actions, rng)
    if method == "rloo":
        adv = rloo_advantages(torch.from_numpy(rewards)).numpy()
    elif method == "reinforce":
        adv = rewards
    else:
        adv = rewards - (pi @ b.q + 2.0)
    grads = ((np.eye(len(pi))[actions] - pi) * adv[:, :, None]).sum(axis=1) / k
    np.testing.assert_allclose(score_function_gradients(pi, actions, adv), grads, atol=1e-12)
    proj = grads @ true / (true @ true)
    se = proj.std(ddof=1) / math.sqrt(n)
    assert abs(proj.mean() - 1) < 4 * se
    row = _row(result, method, k)
    assert abs(row["ratio"] - 1) < 4 * se
    # Bias of an unbiased estimator is just Monte-Carlo error, of size sqrt(variance / n).
    assert row["bias"] < 3 * math.sqrt(row["variance"] / result["config"]["n_estimates"])
    if method == "rloo":
        # The group mean's shrinkage is many standard errors away, so this check can see it.
        assert (1 / k) > 8 * se


def test_variance_reduction(result):
    reinforce4 = _row(result, "reinforce", 4)["variance"]
    rloo4 = _row(result, "rloo", 4)["variance"]
    assert reinforce4 / rloo4 >= 10  # reference: about 20x
    assert reinforce4 == pytest.approx(1.297, rel=0.03)  # the quoted no-baseline variance is the k=4 row
    assert rloo4 / _row(result, "oracle", 4)["variance"] < 1.5  # reference: within 35%
    assert _row(result, "rloo", 8)["variance"] / _row(result, "oracle", 8)["variance"] < 1.25  # within 15%
    assert _row(result, "rloo", 2)["variance"] / rloo4 > 2.5  # reference: about 3x
    # REINFORCE's variance falls as 1/k from the closed-form single-sample value.
    for k in KS:
        assert _row(result, "reinforce", k)["variance"] == pytest.approx(
            result["reinforce_single_sample_variance"] / k, rel=0.05
        )


def test_training_end_points(result):
    rloo4 = _train(result, "rloo")
    assert rloo4["k"] == 4
    for method in ("rloo", "moving_average", "oracle"):
        row = _train(result, method)
        assert row["final_mean"] == pytest.approx(0.665, abs=0.01), method
        assert row["final_std"] < 0.01, method
        assert len(row["seeds"]) == 10
    reinforce = _train(result, "reinforce")
    # Without a baseline some runs lock onto a worse response: lower mean, much larger spread.
    assert 0.5 < reinforce["final_mean"] < rloo4["final_mean"] - 0.005
    assert reinforce["final_std"] > 10 * rloo4["final_std"]
    assert all(0.25 < s < result["best_q"] for r in result["training"] for s in r["seeds"])
    assert _train(result, "grpo")["final_mean"] == pytest.approx(0.665, abs=0.01)


def test_stage_writes_json_and_png(tmp_path):
    out_json = tmp_path / "toy" / "toy.json"
    out_png = tmp_path / "toy" / "toy.png"
    res = toy_stage.run(str(out_json), str(out_png), seed=0)
    on_disk = json.loads(out_json.read_text())
    assert on_disk["estimators"] == res["estimators"]
    assert out_png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert sorted(p.name for p in out_json.parent.iterdir()) == ["toy.json", "toy.png"]  # no temp files left
