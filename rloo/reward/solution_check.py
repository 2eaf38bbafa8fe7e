"""A judge of the whole written solution, independent of the training reward: every `<<expr=value>>`
calculator annotation must evaluate to its stated value, and the final answer must match the gold.

The training reward (the verifier) reads only the final `#### N`; this checker also reads the work.
An expression is evaluated by walking its syntax tree, allowing numbers, + - * /, unary signs and
parentheses only: anything else (a name, a call, `**`, an attribute) is rejected unevaluated, and a
rejected annotation counts as wrong work.

Two figures are kept apart: whether the work is right (the checker's own, read from the annotations
only) and whether the answer is right (the verifier's strict check, so not independent of a
verifier-trained policy). A completion without annotations has unchecked work: it is never counted as
right work, only as unchecked.
"""

from __future__ import annotations

import ast
import math
import re
from dataclasses import dataclass
from decimal import ROUND_DOWN, ROUND_HALF_UP, Decimal, InvalidOperation
from fractions import Fraction

from rloo.reward.verifier import is_correct, normalize_number

ANNOTATION = re.compile(r"<<([^<>=]*)=([^<>]*)>>")
# Longer expressions are rejected before parsing: a calculator step is short, and this bounds the
# size of the numbers + - * / can build.
MAX_EXPRESSION_CHARS = 100
_OPS = {ast.Add: lambda x, y: x + y, ast.Sub: lambda x, y: x - y, ast.Mult: lambda x, y: x * y,
        ast.Div: lambda x, y: x / y}


class UnsafeExpression(ValueError):
    """An annotation's expression holds something other than numbers, + - * / and parentheses."""


def evaluate_arithmetic(expr: str) -> Fraction:
    """The exact value of `expr` (numbers, + - * /, unary signs, parentheses); raises UnsafeExpression
    for anything else, ZeroDivisionError on a division by zero."""
    text = expr.replace(",", "").replace("$", "").replace("×", "*").replace("÷", "/").replace("−", "-").strip()
    if not text or len(text) > MAX_EXPRESSION_CHARS:
        raise UnsafeExpression(f"expression of {len(text)} characters")
    try:
        tree = ast.parse(text, mode="eval")
    except SyntaxError as e:
        raise UnsafeExpression(f"not arithmetic: {expr!r}") from e
    return _value(tree.body)


def _value(node: ast.AST) -> Fraction:
    if isinstance(node, ast.Constant) and type(node.value) is int:
        return Fraction(node.value)
    if isinstance(node, ast.Constant) and type(node.value) is float and math.isfinite(node.value):
        return Fraction(repr(node.value))  # via its repr: 0.1 is one tenth, not the nearest binary fraction
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.UAdd, ast.USub)):
        v = _value(node.operand)
        return -v if isinstance(node.op, ast.USub) else v
    if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
        return _OPS[type(node.op)](_value(node.left), _value(node.right))
    raise UnsafeExpression(f"not allowed in a calculator annotation: {type(node).__name__}")


def annotation_is_right(expr: str, stated: str) -> bool:
    """Whether `expr` evaluates to `stated`: exactly, or rounded (half up) or truncated to the stated
    number's decimals, as GSM8K writes 10/3 = 3.33; an unsafe or unevaluable expression is wrong."""
    number = normalize_number(stated)
    try:
        value = evaluate_arithmetic(expr)
    except (UnsafeExpression, ZeroDivisionError):
        return False
    if number is None:
        return False
    target = Decimal(number)
    if Fraction(target) == value:
        return True
    exponent = min(0, int(target.as_tuple().exponent))
    places = Decimal(1).scaleb(exponent)
    try:
        exact = Decimal(value.numerator) / Decimal(value.denominator)
        return target in (exact.quantize(places, ROUND_HALF_UP), exact.quantize(places, ROUND_DOWN))
    except InvalidOperation:  # beyond Decimal's 28 digits: no calculator step, and not the stated value
        return False


@dataclass(frozen=True)
class Checked:
    """One completion: its final answer against the gold, and its annotations."""

    right_answer: bool
    annotations: int
    wrong_annotations: int

    @property
    def work_checked(self) -> bool:
        """At least one annotation: work with none cannot be checked, so it is neither right nor wrong."""
        return self.annotations > 0

    @property
    def work_right(self) -> bool:
        """Checked work with every annotation right."""
        return self.work_checked and self.wrong_annotations == 0

    @property
    def right(self) -> bool:
        """Right answer and checked, right work."""
        return self.right_answer and self.work_right


def check(completion: str, gold: str) -> Checked:
    """Grade `completion`: the verifier's strict final answer against `gold`, and every annotation."""
    found = ANNOTATION.findall(completion)
    wrong = sum(not annotation_is_right(expr, stated) for expr, stated in found)
    return Checked(is_correct(completion, gold, "strict"), len(found), wrong)


NO_ANNOTATIONS = "no completion carries a <<expr=value>> calculator annotation: the work cannot be checked"
# The keys that read only the annotations, and those that read the verifier's final-answer check too:
# the results' `judges` block flags their independence from the training reward apart.
WORK_FIGURES = ("work_checked_share", "work_right", "work_right_greedy")
ANSWER_FIGURES = ("answer_right", "answer_right_greedy", "answer_and_work_right", "answer_and_work_right_greedy",
                  "right_answer_wrong_work_share", "right_answer_unchecked_share")


def _share(hits: list[bool]) -> float | None:
    return sum(hits) / len(hits) if hits else None


def summarize(sampled: list[list[str]], greedy: list[str], golds: list[str]) -> dict:
    """The checker's figures for one policy: `sampled` holds each problem's draws, `greedy` one
    completion per problem. Sampled figures are over every draw.

    work_checked_share: completions with at least one annotation; work_right(_greedy): of those, the
    share with every annotation right; answer_right(_greedy): the verifier's strict final answer;
    answer_and_work_right(_greedy): both, unchecked work counting as not right; of the sampled
    completions with the right answer, right_answer_wrong_work_share is the share of the checked ones
    with a wrong annotation, right_answer_unchecked_share the share without annotations. Where no
    completion is annotated the work figures are None, with a `reason`: n/a, not 0.
    """
    draws = [check(t, g) for texts, g in zip(sampled, golds, strict=True) for t in texts]
    greedy_checked = [check(t, g) for t, g in zip(greedy, golds, strict=True)]
    right_answer = [c for c in draws if c.right_answer]
    out = {
        "completions": len(draws),
        "work_checked_share": _share([c.work_checked for c in draws]) or 0.0,
        "work_right": None, "work_right_greedy": None,
        "answer_right": _share([c.right_answer for c in draws]),
        "answer_right_greedy": _share([c.right_answer for c in greedy_checked]),
        "answer_and_work_right": None, "answer_and_work_right_greedy": None,
        "right_answer_wrong_work_share": None,
        "right_answer_unchecked_share": _share([not c.work_checked for c in right_answer]),
    }
    if not any(c.work_checked for c in draws + greedy_checked):
        return {**out, "reason": NO_ANNOTATIONS}
    out.update(
        work_right=_share([c.work_right for c in draws if c.work_checked]),
        work_right_greedy=_share([c.work_right for c in greedy_checked if c.work_checked]),
        answer_and_work_right=_share([c.right for c in draws]),
        answer_and_work_right_greedy=_share([c.right for c in greedy_checked]),
        right_answer_wrong_work_share=_share([not c.work_right for c in right_answer if c.work_checked]),
    )
    return out
