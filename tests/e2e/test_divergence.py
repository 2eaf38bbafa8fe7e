"""A diverged run stops, and a damaged checkpoint is never resumed from (rloo/train/loop.py, rloo/model/checkpoint.py).

Real runs of `rloo train` / `rloo sft` / `rloo evaluate` on the micro config, through `rloo_workflow.cli.main`
in this process: an exploding learning rate stops the stage with one line and exit 2, writes no
output and keeps the last good checkpoint; NaN weights in the newest checkpoint, or a file changed by
one byte, make the resume fall back to the checkpoint before it; with every checkpoint damaged the
stage fails clearly; evaluate refuses a model with non-finite weights before sampling anything.
"""

from __future__ import annotations

import json
import math
import re
import shutil
from pathlib import Path

import pytest
import torch
from fault_helpers import file_size_limit
from safetensors.torch import load_file, save_file

from rloo.model import checkpoint, models
from rloo.train.loop import NonFiniteError, TrainingLoop
from rloo_workflow import cli

ROOT = Path(__file__).resolve().parents[2]
MICRO = str(ROOT / "config" / "micro.yaml")


def _train(micro_run, micro_reward, tmp: Path, *sets: str, steps: int = 6) -> list[str]:
    # The micro reward model as the training reward: its scores differ between samples, so every
    # step moves the weights (on the verifier the micro policy earns 0 and nothing moves).
    argv = ["train", "-c", MICRO, "--set", "reward.source=model", "--reward-model", str(micro_reward),
            "--set", f"rloo.steps={steps}", "--set", "rloo.checkpoint_every=2", "--set", "rloo.eval_every=0",
            "--set", "tracking.enabled=false", "--data", str(micro_run["data"]), "--policy", str(micro_run["sft"]),
            "--out", str(tmp / "out"), "--work", str(tmp / "work")]
    for s in sets:
        argv += ["--set", s]
    return argv


def _finite(folder: Path) -> bool:
    return all(bool(torch.isfinite(t).all()) for t in models.load_causal_lm(folder).state_dict().values())


def _poison(ckpt: Path, rehash: bool) -> None:
    """NaN weights in a checkpoint's model.safetensors, still a valid safetensors file; `rehash`: as if an
    unguarded run had saved them (checkpoint.json's digest matches), so only the finiteness check is left."""
    path = ckpt / "model.safetensors"
    state = load_file(str(path))
    save_file({k: torch.full_like(v, math.nan) for k, v in state.items()}, str(path))
    if rehash:
        meta = json.loads((ckpt / "checkpoint.json").read_text())
        meta["sha256"] = checkpoint.digests(ckpt)
        (ckpt / "checkpoint.json").write_text(json.dumps(meta))


def test_an_exploding_learning_rate_stops_the_run_without_output(micro_run, micro_reward, tmp_path, capsys):
    code = cli.main(_train(micro_run, micro_reward, tmp_path, "rloo.lr=1.0e6", "rloo.grad_clip=1.0e9", steps=10))
    err = capsys.readouterr().err
    assert code == 2, err[-3000:]
    line = [x for x in err.splitlines() if x.startswith("rloo train: error:")]
    assert line and "the run diverged" in line[0] and "step" in line[0], err[-3000:]
    assert not (tmp_path / "out").exists()  # nothing that Snakemake or DVC could take as done
    record = json.loads((tmp_path / "work" / "diverged.json").read_text())
    # caught at the step, before the optimizer applied it (not only by the weights check at the end)
    assert record["stage"] == "rloo" and record["step"] < 10
    assert record["quantity"] in ("loss", "grad_norm", "kl", "advantages"), record
    # every checkpoint that was kept holds finite weights: the last good one
    for ckpt in checkpoint.complete(tmp_path / "work" / "checkpoints"):
        assert checkpoint.nonfinite(load_file(str(ckpt / "model.safetensors"))) is None, ckpt


def test_an_exploding_sft_stops_too(micro_run, tmp_path, capsys):
    code = cli.main(["sft", "-c", MICRO, "--set", "sft.lr=1.0e6", "--set", "sft.grad_clip=1.0e9",
                     "--set", "tracking.enabled=false", "--data", str(micro_run["data"]),
                     "--base", str(micro_run["base_model"]), "--out", str(tmp_path / "out"), "--work", str(tmp_path / "work")])
    err = capsys.readouterr().err
    assert code == 2 and "the run diverged" in err, err[-3000:]
    assert not (tmp_path / "out").exists()
    record = json.loads((tmp_path / "work" / "diverged.json").read_text())
    assert record["stage"] == "sft" and record["quantity"] in ("loss", "grad_norm"), record


@pytest.mark.parametrize(("lr", "why"), [
    # the loss climbs from 5.79 to about 24: finite, so the divergence guard passes it
    (1.0, r"the final training loss [\d.]+ \(step 11\) is not below the first step's 5\.79"),
    # the weights hardly move: the final loss (5.79) is a hair below the first step's, not below ln(320) - 0.1
    (1e-7, r"not below ln\(320\) = 5\.7683, a uniform guess over the vocabulary, by sft\.min_loss_drop_nats=0\.1"),
    # the probe saw it end finite near ln(320); here it overflows at step 1: either guard stops it
    (1e6, r"the run (diverged|learned nothing)"),
], ids=["loss-climbs", "loss-flat", "lr-1e6"])
def test_an_sft_that_learned_nothing_stops_without_output(micro_run, tmp_path, capsys, lr, why):
    code = cli.main(["sft", "-c", MICRO, "--set", f"sft.lr={lr}", "--set", "tracking.enabled=false",
                     "--data", str(micro_run["data"]), "--base", str(micro_run["base_model"]),
                     "--out", str(tmp_path / "out"), "--work", str(tmp_path / "work")])
    err = capsys.readouterr().err
    line = [x for x in err.splitlines() if x.startswith("rloo sft: error:")]
    assert code == 2 and line and re.search(why, line[0]), err[-3000:]
    assert not (tmp_path / "out").exists()
    if lr != 1e6:
        assert "the run learned nothing; no output written, its last checkpoint" in line[0], line[0]
        assert (tmp_path / "work" / "checkpoints" / "step_00000010").is_dir()  # finished work kept


@pytest.mark.parametrize("damage", ["nan-weights", "one-byte"])
def test_a_damaged_newest_checkpoint_is_passed_over(micro_run, micro_reward, tmp_path, caplog, damage):
    assert cli.main(_train(micro_run, micro_reward, tmp_path, steps=6)) == 0
    ckpts = checkpoint.complete(tmp_path / "work" / "checkpoints")
    assert [c.name for c in ckpts] == ["step_00000002", "step_00000004"]
    if damage == "nan-weights":
        _poison(ckpts[-1], rehash=True)
    else:  # one byte of the optimizer state: the file still loads, its digest no longer matches
        data = bytearray((ckpts[-1] / "optimizer.pt").read_bytes())
        data[len(data) // 2] ^= 0x01
        (ckpts[-1] / "optimizer.pt").write_bytes(bytes(data))
    (tmp_path / "out").rename(tmp_path / "first")
    with caplog.at_level("WARNING", logger="rloo"):
        assert cli.main(_train(micro_run, micro_reward, tmp_path, steps=10)) == 0
    assert json.loads((tmp_path / "work" / "timings.json").read_text())["resumed_from_step"] == 2
    why = "non-finite" if damage == "nan-weights" else "changed since it was saved"
    assert any("step_00000004" in r.getMessage() and why in r.getMessage() for r in caplog.records), caplog.text
    assert _finite(tmp_path / "out")


def test_every_checkpoint_damaged_is_a_clear_failure(micro_run, micro_reward, tmp_path, capsys):
    assert cli.main(_train(micro_run, micro_reward, tmp_path, steps=6)) == 0
    for ckpt in checkpoint.complete(tmp_path / "work" / "checkpoints"):
        _poison(ckpt, rehash=False)
    capsys.readouterr()
    code = cli.main(_train(micro_run, micro_reward, tmp_path, steps=10))
    err = capsys.readouterr().err
    assert code == 2 and "no usable checkpoint in" in err, err[-3000:]
    line = err.strip().splitlines()[-1]
    assert line.index("step_00000004: ") < line.index("step_00000002: ") and "changed since it was saved" in line, line


def test_evaluate_refuses_a_non_finite_policy_before_sampling(micro_run, tmp_path, capsys):
    bad = tmp_path / "bad"
    model = models.load_causal_lm(micro_run["sft"])
    with torch.no_grad():
        next(model.parameters()).fill_(math.inf)
    models.save_pretrained(model, models.load_tokenizer(micro_run["sft"]), bad)
    code = cli.main(["evaluate", "-c", MICRO, "--set", "tracking.enabled=false", "--data", str(micro_run["data"]),
                     "--sft", str(micro_run["sft"]), "--policy", f"rloo={bad}", "--out", str(tmp_path / "rloo.jsonl")])
    err = capsys.readouterr().err
    assert code == 2 and f"{bad}: weight" in err and "not finite" in err, err[-3000:]
    assert not (tmp_path / "rloo.jsonl").exists() and not (tmp_path / "rloo.json").exists()


def test_skipped_non_finite_steps_are_counted_then_stop(tmp_path):
    model = torch.nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    loop = TrainingLoop("rloo", 5, tmp_path / "ckpt", model, opt, None, "f", 10, max_nonfinite_steps=1)
    assert loop.finite(0, loss=1.0, grad_norm=2.0)
    assert not loop.finite(1, loss=math.nan, grad_norm=2.0) and loop.skipped_steps == 1
    with pytest.raises(NonFiniteError, match=r"step 2: grad_norm is inf"):
        loop.finite(2, loss=1.0, grad_norm=math.inf)
    assert json.loads((tmp_path / "diverged.json").read_text())["skipped_steps"] == 2
    with torch.no_grad():
        model.weight[0, 0] = math.nan
    with pytest.raises(NonFiniteError, match=r"weight model:weight"):
        loop.check_weights(3, "a checkpoint")


def test_a_missing_model_folder_names_the_stage_that_writes_it(micro_run, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)  # no results/models/reward here: the micro config's reward source
    code = cli.main(["train", "-c", MICRO, "--set", "tracking.enabled=false", "--set", "reward.source=model",
                     "--data", str(micro_run["data"]), "--policy", str(micro_run["sft"])])
    err = capsys.readouterr().err
    assert code == 2, err[-3000:]
    assert err.strip().splitlines()[-1] == ("rloo train: error: results/models/reward (reward.source=model) does not "
                                            "exist: the reward stage writes it (rloo reward, or snakemake runs it)")
    assert "Traceback" not in err and "Repo id" not in err


@pytest.mark.parametrize("failure", ["oserror", "safetensors", "permission"])
def test_a_full_disk_is_one_line_and_leaves_no_partial_output(micro_run, tmp_path, capsys, monkeypatch, failure):
    import errno

    def full_disk(model, tokenizer, folder):
        (Path(folder) / "model.safetensors").write_bytes(b"\0" * 1000)  # a partial file, then the disk is full
        if failure == "oserror":
            raise OSError(errno.ENOSPC, "No space left on device", str(Path(folder) / "model.safetensors"))
        if failure == "permission":
            raise PermissionError(errno.EACCES, "Permission denied", str(Path(folder) / "model.safetensors"))
        raise RuntimeError("Error while serializing: IoError(Os { code: 28, kind: StorageFull, message: "
                           '"No space left on device" })')  # how safetensors reports it

    monkeypatch.setattr(models, "save_pretrained", full_disk)
    out = tmp_path / "out"
    code = cli.main(["sft", "-c", MICRO, "--set", "tracking.enabled=false", "--data", str(micro_run["data"]),
                     "--base", str(micro_run["base_model"]), "--out", str(out), "--work", str(tmp_path / "work")])
    err = capsys.readouterr().err
    assert code == 2, err[-3000:]
    last = err.strip().splitlines()[-1]
    reason = "Permission denied" if failure == "permission" else "no space left on the device"
    assert last.startswith(f"rloo sft: error: could not write {out}: {reason} (") and " MiB free there); " in last, last
    assert "Traceback" not in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["work"]  # no output, no temporary sibling of it


def test_a_failed_checkpoint_write_is_one_line_and_keeps_the_older_checkpoints(micro_run, micro_reward, tmp_path,
                                                                               capsys):
    """A checkpoint whose optimizer state cannot be written (torch.save's zip stream fails, as on a full
    disk, not with an OSError): one line naming the checkpoint folder and the free space, exit 2; the
    partial folder removed, the older checkpoint kept (a rerun resumes from it), no output."""
    assert cli.main(_train(micro_run, micro_reward, tmp_path, steps=4)) == 0  # its checkpoint: step 2
    shutil.rmtree(tmp_path / "out")
    weights = (tmp_path / "work/checkpoints/step_00000002/model.safetensors").stat().st_size
    assert (tmp_path / "work/checkpoints/step_00000002/optimizer.pt").stat().st_size > 1.5 * weights
    capsys.readouterr()
    with file_size_limit(int(1.2 * weights)):  # the weights fit, the optimizer state (twice their size) does not
        code = cli.main(_train(micro_run, micro_reward, tmp_path, steps=6))  # resumes at 2, saves at 4
    err = capsys.readouterr().err
    last = err.strip().splitlines()[-1]
    ckpts = tmp_path / "work" / "checkpoints"
    assert code == 2, err[-3000:]
    assert re.fullmatch(
        rf"rloo train: error: could not write {re.escape(str(ckpts / 'step_00000004'))}: the writer failed \(.*unexpected "
        rf"pos.*\) \(\d+ MiB free there\); the partial output was removed; the older checkpoints in "
        rf"{re.escape(str(ckpts))} are kept: free some space \(or fix the file system\) and rerun", last), last
    assert "Traceback" not in err
    assert sorted(p.name for p in ckpts.iterdir()) == ["step_00000002"]  # no partial step_00000004, nor its temporary
    assert not (tmp_path / "out").exists()
    assert cli.main(_train(micro_run, micro_reward, tmp_path, steps=6)) == 0  # space again: the rerun resumes
    assert json.loads((tmp_path / "work" / "timings.json").read_text())["resumed_from_step"] == 2


@pytest.mark.slow
def test_a_diverged_run_is_recorded_in_mlflow(micro_run, micro_reward, tmp_path):
    """Tracked (a real SQLite store, the stage in its own process, as Snakemake runs it): the stage's
    run ends FAILED with the tag rloo.diverged and the metric rloo/diverged_at_step."""
    import os
    import subprocess
    import sys

    from mlflow import MlflowClient

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    argv = _train(micro_run, micro_reward, tmp_path, "rloo.lr=1.0e6", "rloo.grad_clip=1.0e9", steps=10)
    argv[argv.index("tracking.enabled=false")] = "tracking.enabled=true"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MLFLOW_", "RLOO_MLFLOW"))}
    res = subprocess.run([sys.executable, "-m", "rloo_workflow.cli", *argv], env={**env, "MLFLOW_TRACKING_URI": uri},
                         capture_output=True, text=True, timeout=600)
    assert res.returncode == 2 and "the run diverged" in res.stderr, res.stderr[-3000:]
    client = MlflowClient(uri)
    [run] = client.search_runs([e.experiment_id for e in client.search_experiments()])
    step = json.loads((tmp_path / "work" / "diverged.json").read_text())["step"]
    assert run.info.status == "FAILED" and run.data.tags["rloo.diverged"].startswith(f"step {step}: ")
    assert [m.value for m in client.get_metric_history(run.info.run_id, "rloo/diverged_at_step")] == [step]
