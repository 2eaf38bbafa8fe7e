"""The article's failure modes as running checks over the per-step metrics.

Each check returns True while its condition holds; the trainer logs the flags as `alarm/*` metrics
and warns the first time each one fires.
"""

from __future__ import annotations

import itertools
import math

import numpy as np


def _slope(values: list[float]) -> float:
    if len(values) < 2:
        return 0.0
    x = np.arange(len(values), dtype=float)
    return float(np.polyfit(x, np.asarray(values, dtype=float), 1)[0])


def zero_signal(zero_adv_frac: float, threshold: float = 0.5) -> bool:
    """More than half of the groups carry no learning signal (all k rewards equal)."""
    return zero_adv_frac > threshold


def kl_without_reward(kl: list[float], reward: list[float], window: int = 20) -> bool:
    """KL to the reference climbs over the last `window` steps while the reward does not."""
    if len(kl) < window:
        return False
    k, r = kl[-window:], reward[-window:]
    kl_rise = _slope(k) * window
    return kl_rise > max(0.5, 0.5 * abs(float(np.mean(k)))) and _slope(r) <= 0.0


def length_climb(lengths: list[float], window: int = 20, chunks: int = 4) -> bool:
    """Mean response length rises monotonically across `chunks` consecutive blocks of the window."""
    if len(lengths) < window:
        return False
    means = [float(np.mean(c)) for c in np.array_split(np.asarray(lengths[-window:]), chunks)]
    return all(b > a * 1.02 for a, b in itertools.pairwise(means))


def reward_hacking(accuracy: list[float], proxy: list[float], n: int, z: float = 2.0) -> bool:
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


ALARMS = ("zero_signal", "kl_without_reward", "length_climb", "reward_hacking")


def first_alarms(history: list[dict]) -> dict[str, int | None]:
    """For each alarm, the step (counted from 1, like `steps_trained`) at which it first fired; None: never."""
    out: dict[str, int | None] = dict.fromkeys(ALARMS)
    for rec in history:
        for name in ALARMS:
            if out[name] is None and rec.get(f"alarm/{name}"):
                out[name] = rec["step"] + 1
    return out
