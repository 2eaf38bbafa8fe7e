"""The config as MLflow parameters: flat, redacted, and only the keys that decide what a stage computes."""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import Any

from rloo_workflow.config import select
from rloo_workflow.tracking.redact import redact

# How a run is observed, not what it computes: never a parameter.
NOT_PARAMS = ("tracking",)


def flatten(obj: Any, prefix: str = "") -> dict[str, Any]:
    """{"a": {"b": 1}} → {"a.b": 1}; lists stay whole."""
    out: dict[str, Any] = {}
    if isinstance(obj, dict):
        for k, v in obj.items():
            out.update(flatten(v, f"{prefix}{k}."))
    else:
        out[prefix[:-1]] = obj
    return out


def leaf_keys(tree: Any, prefix: str = "") -> list[str]:
    """The dotted keys of a nested dict's leaves ({"a": {"b": 1}} → ["a.b"])."""
    if isinstance(tree, dict) and tree:
        return [k for key, v in tree.items() for k in leaf_keys(v, f"{prefix}{key}.")]
    return [prefix[:-1]] if prefix else []


def config_part(cfg: dict, keys: Iterable[str] | None = None) -> dict:
    """The sub-tree of `cfg` named by dotted `keys` (all of it for None), without NOT_PARAMS."""
    if keys is None:
        return {k: v for k, v in cfg.items() if k not in NOT_PARAMS}
    return select(cfg, [k for k in keys if k.split(".")[0] not in NOT_PARAMS])


def config_params(cfg: dict, keys: Iterable[str] | None = None) -> dict[str, str]:
    """Flattened, redacted config keys as MLflow params (strings of at most 6000 chars)."""
    params = {}
    for k, v in flatten(redact(config_part(cfg, keys))).items():
        s = v if isinstance(v, str) else json.dumps(v, sort_keys=True)
        params[k] = s if len(s) <= 6000 else s[:5980] + "…[truncated]"
    return params
