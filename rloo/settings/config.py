"""The whole configuration: every section, its defaults the pipeline's defaults, and the rules that tie
keys of several sections together (each in the section of the key it names: `problems`)."""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import rloo.settings.workflow as workflow  # not `from rloo.settings import ...`: that init imports this module
from rloo.settings.data import DataConfig, PromptConfig
from rloo.settings.evaluation import EvaluateConfig
from rloo.settings.fields import Section, setting
from rloo.settings.model import ModelConfig
from rloo.settings.tools import ToolsConfig
from rloo.settings.training import RewardConfig, RlooConfig, RolloutConfig, SftConfig


@dataclass(frozen=True)
class Config(Section):
    """Configuration of the rloo pipeline. Every key has a default; unknown keys are errors. The same schema
    validates the config in `rloo <stage>` and in the Snakefile."""

    name: str = "tiny"
    """Label of this configuration (recorded in results and MLflow)."""
    seed: int = 0
    """The seed every stage derives its randomness from (data, initialisation, each step's batch and noise)."""
    threads: int | None = setting(None, minimum=1)
    """torch intra-op threads; null = all cores of the job (Slurm's cpus_per_task when set)."""
    progress_every_s: float = setting(30.0, exclusive_minimum=0)
    """Seconds between two progress lines of a long stage (sft, reward, rloo, evaluate, the judge), on the
    terminal and in its log: `rloo: step 120/480 (25%) · reward 0.62 · kl 0.11 · 1.4 s/step · ETA 8 min`.
    How a job reports, not what it computes: it is in no stage's parameters, so changing it reruns nothing."""
    paths: workflow.PathsConfig = field(default_factory=workflow.PathsConfig)
    """Where the pipeline writes."""
    data: DataConfig = field(default_factory=DataConfig)
    """The problems and their splits."""
    prompt: PromptConfig = field(default_factory=PromptConfig)
    """How a question becomes a prompt."""
    model: ModelConfig = field(default_factory=ModelConfig)
    """The starting model and how it is held."""
    sft: SftConfig = field(default_factory=SftConfig)
    """Supervised fine-tuning."""
    reward: RewardConfig = field(default_factory=RewardConfig)
    """RLOO's reward, and the reward model."""
    rloo: RlooConfig = field(default_factory=RlooConfig)
    """The RLOO stage."""
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    """The RLOO stage's sampler."""
    tools: ToolsConfig = field(default_factory=ToolsConfig)
    """Tools the policy calls inside its completion (the calculator): none by default."""
    distributed: workflow.DistributedConfig = field(default_factory=workflow.DistributedConfig)
    """Data-parallel training."""
    evaluate: EvaluateConfig = field(default_factory=EvaluateConfig)
    """The held-out evaluation."""
    plan: workflow.PlanConfig = field(default_factory=workflow.PlanConfig)
    """The memory plan."""
    tracking: workflow.TrackingConfig = field(default_factory=workflow.TrackingConfig)
    """MLflow."""
    seeds: workflow.SeedsConfig = field(default_factory=workflow.SeedsConfig)
    """The seeds target."""
    comparison: workflow.ComparisonConfig = field(default_factory=workflow.ComparisonConfig)
    """The comparison target."""
    sweeps: Mapping[str, Mapping[str, tuple[Any, ...]]] = setting({}, schema=workflow.SWEEPS_SCHEMA)
    """Named grids, `<name>: {<key.path>: [values], ...}`: target results/sweeps/<name>.json runs every point
    of the cartesian product (its outputs under <paths.*>/sweeps/<name>/<point id>/) and tables them, the
    best point chosen by validation accuracy. A point reruns only the stages that read a key it sets; the
    others are the main chain's. Each key must be a config key and each value valid for it. Not read by any
    stage: changing it reruns nothing of the main chain."""

    @classmethod
    def of(cls, cfg: Config | Mapping[str, Any]) -> Config:
        """The typed config of `cfg`: itself, or the validated dict (every key filled) converted. Code outside
        the config loaders reads settings through it, never the dict's keys. A workflow asks this of its one
        dict thousands of times while Snakemake builds the DAG (every job's inputs, params and lineage), so
        the last few conversions are kept, by the dict's content (serialising it costs a tenth of
        converting it)."""
        if isinstance(cfg, Config):
            return cfg
        key = json.dumps(cfg, sort_keys=True, default=str)
        if (hit := _TYPED.get(key)) is not None:
            return hit
        typed = cls.from_config(cfg)
        if len(_TYPED) >= 8:
            _TYPED.pop(next(iter(_TYPED)))
        _TYPED[key] = typed
        return typed

    def problems(self) -> list[str]:
        """Every rule that ties a key to others, broken: one line each, naming the key. Each rule is its
        section's (`problems`), handed what it reads of the others."""
        context, examples = self.model.max_length, self.data.train_examples()
        return (self.sft.problems(context, examples) + self.reward.problems(context, self)
                + self.rloo.problems(context, examples, self.distributed.strategy) + self.evaluate.problems(context, self.reward.source)
                + self.tools.problems(self))


_TYPED: dict[str, Config] = {}  # the last few dicts converted (`Config.of`), by their content
