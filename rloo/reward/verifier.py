"""Final-answer extraction and numeric comparison for GSM8K-style solutions: the ground-truth judge.

strict   : the GSM8K convention, and nothing a policy could game: exactly one ``####`` marker, and
           after it one well-formed number and nothing else (a second marker, a fraction, an exponent,
           units or a hedge such as ``5 or 7`` give no answer at all);
flexible : the last number anywhere in the text (for lenient reporting only).
A number is an optional minus sign and ``$``, digits with optional thousands separators, and optional
decimals; numbers are compared as exact decimals, so ``1,000.00`` equals ``1000``.
"""

from __future__ import annotations

import re
from decimal import Decimal, InvalidOperation
from typing import Literal

Mode = Literal["strict", "flexible"]

# A minus sign counts only when it does not follow a word or a closing bracket ("3-4" is 3 and 4).
_NUMBER = (
    r"(?P<sign>(?<![\w.)\]])[-−])?\s?\$?\s?"
    r"(?<![\d.,])(?P<digits>\d{1,3}(?:,\d{3})+(?![\d])|\d+)(?P<frac>\.\d+)?"
)
_NUMBER_RE = re.compile(_NUMBER)
MARKER = "####"
# Everything after the marker: one number, surrounded by nothing but whitespace.
_STRICT_TAIL = re.compile(r"\s*(?P<sign>[-−])?\s?\$?\s?(?P<digits>\d{1,3}(?:,\d{3})+|\d+)(?P<frac>\.\d+)?\s*")


def normalize_number(text: str) -> str | None:
    """Canonical decimal string of a number written with optional sign, `$` and commas, else None."""
    cleaned = text.strip().replace(",", "").replace("$", "").replace("−", "-").replace(" ", "")
    try:
        value = Decimal(cleaned)
    except InvalidOperation:
        return None
    if not value.is_finite():
        return None
    return _canonical(value)


def _canonical(value: Decimal) -> str:
    out = format(value.normalize(), "f")
    if "." in out:
        out = out.rstrip("0").rstrip(".")
    return "0" if out in ("-0", "") else out


def _from_match(m: re.Match) -> str:
    sign = "-" if m.group("sign") else ""
    digits = m.group("digits").replace(",", "")
    frac = m.group("frac") or ""
    return _canonical(Decimal(sign + digits + frac))


def extract_answer(text: str, mode: Mode = "strict") -> str | None:
    """The final answer of `text` as a normalised number string, or None if there is none."""
    if mode == "strict":
        parts = text.split(MARKER)
        m = _STRICT_TAIL.fullmatch(parts[1]) if len(parts) == 2 else None
        return _from_match(m) if m else None
    if mode == "flexible":
        matches = list(_NUMBER_RE.finditer(text))
        return _from_match(matches[-1]) if matches else None
    raise ValueError(f"mode must be 'strict' or 'flexible', got {mode!r}")


def gold_answer(gold: str | int | float) -> str | None:
    """The reference number of a bare number or of a full GSM8K answer ending in `#### N`."""
    text = str(gold)
    if "####" in text:
        return extract_answer(text, "strict")
    return normalize_number(text) or extract_answer(text, "flexible")


def is_correct(completion: str, gold: str | int | float, mode: Mode = "strict") -> bool:
    """True when the completion's final answer equals the gold answer as a number."""
    target = gold_answer(gold)
    got = extract_answer(completion, mode)
    return target is not None and got is not None and Decimal(got) == Decimal(target)


def reward(completions: list[str], answer: list[str], finished: list[bool] | None = None,
           **kwargs) -> list[float]:
    """The verifier as a reward function (`reward.functions: - {fn: "rloo.reward.verifier:reward"}`,
    TRL's calling convention: rloo/reward/functions.py): 1.0 for a completion whose final answer equals
    the record's, else 0.0; like `reward.source: verifier`, a completion cut off by the token budget
    (`finished` False, where the caller says) scores 0."""
    done = finished if finished is not None else [True] * len(completions)
    return [float(f and is_correct(c, a)) for c, a, f in zip(completions, answer, done, strict=True)]
