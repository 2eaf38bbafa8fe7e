"""A rule's shell command as a DVC stage command: read as a POSIX shell reads it, written again with
the config from params.yaml.

What carries over: commands joined by `&&`; an `@FILE` word is the options FILE holds, one a line (the
rules' args files: rloo_workflow.config.job_args_file), in its place; output redirections and `--log FILE`
are dropped (a log is how a job ran, not what it computes). Anything the rewrite could not carry over faithfully is refused with an error
naming the rule: other operators (`|`, `;`, `||`, `&`, `<`, `(`, a newline), expansions (`$`,
backquotes) outside single quotes, unquoted glob characters, a comment.
"""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path
from typing import Any

import yaml

from rloo_workflow.dvc.dvcyaml import PARAMS, DvcError

# `--set KEY=...` of the Snakemake command that only say how a job runs.
RUNTIME_KEYS = {"threads"}

_OPERATOR_CHARS = "|&;<>()"
# `>`, `>>`, `>&`, `&>`, `&>>`, with a file descriptor before it (`2>`, `2>&`): the target follows.
_REDIRECTION = re.compile(r"\d*(?:>>?&?|&>>?)")
_UNQUOTED_BAD = "$`*?["
_DOUBLE_QUOTED_ESCAPES = '$`"\\\n'


def shell_words(cmd: str) -> list[tuple[str, bool]]:
    """`cmd` split as a POSIX shell splits it: (word, False), quotes and backslashes resolved, and
    (operator, True) for each unquoted run of `|&;<>()` (a file descriptor number written against a
    redirection is part of it: `2>`, `2>&`) or a newline. ValueError for what a shell would expand."""
    tokens: list[tuple[str, bool]] = []
    word: list[str] = []
    started = plain = False  # a word is open (it may be ''); it has no quoted or escaped part
    i, n = 0, len(cmd)

    def end_word() -> None:
        nonlocal started, plain
        if started:
            tokens.append(("".join(word), False))
        word.clear()
        started = plain = False

    while i < n:
        c = cmd[i]
        if c in " \t\r":
            end_word()
        elif c == "\n":
            end_word()
            if tokens and tokens[-1] != ("&&", True):  # a newline after `&&` only continues the line
                tokens.append(("\n", True))
        elif c in _OPERATOR_CHARS:
            j = i
            while j < n and cmd[j] in _OPERATOR_CHARS:
                j += 1
            op = cmd[i:j]
            if started and plain and "".join(word).isdigit() and op[0] in "<>":
                op = "".join(word) + op
                word.clear()
                started = plain = False
            end_word()
            tokens.append((op, True))
            i = j
            continue
        elif c == "'":
            j = cmd.find("'", i + 1)
            if j < 0:
                raise ValueError("no closing quotation")
            word.append(cmd[i + 1 : j])
            started, plain, i = True, False, j + 1
            continue
        elif c == '"':
            j = i + 1
            while j < n and cmd[j] != '"':
                if cmd[j] in "$`":
                    raise ValueError(f"an expansion ({cmd[j]}) in double quotes")
                if cmd[j] == "\\" and j + 1 < n and cmd[j + 1] in _DOUBLE_QUOTED_ESCAPES:
                    j += 1
                word.append(cmd[j])
                j += 1
            if j >= n:
                raise ValueError("no closing quotation")
            started, plain, i = True, False, j + 1
            continue
        elif c == "\\":
            if i + 1 >= n:
                raise ValueError("a backslash at the end")
            if cmd[i + 1] != "\n":
                word.append(cmd[i + 1])
                started, plain = True, False
            i += 2
            continue
        elif c in _UNQUOTED_BAD or (not started and c in "#~"):
            raise ValueError(f"an unquoted {c!r}")
        else:
            word.append(c)
            plain = plain or not started
            started = True
        i += 1
    end_word()
    return tokens


def _set_value(value: Any) -> str:
    if isinstance(value, str) and yaml.safe_load(value) == value:
        return value
    return json.dumps(value)


def dvc_command(shellcmd: str, sets: dict[str, Any], rule: str | None = None, root: str | Path = ".") -> str:
    """The DVC command of a Snakemake job: its shell command with its args files' options in place (`@FILE`,
    relative to `root`), the config read from params.yaml (`--config params.yaml` + `--set` for per-job
    keys) instead of the job's `--job-config` file, and without logs (redirections, `--log`) and `--set
    threads=` (how a job runs, not what it computes)."""
    where = f"rule {rule}: " if rule else ""
    try:
        tokens = _with_args_files(shell_words(shellcmd.strip()), Path(root))
    except OSError as e:
        raise DvcError(f"{where}its args file cannot be read ({e}): {shellcmd}") from e
    except ValueError as e:
        raise DvcError(f"{where}its shell command cannot be carried over to dvc.yaml ({e}): {shellcmd}") from e
    bad = sorted({t for t, op in tokens if op and t != "&&" and not _REDIRECTION.fullmatch(t)})
    if bad:
        raise DvcError(f"{where}unsupported shell syntax {bad} in its shell command (dvc.yaml carries over "
                       f"commands joined by `&&` and output redirections only; move the rest into a script): "
                       f"{shellcmd}")
    segments: list[list[str]] = [[]]
    it = iter(tokens)
    for tok, op in it:
        seg = segments[-1]
        if op and tok == "&&":
            segments.append([])
        elif op:
            next(it, None)  # a redirection and its target
        elif tok == "--log":
            next(it, None)
        elif tok == "--job-config":
            next(it, None)
            seg += ["--config", shlex.quote(PARAMS)]
            for key, value in sets.items():
                seg += ["--set", shlex.quote(f"{key}={_set_value(value)}")]
        elif tok == "--set":
            value = next(it, ("", False))[0]
            if value.split("=", 1)[0] not in RUNTIME_KEYS:
                seg += [tok, shlex.quote(value)]
        else:
            seg.append(shlex.quote(tok))
    return " && ".join(" ".join(seg) for seg in segments if seg)


def _with_args_files(tokens: list[tuple[str, bool]], root: Path) -> list[tuple[str, bool]]:
    """`tokens` with each `@FILE` word replaced by the words FILE holds, one a line (as argparse reads it)."""
    out: list[tuple[str, bool]] = []
    for tok, op in tokens:
        if not op and tok.startswith("@") and len(tok) > 1:
            out += [(line, False) for line in (root / tok[1:]).read_text().splitlines()]
        else:
            out.append((tok, op))
    return out
