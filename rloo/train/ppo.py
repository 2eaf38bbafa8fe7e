"""PPO with a learned critic: the method RLOO is measured against, as an estimator of the same stage.

Same sampling (B prompts x k samples at T = 1), reward, frozen reference, evaluation, checkpoints and
resume as the critic-free estimators (`rloo.estimator: ppo`). What differs, per batch:

    r_t   = -beta * kl_t on every response token, + the score on the last one  (losses.token_rewards)
    V_t   = the critic's value of the state before token t                       (a separate network)
    A_t   = GAE(r, V; gamma, lambda), whitened; R_t = A_t + V_t                  (estimators.gae, eq. 7)
    then `ppo.epochs` passes over `ppo.minibatches` minibatches: the clipped-ratio policy loss on A_t
    (token mean; each token's surrogate times the rollout correction's w_t under
    rloo.rollout_correction) and the clipped value loss on R_t, each network with its own optimizer.
"""

from __future__ import annotations

import math
import time
from pathlib import Path

import torch

from rloo.algo.estimators import gae, whiten
from rloo.algo.losses import approx_kl, explained_variance, policy_loss, token_kl, token_rewards, value_loss
from rloo.model import microbatch, models
from rloo.model.logprobs import SeqBatch, join
from rloo.reward.rewards import RewardSource
from rloo.rollout.collect import has_signal
from rloo.runtime import autocast, step_generator
from rloo.train.rloo import Trainer


class PPOTrainer(Trainer):
    """`Trainer` plus a critic: one PPO iteration per `step()`."""

    # A group whose k rewards are equal still carries signal here (R_t - V_t is not zero), so the share of
    # such groups, which rises as PPO's policy sharpens (0.62-0.67 in the comparison run), is no alarm.
    alarms_not_applicable = ("zero_signal",)

    def __init__(self, cfg: dict, policy_dir: str | Path, reward: RewardSource, train: list[dict],
                 critic_dir: str | Path) -> None:
        super().__init__(cfg, policy_dir, reward, train)
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

    def step(self, step: int) -> dict:
        rc, ppo = self.rc, self.rc.ppo
        t0 = time.perf_counter()
        got = self.collect(step)  # the same groups RLOO would train on (dynamic sampling included)
        ro, scores = got.rollout, got.scores
        t_score = time.perf_counter()

        batch = join(ro.prompt_ids, ro.prompt_mask, ro.completions, ro.completion_mask)
        mask = batch.completion_mask
        # Fixed minibatches for the step (their order changes by epoch), each in micro-batches under
        # rloo.micro_batch_tokens: the log-probabilities and values before any update are computed on
        # exactly the batches the updates see, so the first update's ratio is exactly 1 and its value
        # clip inactive (other batch shapes round differently in bf16).
        g = step_generator(self.seed, step, stream=31)  # resume-exact
        minibatches = torch.randperm(len(mask), generator=g).to(self.device).chunk(ppo.minibatches)
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
        t_ref = time.perf_counter()
        # The sampler-trainer mismatch and, under rloo.rollout_correction, the weights of the surrogate.
        correction = self.correction(ro, old_lp, mask)
        weights = correction.weights

        valid = torch.isfinite(scores)
        kl = token_kl(old_lp, ref_lp, rc.kl_estimator) * mask
        rewards = token_rewards(torch.where(valid, scores, torch.zeros_like(scores)), kl, mask, rc.beta)
        adv, returns = gae(rewards, old_values, mask, ppo.gamma, ppo.lam)
        # A sample without a reward (NaN) is left out of both losses rather than trained on a made-up 0.
        train_mask = mask * valid[:, None].to(mask.dtype)
        if ppo.whiten_advantages:
            adv = whiten(adv, train_mask)
        adv_abs_max = float(adv.abs().max())  # for the finiteness guard of every minibatch update

        stats = {"clip_frac": 0.0, "approx_kl": 0.0, "value_loss": 0.0, "value_clip_frac": 0.0, "loss": 0.0}
        grad_norm, entropy, n_updates = 0.0, math.nan, ppo.epochs * ppo.minibatches
        lr = self.scheduler.get_last_lr()[0]
        for epoch in range(ppo.epochs):
            order = range(len(micro)) if epoch == 0 else torch.randperm(len(micro), generator=g).tolist()
            for j in order:
                # One minibatch: its loss is a token mean over all of its micro-batches' tokens.
                tokens = float(train_mask[minibatches[j]].sum())
                acc = {"clipped": 0.0, "kl": 0.0, "vclipped": 0.0, "loss": 0.0, "vloss": 0.0}
                for rows, mb in micro[j]:
                    m = train_mask[rows, : mb.completion_len]
                    lp, ent = self._policy_pass(mb, torch.arange(len(rows), device=self.device))
                    loss, st = policy_loss(lp, m, adv[rows, : mb.completion_len], norm="token",
                                           old_token_logp=old_lp[rows, : mb.completion_len], clip_eps=rc.clip_eps,
                                           denominator=None if len(micro[j]) == 1 else tokens,
                                           weights=None if weights is None else weights[rows, : mb.completion_len])
                    loss.backward()
                    part = float(m.sum())
                    acc["clipped"] += float(st["clip_frac"]) * part
                    acc["kl"] += float(approx_kl(lp, old_lp[rows, : mb.completion_len], m)) * part
                    acc["loss"] += float(loss.detach())
                    if epoch == 0:  # the entropy of the policy that sampled (before this batch's updates)
                        entropy = (0.0 if math.isnan(entropy) else entropy) + float(
                            (ent * mb.completion_mask).sum() / mask.sum().clamp(min=1))
                grad_norm = float(torch.nn.utils.clip_grad_norm_(self.policy.parameters(), rc.grad_clip))
                if self.guard(step, loss=acc["loss"], grad_norm=grad_norm, kl=acc["kl"],
                              advantages=adv_abs_max):
                    self.optimizer.step()
                self.optimizer.zero_grad(set_to_none=True)
                for rows, mb in micro[j]:
                    n = mb.completion_len
                    m = train_mask[rows, :n]
                    vloss, vst = value_loss(self.values(mb), old_values[rows, :n], returns[rows, :n], m, ppo.value_clip,
                                            denominator=None if len(micro[j]) == 1 else tokens)
                    vloss.backward()
                    acc["vloss"] += float(vloss.detach())
                    acc["vclipped"] += float(vst["value_clip_frac"]) * float(m.sum())
                torch.nn.utils.clip_grad_norm_(self.critic.parameters(), rc.grad_clip)
                self.critic_optimizer.step()
                self.critic_optimizer.zero_grad(set_to_none=True)
                per_token = max(tokens, 1.0)
                for key, value in (("clip_frac", acc["clipped"] / per_token), ("approx_kl", acc["kl"] / per_token),
                                   ("value_loss", acc["vloss"]), ("value_clip_frac", acc["vclipped"] / per_token),
                                   ("loss", acc["loss"])):
                    stats[key] += value / n_updates
        self.scheduler.step()
        self.rollout.sync_weights(self.policy)
        t_upd = time.perf_counter()

        metrics = {
            "step": step,
            **sample_metrics(scores, kl.sum(1), ro, rc.k),
            "train/clip_frac": stats["clip_frac"],
            "train/entropy": entropy,
            "train/grad_norm": grad_norm,
            "train/loss": stats["loss"],
            "train/lr": lr,
            "ppo/value_loss": stats["value_loss"],
            "ppo/value_clip_frac": stats["value_clip_frac"],
            "ppo/explained_variance": float(explained_variance(old_values, returns, train_mask)),
            "ppo/approx_kl": stats["approx_kl"],
            "ppo/policy_clip_frac": stats["clip_frac"],
            "ppo/value_mean": float((old_values * train_mask).sum() / train_mask.sum().clamp(min=1)),
            "ppo/return_mean": float((returns * train_mask).sum() / train_mask.sum().clamp(min=1)),
            **correction.metrics,
        }
        return self._complete(metrics, got, (t0, t_score, t_ref, t_upd))


def sample_metrics(scores: torch.Tensor, seq_kl: torch.Tensor, ro, k: int) -> dict[str, float]:
    """What a batch of samples says before any update: reward, KL, lengths, and the zero-signal share
    (groups whose valid rewards do not differ: no estimator can learn from them)."""
    valid = torch.isfinite(scores)
    no_signal = ~has_signal(scores.view(-1, k))  # the test dynamic sampling filters on
    return {
        "train/reward_mean": float(scores[valid].mean()) if valid.any() else math.nan,
        "train/reward_std": float(scores[valid].std()) if int(valid.sum()) > 1 else 0.0,
        "train/kl": float(seq_kl.mean()),
        "train/zero_adv_frac": float(no_signal.float().mean()),
        "train/missing_rewards": int((~valid).sum()),
        "train/response_length": float(ro.lengths.float().mean()),
        "train/truncated_frac": float((~ro.finished).float().mean()),
    }
