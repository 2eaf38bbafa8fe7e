"""The pipeline's jobs for a config, from the project's own declaration (rloo_workflow.pipeline: the stages,
their inputs and outputs; rloo_workflow.commands: their commands), as the rules build them: what dvc.yaml
is compiled from (issue 70), with no Snakemake object read.

Every job the config can build (`universe`: the main chain for every estimator and evaluated policy, each
seed's and each sweep point's own jobs, the aggregates), each with its inputs, outputs and command; a
target (a file, `all`, an aggregate rule) or a DVC stage name picks jobs, and the jobs that make their
inputs come along (`declared_dag`)."""

from __future__ import annotations

import json
import os
import shlex
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import yaml

from rloo.code_fingerprint import PARAM_PREFIX
from rloo.settings import Config
from rloo_workflow.code_fingerprint import stage_code_param, stage_fingerprint
from rloo_workflow.commands import aggregate_options, chain_options, job_logs, local_inputs
from rloo_workflow.config import deep_merge, job_config_file, load_schema
from rloo_workflow.config import validate as validate_config
from rloo_workflow.config.schema import ConfigError
from rloo_workflow.dvc.dvcyaml import (
    DvcError,
    covers,
    dvc_rule,
    log,
    per_job,
    stage_name,
    variant_fields,
    variant_job,
    variant_rule,
)
from rloo_workflow.pipeline import (
    CHAIN,
    POLICIES,
    STAGES,
    Variant,
    job_config,
    job_inputs,
    job_settings,
    outputs,
    owns,
    parse_variant,
    rule_outputs,
    seed_variant,
    stage_config,
    sweep_grid,
    sweep_variant,
)

AGGREGATES = ("toy", "comparison", "seeds", "sweep")
# A wildcard value no real job has: the job built with it is the template of a foreach stage.
SENTINEL = "rlooitem0sentinel"


@dataclass
class Job:
    rule: str  # as DVC names it, with its wildcards (dvcyaml.dvc_rule: a variant rule's job by its kind)
    wildcards: dict[str, str]
    inputs: list[str]
    outputs: list[str]
    shellcmd: str
    cfg: str | None  # the config the job reads, as JSON (its `cfg` param, or the file that param names)
    needrun: bool = True
    cfg_file: str | None = None  # the file of its `cfg` param: its command's --job-config
    code: str | None = None  # the stage's code fingerprint (`code:<stage>:<digest>`: its `code` param, or its identity's part)
    benchmark: str | None = None
    identity: str | None = None  # a chain rule's `identity` param (`identity:<digest>`)

    @property
    def stage(self) -> str:
        return stage_name(self.rule, self.wildcards)


@dataclass
class Dag:
    jobs: list[Job]  # topological order, the `all` rule left out
    templates: dict[str, Job]  # rule -> its job for the SENTINEL wildcard value (rules with a wildcard)
    config: dict  # the resolved config Snakemake ran with


def toposort(jobs: list[Job]) -> list[Job]:
    """Jobs in dependency order (ties by rule order of first appearance, then stage name)."""
    by_stage = {j.stage: j for j in jobs}
    parents = {
        j.stage: {o.stage for o in jobs if o is not j and any(covers(out, i) for out in o.outputs for i in j.inputs)}
        for j in jobs
    }
    order: list[Job] = []
    done: set[str] = set()
    rank = {name: i for i, name in enumerate(dict.fromkeys(j.rule for j in jobs))}
    while len(order) < len(jobs):
        ready = sorted((s for s in by_stage if s not in done and parents[s] <= done),
                       key=lambda s: (rank[by_stage[s].rule], s))
        if not ready:
            raise DvcError("the jobs form a cycle")
        # one at a time, so that a rule's jobs follow its parents as early as possible
        done.add(ready[0])
        order.append(by_stage[ready[0]])
    return order


def resolved_config(root: Path, configfiles: Iterable[str]) -> dict:
    """The config a `snakemake --configfile FILES` run holds: config/config.yaml with each file laid over it
    (as Snakemake reads them), validated and its defaults filled in (workflow/rules/common.smk)."""
    cfg: dict = {}
    paths = [Path(root) / "config" / "config.yaml", *(Path(root) / f for f in configfiles)]
    try:
        for path in paths:
            cfg = deep_merge(cfg, yaml.safe_load(path.read_text()) or {})
        return validate_config(cfg, source=" + ".join(os.path.relpath(p, root) for p in paths))
    except OSError as e:
        raise DvcError(f"{e.filename}: {e.strerror}") from e
    except (yaml.YAMLError, ConfigError) as e:
        raise DvcError(str(e)) from e


class Jobs:
    """The jobs of one config (`universe`), built as the rules build them."""

    def __init__(self, cfg: dict):
        self.cfg = cfg
        self.s = Config.of(cfg)
        self.estimator = self.s.rloo.estimator
        self.estimators = load_schema()["properties"]["rloo"]["properties"]["estimator"]["enum"]

    # -- one job -----------------------------------------------------------------------------------------
    def chain(self, stage: str, estimator: str | None = None, policy: str | None = None,
              variant: Variant | None = None) -> Job:
        """The job of chain rule `stage` (`<stage>_variant` for a variant's): `estimator`, the wildcard of
        rloo, judge and report; `policy`, an evaluation's."""
        cfg = self.cfg
        wildcards = ({"estimator": estimator} if stage in ("rloo", "judge", "report") and not variant else {})
        wildcards = {**({"variant": variant.folder} if variant else {}), **wildcards,
                     **({"policy": policy} if stage == "evaluate" else {})}
        est = None if variant else estimator
        inputs: dict[str, str | list[str]] = dict(job_inputs(cfg, stage, est, variant, policy))
        extra = local_inputs(stage, cfg)
        inputs = {**(extra if stage == "prepare" else {}), **inputs, **({} if stage == "prepare" else extra)}
        named = estimator if not variant else self.estimator
        outs = {k: v.format(estimator=named, policy=policy, variant=variant.folder if variant else "")
                for k, v in rule_outputs(stage, cfg, "{variant}" if variant else None).items()}
        settings = job_settings(cfg, stage, est, variant, policy)
        cfg_file = job_config_file(stage, settings)
        options = chain_options(stage, cfg, {k: v for k, v in inputs.items() if isinstance(v, str)}, outs, cfg_file,
                                est, variant, policy)
        logs = job_logs(stage, cfg, named, policy, variant.folder if variant else None)
        jcfg = job_config(cfg, stage, variant, est, policy)
        return self._job(stage if not variant else f"{stage}_variant", wildcards, inputs, outs, options, logs,
                         settings, cfg_file, f"{PARAM_PREFIX}{stage}:{stage_fingerprint(stage, dict(jcfg)).digest}")

    def aggregate(self, stage: str, sweep: str | None = None) -> Job:
        """The job of an aggregate rule: toy, comparison, seeds, sweep (`sweep`: its name)."""
        cfg = self.cfg
        outs = outputs(stage, cfg, sweep=sweep)
        records: dict[str, str] = {}
        if stage == "comparison":
            compared = list(self.s.comparison.estimators)
            results = {e: self.chain("report", e).outputs[0] for e in compared}
            records = {e: self._evaluate_records(e) for e in compared}
        elif stage == "seeds":
            results = {str(v): self._result(seed_variant(cfg, v)) for v in self.s.seeds.values}
        elif stage == "sweep":
            results = {p: self._result(sweep_variant(cfg, sweep, p)) for p in sweep_grid(cfg, sweep)}
        else:
            results = {}
        inputs = {"results": list(results.values()), "records": list(records.values()), **local_inputs(stage, cfg)}
        cfg_file = job_config_file(stage, stage_config(cfg, stage))
        options = aggregate_options(stage, cfg, outs, cfg_file, results, records=records, sweep=sweep)
        return self._job(stage, {"sweep": sweep} if sweep else {}, inputs, outs, options,
                         job_logs(stage, cfg, sweep=sweep), stage_config(cfg, stage), cfg_file,
                         stage_code_param(stage, cfg))

    def _evaluate_records(self, policy: str) -> str:
        return self.chain("evaluate", policy=policy).outputs[0]

    def _result(self, variant: Variant) -> str:
        return self.chain("report", variant=variant).outputs[0]

    def _job(self, rule: str, wildcards: dict, inputs: dict, outs: dict, options: list[str], logs: dict,
             settings: dict, cfg_file: str, code: str) -> Job:
        stage = rule.removesuffix("_variant")
        cmd = f"rloo {STAGES[stage].verb} {shlex.join(options)}"
        if "judge_log" in logs and stage == "judge":
            cmd += f" --judge-log {shlex.quote(logs['judge_log'])}"
        flat = [p for v in inputs.values() for p in ([v] if isinstance(v, str) else v)]
        rule, wildcards = dvc_rule(rule, wildcards)
        return Job(rule=rule, wildcards=wildcards, inputs=list(dict.fromkeys(flat)), outputs=list(outs.values()),
                   shellcmd=cmd, cfg=json.dumps(settings, sort_keys=True, separators=(",", ":")),
                   cfg_file=cfg_file, code=code, benchmark=logs["benchmark"])

    # -- every job --------------------------------------------------------------------------------------
    def variants(self) -> list[Variant]:
        seeds = [seed_variant(self.cfg, v) for v in self.s.seeds.values]
        return seeds + [sweep_variant(self.cfg, n, p) for n in self.s.sweeps for p in sweep_grid(self.cfg, n)]

    def universe(self) -> list[Job]:
        """Every job this config can build: the main chain for each estimator and evaluated policy, each
        variant's own jobs (those it runs itself: rloo_workflow.pipeline.owns), and the aggregates."""
        jobs = [self.chain(s) for s in ("prepare", "base", "sft", "reward")]
        jobs += [self.chain(s, e) for e in self.estimators for s in ("rloo", "judge", "report")]
        jobs += [self.chain("evaluate", policy=p) for p in [*POLICIES, *self.estimators]]
        for v in self.variants():
            for stage in CHAIN:
                for policy in ([*POLICIES, self.estimator] if stage == "evaluate" else [None]):
                    if owns(v, self.cfg, stage, None, policy):
                        jobs.append(self.chain(stage, policy=policy, variant=v))
        jobs += [self.aggregate(s) for s in ("toy", "comparison", "seeds")]
        jobs += [self.aggregate("sweep", n) for n in self.s.sweeps]
        return jobs


def _foreign(cfg: dict, name: str) -> str | None:
    """The sweep of DVC stage `name` where this config does not define it (given once with --config), else None."""
    from rloo.errors import InputError

    rule, _, value = name.partition("@") if "@" in name else name.partition("-")
    try:
        if variant_rule(rule):
            parse_variant(cfg, variant_job(rule, value, ("policy",) if rule.startswith("evaluate_") else ())[1]["variant"])
        elif rule == "sweep":
            sweep_grid(cfg, value)
    except (InputError, ValueError, KeyError):
        return variant_fields(variant_job(rule, value, ())[1]["variant"])[1].get("sweep", value) \
            if variant_rule(rule) else value
    return None


_SAID: set[str] = set()


def declared_dag(root: Path, configfiles: list[str], stages: Iterable[str] = (), targets: Iterable[str] = (),
                 default: bool = True) -> Dag:
    """The jobs of the default target (unless not `default`), of `targets` (files or rule names) and of
    `stages` (DVC stage names), with every job above them; stage names this config has no job of are
    dropped with a message (the caller compares the result with dvc.yaml)."""
    root = Path(root)
    cwd = Path.cwd()
    os.chdir(root)  # the rules' paths are relative to the project
    try:
        cfg = resolved_config(root, configfiles)
        build = Jobs(cfg)
        universe = build.universe()
        by_stage = {j.stage: j for j in universe}
        wanted: list[Job] = []
        if default or "all" in targets:  # the Snakefile's default rule: the config's estimator's results, the toy experiment
            wanted += [by_stage[f"report@{build.estimator}"], by_stage["toy"]]
        for t in (t for t in targets if t != "all"):
            found = [j for j in universe if t in (j.rule, *j.outputs) or any(covers(o, t) for o in j.outputs)]
            wanted += found[:1]
        foreign: dict[str, list[str]] = {}
        for name in stages:
            if name in by_stage:
                wanted.append(by_stage[name])
            elif (sweep := _foreign(cfg, name)) is not None:
                foreign.setdefault(sweep, []).append(name)
            else:
                rule, _, value = name.partition("@") if "@" in name else name.partition("-")
                problem = (f"rule {rule} does not accept {value!r}" if any(j.rule == rule for j in universe)
                           else f"no rule {rule} in the workflow any more")
                log(f"stage {name}: {problem}; dropped")
        if foreign:
            line = (f"left as they are: the stages of {', '.join(f'sweeps.{s}' for s in sorted(foreign))}, a sweep "
                    "this config does not define (given with --config?): "
                    f"{', '.join(n for ns in foreign.values() for n in ns)}")
            if line not in _SAID:
                _SAID.add(line)
                log(line)
        producers = {o: j for j in universe for o in j.outputs}
        jobs: dict[str, Job] = {}
        todo = list(wanted)
        while todo:
            job = todo.pop()
            if job.stage in jobs:
                continue
            jobs[job.stage] = job
            todo += [producers[i] for i in job.inputs if i in producers]
        templates = {}
        for job in jobs.values():
            if job.wildcards and not per_job(job.wildcards) and job.rule not in templates:
                templates[job.rule] = _template(build, job.rule)
        order = {r: i for i, r in enumerate([*CHAIN, *AGGREGATES])}
        listed = sorted(jobs.values(), key=lambda j: (order.get(j.rule.split("_")[0], 99), j.stage))
        return Dag(jobs=toposort(listed), templates=templates, config=json.loads(json.dumps(cfg)))
    finally:
        os.chdir(cwd)


def _template(build: Jobs, rule: str) -> Job:
    """The job of `rule` (as DVC names it) for the SENTINEL wildcard value: a foreach stage's template."""
    if variant_rule(rule):
        return build.chain(rule.rpartition("_")[0], variant=seed_variant(build.cfg, SENTINEL))
    return build.chain(rule, SENTINEL)
