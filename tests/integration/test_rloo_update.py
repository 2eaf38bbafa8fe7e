"""The trainer's RLOO update (rloo/train/rloo_trainer.py: shared prompt passes, duplicate rows read once,
micro-batches, the chunked head) has the gradient of the method's plain update (rloo/algo/rloo_update.py)
on the same samples, for both normalisations and the KL in the reward or in the loss."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from model_helpers import LengthReward
from test_microbatch import _budget_for_parts, _cfg, _rows

from rloo.algo import rloo_update
from rloo.model.logprobs import join
from rloo.train.rloo_trainer import RlooTrainer

# Float32 on the micro policy: the chunked head and the micro-batches round differently from one full
# forward pass (measured max |diff| ~1e-7 against gradient entries of ~1e-2); a wrong normaliser or a
# dropped KL term moves entries by 1e-3 or more.
ATOL, RTOL = 2e-6, 1e-4


def _perturbed_trainer(cfg: dict, micro_run) -> RlooTrainer:
    """A trainer whose policy has moved off its reference, so the KL (and its term) is not zero."""
    trainer = RlooTrainer(cfg, micro_run["sft"], LengthReward(), _rows(micro_run))
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in trainer.policy.parameters():
            p.add_(0.02 * torch.randn(p.shape, generator=g))
    return trainer


def _trainer_gradient(trainer: RlooTrainer, got) -> tuple[dict[str, torch.Tensor], dict]:
    """The gradient the trainer's update hands the optimizer (its guard sees it; the step is skipped),
    and the step's metrics."""
    grads: dict[str, torch.Tensor] = {}

    def capture(step: int, **quantities: float) -> bool:
        grads.update({n: p.grad.detach().clone() for n, p in trainer.policy.named_parameters() if p.grad is not None})
        return False

    trainer.guard = capture
    metrics = trainer.update(0, got)
    return grads, metrics


def _plain_gradient(trainer: RlooTrainer, got, cfg: dict) -> dict[str, torch.Tensor]:
    r, ro = cfg["rloo"], got.rollout
    trainer.policy.zero_grad(set_to_none=True)
    with torch.no_grad():
        logp_ref = rloo_update.token_logprobs(trainer.reference, ro.prompt_ids, ro.prompt_mask, ro.completions,
                                            ro.completion_mask)
    logp = rloo_update.token_logprobs(trainer.policy, ro.prompt_ids, ro.prompt_mask, ro.completions, ro.completion_mask)
    loss = rloo_update.rloo_loss(logp, logp_ref, ro.completion_mask, got.scores, r["k"], r["beta"],
                               norm=r["loss_norm"], kl_in=r["kl_in"], kl=r["kl_estimator"])
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in trainer.policy.named_parameters() if p.grad is not None}
    trainer.policy.zero_grad(set_to_none=True)
    return grads


@pytest.mark.parametrize("micro_batches", [False, True], ids=["one-pass", "micro-batches"])
@pytest.mark.parametrize("kl_in", ["reward", "loss"])
@pytest.mark.parametrize("norm", ["sequence", "token"])
def test_the_trainers_update_has_the_plain_updates_gradient(micro_run, norm, kl_in, micro_batches):
    cfg = _cfg(micro_run, loss_norm=norm, kl_in=kl_in, beta=0.5, kl_estimator="k3" if kl_in == "loss" else "k1")
    trainer = _perturbed_trainer(cfg, micro_run)
    if micro_batches:
        # the trainer reads its own frozen copy of the section: the budget goes there
        trainer.rc = dataclasses.replace(trainer.rc, micro_batch_tokens=_budget_for_parts(trainer, 0, 3))
    got = trainer.collect(0)
    ro = got.rollout
    batch = join(ro.prompt_ids, ro.prompt_mask, ro.completions, ro.completion_mask)
    parts = len(trainer.parts(batch.select(batch.distinct_rows[0])))
    assert parts >= 2 if micro_batches else parts == 1, parts
    assert float(got.scores.std()) > 0, "degenerate fixture: no reward spread, so no gradient"
    want = _plain_gradient(trainer, got, cfg)
    have, metrics = _trainer_gradient(trainer, got)
    assert abs(metrics["train/kl"]) > 1e-3, "the policy is its reference: the KL term is not exercised"
    assert have.keys() == want.keys() and want
    assert max(float(g.abs().max()) for g in want.values()) > 1e-4  # a step that moves something
    for name in want:
        torch.testing.assert_close(have[name], want[name], atol=ATOL, rtol=RTOL, msg=lambda m, n=name: f"{n}: {m}")


@pytest.mark.parametrize("micro_batches", [False, True], ids=["one-pass", "micro-batches"])
def test_the_trainers_corrected_update_has_the_plain_updates_gradient(micro_run, micro_batches):
    """rloo.rollout_correction token_tis: the trainer weights each token by min(π/π_sampler, C) as the
    reference does, through its duplicate rows and micro-batches. The sampler's log-probabilities are
    moved off the trainer's (a sampler that disagrees), so that the weights range over (0, C]."""
    # temperature 1: the sampler is the policy (at _cfg's 0.1 its log-probs are far above the trainer's)
    cfg = _cfg(micro_run, beta=0.5, temperature=1.0, rollout_correction={"mode": "token_tis", "cap": 1.5})
    trainer = _perturbed_trainer(cfg, micro_run)
    if micro_batches:
        # the trainer reads its own frozen copy of the section: the budget goes there
        trainer.rc = dataclasses.replace(trainer.rc, micro_batch_tokens=_budget_for_parts(trainer, 0, 3))
    got = trainer.collect(0)
    ro = got.rollout
    g = torch.Generator().manual_seed(1)
    ro.logprobs = ro.logprobs + 0.5 * torch.randn(ro.logprobs.shape, generator=g) * ro.completion_mask
    assert float(got.scores.std()) > 0, "degenerate fixture: no reward spread, so no gradient"
    r = cfg["rloo"]
    trainer.policy.zero_grad(set_to_none=True)
    with torch.no_grad():
        logp_ref = rloo_update.token_logprobs(trainer.reference, ro.prompt_ids, ro.prompt_mask, ro.completions,
                                            ro.completion_mask)
    logp = rloo_update.token_logprobs(trainer.policy, ro.prompt_ids, ro.prompt_mask, ro.completions, ro.completion_mask)
    rloo_update.rloo_loss(logp, logp_ref, ro.completion_mask, got.scores, r["k"], r["beta"],
                        sampler_logp=ro.logprobs, cap=1.5).backward()
    want = {n: p.grad.detach().clone() for n, p in trainer.policy.named_parameters() if p.grad is not None}
    trainer.policy.zero_grad(set_to_none=True)
    have, metrics = _trainer_gradient(trainer, got)
    assert 0 < metrics["train/correction_truncated_share"] < 1 and metrics["train/mismatch_abs_mean"] > 0.1
    assert have.keys() == want.keys() and want
    for name in want:
        torch.testing.assert_close(have[name], want[name], atol=ATOL, rtol=RTOL, msg=lambda m, n=name: f"{n}: {m}")
