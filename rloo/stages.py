"""The pipeline's stages, declared once: each stage's names, its command, its outputs, and the config keys it
reads (`stage_keys`). The library's part of the declaration, so that a training run's checkpoint identity
(rloo/identity.py) reads the same keys whether Snakemake, `rloo <verb>` or rloo.api started the run;
the workflow builds its rules, DVC stages, MLflow runs and variants on it (rloo_workflow/pipeline.py).

Output templates use the config's folders (`{data}`, `{models}`, `{results}`: `paths.*`) and, for
the stages run once per advantage estimator, `{estimator}`; for the evaluation, run once per policy,
`{policy}` (Snakemake wildcards in the rules).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from rloo.settings import Config
from rloo.settings.selection import drop, put, select

# What the functions below take: the typed config, or the validated dict the Snakefile (workflow/rules/*.smk)
# and the CLI hold, which each converts once (`Config.of`) and hands on typed.
ConfigLike = Config | Mapping[str, Any]
# What scores RLOO's samples: the reward model's run does not read it.
NOT_READ_BY_REWARD_MODEL = ("reward.source", "reward.batch_size_score", "reward.functions", "reward.http")


@dataclass(frozen=True)
class Stage:
    name: str  # the Snakemake rule, the DVC stage, the stage module, the code key and (with the estimator) the MLflow run
    verb: str  # `rloo <verb>` runs rloo_workflow.stages.<name>; the name but for rloo (`rloo train`)
    outputs: dict[str, str]  # named output paths (templates); `cli_outputs` maps them to the CLI options
    keys: tuple[str, ...] = ()  # config keys it reads ("section" or "section.key")
    excluded: tuple[str, ...] = ()  # keys below those that it does not read
    per_estimator: bool = False  # one job per advantage estimator
    per_policy: bool = False  # one job per policy evaluated: the base model, SFT, each estimator's
    work: bool = False  # keeps checkpoints under {results}/work/<name> (resumable)
    data_parallel: bool = False  # trains on several processes under `distributed` (rloo/model/distributed.py)


# `model` keys that say how a stage trains or runs the model, not which model it starts from.
TRAINING_MODEL_KEYS = ("shape", "dtype", "autocast", "device", "lora", "gradient_checkpointing", "logits_chunk_tokens")
# What the base stage reads when it does not build the embedded model (a hub id, a folder, a GGUF file).
PRETRAINED_BASE_KEYS = ("model.name_or_path", "model.gguf", "model.revision", "model.tokenizer", "model.trust_remote_code")

# What an evaluation reads of the config (and the report over it).
EVALUATE_KEYS = ("seed", "model", "prompt", "evaluate")

STAGES: dict[str, Stage] = {s.name: s for s in (
    Stage("prepare", "prepare",
          {"train": "{data}/train.jsonl", "test": "{data}/test.jsonl", "val": "{data}/val.jsonl",
           "manifest": "{data}/manifest.json"},
          keys=("seed", "data")),
    # The starting model as one local folder: what every later stage reads of model.name_or_path / gguf.
    Stage("base", "base", {"model": "{models}/base"}, keys=("seed", "model", "prompt.template", "sft.max_train_examples"),
          excluded=tuple(f"model.{k}" for k in TRAINING_MODEL_KEYS)),
    Stage("sft", "sft", {"model": "{models}/sft"}, keys=("seed", "model", "prompt", "sft"), work=True,
          excluded=("model.shape",), data_parallel=True),
    # The reward model does not depend on what RLOO then uses as its reward.
    Stage("reward", "reward", {"model": "{models}/reward"}, keys=("seed", "model", "prompt", "reward"),
          excluded=(*NOT_READ_BY_REWARD_MODEL, "model.shape"),
          work=True, data_parallel=True),
    Stage("rloo", "train", {"model": "{models}/rloo_{estimator}"},
          keys=("seed", "model", "prompt", "reward.source", "rloo", "rollout"), per_estimator=True, work=True,
          # the off-policy sampler's threads: how fast, not what (the stage's own `threads` is not read either)
          excluded=("model.shape", "rollout.sampler_threads"), data_parallel=True),
    # One job per policy: the untrained base, SFT, each trained policy (`{policy}`: base, sft or an
    # estimator), on the held-out problems: its records (every completion, graded) and its figures.
    Stage("evaluate", "evaluate", {"records": "{results}/eval/{policy}.jsonl", "summary": "{results}/eval/{policy}.json"},
          keys=EVALUATE_KEYS, excluded=("model.shape",), per_policy=True),
    # An LLM judge's verdicts on a trained policy's completions against SFT's (evaluate.judge: llm), one job
    # serving the judge once; the verifier's win rates need no job of their own (the report computes them).
    Stage("judge", "judge", {"result": "{results}/gsm8k_{estimator}/judged.json"},
          keys=("evaluate.judge", "evaluate.llm_judge", "evaluate.win_rate_decoding"), per_estimator=True),
    # base -> SFT -> RL from the evaluations' records alone (no model): the results JSON and its plots.
    # It reads what the evaluations read of the config (so its config hash is theirs).
    Stage("report", "report",
          {"result": "{results}/gsm8k_{estimator}.json", "policies": "{results}/gsm8k_{estimator}/policies.png",
           "proxy_vs_judge": "{results}/gsm8k_{estimator}/proxy_vs_judge.png"},
          keys=EVALUATE_KEYS, excluded=("model.shape",), per_estimator=True),
    Stage("toy", "toy", {"result": "{results}/toy_variance.json", "plot": "{results}/toy_variance.png"},
          keys=("seed",)),
    # It judges every estimator's policy against RLOO's with the evaluation's judge, on their records.
    Stage("comparison", "comparison", {"result": "{results}/comparison.json", "plot": "{results}/comparison.png"},
          keys=("seed", "evaluate.judge", "evaluate.llm_judge", "evaluate.win_rate_decoding")),
    # The `seeds` target: the chain per seed of `seeds.values` (the config's estimator), aggregated. It
    # reads only the per-seed results files its rule hands it, so no config key reruns it by itself.
    Stage("seeds", "seeds", {"result": "{results}/seeds/gsm8k_{estimator}.json",
                             "plot": "{results}/seeds/gsm8k_{estimator}.png"}, per_estimator=True),
    # A sweep of `sweeps.<name>`: one chain per point of its grid, tabled; `best` by validation accuracy.
    Stage("sweep", "sweep", {"result": "{results}/sweeps/{sweep}.json", "plot": "{results}/sweeps/{sweep}.png"}),
)}
BY_VERB: dict[str, Stage] = {s.verb: s for s in STAGES.values()}



def pretrained_start(sections: Config) -> bool:
    """Whether the base stage starts from a model (a hub id, a folder, a GGUF file) rather than building
    the embedded one from the training texts."""
    return bool(sections.model.name_or_path or sections.model.gguf)




# The stages that read `tools:` where a tool is enabled.
TOOL_STAGES = ("sft", "rloo", "evaluate", "report")

# reward.source values that are a user's plug-in, and the key that configures each.
PLUGIN_REWARDS = {"function": "reward.functions", "http": "reward.http"}


def stage_keys(cfg: ConfigLike, stage: str, estimator: str | None = None) -> tuple[list[str], list[str]]:
    """(dotted keys `stage` reads under this config, keys below those that it does not read);
    `estimator`: the RLOO stage's, when it is not the config's own (a Snakemake wildcard)."""
    sections = Config.of(cfg)
    source = sections.reward.source
    decl = STAGES[stage]
    keys, excluded = list(decl.keys), list(decl.excluded)
    if stage == "base" and pretrained_start(sections):
        keys, excluded = list(PRETRAINED_BASE_KEYS), []  # a pretrained start: no seed, shape or data
    if stage == "rloo" and (estimator or sections.rloo.estimator) != "ppo":
        excluded.append("rloo.ppo")  # PPO's settings: the critic-free estimators do not rerun on them
    if stage == "rloo" and source == "model":
        keys.append("reward.batch_size_score")  # the reward model's scoring batch inside RLOO
    elif stage == "rloo" and source == "judge":
        keys += ["evaluate.judge", "evaluate.llm_judge"]  # RLOO is scored by the evaluation judge
    if stage in ("rloo", "evaluate", "report") and (plugin := PLUGIN_REWARDS.get(source)):
        # reward functions or a reward server: RLOO trains on them, the evaluation reports them
        keys += [plugin] if stage == "rloo" else ["reward.source", plugin]
    if stage in TOOL_STAGES and sections.tools.enabled:
        # tools (the calculator): SFT masks their results, RLOO and the evaluations run them. Only when
        # enabled, so that a config without tools reads (and reruns on) what it did before.
        keys.append("tools")
        if stage in ("sft", "rloo"):  # the evaluations' second pass without the tools: no training reads it
            excluded.append("tools.evaluate_without")
    return keys, excluded


def stage_config(cfg: dict, stage: str, overrides: dict[str, Any] | None = None) -> dict:
    """The part of `cfg` that `stage` reads (a copy; `stage_keys`), with {dotted key: value}
    `overrides` set on top. Snakemake passes a stage exactly this part (workflow/rules/common.smk), so a
    changed value reruns just the stages that read it; a stage run by hand logs it as MLflow parameters."""
    keys, excluded = stage_keys(cfg, stage, (overrides or {}).get("rloo.estimator"))
    part = select(cfg, keys)
    for key in excluded:
        drop(part, key)
    for key, value in (overrides or {}).items():
        put(part, key, value)
    return part


def reads_key(cfg: ConfigLike, stage: str, key: str) -> bool:
    """Whether `stage` reads the dotted config `key` (or a key below it): a change of it reruns the stage."""
    keys, excluded = stage_keys(cfg, stage)

    def under(a: str, b: str) -> bool:
        return a == b or a.startswith(b + ".")

    return any(under(key, k) or under(k, key) for k in keys) and not any(under(key, e) for e in excluded)
