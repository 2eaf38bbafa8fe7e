"""Shared fixtures: the micro config, and a prepared data set + SFT model built once per session."""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile
from pathlib import Path

import pytest

from rloo.config import load_config

ROOT = Path(__file__).resolve().parents[1]
MICRO = ROOT / "config" / "micro.yaml"

# No test may reach a model or data set hub.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
# MLflow: a test that runs a stage with tracking on logs into a throwaway store, never into the
# repository's mlflow.db; no pipeline run of the caller's environment leaks in.
_MLFLOW_DIR = tempfile.mkdtemp(prefix="rloo-tests-mlflow-")
atexit.register(shutil.rmtree, _MLFLOW_DIR, ignore_errors=True)
os.environ["MLFLOW_TRACKING_URI"] = f"sqlite:///{_MLFLOW_DIR}/mlflow.db"
for _var in ("RLOO_MLFLOW_PARENT_RUN_ID", "RLOO_MLFLOW_RUNS_DIR", "RLOO_TRACKING", "MLFLOW_RUN_ID"):
    os.environ.pop(_var, None)


@pytest.fixture
def micro_cfg() -> dict:
    return load_config(MICRO)


@pytest.fixture(scope="session")
def micro_run(tmp_path_factory) -> dict:
    """prepare + sft on the micro config, shared read-only by the tests that need a trained policy."""
    from rloo.stages import prepare, sft

    base = tmp_path_factory.mktemp("micro")
    cfg = load_config(MICRO, {"tracking": {"enabled": False}})
    prepare.run(cfg, base / "data")
    metrics = sft.run(cfg, base / "data", base / "sft", base / "work" / "sft")
    return {"cfg": cfg, "base": base, "data": base / "data", "sft": base / "sft", "sft_metrics": metrics}


@pytest.fixture(scope="session")
def micro_reward(micro_run) -> Path:
    """The micro reward model, trained once: a training reward with spread on the micro policy (the
    verifier pays 0 to everything that policy writes, so an RLOO step on it changes no weight)."""
    from rloo.stages import reward

    out = micro_run["base"] / "reward"
    reward.run(micro_run["cfg"], micro_run["data"], micro_run["sft"], out)
    return out
