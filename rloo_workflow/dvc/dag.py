"""Why Snakemake would run a job (`rloo why-rerun`, and the stages `rloo dvc commit` leaves out), read off
Snakemake's own DAG in this process: the one module of rloo that uses Snakemake's internals. dvc.yaml is
compiled from the project's declaration instead (rloo_workflow/dvc/jobs.py).

Why internals: Snakemake's reason for a job (its Reason: a missing output, an updated input, changed
params) and the lock check it would make have no public route but the dry run's text. The DAG is built
with `snakemake.api` (public) and read off the objects behind it. Every attribute read beyond
`snakemake.api` and `snakemake.settings` goes through `attr()` or `call()` and is listed in INTERNALS
(`force_rerun` too, which the rules call while Snakemake builds its DAG): when a Snakemake upgrade removes
one or changes its arguments, the error names the call and the installed version. pyproject.toml allows
the Snakemake releases they were tested with, from the oldest (scripts/test_oldest_snakemake.sh, in CI) to
the newest 9.x; tests/integration/test_snakemake_api.py runs every call on a small workflow.
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

from rloo_workflow.dvc.dvcyaml import DvcError, dvc_rule
from rloo_workflow.dvc.jobs import Job, toposort

# Every Snakemake attribute this module uses beyond snakemake.api / snakemake.settings, by the class
# it is read from (WorkflowApi is snakemake.api's).
INTERNALS: dict[str, tuple[str, ...]] = {
    "WorkflowApi": ("_workflow",),
    "Workflow": ("_prepare_dag", "_build_dag", "dag", "persistence"),
    "Rule": ("name",),
    # forcefiles: the outputs whose jobs run whatever their records say (`force_rerun`)
    "DAG": ("jobs", "needrun", "reason", "forcefiles"),
    # why a job would run (plan); ParamsChange is what Reason.params_changed holds
    "Reason": ("missing_output", "updated_input", "updated_input_run", "params_changed", "code_changed",
               "input_changed", "software_stack_changed", "forced"),
    "ParamsChange": ("only_old", "only_new"),
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


@contextlib.contextmanager
def built_dag(root: Path, configfiles: list[str], targets: Iterable[str] = ()) -> Iterator[Any]:
    """Snakemake's workflow (`Workflow`) with its DAG built for the default target and `targets` (files or
    rule names), as a run would build it (not forced), in this process; cwd is `root` meanwhile."""
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
        wf_api.dag(DAGSettings(targets=frozenset({"all", *targets})))
        call("Workflow", workflow, "_prepare_dag", forceall=False, ignore_incomplete=True,
             lock_warn_only=True, nolock=True)
        call("Workflow", workflow, "_build_dag")
        yield workflow


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


def plan(root: Path, configfiles: list[str], targets: list[str] = ()) -> Plan:
    """Each job of the default target and `targets` that Snakemake would run, with its reason, and the lock
    Snakemake would check before it runs them (the DAG is built with
    `nolock`, so the check is asked here, of the same object Snakemake asks)."""
    out = []
    with built_dag(root, configfiles, targets=targets) as workflow:
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
