"""One-step off-policy RLOO with real processes: the CLI's run with its sampler process stopped by SIGINT
resumes to the bytes of an uninterrupted run and leaves no sampler behind; the micro chain runs
off-policy under Snakemake, where the sampler's threads rerun nothing."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import copy_tree
from test_crash_safety import _wait_for_checkpoint
from workflow_helpers import CONFIGFILES, job_counts, planned, same_weights, snakemake

from rloo.model import checkpoint

ROOT = Path(__file__).resolve().parents[2]


def _train_cmd(micro_run, reward_dir, tmp_path, out, work):
    # The micro reward model as the training reward (every step moves the weights), in 2-3 micro-batches.
    return [
        sys.executable, "-m", "rloo_workflow.cli", "train", "-c", str(ROOT / "config" / "micro.yaml"),
        "--set", "reward.source=model", "--reward-model", str(reward_dir),
        "--set", "rloo.steps=24", "--set", "rloo.checkpoint_every=3", "--set", "tracking.enabled=false",
        "--set", "rloo.micro_batch_tokens=160", "--set", "rloo.off_policy_steps=1",
        "--set", "rollout.sampler_threads=1", "--set", "rloo.rollout_correction.mismatch_every=4",
        "--data", str(micro_run["data"]), "--policy", str(micro_run["sft"]),
        "--out", str(tmp_path / out), "--work", str(tmp_path / work),
    ]


def _sampler_pids(stderr: str) -> list[int]:
    return [int(p) for p in re.findall(r"off-policy sampler: pid (\d+)", stderr)]


def _gone(pid: int, timeout: float = 30) -> bool:
    deadline = time.time() + timeout
    while time.time() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        stat = Path(f"/proc/{pid}/stat")
        if stat.is_file() and stat.read_text().split(")")[-1].split()[0] == "Z":
            return True  # ended, not yet reaped by its new parent
        time.sleep(0.1)
    return False


@pytest.mark.slow
def test_sigint_checkpoints_and_the_rerun_resumes_to_the_uninterrupted_bytes(micro_run, micro_reward, tmp_path):
    done = subprocess.run(_train_cmd(micro_run, micro_reward, tmp_path, "full", "w_full"), capture_output=True,
                          text=True, check=True)
    assert json.loads((tmp_path / "w_full" / "timings.json").read_text())["sampler"] == "process"
    proc = subprocess.Popen(_train_cmd(micro_run, micro_reward, tmp_path, "out", "work"), stderr=subprocess.PIPE,
                            text=True)
    ckpts = tmp_path / "work" / "checkpoints"
    _wait_for_checkpoint(tmp_path / "work", proc, timeout=120)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err[-3000:]
    assert "SIGINT received" in err and "Traceback" not in err
    assert not (tmp_path / "out").exists()
    step = int(checkpoint.latest(ckpts).name.split("_")[1])
    assert 0 < step < 24, "the run finished before the signal: nothing was tested"
    assert (checkpoint.latest(ckpts) / "lagged.safetensors").is_file()
    pids = _sampler_pids(err)
    assert len(pids) == 1 and _gone(pids[0]), f"the sampler process {pids} outlived its trainer"
    rerun = subprocess.run(_train_cmd(micro_run, micro_reward, tmp_path, "out", "work"), capture_output=True, text=True,
                           check=True)
    assert json.loads((tmp_path / "work" / "timings.json").read_text())["resumed_from_step"] == step
    assert same_weights(tmp_path / "full", tmp_path / "out")
    for name in ("model.safetensors", "steps.jsonl", "metrics.json"):
        assert (tmp_path / "out" / name).read_bytes() == (tmp_path / "full" / name).read_bytes(), name
    for stderr in (done.stderr, rerun.stderr):
        assert all(_gone(p) for p in _sampler_pids(stderr))


@pytest.mark.slow
def test_the_micro_chain_runs_off_policy_under_snakemake(micro_workflow, tmp_path):
    c = copy_tree(micro_workflow["copy"], tmp_path / "wf")
    (c / "config" / "offpolicy.yaml").write_text(
        "rloo: {off_policy_steps: 1, rollout_correction: {mismatch_every: 2}}\nrollout: {sampler_threads: 1}\n")
    res = snakemake(c, "--cores", "1", *CONFIGFILES, "config/offpolicy.yaml")
    # an rloo.* key: rloo, its policy's evaluation and the report
    assert job_counts(res.stdout + res.stderr) == {"rloo": 1, "evaluate": 1, "report": 1}
    steps = [json.loads(line) for line in (c / "results/models/rloo_rloo/steps.jsonl").read_text().splitlines()]
    assert [s["train/policy_lag"] for s in steps] == [0] + [1] * (len(steps) - 1)
    assert [s["step"] for s in steps if "train/lag_k3_token" in s] == [s["step"] for s in steps][::2]
    metrics = json.loads((c / "results/models/rloo_rloo/metrics.json").read_text())
    assert metrics["off_policy"]["mode"] == "token_tis" and metrics["steps_trained"] == len(steps)
    facts = json.loads((c / "results/work/rloo_rloo/timings.json").read_text())
    assert facts["sampler"] == "process" and facts["sampler_threads"] == 1
    assert (c / "results/gsm8k_rloo.json").is_file()
    # how many threads the sampler has is how fast, not what: nothing to rerun
    assert planned(c, extra_config="rloo: {off_policy_steps: 1, rollout_correction: {mismatch_every: 2}}\n"
                                   "rollout: {sampler_threads: 2}\n") == {}


def test_the_gpu_profile_asks_for_a_second_gpu_for_the_sampler(tmp_path):
    """Planned, not run: config/gpu.yaml off-policy under the cluster and GPU profiles, a dry run."""
    import yaml
    from workflow_helpers import make_copy

    c = make_copy(tmp_path / "wf")
    (c / "config" / "offpolicy-gpu.yaml").write_text(yaml.safe_dump({"rloo": {"off_policy_steps": 1}}))
    res = snakemake(c, "results/gsm8k_rloo.json", "-n", "--cores", "64", "--profile", "slurm", "--workflow-profile",
                    "profiles/gpu", "--configfile", "config/gpu.yaml", "config/offpolicy-gpu.yaml")
    out = res.stdout + res.stderr
    blocks = {m.group(1): m.group(2) for m in re.finditer(r"^rule (\w+):\n(.*?)(?=^\S|\Z)", out, re.M | re.S)}
    gpus = {rule: re.search(r"resources: .*\bgpu=(\d+)", blocks[rule]).group(1) for rule in ("sft", "reward", "rloo")}
    assert gpus == {"sft": "1", "reward": "1", "rloo": "2"}, gpus
