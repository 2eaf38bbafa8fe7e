"""Data-parallel stages launched by Slurm (rloo_workflow/launch.py, the rules' `gpu_resources`).

Fast: Slurm's task variables become torchrun's (ranks, local world, the rendezvous host and port), the
srun line, and what the rules ask Slurm for, in a dry run of the literal cluster command with 2 nodes x
8 GPUs (`snakemake --profile slurm -n -p`: nodes, tasks per node, GPUs per node, the srun line), and
with `strategy: none` exactly the one-GPU request of before.
On the test cluster, the literal `snakemake --profile slurm` runs the micro pipeline with its training
stages as 2-task jobs: test_workflow_slurm.py (one run for both the every-stage-a-job and the
data-parallel checks).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from workflow_helpers import CONFIGFILES, make_copy, snakemake

from rloo.model.launcher import first_host, slurm_task_env
from rloo_workflow.config import load_config
from rloo_workflow.launch import srun_command


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
