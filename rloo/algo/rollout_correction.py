"""Sampler-trainer mismatch: how far the sampler's log-probabilities of the sampled tokens are from the
trainer's, and the correction of the policy-gradient term for it (docs/rollout-correction.md).

Shapes as in rloo.algo.losses: ``trainer_logp``, ``sampler_logp`` and ``mask`` are ``[B, T]``. With the
per-token log-ratio Δ_t = log π_trainer(y_t) − log π_sampler(y_t) and r_t = exp(Δ_t):

  (1) mismatch |Δ_t|, mean and max over completion tokens
  (2) k3 of KL(sampler ‖ trainer) per token:  (r_t − 1) − log r_t   (samples from the sampler; >= 0)
  (3) per sequence: Σ_t of (2), mean over sequences
  (4) out of band: the share of tokens with r_t outside [1/C, C]

and the correction weights, constants multiplying each token's policy-gradient term:

  (5) token_tis:     w_t = min(r_t, C)
  (6) sequence_tis:  w_t = min(exp(Σ_s Δ_s), C)        (every token of the sequence)
  (7) token_mask:    w_t = 1[1/C <= r_t <= C]
  (8) sequence_mask: w_t = 1[1/C <= exp(mean_s Δ_s) <= C]   (the geometric mean: length-independent band)
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch

from rloo.algo.losses import kl_k3

Mode = Literal["none", "token_tis", "sequence_tis", "token_mask", "sequence_mask"]
MODES: tuple[str, ...] = ("none", "token_tis", "sequence_tis", "token_mask", "sequence_mask")

# exp() of a log-ratio above ~88 overflows float32; the weights are capped at C anyway, so a larger
# log-ratio only needs to stay finite.
_MAX_LOG_RATIO = 20.0


def valid_tokens(sampler_logp: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Completion tokens whose sampler log-prob is known (vLLM writes NaN where it returned none), bool."""
    return mask.bool() & torch.isfinite(sampler_logp)


def log_ratio(trainer_logp: torch.Tensor, sampler_logp: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Δ_t = log π_trainer − log π_sampler on valid tokens, 0 elsewhere (detached, float32)."""
    m = valid_tokens(sampler_logp, mask)
    delta = trainer_logp.detach().float() - torch.where(m, sampler_logp.float(), 0.0)
    return torch.where(m, delta, 0.0).clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO)


@dataclass(frozen=True)
class MismatchSums:
    """Eqs. (1)-(4) as sums and counts, so that data-parallel ranks add theirs before dividing."""

    tokens: float
    sequences: float
    abs_sum: float
    abs_max: float
    k3_sum: float
    out_of_band: float


def mismatch_sums(trainer_logp: torch.Tensor, sampler_logp: torch.Tensor, mask: torch.Tensor,
                  cap: float) -> MismatchSums:
    """Eqs. (1)-(4) over the valid tokens of these rows, as sums (a sequence counts if it has a valid token)."""
    m = valid_tokens(sampler_logp, mask)
    delta = log_ratio(trainer_logp, sampler_logp, mask)
    k3 = torch.where(m, kl_k3(torch.zeros_like(delta), delta), 0.0)  # e^Δ − 1 − Δ = (r − 1) − log r
    outside = m & (delta.abs() > math.log(cap))
    return MismatchSums(
        tokens=float(m.sum()), sequences=float(m.any(1).sum()), abs_sum=float(delta.abs().sum()),
        abs_max=float(delta.abs().max()) if delta.numel() else 0.0, k3_sum=float(k3.sum()),
        out_of_band=float(outside.sum()),
    )


def mismatch_metrics(s: MismatchSums, prefix: str = "train/mismatch_") -> dict[str, float]:
    """The `train/mismatch_*` figures of eqs. (1)-(4) from (possibly rank-summed) sums; NaN without tokens.
    (`prefix`: off-policy, the same figures of the policy lag and of the whole ratio have names of their own.)"""
    if not s.tokens:
        return {f"{prefix}{k}": math.nan for k in ("abs_mean", "abs_max", "k3_token", "k3_seq", "out_of_band")}
    return {
        f"{prefix}abs_mean": s.abs_sum / s.tokens,
        f"{prefix}abs_max": s.abs_max,
        f"{prefix}k3_token": s.k3_sum / s.tokens,
        f"{prefix}k3_seq": s.k3_sum / s.sequences,
        f"{prefix}out_of_band": s.out_of_band / s.tokens,
    }


@dataclass(frozen=True)
class Correction:
    """The weights of eqs. (5)-(8), [B, T] detached (1 on tokens without a sampler log-prob), and the
    share of valid tokens whose weight the cap truncated or the band masked."""

    weights: torch.Tensor
    truncated_share: float
    masked_share: float


def _sequence_log_ratio(delta: torch.Tensor, m: torch.Tensor, mean: bool) -> torch.Tensor:
    """Σ_t Δ_t per sequence, or its mean over the sequence's valid tokens (log of the geometric mean), [B, 1]."""
    total = (delta * m).sum(1, keepdim=True)
    return total / m.sum(1, keepdim=True).clamp(min=1) if mean else total


def correction_weights(trainer_logp: torch.Tensor, sampler_logp: torch.Tensor, mask: torch.Tensor,
                       mode: Mode, cap: float) -> Correction:
    """Eqs. (5)-(8) for `mode` with cap C = `cap` (> 1); the weights are constants (no gradient)."""
    if mode not in MODES or mode == "none":
        raise ValueError(f"rollout correction mode {mode!r}: one of {', '.join(MODES[1:])} (none applies nothing)")
    m = valid_tokens(sampler_logp, mask)
    mf = m.float()
    delta = log_ratio(trainer_logp, sampler_logp, mask)  # detached: the weights carry no gradient
    log_cap = math.log(cap)
    if mode in ("token_tis", "token_mask"):
        level = delta
    else:
        level = _sequence_log_ratio(delta, mf, mean=mode == "sequence_mask").expand_as(delta)
    if mode.endswith("_tis"):
        truncated = m & (level > log_cap)
        w = torch.exp(level.clamp(max=log_cap))  # min(r, C), as exp(min(log r, log C))
        masked = torch.zeros_like(m)
    else:
        masked = m & (level.abs() > log_cap)
        w = (~masked).float()
        truncated = torch.zeros_like(m)
    n = float(m.sum())
    weights = torch.where(m, w, 1.0)  # built from the detached Δ: a constant
    return Correction(weights, float(truncated.sum()) / n if n else 0.0, float(masked.sum()) / n if n else 0.0)
