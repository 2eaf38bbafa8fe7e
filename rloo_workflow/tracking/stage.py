"""A stage's MLflow run, from its parameters to its artifacts; a no-op when no run is active.

Stages call `log_metrics(...)` as they go, so library code and tests never need a tracking server. The
CLI wraps every stage in `stage_run`, which opens the stage's run (a child of the pipeline's run when
`RLOO_MLFLOW_PARENT_RUN_ID` is set, else a top-level run), logs the stage's parameters and provenance
tags, and, once the stage is done, its artifacts (see artifacts.py). Tracking never fails a stage.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import stat
import sys
import tempfile
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import rloo_workflow.tracking.store as store  # not `from rloo_workflow.tracking import store`: that init imports this module
from rloo.train.run_log import RunLog
from rloo_workflow.tracking.artifacts import WEIGHT_SUFFIXES, artifact_files
from rloo_workflow.tracking.params import config_params, config_part, flatten, leaf_keys
from rloo_workflow.tracking.provenance import dvc_lock_md5s, dvc_md5, identity_tags, rel_path, tag_path
from rloo_workflow.tracking.records import new_record, recorded_runs, runs_dir
from rloo_workflow.tracking.redact import redact

if TYPE_CHECKING:
    from rloo.identity import Identity
from rloo_workflow.tracking.run import Run, open_run

log = logging.getLogger("rloo_workflow.tracking")

_active: Run | None = None  # the stage run of this process, set by stage_run


def active_run_id() -> str | None:
    return _active.run_id if _active is not None else None


def log_metrics(metrics: dict[str, Any], step: int | None = None) -> None:
    """Log the numeric, finite metrics of the active stage run at `step` (no-op without a run).

    The key "step" and non-numeric or non-finite values are skipped; booleans log as 0/1.
    """
    if _active is None:
        return
    _active.log_metrics(metrics, step)


def set_tags(tags: dict[str, str]) -> None:
    """Tag the active stage run (no-op without a run)."""
    if _active is not None:
        _active.set_tags(tags)


def replay_history(records: list[dict], resumed_from: int) -> None:
    """A resumed stage's run gets the metrics of the steps before its checkpoint (kept in the checkpoint),
    so that one run holds the whole history; tagged with the step it resumed from."""
    if _active is None:
        return
    _active.set_tags({"rloo.resumed_from_step": str(resumed_from)})
    _active.log_records(records)


# A training loop's log (rloo.train.run_log): this process's stage run.
STAGE_LOG = RunLog(metrics=log_metrics, history=replay_history, tags=set_tags)


def _redirected_log() -> Path | None:
    """The file this process's stderr (else stdout) is redirected to: Snakemake's `> {log} 2>&1`."""
    for fd in (2, 1):
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                continue
            target = Path(os.readlink(f"/proc/self/fd/{fd}"))
        except OSError:
            continue
        if target.is_file():
            return target
    return None


def _stage_base(stage: str) -> str:
    """The declared stage of a run name: `rloo_grpo` -> rloo, `evaluate[seed=1]` -> evaluate."""
    from rloo_workflow.pipeline import base_stage

    return base_stage(stage)


def _start_stage_run(cfg: dict, stage: str, keys: list[str] | None, outputs: list[Path],
                     identity: Identity | None = None) -> Run:
    from rloo_workflow.config import config_hash
    from rloo_workflow.pipeline import STAGES, stage_config

    uri = store.tracking_uri(cfg)
    if down := store.unanswered(uri):  # a server that does not answer costs this one short call
        raise ConnectionError(f"the tracking server does not answer: {down}")
    parent = os.environ.get(store.ENV_PARENT, "").strip() or None
    client = None
    experiment_id = None
    if parent:
        client = store.mlflow_client(uri)
        try:
            experiment_id = client.get_run(parent).info.experiment_id
        except Exception as e:
            if store.timed_out(e):  # not a missing run: a server that stopped answering
                raise
            log.warning("MLflow: parent run %s not found at %s (%s); this stage gets a top-level run",
                        parent, store.display_uri(uri), e)
            parent = None
    if experiment_id is None:
        experiment_id = store.ensure_experiment(uri, store.experiment_name(cfg))
        client = client or store.mlflow_client(uri)
    # Under Snakemake `keys` are those its rule passed (see `cli_context`), which decide whether it
    # reruns; run by hand, a stage's parameters are what it reads of the config, plus name and threads.
    if keys is None and _stage_base(stage) in STAGES:
        keys = ["name", "threads", *leaf_keys(stage_config(cfg, _stage_base(stage)))]
    tags = {
        "rloo.stage": stage,
        "config_hash": config_hash(cfg),
        "config_hash_stage": config_hash(config_part(cfg, keys)),
        "rloo.outputs": json.dumps([rel_path(p) for p in outputs]),
    }
    if parent:
        tags["parent_run_id"] = parent
    # Lineage: the latest run of each stage declared before this one (the runs that made its inputs, from
    # the run-id files). It lives here, not in the outputs, which must not change with tracking on or off.
    order = [s for s in STAGES if s != "toy"]
    base = _stage_base(stage)
    earlier = order[: order.index(base)] if base in order else []
    tags.update({f"rloo.upstream.{name}": rec["run_id"] for name, rec in recorded_runs(runs_dir(cfg)).items()
                 if rec.get("run_id") and _stage_base(name) in earlier})
    if base in STAGES:
        try:
            tags |= identity_tags(cfg, base, identity)
        except (OSError, ValueError, SyntaxError) as e:  # a reward file that does not parse: the stage says so
            log.warning("MLflow: no identity tags for stage %s: %s", stage, e)
    run_id = open_run(client, experiment_id, stage, "stage", parent, tags)
    experiment = store.experiment_name(cfg)
    with contextlib.suppress(Exception):
        experiment = client.get_experiment(experiment_id).name
    record = new_record(stage, run_id, stage, parent, experiment_id, experiment, uri)
    run = Run(client, run_id, stage, record, runs_dir(cfg) / f"{stage}.json")
    run.write_record()
    run.log_params(config_params(cfg, keys))
    return run


def _finish_stage_run(run: Run, cfg: dict, outputs: list[Path], log_file: Path | None, ok: bool) -> None:
    """Artifacts (the outputs' metrics JSON and plots, curves, the log), output md5 tags, config.

    A failed stage logs only its log and config: whatever lies at its output paths is not its work.
    """
    with contextlib.suppress(Exception):
        sys.stdout.flush()
        sys.stderr.flush()
    tags: dict[str, str] = {}
    manifest: dict[str, Any] = {}
    locked = dvc_lock_md5s(Path.cwd())
    for out in outputs if ok else []:
        out = Path(out)
        if not out.exists():
            continue
        rel = rel_path(out)
        try:
            digest, files = dvc_md5(out)
        except OSError as e:
            log.warning("MLflow: could not hash %s: %s", out, e)
            continue
        key = tag_path(rel)
        tags[f"dvc.md5.{key}"] = digest
        if rel in locked:
            tags[f"dvc.lock.{key}"] = "match" if locked[rel] == digest else f"differs ({locked[rel]})"
        for name, info in files.items():
            if Path(name).suffix.lower() in WEIGHT_SUFFIXES:
                tags[f"md5.{key}/{name}" if out.is_dir() else f"md5.{key}"] = info["md5"]
        manifest[rel] = {"dvc_md5": digest, "files": files}
        for f in artifact_files(out):
            if out.is_dir():
                sub = f.parent.relative_to(out).as_posix()
                run.log_file(f, f"outputs/{out.name}" + ("" if sub == "." else f"/{sub}"))
            else:
                run.log_file(f, "outputs")
    if ok and _stage_base(run.name) == "evaluate":
        _log_policy(run, outputs)
    if ok and _stage_base(run.name) == "report":
        _log_evaluation(run, outputs)
    if manifest:
        run.log_text(json.dumps(manifest, indent=2), "provenance/outputs.json")
    run.log_text(json.dumps(redact(cfg), indent=2), "provenance/config.json")
    if tags:
        run.set_tags(tags)
    if ok and run.history:
        _log_curves(run)
    if log_file is not None and Path(log_file).is_file():
        run.log_file(Path(log_file), "logs", name=f"{run.name}.log")


def _log_policy(run: Run, outputs: list[Path]) -> None:
    """One policy's evaluation figures (rloo.eval.records' summary, `<policy>.json`) as metrics of its run:
    evaluate/<metric>."""
    for out in outputs:
        if out.suffix == ".json" and out.is_file():
            with contextlib.suppress(OSError, json.JSONDecodeError, KeyError):
                figures = flatten(json.loads(out.read_text())["figures"])
                run.log_metrics({f"evaluate/{k.replace('.', '/')}": v for k, v in figures.items()}, 0)


def _log_evaluation(run: Run, outputs: list[Path]) -> None:
    """The report's results as metrics: evaluate/<policy>/<metric>, evaluate/win_rate/<policy>/*, and
    each policy's gain over SFT with its interval (rloo.eval.gains.gain_metrics: gain/sampled, ...)."""
    for out in outputs:
        if out.suffix == ".json" and out.is_file():
            try:
                result = json.loads(out.read_text())
            except (OSError, json.JSONDecodeError):
                continue
            policies = flatten(result.get("policies") or {})
            wins = flatten(result.get("win_rates") or {})
            metrics = {f"evaluate/{k.replace('.', '/')}": v for k, v in policies.items()}
            metrics |= {f"evaluate/win_rate/{k.replace('.', '/')}": v for k, v in wins.items()}
            metrics |= gain_metrics(result.get("gains") or {})
            if base := result.get("base"):  # evaluate/base/<metric> and gain_over_base/<policy>/<mode>...
                metrics |= {f"evaluate/base/{k.replace('.', '/')}": v for k, v in flatten(base["policy"]).items()}
                metrics |= gain_metrics(base["gains"], prefix="gain_over_base/", always_named=True)
            run.log_metrics(metrics, 0)


def gain_metrics(gains: dict[str, dict], prefix: str = "gain/", always_named: bool = False) -> dict[str, float]:
    """MLflow metrics of the gains: gain/<mode>, gain/<mode>_ci95_lo, _ci95_hi, _p_value for one trained
    policy; gain/<policy>/<mode>... when there are several (or `always_named`)."""
    out = {}
    for name, g in gains.items():
        head = prefix if len(gains) == 1 and not always_named else f"{prefix}{name}/"
        for mode in ("sampled", "greedy"):
            m = g[mode]
            out |= {f"{head}{mode}": m["gain"], f"{head}{mode}_ci95_lo": m["ci95"][0],
                    f"{head}{mode}_ci95_hi": m["ci95"][1], f"{head}{mode}_p_value": m["p_value"]}
    return out


def _log_curves(run: Run) -> None:
    """plots/curves.png: the run's metric curves (matplotlib only now, and a failure only a warning)."""
    with tempfile.TemporaryDirectory(prefix="rloo-curves-") as tmp:
        try:
            from rloo.eval.plots import plot_curves

            curves = plot_curves(run.history, run.name, Path(tmp) / "curves.png")
        except Exception as e:
            log.warning("MLflow: could not draw the metric curves: %s", e)
            return
        if curves is not None:
            run.log_file(Path(curves), "plots")


@contextlib.contextmanager
def stage_run(
    cfg: dict,
    stage: str,
    *,
    outputs: Iterable[str | os.PathLike] = (),
    keys: Iterable[str] | None = None,
    log_file: str | os.PathLike | None = None,
    identity: Identity | None = None,
) -> Iterator[Run | None]:
    """Run a stage inside an MLflow run named `stage` (yields it; None when tracking is off).

    A child of RLOO_MLFLOW_PARENT_RUN_ID when set, else a top-level run in the config's experiment.
    `outputs` (files or folders) are hashed into `dvc.md5.<path>` tags and their metrics JSON and
    PNG plots logged; `keys` are the config keys logged as params (default: the stage's, see
    STAGE_KEYS); `log_file` (default: the file stderr is redirected to) is logged, redacted; `identity`: the
    job's (rloo.identity; default: its keys and code alone), tagged with its parts (`identity_tags`).
    The run ends FINISHED, FAILED on an exception, KILLED on preemption or interrupt.
    """
    global _active
    if not store.enabled(cfg):
        yield None
        return
    outputs = [Path(p) for p in outputs]
    keys = list(keys) if keys is not None else None
    try:
        run = _start_stage_run(cfg, stage, keys, outputs, identity)
    except Exception as e:
        log.warning("MLflow: could not start a run for stage %s at %s (%s); running untracked",
                    stage, store.display_uri(store.tracking_uri(cfg)), e)
        yield None
        return
    log_path = Path(log_file) if log_file is not None else _redirected_log()
    previous, _active = _active, run
    status = "FAILED"
    try:
        yield run
        status = "FINISHED"
    except (KeyboardInterrupt, SystemExit) as e:
        status = "FINISHED" if isinstance(e, SystemExit) and e.code in (0, None) else "KILLED"
        raise
    finally:
        _active = previous
        try:
            _finish_stage_run(run, cfg, outputs, log_path, ok=status == "FINISHED")
        except Exception as e:
            log.warning("MLflow: could not log the artifacts of stage %s: %s", stage, e)
        run.end(status)


def cli_context(args: Any, cfg: dict, stage: str | None = None) -> dict:
    """stage_run's arguments for `rloo <stage>`: the run's name, its outputs, the config keys given.

    Under Snakemake a stage gets only the keys its rule passes (--job-config, --set): those are its
    parameters. Run by hand (no --job-config), the stage's declared keys are used. Names and outputs
    come from the pipeline's declaration (rloo_workflow/pipeline.py), as the CLI's do. (`stage` is ignored.)
    """
    from rloo_workflow import pipeline

    ctx: dict[str, Any] = {"stage": pipeline.cli_run_name(args, cfg),
                           "outputs": list(pipeline.cli_outputs(args, cfg).values())}
    if getattr(args, "job_config", None):
        keys: list[str] = []
        with contextlib.suppress(Exception):
            from rloo_workflow.config import read_job_config

            keys += leaf_keys(read_job_config(args.job_config))
        with contextlib.suppress(Exception):
            from rloo_workflow.config import parse_set

            keys += leaf_keys(parse_set(getattr(args, "set", None) or []))
        ctx["keys"] = sorted(set(keys))
    return ctx
