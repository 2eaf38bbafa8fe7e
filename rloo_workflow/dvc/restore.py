"""Snakemake's view of the outputs made to agree with DVC's (after `dvc pull`, `dvc checkout`,
`dvc repro`, and after `dvc commit`): timestamps, and Snakemake's records of outputs DVC replaced.

DVC does not restore mtimes, and a checkout leaves files in any order; on a fresh clone Snakemake has
no records of the run. So DVC decides (checksums of inputs and outputs; parameter values, code fingerprints): the
outputs of up-to-date stages get increasing mtimes in DAG order, those of outdated stages an old one,
so that Snakemake reruns them (keeping its own rerun triggers, mtime included).
"""

from __future__ import annotations

import configparser
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import yaml

from rloo_workflow.dvc.compile import generate
from rloo_workflow.dvc.driver import changed_stages, relink_folders, unprotect
from rloo_workflow.dvc.dvcyaml import (
    LOCK,
    MARKER,
    DvcError,
    covers,
    expand_stages,
    load_pipeline,
    log,
    stage_deps,
    stage_outs,
    venv_executable,
)

# mtime of an output DVC reports as outdated: older than any input, so Snakemake reruns its job.
STALE_MTIME_NS = 315_532_800 * 10**9  # 1980-01-01
STEP_NS = 10_000_000  # 10 ms between consecutive stages


def _carrier(path: Path) -> Path:
    """The file whose mtime Snakemake reads for an output: the marker of a directory, else the file."""
    return path / MARKER if path.is_dir() and not path.is_symlink() else path


def snapshot(root: Path, outs: list[str]) -> dict[str, int]:
    times = {}
    for out in outs:
        carrier = _carrier(Path(root) / out)
        if carrier.exists() or carrier.is_symlink():
            times[out] = os.lstat(carrier).st_mtime_ns
    return times


def set_mtime(root: Path, out: str, mtime_ns: int) -> None:
    path = Path(root) / out
    if not (path.exists() or path.is_symlink()):
        return
    carrier = _carrier(path)
    if carrier != path and not carrier.exists():
        carrier.touch()
    if carrier.is_symlink() and carrier.exists():
        os.utime(carrier, ns=(mtime_ns, mtime_ns))  # the target (Snakemake follows links of inputs)
    os.utime(carrier, ns=(mtime_ns, mtime_ns), follow_symlinks=False)
    if carrier != path:
        os.utime(path, ns=(mtime_ns, mtime_ns), follow_symlinks=False)


def dag_order(stages: dict[str, dict]) -> list[str]:
    """The stages of dvc.yaml (expanded) in DAG order, from their deps and outs."""
    producers = {o: s for s, b in stages.items() for o in stage_outs(b)}
    order: list[str] = []
    seen: set[str] = set()

    def visit(s: str) -> None:
        if s in seen:
            return
        seen.add(s)
        for dep in stage_deps(stages[s]):
            for out, producer in producers.items():
                if covers(out, dep) and producer != s:
                    visit(producer)
        order.append(s)

    for s in stages:
        visit(s)
    return order


def restore(root: Path, configfiles: list[str], regenerate: bool = True) -> dict[str, list[str]]:
    """Make Snakemake's view of the outputs agree with DVC's (after `dvc pull`, `dvc checkout`,
    `dvc repro`): outputs of up-to-date stages get increasing mtimes in DAG order and lose Snakemake's
    stale records; outputs of outdated stages (code fingerprint, inputs or params changed) get an old mtime, so
    that Snakemake reruns them. Returns {"current": [...], "outdated": [...], "missing": [...]}."""
    root = Path(root)
    benchmarks: dict[str, str] = {}
    if regenerate:
        dag, _, changed = generate(root, configfiles)
        if changed:
            log(f"updated {', '.join(changed)} for this config")
        benchmarks = {j.stage: j.benchmark for j in dag.jobs if j.benchmark}
    stages = expand_stages(load_pipeline(root))
    status = changed_stages(root)
    present = [s for s, b in stages.items() if all((root / o).exists() for o in stage_outs(b))]
    missing = [s for s in stages if s not in present]
    outdated = [s for s in present if s in status]
    current = [s for s in present if s not in status]
    relink_folders(root, [o for s in current for o in stage_outs(stages[s])])
    unprotect(root, [o for s in present for o in stage_outs(stages[s])])

    producers = {o: s for s, b in stages.items() for o in stage_outs(b)}
    order = dag_order(stages)
    t = time.time_ns() - (len(order) + 1) * STEP_NS
    for s in order:
        if s not in present:
            continue
        outs = stage_outs(stages[s])
        if s in status:
            for out in outs:
                set_mtime(root, out, STALE_MTIME_NS)
            continue
        external = [root / d for d in stage_deps(stages[s]) if not any(covers(o, d) for o in producers)]
        newest = max((p.stat().st_mtime_ns for p in external if p.exists()), default=0)
        t = max(t + STEP_NS, newest + STEP_NS)
        # Snakemake's benchmark file of the job counts as one of its outputs (the oldest decides)
        for out in [*outs, *([benchmarks[s]] if s in benchmarks else [])]:
            set_mtime(root, out, t)
    _forget_snakemake_records(root, configfiles, [o for s in current for o in stage_outs(stages[s])])
    return {"current": current, "outdated": outdated, "missing": missing}


def _forget_snakemake_records(root: Path, configfiles: list[str], outs: list[str]) -> None:
    """Snakemake's own records (params, code, input set of the run that made an output) describe
    the outputs it made itself; after DVC replaced them (checkout, pull, repro) they are stale and
    would trigger reruns. Drop them for the outputs DVC vouches for (`snakemake --cleanup-metadata`)."""
    metadata = Path(root) / ".snakemake" / "metadata"
    if not outs or not metadata.is_dir() or not any(metadata.iterdir()):
        return
    cmd = [venv_executable("snakemake") or "snakemake", "--cleanup-metadata", *outs, "--cores", "1"]
    if configfiles:
        cmd += ["--configfile", *configfiles]
    res = subprocess.run(cmd, cwd=root, text=True, capture_output=True)
    # Snakemake cleans every path it has records of and then names those it had none of (e.g. outputs a
    # failed rerun deleted, on a clone): nothing to forget there.
    if res.returncode != 0 and "because the metadata was not present" not in res.stderr:
        raise DvcError(f"snakemake --cleanup-metadata failed:\n{res.stderr[-3000:]}")


def cache_dir(root: Path) -> Path:
    """The project's DVC cache: `cache.dir` of .dvc/config.local or .dvc/config (relative to .dvc/), else .dvc/cache."""
    dot = Path(root) / ".dvc"
    for name in ("config.local", "config"):
        parser = configparser.ConfigParser()
        try:
            parser.read(dot / name)
        except configparser.Error:
            continue
        if parser.has_option("cache", "dir"):
            return (dot / parser.get("cache", "dir")).resolve()
    return dot / "cache"


def _cached(cache: Path, md5: str) -> bool:
    """Whether the DVC cache holds the whole content of `md5`: a file, or a folder's listing (`.dir`) and every file in it."""
    path = cache / "files" / "md5" / md5[:2] / md5[2:]
    if not path.is_file():
        return False
    if not md5.endswith(".dir"):
        return True
    try:
        entries = json.loads(path.read_text())
    except (OSError, ValueError):
        return False
    return all(_cached(cache, e["md5"]) for e in entries if isinstance(e, dict) and "md5" in e)


def missing_but_cached(root: Path) -> list[str]:
    """The outputs dvc.lock records (the last committed run's) that are gone from the workspace while the
    DVC cache holds their whole content: what `dvc checkout PATH` brings back, byte for byte."""
    root = Path(root)
    try:
        stages = (yaml.safe_load((root / LOCK).read_text()) or {}).get("stages") or {}
    except (OSError, yaml.YAMLError):
        return []
    cache = cache_dir(root)
    found = []
    for body in stages.values():
        for out in body.get("outs") or []:
            path, md5 = out.get("path"), out.get("md5")
            if path and md5 and not (root / path).exists() and not (root / path).is_symlink() and _cached(cache, md5):
                found.append(path)
    return list(dict.fromkeys(found))


def say_where_outputs_are(root: Path | None = None) -> None:
    """Snakemake's `onerror` (workflow/rules/tracking.smk): a failed run's deleted outputs (Snakemake deletes a
    job's outputs before it runs it) that the DVC cache holds from the last committed run, and the one
    command that brings them back. Never fails: it only points."""
    try:
        lost = missing_but_cached(Path.cwd() if root is None else root)
    except Exception:  # an error handler: the run's own error is what matters
        return
    if lost:
        print(f"rloo: the last committed {' and '.join(lost)} (Snakemake deleted {'it' if len(lost) == 1 else 'them'}) "
              f"{'is' if len(lost) == 1 else 'are'} in the DVC cache; to get {'it' if len(lost) == 1 else 'them'} "
              f"back: dvc checkout {' '.join(lost)}", file=sys.stderr, flush=True)
