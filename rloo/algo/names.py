"""The advantage estimators' names, without torch: the config checks read them before any stage runs."""

ESTIMATORS: tuple[str, ...] = ("rloo", "grpo", "grpo_std", "reinforce", "moving_average", "remax")

# Estimators whose baseline is built from the other samples of the same group, so k >= 2 is required.
GROUP_ESTIMATORS: tuple[str, ...] = ("rloo", "grpo", "grpo_std")
