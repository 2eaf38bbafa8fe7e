"""Experiment tracking (MLflow): one parent run per pipeline invocation, one child run per stage.

Why MLflow at all: a person audits a result by opening its run (parameters, per-step metrics, the
outputs' md5, the log) without rerunning anything. One module per job, each owned on its own:

    redact       secrets out of params, tags and text artifacts
    params       the config as params (flat, redacted, only the stage's keys)
    store        the store's URI, its lock, the experiment; whether tracking is on
    provenance   git commit, host, Slurm job, DVC-style md5 of each output
    records      <paths.results>/runs/<stage>.json: where each run's id is recorded
    artifacts    which output files become artifacts, and their scrubbed text
    run          an open run whose every MLflow call is redacted and never fails the stage
    stage        stage_run / log_metrics: a stage's run (the CLI wraps every stage in it)
    pipeline     start_pipeline / end_pipeline: the parent run, opened by Snakemake's main process

Everything the rest of the package and the tests use is re-exported here: `tracking.stage_run`.
"""

from __future__ import annotations

from rloo_workflow.tracking.artifacts import (
    ARTIFACT_NAMES,
    ARTIFACT_SUFFIXES,
    MAX_ARTIFACT_BYTES,
    MAX_LOG_BYTES,
    TEXT_SUFFIXES,
    WEIGHT_SUFFIXES,
)
from rloo_workflow.tracking.params import NOT_PARAMS, config_params, config_part, flatten
from rloo_workflow.tracking.parent_run import PIPELINE_RUN_NAME, end_pipeline, start_pipeline
from rloo_workflow.tracking.provenance import DVC_IGNORED, dvc_md5, git_info, host_tags
from rloo_workflow.tracking.records import ENV_RUNS_DIR, recorded_runs, runs_dir
from rloo_workflow.tracking.redact import REDACTED, is_secret_key, redact, redact_text, redact_value
from rloo_workflow.tracking.stage import (
    STAGE_LOG,
    active_run_id,
    cli_context,
    log_metrics,
    replay_history,
    set_tags,
    stage_run,
)
from rloo_workflow.tracking.store import (
    DEFAULT_EXPERIMENT,
    DEFAULT_URI,
    ENV_ENABLED,
    ENV_PARENT,
    display_uri,
    enabled,
    ensure_experiment,
    experiment_name,
    tracking_uri,
)

__all__ = [
    "ARTIFACT_NAMES",
    "ARTIFACT_SUFFIXES",
    "DEFAULT_EXPERIMENT",
    "DEFAULT_URI",
    "DVC_IGNORED",
    "ENV_ENABLED",
    "ENV_PARENT",
    "ENV_RUNS_DIR",
    "MAX_ARTIFACT_BYTES",
    "MAX_LOG_BYTES",
    "NOT_PARAMS",
    "PIPELINE_RUN_NAME",
    "REDACTED",
    "STAGE_LOG",
    "TEXT_SUFFIXES",
    "WEIGHT_SUFFIXES",
    "active_run_id",
    "cli_context",
    "config_params",
    "config_part",
    "display_uri",
    "dvc_md5",
    "enabled",
    "end_pipeline",
    "ensure_experiment",
    "experiment_name",
    "flatten",
    "git_info",
    "host_tags",
    "is_secret_key",
    "log_metrics",
    "recorded_runs",
    "redact",
    "redact_text",
    "redact_value",
    "replay_history",
    "runs_dir",
    "set_tags",
    "stage_run",
    "start_pipeline",
    "tracking_uri",
]
