"""PPO with a learned critic: the method RLOO is measured against, as an estimator of the same stage.

Same sampling (B prompts x k samples at T = 1), reward, frozen reference, evaluation, checkpoints and
resume as the critic-free estimators (`rloo.estimator: ppo`). What differs, per batch:

    r_t   = -beta * kl_t on every response token, + the score on the last one  (losses.token_rewards)
    V_t   = the critic's value of the state before token t                       (a separate network)
    A_t   = GAE(r, V; gamma, lambda), whitened; R_t = A_t + V_t                  (estimators.gae, eq. 7)
    then `ppo.epochs` passes over `ppo.minibatches` minibatches: the clipped-ratio policy loss on A_t
    (token mean; each token's surrogate times the rollout correction's w_t under
    rloo.rollout_correction) and the clipped value loss on R_t, each network with its own optimizer.

With tools (rloo/rollout/tools.py) "response token" above means the policy's own (`policy_tokens`): a
tool's forced token has no reward, no advantage, no value target and no term in either loss; GAE bridges a
forced span (the action before it bootstraps from the value before the next policy token).
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from pathlib import Path

import torch

from rloo.algo.estimators import gae, whiten
from rloo.algo.losses import approx_kl, policy_loss, token_kl, token_rewards, value_loss
from rloo.model import distributed, microbatch, models
from rloo.model.logprobs import SeqBatch, join
from rloo.reward.rewards import RewardSource
from rloo.rollout import Rollout
from rloo.rollout.collect import Collected
from rloo.runtime import autocast, step_generator
from rloo.settings import Config
from rloo.train.policy_trainer import PolicyTrainer, policy_tokens
from rloo.train.step_metrics import ppo_update_metrics
from rloo.train.step_records import MinibatchUpdate, PpoAdvantages, PpoRows, PpoUpdates


class PPOTrainer(PolicyTrainer):
    """The shared trainer (rloo/train/policy_trainer.py) plus a critic: one PPO iteration per `step()`."""

    # A group whose k rewards are equal still carries signal here (R_t - V_t is not zero), so the share of
    # such groups, which rises as PPO's policy sharpens (0.62-0.67 in the comparison run), is no alarm.
    alarms_not_applicable = ("zero_signal",)

    def __init__(self, config: Config | Mapping, policy_dir: str | Path, reward: RewardSource, train: list[dict],
                 critic_dir: str | Path, source: str = "the rows handed in") -> None:
        super().__init__(config, policy_dir, reward, train, source)
        self.critic = models.load_critic(critic_dir, **models.load_options(self.mc), trainable=True)
        self.critic.config.pad_token_id = self.tokenizer.pad_token_id
        self.critic_optimizer = torch.optim.AdamW(self.critic.parameters(), lr=self.rc.ppo.critic_lr,
                                                  weight_decay=self.rc.weight_decay)

    def companions(self) -> dict[str, tuple[torch.nn.Module, torch.optim.Optimizer]]:
        return {"critic": (self.critic, self.critic_optimizer)}

    def networks(self) -> dict[str, int]:
        return {**super().networks(), "critic": models.count_parameters(self.critic)}

    def _micro(self, batch: SeqBatch, rows: torch.Tensor) -> list[tuple[torch.Tensor, SeqBatch]]:
        """A minibatch's rows in micro-batches under rloo.micro_batch_tokens: (rows, their batch) each;
        one micro-batch is the minibatch itself, at its full width."""
        mb = batch.select(rows)
        parts = self.parts(mb)
        if len(parts) == 1:
            return [(rows, mb)]
        return [(rows[part.rows.to(rows.device)], microbatch.sub_batch(mb, part.rows)) for part in parts]

    def values(self, batch: SeqBatch) -> torch.Tensor:
        """[B, T] the critic's value of the state before each completion token (aligned with log-probs)."""
        with autocast(self.mc.autocast, self.device):
            out = self.critic(input_ids=batch.input_ids, attention_mask=batch.attention_mask,
                              position_ids=batch.position_ids, use_cache=False)
        return out.logits[:, batch.prompt_len - 1 : -1, 0].float()

    def update(self, step: int, got: Collected, t0: float | None = None) -> dict:
        """One PPO iteration on the scored groups `got`, in named steps as RLOO's update: the rows in fixed
        minibatches with the log-probabilities and values before any update, the per-token advantages,
        then `ppo.epochs` passes of policy and critic updates; then the step's metrics."""
        t0 = time.perf_counter() if t0 is None else t0
        t_score = time.perf_counter()
        rows = self._ppo_rows(step, got.rollout)
        t_ref = time.perf_counter()
        # The sampler-trainer mismatch and, under rloo.rollout_correction, the weights of the surrogate.
        correction = self.correction(got.rollout, rows.old_lp, rows.mask, got.trainer_logprobs)
        adv = self._ppo_advantages(got.scores, rows)
        lr = self.scheduler.get_last_lr()[0]
        updates = self._ppo_updates(step, rows, adv, correction.weights)
        self.scheduler.step()
        self.rollout.sync_weights(self.policy)
        t_upd = time.perf_counter()
        metrics = {**ppo_update_metrics(step, got, rows, adv, updates, lr, self.rc.k), **correction.metrics}
        return self._complete(metrics, got, (t0, t_score, t_ref, t_upd))

    def _ppo_rows(self, step: int, ro: Rollout) -> PpoRows:
        """The step's rows in fixed minibatches (their order changes by epoch), each in micro-batches under
        rloo.micro_batch_tokens, and the reference's and policy's log-probabilities and the critic's
        values before any update, computed on exactly the batches the updates see: the first update's
        ratio is exactly 1 and its value clip inactive (other batch shapes round differently in bf16)."""
        batch = join(ro.prompt_ids, ro.prompt_mask, ro.completions, ro.completion_mask)
        mask = policy_tokens(ro, batch)  # with tools, a forced token is neither an action nor a value target
        g = step_generator(self.seed, step, stream=31)  # resume-exact
        minibatches = torch.randperm(len(mask), generator=g).to(self.device).chunk(self.rc.ppo.minibatches)
        micro = [self._micro(batch, rows) for rows in minibatches]
        ref_lp, old_lp, old_values = (torch.zeros_like(mask) for _ in range(3))
        with torch.no_grad():
            for parts in micro:
                for rows, mb in parts:
                    n = mb.completion_len
                    with autocast(self.mc.autocast, self.device):
                        with self.reference_model() as reference:  # under LoRA: the policy, adapters off
                            ref_lp[rows, :n] = self._logprobs(reference, mb, self.chunk_rows)[0]
                        old_lp[rows, :n] = self._logprobs(self.policy, mb, self.chunk_rows)[0]
                    old_values[rows, :n] = self.values(mb)
        return PpoRows(ro, mask, minibatches, micro, g, ref_lp, old_lp, old_values)

    def _ppo_advantages(self, scores: torch.Tensor, rows: PpoRows) -> PpoAdvantages:
        """r_t = -β kl_t (+ the score on the last token), A_t = GAE(r, V), whitened; R_t = A_t + V_t. A
        sample without a reward (NaN) is left out of both losses rather than trained on a made-up 0."""
        rc, ppo, mask = self.rc, self.rc.ppo, rows.mask
        valid = torch.isfinite(scores)
        kl = token_kl(rows.old_lp, rows.ref_lp, rc.kl_estimator) * mask
        rewards = token_rewards(torch.where(valid, scores, torch.zeros_like(scores)), kl, mask, rc.beta)
        adv, returns = gae(rewards, rows.old_values, mask, ppo.gamma, ppo.lam)
        train_mask = mask * valid[:, None].to(mask.dtype)
        if ppo.whiten_advantages:
            adv = whiten(adv, train_mask)
        return PpoAdvantages(kl, adv, returns, train_mask)

    def _ppo_updates(self, step: int, rows: PpoRows, adv: PpoAdvantages, weights: torch.Tensor | None) -> PpoUpdates:
        """`ppo.epochs` passes over the minibatches (the first in order, then shuffled), each a policy
        update on the clipped surrogate (token mean) and a critic update on the clipped value loss."""
        ppo = self.rc.ppo
        out = PpoUpdates(n_updates=ppo.epochs * ppo.minibatches)
        adv_abs_max = float(adv.advantages.abs().max())  # for the finiteness guard of every minibatch update
        for epoch in range(ppo.epochs):
            order = range(len(rows.micro)) if epoch == 0 else torch.randperm(len(rows.micro), generator=rows.g).tolist()
            for j in order:
                out.add(self._minibatch_update(step, rows, adv, weights, j, adv_abs_max, first_epoch=epoch == 0))
        return out

    def _minibatch_update(self, step: int, rows: PpoRows, adv: PpoAdvantages, weights: torch.Tensor | None, j: int,
                          adv_abs_max: float, first_epoch: bool) -> MinibatchUpdate:
        """Minibatch `j`: its loss a token mean over all of its micro-batches' tokens; the policy's
        optimizer step (when the guard allows), then the critic's."""
        rc, micro, train_mask = self.rc, rows.micro[j], adv.train_mask
        tokens = float(train_mask[rows.minibatches[j]].sum())
        denominator = None if len(micro) == 1 else tokens
        upd = MinibatchUpdate(tokens=tokens)
        for part_rows, mb in micro:
            n = mb.completion_len
            m = train_mask[part_rows, :n]
            lp, ent = self._policy_pass(mb, torch.arange(len(part_rows), device=self.device))
            loss, st = policy_loss(lp, m, adv.advantages[part_rows, :n], norm="token",
                                   old_token_logp=rows.old_lp[part_rows, :n], clip_eps=rc.clip_eps,
                                   denominator=denominator, weights=None if weights is None else weights[part_rows, :n])
            loss.backward()
            part = float(m.sum())
            upd.clipped += float(st["clip_frac"]) * part
            upd.kl += float(approx_kl(lp, rows.old_lp[part_rows, :n], m)) * part
            upd.loss += float(loss.detach())
            if first_epoch:  # the entropy of the policy that sampled (before this batch's updates)
                upd.entropies.append(float((ent * rows.mask[part_rows, :n]).sum() / rows.mask.sum().clamp(min=1)))
        upd.grad_norm = float(distributed.clip_grad_norm_(self.policy.parameters(), rc.grad_clip))
        if self.guard(step, loss=upd.loss, grad_norm=upd.grad_norm, kl=upd.kl, advantages=adv_abs_max):
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        for part_rows, mb in micro:
            n = mb.completion_len
            m = train_mask[part_rows, :n]
            vloss, vst = value_loss(self.values(mb), rows.old_values[part_rows, :n], adv.returns[part_rows, :n], m,
                                    rc.ppo.value_clip, denominator=denominator)
            vloss.backward()
            upd.value_loss += float(vloss.detach())
            upd.value_clipped += float(vst["value_clip_frac"]) * float(m.sum())
        distributed.clip_grad_norm_(self.critic.parameters(), rc.grad_clip)
        self.critic_optimizer.step()
        self.critic_optimizer.zero_grad(set_to_none=True)
        return upd
