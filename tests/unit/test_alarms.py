"""Each alarm fires on a trajectory that shows its failure mode and stays silent on healthy ones: the
recorded runs of tests/data/trajectories (bench/alarms.py replays the same files) and constructed cases."""

import json
from pathlib import Path

import numpy as np
import pytest

from rloo.train import alarms
from rloo_workflow.config import load_config

ROOT = Path(__file__).resolve().parents[2]
RUNS = ROOT / "tests" / "data" / "trajectories"
INDEX = json.loads((RUNS / "index.json").read_text())
CFG = alarms.AlarmConfig.from_config(load_config(ROOT / "config" / "config.yaml")["rloo"]["alarms"])


def _history(name: str) -> list[dict]:
    return [json.loads(line) for line in (RUNS / f"{name}.jsonl").read_text().splitlines()]


def _hacking_steps(run: dict) -> list[int]:
    return alarms.hacking_steps(run["evals"], run["eval_answers"], CFG.hacking_z)


def test_the_default_config_uses_the_calibrated_thresholds():
    assert alarms.DEFAULTS == CFG  # config/config.yaml overrides none of the schema's thresholds
    assert alarms.AlarmConfig.from_config({"window": 7}).window == 7


@pytest.mark.parametrize("name", sorted(n for n, r in INDEX.items() if r["kind"] == "healthy"))
def test_silent_on_recorded_healthy_runs(name):
    fired = alarms.replay(_history(name), CFG, INDEX[name].get("not_applicable", []))
    assert fired == {a: [] for a in alarms.STEP_ALARMS}
    assert _hacking_steps(INDEX[name]) == []


FAILING = sorted(n for n, r in INDEX.items() if r["kind"] == "failing")


@pytest.mark.parametrize("name", [n for n in FAILING if not INDEX[n].get("known_miss")])
def test_fires_on_recorded_failing_runs(name):
    run, history = INDEX[name], _history(name)
    assert run["expect"] in alarms.ALARMS, f"{name}: a failing run names the alarm it must fire, or its known miss"
    steps = _hacking_steps(run) if run["expect"] == "reward_hacking" else alarms.replay(history, CFG)[run["expect"]]
    assert steps, f"{run['expect']} silent on {name}"
    assert steps[0] <= max(len(history), run["evals"][-1]["step"] if run["evals"] else 0)


def test_the_known_miss_is_missed_by_its_recorded_margin():
    """reward_model_seed0 (the learned-reward chain at seed 0) is a failing run reward_hacking misses:
    the accuracy drop at step 200 is 1.95 standard errors, short of hacking_z = 2. A one-sided 5 % margin
    would catch it; if the default changes so that it does, this test says to update the docs."""
    misses = {n: INDEX[n]["known_miss"] for n in FAILING if INDEX[n].get("known_miss")}
    assert set(misses) == {"reward_model_seed0"}
    run, miss = INDEX["reward_model_seed0"], misses["reward_model_seed0"]
    assert miss["alarm"] == "reward_hacking" and run["expect"] is None
    assert _hacking_steps(run) == []  # missed at the default margin
    n = run["eval_answers"]
    assert alarms.hacking_steps(run["evals"], n, 1.95) == []
    assert alarms.hacking_steps(run["evals"], n, 1.94) == [miss["step"]]  # the drop is 1.94-1.95 SE
    assert alarms.hacking_steps(run["evals"], n, 1.645) == [miss["step"]]


def test_length_climb_fires_on_its_constructed_run():
    """No measured run climbs in length: length_climb's failing run is a real micro RLOO run on a
    verbosity-biased judge (bench/alarms.py construct-length-climb), whose reward's mean cannot rise.
    The alarm fires on it; on the first 49 steps (under the window) it cannot."""
    run, history = INDEX["length_climb"], _history("length_climb")
    assert run["expect"] == "length_climb" and "constructed" in run["construction"]
    assert all(abs(h["train/reward_mean"] - 0.5) < 1e-6 for h in history)  # ranks average 1/2 in every group
    lengths = [h["train/response_length"] for h in history]
    assert np.mean(lengths[-25:]) > 1.5 * np.mean(lengths[:10])
    fired = alarms.replay(history, CFG)["length_climb"]
    assert fired and fired[0] == CFG.window
    assert alarms.replay(history[: CFG.window - 1], CFG)["length_climb"] == []


def _steps(n: int, **series) -> list[dict]:
    rng = np.random.default_rng(0)
    out = []
    for i in range(n):
        rec = {"step": i, "train/reward_mean": 0.6 + rng.normal(0, 0.1), "train/kl": 0.3 + rng.normal(0, 0.2),
               "train/zero_adv_frac": float(np.clip(0.45 + rng.normal(0, 0.12), 0, 1)),
               "train/response_length": 45 + rng.normal(0, 3)}
        for key, f in series.items():
            rec[f"train/{key}"] = f(i, rng)
        out.append(rec)
    return out


def test_constructed_healthy_run_is_silent():
    assert alarms.replay(_steps(400), CFG) == {a: [] for a in alarms.STEP_ALARMS}


def test_zero_signal_tests_the_window_not_one_batch():
    cfg = CFG
    # one batch with no signal at all, among healthy ones: silent
    shares = [0.45] * 49 + [1.0]
    assert not alarms.zero_signal(shares, cfg)
    # a window steadily above half by more than its noise: fires
    rng = np.random.default_rng(1)
    stuck = list(np.clip(0.7 + rng.normal(0, 0.12, 50), 0, 1))
    assert alarms.zero_signal(stuck, cfg)
    # the same level while falling (the policy is finding signal, the seed's healthy start): silent
    falling = list(np.clip(np.linspace(0.9, 0.55, 50) + rng.normal(0, 0.05, 50), 0, 1))
    assert not alarms.zero_signal(falling, cfg)
    # just above half, within noise: silent
    assert not alarms.zero_signal(list(np.clip(0.52 + rng.normal(0, 0.12, 50), 0, 1)), cfg)
    assert not alarms.zero_signal(stuck[:49], cfg)  # fewer steps than the window


def test_kl_without_reward_is_a_trend_against_the_reward():
    steps = np.arange(50)
    climbing_kl = list(0.1 + 0.05 * steps)
    rng = np.random.default_rng(2)
    flat_reward = list(0.5 + rng.normal(0, 0.1, 50))
    rising_reward = list(0.3 + 0.01 * steps + rng.normal(0, 0.1, 50))
    assert alarms.kl_without_reward(climbing_kl, flat_reward, CFG)
    assert not alarms.kl_without_reward(climbing_kl, rising_reward, CFG)  # KL bought reward: healthy
    assert not alarms.kl_without_reward(list(0.2 + 0.005 * steps), flat_reward, CFG)  # KL drifts 0.25 nats
    assert not alarms.kl_without_reward(climbing_kl[:49], flat_reward[:49], CFG)  # too early to tell
    # a missing reward (NaN step) is left out, not propagated
    holed = list(flat_reward)
    holed[3] = float("nan")
    assert alarms.kl_without_reward(climbing_kl, holed, CFG)


def test_length_climb():
    rng = np.random.default_rng(0)
    flat = list(0.6 + rng.normal(0, 0.1, 50))
    climbing = list(30 + 0.8 * np.arange(50) + rng.normal(0, 2.0, 50))
    assert alarms.length_climb(climbing, flat, CFG)
    assert not alarms.length_climb(list(30 + rng.normal(0, 2.0, 50)), flat, CFG)
    assert not alarms.length_climb(list(60 - 0.5 * np.arange(50)), flat, CFG)
    # longer answers that buy reward (longer reasoning that solves more): not the failure mode
    assert not alarms.length_climb(climbing, list(0.3 + 0.01 * np.arange(50) + rng.normal(0, 0.05, 50)), CFG)


def test_replay_matches_what_the_trainer_logs():
    """replay() is the trainer's computation: the flags it recomputes from a history are the ones a step
    would log with that history behind it."""
    history = _steps(120, kl=lambda i, rng: 0.1 + 0.03 * i)
    fired = alarms.replay(history, CFG)
    assert fired["kl_without_reward"] and fired["kl_without_reward"][0] == CFG.window
    for s in fired["kl_without_reward"]:
        assert alarms.step_flags(history[:s], CFG)["kl_without_reward"]


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


def test_zero_signal_is_not_ppos_alarm():
    """PPO's baseline is its critic: a group of equal rewards still has R - V advantages, and the share of
    such groups rises as its policy sharpens (the comparison run, above half from step 50). Its trainer
    does not check zero_signal; every group-baselined estimator does."""
    from rloo.train.ppo import PPOTrainer
    from rloo.train.rloo_trainer import RlooTrainer

    history = _history("comparison_ppo")
    assert alarms.replay(history, CFG)["zero_signal"]
    assert alarms.replay(history, CFG, PPOTrainer.alarms_not_applicable)["zero_signal"] == []
    assert PPOTrainer.alarms_not_applicable == ("zero_signal",) and RlooTrainer.alarms_not_applicable == ()


def test_sampling_mismatch_is_a_level_beyond_the_windows_noise():
    """The window's mean per-token KL(sampler || trainer) above `mismatch_kl` by z standard errors; the
    healthy level (the default's float32 sampler against its bf16-autocast trainer: 4.7e-5, sd 3.6e-5 a
    step) is below it, a T = 1.2 sampler's (2.8e-3, sd 9e-4) above."""
    t, rng = CFG.mismatch_kl, np.random.default_rng(3)
    assert not alarms.sampling_mismatch(list(np.abs(4.7e-5 + rng.normal(0, 3.6e-5, 50))), CFG)
    tempered = list(np.abs(2.8e-3 + rng.normal(0, 9e-4, 50)))
    assert alarms.sampling_mismatch(tempered, CFG)
    assert not alarms.sampling_mismatch(tempered[:49], CFG)  # fewer steps than the window
    assert not alarms.sampling_mismatch([4.7e-5] * 49 + [100 * t], CFG)  # one batch far off: not the window
    # a mean above the threshold within the window's noise: silent (mean 1.3 t, standard error 0.16 t)
    assert not alarms.sampling_mismatch([0.2 * t, 2.4 * t] * 25, CFG)
    # steps where the sampler reported no log-probabilities are left out; too few left: silent
    holed = list(tempered)
    holed[::3] = [float("nan")] * len(holed[::3])
    assert alarms.sampling_mismatch(holed, CFG)
    assert not alarms.sampling_mismatch([float("nan")] * 30 + tempered[:20], CFG)


def test_sampling_mismatch_replays_like_the_trainer_and_needs_the_metric():
    history = _steps(80, mismatch_k3_token=lambda i, rng: 0.02 + rng.normal(0, 1e-3))
    fired = alarms.replay(history, CFG)
    assert fired["sampling_mismatch"] == list(range(CFG.window, 81))
    assert all(v == [] for a, v in fired.items() if a != "sampling_mismatch")
    # a trajectory without the metric (recorded before it existed, or a sampler without log-probabilities)
    assert alarms.replay(_steps(80), CFG)["sampling_mismatch"] == []
    assert alarms.replay(history, CFG, ["sampling_mismatch"])["sampling_mismatch"] == []
