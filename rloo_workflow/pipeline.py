"""The pipeline's shape, declared once: each stage's names, its command, its outputs, the config it reads.

`rloo <verb>` (rloo_workflow/cli.py) takes its default outputs from here, the Snakemake rules
(workflow/rules/*.smk) their output paths, MLflow its run names and output tags (rloo_workflow/tracking/);
`dvc.yaml` is compiled from the Snakemake DAG. tests/e2e/test_pipeline.py checks that all four agree.

Output templates use the config's folders (`{data}`, `{models}`, `{results}`: `paths.*`) and, for
the stages run once per advantage estimator, `{estimator}`; for the evaluation, run once per policy,
`{policy}` (Snakemake wildcards in the rules).

Variants (`Variant`): the chain again on a config with some keys changed, a seed of the `seeds` target
or a point of a sweep, its outputs in folders of its own (`SEED_FOLDER`, `SWEEP_FOLDER` below each of
`paths.*`, and below the work folder; `parse_variant` reads a folder back), so that each variant's jobs run, and resume, on their own. A
variant runs only the jobs it changes (`owns`); the others are the main chain's.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

from rloo.errors import InputError
from rloo.settings import Config
from rloo.train.identity import NOT_READ_BY_REWARD_MODEL
from rloo_workflow.config.selection import put, select, with_overrides

# What the functions below take: the typed config, or the validated dict the Snakefile (workflow/rules/*.smk)
# and the CLI hold, which each converts once (`Config.of`) and hands on typed.
ConfigLike = Config | Mapping[str, Any]


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

# The chain a variant runs again, in order, and what each of its stages reads of the others' outputs
# (`upstream`): a variant that changes a stage changes every stage downstream of it.
CHAIN = ("prepare", "base", "sft", "reward", "rloo", "evaluate", "judge", "report")
# The policies every result evaluates beside its trained one: the untrained start and the reference.
POLICIES = ("base", "sft")
# A variant's folder below each of paths.data, paths.models, paths.results and the work folder, by
# kind: a seed of the `seeds` target, a point of a sweep. The workflow's variant rules take it as one
# wildcard (`variant`, VARIANT_PATTERN) and read the variant back from it (`parse_variant`).
SEED_FOLDER = "seeds/seed{seed}"
SWEEP_FOLDER = "sweeps/{sweep}/{point}"
VARIANT_FOLDERS = {"seed": SEED_FOLDER, "sweep": SWEEP_FOLDER}
# The values the workflow accepts in a variant folder's fields (`point`: rloo_workflow.pipeline.point_id).
VARIANT_FIELDS = {"seed": r"\d+", "sweep": r"[A-Za-z0-9_]+", "point": r"p[0-9a-f]{8}"}


def _folder_regex(template: str, fields: dict[str, str] | None = None, named: bool = True) -> str:
    """`template` as a regex: each `{field}` its pattern in `fields` (default: one folder name)."""
    parts = re.split(r"\{(\w+)\}", template)  # literal, field, literal, ...
    return "".join(re.escape(p) if i % 2 == 0 else
                   f"({'?P<' + p + '>' if named else '?:'}{(fields or {}).get(p, '[^/]+')})"
                   for i, p in enumerate(parts))


# The variant folders the workflow's rules accept: the `variant` wildcard's constraint.
VARIANT_PATTERN = "|".join(_folder_regex(t, VARIANT_FIELDS, named=False) for t in VARIANT_FOLDERS.values())
# seeds.scope: the stages whose seed a seed of the `seeds` target sets. The evaluations follow RLOO's seed:
# the decoding noise of every policy a result compares is drawn from it, so the paired comparisons share
# it, and the spread across seeds holds the evaluation's noise too (docs/workflow.md#seeds).
SEED_SCOPES = {"rloo": ("rloo", "evaluate", "report"), "all": CHAIN}


@dataclass(frozen=True)
class Variant:
    """The chain on the config with `overrides` ({dotted key: value}) set, for the jobs it changes: those of
    the stages `roots` (they read a key it sets) and every job below one of them (`owns`); the other jobs
    are the main chain's (shared). `folder`: its outputs' folder below each of the config's folders;
    `label`: its MLflow run names' suffix (`rloo[seed=1]`)."""

    folder: str
    label: str
    overrides: dict[str, Any] = field(default_factory=dict)
    roots: frozenset[str] = frozenset()


def _pretrained(sections: Config) -> bool:
    """Whether the base stage starts from a model (a hub id, a folder, a GGUF file) rather than building
    the embedded one from the training texts."""
    return bool(sections.model.name_or_path or sections.model.gguf)


def reads_reward_model(cfg: ConfigLike, estimator: str | None = None) -> bool:
    """Whether the RLOO stage of `estimator` (default: the config's) reads the reward model: as its
    training reward, or as the start of PPO's critic."""
    sections = Config.of(cfg)
    estimator = estimator or sections.rloo.estimator
    return sections.reward.source == "model" or (
        estimator == "ppo" and sections.rloo.ppo.critic_init == "reward_model")


class Ref(NamedTuple):
    """An input of a job: output `output` of the job of `stage` for `estimator` (None: the reading job's own)
    and `policy` (an evaluation's: base, sft or an estimator)."""

    stage: str
    output: str
    estimator: str | None = None
    policy: str | None = None


def policy_model(policy: str) -> Ref:
    """The model folder an evaluation of `policy` reads: the base stage's, SFT's, or an estimator's RLOO policy."""
    return {"base": Ref("base", "model"), "sft": Ref("sft", "model")}.get(policy) or Ref("rloo", "model", policy)


# The input graph, declared once: each chain stage's named inputs, as outputs of the jobs that write them.
# The Snakemake rules take their inputs from it (`job_inputs`), `rloo <stage>` checks them before it runs
# (rloo_workflow/cli.py `_inputs_exist`), and a job's lineage (what reruns it:
# `lineage`) and the jobs a variant runs itself (`owns`) follow it.
def input_graph(stage: str, cfg: ConfigLike, estimator: str | None = None,
                policy: str | None = None) -> dict[str, Ref]:
    """{input name: Ref} of `stage`'s job (`estimator`: the RLOO stage's, when it is not the config's own;
    `policy`: an evaluation's). rloo reads the reward model only where it uses it, base the training texts
    only where it builds the embedded model from them, the report the judge's verdicts only where an LLM
    judges."""
    sections = Config.of(cfg)
    estimator = estimator or sections.rloo.estimator
    if stage == "prepare":
        return {}
    if stage == "base":
        return {} if _pretrained(sections) else {"train": Ref("prepare", "train")}
    if stage == "sft":
        return {"train": Ref("prepare", "train"), "test": Ref("prepare", "test"), "base": Ref("base", "model")}
    if stage == "reward":
        return {"train": Ref("prepare", "train"), "policy": Ref("sft", "model")}
    if stage == "rloo":
        reward = {"reward_model": Ref("reward", "model")} if reads_reward_model(sections, estimator) else {}
        return {**reward, "train": Ref("prepare", "train"), "val": Ref("prepare", "val"), "policy": Ref("sft", "model")}
    if stage == "evaluate":
        # SFT is every evaluation's tokenizer and KL reference, the reward model its proxy
        return {"reward_model": Ref("reward", "model"), "test": Ref("prepare", "test"),
                "manifest": Ref("prepare", "manifest"), "sft": Ref("sft", "model"),
                "policy": policy_model(policy or estimator)}
    if stage == "judge":
        return {"policy": Ref("evaluate", "records", policy=estimator), "sft": Ref("evaluate", "records", policy="sft")}
    if stage == "report":
        evaluations = {f"{name}{suffix}": Ref("evaluate", output, policy=policy)
                       for name, policy in (("base", "base"), ("sft", "sft"), ("policy", estimator))
                       for suffix, output in (("", "records"), ("_summary", "summary"))}
        judged = {"judged": Ref("judge", "result")} if sections.evaluate.judge == "llm" else {}
        # the trained policy's folder: its training metrics (the checkpoint selected, the alarms, the evals)
        return {**evaluations, **judged, "training": Ref("rloo", "model"), "manifest": Ref("prepare", "manifest")}
    raise KeyError(f"{stage} is not a stage of the chain ({', '.join(CHAIN)})")


def _node(stage: str, estimator: str | None, policy: str | None) -> tuple[str, str | None, str | None]:
    """A job as (stage, estimator, policy), with what does not tell its jobs apart left out: an evaluation is
    one per policy, whichever result reads it; the stages run once for all estimators have none."""
    if stage == "evaluate":
        return stage, None if policy in POLICIES else policy, policy
    return stage, estimator if STAGES[stage].per_estimator else None, None


def upstream_jobs(stage: str, cfg: ConfigLike, estimator: str | None = None,
                  policy: str | None = None) -> list[tuple[str, str | None, str | None]]:
    """The jobs (stage, estimator, policy) whose outputs `stage`'s job reads (`input_graph`), once each."""
    jobs = (_node(r.stage, r.estimator or estimator, r.policy)
            for r in input_graph(stage, cfg, estimator, policy).values())
    return list(dict.fromkeys(jobs))


def upstream(stage: str, cfg: ConfigLike, estimator: str | None = None, policy: str | None = None) -> tuple[str, ...]:
    """The chain stages whose outputs `stage` reads (`input_graph`), in chain order."""
    read = {job[0] for job in upstream_jobs(stage, cfg, estimator, policy)}
    return tuple(s for s in CHAIN if s in read)


def owns(variant: Variant | None, cfg: ConfigLike, stage: str, estimator: str | None = None,
         policy: str | None = None) -> bool:
    """Whether `variant` runs `stage`'s job itself: the stage reads a key it sets, or the job reads the
    output of a job it runs itself. So a sweep of rloo.lr runs rloo, the evaluation of its policy and the
    report, and reads the main chain's evaluations of the base model and of SFT."""
    if variant is None:
        return False
    if stage in variant.roots:
        return True
    return any(owns(variant, cfg, *job) for job in upstream_jobs(stage, cfg, estimator, policy))


def seed_variant(cfg: ConfigLike, seed: int | str) -> Variant:
    """Seed `seed` of the `seeds` target: the seed of the stages of `seeds.scope`, and of every stage
    downstream of them. (A non-numeric seed stays a string: the DVC compiler's template job.)"""
    sections = Config.of(cfg)
    value = int(seed) if str(seed).lstrip("-").isdigit() else seed
    # only the scope's stages that read the seed (a pretrained base does not); what follows them too (`owns`)
    roots = frozenset(s for s in SEED_SCOPES[sections.seeds.scope] if reads_key(sections, s, "seed"))
    return Variant(SEED_FOLDER.format(seed=seed), f"seed={seed}", {"seed": value}, roots)


def variant_fields(folder: str) -> tuple[str, dict[str, str]]:
    """(kind, fields) of a variant folder: `seeds/seed1` is ("seed", {"seed": "1"}), `sweeps/beta/p1234abcd`
    ("sweep", {"sweep": "beta", "point": "p1234abcd"}); any other folder is an error naming the forms.
    (A field may be any folder name here: the workflow's VARIANT_PATTERN narrows them.)"""
    for kind, template in VARIANT_FOLDERS.items():
        if m := re.fullmatch(_folder_regex(template), folder):
            return kind, m.groupdict()
    raise InputError(f"'{folder}' is not a variant folder: a seed's is {SEED_FOLDER}, a sweep point's {SWEEP_FOLDER}")


def parse_variant(cfg: ConfigLike, folder: str) -> Variant:
    """The variant whose folder is `folder` (`Variant.folder`): a seed (`seed_variant`) or a sweep's point
    (`sweep_variant`: an error for a sweep or point not in the config)."""
    kind, fields = variant_fields(folder)
    sections = Config.of(cfg)
    return (seed_variant(sections, fields["seed"]) if kind == "seed" else
            sweep_variant(sections, fields["sweep"], fields["point"]))


# Sweeps (`sweeps.<name>: {key.path: [values], ...}`): the grid's points, each a variant of the chain
# that reruns only the stages reading a key it sets.

def point_id(values: dict[str, Any]) -> str:
    """A short stable id of a point (its folder, and its DVC stage's name: DVC takes no `.`, `=` or `/`
    there); the JSON maps each id to its values and its readable label."""
    blob = json.dumps(values, sort_keys=True, separators=(",", ":"))
    return "p" + hashlib.sha256(blob.encode()).hexdigest()[:8]


def point_label(values: dict[str, Any]) -> str:
    """`rloo.beta=0.1,rloo.k=2`: the point as a person reads it (MLflow run names, the table)."""
    return ",".join(f"{k}={json.dumps(v) if not isinstance(v, str) else v}" for k, v in values.items())


def sweep_grid(cfg: ConfigLike, name: str) -> dict[str, dict[str, Any]]:
    """{point id: {key: value}}: the cartesian product of `sweeps.<name>`, in the order the grid lists it."""
    sweeps = Config.of(cfg).sweeps
    try:
        axes = sweeps[name]
    except KeyError:
        raise InputError(f"no sweep named '{name}' (config key sweeps.{name}); sweeps: "
                         f"{', '.join(sweeps) or 'none'}") from None
    keys = list(axes)
    return {point_id(p): p for p in (dict(zip(keys, combo, strict=True)) for combo in itertools.product(*axes.values()))}


def sweep_stages(cfg: ConfigLike, name: str) -> frozenset[str]:
    """The chain stages that read a key of sweep `name`: a point runs their jobs itself, and those below them."""
    sections = Config.of(cfg)
    keys = list(sections.sweeps[name])
    return frozenset(s for s in CHAIN if any(reads_key(sections, s, k) for k in keys))


def sweep_variant(cfg: ConfigLike, name: str, point: str) -> Variant:
    """Point `point` of sweep `name` as a variant of the chain; a point id not in the grid is an error
    naming the grid's points (never another point's values)."""
    sections = Config.of(cfg)
    points = sweep_grid(sections, name)
    if point not in points:
        raise InputError(f"sweep {name}: no point '{point}' in its grid (sweeps.{name}); points: {', '.join(points)}")
    values = points[point]
    return Variant(SWEEP_FOLDER.format(sweep=name, point=point), f"sweep={name},{point_label(values)}",
                   dict(values), sweep_stages(sections, name))


def folders(cfg: ConfigLike, variant: Variant | None = None) -> dict[str, str]:
    """The config's data, models and results folders (`paths.*`), or a variant's below each."""
    p = Config.of(cfg).paths
    base = {"data": p.data, "models": p.models, "results": p.results}
    return {k: f"{v}/{variant.folder}" for k, v in base.items()} if variant else base


def _owner(cfg: ConfigLike, stage: str, estimator: str | None, policy: str | None,
           variant: Variant | None) -> Variant | None:
    """The variant whose folders hold the job's outputs: `variant` where it runs the job itself, else the main chain."""
    return variant if owns(variant, cfg, stage, estimator, policy) else None


def outputs(stage: str, cfg: ConfigLike, estimator: str | None = None, variant: Variant | None = None,
            sweep: str | None = None, policy: str | None = None) -> dict[str, str]:
    """The output paths of `stage` under `cfg` (`estimator`: the config's rloo.estimator by default;
    `policy`: an evaluation's, by default the estimator's policy; `variant`: a seed's or sweep point's,
    where it runs the job itself; `sweep`: the sweep stage's name)."""
    sections = Config.of(cfg)
    est = estimator or sections.rloo.estimator
    f = folders(sections, _owner(cfg, stage, estimator, policy or est, variant))
    return {k: v.format(**f, estimator=est, sweep=sweep or "{sweep}", policy=policy or est)
            for k, v in STAGES[stage].outputs.items()}


def rule_outputs(stage: str, cfg: ConfigLike, folder: str | None = None) -> dict[str, str]:
    """The output paths for the Snakemake rule: config folders filled in, `{estimator}`, `{policy}` (and
    `{sweep}`) left wildcards; `folder`: a variant folder, or a template of one (`{variant}`: a wildcard too)."""
    f = folders(cfg, Variant(folder, "") if folder else None)
    return {k: v.format(**f, estimator="{estimator}", sweep="{sweep}", policy="{policy}")
            for k, v in STAGES[stage].outputs.items()}


def work_dir(stage: str, cfg: ConfigLike, estimator: str | None = None, variant: Variant | None = None) -> str:
    """Where a resumable stage keeps its checkpoints: outside its outputs, so a rerun resumes; a
    variant's below its own folder, so each seed or point resumes on its own."""
    sections = Config.of(cfg)
    name = STAGES[stage].name
    if STAGES[stage].per_estimator:
        name = f"{name}_{estimator or sections.rloo.estimator}"
    owner = _owner(cfg, stage, estimator, None, variant)
    return f"{sections.paths.results}/work/" + (f"{owner.folder}/" if owner else "") + name


def job_config(cfg: Mapping[str, Any], stage: str, variant: Variant | None = None, estimator: str | None = None,
               policy: str | None = None) -> Mapping[str, Any]:
    """The config `stage`'s job runs on: `cfg`, with the variant's keys set where it runs the job itself."""
    owner = _owner(cfg, stage, estimator, policy, variant)
    return with_overrides(dict(cfg), owner.overrides) if owner else cfg


def job_settings(cfg: Mapping[str, Any], stage: str, estimator: str | None = None,
                 variant: Variant | None = None, policy: str | None = None) -> dict:
    """What `stage`'s job reads of its config (`stage_keys`): the part a rule hands its command, and
    reruns on. The RLOO stage's estimator is the job's (a target's wildcard), else its config's."""
    jcfg = job_config(cfg, stage, variant, estimator, policy)
    estimator = estimator or Config.of(jcfg).rloo.estimator
    return stage_config(dict(jcfg), stage, {"rloo.estimator": estimator} if stage == "rloo" else None)


def job_inputs(cfg: Mapping[str, Any], stage: str, estimator: str | None = None,
               variant: Variant | None = None, policy: str | None = None) -> dict[str, str]:
    """{input name: path} of `stage`'s job (`input_graph`): each upstream output for the job's estimator,
    in the variant's folders where the variant runs that job itself, else the main chain's."""
    jcfg = job_config(cfg, stage, variant, estimator, policy)
    decide = estimator or Config.of(jcfg).rloo.estimator
    return {name: outputs(r.stage, cfg, r.estimator or estimator, variant, policy=r.policy)[r.output]
            for name, r in input_graph(stage, jcfg, decide, policy).items()}


def lineage(cfg: Mapping[str, Any], stage: str, code: Callable[[str], str], estimator: str | None = None,
            variant: Variant | None = None, policy: str | None = None) -> str:
    """`lineage:<digest>` of `stage`'s job: what it reads of the config (`job_settings`) and its code
    (`code(stage)`: its fingerprint), and the same of every job upstream of it, recursively. A rule's
    `lineage` param: a change anywhere above a job reruns it, whether or not the job in between still has
    its output (an interrupted rerun deletes it)."""
    return _lineage(cfg, _node(stage, estimator, policy), code, variant, {})


def _lineage(cfg: Mapping[str, Any], job: tuple[str, str | None, str | None], code: Callable[[str], str],
             variant: Variant | None, seen: dict) -> str:
    if job in seen:  # a job read by several below it (an evaluation of SFT, prepare's outputs)
        return seen[job]
    stage, estimator, policy = job
    jcfg = job_config(cfg, stage, variant, estimator, policy)
    decide = estimator or Config.of(jcfg).rloo.estimator
    parts = {"stage": stage, "policy": policy, "config": job_settings(cfg, stage, estimator, variant, policy),
             "code": code(stage),
             "upstream": sorted(_lineage(cfg, up, code, variant, seen)
                                for up in upstream_jobs(stage, jcfg, decide, policy))}
    blob = json.dumps(parts, sort_keys=True, separators=(",", ":"))
    seen[job] = "lineage:" + hashlib.sha256(blob.encode()).hexdigest()[:16]
    return seen[job]


def run_name(stage: str, estimator: str | None = None, policy: str | None = None, variant: str | None = None) -> str:
    """The MLflow run of a job: the stage, plus the estimator unless it is the default `rloo` (so that the
    default pipeline's runs read prepare, sft, reward, rloo, ..., report), and an evaluation's policy
    always (evaluate_base, evaluate_sft, evaluate_rloo); a variant's job adds its label: `rloo[seed=1]`,
    `sft[sweep=lr,sft.lr=0.001]`."""
    if STAGES[stage].per_policy:
        name = f"{stage}_{policy}" if policy else stage
    else:
        suffix = estimator if STAGES[stage].per_estimator else None
        name = stage if suffix in (None, "rloo") else f"{stage}_{suffix}"
    return f"{name}[{variant}]" if variant else name


def base_stage(run: str) -> str:
    """The stage of an MLflow run name (`rloo_grpo[seed=1]` -> `rloo`)."""
    return run.split("[", 1)[0].split("_", 1)[0]


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
    if stage == "base" and _pretrained(sections):
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
    return keys, excluded


def stage_config(cfg: dict, stage: str, overrides: dict[str, Any] | None = None) -> dict:
    """The part of `cfg` that `stage` reads (a copy; `stage_keys`), with {dotted key: value}
    `overrides` set on top. Snakemake passes a stage exactly this part (workflow/rules/common.smk), so a
    changed value reruns just the stages that read it; a stage run by hand logs it as MLflow parameters."""
    keys, excluded = stage_keys(cfg, stage, (overrides or {}).get("rloo.estimator"))
    part = select(cfg, keys)
    for key in excluded:
        *parents, leaf = key.split(".")
        node = part
        for name in parents:
            node = node.get(name, {})
        node.pop(leaf, None)
    for key, value in (overrides or {}).items():
        put(part, key, value)
    return part


def reads_key(cfg: ConfigLike, stage: str, key: str) -> bool:
    """Whether `stage` reads the dotted config `key` (or a key below it): a change of it reruns the stage."""
    keys, excluded = stage_keys(cfg, stage)

    def under(a: str, b: str) -> bool:
        return a == b or a.startswith(b + ".")

    return any(under(key, k) or under(k, key) for k in keys) and not any(under(key, e) for e in excluded)


def evaluated_policy(args: Any, cfg: ConfigLike) -> tuple[str, str]:
    """(name, folder) of the policy `rloo evaluate` evaluates, or whose result `rloo report` and `rloo
    judge` write: its --policy NAME=FOLDER, else the config's estimator and its RLOO output."""
    given = getattr(args, "policy", None)
    if isinstance(given, list):  # `rloo judge` takes several: it is named after the first
        given = given[0] if given else None
    if given:
        name, _, folder = given.partition("=")
        return name, folder
    estimator = Config.of(cfg).rloo.estimator
    return estimator, outputs("rloo", cfg, estimator)["model"]


def cli_outputs(args: Any, cfg: ConfigLike) -> dict[str, str]:
    """What `rloo <verb>` writes: its --out (and --plot/--plots) where given, else the declared outputs.
    The CLI writes there and MLflow tags exactly these paths with their md5."""
    sections = Config.of(cfg)
    stage = BY_VERB[args.stage]
    out = getattr(args, "out", None)
    if stage.name == "prepare":
        return {"data": out or folders(sections)["data"]}
    if stage.name == "evaluate":
        name, _ = evaluated_policy(args, sections)
        records = out or outputs("evaluate", sections, policy=name)["records"]
        return {"records": records, "summary": str(Path(records).with_suffix(".json"))}
    if stage.name == "report":
        name, _ = evaluated_policy(args, sections)
        result = out or outputs("report", sections, name)["result"]
        return {"result": result, "plots": getattr(args, "plots", None) or str(Path(result).with_suffix(""))}
    declared = outputs(stage.name, sections, sweep=getattr(args, "name", None))
    if stage.name == "judge":
        return {"result": out or outputs("judge", sections, evaluated_policy(args, sections)[0])["result"]}
    if "model" in declared:
        return {"model": out or declared["model"]}
    return {"result": out or declared["result"], "plot": getattr(args, "plot", None) or declared["plot"]}


def cli_run_name(args: Any, cfg: ConfigLike) -> str:
    """The MLflow run of `rloo <verb>`: see `run_name`."""
    sections = Config.of(cfg)
    stage = BY_VERB[args.stage]
    variant = getattr(args, "variant", None)
    if stage.name in ("evaluate", "report", "judge"):
        name, _ = evaluated_policy(args, sections)
        return run_name(stage.name, name, policy=name, variant=variant)
    return run_name(stage.name, sections.rloo.estimator, variant=variant)
