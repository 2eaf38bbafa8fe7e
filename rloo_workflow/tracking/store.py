"""Where runs go, and whether they go anywhere: the MLflow store, its experiment, RLOO_TRACKING.

The store is `MLFLOW_TRACKING_URI` (when set and not empty), else the config's `tracking.tracking_uri`
(default `sqlite:///mlflow.db`, a file in the directory the pipeline runs in). The database and the
experiment are created once, up front, under a lock: concurrent first use of SQLite races.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from rloo_workflow.tracking.redact import redact_url_passwords

log = logging.getLogger("rloo_workflow.tracking")

DEFAULT_URI = "sqlite:///mlflow.db"
DEFAULT_EXPERIMENT = "rloo"
ENV_ENABLED = "RLOO_TRACKING"
ENV_PARENT = "RLOO_MLFLOW_PARENT_RUN_ID"


def enabled(cfg: dict | None = None) -> bool:
    """RLOO_TRACKING=0/1 decides when set; else the config's tracking.enabled (default true)."""
    env = os.environ.get(ENV_ENABLED, "").strip().lower()
    if env:
        return env not in {"0", "false", "no", "off"}
    return bool(((cfg or {}).get("tracking") or {}).get("enabled", True))


def _absolute_sqlite(uri: str, base: Path | None = None) -> str:
    prefix = "sqlite:///"
    if uri.startswith(prefix):
        path = uri[len(prefix):]
        if path and path != ":memory:" and not path.startswith("/"):
            return prefix + str(((base or Path.cwd()) / path).resolve())
    return uri


def tracking_uri(cfg: dict | None = None) -> str:
    """MLFLOW_TRACKING_URI when set (and not empty), else tracking.tracking_uri; SQLite made absolute."""
    uri = os.environ.get("MLFLOW_TRACKING_URI", "").strip()
    if not uri:
        uri = ((cfg or {}).get("tracking") or {}).get("tracking_uri") or DEFAULT_URI
    return _absolute_sqlite(uri)


def experiment_name(cfg: dict | None = None) -> str:
    return ((cfg or {}).get("tracking") or {}).get("experiment") or DEFAULT_EXPERIMENT


def display_uri(uri: str) -> str:
    """A tracking URI fit to print or record (no password)."""
    return redact_url_passwords(uri)


def _sqlite_path(uri: str) -> Path | None:
    if uri.startswith("sqlite:///"):
        path = uri[len("sqlite:///"):]
        if path and path != ":memory:":
            return Path(path)
    return None


@contextlib.contextmanager
def _store_lock(uri: str) -> Iterator[None]:
    """An exclusive lock on the SQLite file's folder (no stray lock file), none for a server."""
    db = _sqlite_path(uri)
    if db is None:
        yield
        return
    import fcntl

    db.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(db.parent, os.O_RDONLY)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
        except OSError as e:  # a filesystem without flock: go on unlocked
            log.debug("no lock on %s: %s", db.parent, e)
        yield
    finally:
        os.close(fd)  # closing the descriptor releases the lock


# Seconds a tracking server has to answer one request: a live one answers in milliseconds.
HTTP_TIMEOUT_S = 5


def _is_server(uri: str) -> bool:
    return uri.startswith(("http://", "https://"))


def mlflow_client(uri: str) -> Any:
    """An MlflowClient on `uri` (mlflow is imported only here, when a run is actually opened)."""
    from mlflow import MlflowClient

    # Bounded calls to a tracking server: MLflow's defaults (7 retries, exponential back-off, 120 s
    # timeout) make one call to a server that went away wait about 4 minutes, at every step. Here one
    # call is two tries of HTTP_TIMEOUT_S at most (a frozen server: about 10 s); a run that fails once
    # stops calling (tracking/run.py), so the stage loses seconds. The environment wins.
    if _is_server(uri):
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "1")
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR", "1")
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", str(HTTP_TIMEOUT_S))
    # The SQLite store announces table creation and migrations on every first use: keep it quiet.
    for name in ("mlflow.store.db.utils", "alembic.runtime.migration", "mlflow.store.db"):
        logging.getLogger(name).setLevel(logging.WARNING)
    return MlflowClient(tracking_uri=uri)


def ensure_experiment(uri: str, name: str = DEFAULT_EXPERIMENT) -> str:
    """Create the store (SQLite: the database, migrated) and the experiment once; return its id.

    Serialised by a lock on the database's folder, so concurrent first use cannot race on schema
    creation; a deleted experiment of that name is restored.
    """
    from mlflow.entities import LifecycleStage
    from mlflow.exceptions import MlflowException

    with _store_lock(uri):
        client = mlflow_client(uri)
        exp = client.get_experiment_by_name(name)
        if exp is None:
            db = _sqlite_path(uri)
            location = str(db.parent / "mlruns") if db is not None else None
            tags = {
                # MLflow 3's UI: open this experiment's runs table (model training), not GenAI views.
                "mlflow.experimentKind": "custom_model_development",
                "mlflow.note.content": "rloo pipeline runs: one `pipeline` run per Snakemake invocation, "
                "one child run per stage (docs/tracking.md: auditing runs in MLflow).",
            }
            try:
                return client.create_experiment(name, artifact_location=location, tags=tags)
            except MlflowException:  # created meanwhile by another client of a server
                exp = client.get_experiment_by_name(name)
                if exp is None:
                    raise
        if exp.lifecycle_stage == LifecycleStage.DELETED:
            client.restore_experiment(exp.experiment_id)
        return exp.experiment_id


def unanswered(uri: str) -> str | None:
    """Why the tracking server at `uri` is taken to be down, or None: the first call of a stage or a
    pipeline, one GET of its /health with HTTP_TIMEOUT_S to answer and no retry, so that a server that
    is stopped (SIGSTOP: it accepts connections and never replies) or unreachable costs seconds before
    anything else asks it. Any HTTP status is an answer; a store that is not a server (SQLite) is None."""
    if not _is_server(uri):
        return None
    import urllib.error
    import urllib.request

    try:
        with urllib.request.urlopen(uri.rstrip("/") + "/health", timeout=HTTP_TIMEOUT_S):
            return None
    except urllib.error.HTTPError:
        return None  # it answered
    except (OSError, ValueError) as e:
        reason = e.reason if isinstance(e, urllib.error.URLError) else e
        if isinstance(reason, TimeoutError):
            return f"no reply within {HTTP_TIMEOUT_S} s"
        return f"{type(reason).__name__}: {reason}"


def timed_out(e: BaseException) -> bool:
    """Whether a failed MLflow call got no reply in time (its cause, or a cause of that, is a timeout):
    a server that is stopped or overloaded, which another call would only wait on again."""
    seen: set[int] = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, TimeoutError) or "Timeout" in type(e).__name__:
            return True
        e = e.__cause__ or e.__context__
    return False
