"""Starting a data-parallel run's processes: torchrun on one machine, srun inside a Slurm allocation.

`rloo sft|reward|train` with more than one process to run (`distributed.nodes` x `nproc_per_node`, or
`--nproc`) and no launcher around it replaces itself by one (`relaunch`):

- inside a Slurm allocation but not in one of its steps (a batch script, an salloc shell, the shell of
  a Snakemake rule with an `mpi` resource): `srun_command`, one task per process on every node;
- elsewhere: `torchrun --standalone --nproc-per-node N` (one machine only).

Each srun task maps Slurm's variables to torchrun's (`adopt_slurm_env`: RANK from SLURM_PROCID and so
on, the rendezvous at the step's first host), so rloo/model/distributed.py sees one kind of launcher
(rloo/model/launcher.py).
Torch-free: the workflow's rules build their resources and the srun line with it.
"""

from __future__ import annotations

import os
import sys

from rloo.settings import Config


def in_slurm_allocation() -> bool:
    """Inside a Slurm job but not in one of its steps: a batch script, an salloc shell, or the shell
    of a Snakemake rule with an `mpi` resource (the plugin runs it in the batch step, not under srun)."""
    return "SLURM_JOB_ID" in os.environ and "SLURM_STEP_ID" not in os.environ


def srun_command(cfg: dict, nproc: int | None = None) -> list[str]:
    """The srun line that starts every process of a run in the current allocation: one task per
    process, `distributed.nodes` x `nproc` (default: nproc_per_node) tasks, `threads` CPUs each.
    Counts are explicit: the Snakemake plugin strips the allocation's SLURM_* defaults from the
    rule's environment."""
    config = Config.of(cfg)
    d = config.distributed
    per_node = nproc or d.nproc_per_node
    cmd = ["srun", f"--nodes={d.nodes}", f"--ntasks={d.nodes * per_node}", f"--ntasks-per-node={per_node}"]
    if config.threads:
        cmd.append(f"--cpus-per-task={config.threads}")
    return [*cmd, "--kill-on-bad-exit=1"]


def launch_problem(cfg: dict, nproc: int) -> str | None:
    """Why `rloo <stage> --nproc N` cannot start N processes here, or None."""
    d = Config.of(cfg).distributed
    if d.strategy == "none":
        return f"--nproc {nproc} needs distributed.strategy ddp or fsdp (it is none)"
    if d.nodes > 1 and not in_slurm_allocation():
        return (f"distributed.nodes={d.nodes}: run inside a Slurm allocation (sbatch, salloc, or "
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
        cmd = [*srun_command(cfg, nproc), sys.executable, "-m", "rloo_workflow.cli", *args]
        print(f"rloo: inside Slurm job {os.environ['SLURM_JOB_ID']}: {' '.join(cmd)}", file=sys.stderr)
        sys.stdout.flush()
        sys.stderr.flush()
        os.execvp(cmd[0], cmd)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           "-m", "rloo_workflow.cli", *args]
    sys.stdout.flush()
    sys.stderr.flush()
    os.execv(sys.executable, cmd)
