"""An MLflow run this process opened, behind calls that never fail the stage.

Every call goes through `_safe`, and a tracker that fails cannot stall the stage: after the first
failed call (one warning) the run stops calling the server. Its metrics are kept and sent again once,
when the stage ends (`end`), unless that call got no reply in time (a server that is stopped or
overloaded would make the resend wait as long again); if they are not sent, the run's record says
how many metric values are missing there and why, and the stage's own files (steps.jsonl,
history.json) hold them all. Over HTTP each call is bounded (store.mlflow_client: two tries of 5 s at
most) so that even the first failure costs seconds, not MLflow's default minutes. Everything logged is redacted first; the run keeps a
copy of its metric history for the curves drawn at the end.
"""

from __future__ import annotations

import logging
import math
import shutil
import tempfile
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import rloo_workflow.tracking.store as store  # not `from rloo_workflow.tracking import store`: that init imports this module
from rloo_workflow.tracking.artifacts import (
    MAX_ARTIFACT_BYTES,
    TEXT_SUFFIXES,
    WEIGHT_SUFFIXES,
    redacted_file_text,
)
from rloo_workflow.tracking.provenance import base_tags
from rloo_workflow.tracking.records import write_record
from rloo_workflow.tracking.redact import redact_text, redact_value

log = logging.getLogger("rloo_workflow.tracking")


class Run:
    """A run this process opened: its client, id, and a copy of the metric history (for plots)."""

    def __init__(self, client, run_id: str, name: str, record: dict, record_path: Path | None):
        self.client = client
        self.run_id = run_id
        self.name = name
        self.record = record
        self.record_path = record_path
        self.history: dict[str, list[tuple[int, float]]] = defaultdict(list)
        self.failures = 0
        self.offline = False  # set by the first failed call: nothing more is sent until `end`
        self.timed_out = False  # that call got no reply in time: `end` does not ask again
        self.pending: list = []  # metrics not sent while offline, sent again by `end`

    def _safe(self, what: str, fn, *args, **kwargs):
        if self.offline:
            return None
        try:
            return fn(*args, **kwargs)
        except Exception as e:
            self.failures += 1
            self.offline = True
            self.timed_out = store.timed_out(e)
            then = "not sent again: it did not reply in time" if self.timed_out else "sent again when it ends"
            log.warning("MLflow: could not %s for run %s (%s); the stage stops waiting on the tracking store: its "
                        "metrics stay in the stage's own files and are %s", what, self.run_id, e, then)
            return None

    def log_metrics(self, metrics: dict, step: int | None) -> None:
        self.log_records([{**metrics, "step": step}])

    def log_records(self, records: list[dict]) -> None:
        """Each record's numeric, finite metrics at its "step", in as few MLflow calls as MLflow allows."""
        from mlflow.entities import Metric

        ts = int(time.time() * 1000)
        batch = []
        for rec in records:
            step = int(rec["step"]) if rec.get("step") is not None else 0
            for key, value in rec.items():
                if key == "step" or isinstance(value, str) or value is None:
                    continue
                try:
                    v = float(value)
                except (TypeError, ValueError):
                    continue
                if not math.isfinite(v):
                    continue
                batch.append(Metric(str(key), v, ts, step))
                self.history[str(key)].append((step, v))
        for i in range(0, len(batch), 1000):  # MLflow's limit per log_batch
            if not self.offline:
                self._safe("log metrics", self.client.log_batch, self.run_id, metrics=batch[i : i + 1000])
            if self.offline:  # this call failed, or an earlier one: keep the rest for `end`
                self.pending.extend(batch[i:])
                return

    def log_params(self, params: dict[str, str]) -> None:
        from mlflow.entities import Param

        items = [Param(k, v) for k, v in params.items()]
        for i in range(0, len(items), 100):
            self._safe("log params", self.client.log_batch, self.run_id, params=items[i : i + 100])

    def set_tags(self, tags: dict[str, str]) -> None:
        from mlflow.entities import RunTag

        items = [RunTag(k[:250], str(redact_value(k, v))[:8000]) for k, v in tags.items()]
        for i in range(0, len(items), 100):
            self._safe("set tags", self.client.log_batch, self.run_id, tags=items[i : i + 100])

    def log_file(self, path: Path, artifact_dir: str | None, name: str | None = None) -> None:
        """Upload one file; text is redacted first (a scrubbed copy is uploaded, never the original)."""
        path = Path(path)
        if path.suffix.lower() in WEIGHT_SUFFIXES:
            return
        size = path.stat().st_size
        if size > MAX_ARTIFACT_BYTES:
            log.warning("MLflow: %s is %d MB; not logged as an artifact", path, size >> 20)
            return
        name = name or path.name
        with tempfile.TemporaryDirectory(prefix="rloo-artifact-") as tmp:
            dst = Path(tmp) / name
            if path.suffix.lower() in TEXT_SUFFIXES:
                dst.write_text(redacted_file_text(path), encoding="utf-8")
            else:
                shutil.copyfile(path, dst)
            self._safe(f"log artifact {path}", self.client.log_artifact, self.run_id, str(dst), artifact_dir)

    def log_text(self, text: str, artifact_file: str) -> None:
        self._safe(f"log {artifact_file}", self.client.log_text, self.run_id, redact_text(text), artifact_file)

    def write_record(self, **changes: Any) -> None:
        self.record.update(changes)
        if self.record_path is not None:
            write_record(self.record_path, self.record)

    def end(self, status: str) -> None:
        if self.offline and not self.timed_out:  # one more try for what was kept back: the store may be back
            try:
                for i in range(0, len(self.pending), 1000):
                    self.client.log_batch(self.run_id, metrics=self.pending[i : i + 1000])
                self.offline, self.pending = False, []
            except Exception as e:
                log.debug("MLflow: the kept metrics of run %s were not sent: %s", self.run_id, e)
        if self.offline:
            why = ("the tracking store gave no reply in time, and was not asked again" if self.timed_out
                   else "the tracking store did not come back")
            log.warning("MLflow: run %s is missing %d metric values (%s); the stage's own files hold them",
                        self.run_id, len(self.pending), why)
            self.write_record(status=status, metrics_missing=len(self.pending), tracking_store=why)
            return
        self.write_record(status=status)
        self._safe("end the run", self.client.set_terminated, self.run_id, status)


def open_run(client, experiment_id: str, name: str, kind: str, parent: str | None, extra_tags: dict) -> str:
    """Create a run (a child of `parent` when given) with the base tags and `extra_tags`, redacted."""
    tags = base_tags(kind, name)
    if parent:
        tags["mlflow.parentRunId"] = parent
    tags.update(extra_tags)
    tags = {k: str(redact_value(k, v))[:8000] for k, v in tags.items()}
    run = client.create_run(experiment_id, tags=tags, run_name=name)
    return run.info.run_id
