"""rloo_workflow/job_log.py: a stage's log under Snakemake (`rloo <verb> --log FILE`)."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

from rloo_workflow.job_log import TAIL_LINES, tail

SCRIPT = textwrap.dedent("""
    import sys
    from rloo_workflow.job_log import run_logged

    def run():
        print("to the terminal")
        for i in range(30):
            print(f"log line {i}", file=sys.stderr)
        print("stage: 40%|####  | 2/5\\rstage: 60%|######  | 3/5", file=sys.stderr)
        if sys.argv[2] == "fail":
            raise ValueError("the reason")
        if sys.argv[2] == "user":  # the CLI's way with an error the user can fix (rloo_workflow/cli.py)
            print('Traceback (most recent call last):\\n  File "/x/rloo/reward/functions.py", line 9, in call',
                  file=sys.stderr)
            print("rloo demo: error: reward function 'f' raised KeyError: 'id' at my.py:3\\n  (the run stops)",
                  file=sys.stderr)
            return 2
        return 0

    sys.exit(run_logged(sys.argv[1], "rloo demo", run))
""")


def _run(tmp_path: Path, how: str) -> subprocess.CompletedProcess:
    (tmp_path / "demo.py").write_text(SCRIPT)
    return subprocess.run([sys.executable, str(tmp_path / "demo.py"), str(tmp_path / "logs" / "demo.log"), how],
                          capture_output=True, text=True, timeout=60)


def test_a_stage_that_succeeds_writes_its_stderr_to_the_log_and_nothing_else_to_the_terminal(tmp_path):
    res = _run(tmp_path, "ok")
    assert res.returncode == 0 and res.stdout == "to the terminal\n" and res.stderr == ""
    log = (tmp_path / "logs" / "demo.log").read_text()
    assert "log line 0" in log and "log line 29" in log


def test_a_stage_that_fails_shows_the_logs_last_lines_and_its_path(tmp_path):
    res = _run(tmp_path, "fail")
    assert res.returncode == 1
    lines = res.stderr.splitlines()
    assert lines[0] == f"rloo demo failed (exit 1); the end of its log, {tmp_path / 'logs' / 'demo.log'}:"
    assert len(lines) == 1 + TAIL_LINES and lines[-1] == "  ValueError: the reason"
    assert "  stage: 60%|######  | 3/5" in lines  # a progress bar as last drawn
    assert "log line 0" not in res.stderr  # not the whole log
    assert "Traceback" in (tmp_path / "logs" / "demo.log").read_text()


def test_an_error_the_user_can_fix_shows_its_one_error_line_alone(tmp_path):
    res = _run(tmp_path, "user")
    assert res.returncode == 2
    # the terminal's lines end on it: no frame of the package, no progress bar, no log lines
    assert res.stderr.splitlines() == ["rloo demo: error: reward function 'f' raised KeyError: 'id' at my.py:3",
                                       "  (the run stops)"], res.stderr
    assert "functions.py" in (tmp_path / "logs" / "demo.log").read_text()  # the log keeps the frames


def test_the_tail_shows_the_one_error_line_once_without_a_tracebacks_markers(tmp_path):
    log = tmp_path / "x.log"
    log.write_text("a\n\n  File \"x.py\", line 2, in f\n    1 / 0\n    ~~^~~\n"
                   "rloo.x.Err: bad thing at my.py:3\nrloo train: error: bad thing at my.py:3\n")
    assert tail(log) == ["a", '  File "x.py", line 2, in f', "    1 / 0", "rloo train: error: bad thing at my.py:3"]
    assert tail(tmp_path / "missing.log") == []

