"""The RLOO trainer: `update` is one step of RLOO or another critic-free estimator on the scored groups.

Per step: sample k completions for each of B prompts at T = 1 and score them (`collect`, shared with PPO in
rloo/train/policy_trainer.py; with `rloo.dynamic_sampling`, only groups whose rewards differ, refilled from
further prompts: rloo/rollout/collect.py), shape the reward with the sequence KL to the reference, turn
rewards into advantages with the configured estimator, and take one (or a few, ratio-clipped) optimizer
steps on -mean_i A_i log π(y_i). PPO's trainer (rloo/train/ppo.py) shares the policy, the sampling and the
rest with it through `PolicyTrainer`, and has its own advantage and update.

Beside it: the settings it refuses (preflight.py), the records the update's named steps hand on
(step_records.py), the rollout correction (correction.py) and the step's metrics (step_metrics.py).
"""

from __future__ import annotations

import time

import numpy as np
import torch

from rloo.algo.estimators import compute_advantages
from rloo.algo.losses import kl_loss_term, policy_loss, sequence_kl, shaped_reward
from rloo.model import distributed, microbatch
from rloo.model.logprobs import SeqBatch, join
from rloo.rollout import Rollout
from rloo.rollout.collect import Collected
from rloo.runtime import autocast
from rloo.train.policy_trainer import PolicyTrainer, policy_tokens
from rloo.train.step_metrics import update_metrics
from rloo.train.step_records import GradientStep, StepAdvantages, StepRows


class RlooTrainer(PolicyTrainer):
    """RLOO and the critic-free estimators: `update` shapes each sample's reward with its sequence KL,
    turns the rewards into advantages by `rloo.estimator` and takes the policy-gradient step(s)."""

    def _generate(self, prompts: list[list[int]], **kwargs) -> Rollout:
        return self.batches.generate(prompts, **kwargs)

    def _score(self, idx: np.ndarray, ro: Rollout, repeat: int) -> tuple[torch.Tensor, list[str]]:
        return self.batches.score(idx, ro, repeat)

    def _greedy_baseline(self, idx: np.ndarray) -> torch.Tensor:
        """ReMax: the shaped reward of each prompt's greedy completion."""
        with distributed.gathered(self.policy):
            ro = self._generate([self.prompt_ids[i] for i in idx], greedy=True, **self.batches.tool_arguments(idx, 1))
            scores, _ = self._score(idx, ro, 1)
            batch = join(ro.prompt_ids, ro.prompt_mask, ro.completions, ro.completion_mask)
            with torch.no_grad(), autocast(self.mc.autocast, self.device):
                lp = self._logprobs(self.policy, batch, self.chunk_rows)[0]
                with self.reference_model() as reference:
                    lp_ref = self._logprobs(reference, batch, self.chunk_rows)[0]
        kl = sequence_kl(lp, lp_ref, policy_tokens(ro, batch), self.rc.kl_estimator)
        return shaped_reward(scores, kl, self.rc.beta) if self.rc.kl_in == "reward" else scores

    def _reference_logprobs(self, batch: SeqBatch, parts: list[microbatch.Part]) -> torch.Tensor:
        """The frozen reference's token log-probabilities of `batch`, a micro-batch at a time."""
        with torch.no_grad(), autocast(self.mc.autocast, self.device), self.reference_model() as reference:
            if len(parts) == 1:
                return self._logprobs(reference, batch, self.chunk_rows)[0]
            return microbatch.no_grad_map(
                [p.rows for p in parts if p.weight],
                lambda rows: self._logprobs(reference, microbatch.sub_batch(batch, rows), self.chunk_rows)[0],
                len(batch.completion_mask), (batch.completion_len,), batch.completion_mask)

    def _old_policy_pass(self, batch: SeqBatch, parts: list[microbatch.Part]) -> tuple[torch.Tensor, torch.Tensor]:
        """The policy's token log-probabilities and entropies before the update, a micro-batch at a time
        without gradient, each through the very computation its gradient pass repeats (so a first
        ratio-clipped update starts at ratio 1)."""
        width, n = batch.completion_len, len(batch.completion_mask)
        lp, ent = (batch.completion_mask.new_zeros((n, width)) for _ in range(2))
        with torch.no_grad(), distributed.gathered(self.policy):
            for part in (p for p in parts if p.weight):
                sub = microbatch.sub_batch(batch, part.rows)
                got_lp, got_ent = self._policy_pass(sub, torch.arange(len(part.rows), device=self.device))
                lp[part.rows, : got_lp.shape[1]], ent[part.rows, : got_ent.shape[1]] = got_lp, got_ent
        return lp, ent

    def update(self, step: int, got: Collected, t0: float | None = None) -> dict:
        """The update of step `step` on the scored groups `got` (what `collect(step)` returned), in three
        named steps: the rows' log-probabilities, the advantages of their KL-shaped rewards, and the
        policy-gradient pass (micro-batched under rloo.micro_batch_tokens), each token's term weighted
        by the rollout correction (`correction`; none by default); then the step's metrics."""
        t0 = time.perf_counter() if t0 is None else t0
        greedy = self._greedy_baseline(got.idx) if self.rc.estimator == "remax" else None
        t_score = time.perf_counter()
        rows = self._step_rows(got.rollout)
        t_ref = time.perf_counter()
        self._policy_logprobs(rows)
        correction = self.correction(rows.rollout, rows.old_lp, rows.mask, got.trainer_logprobs)
        adv = self._advantages(got.scores, rows, greedy)
        lr = self.scheduler.get_last_lr()[0]  # the rate this step's updates use
        grad = self._policy_gradient(step, rows, adv, correction.weights)
        self.scheduler.step()
        self.rollout.sync_weights(self.policy)  # rollout backend (issue 8): in-place push; no-op for hf
        t_upd = time.perf_counter()
        metrics = {**update_metrics(step, got, rows, adv, grad, lr), **correction.metrics}
        return self._complete(metrics, got, (t0, t_score, t_ref, t_upd))

    def _step_rows(self, ro: Rollout) -> StepRows:
        """The step's rows, their distinct rows in micro-batches, and the reference's log-probabilities.

        Samples of a prompt are often the very same completion (a peaked policy): the forward passes run
        once per distinct row, and every copy reads its log-probabilities. Exact: copies have the same
        log-probabilities, KL and shaped reward, and the gradient through the shared row is the sum over
        its copies."""
        batch = join(ro.prompt_ids, ro.prompt_mask, ro.completions, ro.completion_mask)
        first, inverse = self.distinct_rows(batch)
        distinct = batch.select(first) if len(first) < len(inverse) else batch
        parts = self.parts(distinct)
        ref_lp = self._reference_logprobs(distinct, parts)[inverse]
        return StepRows(ro, policy_tokens(ro, batch), distinct, first, inverse, parts, ref_lp)

    def distinct_rows(self, batch: SeqBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """(each distinct row's index, each row's distinct row): the rows the forward passes run on."""
        return batch.distinct_rows

    def _policy_logprobs(self, rows: StepRows) -> None:
        """The policy's log-probabilities before the update (`old_lp`) and its entropies. One micro-batch:
        one pass with gradient, kept for the first update (`lp`). Several: a pass without gradient, each
        micro-batch's gradient pass comes later. The policy stays in eval mode (no dropout): before the
        first update it gives exactly the reference's log-probabilities, so the measured KL starts at 0."""
        if rows.one_pass:
            rows.lp, rows.token_ent = self._policy_pass(rows.distinct, rows.inverse)
            rows.old_lp = rows.lp.detach()
        else:
            old_d, ent_d = self._old_policy_pass(rows.distinct, rows.parts)
            rows.old_lp, rows.token_ent = old_d[rows.inverse], ent_d[rows.inverse]

    def _advantages(self, scores: torch.Tensor, rows: StepRows, greedy: torch.Tensor | None) -> StepAdvantages:
        """R̃_i = r_i - β KL_i (β here only under `kl_in: reward`), then A from R̃ by the configured
        estimator (rloo: A_i = R̃_i - mean_{j≠i} R̃_j)."""
        rc = self.rc
        seq_kl = sequence_kl(rows.old_lp, rows.ref_lp, rows.mask, rc.kl_estimator)
        shaped = shaped_reward(scores, seq_kl, rc.beta if rc.kl_in == "reward" else 0.0)
        adv = compute_advantages(rc.estimator, shaped.view(-1, rc.k), state=self.baseline,
                                 greedy_rewards=greedy, decay=rc.moving_average_decay)
        if adv.state is not None:
            self.baseline = adv.state
        return StepAdvantages(seq_kl, shaped, adv.advantages.reshape(-1), adv.zero_adv_frac, adv.n_degenerate_groups)

    def _policy_gradient(self, step: int, rows: StepRows, adv: StepAdvantages,
                         weights: torch.Tensor | None = None) -> GradientStep:
        """rloo.updates_per_batch optimizer steps on L = (1/D) Σ_i A_i ℓ_i (+ β KL in the loss under
        `kl_in: loss`), ℓ_i = -Σ_t w_it log π(y_it) or its ratio-clipped form (w: the rollout
        correction's constant weights, or none), D the step's responses
        (`sequence`) or response tokens (`token`). One normaliser: D is this process's rows or tokens;
        data-parallel, the loss is also multiplied by W·D/D_all (`distributed.loss_scale`), so that the
        ranks' averaged gradients are those of L over all D_all rows or tokens."""
        rc = self.rc
        mask = rows.mask
        denominator = float(mask.sum()) if rc.loss_norm == "token" else float(len(mask))
        scale = distributed.loss_scale(denominator) if distributed.enabled() else 1.0
        # One micro-batch holds every row: the loss's own mean over them is the same normaliser D.
        step_denominator = None if rows.one_pass else denominator
        clipped = rc.updates_per_batch > 1

        def loss_of(lp: torch.Tensor, sel: torch.Tensor | slice, width: int) -> tuple[torch.Tensor, dict[str, float]]:
            """The loss of the step's rows `sel`, whose log-probabilities with gradient are `lp`, and
            how many of their tokens the ratio clipped."""
            m = mask[sel, :width]
            loss, stats = policy_loss(lp, m, adv.advantages[sel], norm=rc.loss_norm,
                                      old_token_logp=rows.old_lp[sel, :width] if clipped else None,
                                      clip_eps=rc.clip_eps, denominator=step_denominator,
                                      weights=None if weights is None else weights[sel, :width])
            if rc.kl_in == "loss":
                loss = loss + kl_loss_term(lp, rows.ref_lp[sel, :width], m, rc.beta, rc.kl_estimator,
                                           rc.loss_norm, denominator=step_denominator)
            return loss * scale, {"clipped_tokens": float(stats["clip_frac"]) * float(m.sum())}

        def micro_loss(part_rows: torch.Tensor) -> tuple[torch.Tensor, dict[str, float]]:
            """A micro-batch of distinct rows: its gradient pass, read by every copy of its rows."""
            sub = microbatch.sub_batch(rows.distinct, part_rows)
            sel, at = microbatch.copies(rows.inverse, part_rows)
            return loss_of(self._policy_pass(sub, at)[0], sel, sub.completion_len)

        clip_frac, grad_norm, loss_value = 0.0, 0.0, 0.0
        for update in range(rc.updates_per_batch):
            if rows.one_pass:
                if update > 0:  # (the entropy logged stays the sampling policy's, as with micro-batches)
                    rows.lp, _ = self._policy_pass(rows.distinct, rows.inverse)
                loss, counts = loss_of(rows.lp, slice(None), mask.shape[1])
                loss.backward()
                loss_value = float(loss.detach())
            else:
                loss_value, counts = microbatch.accumulate(self.policy_train, rows.parts, micro_loss)
            grad_norm = float(distributed.clip_grad_norm_(self.policy.parameters(), rc.grad_clip))
            if self.guard(step, loss=loss_value, grad_norm=grad_norm, kl=float(adv.seq_kl.mean()),
                          advantages=float(adv.advantages.abs().max())):
                self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
            clip_frac += counts.get("clipped_tokens", 0.0) / max(float(mask.sum()), 1.0) / rc.updates_per_batch
        return GradientStep(loss_value, grad_norm, clip_frac)
