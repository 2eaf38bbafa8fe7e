"""Atomic writes (no stage ever leaves a half-written output; a failed write is one WriteError naming the
output and the free space; a killed writer's temporary sibling is removed by the next writer of the same
output), line-numbered JSONL reading, file digests."""

from __future__ import annotations

import codecs
import contextlib
import errno
import glob
import hashlib
import json
import os
import re
import shutil
import socket
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from rloo.errors import InputError, UserError

_HOST = re.sub(r"[^A-Za-z0-9_-]", "_", socket.gethostname().split(".")[0]) or "host"


def _writer_tag() -> str:
    """Who writes a temporary sibling: `<host>-<pid>`, so that a later writer can tell one whose process
    died (kill -9, a node failure: no `finally` ran) from one still being written."""
    return f"{_HOST}-{os.getpid()}"


def exists(send: Callable[[int, int], None], target: int) -> bool:
    """Whether a process (`os.kill`, a pid) or a process group (`os.killpg`, a pgid) still exists: signal 0
    reaches it, or it is another user's."""
    try:
        send(target, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_stale_siblings(path: Path) -> list[Path]:
    """Remove the temporary siblings of `path` (`.<name>.<host>-<pid>.<random>.tmp`) that a process of
    this host left when it died while writing; return them. Those of a live process, or of another
    host, are left alone."""
    stale = []
    pattern = re.compile(rf"\.{re.escape(path.name)}\.(?P<host>[A-Za-z0-9_-]+)-(?P<pid>\d+)\.[^/]*\.tmp")
    for sibling in path.parent.glob(f".{glob.escape(path.name)}.*.tmp"):
        m = pattern.fullmatch(sibling.name)
        if m and m["host"] == _HOST and not exists(os.kill, int(m["pid"])):
            shutil.rmtree(sibling, ignore_errors=True) if sibling.is_dir() else sibling.unlink(missing_ok=True)
            stale.append(sibling)
    return stale


def _tmp_sibling(path: Path, is_dir: bool = False) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_siblings(path)  # a killed earlier writer's: never left behind for good
    # A sibling in the same directory, so the final rename stays on one filesystem and is atomic.
    prefix = f".{path.name}.{_writer_tag()}."
    if is_dir:
        tmp = tempfile.mkdtemp(prefix=prefix, suffix=".tmp", dir=path.parent)
        os.chmod(tmp, 0o755)
        return Path(tmp)
    fd, name = tempfile.mkstemp(prefix=prefix, suffix=".tmp", dir=path.parent)
    os.close(fd)
    # mkstemp creates 0600 files; outputs should have the usual permissions once renamed.
    os.chmod(name, 0o644)
    return Path(name)


class WriteError(UserError):
    """Writing an output failed (a full disk, a quota, a file-size limit, an I/O error): the message names
    the output, the reason and the free space left there; the partial output was removed."""


# How a failed stream looks where the writer does not raise an OSError: torch.save's zip writer
# ("[enforce fail at inline_container.cc:672] . unexpected pos 252224 vs 252112", "PytorchStreamWriter
# failed writing file ..."), safetensors ("Error while serializing: I/O error: File too large (os error
# 27)", "IoError(Os { code: 28, kind: StorageFull, ... })").
_STREAM_FAILURES = ("unexpected pos", "PytorchStreamWriter failed", "I/O error", "IoError", "No space left")
_FULL = (errno.ENOSPC, errno.EDQUOT)
# OSErrors of a write (a missing file inside a write block is another error, and says so itself)
_WRITE_ERRNOS = (*_FULL, errno.EFBIG, errno.EIO, errno.EROFS, errno.EACCES, errno.EPERM)


def is_write_failure(e: BaseException) -> bool:
    """Whether `e` is a failed write: an OSError of a write (_WRITE_ERRNOS), or a writer's error that
    wraps one (_STREAM_FAILURES)."""
    if isinstance(e, UserError):
        return False
    if isinstance(e, OSError):
        return e.errno in _WRITE_ERRNOS
    return (isinstance(e, RuntimeError) or type(e).__name__ == "SafetensorError") and any(
        s in str(e) for s in _STREAM_FAILURES)


def free_space(path: str | os.PathLike) -> str:
    """The free space on the file system of `path` (its nearest existing parent), for a person."""
    path = Path(path)
    for p in (path, *path.resolve().parents):
        if p.exists():
            return f"{shutil.disk_usage(p).free / 2**20:.0f} MiB"
    return "unknown"


def write_failure(e: BaseException, path: str | os.PathLike, kept: str = "") -> WriteError:
    """The one-line WriteError for `e`, raised while writing `path`."""
    full = (isinstance(e, OSError) and e.errno in _FULL) or "No space left" in str(e) or "StorageFull" in str(e)
    if full:
        reason = "no space left on the device"
    elif isinstance(e, OSError):
        reason = e.strerror or str(e)
    else:  # torch's zip writer does not say why; a full disk is the usual cause
        reason = f"the writer failed ({str(e).strip().splitlines()[0][:120]})"
    return WriteError(f"could not write {path}: {reason} ({free_space(path)} free there); the partial output was "
                      f"removed{kept}: free some space (or fix the file system) and rerun")


def failed_write_line(e: BaseException, output: Callable[[], str | os.PathLike]) -> str | None:
    """One line for a failed write that escaped the atomic blocks (those raise WriteError): a full disk
    or a stream failure, named after the file when it says, else the stage's `output()`; another
    OSError on a named file (permissions, a read-only file system, ...) as `file: reason`. None: not a
    write (a bug, whose traceback stays)."""
    if isinstance(e, OSError) and e.filename and e.errno not in _FULL:
        return f"{e.filename}: {e.strerror or e}"
    if is_write_failure(e):
        return str(write_failure(e, getattr(e, "filename", None) or output()))
    return None


def _failed(e: BaseException, final: Path, kept: str) -> BaseException:
    """`e` as the WriteError of `final`, where it is a failed write; an inner atomic write's WriteError
    (a file inside the temporary folder) is named after `final` too."""
    cause = e.__cause__ if isinstance(e, WriteError) else e
    return write_failure(cause, final, kept) if cause is not None and is_write_failure(cause) else e


@contextlib.contextmanager
def _as_write_error(final: Path, kept: str) -> Iterator[None]:
    """A failed write within the block (`is_write_failure`) raised as a WriteError naming `final`."""
    try:
        yield
    except Exception as e:
        if (err := _failed(e, final, kept)) is not e:
            raise err from (e.__cause__ if isinstance(e, WriteError) else e)
        raise


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike, kept: str = "") -> Iterator[Path]:
    """Yield a temporary file path that replaces `path` only if the block finishes without error. A
    failed write (`is_write_failure`) becomes a WriteError naming `path` (`kept`: what stays, for it)."""
    final = Path(path)
    tmp = _tmp_sibling(final)
    try:
        with _as_write_error(final, kept):
            yield tmp
            os.replace(tmp, final)
    finally:
        tmp.unlink(missing_ok=True)


@contextlib.contextmanager
def atomic_dir(path: str | os.PathLike, kept: str = "") -> Iterator[Path]:
    """Yield a temporary directory that replaces directory `path` only if the block succeeds; a failed
    write becomes a WriteError as in `atomic_path`."""
    final = Path(path)
    tmp = _tmp_sibling(final, is_dir=True)
    try:
        with _as_write_error(final, kept):
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


def config_hash(cfg: dict[str, Any], sections: list[str] | None = None) -> str:
    """A short stable hash of a (resolved) config, or of some of its sections."""
    part = cfg if sections is None else {k: cfg.get(k) for k in sections}
    blob = json.dumps(part, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def write_together(writes: list[tuple[str | os.PathLike, Callable[[Path], None]]]) -> None:
    """Files that belong together (an evaluation's records and its figures), all or none: each
    `write(tmp)` fills a temporary sibling of its path, and they replace their files only once every one
    is written. A failed write (a WriteError naming its file) leaves the files as they were; a failed
    replacement (the path a folder) removes those of them already replaced and the rest, so that no one
    stays without the others."""
    staged: list[tuple[Path, Path]] = []
    try:
        for path, write in writes:
            final = Path(path)
            staged.append((_tmp_sibling(final), final))
            with _as_write_error(final, ""):
                write(staged[-1][0])
        try:
            for tmp, final in staged:
                os.replace(tmp, final)
        except BaseException:
            for _, final in staged:
                if not final.is_dir():
                    final.unlink(missing_ok=True)
            raise
    finally:
        for tmp, _ in staged:
            tmp.unlink(missing_ok=True)


def dump_json(path: Path, obj: Any) -> None:
    path.write_text(json.dumps(obj, indent=2, sort_keys=False) + "\n")


def dump_jsonl(path: Path, rows: list[dict]) -> None:
    with path.open("w") as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")


def write_json_atomic(path: str | os.PathLike, obj: Any) -> None:
    with atomic_path(path) as tmp:
        dump_json(tmp, obj)


def write_jsonl_atomic(path: str | os.PathLike, rows: list[dict]) -> None:
    with atomic_path(path) as tmp:
        dump_jsonl(tmp, rows)


def text_lines(path: str | os.PathLike) -> Iterator[tuple[int, bytes]]:
    """(line number, bytes) of each line of a text file, a leading UTF-8 byte order mark left out: files
    saved by Windows editors, or by pandas with encoding="utf-8-sig", start with one, and are valid UTF-8
    all the same. A CRLF line end is one line break, as LF is (its CR is whitespace to JSON)."""
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, start=1):
            yield lineno, raw.removeprefix(codecs.BOM_UTF8) if lineno == 1 else raw


def jsonl_records(path: str | os.PathLike) -> Iterator[tuple[int, dict | None, str | None]]:
    """(line number, record, None) for each non-blank line holding a JSON object, or (line number,
    None, why) for one that does not (not UTF-8, malformed JSON, not an object): the reason names file
    and line, and a reader that skips bad records can skip it. A leading BOM is not part of line 1
    (`text_lines`)."""
    for lineno, raw in text_lines(path):
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
