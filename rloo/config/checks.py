"""Validation: the schema, then the rules it cannot state (finite numbers, no secrets in URLs, keys that
depend on each other, the values each sweep sets, a served judge's flags), each naming the offending key."""

from __future__ import annotations

import copy
import math
import re
from urllib.parse import parse_qsl, urlsplit

from rloo.config.schema import ConfigError, Validator, coerce, key_path, load_schema
from rloo.config.sections import RlooConfig
from rloo.config.selection import leaves, put, select
from rloo.config.sizes import size_checks
from rloo.reward.functions import config_problems as reward_function_problems


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
    return (RlooConfig.from_config(cfg["rloo"]).problems() + _serve_checks(cfg) + _reward_checks(cfg)
            + _sweep_checks(cfg) + size_checks(cfg))


def _reward_checks(cfg: dict) -> list[str]:
    """A reward server needs its URL; each reward function must import and take TRL's arguments."""
    if cfg["reward"]["source"] == "http" and not cfg["reward"]["http"]["url"]:
        return ["key 'reward.http.url': reward.source is 'http' but no URL is set (http://host:port/path)"]
    return reward_function_problems(cfg)


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


def _serve_checks(cfg: dict) -> list[str]:
    """A served judge (evaluate.llm_judge.serve) runs inside the evaluate job only, on serve.gpus GPUs."""
    serve = cfg["evaluate"]["llm_judge"]["serve"]
    if not serve:
        return []
    from rloo.reward.judge_server import (
        tensor_parallel,  # here: judge_server imports torch, a config check must not
    )

    problems = []
    tp = tensor_parallel(serve["args"])
    if tp is not None and serve["gpus"] and tp != serve["gpus"]:
        problems.append(f"key 'evaluate.llm_judge.serve.args': --tensor-parallel-size {tp} but serve.gpus is "
                        f"{serve['gpus']} (the GPUs the evaluate job gets for the judge): make them equal")
    owned = sorted({a.split("=", 1)[0] for a in serve["args"]} & {"--host", "--port", "--api-key"})
    if owned:
        problems.append(f"key 'evaluate.llm_judge.serve.args': {', '.join(owned)} are set by the evaluate job (a free "
                        "local port, a key of this run only); leave them out")
    if cfg["reward"]["source"] == "judge" and cfg["evaluate"]["judge"] == "llm":
        problems.append("key 'evaluate.llm_judge.serve': the judge is served by the evaluate job only, but "
                        "reward.source: judge scores RLOO with it too; give RLOO a running judge "
                        "(evaluate.llm_judge.base_url, serve: null) or another reward.source")
    return problems
