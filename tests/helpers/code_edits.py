"""Edits of the package's source as a person makes them, for the tests of the code fingerprint
(rloo_workflow/code_fingerprint.py): one that changes what a function computes, and ones that change nothing."""

from __future__ import annotations

import ast
import re
from pathlib import Path


def semantic_edit(path: Path, function: str) -> None:
    """Add a statement at the end of `function` (a top-level function, or `Class.method`): a change of
    what it computes, as small as one gets."""
    source = path.read_text()
    name, _, method = function.partition(".")
    node = next(n for n in ast.parse(source).body
                if isinstance(n, ast.FunctionDef | ast.ClassDef) and n.name == name)
    if method:
        node = next(n for n in node.body if isinstance(n, ast.FunctionDef) and n.name == method)
    lines = source.splitlines(keepends=True)
    indent = re.match(r"\s*", lines[node.body[-1].lineno - 1]).group(0)
    lines.insert(node.end_lineno, f"{indent}_edited_by_the_test = None\n")
    path.write_text("".join(lines))


def append_comment(path: Path) -> None:
    path.write_text(path.read_text() + "# a comment added by the test\n")


def edit_module_docstring(path: Path) -> None:
    text = path.read_text()
    assert text.startswith('"""'), path
    path.write_text(text.replace('"""', '"""Edited by the test. ', 1))


def edit_setting_docs(settings: Path, count: int = 3) -> None:
    """A word added to the docs of the first `count` fields of a settings module (rloo/settings/*.py): the
    config schema's descriptions."""
    lines = settings.read_text().splitlines(keepends=True)
    edited = 0
    for i in range(1, len(lines)):
        if edited < count and re.match(r"    \w+: .+ = ", lines[i - 1]) and lines[i].startswith('    """'):
            lines[i] = lines[i].replace('"""', '"""Edited. ', 1)
            edited += 1
    assert edited == count, settings
    settings.write_text("".join(lines))
