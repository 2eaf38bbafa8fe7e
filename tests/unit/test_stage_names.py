"""docs/design.md's table of stage names is the code's: each row's rule and log from the Snakemake files,
its verb from the CLI's parser, its modules from the tree, its output and MLflow run from the pipeline's
stage table; and the names that should be one are one (issue 64: one name per stage)."""

from __future__ import annotations

import argparse
import ast
import re
from pathlib import Path

import pytest

from rloo.settings import Config
from rloo_workflow import cli
from rloo_workflow.commands import job_logs
from rloo_workflow.pipeline import STAGES, run_name

ROOT = Path(__file__).resolve().parents[2]
COLUMNS = ["stage", "rule", "CLI verb", "stage module", "library module", "first output", "MLflow run", "log"]


def table(text: str) -> dict[str, dict[str, str]]:
    """The rows of the stage-names table between its markers, by stage, each cell without backquotes."""
    body = re.search(r"<!-- stage-names -->\n(.*?)<!-- /stage-names -->", text, re.S)
    assert body, "docs/design.md: no <!-- stage-names --> table"
    lines = [line for line in body.group(1).strip().splitlines() if line.startswith("|")]
    header = [c.strip() for c in lines[0].strip("|").split("|")]
    assert header == COLUMNS
    rows = [dict(zip(header, (c.strip().strip("`") for c in line.strip("|").split("|")), strict=True))
            for line in lines[2:]]
    return {r["stage"]: r for r in rows}


def rules() -> dict[str, str]:
    """{rule name: its block's text} of every rule in workflow/rules/*.smk."""
    out = {}
    for f in sorted((ROOT / "workflow" / "rules").glob("*.smk")):
        for m in re.finditer(r"(?ms)^rule (\w+):\n(.*?)(?=^\S|\Z)", f.read_text()):
            out[m.group(1)] = m.group(2)
    return out


def rule_log(name: str, block: str) -> str:
    """The rule's (first) log file as the table writes it ({logs}/..., its wildcards as {wildcard}): the one
    the declaration gives (rloo_workflow.commands.job_logs), which the rule reads (`LOG[stage]["log"]`)."""
    logs = re.search(r"(?ms)^    log:\n(.*?)(?=^    \S)", block)
    assert logs and f'LOG["{name}"]["log"]' in logs.group(1), block
    cfg = Config()  # the default paths: `logs` is the table's {logs}
    declared = job_logs(name, cfg, "{estimator}", "{policy}", sweep="{sweep}")["log"]
    return "{logs}/" + declared.removeprefix(f"{cfg.paths.logs}/")


def verbs() -> dict[str, str]:
    """{verb or alias: the command it runs} of the CLI's parser (`rloo <verb>`)."""
    sub = next(a for a in cli.build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return {name: cli.ALIASES.get(name, name) for name in sub.choices}


def imported_modules(path: Path) -> set[str]:
    """The modules a file imports, and for `from a import b` both a and a.b (b may be a module)."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            out |= {node.module, *(f"{node.module}.{a.name}" for a in node.names)}
    return out


def check(text: str) -> None:
    rows, blocks, cli_verbs = table(text), rules(), verbs()
    assert set(rows) == set(STAGES), f"the table's stages {sorted(rows)} are not the pipeline's {sorted(STAGES)}"
    for name, row in rows.items():
        stage = STAGES[name]
        # one name: the rule, the stage module and the run are the stage's
        assert row["rule"] == name and row["stage module"] == f"stages/{name}.py", row
        assert row["rule"] in blocks, f"{name}: no rule {row['rule']} in workflow/rules/"
        # its code fingerprint is its stage's: its `code` param, or a part of a chain rule's `identity`
        assert any(f'{param}("{name}")' in blocks[row["rule"]] for param in ("code", "chain_identity")), \
            f"rule {name}: its code param is not code(\"{name}\") nor its identity chain_identity(\"{name}\")"
        assert row["log"] == rule_log(name, blocks[row["rule"]]), row
        assert Path(row["log"]).name.startswith(name), row
        verb = row["CLI verb"].removeprefix("rloo ")
        assert cli_verbs.get(verb) == verb == stage.verb, f"{name}: `rloo {verb}` is not its command"
        module = ROOT / "rloo_workflow" / row["stage module"]
        assert module.is_file(), module
        library = ROOT / row["library module"]
        assert library.is_file() and row["library module"].startswith("rloo/"), library
        dotted = row["library module"].removesuffix(".py").replace("/", ".")
        assert dotted in imported_modules(module), f"{name}: {row['stage module']} does not import {dotted}"
        assert row["first output"] == next(iter(stage.outputs.values())), row
        assert row["MLflow run"] == run_name(name, estimator="{estimator}", policy="{policy}"), row


def test_the_design_docs_stage_names_are_the_codes():
    check((ROOT / "docs" / "design.md").read_text())


def test_the_verbs_differ_from_the_stage_names_only_where_documented():
    """`rloo train` runs the rloo stage; `rloo compare` is the old spelling of `rloo comparison`."""
    assert {s.name: s.verb for s in STAGES.values() if s.verb != s.name} == {"rloo": "train"}
    assert {a: c for a, c in verbs().items() if a != c} == {"compare": "comparison"}


@pytest.mark.parametrize(("old", "new", "message"), [
    ("| rloo | rloo | `rloo train` | stages/rloo.py | rloo/train/rloo.py |",
     "| rloo | rloo | `rloo train` | stages/rloo.py | rloo/train/train_rloo.py |", "train_rloo.py"),
    ("| `{logs}/rloo_{estimator}.log` |", "| `{logs}/train_{estimator}.log` |", "train_"),
    ("| `rloo comparison` |", "| `rloo compare` |", "rloo compare"),
    ("| comparison | comparison | `rloo", "| compare | comparison | `rloo", "compare"),
])
def test_a_row_that_is_not_the_code_fails(old, new, message):
    text = (ROOT / "docs" / "design.md").read_text()
    assert text.count(old) == 1, old
    with pytest.raises(AssertionError, match=re.escape(message)):
        check(text.replace(old, new))
