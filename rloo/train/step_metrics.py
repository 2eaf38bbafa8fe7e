"""What a training step reports: the `train/*` figures of an RLOO update (`update_metrics`) and of a PPO
update (`ppo_update_metrics`, with its `ppo/*` figures), from the records their named parts hand on
(rloo/train/step_records.py), and what every trainer adds to its own figures, the dynamic-sampling stats
and the time of each phase (`collection_metrics`)."""

from __future__ import annotations

import math

import torch

from rloo.algo.estimators import has_signal
from rloo.algo.losses import explained_variance
from rloo.model import distributed
from rloo.rollout import Rollout, logprob_gap
from rloo.rollout.collect import Collected
from rloo.train.step_records import GradientStep, PpoAdvantages, PpoRows, PpoUpdates, StepAdvantages, StepRows


def update_metrics(step: int, got: Collected, rows: StepRows, adv: StepAdvantages, grad: GradientStep,
                   lr: float) -> dict:
    """The `train/*` figures of an RLOO update (and the sampler's log-prob gap); data-parallel, over all
    ranks' rows, as one process would compute them."""
    ro, mask, token_ent = rows.rollout, rows.mask, rows.token_ent
    rollout_metrics = logprob_gap(ro, rows.old_lp, mask)  # rollout backend (issue 8): vLLM vs trainer
    scores, shaped, seq_kl, advantages = got.scores, adv.shaped, adv.seq_kl, adv.advantages
    lengths, finished = ro.lengths.float(), ro.finished
    entropy = float((token_ent * mask).sum() / mask.sum().clamp(min=1))
    clip_frac, loss_value = grad.clip_frac, grad.loss
    zero_adv_frac, degenerate = adv.zero_adv_frac, adv.n_degenerate_groups
    distinct_frac = len(rows.first) / len(rows.inverse)
    if distributed.enabled():
        scores, shaped, seq_kl, advantages, lengths, finished = distributed.gather_rows(
            scores, shaped, seq_kl, advantages, lengths, finished)
        totals = dict(zip(
            ("entropy", "tokens", "clipped", "distinct", "rows", "zero", "degenerate", "groups"),
            distributed.all_sum(float((token_ent * mask).sum()), float(mask.sum()), clip_frac * float(mask.sum()),
                                len(rows.first), len(rows.inverse), adv.zero_adv_frac * len(got.idx),
                                adv.n_degenerate_groups, len(got.idx)), strict=True))
        entropy = totals["entropy"] / max(totals["tokens"], 1.0)
        clip_frac = totals["clipped"] / max(totals["tokens"], 1.0)
        zero_adv_frac, degenerate = totals["zero"] / totals["groups"], int(totals["degenerate"])
        distinct_frac = totals["distinct"] / totals["rows"]
        loss_value = distributed.mean_over_ranks({"loss": loss_value})["loss"]
    valid = torch.isfinite(scores)
    return {
        "step": step,
        "train/reward_mean": float(scores[valid].mean()) if valid.any() else math.nan,
        "train/reward_std": float(scores[valid].std()) if int(valid.sum()) > 1 else 0.0,
        "train/shaped_reward_mean": float(shaped[valid].mean()) if valid.any() else math.nan,
        "train/kl": float(seq_kl.mean()),
        "train/zero_adv_frac": zero_adv_frac,
        "train/degenerate_groups": degenerate,
        "train/missing_rewards": int((~valid).sum()),
        "train/response_length": float(lengths.mean()),
        "train/distinct_frac": distinct_frac,
        "train/truncated_frac": float((~finished).float().mean()),
        "train/adv_mean": float(advantages.mean()),
        "train/adv_std": float(advantages.std()),
        "train/adv_abs_max": float(advantages.abs().max()),
        "train/clip_frac": clip_frac,
        "train/entropy": entropy,
        "train/grad_norm": grad.grad_norm,
        "train/loss": loss_value,
        "train/lr": lr,
        **rollout_metrics,
        **tool_metrics(ro),
    }


def tool_metrics(ro: Rollout) -> dict[str, float]:
    """With tools (rloo/rollout/tools.py; none without, so a run without tools logs what it did before):
    `tool/calls_per_completion`, `tool/error_share` (the share of the step's calls whose result erred, 0
    in a step without calls) and `tool/forced_token_share` (the share of the completion tokens a tool
    forced, which no loss trains on); data-parallel, over all ranks' rows."""
    if ro.tool_calls is None:
        return {}
    forced = ro.completion_mask & ~ro.loss_mask
    errors = ro.tool_errors if ro.tool_errors is not None else torch.zeros_like(ro.tool_calls)
    calls, errors, forced_n, tokens, rows = distributed.all_sum(
        ro.tool_calls.sum(), errors.sum(), forced.sum(), ro.completion_mask.sum(), len(ro.tool_calls))
    return {"tool/calls_per_completion": float(calls) / max(float(rows), 1.0),
            "tool/error_share": float(errors) / max(float(calls), 1.0),
            "tool/forced_token_share": float(forced_n) / max(float(tokens), 1.0)}


def sample_metrics(scores: torch.Tensor, seq_kl: torch.Tensor, ro: Rollout, k: int) -> dict[str, float]:
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


def ppo_update_metrics(step: int, got: Collected, rows: PpoRows, adv: PpoAdvantages, upd: PpoUpdates, lr: float,
                       k: int) -> dict:
    """The `train/*` and `ppo/*` figures of a PPO update (one process: PPO is refused data-parallel)."""
    train_mask, means = adv.train_mask, upd.means()
    tokens = train_mask.sum().clamp(min=1)
    return {
        "step": step,
        **sample_metrics(got.scores, adv.kl.sum(1), rows.rollout, k),
        "train/clip_frac": means["clip_frac"],
        "train/entropy": upd.entropy,
        "train/grad_norm": upd.grad_norm,
        "train/loss": means["loss"],
        "train/lr": lr,
        "ppo/value_loss": means["value_loss"],
        "ppo/value_clip_frac": means["value_clip_frac"],
        "ppo/explained_variance": float(explained_variance(rows.old_values, adv.returns, train_mask)),
        "ppo/approx_kl": means["approx_kl"],
        "ppo/policy_clip_frac": means["clip_frac"],
        "ppo/value_mean": float((rows.old_values * train_mask).sum() / tokens),
        "ppo/return_mean": float((adv.returns * train_mask).sum() / tokens),
        **tool_metrics(rows.rollout),
    }


def collection_metrics(got: Collected, times: tuple[float, float, float, float]) -> dict:
    """The dynamic-sampling stats of the step's groups `got` and the time of each phase (start, scored,
    reference done, updated); data-parallel, the ranks' mean."""
    t0, t_score, t_ref, t_upd = times
    timings = got.timings
    if "wait_s" in timings:  # off-policy: sampled and scored beside the previous update; the step waited wait_s
        sampling = {"time/generation_s": timings["generation_s"], "time/scoring_s": timings["scoring_s"],
                    "time/sample_wait_s": timings["wait_s"], "time/lag_pass_s": timings.get("lag_pass_s", 0.0)}
    else:
        sampling = {"time/generation_s": timings["generation_s"],
                    "time/scoring_s": t_score - t0 - timings["generation_s"]}
    return distributed.mean_over_ranks({
        **got.stats,
        **sampling,
        "time/reference_s": t_ref - t_score,
        "time/update_s": t_upd - t_ref,
        "time/step_s": t_upd - t0,
    })
