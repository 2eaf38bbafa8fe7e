"""README.md's "your model, your data, your reward" overlays are the files in config/examples/: each YAML
block of that section holds the values of the file linked before it, key for key (a block may leave keys
out, never change one), and the section runs each of the three files. The files validate in
tests/unit/test_config.py; the reward overlay runs at micro size in tests/e2e/test_reward_plugins.py."""

import re
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]
SECTION = "## Your model, your data, your reward"


def section() -> str:
    text = (ROOT / "README.md").read_text()
    assert SECTION in text, f"README.md has no section {SECTION!r}"
    return text.split(SECTION, 1)[1].split("\n## ", 1)[0]


def blocks_and_files(text: str) -> list[tuple[dict, str]]:
    """Each YAML block with the config/examples/ file most recently linked before it."""
    out, linked = [], None
    for m in re.finditer(r"\]\((config/examples/[\w.-]+\.yaml)\)|^```yaml\n(.*?)^```", text, re.M | re.S):
        if m.group(1):
            linked = m.group(1)
        else:
            assert linked, "a YAML block before any link to its config/examples/ file"
            out.append((yaml.safe_load(m.group(2)), linked))
    return out


def departures(shown: object, actual: object, where: str = "") -> list[str]:
    """Where the README's block `shown` differs from the file's `actual` (keys the block leaves out aside)."""
    if isinstance(shown, dict) and isinstance(actual, dict):
        return [d for k, v in shown.items()
                for d in (departures(v, actual[k], f"{where}.{k}") if k in actual else [f"{where}.{k}: not in the file"])]
    return [] if shown == actual else [f"{where}: README {shown!r}, file {actual!r}"]


def test_each_overlay_on_the_front_page_is_its_file():
    pairs = blocks_and_files(section())
    assert {f for _, f in pairs} == {f"config/examples/your-{x}.yaml" for x in ("model", "data", "reward")}, pairs
    for shown, path in pairs:
        actual = yaml.safe_load((ROOT / path).read_text())
        assert not departures(shown, actual), (path, departures(shown, actual))


def test_the_front_page_runs_each_overlay():
    text = section()
    for name in ("your-model", "your-data", "your-reward"):
        assert re.search(rf"snakemake --cores \w+ (--configfile [\w/.-]+ )*--configfile( \S+)* config/examples/{name}\.yaml",
                         text), name


def test_a_changed_value_is_a_departure():
    actual = {"reward": {"functions": [{"name": "format", "weight": 0.2}]}, "base": "../config.yaml"}
    assert departures({"reward": {"functions": [{"name": "format", "weight": 0.2}]}}, actual) == []
    assert departures({"reward": {"functions": [{"name": "format", "weight": 0.3}]}}, actual)
    assert departures({"reward": {"source": "function"}}, actual) == [".reward.source: not in the file"]
