"""How a policy's completions used the tools (issue 73), read from the completions' text alone, so the
figures can be recomputed from the evaluation records: the share of the tools' calls that erred, and the
share of right answers whose final number came from a tool's result.

A call's result is found as the rollout finds it (rloo.tools.result_spans: after an opening marker, the
first call end, up to the closing marker), the first `tools.max_calls` of a completion: later ones are the
policy's own text, as in the rollout. A call erred when its result is the calculator's `ERROR`, the result
a tool returns for input it cannot compute (docs/rewards-and-data.md#your-own-tool). A right answer came
from a tool when its final number (the verifier's strict answer) equals, as a number, one of the
completion's results: the policy copied what the tool computed rather than computing it itself.
"""

from __future__ import annotations

from decimal import Decimal
from typing import Any

from rloo.reward.verifier import extract_answer, is_correct, normalize_number
from rloo.tools import Toolbox, result_spans
from rloo.tools.calculator import ERROR


def tool_results(text: str, triggers: list[tuple[str, str, str]], max_calls: int) -> list[str]:
    """The results the tools wrote into `text` (without their closing markers), in order: those of its
    first `max_calls` calls. `triggers`: (open, end, close) of each tool (rloo.tools.triggers)."""
    closes = {close for _, _, close in triggers}
    out = []
    for start, stop in result_spans(text, triggers)[:max_calls]:
        piece = text[start:stop]
        out.append(next((piece[: -len(c)] for c in closes if piece.endswith(c)), piece))
    return out


def from_tool(text: str, results: list[str]) -> bool:
    """Whether `text`'s final answer (strict) equals, as a number, one of the tools' `results`."""
    answer = extract_answer(text, "strict")
    if answer is None:
        return False
    values = {Decimal(v) for v in map(normalize_number, results) if v is not None}
    return Decimal(answer) in values


def tool_use(texts: dict[str, Any], golds: list[str], box: Toolbox) -> dict[str, float | None]:
    """Over every sampled draw (`texts["draws"]`, evaluate_policy's completions per problem):
    `tool_error_share_sampled`, the share of the tools' calls whose result is `ERROR` (None without a
    call), and `tool_answer_share_sampled`, the share of right answers (strict) whose final number came from
    a tool's result (None without a right answer)."""
    triggers = [(t.open, t.end, t.close) for t in box.tools]
    calls = errors = right = from_tools = 0
    for draws, gold in zip(texts["draws"], golds, strict=True):
        for text in draws:
            results = tool_results(text, triggers, box.max_calls)
            calls += len(results)
            errors += sum(r.strip() == ERROR for r in results)
            if is_correct(text, gold):
                right += 1
                from_tools += from_tool(text, results)
    return {"tool_error_share_sampled": errors / calls if calls else None,
            "tool_answer_share_sampled": from_tools / right if right else None}
