"""The literal cluster command, `snakemake --profile slurm results/gsm8k_rloo.json`, on a real Slurm.

Runs in an isolated working copy of the workflow (tests/helpers/workflow_helpers.py) that holds the repo's
`slurm/` profile, so `--profile slurm` resolves to ./slurm exactly as from the repository root. Added
to the literal command: the micro config, an earlier first status check, and memory requests that fit
the one-node test cluster. Needs the cluster of tests/slurm/start.sh (selection as in
test_slurm_smoke.py: RLOO_SLURM=1 requires it, RLOO_SLURM=0 skips, unset runs if one answers).
"""

from __future__ import annotations

import json
import re
import time

import pytest
from test_slurm_smoke import _sacct, run_on_slurm, slurm_env  # noqa: F401  (slurm_env is a fixture)
from workflow_helpers import CONFIGFILES, CPU_RULES, PIPELINE, make_copy, snakemake, snakemake_bin

pytestmark = [pytest.mark.slurm, pytest.mark.slow]

LITERAL = ["--profile", "slurm", "results/gsm8k_rloo.json"]
TEST_OPTIONS = [
    # first sacct query 2 s after a submission instead of the profile's 30 s
    "--slurm-init-seconds-before-status-checks", "2",
    # the GPU stages ask for 16-32 GB; the test node may have less
    "--set-resources", "base:mem_mb=2000", "sft:mem_mb=2000", "reward:mem_mb=2000", "rloo:mem_mb=2000", "evaluate:mem_mb=2000",
    # last: --configfile takes several values
    *CONFIGFILES,
]
GPU_STAGES = PIPELINE - CPU_RULES


def test_literal_slurm_command_runs_every_stage_as_a_slurm_job(slurm_env, tmp_path):  # noqa: F811
    copy = make_copy(tmp_path / "wf")
    output, job_ids = run_on_slurm(copy, [snakemake_bin(), *LITERAL, *TEST_OPTIONS], 900,
                                   "snakemake --profile slurm results/gsm8k_rloo.json (micro)")

    result = json.loads((copy / "results/gsm8k_rloo.json").read_text())
    assert set(result["policies"]) == {"sft", "rloo"}

    # every stage ran as its own Slurm job, and Slurm accounted it as COMPLETED
    assert len(job_ids) == len(PIPELINE), output[-3000:]
    deadline = time.monotonic() + 30  # sacct may lag slurmctld by a second or two
    while True:
        rows = _sacct(job_ids, "State,Comment,AllocTRES")
        if all(rows.get(i, [""])[0] == "COMPLETED" for i in job_ids) or time.monotonic() > deadline:
            break
        time.sleep(1)
    assert all(rows.get(i, [""])[0] == "COMPLETED" for i in job_ids), rows
    # the plugin records the rule in the job comment: rule_<name>[_wildcards_<values>]
    by_rule = {re.match(r"rule_([a-z]+)", rows[i][1]).group(1): rows[i] for i in job_ids}
    assert set(by_rule) == PIPELINE, rows
    for rule, (_, _, tres) in by_rule.items():
        assert ("gres/gpu=1" in tres) == (rule in GPU_STAGES), (rule, tres)

    # the cluster run leaves nothing to do, under the same profile
    dry = snakemake(copy, *LITERAL, "-n", *CONFIGFILES)
    assert "Nothing to be done" in dry.stdout + dry.stderr
