"""The Snakemake workflow, run for real on the micro config in an isolated working copy.

One full run (the session's `micro_workflow`, tests/conftest.py: the default target, i.e.
results/gsm8k_rloo.json and the toy experiment, plus results/gsm8k_grpo.json, a second estimator
sharing prepare/sft/reward; this file works on its own copy) is reused by every check: nothing left to do afterwards; which jobs a changed parameter or an edited source file
plans (dry runs); lint; the HTML report; and, last, SIGTERM -> retry -> resume of a longer rloo
job. See tests/helpers/workflow_helpers.py for how outputs are isolated.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import yaml
from code_edits import append_comment, edit_module_docstring, edit_setting_docs, semantic_edit
from conftest import copy_tree
from stage_server import ENV_VAR as STAGE_SERVER_ENV
from workflow_helpers import (
    CONFIGFILES,
    CPU_RULES,
    JOBS,
    PIPELINE,
    ROOT,
    env_for,
    job_counts,
    make_copy,
    planned,
    snakemake,
    snakemake_bin,
)

from rloo.settings.evaluation import tensor_parallel
from rloo_workflow.config import load_config
from rloo_workflow.stages import comparison

pytestmark = pytest.mark.slow

RLOO = "results/gsm8k_rloo.json"
GRPO = "results/gsm8k_grpo.json"


@pytest.fixture(scope="module")
def run(micro_workflow, tmp_path_factory) -> dict:
    """This file's own copy of the session's full micro run (tests/conftest.py `micro_workflow`)."""
    copy = copy_tree(micro_workflow["copy"], tmp_path_factory.mktemp("workflow") / "wf")
    print(f"full micro pipeline (default target + {GRPO}): {micro_workflow['seconds']:.1f} s")
    return {"copy": copy, "output": micro_workflow["output"], "seconds": micro_workflow["seconds"]}


def test_full_run_shares_prepare_sft_reward(run):
    # one prepare/sft/reward feeding two estimators, and the toy experiment
    # and each policy evaluated once: the base model and SFT for both results
    assert job_counts(run["output"]) == {"prepare": 1, "base": 1, "sft": 1, "reward": 1, "rloo": 2, "evaluate": 4,
                                         "report": 2, "toy": 1}


def test_full_run_outputs(run):
    c = run["copy"]
    for f in ("data/gsm8k/train.jsonl", "data/gsm8k/test.jsonl", "data/gsm8k/manifest.json",
              "results/toy_variance.json", "results/toy_variance.png"):
        assert (c / f).is_file(), f
    for d in ("sft", "reward", "rloo_rloo", "rloo_grpo"):
        assert (c / "results/models" / d / "config.json").is_file(), d
    for estimator in ("rloo", "grpo"):
        result = json.loads((c / f"results/gsm8k_{estimator}.json").read_text())
        assert set(result["policies"]) == {"sft", estimator}
        assert result["examples"] == 16  # evaluate.examples of config/micro.yaml
        assert result["training"][estimator]["estimator"] == estimator
        # the gain over SFT with its uncertainty, and the win rate's interval (rloo.eval.gains)
        gains = result["gains"][estimator]
        for mode in ("sampled", "greedy"):
            assert len(gains[mode]["ci95"]) == 2 and 0 < gains[mode]["p_value"] <= 1
        assert len(result["win_rates"][estimator]["ci95"]) == 2
        for png in ("policies.png", "proxy_vs_judge.png"):
            assert (c / f"results/gsm8k_{estimator}" / png).stat().st_size > 1000
        assert (c / f"logs/rloo_{estimator}.log").is_file()
        assert (c / f"logs/benchmarks/rloo_{estimator}.tsv").is_file()
        assert (c / f"logs/report_{estimator}.log").is_file()
    # each policy's evaluation: a line per problem (every completion, graded) and its figures
    for policy in ("base", "sft", "rloo", "grpo"):
        lines = (c / f"results/eval/{policy}.jsonl").read_text().splitlines()
        assert len(lines) == 16 and {"question", "answer", "greedy", "draws"} <= set(json.loads(lines[0]))
        assert json.loads((c / f"results/eval/{policy}.json").read_text())["policy"] == policy
        assert (c / f"logs/evaluate_{policy}.log").is_file()
    # checkpoints live outside the outputs, with the identity of the job they belong to, the one its output
    # records and its rule's `identity` param holds (rloo.identity)
    assert list((c / "results/work/rloo_rloo/checkpoints").iterdir())
    work = json.loads((c / "results/work/rloo_rloo/identity.json").read_text())
    made = json.loads((c / "results/models/rloo_rloo/identity.json").read_text())
    assert work == made and (c / ".rloo/identity" / f"{made['rerun']}.json").is_file()


def test_nothing_to_do_after_full_run(run):
    assert planned(run["copy"]) == {}
    assert planned(run["copy"], RLOO, GRPO) == {}


@pytest.mark.parametrize(
    ("change", "expected"),
    [
        # RLOO parameters: exactly rloo, its policy's evaluation and the report; never the base model's or SFT's
        ("rloo: {lr: 1.0e-4}", {"rloo": 1, "evaluate": 1, "report": 1}),
        ("rollout: {gpu_memory_utilization: 0.5}", {"rloo": 1, "evaluate": 1, "report": 1}),
        ("reward: {source: model}", {"rloo": 1, "evaluate": 1, "report": 1}),
        # a prepare parameter: everything downstream of prepare
        ("data: {synthetic: {n_train: 200}}", {"prepare": 1, "base": 1, "sft": 1, "reward": 1, "rloo": 1,
                                               "evaluate": 3, "report": 1}),
        # SFT is every evaluation's KL reference and tokenizer: the base model's evaluation too
        ("sft: {lr: 1.0e-3}", {"sft": 1, "reward": 1, "rloo": 1, "evaluate": 3, "report": 1}),
        # the reward model: every evaluation's proxy (RLOO trains on the verifier by default)
        ("reward: {lr: 1.0e-2}", {"reward": 1, "evaluate": 3, "report": 1}),
        ("evaluate: {examples: 8}", {"evaluate": 3, "report": 1}),
        # the estimator comes from the target, not from the config
        ("rloo: {estimator: grpo}", {}),
        # how a run is observed or scheduled, and where logs go: no rerun
        ("tracking: {enabled: true}", {}),
        ("name: renamed", {}),
        ("threads: 2", {}),
        ("paths: {logs: other_logs}", {}),
        # the seeds and sweeps targets' own keys: no stage of the main chain reads them
        ("seeds: {values: [5, 6], scope: all}", {}),
        ("sweeps: {beta: {rloo.beta: [0.0, 0.1]}}", {}),
    ],
)
def test_changed_parameter_plans_exactly_the_affected_stages(run, change, expected):
    assert planned(run["copy"], RLOO, extra_config=change) == expected


def test_changed_parameter_with_two_estimators_and_toy(run):
    # default target (+ grpo): a prepare parameter does not touch the toy experiment ...
    assert planned(run["copy"], "all", GRPO, extra_config="data: {synthetic: {n_train: 200}}") == {
        "prepare": 1, "base": 1, "sft": 1, "reward": 1, "rloo": 2, "evaluate": 4, "report": 2}
    # ... the seed reaches everything, the toy experiment included
    assert planned(run["copy"], "all", GRPO, extra_config="seed: 1") == {
        "prepare": 1, "base": 1, "sft": 1, "reward": 1, "rloo": 2, "evaluate": 4, "report": 2, "toy": 1}
    assert planned(run["copy"], "all", GRPO, extra_config="rloo: {beta: 0.1}") == {"rloo": 2, "evaluate": 2, "report": 2}


def test_comments_docstrings_and_descriptions_rerun_nothing(run):
    """The edits of issue 54, each of which used to rerun stages: a comment in a module no stage of the
    default chain runs, a word in the schema's descriptions, the maths' module docstring; and a comment in
    every stage's own module. Snakemake compares each stage's code fingerprint (rloo_workflow/code_fingerprint.py)."""
    c = run["copy"]
    saved = {p: p.read_text() for p in [c / "rloo_workflow/judge_server.py", c / "rloo/settings/training.py",
                                         c / "rloo/algo/estimators.py", *sorted((c / "rloo_workflow/stages").glob("*.py"))]}
    try:
        append_comment(c / "rloo_workflow/judge_server.py")
        edit_setting_docs(c / "rloo/settings/training.py")
        edit_module_docstring(c / "rloo/algo/estimators.py")
        for stage in sorted((c / "rloo_workflow/stages").glob("*.py")):
            append_comment(stage)
        assert planned(c, "all", GRPO) == {}
    finally:
        for path, text in saved.items():
            path.write_text(text)


@pytest.mark.parametrize(
    ("source", "function", "expected"),
    [
        ("rloo_workflow/stages/reward.py", "run", {"reward": 1, "evaluate": 4, "report": 2}),
        ("rloo_workflow/stages/rloo.py", "run", {"rloo": 2, "evaluate": 2, "report": 2}),
        ("rloo_workflow/stages/evaluate.py", "run", {"evaluate": 4, "report": 2}),
        ("rloo_workflow/stages/report.py", "run", {"report": 2}),
        ("rloo/algo/bandit.py", "run_toy", {"toy": 1}),
        # the estimator: RLOO's stage (of both estimators: one fingerprint per stage) and the toy experiment
        ("rloo/algo/estimators.py", "rloo_advantages", {"rloo": 2, "evaluate": 2, "report": 2, "toy": 1}),
        # the SFT loop, and the loop the three training stages share: sft and every stage below it
        ("rloo_workflow/stages/sft.py", "run", {"sft": 1, "reward": 1, "rloo": 2, "evaluate": 4, "report": 2}),
        ("rloo/train/loop.py", "TrainingLoop.resume", {"sft": 1, "reward": 1, "rloo": 2, "evaluate": 4, "report": 2}),
        ("rloo/data/synthetic.py", "generate", {"prepare": 1, "base": 1, "sft": 1, "reward": 1, "rloo": 2,
                                                "evaluate": 4, "report": 2}),
        ("rloo/model/base.py", "source", {"base": 1, "sft": 1, "reward": 1, "rloo": 2, "evaluate": 4, "report": 2}),
    ],
)
def test_a_change_of_what_a_stage_computes_reruns_it_and_its_descendants(run, source, function, expected):
    path = run["copy"] / source
    original = path.read_text()
    try:
        semantic_edit(path, function)
        assert planned(run["copy"], "all", GRPO) == expected
        if source == "rloo_workflow/stages/reward.py":
            # `rloo why-rerun` names the file and the function, and the stage below it
            res = subprocess.run(["rloo", "why-rerun", *CONFIGFILES], cwd=run["copy"], env=env_for(run["copy"]),
                                 capture_output=True, text=True, timeout=300)
            assert res.returncode == 0, res.stderr
            assert "reward: its code changed:\n    rloo_workflow/stages/reward.py: changed run\n" in res.stdout, res.stdout
            assert "evaluate-sft: its inputs are made again: results/models/reward" in res.stdout, res.stdout
            stages = {line.split(":")[0] for line in res.stdout.splitlines() if not line.startswith(" ")}
            assert "sft" not in stages and "prepare" not in stages, stages
    finally:
        path.write_text(original)
    assert planned(run["copy"], "all", GRPO) == {}  # the same code again: nothing


def test_why_rerun_without_configfile_reads_what_the_last_run_was_given(run):
    """Issue 62: `rloo why-rerun` run bare compares with the configuration the last `snakemake` run was
    given (.rloo/last-run.json: its --configfile files, --config values and targets), and says so; a bare
    `snakemake -n` reads config/config.yaml alone and plans every stage. --configfile still chooses."""
    c = run["copy"]
    last = json.loads((c / ".rloo/last-run.json").read_text())
    assert last["configfiles"] == ["config/micro.yaml", "config/test.yaml"], last
    assert last["targets"] == ["all", GRPO], last

    def why(*args: str) -> subprocess.CompletedProcess:
        res = subprocess.run(["rloo", "why-rerun", *args], cwd=c, env=env_for(c), capture_output=True, text=True,
                             timeout=300)
        assert res.returncode == 0, res.stderr
        return res

    bare = why()
    assert bare.stdout == "nothing to rerun: its outputs are up to date\n", bare.stdout
    assert ("rloo why-rerun: the last run's configuration (" in bare.stderr
            and f": all {GRPO} --configfile config/micro.yaml config/test.yaml; --configfile to give another)"
            in bare.stderr), bare.stderr
    assert job_counts(snakemake(c, "-n", "--quiet", "rules").stdout)  # Snakemake's own bare dry run: config.yaml
    given = why("--configfile", "config/config.yaml")
    assert "prepare: its identity changed: keys data." in given.stdout and "last run" not in given.stderr, given.stdout


def test_a_changed_key_clears_the_work_folder_under_snakemake_and_why_rerun_names_the_identity_part(
        micro_workflow, tmp_path):
    """Issue 70: a key SFT reads changes after a finished run. `rloo why-rerun` names it as the part of the
    job's identity that changed (the stored parts against the current ones); Snakemake reruns SFT, whose
    work folder holds the old job's checkpoints: cleared, with one line in the job's log naming the change
    (--work-guard; `rloo sft` by hand refuses them: tests/unit/test_identity.py). Then the jobs below SFT
    rerun because the identity of their input changed, which why-rerun names too."""
    c = copy_tree(micro_workflow["copy"], tmp_path / "wf")
    (c / "config" / "lr.yaml").write_text("sft: {lr: 0.002}\n")
    configs = [*CONFIGFILES, "config/lr.yaml"]

    def why(*stages: str) -> str:
        res = subprocess.run(["rloo", "why-rerun", *stages, *configs], cwd=c, env=env_for(c), capture_output=True,
                             text=True, timeout=300)
        assert res.returncode == 0, res.stderr
        return res.stdout

    assert why("sft") == "sft: its identity changed: keys sft.lr\n"
    assert list((c / "results/work/sft/checkpoints").iterdir())  # the finished job's
    res = snakemake(c, "results/models/sft", "--cores", "1", *configs)
    assert job_counts(res.stdout + res.stderr) == {"sft": 1}
    log = (c / "logs/sft.log").read_text()
    assert "workdir results/work/sft: cleared: its checkpoints are another job's (changed: keys sft.lr)" in log, log[-3000:]
    said = why("reward")
    assert said.startswith("reward: its identity changed: upstream policy\n"), said
    assert "its inputs changed: results/models/sft" in said, said


def test_gpu_config_plans_the_whole_pipeline_with_cluster_resources(tmp_path):
    """The README's cluster command: each rule's GPUs, threads, memory and time for config/gpu.yaml."""
    # A dry run caps threads at --cores (1 unless given); a Slurm run has no such cap.
    res = snakemake(make_copy(tmp_path / "workflow"), RLOO, "-n", "--cores", "64", "--profile", "slurm", "--workflow-profile", "profiles/gpu",
                    "--configfile", "config/gpu.yaml")
    out = res.stdout + res.stderr
    assert job_counts(out) == {**JOBS, "judge": 1}  # an LLM judges: its job serves it
    blocks = {m.group(1): m.group(2) for m in re.finditer(r"^rule (\w+):\n(.*?)(?=^\S|\Z)", out, re.M | re.S)}
    resources = {rule: dict(kv.split("=", 1) for kv in re.search(r"resources: (.*)", blocks[rule]).group(1).split(", "))
                 for rule in {*PIPELINE, "judge"}}
    profile = yaml.safe_load((ROOT / "profiles" / "gpu" / "config.yaml").read_text())["set-resources"]
    gpu_cfg = load_config(ROOT / "config" / "gpu.yaml")
    judge_gpus = gpu_cfg["evaluate"]["llm_judge"]["serve"]["gpus"]
    for rule in PIPELINE - CPU_RULES:
        r = resources[rule]
        assert r["gpu"] == "1", (rule, r)  # each evaluation its policy's
        assert r["cpus_per_task"] == "8"  # threads: null in the config -> 8 threads for the torch stages
        assert (r["mem_mb"], r["runtime"]) == (str(profile[rule]["mem_mb"]), str(profile[rule]["runtime"])), (rule, r)
        assert r["slurm_extra"] == "--signal=TERM@300"  # the cluster profile's keys are kept
    assert "gpu" not in resources["prepare"] and "gpu" not in resources["base"]  # a download and a copy: CPU jobs
    assert "gpu" not in resources["report"]  # it loads no model
    # the judge job serves the judge on GPUs of its own, and holds no policy
    assert resources["judge"]["gpu"] == str(judge_gpus), resources["judge"]
    assert (resources["judge"]["mem_mb"], resources["judge"]["runtime"]) == (
        str(profile["judge"]["mem_mb"]), str(profile["judge"]["runtime"]))
    # the judge's tensor-parallel size, when its flags give one, is the GPU count the job asks for
    assert tensor_parallel(gpu_cfg["evaluate"]["llm_judge"]["serve"]["args"]) in (None, judge_gpus)
    assert gpu_cfg["evaluate"]["judge"] == "llm" and gpu_cfg["rollout"]["backend"] == "vllm"
    assert gpu_cfg["prompt"]["chat_template"] is True and gpu_cfg["prompt"]["system"]
    assert gpu_cfg["sft"]["max_dropped_share"] == 0  # an over-long example is an error, never dropped


@pytest.mark.parametrize("overlay, nodes", [("fsdp-1x8.yaml", 1), ("fsdp-2x8.yaml", 2)])
def test_scale_out_overlays_plan_one_task_per_gpu(tmp_path, overlay, nodes):
    """docs/scaling.md's commands ("In one screen"): sft, reward and rloo ask Slurm for `nodes` nodes of 8 GPUs and 8
    tasks each, started by the srun line in `mpi`; an evaluation keeps its policy's GPU, the judge job the judge's."""
    res = snakemake(make_copy(tmp_path / "workflow"), RLOO, "-n", "--cores", "64", "--profile", "slurm",
                    "--workflow-profile", "profiles/gpu", "--configfile", "config/gpu.yaml", f"config/{overlay}",
                    "--set-resources", "sft:mem_mb=256000", "reward:mem_mb=256000", "rloo:mem_mb=256000")
    out = res.stdout + res.stderr
    assert job_counts(out) == {**JOBS, "judge": 1}, out[-3000:]
    resources = dict(re.findall(r"^rule (\w+):\n(?:    .*\n)*?    resources: (.*)$", out, re.M))
    srun = (f"mpi=srun --nodes={nodes} --ntasks={8 * nodes} --ntasks-per-node=8 --cpus-per-task=8 "
            "--kill-on-bad-exit=1")
    for rule in ("sft", "reward", "rloo"):
        for part in (f"nodes={nodes}", "gres=gpu:8", "tasks_per_node=8", "mem_mb=256000", srun):
            assert part in resources[rule], (rule, part, resources[rule])
    assert "gpu=1" in resources["evaluate"] and "mpi=" not in resources["evaluate"], resources["evaluate"]
    assert "gpu=1" in resources["judge"] and "mpi=" not in resources["judge"], resources["judge"]
    cfg = load_config(ROOT / "config" / overlay)  # the files it extends: gpu.yaml, config.yaml
    assert cfg["model"]["name_or_path"] == load_config(ROOT / "config" / "gpu.yaml")["model"]["name_or_path"]
    world = 8 * nodes
    for key in ("sft.batch_size", "reward.batch_size", "rloo.prompts_per_step"):  # each process gets a share
        section, name = key.split(".")
        assert cfg[section][name] >= world, key


def test_gpu_check_script_parses():
    """scripts/gpu_check.sh runs only where a GPU is lent: here it is checked as bash (its verdicts'
    logic: tests/integration/test_gpu_check.py)."""
    res = subprocess.run(["bash", "-n", str(ROOT / "scripts" / "gpu_check.sh")], capture_output=True, text=True)
    assert res.returncode == 0, res.stderr


def test_comparison_target_reuses_shared_stages(run):
    # 7 estimators (PPO among them): the 5 not run yet get rloo, the evaluation of their policy and a report;
    # prepare/sft/reward, and the evaluations of the base model and of SFT, are shared
    assert planned(run["copy"], "results/comparison.json") == {"rloo": 5, "evaluate": 5, "report": 5, "comparison": 1}


def test_compare_stage_on_real_results(run, tmp_path):
    c = run["copy"]
    table = comparison.run({e: c / f"results/gsm8k_{e}.json" for e in ("rloo", "grpo")},
                        tmp_path / "comparison.json", tmp_path / "comparison.png")
    assert set(table["estimators"]) == {"rloo", "grpo"}
    assert table["checks"] == dict.fromkeys(("same_data", "same_examples", "same_sft_accuracy", "same_steps",
                                             "same_samples_per_step"), True)
    for e in ("rloo", "grpo"):  # each estimator's paired comparison with SFT, from its evaluation
        gains = json.loads((c / f"results/gsm8k_{e}.json").read_text())["gains"][e]
        assert table["estimators"][e]["gain_vs_sft"] == gains and "ci95" in gains["sampled"]
    assert (tmp_path / "comparison.png").stat().st_size > 1000
    accuracy = {e: json.loads((c / f"results/gsm8k_{e}.json").read_text())["policies"][e]["accuracy"]
                for e in ("rloo", "grpo")}
    written = json.loads((tmp_path / "comparison.json").read_text())
    if accuracy["rloo"] == accuracy["grpo"]:  # a tie names both and picks neither
        assert written["best_by_accuracy"] is None and written["tie_by_accuracy"] == ["rloo", "grpo"]
    else:
        assert written["best_by_accuracy"] == max(accuracy, key=accuracy.get) and written["tie_by_accuracy"] is None
    # `rloo summary` reads every kind of file the run wrote, the comparison's too, exit status 0
    files = [tmp_path / "comparison.json", c / RLOO, c / GRPO, *sorted((c / "results/eval").glob("*.json")),
             c / "results/models/rloo_rloo/metrics.json", c / "data/gsm8k/manifest.json"]
    said = {}
    for f in files:
        res = subprocess.run([str(Path(sys.executable).with_name("rloo")), "summary", str(f)], capture_output=True,
                             text=True, timeout=120)
        assert res.returncode == 0 and res.stdout + res.stderr, (f, res.stderr[-2000:])
        said[f.name] = res.stdout + res.stderr
    assert {"base.json", "sft.json", "rloo.json", "grpo.json"} <= set(said)
    assert said["sft.json"].startswith("evaluate: sft: accuracy sampled ")
    assert "RLOO − SFT = " in said["comparison.json"] and "GRPO − SFT = " in said["comparison.json"]
    # the micro policies solve nothing: both accuracies are 0, a tie, and the summary says so
    tied = len({accuracy["rloo"], accuracy["grpo"]}) == 1
    assert ("comparison: tie: rloo, grpo" in said["comparison.json"]) == tied
    assert ("comparison: most accurate (greedy): " in said["comparison.json"]) == (not tied)


def test_comparison_target_has_a_ppo_row_judged_against_rloo(run):
    # comparison.estimators narrows the table to RLOO, GRPO (both run already) and PPO: one more RLOO
    # stage and evaluation instead of five (the default's seven are planned above)
    c = run["copy"]
    (c / "config" / "compared.yaml").write_text("comparison: {estimators: [rloo, grpo, ppo]}\n")
    res = snakemake(c, "results/comparison.json", "--cores", "1", *CONFIGFILES, "config/compared.yaml", timeout=1200)
    assert job_counts(res.stdout + res.stderr) == {"rloo": 1, "evaluate": 1, "report": 1, "comparison": 1}
    table = json.loads((c / "results/comparison.json").read_text())
    rows = table["estimators"]
    assert set(rows) == {"rloo", "grpo", "ppo"}
    ppo, rloo = rows["ppo"], rows["rloo"]
    # The memory argument: PPO holds a critic beside the policy, the reference and the reward model.
    assert set(ppo["training"]["networks"]) == set(rloo["training"]["networks"]) | {"critic"}
    assert ppo["parameters_held"] > rloo["parameters_held"]
    nets = ppo["training"]["networks"]
    frozen = sum(n for name, n in nets.items() if name not in ("policy", "critic"))
    assert ppo["model_state_bytes"] == 16 * (nets["policy"] + nets["critic"]) + 2 * frozen
    for row in (ppo, rloo):
        assert row["training"]["seconds_per_step"] > 0 and row["training"]["peak_memory_mb"] > 0
        assert row["samples_to_target"]["samples"] > 0
    # Every policy but RLOO's is judged against RLOO's by the evaluation's judge, in both orders.
    assert "win_rate_vs_rloo" not in rloo
    for name, row in rows.items():
        if name != "rloo":
            wr = row["win_rate_vs_rloo"]
            assert wr["wins"] + wr["losses"] + wr["ties"] + wr["invalid"] == table["examples"], name
    assert table["judge_vs_baseline"]["baseline"] == "rloo"


def test_lint_only_asks_for_conda_or_containers(run):
    res = snakemake(run["copy"], "--lint", *CONFIGFILES, check=False)
    out = res.stdout + res.stderr
    lints = set(re.findall(r"^\s+\* (.+?):?$", out, flags=re.M))
    assert lints <= {"Specify a conda environment or container for each rule."}, out


def test_lint_is_clean(run):
    # Every rule names workflow/envs/rloo.yaml (used with --software-deployment-method conda only).
    res = snakemake(run["copy"], "--lint", *CONFIGFILES, check=False)
    out = res.stdout + res.stderr
    assert res.returncode == 0 and "Lints for" not in out and "good condition" in out, out


def test_report_includes_the_plots(run):
    res = snakemake(run["copy"], "all", GRPO, "--report", "report.html", *CONFIGFILES)
    html = (run["copy"] / "report.html").read_text()
    for plot in ("results/gsm8k_rloo/policies.png", "results/gsm8k_rloo/proxy_vs_judge.png",
                 "results/gsm8k_grpo/policies.png", "results/toy_variance.png"):
        assert plot in html, plot
    # the images are embedded, not linked
    assert html.count("iVBORw0KGgo") >= 5, res.stderr[-2000:]


def _job_resources(out: str) -> dict[str, str]:
    """{rule: the `resources:` line of its (last) job block} of a dry run's output."""
    blocks = {m.group(1): m.group(2) for m in re.finditer(r"^rule (\w+):\n(.*?)(?=^\S|\Z)", out, re.M | re.S)}
    return {rule: re.search(r"resources: (.*)", block).group(1) for rule, block in blocks.items()}


def test_slurm_profile_resolves_from_the_repository_root(run):
    """`--profile slurm` finds ./slurm; each rule gets its size from the profile's set-resources, GPU stages
    a GPU, every job the SIGTERM warning. A local run's job blocks show none of the cluster's sizes."""
    profile = yaml.safe_load((ROOT / "slurm" / "config.yaml").read_text())
    assert profile["executor"] == "slurm"
    assert profile["rerun-incomplete"] is True
    res = snakemake(run["copy"], RLOO, "-n", "-F", "--profile", "slurm", *CONFIGFILES)
    out = res.stdout + res.stderr
    jobs = _job_resources(out)
    assert set(jobs) >= PIPELINE, out[-3000:]
    for rule in PIPELINE:
        resources = jobs[rule]
        assert "slurm_extra=--signal=TERM@300" in resources, resources
        assert ("gpu=1" in resources) == (rule not in CPU_RULES), resources
        size = profile["set-resources"][rule]
        assert f"mem_mb={size['mem_mb']}," in resources and f"runtime={size['runtime']}" in resources, resources
        if rule not in CPU_RULES:
            assert "cpus_per_task=1" in resources
    # the same jobs run here: the machine's resources only, no cluster's sizes, GPUs or CPUs per task
    res = snakemake(run["copy"], RLOO, "-n", "-F", *CONFIGFILES)
    local = _job_resources(res.stdout + res.stderr)
    assert set(local) >= PIPELINE
    for rule in PIPELINE:
        assert not re.search(r"\b(mem_mb|mem|runtime|gpu|cpus_per_task)=", local[rule]), (rule, local[rule])


def _job_pids(copy: Path, *words: str) -> list[int]:
    """Processes of `rloo ...` with every one of `words` among its arguments (an args file's, `@FILE`, read as
    argparse reads them), running in `copy` (started by this test's snakemake):
    `_job_pids(copy, "train", "results/work/rloo_grpo")`."""
    pids = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            args = [a.decode(errors="replace") for a in (proc / "cmdline").read_bytes().split(b"\0")]
            cwd = Path(os.readlink(proc / "cwd"))
            if cwd == copy:
                args = [w for a in args for w in ((cwd / a[1:]).read_text().splitlines() if a.startswith("@") else [a])]
        except OSError:
            continue
        if cwd == copy and all(w in args for w in words) and any(a.endswith("/rloo") for a in args[:2]):
            pids.append(int(proc.name))
    return pids


def test_sigterm_checkpoint_retry_resumes(run):
    """The preemption path without Slurm: SIGTERM to the running rloo stage -> checkpoint + exit 143
    -> Snakemake retries the job (--retries, as the slurm profile does) -> the work folder guard sees
    the same job -> the stage resumes from its checkpoint instead of starting over. Meanwhile the job's
    progress lines (rloo/progress.py, one every progress_every_s) reach Snakemake's own output as it
    trains, not only its log, and the log holds them without a progress bar's carriage returns."""
    c = run["copy"]
    work, model = "results/work/rloo_reinforce", c / "results/models/rloo_reinforce"
    # a longer run (another estimator, so the other tests' outputs stay as they are)
    (c / "config" / "resume.yaml").write_text("rloo: {steps: 100, checkpoint_every: 5}\nprogress_every_s: 0.3\n")
    cmd = [snakemake_bin(), "results/models/rloo_reinforce", "--cores", "1", "--retries", "1",
           *CONFIGFILES, "config/resume.yaml"]
    proc = subprocess.Popen(cmd, cwd=c, env=env_for(c), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    seen: list[tuple[str, bool]] = []  # Snakemake's output as it came, and whether the job had ended by then

    def read() -> None:
        for line in proc.stdout:
            seen.append((line, model.exists()))

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        deadline = time.monotonic() + 300
        signalled = None
        while signalled is None and time.monotonic() < deadline and proc.poll() is None:
            if list((c / work / "checkpoints").glob("step_*/checkpoint.json")):
                pids = _job_pids(c.resolve(), "train", work)
                if pids:
                    for pid in pids:
                        os.kill(pid, signal.SIGTERM)
                    signalled = pids
            time.sleep(0.1)
        proc.wait(timeout=600)
        reader.join(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    output = "".join(line for line, _ in seen)
    assert signalled, f"never saw a checkpoint and a running stage:\n{output[-3000:]}"
    assert proc.returncode == 0, output[-5000:]
    assert "Trying to restart job" in output, output[-3000:]
    metrics = json.loads((c / "results/models/rloo_reinforce/metrics.json").read_text())
    assert metrics["steps"] == 100
    facts = json.loads((c / work / "timings.json").read_text())  # the run's facts, beside its checkpoints
    assert facts["resumed_from_step"] > 0 and "resumed_from_step" not in metrics, facts
    log = (c / "logs/rloo_reinforce.log").read_text()
    assert "same job, resuming" in log
    line = re.compile(r"^rloo: step (\d+)/100 \(\d+%\) · reward -?[\d.]+ · kl -?[\d.]+ · [\d.]+ (s/step|steps/s) · "
                      r"(ETA|took) \d+ (s|min)$")
    live = [int(m.group(1)) for text, ended in seen if not ended and (m := line.match(text.rstrip("\n")))]
    assert len(live) >= 2 and live == sorted(live) and live[-1] == 100, output[-3000:]
    assert "\r" not in log, log[-3000:]
    assert "INFO rloo.progress: rloo: step 100/100 (100%)" in log, log[-3000:]  # the retry's log


def _interrupted(c: Path, cmd: list[str], when, stop) -> str:
    """Run `cmd` in `c` in a session of its own, call `stop(proc)` as soon as `when()` holds, and wait for
    it to end (in failure); its output. Its jobs run in fresh interpreters, as in a terminal: the stage
    server's client and forked process would see the signal otherwise (tests/conftest.py)."""
    env = {**env_for(c), "PYTHONPATH": str(c)}
    env.pop(STAGE_SERVER_ENV, None)
    proc = subprocess.Popen(cmd, cwd=c, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        deadline = time.monotonic() + 300
        while proc.poll() is None and time.monotonic() < deadline:
            if when():
                stop(proc)
                break
            time.sleep(0.05)
        output, _ = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode != 0, output[-3000:]
    return output


def _again(c: Path, cmd: list[str]) -> str:
    """The same command again, to its end: its output."""
    again = subprocess.run(cmd, cwd=c, env=env_for(c), capture_output=True, text=True, timeout=600)
    out = again.stdout + again.stderr
    assert again.returncode == 0, out[-5000:]
    assert "Nothing to be done" not in out, out[-3000:]
    return out


def test_ctrl_c_after_a_key_change_then_the_same_command_ends_in_the_new_configs_results(micro_workflow, tmp_path):
    """Issue 61's probe: after a finished run, a key of the rloo stage changes (a longer run), and the rloo
    job is interrupted with SIGINT while it trains. Snakemake records the job's new params for its output,
    then deletes the output as incomplete; the same command again must not call the old config's results
    current (no job's record then differs: Snakemake alone said "Nothing to be done"). It resumes the job
    from its checkpoint, evaluates again, and every output is the same bytes as an uninterrupted run of the
    new config (the resume a run fact kept in timings.json, MLflow and the logs, never in an output).
    The signal goes to the job's processes: a Ctrl-C in a terminal reaches Snakemake too, which then
    either handles the job's failure first (this path, the probe's) or cancels the job (whose record
    then keeps the old params, and which reruns anyway)."""
    c = copy_tree(micro_workflow["copy"], tmp_path / "wf")
    (c / "config" / "longer.yaml").write_text("rloo: {steps: 30, checkpoint_every: 3}\n")
    # the default target, as the probe ran it (results/gsm8k_rloo.json and the toy experiment)
    cmd = [snakemake_bin(), "--cores", "1", *CONFIGFILES, "config/longer.yaml"]
    work, outputs = c / "results/work/rloo_rloo", (RLOO, "results/models/rloo_rloo/metrics.json",
                                                   "results/models/rloo_rloo/steps.jsonl")
    old = {p.parent.name for p in (work / "checkpoints").glob("step_*/checkpoint.json")}

    def training() -> bool:
        """The new job has written a checkpoint of its own: it trains. (The steps and the checkpoint
        interval are bookkeeping under the constant LR, so the job resumes the old job's checkpoints:
        the work folder's identity changes as the job starts, before it trains.)"""
        return bool({p.parent.name for p in (work / "checkpoints").glob("step_*/checkpoint.json")} - old)

    def ctrl_c(proc) -> None:
        for pid in _job_pids(c.resolve(), "train"):
            os.kill(pid, signal.SIGINT)

    output = _interrupted(c, cmd, training, ctrl_c)
    assert not (c / "results/models/rloo_rloo").exists() and (c / RLOO).exists(), output[-3000:]
    _again(c, cmd)
    facts = json.loads((work / "timings.json").read_text())
    assert facts["resumed_from_step"] > 0, facts
    got = {f: (c / f).read_bytes() for f in outputs}
    for f in ("results/models/rloo_rloo", RLOO, "results/work/rloo_rloo"):  # the same run, uninterrupted
        shutil.rmtree(c / f) if (c / f).is_dir() else (c / f).unlink()
    snakemake(c, "--cores", "1", *CONFIGFILES, "config/longer.yaml")
    assert json.loads((work / "timings.json").read_text())["resumed_from_step"] == 0
    for f in outputs:
        assert (c / f).read_bytes() == got[f], f
    assert planned(c, RLOO, extra_config="rloo: {steps: 30, checkpoint_every: 3}") == {}


def test_kill_9_of_prepare_after_a_data_change_then_the_same_command_remakes_the_chain(micro_workflow, tmp_path):
    """Issue 61's second probe: after a finished run, a data key changes; prepare's job is killed with
    SIGKILL mid-run, and Snakemake deletes its outputs. The same command again runs prepare and every stage
    below it, and its results equal a clean run of the new config (Snakemake alone left the old results
    standing, and data/ holding only the killed writer's temporary file)."""
    c = copy_tree(micro_workflow["copy"], tmp_path / "wf")
    # Any data key will do. The kill, as soon as prepare's process appears (polled every 50 ms), lands in
    # its start-up at 300 rows as at 40,000, and Snakemake deletes the killed job's outputs either way. It
    # waited half a second once, until the package's bytecode came with the copy and the code fingerprint
    # was read back from disk: a 300-row prepare then ended within it. 40,000 rows cost the two chains
    # after it a tokenizer and SFT data built over them: 76 CPU-s for this test against 43.
    change = "data: {synthetic: {n_train: 300}}\n"
    (c / "config" / "bigger.yaml").write_text(change)
    cmd = [snakemake_bin(), RLOO, "--cores", "1", *CONFIGFILES, "config/bigger.yaml"]
    killed: list[int] = []

    def preparing() -> bool:
        killed[:] = _job_pids(c.resolve(), "prepare")
        return bool(killed)

    def kill(proc) -> None:
        for pid in killed:
            os.kill(pid, signal.SIGKILL)

    output = _interrupted(c, cmd, preparing, kill)
    assert killed and not (c / "data/gsm8k/train.jsonl").exists() and (c / RLOO).exists(), output[-3000:]
    _again(c, cmd)
    got = (c / RLOO).read_bytes()
    clean = copy_tree(micro_workflow["copy"], tmp_path / "clean")
    for f in ("data", "results", ".snakemake"):  # nothing of the old run: a clean run of the new config
        shutil.rmtree(clean / f, ignore_errors=True)
    (clean / "config" / "bigger.yaml").write_text(change)
    snakemake(clean, RLOO, "--cores", "1", *CONFIGFILES, "config/bigger.yaml")
    assert json.loads(got) == json.loads((clean / RLOO).read_bytes())
    assert got == (clean / RLOO).read_bytes()


def test_kill_9_of_a_run_leaves_a_lock_that_why_rerun_names_and_clears(micro_workflow, tmp_path):
    """Issue 71's probe: Snakemake killed with SIGKILL, its jobs with it, while rloo trains. Its lock stays
    (.snakemake/locks), and the same command stops at once with LockException. `rloo why-rerun` names the
    lock, says that no run is alive (the killed run's record, .rloo/running, names a process that is gone)
    and gives the command that clears it; after that command, the same command ends in the results of
    the uninterrupted run (micro_workflow's, byte for byte)."""
    c = copy_tree(micro_workflow["copy"], tmp_path / "wf")
    outputs = (RLOO, "results/models/rloo_rloo/metrics.json", "results/models/rloo_rloo/steps.jsonl")
    uninterrupted = {f: (c / f).read_bytes() for f in outputs}
    for f in ("results/models/rloo_rloo", "results/work/rloo_rloo", RLOO):  # rloo, its evaluation, the report
        shutil.rmtree(c / f) if (c / f).is_dir() else (c / f).unlink()
    cmd = [snakemake_bin(), RLOO, "--cores", "1", *CONFIGFILES]
    killed: list[int] = []

    def kill(proc) -> None:  # Snakemake and its jobs (its process group)
        killed.append(proc.pid)
        os.killpg(proc.pid, signal.SIGKILL)

    output = _interrupted(c, cmd, lambda: bool(_job_pids(c.resolve(), "train")), kill)
    assert list((c / ".snakemake/locks").iterdir()) and list((c / ".rloo/running").iterdir()), output[-3000:]
    refused = snakemake(c, RLOO, "--cores", "1", *CONFIGFILES, check=False)
    assert refused.returncode != 0 and "LockException" in refused.stdout + refused.stderr, refused.stderr[-3000:]

    why = subprocess.run(["rloo", "why-rerun"], cwd=c, env=env_for(c), capture_output=True, text=True, timeout=300)
    assert why.returncode == 0, why.stderr
    lines = why.stdout.splitlines()
    assert lines[0].startswith("locked: the working folder is locked (.snakemake/locks)"), why.stdout
    assert lines[1].startswith(f"  no run is alive: the last run, PID {killed[0]} on "), why.stdout
    unlock = re.search(r"(snakemake --unlock .*)$", lines[2]).group(1)
    assert shlex.split(unlock) == ["snakemake", "--unlock", *CONFIGFILES], why.stdout  # the killed run's files
    assert "rloo@rloo: its output is missing: results/models/rloo_rloo" in why.stdout, why.stdout
    subprocess.run(shlex.split(unlock), cwd=c, env=env_for(c), check=True, capture_output=True, timeout=300)
    _again(c, cmd)
    for f in outputs:
        assert (c / f).read_bytes() == uninterrupted[f], f
    assert not list((c / ".rloo/running").iterdir())  # the next run forgot the dead one, and ended


# What a missing output of each stage reruns (rloo_workflow.pipeline.input_graph): the stage and everything below it.
BELOW = {
    "data/gsm8k/train.jsonl": {"prepare": 1, "base": 1, "sft": 1, "reward": 1, "rloo": 2, "evaluate": 4, "report": 2},
    "results/models/base": {"base": 1, "sft": 1, "reward": 1, "rloo": 2, "evaluate": 4, "report": 2},
    "results/models/sft": {"sft": 1, "reward": 1, "rloo": 2, "evaluate": 4, "report": 2},
    "results/models/reward": {"reward": 1, "evaluate": 4, "report": 2},
    "results/models/rloo_grpo": {"rloo": 1, "evaluate": 1, "report": 1},
    "results/eval/sft.jsonl": {"evaluate": 1, "report": 2},
    "results/gsm8k_grpo.json": {"report": 1},
}


@pytest.mark.parametrize("gone", list(BELOW))
def test_a_missing_output_reruns_its_stage_and_everything_below_it(run, gone):
    """Snakemake's own rule leaves a missing intermediate output alone while what was made from it is
    current; here it reruns its stage and every stage below it (workflow/rules/common.smk's
    rerun_if_stale), and `rloo why-rerun` says so. Dry runs; the output is put back after."""
    c = run["copy"]
    aside = c / "aside"
    (c / gone).rename(aside)
    try:
        assert planned(c, RLOO, GRPO) == BELOW[gone]
        if gone == "results/models/reward":
            res = subprocess.run(["rloo", "why-rerun", *CONFIGFILES], cwd=c, env=env_for(c),
                                 capture_output=True, text=True, timeout=300)
            assert res.returncode == 0, res.stderr
            assert ("evaluate-sft: an input it was made from is missing: results/models/reward (made again, "
                    "then this job)") in res.stdout, res.stdout
            assert "reward: its output is missing: results/models/reward" in res.stdout, res.stdout
    finally:
        aside.rename(c / gone)
    assert planned(c, RLOO, GRPO) == {}


@pytest.mark.slow
def test_an_overlay_whose_extended_file_snakemake_did_not_read_is_an_error(tmp_path):
    """Snakemake reads a --configfile as it is; `extends:` is rloo's. An overlay given without the file it
    extends (config/qwen2-tiny.yaml overlays config/micro.yaml) would silently lose that file's keys: it stops
    the run, naming both files; given in order, the same overlay plans."""
    copy = make_copy(tmp_path / "wf")
    res = snakemake(copy, "-n", "--configfile", "config/qwen2-tiny.yaml", check=False)
    out = res.stdout + res.stderr
    assert res.returncode != 0
    assert "the file it extends" in out and "--configfile config/micro.yaml config/qwen2-tiny.yaml" in out, out[-2000:]
    ok = snakemake(copy, "-n", "--configfile", "config/micro.yaml", "config/qwen2-tiny.yaml", check=False)
    assert ok.returncode == 0, (ok.stdout + ok.stderr)[-2000:]
