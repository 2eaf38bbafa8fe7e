"""Run-id files: how the evaluation, the pipeline run and a person find a stage's MLflow run.

Each stage writes `<runs dir>/<stage>.json` (`run_id`, `parent_run_id`, `experiment_id`, `status`, ...)
atomically when its run starts and again when it ends; the pipeline writes `<runs dir>/pipeline.json`.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import time
from pathlib import Path

from rloo.io import write_json_atomic
from rloo_workflow.tracking.store import display_uri

log = logging.getLogger("rloo_workflow.tracking")

ENV_RUNS_DIR = "RLOO_MLFLOW_RUNS_DIR"


def runs_dir(cfg: dict | None = None) -> Path:
    """RLOO_MLFLOW_RUNS_DIR when set (the pipeline exports it), else <paths.results>/runs."""
    if os.environ.get(ENV_RUNS_DIR):
        return Path(os.environ[ENV_RUNS_DIR])
    results = ((cfg or {}).get("paths") or {}).get("results") or "results"
    return Path(results) / "runs"


def write_record(path: Path, record: dict) -> None:
    """Write a run record; a failure is a warning, never the stage's failure."""
    try:
        write_json_atomic(path, record)
    except OSError as e:
        log.warning("could not write the run record %s: %s", path, e)


def recorded_runs(directory: str | Path | None = None) -> dict[str, dict]:
    """{stage or "pipeline": record} from the run-id files (empty if none were written)."""
    d = Path(directory) if directory is not None else runs_dir()
    out = {}
    for p in sorted(d.glob("*.json")) if d.is_dir() else []:
        with contextlib.suppress(OSError, json.JSONDecodeError):
            out[p.stem] = json.loads(p.read_text())
    return out


def new_record(stage: str, run_id: str, run_name: str, parent_run_id: str | None, experiment_id: str,
               experiment: str, uri: str) -> dict:
    """The record of a run just opened (status RUNNING); `uri` is recorded without its password."""
    return {
        "stage": stage,
        "run_id": run_id,
        "run_name": run_name,
        "parent_run_id": parent_run_id,
        "experiment_id": experiment_id,
        "experiment": experiment,
        "tracking_uri": display_uri(uri),
        "status": "RUNNING",
        "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
