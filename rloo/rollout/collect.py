"""What a policy-gradient step trains on: the prompts of each step and, with dynamic sampling, only
groups whose rewards differ.

`gather` is the loop behind `PolicyTrainer.collect(step)` (rloo/train/policy_trainer.py): sample k
completions for each of the step's B prompts and score them; with `rloo.dynamic_sampling` (DAPO's
dynamic sampling), drop the groups with no reward spread and refill from further prompts, at most
`rloo.dynamic_sampling_max_rounds` extra rounds, until B groups with signal are in hand. It knows
nothing of the loss: any trainer that learns from scored groups of samples (RLOO, PPO) reuses it.

Everything a step draws depends only on (seed, step) and the policy's weights, so a resumed run
repeats it: round 0 is `prompt_indices(...)` with the sampling noise of `step_generator(seed, step)`,
round r >= 1 takes prompts from a permutation seeded by (seed, step, r) that skips the prompts already
drawn this step, with the noise of `step_generator(seed, step, stream=REFILL_STREAM + r)`.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F

from rloo.algo.estimators import has_signal
from rloo.data.gsm8k import solution_steps
from rloo.errors import InputError
from rloo.rollout import Rollout

log = logging.getLogger("rloo.train")

REFILL_STREAM = 100  # step_generator stream of refill round r: REFILL_STREAM + r (round 0 keeps stream 0)


def training_prompts(rows: list[dict], min_steps: int) -> list[dict]:
    """The RL prompt pool: rows whose reference solution has >= `min_steps` reasoning lines."""
    kept = [r for r in rows if solution_steps(r["answer"]) >= min_steps]
    if min_steps:
        log.info("rloo.min_solution_steps=%d keeps %d of %d training prompts", min_steps, len(kept), len(rows))
    if not kept:
        raise InputError(f"rloo.min_solution_steps={min_steps}: no training prompt has that many solution steps")
    return kept


def prompt_indices(n: int, step: int, per_step: int, seed: int) -> np.ndarray:
    """The prompts of `step`: consecutive slices of a seeded permutation per epoch (resume-exact)."""
    per_epoch = max(1, n // per_step)
    epoch, pos = divmod(step, per_epoch)
    perm = np.random.default_rng([seed, epoch, 1]).permutation(n)
    return perm[pos * per_step : (pos + 1) * per_step]


def refill_indices(n: int, step: int, round_: int, seed: int, exclude: np.ndarray, count: int) -> np.ndarray:
    """Up to `count` prompts for refill round `round_` of `step`, none of `exclude` (those drawn already)."""
    perm = np.random.default_rng([seed, step, round_, 2]).permutation(n)
    return perm[~np.isin(perm, exclude)][:count]


def group_rows(groups: torch.Tensor, k: int) -> torch.Tensor:
    """The sample rows of `groups` (k consecutive rows per group)."""
    return (groups[:, None] * k + torch.arange(k, device=groups.device)).reshape(-1)


def cat_rollouts(parts: list[Rollout], pad_id: int) -> Rollout:
    """The rollouts' rows one after another, prompts left-padded and completions right-padded to the
    widest real row of any part (padding no row needs is cut)."""
    p = max(int(ro.prompt_mask.sum(1).max()) for ro in parts)
    t = max(1, *(int(ro.lengths.max()) for ro in parts))

    def fit(x: torch.Tensor, width: int, value, left: bool) -> torch.Tensor:  # F.pad cuts where negative
        d = width - x.shape[1]
        return F.pad(x, (d, 0) if left else (0, d), value=value)

    return Rollout(
        prompt_ids=torch.cat([fit(ro.prompt_ids, p, pad_id, True) for ro in parts]),
        prompt_mask=torch.cat([fit(ro.prompt_mask, p, 0, True) for ro in parts]),
        completions=torch.cat([fit(ro.completions, t, pad_id, False) for ro in parts]),
        completion_mask=torch.cat([fit(ro.completion_mask, t, False, False) for ro in parts]),
        finished=torch.cat([ro.finished for ro in parts]),
        logprobs=None if any(ro.logprobs is None for ro in parts)
        else torch.cat([fit(ro.logprobs, t, 0.0, False) for ro in parts]),
        # a part in which no tool forced a token: its policy tokens are its completion's
        policy_mask=None if all(ro.policy_mask is None for ro in parts)
        else torch.cat([fit(ro.loss_mask, t, False, False) for ro in parts]),
        tool_calls=_counts(parts, "tool_calls"),
        tool_errors=_counts(parts, "tool_errors"),
    )


def _counts(parts: list[Rollout], name: str) -> torch.Tensor | None:
    """A per-row count field of the parts (tool_calls, tool_errors), 0 for a part without it; None if none has it."""
    if all(getattr(ro, name) is None for ro in parts):
        return None
    return torch.cat([ro.finished.new_zeros(len(ro.finished), dtype=torch.long) if getattr(ro, name) is None
                      else getattr(ro, name) for ro in parts])


@dataclass
class Collected:
    """The groups a step trains on, k consecutive sample rows per group."""

    idx: np.ndarray  # [G] training-prompt index of each group (G = B, or fewer when signal ran short)
    rollout: Rollout  # [G * k] the groups' samples
    scores: torch.Tensor  # [G * k] raw task rewards, before any KL shaping (NaN = missing)
    stats: dict[str, float] = field(default_factory=dict)  # train/dynamic_* (dynamic sampling), train/reward/* (functions)
    timings: dict[str, float] = field(default_factory=dict)  # generation_s, scoring_s: seconds this step
    # Off-policy, at the steps it is measured (rloo/train/off_policy.py): the trainer's log-probabilities of
    # the samples under the weights that sampled them, [G * k, T].
    trainer_logprobs: torch.Tensor | None = None

    def to(self, device: torch.device | str) -> Collected:
        """The same groups with every tensor on `device`."""
        lp = None if self.trainer_logprobs is None else self.trainer_logprobs.to(device)
        return Collected(self.idx, self.rollout.to(device), self.scores.to(device), self.stats, self.timings, lp)


def gather(
    first: np.ndarray,
    sample: Callable[[np.ndarray, int], Rollout],
    score: Callable[[np.ndarray, Rollout], torch.Tensor],
    *, k: int, n_prompts: int, seed: int, step: int, pad_id: int, dynamic: bool, max_rounds: int,
) -> Collected:
    """Sample (`sample(idx, round)`) and score (`score(idx, rollout)`) the groups of `first`; with
    `dynamic`, keep only groups with reward spread (`has_signal` on the raw rewards) and refill.

    A refill round draws ceil(missing groups / share with signal so far) prompts, at most B (all B
    when none had signal yet), so each round costs at most what round 0 did. After `max_rounds` extra
    rounds (or when the prompts run out) the step trains on the groups with signal found, fewer than B;
    when not one group had signal it trains on round 0's B groups, as without dynamic sampling (their
    advantages are zero: `train/zero_adv_frac` is 1, and the zero_signal alarm fires if that persists).
    """
    timings = {"generation_s": 0.0, "scoring_s": 0.0}

    def draw(idx: np.ndarray, round_: int) -> tuple[Rollout, torch.Tensor]:
        t0 = time.perf_counter()
        ro = sample(idx, round_)
        t1 = time.perf_counter()
        scores = score(idx, ro)
        timings["generation_s"] += t1 - t0
        timings["scoring_s"] += time.perf_counter() - t1
        return ro, scores

    ro, scores = draw(first, 0)
    if not dynamic:
        return Collected(first, ro, scores, timings=timings)
    want = len(first)
    original = Collected(first, ro, scores, timings=timings)
    kept: list[Part] = []  # each round's groups with signal
    n_kept = sampled = silent = rounds = 0
    drawn, idx = first, first
    while True:
        part, n_groups, n_silent = _with_signal(idx, ro, scores, k, want - n_kept)
        sampled, silent = sampled + len(idx), silent + n_silent
        if part is not None:
            kept.append(part)
        n_kept += n_groups
        if n_kept >= want or rounds >= max_rounds:
            break
        count = want if n_kept == 0 else min(want, math.ceil((want - n_kept) * sampled / n_kept))
        idx = refill_indices(n_prompts, step, rounds + 1, seed, drawn, count)
        if not len(idx):
            break
        rounds += 1
        drawn = np.concatenate([drawn, idx])
        ro, scores = draw(idx, rounds)
    stats = {
        "train/dynamic_dropped_frac": silent / sampled,
        "train/extra_samples": (sampled - want) * k,
        "train/dynamic_rounds": rounds,
        "train/dynamic_groups": n_kept or want,
    }
    if not kept:
        original.stats = stats
        return original
    return _joined(kept, stats, timings, pad_id)


Part = tuple[np.ndarray, Rollout, torch.Tensor]  # (prompts, their samples, their scores) of one round


def _with_signal(idx: np.ndarray, ro: Rollout, scores: torch.Tensor, k: int, room: int
                 ) -> tuple[Part | None, int, int]:
    """One round's groups with signal, the first `room` of them (beyond B, groups with signal are left
    out): (those groups or None, how many, how many of the round's groups had no signal)."""
    signal = has_signal(scores.view(-1, k))
    groups = signal.nonzero().squeeze(1)[:room]
    silent = len(idx) - int(signal.sum())
    if len(groups) == len(idx):
        return (idx, ro, scores), len(groups), silent
    if not len(groups):
        return None, 0, silent
    rows = group_rows(groups, k)
    return (idx[groups.cpu().numpy()], ro.select(rows), scores[rows]), len(groups), silent


def _joined(kept: list[Part], stats: dict[str, float], timings: dict[str, float], pad_id: int) -> Collected:
    """The rounds' groups with signal as one batch."""
    if len(kept) == 1:
        return Collected(*kept[0], stats, timings)
    return Collected(np.concatenate([i for i, _, _ in kept]), cat_rollouts([r for _, r, _ in kept], pad_id),
                     torch.cat([s for _, _, s in kept]), stats, timings)
