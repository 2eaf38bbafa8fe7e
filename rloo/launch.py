"""Starting a data-parallel run's processes: torchrun on one machine, srun inside a Slurm allocation.

`rloo sft|reward|train` with more than one process to run (`distributed.nodes` x `nproc_per_node`, or
`--nproc`) and no launcher around it replaces itself by one (`relaunch`):

- inside a Slurm allocation but not in one of its steps (a batch script, an salloc shell, the shell of
  a Snakemake rule with an `mpi` resource): `srun_command`, one task per process on every node;
- elsewhere: `torchrun --standalone --nproc-per-node N` (one machine only).

Each srun task maps Slurm's variables to torchrun's (`adopt_slurm_env`: RANK from SLURM_PROCID and so
on, the rendezvous at the step's first host), so rloo/model/distributed.py sees one kind of launcher.
Torch-free: the workflow's rules build their resources and the srun line with it.
"""

from __future__ import annotations

import os
import sys


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


def in_slurm_allocation() -> bool:
    """Inside a Slurm job but not in one of its steps: a batch script, an salloc shell, or the shell
    of a Snakemake rule with an `mpi` resource (the plugin runs it in the batch step, not under srun)."""
    return "SLURM_JOB_ID" in os.environ and "SLURM_STEP_ID" not in os.environ


def srun_command(cfg: dict, nproc: int | None = None) -> list[str]:
    """The srun line that starts every process of a run in the current allocation: one task per
    process, `distributed.nodes` x `nproc` (default: nproc_per_node) tasks, `threads` CPUs each.
    Counts are explicit: the Snakemake plugin strips the allocation's SLURM_* defaults from the
    rule's environment."""
    d = cfg["distributed"]
    per_node = nproc or d["nproc_per_node"]
    cmd = ["srun", f"--nodes={d['nodes']}", f"--ntasks={d['nodes'] * per_node}", f"--ntasks-per-node={per_node}"]
    if cfg["threads"]:
        cmd.append(f"--cpus-per-task={cfg['threads']}")
    return [*cmd, "--kill-on-bad-exit=1"]


def launch_problem(cfg: dict, nproc: int) -> str | None:
    """Why `rloo <stage> --nproc N` cannot start N processes here, or None."""
    d = cfg["distributed"]
    if d["strategy"] == "none":
        return f"--nproc {nproc} needs distributed.strategy ddp or fsdp (it is none)"
    if d["nodes"] > 1 and not in_slurm_allocation():
        return (f"distributed.nodes={d['nodes']}: run inside a Slurm allocation (sbatch, salloc, or "
                "snakemake --profile slurm), where the stage starts its processes with srun, or start one "
                "torchrun per node; --nproc launches the processes of this machine only")
    return None


def relaunch(cfg: dict, nproc: int, argv: list[str]) -> None:
    """Replace this process by the launcher of the run's processes, each running `rloo <argv>` without
    its --nproc (which torchrun's own parser would take for an abbreviation of its options): srun
    inside a Slurm allocation (every node of it: `srun_command`), else torchrun with `nproc` local
    processes."""
    args, rest = [], iter(argv)
    for a in rest:
        if a == "--nproc":
            next(rest, None)  # its value
        elif not a.startswith("--nproc="):
            args.append(a)
    if in_slurm_allocation():
        cmd = [*srun_command(cfg, nproc), sys.executable, "-m", "rloo.cli", *args]
        print(f"rloo: inside Slurm job {os.environ['SLURM_JOB_ID']}: {' '.join(cmd)}", file=sys.stderr)
        sys.stdout.flush()
        sys.stderr.flush()
        os.execvp(cmd[0], cmd)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           "-m", "rloo.cli", *args]
    sys.stdout.flush()
    sys.stderr.flush()
    os.execv(sys.executable, cmd)
