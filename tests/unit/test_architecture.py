"""The package's shape, read from its imports (an AST scan of every `import rloo.x` and `from rloo.x import`,
module-level or not): no import cycle, a package's `__init__` included (`from rloo.p import m` inside
rloo/p/ goes through rloo/p/__init__.py), and no module importing another's private names."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def modules(root: Path = ROOT) -> dict[str, Path]:
    out = {}
    for path in sorted((root / "rloo").rglob("*.py")):
        parts = path.relative_to(root).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def import_edges(mods: dict[str, Path]) -> tuple[dict[str, set[str]], list[str]]:
    """{module: the package modules it imports} (`from P import X` is an edge to P, and to P.X when X
    is a module), and every `from M import _private` of another module M."""
    edges: dict[str, set[str]] = {m: set() for m in mods}
    private = []
    for m, path in mods.items():
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module in mods:
                edges[m].add(node.module)
                for a in node.names:
                    if f"{node.module}.{a.name}" in mods:
                        edges[m].add(f"{node.module}.{a.name}")
                    elif a.name.startswith("_") and node.module != m:
                        private.append(f"{m}: from {node.module} import {a.name}")
            elif isinstance(node, ast.Import):
                edges[m].update(a.name for a in node.names if a.name in mods)
    return edges, private


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(edges[v] - {v}):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return out


def test_no_import_cycle_package_inits_included():
    edges, _ = import_edges(modules())
    assert cycles(edges) == []


def test_the_scan_finds_a_cycle_through_a_package_init():
    # the shape issue 56 found: rloo/rollout/__init__.py imports hf, and hf imported `from rloo.rollout import decode`
    edges = {"rloo.rollout": {"rloo.rollout.hf"}, "rloo.rollout.hf": {"rloo.rollout", "rloo.rollout.decode"},
             "rloo.rollout.decode": set()}
    assert cycles(edges) == [["rloo.rollout", "rloo.rollout.hf"]]


def test_no_module_imports_another_modules_private_names():
    _, private = import_edges(modules())
    assert private == []
