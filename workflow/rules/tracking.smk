# MLflow: one parent run per `snakemake` invocation, one child run per job (rloo_workflow/tracking/).
# The handlers run in the main process only, and not for dry runs (-n) or when nothing is to be
# done. onstart creates the store and the experiment once (before any job, so jobs never race on a
# new SQLite database) and the "pipeline" run, and exports to the jobs (sbatch passes the
# environment on): MLFLOW_TRACKING_URI (absolute), RLOO_MLFLOW_PARENT_RUN_ID, RLOO_MLFLOW_RUNS_DIR
# (run ids: <paths.results>/runs/<stage>.json), and RLOO_TRACKING=0 when tracking.enabled is false.
# Snakemake keeps one handler of each kind: add other start/end work to these blocks.
# onsuccess also commits the run's outputs to DVC (rloo_workflow/dvc/commit.py: dvc.yaml, dvc.lock, the DVC cache;
# one `dvc` process, here in the main process, never in the jobs; skipped outside a DVC repository); onerror
# names the command that brings back what a failed run deleted (rloo_workflow/dvc/restore.py).
# The run records itself first, and removes its record last (rloo_workflow/running.py): a run killed with
# SIGKILL leaves it behind with Snakemake's lock, and `rloo why-rerun` tells whether that run is alive.
from rloo_workflow import dvc as _dvc
from rloo_workflow import running as _running
from rloo_workflow import tracking as _tracking
from rloo_workflow.config import export_resolved as _export_resolved
from rloo_workflow.run_record import record as _record_run


onstart:
    _running.start(Path.cwd(), local=workflow.local_exec)
    # The user's resolved config for every job (RLOO_RESOLVED_CONFIG): each stage reruns on its own keys
    # (--job-config) but sees, logs and hashes what the user ran.
    _export_resolved(config, f"{RESULTS}/runs/config.json")
    # what this run was given, for `rloo why-rerun` and `rloo dvc` without --configfile (rloo_workflow/run_record.py)
    _record_run(Path.cwd(), workflow.overwrite_configfiles or [], workflow.config_settings.config,
                workflow.dag_settings.targets)
    _tracking.start_pipeline(config, results_dir=RESULTS)


onsuccess:
    try:
        _tracking.end_pipeline("FINISHED", log)
        _dvc.commit_run(workflow, config)
    finally:
        _running.end(Path.cwd())


onerror:
    try:
        _tracking.end_pipeline("FAILED", log)
        # Snakemake deleted the failed jobs' outputs: the one command that brings back the last committed ones
        _dvc.say_where_outputs_are()
    finally:
        _running.end(Path.cwd())
