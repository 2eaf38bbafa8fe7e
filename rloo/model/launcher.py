"""What a launcher told this process: torchrun's variables (WORLD_SIZE, RANK, ...), or Slurm's for a task
of a multi-task srun step, mapped to torchrun's (`adopt_slurm_env`), so rloo/model/distributed.py sees one
kind of launcher. Torch-free: the workflow's rules and its relaunch (rloo_workflow/launch.py) use it too."""

from __future__ import annotations

import os


def launched_world() -> int:
    """WORLD_SIZE as a launcher (torchrun, or srun through `adopt_slurm_env`) set it; 1 outside one."""
    return int(os.environ.get("WORLD_SIZE", "1") or 1)


def launched_rank() -> int:
    """This process's RANK as its launcher set it; 0 outside a launcher."""
    return int(os.environ.get("RANK", "0") or 0) if launched_world() > 1 else 0


def first_host(nodelist: str) -> str:
    """The first host of a Slurm hostlist expression: "gpu[07-08,11],cpu1" -> "gpu07"."""
    head = nodelist.strip()
    depth = 0
    for i, ch in enumerate(head):  # the first comma outside brackets ends the first item
        depth += ch == "["
        depth -= ch == "]"
        if ch == "," and depth == 0:
            head = head[:i]
            break
    if "[" not in head:
        return head
    prefix, rest = head.split("[", 1)
    return prefix + rest.split("]", 1)[0].split(",")[0].split("-")[0] + rest.split("]", 1)[1]


def _tasks_on_node(spec: str, node: int) -> int:
    """This node's task count from SLURM_STEP_TASKS_PER_NODE ("8(x2),4": 8 on nodes 0-1, 4 on node 2)."""
    counts: list[int] = []
    for part in spec.split(","):
        n, _, times = part.partition("(x")
        counts += [int(n)] * int(times.rstrip(")") or 1)
    return counts[node] if node < len(counts) else counts[-1]


def slurm_task_env(environ: dict[str, str]) -> dict[str, str]:
    """torchrun's variables for a task of a Slurm step with several tasks (srun sets SLURM_STEP_ID,
    SLURM_PROCID, SLURM_LOCALID, SLURM_NTASKS), else {}: RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE,
    and the rendezvous MASTER_ADDR (the step's first host) and MASTER_PORT (from the job id, so two
    jobs sharing a node do not collide), unless those two are already set."""
    if "WORLD_SIZE" in environ or "SLURM_STEP_ID" not in environ or int(environ.get("SLURM_NTASKS", "1")) <= 1:
        return {}
    nodes = environ.get("SLURM_STEP_NODELIST") or environ["SLURM_JOB_NODELIST"]
    local = environ.get("SLURM_STEP_TASKS_PER_NODE") or environ.get("SLURM_TASKS_PER_NODE", "1")
    return {
        "RANK": environ["SLURM_PROCID"],
        "WORLD_SIZE": environ["SLURM_NTASKS"],
        "LOCAL_RANK": environ.get("SLURM_LOCALID", "0"),
        "LOCAL_WORLD_SIZE": str(_tasks_on_node(local, int(environ.get("SLURM_NODEID", "0")))),
        "MASTER_ADDR": environ.get("MASTER_ADDR") or first_host(nodes),
        "MASTER_PORT": environ.get("MASTER_PORT") or str(20000 + int(environ.get("SLURM_JOB_ID", "0")) % 20000),
    }


def adopt_slurm_env() -> None:
    """In a task of a multi-task srun step, set torchrun's variables from Slurm's (see slurm_task_env):
    the process then joins the group as a torchrun worker does."""
    os.environ.update(slurm_task_env(dict(os.environ)))
