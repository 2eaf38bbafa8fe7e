"""The records the named parts of an update hand on: RLOO's (rloo/train/rloo_trainer.py, `RlooTrainer.update`): the
step's rows with their log-probabilities (`StepRows`), their advantages (`StepAdvantages`) and the
optimizer steps taken on them (`GradientStep`); PPO's (rloo/train/ppo.py, `PPOTrainer.update`) the same
three for its minibatches, critic and per-token advantages (`PpoRows`, `PpoAdvantages`, `PpoUpdates` of
`MinibatchUpdate`s). rloo/train/step_metrics.py reads them."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

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


@dataclass
class PpoRows:
    """One PPO step's rows: the rollout, its completion mask, the fixed minibatches (row indices) in
    micro-batches ((rows, their batch) each), the step's generator (the later epochs' orders), and the
    log-probabilities of the reference and the policy and the critic's values before any update."""

    rollout: Rollout
    mask: torch.Tensor
    minibatches: tuple[torch.Tensor, ...]
    micro: list[list[tuple[torch.Tensor, SeqBatch]]]
    g: torch.Generator
    ref_lp: torch.Tensor
    old_lp: torch.Tensor
    old_values: torch.Tensor


@dataclass(frozen=True)
class PpoAdvantages:
    kl: torch.Tensor  # [rows, T] per-token KL to the reference, on response tokens
    advantages: torch.Tensor  # [rows, T] GAE, whitened where ppo.whiten_advantages
    returns: torch.Tensor  # [rows, T] the critic's targets, A_t + V_t
    train_mask: torch.Tensor  # [rows, T] the response tokens of samples with a reward


@dataclass
class MinibatchUpdate:
    """One minibatch's policy and critic update: sums over its micro-batches, token-weighted where a
    share (clipped tokens, approximate KL, clipped values)."""

    tokens: float
    clipped: float = 0.0
    kl: float = 0.0
    loss: float = 0.0
    value_loss: float = 0.0
    value_clipped: float = 0.0
    grad_norm: float = 0.0
    entropies: list[float] = field(default_factory=list)  # first epoch: each micro-batch's share of the entropy


@dataclass
class PpoUpdates:
    """A step's minibatch updates (`add`, in the order they ran): their means over `n_updates` of the
    policy's clipped share, approximate KL, value loss, value-clipped share and loss; the last update's
    gradient norm; the entropy of the policy that sampled, from the first epoch's passes."""

    n_updates: int
    done: list[MinibatchUpdate] = field(default_factory=list)

    def add(self, upd: MinibatchUpdate) -> None:
        self.done.append(upd)

    def means(self) -> dict[str, float]:
        """Each minibatch figure's mean over the step's updates (summed in the order they ran)."""
        figures: dict[str, Callable[[MinibatchUpdate], float]] = {
            "clip_frac": lambda u: u.clipped / max(u.tokens, 1.0),
            "approx_kl": lambda u: u.kl / max(u.tokens, 1.0),
            "value_loss": lambda u: u.value_loss,
            "value_clip_frac": lambda u: u.value_clipped / max(u.tokens, 1.0),
            "loss": lambda u: u.loss,
        }
        return {name: sum(f(u) / self.n_updates for u in self.done) for name, f in figures.items()}

    @property
    def grad_norm(self) -> float:
        return self.done[-1].grad_norm if self.done else 0.0

    @property
    def entropy(self) -> float:
        entropies = [e for u in self.done for e in u.entropies]
        return sum(entropies) if entropies else float("nan")
