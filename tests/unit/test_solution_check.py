"""rloo.reward.solution_check: hand-made completions, and expressions that must be refused, not run."""

from fractions import Fraction

import pytest

from rloo.reward.solution_check import (
    NO_ANNOTATIONS,
    UnsafeExpression,
    annotation_is_right,
    check,
    evaluate_arithmetic,
    summarize,
)

GOLD = "5+3=<<5+3=8>>8\n8*2=<<8*2=16>>16\n#### 16"
RIGHT = "5+3=<<5+3=8>>8\n8*2=<<8*2=16>>16\n#### 16"
RIGHT_ANSWER_WRONG_WORK = "5+3=<<5+3=9>>9\n8*2=<<8*2=16>>16\n#### 16"
WRONG_ANSWER = "5+3=<<5+3=8>>8\n8*3=<<8*3=24>>24\n#### 24"
CHAT = "Five plus three is eight, and twice that is sixteen.\n#### 16"


def test_right_answer_and_right_work():
    c = check(RIGHT, GOLD)
    assert (c.right_answer, c.annotations, c.wrong_annotations, c.work_checked, c.work_right, c.right) == (
        True, 2, 0, True, True, True)


def test_right_answer_with_a_wrong_annotation_is_not_right():
    c = check(RIGHT_ANSWER_WRONG_WORK, GOLD)
    assert (c.right_answer, c.wrong_annotations, c.work_right, c.right) == (True, 1, False, False)


def test_wrong_answer_with_right_work_is_not_right():
    c = check(WRONG_ANSWER, GOLD)
    assert (c.right_answer, c.wrong_annotations, c.work_right, c.right) == (False, 0, True, False)


def test_work_without_annotations_is_unchecked_not_right():
    c = check(CHAT, GOLD)
    assert (c.right_answer, c.work_checked, c.work_right, c.right) == (True, False, False, False)


def test_policy_figures():
    sampled = [[RIGHT, RIGHT_ANSWER_WRONG_WORK], [WRONG_ANSWER, RIGHT]]
    s = summarize(sampled, [RIGHT, WRONG_ANSWER], [GOLD, GOLD])
    assert s["work_checked_share"] == 1.0 and s["completions"] == 4
    assert s["work_right"] == 3 / 4 and s["work_right_greedy"] == 1.0  # the answer is not read
    assert s["answer_right"] == 3 / 4 and s["answer_right_greedy"] == 1 / 2
    assert s["answer_and_work_right"] == 2 / 4 and s["answer_and_work_right_greedy"] == 1 / 2
    assert s["right_answer_wrong_work_share"] == 1 / 3  # of the 3 right final answers, 1 has wrong work
    assert s["right_answer_unchecked_share"] == 0.0
    assert "reason" not in s


def test_a_completion_without_annotations_is_unchecked_in_the_figures():
    """Dropping the annotations must not buy right work: the prose answer is right, its work unchecked."""
    s = summarize([[RIGHT, CHAT], [CHAT, RIGHT_ANSWER_WRONG_WORK]], [CHAT, RIGHT], [GOLD, GOLD])
    assert s["work_checked_share"] == 2 / 4
    assert s["work_right"] == 1 / 2  # of the two checked: RIGHT right, RIGHT_ANSWER_WRONG_WORK wrong
    assert s["answer_right"] == 1.0  # every final answer is 16
    assert s["answer_and_work_right"] == 1 / 4 and s["answer_and_work_right_greedy"] == 1 / 2
    assert s["right_answer_wrong_work_share"] == 1 / 2 and s["right_answer_unchecked_share"] == 2 / 4
    assert s["work_right_greedy"] == 1.0  # the greedy CHAT is unchecked, not counted


def test_no_annotations_is_not_applicable_rather_than_zero():
    s = summarize([[CHAT, CHAT]], [CHAT], [GOLD])
    assert s["work_right"] is None and s["answer_and_work_right"] is None and s["right_answer_wrong_work_share"] is None
    assert s["work_checked_share"] == 0.0 and s["reason"] == NO_ANNOTATIONS
    assert s["answer_right"] == 1.0 and s["right_answer_unchecked_share"] == 1.0  # the answer is still graded


@pytest.mark.parametrize(("expr", "stated", "right"), [
    ("10/3", "3.33", True), ("10/3", "3.34", False), ("(2+3)*4", "20", True), ("-2*-3", "6", True),
    ("1,000/4", "250", True), ("$12*3", "$36", True), ("0.1+0.2", "0.3", True), ("7/0", "0", False),
    ("2*3", "7", False), ("2*3", "six", False)])
def test_annotation_values(expr, stated, right):
    assert annotation_is_right(expr, stated) is right


@pytest.mark.parametrize("expr", [
    "__import__('os').system('touch /tmp/rloo-pwned')", "open('/etc/passwd').read()", "2**10", "9**9**9",
    "(lambda: 1)()", "x+1", "[1][0]", "1 if 1 else 2", "'3'+'4'", "1e999", "1" * 101, "not 1", "True+1"])
def test_unsafe_expressions_are_rejected_not_evaluated(expr, tmp_path):
    with pytest.raises(UnsafeExpression):
        evaluate_arithmetic(expr)
    assert annotation_is_right(expr, "1") is False
    c = check(f"x=<<{expr}=1>>1\n#### 16", GOLD)
    assert c.annotations == 1 and c.wrong_annotations == 1


def test_exact_arithmetic():
    assert evaluate_arithmetic("1/3 + 1/6") == Fraction(1, 2)
