"""Reward functions in TRL's form for the tests: one with spread on the micro policy (which solves nothing,
so the verifier pays it 0 everywhere and an update would change no weight)."""


def shorter(completions, **kwargs):
    """Shorter completions score higher."""
    return [-len(c) / 50.0 for c in completions]
