"""DVC for the Snakemake workflow (`rloo dvc -h`, rloo_workflow/dvc/cli.py, says what it does):

    jobs.py     the pipeline's jobs for a config, from the project's declaration (what dvc.yaml is made of)
    dag.py      why Snakemake would run a job, read through its API (the one module using its internals)
    shell.py    a rule's shell command as a DVC stage command
    compile.py  the declared jobs -> dvc.yaml and params.yaml
    external.py model sources off the project (an installed package's GGUF file) pinned by hash
    driver.py   running `dvc` (status as JSON, unprotect, relink)
    restore.py  Snakemake's view made to agree with DVC's: mtimes in DAG order, stale records dropped
    commit.py   the outputs committed to the DVC cache: `rloo dvc commit`, and after every run
    cli.py      `rloo dvc ...` / `python -m rloo_workflow.dvc ...`
    dvcyaml.py  what they share: file names, DvcError, dvc.yaml as written
"""

from rloo_workflow.dvc.cli import main
from rloo_workflow.dvc.commit import commit, commit_run
from rloo_workflow.dvc.compile import build_pipeline, check, generate, split_params
from rloo_workflow.dvc.dag import SnakemakeApiError
from rloo_workflow.dvc.driver import changed_stages, dvc, is_dvc_repo
from rloo_workflow.dvc.dvcyaml import (
    DVC_YAML,
    LOCK,
    PARAMS,
    DvcError,
    covers,
    expand_stages,
    load_pipeline,
    stage_deps,
    stage_name,
    stage_outs,
)
from rloo_workflow.dvc.jobs import Dag, Job, declared_dag, toposort
from rloo_workflow.dvc.restore import missing_but_cached, restore, say_where_outputs_are
from rloo_workflow.dvc.shell import dvc_command

__all__ = [
    "DVC_YAML",
    "LOCK",
    "PARAMS",
    "Dag",
    "DvcError",
    "Job",
    "SnakemakeApiError",
    "build_pipeline",
    "changed_stages",
    "check",
    "commit",
    "commit_run",
    "covers",
    "declared_dag",
    "dvc",
    "dvc_command",
    "expand_stages",
    "generate",
    "is_dvc_repo",
    "load_pipeline",
    "main",
    "missing_but_cached",
    "restore",
    "say_where_outputs_are",
    "split_params",
    "stage_deps",
    "stage_name",
    "stage_outs",
    "toposort",
]
