"""Reward functions as plug-ins (`reward.source: function`): a user's Python functions, called the way
TRL calls its reward functions, so that one written for TRL's trainers runs here unchanged.

    def format_bonus(completions, **kwargs) -> list[float | None]: ...

`fn` names one as `module:function` (importable: `rloo.reward.verifier:reward`) or
`path/to/file.py:function` (a relative path is read from the working directory the pipeline runs in).
Each call passes keyword arguments only, each a list with one item per completion: `prompts` (the
rendered prompt texts), `completions` (the completion texts), `completion_ids` (their token ids),
`finished` (whether it ended with EOS within the token budget) and every column of the data record
(`question`, `answer` in its GSM8K form `... #### N`, and any other field the data set carries). A
function without `**kwargs` gets only the arguments it names. It returns one float or None (a missing
reward) per completion.

Checked before any stage runs (`config_problems`, from rloo_workflow.config.checks): the function imports and
its signature fits. Checked at every call (`RewardFunction.__call__`): one reward per completion, each a
finite number or None; an exception on more than `max_failed_share` of a batch stops the run. Each
problem is one line naming the key or the function; an exception's names the file and line of the
user's code it was raised at (`rloo.plugins.user_frame`: the loading and these checks are the plug-ins' machinery, shared with the tools), its traceback chained for the stage's log. Nothing here imports torch: the checks run when
Snakemake reads the workflow.
"""

from __future__ import annotations

import logging
import math
import numbers
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rloo import plugins
from rloo.plugins import Parameters, PluginError, code_file, is_path, raised, resolve

log = logging.getLogger("rloo.reward.functions")

# What every call offers besides the record's columns (these win over a column of the same name).
ARGUMENTS = ("prompts", "completions", "completion_ids", "finished")
# The columns every prepared record has (rloo.data.gsm8k); a jsonl or hub data set may add more.
RECORD_COLUMNS = ("question", "answer")
# The verifier as a reward function: the one `fn` the evaluation knows to grade accuracy too.
VERIFIER_FN = "rloo.reward.verifier:reward"


class RewardFunctionError(PluginError):
    """A reward function that cannot be used: it does not import, its signature does not fit, or it
    did not return one finite number (or None) per completion."""


def load(fn: str, key: str) -> tuple[Callable, str]:
    """(the function `fn` names, the file it is in); a RewardFunctionError naming `key` and the file
    when it does not import (rloo.plugins.load)."""
    return plugins.load(fn, key, RewardFunctionError)


def signature_problem(func: Callable, offered: set[str] | None) -> str | None:
    """Why `func` cannot be called as a reward function with the arguments `offered` (None: the
    record's further columns are not known yet, and the names it needs are checked at its first call),
    or None when it can."""
    params = Parameters.of(func)
    if params is None:
        return None
    if params.positional_only:
        return f"its parameter '{params.positional_only[0]}' is positional-only, but every argument is passed by keyword"
    if "completions" not in params.named and not params.any_keyword:
        return "it takes no 'completions' argument (TRL's form: def f(completions, **kwargs))"
    return params.unknown(offered)


def offered_names(config: Any) -> set[str] | None:
    """The arguments every call offers under `config` (a rloo.settings.Config, as every function here
    takes: not imported, since the settings' own check imports this module): None where the data set may carry further columns
    (a jsonl or hub source: they are checked at the first call, when the records are read)."""
    return None if config.data.source in ("jsonl", "hub") else {*ARGUMENTS, *RECORD_COLUMNS}


def config_problems(config: Any) -> list[str]:
    """Each configured reward function that does not import or whose signature does not fit, one line
    each naming its key and file; and a function source without functions."""
    functions = _functions(config)
    if functions is None:
        return []
    if not functions:
        return ["key 'reward.functions': reward.source is 'function' but no function is listed "
                "(- {name: correct, fn: 'rloo.reward.verifier:reward', weight: 1.0})"]
    problems, names = [], set()
    offered = offered_names(config)
    for i, f in enumerate(functions):
        key = f"reward.functions[{i}]"
        if f.name in names:
            problems.append(f"key '{key}.name': '{f.name}' is the name of an earlier function; names must differ")
        names.add(f.name)
        try:
            func, where = load(f.fn, f"{key}.fn")
        except RewardFunctionError as e:
            problems.append(str(e))
            continue
        if problem := signature_problem(func, offered):
            name = f.fn.rpartition(":")[2]
            problems.append(f"key '{key}.fn': {plugins.defined_at(func, where)}: '{name}' cannot be called as a "
                            f"reward function: {problem}")
    return problems


def _functions(config: Any) -> tuple[Any, ...] | None:
    """`reward.functions` (rloo.settings.RewardFunctionConfig) where `reward.source` is function, else None."""
    rc = config.reward
    return rc.functions if rc.source == "function" else None


def package_functions(config: Any) -> list[tuple[str, str]]:
    """(module, function) of each configured reward function that this package holds
    (`rloo.reward.verifier:reward`): code the rloo and evaluate stages run by name, which their code
    fingerprints count (rloo_workflow/code_fingerprint.py)."""
    return plugins.package_functions(f.fn for f in _functions(config) or ())


def user_files(config: Any) -> list[Path]:
    """The files of the user's own code that the configured reward functions run (rloo.plugins.user_files):
    the rloo and evaluate stages' code fingerprints count them."""
    return plugins.user_files(f.fn for f in _functions(config) or ())


def callable_files(functions: Iterable[RewardFunction]) -> list[Path]:
    """The user's files among those the code of `functions` lies in (callables handed to rloo.api): what
    the run's checkpoint identity counts, as `user_files` for the configured ones."""
    return plugins.users_own(Path(f._file) for f in functions if f._file)


def _from_file(key: str, name: str, fn: str, weight: float, max_failed_share: float) -> RewardFunction:
    """A RewardFunction of a file's function, loaded in this process (RewardFunction.__reduce__)."""
    func, _ = load(fn, f"{key}.fn")
    return RewardFunction(key, name, fn, weight, max_failed_share, func, Parameters.of(func))


@dataclass
class RewardFunction:
    """One reward function, loaded: the setting `reward.functions[i]` (rloo.settings.RewardFunctionConfig)
    with the function it names, or a Python callable (`of`). `__call__` scores a batch, checking what it
    returns."""

    key: str  # reward.functions[i]
    name: str
    fn: str
    weight: float
    max_failed_share: float
    func: Callable = field(repr=False)
    params: Parameters | None = field(repr=False, default=None)

    @classmethod
    def from_config(cls, config: Any) -> list[RewardFunction]:
        out = []
        for i, f in enumerate(config.reward.functions):
            key = f"reward.functions[{i}]"
            func, _ = load(f.fn, f"{key}.fn")
            out.append(cls(key, f.name, f.fn, float(f.weight), float(f.max_failed_share), func, Parameters.of(func)))
        return out

    def __reduce__(self):
        # A function of a file (path/to/file.py:function) lives in a module no other process can import by
        # its name: another process (the off-policy sampler, rloo/train/off_policy.py) runs the file again.
        target, _, func = self.fn.rpartition(":")
        if is_path(target):
            return _from_file, (self.key, self.name, f"{resolve(target)}:{func}", self.weight, self.max_failed_share)
        return super().__reduce__()

    @classmethod
    def of(cls, func: Callable, weight: float = 1.0, name: str | None = None, max_failed_share: float = 0.0
           ) -> RewardFunction:
        """A Python callable as a reward function (rloo.api.train_rloo's `reward`), named after itself."""
        name = name or getattr(func, "__name__", type(func).__name__)
        fn = f"{getattr(func, '__module__', '?')}:{getattr(func, '__qualname__', name)}"
        if problem := signature_problem(func, None):
            raise RewardFunctionError(f"reward function '{name}' ({fn}): {problem}")
        return cls(f"reward[{name}]", name, fn, float(weight), float(max_failed_share), func, Parameters.of(func))

    @property
    def _file(self) -> str | None:
        return code_file(self.func)

    @property
    def label(self) -> str:
        return f"reward function '{self.name}' ({self.fn})"

    def _arguments(self, batch: dict[str, list]) -> dict[str, list]:
        """What this function is passed of `batch`: all of it (`**kwargs`), else the names it declares."""
        if self.params is None:
            return batch
        if missing := [n for n in self.params.required if n not in batch]:
            raise RewardFunctionError(f"{self.label} needs {', '.join(repr(n) for n in missing)}, which the data "
                                      f"records do not have (offered: {', '.join(sorted(batch))})")
        return batch if self.params.any_keyword else {k: v for k, v in batch.items() if k in self.params.named}

    def __call__(self, batch: dict[str, list]) -> list[float | None]:
        """The function's rewards of `batch` (keyword argument lists, `n` completions). An exception on
        the whole batch is retried completion by completion: those that raise again are missing
        rewards, and the run stops when they are more than `max_failed_share` of the batch."""
        args = self._arguments(batch)
        n = len(batch["completions"])
        try:
            return self._checked(self.func(**args), n)
        except RewardFunctionError:
            raise
        except Exception as e:
            first = e
        allowed = math.floor(self.max_failed_share * n + 1e-9)
        out: list[float | None] = []
        failed, last = 0, first
        for i in range(n):
            try:
                out += self._checked(self.func(**{k: v[i : i + 1] for k, v in args.items()}), 1)
            except RewardFunctionError:
                raise
            except Exception as e:
                failed, last = failed + 1, e
                out.append(None)
                if failed > allowed:
                    # `from last`: the user's own frames follow where tracebacks go (the stage's log)
                    raise RewardFunctionError(
                        f"{self.label} raised {raised(last, self._file)} on {failed} of the {i + 1} completions "
                        f"tried one by one, more than {self.key}.max_failed_share={self.max_failed_share:g} of the "
                        f"batch of {n} allows: the run stops") from last
        if failed:
            log.warning("%s raised on %d of %d completions (last: %s): missing rewards", self.label, failed, n,
                        raised(last, self._file))
        return out

    def _checked(self, values: Any, n: int) -> list[float | None]:
        try:
            return reward_list(values, n)
        except BadRewards as e:
            raise RewardFunctionError(f"{self.label} {e}") from None


class BadRewards(ValueError):
    """What a scorer returned is not one finite number or None per completion."""


def reward_list(values: Any, n: int) -> list[float | None]:
    """`values` as one float or None per completion of `n`; else BadRewards saying what was returned."""
    if hasattr(values, "tolist") and not isinstance(values, list | tuple):
        values = values.tolist()  # a numpy array or a tensor
    if not isinstance(values, list | tuple):
        raise BadRewards(f"returned a {type(values).__name__}, not a list of rewards (one float or None per completion)")
    if len(values) != n:
        raise BadRewards(f"returned {len(values)} rewards for {n} completions")
    out: list[float | None] = []
    for i, v in enumerate(values):
        if v is None:
            out.append(None)
        elif not isinstance(v, numbers.Real):
            raise BadRewards(f"returned {v!r:.60} for completion {i}: not a number (a reward is a float, or None "
                             "for a missing one)")
        elif not math.isfinite(float(v)):
            raise BadRewards(f"returned {float(v)} for completion {i}: a reward must be finite (None marks a "
                             "missing one)")
        else:
            out.append(float(v))
    return out


def arguments(prompts: list[str], completions: list[str], finished: list[bool], rows: list[dict],
              completion_ids: list[list[int]] | None = None) -> dict[str, list]:
    """A call's keyword arguments: every column of the records `rows` (one per completion), then the
    prompts, completions, their token ids (where known) and whether each finished."""
    columns: dict[str, list] = {}
    for key in dict.fromkeys(k for r in rows for k in r):
        columns[key] = [r.get(key) for r in rows]
    columns.update(prompts=list(prompts), completions=list(completions), finished=list(finished))
    if completion_ids is not None:
        columns["completion_ids"] = list(completion_ids)
    return columns


def weighted_sum(values: dict[str, list[float | None]], weights: dict[str, float]) -> list[float]:
    """Per completion, the weighted sum of the functions that gave a number; NaN (a missing reward)
    where none did."""
    n = len(next(iter(values.values()))) if values else 0
    out = []
    for i in range(n):
        terms = [weights[name] * v[i] for name, v in values.items() if v[i] is not None]
        out.append(math.fsum(terms) if terms else math.nan)
    return out


@dataclass
class Tally:
    """Running sums of each function's rewards (missing ones left out), for its mean over a step."""

    sums: dict[str, float] = field(default_factory=dict)
    counts: dict[str, int] = field(default_factory=dict)

    def add(self, values: dict[str, list[float | None]]) -> None:
        for name, v in values.items():
            got = [x for x in v if x is not None]
            self.sums[name] = self.sums.get(name, 0.0) + math.fsum(got)
            self.counts[name] = self.counts.get(name, 0) + len(got)

    def clear(self) -> None:
        self.sums.clear()
        self.counts.clear()

    def means(self, prefix: str = "") -> dict[str, float]:
        return {f"{prefix}{n}": self.sums[n] / self.counts[n] if self.counts[n] else math.nan for n in self.sums}
