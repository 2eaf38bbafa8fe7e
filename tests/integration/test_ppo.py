"""PPO beside RLOO: GAE, the per-token rewards, the policy and value losses against direct computations,
and a micro PPO run of the RLOO stage (`rloo.estimator: ppo`) that trains, checkpoints its critic and
resumes bit-identically."""

from __future__ import annotations

import json
import math
import shutil

import pytest
import torch
from workflow_helpers import same_weights

from rloo.algo.estimators import gae, whiten
from rloo.algo.losses import explained_variance, policy_loss, token_rewards, value_loss
from rloo.model import checkpoint, models
from rloo.reward.rewards import build_reward
from rloo.rollout.collect import training_prompts
from rloo.train.rloo import make_trainer
from rloo_workflow.stages import rloo as rloo_stage


def test_gae_on_a_hand_computed_trajectory():
    # One response of 3 tokens, rewards (0, 0, 1), values (0.5, 0.6, 0.7), gamma 1, lambda 0.5:
    #   delta_2 = 1 - 0.7 = 0.3                 A_2 = 0.3
    #   delta_1 = 0 + 0.7 - 0.6 = 0.1           A_1 = 0.1 + 0.5 * 0.3 = 0.25
    #   delta_0 = 0 + 0.6 - 0.5 = 0.1           A_0 = 0.1 + 0.5 * 0.25 = 0.225
    # and a second response of 2 tokens (then padding), rewards (0, 2), values (1, 1), gamma 0.9:
    #   delta_1 = 2 - 1 = 1 -> A_1 = 1;  delta_0 = 0 + 0.9 * 1 - 1 = -0.1 -> A_0 = -0.1 + 0.45 * 1 = 0.35
    rewards = torch.tensor([[0.0, 0.0, 1.0], [0.0, 2.0, 9.0]])
    values = torch.tensor([[0.5, 0.6, 0.7], [1.0, 1.0, 9.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    adv, ret = gae(rewards[:1], values[:1], mask[:1], gamma=1.0, lam=0.5)
    assert adv.tolist()[0] == pytest.approx([0.225, 0.25, 0.3])
    assert ret.tolist()[0] == pytest.approx([0.725, 0.85, 1.0])
    adv, _ = gae(rewards[1:], values[1:], mask[1:], gamma=0.9, lam=0.5)
    assert adv.tolist()[0] == pytest.approx([0.35, 1.0, 0.0])  # padding gets 0, its reward is ignored


def test_gae_with_gamma_and_lambda_one_is_return_minus_value():
    g = torch.Generator().manual_seed(0)
    rewards, values = torch.randn(4, 7, generator=g), torch.randn(4, 7, generator=g)
    mask = (torch.arange(7)[None] < torch.tensor([7, 5, 1, 3])[:, None]).float()
    adv, ret = gae(rewards, values, mask, gamma=1.0, lam=1.0)
    future = torch.flip(torch.cumsum(torch.flip(rewards * mask, [1]), 1), [1])  # sum_{s >= t} r_s
    assert torch.allclose(adv, (future - values) * mask, atol=1e-6)
    assert torch.allclose(ret, future * mask, atol=1e-6)


def test_gae_bridges_a_span_off_the_mask_as_if_it_were_not_there():
    """A tool's forced tokens (rloo/rollout/tools.py) are off PPO's mask inside a response: no action, no
    value target (0 there), and the action before the span bootstraps from the value after it. So GAE on a
    row with holes equals GAE on the row with the holes cut out, at the policy's tokens; and the score
    goes to the last policy token, not to the mask's count."""
    g = torch.Generator().manual_seed(3)
    rewards, values = torch.randn(3, 9, generator=g), torch.randn(3, 9, generator=g)
    mask = torch.tensor([[1, 1, 0, 0, 1, 1, 0, 1, 0],  # two forced spans, then padding
                         [1, 0, 0, 1, 1, 1, 1, 1, 1],
                         [1, 1, 1, 1, 0, 0, 0, 0, 0]], dtype=torch.float32)  # a forced run at the end
    for gamma, lam in ((1.0, 0.95), (0.9, 0.5)):
        adv, ret = gae(rewards, values, mask, gamma=gamma, lam=lam)
        for row in range(3):
            on = mask[row].bool()
            want_adv, want_ret = gae(rewards[row, on][None], values[row, on][None], torch.ones(1, int(on.sum())),
                                     gamma=gamma, lam=lam)
            assert torch.allclose(adv[row, on], want_adv[0], atol=1e-6), (row, gamma)
            assert torch.allclose(ret[row, on], want_ret[0], atol=1e-6), (row, gamma)
            assert bool((adv[row, ~on] == 0).all() and (ret[row, ~on] == 0).all())
    r = token_rewards(torch.tensor([1.0, 2.0, 3.0]), torch.zeros(3, 9), mask, beta=0.1)
    assert [int(r[i].nonzero()[0]) for i in range(3)] == [7, 8, 3]


def test_token_rewards_sum_to_the_shaped_sequence_reward():
    g = torch.Generator().manual_seed(1)
    kl = torch.randn(3, 6, generator=g)
    mask = (torch.arange(6)[None] < torch.tensor([6, 2, 4])[:, None]).float()
    scores, beta = torch.tensor([1.0, 0.0, -0.5]), 0.05
    r = token_rewards(scores, kl, mask, beta)
    assert torch.allclose(r.sum(1), scores - beta * (kl * mask).sum(1), atol=1e-6)
    assert (r * (1 - mask)).abs().max() == 0  # nothing on padding
    assert r[1, 1] == pytest.approx(-beta * float(kl[1, 1]) + 0.0) and r[0, 5] == pytest.approx(1.0 - beta * float(kl[0, 5]))


def test_ppo_policy_loss_against_a_direct_computation():
    g = torch.Generator().manual_seed(2)
    logp = torch.randn(3, 5, generator=g, requires_grad=True)
    old = logp.detach() + 0.3 * torch.randn(3, 5, generator=g)
    adv = torch.randn(3, 5, generator=g)
    mask = (torch.arange(5)[None] < torch.tensor([5, 3, 1])[:, None]).float()
    loss, stats = policy_loss(logp, mask, adv, norm="token", old_token_logp=old, clip_eps=0.2)
    ratio = torch.exp(logp - old)
    surrogate = torch.minimum(ratio * adv, ratio.clamp(0.8, 1.2) * adv)
    direct = -((surrogate + adv * (old - 1.0)) * mask).sum() / mask.sum()
    assert loss.item() == pytest.approx(direct.item(), abs=1e-6)
    (g1,) = torch.autograd.grad(loss, logp)
    (g2,) = torch.autograd.grad(direct, logp)
    assert torch.allclose(g1, g2, atol=1e-6) and g1.abs().sum() > 0
    clipped = ((adv > 0) & (ratio > 1.2)) | ((adv < 0) & (ratio < 0.8))
    assert stats["clip_frac"].item() == pytest.approx(float((clipped * mask).sum() / mask.sum()))


def test_value_loss_and_explained_variance_against_a_direct_computation():
    values = torch.tensor([[0.0, 1.0, 2.0], [0.5, 0.5, 0.0]], requires_grad=True)
    old = torch.tensor([[0.0, 0.5, 2.5], [0.0, 1.0, 0.0]])
    returns = torch.tensor([[1.0, 1.0, 1.0], [0.0, 2.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    loss, stats = value_loss(values, old, returns, mask, clip_eps=0.2)
    clipped = old + (values.detach() - old).clamp(-0.2, 0.2)
    err, err_c = (values.detach() - returns) ** 2, (clipped - returns) ** 2
    direct = 0.5 * (torch.maximum(err, err_c) * mask).sum() / mask.sum()
    assert loss.item() == pytest.approx(direct.item())
    assert stats["value_clip_frac"].item() == pytest.approx(float(((err_c > err) * mask).sum() / mask.sum()))
    assert explained_variance(returns, returns, mask).item() == pytest.approx(1.0)
    flat = torch.full_like(returns, float((returns * mask).sum() / mask.sum()))
    assert explained_variance(flat, returns, mask).item() == pytest.approx(0.0, abs=1e-6)


def test_whiten_is_zero_mean_unit_variance_on_the_mask():
    x = torch.tensor([[1.0, 2.0, 3.0], [4.0, 100.0, 100.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]])
    w = whiten(x, mask)
    vals = w[mask.bool()]
    assert vals.mean().item() == pytest.approx(0.0, abs=1e-6) and (vals**2).mean().item() == pytest.approx(1.0, abs=1e-4)
    assert w[1, 1] == 0 and w[1, 2] == 0


def _ppo_cfg(micro_run, **rloo):
    cfg = json.loads(json.dumps(micro_run["cfg"]))
    cfg["reward"]["source"] = "model"  # the micro reward model: scores with spread, so the policy moves
    cfg["rloo"].update({"estimator": "ppo", "steps": 4, "checkpoint_every": 2, "eval_every": 2, "eval_examples": 4,
                        "lr": 1e-3, **rloo})
    cfg["rloo"]["ppo"].update({"epochs": 2, "minibatches": 2, "critic_lr": 1e-3})
    return cfg


@pytest.mark.slow
def test_ppo_run_trains_policy_and_critic_and_resumes_bit_identically(micro_run, micro_reward, tmp_path):
    cfg = _ppo_cfg(micro_run)

    def run(out, work):
        return rloo_stage.run(cfg, micro_run["data"], micro_run["sft"], tmp_path / out, tmp_path / work, micro_reward)

    summary = run("full", "w_full")
    assert summary["estimator"] == "ppo" and summary["steps_trained"] == 4
    nets = summary["networks"]
    assert set(nets) == {"policy", "reference", "reward_model", "critic"} and nets["critic"] > 0
    steps = [json.loads(x) for x in (tmp_path / "full" / "steps.jsonl").read_text().splitlines()]
    for key in ("ppo/value_loss", "ppo/explained_variance", "ppo/value_clip_frac", "ppo/policy_clip_frac",
                "ppo/approx_kl", "train/kl", "train/reward_mean", "train/zero_adv_frac"):
        assert all(math.isfinite(s[key]) for s in steps), key
    assert steps[0]["train/kl"] == pytest.approx(0.0, abs=1e-6)  # the policy starts as the reference
    assert any(s["ppo/approx_kl"] > 0 for s in steps)  # the epochs after the first moved the policy
    sft = models.load_causal_lm(micro_run["sft"]).state_dict()
    full = models.load_causal_lm(tmp_path / "full").state_dict()
    assert max(float((full[k] - sft[k]).abs().max()) for k in sft) > 1e-4  # the policy trained
    ck = checkpoint.latest(tmp_path / "w_full" / "checkpoints")
    assert ck is not None and (ck / "critic.safetensors").is_file() and (ck / "critic_optimizer.pt").is_file()
    critic0 = models.load_critic(micro_run["sft"]).state_dict()
    from safetensors.torch import load_file

    critic = load_file(str(ck / "critic.safetensors"))
    moved = [k for k in critic if k in critic0 and not k.startswith("score") and not torch.equal(critic[k], critic0[k])]
    assert moved, "the critic's backbone trained"
    # Killed after the step-2 checkpoint: the rerun resumes (critic and its optimizer included) and
    # ends with the same weights as the uninterrupted run.
    shutil.copytree(ck, tmp_path / "w_dead" / "checkpoints" / ck.name)
    resumed = run("resumed", "w_dead")
    assert resumed["resumed_from_step"] == 2
    assert same_weights(tmp_path / "full", tmp_path / "resumed")
    assert (tmp_path / "resumed" / "steps.jsonl").read_text() == (tmp_path / "full" / "steps.jsonl").read_text()


def test_ppo_settings_do_not_rerun_the_critic_free_estimators(micro_run):
    from rloo_workflow.pipeline import stage_config

    cfg = json.loads(json.dumps(micro_run["cfg"]))
    assert "ppo" not in stage_config(cfg, "rloo", {"rloo.estimator": "rloo"})["rloo"]
    assert stage_config(cfg, "rloo", {"rloo.estimator": "ppo"})["rloo"]["ppo"]["lam"] == 0.95


def test_ppo_trains_on_the_groups_dynamic_sampling_keeps(micro_run):
    from test_dynamic_sampling import ScriptedReward, _cfg, _rows

    from rloo.train.ppo import PPOTrainer

    cfg = _cfg(micro_run, estimator="ppo")
    plain = PPOTrainer({**cfg, "rloo": {**cfg["rloo"], "dynamic_sampling": False}}, micro_run["sft"],
                       ScriptedReward(), _rows(micro_run), micro_run["sft"])
    dynamic = PPOTrainer(cfg, micro_run["sft"], ScriptedReward(), _rows(micro_run), micro_run["sft"])
    before, after = plain.step(0), dynamic.step(0)
    assert before["train/zero_adv_frac"] > 0  # the scripted reward leaves most groups without signal
    assert after["train/zero_adv_frac"] == 0 and after["train/dynamic_dropped_frac"] > 0
    assert math.isfinite(after["ppo/value_loss"])


def test_a_single_update_starts_at_ratio_one(micro_run, micro_reward):
    from rloo.io import read_jsonl
    from rloo.reward.rewards import build_reward
    from rloo.rollout.collect import training_prompts
    from rloo.train.ppo import PPOTrainer

    cfg = _ppo_cfg(micro_run)
    cfg["rloo"]["ppo"].update({"epochs": 1, "minibatches": 1})
    rows = training_prompts([r for _, r in read_jsonl(micro_run["data"] / "train.jsonl")], 0)
    trainer = PPOTrainer(cfg, micro_run["sft"], build_reward(cfg, str(micro_reward)), rows, micro_run["sft"])
    m = trainer.step(0)
    # One update: it sees exactly the log-probabilities and values the advantages were computed with
    # (the ratio is 1, no value is clipped), and at step 0 the policy is the reference (KL 0).
    assert m["ppo/approx_kl"] == 0.0 and m["ppo/policy_clip_frac"] == 0.0 and m["ppo/value_clip_frac"] == 0.0
    assert m["train/kl"] == 0.0


def test_a_critic_grown_from_the_reward_model_reuses_its_head(micro_run, micro_reward, tmp_path):
    from safetensors.torch import load_file

    cfg = _ppo_cfg(micro_run, steps=1, eval_every=0, select="last")
    cfg["rloo"]["ppo"]["critic_init"] = "reward_model"
    trainer = make_trainer(cfg, micro_run["sft"], build_reward(cfg, str(micro_reward)),
                                 training_prompts([{"question": "q", "answer": "a\n#### 1"}] * 8, 0), micro_reward)
    head = load_file(str(micro_reward / "model.safetensors"))["score.weight"]
    assert torch.equal(trainer.critic.score.weight.detach(), head)  # the reward model's scalar head, per position
    with pytest.raises(Exception, match="critic_init=reward_model"):
        make_trainer(cfg, micro_run["sft"], build_reward(cfg, str(micro_reward)),
                           [{"question": "q", "answer": "a\n#### 1"}] * 8, None)
