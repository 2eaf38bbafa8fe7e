"""Plug-ins: a user's Python function named in the config as `module:function` (importable:
`rloo.reward.verifier:reward`) or `path/to/file.py:function` (a relative path is read from the working
directory the pipeline runs in). The reward functions (rloo/reward/functions.py) and the tools
(rloo/tools/__init__.py) share this machinery: loading (`load`, a file run once per version), what a
signature accepts (`Parameters`), where in the user's code an exception was raised (`user_frame`,
`raised`) and which files of the user's code a config runs (`user_files`), which the code fingerprints of
the stages running them count. Nothing here imports torch: the checks run when Snakemake reads the
workflow."""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import inspect
import os
import sys
import traceback
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rloo.errors import UserError


class PluginError(UserError, RuntimeError):
    """A plug-in that cannot be used: it does not import, its signature does not fit, or a call of it
    failed (a reward function's or a tool's, each its own subclass)."""


def _one_line(e: BaseException) -> str:
    return f"{type(e).__name__}: {' '.join(str(e).split())}"[:300]


def _not_user_roots() -> set[Path]:
    """Where code that is not the user's lies: this package, the Python installation and its environment."""
    return {Path(__file__).resolve().parent, Path(sys.prefix).resolve(), Path(sys.base_prefix).resolve()}


def _is_user_file(path: Path, not_user: set[Path]) -> bool:
    return not (not_user & set(path.resolve().parents))


def user_frame(e: BaseException, own_file: str | None = None) -> str | None:
    """`file:line` of the innermost frame of `e`'s traceback in the user's code (outside this package and
    Python's installation; a SyntaxError's own file and line), else the innermost one in `own_file` (a
    function of this package the config names), else None. The path is relative where it lies under the
    working directory, as a config names it."""
    if isinstance(e, SyntaxError) and e.filename and e.lineno:
        return f"{_shown(e.filename)}:{e.lineno}"
    frames = [f for f in traceback.extract_tb(e.__traceback__) if f.filename and not f.filename.startswith("<")]
    not_user = _not_user_roots()
    for wanted in (lambda f: _is_user_file(Path(f.filename), not_user),
                   lambda f: own_file is not None and Path(f.filename).resolve() == Path(own_file).resolve()):
        if found := [f for f in frames if wanted(f)]:
            return f"{_shown(found[-1].filename)}:{found[-1].lineno}"
    return None


def _shown(filename: str) -> str:
    path = Path(filename).resolve()
    return os.path.relpath(path) if Path.cwd().resolve() in path.parents else str(path)


def raised(e: BaseException, own_file: str | None = None) -> str:
    """'ZeroDivisionError: division by zero at my_reward.py:12': the exception and where in the user's
    code it was raised."""
    where = user_frame(e, own_file)
    return _one_line(e) + (f" at {where}" if where else "")


def is_path(target: str) -> bool:
    """Whether the part of `fn` before the colon names a file rather than a module."""
    return target.endswith(".py") or "/" in target or os.sep in target


def resolve(target: str) -> Path:
    """A reward file's path: as given when absolute, else relative to the working directory."""
    path = Path(target).expanduser()
    return path if path.is_absolute() else Path.cwd() / path


_loaded: dict[tuple[str, int, int], Any] = {}  # (file, mtime_ns, size) -> module: a file is run once


def _load_file(path: Path) -> Any:
    stat = path.stat()
    key = (str(path.resolve()), stat.st_mtime_ns, stat.st_size)
    if key not in _loaded:
        name = "rloo_user_plugin_" + hashlib.sha256(key[0].encode()).hexdigest()[:12]
        spec = importlib.util.spec_from_file_location(name, path)
        if spec is None or spec.loader is None:
            raise ImportError(f"{path} is not a Python file")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module  # as an import would: dataclasses and pickling look the module up
        try:
            spec.loader.exec_module(module)
        except BaseException:
            sys.modules.pop(name, None)
            raise
        _loaded[key] = module
    return _loaded[key]


def load(fn: str, key: str, error: type[PluginError] = PluginError) -> tuple[Callable, str]:
    """(the function `fn` names, the file it is in); an `error` naming `key` and the file when it does
    not import."""
    target, sep, name = fn.rpartition(":")
    if not sep or not target or not name.isidentifier():
        raise error(f"key '{key}': '{fn}' is not 'module:function' or 'path/to/file.py:function'")
    if is_path(target):
        path = resolve(target)
        where = str(path)
        if not path.is_file():
            raise error(f"key '{key}': {path}: no such file (a relative path is read from the "
                                      f"working directory, {Path.cwd()})")
        try:
            module = _load_file(path)
        except Exception as e:
            raise error(f"key '{key}': {path}: importing it raised {raised(e)}") from e
    else:
        try:
            module = importlib.import_module(target)
        except Exception as e:
            raise error(f"key '{key}': module '{target}' does not import ({raised(e)})") from e
        where = getattr(module, "__file__", None) or f"module {target}"
    func = getattr(module, name, None)
    if func is None:
        raise error(f"key '{key}': {where}: no function '{name}'")
    if not callable(func):
        raise error(f"key '{key}': {where}: '{name}' is a {type(func).__name__}, not a function")
    return func, where




@dataclass(frozen=True)
class Parameters:
    """What a function's signature accepts: every keyword (`**kwargs`), or only the names it declares."""

    any_keyword: bool
    named: frozenset[str]
    required: tuple[str, ...]
    positional_only: tuple[str, ...]  # required ones that no keyword can fill
    first_positional: str | None = None  # the first parameter, where a positional argument can fill it

    @classmethod
    def of(cls, func: Callable) -> Parameters | None:
        """None where Python cannot tell (some builtins): the function is called with every argument."""
        try:
            sig = inspect.signature(func)
        except (TypeError, ValueError):
            return None
        P = inspect.Parameter
        params = list(sig.parameters.values())
        required = [p for p in params if p.default is P.empty and p.kind not in (P.VAR_KEYWORD, P.VAR_POSITIONAL)]
        return cls(
            any_keyword=any(p.kind is P.VAR_KEYWORD for p in params),
            named=frozenset(p.name for p in params if p.kind in (P.POSITIONAL_OR_KEYWORD, P.KEYWORD_ONLY)),
            required=tuple(p.name for p in required),
            positional_only=tuple(p.name for p in required if p.kind is P.POSITIONAL_ONLY),
            first_positional=params[0].name if params and params[0].kind in (
                P.POSITIONAL_ONLY, P.POSITIONAL_OR_KEYWORD, P.VAR_POSITIONAL) else None,
        )

    def unknown(self, offered: set[str] | None, given: tuple[str, ...] = ()) -> str | None:
        """Why a call offering the keywords `offered` (None: not known yet) besides the `given`
        arguments cannot fill the required parameters, or None."""
        unknown = [n for n in self.required if offered is not None and n not in offered and n not in given]
        if unknown:
            return (f"it needs {', '.join(repr(n) for n in unknown)}, which no call offers (offered: "
                    f"{', '.join(sorted(offered or ()))}); give it a default or take **kwargs")
        return None

    def accepted(self, arguments: dict[str, Any]) -> dict[str, Any]:
        """What of the keyword `arguments` this signature takes: all of them (`**kwargs`), else those it names."""
        return arguments if self.any_keyword else {k: v for k, v in arguments.items() if k in self.named}


def user_files(fns: Iterable[str]) -> list[Path]:
    """The files of the user's own code that the plug-ins `fns` (each `module:function` or
    `path/to/file.py:function`) run: each file named, and each module lying outside this package and
    outside the Python installation and its environment (the standard library, installed packages): a
    module of the working directory, say. The code fingerprints of the stages that run them count them
    (rloo_workflow/code_fingerprint.py), so that editing one reruns those stages."""
    out: list[Path] = []
    not_user = _not_user_roots()
    for fn in fns:
        target = fn.rpartition(":")[0]
        if is_path(target):
            path = resolve(target)
        else:
            try:
                spec = importlib.util.find_spec(target)
            except (ImportError, ValueError):
                continue  # does not import: the config checks say so
            if spec is None or not spec.origin or not spec.has_location:
                continue
            path = Path(spec.origin)
            if not _is_user_file(path, not_user):
                continue
        if path not in out:
            out.append(path)
    return out


def users_own(paths: Iterable[Path]) -> list[Path]:
    """Those of `paths` that are files of the user's own code (not this package's, not the installation's),
    each once, in order."""
    not_user = _not_user_roots()
    return list(dict.fromkeys(p for p in paths if p.is_file() and _is_user_file(p, not_user)))


def package_functions(fns: Iterable[str]) -> list[tuple[str, str]]:
    """(module, function) of each of the plug-ins `fns` that this package holds
    (`rloo.reward.verifier:reward`): code a stage runs by name, which its code fingerprint counts."""
    out = []
    for fn in fns:
        target, _, name = fn.rpartition(":")
        if not is_path(target) and (target == "rloo" or target.startswith("rloo.")):
            out.append((target, name))
    return out


def defined_at(func: Callable, where: str) -> str:
    """`where` (the file `load` found `func` in) with the line `func` is defined on, `my_tools.py:3`,
    where Python knows it (a builtin or a callable object: the file alone)."""
    code = getattr(inspect.unwrap(func), "__code__", None)
    return f"{code.co_filename}:{code.co_firstlineno}" if code is not None else where


def code_file(func: Callable) -> str | None:
    """The file a function's code lies in (`raised`'s `own_file`: its own lines, where it is this package's)."""
    code = getattr(func, "__code__", None)
    return code.co_filename if code is not None else None
