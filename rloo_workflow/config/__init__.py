"""The run's configuration: read (overlays), checked against the schema (checks), cut per stage (selection).
The names below are what stages, the CLI and the Snakefile use."""

from rloo.settings.selection import changed_keys, config_hash, select, with_overrides
from rloo_workflow.config.checks import validate
from rloo_workflow.config.overlays import (
    JOB_ARGS_DIR,
    JOB_CONFIG_DIR,
    RESOLVED_ENV,
    config_extends,
    declares_extends,
    deep_merge,
    export_resolved,
    job_args_file,
    job_config_file,
    load_config,
    parse_set,
    read_job_config,
    resolved_base,
)
from rloo_workflow.config.schema import SCHEMA_PATH, ConfigError, load_schema

__all__ = [
    "JOB_ARGS_DIR", "JOB_CONFIG_DIR", "RESOLVED_ENV", "SCHEMA_PATH", "ConfigError", "changed_keys", "config_extends", "config_hash", "declares_extends",
    "deep_merge",
    "export_resolved", "job_args_file", "job_config_file", "load_config", "load_schema", "parse_set", "read_job_config", "resolved_base", "select",
    "validate", "with_overrides",
]
