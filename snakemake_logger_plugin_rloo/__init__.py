"""Snakemake logger plugin `rloo` (`--logger rloo`, set by profiles/default, profiles/gpu and slurm/config.yaml):
Snakemake's own terminal output, its formatter and filter, less what a user never acts on (issue 72), and a
missing `--configfile` as one line instead of a traceback (issue 71). docs/workflow.md "What a failed run prints".

Snakemake imports every installed module named `snakemake_logger_plugin_*` when it builds its argument
parser (snakemake_interface_common's plugin registry), before it reads any config file, whether or not
`--logger rloo` is given: so the config-file guard below applies to every `snakemake` of this venv, and the
handler to the runs that name it. Nothing here may break Snakemake: whatever is matched by Snakemake's
wording only ever drops a line when the wording is the one measured; a changed wording prints the line.
"""

from __future__ import annotations

import functools
import logging
import os
import sys
from pathlib import Path

from snakemake_interface_logger_plugins.base import LogHandlerBase
from snakemake_interface_logger_plugins.common import LogEvent


class _OpenedInside:
    """A config file's path that is opened when the loader enters it (`with obj as f`), inside its `try`."""

    def __init__(self, path: str | Path) -> None:
        self.path = path

    def __str__(self) -> str:  # the loader's message names the file as given
        return str(self.path)

    def __enter__(self):
        self.file = open(self.path, encoding="utf-8")
        return self.file.__enter__()

    def __exit__(self, *exc) -> None:
        self.file.__exit__(*exc)


def _guard_missing_configfile() -> None:
    """Make `snakemake --configfile nope.yaml` end on Snakemake's own "Config file nope.yaml not found."
    WorkflowError, not a 27-line FileNotFoundError traceback. Snakemake (9.17 to 9.27 at least) opens the
    file above the `try` meant to turn the error into that WorkflowError (docs/upstream/
    snakemake-configfile-not-found.patch). A no-op where the loader is gone or renamed; where upstream fixed
    it, the same path gives the same line."""
    try:
        from snakemake.common import configfile
        from snakemake_interface_common.exceptions import WorkflowError
    except ImportError:
        return
    load = getattr(configfile, "_load_configfile", None)
    if not callable(load) or getattr(load, "rloo_guard", False):
        return

    @functools.wraps(load)
    def guarded(configpath_or_obj, *args, **kwargs):
        if not isinstance(configpath_or_obj, (str, Path)) or os.path.exists(configpath_or_obj):
            return load(configpath_or_obj, *args, **kwargs)  # what exists is Snakemake's to read
        try:
            # opened inside the loader's `try`: Snakemake raises its own WorkflowError, from its own frame
            # (its print_exception then shows no traceback, as for every WorkflowError of its own)
            return load(_OpenedInside(configpath_or_obj), *args, **kwargs)
        except WorkflowError:
            raise
        except Exception:  # the loader changed shape: the same error, from here
            pass
        filetype = kwargs.get("filetype", args[0] if args else "Config")
        raise WorkflowError(f"{filetype} file {configpath_or_obj} not found.")

    guarded.rloo_guard = True  # type: ignore[attr-defined]  # imported twice: wrap once
    # load_configfile (the --configfile path) looks the loader up in the module at each call
    configfile._load_configfile = guarded


_guard_missing_configfile()

# Whole lines of Snakemake's (records without an event, or about resources) that say nothing a user acts
# on, matched exactly: a reworded one is printed. Measured: docs/workflow.md "What a failed run prints".
NOISE = frozenset({
    "Assuming unrestricted shared filesystem usage.",
    "Rules claiming more threads will be scaled down.",
    "Select jobs to execute...",
    "Shutting down, this might take some time.",
})
NOISE_PREFIXES = ("Using shell: ",)
# the line after "Error in rule x:" that Snakemake prints for a rule without a `message:` (its formatter
# tests one field and prints another); the same words further down (a log shown whole) stay
NO_MESSAGE = "message: None"


def is_noise(line: str) -> bool:
    """Whether `line`, of a record of Snakemake's without an event or about resources, is left out."""
    return line in NOISE or line.startswith(NOISE_PREFIXES)


def tidy(record: logging.LogRecord, text: str) -> str:
    """Snakemake's formatted `text` for the terminal: noise lines out ("" is not printed), an error of one
    line as one line ("WorkflowError:" / "Config file x not found." -> "WorkflowError: Config file x not
    found."), the error block without its `message: None`. Everything else as Snakemake formats it."""
    event = getattr(record, "event", None)
    if event in (None, LogEvent.RESOURCES_INFO):
        return "\n".join(line for line in text.split("\n") if not is_noise(line))
    if event == LogEvent.ERROR:
        lines = text.split("\n")
        if len(lines) == 2 and lines[0].endswith(":") and lines[1].strip():
            return f"{lines[0]} {lines[1]}"
    elif event == LogEvent.JOB_ERROR:
        lines = text.split("\n")
        for i, line in enumerate(lines[:-1]):
            if line.strip().startswith("Error in rule "):
                if lines[i + 1].strip() == NO_MESSAGE:
                    del lines[i + 1]
                break
        return "\n".join(lines)
    return text


class _Tidy(logging.Formatter):
    """Snakemake's formatter (given to the plugin by Snakemake), then `tidy`."""

    def __init__(self, inner: logging.Formatter) -> None:
        super().__init__()
        self.inner = inner

    def format(self, record: logging.LogRecord) -> str:
        text = self.inner.format(record)
        return text if text is None else tidy(record, text)


def _stream_handler(nocolor: bool, stream) -> logging.Handler:
    """Snakemake's own terminal handler (its colours, its blank line before a job), else a plain one."""
    try:
        from snakemake.logging import ColorizingTextHandler

        return ColorizingTextHandler(nocolor=nocolor, stream=stream)
    except Exception:  # moved or changed upstream: plain lines, the same text
        return logging.StreamHandler(stream)


def duplicates_error_block(held: logging.LogRecord, record: logging.LogRecord) -> bool:
    """Whether `held`, the RuleException Snakemake prints for a failed shell command, says only what the
    "Error in rule" block (`record`) that follows it says: that the same command exited non-zero."""
    shellcmd = getattr(record, "shellcmd", None)
    return (getattr(record, "event", None) == LogEvent.JOB_ERROR and bool(shellcmd)
            and "CalledProcessError" in held.getMessage() and shellcmd.strip() in held.getMessage())


class LogHandler(LogHandlerBase):
    """Snakemake's terminal output, tidied (`tidy`), and a failed shell command's RuleException left out when
    the "Error in rule" block (rule, output, log, command) follows it: the command was printed twice."""

    writes_to_stream = True
    writes_to_file = False
    has_filter = False  # Snakemake's: --quiet, --printshellcmds, ... as without the plugin
    has_formatter = False  # Snakemake's, wrapped by _Tidy
    needs_rulegraph = False

    def __post_init__(self) -> None:
        settings = self.common_settings
        stream = sys.stdout if getattr(settings, "stdout", False) else sys.stderr
        self.out = _stream_handler(bool(getattr(settings, "nocolor", False)), stream)
        self.held: logging.LogRecord | None = None

    def setFormatter(self, fmt: logging.Formatter | None) -> None:
        super().setFormatter(fmt)
        self.out.setFormatter(_Tidy(fmt) if fmt is not None else None)

    def emit(self, record: logging.LogRecord) -> None:
        if self.held is not None:
            held, self.held = self.held, None
            if not duplicates_error_block(held, record):
                self.out.handle(held)
        if getattr(record, "event", None) == LogEvent.ERROR and getattr(record, "exception", None) == "RuleException":
            self.held = record  # until the next record says whether it is a duplicate
            return
        self.out.handle(record)

    def flush(self) -> None:
        if self.held is not None:
            held, self.held = self.held, None
            self.out.handle(held)
        self.out.flush()

    def close(self) -> None:
        self.flush()
        super().close()
