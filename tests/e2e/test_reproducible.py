"""A stage's outputs are a function of its inputs: the micro chain run twice through `rloo <stage>`,
once with MLflow tracking on (a real SQLite store, each stage its own process) and once with it off
(the same command lines through `rloo.cli.main` in this process: no interpreter start-ups to pay),
writes the same bytes.

Run ids, hosts and wall-clock figures go to MLflow, the job logs and `<work>/timings.json`; none of
them may reach a DVC-tracked output, or DVC would see a changed output on every rerun.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from pathlib import Path

import mlflow
import pytest

ROOT = Path(__file__).resolve().parents[2]
MICRO = ROOT / "config" / "micro.yaml"

# (verb, arguments): every stage of results/gsm8k_rloo.json, with the paths the rules would give.
CHAIN = [
    ("prepare", ["--out", "data"]),
    ("base", ["--data", "data", "--out", "models/base"]),
    ("sft", ["--data", "data", "--base", "models/base", "--out", "models/sft", "--work", "work/sft"]),
    ("reward", ["--data", "data", "--policy", "models/sft", "--out", "models/reward", "--work", "work/reward"]),
    ("train", ["--data", "data", "--policy", "models/sft", "--reward-model", "models/reward", "--out", "models/rloo_rloo",
               "--work", "work/rloo_rloo"]),
    ("evaluate", ["--data", "data", "--sft", "models/sft", "--policy", "rloo=models/rloo_rloo",
                  "--reward-model", "models/reward", "--out", "results/gsm8k_rloo.json", "--plots", "results/gsm8k_rloo"]),
]
OUTPUTS = ("data", "models", "results/gsm8k_rloo.json", "results/gsm8k_rloo")


def _run_chain(cwd: Path, tracking: bool, in_process: bool = False) -> None:
    cwd.mkdir()
    if in_process:
        from rloo import cli

        old = Path.cwd()
        try:
            os.chdir(cwd)
            for verb, args in CHAIN:
                code = cli.main([verb, "-c", str(MICRO), "--set", f"tracking.enabled={str(tracking).lower()}", *args])
                assert code in (0, None), f"rloo {verb} exited {code}"
        finally:
            os.chdir(old)
        return
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
           "MLFLOW_TRACKING_URI": f"sqlite:///{cwd / 'mlflow.db'}"}
    for name in ("RLOO_MLFLOW_PARENT_RUN_ID", "RLOO_MLFLOW_RUNS_DIR", "RLOO_TRACKING", "MLFLOW_RUN_ID"):
        env.pop(name, None)
    for verb, args in CHAIN:
        cmd = [sys.executable, "-m", "rloo.cli", verb, "-c", str(MICRO),
               "--set", f"tracking.enabled={str(tracking).lower()}", *args]
        res = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=600)
        assert res.returncode == 0, f"rloo {verb} exited {res.returncode}:\n{res.stderr[-4000:]}"


def _digests(cwd: Path) -> dict[str, str]:
    files = [p for out in OUTPUTS for p in ([cwd / out] if (cwd / out).is_file() else sorted((cwd / out).rglob("*")))]
    return {str(p.relative_to(cwd)): hashlib.sha256(p.read_bytes()).hexdigest() for p in files if p.is_file()}


@pytest.mark.slow
def test_outputs_are_byte_identical_with_tracking_on_and_off(tmp_path):
    _run_chain(tmp_path / "tracked", tracking=True)
    _run_chain(tmp_path / "untracked", tracking=False, in_process=True)
    # The tracked chain really was tracked: one finished MLflow run per stage.
    client = mlflow.MlflowClient(f"sqlite:///{tmp_path / 'tracked' / 'mlflow.db'}")
    runs = client.search_runs([e.experiment_id for e in client.search_experiments()])
    assert sorted(r.info.run_name for r in runs) == ["base", "evaluate", "prepare", "reward", "rloo", "sft"]
    assert all(r.info.status == "FINISHED" for r in runs)
    tracked, untracked = _digests(tmp_path / "tracked"), _digests(tmp_path / "untracked")
    assert {"models/sft/metrics.json", "models/reward/model.safetensors", "models/rloo_rloo/steps.jsonl",
            "results/gsm8k_rloo.json"} <= set(tracked)
    differ = sorted(k for k in tracked.keys() | untracked.keys() if tracked.get(k) != untracked.get(k))
    assert differ == [], f"outputs differ between the tracked and the untracked run: {differ}"
    # The wall-clock figures were measured, just not written into the outputs.
    assert (tmp_path / "tracked" / "work" / "rloo_rloo" / "timings.json").is_file()
