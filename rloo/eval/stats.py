"""The uncertainty of a comparison of two policies on the same problems: the maths, in one place.

Correctness arrays are 0/1 per problem (greedy: shape (n,)) or per problem and draw (sampled: (n, d)).
Every resampling function takes its number of resamples and a seed, so its result is a deterministic
function of its inputs. docs/statistics.md says which test answers which question, and why.
"""

from __future__ import annotations

from fractions import Fraction
from math import comb, exp, lgamma, log, sqrt
from statistics import NormalDist

import numpy as np

LEVEL = 0.95
Z95 = NormalDist().inv_cdf(0.5 + LEVEL / 2)  # 1.959964
# Resamples are drawn in blocks of this many, so memory stays small and the stream of random numbers
# (hence the result) does not depend on the problem count.
_BLOCK = 1000


def _per_draw(correct: np.ndarray) -> np.ndarray:
    """`correct` as an (n, draws) float array of 0/1 (a greedy (n,) array is one draw per problem)."""
    x = np.asarray(correct, dtype=float)
    x = x[:, None] if x.ndim == 1 else x
    if x.ndim != 2 or not np.isin(x, (0.0, 1.0)).all():
        raise ValueError("correctness must be 0/1 of shape (problems,) or (problems, draws)")
    return x


def paired_bootstrap(a: np.ndarray, b: np.ndarray, resamples: int, seed: int, resample_draws: bool = False,
                     level: float = LEVEL) -> tuple[float, float]:
    """Percentile interval of mean accuracy a − b over problems, by a paired bootstrap over problems.

    Each resample draws the problems with replacement, the same problems for a and b (the pairing),
    and takes the difference of their per-problem accuracies (the mean over each problem's draws).
    With `resample_draws` it also re-draws each drawn problem's draws with replacement, separately
    for a and b (for 0/1 draws exactly Binomial(d, k/d)): a per-problem mean already carries its draws'
    noise, so this counts that noise twice and over-covers (docs/statistics.md); it is off by default.
    """
    a, b = _per_draw(a), _per_draw(b)
    if len(a) != len(b) or len(a) == 0:
        raise ValueError(f"paired correctness needs the same problems on both sides, got {len(a)} and {len(b)}")
    rng = np.random.default_rng(seed)
    n, da, db = len(a), a.shape[1], b.shape[1]
    pa, pb = a.mean(axis=1), b.mean(axis=1)
    diffs = []
    for start in range(0, resamples, _BLOCK):
        idx = rng.integers(0, n, size=(min(_BLOCK, resamples - start), n))
        if resample_draws:
            ra, rb = rng.binomial(da, pa[idx]) / da, rng.binomial(db, pb[idx]) / db
        else:
            ra, rb = pa[idx], pb[idx]
        diffs.append((ra - rb).mean(axis=1))
    lo, hi = np.quantile(np.concatenate(diffs), [(1 - level) / 2, (1 + level) / 2])
    return float(lo), float(hi)


def mcnemar_exact(a: np.ndarray, b: np.ndarray) -> tuple[float, int, int]:
    """Exact McNemar test of paired 0/1 outcomes: two-sided binomial(n, 1/2) p-value on the discordant pairs.

    Returns (p, a right where b is wrong, b right where a is wrong); p = 1 without discordant pairs.
    """
    a, b = np.asarray(a, dtype=bool), np.asarray(b, dtype=bool)
    a_only, b_only = int((a & ~b).sum()), int((~a & b).sum())
    n, k = a_only + b_only, min(a_only, b_only)
    # P(X <= k) for X ~ Binomial(n, 1/2), doubled; exact integers so small p-values do not underflow.
    tail = Fraction(sum(comb(n, i) for i in range(k + 1)), 2**n)
    return float(min(Fraction(1), 2 * tail)), a_only, b_only


def sign_flip_test(diffs: np.ndarray, resamples: int, seed: int) -> float:
    """Two-sided paired permutation test of mean(diffs) = 0: each difference's sign flipped at random.

    p = (1 + flips with |sum| at least the observed) / (1 + resamples), never 0, valid at any count.
    """
    d = np.asarray(diffs, dtype=float)
    observed = abs(d.sum())
    # Sums of per-problem mean differences are exact multiples of 1/(da·db); the tolerance only
    # absorbs float rounding, so a flip that reproduces the observed sum counts as "at least".
    tol = 1e-9 * max(1.0, float(np.abs(d).sum()))
    rng = np.random.default_rng(seed)
    extreme = 0
    for start in range(0, resamples, _BLOCK):
        signs = rng.choice((-1.0, 1.0), size=(min(_BLOCK, resamples - start), len(d)))
        extreme += int((np.abs(signs @ d) >= observed - tol).sum())
    return (1 + extreme) / (1 + resamples)


def wilson_interval(successes: float, n: float, z: float = Z95) -> tuple[float, float] | None:
    """Wilson score interval of a proportion successes / n; None when n is 0.

    A win rate that counts a tie as half a win passes wins + ties / 2 as `successes`: a tie varies
    less than a win-or-loss trial, so the interval is, if anything, wider than it need be.
    """
    if n <= 0:
        return None
    p = successes / n
    denom = 1 + z * z / n
    centre = (p + z * z / (2 * n)) / denom
    half = z / denom * sqrt(p * (1 - p) / n + z * z / (4 * n * n))
    return max(0.0, centre - half), min(1.0, centre + half)


def _betacf(a: float, b: float, x: float) -> float:
    """The continued fraction of the regularized incomplete beta function (modified Lentz)."""
    tiny, qab, qap, qam = 1e-300, a + b, a + 1.0, a - 1.0
    c, d = 1.0, 1.0 - qab * x / qap
    d = 1.0 / (d if abs(d) > tiny else tiny)
    h = d
    for m in range(1, 300):
        m2 = 2 * m
        for aa in (m * (b - m) * x / ((qam + m2) * (a + m2)), -(a + m) * (qab + m) * x / ((a + m2) * (qap + m2))):
            d = 1.0 + aa * d
            d = 1.0 / (d if abs(d) > tiny else tiny)
            c = 1.0 + aa / c
            c = c if abs(c) > tiny else tiny
            h *= d * c
        if abs(d * c - 1.0) < 1e-15:
            break
    return h


def _incomplete_beta(a: float, b: float, x: float) -> float:
    if x <= 0.0:
        return 0.0
    if x >= 1.0:
        return 1.0
    front = exp(lgamma(a + b) - lgamma(a) - lgamma(b) + a * log(x) + b * log(1.0 - x))
    if x < (a + 1.0) / (a + b + 2.0):
        return front * _betacf(a, b, x) / a
    return 1.0 - front * _betacf(b, a, 1.0 - x) / b


def t_cdf(t: float, df: int) -> float:
    """Student's t distribution function with `df` degrees of freedom (numpy has none, and scipy is not
    a dependency): through the regularized incomplete beta function."""
    tail = 0.5 * _incomplete_beta(df / 2.0, 0.5, df / (df + t * t))
    return 1.0 - tail if t >= 0 else tail


def t_quantile(p: float, df: int) -> float:
    """The `p` quantile of Student's t with `df` degrees of freedom, by bisection on t_cdf."""
    if not 0.0 < p < 1.0 or df < 1:
        raise ValueError(f"t_quantile needs 0 < p < 1 and df >= 1, got p={p}, df={df}")
    lo, hi = -1e6, 1e6
    for _ in range(200):
        mid = (lo + hi) / 2
        if t_cdf(mid, df) < p:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


def t_interval(values, level: float = LEVEL) -> tuple[float, float] | None:
    """Interval of the mean of independent runs (one figure per seed): mean ± t_{n-1} · s / sqrt(n).

    Seeds are few (3 by default), so the t quantile, not the normal's 1.96, sets the width (4.30 at n = 3).
    None with fewer than two values (no spread to estimate)."""
    x = np.asarray(values, dtype=float)
    if x.ndim != 1 or len(x) < 2:
        return None
    mean, sd = float(x.mean()), float(x.std(ddof=1))
    half = t_quantile(0.5 + level / 2, len(x) - 1) * sd / sqrt(len(x))
    return mean - half, mean + half
