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


@pytest.mark.parametrize("name", ["no_call", "needs_column"])
def test_a_tools_signature_error_names_the_users_file_and_line(tools_file, name):
    with pytest.raises(ConfigError) as e:
        config({"fn": f"my_tools.py:{name}"})
    line = next(i for i, t in enumerate(TOOLS.splitlines(), 1) if t.startswith(f"def {name}("))
    assert f"{tools_file}:{line}: '{name}' cannot be called as a tool" in str(e.value)


def test_the_example_tools_of_config_examples_run(monkeypatch):
    """config/examples/your-tool.yaml (validated with the other example overlays, tests/unit/test_config.py):
    its unit converter and its lookup in the row's fields answer their calls, and bad input gets ERROR."""
    root = Path(__file__).resolve().parents[2]
    monkeypatch.chdir(root)  # its paths are relative to the repository's root, where the pipeline runs
    cfg = load_config(root / "config" / "examples" / "your-tool.yaml")
    assert cfg["tools"]["evaluate_without"] is True
    calc, units, number = Toolbox.from_config(Config.of(cfg)).tools
    row = {"question": "Ava walks 5 km on day 1 and 12.5 km on day 2.", "answer": "#### 11"}
    assert calc("5+12.5", row) == "17.5" and units("5 km", row) == "3.107" and units("x km", row) == "ERROR"
    assert (number("n2", row), number("n1", row), number("n3", row), number("n5", row), number("two", row)) == (
        "1", "5", "12.5", "ERROR", "ERROR")
    assert user_files(Config.of(cfg)) == [root / "config" / "examples" / "tools" / "units.py"]


def test_names_and_opening_markers_must_differ():
    with pytest.raises(ConfigError, match=r"tools.enabled\[1\].open"):
        config({}, {"name": "other"})
    with pytest.raises(ConfigError, match=r"tools.enabled\[1\].name"):
        config({}, {"open": "[["})


def test_a_python_callable_is_checked_as_a_tool():
    assert Tool.of(lambda call, **row: call)("x") == "x"
    with pytest.raises(ToolError, match="positional"):
        Tool.of(lambda *, call: call)


def test_the_vllm_sampler_runs_tools_too():
    """Both rollout backends run the tools (tests/e2e/test_vllm.py holds vLLM's): the config is valid."""
    cfg = Config.of(load_config(None, {"tools": {"enabled": [{}]}, "rollout": {"backend": "vllm"}}))
    assert cfg.tools.on and cfg.rollout.backend == "vllm"


def test_ppo_runs_with_tools():
    """PPO's critic honours the policy mask (rloo/train/ppo.py): the config is accepted."""
    cfg = load_config(None, {"tools": {"enabled": [{}]}, "rloo": {"estimator": "ppo"}})
    assert cfg["rloo"]["estimator"] == "ppo" and cfg["tools"]["enabled"]


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


def test_the_evaluation_without_the_tools_is_read_by_the_evaluations_only():
    """tools.evaluate_without reruns the evaluations (and the report), not SFT or RLOO, nor their
    checkpoints; without a tool enabled it is a config error naming the key."""
    from rloo.code_fingerprint import Fingerprint
    from rloo.identity import job_identity
    from rloo_workflow.pipeline import reads_key

    on, both = config({}), config({}, evaluate_without=True)
    for stage in ("prepare", "base", "sft", "reward", "rloo", "evaluate", "report"):
        assert reads_key(both, stage, "tools.evaluate_without") == (stage in ("evaluate", "report"))
    for stage in ("sft", "rloo"):  # the keys' part of the identity (the code walk: the test below)
        code = Fingerprint(stage, "0", {})
        assert job_identity(Config.of(on), stage, code=code).rerun == job_identity(Config.of(both), stage, code=code).rerun
    with pytest.raises(ConfigError, match=r"tools.evaluate_without"):
        config(evaluate_without=True)


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
