"""One-step off-policy RLOO (`rloo.off_policy_steps: 1`, rloo/train/off_policy.py) on the micro model: a
run with its sampler in a process of its own is, to the bit, the sequential emulation of its schedule
written out here (the batch of step t sampled with a copy of the weights after t - 1 updates, then the
update, corrected by token_tis at cap 2); the update weights each token by the ratio to the lagged
sampler; a run resumed from a checkpoint ends with the same bytes."""

from __future__ import annotations

import copy
import json
import shutil
from pathlib import Path

import pytest
import torch
from model_helpers import LengthReward
from safetensors.torch import load_file
from workflow_helpers import same_weights

from rloo.algo import rloo_update
from rloo.data.gsm8k import read_split
from rloo.model import checkpoint, models
from rloo.reward.rewards import build_reward
from rloo.rollout import make_rollout
from rloo.rollout.collect import training_prompts
from rloo.runtime import setup
from rloo.settings import Config
from rloo.train.rloo_trainer import RlooTrainer
from rloo_workflow.stages import rloo as rloo_stage

# As tests/integration/test_rloo_update.py: float32 on the micro policy, the trainer's chunked head and
# shared prompt passes against one plain forward pass round apart by ~1e-7.
ATOL, RTOL = 2e-6, 1e-4
ROOT = Path(__file__).resolve().parents[2]


def _cfg(micro_run, **rloo) -> dict:
    """The micro config on the micro reward model (its scores have spread: every step moves the weights),
    without validation evaluations."""
    cfg = json.loads(json.dumps(micro_run["cfg"]))
    cfg["reward"]["source"] = "model"
    cfg["rloo"].update({"steps": 5, "lr": 3e-3, "warmup_steps": 0, "eval_every": 0, "select": "last",
                        "checkpoint_every": 2, **rloo})
    return cfg


def _off_policy(cfg: dict, sampler_threads: int = 1) -> dict:
    cfg = json.loads(json.dumps(cfg))
    cfg["rloo"]["off_policy_steps"] = 1
    cfg["rollout"]["sampler_threads"] = sampler_threads
    return cfg


def _steps(folder) -> list[dict]:
    return [json.loads(line) for line in (folder / "steps.jsonl").read_text().splitlines()]


def _emulate(cfg: dict, micro_run, reward_dir) -> tuple[RlooTrainer, list[dict]]:
    """The schedule of rloo.off_policy_steps 1 in one process, from parts of a synchronous trainer: the batch
    of step t is sampled by a copy of the policy that holds the weights after t - 1 updates (the
    starting weights for steps 0 and 1), then the trainer updates on it with token_tis at cap 2."""
    cfg = json.loads(json.dumps(cfg))
    cfg["rloo"]["rollout_correction"] = {"mode": "token_tis", "cap": 2.0}
    config = Config.from_config(cfg)
    setup(config.threads, config.seed)
    rows = training_prompts(read_split(micro_run["data"], "train"), config.rloo.min_solution_steps)
    trainer = RlooTrainer(config, micro_run["sft"], build_reward(cfg, str(reward_dir)), rows)
    lagged = copy.deepcopy(trainer.policy)
    trainer.batches.rollout = make_rollout(config, config.seed, micro_run["sft"], lagged)
    history = []
    for step in range(config.rloo.steps):
        got = trainer.batches.collect(step)
        lagged.load_state_dict(trainer.policy.state_dict())  # the weights after `step` updates sample step + 1
        history.append(trainer.update(step, got))
    return trainer, history


@pytest.mark.slow
def test_an_off_policy_run_equals_its_sequential_emulation_to_the_bit(micro_run, micro_reward, tmp_path):
    cfg = _cfg(micro_run)
    summary = rloo_stage.run(_off_policy(cfg), micro_run["data"], micro_run["sft"], tmp_path / "out", tmp_path / "w",
                             micro_reward)
    facts = json.loads((tmp_path / "w" / "timings.json").read_text())
    assert facts["sampler"] == "process" and facts["sampler_threads"] == 1, facts  # it did run beside the trainer
    assert summary["off_policy"]["mode"] == "token_tis" and summary["sampling_mismatch"] is None
    trainer, history = _emulate(cfg, micro_run, micro_reward)
    run = _steps(tmp_path / "out")
    assert [r["train/policy_lag"] for r in run] == [0, 1, 1, 1, 1]
    for got, want in zip(run, history, strict=True):
        # the emulation is a synchronous trainer: its sampler-to-trainer figures are the run's train/offpolicy_*
        want = {k.replace("train/mismatch_", "train/offpolicy_"): v for k, v in want.items() if not k.startswith("time/")}
        assert {k: got[k] for k in want} == want
    assert run[-1]["train/offpolicy_k3_token"] > 1e-6  # the lag is there: later weights than the sampler's
    out = models.load_causal_lm(tmp_path / "out").state_dict()
    mine = trainer.policy.state_dict()
    assert out.keys() == mine.keys() and all(torch.equal(out[k], mine[k]) for k in out)
    sft = models.load_causal_lm(micro_run["sft"]).state_dict()
    assert max(float((out[k] - sft[k]).abs().max()) for k in sft) > 1e-3  # it trained


def _gradient(trainer: RlooTrainer, step: int, got) -> dict[str, torch.Tensor]:
    """The gradient the trainer's update of `got` hands the optimizer (its guard sees it; the step is skipped)."""
    grads: dict[str, torch.Tensor] = {}

    def capture(step: int, **quantities: float) -> bool:
        grads.update({n: p.grad.detach().clone() for n, p in trainer.policy.named_parameters() if p.grad is not None})
        return False

    trainer.guard = capture
    trainer.update(step, got)
    return grads


def test_the_update_weights_each_token_by_its_ratio_to_the_lagged_sampler(micro_run):
    """Step 2 samples with the weights after step 0 (W1) and updates the weights after step 1 (W2): its
    gradient is the reference update's with w_t = min(π_W2(y_t) / π_W1(y_t), 2), π_W1 computed here by
    one plain forward pass of a copy of W1."""
    cfg = _cfg(micro_run, k=4, prompts_per_step=4, max_new_tokens=8, lr=3e-2, beta=0.5, grad_clip=1e9)
    cfg["model"]["autocast"] = "none"  # float32: the comparison is about the weights, not bf16 rounding
    cfg = _off_policy(cfg, sampler_threads=0)  # the emulation in this process: the policies are at hand
    rows = [r for r in training_prompts(read_split(micro_run["data"], "train"), 0)]
    trainer = RlooTrainer(cfg, micro_run["sft"], LengthReward(), rows)
    trainer.step(0)
    w1 = copy.deepcopy(trainer.policy)
    trainer.step(1)
    got = trainer.collect(2)
    ro, r = got.rollout, cfg["rloo"]
    assert float(got.scores.std()) > 0, "degenerate fixture: no reward spread, so no gradient"
    args = (ro.prompt_ids, ro.prompt_mask, ro.completions, ro.completion_mask)
    with torch.no_grad():
        lagged = rloo_update.token_logprobs(w1, *args)
        logp_ref = rloo_update.token_logprobs(trainer.reference, *args)
    trainer.policy.zero_grad(set_to_none=True)
    logp = rloo_update.token_logprobs(trainer.policy, *args)
    m = ro.completion_mask
    # the batch was sampled with W1 (its recorded log-probabilities are W1's), and W2 is far from it
    assert float((ro.logprobs - lagged)[m].abs().max()) < 1e-4
    assert float((logp.detach() - lagged)[m].abs().mean()) > 1e-2

    def reference_gradient(sampler_logp: torch.Tensor) -> dict[str, torch.Tensor]:
        trainer.policy.zero_grad(set_to_none=True)
        lp = rloo_update.token_logprobs(trainer.policy, *args)
        rloo_update.rloo_loss(lp, logp_ref, m, got.scores, r["k"], r["beta"], sampler_logp=sampler_logp,
                            cap=2.0).backward()
        out = {n: p.grad.detach().clone() for n, p in trainer.policy.named_parameters() if p.grad is not None}
        trainer.policy.zero_grad(set_to_none=True)
        return out

    want = reference_gradient(lagged)
    unweighted = reference_gradient(logp.detach())  # the current weights' log-probabilities: w_t = 1
    have = _gradient(trainer, 2, got)
    assert have.keys() == want.keys() and want
    assert max(float((want[n] - unweighted[n]).abs().max()) for n in want) > 100 * ATOL  # the ratio matters here
    for name in want:
        torch.testing.assert_close(have[name], want[name], atol=ATOL, rtol=RTOL, msg=lambda s, n=name: f"{n}: {s}")


@pytest.mark.slow
def test_an_off_policy_run_resumed_from_its_checkpoint_ends_with_the_same_bytes(micro_run, micro_reward, tmp_path):
    cfg = _off_policy(_cfg(micro_run, rollout_correction={"mismatch_every": 2}))

    def run(out, work):
        return rloo_stage.run(cfg, micro_run["data"], micro_run["sft"], tmp_path / out, tmp_path / work, micro_reward)

    run("full", "w_full")
    ck = checkpoint.latest(tmp_path / "w_full" / "checkpoints")
    assert ck is not None and ck.name == "step_00000004" and (ck / "lagged.safetensors").is_file()
    # the batch of step 4 in flight at the checkpoint was sampled with the weights after 3 updates: the
    # checkpoint's lagged weights are those, not its own
    lagged, own = (load_file(str(ck / f)) for f in ("lagged.safetensors", "model.safetensors"))
    assert any(not torch.equal(lagged[k], own[k]) for k in lagged)
    shutil.copytree(ck, tmp_path / "w_dead" / "checkpoints" / ck.name)
    resumed = run("resumed", "w_dead")
    assert resumed["resumed_from_step"] == 4
    assert same_weights(tmp_path / "full", tmp_path / "resumed")
    for name in ("steps.jsonl", "metrics.json"):
        assert (tmp_path / "resumed" / name).read_bytes() == (tmp_path / "full" / name).read_bytes(), name
    # the mismatch was measured every 2 steps and the lag at step 0 is none at all
    steps = _steps(tmp_path / "full")
    assert [s["step"] for s in steps if "train/mismatch_k3_token" in s] == [0, 2, 4]
    assert steps[0]["train/lag_abs_max"] == 0.0 and steps[2]["train/lag_k3_token"] > 0


@pytest.mark.slow
def test_reward_functions_of_a_file_score_in_the_sampler_process(micro_run, tmp_path):
    """A reward function given as path/to/file.py:function is scored by the sampler process (which runs the
    file again: its module cannot be imported there by name), with the same figures as inline."""
    cfg = _cfg(micro_run, steps=3)
    cfg["reward"] = {**cfg["reward"], "source": "function", "functions": [
        {"name": "shorter", "fn": f"{ROOT / 'tests' / 'helpers' / 'reward_functions.py'}:shorter", "weight": 1.0,
         "max_failed_share": 0.0}]}
    for threads in (1, 0):
        rloo_stage.run(_off_policy(cfg, threads), micro_run["data"], micro_run["sft"], tmp_path / f"out{threads}",
                       tmp_path / f"w{threads}")
    facts = json.loads((tmp_path / "w1" / "timings.json").read_text())
    assert facts["sampler"] == "process", facts  # not the fallback to inline sampling
    assert json.loads((tmp_path / "w0" / "timings.json").read_text())["sampler"] == "inline"
    steps = (tmp_path / "out1" / "steps.jsonl").read_text()
    assert '"train/reward/shorter"' in steps and steps == (tmp_path / "out0" / "steps.jsonl").read_text()


@pytest.mark.slow
@pytest.mark.parametrize("variant", ["ppo", "lora"])
def test_ppo_and_lora_run_off_policy_with_the_same_bytes_in_a_sampler_process_as_inline(variant, micro_run, micro_reward,
                                                                                        tmp_path):
    """PPO shares the batches and the correction; under LoRA the sampler holds the base model and receives
    the adapters alone."""
    cfg = _cfg(micro_run, steps=3, **({"estimator": "ppo"} if variant == "ppo" else {}))
    if variant == "lora":
        cfg["model"]["lora"]["enabled"] = True
    for threads in (1, 0):
        rloo_stage.run(_off_policy(cfg, threads), micro_run["data"], micro_run["sft"], tmp_path / f"out{threads}",
                       tmp_path / f"w{threads}", micro_reward)
    assert json.loads((tmp_path / "w1" / "timings.json").read_text())["sampler"] == "process"
    for name in ("model.safetensors", "steps.jsonl"):
        assert (tmp_path / "out1" / name).read_bytes() == (tmp_path / "out0" / name).read_bytes(), name
    assert not same_weights(tmp_path / "out1", micro_run["sft"])  # it trained


def test_a_reward_that_does_not_pickle_samples_inline_and_says_so(micro_run, tmp_path, caplog):
    """rloo.api.train_rloo with a notebook's lambda as the reward: no process can be handed it, so the
    lagged batches are sampled in the trainer's process (one warning), the same bytes as asked for inline."""
    from rloo.api import train_rloo
    from rloo.settings import Config

    cfg = _cfg(micro_run, steps=2)
    cfg["reward"]["source"] = "verifier"
    rows = training_prompts(read_split(micro_run["data"], "train"), 0)
    shorter = lambda completions, **kw: [-len(c) / 50.0 for c in completions]  # noqa: E731
    with caplog.at_level("WARNING", logger="rloo.train"):
        for threads in (1, 0):
            config = Config.from_config(_off_policy(cfg, threads))
            train_rloo(micro_run["sft"], rows, tmp_path / f"out{threads}", reward=shorter, config=config)
    assert sum("the training reward does not pickle" in r.message for r in caplog.records) == 1
    assert json.loads((tmp_path / "out1.work" / "timings.json").read_text())["sampler"] == "inline"
    for name in ("model.safetensors", "steps.jsonl"):
        assert (tmp_path / "out1" / name).read_bytes() == (tmp_path / "out0" / name).read_bytes(), name
