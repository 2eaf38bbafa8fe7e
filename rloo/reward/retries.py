"""The tries of a call to a scorer that runs elsewhere (a reward server, an LLM judge): one policy for both.

A call that fails in a way another try may cure is tried again after 0.5, 1, 2 ... s (5 s at most), up
to `max_retries` times. Each retry is one console line naming the scorer, what went wrong and the
attempt, of the most tries that call may take (`most_tries`), so the caller's error can count the tries
made (`Retries.tries`) without contradicting it (`rloo.console`: the stage's log, and the terminal under Snakemake), and is counted
(`Retries.count`), so a flaky scorer shows while the stage runs and in its figures.

Until the scorer has answered once, a try that got no reply in time (it accepted the connection and
hangs, or the connection attempt hangs) ends the call from the FIRST_CALL_TRIES-th try on: a scorer
that is down is known after about FIRST_CALL_TRIES x timeout_s, not (1 + max_retries) x timeout_s. One
that answers, however slowly within its timeout, is never cut short, and once it has answered, every
call gets all its tries. Connecting gets CONNECT_TIMEOUT_S at most (a host that drops connection
attempts is known down in seconds); the reply, the caller's own timeout.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TypeVar

from rloo.console import console

log = logging.getLogger("rloo.reward.retries")

FIRST_CALL_TRIES = 2
CONNECT_TIMEOUT_S = 10.0

T = TypeVar("T")


def wait_s(attempt: int) -> float:
    """The pause before try `attempt` + 1: 0.5 s, then doubling, 5 s at most."""
    return min(0.5 * 2 ** (attempt - 1), 5.0)


class Retries:
    """The tries of every call to one scorer, `what` (e.g. `reward server http://host/score`), and their count."""

    def __init__(self, what: str, max_retries: int) -> None:
        self.what, self.max_retries = what, max_retries
        self.answered = False  # the scorer has answered a call at least once
        self.count = 0  # retries made, over all calls
        self.tries = 0  # tries of the latest call

    def most_tries(self, e: BaseException, silent: Callable[[BaseException], bool]) -> int:
        """The most tries the call that just failed with `e` may take: FIRST_CALL_TRIES while the scorer has
        never answered and `e` is no reply in time (the policy above), else all of them. The console line
        counts against it, so that "attempt 1 of 2" is followed by an error after 2 tries, not 3."""
        tries = self.max_retries + 1
        return min(tries, FIRST_CALL_TRIES) if not self.answered and silent(e) else tries

    def call(self, send: Callable[[], T], *, retryable: Callable[[BaseException], bool],
             silent: Callable[[BaseException], bool], reason: Callable[[BaseException], str]) -> T:
        """`send()`'s result, after as many tries as the policy above allows; raises the last try's error.
        `retryable(e)`: another try may cure e; `silent(e)`: e is no reply in time; `reason(e)`: a few words
        on e for the console line, never a credential."""
        tries = self.max_retries + 1
        for attempt in range(1, tries + 1):
            self.tries = attempt
            try:
                out = send()
            except Exception as e:
                if (attempt == tries or not retryable(e)
                        or (not self.answered and silent(e) and attempt >= FIRST_CALL_TRIES)):
                    raise
                self.count += 1
                console(f"{self.what}: {reason(e)} on attempt {attempt} of {self.most_tries(e, silent)}; retrying in "
                        f"{wait_s(attempt):g} s", log)
                time.sleep(wait_s(attempt))
            else:
                self.answered = True
                return out
        raise AssertionError("not reached")
