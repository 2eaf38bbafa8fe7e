"""End-to-end smoke test of the real one-node Slurm started by tests/slurm/start.sh.

Runs a two-rule Snakefile (one rule asks for ``gpu=1``, one is CPU-only) through Snakemake's
``slurm`` executor plugin and checks, from inside the jobs and from ``sacct``, that:
both jobs COMPLETED, the GPU job got ``gres/gpu=1`` (and ``CUDA_VISIBLE_DEVICES``), jobs run in
the submission directory with the submitting interpreter and environment (sbatch --export=ALL).
A second test checks that ``--signal`` delivers SIGTERM to a job step before its time limit.

Selection: ``RLOO_SLURM=1`` makes a missing/unhealthy Slurm a failure (CI after start.sh);
``RLOO_SLURM=0`` always skips; unset runs when ``sinfo`` answers with a usable node, else skips.
"""

from __future__ import annotations

import functools
import json
import os
import re
import shlex
import shutil
import socket
import subprocess
import sys
import textwrap
import time
import uuid
from pathlib import Path

import pytest
from workflow_helpers import env_for

pytestmark = [pytest.mark.slurm, pytest.mark.slow]


def _state_dir() -> Path:
    """$SLURM_TEST_DIR, else the directory /etc/slurm/slurm.conf points at, else start.sh's default."""
    if os.environ.get("SLURM_TEST_DIR"):
        return Path(os.environ["SLURM_TEST_DIR"])
    try:
        for line in Path("/etc/slurm/slurm.conf").read_text().splitlines():
            if line.startswith("StateSaveLocation=") and line.rstrip().endswith("/slurmctld"):
                return Path(line.split("=", 1)[1].strip()).parent
    except OSError:
        pass
    return Path("/var/lib/rloo-slurm")


START_HINT = "start it with `sudo tests/slurm/start.sh` (stop with tests/slurm/stop.sh)"


def _read_env_file() -> dict[str, str]:
    """KEY=VALUE lines written by start.sh (values may be double-quoted)."""
    env: dict[str, str] = {}
    path = _state_dir() / "env"
    if path.is_file():
        for line in path.read_text().splitlines():
            if "=" in line and not line.lstrip().startswith("#"):
                key, value = line.split("=", 1)
                env[key.strip()] = value.strip().strip('"')
    return env


def _slurmctld_address() -> tuple[str, int] | None:
    """(address, port) of SlurmctldHost in slurm.conf, None when there is no slurm.conf."""
    conf = Path(os.environ.get("SLURM_CONF", "/etc/slurm/slurm.conf"))
    if not conf.is_file():
        return None
    host, port = "localhost", 6817
    for line in conf.read_text().splitlines():
        key, _, value = line.partition("=")
        if key.strip().lower() == "slurmctldhost" and host == "localhost":
            value = value.strip()  # name(addr) or name
            host = value[value.find("(") + 1 : value.find(")")] if "(" in value else value
        elif key.strip().lower() == "slurmctldport":
            port = int(value.strip().split("-")[0])
    return host, port


@functools.cache
def _slurm_problem() -> str | None:
    """None if a usable Slurm answers, else why not (fast when nothing runs: sinfo retries ~5 s)."""
    if shutil.which("sinfo") is None:
        return "Slurm client tools not installed (no `sinfo` on PATH)"
    address = _slurmctld_address()
    if address is None:
        return "no /etc/slurm/slurm.conf"
    try:
        socket.create_connection(address, timeout=2).close()
    except OSError as exc:
        return f"slurmctld not listening on {address[0]}:{address[1]} ({exc.strerror or exc})"
    try:
        res = subprocess.run(["sinfo", "-h", "-o", "%T"], capture_output=True, text=True, timeout=20)
    except subprocess.TimeoutExpired:
        return "`sinfo` timed out (slurmctld not answering)"
    if res.returncode != 0:
        return f"`sinfo` failed: {res.stderr.strip() or res.stdout.strip()}"
    states = res.stdout.split()
    if not any(s.rstrip("*~#") in {"idle", "mixed", "allocated", "completing"} for s in states):
        return f"no usable Slurm node (sinfo states: {states or 'none'})"
    if shutil.which("sacct") is None:
        return "`sacct` not installed"
    res = subprocess.run(["sacct", "-n", "-X", "-S", "now"], capture_output=True, text=True, timeout=20)
    if res.returncode != 0:
        return f"`sacct` failed (slurmdbd down?): {res.stderr.strip()}"
    return None


@pytest.fixture(scope="module")
def slurm_env() -> dict[str, str]:
    wanted = os.environ.get("RLOO_SLURM")
    if wanted == "0":
        pytest.skip("RLOO_SLURM=0")
    problem = _slurm_problem()
    if problem:
        if wanted == "1":
            pytest.fail(f"RLOO_SLURM=1 but Slurm is not usable: {problem}; {START_HINT}")
        pytest.skip(f"no usable Slurm: {problem}; {START_HINT}, or set RLOO_SLURM=1 to require it")
    env = _read_env_file()
    env.setdefault("SLURM_TEST_ACCOUNT", "rloo")
    env.setdefault("SLURM_TEST_PARTITION", "gpu")
    return env


def _snakemake_bin() -> str:
    """The snakemake console script of the running interpreter (the project venv)."""
    candidate = Path(sys.executable).parent / "snakemake"
    if candidate.exists():
        return str(candidate)
    found = shutil.which("snakemake")
    if found is None:
        pytest.skip("snakemake not installed")
    return found


def _sacct(job_ids: list[str], fields: str) -> dict[str, list[str]]:
    res = subprocess.run(
        ["sacct", "-X", "-n", "-P", "-j", ",".join(job_ids), "-o", f"JobID,{fields}"],
        capture_output=True,
        text=True,
        timeout=30,
        check=True,
    )
    rows = [line.split("|") for line in res.stdout.splitlines() if line.strip()]
    return {row[0]: row[1:] for row in rows}


def run_on_slurm(copy: Path, cmd: list[str], limit_s: int, what: str) -> tuple[str, list[str]]:
    """Run a `snakemake --profile slurm ...` command in `copy` (under `timeout` where there is one):
    its output and the Slurm job ids it submitted. A failed run is cancelled and fails the test with
    the diagnostics."""
    if shutil.which("timeout"):
        cmd = ["timeout", "-k", "15", str(limit_s), *cmd]
    t0 = time.monotonic()
    res = subprocess.run(cmd, cwd=copy, env=env_for(copy), capture_output=True, text=True, timeout=limit_s + 60)
    print(f"{what}: {time.monotonic() - t0:.1f} s")
    output = res.stdout + res.stderr
    job_ids = re.findall(r"submitted with SLURM jobid (\d+)", output)
    try:
        assert res.returncode == 0, f"snakemake exited {res.returncode}\n{_diagnostics(copy, output)}"
    finally:
        if res.returncode != 0 and job_ids:
            subprocess.run(["scancel", *job_ids], check=False, capture_output=True)
    return output, job_ids


def _diagnostics(workdir: Path, output: str) -> str:
    parts = ["--- snakemake output (tail) ---", output[-6000:]]
    for log in sorted((workdir / ".snakemake" / "slurm_logs").rglob("*.log")):
        parts += [f"--- {log.relative_to(workdir)} (tail) ---", log.read_text(errors="replace")[-3000:]]
    parts.append("--- squeue / sacct ---")
    for cmd in (
        ["squeue"],
        ["sacct", "-X", "-S", "now-15minutes", "-o", "JobID,JobName%20,State,Comment%20,AllocTRES%50"],
    ):
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
        parts.append(res.stdout + res.stderr)
    return "\n".join(parts)


RECORD_PY = textwrap.dedent(
    """\
    import json, os, sys

    KEYS = ["CUDA_VISIBLE_DEVICES", "SLURM_JOB_ID", "SLURM_JOB_PARTITION", "SLURM_STEP_GPUS",
            "SLURM_GPUS_ON_NODE", "SLURM_CPUS_PER_TASK", "RLOO_SMOKE_MARKER", "VIRTUAL_ENV"]


    def record(path):
        info = {k: os.environ.get(k) for k in KEYS}
        info.update(cwd=os.getcwd(), executable=sys.executable, prefix=sys.prefix)
        with open(path, "w") as f:
            json.dump(info, f, indent=1)


    if __name__ == "__main__":
        record(sys.argv[1])
    """
)

SNAKEFILE = textwrap.dedent(
    """\
    import sys
    sys.path.insert(0, workflow.basedir)
    from record import record

    rule all:
        input: "out/gpu.json", "out/cpu.json"

    # runs inside the job's own snakemake process (the interpreter the plugin submits)
    rule gpu_job:
        output: "out/gpu.json"
        resources: gpu=1
        run:
            record(output[0])

    # a shell rule: `python` is whatever PATH (exported by sbatch) finds
    rule cpu_job:
        output: "out/cpu.json"
        threads: 1
        shell: "python record.py {output}"
    """
)


def test_slurm_smoke_snakemake_executor(slurm_env: dict[str, str], tmp_path: Path) -> None:
    workdir = tmp_path / "wf"
    profile = tmp_path / "profile"
    workdir.mkdir()
    profile.mkdir()
    (workdir / "Snakefile").write_text(SNAKEFILE)
    (workdir / "record.py").write_text(RECORD_PY)
    account, partition = slurm_env["SLURM_TEST_ACCOUNT"], slurm_env["SLURM_TEST_PARTITION"]
    (profile / "config.yaml").write_text(
        textwrap.dedent(
            f"""\
            executor: slurm
            jobs: 4
            latency-wait: 10
            printshellcmds: true
            default-resources:
              - slurm_partition={partition}
              - slurm_account={account}
              - runtime=5
              - mem_mb=500
            # first sacct poll after 2 s instead of 40 s (later polls back off by +10 s each)
            slurm-init-seconds-before-status-checks: 2
            """
        )
    )
    marker = uuid.uuid4().hex
    venv_bin = str(Path(sys.executable).parent)
    env = dict(os.environ)
    env.update(
        RLOO_SMOKE_MARKER=marker,
        # as if the venv were activated: shell rules then find its `python` (sbatch exports PATH)
        PATH=venv_bin + os.pathsep + env.get("PATH", ""),
        VIRTUAL_ENV=sys.prefix,
    )
    cmd = [_snakemake_bin(), "--profile", str(profile)]
    if shutil.which("timeout"):
        cmd = ["timeout", "-k", "10", "300", *cmd]

    t0 = time.monotonic()
    res = subprocess.run(cmd, cwd=workdir, env=env, capture_output=True, text=True, timeout=330)
    elapsed = time.monotonic() - t0
    output = res.stdout + res.stderr
    print(f"snakemake on slurm took {elapsed:.1f} s")
    assert res.returncode == 0, f"snakemake exited {res.returncode}\n{_diagnostics(workdir, output)}"

    gpu = json.loads((workdir / "out" / "gpu.json").read_text())
    cpu = json.loads((workdir / "out" / "cpu.json").read_text())

    for info in (gpu, cpu):
        assert info["SLURM_JOB_ID"], info  # really ran under Slurm
        assert info["SLURM_JOB_PARTITION"] == partition
        assert info["RLOO_SMOKE_MARKER"] == marker  # submit environment exported (--export=ALL)
        assert Path(info["cwd"]).resolve() == workdir.resolve()  # sbatch -D <workdir>
        assert Path(info["prefix"]).resolve() == Path(sys.prefix).resolve(), info  # same venv
    assert gpu["SLURM_JOB_ID"] != cpu["SLURM_JOB_ID"]
    assert gpu["CUDA_VISIBLE_DEVICES"] == "0" and gpu["SLURM_STEP_GPUS"] == "0", gpu
    assert cpu["CUDA_VISIBLE_DEVICES"] is None, cpu

    ids = [gpu["SLURM_JOB_ID"], cpu["SLURM_JOB_ID"]]
    deadline = time.monotonic() + 15  # sacct lags slurmctld by ~1-2 s
    while True:
        rows = _sacct(ids, "State,AllocTRES,Account,Comment")
        if all(rows.get(i, [""])[0] == "COMPLETED" for i in ids) or time.monotonic() > deadline:
            break
        time.sleep(1)
    assert rows[gpu["SLURM_JOB_ID"]][0] == "COMPLETED", rows
    assert rows[cpu["SLURM_JOB_ID"]][0] == "COMPLETED", rows
    assert "gres/gpu=1" in rows[gpu["SLURM_JOB_ID"]][1], rows
    assert "gres/gpu" not in rows[cpu["SLURM_JOB_ID"]][1], rows
    assert rows[gpu["SLURM_JOB_ID"]][2] == account, rows
    assert rows[gpu["SLURM_JOB_ID"]][3] == "rule_gpu_job", rows  # plugin puts the rule in --comment


def test_slurm_signal_before_time_limit(slurm_env: dict[str, str], tmp_path: Path) -> None:
    """`--signal=TERM@50` with a 1-minute limit: the step's processes get SIGTERM well before the
    limit (Slurm checks every ~30 s, so 0-30 s after start) and can exit cleanly -> COMPLETED."""
    out = tmp_path / "signal.txt"
    step = (
        f"s=$(date +%s); trap 'echo TERM after $(( $(date +%s) - s ))s > {out}; exit 0' TERM; "
        f"for i in $(seq 1 120); do sleep 1; done; echo no-signal > {out}"
    )
    res = subprocess.run(
        [
            "sbatch",
            "--parsable",
            "-t",
            "1",
            "--signal=TERM@50",
            "-p",
            slurm_env["SLURM_TEST_PARTITION"],
            "-A",
            slurm_env["SLURM_TEST_ACCOUNT"],
            "-o",
            str(tmp_path / "slurm-%j.out"),
            "-D",
            str(tmp_path),
            "--wrap",
            f"srun -n1 bash -c {shlex.quote(step)}",
        ],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert res.returncode == 0, res.stderr
    job_id = res.stdout.strip().split(";")[0]
    deadline = time.monotonic() + 150
    state = ""
    while time.monotonic() < deadline:
        state = _sacct([job_id], "State").get(job_id, [""])[0]
        if state and state not in {"PENDING", "RUNNING", "COMPLETING", "REQUEUED", "RESIZING", "SUSPENDED"}:
            break
        time.sleep(2)
    else:
        subprocess.run(["scancel", job_id], check=False)
    assert out.exists(), f"job {job_id} state={state}; no output written"
    text = out.read_text().strip()
    assert text.startswith("TERM after"), text
    assert int(text.split()[2].rstrip("s")) < 55, text  # before the 60 s limit
    assert state == "COMPLETED", state
