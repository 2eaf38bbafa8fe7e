"""A line a person should see while a stage runs, on the terminal as well as in the stage's log."""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Callable

_logger = logging.getLogger("rloo")


def _unchanged(text: str) -> str:
    return text


# What every console line and log record passes through before it is written: the application installs
# its secret redaction here (rloo_workflow.cli: rloo_workflow.tracking.redact.redact_text); the core
# knows nothing of its rules.
_scrub: Callable[[str], str] = _unchanged


def set_scrubber(scrub: Callable[[str], str]) -> None:
    """Pass every console line and log record of this process through `scrub` (a secret's redaction)."""
    global _scrub
    _scrub = scrub


class _Scrubbed(logging.Filter):
    """A log record's message, and its traceback, as `_scrub` leaves them."""

    def filter(self, record: logging.LogRecord) -> bool:
        record.msg, record.args = _scrub(record.getMessage()), None
        if record.exc_info:
            record.exc_text = _scrub(logging.Formatter().formatException(record.exc_info))
            record.exc_info = None
        return True


def console(message: str, logger: logging.Logger | None = None, level: int = logging.WARNING) -> None:
    """A line a person should see while the stage runs (a retry, a count at the end), not only in its log.

    It goes to the log (stderr) at `level` (a warning unless told); when stdout is another file, as under
    Snakemake, whose rules send a stage's stderr to its log file (`--log`, `run_logged`) while its stdout
    reaches the terminal, to stdout too, so it is shown once either way."""
    message = _scrub(message)
    (logger or _logger).log(level, "%s", message)
    try:
        out, err = os.fstat(sys.stdout.fileno()), os.fstat(sys.stderr.fileno())
    except (OSError, ValueError, AttributeError):  # a closed or replaced stream: the log has it
        return
    if (out.st_dev, out.st_ino) != (err.st_dev, err.st_ino):
        print(message, file=sys.stdout, flush=True)


def configure_logging() -> None:
    """The stages' log format, INFO and up, on stderr (once; later calls change nothing)."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    for handler in logging.getLogger().handlers:
        if not any(isinstance(f, _Scrubbed) for f in handler.filters):
            handler.addFilter(_Scrubbed())
