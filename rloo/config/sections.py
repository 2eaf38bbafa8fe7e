"""The config sections the trainers, samplers and stages read, as frozen dataclasses built once from the
validated dict (`Sections.from_config(cfg)`). The schema (rloo/schemas/config.schema.yaml) documents
every key and holds every default; tests/unit/test_config_sections.py holds each dataclass's fields equal to
its section's keys. The rules that tie a section's keys together live here, next to those keys.

The raw dict stays what MLflow params, provenance and run fingerprints read."""

from __future__ import annotations

import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass, fields, is_dataclass
from types import MappingProxyType
from typing import Any

from rloo.algo.names import GROUP_ESTIMATORS


class Section:
    """A config section as a frozen dataclass: `from_config` takes the validated dict's section."""

    @classmethod
    def from_config(cls, section: Mapping[str, Any]):
        names = {f.name for f in fields(cls)}  # type: ignore[arg-type]
        if unknown := sorted(set(section) - names):
            # the schema has a key this dataclass lacks: tests/unit/test_config_sections.py says which
            raise KeyError(f"{cls.__name__}: no field for config key(s) {', '.join(unknown)}")
        hints = typing.get_type_hints(cls)
        return cls(**{name: _typed(hints[name], section[name]) for name in names})


def _typed(hint: Any, value: Any) -> Any:
    """`value` as the field's type: a nested section built, a list frozen into a tuple, a mapping
    into a read-only copy."""
    if value is None:
        return None
    for t in (hint, *typing.get_args(hint)):
        if isinstance(t, type) and is_dataclass(t):
            return t.from_config(value)  # type: ignore[attr-defined]
    if isinstance(value, list):
        return tuple(value)
    if isinstance(value, Mapping):
        return MappingProxyType(dict(value))
    return value


def section_types(cls: type) -> dict[str, type]:
    """{field: its nested section dataclass} of `cls` (a nullable one included)."""
    out = {}
    for name, hint in typing.get_type_hints(cls).items():
        args = typing.get_args(hint) if isinstance(hint, types.UnionType) else (hint,)
        for t in args:
            if isinstance(t, type) and is_dataclass(t):
                out[name] = t
    return out


# -- model ------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class TinyConfig(Section):
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    intermediate_size: int


@dataclass(frozen=True)
class LoraConfig(Section):
    enabled: bool
    r: int
    alpha: float
    dropout: float
    target_modules: str | tuple[str, ...]


@dataclass(frozen=True)
class ModelConfig(Section):
    name_or_path: str | None
    gguf: str | None
    revision: str | None
    tokenizer: str | None
    trust_remote_code: bool
    dtype: str
    autocast: str
    inference_dtype: str | None
    device: str
    attn_implementation: str | None
    max_length: int
    tiny: TinyConfig
    lora: LoraConfig
    gradient_checkpointing: bool
    logits_chunk_tokens: int
    shape: Mapping[str, Any] | None  # read by `rloo plan` only (rloo/memory_plan.py), from the raw dict


# -- the training stages ------------------------------------------------------------------------------
@dataclass(frozen=True)
class SftConfig(Section):
    steps: int
    batch_size: int
    lr: float
    warmup_steps: int
    weight_decay: float
    adam_beta2: float
    grad_clip: float
    max_train_examples: int | None
    max_dropped_share: float
    eval_examples: int
    eval_max_new_tokens: int
    eval_draws: int
    eval_batch_size: int
    checkpoint_every: int
    max_nonfinite_steps: int
    log_every: int
    micro_batch_tokens: int


@dataclass(frozen=True)
class RewardHttpConfig(Section):
    """reward.http: the reward server of `reward.source: http` (rloo/reward/remote.py)."""

    url: str | None
    timeout_s: float
    max_retries: int
    max_failed_share: float
    api_key_env: str | None


@dataclass(frozen=True)
class RewardConfig(Section):
    source: str
    # {name, fn, weight, max_failed_share} each: rloo/reward/functions.py reads them from the dict
    functions: tuple[Mapping[str, Any], ...]
    http: RewardHttpConfig
    init: str | None
    samples_per_prompt: int
    prompts: int
    val_fraction: float
    steps: int
    batch_size: int
    checkpoint_every: int
    max_nonfinite_steps: int
    lr: float
    max_new_tokens: int
    batch_size_score: int
    micro_batch_tokens: int


@dataclass(frozen=True)
class RolloutCorrectionConfig(Section):
    """rloo.rollout_correction: weights or masks from pi_trainer / pi_sampler (docs/rollout-correction.md)."""

    mode: str
    cap: float

    @property
    def applied(self) -> bool:
        """Whether weights or masks enter the loss (every mode but `none`, which only measures)."""
        return self.mode != "none"


@dataclass(frozen=True)
class PpoConfig(Section):
    gamma: float
    lam: float
    epochs: int
    minibatches: int
    whiten_advantages: bool
    value_clip: float
    critic_lr: float
    critic_init: str


@dataclass(frozen=True)
class AlarmConfig(Section):
    """`rloo.alarms`, the thresholds of rloo/train/alarms.py; the schema documents each key and holds the
    defaults, the calibrated thresholds."""

    window: int  # steps every windowed check reads; none fires before this many steps
    z: float  # one-sided margin, in standard errors, that a level or a change must clear
    zero_signal_share: float  # the seed's "above 50 %" of groups without signal
    kl_rise: float  # nats: KL's rise from the window's first half to its second that counts as a climb
    length_rise: float  # relative rise of the mean response length across the window
    hacking_z: float  # reward_hacking: the accuracy drop, in standard errors of a difference
    mismatch_kl: float  # sampling_mismatch: nats per token of KL(sampler || trainer) (k3) that counts as a mismatch

    @classmethod
    def from_config(cls, section: Mapping[str, Any] | None = None) -> AlarmConfig:
        """`section` (a validated config's `rloo.alarms`, or part of one) over the schema's defaults."""
        from rloo.config.schema import load_schema

        schema = load_schema()["properties"]["rloo"]["properties"]["alarms"]["properties"]
        values = {f.name: schema[f.name]["default"] for f in fields(cls)}
        return cls(**{**values, **{k: v for k, v in (section or {}).items() if k in values}})


@dataclass(frozen=True)
class RlooConfig(Section):
    estimator: str
    k: int  # samples per prompt: the group; see `k_problems`
    prompts_per_step: int
    steps: int
    lr: float
    warmup_steps: int
    lr_schedule: str
    min_lr_ratio: float
    weight_decay: float
    beta: float
    kl_estimator: str
    kl_in: str
    loss_norm: str
    updates_per_batch: int
    clip_eps: float
    max_new_tokens: int
    min_solution_steps: int
    dynamic_sampling: bool
    dynamic_sampling_max_rounds: int
    temperature: float
    top_p: float
    top_k: int
    grad_clip: float
    moving_average_decay: float
    checkpoint_every: int
    max_nonfinite_steps: int
    keep_checkpoints: int
    eval_every: int
    eval_examples: int
    eval_draws: int
    eval_batch_size: int
    micro_batch_tokens: int
    rollout_correction: RolloutCorrectionConfig
    ppo: PpoConfig
    select: str
    alarms: AlarmConfig
    stop_on: tuple[str, ...]

    def problems(self) -> list[str]:
        """The rules that tie this section's keys together, each naming its key; the config checks
        raise them before any stage runs."""
        out = [f"key 'rloo.k': {p}, got {self.k}" for p in k_problems(self.estimator, self.k, self.dynamic_sampling)]
        if self.select == "best" and not self.eval_every:
            out.append("key 'rloo.select': 'best' picks a checkpoint by validation accuracy and needs "
                       "rloo.eval_every > 0 (or set rloo.select: last)")
        return out


def k_problems(estimator: str, k: int, dynamic_sampling: bool = False) -> list[str]:
    """What `k` samples per prompt are too few for: a group estimator's baseline is built from a prompt's
    other samples, and dynamic sampling keeps the groups whose rewards differ (the config checks, the
    trainer and the estimators all ask here)."""
    out = []
    if estimator in GROUP_ESTIMATORS and k < 2:
        out.append(f"the {estimator} estimator needs k >= 2 samples per prompt")
    if dynamic_sampling and k < 2:
        out.append("rloo.dynamic_sampling keeps groups whose rewards differ; needs k >= 2")
    return out


@dataclass(frozen=True)
class RolloutConfig(Section):
    """rollout: which engine samples the RLOO stage's completions (hf or vllm) and vLLM's memory share."""

    backend: str
    gpu_memory_utilization: float


# -- evaluate -------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ServeConfig(Section):
    model: str
    args: tuple[str, ...]
    gpus: int
    startup_timeout_s: float
    stop_grace_s: float
    command: tuple[str, ...] | None


@dataclass(frozen=True)
class LlmJudgeConfig(Section):
    base_url: str
    model: str
    api_key_env: str
    timeout_s: float
    max_retries: int
    max_failed_share: float
    structured_verdict: bool | str
    serve: ServeConfig | None


@dataclass(frozen=True)
class EvaluateConfig(Section):
    examples: int
    samples_per_prompt: int
    max_new_tokens: int
    batch_size: int
    judge: str
    win_rate_decoding: str
    llm_judge: LlmJudgeConfig


@dataclass(frozen=True)
class Sections(Section):
    """The typed sections of one validated config."""

    model: ModelConfig
    sft: SftConfig
    reward: RewardConfig
    rloo: RlooConfig
    rollout: RolloutConfig
    evaluate: EvaluateConfig

    @classmethod
    def from_config(cls, cfg: Mapping[str, Any]) -> Sections:
        return cls(**{name: t.from_config(cfg[name]) for name, t in section_types(cls).items()})
