"""The literal cluster command, `snakemake --profile slurm results/gsm8k_rloo.json`, on a real Slurm,
with the training stages data-parallel: one run proves both that every stage runs as a Slurm job and
that the training stages run as multi-task jobs (rloo_workflow/launch.py, the rules' `gpu_resources`).

Runs in an isolated working copy of the workflow (tests/helpers/workflow_helpers.py) that holds the repo's
`slurm/` profile, so `--profile slurm` resolves to ./slurm exactly as from the repository root. Added
to the literal command: the micro config under `distributed: {strategy: ddp, nproc_per_node: 2}` (RLOO on
the reward model: the verifier pays the micro policy nothing, so there would be no update to compare),
an earlier first status check, and resource requests that fit the one-node test cluster. Checked:
every stage is one Slurm job, COMPLETED in sacct, GPU stages with their GPU; sft, reward and rloo each
ran one srun step of 2 tasks; the policy equals the one `rloo train --nproc 2` (torchrun) trains on this
machine from the same SFT policy and reward model; the run leaves nothing to do. Needs the cluster of
tests/slurm/start.sh (selection as in test_slurm_smoke.py: RLOO_SLURM=1 requires it, RLOO_SLURM=0
skips, unset runs if one answers). The fast checks of the launch plumbing: test_slurm_distributed.py.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time

import pytest
from test_slurm_smoke import _sacct, run_on_slurm, slurm_env  # noqa: F401  (slurm_env is a fixture)
from workflow_helpers import (
    CONFIGFILES,
    CPU_RULES,
    JOBS,
    PIPELINE,
    env_for,
    make_copy,
    same_weights,
    snakemake,
    snakemake_bin,
)

pytestmark = [pytest.mark.slurm, pytest.mark.slow]

LITERAL = ["--profile", "slurm", "results/gsm8k_rloo.json"]
TRAINING = ("sft", "reward", "rloo")
# a progress line (rloo/progress.py) after every step: the micro stages take seconds, not minutes
DDP2 = "distributed: {strategy: ddp, nproc_per_node: 2}\nreward: {source: model}\nprogress_every_s: 0.01\n"
CONFIGS = [*CONFIGFILES, "config/ddp.yaml"]
TEST_OPTIONS = [
    # first sacct query 2 s after a submission instead of the profile's 30 s
    "--slurm-init-seconds-before-status-checks", "2",
    # the plugin deletes a successful job's Slurm log at the end of the run: kept, to read its progress lines
    "--slurm-keep-successful-logs",
    # the GPU stages ask for 16-32 GB, the test node may have less; the 2-task jobs share its one (fake) GPU
    "--set-resources", "base:mem_mb=2000", "evaluate:mem_mb=2000",
    *(f"{rule}:{res}" for rule in TRAINING for res in ("mem_mb=2000", "gres=gpu:1")),
    # last: --configfile takes several values
    *CONFIGS,
]
GPU_STAGES = PIPELINE - CPU_RULES
TARGET = "results/models/rloo_rloo"


def _steps(job_id: str) -> dict[str, tuple[str, str, str]]:
    """{JobID: (State, NTasks, Comment)} of a job and its steps."""
    res = subprocess.run(["sacct", "-n", "-P", "-j", job_id, "--format", "JobID,State,NTasks,Comment"],
                         capture_output=True, text=True, timeout=30, check=True)
    rows = [line.split("|") for line in res.stdout.splitlines() if line.strip()]
    return {r[0]: (r[1], r[2], r[3]) for r in rows}


def test_literal_slurm_command_runs_every_stage_as_a_job_and_training_as_two_task_jobs(slurm_env, tmp_path):  # noqa: F811
    copy = make_copy(tmp_path / "wf")
    (copy / "config" / "ddp.yaml").write_text(DDP2)
    output, job_ids = run_on_slurm(copy, [snakemake_bin(), *LITERAL, *TEST_OPTIONS], 900,
                                   "snakemake --profile slurm results/gsm8k_rloo.json (micro, ddp x 2)")

    result = json.loads((copy / "results/gsm8k_rloo.json").read_text())
    assert set(result["policies"]) == {"sft", "rloo"}

    # every stage ran as its own Slurm job, and Slurm accounted it (and each of its steps) as COMPLETED
    assert len(job_ids) == sum(JOBS.values()), output[-3000:]
    deadline = time.monotonic() + 30  # sacct may lag slurmctld by a second or two
    while True:
        jobs = {i: _steps(i) for i in job_ids}
        done = all(rows.get(i, ("",))[0] == "COMPLETED" for i, rows in jobs.items())
        if done or time.monotonic() > deadline:
            break
        time.sleep(1)
    assert done, jobs
    tres = _sacct(job_ids, "State,Comment,AllocTRES")
    # the plugin records the rule in the job comment: rule_<name>[_wildcards_<values>]
    by_rule = {re.match(r"rule_([a-z]+)", rows[i][2]).group(1): (i, rows) for i, rows in jobs.items()}
    assert set(by_rule) == PIPELINE, jobs
    for rule, (job_id, _) in by_rule.items():
        assert ("gres/gpu=1" in tres[job_id][2]) == (rule in GPU_STAGES), (rule, tres[job_id])
    for rule in TRAINING:
        job_id, rows = by_rule[rule]
        # the job, its batch step (the rule's shell) and the one srun step of the stage's 2 processes
        assert rows[f"{job_id}.batch"][:2] == ("COMPLETED", "1"), (rule, rows)
        assert rows[f"{job_id}.0"][:2] == ("COMPLETED", "2"), (rule, rows)
    log = (copy / "logs" / "rloo_rloo.log").read_text()
    assert "srun --nodes=1 --ntasks=2 --ntasks-per-node=2 --cpus-per-task=1" in log, log[-3000:]
    # the job's progress lines in its Slurm log, where the plugin sends the job's output (the stage's stderr
    # is its own log, logs/rloo_rloo.log, which keeps them too), written once: by the first of its 2 processes
    slurm_logs = list((copy / ".snakemake" / "slurm_logs" / "rule_rloo").rglob("*.log"))
    job_log = "".join(f.read_text(errors="replace") for f in slurm_logs)
    steps = re.findall(r"^rloo: step (\d+)/4 \(\d+%\) · reward -?[\d.]+ · kl -?[\d.]+ · ", job_log, re.M)
    assert steps and steps == sorted(set(steps)) and steps[-1] == "4", (slurm_logs, job_log[-3000:])
    assert "rloo.progress: rloo: step 4/4" in log and "\r" not in log, log[-3000:]

    # the cluster run leaves nothing to do, under the same profile
    dry = snakemake(copy, *LITERAL, "-n", *CONFIGS)
    assert "Nothing to be done" in dry.stdout + dry.stderr

    # The same training under torchrun on this machine, from the cluster run's SFT policy.
    local = tmp_path / "local"
    train = [sys.executable, "-m", "rloo_workflow.cli", "train", *[a for c in ["config/config.yaml", *CONFIGS[1:]]
                                                          for a in ("-c", str(copy / c))],
             "--set", "threads=1", "--data", str(copy / "data" / "gsm8k"), "--policy", str(copy / "results/models/sft"),
             "--reward-model", str(copy / "results/models/reward"),
             "--out", str(local / "out"), "--work", str(local / "work")]
    done = subprocess.run(train, env=env_for(copy), capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    assert same_weights(copy / TARGET, local / "out")
    assert not same_weights(copy / TARGET, copy / "results/models/sft")  # RLOO moved the weights
