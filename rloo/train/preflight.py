"""What the RLOO (and PPO) trainer refuses before it loads a model: settings that cannot run together
(too few samples per prompt, more prompts per step than there are, LoRA with the vLLM sampler), an
optional package it needs that is missing (rloo.extras), and
the features that do not run data-parallel yet (`distributed.refuse`)."""

from __future__ import annotations

from rloo import extras
from rloo.algo.names import k_problems
from rloo.errors import InputError
from rloo.model import distributed, lora
from rloo.settings import Config
from rloo.settings.training import refuse_batch_over_data


def check_settings(sections: Config, n_train: int, source: str = "the rows handed in") -> None:
    """Raise InputError for the first setting of `sections` a trainer on `n_train` prompts (`source`) cannot
    run."""
    rc = sections.rloo
    if problems := k_problems(rc.estimator, rc.k, rc.dynamic_sampling):
        raise InputError(f"rloo.k={rc.k}: {problems[0]}")
    refuse_batch_over_data("rloo.prompts_per_step", rc.prompts_per_step, n_train, source, "training prompts")
    vllm = sections.rollout.backend == "vllm"
    for what, unsupported in (("rloo.estimator=ppo", rc.estimator == "ppo"),
                              ("rloo.estimator=moving_average (a baseline over the whole batch)",
                               rc.estimator == "moving_average"),
                              ("rloo.dynamic_sampling", rc.dynamic_sampling),
                              ("rollout.backend=vllm", vllm)):
        if unsupported:
            distributed.refuse(what)
    if problems := rc.off_policy_problems(sections.distributed.strategy):  # a config that skipped validation
        raise InputError(problems[0].replace("key 'rloo.off_policy_steps': ", "rloo.off_policy_steps="))
    if lora.enabled(sections.model) and vllm:
        raise InputError("model.lora with rollout.backend=vllm: the engine would sample from the base weights "
                         "(no adapter sync); use rollout.backend hf with LoRA, or turn model.lora off")
    # last: a setting that cannot run anywhere is the user's to fix first; then what this machine lacks
    # (rloo.api's trainers too: vLLM missing is one line, before any model loads)
    extras.require(sections, "rloo")
