"""Preemption (SIGTERM), kill -9, atomic outputs, determinism: with real processes."""

import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml
from code_edits import append_comment, semantic_edit
from model_helpers import evaluate_and_report

from rloo.model import checkpoint, models
from rloo_workflow.config import load_config
from rloo_workflow.stages import reward
from rloo_workflow.stages import rloo as rloo_stage

ROOT = Path(__file__).resolve().parents[2]


def _train_cmd(micro_run, tmp_path, out, work, steps=24):
    # The micro reward model as the training reward: its scores differ between samples, so every
    # step moves the weights (on the verifier the micro policy earns 0 everywhere and nothing moves).
    return [
        sys.executable, "-m", "rloo_workflow.cli", "train", "-c", str(ROOT / "config" / "micro.yaml"),
        "--set", "reward.source=model", "--reward-model", str(micro_run["base"] / "reward"),
        "--set", f"rloo.steps={steps}", "--set", "rloo.checkpoint_every=3", "--set", "tracking.enabled=false",
        # Every step in 2-3 micro-batches (rloo/model/microbatch.py): a resume must repeat them exactly too.
        "--set", "rloo.micro_batch_tokens=160",
        "--data", str(micro_run["data"]), "--policy", str(micro_run["sft"]),
        "--out", str(tmp_path / out), "--work", str(tmp_path / work),
    ]


def _step(work: Path) -> int:
    """The step of the run's latest checkpoint, 0 before the first."""
    latest = checkpoint.latest(work / "checkpoints")
    return 0 if latest is None else int(latest.name.split("_")[1])


def _wait_for_checkpoint(work: Path, proc: subprocess.Popen, timeout: float = 60, step: int = 1) -> None:
    """Until the run has checkpointed step `step` or later (by default: any step)."""
    deadline = time.time() + timeout
    while _step(work) < step:
        assert proc.poll() is None, proc.stderr.read() if proc.stderr else "train exited early"
        assert time.time() < deadline, "no checkpoint appeared"
        time.sleep(0.05)


def _weights(folder: Path) -> dict:
    return models.load_causal_lm(folder).state_dict()


@pytest.fixture(scope="module")
def uninterrupted_run(micro_run, micro_reward, tmp_path_factory):
    """The weights of an uninterrupted run, and its wall time (to aim a kill inside a run)."""
    tmp = tmp_path_factory.mktemp("uninterrupted")
    t0 = time.monotonic()
    subprocess.run(_train_cmd(micro_run, tmp, "out", "work"), check=True, capture_output=True)
    weights, sft = _weights(tmp / "out"), _weights(micro_run["sft"])
    # The run must have trained: a resume test on unchanged weights would test nothing.
    assert max(float((weights[k] - sft[k]).abs().max()) for k in sft) > 1e-4  # a zero update gives exactly 0
    return weights, time.monotonic() - t0


@pytest.fixture(scope="module")
def uninterrupted(uninterrupted_run):
    return uninterrupted_run[0]


@pytest.mark.slow
def test_sigterm_checkpoints_exits_nonzero_and_the_rerun_resumes(micro_run, tmp_path, uninterrupted):
    proc = subprocess.Popen(_train_cmd(micro_run, tmp_path, "out", "work"), stderr=subprocess.PIPE, text=True)
    _wait_for_checkpoint(tmp_path / "work", proc)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 143, err
    assert "SIGTERM received" in err
    assert not (tmp_path / "out").exists()  # no output that looks complete
    step = int(checkpoint.latest(tmp_path / "work" / "checkpoints").name.split("_")[1])
    assert 0 < step < 24
    done = subprocess.run(_train_cmd(micro_run, tmp_path, "out", "work"), capture_output=True, text=True, check=True)
    assert "resumed from" in done.stderr
    assert json.loads((tmp_path / "work" / "timings.json").read_text())["resumed_from_step"] == step
    b = _weights(tmp_path / "out")
    assert all(torch.equal(uninterrupted[k], b[k]) for k in b)


BONUS = "def bonus(completions, **kwargs):\n    return [float(len(c) % 3) for c in completions]\n"


@pytest.mark.slow
def test_a_checkpoint_resumes_across_a_comment_not_an_edit_of_the_code_or_the_reward_file(micro_run, tmp_path):
    """Issue 70: `rloo train` resumed a checkpoint after `rloo_advantages` was edited. The identity a
    checkpoint must match (rloo.identity) counts the code the run runs (its stage's code fingerprint) and the
    user's reward file: on a copy of the package (its code is what runs), a finished run's work folder is
    resumed after a comment, and refused, in one line naming the part that changed, after an edit of the
    estimator or of the reward file's body."""
    for name in ("rloo", "rloo_workflow"):
        shutil.copytree(ROOT / name, tmp_path / name, ignore=shutil.ignore_patterns("__pycache__"))
    (tmp_path / "bonus.py").write_text(BONUS)
    (tmp_path / "reward.yaml").write_text(yaml.safe_dump({"reward": {"source": "function", "functions": [
        {"name": "bonus", "fn": f"{tmp_path / 'bonus.py'}:bonus"}]}}))
    cmd = [sys.executable, "-m", "rloo_workflow.cli", "train", "-c", str(ROOT / "config" / "micro.yaml"),
           "-c", str(tmp_path / "reward.yaml"), "--set", "rloo.steps=2", "--set", "rloo.checkpoint_every=1",
           "--set", "tracking.enabled=false", "--data", str(micro_run["data"]), "--policy", str(micro_run["sft"]),
           "--out", str(tmp_path / "out"), "--work", str(tmp_path / "work")]
    env = {**os.environ, "PYTHONPATH": str(tmp_path), "PYTHONDONTWRITEBYTECODE": "1"}

    def train() -> subprocess.CompletedProcess:
        return subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)

    first = train()
    assert first.returncode == 0 and "resumed from" not in first.stderr, first.stderr[-3000:]
    estimators = tmp_path / "rloo" / "algo" / "estimators.py"
    original = estimators.read_text()
    append_comment(estimators)  # what the code computes is the same: the checkpoint resumes
    again = train()
    assert again.returncode == 0 and "resumed from" in again.stderr, again.stderr[-3000:]
    for edit, changed in ((lambda: semantic_edit(estimators, "rloo_advantages"), "(changed: code)"),
                          (lambda: (tmp_path / "bonus.py").write_text(BONUS.replace("% 3", "% 5")),
                           "(changed: code; files bonus.py)")):  # the file, relative to the project
        edit()
        refused = train()
        lines = refused.stderr.strip().splitlines()
        assert refused.returncode != 0 and "resumed from" not in refused.stderr, refused.stderr[-3000:]
        assert f"holds the checkpoints of another job {changed}" in lines[-1], lines[-5:]
        assert "Traceback" not in refused.stderr, lines[-5:]
        estimators.write_text(original)
    (tmp_path / "bonus.py").write_text(BONUS)
    assert "resumed from" in train().stderr  # both back as they were: the same identity


@pytest.mark.slow
def test_kill_9_at_a_random_point_then_rerun_gives_the_same_weights(micro_run, tmp_path, uninterrupted_run):
    uninterrupted, duration = uninterrupted_run
    proc = subprocess.Popen(_train_cmd(micro_run, tmp_path, "out", "work"), stderr=subprocess.DEVNULL)
    # A random point in the first half of the run's 24 steps, aimed by progress, not by the clock (a
    # time aimed from the uninterrupted run's wall time overshot the end when this run ran faster
    # than that one, under another load): a random checkpoint of the first half, then up to one
    # checkpoint interval more (3 steps of the uninterrupted run's pace), anywhere in a step or a save.
    rng = random.Random(os.getpid())
    _wait_for_checkpoint(tmp_path / "work", proc, step=rng.choice([3, 6, 9]))
    time.sleep(rng.uniform(0.0, 3 * duration / 24))
    assert proc.poll() is None, "the run finished before the kill: nothing was tested"
    proc.kill()
    proc.wait()
    assert not (tmp_path / "out" / "model.safetensors").exists()
    # What a kill during a save can leave: a temporary folder, and a step folder without its marker.
    (tmp_path / "work" / "checkpoints" / ".step_00000099.abc.tmp").mkdir()
    (tmp_path / "work" / "checkpoints" / "step_00000099").mkdir()
    subprocess.run(_train_cmd(micro_run, tmp_path, "out", "work"), check=True, capture_output=True)
    assert json.loads((tmp_path / "work" / "timings.json").read_text())["resumed_from_step"] > 0
    b = _weights(tmp_path / "out")
    assert all(torch.equal(uninterrupted[k], b[k]) for k in b)


def test_a_failing_stage_leaves_the_previous_output_untouched(micro_run, tmp_path):
    cfg = json.loads(json.dumps(micro_run["cfg"]))
    cfg["reward"]["source"] = "verifier"
    cfg["rloo"]["steps"] = 2
    rloo_stage.run(cfg, micro_run["data"], micro_run["sft"], tmp_path / "out", tmp_path / "w1")
    before = (tmp_path / "out" / "model.safetensors").read_bytes()
    cfg["rloo"]["k"] = 1
    with pytest.raises(ValueError, match="k >= 2"):
        rloo_stage.run(cfg, micro_run["data"], micro_run["sft"], tmp_path / "out", tmp_path / "w2")
    assert (tmp_path / "out" / "model.safetensors").read_bytes() == before
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".out")]


# What may differ between two runs with the same inputs: wall-clock figures, and the paths of the
# two runs' own folders. Everything else, the headline metrics included, must be equal.
VOLATILE = {"train_seconds", "pair_seconds", "samples_per_second", "tokens_per_second", "run_ids", "plots", "init"}


def _strip_volatile(obj):
    if isinstance(obj, dict):
        return {k: _strip_volatile(v) for k, v in obj.items() if k not in VOLATILE and not k.startswith("time/")}
    if isinstance(obj, list):
        return [_strip_volatile(v) for v in obj]
    return obj


def test_same_config_and_seed_give_the_same_results(micro_run, tmp_path):
    results = []
    for rep in ("a", "b"):
        base = tmp_path / rep
        cfg = load_config(ROOT / "config" / "micro.yaml", {"tracking": {"enabled": False}})
        reward.run(cfg, micro_run["data"], micro_run["sft"], base / "reward")
        rloo_stage.run(cfg, micro_run["data"], micro_run["sft"], base / "rloo", base / "work", base / "reward")
        policies = {"base": micro_run["base_model"], "sft": micro_run["sft"], "rloo": base / "rloo"}
        results.append(evaluate_and_report(cfg, micro_run["data"], micro_run["sft"], policies,
                                           base / "gsm8k_rloo.json", base / "reward"))
    assert _strip_volatile(results[0]) == _strip_volatile(results[1])
    assert results[0]["policies"]["rloo"]["kl"] != 0.0
    kept = _strip_volatile(results[0])
    for key in ("accuracy_sampled", "accuracy_sampled_draws", "proxy_reward", "selected_step"):
        assert key in kept["policies"]["rloo"]  # the headline figures are compared, not dropped
    assert "data_manifest_sha256" in kept and kept["training"]["rloo"]["reward_source"] == "model"


def _reward_cmd(micro_run, tmp_path):
    return [
        sys.executable, "-m", "rloo_workflow.cli", "reward", "-c", str(ROOT / "config" / "micro.yaml"),
        "--set", "reward.steps=80", "--set", "reward.checkpoint_every=4", "--set", "tracking.enabled=false",
        "--data", str(micro_run["data"]), "--policy", str(micro_run["sft"]),
        "--out", str(tmp_path / "out"), "--work", str(tmp_path / "work"),
    ]


@pytest.mark.slow
def test_reward_stage_killed_then_rerun_gives_the_same_model(micro_run, tmp_path_factory):
    """The reward stage resumes like sft and rloo: kill -9 after a checkpoint, rerun, same weights."""
    whole, cut = tmp_path_factory.mktemp("reward_whole"), tmp_path_factory.mktemp("reward_cut")
    subprocess.run(_reward_cmd(micro_run, whole), check=True, capture_output=True)
    expected = models.load_reward_model(whole / "out").state_dict()
    start = models.load_reward_model(micro_run["sft"], trained=False).state_dict()
    assert max(float((expected[k] - start[k]).abs().max()) for k in expected if k in start) > 1e-4  # it trained
    proc = subprocess.Popen(_reward_cmd(micro_run, cut), stderr=subprocess.DEVNULL)
    _wait_for_checkpoint(cut / "work", proc, timeout=120)
    assert proc.poll() is None, "the run finished before the kill: nothing was tested"
    proc.kill()
    proc.wait()
    assert not (cut / "out").exists()
    subprocess.run(_reward_cmd(micro_run, cut), check=True, capture_output=True)
    assert json.loads((cut / "work" / "timings.json").read_text())["resumed_from_step"] > 0
    got = models.load_reward_model(cut / "out").state_dict()
    assert all(torch.equal(expected[k], got[k]) for k in expected)


@pytest.mark.parametrize("keep", [1, 2, 3])
def test_sigint_checkpoint_is_logged_and_counts_towards_the_kept_ones(tmp_path, caplog, keep):
    """A real SIGINT to this process at step 20 of a loop that checkpoints every 2 steps: the loop
    saves step 21, logs its step and path in one line, and leaves `keep` checkpoints, that one
    included (the issue's probe found 18, 20 and 21 with a limit of 2)."""
    from rloo.runtime import Preempted
    from rloo.train.loop import TrainingLoop

    model = torch.nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    loop = TrainingLoop("rloo", 30, tmp_path / "ckpt", model, opt, None, "f", 2, keep=keep)
    with caplog.at_level("WARNING", logger="rloo"), pytest.raises(Preempted) as stopped:
        for step in loop:
            if step == 20:
                os.kill(os.getpid(), signal.SIGINT)
    assert stopped.value.step == 21 and stopped.value.code == 130
    kept = [p.name for p in checkpoint.complete(tmp_path / "ckpt")]
    assert kept == [f"step_{s:08d}" for s in (16, 18, 20, 21)[-keep:]], kept
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == kept  # nothing else left there
    saved = tmp_path / "ckpt" / "step_00000021"
    lines = [r.getMessage() for r in caplog.records if "checkpoint of step" in r.getMessage()]
    assert lines == [f"rloo: stopped by SIGINT: checkpoint of step 21 saved at {saved} (the same command "
                     "resumes from it)"], caplog.text
