"""Parts of a config: dotted-key copies and overrides, hashes and differences (what a stage reads of it:
rloo_workflow.pipeline.stage_config)."""

from __future__ import annotations

import copy
from collections.abc import Iterable, Iterator
from typing import Any

from rloo.io import config_hash  # noqa: F401 (re-exported: rloo_workflow.config.config_hash)


def leaves(node: Any, path: str = "") -> Iterator[tuple[str, Any]]:
    """(dotted path, value) of every leaf of a config tree; list items as `key[i]`."""
    if isinstance(node, dict):
        for key, value in node.items():
            yield from leaves(value, f"{path}.{key}" if path else str(key))
    elif isinstance(node, list):
        for i, value in enumerate(node):
            yield from leaves(value, f"{path}[{i}]")
    else:
        yield path, node


def changed_keys(a: dict, b: dict) -> list[str]:
    """Dotted keys whose values differ between two configs."""
    left, right = dict(leaves(a)), dict(leaves(b))
    return sorted(k for k in left.keys() | right.keys() if left.get(k) != right.get(k))


def with_overrides(cfg: dict, overrides: dict[str, Any]) -> dict:
    """A copy of `cfg` with {dotted key: value} `overrides` set: a seed's or a sweep point's config."""
    out = copy.deepcopy(cfg)
    for key, value in overrides.items():
        put(out, key, value)
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
        put(part, key, node)
    return part


def put(tree: dict, dotted: str, value: Any) -> None:
    """Set dotted key `dotted` of `tree` to a copy of `value`, making the parents it lacks."""
    *parents, leaf = dotted.split(".")
    for name in parents:
        tree = tree.setdefault(name, {})
    tree[leaf] = copy.deepcopy(value)


def drop(tree: dict, dotted: str) -> None:
    """Remove dotted key `dotted` from `tree` where it is there."""
    *parents, leaf = dotted.split(".")
    for name in parents:
        tree = tree.get(name) or {}
    tree.pop(leaf, None)
