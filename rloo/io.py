"""Atomic writes (no stage ever leaves a half-written output), line-numbered JSONL reading, file digests."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from rloo.errors import InputError


def _tmp_sibling(path: Path, is_dir: bool = False) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    # A sibling in the same directory, so the final rename stays on one filesystem and is atomic.
    if is_dir:
        tmp = tempfile.mkdtemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
        os.chmod(tmp, 0o755)
        return Path(tmp)
    fd, name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    # mkstemp creates 0600 files; outputs should have the usual permissions once renamed.
    os.chmod(name, 0o644)
    return Path(name)


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike) -> Iterator[Path]:
    """Yield a temporary file path that replaces `path` only if the block finishes without error."""
    final = Path(path)
    tmp = _tmp_sibling(final)
    try:
        yield tmp
        os.replace(tmp, final)
    finally:
        tmp.unlink(missing_ok=True)


@contextlib.contextmanager
def atomic_dir(path: str | os.PathLike) -> Iterator[Path]:
    """Yield a temporary directory that replaces directory `path` only if the block succeeds."""
    final = Path(path)
    tmp = _tmp_sibling(final, is_dir=True)
    try:
        yield tmp
        if final.exists():
            old = final.with_name(f".{final.name}.old")
            shutil.rmtree(old, ignore_errors=True)
            os.replace(final, old)
            os.replace(tmp, final)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, final)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def write_json_atomic(path: str | os.PathLike, obj: Any) -> None:
    with atomic_path(path) as tmp:
        tmp.write_text(json.dumps(obj, indent=2, sort_keys=False) + "\n")


def write_jsonl_atomic(path: str | os.PathLike, rows: list[dict]) -> None:
    with atomic_path(path) as tmp, tmp.open("w") as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")


def jsonl_records(path: str | os.PathLike) -> Iterator[tuple[int, dict | None, str | None]]:
    """(line number, record, None) for each non-blank line holding a JSON object, or (line number,
    None, why) for one that does not (not UTF-8, malformed JSON, not an object): the reason names file
    and line, and a reader that skips bad records can skip it."""
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, start=1):
            where = f"{path}:{lineno}"
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                yield lineno, None, f"{where}: not UTF-8 text (byte 0x{raw[e.start]:02x} at column {e.start + 1})"
                continue
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as e:
                yield lineno, None, f"{where}: malformed JSON ({e.msg} at column {e.colno})"
                continue
            if not isinstance(rec, dict):
                yield lineno, None, f"{where}: expected a JSON object, got {type(rec).__name__}"
                continue
            yield lineno, rec, None


def read_jsonl(path: str | os.PathLike) -> Iterator[tuple[int, dict]]:
    """Yield (line number, record); a bad line raises InputError naming file and line."""
    for lineno, rec, bad in jsonl_records(path):
        if bad:
            raise InputError(bad)
        yield lineno, rec


def file_digest(path: str | os.PathLike, algorithm: str = "sha256") -> str:
    """Hex digest of a file's bytes, read 1 MiB at a time (md5 only where DVC's checksums need it)."""
    h = hashlib.new(algorithm, usedforsecurity=False)
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def sha256_file(path: str | os.PathLike) -> str:
    return file_digest(path, "sha256")
