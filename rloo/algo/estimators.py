"""Advantage estimators for grouped rewards shaped ``[prompts, k]``.

Every function here is pure: tensors in, tensors out, no randomness. A NaN reward marks a sample whose
reward is missing (a scorer failure, a truncated completion): it is kept out of every baseline and gets
advantage 0. A group needs at least two valid rewards before a leave-one-out or group-mean baseline
exists; groups below that get zero advantage rather than a made-up baseline (verl's loop and vectorised
RLOO disagree on exactly this case, so it is pinned down here and in the tests). A group whose valid
rewards are all equal carries no learning signal and gets exactly zero, not rounding noise.

Equation numbers refer to the list below, for k samples y_1..y_k of one prompt with rewards R_1..R_k:

  (1) REINFORCE, no baseline:   A_i = R_i
  (2) leave-one-out (RLOO):     A_i = R_i - (sum_{j != i} R_j) / (k - 1)   [= k/(k-1) * (R_i - mean(R))]
  (3) group mean (GRPO/Dr.GRPO): A_i = R_i - mean(R)
  (4) group mean / std (GRPO):  A_i = (R_i - mean(R)) / (std(R) + eps),  std with ddof = 0
  (5) moving average:           A_i = R_i - b,   b <- decay * b + (1 - decay) * mean(batch rewards)
  (6) ReMax / self-critical:    A_i = R_i - R(greedy decode of the same prompt)

PPO's critic-based estimator works per token instead, on rewards r_t and values V_t shaped [B, T]:

  (7) GAE:  delta_t = r_t + gamma V_{t+1} - V_t,  A_t = sum_l (gamma lambda)^l delta_{t+l},  R_t = A_t + V_t
      (V after the last response token is 0; with gamma = lambda = 1, A_t = sum_{s>=t} r_s - V_t)
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch

from rloo.algo.names import k_problems


def _check_rewards(rewards: torch.Tensor) -> torch.Tensor:
    if not isinstance(rewards, torch.Tensor):
        raise TypeError(f"rewards must be a torch.Tensor, got {type(rewards).__name__}")
    if rewards.dim() != 2:
        raise ValueError(f"rewards must be shaped [prompts, k], got shape {tuple(rewards.shape)}")
    if not rewards.is_floating_point():
        rewards = rewards.to(torch.get_default_dtype())
    # NaN means "missing"; an infinite reward is a scorer bug and would poison every baseline it touches.
    if torch.isinf(rewards).any():
        raise ValueError("rewards contain +/-inf; use NaN to mark a missing reward")
    return rewards


def _require_group(rewards: torch.Tensor, name: str) -> None:
    k = rewards.shape[1]
    if problems := k_problems(name, k):
        raise ValueError(f"rloo.k={k}: {problems[0]}")


def _group_stats(rewards: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Return (valid mask, valid count, sum of valid rewards, rewards with NaN replaced by 0)."""
    valid = ~torch.isnan(rewards)
    filled = torch.where(valid, rewards, torch.zeros_like(rewards))
    count = valid.sum(dim=1, keepdim=True)
    total = filled.sum(dim=1, keepdim=True)
    return valid, count, total, filled


def has_signal(rewards: torch.Tensor) -> torch.Tensor:
    """Per group of raw rewards [groups, k] -> [groups]: at least two finite rewards, and not all of them
    equal. The one test of a group's learning signal: the group estimators zero the groups that fail it,
    dynamic sampling drops them and the step metrics count them."""
    finite = torch.isfinite(rewards)
    hi = torch.where(finite, rewards, -math.inf).amax(dim=1)
    lo = torch.where(finite, rewards, math.inf).amin(dim=1)
    return (finite.sum(dim=1) >= 2) & (hi > lo)


def rloo_advantages(rewards: torch.Tensor) -> torch.Tensor:
    """Eq. (2): each reward minus the mean of the other valid rewards of its group."""
    rewards = _check_rewards(rewards)
    _require_group(rewards, "rloo")
    valid, count, total, filled = _group_stats(rewards)
    # Same formula as TRL: baseline = (nansum - r) / (valid_count - 1); the clamp only avoids 0/0 in
    # groups that are masked to zero just below.
    baseline = (total - filled) / (count - 1).clamp(min=1)
    keep = valid & has_signal(rewards)[:, None]
    return torch.where(keep, filled - baseline, torch.zeros_like(rewards))


def grpo_advantages(rewards: torch.Tensor, scale_by_std: bool = False, eps: float = 1e-6) -> torch.Tensor:
    """Eq. (3), or Eq. (4) with scale_by_std: reward minus the group mean (including itself), over std."""
    rewards = _check_rewards(rewards)
    _require_group(rewards, "grpo_std" if scale_by_std else "grpo")
    valid, count, total, filled = _group_stats(rewards)
    mean = total / count.clamp(min=1)
    centred = torch.where(valid, filled - mean, torch.zeros_like(rewards))
    if scale_by_std:
        # Population std (ddof=0) over the valid samples: the convention of the worked example
        # (R = 1.0, 0.0, 0.5, 0.3 -> std 0.364) and of GRPO implementations that normalise per group.
        std = (centred.square().sum(dim=1, keepdim=True) / count.clamp(min=1)).sqrt()
        centred = centred / (std + eps)
    keep = valid & has_signal(rewards)[:, None]
    return torch.where(keep, centred, torch.zeros_like(rewards))


def reinforce_advantages(rewards: torch.Tensor) -> torch.Tensor:
    """Eq. (1): the raw reward, with missing (NaN) rewards set to 0."""
    rewards = _check_rewards(rewards)
    return torch.nan_to_num(rewards, nan=0.0)


def update_moving_baseline(baseline: float | None, rewards: torch.Tensor, decay: float) -> float | None:
    """Eq. (5), update: b <- decay * b + (1 - decay) * mean of this batch's valid rewards."""
    if not 0.0 <= decay < 1.0:
        raise ValueError(f"moving-average decay must be in [0, 1), got {decay}")
    rewards = _check_rewards(rewards)
    valid = ~torch.isnan(rewards)
    if not valid.any():
        return baseline
    batch_mean = float(rewards[valid].double().mean())
    if baseline is None:
        return batch_mean
    return decay * baseline + (1.0 - decay) * batch_mean


def moving_average_advantages(
    rewards: torch.Tensor, baseline: float | None, decay: float = 0.9
) -> tuple[torch.Tensor, float | None]:
    """Eq. (5): reward minus a running mean of past batch rewards; returns (advantages, new baseline)."""
    rewards = _check_rewards(rewards)
    if baseline is None:
        # No history yet: centre the first batch on its own mean (a one-step, GRPO-like shrinkage)
        # instead of on 0, which with uncentred rewards would be a large, noisy REINFORCE step.
        baseline = update_moving_baseline(None, rewards, decay)
        if baseline is None:
            return torch.zeros_like(rewards), None
    # The baseline used here is computed before this batch is folded in, so it does not depend on the
    # samples it is subtracted from (except on the very first batch, see above).
    adv = torch.where(torch.isnan(rewards), torch.zeros_like(rewards), rewards - baseline)
    return adv, update_moving_baseline(baseline, rewards, decay)


def remax_advantages(rewards: torch.Tensor, greedy_rewards: torch.Tensor) -> torch.Tensor:
    """Eq. (6): reward minus the reward of the greedy decode for the same prompt."""
    rewards = _check_rewards(rewards)
    if not isinstance(greedy_rewards, torch.Tensor) or greedy_rewards.shape != rewards.shape[:1]:
        shape = tuple(greedy_rewards.shape) if isinstance(greedy_rewards, torch.Tensor) else None
        raise ValueError(f"greedy_rewards must be shaped [prompts]={rewards.shape[0]}, got {shape}")
    greedy = greedy_rewards.to(rewards.dtype).unsqueeze(1)
    if torch.isinf(greedy).any():
        raise ValueError("greedy_rewards contain +/-inf; use NaN to mark a missing reward")
    # A missing greedy reward leaves no baseline for that prompt, so the whole group sits this step out.
    keep = ~torch.isnan(rewards) & ~torch.isnan(greedy)
    return torch.where(keep, rewards - greedy, torch.zeros_like(rewards))


@dataclass(frozen=True)
class MovingBaseline:
    """Running baseline for the ``moving_average`` estimator; plain floats so it serialises with asdict."""

    value: float | None = None
    decay: float = 0.9


@dataclass(frozen=True)
class AdvantageResult:
    advantages: torch.Tensor  # [prompts, k], never NaN
    n_degenerate_groups: int  # groups with fewer than 2 valid (non-NaN) rewards
    zero_adv_frac: float  # fraction of groups whose advantages are all exactly zero (no learning signal)
    state: MovingBaseline | None = None  # updated running baseline (moving_average only)


def _moving_average(rewards: torch.Tensor, *, state: MovingBaseline | None, decay: float, **_
                    ) -> tuple[torch.Tensor, MovingBaseline]:
    if state is None:
        state = MovingBaseline(value=None, decay=decay)
    elif not isinstance(state, MovingBaseline):
        raise TypeError(f"moving_average state must be a MovingBaseline, got {type(state).__name__}")
    adv, value = moving_average_advantages(rewards, state.value, state.decay)
    return adv, dataclasses.replace(state, value=value)


def _remax(rewards: torch.Tensor, *, greedy_rewards: torch.Tensor | None, **_) -> tuple[torch.Tensor, None]:
    if greedy_rewards is None:
        raise ValueError("estimator 'remax' needs greedy_rewards (the reward of each prompt's greedy decode)")
    return remax_advantages(rewards, greedy_rewards), None


# The estimator table, `rloo.estimator` -> (rewards, *, state, greedy_rewards, eps, decay) -> (advantages,
# new running baseline or None). Its keys are the config's critic-free estimators: rloo/algo/names.py reads
# them from this source without torch, and the settings' enum (rloo.settings.training.Estimator) from there.
# A literal table, so that the code fingerprint's static walk sees every estimator a stage can pick.
ESTIMATOR_TABLE = {
    "rloo": lambda rewards, **_: (rloo_advantages(rewards), None),
    "grpo": lambda rewards, *, eps, **_: (grpo_advantages(rewards, scale_by_std=False, eps=eps), None),
    "grpo_std": lambda rewards, *, eps, **_: (grpo_advantages(rewards, scale_by_std=True, eps=eps), None),
    "reinforce": lambda rewards, **_: (reinforce_advantages(rewards), None),
    "moving_average": _moving_average,
    "remax": _remax,
}


def compute_advantages(
    name: str,
    rewards: torch.Tensor,
    *,
    state: MovingBaseline | None = None,
    greedy_rewards: torch.Tensor | None = None,
    eps: float = 1e-6,
    decay: float = 0.9,
) -> AdvantageResult:
    """Dispatch to the estimator called ``name`` (a key of ESTIMATOR_TABLE) and collect group diagnostics.

    ``state`` carries the running baseline of ``moving_average`` between steps (``decay`` is used only
    when it is None); ``greedy_rewards`` [prompts] is required by ``remax``.
    """
    if name not in ESTIMATOR_TABLE:
        raise ValueError(f"unknown advantage estimator {name!r}; valid names: {', '.join(ESTIMATOR_TABLE)}")
    rewards = _check_rewards(rewards)
    _require_group(rewards, name)
    adv, new_state = ESTIMATOR_TABLE[name](rewards, state=state, greedy_rewards=greedy_rewards, eps=eps, decay=decay)

    n_prompts = rewards.shape[0]
    valid_count = (~torch.isnan(rewards)).sum(dim=1)
    n_degenerate = int((valid_count < 2).sum())
    zero_frac = float((adv == 0).all(dim=1).double().mean()) if n_prompts else 0.0
    return AdvantageResult(adv, n_degenerate, zero_frac, new_state)


def gae(rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float = 1.0,
        lam: float = 0.95) -> tuple[torch.Tensor, torch.Tensor]:
    """(7) Generalised advantage estimation over each response's tokens: (advantages, returns), [B, T].

    The actions are the tokens where `mask` is 1 (the policy's): right padding, and a tool's forced tokens
    inside a completion (rloo/rollout/tools.py), are no actions and get 0. A span of masked tokens is
    bridged, not an end: the next state of an action is the next action's state (its V_{t+1} the value
    before the next policy token, gamma and lambda applied once per action), as if the forced tokens were
    part of the environment's transition; the value after a row's last action is 0 (the episode ends
    there). With a mask of right padding alone this is the plain recursion, to the bit."""
    if rewards.shape != values.shape or rewards.shape != mask.shape or rewards.dim() != 2:
        raise ValueError(f"rewards, values and mask must share one [B, T] shape, got "
                         f"{tuple(rewards.shape)}, {tuple(values.shape)}, {tuple(mask.shape)}")
    m = mask.to(values.dtype)
    on = m > 0
    r, v = rewards.detach() * m, values.detach() * m
    adv = torch.zeros_like(v)
    running, next_value = torch.zeros_like(v[:, 0]), torch.zeros_like(v[:, 0])
    for t in reversed(range(v.shape[1])):
        delta = r[:, t] + gamma * next_value - v[:, t]
        here = (delta + gamma * lam * running) * m[:, t]
        adv[:, t] = here
        # Off the mask the recursion's state passes through unchanged: the action before a forced span
        # reads the action after it.
        running = torch.where(on[:, t], here, running)
        next_value = torch.where(on[:, t], v[:, t], next_value)
    return adv, (adv + v) * m


def whiten(x: torch.Tensor, mask: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    """(x - mean) / std over the entries where `mask` is 1 (PPO's advantage whitening); 0 elsewhere."""
    m = mask.to(x.dtype)
    n = m.sum().clamp(min=1.0)
    mean = (x * m).sum() / n
    var = (((x - mean) ** 2) * m).sum() / n
    return (x - mean) * torch.rsqrt(var + eps) * m
