"""A stage's log under Snakemake (`rloo <verb> --log FILE`): its standard error (logging, progress bars,
tracebacks) goes to the file, its standard output to the terminal (the few lines a person should see
while it runs: rloo.console), and a failure shows the terminal its one error line, or its last lines and
its path: not the whole log.

Snakemake would otherwise print a failed job's whole log (`show-failed-logs`), or nothing of it; a
user's failing reward function then buried its one line under the progress bars and the config. An
error the user can fix (bad input, their own code raising: exit 2, rloo.errors.UserError and its kin)
ends the job's output on the CLI's one error line, which names their file and line (Snakemake's own
error block, which follows, names the log); the package's frames stay in the log (and on the terminal
with --debug). Anything else (a bug in rloo, a crash) shows
the log's last lines, its traceback's end, and where the log is.
"""

from __future__ import annotations

import os
import sys
import traceback
from collections.abc import Callable
from pathlib import Path

TAIL_LINES = 9  # what an internal error shows of the log: with Snakemake's own lines, one screen (60)
USER_ERROR = 2  # the CLI's exit status for an error the user can fix, said in one line (rloo_workflow/cli.py)
MAX_LINE = 400  # characters of one log line shown


def _is_log(fd: int, path: Path) -> bool:
    """Whether `fd` already writes to `path` (a process the stage started again: torchrun's workers)."""
    try:
        return os.path.samestat(os.fstat(fd), path.stat())
    except OSError:
        return False


def tail(path: str | Path, lines: int = TAIL_LINES) -> list[str]:
    """The last `lines` lines of the log as a terminal would have shown them: a progress bar's line is its
    last redraw (the text after its last carriage return), blank lines left out, long ones cut."""
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - 64 * 1024))
            text = f.read().decode("utf-8", "replace")
    except OSError:
        return []
    shown = [line.rsplit("\r", 1)[-1].rstrip() for line in text.splitlines()]
    shown = [line for line in shown if line.strip(" ^~")]  # no blank lines, nor a traceback's markers
    # the CLI's one error line repeats the exception's last traceback line: show it once
    if len(shown) > 1 and ": error: " in shown[-1] and shown[-2].endswith(shown[-1].split(": error: ", 1)[1]):
        del shown[-2]
    return [line if len(line) <= MAX_LINE else line[:MAX_LINE] + " ..." for line in shown[-lines:]]


def run_logged(path: str | Path | None, label: str, run: Callable[[], int]) -> int:
    """`run()` with its standard error appended to `path` (none given, or already there: as it is); where it
    fails (a non-zero exit, an exception), the log's last lines and its path on the terminal."""
    if path is None:
        return run()
    log = Path(path)
    log.parent.mkdir(parents=True, exist_ok=True)
    log.touch()
    if _is_log(2, log):
        return run()
    sys.stdout.flush()
    sys.stderr.flush()
    terminal = os.dup(2)
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 2)
    os.close(fd)
    try:
        code = run()
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 1
    except BaseException:  # a bug: its traceback into the log, and the tail below
        traceback.print_exc()
        code = 1
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os.dup2(terminal, 2)
        os.close(terminal)
    if code:
        print(failure(log, label, code), file=sys.stderr, flush=True)
    return code


def failure(log: Path, label: str, code: int) -> str:
    """What the terminal shows of a failed stage. An error the user can fix: the CLI's one error line alone
    (from the last line that starts with `rloo`: a message may span lines), so that the job's output ends
    on it; the log it was written to is named by the command line (--log) and by Snakemake's error block.
    Anything else: the log's last lines under its path."""
    lines = tail(log, lines=40)
    start = next((i for i in range(len(lines) - 1, -1, -1) if lines[i].startswith(("rloo ", "rloo:"))), None)
    if code == USER_ERROR and start is not None:
        return "\n".join(lines[start:])
    shown = "\n".join(f"  {line}" for line in lines[-TAIL_LINES:])
    return f"{label} failed (exit {code}); the end of its log, {log}:\n{shown}"
