"""Experiment tracking (MLflow): one parent run per pipeline invocation, one child run per stage.

Stages call `log_metrics(...)` as they go; it is a no-op when no run is active, so library code and
tests never need a tracking server. The CLI wraps every stage in `stage_run`, which opens the stage's
run (a child of the pipeline's run when `RLOO_MLFLOW_PARENT_RUN_ID` is set, else a top-level run),
logs the stage's parameters and provenance tags, and, once the stage is done, its artifacts (metrics
JSON, PNG plots, the stage log; never model weights, whose md5 goes into tags instead).

The pipeline's run is opened by `start_pipeline` in Snakemake's `onstart` handler (the main process
only; never for dry runs) and closed by `end_pipeline` in `onsuccess`/`onerror`
(workflow/rules/tracking.smk). It exports to the jobs, through the environment:

    MLFLOW_TRACKING_URI        the store (a relative SQLite path made absolute)
    RLOO_MLFLOW_PARENT_RUN_ID  the pipeline run's id (the jobs' runs are its children)
    RLOO_MLFLOW_RUNS_DIR       where each stage records its run id (<paths.results>/runs)
    RLOO_TRACKING=0            when the workflow's config disables tracking (`rloo <stage>` honours
                               RLOO_TRACKING=0/1 over its config's tracking.enabled)

Store: `MLFLOW_TRACKING_URI` (when set and not empty), else the config's `tracking.tracking_uri`
(default `sqlite:///mlflow.db`, a file in the directory the pipeline runs in). The database and the
experiment are created once, up front, under a lock: concurrent first use of SQLite races.

Run ids: each stage writes `<runs dir>/<stage>.json` (`run_id`, `parent_run_id`, `experiment_id`,
`status`, ...) atomically when its run starts and again when it ends; the pipeline writes
`<runs dir>/pipeline.json`. `recorded_runs()` reads them back.

Hygiene: parameters, tags and text artifacts pass through `redact`: a key that names a secret (API
key, token, password, ...) has its value replaced, and so has any value that looks like a credential
or equals the value of a secret-named environment variable. A key ending in `_env` that holds an
environment variable's *name* (evaluate.llm_judge.api_key_env) is kept. Tracking never fails a
stage: an MLflow error is logged as a warning and the stage goes on untracked.
"""

from __future__ import annotations

import atexit
import contextlib
import getpass
import hashlib
import json
import logging
import math
import os
import re
import shutil
import socket
import stat
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from rloo.config import select

log = logging.getLogger("rloo.tracking")

DEFAULT_URI = "sqlite:///mlflow.db"
DEFAULT_EXPERIMENT = "rloo"
ENV_PARENT = "RLOO_MLFLOW_PARENT_RUN_ID"
ENV_RUNS_DIR = "RLOO_MLFLOW_RUNS_DIR"
ENV_ENABLED = "RLOO_TRACKING"
PIPELINE_RUN_NAME = "pipeline"

# How a run is observed, not what it computes: never a parameter.
NOT_PARAMS = ("tracking",)

# Files of a stage's output folders that become artifacts (besides every *.png). Everything else
# (weights, tokenizer files, data splits) stays out of MLflow; its md5 goes into the tags.
ARTIFACT_NAMES = {"metrics.json", "history.json", "steps.jsonl", "manifest.json"}
ARTIFACT_SUFFIXES = {".json", ".jsonl", ".png", ".txt", ".md", ".csv", ".tsv", ".yaml", ".yml"}
WEIGHT_SUFFIXES = {".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".gguf", ".h5", ".msgpack", ".onnx"}
MAX_ARTIFACT_BYTES = 20 << 20
MAX_LOG_BYTES = 5 << 20
TEXT_SUFFIXES = {".json", ".jsonl", ".txt", ".md", ".csv", ".tsv", ".yaml", ".yml", ".log"}

# Curves drawn into plots/curves.png, in this order (then any other metric with a history).
CURVE_PRIORITY = [
    "train/reward_mean", "train/kl", "train/zero_adv_frac", "train/response_length", "train/entropy",
    "train/loss", "train/grad_norm", "train/clip_frac", "eval/accuracy_sampled", "eval/proxy_reward",
    "time/step_s", "sft/loss", "sft/grad_norm", "sft/lr", "reward/loss", "reward/train_accuracy",
]
MAX_CURVES = 12

# --------------------------------------------------------------------------------------------------
# Secrets


_SECRET_KEY = re.compile(
    r"(?i)(?:^|[^a-z])(?:api[_-]?keys?|apikey|secrets?|passw(?:or)?ds?|passphrase|token|"
    r"credentials?|private[_-]?key|auth|authorization|cookie|session[_-]?key)(?:$|[^a-z])"
)
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_SECRET_VALUE = [
    re.compile(r"-----BEGIN [A-Z ]*PRIVATE KEY-----.*?(?:-----END [A-Z ]*PRIVATE KEY-----|\Z)", re.S),
    re.compile(r"\bsk-[A-Za-z0-9_\-]{16,}"),
    re.compile(r"\bhf_[A-Za-z0-9]{20,}"),
    re.compile(r"\bgh[pousr]_[A-Za-z0-9]{20,}"),
    re.compile(r"\bgithub_pat_[A-Za-z0-9_]{20,}"),
    re.compile(r"\bglpat-[A-Za-z0-9_\-]{20,}"),
    re.compile(r"\b(?:AKIA|ASIA)[0-9A-Z]{16}\b"),
    re.compile(r"\bxox[abprs]-[A-Za-z0-9\-]{10,}"),
    re.compile(r"\beyJ[A-Za-z0-9_\-]{8,}\.[A-Za-z0-9_\-]{8,}\.[A-Za-z0-9_\-]{8,}"),
    re.compile(r"(?i)\bbearer\s+[A-Za-z0-9._~+/\-]{12,}=*"),
]
# user:password@ in a URL: keep the user, drop the password.
_URL_CREDENTIALS = re.compile(r"(?i)\b([a-z][a-z0-9+.\-]*://[^/\s:@]+):[^/\s@]+@")
# KEY=VALUE / "key": "value" with a secret-named key, inside free text (logs, command lines).
_ASSIGNMENT = re.compile(
    r"""(?ix)
    (?P<key>[A-Za-z0-9_.\-]*(?:api[_-]?key|apikey|secret|passw(?:or)?d|token|credential|private[_-]?key)
        [A-Za-z0-9_.\-]*)
    (?P<sep>["']?\s*[:=]\s*["']?)
    (?P<value>[^\s"',}]{6,})
    """
)
REDACTED = "[REDACTED]"


def is_secret_key(key: str) -> bool:
    """True for a key that names a secret (api_key, hf_token, password, ...), not max_new_tokens."""
    return bool(_SECRET_KEY.search(str(key)))


def _secret_env_values() -> list[str]:
    """Values of secret-named environment variables (not those that merely name another variable)."""
    vals = {v for k, v in os.environ.items()
            if is_secret_key(k) and len(v) >= 8 and not re.fullmatch(r"[A-Z][A-Z0-9]*(?:_[A-Z0-9]+)+", v)}
    return sorted(vals, key=len, reverse=True)


def redact_text(text: str) -> str:
    """Replace credentials in free text: secret env values, known token shapes, URL passwords."""
    if not text:
        return text
    for value in _secret_env_values():
        text = text.replace(value, REDACTED)
    for pattern in _SECRET_VALUE:
        text = pattern.sub(REDACTED, text)
    text = _URL_CREDENTIALS.sub(rf"\1:{REDACTED}@", text)

    def _assignment(m: re.Match) -> str:
        key, value = m.group("key"), m.group("value")
        if key.lower().endswith("_env") and _ENV_NAME.match(value):
            return m.group(0)  # the *name* of an environment variable, not its value
        if value == REDACTED:
            return m.group(0)
        return f"{key}{m.group('sep')}{REDACTED}"

    return _ASSIGNMENT.sub(_assignment, text)


def redact_value(key: str, value: Any) -> Any:
    """The value to log under `key`: REDACTED for a secret key (unless it holds an env var name)."""
    leaf = str(key).rsplit(".", 1)[-1]
    if is_secret_key(leaf) and value not in (None, "", False):
        if leaf.lower().endswith("_env") and isinstance(value, str) and _ENV_NAME.match(value):
            return value
        return REDACTED
    if isinstance(value, str):
        return redact_text(value)
    return value


def redact(obj: Any, key: str = "") -> Any:
    """Deep copy of a JSON-like object with every secret replaced (see module docstring)."""
    if isinstance(obj, dict):
        return {k: redact(v, str(k)) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [redact(v, key) for v in obj]
    return redact_value(key, obj)


def flatten(obj: Any, prefix: str = "") -> dict[str, Any]:
    """{"a": {"b": 1}} → {"a.b": 1}; lists stay whole."""
    out: dict[str, Any] = {}
    if isinstance(obj, dict):
        for k, v in obj.items():
            out.update(flatten(v, f"{prefix}{k}."))
    else:
        out[prefix[:-1]] = obj
    return out


def config_part(cfg: dict, keys: Iterable[str] | None = None) -> dict:
    """The sub-tree of `cfg` named by dotted `keys` (all of it for None), without NOT_PARAMS."""
    if keys is None:
        return {k: v for k, v in cfg.items() if k not in NOT_PARAMS}
    return select(cfg, [k for k in keys if k.split(".")[0] not in NOT_PARAMS])


def config_params(cfg: dict, keys: Iterable[str] | None = None) -> dict[str, str]:
    """Flattened, redacted config keys as MLflow params (strings of at most 6000 chars)."""
    params = {}
    for k, v in flatten(redact(config_part(cfg, keys))).items():
        s = v if isinstance(v, str) else json.dumps(v, sort_keys=True)
        params[k] = s if len(s) <= 6000 else s[:5980] + "…[truncated]"
    return params


# --------------------------------------------------------------------------------------------------
# Store


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
    return _URL_CREDENTIALS.sub(rf"\1:{REDACTED}@", uri)


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


def _client(uri: str):
    from mlflow import MlflowClient

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
        client = _client(uri)
        exp = client.get_experiment_by_name(name)
        if exp is None:
            db = _sqlite_path(uri)
            location = str(db.parent / "mlruns") if db is not None else None
            tags = {
                # MLflow 3's UI: open this experiment's runs table (model training), not GenAI views.
                "mlflow.experimentKind": "custom_model_development",
                "mlflow.note.content": "rloo pipeline runs: one `pipeline` run per Snakemake invocation, "
                "one child run per stage (see the README: Auditing runs in MLflow).",
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


# --------------------------------------------------------------------------------------------------
# Provenance


def _git(args: list[str], cwd: Path) -> str | None:
    try:
        res = subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return res.stdout.strip() if res.returncode == 0 else None


def git_info(cwd: Path | None = None) -> dict[str, str]:
    """Commit (and whether tracked files differ from it) of the project run from, else of the package."""
    for where in (cwd or Path.cwd(), Path(__file__).resolve().parent):
        commit = _git(["rev-parse", "HEAD"], where)
        if commit:
            dirty = _git(["status", "--porcelain", "--untracked-files=no"], where)
            return {"git_commit": commit, "git_dirty": str(bool(dirty)).lower()}
    return {}


def _md5_file(path: Path) -> str:
    h = hashlib.md5(usedforsecurity=False)
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


# Snakemake's marker in directory outputs, written after the job: not part of the stage's output
# (the project's .dvcignore should list it too, so DVC's md5 of the folder is this one).
DVC_IGNORED = {".snakemake_timestamp"}


def dvc_md5(path: Path) -> tuple[str, dict[str, dict]]:
    """The md5 DVC 3 records for `path` (a folder's ends in .dir) and each file's {md5, size}."""
    path = Path(path)
    if path.is_file():
        digest = _md5_file(path)
        return digest, {path.name: {"md5": digest, "size": path.stat().st_size}}
    files: dict[str, dict] = {}
    for p in sorted(path.rglob("*")):
        if p.is_file() and not p.is_symlink() and p.name not in DVC_IGNORED:
            files[p.relative_to(path).as_posix()] = {"md5": _md5_file(p), "size": p.stat().st_size}
    listing = sorted(({"md5": v["md5"], "relpath": k} for k, v in files.items()), key=lambda e: e["relpath"])
    blob = json.dumps(listing, sort_keys=True).encode()
    return hashlib.md5(blob, usedforsecurity=False).hexdigest() + ".dir", files


def _dvc_lock_md5s(start: Path) -> dict[str, str]:
    """{output path (relative to the repo): md5} from dvc.lock, when there is one."""
    lock = start / "dvc.lock"
    if not lock.is_file():
        return {}
    try:
        import yaml

        data = yaml.safe_load(lock.read_text()) or {}
    except Exception:
        return {}
    out = {}
    for stage in (data.get("stages") or {}).values():
        for o in stage.get("outs") or []:
            if isinstance(o, dict) and o.get("path") and o.get("md5"):
                out[str(Path(o["path"]))] = o["md5"]
    return out


def _rel(path: Path) -> str:
    try:
        return Path(os.path.relpath(Path(path).resolve(), Path.cwd())).as_posix()
    except ValueError:
        return str(path)


def _tag_path(rel: str) -> str:
    """`rel` as part of a tag key: MLflow refuses keys that normalise to another path ("x.../../y"),
    so an output outside the working directory is named by its absolute path under "outside/"."""
    if rel.startswith(("..", "/")):
        return "outside/" + Path(rel).resolve().as_posix().lstrip("/")
    return rel


def host_tags() -> dict[str, str]:
    tags = {"host": socket.gethostname()}
    if os.environ.get("SLURM_JOB_ID"):
        tags["slurm_job_id"] = os.environ["SLURM_JOB_ID"]
        if os.environ.get("SLURM_ARRAY_TASK_ID"):
            tags["slurm_array_task_id"] = os.environ["SLURM_ARRAY_TASK_ID"]
        if os.environ.get("SLURM_CLUSTER_NAME"):
            tags["slurm_cluster"] = os.environ["SLURM_CLUSTER_NAME"]
    return tags


def _base_tags(kind: str, name: str) -> dict[str, str]:
    tags = {
        "mlflow.source.type": "LOCAL",
        "mlflow.source.name": "snakemake" if kind == "pipeline" else f"rloo {name}",
        "rloo.kind": kind,
        **host_tags(),
    }
    with contextlib.suppress(Exception):
        tags["mlflow.user"] = getpass.getuser()
    git = git_info()
    tags.update(git)
    if "git_commit" in git:
        tags["mlflow.source.git.commit"] = git["git_commit"]
    return tags


# --------------------------------------------------------------------------------------------------
# Run-id records


def runs_dir(cfg: dict | None = None) -> Path:
    """RLOO_MLFLOW_RUNS_DIR when set (the pipeline exports it), else <paths.results>/runs."""
    if os.environ.get(ENV_RUNS_DIR):
        return Path(os.environ[ENV_RUNS_DIR])
    results = ((cfg or {}).get("paths") or {}).get("results") or "results"
    return Path(results) / "runs"


def _write_record(path: Path, record: dict) -> None:
    from rloo.io import write_json_atomic

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


# --------------------------------------------------------------------------------------------------
# The active stage run


class _Run:
    """A run this process opened: its client, id, and a copy of the metric history (for plots)."""

    def __init__(self, client, run_id: str, name: str, record: dict, record_path: Path | None):
        self.client = client
        self.run_id = run_id
        self.name = name
        self.record = record
        self.record_path = record_path
        self.history: dict[str, list[tuple[int, float]]] = defaultdict(list)
        self.failures = 0

    def _safe(self, what: str, fn, *args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except Exception as e:
            self.failures += 1
            if self.failures <= 3:
                log.warning("MLflow: could not %s for run %s: %s", what, self.run_id, e)
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
            self._safe("log metrics", self.client.log_batch, self.run_id, metrics=batch[i : i + 1000])

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
                dst.write_text(_redacted_file_text(path), encoding="utf-8")
            else:
                shutil.copyfile(path, dst)
            self._safe(f"log artifact {path}", self.client.log_artifact, self.run_id, str(dst), artifact_dir)

    def log_text(self, text: str, artifact_file: str) -> None:
        self._safe(f"log {artifact_file}", self.client.log_text, self.run_id, redact_text(text), artifact_file)

    def write_record(self, **changes) -> None:
        self.record.update(changes)
        if self.record_path is not None:
            _write_record(self.record_path, self.record)

    def end(self, status: str) -> None:
        self.write_record(status=status)
        self._safe("end the run", self.client.set_terminated, self.run_id, status)


def _redacted_file_text(path: Path) -> str:
    text = path.read_text(encoding="utf-8", errors="replace")
    if path.suffix.lower() == ".log" and len(text) > MAX_LOG_BYTES:
        text = f"[... {len(text) - MAX_LOG_BYTES} characters cut ...]\n" + text[-MAX_LOG_BYTES:]
    if path.suffix.lower() == ".json":
        with contextlib.suppress(json.JSONDecodeError):
            return json.dumps(redact(json.loads(text)), indent=2) + "\n"
    if path.suffix.lower() == ".jsonl":
        lines = []
        for line in text.splitlines():
            try:
                lines.append(json.dumps(redact(json.loads(line))) if line.strip() else line)
            except json.JSONDecodeError:
                lines.append(redact_text(line))
        return "\n".join(lines) + "\n"
    return redact_text(text)


_active: _Run | None = None  # the stage run of this process, set by stage_run
_pipeline: _Run | None = None  # the pipeline run opened by start_pipeline in this process


def active_run_id() -> str | None:
    return _active.run_id if _active is not None else None


def log_metrics(metrics: dict[str, Any], step: int | None = None) -> None:
    """Log the numeric, finite metrics of the active stage run at `step` (no-op without a run).

    The key "step" and non-numeric or non-finite values are skipped; booleans log as 0/1.
    """
    if _active is None:
        return
    _active.log_metrics(metrics, step)


def replay_history(records: list[dict], resumed_from: int) -> None:
    """A resumed stage's run gets the metrics of the steps before its checkpoint (kept in the checkpoint),
    so that one run holds the whole history; tagged with the step it resumed from."""
    if _active is None:
        return
    _active.set_tags({"rloo.resumed_from_step": str(resumed_from)})
    _active.log_records(records)


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
    return "rloo" if stage.startswith("rloo") else stage


def _open_run(client, experiment_id: str, name: str, kind: str, parent: str | None, extra_tags: dict) -> str:
    tags = _base_tags(kind, name)
    if parent:
        tags["mlflow.parentRunId"] = parent
    tags.update(extra_tags)
    tags = {k: str(redact_value(k, v))[:8000] for k, v in tags.items()}
    run = client.create_run(experiment_id, tags=tags, run_name=name)
    return run.info.run_id


def _start_stage_run(cfg: dict, stage: str, keys: list[str] | None, outputs: list[Path]) -> _Run:
    from rloo.config import config_hash, stage_config
    from rloo.pipeline import STAGES

    uri = tracking_uri(cfg)
    parent = os.environ.get(ENV_PARENT, "").strip() or None
    client = None
    experiment_id = None
    if parent:
        client = _client(uri)
        try:
            experiment_id = client.get_run(parent).info.experiment_id
        except Exception as e:
            log.warning("MLflow: parent run %s not found at %s (%s); this stage gets a top-level run",
                        parent, display_uri(uri), e)
            parent = None
    if experiment_id is None:
        experiment_id = ensure_experiment(uri, experiment_name(cfg))
        client = client or _client(uri)
    # Under Snakemake `keys` are those its rule passed (see `cli_context`), which decide whether it
    # reruns; run by hand, a stage's parameters are what it reads of the config, plus name and threads.
    if keys is None and _stage_base(stage) in STAGES:
        keys = ["name", "threads", *_leaf_keys(stage_config(cfg, _stage_base(stage)))]
    tags = {
        "rloo.stage": stage,
        "config_hash": config_hash(cfg),
        "config_hash_stage": config_hash(config_part(cfg, keys)),
        "rloo.outputs": json.dumps([_rel(p) for p in outputs]),
    }
    if parent:
        tags["parent_run_id"] = parent
    run_id = _open_run(client, experiment_id, stage, "stage", parent, tags)
    experiment = experiment_name(cfg)
    with contextlib.suppress(Exception):
        experiment = client.get_experiment(experiment_id).name
    record = {
        "stage": stage,
        "run_id": run_id,
        "run_name": stage,
        "parent_run_id": parent,
        "experiment_id": experiment_id,
        "experiment": experiment,
        "tracking_uri": display_uri(uri),
        "status": "RUNNING",
        "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    run = _Run(client, run_id, stage, record, runs_dir(cfg) / f"{stage}.json")
    run.write_record()
    run.log_params(config_params(cfg, keys))
    return run


def _finish_stage_run(run: _Run, cfg: dict, outputs: list[Path], log_file: Path | None, ok: bool) -> None:
    """Artifacts (the outputs' metrics JSON and plots, curves, the log), output md5 tags, config.

    A failed stage logs only its log and config: whatever lies at its output paths is not its work.
    """
    with contextlib.suppress(Exception):
        sys.stdout.flush()
        sys.stderr.flush()
    tags: dict[str, str] = {}
    manifest: dict[str, Any] = {}
    locked = _dvc_lock_md5s(Path.cwd())
    for out in outputs if ok else []:
        out = Path(out)
        if not out.exists():
            continue
        rel = _rel(out)
        try:
            digest, files = dvc_md5(out)
        except OSError as e:
            log.warning("MLflow: could not hash %s: %s", out, e)
            continue
        key = _tag_path(rel)
        tags[f"dvc.md5.{key}"] = digest
        if rel in locked:
            tags[f"dvc.lock.{key}"] = "match" if locked[rel] == digest else f"differs ({locked[rel]})"
        for name, info in files.items():
            if Path(name).suffix.lower() in WEIGHT_SUFFIXES:
                tags[f"md5.{key}/{name}" if out.is_dir() else f"md5.{key}"] = info["md5"]
        manifest[rel] = {"dvc_md5": digest, "files": files}
        for f in _artifact_files(out):
            if out.is_dir():
                sub = f.parent.relative_to(out).as_posix()
                run.log_file(f, f"outputs/{out.name}" + ("" if sub == "." else f"/{sub}"))
            else:
                run.log_file(f, "outputs")
    if ok and _stage_base(run.name) == "evaluate":
        _log_evaluation(run, outputs)
    if manifest:
        run.log_text(json.dumps(manifest, indent=2), "provenance/outputs.json")
    run.log_text(json.dumps(redact(cfg), indent=2), "provenance/config.json")
    if tags:
        run.set_tags(tags)
    if ok and (curves := _plot_curves(run.history, run.name)) is not None:
        run.log_file(curves, "plots")
        shutil.rmtree(curves.parent, ignore_errors=True)
    if log_file is not None and Path(log_file).is_file():
        run.log_file(Path(log_file), "logs", name=f"{run.name}.log")


def _log_evaluation(run: _Run, outputs: list[Path]) -> None:
    """The evaluation's results as metrics: evaluate/<policy>/<metric>, evaluate/win_rate/<policy>/*."""
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
            run.log_metrics(metrics, 0)


def _artifact_files(out: Path) -> list[Path]:
    if out.is_file():
        return [out] if out.suffix.lower() in ARTIFACT_SUFFIXES else []
    files = []
    for p in sorted(out.rglob("*")):
        if not p.is_file() or p.name.startswith("."):
            continue
        if p.name in ARTIFACT_NAMES or p.suffix.lower() == ".png":
            files.append(p)
    return files


def _plot_curves(history: dict[str, list[tuple[int, float]]], title: str) -> Path | None:
    """A grid of the stage's metric curves (every metric logged at two or more steps)."""
    names = [k for k, v in history.items() if len({s for s, _ in v}) >= 2]
    if not names:
        return None
    order = {k: i for i, k in enumerate(CURVE_PRIORITY)}
    names = sorted(names, key=lambda k: (order.get(k, len(order)), k))[:MAX_CURVES]
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        cols = min(3, len(names))
        rows = math.ceil(len(names) / cols)
        fig, axes = plt.subplots(rows, cols, figsize=(4 * cols, 2.8 * rows), squeeze=False)
        for ax, name in zip(axes.flat, names, strict=False):
            pts = sorted(history[name])
            ax.plot([s for s, _ in pts], [v for _, v in pts], marker="." if len(pts) < 50 else None)
            ax.set_title(name, fontsize=9)
            ax.set_xlabel("step", fontsize=8)
            ax.tick_params(labelsize=7)
        for ax in list(axes.flat)[len(names):]:
            ax.set_visible(False)
        fig.suptitle(f"{title}: metric curves", fontsize=10)
        fig.tight_layout()
        path = Path(tempfile.mkdtemp(prefix="rloo-curves-")) / "curves.png"
        fig.savefig(path, dpi=90)
        plt.close(fig)
        return path
    except Exception as e:
        log.warning("MLflow: could not draw the metric curves: %s", e)
        return None


@contextlib.contextmanager
def stage_run(
    cfg: dict,
    stage: str,
    *,
    outputs: Iterable[str | os.PathLike] = (),
    keys: Iterable[str] | None = None,
    log_file: str | os.PathLike | None = None,
) -> Iterator[_Run | None]:
    """Run a stage inside an MLflow run named `stage` (yields it; None when tracking is off).

    A child of RLOO_MLFLOW_PARENT_RUN_ID when set, else a top-level run in the config's experiment.
    `outputs` (files or folders) are hashed into `dvc.md5.<path>` tags and their metrics JSON and
    PNG plots logged; `keys` are the config keys logged as params (default: the stage's, see
    STAGE_KEYS); `log_file` (default: the file stderr is redirected to) is logged, redacted.
    The run ends FINISHED, FAILED on an exception, KILLED on preemption or interrupt.
    """
    global _active
    if not enabled(cfg):
        yield None
        return
    outputs = [Path(p) for p in outputs]
    keys = list(keys) if keys is not None else None
    try:
        run = _start_stage_run(cfg, stage, keys, outputs)
    except Exception as e:
        log.warning("MLflow: could not start a run for stage %s at %s (%s); running untracked",
                    stage, display_uri(tracking_uri(cfg)), e)
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


def _leaf_keys(tree: Any, prefix: str = "") -> list[str]:
    if isinstance(tree, dict) and tree:
        return [k for key, v in tree.items() for k in _leaf_keys(v, f"{prefix}{key}.")]
    return [prefix[:-1]] if prefix else []


def cli_context(args, cfg: dict, stage: str | None = None) -> dict:
    """stage_run's arguments for `rloo <stage>`: the run's name, its outputs, the config keys given.

    Under Snakemake a stage gets only the keys its rule passes (--config-json, --set): those are its
    parameters. Run by hand (no --config-json), the stage's declared keys are used. Names and outputs
    come from the pipeline's declaration (rloo/pipeline.py), as the CLI's do. (`stage` is ignored.)
    """
    from rloo import pipeline

    ctx: dict[str, Any] = {"stage": pipeline.cli_run_name(args, cfg),
                           "outputs": list(pipeline.cli_outputs(args, cfg).values())}
    if getattr(args, "config_json", None):
        keys: list[str] = []
        with contextlib.suppress(json.JSONDecodeError, TypeError):
            keys += _leaf_keys(json.loads(args.config_json))
        with contextlib.suppress(Exception):
            from rloo.config import parse_set

            keys += _leaf_keys(parse_set(getattr(args, "set", None) or []))
        ctx["keys"] = sorted(set(keys))
    return ctx


# --------------------------------------------------------------------------------------------------
# The pipeline run (Snakemake's main process)


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
    if not enabled(config):
        os.environ[ENV_ENABLED] = "0"
        return None
    uri = tracking_uri(config)
    results = Path(results_dir or ((config.get("paths") or {}).get("results") or "results")).resolve()
    os.environ[ENV_RUNS_DIR] = str(results / "runs")
    try:
        experiment_id = ensure_experiment(uri, experiment_name(config))
        client = _client(uri)
        from rloo.config import config_hash

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
        run_id = _open_run(client, experiment_id, name, "pipeline", None, tags)
    except Exception as e:
        log.warning("MLflow: could not open the pipeline run at %s (%s); stages log top-level runs",
                    display_uri(uri), e)
        print(f"rloo: MLflow pipeline run not created ({e})", file=sys.stderr)
        return None
    record = {
        "stage": "pipeline",
        "run_id": run_id,
        "run_name": name,
        "parent_run_id": None,
        "experiment_id": experiment_id,
        "experiment": experiment_name(config),
        "tracking_uri": display_uri(uri),
        "status": "RUNNING",
        "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    _pipeline = _Run(client, run_id, name, record, results / "runs" / "pipeline.json")
    _pipeline.write_record()
    _pipeline.log_params(config_params(config))
    os.environ["MLFLOW_TRACKING_URI"] = uri
    os.environ[ENV_PARENT] = run_id
    atexit.register(_end_pipeline_at_exit)
    ui = f"mlflow ui --backend-store-uri {uri}" if uri.startswith("sqlite:") else display_uri(uri)
    print(f"rloo: MLflow pipeline run {run_id} (experiment '{experiment_name(config)}', "
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


__all__ = [
    "ENV_ENABLED",
    "ENV_PARENT",
    "ENV_RUNS_DIR",
    "active_run_id",
    "cli_context",
    "config_params",
    "dvc_md5",
    "enabled",
    "end_pipeline",
    "ensure_experiment",
    "log_metrics",
    "recorded_runs",
    "redact",
    "redact_text",
    "stage_run",
    "start_pipeline",
    "tracking_uri",
]
