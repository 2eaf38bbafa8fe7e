"""Load a YAML config, apply overrides, validate it against the schema and fill its defaults."""

from __future__ import annotations

import copy
import hashlib
import json
import math
import os
import re
from collections.abc import Iterable
from importlib import resources
from pathlib import Path
from typing import Any
from urllib.parse import parse_qsl, urlsplit

import jsonschema
import yaml

from rloo.errors import UserError
from rloo.pipeline import stage_keys

SCHEMA_PATH = Path(str(resources.files("rloo") / "schemas" / "config.schema.yaml"))


class ConfigError(UserError, ValueError):
    """A config that does not match the schema; the message names the file and the key."""


def load_schema() -> dict:
    return yaml.safe_load(SCHEMA_PATH.read_text())


def _with_defaults(validator_class):
    validate_properties = validator_class.VALIDATORS["properties"]

    def set_defaults(validator, properties, instance, schema):
        if isinstance(instance, dict):
            for key, sub in properties.items():
                if "default" in sub and key not in instance:
                    # Deep copy: the schema's `{}` defaults must not be shared between configs.
                    instance[key] = copy.deepcopy(sub["default"])
        yield from validate_properties(validator, properties, instance, schema)

    return jsonschema.validators.extend(validator_class, {"properties": set_defaults})


_Validator = _with_defaults(jsonschema.Draft202012Validator)


def _key_path(error: jsonschema.ValidationError) -> str:
    return ".".join(str(p) for p in error.absolute_path) or "<top level>"


def validate(cfg: dict, source: str = "config") -> dict:
    """Validate `cfg` in place, filling defaults; raise ConfigError naming the offending key."""
    schema = load_schema()
    cfg.pop("base", None)  # an overlay's declared base, already merged by load_config
    _coerce(cfg, schema)
    if problems := _non_finite(cfg) + _credentials(cfg):
        raise ConfigError(f"{source}: invalid configuration:\n  " + "\n  ".join(problems))
    errors = sorted(_Validator(schema).iter_errors(cfg), key=lambda e: list(e.absolute_path))
    if errors:
        lines = []
        for e in errors:
            if e.validator == "additionalProperties":
                allowed = sorted(e.schema.get("properties", {}))
                extra = sorted(set(e.instance) - set(allowed))
                where = _key_path(e)
                for key in extra:
                    full = key if where == "<top level>" else f"{where}.{key}"
                    lines.append(f"unknown key '{full}' (allowed here: {', '.join(allowed)})")
            else:
                lines.append(f"key '{_key_path(e)}': {e.message}")
        raise ConfigError(f"{source}: invalid configuration:\n  " + "\n  ".join(lines))
    if problems := _cross_checks(cfg):
        raise ConfigError(f"{source}: invalid configuration:\n  " + "\n  ".join(problems))
    return cfg


_INT = re.compile(r"[+-]?\d+")


def _coerce(node: dict, schema: dict) -> None:
    """Strings that spell a number or boolean where the schema wants one become that value.

    YAML 1.1 reads `5e-5` (no dot) as a string, and `snakemake --config 'rloo={beta: 0.1}'` passes
    nested values as strings; both mean the number. Anything else is left for the schema to reject.
    """
    for key, sub in schema.get("properties", {}).items():
        if key not in node:
            continue
        value = node[key]
        if isinstance(value, dict):
            _coerce(value, sub)
        elif isinstance(value, list) and isinstance(sub.get("items"), dict):
            # `--config 'seeds={values: [0, 1]}'` passes the list's items as strings too
            node[key] = [_coerced(v, sub["items"]) for v in value]
        else:
            node[key] = _coerced(value, sub)


def _coerced(value: Any, sub: dict) -> Any:
    """`value`, as the number or boolean it spells where the schema `sub` wants one (see `_coerce`)."""
    if not isinstance(value, str):
        return value
    types = sub.get("type", [])
    types = [types] if isinstance(types, str) else types
    text = value.strip()
    if "integer" in types and _INT.fullmatch(text):
        return int(text)
    if "number" in types:
        try:
            number = float(text)
        except ValueError:
            return value
        if math.isfinite(number):
            return int(text) if _INT.fullmatch(text) else number
    elif "boolean" in types and text.lower() in ("true", "false"):
        return text.lower() == "true"
    return value


def _leaves(node: Any, path: str = ""):
    if isinstance(node, dict):
        for key, value in node.items():
            yield from _leaves(value, f"{path}.{key}" if path else str(key))
    elif isinstance(node, list):
        for i, value in enumerate(node):
            yield from _leaves(value, f"{path}[{i}]")
    else:
        yield path, node


def _non_finite(cfg: dict) -> list[str]:
    """NaN and infinity pass a JSON schema's `number` and train nothing (a NaN beta zeroes every update)."""
    return [f"key '{path}': must be a finite number, got {value}"
            for path, value in _leaves(cfg) if isinstance(value, float) and not math.isfinite(value)]


_SECRET_PARAM = re.compile(r"key|token|secret|password|passwd|auth|signature|credential", re.IGNORECASE)


def _credentials(cfg: dict) -> list[str]:
    """A URL that carries a password or a key ends up in params.yaml, dvc.lock, logs, the results and
    the command line: refuse it, and say where a secret belongs. The message never repeats it."""
    problems = []
    for path, value in _leaves(cfg):
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
                 "pass secrets through environment variables")
        problems.append(f"key '{path}': the URL for {url.scheme}://{host} carries {what}, which would be written "
                        f"to params.yaml, dvc.lock, logs and command lines; remove it and {where}")
    return problems


GROUP_ESTIMATORS = ("rloo", "grpo", "grpo_std")


def _cross_checks(cfg: dict) -> list[str]:
    """Rules that tie several keys together, checked before any stage runs (so `snakemake -n` fails)."""
    r = cfg["rloo"]
    problems = []
    if r["estimator"] in GROUP_ESTIMATORS and r["k"] < 2:
        problems.append(f"key 'rloo.k': the {r['estimator']} estimator needs k >= 2 samples per prompt, got {r['k']}")
    if r["select"] == "best" and not r["eval_every"]:
        problems.append("key 'rloo.select': 'best' picks a checkpoint by validation accuracy and needs "
                        "rloo.eval_every > 0 (or set rloo.select: last)")
    return problems + _serve_checks(cfg) + _sweep_checks(cfg)


# Keys a sweep may not set: they say where outputs go, or declare the seeds and sweeps themselves.
UNSWEEPABLE = ("paths", "seeds", "sweeps")


def _sweep_checks(cfg: dict) -> list[str]:
    """Each `sweeps.<name>.<key>` must name a config key, and each of its values must make a valid config
    (the schema and the cross-checks, on the config with that value set): else an error naming it, before
    anything runs. Values that spell numbers are coerced as the config's own are (`_coerce`)."""
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
                _put(point, key, value)
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


def deep_merge(base: dict, override: dict) -> dict:
    out = copy.deepcopy(base)
    for key, value in override.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = deep_merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def parse_set(assignments: list[str]) -> dict:
    """Turn ["rloo.k=8", "sft.lr=1e-3"] into a nested dict; values are parsed as YAML."""
    out: dict = {}
    for item in assignments:
        if "=" not in item:
            raise ConfigError(f"--set {item!r}: expected KEY.PATH=VALUE")
        dotted, raw = item.split("=", 1)
        node = out
        *parents, leaf = dotted.strip().split(".")
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = _scalar(raw)
    return out


def _scalar(raw: str):
    """A YAML scalar, except that "1e-4" is a number (YAML 1.1 wants "1.0e-4", users don't)."""
    value = yaml.safe_load(raw)
    if isinstance(value, str):
        try:
            return float(value)
        except ValueError:
            return value
    return value


# Where Snakemake's main process leaves the user's resolved config for its jobs (workflow/rules/tracking.smk).
RESOLVED_ENV = "RLOO_RESOLVED_CONFIG"


def export_resolved(cfg: dict, path: str | Path) -> Path:
    """Write the resolved `cfg` to `path` and name it in the environment the jobs inherit, so that
    each stage sees the user's whole config (provenance, config hash) while Snakemake reruns it on its
    own keys only (its --config-json)."""
    from rloo.io import write_json_atomic

    path = Path(path).resolve()
    write_json_atomic(path, cfg)
    os.environ[RESOLVED_ENV] = str(path)
    return path


def resolved_base() -> dict:
    """The config exported by `export_resolved` for this job, or {} outside a Snakemake run."""
    path = os.environ.get(RESOLVED_ENV)
    if not path:
        return {}
    try:
        base = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ConfigError(f"{path} ({RESOLVED_ENV}): cannot read the pipeline's resolved config ({e})") from None
    return base if isinstance(base, dict) else {}


def load_config(
    path: str | Path | list[str | Path] | None = None,
    overrides: dict | None = None,
) -> dict:
    """Read a YAML file, or several merged in order (later ones overlay earlier ones), or start empty;
    merge overrides, validate and fill defaults."""
    paths = [] if path is None else [path] if isinstance(path, str | Path) else list(path)
    cfg: dict = {}
    for p in paths:
        cfg = deep_merge(cfg, _read_yaml(p))
    source = " + ".join(map(str, paths)) or "config"
    if overrides:
        cfg = deep_merge(cfg, overrides)
        source += " (with overrides)"
    return validate(cfg, source)


def _read_yaml(path: str | Path, seen: tuple[Path, ...] = ()) -> dict:
    """A config file; an overlay that names its `base` (a path relative to itself) is read on top of it."""
    try:
        cfg = yaml.safe_load(Path(path).read_text()) or {}
    except FileNotFoundError:
        raise ConfigError(f"{path}: config file not found") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: not valid YAML: {e}") from None
    if not isinstance(cfg, dict):
        raise ConfigError(f"{path}: the top level must be a mapping, got {type(cfg).__name__}")
    base = cfg.pop("base", None)
    if base is None:
        return cfg
    if not isinstance(base, str):
        raise ConfigError(f"{path}: key 'base' must be a path to the config this file overlays")
    base_path = (Path(path).parent / base).resolve()
    if base_path in seen:
        raise ConfigError(f"{path}: key 'base': {base} is already being read (a cycle of bases)")
    return deep_merge(_read_yaml(base_path, (*seen, base_path)), cfg)


def declares_base(path: str | Path) -> bool:
    """Whether a config file names the config it overlays (`base:`)."""
    try:
        cfg = yaml.safe_load(Path(path).read_text())
    except (OSError, yaml.YAMLError):
        return False
    return isinstance(cfg, dict) and "base" in cfg


def changed_keys(a: dict, b: dict) -> list[str]:
    """Dotted keys whose values differ between two configs."""
    left, right = dict(_leaves(a)), dict(_leaves(b))
    return sorted(k for k in left.keys() | right.keys() if left.get(k) != right.get(k))


def config_hash(cfg: dict[str, Any], sections: list[str] | None = None) -> str:
    """A short stable hash of the (resolved) config, or of some of its sections."""
    part = cfg if sections is None else {k: cfg.get(k) for k in sections}
    blob = json.dumps(part, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def stage_config(cfg: dict, stage: str, overrides: dict[str, Any] | None = None) -> dict:
    """The part of `cfg` that `stage` reads (a copy; `pipeline.stage_keys`), with {dotted key: value}
    `overrides` set on top. Snakemake passes a stage exactly this part (workflow/rules/common.smk), so a
    changed value reruns just the stages that read it; a stage run by hand logs it as MLflow parameters."""
    keys, excluded = stage_keys(cfg, stage, (overrides or {}).get("rloo.estimator"))
    part = select(cfg, keys)
    for key in excluded:
        *parents, leaf = key.split(".")
        node = part
        for name in parents:
            node = node.get(name, {})
        node.pop(leaf, None)
    for key, value in (overrides or {}).items():
        _put(part, key, value)
    return part


def with_overrides(cfg: dict, overrides: dict[str, Any]) -> dict:
    """A copy of `cfg` with {dotted key: value} `overrides` set: a seed's or a sweep point's config."""
    out = copy.deepcopy(cfg)
    for key, value in overrides.items():
        _put(out, key, value)
    return out


def select(cfg: dict, keys: Iterable[str]) -> dict:
    """A copy of the sub-tree of `cfg` named by dotted `keys` ("rloo.lr", "model"); absent keys are skipped."""
    part: dict = {}
    for key in keys:
        node: Any = cfg
        try:
            for name in key.split("."):
                node = node[name]
        except (KeyError, TypeError):
            continue
        _put(part, key, node)
    return part


def _put(tree: dict, dotted: str, value: Any) -> None:
    *parents, leaf = dotted.split(".")
    for name in parents:
        tree = tree.setdefault(name, {})
    tree[leaf] = copy.deepcopy(value)


TP_FLAGS = ("--tensor-parallel-size", "-tp")


def tensor_parallel(args: list[str]) -> int | None:
    """The tensor-parallel size given among vLLM `args` (`--tensor-parallel-size N`, `-tp N`, `--...=N`)."""
    for i, a in enumerate(args):
        name, eq, value = a.partition("=")
        if name in TP_FLAGS:
            value = value if eq else (args[i + 1] if i + 1 < len(args) else "")
            try:
                return int(value)
            except ValueError:
                return None
    return None
