"""Reward functions through the real Snakemake workflow: config/examples/your-reward.yaml (the verifier's
correctness plus the format bonus of config/examples/rewards/format.py, a file of the workflow copy in a
temporary folder) on a copy of the session's finished micro chain (`micro_workflow`), with MLflow
tracking on. Only rloo, the evaluations and the report run; each function is logged (steps.jsonl, MLflow, `rloo summary`)
and their weighted sum is the training reward; the evaluation reports them for base, SFT and RLOO;
a change to what the file computes reruns rloo, the evaluations and the report only, and a comment nothing; a function that
does not import stops Snakemake before any job in one line; one that raises, in a rerun, stops the rloo
job with one line naming the user's file and line, last, its traceback in the job's log, and the
terminal names the command that brings back the model the rerun deleted; the file counts in the code
fingerprints of those two stages that DVC reads."""

from __future__ import annotations

import json
import re
import subprocess

import pytest
import yaml
from code_edits import append_comment, semantic_edit
from conftest import copy_tree
from workflow_helpers import CONFIGFILES, VENV_BIN, env_for, job_counts, planned, snakemake, tool

from rloo_workflow.code_fingerprint import FINGERPRINTS_FILE

pytestmark = pytest.mark.slow

RLOO = "results/gsm8k_rloo.json"
OVERLAY = "config/examples/your-reward.yaml"
FORMAT = "config/examples/rewards/format.py"
WEIGHTS = {"correct": 1.0, "format": 0.2}  # the overlay's


@pytest.fixture(scope="module")
def chain(micro_workflow, tmp_path_factory) -> dict:
    copy = copy_tree(micro_workflow["copy"], tmp_path_factory.mktemp("reward_plugins") / "wf")
    (copy / "config" / "tracked.yaml").write_text("tracking: {enabled: true}\n")
    configs = [*CONFIGFILES, OVERLAY, "config/tracked.yaml"]
    env = {"MLFLOW_TRACKING_URI": f"sqlite:///{copy}/mlflow.db"}
    res = snakemake(copy, RLOO, "--cores", "1", *configs, env=env)
    return {"copy": copy, "output": res.stdout + res.stderr, "configs": configs, "env": env}


def _plan(chain: dict, *extra: str) -> dict[str, int]:
    res = snakemake(chain["copy"], RLOO, "-n", "--quiet", "rules", *chain["configs"], *extra, env=chain["env"])
    out = res.stdout + res.stderr
    return {} if "Nothing to be done" in out else job_counts(out)


def test_only_rloo_and_evaluate_run_on_the_new_reward(chain):
    # every evaluation reports the training reward's parts: the three run again, and the report
    assert job_counts(chain["output"]) == {"rloo": 1, "evaluate": 3, "report": 1}
    assert _plan(chain) == {}


def test_each_function_is_logged_and_their_weighted_sum_is_the_reward(chain):
    model = chain["copy"] / "results" / "models" / "rloo_rloo"
    steps = [json.loads(line) for line in (model / "steps.jsonl").read_text().splitlines()]
    assert len(steps) == 4
    for s in steps:
        parts = {name: s[f"train/reward/{name}"] for name in WEIGHTS}
        assert s["train/reward_mean"] == pytest.approx(sum(WEIGHTS[n] * v for n, v in parts.items()), abs=1e-6), s
    assert any(s["train/reward/format"] > 0 for s in steps)  # the sum is tested where the weight matters
    metrics = json.loads((model / "metrics.json").read_text())
    assert metrics["reward_source"] == "function"
    assert {n: f["weight"] for n, f in metrics["reward_functions"].items()} == WEIGHTS
    assert "rloo: reward functions, mean over the last 10 steps: correct 0.000 (weight 1), format " in chain["output"]

    from mlflow import MlflowClient

    client = MlflowClient(chain["env"]["MLFLOW_TRACKING_URI"])
    runs = client.search_runs([client.get_experiment_by_name("rloo").experiment_id],
                              filter_string="attributes.run_name = 'rloo'")
    assert len(runs) == 1
    for name in WEIGHTS:
        history = client.get_metric_history(runs[0].info.run_id, f"train/reward/{name}")
        assert [(m.step, m.value) for m in history] == [(s["step"], s[f"train/reward/{name}"]) for s in steps]


def test_the_evaluation_reports_the_training_reward_for_every_policy(chain):
    result = json.loads((chain["copy"] / RLOO).read_text())
    for name, policy in [*result["policies"].items(), ("base", result["base"]["policy"])]:
        tr = policy["training_reward"]
        assert {n: p["weight"] for n, p in tr["parts"].items()} == WEIGHTS, name
        assert tr["completions"] == 16 * 4  # evaluate.examples x samples_per_prompt
        parts = {n: p["mean"] for n, p in tr["parts"].items()}
        assert tr["weighted_sum"]["mean"] == pytest.approx(sum(WEIGHTS[n] * v for n, v in parts.items())), name
        assert all(len(p["ci95"]) == 2 for p in (*tr["parts"].values(), tr["weighted_sum"])), name
    judges = result["judges"]
    assert judges["training_reward"] == {"graded_by": "the training reward (correct, format)",
                                          "independent_of_training_reward": False}
    # the verifier is one of the functions: accuracy is not independent of what RLOO trained on; the format
    # function is the user's code, so whether the checker's work figures are is not known
    assert judges["accuracy"]["independent_of_training_reward"] is False
    assert judges["solution_check_work"]["independent_of_training_reward"] is None
    assert "report: rloo: training reward " in chain["output"] and " + 0.2 x format " in chain["output"]


def test_editing_the_reward_file_reruns_rloo_and_evaluate_only(chain):
    path = chain["copy"] / FORMAT
    original = path.read_text()
    try:
        append_comment(path)
        assert _plan(chain) == {}  # the code fingerprint: a comment computes nothing
        semantic_edit(path, "format_bonus")
        assert _plan(chain) == {"rloo": 1, "evaluate": 3, "report": 1}
    finally:
        path.write_text(original)
    assert _plan(chain) == {}


def test_a_function_that_does_not_import_stops_snakemake_before_any_job(chain):
    broken = chain["copy"] / "config" / "broken.yaml"
    broken.write_text(yaml.safe_dump({"reward": {"functions": [
        {"name": "correct", "fn": "rloo.reward.verifier:reward"}, {"name": "format", "fn": f"{FORMAT}:nosuch"}]}}))
    res = snakemake(chain["copy"], RLOO, "-n", *chain["configs"], "config/broken.yaml", env=chain["env"], check=False)
    out = res.stdout + res.stderr
    line = f"key 'reward.functions[1].fn': {chain['copy'] / FORMAT}: no function 'nosuch'"
    assert res.returncode != 0 and line in out, out[-3000:]


RAISES = '''def bonus(completions, **kwargs):
    return [_length_score(c) for c in completions]


def _length_score(completion):
    return 1.0 / (len(completion) - len(completion))  # raises on every completion
'''


def test_a_rerun_whose_function_raises_ends_on_the_users_line_and_names_how_to_get_the_last_model_back(
        tracked_workflow, tmp_path):
    """Issues 62 and 72: a rerun of rloo and evaluate (a copy of the session's finished run, committed to DVC)
    whose reward function raises shows at most 45 lines, Snakemake's own included: the job's output ends on
    the one line naming the user's file:line (within the last 25 lines), no frame or path of the package,
    not the stage's config nor the log, and the rule's command one short line; its traceback stays in the
    log. Snakemake deleted the finished model before the job ran: the terminal names the one command that
    brings it back, and that command brings it back byte for byte; `rloo dvc restore` with the settings that
    made it then leaves Snakemake nothing to do."""
    repo = tmp_path / "repo"  # `cp -a`: the model folders' hard links into the DVC cache kept
    subprocess.run(["cp", "-a", str(tracked_workflow["wf"]), str(repo)], check=True)
    (repo / "my_bonus.py").write_text(RAISES)
    (repo / "config" / "raises.yaml").write_text(yaml.safe_dump({"reward": {"source": "function", "functions": [
        {"name": "correct", "fn": "rloo.reward.verifier:reward"}, {"name": "bonus", "fn": "my_bonus.py:bonus"}]}}))
    res = snakemake(repo, RLOO, "--cores", "1", *CONFIGFILES, "config/raises.yaml", check=False)
    out = res.stdout + res.stderr
    lines = out.splitlines()
    one_line = ("rloo train: error: reward function 'bonus' (my_bonus.py:bonus) raised ZeroDivisionError: float "
                "division by zero at my_bonus.py:6 on 1 of the 1 completions tried one by one")
    assert res.returncode != 0 and one_line in out, out[-4000:]
    assert job_counts(out) == {"rloo": 1, "evaluate": 3, "report": 1}, out[-4000:]
    # 40 lines: the user's, rloo's onerror line (below) and 38 of Snakemake's: its banner (5), the job stats
    # (8), the scheduler's lines (2), the job's block (10: its `reason:` left out by profiles/default), its
    # error block (9) and its shutdown (4). Without the profiles' logger plugin (snakemake_logger_plugin_rloo)
    # 51: docs/workflow.md ("What a failed run prints")
    assert len(lines) <= 45, f"{len(lines)} lines:\n{out}"
    assert not any(line.strip().startswith("reason: ") for line in lines), out  # the digests' dump
    assert any(line.startswith(one_line) for line in lines[-25:]), f"not in the last 25 lines:\n{out}"
    # the job's own output ends on it; Snakemake's blocks follow
    job_end = max(i for i, line in enumerate(lines) if line.startswith("rloo train"))
    assert lines[job_end].startswith(one_line), out
    assert "log: logs/rloo_rloo.log" in out, out  # Snakemake's error block names the log
    assert not re.search(r"rloo(_workflow)?/[\w/]+\.py", out), out  # no frame, no path of the package
    assert '"rloo":{' not in out and "--config-json" not in out and "rloo: 0%" not in out, out  # no config, no log
    commands = [line.strip() for i, line in enumerate(lines) if i and lines[i - 1].strip() == "shell:"]
    assert commands and all(c.startswith("rloo train @") and len(c) <= 120 for c in commands), commands
    assert out.count(commands[0]) == 1, out  # printed once: the RuleException above the block said it again
    log = (repo / "logs" / "rloo_rloo.log").read_text()
    assert log.rstrip().splitlines()[-1].startswith(one_line), log[-3000:]  # the log ends with it too
    # the traceback, above it in the log: the user's own frames, not only the package's
    assert f'File "{repo / "my_bonus.py"}", line 2, in bonus' in log and \
        f'File "{repo / "my_bonus.py"}", line 6, in _length_score' in log, log[-3000:]

    model = "results/models/rloo_rloo"
    assert not (repo / model).exists()
    command = f"dvc checkout {model}"
    assert any(line.startswith("rloo: ") and line.endswith(f"to get it back: {command}") for line in lines[job_end:]), out
    tool(repo, *command.split())
    finished = tracked_workflow["wf"] / model
    files = sorted(p.relative_to(finished) for p in finished.rglob("*") if p.is_file() and p.name != ".snakemake_timestamp")
    assert files and sorted(p.relative_to(repo / model) for p in (repo / model).rglob("*") if p.is_file()
                            and p.name != ".snakemake_timestamp") == files
    assert all((repo / model / f).read_bytes() == (finished / f).read_bytes() for f in files)
    # back to the settings that made it: Snakemake takes it as current once DVC has vouched for it (docs/workflow.md)
    tool(repo, "rloo", "dvc", "restore", "--configfile", *CONFIGFILES[1:])
    assert planned(repo, RLOO) == {}


def test_the_reward_file_counts_in_the_code_fingerprints_dvc_reads_of_rloo_and_evaluate(chain):
    def fingerprints() -> dict[str, str]:
        res = subprocess.run([str(VENV_BIN / "rloo"), "dvc", "yaml", "--configfile", *chain["configs"][1:]],
                             cwd=chain["copy"], env=env_for(chain["copy"]), capture_output=True, text=True, timeout=300)
        assert res.returncode == 0, res.stderr[-3000:]
        return yaml.safe_load((chain["copy"] / FINGERPRINTS_FILE).read_text())

    path = chain["copy"] / FORMAT
    original = path.read_text()
    before = fingerprints()
    try:
        semantic_edit(path, "format_bonus")
        after = fingerprints()
    finally:
        path.write_text(original)
    assert {v for v in before if before[v] != after[v]} == {"rloo", "evaluate"}
    stages = yaml.safe_load((chain["copy"] / "dvc.yaml").read_text())["stages"]
    assert {".rloo/fingerprints.yaml": ["rloo"]} in stages["rloo"]["do"]["params"]
