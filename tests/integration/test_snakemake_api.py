"""Canary for the Snakemake internals behind `rloo why-rerun` and the stages `rloo dvc commit` leaves out
(rloo_workflow/dvc/dag.py; dvc.yaml itself is compiled from the project's declaration, rloo_workflow/dvc/jobs.py).

Snakemake has no public route to its reason for running a job, nor to the lock check it would make, so
rloo_workflow.dvc.dag reads them off Snakemake's objects: every such attribute is declared in `dag.INTERNALS` and read through `attr()`/`call()`, which raise
SnakemakeApiError naming the call and the installed Snakemake version. These tests run every one of
them on a small workflow (seconds, no pipeline), so a Snakemake upgrade that breaks one fails here
with that message; pyproject.toml allows the releases they pass with (scripts/test_oldest_snakemake.sh
runs them with the oldest, in CI).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tomllib
from importlib.metadata import version
from pathlib import Path

import pytest
import snakemake.api  # noqa: F401  (first: snakemake.workflow imports it back)
from packaging.specifiers import SpecifierSet
from packaging.version import Version
from snakemake.dag import DAG
from snakemake.workflow import Workflow

from rloo_workflow.dvc import dag as smk

ROOT = Path(__file__).resolve().parents[2]

SNAKEFILE = """\
import json
import os

from rloo_workflow.dvc.dag import force_rerun

configfile: "config.yaml"

def b_input(wildcards):
    if os.path.exists("stale"):  # as workflow/rules/common.smk's rerun_if_stale does
        force_rerun(workflow, [f"out/{wildcards.name}.txt"])
    return "a.txt"

wildcard_constraints:
    name="x|y",

rule all:
    default_target: True
    input: "out/x.txt"

rule a:
    output: "a.txt"
    params: cfg=lambda wildcards: json.dumps(config, sort_keys=True)
    shell: "echo {params.cfg:q} > {output}"

rule b:
    input: b_input
    output: "out/{name}.txt"
    benchmark: "bench/b_{name}.tsv"
    shell: "cp {input} {output} 2> logs/b_{wildcards.name}.log"
"""


@pytest.fixture
def workflow_dir(tmp_path) -> Path:
    (tmp_path / "Snakefile").write_text(SNAKEFILE)
    (tmp_path / "config.yaml").write_text("k: 1\n")
    return tmp_path


def _declared() -> set[tuple[str, str]]:
    return {(owner, name) for owner, names in smk.INTERNALS.items() for name in names}


def test_every_internal_works_with_the_installed_snakemake(workflow_dir):
    smk.USED.clear()
    cwd = os.getcwd()
    reasons = {r.job.stage: r for r in smk.plan(workflow_dir, []).reruns}  # nothing made yet: every job
    assert os.getcwd() == cwd
    assert list(reasons) == ["a", "b@x"] and all(r.missing for r in reasons.values())
    jobs = {stage: r.job for stage, r in reasons.items()}
    assert jobs["a"].cfg == '{"k": 1}' and jobs["a"].outputs == ["a.txt"] and jobs["a"].inputs == []
    assert jobs["a"].shellcmd == """echo '{"k": 1}' > a.txt"""
    assert jobs["b@x"].wildcards == {"name": "x"} and jobs["b@x"].inputs == ["a.txt"]
    assert jobs["b@x"].shellcmd == "cp a.txt out/x.txt 2> logs/b_x.log"
    assert jobs["b@x"].benchmark == "bench/b_x.tsv" and jobs["b@x"].cfg is None

    # why a job would run again (rloo why-rerun): the records of a real run, then a changed param
    (workflow_dir / "logs").mkdir()
    subprocess.run([str(Path(sys.executable).parent / "snakemake"), "--cores", "1", "--forceall"], cwd=workflow_dir,
                   check=True, capture_output=True)
    assert smk.plan(workflow_dir, []).reruns == []
    (workflow_dir / "config.yaml").write_text("k: 2\n")
    reasons = {r.job.stage: r for r in smk.plan(workflow_dir, []).reruns}
    assert list(reasons) == ["a", "b@x"]
    assert (reasons["a"].params_before, reasons["a"].params_now) == (['{"k": 1}'], ['{"k": 2}'])
    assert reasons["b@x"].rebuilt_inputs == ["a.txt"] and not reasons["b@x"].params_now
    (workflow_dir / "config.yaml").write_text("k: 1\n")
    assert smk.plan(workflow_dir, []).reruns == []
    (workflow_dir / "stale").touch()  # a job forced from its input function (force_rerun)
    assert [(r.job.stage, r.forced) for r in smk.plan(workflow_dir, []).reruns] == [("b@x", True)]
    (workflow_dir / "stale").unlink()
    (workflow_dir / "out/x.txt").unlink()
    assert [(r.job.stage, r.missing) for r in smk.plan(workflow_dir, []).reruns] == [("b@x", ["out/x.txt"])]

    unused = _declared() - smk.USED
    assert not unused, f"declared in rloo_workflow.dvc.dag.INTERNALS but not exercised here: {sorted(unused)}"


@pytest.mark.parametrize(("owner", "cls", "name"), [
    ("Workflow", Workflow, "_build_dag"),
    ("DAG", DAG, "needrun"),
])
def test_a_missing_internal_is_named_with_the_installed_version(workflow_dir, monkeypatch, owner, cls, name):
    monkeypatch.delattr(cls, name)
    with pytest.raises(smk.SnakemakeApiError) as e:
        smk.plan(workflow_dir, [])
    assert f"Snakemake {version('snakemake')}: {owner}.{name} is gone" in str(e.value)


def test_an_internal_with_other_arguments_is_named(workflow_dir, monkeypatch):
    monkeypatch.setattr(Workflow, "_prepare_dag", lambda self, forceall, nolock: None)
    with pytest.raises(smk.SnakemakeApiError, match=r"Workflow\._prepare_dag takes other arguments"):
        smk.plan(workflow_dir, [])


def test_pyproject_allows_a_range_of_snakemake_9_whose_oldest_the_snakefile_requires():
    """pyproject.toml allows `snakemake>=9.N,<10`: 9.N is the oldest release these tests pass with
    (scripts/test_oldest_snakemake.sh runs them with it in CI), and the Snakefile's min_version says the
    same; the installed Snakemake is one of the range, and dag.py's errors name it."""
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    (spec,) = [d for d in deps if re.match(r"snakemake\s*[<>=]", d)]
    m = re.fullmatch(r"snakemake>=(9\.\d+),<10", spec.replace(" ", ""))
    assert m, spec
    assert re.search(rf'^min_version\("{re.escape(m.group(1))}"\)', (ROOT / "Snakefile").read_text(), re.M), m.group(1)
    installed = Version(version("snakemake"))
    assert installed in SpecifierSet(spec.removeprefix("snakemake")), (installed, spec)
    assert SpecifierSet(smk.tested_range().removeprefix("snakemake")) == SpecifierSet(spec.removeprefix("snakemake"))


def test_another_runs_lock_on_a_file_of_the_dag_is_the_one_snakemake_refuses(workflow_dir):
    """rloo why-rerun's lock check (`plan().locked`) against real Snakemake: a lock on a file of this DAG
    makes it refuse the run (LockException), a lock on another file does not."""
    assert not smk.plan(workflow_dir, []).lock_held
    lock = workflow_dir / ".snakemake" / "locks" / "0.output.lock"
    for path, refused in (("a.txt", True), ("elsewhere.txt", False)):
        lock.parent.mkdir(parents=True, exist_ok=True)
        lock.write_text(f"{path}\n")
        planned = smk.plan(workflow_dir, [])
        assert (planned.locked, planned.lock_held) == (refused, True)
        res = subprocess.run([str(Path(sys.executable).parent / "snakemake"), "--cores", "1", "--forceall"],
                             cwd=workflow_dir, capture_output=True, text=True)
        assert (res.returncode != 0 and "LockException" in res.stdout + res.stderr) == refused, res.stderr
        lock.unlink(missing_ok=True)  # a run that ends removes the folder of locks, others' too
