"""The typed config sections (rloo/config/sections.py) agree with the schema: each dataclass has a field
for every key of its section and no other, nested sections too. A key the code reads through a section
but the schema lacks, or a schema key no section carries, fails here."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from rloo.config import load_config, load_schema, validate
from rloo.config.sections import Sections, section_types

ROOT = Path(__file__).resolve().parents[2]


def _pairs(cls: type, schema: dict, where: str):
    """(where, dataclass, its schema node) for `cls` and every section nested in it."""
    yield where, cls, schema
    for name, sub in section_types(cls).items():
        yield from _pairs(sub, schema["properties"][name], f"{where}.{name}" if where else name)


def mismatches(schema: dict) -> list[str]:
    problems = []
    for where, cls, node in _pairs(Sections, schema, ""):
        keys = set(node.get("properties", {}))
        names = {f.name for f in dataclasses.fields(cls)}
        problems += [f"{where or '<top>'}.{k}: in the schema, not in {cls.__name__}" for k in sorted(keys - names)
                     if where]  # the top level holds sections the trainers do not read (paths, data, ...)
        problems += [f"{where or '<top>'}.{k}: a field of {cls.__name__}, not in the schema"
                     for k in sorted(names - keys)]
    return problems


def test_every_section_dataclass_has_exactly_its_schema_keys():
    assert mismatches(load_schema()) == []


def test_a_key_removed_from_the_schema_is_caught():
    schema = load_schema()
    del schema["properties"]["rloo"]["properties"]["clip_eps"]
    del schema["properties"]["rloo"]["properties"]["alarms"]["properties"]["kl_rise"]
    assert mismatches(schema) == ["rloo.clip_eps: a field of RlooConfig, not in the schema",
                                  "rloo.alarms.kl_rise: a field of AlarmConfig, not in the schema"]


def test_a_key_added_to_the_schema_is_caught():
    schema = load_schema()
    schema["properties"]["evaluate"]["properties"]["llm_judge"]["properties"]["temperature"] = {"type": "number"}
    assert mismatches(schema) == ["evaluate.llm_judge.temperature: in the schema, not in LlmJudgeConfig"]


def test_sections_hold_the_validated_values():
    cfg = load_config(ROOT / "config" / "micro.yaml")
    s = Sections.from_config(cfg)
    assert s.rloo.k == cfg["rloo"]["k"] == 2 and s.model.tiny.hidden_size == 64
    assert s.rloo.stop_on == tuple(cfg["rloo"]["stop_on"]) and s.evaluate.llm_judge.serve is None
    assert dataclasses.asdict(s.rloo.ppo) == cfg["rloo"]["ppo"]
    assert dataclasses.asdict(s.rloo.alarms) == cfg["rloo"]["alarms"]
    cfg["rloo"]["alarms"]["window"] = 1  # a copy, not a view of the dict
    assert s.rloo.alarms.window == 50
    with pytest.raises(dataclasses.FrozenInstanceError):
        s.rloo.k = 3  # type: ignore[misc]


def test_a_served_judge_is_a_nested_section():
    cfg = validate({"evaluate": {"judge": "llm", "llm_judge": {"serve": {"model": "m", "args": ["--x"]}}}})
    serve = Sections.from_config(cfg).evaluate.llm_judge.serve
    assert serve.model == "m" and serve.args == ("--x",) and serve.gpus == 1 and serve.command is None


def test_a_key_without_a_field_is_refused_at_build_time():
    cfg = load_config(ROOT / "config" / "micro.yaml")
    cfg["rollout"]["speculative"] = True
    with pytest.raises(KeyError, match=r"RolloutConfig: no field for config key\(s\) speculative"):
        Sections.from_config(cfg)
