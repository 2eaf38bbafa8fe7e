"""A line a person should see while a stage runs, on the terminal as well as in the stage's log."""

from __future__ import annotations

import logging
import os
import sys

_logger = logging.getLogger("rloo")


def console(message: str, logger: logging.Logger | None = None, level: int = logging.WARNING) -> None:
    """A line a person should see while the stage runs (a retry, a count at the end), not only in its log.

    It goes to the log (stderr) at `level` (a warning unless told); when stdout is another file, as under
    Snakemake, whose rules send a stage's stderr to its log file (`--log`, `run_logged`) while its stdout
    reaches the terminal, to stdout too, so it is shown once either way."""
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
