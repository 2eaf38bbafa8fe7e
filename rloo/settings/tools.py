"""The `tools:` section: tools the policy calls inside its completion (issue 73, rloo/tools), off by default."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from rloo.settings.fields import Section, setting

CALCULATOR_FN = "rloo.tools.calculator:calculate"


@dataclass(frozen=True)
class ToolConfig(Section):
    """One tool: its trigger and its function. When the completion so far ends with an open call (`open`,
    then text without `close`, then `end`), the rollout calls the function with the text between `open`
    and `end` and appends its result and `close` as forced tokens, which no loss trains on."""

    name: str = setting("calculator", pattern="^[A-Za-z0-9_.-]+$")
    """The tool's name (its metrics, its errors)."""
    fn: str = setting(CALCULATOR_FN)
    """f(call: str, **row) -> str as module:function (rloo.tools.calculator:calculate, the calculator) or
    path/to/file.py:function (a relative path is read from the folder the pipeline runs in); `row` is the
    data record's columns (question, answer, ...)."""
    open: str = setting("<<", min_length=1)
    """The opening marker of a call."""
    end: str = setting("=", min_length=1)
    """The call's end: the text before it (after `open`) is the call."""
    close: str = setting(">>", min_length=1)
    """The closing marker, forced after the result."""


@dataclass(frozen=True)
class ToolsConfig(Section):
    """Tools called inside the completion (docs/rewards-and-data.md#tools): none by default."""

    enabled: tuple[ToolConfig, ...] = ()
    """The tools the rollout runs, e.g. [{name: calculator}]; empty = none (the completions are the
    policy's alone)."""
    max_calls: int = setting(8, minimum=1)
    """Calls per completion at most; later calls are left as the policy writes them."""
    max_result_chars: int = setting(32, minimum=1)
    """A result longer than this many characters is cut to it."""
    evaluate_without: bool = False
    """Each evaluation (the evaluate stage, rloo.api.evaluate) also decodes every policy without the tools,
    on the same problems with the same noise, and reports the tool's gain with its paired interval: a
    second pass, so off by default (config/tools.yaml turns it on). Read by the evaluations only."""

    @property
    def on(self) -> bool:
        return bool(self.enabled)

    def problems(self, cfg: Any) -> list[str]:
        """Names and opening markers must differ; each tool's function imports and its signature fits
        (rloo.tools.config_problems: imported only when a tool is enabled, since it runs the user's code)."""
        out: list[str] = []
        names: set[str] = set()
        opens: set[str] = set()
        for i, t in enumerate(self.enabled):
            if t.name in names:
                out.append(f"key 'tools.enabled[{i}].name': '{t.name}' is the name of an earlier tool; names must differ")
            if t.open in opens:
                out.append(f"key 'tools.enabled[{i}].open': '{t.open}' opens an earlier tool's calls; markers must differ")
            names.add(t.name)
            opens.add(t.open)
        if self.evaluate_without and not self.enabled:
            out.append("key 'tools.evaluate_without': no tool is enabled (tools.enabled), so there is no "
                       "evaluation with a tool to set beside one without")
        if self.enabled:
            from rloo.tools import config_problems

            out += config_problems(cfg)
        return out
