"""Validation: the schema, then the rules it cannot state (finite numbers, no secrets in URLs, keys that
depend on each other, each in its section's `problems` (rloo/settings/), the values each sweep sets, and a
CPU run's predicted host memory), each naming the offending key."""

from __future__ import annotations

import copy
import dataclasses
import math
import re
from functools import cache
from typing import Any
from urllib.parse import SplitResult, parse_qsl, urlsplit

from rloo.settings import Config, section_types
from rloo.settings.selection import leaves, put, select
from rloo_workflow.config.schema import ConfigError, Validator, coerce, key_path, load_schema
from rloo_workflow.host_memory import config_problems as host_memory_problems

# The key by which an overlay names the config it lays itself over, then its old spelling (still read):
# rloo_workflow.config.overlays merges the file it names before the config is validated.
EXTENDS_KEYS = ("extends", "base")


def validate(cfg: dict, source: str = "config", overrides: dict | None = None) -> dict:
    """Validate `cfg` in place, filling defaults; raise ConfigError naming the offending key. `overrides`:
    the part of `cfg` set last (`--set`, `snakemake --config`, a sweep's value), whose keys a rule that
    ties several keys together names first (`_lead_with_given`)."""
    schema = load_schema()
    for key in EXTENDS_KEYS:  # the file an overlay extends, already merged by load_config
        cfg.pop(key, None)
    coerce(cfg, schema)
    given = {**dict.fromkeys(_paths(cfg), 1), **dict.fromkeys(_paths(overrides or {}), 2)}  # before the defaults
    if problems := _non_finite(cfg) + _credentials(cfg) + _env_names(cfg):
        raise ConfigError(f"{source}: invalid configuration:\n  " + "\n  ".join(problems))
    errors = sorted(Validator(schema).iter_errors(cfg), key=lambda e: list(e.absolute_path))
    if errors:
        lines = []
        for e in errors:
            if e.validator == "additionalProperties":
                allowed = sorted(e.schema.get("properties", {}))
                extra = sorted(set(e.instance) - set(allowed))
                where = key_path(e)
                for key in extra:
                    full = key if where == "<top level>" else f"{where}.{key}"
                    lines.append(f"unknown key '{full}' (allowed here: {', '.join(allowed)})")
            elif e.validator == "contains" and "const" in e.validator_value:
                lines.append(f"key '{key_path(e)}': must include {e.validator_value['const']!r}, got {e.instance}")
            else:
                lines.append(f"key '{key_path(e)}': {e.message}")
        raise ConfigError(f"{source}: invalid configuration:\n  " + "\n  ".join(lines))
    if problems := [_lead_with_given(line, given, cfg) for line in _cross_checks(cfg)]:
        raise ConfigError(f"{source}: invalid configuration:\n  " + "\n  ".join(problems))
    # imported here, not at the top: rloo_workflow.tracking imports this package
    from rloo_workflow.tracking.redact import protect_env

    protect_env([v for key in env_keys() if isinstance(v := _lookup(cfg, key)[1], str)])
    return cfg


@cache
def env_keys(cls: type = Config, prefix: str = "") -> tuple[str, ...]:
    """The dotted key of every setting that names an environment variable: a field of the typed settings
    whose name ends in `_env` (reward.http.api_key_env, evaluate.llm_judge.api_key_env, ...)."""
    nested = section_types(cls)
    out: list[str] = []
    for f in dataclasses.fields(cls):
        if f.name in nested:
            out += env_keys(nested[f.name], f"{prefix}{f.name}.")
        elif f.name.endswith("_env"):
            out.append(f"{prefix}{f.name}")
    return tuple(out)


def _env_names(cfg: dict) -> list[str]:
    """A key pasted where its variable's name belongs would be written to the config copies the jobs read,
    params.yaml and the logs: refuse any value of an `*_env` key that is not a variable's name, or that
    is shaped like a key, and never repeat it. (A value that is no string is the schema's to name.)"""
    from rloo_workflow.tracking.redact import is_env_name, key_like  # as in `validate`

    problems = []
    for key in env_keys():
        value = _lookup(cfg, key)[1]
        if isinstance(value, str) and key_like(value):
            what = "looks like a key itself" if is_env_name(value) else "is not an environment variable's name"
            problems.append(f"key '{key}': must name an environment variable ([A-Za-z_][A-Za-z0-9_]*), but its "
                            f"value {what} (not shown); put the key in an environment variable and give that "
                            f"variable's name here")
    return problems


def _non_finite(cfg: dict) -> list[str]:
    """NaN and infinity pass a JSON schema's `number` and train nothing (a NaN beta zeroes every update)."""
    return [f"key '{path}': must be a finite number, got {value}"
            for path, value in leaves(cfg) if isinstance(value, float) and not math.isfinite(value)]


_SECRET_PARAM = re.compile(r"key|token|secret|password|passwd|auth|signature|credential", re.IGNORECASE)
# Short names of secrets, matched as a whole word of a parameter's name (`sig` of an Azure SAS URL, `code` of
# an Azure function's key, `X-Hdnts-Sig`): inside longer words they mean other things (design, zipcode).
_SECRET_WORDS = frozenset({"sig", "sigs", "pwd", "pass", "jwt", "bearer", "hmac", "code", "sid", "session", "otp"})
_WORDS = re.compile(r"[A-Z]?[a-z]+|[A-Z]+(?![a-z])|\d+")


def _secret_name(name: str) -> bool:
    """Whether a URL parameter of this name carries a secret: a long name containing one, or a short one as
    a word of it (split at punctuation and camelCase: access_token, X-Amz-Signature, apiSig, sig)."""
    return bool(_SECRET_PARAM.search(name)) or any(w.lower() in _SECRET_WORDS for w in _WORDS.findall(name))


def _secret_parts(url: SplitResult) -> list[str]:
    """What of a parsed URL carries a credential, as the refusal names it (never its value)."""
    found = []
    if url.password is not None:
        found.append("a password (user:password@)")
    elif url.username:  # `http://TOKEN@host`: how many services take a token
        found.append("a user part (...@, where a token is often passed)")
    for part, text in (("query", url.query), ("fragment", url.fragment)):
        names = [k for k, _ in parse_qsl(text, keep_blank_values=True) if _secret_name(k)]
        if names:
            found.append(f"a secret {part} parameter ({', '.join(dict.fromkeys(names))})")
    return found


def _secret_home(path: str, cfg: dict) -> str:
    """Where the secret of the URL at `path` belongs instead (docs/rewards-and-data.md, docs/tracking.md)."""
    if path.startswith("evaluate.llm_judge"):
        from rloo_workflow.tracking.redact import key_like  # as in `validate`

        env = (cfg.get("evaluate", {}).get("llm_judge") or {}).get("api_key_env") or "OPENAI_API_KEY"
        now = f" (now {env})" if isinstance(env, str) and not key_like(env) else ""  # a pasted key is not repeated
        return (f"put the API key in an environment variable and name it in evaluate.llm_judge.api_key_env{now}: "
                "it is sent as an Authorization: Bearer header")
    if path.startswith("reward.http"):
        return ("put the key in an environment variable and name it in reward.http.api_key_env: it is sent as an "
                "Authorization: Bearer header")
    if path.startswith("tracking"):
        return ("MLflow reads MLFLOW_TRACKING_USERNAME / MLFLOW_TRACKING_PASSWORD (or MLFLOW_TRACKING_TOKEN) "
                "from the environment")
    return "pass secrets through environment variables"


def _credentials(cfg: dict) -> list[str]:
    """A URL that carries a password, a token or a key ends up in params.yaml, dvc.lock, logs, the results,
    MLflow and the command line: refuse it, and say where a secret belongs. The message never repeats it."""
    problems = []
    for path, value in leaves(cfg):
        if not isinstance(value, str) or "://" not in value:
            continue
        try:
            url = urlsplit(value.strip())
            found = _secret_parts(url)
        except ValueError:  # a port that is no number: not a URL to read, and the schema names what it wants
            continue
        if found:
            problems.append(f"key '{path}': the URL for {url.scheme}://{url.hostname or '?'} carries "
                            f"{' and '.join(found)}, which would be written to params.yaml, dvc.lock, logs and "
                            f"command lines; remove it and {_secret_home(path, cfg)}")
    return problems


def _cross_checks(cfg: dict) -> list[str]:
    """Rules that tie several keys together, checked before any stage runs (so `snakemake -n` fails)."""
    sections = Config.from_config(cfg)
    problems = sections.problems() + _sweep_checks(cfg)
    return problems or host_memory_problems(sections)  # the memory estimate only once the sizes themselves are sane


def _paths(tree: dict, prefix: str = "") -> list[str]:
    """The dotted path of every key of a config tree, sections included (a list is one value)."""
    out = []
    for key, value in tree.items():
        path = f"{prefix}{key}"
        out.append(path)
        if isinstance(value, dict):
            out += _paths(value, path + ".")
    return out


_LEAD = re.compile(r"key '([^']+)': ")
_DOTTED = re.compile(r"\b[a-z_]+(?:\.[a-z0-9_]+)+\b")


def _lookup(cfg: dict, dotted: str) -> tuple[bool, Any]:
    node: Any = cfg
    for part in dotted.split("."):
        if not isinstance(node, dict) or part not in node:
            return False, None
        node = node[part]
    return True, node


def _lead_with_given(line: str, given: dict[str, int], cfg: dict) -> str:
    """A rule's line leads with the key its section checks (`key 'reward.max_new_tokens': ...`), though the
    value that broke it may be another key's that the line names: one the user set, against a default or a
    value set earlier (`--set model.max_length=16` leaves no room for reward.max_new_tokens' default). Then
    the line leads with the key set last (`given`: 2 set last, 1 in a config file, 0 a default), naming
    the other and both values, so that the refusal names the key the user just changed. A rule whose key
    is empty (reward.source http without reward.http.url) asks for that key: its line stays as it is."""
    head = _LEAD.match(line)
    if head is None:
        return line
    key, rest = head.group(1), line[head.end():]
    if _lookup(cfg, key)[1] in (None, "", [], {}):
        return line
    named = [k for k in dict.fromkeys(_DOTTED.findall(rest)) if k != key and _lookup(cfg, k)[0]]
    lead = max(named, key=lambda k: given.get(k, 0), default=None)  # the first named of the highest rank
    if lead is None or given.get(lead, 0) <= given.get(key, 0):
        return line
    default = " (the default)" if not given.get(key) else ""
    return (f"key '{lead}': {_lookup(cfg, lead)[1]!r} conflicts with {key}={_lookup(cfg, key)[1]!r}{default}: "
            f"{rest}")


# Keys a sweep may not set: they say where outputs go, or declare the seeds, sweeps and comparison themselves.
UNSWEEPABLE = ("paths", "seeds", "sweeps", "comparison")


def _sweep_checks(cfg: dict) -> list[str]:
    """Each `sweeps.<name>.<key>` must name a config key, and each of its values must make a valid config
    (the schema and the cross-checks, on the config with that value set): else an error naming it, before
    anything runs. Values that spell numbers are coerced as the config's own are (`coerce`)."""
    problems = []
    props = load_schema()["properties"]
    for name, axes in (cfg.get("sweeps") or {}).items():
        for key, values in axes.items():
            where = f"sweeps.{name}.{key}"
            node: dict = {"properties": props}
            for part in key.split("."):
                node = (node.get("properties") or {}).get(part)
                if node is None:
                    break
            if node is None or key.split(".")[0] in UNSWEEPABLE:
                problems.append(f"key '{where}': '{key}' is not a config key a sweep can set"
                                if node is not None else f"key '{where}': unknown config key '{key}'")
                continue
            for i, value in enumerate(values):
                point = copy.deepcopy({k: v for k, v in cfg.items() if k != "sweeps"})
                put(point, key, value)
                swept: dict = {}
                put(swept, key, value)
                try:
                    resolved = validate(point, where, swept)
                except ConfigError as e:
                    detail = str(e).split("invalid configuration:", 1)[-1].strip()
                    shown = "a value" if key in env_keys() else f"value {value!r}"  # perhaps a key: not repeated
                    problems.append(f"key '{where}': {shown}: {detail}")
                    continue
                values[i] = select(resolved, [key])  # coerced as the config's own values are
                for part in key.split("."):
                    values[i] = values[i][part]
    return problems
