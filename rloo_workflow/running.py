"""The `snakemake` runs of this working folder that may still be running: for `rloo why-rerun`, to say
whether the run that holds Snakemake's lock (.snakemake/locks) is alive.

Snakemake's lock files hold paths, not processes, and a run killed with SIGKILL leaves them behind: the
next run stops at once with `LockException`, and its advice, `--unlock`, is just as wrong while the
run that holds them is alive (both would write the same files). So each run records itself here as it
starts its jobs (the Snakefile's onstart: the main process only, not a dry run, not a job) and removes
its record as it ends (onsuccess, onerror). A run killed with SIGKILL leaves its record behind, which
is the point: its process can be looked for. On this host a record's run is alive when its PID runs
the same process (the same start time since the same boot: a later process may have been given the
PID), or when a process of its jobs still runs: Snakemake's local jobs outlive a Snakemake killed alone,
and go on writing; they carry the run's RUN_ENV, which the run sets as it records itself. On another
host (a shared file system) nothing here can tell.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from rloo.io import write_json_atomic

RUNNING = ".rloo/running"
# <host>-<pid> of the run, in the environment of its jobs (and so of their processes)
RUN_ENV = "RLOO_RUN"


@dataclass(frozen=True)
class Run:
    """One recorded run: `alive` is None where this host cannot tell (another host's run)."""

    pid: int
    host: str
    started: str
    argv: list[str]
    alive: bool | None
    jobs: list[int]  # this host's processes of its jobs still running after its Snakemake is gone
    record: Path  # its file
    local: bool = True  # its jobs ran on this host (else an executor sent them to a cluster's nodes)

    def __str__(self) -> str:
        return f"PID {self.pid} on {self.host}, started {self.started}: {' '.join(self.argv)}"


def _identity(pid: int) -> str | None:
    """What tells process `pid` from a later one given the same PID: the boot and its start time in clock
    ticks since the boot (Linux's /proc); None where there is no such process, or no /proc."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return None
    # field 22 of stat, counted after the command name's closing parenthesis (a name may hold spaces)
    return f"{boot}:{stat.rsplit(')', 1)[1].split()[19]}"


def _alive(pid: int, identity: str | None) -> bool:
    if Path("/proc/self/stat").exists():
        return identity is not None and _identity(pid) == identity
    try:  # no /proc (macOS): the PID alone; a later process given it counts as alive, the safe side
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _key(host: str, pid: int) -> str:
    return f"{host}-{pid}"


def _path(root: Path, host: str, pid: int) -> Path:
    return Path(root) / RUNNING / f"{_key(host, pid)}.json"


def _with_env(key: str) -> list[int]:
    """This host's processes whose environment has RUN_ENV=`key` (those of this user: /proc shows no one
    else's environment)."""
    wanted, pids = f"{RUN_ENV}={key}".encode(), []
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            env = (proc / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if wanted in env and int(proc.name) != os.getpid():
            pids.append(int(proc.name))
    return sorted(pids)


def start(root: Path, argv: list[str] | None = None, local: bool = True) -> None:
    """Record this process as a run of `root` (its main process, as it starts its jobs; `local`: they run
    on this host, Snakemake's `workflow.local_exec`), and forget the records of this host's runs that
    are gone."""
    host, pid = socket.gethostname(), os.getpid()
    for run in recorded(root):
        if run.alive is False:
            run.record.unlink(missing_ok=True)
    os.environ[RUN_ENV] = _key(host, pid)  # the jobs' environment (this process starts them)
    write_json_atomic(_path(root, host, pid), {
        "pid": pid, "host": host, "identity": _identity(pid), "started": time.strftime("%Y-%m-%d %H:%M:%S"),
        "argv": list(sys.argv if argv is None else argv), "local": bool(local),
    })


def end(root: Path) -> None:
    """Remove this process's record (the run ends: onsuccess, onerror)."""
    _path(root, socket.gethostname(), os.getpid()).unlink(missing_ok=True)


def recorded(root: Path) -> list[Run]:
    """The runs recorded in `root`, oldest first, each with whether it is alive."""
    host, runs = socket.gethostname(), []
    for path in sorted((Path(root) / RUNNING).glob("*.json")):
        try:
            rec = json.loads(path.read_text())
            pid, where = int(rec["pid"]), str(rec["host"])
        except (OSError, ValueError, KeyError, TypeError):
            continue  # a record being replaced, or not one of these
        alive = _alive(pid, rec.get("identity")) if where == host else None
        jobs = _with_env(_key(where, pid)) if alive is False else []  # its Snakemake gone, its jobs not
        runs.append(Run(pid=pid, host=where, started=str(rec.get("started", "?")),
                        argv=[str(a) for a in rec.get("argv", [])], alive=None if alive is None else alive or bool(jobs),
                        jobs=jobs, record=path, local=bool(rec.get("local", True))))
    return sorted(runs, key=lambda r: r.started)


def snakemake_processes(root: Path) -> list[int]:
    """The PIDs of this host's `snakemake` processes working in `root` (Linux's /proc; none elsewhere),
    dry runs and unlocks left out: a run holds its lock a moment before it records itself (it builds its
    DAG under the lock, then starts), and a run of an older rloo never records itself."""
    root, pids = Path(root).resolve(), []
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            args = [a.decode(errors="replace") for a in (proc / "cmdline").read_bytes().split(b"\0") if a]
            cwd = Path(os.readlink(proc / "cwd"))
        except OSError:
            continue
        # snakemake, python .../snakemake, python -m snakemake
        if (cwd == root and any(Path(a).name == "snakemake" for a in args[:3])
                and not {"-n", "--dry-run", "--dryrun", "--unlock", "--mode"} & set(args)):
            pids.append(int(proc.name))
    return sorted(pids)
