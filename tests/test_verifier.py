from decimal import Decimal

import pytest
from hypothesis import given
from hypothesis import strategies as st

from rloo.verifier import extract_answer, gold_answer, is_correct, normalize_number


@pytest.mark.parametrize(
    ("text", "strict", "flexible"),
    [
        ("12+5=<<12+5=17>>17\n#### 17", "17", "17"),
        ("#### 1,234", "1234", "1234"),
        ("so #### $1,234.50 dollars", "1234.5", "1234.5"),
        ("#### -5", "-5", "-5"),
        ("####-3", "-3", "-3"),
        ("#### −7", "-7", "-7"),
        ("#### 0.50", "0.5", "0.5"),
        ("#### 18.00 kg", "18", "18"),
        ("The answer is 42.", None, "42"),
        ("between 3-4 apples", None, "4"),
        ("it costs -$5 now", None, "-5"),
        ("no number at all", None, None),
        ("#### 7\n#### 8", "8", "8"),
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
    return [f"{sign}{q}", f"{sign}{q.replace(',', '')}", f"{sign}${q}", f"{sign}{q} dollars"]


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
        assert is_correct(f"#### {s}", str(value))
