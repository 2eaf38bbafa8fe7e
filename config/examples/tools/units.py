"""Tools of your own, for config/examples/your-tool.yaml: each is called as f(call, **row) with the text
between its opening marker and `=` (`call`) and the data record's columns (`row`), and returns the result
text. Bad input gets a result, `ERROR`, never an exception (an exception stops the run on this file's
line): docs/rewards-and-data.md#your-own-tool has the contract."""

import re

_NUMBER = re.compile(r"\d+(?:\.\d+)?")


def km_to_miles(call: str, **row) -> str:
    """A unit converter: `[[5 km=` gets `3.107]]`."""
    number = call.strip().removesuffix("km").strip()
    try:
        return f"{float(number) * 0.621371:.3f}".rstrip("0").rstrip(".")
    except ValueError:
        return "ERROR"


def question_number(call: str, question: str) -> str:
    """A lookup in the row's fields: `{{n2=` gets the question's second number and `}}`, so the policy
    copies the question's numbers rather than misreading them. It names `question`, so it gets only that
    column (every record has it: checked when the config is read)."""
    numbers = _NUMBER.findall(question)
    index = call.strip().removeprefix("n")
    if not index.isdigit() or not 1 <= int(index) <= len(numbers):
        return "ERROR"
    return numbers[int(index) - 1]
