"""Train/test contamination: which training questions are test questions once both are normalised, and
which share a run of n words with one (the common 13-gram decontamination of GPT-3 and its successors).

Normalising takes away what changes the look of a question but not the problem: letter case (and
Unicode's compatibility forms: full-width digits), whitespace, punctuation, and how a number is written
("1,000" is 1000, "3.0" is 3, "$5" is 5). A copy of a test problem with its case changed, spaces doubled,
" ?" before the question mark, thousands separators or trailing punctuation is still that problem.
"""

from __future__ import annotations

import json
import re
import unicodedata
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from decimal import Decimal

# A number as written: digits with thousands separators, or plain digits, each with an optional fraction.
_NUMBER = re.compile(r"\d{1,3}(?:,\d{3})+(?:\.\d+)?|\d+(?:\.\d+)?")
# Punctuation and symbols, except the point inside a decimal number.
_PUNCT = re.compile(r"(?!(?<=\d)\.(?=\d))[^\w\s]|_")


def _number(m: re.Match) -> str:
    out = format(Decimal(m.group().replace(",", "")).normalize(), "f")
    return out.rstrip("0").rstrip(".") if "." in out else out


def words(text: str) -> list[str]:
    """The question's words once normalised (module docstring)."""
    text = unicodedata.normalize("NFKC", text).casefold()
    return _PUNCT.sub(" ", _NUMBER.sub(_number, text)).split()


def normalised(text: str) -> str:
    """The question as the checks compare it: its words once normalised, joined by single spaces."""
    return " ".join(words(text))


def _ngrams(ws: list[str], n: int) -> set[tuple[str, ...]]:
    return {tuple(ws[i : i + n]) for i in range(len(ws) - n + 1)}


@dataclass(frozen=True)
class Overlap:
    """The training questions (their indices) that are test questions once normalised (`exact`), and those
    that share a run of `n` normalised words with one (`ngram`; None when n is 0, the check off). A
    question shorter than n words has no such run: `exact` covers it."""

    exact: list[int]
    ngram: list[int] | None


def overlap(train: Iterable[str], test: Iterable[str], n: int = 0) -> Overlap:
    """Which of the `train` questions overlap the `test` ones (`Overlap`), each question normalised once."""
    test_words = [words(q) for q in test]
    seen = {" ".join(ws) for ws in test_words}  # normalised(q), from the words the n-grams use too
    grams: set[tuple[str, ...]] = set()
    for ws in test_words if n else ():
        grams |= _ngrams(ws, n)
    exact, ngram = [], []
    for i, q in enumerate(train):
        ws = words(q)
        if " ".join(ws) in seen:
            exact.append(i)
        if n and not grams.isdisjoint(_ngrams(ws, n)):
            ngram.append(i)
    return Overlap(exact, ngram if n else None)


@dataclass(frozen=True)
class Duplicates:
    """The records of a split that repeat an earlier one (their indices): `exact`, the same record field for
    field; `normalised`, another record whose question is an earlier record's once both are normalised (as
    `overlap` compares them: the same problem written differently, or asked with a different answer)."""

    exact: list[int]
    normalised: list[int]

    def __len__(self) -> int:
        return len(self.exact) + len(self.normalised)

    def dropped(self, rows: list[dict]) -> list[dict]:
        """`rows` less the duplicates: the first record of each normalised question, in order."""
        gone = {*self.exact, *self.normalised}
        return [r for i, r in enumerate(rows) if i not in gone]


def duplicates(rows: Iterable[Mapping]) -> Duplicates:
    """Which of `rows` ({"question", ...} records) repeat an earlier one (`Duplicates`)."""
    records: set[str] = set()
    questions: set[str] = set()
    exact, norm = [], []
    for i, row in enumerate(rows):
        record, question = json.dumps(row, sort_keys=True, default=str), normalised(row["question"])
        if record in records:
            exact.append(i)
        elif question in questions:
            norm.append(i)
        records.add(record)
        questions.add(question)
    return Duplicates(exact, norm)
