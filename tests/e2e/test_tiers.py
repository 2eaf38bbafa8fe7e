"""The fast tier's guard (tests/conftest.py): an unmarked test over the limit fails and names itself;
the same test marked `slow` passes; `--strict-markers` refuses a misspelt mark."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

BUSY = '''
import time
import pytest

def _busy(seconds):
    t0 = time.process_time()
    while time.process_time() - t0 < seconds:
        pass

def test_unmarked_busy():
    _busy(1.5)

@pytest.mark.slow
def test_marked_busy():
    _busy(1.5)

def test_unmarked_quick():
    _busy(0.05)

def test_unmarked_waits():
    time.sleep(3.5)
'''


def _pytest(folder: Path, *args: str, limit: str = "1", stage_server: bool = False) -> subprocess.CompletedProcess:
    # the load fixed at 1: the waiting test's wall limit must not stretch with this machine's load
    env = {**os.environ, "RLOO_UNMARKED_LIMIT_S": limit, "RLOO_UNMARKED_LOAD": "1",
           "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tests" / "helpers")]),
           "RLOO_TEST_STAGE_SERVER": "1" if stage_server else "0"}
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist", *args],
                          cwd=folder, env=env, capture_output=True, text=True, timeout=300)


def _suite(tmp_path: Path, body: str) -> Path:
    shutil.copy(ROOT / "tests" / "conftest.py", tmp_path / "conftest.py")
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")  # markers, --strict-markers
    (tmp_path / "test_busy.py").write_text(body)
    return tmp_path


def test_an_unmarked_slow_test_fails_and_names_itself(tmp_path):
    res = _pytest(_suite(tmp_path, BUSY), "test_busy.py")
    out = res.stdout + res.stderr
    assert res.returncode == 1, out
    assert "2 failed, 2 passed" in out, out
    assert "test_busy.py::test_unmarked_busy took 1.5 CPU-seconds of its own" in out, out
    assert "mark it @pytest.mark.slow" in out and "test_unmarked_waits took" in out, out


def test_a_misspelt_marker_is_refused(tmp_path):
    res = _pytest(_suite(tmp_path, "import pytest\n\n@pytest.mark.slwo\ndef test_x():\n    pass\n"), "test_busy.py")
    assert res.returncode != 0 and "'slwo' not found in `markers`" in res.stdout + res.stderr, res.stdout + res.stderr


SERVED = f'''
import os, subprocess, sys
import pytest
import stage_server

@pytest.fixture
def sock():
    sock = os.environ[stage_server.ENV_VAR]
    stage_server.wait_listening(sock, 180)  # it listens once it has imported torch and transformers
    return sock

def test_unmarked_served_busy(sock):
    before = stage_server.cpu_seconds(sock)
    subprocess.run([sys.executable, {str(ROOT / "tests" / "helpers" / "served_probe.py")!r}, sock, "burn", "1.5"],
                   check=True)
    assert stage_server.cpu_seconds(sock) - before >= 1.4  # it ran in a process the server forked
'''


@pytest.mark.slow
def test_the_guard_counts_the_cpu_of_commands_the_stage_server_ran(tmp_path):
    """A served command's process is the server's child, not the test's: the guard asks the server."""
    res = _pytest(_suite(tmp_path, SERVED), "test_busy.py", stage_server=True)
    out = res.stdout + res.stderr
    assert res.returncode == 1 and "1 failed" in out, out
    took = re.search(r"test_busy.py::test_unmarked_served_busy took ([0-9.]+) CPU-seconds", out)
    assert took and float(took.group(1)) >= 1.5, out  # the client alone is a fraction of a second
