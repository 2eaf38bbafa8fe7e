"""Validation: the schema, then the rules it cannot state (finite numbers, no secrets in URLs, keys that
depend on each other, each in its section's `problems` (rloo/settings/), the values each sweep sets, and a
CPU run's predicted host memory), each naming the offending key."""

from __future__ import annotations

import copy
import math
import re
from urllib.parse import parse_qsl, urlsplit

from rloo.config.schema import ConfigError, Validator, coerce, key_path, load_schema
from rloo.config.selection import leaves, put, select
from rloo.host_memory import config_problems as host_memory_problems
from rloo.settings import Config


def validate(cfg: dict, source: str = "config") -> dict:
    """Validate `cfg` in place, filling defaults; raise ConfigError naming the offending key."""
    schema = load_schema()
    cfg.pop("base", None)  # an overlay's declared base, already merged by load_config
    coerce(cfg, schema)
    if problems := _non_finite(cfg) + _credentials(cfg):
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
    if problems := _cross_checks(cfg):
        raise ConfigError(f"{source}: invalid configuration:\n  " + "\n  ".join(problems))
    return cfg


def _non_finite(cfg: dict) -> list[str]:
    """NaN and infinity pass a JSON schema's `number` and train nothing (a NaN beta zeroes every update)."""
    return [f"key '{path}': must be a finite number, got {value}"
            for path, value in leaves(cfg) if isinstance(value, float) and not math.isfinite(value)]


_SECRET_PARAM = re.compile(r"key|token|secret|password|passwd|auth|signature|credential", re.IGNORECASE)


def _credentials(cfg: dict) -> list[str]:
    """A URL that carries a password or a key ends up in params.yaml, dvc.lock, logs, the results and
    the command line: refuse it, and say where a secret belongs. The message never repeats it."""
    problems = []
    for path, value in leaves(cfg):
        if not isinstance(value, str) or "://" not in value:
            continue
        try:
            url = urlsplit(value.strip())
        except ValueError:
            continue
        secret_params = [k for k, _ in parse_qsl(url.query, keep_blank_values=True) if _SECRET_PARAM.search(k)]
        if url.password is None and not secret_params:
            continue
        what = "a password (user:password@)" if url.password is not None else f"a secret query parameter ({', '.join(secret_params)})"
        host = url.hostname or "?"
        where = ("put the API key in an environment variable and name it in evaluate.llm_judge.api_key_env"
                 if path.startswith("evaluate.llm_judge") else
                 "MLflow reads MLFLOW_TRACKING_USERNAME / MLFLOW_TRACKING_PASSWORD (or MLFLOW_TRACKING_TOKEN) "
                 "from the environment" if path.startswith("tracking") else
                 "put the key in an environment variable and name it in reward.http.api_key_env"
                 if path.startswith("reward.http") else
                 "pass secrets through environment variables")
        problems.append(f"key '{path}': the URL for {url.scheme}://{host} carries {what}, which would be written "
                        f"to params.yaml, dvc.lock, logs and command lines; remove it and {where}")
    return problems


def _cross_checks(cfg: dict) -> list[str]:
    """Rules that tie several keys together, checked before any stage runs (so `snakemake -n` fails)."""
    sections = Config.from_config(cfg)
    problems = sections.problems() + _sweep_checks(cfg)
    return problems or host_memory_problems(sections)  # the memory estimate only once the sizes themselves are sane


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
                try:
                    resolved = validate(point, where)
                except ConfigError as e:
                    detail = str(e).split("invalid configuration:", 1)[-1].strip()
                    problems.append(f"key '{where}': value {value!r}: {detail}")
                    continue
                values[i] = select(resolved, [key])  # coerced as the config's own values are
                for part in key.split("."):
                    values[i] = values[i][part]
    return problems
