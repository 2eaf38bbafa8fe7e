"""Model sources outside the project (a GGUF file inside an installed package, a model folder elsewhere
on disk) as DVC deps. DVC versions only what lies in the repository, and an absolute path is one
machine's, so each such source is stood in for by a pin file inside the project,
`external/<config key>.json`: the config value and the size and SHA-256 of every file it names. A
changed source changes its pin, so DVC reruns the stage exactly as it would for a file of its own."""

from __future__ import annotations

import json
import os
import site
import sys
from pathlib import Path

from rloo.io import atomic_path, file_digest

EXTERNAL_DIR = "external"
# The config keys that may name a model source off the project: what the base stage reads.
SOURCE_KEYS = ("model.gguf", "model.name_or_path", "model.tokenizer")


def pin_path(key: str) -> str:
    """The project-relative pin file of a config key."""
    return f"{EXTERNAL_DIR}/{key}.json"


def _value(config: dict, key: str):
    node = config
    for part in key.split("."):
        node = node.get(part) if isinstance(node, dict) else None
    return node


def _resolve(key: str, value: str) -> Path | None:
    if key == "model.gguf":
        from rloo.model.base import gguf_file

        return gguf_file(value)
    return Path(value) if os.path.exists(value) else None  # a hub id is no file


def absolute(path: str | os.PathLike, root: Path) -> str:
    """`path` as an absolute path, a relative one read from `root`. Links are not followed: an output
    linked into the DVC cache is still the project's."""
    return os.path.normpath(os.path.join(os.path.abspath(root), path))


def outside(path: str | os.PathLike, root: Path) -> bool:
    """Whether `path` (relative paths read from `root`) lies outside the project."""
    return not Path(absolute(path, root)).is_relative_to(os.path.abspath(root))


def in_environment(path: str | os.PathLike) -> bool:
    """Whether `path` lies in the running Python environment (an installed package's file): the
    quick start's venv sits inside the project, but what it holds is the machine's, not the project's."""
    resolved = Path(os.path.abspath(path))
    return any(resolved.is_relative_to(os.path.abspath(p)) for p in {sys.prefix, *site.getsitepackages()})


def sources(config: dict, root: Path) -> dict[str, str]:
    """{resolved absolute path: config key} of the model sources that lie outside the project or in
    the Python environment (a GGUF file inside an installed package, wherever the venv is)."""
    found = {}
    for key in SOURCE_KEYS:
        value = _value(config, key)
        if isinstance(value, str) and value:
            path = _resolve(key, value)
            if path is not None and (outside(path, root) or in_environment(absolute(path, root))):
                found[absolute(path, root)] = key
    return found


def pin(key: str, value: str, path: Path) -> dict:
    """A source's pin: its config value and every file's size and SHA-256 (paths relative to it), never
    the machine's absolute path, so the same source pins the same on every machine."""
    files = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file())
    base = path.parent if path.is_file() else path
    return {"key": key, "value": value,
            "files": {p.relative_to(base).as_posix(): {"size": p.stat().st_size, "sha256": file_digest(p)}
                      for p in files}}


def write_pins(config: dict, root: Path) -> list[str]:
    """Write (when changed) the pin of each outside source of `config`; the pins written, relative."""
    changed = []
    for path, key in sources(config, root).items():
        target = Path(root, pin_path(key))
        text = json.dumps(pin(key, _value(config, key), Path(path)), indent=1, sort_keys=True) + "\n"
        if target.is_file() and target.read_text() == text:
            continue
        target.parent.mkdir(parents=True, exist_ok=True)
        with atomic_path(target) as tmp:
            tmp.write_text(text)
        changed.append(pin_path(key))
    return changed
