"""Advantage estimators: hand-checked values, algebraic identities, unbiasedness, missing rewards."""

from __future__ import annotations

import itertools
import math
import subprocess
import sys
import typing

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from rloo.algo import names
from rloo.algo.estimators import (
    ESTIMATOR_TABLE,
    MovingBaseline,
    compute_advantages,
    grpo_advantages,
    has_signal,
    moving_average_advantages,
    reinforce_advantages,
    remax_advantages,
    rloo_advantages,
    update_moving_baseline,
)

WORKED = torch.tensor([[1.0, 0.0, 0.5, 0.3]], dtype=torch.float64)


def test_worked_example_rloo():
    adv = rloo_advantages(WORKED)[0]
    torch.testing.assert_close(
        adv, torch.tensor([0.7333, -0.6, 0.0667, -0.2], dtype=torch.float64), atol=5e-4, rtol=0
    )
    # Leave-one-out baselines of the example: 0.267, 0.600, 0.433, 0.500.
    torch.testing.assert_close(
        WORKED[0] - adv, torch.tensor([0.2667, 0.6, 0.4333, 0.5], dtype=torch.float64), atol=5e-4, rtol=0
    )


def test_worked_example_grpo():
    adv = grpo_advantages(WORKED, scale_by_std=False)[0]
    torch.testing.assert_close(
        adv, torch.tensor([0.55, -0.45, 0.05, -0.15], dtype=torch.float64), atol=1e-9, rtol=0
    )
    # Three quarters of RLOO's, as (k-1)/k predicts for k = 4.
    torch.testing.assert_close(adv, 0.75 * rloo_advantages(WORKED)[0])


def test_worked_example_grpo_std_uses_population_std():
    adv = grpo_advantages(WORKED, scale_by_std=True)[0]
    # The example's std is 0.364 (ddof=0); a sample std (0.420) would give +1.31, -1.07, ...
    torch.testing.assert_close(
        adv, torch.tensor([1.51, -1.24, 0.14, -0.41], dtype=torch.float64), atol=5e-3, rtol=0
    )
    assert adv[0].item() == pytest.approx(0.55 / math.sqrt(0.1325), rel=1e-5)


@settings(max_examples=200, deadline=None)
@given(
    arrays(
        np.float64,
        st.tuples(st.integers(1, 6), st.integers(2, 8)),
        elements=st.floats(-100, 100, allow_nan=False, allow_infinity=False),
    )
)
def test_rloo_is_scaled_group_mean_and_sums_to_zero(r):
    rewards = torch.from_numpy(r)
    k = rewards.shape[1]
    rloo = rloo_advantages(rewards)
    grpo = grpo_advantages(rewards)
    torch.testing.assert_close(rloo, k / (k - 1) * grpo, atol=1e-9, rtol=1e-9)
    torch.testing.assert_close(
        rloo.sum(dim=1), torch.zeros(rewards.shape[0], dtype=torch.float64), atol=1e-9, rtol=0
    )
    torch.testing.assert_close(
        grpo.sum(dim=1), torch.zeros(rewards.shape[0], dtype=torch.float64), atol=1e-9, rtol=0
    )
    # Definition check straight from Eq. (2), one sample at a time.
    for i in range(k):
        others = torch.cat([rewards[:, :i], rewards[:, i + 1 :]], dim=1)
        torch.testing.assert_close(rloo[:, i], rewards[:, i] - others.mean(dim=1), atol=1e-9, rtol=1e-9)


def _bandit_estimate(pi, actions, adv):
    """Per group: (1/k) sum_i A_i (e_{a_i} - pi), computed with plain numpy, independently of the package."""
    k = actions.shape[1]
    onehots = np.eye(len(pi))[actions]  # [n, k, A]
    return ((onehots - pi) * adv[:, :, None]).sum(axis=1) / k


def test_rloo_exactly_unbiased_by_enumeration():
    # Every (action, outcome) pair of a k=2 group on a 3-arm Bernoulli bandit, weighted by its
    # probability: the expectation of the RLOO estimate must equal the exact gradient to rounding.
    logits = np.array([0.3, -0.2, 0.8])
    q = np.array([0.1, 0.6, 0.35])
    offset = 2.0
    pi = np.exp(logits) / np.exp(logits).sum()
    true = pi * (q - pi @ q)
    expect_rloo = np.zeros(3)
    expect_grpo = np.zeros(3)
    for a1, a2, s1, s2 in itertools.product(range(3), range(3), (0, 1), (0, 1)):
        prob = pi[a1] * pi[a2] * (q[a1] if s1 else 1 - q[a1]) * (q[a2] if s2 else 1 - q[a2])
        rewards = torch.tensor([[s1 + offset, s2 + offset]], dtype=torch.float64)
        acts = np.array([[a1, a2]])
        expect_rloo += prob * _bandit_estimate(pi, acts, rloo_advantages(rewards).numpy())[0]
        expect_grpo += prob * _bandit_estimate(pi, acts, grpo_advantages(rewards).numpy())[0]
    np.testing.assert_allclose(expect_rloo, true, atol=1e-14)
    # The group mean including the sample itself is exactly (k-1)/k = 1/2 of it.
    np.testing.assert_allclose(expect_grpo, 0.5 * true, atol=1e-14)


def test_rloo_gradient_unbiased_monte_carlo():
    # 4-arm bandit, k = 4, reward = success + 1 (uncentred). With n independent group estimates, each
    # coordinate of the mean is within 5 standard errors of the truth with probability > 1 - 2.3e-6 if
    # the estimator is unbiased (CLT, n = 100k); seeded, so the outcome is deterministic anyway.
    rng = np.random.default_rng(1234)
    logits = np.array([0.5, 0.0, -0.5, 1.0])
    q = np.array([0.2, 0.5, 0.8, 0.3])
    pi = np.exp(logits) / np.exp(logits).sum()
    true = pi * (q - pi @ q)
    n, k = 100_000, 4
    actions = rng.choice(4, size=(n, k), p=pi)
    rewards = (rng.random((n, k)) < q[actions]).astype(np.float64) + 1.0

    est = _bandit_estimate(pi, actions, rloo_advantages(torch.from_numpy(rewards)).numpy())
    se = est.std(axis=0, ddof=1) / math.sqrt(n)
    z = (est.mean(axis=0) - true) / se
    assert np.all(np.abs(z) < 5), z

    # Power check: the same test must reject the group-mean estimator, whose mean is shrunk by 1/k.
    grpo = _bandit_estimate(pi, actions, grpo_advantages(torch.from_numpy(rewards)).numpy())
    z_grpo = (grpo.mean(axis=0) - true) / (grpo.std(axis=0, ddof=1) / math.sqrt(n))
    assert np.abs(z_grpo).max() > 10, z_grpo


def test_missing_rewards_and_degenerate_groups():
    nan = float("nan")
    rewards = torch.tensor(
        [
            [1.0, nan, 0.0, 0.5],  # three valid: baselines over the other two valid
            [nan, 2.0, nan, nan],  # one valid: no baseline exists
            [nan, nan, nan, nan],  # none valid
            [3.0, nan, 1.0, nan],  # two valid
        ],
        dtype=torch.float64,
    )
    for name in ("rloo", "grpo", "grpo_std"):
        res = compute_advantages(name, rewards)
        adv = res.advantages
        assert not torch.isnan(adv).any()
        assert res.n_degenerate_groups == 2
        assert torch.all(adv[1] == 0) and torch.all(adv[2] == 0)
        assert adv[0, 1] == 0 and adv[3, 1] == 0 and adv[3, 3] == 0
        assert res.zero_adv_frac == pytest.approx(0.5)
    rloo = rloo_advantages(rewards)
    torch.testing.assert_close(
        rloo[0], torch.tensor([1.0 - 0.25, 0.0, 0.0 - 0.75, 0.5 - 0.5], dtype=torch.float64)
    )
    torch.testing.assert_close(rloo[3], torch.tensor([2.0, 0.0, -2.0, 0.0], dtype=torch.float64))
    grpo = grpo_advantages(rewards)
    torch.testing.assert_close(grpo[0], torch.tensor([0.5, 0.0, -0.5, 0.0], dtype=torch.float64))
    assert not torch.isnan(reinforce_advantages(rewards)).any()
    assert reinforce_advantages(rewards)[1].tolist() == [0.0, 2.0, 0.0, 0.0]


def test_rloo_matches_trl_formula_with_missing_rewards():
    gen = torch.Generator().manual_seed(7)
    rewards = torch.randn(200, 4, generator=gen, dtype=torch.float64)
    rewards[torch.rand(200, 4, generator=gen) < 0.3] = float("nan")
    # TRL RLOOTrainer: baseline = (nansum(r) - r) / (valid_count - 1), per group.
    count = (~torch.isnan(rewards)).sum(dim=1, keepdim=True).to(torch.float64)
    baseline = (torch.nansum(rewards, dim=1, keepdim=True) - rewards) / (count - 1)
    trl = rewards - baseline
    ours = rloo_advantages(rewards)
    defined = ~torch.isnan(rewards) & (count >= 2)
    assert defined.sum() > 400  # the comparison covers most entries
    torch.testing.assert_close(ours[defined], trl[defined], atol=1e-12, rtol=0)
    assert torch.all(ours[~defined] == 0)
    assert not torch.isnan(ours).any()


def test_equal_rewards_give_exact_zero():
    rewards = torch.tensor([[0.1, 0.1, 0.1], [0.7, 0.7, 0.7], [0.0, 1.0, 0.0]])
    for name in ("rloo", "grpo", "grpo_std"):
        res = compute_advantages(name, rewards)
        assert torch.all(res.advantages[:2] == 0), name
        assert res.zero_adv_frac == pytest.approx(2 / 3)
        assert res.n_degenerate_groups == 0
    # The float32 mean of seven 0.7s is off by an ulp; std normalisation must not blow that rounding
    # noise up into +-1 advantages on a group that has no spread at all.
    flat = torch.tensor([[0.7] * 7, [0.1] * 7, [2.1] * 7], dtype=torch.float32)
    assert (flat - flat.mean(dim=1, keepdim=True)).abs().max() > 0  # the rounding this guards against
    for name in ("rloo", "grpo", "grpo_std"):
        res = compute_advantages(name, flat)
        assert torch.all(res.advantages == 0), name
        assert res.zero_adv_frac == 1.0


@pytest.mark.parametrize("name", ["rloo", "grpo", "grpo_std"])
def test_group_estimators_zero_exactly_the_groups_without_signal(name):
    # the same test dynamic sampling filters on and the step metrics count: ties, NaNs and lone rewards
    gen = torch.Generator().manual_seed(0)
    # float32 0.7s and 0.1s: an equal group's mean is off by an ulp, so only the signal test zeroes it exactly
    rewards = torch.tensor([0.1, 0.7, 2.1])[torch.randint(0, 3, (400, 5), generator=gen)]
    rewards[torch.rand(400, 5, generator=gen) < 0.5] = math.nan
    rewards[:100, :] = rewards[:100, :1]  # equal groups
    signal = has_signal(rewards)
    assert 50 < int(signal.sum()) < 350  # both kinds of group are well represented
    adv = compute_advantages(name, rewards).advantages
    assert torch.all(adv[~signal] == 0)
    assert torch.all((adv[signal] != 0).any(dim=1))


@pytest.mark.parametrize("name", ["rloo", "grpo", "grpo_std"])
def test_group_estimators_need_k_at_least_2(name):
    with pytest.raises(ValueError, match=r"rloo\.k"):
        compute_advantages(name, torch.ones(3, 1))


def test_k_equal_1_is_fine_without_a_group_baseline():
    res = compute_advantages("reinforce", torch.tensor([[1.0], [2.0]]))
    assert res.advantages.tolist() == [[1.0], [2.0]]
    assert res.n_degenerate_groups == 2  # fewer than 2 samples per group, reported not refused


def test_the_table_is_the_one_list_of_estimators_and_its_names_load_without_torch():
    from rloo.settings.training import Estimator
    assert tuple(ESTIMATOR_TABLE) == names.ESTIMATORS
    assert typing.get_args(Estimator) == (*ESTIMATOR_TABLE, "ppo")  # the schema's enum
    code = "import sys, rloo.settings; print(sorted(m for m in sys.modules if m.split('.')[0] == 'torch'))"
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert res.stdout.strip() == "[]"  # the settings (and the config checks) read the names from source


def test_unknown_estimator_lists_valid_names():
    with pytest.raises(ValueError) as info:
        compute_advantages("ppo", torch.ones(2, 4))
    for name in ESTIMATOR_TABLE:
        assert name in str(info.value)


def test_bad_inputs():
    with pytest.raises(ValueError, match="inf"):
        rloo_advantages(torch.tensor([[1.0, float("inf")]]))
    with pytest.raises(ValueError, match="prompts, k"):
        rloo_advantages(torch.ones(4))
    with pytest.raises(ValueError, match="greedy_rewards"):
        compute_advantages("remax", torch.ones(2, 4))


def test_moving_average_sequence():
    r1 = torch.tensor([[1.0, 3.0]])
    r2 = torch.tensor([[4.0, 6.0]])
    adv1, b1 = moving_average_advantages(r1, None, decay=0.5)
    # First batch: centred on its own mean (2.0), which becomes the baseline.
    assert adv1.tolist() == [[-1.0, 1.0]] and b1 == 2.0
    adv2, b2 = moving_average_advantages(r2, b1, decay=0.5)
    # The baseline subtracted is the one from before this batch; then b <- 0.5 * 2 + 0.5 * 5.
    assert adv2.tolist() == [[2.0, 4.0]] and b2 == 3.5
    assert update_moving_baseline(3.5, torch.tensor([[float("nan")]]), 0.5) == 3.5

    state = MovingBaseline(decay=0.5)
    res1 = compute_advantages("moving_average", r1, state=state)
    res2 = compute_advantages("moving_average", r2, state=res1.state)
    assert res2.advantages.tolist() == [[2.0, 4.0]] and res2.state == MovingBaseline(3.5, 0.5)
    assert state.value is None  # states are values, never mutated in place


def test_remax():
    rewards = torch.tensor([[1.0, 0.0, float("nan")], [2.0, 2.0, 3.0], [1.0, 0.0, 1.0]])
    greedy = torch.tensor([0.5, 2.0, float("nan")])
    res = compute_advantages("remax", rewards, greedy_rewards=greedy)
    assert res.advantages.tolist() == [[0.5, -0.5, 0.0], [0.0, 0.0, 1.0], [0.0, 0.0, 0.0]]
    assert res.zero_adv_frac == pytest.approx(1 / 3)
    with pytest.raises(ValueError):
        remax_advantages(rewards, torch.zeros(2))
