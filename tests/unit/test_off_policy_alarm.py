"""sampling_mismatch on recorded one-step off-policy runs of the embedded default (tests/data/trajectories:
offpolicy_t1 and offpolicy_t1.2, the mismatch measured every other step): it reads the mismatch at the
lagged weights, never the policy lag, and needs only a few measurements in its window."""

from test_alarms import CFG, INDEX, _history

from rloo.train import alarms


def _every(history: list[dict], n: int) -> list[dict]:
    """The run as if the mismatch had been measured every `n` steps only (rollout_correction.mismatch_every)."""
    return [h if h["step"] % n == 0 else {k: v for k, v in h.items() if k != "train/mismatch_k3_token"}
            for h in history]


def test_the_recorded_runs_are_off_policy_with_the_mismatch_measured_every_other_step():
    for name, kind in (("offpolicy_t1", "healthy"), ("offpolicy_t1.2", "failing")):
        assert INDEX[name]["kind"] == kind
        history = _history(name)
        assert [h["train/policy_lag"] for h in history] == [0] + [1] * (len(history) - 1)
        assert [h["step"] for h in history if "train/mismatch_k3_token" in h] == list(range(0, len(history), 2))


def test_silent_on_the_healthy_off_policy_run_and_on_its_sparser_measurements():
    history = _history("offpolicy_t1")
    for n in (1, 5, 10):  # every 2, 10 and 20 steps
        assert alarms.replay(_every(history, 2 * n), CFG)["sampling_mismatch"] == [], n


def test_fires_on_the_tempered_off_policy_sampler_from_a_few_measurements_a_window():
    history = _history("offpolicy_t1.2")
    assert alarms.replay(history, CFG)["sampling_mismatch"][0] == CFG.window
    sparse = _every(history, 10)  # 5 measurements a window: a synchronous run's rule wants 25
    assert alarms.replay(sparse, CFG)["sampling_mismatch"][0] == CFG.window
    as_synchronous = [{k: v for k, v in h.items() if k != "train/policy_lag"} for h in sparse]
    assert alarms.replay(as_synchronous, CFG)["sampling_mismatch"] == []


def test_a_lag_far_above_the_threshold_is_no_mismatch():
    """The whole ratio (train/offpolicy_*) holds the lag: a run whose weights move a hundred times further
    per step (its lag and whole ratio scaled up) has the same mismatch, and the alarm stays silent."""
    history = _history("offpolicy_t1")
    scaled = [{**h, **{k: 100 * h[k] for k in ("train/offpolicy_k3_token", "train/lag_k3_token") if k in h}}
              for h in history]
    window_means = [sum(h["train/offpolicy_k3_token"] for h in scaled[i : i + CFG.window]) / CFG.window
                    for i in range(len(scaled) - CFG.window + 1)]
    assert min(window_means) > 10 * CFG.mismatch_kl
    assert alarms.replay(scaled, CFG)["sampling_mismatch"] == []
    unmeasured = [{k: v for k, v in h.items() if k != "train/mismatch_k3_token"} for h in scaled]
    assert alarms.replay(unmeasured, CFG)["sampling_mismatch"] == []  # mismatch_every 0: off
