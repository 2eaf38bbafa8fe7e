"""The rollout correction of a step's rows (`rloo.rollout_correction`, rloo/algo/rollout_correction.py):
the sampler-trainer mismatch (train/mismatch_*) whenever the sampler reported its log-probabilities,
and the weights that multiply each token's policy-gradient term. The RLOO and PPO trainers share it
(`PolicyTrainer.correction`)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rloo.algo import rollout_correction
from rloo.errors import InputError
from rloo.model import distributed
from rloo.rollout import Rollout
from rloo.settings import RolloutCorrectionConfig


def mismatch_metrics(sampler_lp: torch.Tensor, trainer_lp: torch.Tensor, mask: torch.Tensor,
                     cap: float, prefix: str = "train/mismatch_") -> dict[str, float]:
    """train/mismatch_* of these rows (rloo.algo.rollout_correction, eqs. 1-4); data-parallel, over all
    ranks' tokens, as one process would compute them."""
    s = rollout_correction.mismatch_sums(trainer_lp, sampler_lp, mask, cap)
    if distributed.enabled():
        tokens, sequences, abs_sum, k3_sum, out = distributed.all_sum(
            s.tokens, s.sequences, s.abs_sum, s.k3_sum, s.out_of_band)
        s = rollout_correction.MismatchSums(tokens, sequences, abs_sum, distributed.all_max(s.abs_max), k3_sum, out)
    return rollout_correction.mismatch_metrics(s, prefix)


def off_policy_metrics(sampler_lp: torch.Tensor, trainer_lp: torch.Tensor, mask: torch.Tensor, cap: float,
                       lagged_lp: torch.Tensor | None) -> dict[str, float]:
    """Off-policy, the figures of eqs. (1)-(4) of the whole ratio, sampler (lagged weights) to trainer
    (current weights): train/offpolicy_*; where the trainer's log-probabilities under the lagged weights
    were measured (`lagged_lp`), the ratio's two factors: the mismatch, sampler to trainer under the same
    weights (train/mismatch_*, what the sampling_mismatch alarm reads), and the lag, the trainer under the
    lagged weights to the trainer under the current ones (train/lag_*)."""
    out = mismatch_metrics(sampler_lp, trainer_lp, mask, cap, "train/offpolicy_")
    if lagged_lp is not None:
        out.update(mismatch_metrics(sampler_lp, lagged_lp, mask, cap))
        out.update(mismatch_metrics(lagged_lp, trainer_lp, mask, cap, "train/lag_"))
    return out


@dataclass(frozen=True)
class StepCorrection:
    """The rollout correction of a step's rows: the weights w_t [rows, T] that multiply each token's
    policy-gradient term (None under mode none: nothing is applied), and what they truncated or masked."""

    weights: torch.Tensor | None
    metrics: dict[str, float]


def step_correction(ro: Rollout, old_lp: torch.Tensor, mask: torch.Tensor, settings: RolloutCorrectionConfig,
                    sampler: str, off_policy: bool = False, lagged_lp: torch.Tensor | None = None) -> StepCorrection:
    """The sampler-trainer mismatch of these rows (train/mismatch_*, whenever the sampler reported its
    log-probabilities; off-policy, `off_policy_metrics`) and the weights of `settings`, resolved (None
    under mode none, a synchronous run's default: the update then runs exactly the computation it ran
    before the correction existed); `sampler` names the rollout backend in the error of a correction it
    cannot feed. The weights read the whole ratio: off-policy, the lag as well as the mismatch."""
    mode, cap = settings.mode, settings.cap
    if ro.logprobs is None:
        if settings.applied:
            raise InputError(f"rloo.rollout_correction.mode={mode}: the {sampler} sampler reported "
                             "no log-probabilities of its tokens; set mode none")
        return StepCorrection(None, {})
    if off_policy:
        metrics = off_policy_metrics(ro.logprobs, old_lp, mask, cap, lagged_lp)
    else:
        metrics = mismatch_metrics(ro.logprobs, old_lp, mask, cap)
    if not settings.applied:
        return StepCorrection(None, metrics)
    c = rollout_correction.correction_weights(old_lp, ro.logprobs, mask, mode, cap)
    n = float(rollout_correction.valid_tokens(ro.logprobs, mask).sum())
    truncated, masked, tokens = distributed.all_sum(c.truncated_share * n, c.masked_share * n, n)
    return StepCorrection(c.weights, {**metrics, "train/correction_truncated_share": truncated / max(tokens, 1.0),
                                      "train/correction_masked_share": masked / max(tokens, 1.0)})
