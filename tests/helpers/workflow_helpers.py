"""Helpers for the Snakemake tests: an isolated working copy of the workflow, and running `snakemake`.

Isolation: the tests never run Snakemake in the repository. `make_copy` copies what the workflow
needs (Snakefile, workflow/, config/, the profiles slurm/ and profiles/default/, the `rloo` package
sources, the profiles' logger plugin snakemake_logger_plugin_rloo) into a temporary folder; Snakemake
runs there (`cwd`), so data/, results/, logs/, .snakemake/ and the MLflow store all land in the copy.
PYTHONPATH points at the copy, so the Snakefile and every `rloo <stage>` job import the copied package: the code fingerprints
(rloo_workflow.code_fingerprint) are the copy's, and editing a file of it really changes the code the stage runs,
without touching the repository.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
VENV_BIN = Path(sys.executable).parent

# Tracking is another stage's concern; the workflow tests run untracked (one MLflow run per job
# would cost a few seconds each). Passed after config/micro.yaml: `--configfile micro.yaml test.yaml`.
TEST_CONFIG = "tracking: {enabled: false}\n"
CONFIGFILES = ["--configfile", "config/micro.yaml", "config/test.yaml"]

# Every stage of results/gsm8k_rloo.json (rule names), and its jobs: an evaluation per policy (the base
# model, SFT, RLOO's), then the report.
JOBS = {"prepare": 1, "base": 1, "sft": 1, "reward": 1, "rloo": 1, "evaluate": 3, "report": 1}
PIPELINE = set(JOBS)
# The stages that ask for no GPU: a data build, a download/copy/dequantisation of the starting model, and
# the report, which loads no model.
CPU_RULES = {"prepare", "base", "report"}


def make_copy(dest: Path) -> Path:
    """A working copy of the workflow in `dest` (see the module docstring)."""
    dest.mkdir(parents=True, exist_ok=True)
    # The bytecode comes along (tests/conftest.py compiles the packages once per run): copied with their
    # sources' modification times, the .pyc files stay valid for every file the test leaves alone, and a
    # file it edits is newer than its .pyc, so Python compiles it afresh. Without them each process of each
    # copy compiled every module it imported (PYTHONDONTWRITEBYTECODE, env_for): about 5 % of a
    # Snakemake test's CPU (py-spy over tests/e2e/test_workflow.py).
    ignore = shutil.ignore_patterns(".snakemake")
    shutil.copy2(ROOT / "Snakefile", dest / "Snakefile")
    for name in ("workflow", "config", "slurm", "profiles", "rloo", "rloo_workflow", "snakemake_logger_plugin_rloo"):
        shutil.copytree(ROOT / name, dest / name, ignore=ignore)
    (dest / "config" / "test.yaml").write_text(TEST_CONFIG)
    return dest


# tests/conftest.py's stage server takes `rloo` commands from a process whose PYTHONPATH holds this folder
SERVED = Path(__file__).resolve().parent / "served"


def pythonpath(*paths: str | Path) -> str:
    """PYTHONPATH for a command a test starts: `paths`, then the stage server's client hook while the
    session has a server (tests/helpers/served/sitecustomize.py)."""
    served = [str(SERVED)] if os.environ.get("RLOO_STAGE_SERVER") else []
    return os.pathsep.join([*map(str, paths), *served])


def env_for(copy: Path) -> dict[str, str]:
    """The environment of a Snakemake run in `copy`: the venv's tools first, the copy's package."""
    env = dict(os.environ)
    env.update(
        PATH=str(VENV_BIN) + os.pathsep + env.get("PATH", ""),
        VIRTUAL_ENV=sys.prefix,
        PYTHONPATH=pythonpath(copy),
        HF_HUB_OFFLINE="1",
        HF_DATASETS_OFFLINE="1",
        PYTHONDONTWRITEBYTECODE="1",
    )
    env.pop("MLFLOW_RUN_ID", None)
    return env


GIT_ENV = {"GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@example.org", "GIT_COMMITTER_NAME": "t",
           "GIT_COMMITTER_EMAIL": "t@example.org", "GIT_CONFIG_GLOBAL": os.devnull}
# What the project versions for DVC (the rest comes from make_copy).
DVC_FILES = (".dvc/config", ".dvc/.gitignore", ".dvcignore", ".gitignore", "dvc.yaml", "params.yaml")


def tool(repo: Path, *cmd: str, check: bool = True, timeout: float = 600) -> subprocess.CompletedProcess:
    """Run a tool of the venv (dvc, git, ...) in `repo` with the copy's environment and a throwaway git identity."""
    exe = VENV_BIN / cmd[0]
    argv = [str(exe) if exe.exists() else cmd[0], *cmd[1:]]
    env = {**env_for(repo), **GIT_ENV, "DVC_NO_ANALYTICS": "1"}
    res = subprocess.run(argv, cwd=repo, env=env, capture_output=True, text=True, timeout=timeout)
    if check and res.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} exited {res.returncode}:\n{res.stdout[-3000:]}\n{res.stderr[-5000:]}")
    return res


def add_dvc_files(copy: Path) -> Path:
    """The project's DVC files in the working copy: once it is a git repository, a run in it commits to DVC."""
    for name in DVC_FILES:
        (copy / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / name, copy / name)
    return copy


def make_dvc_repo(copy: Path) -> Path:
    """The working copy made a git repository with the project's DVC files: a run in it commits to DVC."""
    add_dvc_files(copy)
    tool(copy, "git", "init", "-q")
    tool(copy, "git", "add", "-A")
    tool(copy, "git", "commit", "-qm", "project")
    return copy


SERVED_SNAKEMAKE = Path(__file__).resolve().parent / "served_snakemake.py"


def snakemake_bin() -> str:
    candidate = VENV_BIN / "snakemake"
    return str(candidate) if candidate.exists() else (shutil.which("snakemake") or "snakemake")


def snakemake(copy: Path, *args: str, timeout: float = 600, check: bool = True,
              env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """Run `snakemake ARGS` in `copy` (`env`: variables set on top of `env_for(copy)`); with `check`, fail
    with its output if it exits non-zero."""
    # snakemake.cli.main through the stage server (served_snakemake.py): the `snakemake` command's own
    # function, without importing Snakemake and its plugins again for each of the suite's many runs
    res = subprocess.run(
        [sys.executable, str(SERVED_SNAKEMAKE), *args], cwd=copy, env={**env_for(copy), **(env or {})},
        capture_output=True, text=True, timeout=timeout
    )
    if check and res.returncode != 0:
        raise AssertionError(f"snakemake {' '.join(args)} exited {res.returncode}:\n{res.stdout[-4000:]}\n"
                             f"{res.stderr[-8000:]}")
    return res


_STATS_ROW = re.compile(r"^(\w+)\s+(\d+)$")


def job_counts(output: str) -> dict[str, int]:
    """{rule: jobs} from the "Job stats" table Snakemake prints (without `all` and `total`)."""
    counts: dict[str, int] = {}
    lines = output.splitlines()
    for i, line in enumerate(lines):
        if line.strip() == "Job stats:":
            for row in lines[i + 1 :]:
                m = _STATS_ROW.match(row.strip())
                if row.strip().startswith("job") or set(row.strip()) <= {"-", " "}:
                    continue
                if not m:
                    break
                if m.group(1) not in ("all", "total"):
                    counts[m.group(1)] = int(m.group(2))
            break
    return counts


def planned(copy: Path, *targets: str, extra_config: str | None = None) -> dict[str, int]:
    """The jobs a dry run for `targets` (default: the default target) would run; {} if none.

    `extra_config`: YAML merged on top of the test config (written to config/extra.yaml).
    """
    configfiles = list(CONFIGFILES)
    if extra_config is not None:
        (copy / "config" / "extra.yaml").write_text(extra_config)
        configfiles.append("config/extra.yaml")
    # Targets first: --quiet and --configfile take several values.
    res = snakemake(copy, *targets, "-n", "--quiet", "rules", *configfiles)
    out = res.stdout + res.stderr
    if "Nothing to be done" in out:
        return {}
    counts = job_counts(out)
    assert counts, f"no job table in the dry run's output:\n{out[-3000:]}"
    return counts


def plans(copy: Path, runs: list[list[str]], timeout: float = 900) -> list[dict[str, int]]:
    """The jobs each of `runs` (argument lists of `snakemake -n`) would run, {} if none: all of them in one
    process (tests/helpers/snakemake_plans.py), for a test that asks for dozens of plans of the same code."""
    args_file = copy / ".snakemake_plans.json"
    args_file.write_text(json.dumps(runs))
    res = subprocess.run([sys.executable, str(Path(__file__).with_name("snakemake_plans.py")), str(args_file)],
                         cwd=copy, env=env_for(copy), capture_output=True, text=True, timeout=timeout)
    assert res.returncode == 0, res.stderr[-5000:]
    out, failed = [], []
    for args, run in zip(runs, json.loads(res.stdout), strict=True):
        text = run["output"]
        counts = {} if "Nothing to be done" in text else job_counts(text)
        if run["code"] not in (0, None) or not (counts or "Nothing to be done" in text):
            failed.append(f"snakemake {' '.join(args)} exited {run['code']}:\n{text[-2000:]}")
        out.append(counts)
    assert not failed, "\n\n".join(failed)  # every failed run at once
    return out


def same_weights(a: Path, b: Path) -> bool:
    """Whether two saved policies hold exactly the same weights (a resumed run against an uninterrupted one)."""
    import torch

    from rloo.model import models

    sa, sb = models.load_causal_lm(a).state_dict(), models.load_causal_lm(b).state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)
