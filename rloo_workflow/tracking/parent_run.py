"""The pipeline's run: one parent per `snakemake` invocation, so a person finds all its stages together.

Opened by `start_pipeline` in Snakemake's `onstart` handler (the main process only; never for dry runs)
and closed by `end_pipeline` in `onsuccess`/`onerror` (workflow/rules/tracking.smk), or at exit when
neither ran. It exports to the jobs, through the environment:

    MLFLOW_TRACKING_URI        the store (a relative SQLite path made absolute)
    RLOO_MLFLOW_PARENT_RUN_ID  the pipeline run's id (the jobs' runs are its children)
    RLOO_MLFLOW_RUNS_DIR       where each stage records its run id (<paths.results>/runs)
    RLOO_TRACKING=0            when the workflow's config disables tracking (`rloo <stage>` honours
                               RLOO_TRACKING=0/1 over its config's tracking.enabled)
"""

from __future__ import annotations

import atexit
import contextlib
import json
import logging
import os
import sys
from pathlib import Path
from typing import Any

import rloo_workflow.tracking.store as store  # not `from rloo_workflow.tracking import store`: that init imports this module
from rloo_workflow.tracking.params import config_params
from rloo_workflow.tracking.records import ENV_RUNS_DIR, new_record, recorded_runs
from rloo_workflow.tracking.redact import redact_text
from rloo_workflow.tracking.run import Run, open_run

log = logging.getLogger("rloo_workflow.tracking")

PIPELINE_RUN_NAME = "pipeline"

_pipeline: Run | None = None  # the pipeline run opened by start_pipeline in this process


def start_pipeline(
    config: dict,
    *,
    results_dir: str | os.PathLike | None = None,
    name: str = PIPELINE_RUN_NAME,
    argv: list[str] | None = None,
    extra_tags: dict[str, str] | None = None,
) -> str | None:
    """Open the pipeline's run and export its id to the jobs (see module docstring); return the id.

    Creates the store and the experiment first, so the jobs never race on them. Returns None (and
    exports RLOO_TRACKING=0) when tracking is disabled; on an MLflow error it warns and returns None.
    """
    global _pipeline
    if not store.enabled(config):
        os.environ[store.ENV_ENABLED] = "0"
        return None
    uri = store.tracking_uri(config)
    results = Path(results_dir or ((config.get("paths") or {}).get("results") or "results")).resolve()
    os.environ[ENV_RUNS_DIR] = str(results / "runs")
    try:
        if down := store.unanswered(uri):  # a server that does not answer costs this one short call
            raise ConnectionError(f"the tracking server does not answer: {down}")
        experiment_id = store.ensure_experiment(uri, store.experiment_name(config))
        client = store.mlflow_client(uri)
        from rloo_workflow.config import config_hash

        command = " ".join(argv if argv is not None else sys.argv)
        tags = {
            "config_hash": config_hash(config),
            "config_name": str(config.get("name", "")),
            "snakemake.command": redact_text(command)[:8000],
            **(extra_tags or {}),
        }
        with contextlib.suppress(Exception):
            from snakemake import __version__ as smk_version

            tags["snakemake.version"] = smk_version
        run_id = open_run(client, experiment_id, name, "pipeline", None, tags)
    except Exception as e:
        log.warning("MLflow: could not open the pipeline run at %s (%s); stages log top-level runs",
                    store.display_uri(uri), e)
        print(f"rloo: MLflow pipeline run not created ({e})", file=sys.stderr)
        return None
    record = new_record("pipeline", run_id, name, None, experiment_id, store.experiment_name(config), uri)
    _pipeline = Run(client, run_id, name, record, results / "runs" / "pipeline.json")
    _pipeline.write_record()
    _pipeline.log_params(config_params(config))
    os.environ["MLFLOW_TRACKING_URI"] = uri
    os.environ[store.ENV_PARENT] = run_id
    atexit.register(_end_pipeline_at_exit)
    ui = f"mlflow ui --backend-store-uri {uri}" if uri.startswith("sqlite:") else store.display_uri(uri)
    print(f"rloo: MLflow pipeline run {run_id} (experiment '{store.experiment_name(config)}', "
          f"id {experiment_id}); to browse: {ui}", file=sys.stderr)
    return run_id


def end_pipeline(status: str = "FINISHED", snakemake_log: Any = None) -> None:
    """Close the pipeline run opened by start_pipeline in this process (FINISHED, FAILED, KILLED).

    `snakemake_log`: the `log` Snakemake hands its handlers (a path, or a list of paths).
    """
    global _pipeline
    run, _pipeline = _pipeline, None
    if run is None:
        return
    try:
        children = recorded_runs(Path(os.environ.get(ENV_RUNS_DIR, "")) if os.environ.get(ENV_RUNS_DIR) else None)
        stages = {k: v.get("run_id") for k, v in children.items()
                  if k != "pipeline" and v.get("parent_run_id") == run.run_id}
        run.log_text(json.dumps(stages, indent=2), "provenance/stage_runs.json")
        logs = snakemake_log if isinstance(snakemake_log, list | tuple) else [snakemake_log]
        for f in [Path(p) for p in logs if p]:
            if f.is_file():
                run.log_file(f, "logs", name=f.name if f.suffix == ".log" else f"{f.name}.log")
    except Exception as e:
        log.warning("MLflow: could not log the pipeline's artifacts: %s", e)
    run.end(status)


def _end_pipeline_at_exit() -> None:
    if _pipeline is not None:  # neither onsuccess nor onerror ran: interrupted
        end_pipeline("KILLED")
