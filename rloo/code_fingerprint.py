"""Code fingerprints: what code computes, not how it is spelled. The library's part: the walk and the
digests, and the fingerprint of each training run's code (`training_fingerprint`), which the identity of a
run rloo.api starts counts (rloo/identity.py; a stage's run counts its stage's fingerprint, below).
The workflow adds each stage's fingerprint (rloo_workflow/code_fingerprint.py: its module and the CLI's
dispatch), and keeps the manifests `rloo why-rerun` compares.

Code is the two packages (the library `rloo`, the workflow `rloo_workflow`) read as source: nothing is
imported. A function, class or module-level name is counted when a counted definition names it (through
the imports of its module or of its function), and a module's import-time statements are counted when
the module is imported. Each counted definition is reduced to its syntax tree without docstrings
(comments are not in the tree), so a comment, a docstring or a reflowed line changes nothing, and a
changed expression changes the fingerprint of exactly the runs that reach it. The package data a
counted module reads (MODULE_DATA) counts as its parsed value. The config's schema is code too: the typed
settings (rloo/settings/) that every run's validation reaches, their types, defaults and constraints
in the tree, their docs (the strings under the fields) not. A user's file the config names (a reward
function's) counts whole, by the same syntax tree.

The manifest behind a fingerprint ({file: {definition: digest}}) says what changed between two
fingerprints (`changes`), and each file's digest (`file_digests`) is what MLflow records.

The walk is static: a definition reached only through a string (`importlib.import_module("rloo.x")`,
`getattr(module, "name")` on a module passed as a value counts the whole module) or only through a
registry filled by a decorator would be missed. tests/integration/test_code_fingerprint_sound.py runs
the stages under a profiler and checks that every package function they call is counted.
"""

from __future__ import annotations

import ast
import contextlib
import hashlib
import json
import os
import sys
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import yaml

PACKAGES = ("rloo", "rloo_workflow")  # the library and the workflow: both are the stages' code
ROOT = Path(__file__).resolve().parents[1]
# Package data a module reads as it runs: part of its code (an edited theme reruns the stages that use it).
MODULE_DATA = {"rloo.data.synthetic": ("data/themes.yaml",)}  # relative to the module's package
# Fingerprints kept on disk by what they were computed from (`Codebase.kept`): a walk costs about a second
# of CPU, paid by every process that asks (each stage job, each Snakemake run), for a result that changes
# only when the sources do. RLOO_CACHE_DIR moves the folder; KEPT_MAX bounds it.
CACHE_DIR_ENV = "RLOO_CACHE_DIR"
KEPT_MAX = 512
MODULE_NODE = "<module>"  # a module's import-time statements: imports, `if`/`try` blocks, expressions
PARAM_PREFIX = "code:"  # the rules' `code` param: `code:<stage>:<digest>`

Key = tuple[str, str]  # (module, definition name)


# --------------------------------------------------------------------------------------------------
# Syntax trees without docstrings


class _DropDocstrings(ast.NodeTransformer):
    """Removes every statement that is a bare string: docstrings and strings used as comments do nothing."""

    def generic_visit(self, node: ast.AST) -> ast.AST:
        super().generic_visit(node)
        for field in ("body", "orelse", "finalbody"):
            body = getattr(node, field, None)
            if isinstance(body, list) and body and isinstance(body[0], ast.stmt):
                kept = [s for s in body if not (isinstance(s, ast.Expr) and isinstance(s.value, ast.Constant)
                                                and isinstance(s.value.value, str))]
                setattr(node, field, kept or [ast.Pass()])
        return node


def semantic_tree(source: str, filename: str = "<source>") -> ast.Module:
    """`source` parsed, its docstrings dropped (comments never reach the tree)."""
    return _DropDocstrings().visit(ast.parse(source, filename=filename))


def semantic_dump(node: ast.AST) -> str:
    """The tree as text without line numbers: equal for code that differs only in layout."""
    return ast.dump(node, annotate_fields=False, include_attributes=False)


def _digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def same_meaning(path: str, before: str, after: str) -> bool:
    """Two versions of a file that differ in comments, docstrings or layout only: YAML that parses to
    the same value, Python with the same tree without docstrings."""
    try:
        if path.endswith((".yaml", ".yml")):
            return yaml.safe_load(before) == yaml.safe_load(after)
        if path.endswith(".py"):
            return semantic_dump(semantic_tree(before)) == semantic_dump(semantic_tree(after))
    except (yaml.YAMLError, SyntaxError, ValueError):
        return False
    return before == after


# --------------------------------------------------------------------------------------------------
# A module's definitions and what each names


@dataclass(frozen=True)
class _Binding:
    """What a name bound by an import refers to: a module, or `attr` of a module."""

    module: str
    attr: str | None = None


@dataclass(frozen=True)
class _Module:
    name: str
    path: Path
    defs: dict[str, list[ast.stmt]]  # definition -> its statements (MODULE_NODE: import-time ones)
    names: dict[str, str]  # a module-level name -> the definition that binds it
    imports: dict[str, _Binding]  # module-level import bindings
    lines: list[tuple[int, int, str]]  # (first line, last line, definition) as written: code objects' owners


def _assigned_names(stmt: ast.stmt) -> list[str]:
    targets = stmt.targets if isinstance(stmt, ast.Assign) else [stmt.target]
    return [n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)]


def _chains(stmts: list[ast.stmt]) -> Iterator[list[str]]:
    """Every dotted name the statements read (`a.b.c` as ['a', 'b', 'c']; a plain name as one item),
    annotations included: dataclasses and typing.get_type_hints read them at run time (the config
    sections build their nested sections from them)."""
    inner: set[int] = set()  # a Name or Attribute that is part of a longer chain already yielded
    for stmt in stmts:
        for node in ast.walk(stmt):
            if id(node) in inner:
                continue
            if isinstance(node, ast.Attribute):
                parts, cur = [], node
                while isinstance(cur, ast.Attribute):
                    parts.append(cur.attr)
                    inner.add(id(cur.value))
                    cur = cur.value
                if isinstance(cur, ast.Name):
                    yield [cur.id, *reversed(parts)]
            elif isinstance(node, ast.Name):
                yield [node.id]


def _data_digest(path: Path) -> str:
    text = path.read_text()
    value = yaml.safe_load(text) if path.suffix in (".yaml", ".yml") else text
    return _digest(json.dumps(value, sort_keys=True))


@dataclass(frozen=True)
class Fingerprint:
    stage: str  # the stage's name (rloo.stages.STAGES), or a command that is no stage
    digest: str
    manifest: dict[str, dict[str, str]]  # {file: {definition: digest}}

    @property
    def files(self) -> list[str]:
        return sorted(self.manifest)

    @property
    def param(self) -> str:
        return f"{PARAM_PREFIX}{self.stage}:{self.digest}"


def parse_param(value: str | None) -> tuple[str, str] | None:
    """(stage, digest) of a `code` param, else None."""
    if not isinstance(value, str) or not value.startswith(PARAM_PREFIX) or value.count(":") != 2:
        return None
    _, stage, digest = value.split(":")
    return stage, digest


class Codebase:
    """The package below `root` (its folder `rloo/`), read as source: nothing of it is imported."""

    def __init__(self, root: Path = ROOT) -> None:
        self.root = Path(root).resolve()
        self.package_dirs = [self.root / p for p in PACKAGES]
        self._files: dict[str, Path | None] = {}
        self._modules: dict[str, _Module] = {}
        self._edge_cache: dict[Key, tuple[Key, ...]] = {}
        self._digests: dict[Key, dict[str, str]] = {}

    # -- modules ----------------------------------------------------------------------------------

    def module_file(self, name: str) -> Path | None:
        if name not in self._files:
            rel = Path(*name.split("."))
            self._files[name] = next((c for c in (self.root / rel.with_suffix(".py"), self.root / rel / "__init__.py")
                                      if c.is_file()), None)
        return self._files[name]

    def is_module(self, name: str) -> bool:
        return name.split(".")[0] in PACKAGES and self.module_file(name) is not None

    def _bindings(self, stmt: ast.stmt) -> dict[str, _Binding]:
        """The package names an import statement binds (others, and relative imports, bind nothing here)."""
        out: dict[str, _Binding] = {}
        if isinstance(stmt, ast.Import):
            for a in stmt.names:
                if (top := a.name.split(".")[0]) in PACKAGES:
                    out[a.asname or top] = _Binding(a.name if a.asname else top)
        elif isinstance(stmt, ast.ImportFrom) and stmt.level == 0 and (stmt.module or "").split(".")[0] in PACKAGES:
            for a in stmt.names:
                sub = f"{stmt.module}.{a.name}"
                out[a.asname or a.name] = _Binding(sub) if self.is_module(sub) else _Binding(stmt.module, a.name)
        return out

    def _imported(self, stmt: ast.stmt) -> list[str]:
        """The package modules an import statement runs (their parents too: see `loads`)."""
        if isinstance(stmt, ast.Import):
            return [a.name for a in stmt.names if self.is_module(a.name)]
        if isinstance(stmt, ast.ImportFrom) and stmt.level == 0 and stmt.module and self.is_module(stmt.module):
            return [stmt.module, *(m for a in stmt.names if self.is_module(m := f"{stmt.module}.{a.name}"))]
        return []

    def parse(self, name: str) -> _Module:
        if name in self._modules:
            return self._modules[name]
        path = self.module_file(name)
        if path is None:
            raise ValueError(f"{name}: no such module below {self.root}")
        tree = semantic_tree(path.read_text(), str(path))
        defs: dict[str, list[ast.stmt]] = {MODULE_NODE: []}
        names: dict[str, str] = {}
        imports: dict[str, _Binding] = {}
        lines = []  # docstrings dropped, the definitions keep their lines as written
        for stmt in tree.body:
            if isinstance(stmt, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                defs[stmt.name] = [stmt]
                names[stmt.name] = stmt.name
                first = min([stmt.lineno, *(d.lineno for d in stmt.decorator_list)])
                lines.append((first, stmt.end_lineno or stmt.lineno, stmt.name))
            elif isinstance(stmt, ast.Assign | ast.AnnAssign) and all(
                    isinstance(t, ast.Name) for t in (stmt.targets if isinstance(stmt, ast.Assign) else [stmt.target])):
                assigned = _assigned_names(stmt)
                defs.setdefault(assigned[0], []).append(stmt)
                names.update(dict.fromkeys(assigned, assigned[0]))
                lines.append((stmt.lineno, stmt.end_lineno or stmt.lineno, assigned[0]))
            else:  # runs on import: an import, an `if`, a `try`, an expression, a subscript assignment
                defs[MODULE_NODE].append(stmt)
                imports.update(self._bindings(stmt))
        self._modules[name] = _Module(name, path, defs, names, imports, lines)
        return self._modules[name]

    def owner(self, module: str, line: int) -> str:
        """The definition of `module` whose source holds `line` (a code object's first line)."""
        return next((name for first, last, name in self.parse(module).lines if first <= line <= last), MODULE_NODE)

    def module_of(self, path: str | Path) -> str | None:
        """The module of a file below the root, or None."""
        path = Path(path).resolve()
        if not any(path.is_relative_to(d) for d in self.package_dirs) or path.suffix != ".py":
            return None
        parts = path.relative_to(self.root).with_suffix("").parts
        return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)

    def data_file(self, module: str, name: str) -> Path:
        """A MODULE_DATA file of `module`: relative to its package's folder."""
        return self.root / module.split(".")[0] / name

    def path_of(self, module: str) -> str:
        """`module`'s file, relative to the root."""
        return str(self.parse(module).path.relative_to(self.root))

    # -- reachability -----------------------------------------------------------------------------

    def loads(self, module: str) -> list[Key]:
        """What importing `module` runs: its own and its parent packages' import-time statements."""
        parts = module.split(".")
        return [(m, MODULE_NODE) for i in range(1, len(parts) + 1) if self.is_module(m := ".".join(parts[:i]))]

    def whole(self, module: str) -> list[Key]:
        return [(module, d) for d in self.parse(module).defs]

    def symbol(self, module: str, name: str, seen: frozenset[str] = frozenset()) -> list[Key]:
        """What `module.name` is: its definition there, followed through re-exports; a submodule as a
        whole; an unknown name the whole module (it may be made at run time)."""
        if self.is_module(f"{module}.{name}"):
            return self.whole(f"{module}.{name}")
        info = self.parse(module)
        if name in info.names:
            return [(module, info.names[name])]
        if name in info.imports and module not in seen:
            b = info.imports[name]
            return self.symbol(b.module, b.attr, seen | {module}) if b.attr else self.whole(b.module)
        return self.whole(module)

    def _resolve(self, chain: list[str], module: str, local: dict[str, _Binding]) -> list[Key]:
        info = self.parse(module)
        head, rest = chain[0], chain[1:]
        binding = local.get(head) or info.imports.get(head)
        if binding is None:
            return [(module, info.names[head])] if head in info.names else []
        if binding.attr is not None:
            return self.symbol(binding.module, binding.attr)
        mod = binding.module
        while rest and self.is_module(f"{mod}.{rest[0]}"):
            mod, rest = f"{mod}.{rest[0]}", rest[1:]
        if not rest:  # the module itself as a value (passed on, or read with getattr): all of it
            return self.whole(mod)
        return self.symbol(mod, rest[0])

    def edges(self, key: Key) -> tuple[Key, ...]:
        """What a definition names (resolved through the imports of its module and of its own body)."""
        if key not in self._edge_cache:
            module, name = key
            stmts = self.parse(module).defs.get(name, [])
            local: dict[str, _Binding] = {}
            out: list[Key] = []
            for stmt in stmts:
                for node in ast.walk(stmt):
                    if isinstance(node, ast.Import | ast.ImportFrom):
                        local.update(self._bindings(node))
                        for m in self._imported(node):
                            out += self.loads(m)
            for chain in _chains(stmts):
                out += self._resolve(chain, module, local)
            self._edge_cache[key] = tuple(out)
        return self._edge_cache[key]

    def reachable(self, roots: Iterable[Key], excluded: Iterable[Key] = ()) -> set[Key]:
        """Every definition `roots` reach (the modules they live in loaded too); `excluded` are not entered."""
        excluded = set(excluded)
        seen: set[Key] = set()
        todo = [k for r in roots for k in (*self.loads(r[0]), r)]
        while todo:
            key = todo.pop()
            if key in seen or key in excluded or key[1] not in self.parse(key[0]).defs:
                continue
            seen.add(key)
            todo += self.loads(key[0])
            todo += self.edges(key)
        return seen

    def script_files(self, path: Path) -> list[str]:
        """The files of the package a script outside it runs: what its imports of the package reach."""
        roots: list[Key] = []
        for node in ast.walk(ast.parse(Path(path).read_text(), filename=str(path))):
            if isinstance(node, ast.Import | ast.ImportFrom):
                for b in self._bindings(node).values():
                    roots += self.symbol(b.module, b.attr) if b.attr else self.whole(b.module)
        keys = self.reachable(roots)
        return sorted({self.path_of(m) for m, _ in keys} | {self._rel(self.data_file(m, f)) for m, _ in keys
                                                             for f in MODULE_DATA.get(m, ())})

    # -- digests ----------------------------------------------------------------------------------

    def definition_digests(self, key: Key) -> dict[str, str]:
        """A definition's digest; a class's as its header and attributes plus one per method, so a
        change is named down to the method."""
        if key not in self._digests:
            module, name = key
            stmts = self.parse(module).defs[name]
            if len(stmts) == 1 and isinstance(stmts[0], ast.ClassDef):
                cls = stmts[0]
                methods = [s for s in cls.body if isinstance(s, ast.FunctionDef | ast.AsyncFunctionDef)]
                shell = ast.ClassDef(name=cls.name, bases=cls.bases, keywords=cls.keywords,
                                     body=[s for s in cls.body if s not in methods], decorator_list=cls.decorator_list)
                out = {name: _digest(semantic_dump(shell))}
                out.update({f"{name}.{m.name}": _digest(semantic_dump(m)) for m in methods})
            else:
                out = {name: _digest("\n".join(semantic_dump(s) for s in stmts))}
            self._digests[key] = out
        return self._digests[key]

    def _rel(self, path: Path) -> str:
        path = Path(path).resolve()
        return str(path.relative_to(self.root)) if path.is_relative_to(self.root) else str(path)

    def manifest(self, keys: Iterable[Key]) -> dict[str, dict[str, str]]:
        """{file: {definition: digest}} of the definitions `keys` (and the package data of their modules)."""
        keys = sorted(set(keys))
        out: dict[str, dict[str, str]] = {}
        for key in keys:
            out.setdefault(self.path_of(key[0]), {}).update(self.definition_digests(key))
        for module in sorted({m for m, _ in keys}):
            for f in MODULE_DATA.get(module, ()):
                out[self._rel(self.data_file(module, f))] = {"<data>": _data_digest(self.data_file(module, f))}
        return out

    def source_digest(self) -> str:
        """A digest of every file a walk below the root may read: the packages' sources and their data."""
        files = sorted(p for d in self.package_dirs for p in d.rglob("*.py"))
        files += [self.data_file(m, f) for m in sorted(MODULE_DATA) for f in MODULE_DATA[m]]
        h = hashlib.sha256()  # not the root: a manifest names files relative to it, so a copy elsewhere has the same
        for f in files:
            with contextlib.suppress(OSError):
                h.update(f"\0{f.relative_to(self.root)}\0".encode() + hashlib.sha256(f.read_bytes()).digest())
        return h.hexdigest()

    def kept(self, what: object, extra_files: Iterable[Path], compute: Callable[[], Fingerprint]) -> Fingerprint:
        """`compute()`, read back from disk when it was kept for the same `what` (JSON: the kind of walk and
        its arguments), the same sources (`source_digest`, this module's own among them), the same
        `extra_files`' bytes and the same Python (whose `ast.dump` the digests are of); else computed and
        kept. A folder that cannot be written keeps nothing."""
        key = [what, self.source_digest(), list(sys.version_info[:2])]
        h = hashlib.sha256(json.dumps(key, sort_keys=True, default=str).encode())
        for f in extra_files:
            h.update(f"\0{Path(f).resolve()}\0".encode())
            with contextlib.suppress(OSError):
                h.update(hashlib.sha256(Path(f).read_bytes()).digest())
        folder = Path(os.environ.get(CACHE_DIR_ENV) or Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
                      / "rloo" / "code-fingerprints")
        path = folder / f"{h.hexdigest()[:32]}.json"
        with contextlib.suppress(OSError, ValueError, KeyError, TypeError):
            got = json.loads(path.read_text())
            return Fingerprint(got["stage"], got["digest"], got["manifest"])
        fp = compute()
        with contextlib.suppress(OSError):
            folder.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_text(json.dumps({"stage": fp.stage, "digest": fp.digest, "manifest": fp.manifest}))
            os.replace(tmp, path)
            kept = sorted(folder.glob("*.json"), key=lambda p: p.stat().st_mtime)
            for old in kept[:-KEPT_MAX] if len(kept) > KEPT_MAX else []:
                old.unlink(missing_ok=True)
        return fp

    def fingerprint_of(self, stage: str, keys: Iterable[Key], extra_files: Iterable[Path] = (),
                       extra_roots: Iterable[Key] = ()) -> Fingerprint:
        """The fingerprint named `stage` of the definitions `keys` (and those `extra_roots` reach: functions of
        the package the config names), and `extra_files` (a user's own code the config names), whole."""
        keys = set(keys)
        if extra_roots:
            keys |= self.reachable([k for module, name in extra_roots for k in self.symbol(module, name)])
        m = self.manifest(keys)
        for f in extra_files:
            path = Path(f)
            if path.suffix == ".py":
                tree = semantic_tree(path.read_text(), str(path))
                m[self._rel(path)] = {getattr(s, "name", f"<statement {i}>"): _digest(semantic_dump(s))
                                      for i, s in enumerate(tree.body)}
            else:
                m[self._rel(path)] = {"<data>": _data_digest(path)}
        return Fingerprint(stage, _digest(json.dumps(m, sort_keys=True)), m)


# What each training run runs of the library, whoever starts it (its stage module, rloo.api): the run
# itself, and for RLOO what builds its reward from the config or from the caller's functions.
TRAINING_CODE: dict[str, tuple[Key, ...]] = {
    "sft": (("rloo.train.sft", "run"),),
    "reward": (("rloo.train.reward", "run"),),
    "rloo": (("rloo.train.rloo", "run"), ("rloo.reward.rewards", "build_reward"), ("rloo.api", "reward_source")),
}


@cache
def installed() -> Codebase:
    """The packages this process runs (rloo/ and rloo_workflow/, the folder above this file's)."""
    return Codebase(ROOT)


def training_fingerprint(stage: str, user_files: Iterable[str | Path] = (),
                         package_functions: Iterable[Key] = (), callers: Iterable[Key] = ()) -> Fingerprint:
    """The code of `stage`'s training run (`TRAINING_CODE`; sft, reward or rloo) and the user's files it runs
    (`user_files`: reward functions' files) with the package's functions the config names; `callers`: the
    code that starts the run and reads its inputs (a workflow stage's `run`, read as source like the rest)."""
    code, files, functions, callers = installed(), [Path(f) for f in user_files], tuple(package_functions), tuple(callers)
    return code.kept(["training", stage, functions, callers], files, lambda: code.fingerprint_of(
        stage, code.reachable([*TRAINING_CODE[stage], *callers]), files, functions))


def file_digests(fp: Fingerprint) -> dict[str, str]:
    """{file: digest} of a fingerprint's manifest: one digest per file it counts, a user's file among them."""
    return {f: _digest(json.dumps(defs, sort_keys=True)) for f, defs in sorted(fp.manifest.items())}


def changes(old: dict[str, dict[str, str]], new: dict[str, dict[str, str]]) -> list[str]:
    """What differs between two manifests, one line per file: `file: changed a, b; added c; removed d`."""
    lines = []
    for f in sorted(set(old) | set(new)):
        a, b = old.get(f, {}), new.get(f, {})
        if f not in old:
            lines.append(f"{f}: now run ({', '.join(sorted(b))})")
            continue
        if f not in new:
            lines.append(f"{f}: no longer run")
            continue
        parts = []
        for label, names in (("changed", [n for n in b if n in a and a[n] != b[n]]),
                             ("now run", [n for n in b if n not in a]), ("no longer run", [n for n in a if n not in b])):
            if names:
                parts.append(f"{label} {', '.join(sorted(names))}")
        if parts:
            lines.append(f"{f}: {'; '.join(parts)}")
    return lines
