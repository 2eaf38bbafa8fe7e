"""A training run's identity (rloo/train/identity.py), the one formula the stages and rloo.api resume by: a
bookkeeping key leaves it, any other key its stage reads (the one declaration, rloo.stages), the data, the
starting models' weights and the user's reward code change it. That an edit of the library's code changes
it and a comment does not, through a real `rloo train`: tests/e2e/test_crash_safety.py."""

from __future__ import annotations

from pathlib import Path

import pytest

from rloo.settings import Config, RewardConfig, RlooConfig, RolloutConfig, SftConfig
from rloo.stages import NOT_READ_BY_REWARD_MODEL, STAGES, stage_keys
from rloo.train.identity import BOOKKEEPING, bookkeeping, run_identity


def _folders(tmp_path: Path) -> tuple[Path, Path]:
    data, model = tmp_path / "data", tmp_path / "model"
    data.mkdir()
    model.mkdir()
    (data / "manifest.json").write_text('{"sha256": {"train": "a"}}')
    (model / "config.json").write_text('{"hidden_size": 64}')
    (model / "model.safetensors").write_bytes(b"\0" * 100)
    return data, model


def _rloo(**kw) -> Config:
    return Config(rloo=RlooConfig(**kw))


@pytest.mark.parametrize(("stage", "start", "same", "other"), [
    ("reward", Config(), Config(reward=RewardConfig(checkpoint_every=7, batch_size_score=7)),
     Config(reward=RewardConfig(lr=3e-7))),
    ("rloo", Config(), _rloo(eval_every=3, select="last", checkpoint_every=9), _rloo(lr=1e-3)),
    # under the constant schedule a run may be extended
    ("rloo", _rloo(lr_schedule="constant"), _rloo(lr_schedule="constant", steps=1000),
     _rloo(lr_schedule="constant", beta=0.5)),
    ("sft", Config(), Config(), Config(sft=SftConfig(checkpoint_every=7))),  # no bookkeeping: every key counts
])
def test_a_bookkeeping_key_keeps_the_identity_and_any_other_changes_it(tmp_path, stage, start, same, other):
    data, model = _folders(tmp_path)
    base = run_identity(start, stage, data_dir=data, model_dir=model)
    assert run_identity(same, stage, data_dir=data, model_dir=model) == base
    assert run_identity(other, stage, data_dir=data, model_dir=model) != base


def test_the_inputs_change_it(tmp_path):
    data, model = _folders(tmp_path)
    config = Config()
    base = run_identity(config, "rloo", data_dir=data, model_dir=model)
    (model / "model.safetensors").write_bytes(b"\0" * 101)  # other weights
    assert run_identity(config, "rloo", data_dir=data, model_dir=model) != base
    rows = [{"question": "q", "answer": "#### 1"}]
    assert run_identity(config, "sft", rows=rows) != run_identity(config, "sft", rows=[*rows, *rows])
    reward = tmp_path / "reward.py"
    reward.write_text("def f(completions, **kw): return [0.0] * len(completions)\n")
    with_code = run_identity(config, "rloo", data_dir=data, model_dir=model, reward_files=[reward])
    reward.write_text("def f(completions, **kw): return [1.0] * len(completions)\n")
    assert run_identity(config, "rloo", data_dir=data, model_dir=model, reward_files=[reward]) != with_code
    assert run_identity(config, "rloo", rows=rows, reward_names=["a"]) != run_identity(config, "rloo", rows=rows,
                                                                                      reward_names=["b"])


def test_the_keys_are_the_declarations():
    """The run reads what its stage declares: RLOO's rollout settings count (rollout.backend), the sampler's
    threads (excluded there) do not; the reward model's run does not read what scores RLOO's samples."""
    base = run_identity(Config(), "rloo")
    assert run_identity(Config(rollout=RolloutConfig(backend="vllm")), "rloo") != base
    assert run_identity(Config(rollout=RolloutConfig(sampler_threads=3)), "rloo") == base
    assert "rollout" in stage_keys(Config(), "rloo")[0]
    reward = run_identity(Config(), "reward")
    assert run_identity(Config(reward=RewardConfig(source="judge")), "reward") == reward
    assert set(NOT_READ_BY_REWARD_MODEL) <= set(STAGES["reward"].excluded)


def test_the_bookkeeping_keys_are_declared_once():
    """PPO's settings count for PPO's run alone (the declaration leaves them out of the others', as the
    rerun rules do); the step count is bookkeeping under the constant LR schedule only."""
    assert "rloo.ppo" in bookkeeping("rloo", Config()) and "rloo.ppo" not in bookkeeping("rloo", _rloo(estimator="ppo"))
    assert "rloo.steps" not in bookkeeping("rloo", _rloo(lr_schedule="cosine"))  # its schedule reads the step count
    # a bookkeeping key is one the stage reads (else it would be no part of the identity already)
    for stage, keys in BOOKKEEPING.items():
        read = stage_keys(Config(), stage)[0]
        assert all(any(k == r or k.startswith(r + ".") for r in read) for k in keys), stage
