"""The code fingerprint's walk misses nothing a stage runs (rloo_workflow/code_fingerprint.py).

The fingerprint of `rloo <verb>` counts the definitions a static walk from the stage's module and the
CLI reaches; a definition the stage runs but the walk misses would let an edit to it rerun nothing.
Here each stage of the micro chain runs through `rloo_workflow.cli.main` in this process under a profiler, with
every module of the package imported first (so what runs is the stages' work, not import-time code),
and every function of the package it calls must belong to a definition its fingerprint counts.
"""

from __future__ import annotations

import contextlib
import importlib
import pkgutil
import sys
import threading
from pathlib import Path

import pytest

import rloo
import rloo_workflow
from rloo_workflow import cli
from rloo_workflow.code_fingerprint import installed
from rloo_workflow.pipeline import BY_VERB

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
MICRO = str(ROOT / "config" / "micro.yaml")


def _import_everything() -> None:
    for mod in [*pkgutil.walk_packages(rloo.__path__, "rloo."),
                *pkgutil.walk_packages(rloo_workflow.__path__, "rloo_workflow.")]:
        if mod.name.endswith("__main__"):  # a command, run on import
            continue
        with contextlib.suppress(ImportError):  # an optional engine (vLLM) this venv lacks
            importlib.import_module(mod.name)


def _called(argv: list[str]) -> set[tuple[str, str]]:
    """(module, definition) of every package function `rloo ARGV` calls in this process."""
    code = installed()
    seen: set[tuple[str, int]] = set()
    packages = tuple(str(d) for d in code.package_dirs)

    def profile(frame, event, arg):
        if event == "call" and frame.f_code.co_filename.startswith(packages):
            seen.add((frame.f_code.co_filename, frame.f_code.co_firstlineno))

    sys.setprofile(profile)
    threading.setprofile(profile)
    try:
        assert cli.main(argv) == 0, argv
    finally:
        sys.setprofile(None)
        threading.setprofile(None)
    out = set()
    for filename, line in seen:
        module = code.module_of(filename)
        if module is not None:
            out.add((module, code.owner(module, line)))
    return out


def test_every_function_a_stage_calls_is_in_its_fingerprint(tmp_path, monkeypatch):
    _import_everything()
    monkeypatch.chdir(tmp_path)
    common = ["-c", MICRO, "--set", "tracking.enabled=false"]
    data, models = "data", "models"
    chain = [
        ("prepare", ["--out", data]),
        ("base", ["--data", data, "--out", f"{models}/base"]),
        ("sft", ["--data", data, "--base", f"{models}/base", "--out", f"{models}/sft", "--work", "work/sft"]),
        ("reward", ["--data", data, "--policy", f"{models}/sft", "--out", f"{models}/reward", "--work", "work/reward"]),
        # on the reward model, so that its scoring runs too
        ("train", ["--data", data, "--policy", f"{models}/sft", "--reward-model", f"{models}/reward",
                   "--set", "reward.source=model", "--out", f"{models}/rloo", "--work", "work/rloo"]),
        *(("evaluate", ["--data", data, "--sft", f"{models}/sft", "--policy", f"{name}={models}/{name}",
                        "--reward-model", f"{models}/reward", "--out", f"results/eval/{name}.jsonl"])
          for name in ("base", "rloo")),
        ("evaluate", ["--data", data, "--sft", f"{models}/sft", "--policy", f"sft={models}/sft",
                      "--reward-model", f"{models}/reward", "--out", "results/eval/sft.jsonl"]),
        ("report", ["--data", data, "--policy", "rloo=results/eval/rloo.jsonl", "--sft", "results/eval/sft.jsonl",
                    "--base", "results/eval/base.jsonl", "--training", f"{models}/rloo",
                    "--out", "results/gsm8k_rloo.json"]),
    ]
    missed = {}
    for verb, args in chain:
        called = _called([verb, *common, *args])
        counted = set(installed().stage_keys(BY_VERB[verb].name))
        assert called, verb
        if gaps := sorted(called - counted):
            missed[verb] = gaps
    summary = _called(["summary", "results/gsm8k_rloo.json"])
    assert summary <= set(installed().stage_keys("summary")) or pytest.fail(f"summary: {summary}")
    assert not missed, f"called but not in the stage's code fingerprint: {missed}"
