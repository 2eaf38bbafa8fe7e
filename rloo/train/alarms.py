"""The seed's failure modes as running checks over the per-step metrics.

Each check is a test over a window of steps, never a single batch: a level beyond the noise of the
window's mean, and the trend the seed names (a zero-signal share that is not falling, a KL that climbs
while the reward does not, a length that climbs while the reward does not), or a level alone where the
healthy figure does not drift (the sampler-trainer mismatch). Their thresholds
(`rloo.alarms`) were chosen from measured healthy and failing runs: docs/failure-modes.md, bench/alarms.py.
The trainer logs the flags as `alarm/*` metrics and warns the first time each one fires.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence

import numpy as np

from rloo.settings import AlarmConfig

DEFAULTS = AlarmConfig()


def _mean_se(values: np.ndarray) -> tuple[float, float]:
    """Mean and its standard error (0 for a single value or a constant run; NaN for none)."""
    n = len(values)
    if n == 0:
        return math.nan, math.nan
    sd = float(values.std(ddof=1)) if n > 1 else 0.0
    return float(values.mean()), sd / math.sqrt(n)


def _change(before: np.ndarray, after: np.ndarray) -> tuple[float, float]:
    """Difference of two blocks' means and its standard error (Welch)."""
    (a, sa), (b, sb) = _mean_se(before), _mean_se(after)
    return b - a, math.hypot(sa, sb)


def _finite(values: np.ndarray) -> np.ndarray:
    return values[np.isfinite(values)]  # a step whose rewards were all missing has a NaN mean


def _not_rising(before: np.ndarray, after: np.ndarray, z: float) -> bool:
    """The reward did not rise from one block to the next by `z` standard errors (NaN steps left out)."""
    gain, se = _change(_finite(before), _finite(after))
    return gain <= z * se


def _tail(values: Sequence[float], n: int) -> np.ndarray | None:
    return np.asarray(values[-n:], dtype=float) if len(values) >= n else None


def zero_signal(shares: Sequence[float], cfg: AlarmConfig = DEFAULTS) -> bool:
    """Most groups carry no signal: the window's mean share of groups with k equal rewards exceeds
    `zero_signal_share` by `z` standard errors, and the share is not falling from the window's first half
    to its second by `z` standard errors (the seed's healthy run falls early, as the policy finds prompts
    it can sometimes solve)."""
    s = _tail(shares, cfg.window)
    if s is None:
        return False
    mean, se = _mean_se(s)
    half = len(s) // 2
    change, change_se = _change(s[:half], s[half:]) if half else (0.0, 0.0)
    return mean - cfg.z * se > cfg.zero_signal_share and change >= -cfg.z * change_se


def kl_without_reward(kl: Sequence[float], reward: Sequence[float], cfg: AlarmConfig = DEFAULTS) -> bool:
    """KL to the reference climbs while the reward does not: from the window's first half to its second,
    the mean KL rose by more than `kl_rise` nats and the mean reward did not rise by `z` standard errors
    (healthy: KL grows in step with the reward, sublinearly)."""
    k, r = _tail(kl, cfg.window), _tail(reward, cfg.window)
    if k is None or r is None or cfg.window < 4:
        return False
    half = cfg.window // 2
    return float(k[half:].mean() - k[:half].mean()) > cfg.kl_rise and _not_rising(r[:half], r[half:], cfg.z)


def length_climb(lengths: Sequence[float], reward: Sequence[float], cfg: AlarmConfig = DEFAULTS,
                 blocks: int = 4) -> bool:
    """The mean response length climbs while the reward does not: it rises across `blocks` consecutive
    blocks of the window, the last block is longer than the first by `length_rise` of it and by `z`
    standard errors, and the reward's last block is not above its first by `z` standard errors."""
    lens, rew = _tail(lengths, cfg.window), _tail(reward, cfg.window)
    if lens is None or rew is None or cfg.window < 2 * blocks:
        return False
    parts = np.array_split(lens, blocks)
    means = [float(p.mean()) for p in parts]
    rise, se = _change(parts[0], parts[-1])
    r_parts = np.array_split(rew, blocks)
    return (all(b > a for a, b in itertools.pairwise(means)) and rise > cfg.length_rise * means[0]
            and rise > cfg.z * se and _not_rising(r_parts[0], r_parts[-1], cfg.z))


# Off-policy, the mismatch is measured every rloo.rollout_correction.mismatch_every steps only: the alarm
# needs this many measurements in its window (a synchronous run, half the window).
MIN_MEASURED = 3


def sampling_mismatch(kl_per_token: Sequence[float], cfg: AlarmConfig = DEFAULTS, sparse: bool = False) -> bool:
    """The samples do not come from the policy the loss differentiates: the window's mean per-token
    KL(sampler || trainer) (`train/mismatch_k3_token`, docs/rollout-correction.md) exceeds `mismatch_kl` by
    `z` standard errors. A level alone, no trend: the healthy figure is rounding noise that does not drift
    with training, and a sampler at another temperature is off from its first step. Steps without the
    sampler's log-probabilities (NaN) are left out; silent while fewer than half the window has them, or
    with `sparse` (an off-policy run, which measures the mismatch every few steps) fewer than MIN_MEASURED."""
    s = _tail(kl_per_token, cfg.window)
    if s is None:
        return False
    s = _finite(s)
    if len(s) < (MIN_MEASURED if sparse else 2) or (not sparse and 2 * len(s) < cfg.window):
        return False
    mean, se = _mean_se(s)
    return mean - cfg.z * se > cfg.mismatch_kl


def reward_hacking(accuracy: list[float], proxy: list[float], n: int, z: float = DEFAULTS.hacking_z) -> bool:
    """The proxy reward rose while held-out accuracy fell beyond noise.

    Compared with the evaluation of best accuracy before it, the latest one is less accurate by more
    than `z` standard errors of a difference of two proportions over `n` graded answers each, and its
    proxy reward (the training reward's mean on the same completions) is higher.
    """
    if len(accuracy) < 2 or n < 1:
        return False
    best = int(np.argmax(accuracy[:-1]))
    a, b = accuracy[best], accuracy[-1]
    se = math.sqrt((a * (1 - a) + b * (1 - b)) / n)
    return a - b > z * max(se, 1e-12) and proxy[-1] > proxy[best]


def hacking_steps(evals: Sequence[dict], n: int, z: float = DEFAULTS.hacking_z) -> list[int]:
    """The evaluations (their steps) at which reward_hacking holds, recomputed from a run's recorded
    evaluations ({"step", "eval/accuracy_sampled", "eval/proxy_reward"}) as the stage computes it."""
    acc = [e["eval/accuracy_sampled"] for e in evals]
    proxy = [e["eval/proxy_reward"] for e in evals]
    return [e["step"] for i, e in enumerate(evals) if reward_hacking(acc[: i + 1], proxy[: i + 1], n, z)]


# read from the per-step metrics; reward_hacking from the validation evaluations
STEP_ALARMS = ("zero_signal", "kl_without_reward", "length_climb", "sampling_mismatch")
ALARMS = (*STEP_ALARMS, "reward_hacking")


def step_flags(history: Sequence[dict], cfg: AlarmConfig = DEFAULTS, skip: Sequence[str] = ()) -> dict[str, bool]:
    """The per-step alarms after the last record of `history` (the steps so far, oldest first); those in
    `skip` (not applicable to the estimator) stay False."""
    def series(key: str, optional: bool = False) -> list[float]:
        # optional: NaN where a step lacks the key (a sampler that reports no log-probabilities logs no
        # mismatch, and trajectories recorded before the mismatch metrics have none)
        return [h.get(key, math.nan) if optional else h[key] for h in history[-cfg.window:]]

    reward = series("train/reward_mean")
    # An off-policy run (it logs its policy lag) measures the mismatch alone every mismatch_every steps.
    sparse = any("train/policy_lag" in h for h in history[-cfg.window:])
    return {
        "zero_signal": "zero_signal" not in skip and zero_signal(series("train/zero_adv_frac"), cfg),
        "kl_without_reward": "kl_without_reward" not in skip and kl_without_reward(series("train/kl"), reward, cfg),
        "length_climb": "length_climb" not in skip and length_climb(series("train/response_length"), reward, cfg),
        "sampling_mismatch": "sampling_mismatch" not in skip and sampling_mismatch(
            series("train/mismatch_k3_token", optional=True), cfg, sparse),
    }


def replay(history: Sequence[dict], cfg: AlarmConfig = DEFAULTS, skip: Sequence[str] = ()) -> dict[str, list[int]]:
    """Every step (counted from 1) at which each per-step alarm holds, recomputed from a recorded
    trajectory (a stage's steps.jsonl) as the trainer computes it while training."""
    out: dict[str, list[int]] = {name: [] for name in STEP_ALARMS}
    for i in range(len(history)):
        for name, on in step_flags(history[: i + 1], cfg, skip).items():
            if on:
                out[name].append(history[i]["step"] + 1)
    return out


def first_alarms(history: list[dict]) -> dict[str, int | None]:
    """For each alarm, the step (counted from 1, like `steps_trained`) at which it first fired; None: never."""
    out: dict[str, int | None] = dict.fromkeys(ALARMS)
    for rec in history:
        for name in ALARMS:
            if out[name] is None and rec.get(f"alarm/{name}"):
                out[name] = rec["step"] + 1
    return out
