"""Sampler against trainer (rloo.algo.rollout_correction): the mismatch metrics, the correction modes,
the exact-gradient check on the bandit, and both inside a real RLOO step on the micro policy."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from rloo.algo import bandit
from rloo.algo import estimators as est
from rloo.algo.rollout_correction import MODES, correction_weights, mismatch_metrics, weighted_advantages
from rloo.io import read_jsonl
from rloo.stages import train as rloo_stage

MISMATCH_KEYS = {"train/mismatch_abs_mean", "train/mismatch_abs_max", "train/mismatch_k3_token",
                 "train/mismatch_k3_seq", "train/mismatch_out_of_band"}


def _logits_and_tokens(seed: int = 0, rows: int = 64, width: int = 12, vocab: int = 50):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(rows, width, vocab, generator=g) * 2
    tokens = torch.distributions.Categorical(logits=logits / 1.2).sample()
    mask = torch.arange(width)[None] < torch.randint(3, width + 1, (rows, 1), generator=g)
    return logits, tokens, mask


def _token_logp(logits: torch.Tensor, tokens: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    return torch.log_softmax(logits / temperature, -1).gather(-1, tokens[..., None]).squeeze(-1)


def test_a_sampler_identical_to_the_trainer_shows_no_mismatch_and_no_correction():
    logits, tokens, mask = _logits_and_tokens()
    lp = _token_logp(logits, tokens)
    m = mismatch_metrics(lp, lp.clone(), mask, cap=2.0)
    assert set(m) == MISMATCH_KEYS and all(v == 0.0 for v in m.values()), m
    adv = torch.randn(len(lp))
    for mode in MODES:
        w, stats = correction_weights(lp, lp.clone(), mask, mode, 2.0)
        assert torch.equal(w, mask.float()), mode  # a no-op: every weight 1 on the completion's tokens
        assert all(v == 0.0 for v in stats.values()), (mode, stats)
        assert torch.equal(weighted_advantages(adv, w) * mask, adv[:, None] * mask)


def test_a_temperature_perturbed_sampler_is_detected():
    logits, tokens, mask = _logits_and_tokens()
    trainer, sampler = _token_logp(logits, tokens), _token_logp(logits, tokens, temperature=1.2)
    m = mismatch_metrics(trainer, sampler, mask, cap=1.1)
    assert m["train/mismatch_out_of_band"] > 0.3 and m["train/mismatch_k3_token"] > 0.01, m
    assert m["train/mismatch_k3_seq"] > m["train/mismatch_k3_token"]  # a sum over a sequence's tokens
    # k3 is a KL estimate: never negative, per token
    assert m["train/mismatch_abs_max"] >= m["train/mismatch_abs_mean"] > 0
    # each mode acts on it: truncation below the cap, masks of 0/1 only where the mask is on
    for mode in MODES[1:]:
        w, stats = correction_weights(trainer, sampler, mask, mode, 1.1)
        assert (w[~mask] == 0).all() and (w <= 1.1 + 1e-6).all(), mode
        assert next(iter(stats.values())) > 0, (mode, stats)
        if mode.endswith("mask"):
            assert set(w.unique().tolist()) <= {0.0, 1.0}


def test_the_weights_are_constants():
    logits, tokens, mask = _logits_and_tokens()
    trainer = _token_logp(logits.requires_grad_(), tokens)
    sampler = _token_logp(logits.detach(), tokens, temperature=1.2)
    w, _ = correction_weights(trainer, sampler, mask, "token_tis", 2.0)
    assert not w.requires_grad
    # the loss -Σ w A log π has the gradient of w-weighted REINFORCE, not one through w
    adv = weighted_advantages(torch.ones(len(tokens)), w)
    (-(adv * trainer * mask).sum()).backward()
    expected = torch.autograd.grad(-(w * _token_logp(logits, tokens) * mask).sum(), logits)[0]
    assert torch.allclose(logits.grad, expected)


def _bandit_gradients(mode: str, n: int = 40_000, k: int = 4, temperature: float = 1.6, cap: float = 50.0):
    """Mean RLOO gradient over n groups sampled from the bandit's policy at `temperature` while the
    gradient is the T = 1 policy's, corrected by `mode`, and the exact on-policy gradient."""
    b = bandit.make_bandit(0)
    pi, pi_s = bandit.softmax(b.logits), bandit.softmax(b.logits / temperature)
    rng = np.random.default_rng(1)
    actions = bandit.sample_actions(pi_s, (n, k), rng)
    rewards = bandit.sample_rewards(b.q, actions, rng)
    adv = est.compute_advantages("rloo", torch.from_numpy(rewards)).advantages
    trainer = torch.from_numpy(np.log(pi[actions])).reshape(-1, 1)
    sampler = torch.from_numpy(np.log(pi_s[actions])).reshape(-1, 1)
    w, _ = correction_weights(trainer, sampler, torch.ones_like(trainer, dtype=torch.bool), mode, cap)
    corrected = weighted_advantages(adv.reshape(-1), w).reshape(n, k).numpy()
    grads = bandit.score_function_gradients(pi, actions, corrected)
    return grads.mean(0), bandit.exact_gradient(b.logits, b.q)


@pytest.mark.parametrize("mode", ["token_tis", "sequence_tis"])
def test_on_the_bandit_the_corrected_gradient_is_closer_to_the_exact_one(mode):
    uncorrected, exact = _bandit_gradients("none")
    corrected, _ = _bandit_gradients(mode)
    off, on = np.linalg.norm(uncorrected - exact), np.linalg.norm(corrected - exact)
    assert on < 0.5 * off, (on, off)
    # with the cap binding hard, truncation trades the bias back in: worse than a loose cap
    tight, _ = _bandit_gradients(mode, cap=1.05)
    assert np.linalg.norm(tight - exact) > on


class LengthReward:
    """A reward with spread on the micro policy (which the verifier pays 0 for everything)."""

    name = "length"

    def score(self, prompts, completions, golds, finished):
        return torch.tensor([-len(c) / 50.0 for c in completions])


def _trainer(micro_run, **rloo):
    cfg = json.loads(json.dumps(micro_run["cfg"]))
    cfg["rloo"].update({"k": 2, **rloo})
    rows = [r for _, r in read_jsonl(micro_run["data"] / "train.jsonl")]
    return rloo_stage.Trainer(cfg, micro_run["sft"], LengthReward(), rows)


def test_an_rloo_step_logs_the_mismatch_and_the_hf_sampler_agrees_with_the_trainer(micro_run):
    t = _trainer(micro_run)
    m = t.step(0)
    assert set(m) >= MISMATCH_KEYS, sorted(m)
    # float32, the same weights: the sampling pass's own log-probabilities are the trainer's
    assert m["train/mismatch_abs_max"] < 1e-4 and m["train/mismatch_out_of_band"] == 0.0, m
    # the sampler at T = 1.2 while the trainer's log-probabilities are at T = 1: seen at once
    hot = _trainer(micro_run, temperature=1.2).step(0)
    assert hot["train/mismatch_abs_mean"] > 100 * m["train/mismatch_abs_mean"] and hot["train/mismatch_k3_token"] > 0


def test_the_correction_is_a_no_op_when_sampler_and_trainer_agree(micro_run):
    plain, corrected = _trainer(micro_run), _trainer(micro_run, rollout_correction={"mode": "token_tis", "cap": 2.0})
    m = corrected.step(0)
    plain.step(0)
    assert m["train/correction_truncated_share"] == 0.0
    for a, b in zip(plain.policy.parameters(), corrected.policy.parameters(), strict=True):
        assert torch.allclose(a, b, atol=1e-6, rtol=0), "the correction changed an update it should leave alone"
    # and it acts when they do not: a hot sampler's step is truncated and moves the weights differently
    hot = _trainer(micro_run, temperature=1.2, rollout_correction={"mode": "token_mask", "cap": 1.1}).step(0)
    assert hot["train/correction_masked_share"] > 0


@pytest.mark.parametrize("lean", [True, False])
def test_recording_the_samplers_log_probabilities_changes_no_sample(micro_run, lean):
    """The default chain stays bit for bit: asking the HF loops for log-probabilities draws the same tokens."""
    from rloo.model import models
    from rloo.rollout.hf import generate

    model, tok = models.load_causal_lm(micro_run["sft"]), models.load_tokenizer(micro_run["sft"])
    prompts = [tok("Question: 3 apples and 4 more?\nAnswer:")["input_ids"]] * 3 + [tok("Question: 7 - 2?")["input_ids"]]
    kw = {"max_new_tokens": 12, "eos_id": tok.eos_token_id, "pad_id": tok.pad_token_id, "temperature": 1.0,
          "top_p": 0.9, "lean": lean}
    plain = generate(model, prompts, generator=torch.Generator().manual_seed(3), **kw)
    with_lp = generate(model, prompts, generator=torch.Generator().manual_seed(3), logprobs=True, **kw)
    assert plain.logprobs is None and torch.equal(plain.completions, with_lp.completions)
    assert torch.equal(plain.completion_mask, with_lp.completion_mask)
    lp = with_lp.logprobs
    assert lp.shape == with_lp.completions.shape and (lp[with_lp.completion_mask.bool()] <= 0).all()
    assert (lp[~with_lp.completion_mask.bool()] == 0).all()
