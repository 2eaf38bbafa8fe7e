"""`rloo why-rerun [STAGE ...]`: which jobs Snakemake would run, and why, in the pipeline's terms.

Snakemake's dry run says "Params have changed since last execution" and prints two digests; this names
what changed: for a stage's code, each file and function, class or method whose syntax tree differs
from the code its outputs were made with (rloo_workflow/code_fingerprint.py keeps each fingerprint's manifest);
for its config, the keys; for its inputs, the file and the stage that makes it again.

It says first when Snakemake would refuse to run at all: another run's lock (.snakemake/locks, left by a
run killed with SIGKILL, or held by one still running), whether that run is alive, and the command that
clears the lock, never while a run is known to be alive (rloo_workflow/running.py).
"""

from __future__ import annotations

import argparse
import json
import shlex
import socket
import sys
from pathlib import Path

from rloo.code_fingerprint import changes, parse_param
from rloo.identity import changed_parts, read_identity
from rloo_workflow import running
from rloo_workflow.code_fingerprint import load_identity, load_manifest
from rloo_workflow.config import JOB_ARGS_DIR, changed_keys
from rloo_workflow.dvc.dag import Rerun, plan
from rloo_workflow.dvc.dvcyaml import DvcError, configfile_parser, project_root
from rloo_workflow.run_record import run_args

IDENTITY_PREFIX = "identity:"  # the chain rules' `identity` param (workflow/rules/common.smk chain_identity)


def _code_lines(root: Path, old: str, new: str) -> list[str]:
    """What changed between the code fingerprints `old` and `new` (digests), file by file and definition by
    definition, from their manifests."""
    old_manifest, new_manifest = load_manifest(root, old), load_manifest(root, new)
    if old_manifest is None or new_manifest is None:
        return [f"its code changed (fingerprint {old} -> {new}; the manifest of {old} is not kept in "
                f"{root}, so what changed cannot be named)"]
    lines = changes(old_manifest, new_manifest)
    return ["its code changed:", *(f"  {line}" for line in lines)] if lines else [
        f"its code fingerprint changed ({old} -> {new})"]


def _config(root: Path, value: str) -> dict | None:
    """The config a `cfg` param holds: the file it names (--job-config, kept under .rloo/config), or the
    JSON itself (the records of runs before those files)."""
    path = root / value
    try:
        parsed = json.loads(path.read_text() if value.endswith(".json") and path.is_file() else value)
    except ValueError:
        return None
    return parsed if isinstance(parsed, dict) else None


def _options_changed(root: Path, before: str, now: str) -> str | None:
    """What differs between two args files (rloo_workflow.config.job_args_file): the options of each, or None
    where one is no longer kept."""
    try:
        old, new = ((root / p).read_text().splitlines() for p in (before, now))
    except OSError:
        return None
    return f"before {' '.join(o for o in old if o not in new) or '-'}, now {' '.join(o for o in new if o not in old) or '-'}"


PARTS = ("stage", "keys", "upstream", "code", "files")  # an identity's parts (rloo.identity.job_identity)


def _differs(old: dict, new: dict, parts: tuple[str, ...] = PARTS) -> bool:
    return any(old.get(p) != new.get(p) for p in parts)


def _recorded(root: Path, outputs: list[str]) -> dict | None:
    """The parts of the identity a job's output folder records (rloo.identity.IDENTITY_FILE), None where none does."""
    for out in outputs:
        if (found := read_identity(root / out)) and isinstance(found.get("parts"), dict):
            return found["parts"]
    return None


def explain(root: Path, rerun: Rerun) -> list[str]:
    """The reasons of one job, most specific first."""
    lines: list[str] = []
    if rerun.missing:
        lines.append(f"its output is missing: {', '.join(rerun.missing)}")
    if rerun.forced and (gone := [i for i in rerun.job.inputs if not (root / i).exists()]):
        # workflow/rules/common.smk's rerun_if_stale: an output standing on an input that is gone
        lines.append(f"an input it was made from is missing: {', '.join(gone)} (made again, then this job)")
    before, now = list(rerun.params_before), list(rerun.params_now)
    identity = [p for p in before + now if p.startswith(IDENTITY_PREFIX)]
    # the command's options (the rules' `args` param): the `cfg` file's path among them, so a changed key
    # changes them too; said below only where the options say more than the rest
    options = [p for p in before + now if p.startswith(f"{JOB_ARGS_DIR}/")]
    before = [p for p in before if p not in identity + options]
    now = [p for p in now if p not in identity + options]
    # the identity's parts (rloo.identity), kept by digest: the chain rules' code part is in them
    old_parts, new_parts = ((load_identity(root, p.removeprefix(IDENTITY_PREFIX)) for p in identity)
                            if len(identity) == 2 else (None, None))
    if old_parts is None and rerun.job.identity:  # its params as recorded: the identity its output records
        old_parts = _recorded(root, rerun.job.outputs)
        new_parts = load_identity(root, rerun.job.identity.removeprefix(IDENTITY_PREFIX)) if old_parts else None
    old_code = next((p for p in before if parse_param(p)), None)
    new_code = next((p for p in now if parse_param(p)), None)
    if old_code and new_code:  # the rules outside the chain: a `code` param
        lines += _code_lines(root, parse_param(old_code)[1], parse_param(new_code)[1])
        before.remove(old_code)
        now.remove(new_code)
    elif old_parts and new_parts:  # a chain rule: its identity's parts, stored and current, compared
        if old_parts.get("code") != new_parts.get("code"):
            lines += _code_lines(root, str(old_parts.get("code")), str(new_parts.get("code")))
        if _differs(old_parts, new_parts, ("stage", "keys", "files")):
            # the code said above, the jobs above it below (their own reruns say it first)
            same = {p: new_parts.get(p) for p in ("code", "upstream")}
            lines.append(f"its identity changed: {changed_parts({**old_parts, **same}, new_parts)}")
        # its `cfg` param: the same keys as the identity's (rloo_workflow.pipeline.job_settings)
        before = [p for p in before if _config(root, p) is None]
        now = [p for p in now if _config(root, p) is None]
    old_cfg = next((c for p in before if (c := _config(root, p)) is not None), None)
    new_cfg = next((c for p in now if (c := _config(root, p)) is not None), None)
    if old_cfg is not None and new_cfg is not None:
        lines.append(f"its config changed: {', '.join(changed_keys(old_cfg, new_cfg))}")
        before = [p for p in before if _config(root, p) is None]
        now = [p for p in now if _config(root, p) is None]
    if before or now:
        lines.append(f"its params changed: before {before or '-'}, now {now or '-'}")
    if len(options) == 2 and not lines and (changed := _options_changed(root, *options)):
        lines.append(f"its command's options changed: {changed}")
    if rerun.rebuilt_inputs:
        lines.append(f"its inputs are made again: {', '.join(rerun.rebuilt_inputs)}")
    if not lines and old_parts and new_parts and _differs(old_parts, new_parts):  # a job above it
        lines.append(f"its identity changed: {changed_parts(old_parts, new_parts)}")
    elif len(identity) == 2 and not lines:
        lines.append("the config keys or code of a stage above it changed since its output was made")
    if rerun.updated_inputs:
        lines.append(f"its inputs changed: {', '.join(rerun.updated_inputs)}")
    if rerun.shell_changed:
        lines.append("its rule's command changed")
    if rerun.inputs_changed:
        lines.append("its set of inputs changed")
    if rerun.software_changed:
        lines.append("its software environment changed")
    return lines or [rerun.words]


def lock_lines(root: Path, refused: bool, unlock: list[str]) -> list[str]:
    """What to say of a lock held in `root`: whether Snakemake refuses this plan for it (`refused`), the
    runs that may hold it and whether they are alive, and `unlock`, the command that clears it, unless a
    run is known to be alive."""
    runs = running.recorded(root)
    alive = [r for r in runs if r.alive]
    unknown = [r for r in runs if r.alive is None]
    # a snakemake in this folder not (yet) recorded: it records itself only once its DAG is built, under the lock
    others = [p for p in running.snakemake_processes(root) if p not in {r.pid for r in alive}]
    lines = ["the working folder is locked (.snakemake/locks): snakemake refuses this run (LockException)" if refused
             else "another run's lock is held in the working folder (.snakemake/locks), on files this run does not "
                  "touch: it can run beside it"]
    lines += [f"the run that holds it is gone, {r}, but its jobs still run, and write: PID {', '.join(map(str, r.jobs))}"
              if r.jobs else f"a run that holds it is alive: {r}" for r in alive]
    lines += [f"a snakemake process runs in this folder: PID {p}" for p in others]
    if alive or others:
        return [*lines, "wait for it to end, or stop it; never `snakemake --unlock` while it runs: both runs "
                        "would write the same files"]
    if unknown:
        lines += [f"held by a run of another host, {r}: whether it is alive cannot be told from "
                  f"{socket.gethostname()}" for r in unknown]
        return [*lines, f"once it runs no more, clear the lock: {shlex.join(unlock)}"]
    dead = [r for r in runs if r.alive is False]
    if dead and not dead[-1].local:  # Slurm's jobs outlive the Snakemake that submitted them
        return [*lines, f"no run is alive on this host: the last run, {dead[-1]}, is gone (killed?), but it sent its "
                        "jobs to a cluster, where they may still run and write: look at its queue (Slurm: squeue --me)",
                f"once none of its jobs runs, clear the lock, then run again: {shlex.join(unlock)}"]
    lines.append(f"no run is alive: the last run, {dead[-1]}, is gone (killed?)" if dead else
                 "no run is alive: no run is recorded as running (.rloo/running), no snakemake runs in this folder")
    return [*lines, f"clear the lock, then run again: {shlex.join(unlock)}"]


def _matches(rerun: Rerun, names: list[str]) -> bool:
    job = rerun.job
    return not names or any(n in (job.stage, job.rule, job.rule.split("_")[0]) for n in names)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="rloo why-rerun", description=__doc__, parents=[configfile_parser()],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("stage", nargs="*", help="only these stages (a rule, e.g. sft, or a job, e.g. rloo@grpo)")
    parser.add_argument("--target", action="append", default=[], metavar="FILE_OR_RULE",
                        help="a Snakemake target besides the default one (e.g. results/comparison.json)")
    args = parser.parse_args(argv)
    if (root := project_root("rloo why-rerun")) is None:
        return 2
    run = run_args(root, args.configfile)
    if run.source:
        print(f"rloo why-rerun: {run.source}", file=sys.stderr)
    try:
        planned = plan(root, run.configfiles, [*run.targets, *args.target])
    except DvcError as e:
        print(f"rloo why-rerun: {e}", file=sys.stderr)
        return 1
    if planned.lock_held:
        first, *rest = lock_lines(root, planned.locked, ["snakemake", "--unlock", *run.options])
        print(f"locked: {first}")
        for line in rest:
            print(f"  {line}")
    reruns = [r for r in planned.reruns if _matches(r, args.stage)]
    if not reruns:
        print(f"nothing to rerun{' for ' + ', '.join(args.stage) if args.stage else ''}: its outputs are up to date")
        return 0
    for r in reruns:
        first, *rest = explain(root, r)
        print(f"{r.job.stage}: {first}")
        for line in rest:
            print(f"  {line}")
    return 0
