import json

import pytest

from rloo.model import checkpoint, models
from rloo.train import sft as sft_run
from rloo_workflow.stages import sft


def test_sft_smoke_writes_a_loadable_policy(micro_run):
    out = micro_run["sft"]
    metrics = json.loads((out / "metrics.json").read_text())
    for key in ("accuracy", "accuracy_sampled", "accuracy_flexible", "final_loss"):
        assert key in metrics
    # Wall-clock figures live beside the checkpoints, not in the output (a rerun writes it byte for byte).
    assert "train_seconds" not in metrics
    assert "train_seconds" in json.loads((micro_run["base"] / "work" / "sft" / "timings.json").read_text())
    history = json.loads((out / "history.json").read_text())
    assert history[0]["sft/loss"] > history[-1]["sft/loss"]
    tok = models.load_tokenizer(out)
    model = models.load_causal_lm(out)
    assert len(tok) == model.config.vocab_size
    # The intermediate checkpoints live outside the output folder, so Snakemake never deletes them.
    assert not (out / "checkpoints").exists()


def test_batches_depend_only_on_seed_and_step():
    import numpy as np

    lengths = np.random.default_rng(0).integers(10, 100, size=500)
    a = [sft_run.batch_indices(lengths, s, 16, seed=1).tolist() for s in range(40)]
    b = [sft_run.batch_indices(lengths, s, 16, seed=1).tolist() for s in range(40)]
    assert a == b
    first_epoch = sorted(i for batch in a[: 500 // 16] for i in batch)
    assert len(first_epoch) == len(set(first_epoch))  # an epoch visits each example at most once


def test_sft_resume_from_checkpoint_is_exact(tmp_path, micro_run):
    import shutil

    import torch

    cfg = micro_run["cfg"]
    cfg = {**cfg, "sft": {**cfg["sft"], "steps": 6, "checkpoint_every": 3, "eval_examples": 2}}
    sft.run(cfg, micro_run["data"], micro_run["base_model"], tmp_path / "full", tmp_path / "w_full")
    # A run that died after its step-3 checkpoint: its work folder holds only that checkpoint.
    (tmp_path / "w_dead" / "checkpoints").mkdir(parents=True)
    ck = checkpoint.latest(tmp_path / "w_full" / "checkpoints")
    assert ck is not None and ck.name == "step_00000003"
    shutil.copytree(ck, tmp_path / "w_dead" / "checkpoints" / ck.name)
    metrics = sft.run(cfg, micro_run["data"], micro_run["base_model"], tmp_path / "resumed", tmp_path / "w_dead")
    assert metrics["resumed_from_step"] == 3
    assert json.loads((tmp_path / "w_dead" / "timings.json").read_text())["resumed_from_step"] == 3
    for f in ("metrics.json", "history.json"):  # outputs a function of their inputs: no run fact in them
        assert (tmp_path / "resumed" / f).read_bytes() == (tmp_path / "full" / f).read_bytes(), f
    a = models.load_causal_lm(tmp_path / "full").state_dict()
    b = models.load_causal_lm(tmp_path / "resumed").state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_corrupt_checkpoint_is_a_clear_error(tmp_path, micro_run):
    ck = tmp_path / "w" / "checkpoints" / "step_00000003"
    ck.mkdir(parents=True)
    (ck / "checkpoint.json").write_text('{"step": 3}')
    (ck / "model.safetensors").write_bytes(b"not a safetensors file")
    (ck / "optimizer.pt").write_bytes(b"junk")
    with pytest.raises(checkpoint.CheckpointError, match="step_00000003: corrupt checkpoint"):
        sft.run(micro_run["cfg"], micro_run["data"], micro_run["base_model"], tmp_path / "out", tmp_path / "w")
    assert not (tmp_path / "out").exists()


def test_checkpoint_of_other_settings_is_refused(tmp_path, micro_run):
    import shutil

    cfg = micro_run["cfg"]
    cfg = {**cfg, "sft": {**cfg["sft"], "steps": 4, "checkpoint_every": 2, "eval_examples": 2}}
    sft.run(cfg, micro_run["data"], micro_run["base_model"], tmp_path / "a", tmp_path / "w")
    shutil.rmtree(tmp_path / "a")
    other = {**cfg, "sft": {**cfg["sft"], "lr": cfg["sft"]["lr"] * 2}}
    with pytest.raises(checkpoint.CheckpointError, match="other settings or data"):
        sft.run(other, micro_run["data"], micro_run["base_model"], tmp_path / "a", tmp_path / "w")
    assert not (tmp_path / "a").exists()
