"""Settings are read through the typed config (rloo.settings.Config, `Config.of` of the validated dict), never
by indexing the dict: a raw `cfg["rloo"]["k"]` escapes the settings' defaults, types and docs, and a renamed
key fails only where it runs. The config loaders alone index it (rloo_workflow/config/, which reads, merges
and validates the files, and rloo/settings/config.py, which converts them); the Snakemake rules read
`SETTINGS` (workflow/rules/common.smk)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
LOADERS = {ROOT / "rloo" / "settings" / "config.py", *(ROOT / "rloo_workflow" / "config").glob("*.py")}
NAME = re.compile(r"(\w*_)?cfg|config")  # cfg, job_cfg, jcfg, config: the names the dict goes by
RULE_LOOKUP = re.compile(r"(?<![\w.])(\w*cfg|config)\[")


def _raw_lookups(path: Path, root: Path) -> list[str]:
    """`file:line: the look-up` of each subscript of a config dict in a Python file."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if not isinstance(node, ast.Subscript):
            continue
        target = node.value
        name = target.id if isinstance(target, ast.Name) else target.attr if isinstance(target, ast.Attribute) else ""
        if NAME.fullmatch(name) or name.endswith("cfg"):
            out.append(f"{path.relative_to(root)}:{node.lineno}: {ast.unparse(node)}")
    return out


def raw_lookups(root: Path = ROOT) -> list[str]:
    found = []
    for package in ("rloo", "rloo_workflow"):
        for path in sorted((root / package).rglob("*.py")):
            if path not in LOADERS:
                found += _raw_lookups(path, root)
    for path in [root / "Snakefile", *sorted((root / "workflow").rglob("*.smk"))]:
        for lineno, line in enumerate(path.read_text().splitlines(), start=1):
            if RULE_LOOKUP.search(line.split("#", 1)[0]):
                found.append(f"{path.relative_to(root)}:{lineno}: {line.strip()}")
    return found


def test_no_raw_config_lookup_outside_the_loaders():
    assert raw_lookups() == []


def test_the_scan_names_a_look_up_in_code_and_in_a_rule(tmp_path):
    """The scan itself, on a copy of the tree with one raw look-up added in each kind of file."""
    for package in ("rloo", "rloo_workflow", "workflow"):
        (tmp_path / package).mkdir()
    (tmp_path / "Snakefile").write_text('configfile: "config/config.yaml"\n')
    (tmp_path / "rloo" / "stage.py").write_text('def run(cfg):\n    return cfg["rloo"]["k"], model.peft_config["x"]\n')
    (tmp_path / "rloo_workflow" / "tool.py").write_text('def f(self):\n    return self.config["seed"]\n')
    (tmp_path / "workflow" / "rule.smk").write_text('SEEDS = config["seeds"]["values"]  # a config["x"] comment\n')
    assert raw_lookups(tmp_path) == [
        "rloo/stage.py:2: cfg['rloo']",  # the dict's own look-up: the nested one indexes its result
        "rloo_workflow/tool.py:2: self.config['seed']",
        'workflow/rule.smk:1: SEEDS = config["seeds"]["values"]  # a config["x"] comment',
    ]
