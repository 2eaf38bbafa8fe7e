"""The Snakemake DAG, read in this process through Snakemake's Python API: the one module of rloo
that uses Snakemake's internals.

Why internals: no public route gives what dvc.yaml needs. The CLI describes a DAG as rule names and
edges (`--dag`, `--d3dag`); `--summary`/`--detailed-summary` show shell commands and inputs from the
records of the last run (none on a fresh clone, none for a job not run yet); the dry-run log shows
jobs as text. None gives each job's wildcards, inputs, outputs, benchmark file and formatted shell
command, and none builds the job for a wildcard value that no target asks for (the template of a
`foreach` stage). So the DAG is built with `snakemake.api` (public) and read off the objects behind
it. Every attribute read beyond `snakemake.api` and `snakemake.settings` goes through `attr()` or
`call()` and is listed in INTERNALS (`force_rerun` too, which the rules call while Snakemake builds
its DAG): when a Snakemake upgrade removes one or changes its arguments,
the error names the call and the installed version. `rerun_reasons` reads Snakemake's reason for running a
job the same way (`rloo why-rerun`). pyproject.toml allows the Snakemake releases they were tested with, from
the oldest (scripts/test_oldest_snakemake.sh, in CI) to the newest 9.x; tests/integration/test_snakemake_api.py
runs every call on a small workflow.
"""

from __future__ import annotations

import ast
import contextlib
import inspect
import json
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from importlib.metadata import PackageNotFoundError, requires, version
from pathlib import Path
from typing import Any

from rloo_workflow.dvc.dvcyaml import (
    VARIANT_WILDCARD,
    DvcError,
    covers,
    dvc_rule,
    log,
    per_job,
    stage_name,
    variant_job,
    variant_rule,
)

# A wildcard value no real job has: the job built with it is the template of a foreach stage.
SENTINEL = "rlooitem0sentinel"

# Every Snakemake attribute this module uses beyond snakemake.api / snakemake.settings, by the class
# it is read from (WorkflowApi is snakemake.api's; IOFile is what Rule.get_some_product returns).
INTERNALS: dict[str, tuple[str, ...]] = {
    "WorkflowApi": ("_workflow",),
    "Workflow": ("get_rule", "_prepare_dag", "_build_dag", "dag", "async_run", "config", "persistence"),
    "Rule": ("name", "wildcard_names", "get_some_product", "get_wildcards"),
    "IOFile": ("apply_wildcards",),
    # forcefiles: the outputs whose jobs run whatever their records say (`force_rerun`)
    "DAG": ("jobs", "needrun", "job_factory", "_jobid", "reason", "forcefiles"),
    # why a job would run (rerun_reasons); ParamsChange is what Reason.params_changed holds
    "Reason": ("missing_output", "updated_input", "updated_input_run", "params_changed", "code_changed",
               "input_changed", "software_stack_changed", "forced"),
    "ParamsChange": ("only_old", "only_new"),
    "JobFactory": ("new",),
    # another run's lock (.snakemake/locks): whether Snakemake would refuse this DAG, and any lock at all
    "Persistence": ("locked", "_read_locks"),
    "Job": ("rule", "wildcards_dict", "input", "output", "shellcmd", "params", "benchmark"),
}
USED: set[tuple[str, str]] = set()  # what attr() has read in this process (the canary test's check)


class SnakemakeApiError(DvcError):
    """A Snakemake internal this module uses is gone or takes other arguments."""


def _broken(owner: str, name: str, why: str) -> SnakemakeApiError:
    return SnakemakeApiError(
        f"Snakemake {version('snakemake')}: {owner}.{name} {why}. rloo_workflow/dvc/dag.py builds dvc.yaml through "
        f"it and is tested with the Snakemake releases rloo declares ({tested_range()})")


def tested_range() -> str:
    """The Snakemake releases rloo is tested with: its declared dependency (pyproject.toml, one place)."""
    try:
        spec = next(r for r in requires("rloo") or [] if re.match(r"snakemake\s*[<>=!~]", r))
    except (PackageNotFoundError, StopIteration):
        return "see pyproject.toml"
    return spec.split(";")[0].strip()


def attr(owner: str, obj: Any, name: str) -> Any:
    """`obj.name`, a Snakemake internal declared in INTERNALS[owner]."""
    if name not in INTERNALS.get(owner, ()):
        raise DvcError(f"{owner}.{name} is not declared in rloo_workflow.dvc.dag.INTERNALS")
    USED.add((owner, name))
    try:
        return getattr(obj, name)
    except AttributeError as e:
        raise _broken(owner, name, f"is gone ({e})") from e


def call(owner: str, obj: Any, name: str, *args: Any, **kwargs: Any) -> Any:
    """`obj.name(*args, **kwargs)`, its arguments checked against the installed signature first."""
    fn = attr(owner, obj, name)
    try:
        inspect.signature(fn).bind(*args, **kwargs)
    except TypeError as e:
        raise _broken(owner, name, f"takes other arguments ({e})") from e
    except ValueError:  # no signature to check
        pass
    return fn(*args, **kwargs)


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


def _flat(items) -> list[str]:
    out: list[str] = []
    for item in items:
        if isinstance(item, list | tuple):
            out.extend(_flat(item))
        else:
            out.append(str(item))
    return list(dict.fromkeys(out))


def _rule_name(job) -> str:
    return attr("Rule", attr("Job", job, "rule"), "name")


def _wildcards(job) -> dict[str, str]:
    return {k: str(v) for k, v in dict(attr("Job", job, "wildcards_dict")).items()}


def _cfg(param: Any) -> tuple[str | None, str | None]:
    """(the config a job reads, as JSON text; the file its `cfg` param names, where it names one: a job's
    --job-config, rloo_workflow.config.job_config_file)."""
    if param is None:
        return None, None
    path = Path(str(param))
    if path.suffix == ".json" and path.is_file():  # its keys in one order, whoever wrote the file
        return json.dumps(json.loads(path.read_text()), sort_keys=True, separators=(",", ":")), str(param)
    return str(param), None


def _identity_code(param: Any) -> str | None:
    """The code part of a chain rule's `identity` param, as a `code` param (`code:<stage>:<digest>`): its
    parts, kept by digest where the DAG was built (rloo_workflow.code_fingerprint.save_identity)."""
    from rloo.code_fingerprint import PARAM_PREFIX
    from rloo_workflow.code_fingerprint import load_identity

    if not str(param).startswith("identity:"):
        return None
    parts = load_identity(Path.cwd(), str(param).removeprefix("identity:"))
    return f"{PARAM_PREFIX}{parts['stage']}:{parts['code']}" if parts else None


def _job(job, needrun: bool) -> Job:
    params = attr("Job", job, "params")
    cfg, cfg_file = _cfg(params.get("cfg") if hasattr(params, "get") else None)
    code = params.get("code") if hasattr(params, "get") else None
    if code is None and hasattr(params, "get"):
        code = _identity_code(params.get("identity"))
    benchmark = attr("Job", job, "benchmark")
    rule, wildcards = dvc_rule(_rule_name(job), _wildcards(job))
    return Job(
        rule=rule,
        wildcards=wildcards,
        inputs=_flat(attr("Job", job, "input")),
        outputs=_flat(attr("Job", job, "output")),
        shellcmd=attr("Job", job, "shellcmd") or "",
        cfg=cfg,
        cfg_file=cfg_file,
        needrun=needrun,
        code=str(code) if code is not None else None,
        benchmark=str(benchmark) if benchmark else None,
        identity=str(params.get("identity")) if hasattr(params, "get") and params.get("identity") else None,
    )


def foreach(job: Job) -> bool:
    """Whether `job`'s rule is a foreach stage: one wildcard, whose value is all that tells its jobs apart."""
    return bool(job.wildcards) and not per_job(job.wildcards)


def _other_wildcards(workflow, rule_name: str) -> tuple[str, ...]:
    """The wildcards of a variant rule (DVC's `<stage>_seed`, `<stage>_sweep`) besides its variant folder."""
    if (name := variant_rule(rule_name)) is None:
        return ()
    rule = call("Workflow", workflow, "get_rule", name)
    return tuple(n for n in attr("Rule", rule, "wildcard_names") if n != "variant")


def _of_this_config(workflow, stages: Iterable[str]) -> list[str]:
    """`stages` less those of a sweep this config does not define (its points' and its table's): a sweep
    given to one run with --config left them in dvc.yaml and dvc.lock, and their outputs on disk (in
    folders of their own, which no other job reads). They are left as they are, and one line says so; a
    run with that sweep again finds them up to date."""
    from rloo.errors import InputError
    from rloo_workflow.pipeline import parse_variant, sweep_grid, variant_fields

    config = attr("Workflow", workflow, "config")
    kept, foreign = [], {}
    for name in stages:
        rule, _, value = name.partition("@") if "@" in name else name.partition("-")
        variant = variant_job(rule, value, _other_wildcards(workflow, rule)) if variant_rule(rule) else None
        try:
            if variant:
                parse_variant(config, variant[1][VARIANT_WILDCARD])
            elif rule == "sweep":  # the table of sweep `value`
                sweep_grid(config, value)
        except InputError:
            sweep = variant_fields(variant[1][VARIANT_WILDCARD])[1]["sweep"] if variant else value
            foreign.setdefault(sweep, []).append(name)
            continue
        kept.append(name)
    line = (f"left as they are: the stages of {', '.join(f'sweeps.{s}' for s in sorted(foreign))}, a sweep this "
            f"config does not define (given with --config?): {', '.join(n for ns in foreign.values() for n in ns)}")
    if foreign and line not in _SAID:  # once a process: a commit builds the DAG twice
        _SAID.add(line)
        log(line)
    return kept


_SAID: set[str] = set()


def _stage_target(workflow, name: str) -> str | None:
    """An output file of DVC stage `name` (`rule` or `rule@value`), or None (with a message) when the
    workflow no longer has the rule or the rule does not accept the value."""
    # `rule@value` (a foreach stage's item) or `rule-value-value` (a stage per job: dvcyaml.stage_name)
    rule_name, _, value = name.partition("@") if "@" in name else name.partition("-")
    problem = f"no rule {rule_name} in the workflow any more"
    try:
        # a variant rule's: `rloo_seed@1` is rloo_variant's seeds/seed1, `evaluate_seed-1-sft` evaluate_variant's
        # seeds/seed1 and policy sft
        variant = variant_job(rule_name, value, _other_wildcards(workflow, rule_name))
        rule = call("Workflow", workflow, "get_rule", variant[0] if variant else rule_name)
        product = call("Rule", rule, "get_some_product")
        if product is None:
            return None
        problem = f"does not match rule {rule_name}"
        if variant:
            wildcards = variant[1]
        else:
            # the values in the order the wildcards appear in the output path (see dvcyaml.stage_name)
            names = sorted(attr("Rule", rule, "wildcard_names"), key=lambda n: str(product).find("{" + n))
            values = value.split("-", len(names) - 1) if value else []
            wildcards = dict(zip(names, values, strict=True)) if value else {}
        target = call("IOFile", product, "apply_wildcards", wildcards) if wildcards else str(product)
        problem = f"rule {rule_name} does not accept {value!r}"
        accepted = call("Rule", rule, "get_wildcards", target) is not None
    except SnakemakeApiError:
        raise
    except Exception:
        accepted = False
    if not accepted:
        log(f"stage {name}: {problem}; dropped")
        return None
    return str(target)


def _template(workflow, dag, rule_name: str) -> Job:
    """The job of `rule_name` (as DVC names it: `Job.rule`) for the SENTINEL wildcard value."""
    variant = variant_job(rule_name, SENTINEL)  # a seed's: the variant rule's job of folder seeds/seed<SENTINEL>
    rule = call("Workflow", workflow, "get_rule", variant[0] if variant else rule_name)
    names = attr("Rule", rule, "wildcard_names")
    if len(names) != 1:
        raise DvcError(f"rule {rule_name}: only rules with one wildcard are supported")
    wildcards = variant[1] if variant else {next(iter(names)): SENTINEL}
    target = call("IOFile", call("Rule", rule, "get_some_product"), "apply_wildcards", wildcards)
    # Built directly (the wildcard constraints would refuse the sentinel), with a job id so that its
    # shell command can be formatted.
    factory = attr("DAG", dag, "job_factory")
    job = call("Workflow", workflow, "async_run",
               call("JobFactory", factory, "new", rule, dag, wildcards_dict=wildcards, targetfile=target))
    jobids = attr("DAG", dag, "_jobid")
    jobids.setdefault(job, len(jobids))
    return _job(job, True)


@contextlib.contextmanager
def built_dag(root: Path, configfiles: list[str], targets: Iterable[str] = (), stages: Iterable[str] = (),
              forceall: bool = True, default: bool = True) -> Iterator[Any]:
    """Snakemake's workflow (`Workflow`) with its DAG built for the default target (unless not
    `default`), `targets` (files or rule names) and `stages` (DVC stage names; those the workflow no
    longer has are dropped with a message), in this process; cwd is `root` meanwhile."""
    from snakemake.api import SnakemakeApi
    from snakemake.settings.types import (
        ConfigSettings,
        DAGSettings,
        OutputSettings,
        Quietness,
        ResourceSettings,
    )

    root = Path(root).resolve()
    output = OutputSettings(quiet={Quietness.ALL}, enable_file_logging=False)
    with SnakemakeApi(output) as api:
        wf_api = api.workflow(
            resource_settings=ResourceSettings(cores=1),
            config_settings=ConfigSettings(configfiles=[Path(c).resolve() for c in configfiles]),
            snakefile=root / "Snakefile",
            workdir=root,
        )
        workflow = attr("WorkflowApi", wf_api, "_workflow")
        stages = _of_this_config(workflow, stages)
        wanted = {*(["all"] if default else []), *targets} | {t for s in stages if (t := _stage_target(workflow, s))}
        wf_api.dag(DAGSettings(targets=frozenset(wanted), forceall=forceall))
        call("Workflow", workflow, "_prepare_dag", forceall=forceall, ignore_incomplete=True,
             lock_warn_only=True, nolock=True)
        call("Workflow", workflow, "_build_dag")
        yield workflow


def snakemake_dag(root: Path, configfiles: list[str], stages: list[str] = (), targets: list[str] = (),
                  forceall: bool = True, default: bool = True) -> Dag:
    """The jobs of the Snakemake default target (unless not `default`), of `targets` (files or rule names)
    and of `stages` (DVC stage names), through Snakemake's API, in this process (cwd must stay `root`
    meanwhile).

    Stage names whose rule no longer exists, or whose wildcard value the rule no longer accepts, are
    dropped with a message (the caller compares the result with dvc.yaml). `forceall=False` computes
    which jobs Snakemake would run (`Job.needrun`)."""
    with built_dag(root, configfiles, targets=targets, stages=stages, forceall=forceall, default=default) as workflow:
        dag = attr("Workflow", workflow, "dag")
        jobs = [_job(j, bool(call("DAG", dag, "needrun", j))) for j in attr("DAG", dag, "jobs")
                if _rule_name(j) != "all" and attr("Job", j, "output")]
        templates = {rule: _template(workflow, dag, rule) for rule in sorted({j.rule for j in jobs if foreach(j)})}
        config = json.loads(json.dumps(attr("Workflow", workflow, "config")))
    return Dag(jobs=toposort(jobs), templates=templates, config=config)


def force_rerun(workflow, outputs: Iterable[str]) -> None:
    """Have the jobs of `outputs` run in the DAG `workflow` is building, as `--forcerun` would, and with
    them everything below them. Called from an input function (workflow/rules/common.smk: a stale job,
    one of whose inputs is missing): Snakemake builds a job's inputs before it decides what to run, and
    has no public way for a workflow to add to what it forces."""
    dag = attr("Workflow", workflow, "dag")
    attr("DAG", dag, "forcefiles").update(str(o) for o in outputs)


@dataclass
class Rerun:
    """Why Snakemake would run a job again (its Reason, read off): `params_before` / `params_now` are
    the job's params that differ from its outputs' records (a code fingerprint, a config)."""

    job: Job
    missing: list[str]
    updated_inputs: list[str]
    rebuilt_inputs: list[str]
    params_before: list[str]
    params_now: list[str]
    shell_changed: bool
    inputs_changed: bool
    software_changed: bool
    words: str  # Snakemake's own sentence for it
    forced: bool = False  # forced to run (force_rerun: an input it was made from is missing)


def _unrepr(values: Iterable[Any]) -> list[str]:
    """Snakemake records a param as its repr(): the values back, as text."""
    out = []
    for v in values:
        with contextlib.suppress(ValueError, SyntaxError):
            v = ast.literal_eval(v) if isinstance(v, str) else v
        out.append(v if isinstance(v, str) else json.dumps(v))
    return sorted(out)


@dataclass
class Plan:
    """What a run would do (`reruns`), and whether another run's lock stands in its way: `locked` when
    Snakemake would refuse it (its LockException: the DAG's files are locked), `lock_held` when any lock
    is held in the working folder, on this DAG's files or others."""

    reruns: list[Rerun]
    locked: bool
    lock_held: bool


def rerun_reasons(root: Path, configfiles: list[str], targets: list[str] = ()) -> list[Rerun]:
    """Each job of the default target and `targets` that Snakemake would run, with its reason."""
    return plan(root, configfiles, targets).reruns


def plan(root: Path, configfiles: list[str], targets: list[str] = ()) -> Plan:
    """`rerun_reasons`, and the lock Snakemake would check before it runs them (the DAG is built with
    `nolock`, so the check is asked here, of the same object Snakemake asks)."""
    out = []
    with built_dag(root, configfiles, targets=targets, forceall=False) as workflow:
        persistence = attr("Workflow", workflow, "persistence")
        locked = bool(attr("Persistence", persistence, "locked"))
        lock_held = any(True for _ in call("Persistence", persistence, "_read_locks"))
        dag = attr("Workflow", workflow, "dag")
        for j in attr("DAG", dag, "jobs"):
            if _rule_name(j) == "all" or not attr("Job", j, "output") or not call("DAG", dag, "needrun", j):
                continue
            reason = call("DAG", dag, "reason", j)
            params = attr("Reason", reason, "params_changed")
            rebuilt = _flat(attr("Reason", reason, "updated_input_run") or ())
            out.append(Rerun(
                job=_job(j, True),
                missing=_flat(attr("Reason", reason, "missing_output") or ()),
                updated_inputs=[f for f in _flat(attr("Reason", reason, "updated_input") or ()) if f not in rebuilt],
                rebuilt_inputs=rebuilt,
                params_before=_unrepr(attr("ParamsChange", params, "only_old")) if params else [],
                params_now=_unrepr(attr("ParamsChange", params, "only_new")) if params else [],
                shell_changed=bool(attr("Reason", reason, "code_changed")),
                inputs_changed=bool(attr("Reason", reason, "input_changed")),
                software_changed=bool(attr("Reason", reason, "software_stack_changed")),
                words=str(reason),
                forced=bool(attr("Reason", reason, "forced")),
            ))
    by_stage = {r.job.stage: r for r in out}
    return Plan(reruns=[by_stage[j.stage] for j in toposort([r.job for r in out])], locked=locked,
                lock_held=lock_held)


def run_stages(workflow) -> list[str]:
    """The DVC stages of the jobs of a running workflow's DAG (`workflow` of a Snakefile's onsuccess)."""
    dag = attr("Workflow", workflow, "dag")
    return sorted({stage_name(_rule_name(j), _wildcards(j)) for j in attr("DAG", dag, "jobs")
                   if _rule_name(j) != "all" and attr("Job", j, "output")})


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
