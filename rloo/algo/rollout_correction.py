"""Sampler against trainer: how far their log-probabilities of the sampled tokens disagree, and the
correction of the policy gradient for it (docs/rollout-correction.md).

With Δ_t = log π_trainer(y_t) − log π_sampler(y_t) on the sampled tokens (π_trainer: the policy's
log-probabilities before the update, as the loss sees them; π_sampler: the distribution the tokens were
drawn from) and the ratio r_t = exp(Δ_t):

- token_tis:     w_t = min(r_t, C)                       (truncated importance sampling, per token)
- sequence_tis:  w_i = min(exp(Σ_t Δ_it), C)             (the same for the whole sequence)
- token_mask:    w_t = 1[1/C ≤ r_t ≤ C]                  (tokens outside the band drop out)
- sequence_mask: w_i = 1[1/C ≤ exp(mean_t Δ_it) ≤ C]     (sequences whose geometric-mean ratio leaves it)

The weights are constants (no gradient flows through them) that multiply each token's advantage.
"""

from __future__ import annotations

from typing import Literal

import torch

Mode = Literal["none", "token_tis", "sequence_tis", "token_mask", "sequence_mask"]
MODES: tuple[str, ...] = ("none", "token_tis", "sequence_tis", "token_mask", "sequence_mask")


def log_ratio(trainer_logp: torch.Tensor, sampler_logp: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Δ_t = log π_trainer(y_t) − log π_sampler(y_t) [B, T], 0 where `mask` is off; never differentiated."""
    m = mask.bool()
    delta = trainer_logp.detach().float() - sampler_logp.detach().float()
    return torch.where(m, delta, torch.zeros_like(delta))


def mismatch_metrics(trainer_logp: torch.Tensor, sampler_logp: torch.Tensor, mask: torch.Tensor,
                     cap: float) -> dict[str, float]:
    """`train/mismatch_*`: mean and max |Δ_t|, the k3 estimate of KL(sampler ‖ trainer) per token and per
    sequence, E_sampler[(r − 1) − log r], and the share of tokens with r outside [1/C, C]."""
    m = mask.bool()
    n = int(m.sum())
    if n == 0:
        return {}
    delta = log_ratio(trainer_logp, sampler_logp, m)
    k3 = torch.where(m, torch.expm1(delta) - delta, torch.zeros_like(delta))
    outside = (delta.abs() > torch.log(torch.tensor(cap))) & m
    return {
        "train/mismatch_abs_mean": float(delta.abs()[m].mean()),
        "train/mismatch_abs_max": float(delta.abs()[m].max()),
        "train/mismatch_k3_token": float(k3[m].mean()),
        "train/mismatch_k3_seq": float(k3.sum(-1)[m.any(-1)].mean()),
        "train/mismatch_out_of_band": float(outside.sum()) / n,
    }


def correction_weights(trainer_logp: torch.Tensor, sampler_logp: torch.Tensor, mask: torch.Tensor,
                       mode: Mode, cap: float) -> tuple[torch.Tensor, dict[str, float]]:
    """The weights w [B, T] of `mode` (module docstring), and the share of tokens they truncated
    (`train/correction_truncated_share`, TIS) or masked (`train/correction_masked_share`)."""
    if mode not in MODES:
        raise ValueError(f"rollout correction mode {mode!r}: one of {', '.join(MODES)}")
    if cap <= 1.0:
        raise ValueError(f"rollout correction cap {cap}: must be > 1 (the band is [1/C, C])")
    m = mask.bool()
    delta = log_ratio(trainer_logp, sampler_logp, m)
    ones = m.float()
    n = max(int(m.sum()), 1)
    log_cap = torch.log(torch.tensor(cap, dtype=delta.dtype))
    if mode == "none":
        return ones, {}
    if mode == "token_tis":
        w = torch.exp(torch.clamp(delta, max=log_cap))
        return w * ones, {"train/correction_truncated_share": float(((delta > log_cap) & m).sum()) / n}
    if mode == "sequence_tis":
        seq = delta.sum(-1)
        w = torch.exp(torch.clamp(seq, max=log_cap))[:, None] * ones
        return w, {"train/correction_truncated_share": float(((seq > log_cap)[:, None] & m).sum()) / n}
    if mode == "token_mask":
        keep = (delta.abs() <= log_cap) & m
    else:  # sequence_mask: the geometric mean of the sequence's ratios
        lengths = m.sum(-1).clamp(min=1)
        keep = ((delta.sum(-1) / lengths).abs() <= log_cap)[:, None] & m
    return keep.float(), {"train/correction_masked_share": float((m & ~keep).sum()) / n}


def weighted_advantages(advantages: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """A_it = w_it · A_i (or · A_it): the advantages the policy-gradient term reads, per token."""
    adv = advantages.detach()
    return (adv[:, None] if adv.dim() == 1 else adv) * weights.detach().to(adv.dtype)
