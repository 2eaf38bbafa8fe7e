"""Tools as plug-ins (rloo/tools/__init__.py, the `tools:` section): the reward functions' form and
machinery (rloo/plugins.py), each problem one line naming the key or the user's file and line."""

from __future__ import annotations

import pickle
import textwrap
from pathlib import Path

import pytest

from rloo.settings import Config
from rloo.tools import Tool, Toolbox, ToolError, user_files
from rloo.tools.calculator import calculate
from rloo_workflow.config import ConfigError, load_config

TOOLS = textwrap.dedent('''
    def lookup(call, question, **row):
        """A second tool: a field of the row."""
        return str(len(question)) if call == "len" else row.get(call, "none")

    def raises(call, **row):
        return str(1 / 0)

    def not_text(call, **row):
        return 42

    def no_call(**row):
        return ""

    def needs_column(call, unit):
        return call + unit
''')


@pytest.fixture
def tools_file(tmp_path, monkeypatch) -> Path:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "my_tools.py").write_text(TOOLS)
    return tmp_path / "my_tools.py"


def config(*tools: dict, **keys) -> dict:
    return load_config(None, {"tools": {"enabled": list(tools), **keys}})


def test_off_by_default_and_the_calculator_is_the_first_builtin():
    assert Toolbox.from_config(Config()) is None
    box = Toolbox.from_config(Config.of(config({})))
    (tool,) = box.tools
    assert (tool.name, tool.open, tool.end, tool.close, tool.func) == ("calculator", "<<", "=", ">>", calculate)
    assert tool("48/2", {"question": "q", "answer": "a"}) == "24"


def test_a_second_tool_from_a_file_gets_the_row(tools_file):
    box = Toolbox.from_config(Config.of(config({"name": "lookup", "fn": "my_tools.py:lookup", "open": "[["},
                                               max_result_chars=3)))
    tool = box.tools[0]
    assert tool("len", {"question": "abcd", "answer": "x"}) == "4"
    assert tool("answer", {"question": "q", "answer": "12345"}) == "123"  # cut to max_result_chars
    assert pickle.loads(pickle.dumps(tool))("len", {"question": "ab"}) == "2"  # another process loads the file
    assert user_files(Config.of(config({"name": "lookup", "fn": "my_tools.py:lookup"}))) == [tools_file]
    assert user_files(Config.of(config({}))) == []  # the calculator is this package's code


def test_a_tool_that_raises_is_one_line_naming_the_users_file_and_line(tools_file):
    tool = Toolbox.from_config(Config.of(config({"name": "bad", "fn": "my_tools.py:raises"}))).tools[0]
    with pytest.raises(ToolError) as e:
        tool("1+1", {"question": "q"})
    line = next(i for i, t in enumerate(TOOLS.splitlines(), 1) if "1 / 0" in t)
    assert "\n" not in str(e.value)
    assert "ZeroDivisionError" in str(e.value) and f"my_tools.py:{line}" in str(e.value)
    bad = Toolbox.from_config(Config.of(config({"name": "bad", "fn": "my_tools.py:not_text"}))).tools[0]
    with pytest.raises(ToolError, match="returned a int"):
        bad("x")


@pytest.mark.parametrize(("entry", "says"), [
    ({"fn": "my_tools.py:no_call"}, "takes no positional argument for the call"),
    ({"fn": "my_tools.py:needs_column"}, "needs 'unit'"),
    ({"fn": "my_tools.py:missing"}, "no function 'missing'"),
    ({"fn": "nowhere.py:f"}, "no such file"),
    ({"fn": "rloo.no_such_module:f"}, "does not import"),
])
def test_a_tool_that_cannot_be_called_is_a_config_error_naming_its_key(tools_file, entry, says):
    with pytest.raises(ConfigError) as e:
        config(entry)
    assert "tools.enabled[0].fn" in str(e.value) and says in str(e.value)


def test_names_and_opening_markers_must_differ():
    with pytest.raises(ConfigError, match=r"tools.enabled\[1\].open"):
        config({}, {"name": "other"})
    with pytest.raises(ConfigError, match=r"tools.enabled\[1\].name"):
        config({}, {"open": "[["})


def test_a_python_callable_is_checked_as_a_tool():
    assert Tool.of(lambda call, **row: call)("x") == "x"
    with pytest.raises(ToolError, match="positional"):
        Tool.of(lambda *, call: call)


def test_the_vllm_sampler_does_not_run_tools_yet():
    with pytest.raises(ConfigError, match=r"tools.enabled.*rollout.backend"):
        load_config(None, {"tools": {"enabled": [{}]}, "rollout": {"backend": "vllm"}})


def test_ppo_does_not_mask_tool_tokens_yet():
    with pytest.raises(ConfigError, match=r"tools.enabled.*PPO"):
        load_config(None, {"tools": {"enabled": [{}]}, "rloo": {"estimator": "ppo"}})


def test_tools_are_read_by_sft_and_below_only_when_enabled():
    """A config without tools reads, reruns on and resumes as before; with one, a change of `tools:` reruns
    sft, rloo and the evaluations, and no checkpoint of sft or rloo resumes across it."""
    from rloo.code_fingerprint import Fingerprint
    from rloo.identity import job_identity
    from rloo_workflow.pipeline import reads_key

    def run_identity(c, stage):  # the keys' part (the code walk: below)
        return job_identity(c, stage, code=Fingerprint(stage, "0", {})).resume

    off, on = config(), config({})
    for stage in ("prepare", "base", "sft", "reward", "rloo", "evaluate"):
        assert not reads_key(off, stage, "tools.max_calls")
        assert reads_key(on, stage, "tools.max_calls") == (stage in ("sft", "rloo", "evaluate"))
    more = config({}, max_calls=3)
    for stage in ("sft", "rloo"):
        assert run_identity(Config.of(on), stage) != run_identity(Config.of(more), stage)
        assert run_identity(Config.of(off), stage) == run_identity(Config.of(config(max_calls=3)), stage)
    assert run_identity(Config.of(on), "reward") == run_identity(Config.of(off), "reward")


@pytest.mark.slow  # the code walk: ~8 s on a loaded machine
def test_a_tools_file_counts_for_the_stages_that_run_it(tools_file):
    from rloo.identity import job_identity
    from rloo_workflow.code_fingerprint import _stage_fingerprint, stage_fingerprint

    def run_identity(c, stage):
        return job_identity(c, stage).resume

    cfg = config({"name": "lookup", "fn": "my_tools.py:lookup", "open": "[["})
    stages = ("sft", "rloo", "evaluate", "reward")
    before = {s: stage_fingerprint(s, cfg).digest for s in stages}
    identity = run_identity(Config.of(cfg), "sft")
    tools_file.write_text(TOOLS.replace('"none"', '"nothing"'))
    _stage_fingerprint.cache_clear()
    after = {s: stage_fingerprint(s, cfg).digest for s in stages}
    assert {s for s in stages if before[s] != after[s]} == {"sft", "rloo", "evaluate"}
    assert run_identity(Config.of(cfg), "sft") != identity
