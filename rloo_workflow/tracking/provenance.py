"""What a run's tags say about where it came from: git commit, host, Slurm job, md5 of each output, and a
stage's identity: the digest of what it reads of the config and of the code it runs, with each code
file's digest (rloo_workflow/code_fingerprint.py computes them; the user's reward files among them).

Output md5s are computed the way DVC 3 does (a folder's ends in `.dir`), so a run's `dvc.md5.<path>`
tag can be compared with dvc.lock without DVC installed.
"""

from __future__ import annotations

import contextlib
import getpass
import hashlib
import json
import os
import socket
import subprocess
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING

from rloo.io import file_digest

if TYPE_CHECKING:
    from rloo.identity import Identity

# Snakemake's marker in directory outputs, written after the job: not part of the stage's output
# (the project's .dvcignore should list it too, so DVC's md5 of the folder is this one).
DVC_IGNORED = {".snakemake_timestamp"}


def git_output(args: list[str], cwd: Path) -> str | None:
    """`git ARGS`'s output in `cwd`, stripped; None where git is missing or fails."""
    try:
        res = subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return res.stdout.strip() if res.returncode == 0 else None


def git_info(cwd: Path | None = None, named: Iterable[Path] = ()) -> dict[str, str]:
    """Commit of the project run from, else of the package, and whether the code run differs from it:
    tracked files changed, or a file the config names (`named`: a reward function's) that git does not
    track, so that the commit does not hold it."""
    for where in (cwd or Path.cwd(), Path(__file__).resolve().parent):
        commit = git_output(["rev-parse", "HEAD"], where)
        if commit:
            dirty = git_output(["status", "--porcelain", "--untracked-files=no"], where)
            untracked = [f for f in named if git_output(["ls-files", "--error-unmatch", "--", str(f)], where) is None]
            return {"git_commit": commit, "git_dirty": str(bool(dirty or untracked)).lower()}
    return {}


IDENTITY_TAG = "rloo.identity"  # a stage run's identity (rloo.identity): its rerun digest; its parts below it
CODE_TAG = "rloo.code."  # + a file: the digest of what the stage runs of it (rloo.code_fingerprint.file_digests)


def identity_tags(cfg: dict, stage: str, identity: Identity | None = None) -> dict[str, str]:
    """`stage`'s identity under `cfg` (rloo.identity.job_identity: given, else of its keys and code alone) and
    its parts: `rloo.identity` (the rerun digest), `.resume`, `.keys` (their digest), `.code` (the code
    fingerprint), `.upstream.<input>` (each input's identity), each code file's digest (`rloo.code.<file>`),
    and the user's files among them (`rloo.user_files`); `git_dirty` counts those git does not track. Two
    runs with the same settings and commit but another reward file differ here."""
    from rloo.code_fingerprint import file_digests
    from rloo.identity import digest, job_identity
    from rloo.reward.functions import user_files
    from rloo.settings import Config
    from rloo_workflow.code_fingerprint import stage_fingerprint

    fp = stage_fingerprint(stage, cfg, cached=False)
    identity = identity or job_identity(cfg, stage, code=fp)
    users = user_files(Config.of(cfg)) if stage in ("rloo", "evaluate") else []
    parts = identity.parts
    tags = {IDENTITY_TAG: identity.rerun, f"{IDENTITY_TAG}.resume": identity.resume, f"{IDENTITY_TAG}.code": parts["code"],
            f"{IDENTITY_TAG}.keys": digest(parts["keys"]), "rloo.user_files": json.dumps([rel_path(f) for f in users])}
    tags |= {f"{IDENTITY_TAG}.upstream.{name}": value for name, value in parts["upstream"].items()}
    tags |= {CODE_TAG + tag_path(rel_path(Path(f)) if Path(f).is_absolute() else f): digest
             for f, digest in file_digests(fp).items()}
    return tags | git_info(named=users)


def dvc_md5(path: Path) -> tuple[str, dict[str, dict]]:
    """The md5 DVC 3 records for `path` (a folder's ends in .dir) and each file's {md5, size}."""
    path = Path(path)
    if path.is_file():
        digest = file_digest(path, "md5")
        return digest, {path.name: {"md5": digest, "size": path.stat().st_size}}
    files: dict[str, dict] = {}
    for p in sorted(path.rglob("*")):
        if p.is_file() and not p.is_symlink() and p.name not in DVC_IGNORED:
            files[p.relative_to(path).as_posix()] = {"md5": file_digest(p, "md5"), "size": p.stat().st_size}
    listing = sorted(({"md5": v["md5"], "relpath": k} for k, v in files.items()), key=lambda e: e["relpath"])
    blob = json.dumps(listing, sort_keys=True).encode()
    return hashlib.md5(blob, usedforsecurity=False).hexdigest() + ".dir", files


def dvc_lock_md5s(start: Path) -> dict[str, str]:
    """{output path (relative to the repo): md5} from dvc.lock, when there is one."""
    lock = start / "dvc.lock"
    if not lock.is_file():
        return {}
    try:
        import yaml

        data = yaml.safe_load(lock.read_text()) or {}
    except Exception:
        return {}
    out = {}
    for stage in (data.get("stages") or {}).values():
        for o in stage.get("outs") or []:
            if isinstance(o, dict) and o.get("path") and o.get("md5"):
                out[str(Path(o["path"]))] = o["md5"]
    return out


def rel_path(path: Path) -> str:
    """`path` relative to the working directory (the repository a stage runs in), POSIX-style."""
    try:
        return Path(os.path.relpath(Path(path).resolve(), Path.cwd())).as_posix()
    except ValueError:
        return str(path)


def tag_path(rel: str) -> str:
    """`rel` as part of a tag key: MLflow refuses keys that normalise to another path ("x.../../y"),
    so an output outside the working directory is named by its absolute path under "outside/"."""
    if rel.startswith(("..", "/")):
        return "outside/" + Path(rel).resolve().as_posix().lstrip("/")
    return rel


def host_tags() -> dict[str, str]:
    tags = {"host": socket.gethostname()}
    if os.environ.get("SLURM_JOB_ID"):
        tags["slurm_job_id"] = os.environ["SLURM_JOB_ID"]
        if os.environ.get("SLURM_ARRAY_TASK_ID"):
            tags["slurm_array_task_id"] = os.environ["SLURM_ARRAY_TASK_ID"]
        if os.environ.get("SLURM_CLUSTER_NAME"):
            tags["slurm_cluster"] = os.environ["SLURM_CLUSTER_NAME"]
    return tags


def base_tags(kind: str, name: str) -> dict[str, str]:
    """The tags every run opened here starts with: source, kind, host, user, git commit."""
    tags = {
        "mlflow.source.type": "LOCAL",
        "mlflow.source.name": "snakemake" if kind == "pipeline" else f"rloo {name}",
        "rloo.kind": kind,
        **host_tags(),
    }
    with contextlib.suppress(Exception):
        tags["mlflow.user"] = getpass.getuser()
    git = git_info()
    tags.update(git)
    if "git_commit" in git:
        tags["mlflow.source.git.commit"] = git["git_commit"]
    return tags
