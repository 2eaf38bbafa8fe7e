"""Secrets out of everything MLflow receives: parameters, tags and text artifacts are shared and kept.

A key that names a secret (API key, token, password, ...) has its value replaced, and so has any value
that looks like a credential or equals the value of a secret-named environment variable, or of a
variable a `*_env` config key names (`protect_env`: whatever its name, reward.http.api_key_env's variable
holds a key). A key ending in `_env` that holds an environment variable's *name*
(evaluate.llm_judge.api_key_env) is kept: validation refuses any other value there (`key_like`), so the
config copies the jobs read hold names only.

The same replacement keeps secrets out of the stages' logs and error lines (`redact_text`, installed
by the CLI as rloo.console's scrubber), not only out of MLflow.
"""

from __future__ import annotations

import os
import re
from typing import Any

REDACTED = "[REDACTED]"

_SECRET_KEY = re.compile(
    r"(?i)(?:^|[^a-z])(?:api[_-]?keys?|apikey|secrets?|passw(?:or)?ds?|passphrase|token|"
    r"credentials?|private[_-]?key|auth|authorization|cookie|session[_-]?key)(?:$|[^a-z])"
)
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_SECRET_VALUE = [
    re.compile(r"-----BEGIN [A-Z ]*PRIVATE KEY-----.*?(?:-----END [A-Z ]*PRIVATE KEY-----|\Z)", re.S),
    re.compile(r"\bsk-[A-Za-z0-9_\-]{8,}"),  # OpenAI-style keys, short ones too
    re.compile(r"\bhf_[A-Za-z0-9]{20,}"),
    re.compile(r"\bgh[pousr]_[A-Za-z0-9]{20,}"),
    re.compile(r"\bgithub_pat_[A-Za-z0-9_]{20,}"),
    re.compile(r"\bglpat-[A-Za-z0-9_\-]{20,}"),
    re.compile(r"\b(?:AKIA|ASIA)[0-9A-Z]{16}\b"),
    re.compile(r"\bxox[abprs]-[A-Za-z0-9\-]{10,}"),
    re.compile(r"\beyJ[A-Za-z0-9_\-]{8,}\.[A-Za-z0-9_\-]{8,}\.[A-Za-z0-9_\-]{8,}"),
    re.compile(r"(?i)\bbearer\s+[A-Za-z0-9._~+/\-]{12,}=*"),
]
# user:password@ in a URL: keep the user, drop the password.
_URL_CREDENTIALS = re.compile(r"(?i)\b([a-z][a-z0-9+.\-]*://[^/\s:@]+):[^/\s@]+@")
# KEY=VALUE / "key": "value" with a secret-named key, inside free text (logs, command lines).
_ASSIGNMENT = re.compile(
    r"""(?ix)
    (?P<key>[A-Za-z0-9_.\-]*(?:api[_-]?key|apikey|secret|passw(?:or)?d|token|credential|private[_-]?key)
        [A-Za-z0-9_.\-]*)
    (?P<sep>["']?\s*[:=]\s*["']?)
    (?P<value>[^\s"',}]{6,})
    """
)


# A decimal or exponent number: what a metric whose name holds `token` logs (no credential is one).
_FLOAT = re.compile(r"[-+]?(?:\d+\.\d*|\.\d+|\d+(?=e))(?:e[-+]?\d+)?", re.I)
# A key's own prefix (sk_live_..., hf_..., ghp_...): a valid variable name that is a pasted key.
_KEY_PREFIX = re.compile(r"^(?:sk|rk|pk|hf|gh[pousr]|github_pat|glpat|xox[abprs])[-_]")
# Values shorter than this are not replaced in free text: a short value would blank out common words,
# and no service issues keys that short.
_MIN_SECRET = 6
_PROTECTED: set[str] = set()  # environment variables named by `*_env` keys (`protect_env`)


def is_env_name(value: str) -> bool:
    """Whether `value` is spelled as an environment variable's name ([A-Za-z_][A-Za-z0-9_]*)."""
    return bool(_ENV_NAME.fullmatch(value))


def key_like(value: str) -> bool:
    """Whether a value meant to name an environment variable is a key instead: not a name's spelling, a
    known key's shape or prefix, or a long run of mixed-case letters and digits with no `_` (names are
    words joined by `_`)."""
    if not is_env_name(value) or _KEY_PREFIX.match(value) or any(p.search(value) for p in _SECRET_VALUE):
        return True
    return (len(value) >= 24 and "_" not in value and bool(re.search(r"[a-z]", value))
            and bool(re.search(r"[A-Z]", value)) and bool(re.search(r"\d", value)))


def protect_env(names: list[str] | set[str]) -> None:
    """Redact, from now on in this process, the values of these environment variables (those a `*_env`
    config key names), whatever they are called."""
    _PROTECTED.update(n for n in names if n)


def is_secret_key(key: str) -> bool:
    """True for a key that names a secret (api_key, hf_token, password, ...), not max_new_tokens."""
    return bool(_SECRET_KEY.search(str(key)))


def _secret_env_values() -> list[str]:
    """Values of secret-named environment variables (not those that merely name another variable)."""
    # Another thread may change the environment meanwhile (MLflow's telemetry thread deletes
    # _MLFLOW_TELEMETRY_SESSION_ID): os.environ.items() then raises KeyError for a key it listed a
    # moment before. A snapshot of the names, each read with .get, skips what went away.
    vals = set()
    for k in list(os.environ):
        v = os.environ.get(k)
        if v is not None and is_secret_key(k) and len(v) >= 8 \
                and not re.fullmatch(r"[A-Z][A-Z0-9]*(?:_[A-Z0-9]+)+", v):
            vals.add(v)
    for k in _PROTECTED:
        if (v := os.environ.get(k)) is not None and len(v) >= _MIN_SECRET:
            vals.add(v)
    return sorted(vals, key=len, reverse=True)


def redact_url_passwords(text: str) -> str:
    """`scheme://user:password@` → `scheme://user:[REDACTED]@`, wherever it stands in `text`."""
    return _URL_CREDENTIALS.sub(rf"\1:{REDACTED}@", text)


def redact_text(text: str) -> str:
    """Replace credentials in free text: secret env values, known token shapes, URL passwords."""
    if not text:
        return text
    for value in _secret_env_values():
        text = text.replace(value, REDACTED)
    for pattern in _SECRET_VALUE:
        text = pattern.sub(REDACTED, text)
    text = redact_url_passwords(text)

    def _assignment(m: re.Match) -> str:
        key, value = m.group("key"), m.group("value")
        if key.lower().endswith("_env") and _ENV_NAME.match(value):
            return m.group(0)  # the *name* of an environment variable, not its value
        if value == REDACTED or _FLOAT.fullmatch(value):
            return m.group(0)  # a figure (`mismatch_k3_token: 2.15e-06`), not a credential
        return f"{key}{m.group('sep')}{REDACTED}"

    return _ASSIGNMENT.sub(_assignment, text)


def redact_value(key: str, value: Any) -> Any:
    """The value to log under `key`: REDACTED for a secret key (unless it holds an env var name)."""
    leaf = str(key).rsplit(".", 1)[-1]
    if is_secret_key(leaf) and value not in (None, "", False):
        if leaf.lower().endswith("_env") and isinstance(value, str) and _ENV_NAME.match(value):
            return value
        return REDACTED
    if isinstance(value, str):
        return redact_text(value)
    return value


def redact(obj: Any, key: str = "") -> Any:
    """Deep copy of a JSON-like object with every secret replaced (see module docstring)."""
    if isinstance(obj, dict):
        return {k: redact(v, str(k)) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [redact(v, key) for v in obj]
    return redact_value(key, obj)
