from decimal import Decimal

import pytest
from hypothesis import given
from hypothesis import strategies as st

from rloo.reward.verifier import extract_answer, gold_answer, is_correct, normalize_number


@pytest.mark.parametrize(
    ("text", "strict", "flexible"),
    [
        ("12+5=<<12+5=17>>17\n#### 17", "17", "17"),
        ("#### 1,234", "1234", "1234"),
        ("so #### $1,234.50", "1234.5", "1234.5"),
        ("so #### $1,234.50 dollars", None, "1234.5"),
        ("#### -5", "-5", "-5"),
        ("####-3", "-3", "-3"),
        ("#### −7", "-7", "-7"),
        ("#### 0.50", "0.5", "0.5"),
        ("#### 18.00 kg", None, "18"),
        ("#### 18.00 \n", "18", "18"),
        ("The answer is 42.", None, "42"),
        ("between 3-4 apples", None, "4"),
        ("it costs -$5 now", None, "-5"),
        ("no number at all", None, None),
        ("#### 7\n#### 8", None, "8"),
        ("#### 1,000,000", "1000000", "1000000"),
        ("#### 100", "100", "100"),
        ("#### -0", "0", "0"),
    ],
)
def test_extract(text, strict, flexible):
    assert extract_answer(text, "strict") == strict
    assert extract_answer(text, "flexible") == flexible


def test_is_correct_against_bare_and_full_gold():
    assert is_correct("blah\n#### 1,000.00", "1000")
    assert is_correct("#### 5", "Q: 2+3=<<2+3=5>>5\n#### 5")
    assert not is_correct("#### 6", "5")
    assert not is_correct("the answer is 5", "5")  # strict needs the marker
    assert is_correct("the answer is 5", "5", mode="flexible")
    assert not is_correct("#### 5", "no gold number")
    assert gold_answer(72) == "72"


def test_bad_mode():
    with pytest.raises(ValueError, match="mode"):
        extract_answer("#### 1", "loose")  # type: ignore[arg-type]


def _formats(value: Decimal, places: int) -> list[str]:
    q = f"{abs(value):,.{places}f}"
    sign = "-" if value < 0 else ""
    return [f"{sign}{q}", f"{sign}{q.replace(',', '')}", f"{sign}${q}"]


@given(
    st.integers(min_value=-10**9, max_value=10**9),
    st.integers(min_value=0, max_value=3),
    st.integers(min_value=0, max_value=999),
)
def test_formatted_numbers_round_trip(whole, places, frac):
    value = Decimal(whole) + (Decimal(frac) / 1000 if places else 0)
    value = round(value, places)
    expected = normalize_number(str(value))
    assert expected is not None and Decimal(expected) == value
    for s in _formats(value, places):
        assert extract_answer(f"work...\n#### {s}", "strict") == expected, s
        assert extract_answer(f"so the total is {s}.", "flexible") == expected, s
        assert extract_answer(f"so the total is {s} dollars.", "flexible") == expected, s
        assert is_correct(f"#### {s}", str(value))


# What a policy could write to collect a reward it did not earn: each gets nothing in strict mode.
GAMES = [
    "#### 5\n#### 7",            # several final answers
    "#### 5 or 7",               # hedging between answers
    "#### 5, 7",
    "#### 5/7",                  # a fraction
    "#### 3/4",
    "#### 5e1",                  # an exponent
    "#### 5 apples",             # units or trailing text
    "#### 5\nactually 7",        # more text after the answer
    "#### 5.",
    "#### 1,23",                 # malformed thousands separator
    "#### --5",
    "####",
]


@pytest.mark.parametrize("text", GAMES)
def test_strict_gives_nothing_for_gamed_answers(text):
    assert extract_answer(text, "strict") is None
    assert not any(is_correct(text, gold) for gold in ("5", "7", "3", "50", "123", "1", "-5"))


@given(
    st.integers(min_value=-10**6, max_value=10**6),
    st.sampled_from(["/", "e", "E", " or ", " and ", "x", " ", "\n#### ", "-", "+", "^", "%"]),
    st.integers(min_value=0, max_value=10**6),
)
def test_strict_rejects_anything_but_one_number(a, glue, b):
    text = f"#### {a}{glue}{b}"
    assert extract_answer(text, "strict") is None, text
    assert not is_correct(text, str(a)) and not is_correct(text, str(b))


def test_verifier_reward_pays_nothing_for_games():
    from rloo.reward.rewards import VerifierReward

    honest, games = ["#### 5"], [g for g in GAMES if "5" in g]
    scores = VerifierReward().score([""] * (1 + len(games)), honest + games, ["5"] * (1 + len(games)),
                                    [True] * (1 + len(games)))
    assert scores[0] == 1.0 and scores[1:].sum() == 0.0


def test_prepare_rejects_a_gold_answer_that_is_not_one_number():
    from rloo.data.gsm8k import DataError, check_record

    with pytest.raises(DataError, match=r"train.jsonl:3"):
        check_record({"question": "q", "answer": "1/4 of 3\n#### 3/4"}, "train.jsonl:3")
    assert check_record({"question": "q", "answer": "2+2=<<2+2=4>>4\n#### 4"}, "x")["answer"].endswith("#### 4")
