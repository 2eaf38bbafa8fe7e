"""The config schema, made from the typed settings (rloo/settings/: every section's dataclass, its defaults,
constraints and docs), a validator that fills its defaults, and the coercion of strings that spell the
numbers and booleans it asks for. rloo_workflow/schemas/config.schema.json is the same schema written out (for an
editor that checks config files as they are typed): `rloo schema --write` writes it, and
tests/unit/test_settings.py holds it to the dataclasses."""

from __future__ import annotations

import copy
import json
import math
import re
from functools import cache
from importlib import resources
from pathlib import Path
from typing import Any

import jsonschema

from rloo.errors import UserError
from rloo.settings import Config, json_schema

SCHEMA_PATH = Path(str(resources.files("rloo_workflow") / "schemas" / "config.schema.json"))


class ConfigError(UserError, ValueError):
    """A config that does not match the schema; the message names the file and the key."""


@cache
def _schema() -> dict:
    return json_schema(Config)


def load_schema() -> dict:
    """The schema, as a dict (a copy: callers may mutate it)."""
    return copy.deepcopy(_schema())


def render_schema() -> str:
    """The schema as SCHEMA_PATH holds it."""
    return json.dumps(_schema(), indent=2, ensure_ascii=False) + "\n"


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


Validator = _with_defaults(jsonschema.Draft202012Validator)


def key_path(error: jsonschema.ValidationError) -> str:
    return ".".join(str(p) for p in error.absolute_path) or "<top level>"


_INT = re.compile(r"[+-]?\d+")


def coerce(node: dict, schema: dict) -> None:
    """Strings that spell a number or boolean where the schema wants one become that value.

    YAML 1.1 reads `5e-5` (no dot) as a string, and `snakemake --config 'rloo={beta: 0.1}'` passes
    nested values as strings; both mean the number. Anything else is left for the schema to reject.
    """
    for key, sub in schema.get("properties", {}).items():
        if key not in node:
            continue
        value = node[key]
        if isinstance(value, dict):
            coerce(value, sub)
        elif isinstance(value, list) and isinstance(sub.get("items"), dict):
            # `--config 'seeds={values: [0, 1]}'` passes the list's items as strings too
            node[key] = [_coerced(v, sub["items"]) for v in value]
        else:
            node[key] = _coerced(value, sub)


def _coerced(value: Any, sub: dict) -> Any:
    """`value`, as the number or boolean it spells where the schema `sub` wants one (see `coerce`)."""
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

