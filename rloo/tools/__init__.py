"""Tools the policy calls inside its completion (issue 73), plug-ins in the reward functions' form.

A tool names a trigger, its opening marker, the call's end and its closing marker (`<<`, `=`, `>>`: the
calculator annotations of GSM8K's solutions, `<<48/2=24>>`), and a function

    def f(call: str, **row) -> str: ...

as `module:function` or `path/to/file.py:function` (rloo.plugins: the loading, the signature check and
the user's file and line in an error are the reward functions' machinery). `call` is the text between the
opening marker and the call's end; `row` the data record's columns (`question`, `answer`, any other field
the data set carries; a function without `**row` gets only the ones it names). It returns the result text;
the rollout (rloo/rollout/tools.py) appends it, cut to `tools.max_result_chars`, and the closing marker as
forced tokens, which no loss trains on. A function that raises stops the run with one line naming the
user's file and line: a tool should turn bad input into a result (the calculator's `ERROR`). A result
that begins with `ERROR` counts as an erred call (`Tool.erred`: the `tool/error_share` of a training step).

Nothing here imports torch: the checks run when Snakemake reads the workflow.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rloo import plugins
from rloo.plugins import Parameters, PluginError, code_file, raised
from rloo.tools.calculator import ERROR

# The columns every prepared record has (rloo.data.gsm8k); a jsonl or hub data set may add more.
RECORD_COLUMNS = ("question", "answer")


class ToolError(PluginError):
    """A tool that cannot be used: it does not import, its signature does not fit, or a call of it raised
    or returned no string."""


def signature_problem(func: Callable, offered: set[str] | None) -> str | None:
    """Why `func` cannot be called as `func(call, **row)` with the row's columns `offered` (None: not
    known yet), or None."""
    params = Parameters.of(func)
    if params is None:
        return None
    if params.first_positional is None:
        return "it takes no positional argument for the call (the form: def f(call: str, **row) -> str)"
    if later := [n for n in params.positional_only if n != params.first_positional]:
        return f"its parameter '{later[0]}' is positional-only, but a row's columns are passed by keyword"
    return params.unknown(offered, given=(params.first_positional,))


def offered_names(config: Any) -> set[str] | None:
    """The columns every row offers under `config` (None where a jsonl or hub data set may carry more)."""
    return None if config.data.source in ("jsonl", "hub") else set(RECORD_COLUMNS)


def config_problems(config: Any) -> list[str]:
    """Each enabled tool whose function does not import or whose signature does not fit, one line each
    naming its key and file."""
    problems = []
    offered = offered_names(config)
    for i, t in enumerate(config.tools.enabled):
        key = f"tools.enabled[{i}].fn"
        try:
            func, where = plugins.load(t.fn, key, ToolError)
        except ToolError as e:
            problems.append(str(e))
            continue
        if problem := signature_problem(func, offered):
            problems.append(f"key '{key}': {plugins.defined_at(func, where)}: '{t.fn.rpartition(':')[2]}' cannot be "
                            f"called as a tool: {problem}")
    return problems


def user_files(config: Any) -> list[Path]:
    """The files of the user's own code the enabled tools run: the code fingerprints of the stages that
    run the tools (sft, rloo, evaluate) count them."""
    return plugins.user_files(t.fn for t in config.tools.enabled)


def package_functions(config: Any) -> list[tuple[str, str]]:
    """(module, function) of each enabled tool this package holds (the calculator)."""
    return plugins.package_functions(t.fn for t in config.tools.enabled)


@dataclass
class Tool:
    """One tool, loaded: its trigger and function; `__call__` runs it on a call and a row."""

    name: str
    fn: str
    open: str
    end: str
    close: str
    max_result_chars: int
    func: Callable = field(repr=False)
    params: Parameters | None = field(repr=False, default=None)

    @classmethod
    def of(cls, func: Callable, *, name: str | None = None, open: str = "<<", end: str = "=", close: str = ">>",
           max_result_chars: int = 32) -> Tool:
        """A Python callable as a tool (the calculator by default's trigger)."""
        name = name or getattr(func, "__name__", type(func).__name__)
        fn = f"{getattr(func, '__module__', '?')}:{getattr(func, '__qualname__', name)}"
        if problem := signature_problem(func, None):
            raise ToolError(f"tool '{name}' ({fn}): {problem}")
        return cls(name, fn, open, end, close, max_result_chars, func, Parameters.of(func))

    def __call__(self, call: str, row: dict | None = None) -> str:
        """The tool's result on `call`, cut to max_result_chars; a ToolError (one line naming the user's
        file and line) when the function raises or returns no string."""
        kwargs = dict(row or {})
        kwargs = kwargs if self.params is None else self.params.accepted(kwargs)
        try:
            out = self.func(call, **kwargs)
        except Exception as e:
            raise ToolError(f"tool '{self.name}' ({self.fn}) raised {raised(e, code_file(self.func))} on the "
                            f"call {call[:60]!r}") from e
        if not isinstance(out, str):
            raise ToolError(f"tool '{self.name}' ({self.fn}) returned a {type(out).__name__} on the call "
                            f"{call[:60]!r}, not a string")
        return out[: self.max_result_chars]

    @staticmethod
    def erred(result: str) -> bool:
        """Whether a result reports bad input: it begins with `ERROR` (the calculator's, and the form a tool
        of one's own uses to count among the erred calls)."""
        return result.startswith(ERROR)

    def __reduce__(self):
        # A file's function lives in a module no other process imports by name: load it again there.
        return _loaded_tool, (self.name, self.fn, self.open, self.end, self.close, self.max_result_chars)


def _loaded_tool(name: str, fn: str, open: str, end: str, close: str, max_result_chars: int) -> Tool:
    target, _, func_name = fn.rpartition(":")
    if plugins.is_path(target):
        fn = f"{plugins.resolve(target)}:{func_name}"
    func, _ = plugins.load(fn, f"tool '{name}'", ToolError)
    return Tool(name, fn, open, end, close, max_result_chars, func, Parameters.of(func))


@dataclass
class Toolbox:
    """The enabled tools and the limits on their calls (`tools:`, rloo.settings.ToolsConfig)."""

    tools: list[Tool]
    max_calls: int = 8

    @classmethod
    def from_config(cls, config: Any) -> Toolbox | None:
        """The configured tools; None when none is enabled (the rollout then runs as without tools)."""
        tc = config.tools
        if not tc.enabled:
            return None
        return cls([_loaded_tool(t.name, t.fn, t.open, t.end, t.close, tc.max_result_chars) for t in tc.enabled],
                   tc.max_calls)


def result_spans(text: str, triggers: list[tuple[str, str, str]]) -> list[tuple[int, int]]:
    """The character spans of `text` a tool writes: each call's result and closing marker (`24>>` of
    `<<48/2=24>>`), found as the rollout finds them: after an opening marker, the first call end with no
    closing marker before it, up to the closing marker that follows. `triggers`: (open, end, close) each."""
    spans = []
    for open_, end, close in triggers:
        i = text.find(open_)
        while i != -1:
            start = i + len(open_)
            closed = text.find(close, start)
            stop = text.find(end, start)
            if stop != -1 and (closed == -1 or stop < closed):
                result = stop + len(end)
                closed = text.find(close, result)
                spans.append((result, len(text) if closed == -1 else closed + len(close)))
                i = text.find(open_, spans[-1][1])
            else:
                i = text.find(open_, start)
    return sorted(spans)


def result_tokens(tokenizer: Any, ids: list[int], triggers: list[tuple[str, str, str]]) -> list[int]:
    """The positions in `ids` of the tokens a tool writes (`result_spans`); a token that a span only
    partly covers counts as the tool's, as the rollout forces a token that runs past a call's end."""
    text = tokenizer.decode(ids)
    spans = result_spans(text, triggers)
    if not spans:
        return []
    ends = [len(tokenizer.decode(ids[: j + 1])) for j in range(len(ids))]
    starts = [0, *ends[:-1]]
    return [j for j, (a, b) in enumerate(zip(starts, ends, strict=True)) if any(a < e and s < b for s, e in spans)]


def triggers(config: Any) -> list[tuple[str, str, str]]:
    """(open, end, close) of each enabled tool (`tools.enabled`)."""
    return [(t.open, t.end, t.close) for t in config.tools.enabled]
