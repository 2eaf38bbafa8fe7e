"""The embedded default data set: grade-school word problems in GSM8K format, generated from a seed.

Each problem is a chain of 1-4 arithmetic steps on one quantity, told through one of several themes.
Solutions write one calculation per line as ``a+b=<<a+b=c>>c`` (the GSM8K calculator annotation)
and end with ``#### c``.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import yaml

from rloo.errors import InputError

NAMES = [
    "Ava",
    "Ben",
    "Cora",
    "Dev",
    "Eli",
    "Fay",
    "Gus",
    "Hana",
    "Ivan",
    "Jade",
    "Kai",
    "Lena",
    "Milo",
    "Nina",
    "Omar",
    "Pia",
    "Quinn",
    "Rosa",
    "Sam",
    "Tara",
    "Uma",
    "Vik",
    "Wes",
    "Zoe",
]
ITEMS = [
    "apples",
    "marbles",
    "stickers",
    "cookies",
    "pencils",
    "cards",
    "shells",
    "stamps",
    "books",
    "coins",
    "beads",
    "eggs",
    "toys",
    "plums",
    "rocks",
    "buttons",
]
OPS = ("add", "sub", "mul", "div")


@dataclass(frozen=True)
class Theme:
    """Sentences for the start, each operation and the question; fields are filled by str.format."""

    start: str
    add: str
    sub: str
    mul: str
    div: str
    question: str


THEMES = [Theme(**t) for t in yaml.safe_load((Path(__file__).parent / "themes.yaml").read_text())]

_APPLY: dict[str, Callable[[int, int], int]] = {
    "add": lambda x, b: x + b,
    "sub": lambda x, b: x - b,
    "mul": lambda x, b: x * b,
    "div": lambda x, b: x // b,
}
_SYMBOL = {"add": "+", "sub": "-", "mul": "*", "div": "/"}


def _operand(rng: random.Random, op: str, x: int, max_number: int, max_value: int) -> int | None:
    """A second operand that keeps every intermediate value a whole number in [1, max_value]."""
    if op == "add":
        return rng.randint(1, min(max_number, max_value - x)) if x < max_value else None
    if op == "sub":
        # Keep at least one: a zero would make every later step trivial.
        return rng.randint(1, x - 1) if x >= 2 else None
    if op == "mul":
        b = rng.randint(2, 5)
        return b if x * b <= max_value else None
    divisors = [b for b in range(2, 6) if x % b == 0 and x // b >= 1]
    return rng.choice(divisors) if divisors else None


def make_problem(rng: random.Random, steps: int, max_number: int = 30, max_value: int = 150) -> dict:
    """One problem with exactly `steps` operations: {"question", "answer", "steps"}."""
    theme = rng.choice(THEMES)
    fields = {"name": rng.choice(NAMES), "item": rng.choice(ITEMS)}
    x = rng.randint(2, max_number)
    sentences = [theme.start.format(a=x, **fields)]
    lines = []
    for _ in range(steps):
        while True:
            op = rng.choice(OPS)
            b = _operand(rng, op, x, max_number, max_value)
            if b is not None:
                break
        y = _APPLY[op](x, b)
        sentences.append(getattr(theme, op).format(b=b, **fields))
        expr = f"{x}{_SYMBOL[op]}{b}"
        lines.append(f"{expr}=<<{expr}={y}>>{y}")
        x = y
    question = " ".join([*sentences, theme.question.format(**fields)])
    answer = "\n".join([*lines, f"#### {x}"])
    return {"question": question, "answer": answer, "steps": steps}


def generate(
    n_train: int,
    n_test: int,
    seed: int = 0,
    step_weights: list[float] | tuple[float, ...] = (0.5, 0.3, 0.12, 0.08),
    max_number: int = 30,
    max_value: int = 150,
    n_val: int = 0,
) -> tuple[list[dict], list[dict], list[dict]]:
    """Deterministic train, test and validation splits, no question in two of them; each record notes
    its step count. The validation problems are drawn after the others, so train and test do not depend
    on `n_val`."""
    if not step_weights or sum(step_weights) <= 0:
        raise InputError("data.synthetic.step_weights must contain a positive weight")
    rng = random.Random(seed)
    wanted = n_train + n_test + n_val
    seen: set[str] = set()
    problems: list[dict] = []
    attempts = 0
    while len(problems) < wanted:
        attempts += 1
        if attempts > 50 * wanted + 1000:
            raise InputError(
                f"could only generate {len(problems)} distinct problems out of {wanted}; "
                "raise data.synthetic.max_number or lower n_train/n_test/data.val_examples"
            )
        steps = rng.choices(range(1, len(step_weights) + 1), weights=step_weights)[0]
        p = make_problem(rng, steps, max_number, max_value)
        if p["question"] not in seen:
            seen.add(p["question"])
            problems.append(p)
    # The split is drawn after de-duplication, so no question occurs in two splits.
    return problems[:n_train], problems[n_train : n_train + n_test], problems[n_train + n_test :]
