"""A job's identity (rloo/identity.py), the one function Snakemake's rerun param, the work folder, every
checkpoint and rloo.api resume by: a bookkeeping key changes the rerun digest and leaves the resume one, any
other key its stage reads (the one declaration, rloo.stages), an upstream identity and the code change both;
an input folder is known by the identity recorded in it, else by its content (the weights, not their size);
a work folder of another identity is refused, or cleared under Snakemake. That an edit of the library's code
changes it and a comment does not, through a real `rloo train`: tests/e2e/test_crash_safety.py."""

from __future__ import annotations

import json

import pytest

from rloo.code_fingerprint import Fingerprint
from rloo.errors import InputError
from rloo.identity import IDENTITY_FILE, bookkeeping, claim_work, folder_identity, job_identity
from rloo.settings import Config, RewardConfig, RlooConfig, RolloutConfig, SftConfig
from rloo.stages import NOT_READ_BY_REWARD_MODEL, STAGES, stage_keys

CODE = Fingerprint("any", "c0de", {})  # the code walk is tested elsewhere (test_code_fingerprint.py)


def _id(config: Config, stage: str, code: Fingerprint = CODE, **upstream: str):
    return job_identity(config, stage, upstream=upstream, code=code)


def _rloo(**kw) -> Config:
    return Config(rloo=RlooConfig(**kw))


@pytest.mark.parametrize(("stage", "start", "same", "other"), [
    ("reward", Config(), Config(reward=RewardConfig(checkpoint_every=7)), Config(reward=RewardConfig(lr=3e-7))),
    ("rloo", Config(), _rloo(eval_every=3, select="last", checkpoint_every=9), _rloo(lr=1e-3)),
    # under the constant schedule a run may be extended
    ("rloo", _rloo(lr_schedule="constant"), _rloo(lr_schedule="constant", steps=1000),
     _rloo(lr_schedule="constant", beta=0.5)),
    ("sft", Config(), Config(), Config(sft=SftConfig(checkpoint_every=7))),  # no bookkeeping: every key counts
])
def test_a_bookkeeping_key_reruns_and_resumes_and_any_other_changes_both(stage, start, same, other):
    base = _id(start, stage)
    assert _id(same, stage).resume == base.resume
    assert (_id(same, stage).rerun == base.rerun) == (same == start)
    assert _id(other, stage).resume != base.resume and _id(other, stage).rerun != base.rerun
    assert "keys" in _id(other, stage).changed(base.parts)


def test_upstream_code_and_user_files_change_it(tmp_path):
    config = Config()
    base = _id(config, "rloo", policy="a")
    assert _id(config, "rloo", policy="b").resume != base.resume
    assert _id(config, "rloo", policy="b").changed(base.parts) == "upstream policy"
    other_code = _id(config, "rloo", Fingerprint("any", "c0de2", {}), policy="a")
    assert other_code.resume != base.resume and other_code.changed(base.parts) == "code"
    reward = tmp_path / "reward.py"
    reward.write_text("def f(completions, **kw):\n    return [0.0] * len(completions)\n")
    cfg = Config.of({"reward": {"source": "function", "functions": [{"name": "f", "fn": f"{reward}:f"}]}})
    before = job_identity(cfg, "rloo")  # the training run's own code, with the file the config names
    assert list(before.parts["files"]) == [str(reward)]
    reward.write_text("def f(completions, **kw):\n    # a comment\n    return [0.0] * len(completions)\n")
    assert job_identity(cfg, "rloo").resume == before.resume
    reward.write_text("def f(completions, **kw):\n    return [1.0] * len(completions)\n")
    after = job_identity(cfg, "rloo")
    assert after.resume != before.resume and f"files {reward}" in after.changed(before.parts)


def test_an_input_is_its_recorded_identity_else_its_content(tmp_path):
    """A retrained model of the same size is another input (weights' digests, not their sizes); a folder a
    job made is the identity it recorded; a damaged record falls back to the content; a hub id is itself."""
    model = tmp_path / "sft"
    model.mkdir()
    (model / "config.json").write_text('{"hidden_size": 64}')
    (model / "model.safetensors").write_bytes(b"\0" * 100)
    first = folder_identity(model)
    (model / "model.safetensors").write_bytes(b"\1" * 100)
    assert folder_identity(model) != first
    made = _id(Config(), "sft")
    made.write(model)
    assert folder_identity(model) == made.rerun
    (model / IDENTITY_FILE).write_text("{not json")
    assert folder_identity(model) not in (made.rerun, first)
    assert folder_identity("HuggingFaceTB/SmolLM2-135M") == "HuggingFaceTB/SmolLM2-135M"


def test_a_work_folder_resumes_on_its_own_identity_only(tmp_path):
    work = tmp_path / "work"
    job = _id(_rloo(lr=1e-3), "rloo")
    assert claim_work(work, job, clear=False) == "fresh start"
    (work / "checkpoints" / "step_00000002").mkdir(parents=True)
    assert "resuming" in claim_work(work, _id(_rloo(lr=1e-3, eval_every=7), "rloo"), clear=False)  # bookkeeping
    other = _id(_rloo(lr=2e-3), "rloo")
    with pytest.raises(InputError, match=r"another job \(changed: keys rloo.lr\)"):  # rloo <verb>, rloo.api
        claim_work(work, other, clear=False)
    assert (work / "checkpoints").is_dir()  # refused, never deleted
    assert "cleared" in claim_work(work, other, clear=True) and not (work / "checkpoints").exists()  # Snakemake
    assert json.loads((work / IDENTITY_FILE).read_text())["resume"] == other.resume
    (work / "checkpoints" / "step_00000002").mkdir(parents=True)
    (work / IDENTITY_FILE).write_text("damaged")
    with pytest.raises(InputError, match="damaged identity file"):
        claim_work(work, other, clear=False)
    (work / IDENTITY_FILE).unlink()  # checkpoints of no recorded identity: another job's
    with pytest.raises(InputError, match="no identity file"):
        claim_work(work, other, clear=False)


def test_the_keys_are_the_declarations():
    """The run reads what its stage declares: RLOO's rollout settings count (rollout.backend), the sampler's
    threads (excluded there) do not; the reward model's run does not read what scores RLOO's samples."""
    base = _id(Config(), "rloo").resume
    assert _id(Config(rollout=RolloutConfig(backend="vllm")), "rloo").resume != base
    assert _id(Config(rollout=RolloutConfig(sampler_threads=3)), "rloo").resume == base
    assert "rollout" in stage_keys(Config(), "rloo")[0]
    reward = _id(Config(), "reward").resume
    assert _id(Config(reward=RewardConfig(source="judge")), "reward").resume == reward
    assert set(NOT_READ_BY_REWARD_MODEL) <= set(STAGES["reward"].excluded)


def test_the_bookkeeping_keys_are_declared_once():
    """PPO's settings count for PPO's run alone; the step count is bookkeeping under the constant LR only."""
    assert "rloo.ppo" in bookkeeping("rloo", Config()) and "rloo.ppo" not in bookkeeping("rloo", _rloo(estimator="ppo"))
    assert "rloo.steps" not in bookkeeping("rloo", _rloo(lr_schedule="cosine"))  # its schedule reads the step count
