"""Learning-rate multipliers for `torch.optim.lr_scheduler.LambdaLR`, shared by the training stages."""

from __future__ import annotations

import math
from collections.abc import Callable

DECAYS = ("constant", "linear", "cosine")


def lr_multiplier(warmup: int, total: int, decay: str = "constant", floor: float = 0.0) -> Callable[[int], float]:
    """Multiplier of the peak LR at scheduler step s: (s+1)/warmup while s < warmup, then `decay` from
    1 down to `floor` at step `total` (and `floor` after it); `constant` stays at 1."""
    if decay not in DECAYS:
        raise ValueError(f"unknown LR decay {decay!r} (one of {', '.join(DECAYS)})")

    def f(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        if decay == "constant":
            return 1.0
        progress = min(1.0, (step - warmup) / max(1, total - warmup))
        shape = 0.5 * (1 + math.cos(math.pi * progress)) if decay == "cosine" else 1.0 - progress
        return floor + (1 - floor) * shape

    return f
