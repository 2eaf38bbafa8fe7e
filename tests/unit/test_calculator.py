"""The calculator tool (rloo/tools/calculator.py): exact arithmetic as GSM8K's annotations write it, and
a result string, never an exception, for anything else."""

from __future__ import annotations

from fractions import Fraction

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rloo.tools.calculator import ERROR, MAX_CHARS, MAX_DEPTH, calculate, evaluate, format_value


@pytest.mark.parametrize(("call", "value"), [
    ("2+3*4", "14"), ("48/2", "24"), ("10/4", "2.5"), ("10/3", "3.333333"), ("-1/3", "-0.333333"),
    ("7-10", "-3"), ("0.1+0.2", "0.3"), ("1.5*2", "3"), (".5+1", "1.5"), ("3 × 4 ÷ 2", "6"), ("8 − 3", "5"),
    ("(1+(2*(3+(4-(5/(1+1))))))", "10"), ("((((7))))", "7"), ("-(-(3))", "3"), ("2*-3", "-6"),
    ("2**10", "1024"), ("2^10", "1024"), ("-2**2", "-4"), ("(-2)**2", "4"), ("2**3**2", "512"), ("2**-2", "0.25"),
    ("1/3*3", "1"),
])
def test_arithmetic_as_gsm8k_annotations_write_it(call, value):
    assert calculate(call) == value


@pytest.mark.parametrize("call", [
    "1/0", "5/(3-3)", "0**-1",  # division by zero
    "2**1000", "10**40", "9"*50, "(10**30)*(10**30)", "2**65", "2**0.5", "1/10**45",  # too big, or no bounded result
    "", "(", "((1+2)", "1+2)", "1+", "*3", "1..2", ".", "3 4", "1e5", "5%", "1,000", "$5", "abc", "__import__('os')",
    "(" * (MAX_DEPTH + 1) + "1" + ")" * (MAX_DEPTH + 1), "-" * (MAX_DEPTH + 1) + "1", "1+" * MAX_CHARS + "1",
])
def test_bad_input_gets_the_error_string(call):
    assert calculate(call) == ERROR


def test_a_row_is_accepted_and_not_read():
    assert calculate("6*7", question="q", answer="a #### 42") == "42"


@settings(max_examples=300, deadline=None)
@given(st.text(alphabet="0123456789.+-*/()^× ÷−e ", max_size=60))
def test_any_text_gets_a_string_and_never_raises(call):
    out = calculate(call)
    assert isinstance(out, str) and out and len(out) <= 60


@settings(max_examples=200, deadline=None)
@given(st.integers(-10**6, 10**6), st.integers(-10**6, 10**6), st.sampled_from("+-*/"))
def test_two_integers_agree_with_exact_arithmetic(a, b, op):
    call = f"({a}){op}({b})"
    if op == "/" and b == 0:
        assert calculate(call) == ERROR
        return
    exact = {"+": Fraction(a) + b, "-": Fraction(a) - b, "*": Fraction(a) * b, "/": Fraction(a, b or 1)}[op]
    assert evaluate(call) == exact
    out = calculate(call)
    assert abs(Fraction(out) - exact) <= Fraction(1, 10**6)  # rounded to 6 places at most
    assert out == str(exact.numerator) if exact.denominator == 1 else "." in out


def test_format_value():
    assert [format_value(Fraction(x)) for x in ("12", "-3", "1/4", "2/3", "-1/8", "1/10000000")] == \
        ["12", "-3", "0.25", "0.666667", "-0.125", "0"]
