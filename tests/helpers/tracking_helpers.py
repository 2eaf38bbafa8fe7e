"""What the tracking tests and the session's tracked Snakemake run share: the planted secrets, the
environment of a pipeline subprocess, and a git snapshot of a working copy (the commit runs are tagged with)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

from rloo_workflow import tracking

BIN = Path(sys.executable).parent
# Secrets planted in the pipeline's environment and config: none may reach MLflow.
SECRET_ENV = "sk-rlootest" + "0123456789abcdef0123456789"
SECRET_CFG = "hf_" + "RlooTestToken0123456789abcdef"


def pipeline_env(**extra: str) -> dict[str, str]:
    """The environment of a pipeline subprocess: this venv first, no tracking state of the caller."""
    env = {k: v for k, v in os.environ.items()
           if k not in {"MLFLOW_TRACKING_URI", "MLFLOW_RUN_ID", tracking.ENV_PARENT, tracking.ENV_RUNS_DIR,
                        tracking.ENV_ENABLED}}
    env["PATH"] = f"{BIN}{os.pathsep}{env.get('PATH', '')}"
    env.update({"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1",
                "HF_DATASETS_OFFLINE": "1", "OPENAI_API_KEY": SECRET_ENV})
    env.update(extra)
    return env


def git_snapshot(path: Path) -> str:
    """Make `path` a git repository with one commit (the commit the runs must be tagged with)."""
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@t", "-c", "commit.gpgsign=false"]
    subprocess.run([*git, "init", "-q"], cwd=path, check=True)
    subprocess.run([*git, "add", "-A"], cwd=path, check=True)
    subprocess.run([*git, "commit", "-q", "-m", "copy"], cwd=path, check=True)
    return subprocess.run(["git", "rev-parse", "HEAD"], cwd=path, capture_output=True, text=True).stdout.strip()


def run_tracked_workflow(folder: Path) -> dict:
    """The micro pipeline (default target) through Snakemake with tracking on, into the default store
    (sqlite:///mlflow.db in the copy), in a git repository of the copy with the project's DVC files (the
    run commits every stage to DVC: tests/e2e/test_dvc.py works on a copy), after a dry run that must
    create no store and no run. Writes the copy to `folder/wf` and returns what the tests read."""
    from workflow_helpers import add_dvc_files, env_for, make_copy, snakemake_bin

    wf = add_dvc_files(make_copy(folder / "wf"))
    commit = git_snapshot(wf)
    cmd = [snakemake_bin(), "--cores", "1", "--configfile", "config/micro.yaml", "--config", f"name=micro-{SECRET_CFG}"]
    env = pipeline_env(DVC_NO_ANALYTICS="1",
                       **{k: v for k, v in env_for(wf).items() if k in {"PYTHONPATH", "VIRTUAL_ENV", "PATH"}})

    dry = subprocess.run([*cmd, "-n"], cwd=wf, env=env, capture_output=True, text=True, timeout=300)
    assert dry.returncode == 0, dry.stdout[-3000:] + dry.stderr[-3000:]
    assert not (wf / "mlflow.db").exists() and not (wf / "results" / "runs").exists(), "a dry run created runs"

    t0 = time.time()
    res = subprocess.run(cmd, cwd=wf, env=env, capture_output=True, text=True, timeout=900)
    if res.returncode != 0:
        logs = "\n".join(f"--- {p}\n{p.read_text()[-2000:]}" for p in sorted((wf / "logs").glob("*.log")))
        raise AssertionError(f"snakemake failed ({res.returncode})\n{res.stderr[-5000:]}\n{logs}")
    return {"commit": commit, "output": res.stderr, "seconds": round(time.time() - t0, 1)}
