"""The two packages' shape, read from their imports (an AST scan of every `import rloo.x` and `from rloo.x
import`, and the same of rloo_workflow, module-level or not): no import cycle, a package's `__init__`
included (`from rloo.p import m` inside rloo/p/ goes through rloo/p/__init__.py), no module importing
another's private names, and a library (`rloo`) that imports nothing of the workflow (`rloo_workflow`), of
MLflow, DVC or Snakemake: a researcher imports the maths, the trainers and the settings alone."""

from __future__ import annotations

import ast
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


PACKAGES = ("rloo", "rloo_workflow")


def modules(root: Path = ROOT) -> dict[str, Path]:
    out = {}
    for path in sorted(p for package in PACKAGES for p in (root / package).rglob("*.py")):
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


# -- the library: usable from Python without the pipeline ----------------------------------------------
# The library is the package `rloo` (the maths, the models, the samplers, the trainers, the typed settings,
# the rewards, the data and the measurements); the workflow around it is `rloo_workflow` (config files,
# the pipeline's declaration and commands, tracking, DVC, the judge server, code fingerprints, plans).
LIBRARY = ("rloo",)
WORKFLOW = ("rloo_workflow", "snakemake", "mlflow", "dvc")


def _within(module: str, prefixes: tuple[str, ...]) -> bool:
    return any(module == p or module.startswith(p + ".") for p in prefixes)


def workflow_imports(mods: dict[str, Path]) -> dict[str, list[str]]:
    """{library module: the import chain by which it reaches a workflow module}, over every import statement
    (module-level or not, a package's __init__ run on the way) of the modules it reaches."""
    edges, _ = import_edges(mods)
    for m, path in mods.items():  # importing a.b.c runs a and a.b first; snakemake, mlflow and dvc by name
        parts = m.split(".")
        edges[m] |= {".".join(parts[:i]) for i in range(1, len(parts)) if ".".join(parts[:i]) in mods}
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else (
                [node.module] if isinstance(node, ast.ImportFrom) and node.module else [])
            edges[m] |= {n.split(".")[0] for n in names if n.split(".")[0] in ("snakemake", "mlflow", "dvc")}
    out = {}
    for start in (m for m in mods if _within(m, LIBRARY)):
        todo, seen = [[start]], set()
        while todo:
            chain = todo.pop()
            if chain[-1] in seen:
                continue
            seen.add(chain[-1])
            if _within(chain[-1], WORKFLOW):
                out[start] = chain
                break
            todo += [[*chain, e] for e in sorted(edges.get(chain[-1], ()))]
    return out


def test_no_library_module_imports_the_workflow():
    assert workflow_imports(modules()) == {}


def test_the_boundary_scan_finds_a_workflow_import(tmp_path):
    for package in PACKAGES:
        shutil.copytree(ROOT / package, tmp_path / package)
    losses = tmp_path / "rloo" / "algo" / "losses.py"
    losses.write_text(losses.read_text().replace("import torch\n", "import torch\n\nfrom rloo_workflow import tracking\n", 1))
    found = workflow_imports(modules(tmp_path))
    assert found["rloo.algo.losses"] == ["rloo.algo.losses", "rloo_workflow.tracking"]
    assert "rloo.train.rloo_trainer" in found  # and every library module that imports the losses


def test_importing_the_maths_loads_a_few_modules_of_the_package():
    code = "import sys, rloo.algo.estimators; print(sorted(m for m in sys.modules if m.startswith('rloo')))"
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    loaded = ast.literal_eval(res.stdout.strip())
    assert loaded == ["rloo", "rloo.algo", "rloo.algo.estimators", "rloo.algo.names"]


def test_importing_the_api_loads_nothing_of_the_workflow():
    code = ("import sys, rloo.api; print(sorted({m.split('.')[0] for m in sys.modules} & "
            "{'rloo_workflow', 'mlflow', 'dvc', 'snakemake'}))")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert ast.literal_eval(res.stdout.strip()) == []


CLIPS = ("clip_grad_norm_", "clip_grads_with_norm_")


def direct_grad_clips(mods: dict[str, Path]) -> list[str]:
    """Every call of torch's clip_grad_norm_ (or clip_grads_with_norm_) outside rloo.model.distributed."""
    out = []
    for m, path in mods.items():
        if m == "rloo.model.distributed":
            continue
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Attribute) and node.attr in CLIPS and ast.unparse(node.value) != "distributed":
                out.append(f"{m}:{node.lineno}: {ast.unparse(node)}")
            elif isinstance(node, ast.ImportFrom) and any(a.name in CLIPS for a in node.names):
                out.append(f"{m}:{node.lineno}: from {node.module} import {', '.join(a.name for a in node.names)}")
    return out


def test_every_gradient_clip_is_the_one_that_makes_fsdp_shards_whole():
    # PPO clipped with torch.nn.utils.clip_grad_norm_ beside RLOO's distributed.clip_grad_norm_ (issue 64)
    assert direct_grad_clips(modules()) == []
