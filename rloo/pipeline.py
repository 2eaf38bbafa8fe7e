"""The pipeline's shape, declared once: each stage's names, its command, its outputs, the config it reads.

`rloo <verb>` (rloo/cli.py) takes its default outputs from here, the Snakemake rules
(workflow/rules/*.smk) their output paths, MLflow its run names and output tags (rloo/tracking/);
`dvc.yaml` is compiled from the Snakemake DAG. tests/test_pipeline.py checks that all four agree.

Output templates use the config's folders (`{data}`, `{models}`, `{results}`: `paths.*`) and, for
the stages run once per advantage estimator, `{estimator}` (a Snakemake wildcard in the rules).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class Stage:
    name: str  # the Snakemake rule, the DVC stage and (with the estimator) the MLflow run
    verb: str  # `rloo <verb>`; rloo.stages.<verb>.run does the work
    outputs: dict[str, str]  # named output paths (templates); `cli_outputs` maps them to the CLI options
    keys: tuple[str, ...] = ()  # config keys it reads ("section" or "section.key")
    excluded: tuple[str, ...] = ()  # keys below those that it does not read
    per_estimator: bool = False  # one job per advantage estimator
    work: bool = False  # keeps checkpoints under {results}/work/<name> (resumable)
    data_parallel: bool = False  # trains on several processes under `distributed` (rloo/distributed.py)


STAGES: dict[str, Stage] = {s.name: s for s in (
    Stage("prepare", "prepare",
          {"train": "{data}/train.jsonl", "test": "{data}/test.jsonl", "val": "{data}/val.jsonl",
           "manifest": "{data}/manifest.json"},
          keys=("seed", "data")),
    Stage("sft", "sft", {"model": "{models}/sft"}, keys=("seed", "model", "prompt", "sft"), work=True,
          excluded=("model.shape",), data_parallel=True),
    # The reward model does not depend on what RLOO then uses as its reward.
    Stage("reward", "reward", {"model": "{models}/reward"}, keys=("seed", "model", "prompt", "reward"),
          excluded=("reward.source", "reward.batch_size_score", "model.shape"), work=True, data_parallel=True),
    Stage("rloo", "train", {"model": "{models}/rloo_{estimator}"},
          keys=("seed", "model", "prompt", "reward.source", "rloo", "rollout"), per_estimator=True, work=True,
          excluded=("model.shape",), data_parallel=True),
    Stage("evaluate", "evaluate",
          {"result": "{results}/gsm8k_{estimator}.json", "policies": "{results}/gsm8k_{estimator}/policies.png",
           "proxy_vs_judge": "{results}/gsm8k_{estimator}/proxy_vs_judge.png",
           "completions": "{results}/gsm8k_{estimator}/completions.jsonl"},
          keys=("seed", "model", "prompt", "evaluate"), excluded=("model.shape",), per_estimator=True),
    Stage("toy", "toy", {"result": "{results}/toy_variance.json", "plot": "{results}/toy_variance.png"},
          keys=("seed",)),
    # It judges every estimator's completions against RLOO's with the evaluation's judge.
    Stage("comparison", "compare", {"result": "{results}/comparison.json", "plot": "{results}/comparison.png"},
          keys=("seed", "evaluate.judge", "evaluate.llm_judge", "evaluate.win_rate_decoding")),
)}
BY_VERB: dict[str, Stage] = {s.verb: s for s in STAGES.values()}


def folders(cfg: dict) -> dict[str, str]:
    p = cfg["paths"]
    return {"data": p["data"], "models": p["models"], "results": p["results"]}


def outputs(stage: str, cfg: dict, estimator: str | None = None) -> dict[str, str]:
    """The output paths of `stage` under `cfg` (`estimator`: the config's rloo.estimator by default)."""
    est = estimator or cfg["rloo"]["estimator"]
    return {k: v.format(**folders(cfg), estimator=est) for k, v in STAGES[stage].outputs.items()}


def rule_outputs(stage: str, cfg: dict) -> dict[str, str]:
    """The output paths for the Snakemake rule: config folders filled in, `{estimator}` left a wildcard."""
    return {k: v.format(**folders(cfg), estimator="{estimator}") for k, v in STAGES[stage].outputs.items()}


def work_dir(stage: str, cfg: dict, estimator: str | None = None) -> str:
    """Where a resumable stage keeps its checkpoints: outside its outputs, so a rerun resumes."""
    name = STAGES[stage].name
    if STAGES[stage].per_estimator:
        name = f"{name}_{estimator or cfg['rloo']['estimator']}"
    return f"{cfg['paths']['results']}/work/{name}"


def run_name(stage: str, estimator: str | None = None, policy: str | None = None) -> str:
    """The MLflow run of a job: the stage, plus the estimator (the policy, for evaluate) unless it is
    the default `rloo`, so that the default pipeline's runs read prepare, sft, reward, rloo, evaluate."""
    suffix = policy if stage == "evaluate" else estimator if STAGES[stage].per_estimator else None
    return stage if suffix in (None, "rloo") else f"{stage}_{suffix}"


def stage_keys(cfg: dict, stage: str, estimator: str | None = None) -> tuple[list[str], list[str]]:
    """(dotted keys `stage` reads under this config, keys below those that it does not read);
    `estimator`: the RLOO stage's, when it is not the config's own (a Snakemake wildcard)."""
    decl = STAGES[stage]
    keys, excluded = list(decl.keys), list(decl.excluded)
    if stage == "rloo" and (estimator or cfg["rloo"]["estimator"]) != "ppo":
        excluded.append("rloo.ppo")  # PPO's settings: the critic-free estimators do not rerun on them
    if stage == "rloo" and cfg["reward"]["source"] == "model":
        keys.append("reward.batch_size_score")  # the reward model's scoring batch inside RLOO
    elif stage == "rloo" and cfg["reward"]["source"] == "judge":
        keys += ["evaluate.judge", "evaluate.llm_judge"]  # RLOO is scored by the evaluation judge
    return keys, excluded


def evaluated_policies(args: Any, cfg: dict) -> dict[str, str]:
    """`rloo evaluate`'s trained policies {name: folder}: its --policy NAME=FOLDER options, else the
    config's estimator's RLOO output."""
    given = getattr(args, "policy", None) or []
    if given:
        return dict(p.split("=", 1) for p in given)
    return {cfg["rloo"]["estimator"]: outputs("rloo", cfg)["model"]}


def cli_outputs(args: Any, cfg: dict) -> dict[str, str]:
    """What `rloo <verb>` writes: its --out (and --plot/--plots) where given, else the declared outputs.
    The CLI writes there and MLflow tags exactly these paths with their md5."""
    stage = BY_VERB[args.stage]
    out = getattr(args, "out", None)
    if stage.name == "prepare":
        return {"data": out or folders(cfg)["data"]}
    if stage.name == "evaluate":
        names = list(evaluated_policies(args, cfg))
        result = out or outputs("evaluate", cfg, names[0] if len(names) == 1 else None)["result"]
        return {"result": result, "plots": getattr(args, "plots", None) or str(Path(result).with_suffix(""))}
    declared = outputs(stage.name, cfg)
    if "model" in declared:
        return {"model": out or declared["model"]}
    return {"result": out or declared["result"], "plot": getattr(args, "plot", None) or declared["plot"]}


def cli_run_name(args: Any, cfg: dict) -> str:
    """The MLflow run of `rloo <verb>`: see `run_name`."""
    stage = BY_VERB[args.stage]
    if stage.name == "evaluate":
        names = list(evaluated_policies(args, cfg))
        return run_name("evaluate", policy=names[0] if len(names) == 1 else None)
    return run_name(stage.name, cfg["rloo"]["estimator"])
