"""What a config section is made of: a frozen dataclass whose fields carry their default, their
constraints (`setting`) and, as the string under each field, a one-line doc; and the JSON schema that
follows from them (`json_schema`), the one the config files are validated against.

    @dataclass(frozen=True)
    class RlooConfig(Section):
        k: int = setting(4, minimum=1)
        \"\"\"Samples per prompt: the group whose other members are each one's baseline.\"\"\"
        alarms: AlarmConfig = field(default_factory=AlarmConfig)

A field's type gives the schema its type: int, float (a JSON number), str, bool, `X | None` (nullable),
`Literal[...]` (an enum), `tuple[T, ...]` (an array of T), a nested section (`field(default_factory=...)`:
an object of its own keys, all defaulted) and `Mapping` (an object the field's `schema=` describes). The
docs are read from the source, so they are no code: an edited doc changes no stage's code fingerprint
(rloo_workflow/code_fingerprint.py).
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import itertools
import textwrap
import types
import typing
from collections.abc import Mapping
from functools import cache
from types import MappingProxyType
from typing import Any, Literal

_MISSING = dataclasses.MISSING
# The keyword arguments of `setting` that are JSON-schema keywords of the same meaning, by their name there.
_KEYWORDS = {"minimum": "minimum", "maximum": "maximum", "exclusive_minimum": "exclusiveMinimum",
             "exclusive_maximum": "exclusiveMaximum", "min_items": "minItems", "max_items": "maxItems",
             "unique_items": "uniqueItems", "min_length": "minLength", "pattern": "pattern", "contains": "contains",
             "item": "items", "min_properties": "minProperties"}


def setting(default: Any = _MISSING, *, schema: dict | None = None, **constraints: Any) -> Any:
    """A field with its default and constraints (`minimum`, `maximum`, `exclusive_minimum`,
    `exclusive_maximum`, `min_items`, `max_items`, `unique_items`, `min_length`, `pattern`, `contains`,
    `item`: the schema of an array's items beyond their type); `schema` replaces the schema the type would
    give.
    A list default is stored as a tuple (the section is frozen) and written as a list."""
    unknown = sorted(set(constraints) - set(_KEYWORDS))
    if unknown:
        raise TypeError(f"setting(): unknown constraint(s) {', '.join(unknown)}")
    metadata = {"constraints": {_KEYWORDS[k]: v for k, v in constraints.items()}, "schema": schema}
    if isinstance(default, list):
        default = tuple(default)
    if isinstance(default, dict):
        frozen = MappingProxyType(dict(default))
        return dataclasses.field(default_factory=lambda: frozen, metadata=metadata)
    if default is _MISSING:
        return dataclasses.field(metadata=metadata)
    return dataclasses.field(default=default, metadata=metadata)


class Section:
    """A config section as a frozen dataclass: `from_config` takes the validated dict's section."""

    @classmethod
    def from_config(cls, section: Mapping[str, Any]) -> Any:
        names = {f.name for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
        if unknown := sorted(set(section) - names):
            # the schema has a key this dataclass lacks: the schema is generated from the dataclasses
            raise KeyError(f"{cls.__name__}: no field for config key(s) {', '.join(unknown)}")
        hints = _hints(cls)
        return cls(**{name: _typed(hints[name], section[name]) for name in names if name in section})

    def to_config(self) -> dict[str, Any]:
        """The section as the validated dict holds it: lists for tuples, dicts for nested sections."""
        return {f.name: _plain(getattr(self, f.name)) for f in dataclasses.fields(self)}  # type: ignore[arg-type]


@cache
def _hints(cls: type) -> dict[str, Any]:
    """A section's field types (resolving them is most of a conversion's cost: the pipeline makes hundreds)."""
    return typing.get_type_hints(cls)


def _typed(hint: Any, value: Any) -> Any:
    """`value` as the field's type: a nested section built (a tuple of them too), a list frozen into a
    tuple, a mapping into a read-only copy."""
    if value is None:
        return None
    for t in _members(hint):
        if isinstance(t, type) and dataclasses.is_dataclass(t):
            return t.from_config(value)  # type: ignore[attr-defined]
    if isinstance(value, list):
        items = next((typing.get_args(t)[0] for t in _members(hint) if typing.get_origin(t) is tuple), None)
        return tuple(_typed(items, v) for v in value) if items is not None else tuple(value)
    if isinstance(value, Mapping):
        return MappingProxyType(dict(value))
    return value


def _plain(value: Any) -> Any:
    if isinstance(value, Section):
        return value.to_config()
    if isinstance(value, tuple):
        return [_plain(v) for v in value]
    if isinstance(value, Mapping):
        return {k: _plain(v) for k, v in value.items()}
    return value


def _members(hint: Any) -> tuple[Any, ...]:
    """The types a hint admits: the members of a union, else the hint."""
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        return typing.get_args(hint)
    return (hint,)


def section_types(cls: type) -> dict[str, type]:
    """{field: its nested section dataclass} of `cls` (a nullable one included)."""
    out = {}
    for name, hint in typing.get_type_hints(cls).items():
        for t in _members(hint):
            if isinstance(t, type) and dataclasses.is_dataclass(t):
                out[name] = t
    return out


@cache
def field_docs(cls: type) -> dict[str, str]:
    """{field: the string literal under it in the class body}, read from the source."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    body = tree.body[0].body  # type: ignore[attr-defined]
    docs = {}
    for stmt, following in itertools.pairwise(body):
        if (isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name) and isinstance(following, ast.Expr)
                and isinstance(following.value, ast.Constant) and isinstance(following.value.value, str)):
            docs[stmt.target.id] = " ".join(following.value.value.split())
    return docs


# -- the JSON schema ----------------------------------------------------------------------------------

_SCALARS = {int: "integer", float: "number", str: "string", bool: "boolean"}


def _type_schema(hint: Any) -> dict:
    """The schema of a type (no default, no constraints)."""
    members = _members(hint)
    nullable = type(None) in members
    members = tuple(t for t in members if t is not type(None))
    if len(members) != 1:
        raise TypeError(f"{hint}: a union other than `X | None` needs `schema=`")
    (t,) = members
    if isinstance(t, type) and dataclasses.is_dataclass(t):
        out = _object_schema(t)
        if nullable:
            out["type"] = ["object", "null"]
        return out
    if typing.get_origin(t) is Literal:
        values = list(typing.get_args(t))
        out: dict[str, Any] = {"enum": [*values, None] if nullable else values}
        kinds = sorted({_SCALARS[type(v)] for v in values})
        if len(kinds) > 1 or "boolean" in kinds:  # `coerce` reads the type: "true" is a boolean here
            out["type"] = kinds + (["null"] if nullable else [])
        return out
    if typing.get_origin(t) is tuple:
        out = {"type": ["array", "null"] if nullable else "array", "items": _type_schema(typing.get_args(t)[0])}
        return out
    if t in _SCALARS:
        return {"type": [_SCALARS[t], "null"] if nullable else _SCALARS[t]}
    raise TypeError(f"{hint}: no JSON type; give the field `schema=`")


def _object_schema(cls: type) -> dict:
    """A section's object: its keys, none other; the keys without a default are required."""
    hints = typing.get_type_hints(cls)
    docs = field_docs(cls)
    props, required = {}, []
    for f in dataclasses.fields(cls):
        node = dict(f.metadata.get("schema") or _type_schema(hints[f.name]))
        items = f.metadata.get("constraints", {}).get("items")
        node.update({k: v for k, v in f.metadata.get("constraints", {}).items() if k != "items"})
        if items:
            node["items"] = {**node.get("items", {}), **items}
        default = f.default if f.default is not _MISSING else (
            f.default_factory() if f.default_factory is not _MISSING else _MISSING)
        if default is _MISSING:
            required.append(f.name)
        else:  # a nested section's defaults are its own keys': the schema fills them in
            node["default"] = {} if isinstance(default, Section) else _plain(default)
        if f.name in docs:
            node["description"] = docs[f.name]
        props[f.name] = node
    out: dict[str, Any] = {"type": "object", "additionalProperties": False}
    if cls.__doc__ and not cls.__doc__.startswith(f"{cls.__name__}("):  # dataclass's generated doc: none
        out["description"] = " ".join(inspect.cleandoc(cls.__doc__).split())
    if required:
        out["required"] = required
    out["properties"] = props
    return out


def json_schema(cls: type) -> dict:
    """The JSON schema (draft 2020-12) of the config whose root section is `cls`."""
    return {"$schema": "https://json-schema.org/draft/2020-12/schema", **_object_schema(cls)}
