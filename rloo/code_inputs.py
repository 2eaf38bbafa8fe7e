"""Which source files a stage runs: the package modules it imports (transitively), the data files
they read (MODULE_DATA) and the schema.

Snakemake and DVC both take these files as inputs of the stage, so editing a stage's code, or a
library module it uses, reruns exactly that stage and what depends on it.
"""

from __future__ import annotations

import ast
from functools import cache
from pathlib import Path

PACKAGE_DIR = Path(__file__).resolve().parent
# Package data a module reads as it runs: part of its code (an edited template reruns its stages).
MODULE_DATA = {"rloo.data.synthetic": ("data/themes.yaml",)}


def _module_file(name: str) -> Path | None:
    rel = Path(*name.split("."))
    for cand in (PACKAGE_DIR.parent / rel.with_suffix(".py"), PACKAGE_DIR.parent / rel / "__init__.py"):
        if cand.is_file():
            return cand
    return None


def _imports(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
            names.update(f"{node.module}.{a.name}" for a in node.names)
    return {n for n in names if n == "rloo" or n.startswith("rloo.")}


@cache
def module_sources(module: str) -> tuple[str, ...]:
    """Repository-relative paths of `module` and every rloo module it imports, directly or not.

    A `module` that does not exist is an error: an empty closure would let a stage run code that no
    rule counts as its input, so an edit would rerun nothing."""
    if _module_file(module) is None:
        raise ValueError(f"{module}: no such module in {PACKAGE_DIR} (a stage's code inputs are its imports)")
    seen: dict[str, Path] = {}
    todo = [module]
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        path = _module_file(name)
        if path is None:
            continue
        seen[name] = path
        parts = name.split(".")
        # Importing a.b.c runs a/__init__ and a/b/__init__ too.
        todo.extend(".".join(parts[:i]) for i in range(1, len(parts)))
        todo.extend(_imports(path))
    root = PACKAGE_DIR.parent
    files = {str(p.relative_to(root)) for p in seen.values()}
    files.update(str((PACKAGE_DIR / f).relative_to(root)) for name in seen for f in MODULE_DATA.get(name, ()))
    files.add(str((PACKAGE_DIR / "schemas" / "config.schema.yaml").relative_to(root)))
    return tuple(sorted(files))


def stage_sources(stage: str) -> list[str]:
    """Source files of `rloo <stage>`: the CLI plus the stage module's import closure."""
    return sorted(set(module_sources("rloo.cli")) | set(module_sources(f"rloo.stages.{stage}")))
