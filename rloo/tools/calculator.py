"""The calculator: a safe arithmetic evaluator for the `<<expr=value>>` annotations of GSM8K's solutions
(and of the embedded generator's, rloo/data/synthetic.py), the first built-in tool (rloo/tools).

`calculate(call)` evaluates `call` and returns its value as GSM8K writes it: an integer without `.0`,
otherwise a decimal of at most `DECIMALS` places, trailing zeros dropped. Whatever `call` holds, it returns
a string and never raises: a malformed, oversized or undefined expression (division by zero, a power out of
bounds) gets `ERROR`, a result the policy reads like any other.

The grammar (a recursive-descent parser, never `eval`): numbers (`12`, `3.5`, `.5`; no thousands
separators), `+ - * / × ÷ − ( )`, unary minus and plus, and powers `**` or `^` (right-associative, binding
tighter than unary minus, as in Python: `-2**2` is -4). Arithmetic is exact (fractions), so `0.1+0.2` is
`0.3`; the bounds keep every step cheap: at most `MAX_CHARS` characters and `MAX_DEPTH` nested
parentheses or signs, integer exponents of at most `MAX_EXPONENT`, and no value (numerator or denominator)
beyond `MAX_DIGITS` digits.
"""

from __future__ import annotations

from fractions import Fraction

ERROR = "ERROR"
DECIMALS = 6
MAX_CHARS = 200
MAX_DEPTH = 40
MAX_EXPONENT = 64
MAX_DIGITS = 40
_LIMIT = 10**MAX_DIGITS
_OPERATORS = {"×": "*", "÷": "/", "−": "-", "^": "**"}  # the signs a solution may write, as the parser reads them


class CalcError(ValueError):
    """The expression cannot be evaluated: malformed, too big, or undefined."""


def calculate(call: str, **row) -> str:
    """The value of the arithmetic expression `call` as a GSM8K annotation writes it, or `ERROR`. `row`
    (the data record, a tool's other arguments) is not read: the calculator needs only the call."""
    try:
        return format_value(evaluate(call))
    except CalcError:
        return ERROR


def evaluate(expression: str) -> Fraction:
    """The exact value of `expression`; CalcError when it is malformed, too big or undefined."""
    if not isinstance(expression, str):
        raise CalcError(f"not a string: {type(expression).__name__}")
    if len(expression) > MAX_CHARS:
        raise CalcError(f"longer than {MAX_CHARS} characters")
    parser = _Parser(_tokens(expression))
    value = parser.sum()
    if parser.pos != len(parser.tokens):
        raise CalcError(f"unexpected {parser.tokens[parser.pos]!r}")
    return value


def format_value(value: Fraction) -> str:
    """`value` as GSM8K writes it: `24`, `-3`, `0.25`, `3.333333` (rounded to DECIMALS places)."""
    if value.denominator == 1:
        return str(value.numerator)
    rounded = round(value, DECIMALS)
    if rounded.denominator == 1:
        return str(rounded.numerator)
    sign = "-" if rounded < 0 else ""
    whole, part = divmod(abs(rounded.numerator) * 10**DECIMALS // rounded.denominator, 10**DECIMALS)
    return f"{sign}{whole}.{part:0{DECIMALS}d}".rstrip("0")


def _tokens(text: str) -> list[str]:
    out: list[str] = []
    i, n = 0, len(text)
    while i < n:
        c = text[i]
        if c.isspace():
            i += 1
        elif c.isascii() and (c.isdigit() or c == "."):
            j = i
            while j < n and text[j].isascii() and (text[j].isdigit() or text[j] == "."):
                j += 1
            number = text[i:j]
            if number.count(".") > 1 or number == ".":
                raise CalcError(f"not a number: {number!r}")
            out.append(number)
            i = j
        elif text.startswith("**", i):
            out.append("**")
            i += 2
        elif c in "+-*/()":
            out.append(c)
            i += 1
        elif c in _OPERATORS:
            out.append(_OPERATORS[c])
            i += 1
        else:
            raise CalcError(f"unexpected character {c!r}")
    return out


def _bounded(value: Fraction) -> Fraction:
    if abs(value.numerator) >= _LIMIT or value.denominator >= _LIMIT:
        raise CalcError(f"a value beyond {MAX_DIGITS} digits")
    return value


class _Parser:
    """sum := product (('+'|'-') product)*; product := unary (('*'|'/') unary)*;
    unary := ('-'|'+') unary | power; power := atom ('**' unary)?; atom := number | '(' sum ')'."""

    def __init__(self, tokens: list[str]) -> None:
        self.tokens, self.pos, self.depth = tokens, 0, 0

    def _peek(self) -> str | None:
        return self.tokens[self.pos] if self.pos < len(self.tokens) else None

    def _take(self) -> str:
        token = self._peek()
        if token is None:
            raise CalcError("the expression ends early")
        self.pos += 1
        return token

    def _nest(self) -> None:
        self.depth += 1
        if self.depth > MAX_DEPTH:
            raise CalcError(f"nested deeper than {MAX_DEPTH}")

    def sum(self) -> Fraction:
        value = self.product()
        while self._peek() in ("+", "-"):
            op = self._take()
            right = self.product()
            value = _bounded(value + right if op == "+" else value - right)
        return value

    def product(self) -> Fraction:
        value = self.unary()
        while self._peek() in ("*", "/"):
            op = self._take()
            right = self.unary()
            if op == "/" and right == 0:
                raise CalcError("division by zero")
            value = _bounded(value * right if op == "*" else value / right)
        return value

    def unary(self) -> Fraction:
        if self._peek() in ("-", "+"):
            op = self._take()
            self._nest()
            value = self.unary()
            self.depth -= 1
            return -value if op == "-" else value
        return self.power()

    def power(self) -> Fraction:
        base = self.atom()
        if self._peek() != "**":
            return base
        self._take()
        self._nest()
        exponent = self.unary()
        self.depth -= 1
        if exponent.denominator != 1 or abs(exponent) > MAX_EXPONENT:
            raise CalcError(f"an exponent that is not an integer of at most {MAX_EXPONENT}")
        if base == 0 and exponent < 0:
            raise CalcError("division by zero")
        # The size bound before the power is taken: |base|**e has about e times its digits.
        digits = max(len(str(abs(base.numerator))), len(str(base.denominator)))
        if (digits - 1) * abs(int(exponent)) > MAX_DIGITS:
            raise CalcError(f"a value beyond {MAX_DIGITS} digits")
        return _bounded(base ** int(exponent))

    def atom(self) -> Fraction:
        token = self._take()
        if token == "(":
            self._nest()
            value = self.sum()
            self.depth -= 1
            if self._take() != ")":
                raise CalcError("a '(' without its ')'")
            return value
        if token[0].isdigit() or token[0] == ".":
            return _bounded(Fraction(token))
        raise CalcError(f"unexpected {token!r}")
