"""Reward functions as plug-ins (rloo/reward/functions.py, FunctionReward in rloo/reward/rewards.py):
TRL's calling convention, the weighted sum, and each problem as one line naming the key or the function,
before any stage runs (the config checks) or while training (every call)."""

from __future__ import annotations

import math
import textwrap
import traceback
from pathlib import Path

import pytest
import torch

from rloo.reward.functions import RewardFunction, RewardFunctionError, user_files
from rloo.reward.rewards import FunctionReward, VerifierReward, build_reward
from rloo.reward.verifier import reward as verifier_reward
from rloo.settings import Config
from rloo_workflow.config import ConfigError, load_config

ROOT = Path(__file__).resolve().parents[2]

FUNCTIONS = textwrap.dedent('''
    SEEN = {}

    def trl_style(completions, **kwargs):
        """TRL's documented form (trl.rewards): completions, and every other argument as keywords."""
        SEEN["trl_style"] = {"completions": completions, **kwargs}
        return [float(len(c)) for c in completions]

    def marker(completions, **kwargs):
        return [1.0 if "####" in c else 0.0 for c in completions]

    def declared(completions, answer):
        """No **kwargs: it gets only what it names."""
        return [float(a.endswith(c.strip()[-1:])) for c, a in zip(completions, answer)]

    def steps(completions, steps, **kwargs):
        return [float(s) for s in steps]

    def sometimes_none(completions, **kwargs):
        return [None if c.startswith("x") else 0.5 for c in completions]

    def wrong_length(completions, **kwargs):
        return [1.0]

    def not_a_number(completions, **kwargs):
        return ["1.0"] * len(completions)

    def not_finite(completions, **kwargs):
        return [float("inf")] * len(completions)

    def not_a_list(completions, **kwargs):
        return 1.0

    def raises_on_x(completions, **kwargs):
        return [1 / 0 if c.startswith("x") else 1.0 for c in completions]

    def no_completions(prompts):
        return [0.0] * len(prompts)

    def positional_only(completions, /, **kwargs):
        return [0.0] * len(completions)

    def needs_unknown(completions, difficulty):
        return [0.0] * len(completions)

    NOT_CALLABLE = 3
''')

PROMPTS = ["Question: a\nAnswer:", "Question: b\nAnswer:", "Question: c\nAnswer:", "Question: d\nAnswer:"]
COMPLETIONS = [" 2 + 2 = 4\n#### 4", "x #### 5", " no marker", " #### 7"]
ROWS = [{"question": q, "answer": f"#### {a}", "steps": s}
        for q, a, s in zip("abcd", (4, 6, 1, 7), (1, 2, 3, 4), strict=True)]
FINISHED = [True, True, True, False]


@pytest.fixture
def rewards_file(tmp_path) -> Path:
    path = tmp_path / "mine.py"
    path.write_text(FUNCTIONS)
    return path


def config(functions: list[dict], **data) -> dict:
    return load_config(None, {"reward": {"source": "function", "functions": functions},
                              **({"data": data} if data else {})})


def reward_of(*functions: dict, **data) -> FunctionReward:
    reward = build_reward(config(list(functions), **data))
    assert isinstance(reward, FunctionReward)
    return reward


def score(reward, completions=COMPLETIONS, rows=ROWS) -> torch.Tensor:
    n = len(completions)
    return reward.score(PROMPTS[:n], completions, [r["answer"] for r in rows], FINISHED[:n], rows=rows,
                        completion_ids=[[7, 8]] * n)


def test_a_function_in_trls_documented_form_gets_every_argument(rewards_file):
    reward = reward_of({"name": "trl", "fn": f"{rewards_file}:trl_style"})
    got = score(reward)
    assert got.tolist() == [float(len(c)) for c in COMPLETIONS]
    seen = RewardFunction.from_config(reward_config := Config.of(config([{"name": "t", "fn": f"{rewards_file}:trl_style"}])))
    assert reward_config.reward.functions[0].weight == 1.0  # the schema's default
    module_seen = seen[0].func.__globals__["SEEN"]["trl_style"]
    # prompts, completions, completion_ids, finished, and every column of the records, one item per completion
    assert set(module_seen) == {"prompts", "completions", "completion_ids", "finished", "question", "answer", "steps"}
    assert module_seen["steps"] == [1, 2, 3, 4] and module_seen["answer"][0] == "#### 4"
    assert module_seen["prompts"] == PROMPTS and module_seen["completion_ids"] == [[7, 8]] * 4


def test_the_training_reward_is_the_weighted_sum(rewards_file):
    reward = reward_of({"name": "marker", "fn": f"{rewards_file}:marker", "weight": 0.25},
                       {"name": "steps", "fn": f"{rewards_file}:steps", "weight": -2.0},
                       source="jsonl")  # data that may carry a `steps` column
    assert score(reward).tolist() == [0.25 * m - 2.0 * s for m, s in zip((1, 1, 0, 1), (1, 2, 3, 4), strict=True)]
    # each function's mean over what it scored, for train/reward/<name>
    assert reward.tally.means("train/reward/") == {"train/reward/marker": 0.75, "train/reward/steps": 2.5}


def test_none_is_missing_and_left_out_of_the_sum(rewards_file):
    alone = reward_of({"name": "some", "fn": f"{rewards_file}:sometimes_none"})
    got = score(alone)
    assert math.isnan(got[1]) and got[[0, 2, 3]].tolist() == [0.5, 0.5, 0.5]  # NaN: a missing reward
    both = reward_of({"name": "some", "fn": f"{rewards_file}:sometimes_none", "weight": 2.0},
                     {"name": "marker", "fn": f"{rewards_file}:marker"})
    assert score(both).tolist() == [2.0, 1.0, 1.0, 2.0]  # the other function's reward alone where one is None
    assert both.tally.means() == {"some": 0.5, "marker": 0.75}


def test_a_function_without_kwargs_gets_only_what_it_names(rewards_file):
    assert score(reward_of({"name": "d", "fn": f"{rewards_file}:declared"})).tolist() == [1.0, 0.0, 0.0, 1.0]


def test_the_verifier_as_a_function_is_the_verifier(rewards_file):
    rows = [{"question": "q", "answer": a} for a in ("#### 4", "#### 5", "#### 1", "#### 7")]
    as_function = score(reward_of({"name": "correct", "fn": "rloo.reward.verifier:reward"}), rows=rows)
    built_in = VerifierReward().score(PROMPTS, COMPLETIONS, [r["answer"] for r in rows], FINISHED)
    assert torch.equal(as_function, built_in) and as_function.tolist() == [1.0, 1.0, 0.0, 0.0]  # the last: cut off
    assert verifier_reward(completions=["#### 4"], answer=["#### 4"]) == [1.0]  # TRL's call: no `finished`


def _def_line(path: Path, name: str) -> int:
    return next(i for i, line in enumerate(path.read_text().splitlines(), 1) if line.startswith(f"def {name}("))


@pytest.mark.parametrize(("fn", "expected"), [
    ("wrong_length", "reward function 'f' ({fn}) returned 1 rewards for 4 completions"),
    ("not_a_number", "reward function 'f' ({fn}) returned '1.0' for completion 0: not a number"),
    ("not_finite", "reward function 'f' ({fn}) returned inf for completion 0: a reward must be finite"),
    ("not_a_list", "reward function 'f' ({fn}) returned a float, not a list of rewards"),
    ("raises_on_x", "reward function 'f' ({fn}) raised ZeroDivisionError: division by zero at {file}:{line} on 1 "
                    "of the 2 completions tried one by one, more than reward.functions[0].max_failed_share=0 of the "
                    "batch"),
])
def test_what_a_function_returns_is_checked_at_every_call(rewards_file, fn, expected):
    spec = f"{rewards_file}:{fn}"
    reward = reward_of({"name": "f", "fn": spec})
    with pytest.raises(RewardFunctionError) as info:
        score(reward)
    message = str(info.value)
    line = FUNCTIONS.splitlines().index("    return [1 / 0 if c.startswith(\"x\") else 1.0 for c in completions]") + 1
    assert message.startswith(expected.format(fn=spec, file=rewards_file, line=line)) and "\n" not in message, message


HELPERS = textwrap.dedent('''
    import json


    def parse(text):
        return json.loads(text)  # a completion that is no JSON raises inside json, called from here
''')

CALLER = textwrap.dedent('''
    from helpers_of_mine import parse


    def json_score(completions, **kwargs):
        return [float(parse(c)["score"]) for c in completions]
''')


def test_a_raising_function_is_one_line_with_the_users_file_and_line_and_its_traceback_follows(tmp_path,
                                                                                                monkeypatch):
    # the innermost frame in the user's code: their helper in a second file, not json's frames nor rloo's
    (tmp_path / "helpers_of_mine.py").write_text(HELPERS)
    (tmp_path / "scores.py").write_text(CALLER)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.chdir(tmp_path)
    reward = reward_of({"name": "js", "fn": "scores.py:json_score"})
    with pytest.raises(RewardFunctionError) as info:
        score(reward, completions=['{"score": 1}', "not json"])
    message = str(info.value)
    line = HELPERS.splitlines().index("    return json.loads(text)  # a completion that is no JSON raises inside json,"
                                      " called from here") + 1
    assert message.startswith("reward function 'js' (scores.py:json_score) raised JSONDecodeError: Expecting value: "
                              f"line 1 column 1 (char 0) at helpers_of_mine.py:{line} on 1 of the 2 completions"), message
    assert "\n" not in message
    # the full traceback (what the CLI prints to the stage's log) holds every frame of the user's code
    shown = "".join(traceback.format_exception(info.value))
    assert f'helpers_of_mine.py", line {line}, in parse' in shown and 'scores.py", line 6, in' in shown, shown


def test_a_reward_file_that_raises_on_import_names_its_line(tmp_path):
    (tmp_path / "bad_import.py").write_text("import os\n\nLIMIT = int(os.environ['RLOO_NO_SUCH_VARIABLE'])\n")
    problems = _problems([{"name": "f", "fn": f"{tmp_path}/bad_import.py:f"}])
    assert problems == [f"  key 'reward.functions[0].fn': {tmp_path}/bad_import.py: importing it raised KeyError: "
                        f"'RLOO_NO_SUCH_VARIABLE' at {tmp_path}/bad_import.py:3"], problems


def test_a_function_that_raises_within_its_share_gives_missing_rewards(rewards_file, caplog):
    reward = reward_of({"name": "f", "fn": f"{rewards_file}:raises_on_x", "max_failed_share": 0.25})
    got = score(reward)
    assert math.isnan(got[1]) and got[[0, 2, 3]].tolist() == [1.0, 1.0, 1.0]
    assert "raised on 1 of 4 completions" in caplog.text
    two_bad = ["x", "x", " a", " b"]
    with pytest.raises(RewardFunctionError, match=r"on 2 of the 2 completions tried"):
        score(reward, completions=two_bad)  # 2 of 4 is more than a quarter


def test_a_column_a_function_needs_is_checked_at_its_first_call_where_the_data_may_have_it(rewards_file):
    # jsonl data may carry a `difficulty` column: the signature passes the config checks ...
    reward = reward_of({"name": "u", "fn": f"{rewards_file}:needs_unknown"}, source="jsonl")
    with pytest.raises(RewardFunctionError, match=r"reward function 'u' .* needs 'difficulty', which the data "
                                                  r"records do not have \(offered: answer, completion_ids"):
        score(reward)  # ... and these records have none


def _problems(functions: list[dict]) -> list[str]:
    with pytest.raises(ConfigError) as info:
        config(functions)
    return str(info.value).splitlines()[1:]


@pytest.mark.parametrize(("fn", "expected"), [
    ("{file}", "key 'reward.functions[0].fn': '{file}' is not 'module:function' or 'path/to/file.py:function'"),
    ("{dir}/nosuch.py:f", "key 'reward.functions[0].fn': {dir}/nosuch.py: no such file (a relative path is read "
                          "from the working directory"),
    ("rloo.nosuch:f", "key 'reward.functions[0].fn': module 'rloo.nosuch' does not import (ModuleNotFoundError: "
                      "No module named 'rloo.nosuch')"),
    ("{dir}/broken.py:f", "key 'reward.functions[0].fn': {dir}/broken.py: importing it raised SyntaxError: "),
    ("{file}:nosuch", "key 'reward.functions[0].fn': {file}: no function 'nosuch'"),
    ("{file}:NOT_CALLABLE", "key 'reward.functions[0].fn': {file}: 'NOT_CALLABLE' is a int, not a function"),
    ("{file}:no_completions", "key 'reward.functions[0].fn': {file}:{line_no_completions}: 'no_completions' cannot be called as a "
                              "reward function: it takes no 'completions' argument (TRL's form"),
    ("{file}:positional_only", "key 'reward.functions[0].fn': {file}:{line_positional_only}: 'positional_only' cannot be called as a "
                               "reward function: its parameter 'completions' is positional-only"),
    ("{file}:needs_unknown", "key 'reward.functions[0].fn': {file}:{line_needs_unknown}: 'needs_unknown' cannot be called as a "
                             "reward function: it needs 'difficulty', which no call offers (offered: answer, "
                             "completion_ids, completions, finished, prompts, question)"),
    ("rloo.reward.verifier:is_correct", "key 'reward.functions[0].fn': {verifier}:{line_is_correct}: 'is_correct' "
                                        "cannot be called as a reward function: it takes no 'completions' argument"),
])
def test_a_function_that_cannot_be_used_is_one_line_before_any_stage_runs(rewards_file, fn, expected):
    (rewards_file.parent / "broken.py").write_text("def f(completions, **kwargs)\n    return []\n")
    verifier = ROOT / "rloo" / "reward" / "verifier.py"
    fields = {"file": rewards_file, "dir": rewards_file.parent, "verifier": verifier,
              # a signature the call cannot meet names the line of the function's `def`
              **{f"line_{name}": _def_line(path, name) for path, name in
                 [(rewards_file, "no_completions"), (rewards_file, "positional_only"),
                  (rewards_file, "needs_unknown"), (verifier, "is_correct")]}}
    problems = _problems([{"name": "f", "fn": fn.format(**fields)}])
    assert len(problems) == 1 and problems[0].strip().startswith(expected.format(**fields)), problems


def test_names_must_differ_and_a_function_source_needs_functions(rewards_file):
    spec = f"{rewards_file}:marker"
    assert _problems([{"name": "a", "fn": spec}, {"name": "a", "fn": spec}]) == [
        "  key 'reward.functions[1].name': 'a' is the name of an earlier function; names must differ"]
    assert _problems([])[0].startswith("  key 'reward.functions': reward.source is 'function' but no function")
    with pytest.raises(ConfigError, match=r"key 'reward.functions.0.name': 'a b' does not match"):
        config([{"name": "a b", "fn": spec}])
    with pytest.raises(ConfigError, match=r"key 'reward.http.url': reward.source is 'http' but no URL is set"):
        load_config(None, {"reward": {"source": "http"}})


def test_a_relative_file_is_read_from_the_working_directory(rewards_file, monkeypatch):
    monkeypatch.chdir(rewards_file.parent)
    cfg = config([{"name": "m", "fn": "mine.py:marker"}, {"name": "v", "fn": "rloo.reward.verifier:reward"}])
    assert score(build_reward(cfg)).tolist() == [2.0, 1.0, 0.0, 1.0]
    # the user's code that the rloo and evaluate rules take as inputs: the file, not rloo's own module
    assert user_files(Config.of(cfg)) == [rewards_file.parent / "mine.py"]
    (rewards_file.parent / "my_rewards.py").write_text(FUNCTIONS)  # a module of the working directory
    monkeypatch.syspath_prepend(str(rewards_file.parent))
    cfg = config([{"name": "m", "fn": "my_rewards:marker"}, {"name": "v", "fn": "rloo.reward.verifier:reward"}])
    assert user_files(Config.of(cfg)) == [rewards_file.parent / "my_rewards.py"]
    # the standard library and installed packages are not the user's code
    cfg["reward"]["functions"] += [{"name": "s", "fn": "json:dumps"}, {"name": "y", "fn": "yaml:safe_dump"}]
    assert user_files(Config.of(cfg)) == [rewards_file.parent / "my_rewards.py"]
    assert user_files(Config.of(load_config(ROOT / "config" / "config.yaml"))) == []
