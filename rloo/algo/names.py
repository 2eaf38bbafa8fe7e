"""The advantage estimators' names and what k they need, without torch: the config checks read them before
any stage runs."""

ESTIMATORS: tuple[str, ...] = ("rloo", "grpo", "grpo_std", "reinforce", "moving_average", "remax")

# Estimators whose baseline is built from the other samples of the same group, so k >= 2 is required.
GROUP_ESTIMATORS: tuple[str, ...] = ("rloo", "grpo", "grpo_std")


def k_problems(estimator: str, k: int, dynamic_sampling: bool = False) -> list[str]:
    """What `k` samples per prompt are too few for: a group estimator's baseline is built from a prompt's
    other samples, and dynamic sampling keeps the groups whose rewards differ (the config checks, the
    trainer and the estimators all ask here)."""
    out = []
    if estimator in GROUP_ESTIMATORS and k < 2:
        out.append(f"the {estimator} estimator needs k >= 2 samples per prompt")
    if dynamic_sampling and k < 2:
        out.append("rloo.dynamic_sampling keeps groups whose rewards differ; needs k >= 2")
    return out
