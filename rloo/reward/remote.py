"""A reward server (`reward.source: http`): a scorer that runs elsewhere, asked over HTTP.

Protocol, one request per batch of completions:

    POST <reward.http.url>   {"prompts": [...], "completions": [...], "rows": [{column: value}, ...]}
    200                      {"rewards": [0.5, null, ...]}       one number or null (missing) per completion

`rows` are the data records of the completions (question, answer in its GSM8K form, any further field).
A request that fails (no connection, a timeout, an HTTP error) is retried `max_retries` times, waiting
0.5, 1, 2 ... s (at most 5 s) between tries, each retry one console line and counted
(rloo/reward/retries.py); one that still fails leaves its completions without rewards, and the run
stops once more than `max_failed_share` of the requests so far have failed (with the default 0, at the
first). A server that has never answered and gives no reply to a request's first two tries is taken to
be down (about 2 x timeout_s); connecting gets 10 s at most. A reply that breaks the protocol stops
the run at once. The stop is one line naming the server (and an HTTP error's status and the first line of its
body); the training loop's last checkpoint stays, so
a rerun resumes from it.
The URL never carries a credential (rloo_workflow.config.checks refuses one): a key comes from the environment
variable `api_key_env` names, as a bearer token.
"""

from __future__ import annotations

import http.client
import json
import logging
import os
import urllib.error
import urllib.request
from collections.abc import Mapping

from rloo.errors import UserError
from rloo.reward import retries
from rloo.reward.functions import BadRewards, reward_list
from rloo.settings import Config

log = logging.getLogger("rloo.reward.remote")


class RewardServerError(UserError, RuntimeError):
    """The reward server does not answer, fails more often than allowed, or breaks the protocol."""


class RewardClient:
    def __init__(self, url: str, timeout_s: float = 60.0, max_retries: int = 2, max_failed_share: float = 0.0,
                 api_key_env: str | None = None) -> None:
        self.url, self.timeout_s, self.max_retries = url, timeout_s, max_retries
        self.max_failed_share, self.api_key_env = max_failed_share, api_key_env
        self.requests = 0
        self.failed = 0
        self.retries = retries.Retries(f"reward server {url}", max_retries)

    @classmethod
    def from_config(cls, cfg: Config | Mapping) -> RewardClient:
        h = Config.of(cfg).reward.http
        if not h.url:
            raise RewardServerError("reward.source is 'http' but reward.http.url is not set")
        return cls(h.url, h.timeout_s, h.max_retries, h.max_failed_share, h.api_key_env)

    def _headers(self) -> dict[str, str]:
        headers = {"Content-Type": "application/json"}
        if self.api_key_env:
            key = os.environ.get(self.api_key_env)
            if not key:
                raise RewardServerError(f"reward.http.api_key_env names {self.api_key_env}, which is not set")
            headers["Authorization"] = f"Bearer {key}"
        return headers

    def _post(self, body: bytes) -> bytes:
        """The reply's body, after the tries rloo.reward.retries allows; raises the last error."""
        def send() -> bytes:
            request = urllib.request.Request(self.url, data=body, headers=self._headers(), method="POST")
            with _OPENER.open(request, timeout=self.timeout_s) as reply:
                return reply.read()

        # Any failure may be a passing one (refused, reset, timed out, an HTTP error status).
        return self.retries.call(send, retryable=lambda e: isinstance(e, OSError), silent=_silent, reason=_reason)

    def summary(self) -> str:
        """The requests of this process, for the stage's last lines: how many, retried, failed."""
        return (f"reward server {self.url}: {self.requests} requests, {self.retries.count} retries, {self.failed} "
                "failed after their retries")

    def rewards(self, prompts: list[str], completions: list[str], rows: list[dict]) -> list[float | None]:
        """One reward (or None) per completion from the server."""
        n = len(completions)
        body = json.dumps({"prompts": prompts, "completions": completions, "rows": rows}).encode()
        self.requests += 1
        try:
            raw = self._post(body)
        except (OSError, urllib.error.URLError) as e:
            self.failed += 1
            if not self.retries.answered and _silent(e) and self.max_failed_share < 1:
                # a reply that never came, or (urllib wraps what fails before the reply) a connection
                why = (f"no connection within {retries.CONNECT_TIMEOUT_S:g} s" if isinstance(e, urllib.error.URLError)
                       else f"no reply within reward.http.timeout_s={self.timeout_s:g} s")
                raise RewardServerError(
                    f"the reward server at {self.url} did not answer its first request ({why}, "
                    f"{_tries(self.retries.tries)}): is it up? For a server that is only slow raise "
                    "reward.http.timeout_s; the run stops (its last checkpoint is kept; rerun once the server "
                    "answers)") from None
            if self.failed / self.requests > self.max_failed_share:
                raise RewardServerError(
                    f"the reward server at {self.url} did not answer ({_reason(e)}, after {_tries(self.retries.tries)}); "
                    f"{self.failed} of {self.requests} requests failed, more than "
                    f"reward.http.max_failed_share={self.max_failed_share:g}: the run stops (its last "
                    "checkpoint is kept; rerun once the server is back)") from None
            log.warning("reward server %s: %s after %s: %d completions without a reward", self.url,
                        _reason(e), _tries(self.retries.tries), n)
            return [None] * n
        return self._parse(raw, n)

    def _parse(self, raw: bytes, n: int) -> list[float | None]:
        try:
            reply = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise RewardServerError(f"the reward server at {self.url} replied with no JSON "
                                    f"({raw[:60]!r}); expected {{\"rewards\": [...]}}") from None
        if not isinstance(reply, dict) or "rewards" not in reply:
            raise RewardServerError(f"the reward server at {self.url} replied without 'rewards' ({str(reply)[:60]})")
        try:
            return reward_list(reply["rewards"], n)
        except BadRewards as e:
            raise RewardServerError(f"the reward server at {self.url} {e}") from None


class _ConnectWithin:
    """An HTTP(S) connection that connects within retries.CONNECT_TIMEOUT_S, then waits for the reply up
    to the request's own timeout (urllib has one timeout for both)."""

    def connect(self) -> None:
        wait = self.timeout
        self.timeout = min(wait, retries.CONNECT_TIMEOUT_S)
        try:
            super().connect()
        finally:
            self.timeout = wait
        self.sock.settimeout(wait)


class _HTTPConnection(_ConnectWithin, http.client.HTTPConnection):
    pass


class _HTTPSConnection(_ConnectWithin, http.client.HTTPSConnection):
    pass


class _HTTPHandler(urllib.request.HTTPHandler):
    def http_open(self, req):
        return self.do_open(_HTTPConnection, req)


class _HTTPSHandler(urllib.request.HTTPSHandler):
    def https_open(self, req):
        return self.do_open(_HTTPSConnection, req, context=self._context)


_OPENER = urllib.request.build_opener(_HTTPHandler, _HTTPSHandler)


def _tries(n: int) -> str:
    """The tries a request took, as its error says them (the console lines counted them: attempt n of m)."""
    return f"{n} {'try' if n == 1 else 'tries'}"


def _silent(e: BaseException) -> bool:
    """No reply in time: connecting or reading timed out."""
    return isinstance(e, TimeoutError) or (isinstance(e, urllib.error.URLError) and isinstance(e.reason, TimeoutError))


def _reason(e: BaseException) -> str:
    """What went wrong with a request, in a few words (never the request's headers): an HTTP error's
    status and the first line of the body, where a server says why."""
    if isinstance(e, urllib.error.HTTPError):
        return f"HTTP {e.code} {e.reason}" + (f": {line}" if (line := _first_body_line(e)) else "")
    if isinstance(e, urllib.error.URLError):
        e = e.reason if isinstance(e.reason, BaseException) else e
    return f"{type(e).__name__}: {e}" if str(e) else type(e).__name__


def _first_body_line(e: urllib.error.HTTPError) -> str:
    """The first non-blank line of an HTTP error's body (at most 200 characters), read once: a body can
    be read only once, and each retry's warning and the final error name it."""
    if not hasattr(e, "rloo_first_line"):
        try:
            text = (e.read(4096) or b"").decode("utf-8", "replace")  # a line, not a whole page
        except OSError:
            text = ""
        e.rloo_first_line = next((line.strip() for line in text.splitlines() if line.strip()), "")[:200]
    return e.rloo_first_line
