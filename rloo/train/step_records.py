"""The records the named parts of an RLOO update hand on (rloo/train/rloo.py, `Trainer.update`): the
step's rows with their log-probabilities (`StepRows`), their advantages (`StepAdvantages`) and the
optimizer steps taken on them (`GradientStep`); rloo/train/step_metrics.py reads all three."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rloo.model import microbatch
from rloo.model.logprobs import SeqBatch
from rloo.rollout import Rollout


@dataclass
class StepRows:
    """One step's rows as the update reads them: the rollout, its completion mask, the distinct rows
    (`first`: their index among all rows; `inverse`: each row's distinct row) in micro-batches, and the
    per-token log-probabilities: the reference's, the policy's before the update and its entropies,
    and, in one pass, the policy's with gradient."""

    rollout: Rollout
    mask: torch.Tensor
    distinct: SeqBatch
    first: torch.Tensor
    inverse: torch.Tensor
    parts: list[microbatch.Part]
    ref_lp: torch.Tensor
    old_lp: torch.Tensor | None = None
    token_ent: torch.Tensor | None = None
    lp: torch.Tensor | None = None

    @property
    def one_pass(self) -> bool:
        return len(self.parts) == 1


@dataclass(frozen=True)
class StepAdvantages:
    seq_kl: torch.Tensor  # [rows] KL to the reference, summed over each completion's tokens
    shaped: torch.Tensor  # [rows] R̃ = r - β KL (β = 0 unless kl_in: reward)
    advantages: torch.Tensor  # [rows]
    zero_adv_frac: float
    n_degenerate_groups: int


@dataclass(frozen=True)
class GradientStep:
    loss: float  # the last update's loss (this process's)
    grad_norm: float  # the last update's, before clipping
    clip_frac: float  # the share of response tokens whose ratio was clipped, averaged over the updates
