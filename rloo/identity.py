"""A job's identity: what it read, hashed once (`job_identity`). Every place that decides whether a job
reruns or a training run resumes reads it: Snakemake's `identity` param (workflow/rules/*.smk, through
rloo_workflow.pipeline.identity, recursively over the jobs above), the work folder and every checkpoint
of a training run (`claim_work`, rloo/model/checkpoint.py), the output folder (`IDENTITY_FILE`), MLflow's
tags and `rloo why-rerun` (which compares the stored `parts` with the current ones).

The parts of a job's identity:
- `keys`: what the stage reads of the config (rloo.stages.stage_config, the one declaration);
- `upstream`: the identities of the jobs whose outputs it reads, by input name (under Snakemake computed
  from the config, since outputs do not exist yet when the DAG is built; by hand, each input folder's
  recorded identity (`IDENTITY_FILE`), else its content's digest: `folder_identity`); rloo.api's rows stand
  in for the data;
- `code`: the digest of what its code computes (rloo.code_fingerprint; the workflow passes in its stage's
  fingerprint, the API the training run's own), and `files`: the digest of each user file the config names
  (reward functions, tools, data files, a local model to start from).

Two digests are made from them: `rerun` over all of them, `resume` without the bookkeeping keys
(`bookkeeping`), which change what a run writes but not its trajectory, so a checkpoint may resume across them.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

from rloo.code_fingerprint import PACKAGES, Fingerprint, file_digests, training_fingerprint
from rloo.errors import InputError
from rloo.io import file_digest, write_json_atomic
from rloo.settings import Config
from rloo.settings.selection import drop
from rloo.stages import ConfigLike, stage_config

# What an output folder (a data folder, a model) and a work folder record of the job that made them.
IDENTITY_FILE = "identity.json"
# The keys a run may change and still resume its checkpoints (beside those its stage does not read,
# rloo.stages.STAGES): the checkpoint interval, and (RLOO) what changes what is written, not the
# trajectory: evaluation, selection, stopping rules. `bookkeeping` adds the keys that depend on other settings.
BOOKKEEPING: dict[str, tuple[str, ...]] = {
    "reward": ("reward.checkpoint_every",),
    "rloo": ("rloo.checkpoint_every", "rloo.keep_checkpoints", "rloo.eval_every", "rloo.eval_examples",
             "rloo.eval_draws", "rloo.eval_batch_size", "rloo.select", "rloo.stop_on", "rloo.alarms"),
}


def bookkeeping(stage: str, config: ConfigLike) -> tuple[str, ...]:
    """`BOOKKEEPING[stage]`, and for RLOO: PPO's settings, which the other estimators' runs do not read, and
    under the constant LR schedule the step count (a run may be extended)."""
    out = BOOKKEEPING.get(stage, ())
    if stage != "rloo":
        return out
    rc = Config.of(config).rloo
    return out + (("rloo.ppo",) if rc.estimator != "ppo" else ()) + (("rloo.steps",) if rc.lr_schedule == "constant" else ())


def digest(obj: Any) -> str:
    """16 hex digits of `obj` as canonical JSON."""
    return hashlib.sha256(json.dumps(obj, sort_keys=True, separators=(",", ":"), default=str).encode()).hexdigest()[:16]


@dataclass(frozen=True)
class Identity:
    """A job's identity: `parts` (stage, keys, upstream, code, files: what is stored and compared) and the
    two digests made from them."""

    parts: dict[str, Any]
    rerun: str
    resume: str

    def record(self) -> dict[str, Any]:
        return {"rerun": self.rerun, "resume": self.resume, "parts": self.parts}

    def write(self, folder: str | Path) -> None:
        """Record it in `folder` (an output folder, a work folder): `IDENTITY_FILE`."""
        write_json_atomic(Path(folder) / IDENTITY_FILE, self.record())

    def changed(self, parts: Mapping[str, Any] | None) -> str:
        """Which parts differ from `parts` (another identity's): `changed_parts`."""
        return changed_parts(parts, self.parts)


def changed_parts(old: Mapping[str, Any] | None, new: Mapping[str, Any]) -> str:
    """Which parts of an identity differ between `old` and `new`, in words: `keys rloo.lr`, `upstream
    policy`, `code`, `files reward.py`; `a damaged identity file` where `old` is none."""
    if not isinstance(old, Mapping):
        return "a damaged identity file"
    said = []
    kept = tuple(new.get("bookkeeping") or ())
    for part in ("stage", "keys", "upstream", "code", "files"):
        before, now = old.get(part), new.get(part)
        if before == now:
            continue
        if isinstance(before, dict) and isinstance(now, dict):
            a, b = _leaves(before), _leaves(now)
            names = sorted(k for k in a.keys() ^ b.keys() | {k for k in a.keys() & b.keys() if a[k] != b[k]}
                           if part != "keys" or not any(k == d or k.startswith(f"{d}.") for d in kept))
            if names:
                said.append(f"{part} {', '.join(names)}")
        else:
            said.append(part)
    return "; ".join(said) or "the bookkeeping keys only"


def _leaves(d: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        if isinstance(v, Mapping) and v:
            out |= _leaves(v, f"{prefix}{k}.")
        else:
            out[f"{prefix}{k}"] = v
    return out


def job_identity(config: ConfigLike, stage: str, *, upstream: Mapping[str, str] | None = None,
                 code: Fingerprint | None = None, overrides: Mapping[str, Any] | None = None) -> Identity:
    """The identity of `stage`'s job on `config`: the keys it reads (`stage_config` with `overrides`, the
    RLOO job's estimator), the identities of its `upstream` jobs ({input name: identity}), its `code` (default:
    the training run's own, `training_code`) and the user's files the config names (`user_files`)."""
    sections = Config.of(config)
    code = code or training_code(sections, stage)
    keys = stage_config(sections.to_config(), stage, dict(overrides) if overrides else None)
    files = {f: d for f, d in file_digests(code).items() if not f.startswith(tuple(f"{p}/" for p in PACKAGES))}
    files |= {str(f): folder_identity(f) for f in data_files(sections, stage)}
    kept = bookkeeping(stage, sections)
    parts = {"stage": stage, "keys": keys, "bookkeeping": list(kept), "upstream": dict(sorted((upstream or {}).items())),
             "code": code.digest, "files": dict(sorted(files.items()))}
    resumed = json.loads(json.dumps(keys))
    for dotted in kept:
        drop(resumed, dotted)
    return Identity(parts, digest(parts), digest({**parts, "keys": resumed}))


def code_files(config: Config, stage: str) -> tuple[list[Path], list[tuple[str, str]]]:
    """(the user's files, the package's functions) of the code the config names that `stage` runs: the
    reward functions (rloo, evaluate) and the enabled tools (sft, rloo, evaluate)."""
    from rloo import tools
    from rloo.reward.functions import package_functions, user_files

    files, functions = ((user_files(config), package_functions(config)) if stage in ("rloo", "evaluate") else ([], []))
    if stage in ("sft", "rloo", "evaluate") and config.tools.on:
        files += [f for f in tools.user_files(config) if f not in files]
        functions += [r for r in tools.package_functions(config) if r not in functions]
    return files, functions


def data_files(config: Config, stage: str) -> list[str]:
    """The local files and folders the config names that `stage` reads as data, not code: prepare's data
    files, the starting model (base) and the reward model's (reward.init)."""
    named = {"prepare": (config.data.train_file, config.data.test_file),
             "base": (config.model.name_or_path, config.model.tokenizer, config.model.gguf),
             "reward": (config.reward.init,)}.get(stage, ())
    return [str(v) for v in named if v and os.path.exists(str(v))]


def training_code(config: Config, stage: str, user_code: Sequence[str | Path] = (),
                  callers: Iterable[tuple[str, str]] = ()) -> Fingerprint:
    """The library's fingerprint of `stage`'s training run (rloo.code_fingerprint.TRAINING_CODE) with the
    code the config names (`code_files`) and `user_code` (rloo.api's callables' files)."""
    files, functions = code_files(config, stage)
    files += [Path(f) for f in user_code if Path(f) not in files]
    return training_fingerprint(stage, files, functions, callers)


@cache
def _content(path: str, size: int, mtime_ns: int) -> str:
    return file_digest(path)


def folder_identity(path: str | Path) -> str:
    """The identity of an input: the one recorded by the job that made it (`IDENTITY_FILE` in the folder),
    else its content's digest (every file's, a model's weights included); a name that is no local path
    (a hub id) is itself."""
    p = Path(path)
    recorded = p / IDENTITY_FILE
    if recorded.is_file():
        try:
            return str(json.loads(recorded.read_text())["rerun"])
        except (OSError, ValueError, KeyError, TypeError):
            pass  # a damaged record: the folder's content says what it is
    if p.is_file():
        st = p.stat()
        return _content(str(p.resolve()), st.st_size, st.st_mtime_ns)
    if not p.is_dir():
        return str(path)
    entries = []
    for f in sorted(p.rglob("*")):
        if f.is_file() and f.name not in (IDENTITY_FILE, ".snakemake_timestamp"):
            st = f.stat()
            entries.append([f.relative_to(p).as_posix(), _content(str(f.resolve()), st.st_size, st.st_mtime_ns)])
    return digest(entries)


def rows_identity(rows: Sequence[Mapping]) -> str:
    """The identity of rows handed to rloo.api: their content."""
    return digest([dict(r) for r in rows])


def read_identity(folder: str | Path) -> dict[str, Any] | None:
    """The identity recorded in `folder` ({rerun, resume, parts}); None where there is none, {} where it is damaged."""
    path = Path(folder) / IDENTITY_FILE
    if not path.exists():
        return None
    try:
        got = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return got if isinstance(got, dict) and isinstance(got.get("resume"), str) else {}


def claim_work(work: str | Path, identity: Identity, clear: bool) -> str:
    """Make `work` (a training run's work folder: its checkpoints) this job's. Kept where it records the same
    resume identity; else (another job's, or a record that is damaged or missing) it is cleared where `clear`
    (a Snakemake job: a rerun is a new job), and where it holds checkpoints refused with one line otherwise
    (`rloo <verb>`, rloo.api: the user's to delete). Records `identity` there; returns what was done, in words."""
    work = Path(work)
    recorded = read_identity(work)
    # rloo.api saves a model object's weights there first (`start`): only checkpoints are a run's to resume
    checkpoints = (work / "checkpoints").is_dir() and any((work / "checkpoints").iterdir())
    said = "fresh start"
    if recorded and recorded["resume"] == identity.resume:
        said = "same job, resuming from its checkpoints" if checkpoints else said
    elif checkpoints or (clear and recorded is not None):
        why = "no identity file" if recorded is None else identity.changed(recorded.get("parts"))
        if not clear:
            raise InputError(f"{work} holds the checkpoints of another job (changed: {why}); delete it or "
                             "use another work folder to start afresh")
        shutil.rmtree(work)
        said = f"cleared: its checkpoints are another job's (changed: {why})"
    work.mkdir(parents=True, exist_ok=True)
    identity.write(work)
    return said
