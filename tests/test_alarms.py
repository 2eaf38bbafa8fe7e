"""Each alarm fires on a trajectory that shows its failure mode and stays silent on a healthy one."""

import numpy as np
import pytest

from rloo import alarms


def test_zero_signal():
    assert alarms.zero_signal(0.75) and not alarms.zero_signal(0.25) and not alarms.zero_signal(0.5)


def test_kl_without_reward():
    steps = np.arange(30)
    climbing_kl = list(0.1 + 0.1 * steps)
    flat_reward = [0.5 + 0.01 * ((-1) ** s) for s in steps]
    rising_reward = list(0.3 + 0.02 * steps)
    assert alarms.kl_without_reward(climbing_kl, flat_reward)
    assert not alarms.kl_without_reward(climbing_kl, rising_reward)  # KL bought reward: healthy
    assert not alarms.kl_without_reward(list(0.2 + 0.001 * steps), flat_reward)  # KL barely moves
    assert not alarms.kl_without_reward(climbing_kl[:10], flat_reward[:10])  # too early to tell


def test_length_climb():
    rng = np.random.default_rng(0)
    assert alarms.length_climb(list(30 + 2.0 * np.arange(20) + rng.normal(0, 0.3, 20)))
    assert not alarms.length_climb(list(30 + rng.normal(0, 2.0, 20)))
    assert not alarms.length_climb(list(30 - 1.0 * np.arange(20)))


@pytest.mark.parametrize(
    ("accuracy", "proxy", "n", "fires"),
    [
        # the embedded default's learned-reward run: the proxy climbs while accuracy collapses
        ([0.72, 0.65, 0.55, 0.45], [-1.0, -0.9, -0.7, -0.55], 500, True),
        # healthy: both rise
        ([0.72, 0.75, 0.77, 0.79], [0.72, 0.75, 0.77, 0.79], 500, False),
        # accuracy dips within noise (2 points on 500 problems)
        ([0.72, 0.75, 0.73], [-1.0, -0.9, -0.8], 500, False),
        # accuracy falls beyond noise but the proxy falls too: a bad update, not reward hacking
        ([0.72, 0.60], [-1.0, -1.2], 500, False),
        # the same drop on 20 problems is noise
        ([0.75, 0.60], [-1.0, -0.5], 20, False),
        ([0.72], [-1.0], 500, False),
    ],
)
def test_reward_hacking(accuracy, proxy, n, fires):
    assert alarms.reward_hacking(accuracy, proxy, n) is fires
