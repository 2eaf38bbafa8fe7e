"""The pipeline's shape: the stages (declared once in the library, rloo/stages.py: names, command, outputs,
the config keys each reads), the input graph between them, their outputs' folders and the variants.

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

from rloo.code_fingerprint import Fingerprint
from rloo.errors import InputError
from rloo.identity import Identity, folder_identity, job_identity
from rloo.settings import Config
from rloo.settings.selection import with_overrides
from rloo.stages import (  # noqa: F401 (the declaration, re-exported: the workflow reads it as pipeline.*)
    BY_VERB,
    EVALUATE_KEYS,
    PLUGIN_REWARDS,
    STAGES,
    ConfigLike,
    Stage,
    pretrained_start,
    reads_key,
    stage_config,
    stage_keys,
)

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
# (rloo_workflow/cli.py `_inputs_exist`), and a job's identity (what reruns it:
# `identity`) and the jobs a variant runs itself (`owns`) follow it.
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
        return {} if pretrained_start(sections) else {"train": Ref("prepare", "train")}
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


def identity(cfg: Mapping[str, Any], stage: str, code: Callable[[str, Mapping[str, Any]], Fingerprint],
             estimator: str | None = None, variant: Variant | None = None, policy: str | None = None) -> Identity:
    """The identity of `stage`'s job (rloo.identity.job_identity) as Snakemake sees it before any output
    exists: what it reads of its config, its code (`code(stage, job config)`: its fingerprint) and the
    identities of the jobs above it, computed the same way, recursively. A rule's `identity` param: a change
    anywhere above a job reruns it, whether or not the job in between still has its output (an interrupted
    rerun deletes it). The job records it in its output (`input_identity` reads it back there)."""
    return _identity(cfg, _node(stage, estimator, policy), code, variant, {})


def _identity(cfg: Mapping[str, Any], job: tuple[str, str | None, str | None],
              code: Callable[[str, Mapping[str, Any]], Fingerprint], variant: Variant | None, seen: dict) -> Identity:
    if job in seen:  # a job read by several below it (an evaluation of SFT, prepare's outputs)
        return seen[job]
    stage, estimator, policy = job
    jcfg = job_config(cfg, stage, variant, estimator, policy)
    decide = estimator or Config.of(jcfg).rloo.estimator
    upstream = {name: _identity(cfg, _node(r.stage, r.estimator or estimator, r.policy), code, variant, seen).rerun
                for name, r in input_graph(stage, jcfg, decide, policy).items()}
    seen[job] = job_identity(jcfg, stage, upstream=upstream, code=code(stage, jcfg),
                             overrides={"rloo.estimator": decide} if stage == "rloo" else None)
    return seen[job]


def input_identity(cfg: Mapping[str, Any], stage: str, folders: Mapping[str, str | Path],
                   code: Fingerprint | None = None) -> Identity:
    """The identity of `stage`'s job run on given inputs (`rloo <verb>`, and a rule's job as it runs):
    `folders` ({stage: the folder it reads of that stage's outputs}: the data folder for prepare's), each
    one's recorded identity, else its content's digest (rloo.identity.folder_identity), and `code` (default:
    the stage's fingerprint, rloo_workflow/code_fingerprint.py). Equal to `identity` where the inputs were
    made by the jobs of the same config."""
    from rloo_workflow.code_fingerprint import stage_fingerprint

    sections = Config.of(cfg)
    upstream = {name: folder_identity(folders[r.stage]) for name, r in input_graph(stage, sections).items()
                if folders.get(r.stage) is not None}
    return job_identity(sections, stage, upstream=upstream, code=code or stage_fingerprint(stage, dict(cfg)),
                        overrides={"rloo.estimator": sections.rloo.estimator} if stage == "rloo" else None)


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


def cli_identity(args: Any, cfg: ConfigLike) -> Identity:
    """The identity of the job `rloo <verb>` runs (`input_identity`): its inputs' recorded identities, from
    its options, else the declared folders; an evaluation's policy is its --policy folder."""
    sections = Config.of(cfg)
    stage = BY_VERB[args.stage].name
    data = getattr(args, "data", None) or folders(sections)["data"]
    given = {"base": getattr(args, "base", None), "sft": getattr(args, "policy", None) if stage != "evaluate" else
             getattr(args, "sft", None), "reward": getattr(args, "reward_model", None)}
    found = {s: given.get(s) or outputs(s, sections)["model"] for s in ("base", "sft", "reward")}
    if stage == "evaluate":
        found["rloo"] = evaluated_policy(args, sections)[1]
    return input_identity(sections.to_config(), stage, {**found, "prepare": data})


def cli_run_name(args: Any, cfg: ConfigLike) -> str:
    """The MLflow run of `rloo <verb>`: see `run_name`."""
    sections = Config.of(cfg)
    stage = BY_VERB[args.stage]
    variant = getattr(args, "variant", None)
    if stage.name in ("evaluate", "report", "judge"):
        name, _ = evaluated_policy(args, sections)
        return run_name(stage.name, name, policy=name, variant=variant)
    return run_name(stage.name, sections.rloo.estimator, variant=variant)
