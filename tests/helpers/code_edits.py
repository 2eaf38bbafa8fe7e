"""Edits of the package's source as a person makes them, for the tests of the code fingerprint
(rloo/code_fingerprint.py): one that changes what a function computes, and ones that change nothing."""

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


def edit_descriptions(schema: Path, count: int = 3) -> None:
    """A word added to the first `count` descriptions of the config schema."""
    text = schema.read_text()
    assert text.count("description: ") >= count
    schema.write_text(text.replace("description: ", "description: Edited. ", count))
