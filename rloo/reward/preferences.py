"""Preference pairs for the Bradley-Terry reward model, built from labelled policy samples.

For each prompt, every correct sample and the reference solution are "chosen", every incorrect
sample is "rejected"; pairs never cross prompts and never pair a text with itself.
"""

from __future__ import annotations

import random
from dataclasses import dataclass


@dataclass(frozen=True)
class Pair:
    prompt_id: int
    prompt: str
    chosen: str
    rejected: str


def build_pairs(
    prompt_id: int,
    prompt: str,
    reference: str | None,
    samples: list[str],
    correct: list[bool],
    max_pairs: int,
    rng: random.Random,
) -> list[Pair]:
    """Up to `max_pairs` (chosen, rejected) pairs for one prompt."""
    chosen = list(dict.fromkeys([*([reference] if reference else []), *(s for s, ok in zip(samples, correct, strict=True) if ok)]))
    rejected = list(dict.fromkeys(s for s, ok in zip(samples, correct, strict=True) if not ok))
    pairs = [Pair(prompt_id, prompt, c, r) for c in chosen for r in rejected if c != r]
    rng.shuffle(pairs)
    return pairs[:max_pairs]


def split_by_prompt(pairs: list[Pair], val_fraction: float, seed: int) -> tuple[list[Pair], list[Pair]]:
    """Hold out whole prompts, so validation measures generalisation to unseen questions."""
    ids = sorted({p.prompt_id for p in pairs})
    random.Random(seed).shuffle(ids)
    n_val = max(1, round(len(ids) * val_fraction)) if len(ids) > 1 else 0
    val_ids = set(ids[:n_val])
    return [p for p in pairs if p.prompt_id not in val_ids], [p for p in pairs if p.prompt_id in val_ids]
