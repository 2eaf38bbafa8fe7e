"""rloo.eval.stats and rloo.eval.gains: hand-computed cases, and known-answer simulations of coverage and size."""

from math import comb

import numpy as np
import pytest

from rloo.eval import stats
from rloo.eval.gains import correctness, gain, win_rate_ci95
from rloo.eval.stats import mcnemar_exact, paired_bootstrap, sign_flip_test, wilson_interval


def _pairs(a_only: int, b_only: int, both: int, neither: int) -> tuple[np.ndarray, np.ndarray]:
    a = [1] * a_only + [0] * b_only + [1] * both + [0] * neither
    b = [0] * a_only + [1] * b_only + [1] * both + [0] * neither
    return np.array(a, bool), np.array(b, bool)


@pytest.mark.parametrize(("a_only", "b_only", "expected"), [
    (1, 6, 2 * (comb(7, 0) + comb(7, 1)) / 2**7),                 # 0.125
    (0, 5, 2 * comb(5, 0) / 2**5),                                # 0.0625
    (8, 2, 2 * (comb(10, 0) + comb(10, 1) + comb(10, 2)) / 2**10),  # 0.109375
    (3, 3, 1.0),                                                  # 2 x 42/64 > 1: capped
    (0, 0, 1.0),                                                  # no discordant pair
])
def test_mcnemar_is_the_two_sided_binomial_on_discordant_pairs(a_only, b_only, expected):
    # concordant pairs (both right, both wrong) must not move it
    p, got_a, got_b = mcnemar_exact(*_pairs(a_only, b_only, both=7, neither=4))
    assert (got_a, got_b) == (a_only, b_only)
    assert p == pytest.approx(expected, abs=1e-15)


@pytest.mark.parametrize(("successes", "n", "lo", "hi"), [
    # Newcombe (1998), Statistics in Medicine 17:857, Table I, method 3 (Wilson score, no correction)
    (81, 263, 0.2553, 0.3662), (15, 148, 0.0624, 0.1605), (0, 20, 0.0, 0.1611), (1, 29, 0.0061, 0.1718)])
def test_wilson_matches_the_textbook(successes, n, lo, hi):
    assert wilson_interval(successes, n) == pytest.approx((lo, hi), abs=5e-5)


def test_win_rate_interval_counts_a_tie_as_half_a_win():
    # 46 W, 12 L, 442 T: the rate is (46 + 221) / 500, and so is the Wilson interval's proportion
    detail = {"value": 0.534, "wins": 46.0, "losses": 12.0, "ties": 442.0, "invalid": 0}
    assert win_rate_ci95(detail) == pytest.approx(list(wilson_interval(267, 500)))
    lo, hi = win_rate_ci95(detail)
    assert lo < 0.534 < hi
    assert win_rate_ci95({"value": None, "wins": 0, "losses": 0, "ties": 0, "invalid": 3}) is None


@pytest.mark.parametrize("resample_draws", [False, True])
def test_bootstrap_of_a_constant_difference_has_zero_width(resample_draws):
    # every problem: policy right on all 4 draws, SFT on none -> a difference of exactly 1 everywhere
    a, b = np.ones((50, 4), bool), np.zeros((50, 4), bool)
    assert paired_bootstrap(a, b, 2000, seed=0, resample_draws=resample_draws) == (1.0, 1.0)
    same = np.tile(np.array([[1], [0]], bool), (25, 4))
    assert paired_bootstrap(same, same, 2000, seed=0) == (0.0, 0.0)


def test_bootstrap_is_deterministic_given_its_seed():
    rng = np.random.default_rng(1)
    a, b = rng.random((100, 4)) < 0.7, rng.random((100, 4)) < 0.6
    assert paired_bootstrap(a, b, 3000, seed=5) == paired_bootstrap(a, b, 3000, seed=5)
    assert paired_bootstrap(a, b, 3000, seed=5) != paired_bootstrap(a, b, 3000, seed=6)


def _experiment(rng: np.random.Generator, n: int, draws: int) -> tuple[np.ndarray, np.ndarray]:
    """Synthetic paired problems: SFT's chance p ~ Beta(1, 0.5) per problem, the policy's p + 0.2 (1 − p);
    the true gain over the population of problems is 0.2 x E[1 − p] = 0.2 / 3."""
    p = rng.beta(1.0, 0.5, n)
    q = p + 0.2 * (1 - p)
    return rng.random((n, draws)) < q[:, None], rng.random((n, draws)) < p[:, None]


TRUE_GAIN = 0.2 / 3


def test_bootstrap_interval_covers_the_true_gain_95_percent_of_the_time():
    # 800 experiments: the observed coverage has a standard error of 0.8 points around the true one
    rng = np.random.default_rng(2026)
    covered = 0
    for i in range(800):
        a, b = _experiment(rng, n=200, draws=4)
        lo, hi = paired_bootstrap(a, b, 1000, seed=i)
        covered += lo <= TRUE_GAIN <= hi
    assert 0.93 <= covered / 800 <= 0.97, covered / 800


def test_resampling_draws_as_well_widens_the_interval():
    # a problem's mean already carries its draws' noise: re-drawing them counts it twice (why it is off)
    a, b = _experiment(np.random.default_rng(3), n=300, draws=4)
    lo, hi = paired_bootstrap(a, b, 4000, seed=0)
    lo2, hi2 = paired_bootstrap(a, b, 4000, seed=0, resample_draws=True)
    assert (hi2 - lo2) > 1.1 * (hi - lo)


def test_sign_flip_p_value_by_hand_and_uniform_under_the_null():
    # five equal positive differences: exactly 2 of the 32 sign patterns reach |sum| = 5
    assert sign_flip_test(np.ones(5), 20000, seed=0) == pytest.approx(2 / 32, abs=0.006)
    assert sign_flip_test(np.zeros(7), 100, seed=0) == 1.0
    # no true difference: both policies share each problem's chance
    rng = np.random.default_rng(7)
    ps = []
    for i in range(300):
        p = rng.beta(1.0, 0.5, 200)
        a, b = rng.random((200, 4)) < p[:, None], rng.random((200, 4)) < p[:, None]
        ps.append(sign_flip_test(a.mean(1) - b.mean(1), 500, seed=i))
    ps = np.array(ps)
    assert 0.02 <= (ps <= 0.05).mean() <= 0.09
    for q in (0.25, 0.5, 0.75):  # the deciles of a uniform, within sampling error of 300 p-values
        assert abs((ps <= q).mean() - q) < 0.08, q


def test_gain_of_per_problem_completions():
    golds = ["#### 1", "#### 2", "#### 3", "#### 4"]
    policy = correctness({"greedy": ["#### 1", "#### 2", "#### 3", "#### 0"],
                          "draws": [["#### 1", "#### 1"], ["#### 2", "#### 0"], ["#### 3", "#### 3"], ["#### 0", "#### 4"]]},
                         golds)
    sft = correctness({"greedy": ["#### 1", "#### 0", "#### 0", "#### 0"],
                       "draws": [["#### 1", "#### 0"], ["#### 0", "#### 0"], ["#### 3", "#### 0"], ["#### 0", "#### 0"]]},
                      golds)
    assert policy["sampled"].shape == (4, 2)
    g = gain(policy, sft, seed=0, resamples=2000)
    assert g["sampled"]["gain"] == pytest.approx(6 / 8 - 2 / 8)
    assert g["greedy"]["gain"] == pytest.approx(0.5)
    assert g["greedy"]["discordant"] == {"policy_only": 2, "sft_only": 0}
    assert g["greedy"]["p_value"] == pytest.approx(0.5)  # 2 x (1/2)^2
    lo, hi = g["sampled"]["ci95"]
    assert lo <= g["sampled"]["gain"] <= hi
    assert (g["n_problems"], g["draws"], g["bootstrap"]) == (4, 2, {"resamples": 2000, "seed": 0, "resampled": "problems"})


def test_summary_line_and_mlflow_metrics_of_a_gain():
    from rloo.eval.report import gain_line
    from rloo_workflow.tracking.stage import gain_metrics

    g = {"sampled": {"gain": 0.066, "ci95": [0.041, 0.0912], "p_value": 0.0001},
         "greedy": {"gain": 0.05, "ci95": [0.02, 0.08], "p_value": 0.0123}, "n_problems": 500, "draws": 4}
    assert gain_line("rloo", g) == ("RLOO − SFT = +6.6 [+4.1, +9.1] points (p < 0.001) sampled (4 draws); "
                                    "+5.0 [+2.0, +8.0] points (p = 0.012) greedy; 500 problems, 95 % paired bootstrap")
    assert gain_metrics({"rloo": g}) == {
        "gain/sampled": 0.066, "gain/sampled_ci95_lo": 0.041, "gain/sampled_ci95_hi": 0.0912, "gain/sampled_p_value": 0.0001,
        "gain/greedy": 0.05, "gain/greedy_ci95_lo": 0.02, "gain/greedy_ci95_hi": 0.08, "gain/greedy_p_value": 0.0123}
    assert "gain/grpo/sampled_ci95_lo" in gain_metrics({"rloo": g, "grpo": g})


def test_t_quantile_matches_tables():
    # Student's t, two-sided 95 %: the values every table prints
    for df, q in ((1, 12.7062), (2, 4.3027), (4, 2.7764), (10, 2.2281), (30, 2.0423)):
        assert abs(stats.t_quantile(0.975, df) - q) < 5e-4, df
    assert abs(stats.t_quantile(0.025, 3) + stats.t_quantile(0.975, 3)) < 1e-9  # symmetric
    assert abs(stats.t_cdf(0.0, 5) - 0.5) < 1e-12


def test_t_interval_of_a_mean_across_seeds():
    values = [0.02, 0.05, 0.08]
    lo, hi = stats.t_interval(values)
    mean, sd = 0.05, 0.03  # sample sd (ddof 1)
    half = 4.302653 * sd / 3**0.5
    assert abs(lo - (mean - half)) < 1e-6 and abs(hi - (mean + half)) < 1e-6
    assert stats.t_interval([0.1]) is None  # one seed: no spread to estimate
