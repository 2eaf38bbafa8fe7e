"""Dynamic sampling (`rloo.dynamic_sampling`): only groups whose rewards differ are trained on, the
batch is refilled from further prompts within a bound, and all of it is a function of (seed, step)."""

import json
import math
import shutil
import zlib

import numpy as np
import pytest
import torch

from rloo.algo.estimators import has_signal
from rloo.io import read_jsonl
from rloo.model import checkpoint, models
from rloo.rollout import collect
from rloo.rollout.collect import prompt_indices
from rloo.train.rloo_trainer import RlooTrainer
from rloo_workflow.stages import rloo as rloo_stage


def _cfg(micro_run, **rloo):
    cfg = json.loads(json.dumps(micro_run["cfg"]))
    cfg["reward"]["source"] = "verifier"
    cfg["rloo"].update({"k": 4, "prompts_per_step": 4, "lr": 1e-3, "dynamic_sampling": True, **rloo})
    return cfg


def _rows(micro_run):
    return [r for _, r in read_jsonl(micro_run["data"] / "train.jsonl")]


def _pays(prompt: str) -> bool:
    return zlib.crc32(prompt.encode()) % 3 == 0


class ScriptedReward:
    """Pays by a deterministic rule: on about a third of the prompts the completion's length parity
    (spread within most of their groups), 0 on the rest (groups without signal)."""

    name = "scripted"

    def __init__(self, pays=_pays):
        self.pays, self.calls = pays, 0

    def score(self, prompts, completions, golds, finished):
        self.calls += 1
        return torch.tensor([float(len(c) % 2) if self.pays(p) else 0.0 for p, c in zip(prompts, completions, strict=True)])


def _spread(scores: torch.Tensor, k: int) -> list[bool]:
    """Per group, by hand: at least two finite rewards that differ."""
    out = []
    for g in scores.view(-1, k).tolist():
        finite = [x for x in g if math.isfinite(x)]
        out.append(len(finite) >= 2 and max(finite) > min(finite))
    return out


def test_signal_test_reads_raw_rewards_and_treats_nan_as_missing():
    nan = math.nan
    scores = torch.tensor([[1.0, nan, nan], [1.0, 1.0, 1.0], [nan, nan, nan], [0.0, 1.0, nan], [0.0, 0.0, 0.5]])
    assert has_signal(scores).tolist() == [False, False, False, True, True]


def test_refill_prompts_skip_those_drawn_and_follow_seed_step_round():
    drawn = np.array([0, 2, 4, 6, 8, 9])
    got = collect.refill_indices(10, 3, 1, 0, drawn, 10)
    assert sorted(got.tolist()) == [1, 3, 5, 7]
    assert collect.refill_indices(10, 3, 1, 0, drawn, 2).tolist() == got[:2].tolist()
    orders = {tuple(collect.refill_indices(60, s, r, 0, drawn, 60).tolist()) for s, r in [(3, 1), (3, 2), (4, 1)]}
    assert len(orders) == 3 and orders == {tuple(collect.refill_indices(60, s, r, 0, drawn, 60).tolist())
                                           for s, r in [(3, 1), (3, 2), (4, 1)]}


def _fake_draws(k, pays):
    """A sampler whose rows carry their prompt index, and a reward with spread on the prompts `pays`."""
    def sample(idx, round_):
        ids = torch.tensor([[i] for i in idx for _ in range(k)])
        done = torch.ones(len(ids), dtype=torch.bool)
        return collect.Rollout(ids, torch.ones_like(ids), ids.clone(), done[:, None], done)

    def score(idx, ro):
        return torch.tensor([float(j % 2) if i in pays else 0.0 for i in idx for j in range(k)])
    return sample, score


def test_gather_stops_when_the_prompts_run_out_and_keeps_rows_aligned():
    k = 2
    kw = {"k": k, "n_prompts": 6, "seed": 0, "step": 0, "pad_id": 0, "dynamic": True, "max_rounds": 4}
    first = np.array([0, 1])
    got = collect.gather(first, *_fake_draws(k, pays=set()), **kw)  # no signal anywhere: 3 rounds use all 6
    assert got.stats["train/dynamic_rounds"] == 2 and got.stats["train/extra_samples"] == 4 * k
    assert got.idx.tolist() == [0, 1]
    got = collect.gather(first, *_fake_draws(k, pays={1, 3, 4, 5}), **kw)
    assert len(got.idx) == 2 and set(got.idx.tolist()) <= {1, 3, 4, 5} and got.idx[0] == 1
    assert got.rollout.prompt_ids[:, 0].tolist() == [i for i in got.idx.tolist() for _ in range(k)]
    assert got.scores.tolist() == [0.0, 1.0] * 2


def test_only_groups_with_spread_are_trained_and_refills_are_counted(micro_run):
    k, b = 4, 4
    reward = ScriptedReward()
    trainer = RlooTrainer(_cfg(micro_run), micro_run["sft"], reward, _rows(micro_run))
    plain = RlooTrainer(_cfg(micro_run, dynamic_sampling=False), micro_run["sft"], ScriptedReward(), _rows(micro_run))
    refilled = 0
    for step in range(4):
        got = trainer.collect(step)
        assert len(got.idx) == b and len(set(got.idx.tolist())) == b and all(_spread(got.scores, k))
        # rows, prompts and scores stay aligned through the selection and the joining of rounds
        assert torch.equal(trainer._score(got.idx, got.rollout, k)[0], got.scores)
        # round 0 is today's batch: its groups with signal are kept as sampled, in order, first
        old = plain.collect(step)
        first = [g for g, s in enumerate(_spread(old.scores, k)) if s]
        assert got.idx[: len(first)].tolist() == old.idx[first].tolist()
        rows = collect.group_rows(torch.tensor(first, dtype=torch.long), k)
        ro, ref = got.rollout, old.rollout.select(rows)
        for j in range(len(rows)):
            n = int(ref.lengths[j])
            assert int(ro.lengths[j]) == n and torch.equal(ro.completions[j, :n], ref.completions[j, :n])
        s = got.stats
        assert s["train/dynamic_dropped_frac"] > 0 and s["train/dynamic_groups"] == b
        assert s["train/extra_samples"] % k == 0 and s["train/extra_samples"] > 0
        assert 1 <= s["train/dynamic_rounds"] <= trainer.rc.dynamic_sampling_max_rounds
        refilled += s["train/dynamic_rounds"]
    assert refilled > 0
    m = trainer.step(4)
    assert m["train/zero_adv_frac"] == 0.0 and m["alarm/zero_signal"] == 0 and m["train/grad_norm"] > 0.0
    assert plain.step(4)["train/zero_adv_frac"] > 0.0 and "train/dynamic_rounds" not in plain.step(5)


def test_kept_prompts_and_tokens_depend_only_on_seed_and_step(micro_run):
    a = RlooTrainer(_cfg(micro_run), micro_run["sft"], ScriptedReward(), _rows(micro_run))
    b = RlooTrainer(_cfg(micro_run), micro_run["sft"], ScriptedReward(), _rows(micro_run))
    for step in (0, 7):
        x, y, z = a.collect(step), b.collect(step), a.collect(step)
        for other in (y, z):
            assert x.idx.tolist() == other.idx.tolist() and x.stats == other.stats
            for f in ("prompt_ids", "prompt_mask", "completions", "completion_mask", "finished"):
                assert torch.equal(getattr(x.rollout, f), getattr(other.rollout, f)), f
            assert torch.equal(x.scores, other.scores)
    assert a.collect(0).idx.tolist() != a.collect(7).idx.tolist()


def test_rounds_are_bounded_and_no_signal_trains_on_the_first_batch(micro_run):
    k, b, rounds = 4, 4, 2
    flat = ScriptedReward(pays=lambda p: False)  # 0 everywhere: no group has signal
    # a window of one step, so that this step's share decides zero_signal (the default reads 50 steps)
    trainer = RlooTrainer(_cfg(micro_run, dynamic_sampling_max_rounds=rounds, alarms={"window": 1}),
                            micro_run["sft"], flat, _rows(micro_run))
    plain = RlooTrainer(_cfg(micro_run, dynamic_sampling=False), micro_run["sft"], flat, _rows(micro_run))
    flat.calls = 0
    got = trainer.collect(0)
    assert flat.calls == 1 + rounds
    assert got.stats == {"train/dynamic_dropped_frac": 1.0, "train/extra_samples": rounds * b * k,
                         "train/dynamic_rounds": rounds, "train/dynamic_groups": b}
    old = plain.collect(0)
    assert got.idx.tolist() == old.idx.tolist() and torch.equal(got.rollout.completions, old.rollout.completions)
    m = trainer.step(0)
    assert m["train/zero_adv_frac"] == 1.0 and m["alarm/zero_signal"] == 1 and math.isfinite(m["train/loss"])


@pytest.mark.parametrize("estimator", ["rloo", "remax"])
def test_short_of_signal_trains_on_the_groups_found(micro_run, estimator):
    rows = _rows(micro_run)
    cfg = _cfg(micro_run, estimator=estimator, dynamic_sampling_max_rounds=2)
    lone = rows[int(prompt_indices(len(rows), 0, 4, cfg["seed"])[2])]["question"]
    reward = ScriptedReward(pays=lambda p: lone in p)  # one prompt of step 0 has signal, no other prompt
    trainer = RlooTrainer(cfg, micro_run["sft"], reward, rows)
    got = trainer.collect(0)
    if not all(_spread(got.scores, 4)) or len(got.idx) != 1:
        pytest.fail(f"expected the one group with signal, got {got.idx} {got.scores}")
    assert got.stats["train/dynamic_groups"] == 1 and got.stats["train/dynamic_rounds"] == 2
    assert got.stats["train/dynamic_dropped_frac"] == pytest.approx(1 - 1 / 12)  # 4 + 4 + 4 groups drawn
    m = trainer.step(0)
    assert m["train/zero_adv_frac"] == 0.0 and m["train/grad_norm"] > 0.0 and math.isfinite(m["train/loss"])


def test_dynamic_sampling_needs_two_samples_per_prompt(micro_run):
    with pytest.raises(ValueError, match=r"rloo.dynamic_sampling .* k >= 2"):
        RlooTrainer(_cfg(micro_run, k=1, estimator="reinforce"), micro_run["sft"], ScriptedReward(), _rows(micro_run))


def test_run_with_dynamic_sampling_resumes_bit_identically(micro_run, tmp_path, monkeypatch):
    monkeypatch.setattr(rloo_stage, "build_reward", lambda cfg, reward_model_dir=None: ScriptedReward())
    cfg = _cfg(micro_run, steps=4, checkpoint_every=2, eval_every=2, eval_examples=4, select="last", stop_on=[])

    def run(out, work):
        return rloo_stage.run(cfg, micro_run["data"], micro_run["sft"], tmp_path / out, tmp_path / work)

    run("full", "w_full")
    steps = (tmp_path / "full" / "steps.jsonl").read_text().splitlines()
    records = [json.loads(s) for s in steps]
    assert len(steps) == 4 and all(r["train/zero_adv_frac"] == 0.0 for r in records)
    assert sum(r["train/dynamic_rounds"] for r in records[2:]) > 0  # the resumed steps refill too
    # the samples counted and timed include the refills: B * k per step is fewer than were drawn
    base = cfg["rloo"]["prompts_per_step"] * cfg["rloo"]["k"]
    drawn = sum(base + r["train/extra_samples"] for r in records)
    assert drawn > 4 * base
    assert json.loads((tmp_path / "full" / "metrics.json").read_text())["samples_generated"] == drawn
    t = json.loads((tmp_path / "w_full" / "timings.json").read_text())
    assert t["samples_per_second"] == pytest.approx(drawn / t["train_seconds"], rel=1e-2)
    ck = checkpoint.latest(tmp_path / "w_full" / "checkpoints")
    assert ck is not None and ck.name == "step_00000002"
    shutil.copytree(ck, tmp_path / "w_dead" / "checkpoints" / ck.name)
    assert run("resumed", "w_dead")["resumed_from_step"] == 2
    a = models.load_causal_lm(tmp_path / "full").state_dict()
    b = models.load_causal_lm(tmp_path / "resumed").state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    again = (tmp_path / "resumed" / "steps.jsonl").read_text().splitlines()
    assert [s.split('"time/')[0] for s in again] == [s.split('"time/')[0] for s in steps]
