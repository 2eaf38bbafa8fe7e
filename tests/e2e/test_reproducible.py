"""A stage's outputs are a function of its inputs: the micro pipeline's default target run through
Snakemake twice, once with MLflow tracking on (the session's `tracked_workflow`: a real SQLite store,
a run per job, a git repository, a secret in the config's name) and once with it off (`micro_workflow`),
writes the same bytes in every output of every stage.

Run ids, hosts and wall-clock figures go to MLflow, the job logs and `<work>/timings.json`; none of
them may reach a DVC-tracked output, or DVC would see a changed output on every rerun.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
from workflow_helpers import PIPELINE

from rloo_workflow import pipeline
from rloo_workflow.config import load_config

ROOT = Path(__file__).resolve().parents[2]


def _outputs(copy: Path) -> dict[str, str]:
    """{path: sha256} of every file the default target's stages declare as outputs."""
    cfg = load_config(ROOT / "config" / "micro.yaml")
    paths = sorted({p for stage in PIPELINE for p in pipeline.outputs(stage, cfg).values()})
    digests = {}
    for rel in paths:
        found = copy / rel
        assert found.exists(), f"{rel} missing in {copy}"
        for f in [found] if found.is_file() else sorted(found.rglob("*")):
            if f.is_file():
                digests[str(f.relative_to(copy))] = hashlib.sha256(f.read_bytes()).hexdigest()
    return digests


@pytest.mark.slow
def test_outputs_are_byte_identical_with_tracking_on_and_off(tracked_workflow, micro_workflow):
    tracked_copy, untracked_copy = tracked_workflow["wf"], micro_workflow["copy"]
    # The tracked run really was tracked (test_tracking audits its runs), the other was not.
    assert (tracked_copy / "mlflow.db").is_file() and not (untracked_copy / "mlflow.db").exists()
    tracked, untracked = _outputs(tracked_copy), _outputs(untracked_copy)
    assert {"results/models/sft/metrics.json", "results/models/reward/model.safetensors",
            "results/models/rloo_rloo/steps.jsonl", "results/gsm8k_rloo.json"} <= set(tracked), sorted(tracked)
    differ = sorted(k for k in tracked.keys() | untracked.keys() if tracked.get(k) != untracked.get(k))
    assert differ == [], f"outputs differ between the tracked and the untracked run: {differ}"
    # The wall-clock figures were measured, just not written into the outputs.
    timings = json.loads((tracked_copy / "results" / "work" / "rloo_rloo" / "timings.json").read_text())
    assert timings, "no timings recorded"
