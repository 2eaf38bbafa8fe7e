"""A stage's code fingerprint (rloo_workflow/code_fingerprint.py) changes with what the stage computes and with
nothing else: computed here on a copy of the package (`Codebase`), edited as a person would edit it.
What Snakemake and DVC then plan: tests/e2e/test_workflow.py and tests/e2e/test_dvc.py; that the walk
misses no function a stage calls: tests/integration/test_code_fingerprint_sound.py."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from code_edits import append_comment, edit_module_docstring, edit_setting_docs, semantic_edit

from rloo.code_fingerprint import PACKAGES, changes, parse_param, semantic_dump, semantic_tree
from rloo_workflow.code_fingerprint import Codebase, installed
from rloo_workflow.pipeline import STAGES

ROOT = Path(__file__).resolve().parents[2]
NAMES = list(STAGES)


@pytest.fixture
def package(tmp_path) -> Path:
    """A copy of the two packages (rloo/, rloo_workflow/) to edit."""
    for name in PACKAGES:
        shutil.copytree(ROOT / name, tmp_path / name, ignore=shutil.ignore_patterns("__pycache__"))
    return tmp_path


@pytest.fixture(scope="module")
def baseline() -> dict[str, str]:
    """Every stage's fingerprint of the package as it is (the copies start from it)."""
    return digests(ROOT)


def digests(root: Path) -> dict[str, str]:
    code = Codebase(root)
    return {name: code.fingerprint(name).digest for name in STAGES}


def changed(before: dict[str, str], root: Path) -> set[str]:
    after = digests(root)
    return {v for v in before if before[v] != after[v]}


def test_a_copy_has_the_same_fingerprints(package, baseline):
    assert digests(package) == baseline


def test_comments_docstrings_and_descriptions_change_no_stage(package, baseline):
    # the three edits: a comment in a module no stage of the default chain runs, a word in a
    # schema description, a module docstring of the maths
    append_comment(package / "rloo_workflow/judge_server.py")
    edit_setting_docs(package / "rloo/settings/training.py")
    edit_module_docstring(package / "rloo/algo/estimators.py")
    # and in every stage's own module: a comment, a function's docstring, a line wrapped differently
    for name in NAMES:
        stage = package / f"rloo_workflow/stages/{name}.py"
        text = stage.read_text().replace("\ndef run(", "\n# a note on run\ndef run(", 1)
        stage.write_text(re.sub(r'(\ndef run\([^)]*\)[^:]*:\n    """)', r"\1Edited. ", text, count=1))
    assert changed(baseline, package) == set()


@pytest.mark.parametrize(("path", "function", "expected"), [
    ("rloo_workflow/stages/reward.py", "run", {"reward"}),
    ("rloo/algo/estimators.py", "rloo_advantages", {"rloo", "toy"}),
    ("rloo_workflow/stages/sft.py", "run", {"sft"}),
    ("rloo/train/sft.py", "step_loss", {"sft"}),  # the SFT loop, outside the stage's module
    # shared: every training stage's loop
    ("rloo/train/loop.py", "TrainingLoop.resume", {"sft", "reward", "rloo"}),
    # the CLI: what every stage runs, and what only `rloo summary` runs
    ("rloo_workflow/cli.py", "main", set(NAMES)),
    ("rloo_workflow/cli.py", "_summary", set()),
])
def test_a_change_of_what_runs_changes_exactly_the_stages_that_run_it(package, baseline, path, function, expected):
    semantic_edit(package / path, function)
    assert changed(baseline, package) == expected


def test_a_new_estimator_is_one_entry_of_the_table_which_the_walk_sees(package, baseline):
    estimators = package / "rloo/algo/estimators.py"
    line = '    "reinforce": lambda rewards, **_: (reinforce_advantages(rewards), None),\n'
    assert estimators.read_text().count(line) == 1
    estimators.write_text(estimators.read_text().replace(line, line + line.replace('"reinforce"', '"plain"')))
    assert changed(baseline, package) == {"rloo", "toy"}  # the stages that can pick it
    code = "import sys; sys.path.insert(0, sys.argv[1]); from rloo.algo import names; print(names.ESTIMATORS)"
    res = subprocess.run([sys.executable, "-c", code, str(package)], capture_output=True, text=True, check=True)
    assert "'plain'" in res.stdout  # and the names the settings offer follow it


def test_a_schema_constraint_changes_every_stage_a_description_none(package, baseline):
    """The schema is the typed settings (rloo/settings/): every stage's validation runs it, so a constraint
    or a default counts for each; a field's doc is a string under it, no code."""
    training = package / "rloo/settings/training.py"
    line = "    k: int = setting(4, minimum=1)\n"
    assert training.read_text().count(line) == 1
    edit_setting_docs(training)
    assert changed(baseline, package) == set()
    training.write_text(training.read_text().replace(line, line.replace("minimum=1)", "minimum=1, maximum=1024)")))
    assert changed(baseline, package) == set(NAMES)


def test_changes_name_the_file_and_the_definition(package):
    code = Codebase(package)
    old = code.fingerprint("rloo").manifest
    semantic_edit(package / "rloo/train/rloo_trainer.py", "RlooTrainer.update")
    new = Codebase(package).fingerprint("rloo").manifest
    assert changes(old, new) == ["rloo/train/rloo_trainer.py: changed RlooTrainer.update"]


def test_a_docstring_or_comment_is_not_in_the_tree():
    a = semantic_tree('"""Doc."""\nx = 1  # why\ndef f():\n    """Doc."""\n    return x\n')
    b = semantic_tree("x = 1\ndef f():\n    return x\n")
    assert semantic_dump(a) == semantic_dump(b)
    assert semantic_dump(b) != semantic_dump(semantic_tree("x = 1\ndef f():\n    return x + 0\n"))


def test_the_code_param_names_its_stage_and_digest():
    fp = installed().fingerprint("sft")
    assert parse_param(fp.param) == ("sft", fp.digest)
    assert parse_param('{"sft": 1}') is None and parse_param(None) is None


def test_a_command_the_cli_does_not_have_is_an_error_not_an_empty_fingerprint():
    with pytest.raises(ValueError, match=r"rloo nosuch: no such command"):
        installed().stage_keys("nosuch")


def test_a_stage_is_fingerprinted_by_its_name_through_its_verb():
    """The rloo stage runs `rloo train` (its verb differs: `rloo rloo` reads badly): its code key is `rloo`,
    its module rloo_workflow/stages/rloo.py and its CLI handler the `train` command's."""
    fp = installed().fingerprint("rloo")
    assert parse_param(fp.param) == ("rloo", fp.digest)
    assert "rloo_workflow/stages/rloo.py" in fp.files and "rloo/train/rloo.py" in fp.files
    keys = installed().stage_keys("rloo")
    assert ("rloo_workflow.cli", "_rloo") in keys and ("rloo_workflow.cli", "_sft") not in keys
    with pytest.raises(ValueError, match=r"train: a command, not a stage: `rloo train` runs the stage rloo"):
        installed().stage_keys("train")


def test_a_function_of_the_package_that_the_config_names_counts_for_rloo_and_evaluate(package):
    """`reward.functions` names code by a string (`rloo.reward.verifier:reward`), which no import reaches:
    the fingerprints of the stages that run it count it as a root of their walk."""
    from rloo.reward.functions import package_functions
    from rloo.settings import Config

    cfg = {"reward": {"source": "function", "functions": [
        {"name": "correct", "fn": "rloo.reward.verifier:reward", "weight": 1.0},
        {"name": "mine", "fn": "rewards/mine.py:bonus", "weight": 0.2}]}}
    roots = package_functions(Config.of(cfg))
    assert roots == [("rloo.reward.verifier", "reward")]
    code = Codebase(package)
    named, plain = code.fingerprint("rloo", extra_roots=roots).digest, code.fingerprint("rloo").digest
    semantic_edit(package / "rloo/reward/verifier.py", "reward")
    edited = Codebase(package)
    assert edited.fingerprint("rloo", extra_roots=roots).digest != named
    assert edited.fingerprint("rloo").digest == plain  # no import reaches it: only the config's name does


def test_a_fingerprint_is_kept_on_disk_by_the_sources_it_read(package, tmp_path_factory, monkeypatch):
    """A process reads back the fingerprint an earlier one computed from the same sources (Codebase.kept);
    one changed byte of a source, or a damaged file, computes it afresh."""
    from rloo.code_fingerprint import CACHE_DIR_ENV

    folder = tmp_path_factory.mktemp("kept")
    monkeypatch.setenv(CACHE_DIR_ENV, str(folder))
    first = Codebase(package).fingerprint("sft")
    (kept,) = folder.glob("*.json")
    # read back, not recomputed: a record altered on disk is what the next process gets
    record = {"stage": "sft", "digest": "kept-on-disk", "manifest": first.manifest}
    kept.write_text(json.dumps(record))
    assert Codebase(package).fingerprint("sft").digest == "kept-on-disk"
    kept.write_text("{not json")
    assert Codebase(package).fingerprint("sft") == first
    # a change of code no run of sft reaches computes afresh, to the same digest
    append_comment(package / "rloo_workflow/judge_server.py")
    assert Codebase(package).fingerprint("sft") == first
    assert len(list(folder.glob("*.json"))) == 2
