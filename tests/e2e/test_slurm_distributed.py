"""Data-parallel stages launched by Slurm (rloo/launch.py, the rules' `gpu_resources`).

Fast: Slurm's task variables become torchrun's (ranks, local world, the rendezvous host and port), the
srun line, and what the rules ask Slurm for, in a dry run of the literal cluster command with 2 nodes x
8 GPUs (`snakemake --profile slurm -n -p`: nodes, tasks per node, GPUs per node, the srun line), and
with `strategy: none` exactly the one-GPU request of before.
Slurm (the cluster of tests/slurm/start.sh, selected as in test_slurm_smoke.py): the literal
`snakemake --profile slurm` for the micro RLOO policy under `distributed: {strategy: ddp,
nproc_per_node: 2}`: sft, reward and rloo each run as one Slurm job whose srun step has 2 tasks,
COMPLETED in sacct, and the policy equals the one `rloo train --nproc 2` (torchrun) trains from the
same SFT policy and reward model.
"""

from __future__ import annotations

import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
from test_slurm_smoke import run_on_slurm, slurm_env  # noqa: F401  (slurm_env is a fixture)
from workflow_helpers import CONFIGFILES, env_for, make_copy, same_weights, snakemake, snakemake_bin

from rloo.config import load_config
from rloo.launch import first_host, slurm_task_env, srun_command

TARGET = "results/models/rloo_rloo"
TRAINING = ("sft", "reward", "rloo")
# RLOO trains on the reward model (the verifier pays the micro policy nothing: no update to compare)
DDP2 = "distributed: {strategy: ddp, nproc_per_node: 2}\nreward: {source: model}\n"


# -- fast -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("nodelist, host", [("vm", "vm"), ("gpu[07-08,11]", "gpu07"), ("a[1-2],b3", "a1"),
                                            ("n-[003,005]-ib", "n-003-ib"), ("x1,y[2-3]", "x1")])
def test_the_first_host_of_a_slurm_nodelist(nodelist, host):
    assert first_host(nodelist) == host


def test_a_task_of_an_srun_step_gets_torchruns_variables():
    step = {"SLURM_JOB_ID": "4242", "SLURM_STEP_ID": "0", "SLURM_PROCID": "11", "SLURM_LOCALID": "3",
            "SLURM_NODEID": "1", "SLURM_NTASKS": "16", "SLURM_STEP_NODELIST": "gpu[07-08]",
            "SLURM_STEP_TASKS_PER_NODE": "8(x2)"}
    assert slurm_task_env(step) == {"RANK": "11", "WORLD_SIZE": "16", "LOCAL_RANK": "3", "LOCAL_WORLD_SIZE": "8",
                                    "MASTER_ADDR": "gpu07", "MASTER_PORT": str(20000 + 4242)}
    assert slurm_task_env({**step, "SLURM_NODEID": "2", "SLURM_STEP_TASKS_PER_NODE": "8(x2),4"})["LOCAL_WORLD_SIZE"] == "4"
    # given rendezvous settings win; torchrun's own variables, one task, or no step: nothing to map
    assert slurm_task_env({**step, "MASTER_ADDR": "h", "MASTER_PORT": "1"})["MASTER_ADDR"] == "h"
    assert slurm_task_env({**step, "WORLD_SIZE": "16"}) == {}
    assert slurm_task_env({**step, "SLURM_NTASKS": "1"}) == {}
    assert slurm_task_env({k: v for k, v in step.items() if k != "SLURM_STEP_ID"}) == {}  # the batch step


def test_the_srun_line_names_every_count():
    cfg = load_config(None, {"threads": 6, "distributed": {"strategy": "fsdp", "nproc_per_node": 8, "nodes": 2}})
    assert srun_command(cfg) == ["srun", "--nodes=2", "--ntasks=16", "--ntasks-per-node=8", "--cpus-per-task=6",
                                 "--kill-on-bad-exit=1"]
    assert srun_command(cfg, 4)[2:4] == ["--ntasks=8", "--ntasks-per-node=4"]  # --nproc 4


def _dry_run_jobs(copy: Path, extra: str) -> dict[str, str]:
    """{rule: its `resources:` line} of `snakemake --profile slurm -n -p` for the micro RLOO policy."""
    (copy / "config" / "extra.yaml").write_text(extra)
    res = snakemake(copy, "--profile", "slurm", "-n", "-p", "results/gsm8k_rloo.json", *CONFIGFILES, "config/extra.yaml")
    out = res.stdout + res.stderr
    jobs = dict(re.findall(r"^rule (\w+):\n(?:    .*\n)*?    resources: (.*)$", out, re.M))
    assert set(jobs) >= {"sft", "reward", "rloo", "evaluate"}, out[-3000:]
    return jobs


def _sbatch_flags(resources: str) -> set[str]:
    """The sbatch options snakemake-executor-plugin-slurm builds from a dry run's `resources:` line."""
    from types import SimpleNamespace

    from snakemake_executor_plugin_slurm.submit_string import get_submit_command
    from snakemake_executor_plugin_slurm.utils import set_gres_string

    class Resources(dict):
        __getattr__ = dict.__getitem__

    res = Resources((k, int(v) if v.isdigit() else v) for k, v in (kv.split("=", 1) for kv in resources.split(", ")))
    job = SimpleNamespace(resources=res, threads=res["cpus_per_task"])
    params = {"run_uuid": "u", "slurm_logfile": "log", "comment_str": "c", "account": "", "partition": "", "workdir": ""}
    return set((get_submit_command(job, params) + set_gres_string(job)).split())


@pytest.mark.slow
def test_the_cluster_dry_run_shows_the_multi_node_request_and_its_srun_line(tmp_path):
    copy = make_copy(tmp_path / "wf")
    jobs = _dry_run_jobs(copy, "distributed: {strategy: fsdp, nproc_per_node: 8, nodes: 2}\n")
    for rule in ("sft", "reward", "rloo"):
        res = jobs[rule]
        for part in ("nodes=2", "gres=gpu:8", "tasks_per_node=8",
                     "mpi=srun --nodes=2 --ntasks=16 --ntasks-per-node=8 --cpus-per-task=1 --kill-on-bad-exit=1"):
            assert part in res, (rule, part, res)
        assert "gpu=1" not in res, res
    assert "gpu=1" in jobs["evaluate"] and "mpi=" not in jobs["evaluate"]  # one process
    # what the Slurm plugin makes of them (its own submit-string code): one task per GPU on each node
    assert _sbatch_flags(jobs["rloo"]) >= {"--nodes=2", "--ntasks-per-node=8", "--cpus-per-task=1", "--gres=gpu:8"}
    # one process per node: `tasks` (the plugin's --ntasks) with one task per GPU
    jobs = _dry_run_jobs(copy, "distributed: {strategy: ddp, nproc_per_node: 1, nodes: 4}\n")
    assert all(p in jobs["rloo"] for p in ("nodes=4", "gres=gpu:1", "tasks=4", "tasks_per_gpu=1", "mpi=srun --nodes=4"))


@pytest.mark.slow
def test_strategy_none_asks_slurm_for_what_it_did_before(tmp_path):
    jobs = _dry_run_jobs(make_copy(tmp_path / "wf"), "distributed: {strategy: none, nproc_per_node: 8}\n")
    for rule in ("sft", "reward", "rloo", "evaluate"):
        assert "gpu=1" in jobs[rule] and not re.search(r"\b(mpi|nodes|tasks\w*|gres)=", jobs[rule]), jobs[rule]


# -- on the test cluster --------------------------------------------------------------------------
def _steps(job_id: str) -> dict[str, tuple[str, str]]:
    """{JobID: (State, NTasks)} of a job and its steps (sacct -j <id> --format JobID,State,NTasks)."""
    res = subprocess.run(["sacct", "-n", "-P", "-j", job_id, "--format", "JobID,State,NTasks,Comment"],
                         capture_output=True, text=True, timeout=30, check=True)
    rows = [line.split("|") for line in res.stdout.splitlines() if line.strip()]
    return {r[0]: (r[1], r[2], r[3]) for r in rows}


@pytest.mark.slurm
@pytest.mark.slow
def test_literal_slurm_command_runs_the_training_stages_as_two_task_jobs(slurm_env, tmp_path):  # noqa: F811
    copy = make_copy(tmp_path / "wf")
    (copy / "config" / "ddp.yaml").write_text(DDP2)
    configs = [*CONFIGFILES, "config/ddp.yaml"]
    cmd = [snakemake_bin(), "--profile", "slurm", TARGET,
           "--slurm-init-seconds-before-status-checks", "2",
           # fits the one-node test cluster: 2 tasks x 1 CPU, its one (fake) GPU shared, 2 GB
           "--set-resources", *(f"{rule}:{res}" for rule in TRAINING for res in ("mem_mb=2000", "gres=gpu:1")),
           *configs]
    output, job_ids = run_on_slurm(copy, cmd, 600, f"snakemake --profile slurm {TARGET} (micro, ddp x 2)")
    assert len(job_ids) == 5, output[-3000:]  # prepare, base and the training stages

    deadline = time.monotonic() + 30  # sacct lags slurmctld by a second or two
    while True:
        jobs = {i: _steps(i) for i in job_ids}
        done = all(rows.get(i, ("",))[0] == "COMPLETED" for i, rows in jobs.items())
        if done or time.monotonic() > deadline:
            break
        time.sleep(1)
    by_rule = {re.match(r"rule_([a-z]+)", rows[i][2]).group(1): (i, rows) for i, rows in jobs.items()}
    assert set(by_rule) == {"prepare", "base", *TRAINING}, jobs
    for rule in TRAINING:
        job_id, rows = by_rule[rule]
        # the job, its batch step (the rule's shell) and the one srun step of the stage's 2 processes
        assert rows[job_id][0] == "COMPLETED", rows
        assert rows[f"{job_id}.batch"][:2] == ("COMPLETED", "1"), rows
        assert rows[f"{job_id}.0"][:2] == ("COMPLETED", "2"), rows
    log = (copy / "logs" / "rloo_rloo.log").read_text()
    assert "srun --nodes=1 --ntasks=2 --ntasks-per-node=2 --cpus-per-task=1" in log, log[-3000:]

    # The same training under torchrun on this machine, from the cluster run's SFT policy.
    local = tmp_path / "local"
    train = [sys.executable, "-m", "rloo.cli", "train", *[a for c in ["config/config.yaml", *configs[1:]]
                                                          for a in ("-c", str(copy / c))],
             "--set", "threads=1", "--data", str(copy / "data" / "gsm8k"), "--policy", str(copy / "results/models/sft"),
             "--reward-model", str(copy / "results/models/reward"),
             "--out", str(local / "out"), "--work", str(local / "work")]
    done = subprocess.run(train, env=env_for(copy), capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    assert same_weights(copy / TARGET, local / "out")
    assert not same_weights(copy / TARGET, copy / "results/models/sft")  # RLOO moved the weights
