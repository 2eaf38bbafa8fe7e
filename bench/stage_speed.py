"""Seconds of the embedded default's SFT and RLOO stages: this tree against an earlier commit, like for like.

The default chain's wall time depends on the day this VM has (a whole chain measured 12.4 min one day
and 21 min another, its untouched stages, prepare and toy, 40 % slower too): a change is judged by
running both trees here, in one invocation, on the same data and the same SFT policy, rounds
alternating their order, each round its own seed. Each tree runs its own config/config.yaml (the
embedded default as that commit defines it) through its own `rloo sft` / `rloo train`, shortened to
`--sft-steps` and `--rloo-steps` steps (no evaluation inside the timed loop: the stages' own
`<work>/timings.json` train_seconds).

    python bench/stage_speed.py --baseline ccde575 --json docs/figures/stage_speed.json
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.record import write  # noqa: E402


def _rloo(tree: Path, *args: str) -> None:
    env = {**os.environ, "PYTHONPATH": str(tree), "MLFLOW_TRACKING_URI": "", "HF_HUB_OFFLINE": "1"}
    cmd = [sys.executable, "-m", "rloo_workflow.cli", *args, "-c", str(tree / "config" / "config.yaml"),
           "--set", "tracking.enabled=false"]
    res = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=tree)
    if res.returncode:
        raise SystemExit(f"{' '.join(cmd)} exited {res.returncode}:\n{res.stderr[-3000:]}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--baseline", required=True, help="the git revision to compare with")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--sft-steps", type=int, default=150)
    ap.add_argument("--rloo-steps", type=int, default=30)
    ap.add_argument("--json", default=None)
    a = ap.parse_args()

    work = Path(tempfile.mkdtemp(prefix="rloo-stage-speed-"))
    t0 = time.time()
    trees = {"baseline": work / "baseline", "this tree": ROOT}
    figures: dict[str, dict[str, list[float]]] = {n: {"sft": [], "rloo": []} for n in trees}
    try:
        trees["baseline"].mkdir()
        archive = subprocess.run(["git", "archive", a.baseline], cwd=ROOT, capture_output=True, check=True).stdout
        subprocess.run(["tar", "-x", "-C", str(trees["baseline"])], input=archive, check=True)
        _rloo(ROOT, "prepare", "--out", str(work / "data"))
        # One starting model for both trees, built by this one: the same work, whatever each tree's base stage.
        _rloo(ROOT, "base", "--data", str(work / "data"), "--out", str(work / "base"))
        for r in range(a.rounds):
            order = list(trees) if r % 2 == 0 else list(trees)[::-1]
            for name in order:
                tree, tag = trees[name], f"{name.replace(' ', '_')}-{r}"
                sft_work = work / f"sftw-{tag}"
                _rloo(tree, "sft", "--set", f"sft.steps={a.sft_steps}", "--set", "sft.eval_examples=1",
                      "--set", f"seed={r}", "--data", str(work / "data"), "--base", str(work / "base"),
                      "--out", str(work / f"sft-{tag}"),
                      "--work", str(sft_work))
                figures[name]["sft"].append(json.loads((sft_work / "timings.json").read_text())["train_seconds"])
                # Every RLOO run starts from the same SFT policy: round 0's of this tree.
                policy = work / "sft-this_tree-0" if (work / "sft-this_tree-0").exists() else work / f"sft-{tag}"
                rl_work = work / f"rlw-{tag}"
                _rloo(tree, "train", "--set", f"rloo.steps={a.rloo_steps}", "--set", "rloo.eval_every=0",
                      "--set", "rloo.select=last", "--set", f"rloo.checkpoint_every={a.rloo_steps + 1}",
                      "--set", f"seed={r}", "--data", str(work / "data"), "--policy", str(policy),
                      "--out", str(work / f"rl-{tag}"), "--work", str(rl_work))
                figures[name]["rloo"].append(json.loads((rl_work / "timings.json").read_text())["train_seconds"])
                print(f"round {r} {name:9s}: sft {figures[name]['sft'][-1]:6.1f} s, rloo {figures[name]['rloo'][-1]:6.1f} s",
                      flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    mean = {n: {s: float(np.mean(v)) for s, v in f.items()} for n, f in figures.items()}
    ratio = {s: mean["this tree"][s] / mean["baseline"][s] for s in ("sft", "rloo")}
    print(json.dumps({"mean_seconds": mean, "this_tree_over_baseline": ratio}, indent=1))
    if a.json:
        write(a.json, {
            "baseline": a.baseline,
            "work": {"sft_steps": a.sft_steps, "rloo_steps": a.rloo_steps, "rounds": a.rounds},
            "mean_seconds": mean, "this_tree_over_baseline": ratio, "per_round": figures,
            "wall_seconds": round(time.time() - t0, 1)})


if __name__ == "__main__":
    main()
