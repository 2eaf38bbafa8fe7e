"""Every stage's outputs committed to the DVC cache and dvc.lock: `rloo dvc commit`, and after each
successful `snakemake` run (its onsuccess handler, workflow/rules/tracking.smk)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import yaml

from rloo_workflow.dvc.compile import generate
from rloo_workflow.dvc.dag import plan
from rloo_workflow.dvc.driver import dvc, dvc_executable, is_dvc_repo, relink_folders, unprotect
from rloo_workflow.dvc.dvcyaml import ENV_ENABLED, LOCK, DvcError, expand_stages, load_pipeline, log
from rloo_workflow.dvc.jobs import declared_dag
from rloo_workflow.dvc.restore import set_mtime, snapshot


def commit(root: Path, configfiles: list[str], stages: list[str] | None = None) -> list[str]:
    """Commit `stages` (default: every stage Snakemake considers up to date) to the DVC cache and
    dvc.lock, after regenerating dvc.yaml/params.yaml for this config (adding `stages`). The
    outputs keep their mtimes, so Snakemake's view of the run does not change."""
    root = Path(root)
    ran = stages is not None
    if stages is None:
        jobs = declared_dag(root, configfiles, stages=list(expand_stages(load_pipeline(root)))).jobs
        # what Snakemake would run of them, their outputs its targets
        needrun = sorted({r.job.stage for r in plan(root, configfiles, [o for j in jobs for o in j.outputs]).reruns})
        stages = [j.stage for j in jobs if j.stage not in needrun]
        if needrun:
            log(f"not committed (Snakemake would run them): {', '.join(needrun)}")
    # After a run, dvc.yaml holds what was built: the stages dvc.lock already holds and the run's own.
    # A stage listed but never built (the default target's toy experiment after `snakemake
    # results/gsm8k_rloo.json`) has no lock entry, and `dvc status` would list it as changed.
    dag, _, changed = generate(root, configfiles, stages=[*locked_stages(root), *stages] if ran else stages, only=ran)
    if changed:
        log(f"updated {', '.join(changed)}")
    jobs = {j.stage: j for j in dag.jobs}
    stages = [s for s in stages if s in jobs]
    if not stages:
        log("nothing to commit")
        return []
    outs = [o for s in stages for o in jobs[s].outputs]
    missing = [o for o in outs if not (root / o).exists()]
    if missing:
        raise DvcError(f"outputs missing, not committed: {', '.join(missing)}")
    before = snapshot(root, outs)
    dvc(root, "commit", "--force", *stages)
    relink_folders(root, outs)
    unprotect(root, outs)
    for out, mtime in before.items():
        set_mtime(root, out, mtime)
    log(f"committed {len(stages)} stage(s) to the DVC cache and {LOCK}: {', '.join(stages)} "
        f"(`dvc push` sends them to the remote)")
    return stages


def locked_stages(root: Path) -> list[str]:
    """The stages dvc.lock records (committed by an earlier run)."""
    lock = Path(root) / LOCK
    if not lock.is_file():
        return []
    return list((yaml.safe_load(lock.read_text()) or {}).get("stages") or {})


def commit_run(workflow, config: dict) -> None:
    """Snakemake's `onsuccess` (main process, once per run): commit the stages of every job of the
    run's DAG, all up to date now. Never fails the run: problems are reported as one line."""
    root = Path.cwd()
    try:
        if os.environ.get(ENV_ENABLED, "1") == "0":
            log(f"{ENV_ENABLED}=0: outputs not committed to DVC")
            return
        if not is_dvc_repo(root):
            log("not a DVC repository (no .dvc/): outputs not committed to DVC")
            return
        if dvc_executable() is None:
            log("no `dvc` executable: outputs not committed to DVC")
            return
        # The run's resolved config as the only config file, of its jobs (declared: the run's targets and
        # the jobs above them) and of the commit in a fresh process, which runs `dvc` under the project's lock.
        with tempfile.NamedTemporaryFile("w", suffix=".yaml", prefix="rloo-dvc-config-", delete=False) as f:
            yaml.safe_dump(json.loads(json.dumps(config)), f, sort_keys=False)
        try:
            targets = [str(t) for t in workflow.dag_settings.targets]
            stages = [j.stage for j in declared_dag(root, [f.name], targets=targets, default=not targets).jobs]
            if not stages:
                return
            cmd = [sys.executable, "-m", "rloo_workflow.dvc", "commit", "--configfile", f.name, "--stage", *stages]
            res = subprocess.run(cmd, cwd=root)
        finally:
            os.unlink(f.name)
        if res.returncode != 0:
            log(f"commit failed (exit {res.returncode}); the run's outputs are fine: "
                f"`rloo dvc commit` retries")
    except Exception as e:  # the run itself succeeded
        log(f"commit failed: {e}; `rloo dvc commit` retries")
