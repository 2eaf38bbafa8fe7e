"""Issue 71: who holds Snakemake's lock (rloo_workflow/running.py, `rloo why-rerun`'s lock lines), with real
processes: a run that records itself as the Snakefile's onstart does, alive, killed with SIGKILL, and
killed while a job it started still runs. The whole chain (a Snakemake run killed, why-rerun, the
unlock, the rerun) is tests/e2e/test_workflow.py's test_kill_9_of_a_run_*."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from rloo_workflow import running
from rloo_workflow.why_rerun import lock_lines

UNLOCK = ["snakemake", "--unlock", "--configfile", "config/micro.yaml"]

# A run's main process as far as the record goes: it records itself (onstart), starts a "job" that
# inherits its environment, says so, and waits.
RUN = """
import subprocess, sys, time
from pathlib import Path
from rloo_workflow import running
running.start(Path(sys.argv[1]), ["snakemake", "--cores", "1"])
job = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"], start_new_session=True)
print(job.pid, flush=True)
time.sleep(120)
"""


# A workflow of one job, whose output a lock holds (as a killed run's would): `rloo why-rerun` runs in it.
SNAKEFILE = """\
rule all:
    default_target: True
    input: "out.txt"

rule a:
    output: "out.txt"
    shell: "touch {output}"
"""


@pytest.fixture
def run(tmp_path):
    """A recording run in `tmp_path`: its process and its job's PID; both killed at the end."""
    proc = subprocess.Popen([sys.executable, "-c", RUN, str(tmp_path)], stdout=subprocess.PIPE, text=True)
    job = int(proc.stdout.readline())
    yield proc, job
    for pid in (proc.pid, job):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    proc.wait()


def _record(root: Path) -> dict:
    (path,) = (root / running.RUNNING).glob("*.json")
    return json.loads(path.read_text())


def _gone(pid: int) -> None:
    """Until `pid` has exited (reaped by its parent, or an orphan reaped by init)."""
    deadline = time.monotonic() + 30
    while Path(f"/proc/{pid}").exists() and "Z" not in Path(f"/proc/{pid}/stat").read_text().split(")")[1][:3]:
        assert time.monotonic() < deadline, f"{pid} did not exit"
        time.sleep(0.05)


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="a process's identity is read from /proc")
def test_a_live_run_is_named_and_no_unlock_is_advised_until_it_and_its_jobs_are_gone(run, tmp_path):
    proc, job = run
    assert _record(tmp_path)["pid"] == proc.pid
    (tmp_path / "Snakefile").write_text(SNAKEFILE)
    (tmp_path / ".snakemake" / "locks").mkdir(parents=True)
    (tmp_path / ".snakemake" / "locks" / "0.output.lock").write_text("out.txt\n")
    why = subprocess.run([sys.executable, "-m", "rloo_workflow.cli", "why-rerun"], cwd=tmp_path,
                         capture_output=True, text=True, timeout=120)
    assert why.returncode == 0, why.stderr
    lines = why.stdout.splitlines()
    said = why.stdout
    assert lines[0].startswith("locked: "), said
    assert any(f"alive: PID {proc.pid} on " in line for line in lines), said
    assert "its jobs still run" not in said, said  # alive by its own process
    assert "--unlock" not in said.replace("never `snakemake --unlock`", ""), said

    # Snakemake killed alone: its job runs on, and still writes; the run is alive through it
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    said = "\n".join(lock_lines(tmp_path, True, UNLOCK))
    assert f"its jobs still run, and write: PID {job}" in said, said
    assert "--unlock" not in said.replace("never `snakemake --unlock`", ""), said

    os.kill(job, signal.SIGKILL)
    _gone(job)
    lines = lock_lines(tmp_path, True, UNLOCK)
    assert lines[1].startswith(f"no run is alive: the last run, PID {proc.pid} on "), lines
    assert lines[-1].endswith(": snakemake --unlock --configfile config/micro.yaml"), lines
    assert (tmp_path / running.RUNNING).is_dir()  # the dead run's record stays until the next run starts


def test_a_process_given_a_dead_runs_pid_is_not_that_run(tmp_path):
    """PIDs are reused: a record whose PID now runs another process (another start time) is dead."""
    rec = {"pid": os.getpid(), "host": running.socket.gethostname(), "identity": "another-boot:1",
           "started": "2026-01-01 00:00:00", "argv": ["snakemake"]}
    (tmp_path / running.RUNNING).mkdir(parents=True)
    (tmp_path / running.RUNNING / "x.json").write_text(json.dumps(rec))
    (got,) = running.recorded(tmp_path)
    assert got.alive is (not Path("/proc/self/stat").exists())
    # the next run forgets it, and records itself (here: this process, alive)
    running.start(tmp_path, ["snakemake"])
    try:
        (now,) = running.recorded(tmp_path)
        assert (now.pid, now.alive) == (os.getpid(), True)
    finally:
        running.end(tmp_path)
        os.environ.pop(running.RUN_ENV, None)
    assert running.recorded(tmp_path) == []


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="a process's identity is read from /proc")
def test_a_dead_run_whose_jobs_went_to_a_cluster_is_not_called_over(tmp_path):
    """Killed, the Snakemake that submitted Slurm jobs leaves them running on the nodes: no --unlock
    without a look at the queue first."""
    rec = {"pid": os.getpid(), "host": running.socket.gethostname(), "identity": "another-boot:1",
           "started": "2026-01-01 00:00:00", "argv": ["snakemake", "--profile", "slurm"], "local": False}
    (tmp_path / running.RUNNING).mkdir(parents=True)
    (tmp_path / running.RUNNING / "x.json").write_text(json.dumps(rec))
    lines = lock_lines(tmp_path, True, UNLOCK)
    assert "sent its jobs to a cluster" in lines[1] and lines[-1].startswith("once none of its jobs runs"), lines
    rec["local"] = True
    (tmp_path / running.RUNNING / "x.json").write_text(json.dumps(rec))
    assert lock_lines(tmp_path, True, UNLOCK)[-1].startswith("clear the lock, then run again: "), lines


def test_a_run_of_another_host_cannot_be_told(tmp_path):
    rec = {"pid": 1, "host": "login-2.example", "identity": None, "started": "2026-01-01 00:00:00",
           "argv": ["snakemake", "--profile", "slurm"]}
    (tmp_path / running.RUNNING).mkdir(parents=True)
    (tmp_path / running.RUNNING / "login-2.example-1.json").write_text(json.dumps(rec))
    lines = lock_lines(tmp_path, True, UNLOCK)
    assert "PID 1 on login-2.example" in lines[1] and "cannot be told" in lines[1], lines
    assert lines[-1].startswith("once it runs no more"), lines
