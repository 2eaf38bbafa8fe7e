"""Shared fixtures (the micro config; a prepared data set, SFT model and reward model built once per
test run, whatever the number of xdist workers), the file groups the workers share out, and the guard
that keeps slow tests out of the fast tier (docs/testing.md).

Layout: tests/unit (pure functions and classes), tests/integration (stages and trainers in-process on
the micro model), tests/e2e (a real external process or tool: Snakemake, DVC, MLflow, Slurm, torchrun,
vLLM, the CLI in subprocesses, signals), tests/helpers (modules the tests import, and scripts they or
a person run). This file, at tests/, applies to every folder below it. The folders are not packages
(no __init__.py; pytest's default `prepend` import mode puts each test file's own folder on sys.path),
so test file basenames must stay unique across them; tests/helpers goes on sys.path here, once, so any
test imports a helper by its plain name (`from workflow_helpers import make_copy`). A test file may
still import from another test file of its own folder (`from test_microbatch import _cfg`); what two
folders share lives in tests/helpers. `from conftest import copy_tree` works because pytest puts this
folder on sys.path when it loads this file."""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

# Threads that wait for work sleep rather than spin (libgomp reads this when torch loads it, so before
# any import of torch). Three workers and their subprocesses share two cores: a spinning thread burns
# the core another process needs, and its spin counts as CPU time to the fast tier's guard below. Under
# a full CI's load the spin took a test of about 2 s of work over the guard's 10 s; on the fast tier
# PASSIVE measured as fast or faster (docs/testing.md).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import pytest
from filelock import FileLock

from rloo_workflow.config import load_config

ROOT = Path(__file__).resolve().parents[1]
MICRO = ROOT / "config" / "micro.yaml"

# The helper modules (see the docstring): importable by name from every test folder.
HELPERS = str(Path(__file__).resolve().parent / "helpers")
if HELPERS not in sys.path:
    sys.path.insert(0, HELPERS)

# The packages' bytecode, written once by the controlling process before the workers start (make_copy
# copies it into each workflow copy, whose processes write none). Written whatever PYTHONDONTWRITEBYTECODE
# says (compileall is not the import system): where it is set for the whole machine, as on CI's, no process
# would write it, and every process of the suite compiled the package from source.
if not os.environ.get("PYTEST_XDIST_WORKER"):
    import compileall

    for _package in ("rloo", "rloo_workflow", "snakemake_logger_plugin_rloo"):
        compileall.compile_dir(ROOT / _package, quiet=1)

# No test may reach a model or data set hub.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
# MLflow: a test that runs a stage with tracking on logs into a throwaway store, never into the
# repository's mlflow.db; no pipeline run of the caller's environment leaks in.
_MLFLOW_DIR = tempfile.mkdtemp(prefix="rloo-tests-mlflow-")
atexit.register(shutil.rmtree, _MLFLOW_DIR, ignore_errors=True)
os.environ["MLFLOW_TRACKING_URI"] = f"sqlite:///{_MLFLOW_DIR}/mlflow.db"
for _var in ("RLOO_MLFLOW_PARENT_RUN_ID", "RLOO_MLFLOW_RUNS_DIR", "RLOO_TRACKING", "MLFLOW_RUN_ID"):
    os.environ.pop(_var, None)


@pytest.fixture
def micro_cfg() -> dict:
    return load_config(MICRO)


def shared_folder(tmp_path_factory: pytest.TempPathFactory, name: str, build: Callable[[Path], object]) -> Path:
    """A folder built once per test run by `build(folder)`, however many xdist workers ask for it.

    The workers' temporary folders share a parent; the first worker to ask builds under a file lock
    while the others wait, then everyone reads the same files. Tests treat it as read-only: one that
    changes what it finds works on a copy (`copy_tree`).
    """
    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent
    folder = root / "shared" / name
    folder.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(folder.parent / f"{name}.lock")):
        if not (folder / ".built").is_file():
            shutil.rmtree(folder, ignore_errors=True)
            folder.mkdir()
            build(folder)
            (folder / ".built").touch()
    return folder


def copy_tree(src: Path, dest: Path) -> Path:
    """A private, writable copy of a shared folder; modification times kept (Snakemake reads them)."""
    shutil.copytree(src, dest, symlinks=True, ignore=shutil.ignore_patterns(".built"))
    return dest


@pytest.fixture(scope="session")
def micro_run(tmp_path_factory) -> dict:
    """prepare + base + sft on the micro config, built once per test run and shared read-only."""
    cfg = load_config(MICRO, {"tracking": {"enabled": False}})

    def build(base: Path) -> None:
        from rloo_workflow.stages import base as base_stage
        from rloo_workflow.stages import prepare, sft

        prepare.run(cfg, base / "data")
        base_stage.run(cfg, base / "data", base / "base_model")
        metrics = sft.run(cfg, base / "data", base / "base_model", base / "sft", base / "work" / "sft")
        (base / "sft_metrics.json").write_text(json.dumps(metrics))

    base = shared_folder(tmp_path_factory, "micro", build)
    metrics = json.loads((base / "sft_metrics.json").read_text())
    return {"cfg": cfg, "base": base, "data": base / "data", "base_model": base / "base_model", "sft": base / "sft",
            "sft_metrics": metrics}


@pytest.fixture(scope="session")
def micro_reward(micro_run, tmp_path_factory) -> Path:
    """The micro reward model, trained once: a training reward with spread on the micro policy (the
    verifier pays 0 to everything that policy writes, so an RLOO step on it changes no weight)."""

    out = micro_run["base"] / "reward"  # beside the data and SFT model it was trained from

    def build(_marker: Path) -> None:
        from rloo_workflow.stages import reward

        shutil.rmtree(out, ignore_errors=True)  # a build that died half-way
        reward.run(micro_run["cfg"], micro_run["data"], micro_run["sft"], out)

    shared_folder(tmp_path_factory, "micro_reward", build)
    return out


@pytest.fixture(scope="session")
def micro_workflow(tmp_path_factory) -> dict:
    """One real Snakemake run of the micro pipeline, untracked (the default target: results/gsm8k_rloo.json
    and the toy experiment, plus results/gsm8k_grpo.json, a second estimator sharing prepare/sft/reward),
    in an isolated working copy (tests/helpers/workflow_helpers.py), built once per test run. Tests that run
    more of the workflow take their own copy (`copy_tree`): Snakemake's records come along, so the copy
    has nothing left to do (tests/e2e/test_workflow.py checks it)."""
    from workflow_helpers import CONFIGFILES, make_copy, snakemake

    def build(folder: Path) -> None:
        copy = make_copy(folder / "wf")
        t0 = time.monotonic()
        res = snakemake(copy, "all", "results/gsm8k_grpo.json", "--cores", "1", *CONFIGFILES, timeout=1200)
        (folder / "snakemake.out").write_text(res.stdout + res.stderr)
        (folder / "seconds").write_text(f"{time.monotonic() - t0:.1f}")

    folder = shared_folder(tmp_path_factory, "workflow", build)
    return {"copy": folder / "wf", "output": (folder / "snakemake.out").read_text(),
            "seconds": float((folder / "seconds").read_text())}


@pytest.fixture(scope="session")
def tracked_workflow(tmp_path_factory) -> dict:
    """The micro pipeline's default target through Snakemake with MLflow tracking on, in a git repository
    of its own copy with the project's DVC files (tests/helpers/tracking_helpers.py), built once per test
    run: test_tracking audits its runs, test_dvc works on a copy of its DVC commit, test_reproducible holds
    its outputs to `micro_workflow`'s untracked ones, byte for byte."""
    from tracking_helpers import run_tracked_workflow

    def build(folder: Path) -> None:
        (folder / "run.json").write_text(json.dumps(run_tracked_workflow(folder)))

    folder = shared_folder(tmp_path_factory, "tracked_workflow", build)
    wf = folder / "wf"
    return {"wf": wf, "uri": f"sqlite:///{wf / 'mlflow.db'}", **json.loads((folder / "run.json").read_text())}


# -- tiers and workers ----------------------------------------------------------------------------------
# An unmarked test whose own time (its call, not the shared fixtures it sets up; CPU time, its waited-for
# subprocesses included, so that a loaded machine does not stretch it) passes this many seconds fails
# and names itself: the fast tier (`scripts/test.sh --fast`, `-m "not slow"`) stays fast because a
# slow test cannot join it unnoticed. RLOO_UNMARKED_LIMIT_S changes the limit (0: off).
UNMARKED_LIMIT_S = float(os.environ.get("RLOO_UNMARKED_LIMIT_S", "10"))
WALL_FACTOR = 3  # ... or whose wall time passes 3 times that (it waits rather than works)

# The order of the files is pytest-xdist's own (--loadscope-reorder, its default: files with more tests
# first). A heaviest-first order (--no-loadscope-reorder and the files sorted by their seconds in CI)
# was measured slower on two cores: 1,287 s of pytest against 1,148 s, one CI run each from a clean
# clone. It starts the multi-process files (Slurm's two-task jobs, torchrun, the shared Snakemake runs)
# together, and their processes then wait on each other for the cores; xdist's order mixes them with
# unit files.
# Grouping the long files that hold few tests (test_smollm2, test_crash_safety; sent last by xdist)
# with a file on their subject, so that they go out earlier, gave 1,276 s against 1,202 s: no better
# within the runs' spread (1,148 s and 1,202 s for the same order).

# Files that share the one-node Slurm cluster run on one worker, one after the other.
SLURM_FILES = ("test_slurm_smoke", "test_workflow_slurm", "test_slurm_distributed")


def _group(item: pytest.Item) -> str:
    stem = item.path.stem
    return "slurm" if stem in SLURM_FILES else stem


def pytest_itemcollected(item):
    # One xdist group per file (module fixtures are built once), the Slurm files in one group. Set
    # here, while collecting: xdist reads the marks in its own pytest_collection_modifyitems.
    if not item.get_closest_marker("xdist_group"):
        item.add_marker(pytest.mark.xdist_group(_group(item)))


# -- the stage server ------------------------------------------------------------------------------------
# Each pytest process starts one (tests/helpers/stage_server.py): the `rloo <stage>` processes the tests
# start, directly, through Snakemake or as torchrun's workers, fork from an interpreter that has already
# imported torch, transformers and MLflow, instead of spending ~6.6 CPU-s importing them each
# (docs/testing.md). tests/helpers/served/sitecustomize.py, on PYTHONPATH for every process the tests
# start, makes such a command its client. A command whose environment differs where it matters runs as
# before. RLOO_TEST_STAGE_SERVER=0 turns it off.
_STAGE_SERVER: dict[str, object] = {}


@pytest.fixture(scope="session", autouse=True)
def stage_server(tmp_path_factory):
    import stage_server as ss

    if os.environ.get("RLOO_TEST_STAGE_SERVER", "1") == "0":
        os.environ.pop(ss.ENV_VAR, None)
        yield None
        return
    # What rloo.runtime.setup puts into this process's environment once an in-process test runs a stage,
    # and scikit-learn once a test imports it: set before the server starts, so that later commands'
    # environments still match its own (a CI run's worker was declined 14 commands). What the server's
    # own imports write (threadpoolctl's KMP_DUPLICATE_LIB_OK) it allows for itself.
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("KMP_INIT_AT_FORK", "FALSE")
    folder = Path(tempfile.mkdtemp(prefix="rloo-stage-server-"))
    sock = str(folder / "socket")
    # Its log (the commands it declined, and why) beside the test run's temporary folders.
    log_path = tmp_path_factory.getbasetemp() / f"stage_server_{os.environ.get('PYTEST_XDIST_WORKER', 'main')}.log"
    with open(log_path, "w") as log:
        # Commands sent before it listens run as before (the client falls back): no wait here.
        proc = subprocess.Popen([sys.executable, "-u", ss.__file__, sock], cwd=ROOT,
                                stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT)
    os.environ[ss.ENV_VAR] = sock
    # the sitecustomize.py that hands `rloo` commands to the server, beside it
    served = str(Path(ss.__file__).parent / "served")
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (served, os.environ.get("PYTHONPATH")) if p)
    _STAGE_SERVER["socket"] = sock
    yield sock
    _STAGE_SERVER.clear()
    os.environ.pop(ss.ENV_VAR, None)
    proc.terminate()
    proc.wait(timeout=30)
    shutil.rmtree(folder, ignore_errors=True)


def without_stage_server() -> dict[str, str]:
    """The environment less the stage server: for a test that walks the process tree of the command it
    starts (a forked command's processes hang below the server, not below the client)."""
    from stage_server import ENV_VAR

    return {k: v for k, v in os.environ.items() if k != ENV_VAR}


def _cpu_seconds() -> float:
    """CPU time of this process and of its children waited for, the stage server's forked processes
    included: unlike wall time, not stretched when the other worker (or anything else) shares the cores."""
    own, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    served = 0.0
    if sock := _STAGE_SERVER.get("socket"):
        from stage_server import cpu_seconds

        with contextlib.suppress(OSError):  # not listening yet: it has forked nothing
            served = cpu_seconds(str(sock))
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime + served


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_setup(item):
    t0 = _cpu_seconds()
    yield
    item.setup_cpu_seconds = _cpu_seconds() - t0


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item):
    t0 = _cpu_seconds()
    yield
    item.cpu_seconds = _cpu_seconds() - t0


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    cpu = getattr(item, "cpu_seconds", 0.0)
    # the phase's CPU seconds travel with the report (pytest-xdist sends a report's attributes to the
    # controller), for the summary of where the time went below
    report.cpu_seconds = {"setup": getattr(item, "setup_cpu_seconds", 0.0), "call": cpu}.get(report.when, 0.0)
    # CPU time for work; wall time, with room for a loaded machine, for waiting (a server, a queue). The
    # wall limit grows with the machine's load (runnable processes per core): a test that works for 5 s
    # of CPU on a machine three times oversubscribed takes 15 s of wall without waiting on anything.
    # (RLOO_UNMARKED_LOAD fixes it: tests/e2e/test_tiers.py checks the guard itself on a loaded machine.)
    load = max(1.0, float(os.environ.get("RLOO_UNMARKED_LOAD") or os.getloadavg()[0] / (os.cpu_count() or 1)))
    if (UNMARKED_LIMIT_S > 0 and report.when == "call" and report.passed and item.get_closest_marker("slow") is None
            and (cpu > UNMARKED_LIMIT_S or report.duration > WALL_FACTOR * UNMARKED_LIMIT_S * load)):
        report.outcome = "failed"
        report.longrepr = (f"{item.nodeid} took {cpu:.1f} CPU-seconds of its own (wall {report.duration:.1f} s at load {load:.1f}), "
                           f"over the fast tier's {UNMARKED_LIMIT_S:g} s: mark it @pytest.mark.slow or make it "
                           "faster (tests/conftest.py, docs/testing.md)")


# -- where the time went --------------------------------------------------------------------------------
# With --durations (CI's full run), the session ends with each xdist group's seconds: on --dist loadgroup a
# group runs on one worker, so the longest group is a floor on the suite's wall time, and what a worker
# does once the others are idle (the tail) shows in the groups' end times. Wall seconds of every phase
# (a shared fixture's build counts to the test that asked first), CPU seconds of setups and calls (this
# process, its waited-for children and the stage server's forks), and when the group ran, from the
# session's start. The controller (or the one process of -n 0) collects the workers' reports.
_SESSION_T0 = time.time()
_GROUPS: dict[str, dict] = {}
_PHASES: list[tuple[float, float, str]] = []  # (CPU seconds, wall seconds, "phase nodeid") of every setup and call


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if os.environ.get("PYTEST_XDIST_WORKER"):
        return
    group = report.nodeid.rsplit("@", 1)[1] if "@" in report.nodeid else report.nodeid.split("::")[0]
    node = getattr(report, "node", None)
    worker = node.gateway.id if node is not None else "main"
    g = _GROUPS.setdefault(group, {"worker": worker, "tests": 0, "wall": 0.0, "cpu": 0.0, "from": report.start,
                                   "to": report.stop})
    g["tests"] += report.when == "call"
    g["wall"] += report.duration
    g["cpu"] += getattr(report, "cpu_seconds", 0.0)
    g["from"], g["to"] = min(g["from"], report.start), max(g["to"], report.stop)
    if report.when != "teardown":
        _PHASES.append((getattr(report, "cpu_seconds", 0.0), report.duration, f"{report.when:<5} {report.nodeid}"))


def pytest_terminal_summary(terminalreporter, exitstatus, config) -> None:
    if config.getoption("durations", None) is None or not _GROUPS or os.environ.get("PYTEST_XDIST_WORKER"):
        return
    tr = terminalreporter
    tr.write_sep("=", "where the time went: the 25 longest xdist groups (seconds; from, to: since the session began)")
    tr.write_line(f"{'group':<32} {'worker':>6} {'tests':>5} {'wall':>7} {'CPU':>7} {'from':>6} {'to':>6}")
    for name, g in sorted(_GROUPS.items(), key=lambda kv: -kv[1]["wall"])[:25]:
        tr.write_line(f"{name:<32} {g['worker']:>6} {g['tests']:>5} {g['wall']:7.1f} {g['cpu']:7.1f} "
                      f"{g['from'] - _SESSION_T0:6.0f} {g['to'] - _SESSION_T0:6.0f}")
    for worker in sorted({g["worker"] for g in _GROUPS.values()}):
        mine = [g for g in _GROUPS.values() if g["worker"] == worker]
        tr.write_line(f"worker {worker}: {len(mine)} groups, {sum(g['wall'] for g in mine):.0f} s of tests, "
                      f"{sum(g['cpu'] for g in mine):.0f} CPU-s, its last test ended at "
                      f"{max(g['to'] for g in mine) - _SESSION_T0:.0f} s")
    # CPU, not wall: on two saturated cores the suite's wall time follows its CPU seconds
    tr.write_sep("-", "the 20 setups and calls with the most CPU seconds")
    for cpu, wall, what in sorted(_PHASES, reverse=True)[:20]:
        tr.write_line(f"{cpu:7.1f} CPU-s {wall:7.1f} s  {what}")
