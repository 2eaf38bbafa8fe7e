"""Pairwise judges: which of two answers to a question is better, asked in both presentation orders.

`verifier` (default) prefers the answer whose final number is right; `llm` asks a model behind an
OpenAI-compatible chat-completions endpoint. A judge returns "A", "B", "tie", or None when its
verdict cannot be parsed; `win_rate` turns both orders into wins, losses, ties and invalid verdicts.
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from rloo.errors import UserError
from rloo.progress import Progress
from rloo.reward import retries
from rloo.reward.verifier import is_correct
from rloo.settings import Config, LlmJudgeConfig

if TYPE_CHECKING:
    import torch

log = logging.getLogger("rloo.reward.judges")

Verdict = str | None  # "A" | "B" | "tie" | None (unparseable)


class PairwiseJudge(Protocol):
    name: str

    def judge(self, question: str, gold: str, answer_a: str, answer_b: str) -> Verdict: ...

    def check(self) -> dict:
        """The record of the calls made, for the results; raises when too many failed."""
        ...


class VerifierJudge:
    """Prefers the answer whose final `#### N` is correct; both right or both wrong is a tie."""

    name = "verifier"

    def judge(self, question: str, gold: str, answer_a: str, answer_b: str) -> Verdict:
        a, b = is_correct(answer_a, gold), is_correct(answer_b, gold)
        return "tie" if a == b else ("A" if a else "B")

    def check(self) -> dict:
        return {}  # no calls that can fail


JUDGE_PROMPT = """You are grading two answers to a math word problem.

Question:
{question}

Answer A:
{a}

Answer B:
{b}

Which answer is correct and better reasoned? Reply with exactly one of: A, B, tie."""

VERDICTS = ("A", "B", "tie")
_VERDICT = re.compile(r"\b(A|B|tie)\b", re.IGNORECASE)


def parse_verdict(text: str | None) -> Verdict:
    """The first standalone A / B / tie in the reply, else None."""
    if not text:
        return None
    m = _VERDICT.search(text.strip())
    if not m:
        return None
    v = m.group(1)
    return "tie" if v.lower() == "tie" else v.upper()


class JudgeUnavailable(UserError):
    """The LLM judge does not answer, or fails more often than the config allows."""


class LLMJudge:
    """A model behind an OpenAI-compatible endpoint; the API key comes only from the environment.

    Each call gets the tries of rloo/reward/retries.py (each retry a console line, counted in the
    calls' record); a call that still fails is an invalid verdict, never a loss. Until the judge has
    answered once, a call that gets no reply within `timeout_s` is not tried past FIRST_CALL_TRIES, and
    the judge is then taken to be down (it accepted the connection and hangs, or the connection attempt
    itself hangs): the stage stops with one line after about 2 x timeout_s, rather than waiting out
    timeout_s x (1 + max_retries) for each of the first calls. A judge that answers, however slowly
    within timeout_s, is never failed this way; one that refuses the connection fails after its first
    `FAIL_FAST` calls (seconds: nothing to wait for).
    """

    name = "llm"
    FAIL_FAST = 8
    FIRST_CALL_TRIES = retries.FIRST_CALL_TRIES
    CONNECT_TIMEOUT_S = retries.CONNECT_TIMEOUT_S

    def __init__(self, base_url: str, model: str, api_key_env: str, timeout_s: float, max_retries: int,
                 max_failed_share: float = 1.0, structured: bool = False, api_key: str | None = None) -> None:
        import openai  # optional dependency: pip install 'rloo[judge]'

        # The key is read here (or is a served judge's one-run key) and handed to the client only: it is
        # never logged or stored. The client tries once: the tries are rloo.reward.retries', visible.
        self.client = openai.OpenAI(base_url=base_url, api_key=api_key or os.environ.get(api_key_env) or "EMPTY",
                                    timeout=openai.Timeout(timeout_s, connect=min(timeout_s, self.CONNECT_TIMEOUT_S)),
                                    max_retries=0)
        self.retries = retries.Retries(f"LLM judge {base_url}", max_retries)
        self._openai = openai
        # vLLM's structured outputs: the reply can only be one of the verdicts (a small judge otherwise
        # often answers something parse_verdict cannot read).
        self.extra_body = {"structured_outputs": {"choice": list(VERDICTS)}} if structured else None
        self.model = model
        self.timeout_s = timeout_s
        self.max_retries = max_retries
        self.max_failed_share = max_failed_share
        self.base_url = base_url
        self.description = {"type": "llm", "base_url": base_url, "model": model}
        self.calls = 0
        self.failed = 0
        self.unparsed = 0  # answered, but with no verdict in the reply: as useless as a failed call
        self.last_error = ""

    @property
    def answered(self) -> bool:
        """The judge has replied to a call at least once."""
        return self.retries.answered

    def _retryable(self, e: BaseException) -> bool:
        """What the OpenAI client itself retries: no connection or reply, 408, 409, 429 and 5xx."""
        if isinstance(e, self._openai.APIStatusError):
            return e.status_code in (408, 409, 429) or e.status_code >= 500
        return isinstance(e, self._openai.APIConnectionError)  # a timeout is one

    def _silent(self, e: BaseException) -> bool:
        return isinstance(e, self._openai.APITimeoutError)

    def _reason(self, e: BaseException) -> str:
        if isinstance(e, self._openai.APIStatusError):  # its message holds the reply's body: the code is enough
            return f"HTTP {e.status_code} ({type(e).__name__})"
        if self._silent(e):
            return f"no reply within evaluate.llm_judge.timeout_s={self.timeout_s:g} s"
        return type(e).__name__

    def _ask(self, prompt: str):
        request = {"model": self.model, "temperature": 0.0, "max_tokens": 8, "extra_body": self.extra_body,
                   "messages": [{"role": "user", "content": prompt}]}
        return self.retries.call(lambda: self.client.chat.completions.create(**request), retryable=self._retryable,
                                 silent=self._silent, reason=self._reason)

    def judge(self, question: str, gold: str, answer_a: str, answer_b: str) -> Verdict:
        self.calls += 1
        try:
            resp = self._ask(JUDGE_PROMPT.format(question=question, a=answer_a, b=answer_b))
        except Exception as e:  # a failed call is an invalid verdict, never a loss
            self.failed += 1
            self.last_error = type(e).__name__
            log.warning("judge call failed: %s", self.last_error)
            if not self.answered and self.max_failed_share < 1:
                self._fail_fast(e)
            return None
        verdict = parse_verdict(resp.choices[0].message.content)
        if verdict is None:
            self.unparsed += 1
            self.last_error = f"unparsed reply {resp.choices[0].message.content!r:.40}"
        return verdict

    def _fail_fast(self, e: Exception) -> None:
        """Stop the stage when the judge, never having answered, is evidently down: no reply within
        timeout_s to a call's tries, or the first FAIL_FAST calls all failed."""
        if self._silent(e):
            raise JudgeUnavailable(
                f"the LLM judge at {self.base_url} gave no reply within evaluate.llm_judge.timeout_s="
                f"{self.timeout_s:g} s to its first call ({self.retries.tries} tries): is it up and serving {self.model!r}? "
                "For a judge that is only slow raise timeout_s; or set evaluate.judge: verifier") from None
        if self.failed == self.calls == self.FAIL_FAST:
            raise JudgeUnavailable(
                f"the LLM judge at {self.base_url} did not answer: the first {self.calls} calls "
                f"failed ({self.last_error}, the last after {self.retries.tries} tries); start it, or set "
                "evaluate.judge: verifier") from None

    def check(self) -> dict:
        """The calls' record for the results; raise when more failed, or answered without a verdict,
        than `max_failed_share` allows (a judge whose replies never parse is as absent as a down one)."""
        share = self.failed / self.calls if self.calls else 0.0
        useless = (self.failed + self.unparsed) / self.calls if self.calls else 0.0
        if useless > self.max_failed_share:
            raise JudgeUnavailable(
                f"{self.failed} of {self.calls} LLM-judge calls to {self.base_url} failed and {self.unparsed} "
                f"answered without a verdict ({useless:.1%}, last: {self.last_error}), more than "
                f"evaluate.llm_judge.max_failed_share={self.max_failed_share}")
        return {"calls": self.calls, "failed_calls": self.failed, "failed_share": share, "unparsed_replies": self.unparsed,
                "retries": self.retries.count}

    @classmethod
    def from_config(cls, j: LlmJudgeConfig, base_url: str | None = None, api_key: str | None = None) -> LLMJudge:
        """The judge of `evaluate.llm_judge`; `base_url`/`api_key`: a served judge's, instead of the config's."""
        structured = j.structured_verdict
        if structured == "auto":  # vLLM's own server understands it; an external endpoint may not
            structured = j.serve is not None and not j.serve.command
        return cls(base_url or j.base_url, j.model, j.api_key_env, j.timeout_s, j.max_retries,
                   j.max_failed_share, structured=structured, api_key=api_key)


def build_judge(cfg: Config | Mapping) -> PairwiseJudge:
    ec = Config.of(cfg).evaluate
    return LLMJudge.from_config(ec.llm_judge) if ec.judge == "llm" else VerifierJudge()


@dataclass
class WinRate:
    wins: float = 0.0
    losses: float = 0.0
    ties: float = 0.0
    invalid: int = 0
    scores: list[float | None] = field(default_factory=list)  # per pair, `combine`'s score

    @property
    def value(self) -> float:
        n = self.wins + self.losses + self.ties
        return (self.wins + 0.5 * self.ties) / n if n else float("nan")

    def as_dict(self) -> dict:
        return {"value": self.value, "wins": self.wins, "losses": self.losses, "ties": self.ties,
                "invalid": self.invalid}


def combine(first: Verdict, swapped: Verdict) -> float | None:
    """Score of the candidate (shown as A first, then as B): 1 win, 0 loss, 0.5 tie, None invalid.

    A tie in either order, or orders that disagree (position bias), counts as a tie.
    """
    if first is None or swapped is None:
        return None
    a = {"A": 1.0, "B": 0.0, "tie": 0.5}[first]
    b = {"B": 1.0, "A": 0.0, "tie": 0.5}[swapped]
    return a if a == b else 0.5


def win_rate(judge: PairwiseJudge, questions: list[str], golds: list[str], candidate: list[str],
             baseline: list[str], progress: Progress | None = None) -> WinRate:
    """Candidate vs baseline over all questions, judged in both presentation orders; each problem counted
    on `progress` where given (a served judge's thousands of calls take minutes)."""
    out = WinRate()
    for q, g, c, b in zip(questions, golds, candidate, baseline, strict=True):
        s = combine(judge.judge(q, g, c, b), judge.judge(q, g, b, c))
        if progress is not None:
            progress.update(1)
        out.scores.append(s)
        if s is None:
            out.invalid += 1
        elif s == 1.0:
            out.wins += 1
        elif s == 0.0:
            out.losses += 1
        else:
            out.ties += 1
    return out


def agreement(scores: list[float | None], reference: list[float | None]) -> dict:
    """How often a judge's per-pair verdicts (`combine`'s scores) match a reference judge's on the same
    pairs: over the pairs the reference decides (one answer right, the other wrong, for the verifier),
    where a tie or the other answer is a disagreement, and over every pair both judged (a tie matching a
    tie). Pairs the judge left invalid are counted apart, never as agreement."""
    decided = [(s, r) for s, r in zip(scores, reference, strict=True) if r in (0.0, 1.0)]
    valid = [(s, r) for s, r in decided if s is not None]
    both = [(s, r) for s, r in zip(scores, reference, strict=True) if s is not None and r is not None]
    agree = sum(s == r for s, r in valid)
    return {"decided_pairs": len(decided), "judged": len(valid), "agree": agree,
            "value": agree / len(valid) if valid else None,
            "all_pairs_judged": len(both), "all_pairs_agree": sum(s == r for s, r in both)}


class JudgeReward:
    """`reward.source: judge`: a pointwise reward from the configured judge against the gold answer.

    With the verifier judge this is the verifier; with an LLM judge, the completion is compared with
    the reference solution and scores 1 if judged at least as good, NaN if the verdict is invalid.
    """

    name = "judge"

    def __init__(self, judge: PairwiseJudge) -> None:
        self.judge_ = judge

    @classmethod
    def from_config(cls, cfg: Config | Mapping) -> JudgeReward:
        return cls(build_judge(cfg))

    def score(self, prompts, completions, golds, finished) -> torch.Tensor:
        import torch  # here: the pairwise judges serve the report, which loads no model

        out = []
        for p, c, g, f in zip(prompts, completions, golds, finished, strict=True):
            if not f:
                out.append(0.0)
                continue
            v = self.judge_.judge(p, g, c, g)
            out.append(float("nan") if v is None else float(v in ("A", "tie")))
        return torch.tensor(out)
