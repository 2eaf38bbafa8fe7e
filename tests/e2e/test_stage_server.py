"""The test suite's stage server (tests/helpers/stage_server.py) with real processes: a served command runs
in a process it forked, with the client's arguments, directory, environment, streams and `rloo`; exits,
exceptions and signals reach the client as they would from a process of its own; a kill -9 of the client
takes the forked process with it; a command whose import environment differs runs in the client; the
`rloo` command and `python -m rloo_workflow.cli` are clients through the tests' hook (tests/helpers/served/), and
nothing else: the package's own entry point knows no server."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import stage_server
from workflow_helpers import SERVED

ROOT = Path(__file__).resolve().parents[2]
PROBE = ROOT / "tests" / "helpers" / "served_probe.py"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """A server of this module's own (the session's may be off: RLOO_TEST_STAGE_SERVER=0), started without
    what threadpoolctl writes on import, which this process holds (see the KMP test)."""
    folder = Path(tempfile_dir := tmp_path_factory.mktemp("server"))
    sock = f"/tmp/rloo-test-{os.getpid()}-{folder.name}.sock"
    log = open(folder / "server.log", "w")  # noqa: SIM115 (held open for the server's life)
    env = {k: v for k, v in os.environ.items() if k != "KMP_DUPLICATE_LIB_OK"}
    proc = subprocess.Popen([sys.executable, "-u", str(PROBE.parent / "stage_server.py"), sock], cwd=ROOT,
                            stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, env=env)
    stage_server.wait_listening(sock, 180, proc)
    yield {"sock": sock, "pid": proc.pid, "log": Path(tempfile_dir) / "server.log"}
    proc.terminate()
    proc.wait(timeout=30)
    log.close()
    assert not Path(sock).exists()  # the server removes its socket


def probe(server, *args: str, env: dict | None = None, drop: tuple[str, ...] = (), **kw) -> subprocess.CompletedProcess:
    env = {k: v for k, v in {**os.environ, "PYTHONPATH": str(PROBE.parent), **(env or {})}.items() if k not in drop}
    return subprocess.run([sys.executable, str(PROBE), server["sock"], *args], env=env, capture_output=True,
                          text=True, timeout=60, **kw)


def test_a_served_command_runs_forked_by_the_server_as_the_client(server, tmp_path):
    rloo_copy = tmp_path / "copy"
    shutil.copytree(ROOT / "rloo", rloo_copy / "rloo", ignore=shutil.ignore_patterns("__pycache__"))
    env = {"PYTHONPATH": f"{PROBE.parent}{os.pathsep}{rloo_copy}", "PROBE_VALUE": "from the client"}
    cpu0 = stage_server.cpu_seconds(server["sock"])
    res = probe(server, "info", env=env, cwd=tmp_path, input="on stdin")
    assert res.returncode == 0, res.stderr
    info = json.loads(res.stdout)
    assert info["ppid"] == server["pid"] and info["pgid"] == info["pid"]  # forked, in a process group of its own
    assert info["preloaded"]  # torch was there before the command ran
    assert info["cwd"] == str(tmp_path) and info["probe_env"] == "from the client" and info["stdin"] == "on stdin"
    assert info["argv"] == [str(PROBE), server["sock"], "info"]
    assert info["rloo_file"] == str(rloo_copy / "rloo" / "__init__.py")  # the client's rloo, imported afresh
    assert stage_server.cpu_seconds(server["sock"]) > cpu0


def test_exit_codes_and_exceptions_reach_the_client(server):
    res = probe(server, "exit", "7")
    assert (res.returncode, res.stderr) == (7, "exiting\n")
    res = probe(server, "raise")
    assert res.returncode == 1 and "RuntimeError: the probe raised" in res.stderr and "Traceback" in res.stderr


@pytest.mark.parametrize("command", [[sys.executable, "-m", "rloo_workflow.cli"], [str(Path(sys.executable).parent / "rloo")]])
def test_the_rloo_command_is_served_through_the_tests_hook_with_its_exit_code(server, command):
    cmd = [*command, "validate-config", "-c", str(ROOT / "config" / "nosuch.yaml")]
    hook = {**stage_free_env(), "RLOO_STAGE_SERVER": server["sock"], "PYTHONPATH": str(SERVED)}
    fresh = subprocess.run(cmd, env=stage_free_env(), capture_output=True, text=True, timeout=60)
    cpu0 = stage_server.cpu_seconds(server["sock"])
    # without the hook on its path the command runs as it would anywhere: the package knows no server
    plain = subprocess.run(cmd, env={**hook, "PYTHONPATH": ""}, capture_output=True, text=True, timeout=60)
    assert stage_server.cpu_seconds(server["sock"]) == cpu0
    served = subprocess.run(cmd, env=hook, capture_output=True, text=True, timeout=60)
    assert stage_server.cpu_seconds(server["sock"]) > cpu0
    assert fresh.returncode == plain.returncode == served.returncode != 0
    assert fresh.stdout == served.stdout and fresh.stderr == served.stderr and "nosuch.yaml" in served.stderr


def stage_free_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k != stage_server.ENV_VAR}


def test_a_signal_to_the_client_reaches_the_forked_process(server):
    proc = subprocess.Popen([sys.executable, str(PROBE), server["sock"], "wait"], stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": str(PROBE.parent)})
    forked = int(proc.stdout.readline())
    assert forked != proc.pid
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=30) == -signal.SIGTERM  # the client dies as the forked process did
    assert not _alive(forked)


def test_kill_9_of_the_client_kills_the_forked_process(server):
    proc = subprocess.Popen([sys.executable, str(PROBE), server["sock"], "wait"], stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": str(PROBE.parent)})
    forked = int(proc.stdout.readline())
    proc.kill()
    proc.wait()
    deadline = time.time() + 10
    while _alive(forked):
        assert time.time() < deadline, "the forked process outlived its client"
        time.sleep(0.05)


def test_thread_counts_and_the_temporary_folder_are_the_clients(server, tmp_path):
    """Snakemake sets both per job; the libraries read them when they load, in the server, so the forked
    process sets what a fresh one would have read."""
    n = 1 if len(os.sched_getaffinity(0)) > 1 else 2
    env = {"OMP_NUM_THREADS": str(n), "MKL_NUM_THREADS": str(n), "OPENBLAS_NUM_THREADS": str(n), "TMPDIR": str(tmp_path)}
    # (this test process has torch's compile cache folder in its environment, from its own import of torch)
    info = json.loads(probe(server, "info", env=env, drop=("TORCHINDUCTOR_CACHE_DIR",)).stdout)
    assert info["ppid"] == server["pid"]  # served, not declined
    assert info["threads"]["torch"] == n and set(info["threads"]["blas"]) == {n}
    assert info["tempdir"] == str(tmp_path) and info["inductor_cache"].startswith(str(tmp_path))


def test_a_command_whose_import_environment_differs_runs_in_the_client(server, tmp_path):
    cpu0 = stage_server.cpu_seconds(server["sock"])
    res = probe(server, "info", env={"HF_HOME": str(tmp_path / "hf")})  # huggingface_hub reads it on import
    assert res.returncode == 0, res.stderr
    info = json.loads(res.stdout)
    assert info["ppid"] == os.getpid() and not info["preloaded"]  # the client ran it, importing for itself
    assert stage_server.cpu_seconds(server["sock"]) == cpu0
    assert "declined" in server["log"].read_text() and "HF_HOME" in server["log"].read_text()


def test_what_the_servers_imports_write_is_allowed_for_and_nothing_else(server):
    """threadpoolctl sets KMP_DUPLICATE_LIB_OK on import (setdefault): a client that holds the value it
    writes, or none, would end up where the server is; one that holds another would not."""
    for held in ("True", None):
        drop = () if held else ("KMP_DUPLICATE_LIB_OK",)
        info = json.loads(probe(server, "info", env={"KMP_DUPLICATE_LIB_OK": held or ""}, drop=drop).stdout)
        assert info["ppid"] == server["pid"], held  # served
    info = json.loads(probe(server, "info", env={"KMP_DUPLICATE_LIB_OK": "FALSE"}).stdout)
    assert info["ppid"] == os.getpid()  # declined: the client ran it
    assert "KMP_DUPLICATE_LIB_OK" in server["log"].read_text()


def _alive(pid: int) -> bool:
    """A process that exists and is not a zombie."""
    with contextlib.suppress(OSError):
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] != "Z"
    return False
