"""The typed settings (rloo/settings/) are the one source of the configuration: the JSON schema the config
files are validated against is made from them, so their defaults are the pipeline's; every field has its
doc; rloo_workflow/schemas/config.schema.json, the schema written out, is the one they make now; a notebook builds
a section from keyword arguments or from part of a dict."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from rloo.settings import AlarmConfig, Config, RlooConfig, json_schema, section_types
from rloo.settings.fields import field_docs
from rloo_workflow.config import ConfigError, load_config, validate
from rloo_workflow.config.schema import SCHEMA_PATH, render_schema

ROOT = Path(__file__).resolve().parents[2]


def sections(cls: type = Config) -> list[type]:
    """`cls` and every section nested in it (a tuple's item type too)."""
    out, todo = [], [cls]
    while todo:
        c = todo.pop()
        if c not in out:
            out.append(c)
            todo += section_types(c).values()
    return out


def test_the_defaults_are_the_pipelines():
    # the schema fills a config's missing keys from the dataclasses' defaults: one and the same
    assert Config().to_config() == validate({})
    assert RlooConfig().k == validate({})["rloo"]["k"] == 4


def test_the_written_schema_is_the_one_the_settings_make():
    assert SCHEMA_PATH.read_text() == render_schema(), "run `rloo schema --write`"
    assert json.loads(SCHEMA_PATH.read_text())["properties"]["rloo"]["properties"]["k"] == {
        "type": "integer", "minimum": 1, "default": 4,
        "description": "Samples per prompt: the group whose other members are each sample's baseline (`k_problems`)."}


def test_a_default_changed_on_one_side_only_is_caught(monkeypatch):
    """The written schema against a dataclass whose default moved (and the other way round)."""
    fields = {f.name: f for f in dataclasses.fields(AlarmConfig)}
    monkeypatch.setattr(fields["window"], "default", 60)
    moved = json_schema(Config)
    assert moved["properties"]["rloo"]["properties"]["alarms"]["properties"]["window"]["default"] == 60
    assert json.loads(SCHEMA_PATH.read_text()) != moved


def test_every_field_has_a_doc_and_every_section_a_docstring():
    missing = [f"{c.__name__}.{f.name}" for c in sections() for f in dataclasses.fields(c) if f.name not in field_docs(c)]
    assert missing == []
    assert [c.__name__ for c in sections() if not c.__doc__ or c.__doc__.startswith(c.__name__ + "(")] == []


def test_sections_hold_the_validated_values():
    cfg = load_config(ROOT / "config" / "micro.yaml")
    s = Config.from_config(cfg)
    assert s.rloo.k == cfg["rloo"]["k"] == 2 and s.model.tiny.hidden_size == 64
    assert s.rloo.stop_on == tuple(cfg["rloo"]["stop_on"]) and s.evaluate.llm_judge.serve is None
    assert dataclasses.asdict(s.rloo.ppo) == cfg["rloo"]["ppo"]
    assert dataclasses.asdict(s.rloo.alarms) == cfg["rloo"]["alarms"]
    cfg["rloo"]["alarms"]["window"] = 1  # a copy, not a view of the dict
    assert s.rloo.alarms.window == 50
    assert s.to_config() == load_config(ROOT / "config" / "micro.yaml")
    with pytest.raises(dataclasses.FrozenInstanceError):
        s.rloo.k = 3  # type: ignore[misc]


def test_a_notebook_builds_a_section_from_keywords_or_part_of_a_dict():
    assert RlooConfig(k=8).alarms == AlarmConfig() and RlooConfig(k=8).k == 8
    assert AlarmConfig.from_config({"window": 7}) == AlarmConfig(window=7)
    cfg = Config(rloo=RlooConfig(k=8, lr=1e-5)).to_config()
    assert validate(json.loads(json.dumps(cfg))) == cfg  # a valid config as it is


def test_a_served_judge_and_reward_functions_are_nested_sections():
    cfg = validate({"evaluate": {"judge": "llm", "llm_judge": {"serve": {"model": "m", "args": ["--x"]}}},
                    "reward": {"source": "function", "functions": [{"name": "c", "fn": "rloo.reward.verifier:reward"}]}})
    s = Config.from_config(cfg)
    serve = s.evaluate.llm_judge.serve
    assert serve.model == "m" and serve.args == ("--x",) and serve.gpus == 1 and serve.command is None
    assert s.reward.functions[0].fn == "rloo.reward.verifier:reward" and s.reward.functions[0].weight == 1.0


def test_a_key_without_a_field_is_refused_at_build_time():
    cfg = load_config(ROOT / "config" / "micro.yaml")
    cfg["rollout"]["speculative"] = True
    with pytest.raises(KeyError, match=r"RolloutConfig: no field for config key\(s\) speculative"):
        Config.from_config(cfg)


def test_each_rule_that_ties_keys_names_its_key():
    bad = {"rloo": {"k": 1, "max_new_tokens": 300}, "model": {"max_length": 256}, "sft": {"batch_size": 30000}}
    with pytest.raises(ConfigError) as e:
        validate(bad)
    msg = str(e.value)
    for key in ("rloo.k", "rloo.max_new_tokens", "sft.batch_size"):
        assert f"key '{key}'" in msg, msg
