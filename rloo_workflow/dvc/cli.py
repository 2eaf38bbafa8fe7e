"""DVC for the Snakemake workflow: `dvc.yaml` generated from the Snakemake DAG, every stage's outputs
committed to the DVC cache after a run, and a pulled run that Snakemake sees as up to date.

    rloo dvc yaml    [--configfile F ...] [--target T ...] [--check]   write (or check) dvc.yaml, params.yaml
                                                                       and .rloo/fingerprints.yaml
    rloo dvc commit  [--configfile F ...]                 commit the stages Snakemake considers up to date
    rloo dvc pull    [--configfile F ...] [-r REMOTE]     `dvc pull`, then `restore`
    rloo dvc restore [--configfile F ...]                 after `dvc pull` / `dvc checkout` / `dvc repro`
    rloo dvc checkout [--configfile F ...]                the last committed outputs back (e.g. after a
                                                          failed rerun deleted them), then `restore`

(`python -m rloo_workflow.dvc ...` is the same.) `--configfile` takes the files given to `snakemake --configfile`;
without it, the last snakemake run's files and --config values are used (rloo_workflow/run_record.py).

dvc.yaml: one stage per Snakemake rule; a rule with a wildcard ({estimator}) is a `foreach` stage whose
stage names are `rule@value` (`rloo@grpo`). Each stage has the rule's command, its inputs as deps, its
outputs as outs, and as params exactly the config keys the rule passes the stage (`--job-config`,
workflow/rules/common.smk) and its code fingerprint (the rule's `code` param, rloo_workflow/code_fingerprint.py:
what the stage computes, not how its files are spelled), which `yaml` writes to .rloo/fingerprints.yaml
(not kept in git; every snakemake run and `restore` write it too: after editing code, run one of them
before asking `dvc status`). DVC reads
params from a file, so `params.yaml` holds the resolved config (config/config.yaml + --configfile
files, every default filled in) and the stage command reads it (`--config params.yaml`) instead of the
inline JSON; a key the rule sets per job (`rloo.estimator` from the wildcard) is a `--set` instead of a
param. Logs, `--set threads=` and the checkpoint folders are how a job runs, not what it computes.

Which stages: `rloo dvc yaml` writes those of the Snakemake default target (`rule all`), plus every
stage already in dvc.yaml; `--target results/comparison.json` adds the other estimators and the
comparison. The commit after a run writes those dvc.lock records plus every job the run built: what
has been built, so `dvc status` is clean after any successful `snakemake` run of any target (a listed
stage never built has no lock entry, which DVC reports as changed), and `dvc repro` runs the same
stages as `snakemake`.

Timestamps: DVC does not restore mtimes, and DVC with hardlinks makes files read-only, which Snakemake
refuses to overwrite. `restore` (also part of `pull`, and of `commit` after a run) asks DVC which
stages are up to date (checksums of inputs and outputs; parameter values and code fingerprints), unprotects single-file
outputs, gives up-to-date outputs increasing mtimes in DAG order, gives outdated ones an old mtime so
Snakemake reruns them, and drops Snakemake's own records for outputs DVC vouches for. Snakemake keeps
all its rerun triggers (mtime included: editing a source file still reruns its stages).

Not a DVC repository (no `.dvc/`), no `dvc` executable, or RLOO_DVC=0: the commit after a run is
skipped with one line of output.

One `rloo dvc` at a time in a project (driver.exclusive, an flock on .rloo/rloo-dvc.lock): two
Snakemake runs that end together commit one after the other.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from rloo_workflow.dvc.commit import commit
from rloo_workflow.dvc.compile import check, generate
from rloo_workflow.dvc.driver import dvc, exclusive, is_dvc_repo
from rloo_workflow.dvc.dvcyaml import DVC_YAML, DvcError, configfile_parser, expand_stages, log, project_root
from rloo_workflow.dvc.restore import restore
from rloo_workflow.run_record import run_args


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="rloo dvc", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    configfile = configfile_parser()

    p = sub.add_parser("yaml", parents=[configfile], help="write dvc.yaml and params.yaml from the Snakemake DAG")
    p.add_argument("--target", action="append", default=[], metavar="FILE_OR_RULE",
                   help="add the stages of this Snakemake target (e.g. results/comparison.json)")
    p.add_argument("--check", action="store_true", help="only check that dvc.yaml and params.yaml are in sync; exit 1 if not")

    p = sub.add_parser("commit", parents=[configfile], help="commit up-to-date stages to the DVC cache + dvc.lock")
    p.add_argument("--stage", nargs="+", default=None, help="these stages (default: every up-to-date one)")

    p = sub.add_parser("pull", parents=[configfile], help="dvc pull, then restore")
    p.add_argument("-r", "--remote", default=None)
    p.add_argument("-j", "--jobs", default=None)

    sub.add_parser("restore", parents=[configfile],
                   help="after dvc pull/checkout/repro: writable files, mtimes in DAG order, outdated stages rerun")
    sub.add_parser("checkout", parents=[configfile],
                   help="put back the outputs of the last committed run (dvc.lock) from the DVC cache, then restore")

    args = parser.parse_args(argv)
    root = project_root("rloo dvc")
    if root is None:
        return 2
    run = run_args(root, args.configfile)  # no --configfile: the last snakemake run's (rloo_workflow/run_record.py)
    if run.source:
        log(run.source)
    args.configfile = run.configfiles
    with exclusive(root):
        return _run(root, args)


def _run(root: Path, args: argparse.Namespace) -> int:
    try:
        if args.command == "yaml":
            if args.check:
                problems = check(root, args.configfile)
                for line in problems:
                    print(f"rloo dvc: {line}", file=sys.stderr)
                if problems:
                    print("rloo dvc: dvc.yaml or params.yaml is out of date with the Snakemake workflow: run `rloo dvc yaml`",
                          file=sys.stderr)
                    return 1
                print("dvc.yaml and params.yaml are in sync with the Snakemake workflow")
                return 0
            _, pipeline, changed = generate(root, args.configfile, targets=args.target)
            stages = expand_stages(pipeline)
            print(f"{DVC_YAML}: {len(stages)} stages ({', '.join(stages)}); "
                  + (f"updated {', '.join(changed)}" if changed else "unchanged"))
            return 0
        if not is_dvc_repo(root):
            print("rloo dvc: not a DVC repository (no .dvc/)", file=sys.stderr)
            return 2
        if args.command == "commit":
            commit(root, args.configfile, args.stage)
            return 0
        if args.command == "pull":
            extra = [*(["-r", args.remote] if args.remote else []), *(["-j", args.jobs] if args.jobs else [])]
            dvc(root, "pull", *extra, capture=False)
        if args.command == "checkout":
            # Snakemake deletes a job's previous outputs before it runs and after it fails; the committed
            # ones are still in the cache, as dvc.lock names them.
            dvc(root, "checkout", "--force", capture=False)
        result = restore(root, args.configfile)
        log(f"up to date: {len(result['current'])} stage(s)"
            + (f"; outdated, Snakemake will rerun them: {', '.join(result['outdated'])}" if result["outdated"] else "")
            + (f"; not built: {', '.join(result['missing'])}" if result["missing"] else ""))
        return 0
    except DvcError as e:
        print(f"rloo dvc: {e}", file=sys.stderr)
        return 1
