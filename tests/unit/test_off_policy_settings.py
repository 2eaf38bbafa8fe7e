"""The settings of one-step off-policy RLOO (rloo.off_policy_steps, rollout.sampler_threads,
rloo.rollout_correction's auto mode and mismatch_every): what validation refuses, what `auto` means, and
which keys rerun the stage."""

from __future__ import annotations

from pathlib import Path

import pytest

from rloo.errors import InputError
from rloo.settings import Config, RolloutCorrectionConfig
from rloo.train.preflight import check_settings
from rloo_workflow.config import ConfigError, load_config
from rloo_workflow.pipeline import reads_key

ROOT = Path(__file__).resolve().parents[2]
MICRO = [ROOT / "config" / "config.yaml", ROOT / "config" / "micro.yaml"]


@pytest.mark.parametrize(("override", "names"), [
    ({"distributed": {"strategy": "ddp", "nproc_per_node": 2}}, ("rloo.off_policy_steps", "distributed.strategy=ddp")),
    ({"distributed": {"strategy": "fsdp", "nproc_per_node": 2}}, ("rloo.off_policy_steps", "distributed.strategy=fsdp")),
    ({"rloo": {"estimator": "remax"}}, ("rloo.off_policy_steps", "rloo.estimator=remax")),
])
def test_validation_refuses_what_is_not_built_in_one_line_naming_the_keys(override, names):
    cfg = {**override, "rloo": {**override.get("rloo", {}), "off_policy_steps": 1}, "model": {"device": "cpu"}}
    with pytest.raises(ConfigError) as info:
        load_config(MICRO, cfg)
    line = next(x.strip() for x in str(info.value).splitlines()[1:] if "off_policy_steps" in x)
    assert all(n in line for n in names), line
    # the same combinations set up synchronously are fine
    load_config(MICRO, {**cfg, "rloo": {**cfg["rloo"], "off_policy_steps": 0}})


def test_the_trainer_refuses_them_too_for_a_config_that_skipped_validation():
    config = Config.from_config({"rloo": {"off_policy_steps": 1, "estimator": "remax"}})
    with pytest.raises(InputError, match=r"rloo\.off_policy_steps=1 with rloo\.estimator=remax"):
        check_settings(config, 1000)


def test_only_two_lags_exist():
    with pytest.raises(ConfigError, match=r"key 'rloo\.off_policy_steps': 2 is greater than the maximum of 1"):
        load_config(MICRO, {"rloo": {"off_policy_steps": 2}})


def test_auto_is_token_tis_off_policy_and_none_synchronous_and_an_explicit_mode_is_kept():
    auto = Config.from_config(load_config(MICRO)).rloo.rollout_correction
    assert auto.mode == "auto" and auto.cap == 2.0
    assert auto.resolved(off_policy=True).mode == "token_tis" and auto.resolved(off_policy=True).cap == 2.0
    assert auto.resolved(off_policy=False).mode == "none"
    for mode in ("none", "sequence_mask"):
        assert RolloutCorrectionConfig(mode=mode).resolved(off_policy=True).mode == mode
    with pytest.raises(ValueError, match="resolve it first"):
        _ = auto.applied


def test_the_samplers_threads_rerun_nothing_and_the_lag_reruns_rloo():
    cfg = load_config(MICRO)
    assert not reads_key(cfg, "rloo", "rollout.sampler_threads")
    assert reads_key(cfg, "rloo", "rollout.backend") and reads_key(cfg, "rloo", "rloo.off_policy_steps")
    assert reads_key(cfg, "rloo", "rloo.rollout_correction.mismatch_every")
    assert not reads_key(cfg, "evaluate", "rloo.off_policy_steps")


def test_the_memory_plans_put_the_sampler_on_a_gpu_of_its_own_and_beside_the_trainer_on_a_cpu():
    from rloo_workflow.host_memory import host_plan
    from rloo_workflow.memory_plan import GB, plan
    from rloo_workflow.model_shape import model_shape

    def plans(off: int, **more) -> dict:
        config = Config.from_config(load_config(ROOT / "config" / "gpu.yaml", {"rloo": {"off_policy_steps": off},
                                                                               **more}))
        return {p.stage: p for p in plan(config, model_shape(config.model)[0], 80)}, config

    sync, _ = plans(0)
    off, config = plans(1)
    assert set(off) == {*sync, "rloo sampler (rloo)"}
    sampler, trainer = off["rloo sampler (rloo)"].peak, off["rloo (rloo)"]
    shape = model_shape(config.model)[0]
    assert sampler.vllm == config.rollout.gpu_memory_utilization * 80 * GB  # vLLM's share of its own GPU
    assert config.reward.source == "model"  # it scores there: its copy of the float32 policy and the reward model
    assert sampler.state == (shape.parameters() + shape.reward_model_parameters()) * 4
    assert all(p.vllm == 0 for p in trainer.phases) and any(p.vllm for p in sync["rloo (rloo)"].phases)
    # on one CPU machine both processes hold their memory at once
    cpu = Config.from_config(load_config(MICRO, {"rloo": {"off_policy_steps": 1}, "model": {"device": "cpu"}}))
    phases = host_plan(cpu, model_shape(cpu.model)[0])
    alone = max(p.total for p in phases if p.stage == "rloo sampler (rloo)")
    assert all(p.terms["sampler"] == alone for p in phases if p.stage == "rloo (rloo)")
