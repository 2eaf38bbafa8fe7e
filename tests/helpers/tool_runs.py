"""The micro RLOO stage with the calculator on, run, repeated and resumed (issue 73): what the tests of
both rollout backends hold (tests/integration/test_tool_rollout.py for HF's loops, tests/e2e/test_vllm.py
for vLLM's engine)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from workflow_helpers import same_weights

from rloo.model import checkpoint

ROOT = Path(__file__).resolve().parents[2]


def steps_without_times(folder: Path) -> list[dict]:
    return [{k: v for k, v in json.loads(line).items() if not k.startswith("time/")}
            for line in (folder / "steps.jsonl").read_text().splitlines()]


def tool_config(off_policy: int, **sections: dict) -> dict:
    """config/micro.yaml with the calculator on, a reward with spread (so the weights move), 3 steps with
    a checkpoint after each, `rloo.off_policy_steps: off_policy`; `sections` are merged over it."""
    from rloo_workflow.config import load_config

    overrides = {
        "tracking": {"enabled": False}, "tools": {"enabled": [{}]},
        "reward": {"source": "function", "functions": [
            {"name": "shorter", "fn": f"{ROOT / 'tests' / 'helpers' / 'reward_functions.py'}:shorter"}]},
        "rloo": {"steps": 3, "checkpoint_every": 1, "eval_every": 0, "lr": 1e-3, "max_new_tokens": 48,
                 "off_policy_steps": off_policy},
        "rollout": {"sampler_threads": 1}}
    for name, keys in sections.items():
        overrides[name] = {**overrides.get(name, {}), **keys}
    return load_config(ROOT / "config" / "micro.yaml", overrides)


def check_repeats_and_resumes(cfg: dict, data: Path, sft: Path, tmp_path: Path, again: bool = True) -> list[dict]:
    """Runs the RLOO stage of `cfg` ("first"), again from scratch if `again` (the same steps.jsonl), and
    resumed from the first's step-1 checkpoint (the same last step, the same weights); asserts the policy
    called the tool and, off-policy, that the sampler ran in its own process; the first run is an MLflow run
    where `cfg` tracks. The first run's steps."""
    import contextlib

    from rloo_workflow import tracking
    from rloo_workflow.stages import rloo as rloo_stage

    def run(name: str):
        return rloo_stage.run(cfg, data, sft, tmp_path / name, tmp_path / f"w_{name}")

    # tracked where the config says so (the stage's MLflow run, as `rloo train` opens it)
    with (tracking.stage_run(cfg, "rloo", outputs=[tmp_path / "first"]) if cfg["tracking"]["enabled"]
          else contextlib.nullcontext()):
        run("first")
    first = steps_without_times(tmp_path / "first")
    assert len(first) == 3 and any(s["tool/calls_per_completion"] > 0 for s in first)  # the policy called the tool
    assert any(s["tool/forced_token_share"] > 0 for s in first) and all(0 <= s["tool/error_share"] <= 1 for s in first)
    if again:
        run("again")
        assert steps_without_times(tmp_path / "again") == first
    if cfg["rloo"]["off_policy_steps"]:  # the tools ran in the sampler's own process, not in inline sampling
        assert json.loads((tmp_path / "w_first" / "timings.json").read_text())["sampler"] == "process"
    ck = checkpoint.latest(tmp_path / "w_first" / "checkpoints")
    shutil.copytree(ck.parent / "step_00000001", tmp_path / "w_resumed" / "checkpoints" / "step_00000001")
    assert run("resumed")["resumed_from_step"] == 1
    assert steps_without_times(tmp_path / "resumed")[-1] == first[-1]
    assert same_weights(tmp_path / "first", tmp_path / "resumed")
    return first
