"""Running `dvc`: one subprocess per call, waiting for DVC's repository lock, its JSON read as JSON,
its own message in the error when it fails; one `rloo dvc` at a time in a project (`exclusive`); and
the workspace links DVC leaves behind, made what Snakemake can work with."""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from rloo_workflow.dvc.dvcyaml import MARKER, DvcError, log, venv_executable

LOCK_FILE = ".rloo/rloo-dvc.lock"


@contextlib.contextmanager
def exclusive(root: Path) -> Iterator[None]:
    """Hold the project's `rloo dvc` lock (an flock on .rloo/rloo-dvc.lock, released however the process
    ends). DVC's own lock (--wait-for-lock) covers one dvc command, not a sequence: two Snakemake runs
    that end together (two targets at once) each regenerate dvc.yaml for their own stages, and one
    run's `dvc checkout --relink` then named outputs the other's dvc.yaml no longer had (DVC exited
    255). Every `rloo dvc` command, the commit after a run included, runs whole under this lock."""
    path = Path(root) / LOCK_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as held:
        try:
            fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log(f"waiting for another `rloo dvc` in this project ({LOCK_FILE}: the DVC step of another run)")
            fcntl.flock(held, fcntl.LOCK_EX)
        yield


def is_dvc_repo(root: Path) -> bool:
    return (Path(root) / ".dvc").is_dir()


def dvc_executable() -> list[str] | None:
    found = venv_executable("dvc")
    return [found] if found else None


def dvc(root: Path, *args: str, check: bool = True, capture: bool = True) -> subprocess.CompletedProcess:
    """`dvc --wait-for-lock ARGS` in `root` (DVC holds a repository-wide lock: wait, never race). Never
    `--quiet`: DVC then prints not even its error, and a failure said only `exited 255:`."""
    exe = dvc_executable()
    if exe is None:
        raise DvcError("no `dvc` executable on PATH")
    env = dict(os.environ, DVC_NO_ANALYTICS="1")
    res = subprocess.run([*exe, "--wait-for-lock", *args], cwd=root, env=env, text=True,
                         capture_output=capture)
    if check and res.returncode != 0:
        raise DvcError(f"dvc {' '.join(args)} exited {res.returncode}:\n{(res.stdout or '')[-2000:]}"
                       f"{(res.stderr or '')[-4000:]}")
    return res


def dvc_json(root: Path, *args: str) -> Any:
    """The JSON a `dvc ... --json` command prints: its whole standard output (DVC writes warnings,
    errors and progress to standard error)."""
    res = dvc(root, *args)
    try:
        return json.loads(res.stdout)
    except json.JSONDecodeError as e:
        raise DvcError(f"dvc {' '.join(args)} printed no JSON ({e}):\n{res.stdout[-2000:]}") from e


def changed_stages(root: Path) -> dict[str, Any]:
    """`dvc status` of the pipeline: {stage: what changed}, {} when everything is up to date."""
    status = dvc_json(root, "status", "--json")
    if not isinstance(status, dict):
        raise DvcError(f"dvc status --json printed {type(status).__name__}, not an object: {status!r:.200}")
    # a stage of a dvc.yaml in a subfolder is `path/dvc.yaml:stage`
    return {k.split(":")[-1]: v for k, v in status.items()}


def _file_outs(root: Path, outs: list[str]) -> list[str]:
    return [o for o in outs if (Path(root) / o).is_file()]


def unprotect(root: Path, outs: list[str]) -> None:
    """Single-file outputs as writable copies: with hardlinks or symlinks DVC leaves them read-only
    links to the cache, and Snakemake refuses to rerun a job whose output is write-protected. Model
    folders stay links (a folder is writable, so Snakemake can replace it): they are never stored twice."""
    files = _file_outs(root, outs)
    linked = [f for f in files if os.lstat(Path(root) / f).st_nlink > 1 or (Path(root) / f).is_symlink()
              or not os.access(Path(root) / f, os.W_OK) or not (os.stat(Path(root) / f).st_mode & 0o200)]
    if linked:
        dvc(root, "unprotect", *linked)


def relink_folders(root: Path, outs: list[str]) -> None:
    """Folder outputs as links to the cache: `dvc commit` and `dvc repro` copy a new output into the
    cache and leave the workspace copy in place (a model stored twice) until a checkout relinks it."""
    folders = []
    for out in outs:
        path = Path(root) / out
        if path.is_dir() and not path.is_symlink():
            files = [p for p in path.rglob("*") if p.is_file() and not p.is_symlink() and p.name != MARKER]
            if any(p.stat().st_nlink == 1 for p in files):
                folders.append(out)
    if folders:
        dvc(root, "checkout", "--relink", *folders)
