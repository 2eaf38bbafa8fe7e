"""The rollout correction of a step's rows (`rloo.rollout_correction`, rloo/algo/rollout_correction.py):
the sampler-trainer mismatch (train/mismatch_*) whenever the sampler reported its log-probabilities,
and the weights that multiply each token's policy-gradient term. The RLOO and PPO trainers share it
(`Trainer.correction`)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rloo.algo import rollout_correction
from rloo.errors import InputError
from rloo.model import distributed
from rloo.rollout import Rollout
from rloo.settings import RolloutCorrectionConfig


def mismatch_metrics(sampler_lp: torch.Tensor, trainer_lp: torch.Tensor, mask: torch.Tensor,
                     cap: float) -> dict[str, float]:
    """train/mismatch_* of these rows (rloo.algo.rollout_correction, eqs. 1-4); data-parallel, over all
    ranks' tokens, as one process would compute them."""
    s = rollout_correction.mismatch_sums(trainer_lp, sampler_lp, mask, cap)
    if distributed.enabled():
        tokens, sequences, abs_sum, k3_sum, out = distributed.all_sum(
            s.tokens, s.sequences, s.abs_sum, s.k3_sum, s.out_of_band)
        s = rollout_correction.MismatchSums(tokens, sequences, abs_sum, distributed.all_max(s.abs_max), k3_sum, out)
    return rollout_correction.mismatch_metrics(s)


@dataclass(frozen=True)
class StepCorrection:
    """The rollout correction of a step's rows: the weights w_t [rows, T] that multiply each token's
    policy-gradient term (None under mode none: nothing is applied), and what they truncated or masked."""

    weights: torch.Tensor | None
    metrics: dict[str, float]


def step_correction(ro: Rollout, old_lp: torch.Tensor, mask: torch.Tensor, settings: RolloutCorrectionConfig,
                    sampler: str) -> StepCorrection:
    """The sampler-trainer mismatch of these rows (train/mismatch_*, whenever the sampler reported its
    log-probabilities) and the weights of `settings` (None under mode none, the default: the update
    then runs exactly the computation it ran before the correction existed); `sampler` names the
    rollout backend in the error of a correction it cannot feed."""
    mode, cap = settings.mode, settings.cap
    if ro.logprobs is None:
        if settings.applied:
            raise InputError(f"rloo.rollout_correction.mode={mode}: the {sampler} sampler reported "
                             "no log-probabilities of its tokens; set mode none")
        return StepCorrection(None, {})
    metrics = mismatch_metrics(ro.logprobs, old_lp, mask, cap)
    if not settings.applied:
        return StepCorrection(None, metrics)
    c = rollout_correction.correction_weights(old_lp, ro.logprobs, mask, mode, cap)
    n = float(rollout_correction.valid_tokens(ro.logprobs, mask).sum())
    truncated, masked, tokens = distributed.all_sum(c.truncated_share * n, c.masked_share * n, n)
    return StepCorrection(c.weights, {**metrics, "train/correction_truncated_share": truncated / max(tokens, 1.0),
                                      "train/correction_masked_share": masked / max(tokens, 1.0)})
