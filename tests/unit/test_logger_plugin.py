"""The profiles' Snakemake logger plugin (snakemake_logger_plugin_rloo, `--logger rloo`) as Snakemake sets it up:
its real LoggerManager with the plugin found by Snakemake's own plugin registry, fed records shaped as
Snakemake logs them (snakemake/jobs.py, exceptions.py, workflow.py), next to the same records through
Snakemake's own terminal handler. It leaves out what the "Error in rule" block repeats and the scheduler's
lines; whatever it does not recognise, a reworded line or an error of another kind, it prints as Snakemake
does: more, never less. tests/e2e/test_reward_plugins.py counts a real failed run's lines."""

from __future__ import annotations

import argparse
import logging

import pytest
from snakemake.logging import LoggerManager
from snakemake.settings.types import OutputSettings
from snakemake_interface_logger_plugins.common import LogEvent
from snakemake_interface_logger_plugins.registry import LoggerPluginRegistry

SHELLCMD = "rloo train @.rloo/args/rloo-1 --log logs/rloo_rloo.log"


def rule_exception(cmd: str = SHELLCMD, kind: str = "CalledProcessError") -> tuple:
    return (logging.ERROR, f"RuleException:\n{kind} in file \"workflow/rules/rloo.smk\", line 25:\n"
            f"Command 'set -euo pipefail;  {cmd}' returned non-zero exit status 2.",
            {"event": LogEvent.ERROR, "exception": "RuleException"})


def job_error(cmd: str = SHELLCMD) -> tuple:
    return (logging.ERROR, "Error in rule rloo, jobid: 8", {
        "event": LogEvent.JOB_ERROR, "rule_name": "rloo", "rule_msg": None, "jobid": 8,
        "input": ["data/train.jsonl"], "output": ["results/models/rloo_rloo"], "log": ["logs/rloo_rloo.log"],
        "conda_env": None, "container_img": None, "aux": {}, "indent": False, "shellcmd": cmd})


JOB_INFO = (logging.INFO, None, {
    "event": LogEvent.JOB_INFO, "jobid": 8, "rule_msg": None, "rule_name": "rloo", "local": True,
    "is_checkpoint": False, "input": ["data/train.jsonl"], "output": ["results/models/rloo_rloo"],
    "log": ["logs/rloo_rloo.log"], "benchmark": None, "reason": "Missing output files", "wildcards": {},
    "priority": 0, "threads": 1, "resources": {"_cores": 1, "_nodes": 1, "mem_mb": 32000, "gpu": 1},
    "indent": False, "is_handover": False})


def printed(records: list[tuple], capsys, plugin: bool = True) -> list[str]:
    """The terminal's lines (timestamps left out) once Snakemake's logging has taken `records` and shut down."""
    capsys.readouterr()
    handlers = {"rloo": LoggerPluginRegistry().get_plugin("rloo").get_settings(argparse.Namespace())} if plugin else {}
    logger = logging.getLogger(f"test_logger_plugin.{plugin}")
    manager = LoggerManager(logger, OutputSettings(log_handler_settings=handlers, nocolor=True))
    assert bool(manager.plugin_handlers) == plugin
    for level, msg, extra in records:
        logger.log(level, msg, extra=extra)
    manager.stop()
    err = capsys.readouterr().err
    return [line for line in err.splitlines() if line.strip() and not line.startswith("[")]


def test_a_failed_commands_rule_exception_is_left_out_where_the_error_block_repeats_it(capsys):
    ours = printed([rule_exception(), job_error()], capsys)
    snakemakes = printed([rule_exception(), job_error()], capsys, plugin=False)
    assert sum(SHELLCMD in line for line in snakemakes) == 2 and sum(SHELLCMD in line for line in ours) == 1
    # the block as Snakemake prints it: rule, output, log, the command; less its "message: None"
    assert ours == [line for line in snakemakes[3:] if line.strip() != "message: None"], ours
    assert "Error in rule rloo:" in ours and "    output: results/models/rloo_rloo" in ours


@pytest.mark.parametrize("records", [
    [rule_exception(), job_error("another command")],  # not the command the block names
    [rule_exception(kind="ZeroDivisionError"), job_error()],  # a `run:` block's error, its frames
    [rule_exception(), JOB_INFO],  # no error block follows
    [rule_exception()],  # nothing follows: printed as logging stops
], ids=["other-command", "other-error", "then-a-job", "last"])
def test_a_rule_exception_the_error_block_does_not_repeat_is_printed(capsys, records):
    ours = printed(records, capsys)
    assert ours[:3] == printed(records[:1], capsys, plugin=False), ours


def test_the_schedulers_lines_are_left_out_and_a_reworded_one_is_printed(capsys):
    lines = ["Select jobs to execute...", "Using shell: /usr/bin/bash", "Building DAG of jobs...",
             "Select the jobs to execute..."]
    assert printed([(logging.INFO, line, {}) for line in lines], capsys) == lines[2:]


def test_a_job_block_is_snakemakes_with_its_resources(capsys):
    ours = printed([JOB_INFO], capsys)
    assert ours == printed([JOB_INFO], capsys, plugin=False)
    assert any(line.strip().startswith("resources: ") and "mem_mb=32000" in line for line in ours), ours


def test_an_error_of_one_line_is_one_line_and_of_more_as_snakemake_prints_it(capsys):
    one = (logging.ERROR, "WorkflowError:\nConfig file nope.yaml not found.",
           {"event": LogEvent.ERROR, "exception": "WorkflowError"})
    assert printed([one], capsys) == ["WorkflowError: Config file nope.yaml not found."]
    more = (logging.ERROR, 'WorkflowError in file "Snakefile", line 3:\nbad\n  File "Snakefile", line 3, in <module>',
            {"event": LogEvent.ERROR, "exception": "WorkflowError"})
    assert printed([more], capsys) == printed([more], capsys, plugin=False) == more[1].splitlines()
