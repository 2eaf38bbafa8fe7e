"""Reward functions in TRL's form, for config/examples/your-reward.yaml and config/examples/smollm2-format.yaml:
each takes keyword arguments (lists with one item per completion) and returns one float or None per
completion. docs/rewards-and-data.md has the contract."""

import re

# "#### <number>" alone on the last line: the GSM8K form of a final answer.
_FINAL = re.compile(r"(?:^|\n)####[ \t]*-?\$?[\d,]+(?:\.\d+)?\s*$")


def format_bonus(completions, **kwargs):
    """1.0 for a completion that ends with the line "#### <number>", 0.5 for one that writes the
    marker elsewhere, 0.0 for one without it."""
    return [1.0 if _FINAL.search(c) else 0.5 if "####" in c else 0.0 for c in completions]


def length_penalty(completion_ids, **kwargs):
    """Minus the completion's length in thousands of tokens: a small push towards shorter answers."""
    return [-len(ids) / 1000 for ids in completion_ids]
