"""Sampler against trainer on real weights: the mismatch metrics for each sampler, trainer precision and
micro-batch budget, then RLOO at one seed with and without the rollout correction (issue 36, item 4).

    python bench/rollout_correction.py -c config/smollm2.yaml --data data/gsm8k --policy results/models/sft \
        --json docs/figures/rollout_correction.json

Every run is the RLOO stage itself (`rloo train`, its own process, tracking off), so the figures are the
`train/mismatch_*` metrics a user's run logs (rloo/algo/rollout_correction.py, eqs. 1-4), read from its
steps.jsonl. Part 1 (`--probe-steps` steps per cell): sampler hf | vllm x trainer float32 | bfloat16
autocast x rloo.micro_batch_tokens at the stage's default and at a small budget. Part 2 (`--steps`):
RLOO with the vLLM sampler and the config's precision, rollout_correction none against token_tis (cap 2,
config/gpu.yaml's choice), same seed: validation accuracy, KL, the mismatch and what was truncated.
Needs vLLM (scripts/test_vllm.sh builds .venv-vllm): run it with that venv's python.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.record import command_line, provenance  # noqa: E402

MISMATCH = ("train/mismatch_abs_mean", "train/mismatch_abs_max", "train/mismatch_k3_token", "train/mismatch_k3_seq",
            "train/mismatch_out_of_band")


def train(args, out: Path, sets: dict) -> tuple[list[dict], dict, float]:
    """One `rloo train` run; its steps.jsonl rows, metrics.json and wall seconds."""
    cmd = [sys.executable, "-m", "rloo_workflow.cli", "train", *[x for c in args.config for x in ("-c", c)],
           "--data", args.data, "--policy", args.policy, "--out", str(out / "model"), "--work", str(out / "work"),
           "--set", "tracking.enabled=false", *[x for k, v in sets.items() for x in ("--set", f"{k}={v}")]]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    t0 = time.perf_counter()
    res = subprocess.run(cmd, env=env, capture_output=True, text=True)
    seconds = time.perf_counter() - t0
    if res.returncode != 0:
        raise SystemExit(f"rloo train {sets} exited {res.returncode}:\n{res.stderr[-4000:]}")
    steps = [json.loads(line) for line in (out / "model" / "steps.jsonl").read_text().splitlines() if line.strip()]
    return steps, json.loads((out / "model" / "metrics.json").read_text()), seconds


def mean_of(rows: list[dict], key: str, how=statistics.fmean) -> float | None:
    values = [r[key] for r in rows if isinstance(r.get(key), (int, float)) and math.isfinite(r[key])]
    return how(values) if values else None


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-c", "--config", action="append", default=[], help="config file(s)")
    ap.add_argument("--data", required=True, help="the prepared data folder (train.jsonl)")
    ap.add_argument("--policy", required=True, help="the SFT policy folder RLOO starts from")
    ap.add_argument("--probe-steps", type=int, default=2, help="steps per cell of part 1")
    ap.add_argument("--small-budget", type=int, default=2048,
                    help="the small rloo.micro_batch_tokens of part 1 (0: only the config's budget)")
    ap.add_argument("--samplers", default="hf,vllm", help="part 1's samplers")
    ap.add_argument("--precisions", default="none,bfloat16", help="part 1's trainer model.autocast values")
    ap.add_argument("--steps", type=int, default=20, help="RLOO steps per run of part 2 (0: skip part 2)")
    ap.add_argument("--eval-every", type=int, default=10)
    ap.add_argument("--json", default=None, help="also write the figures here")
    args = ap.parse_args(argv)

    sys.path.insert(0, str(ROOT))
    from rloo_workflow.config import load_config

    cfg = load_config(args.config or None)
    default_budget = cfg["rloo"]["micro_batch_tokens"]
    probe = {"rloo.steps": args.probe_steps, "rloo.eval_every": 0, "rloo.checkpoint_every": 1000,
             "rloo.select": "last"}
    cells = []
    with tempfile.TemporaryDirectory(prefix="rloo-bench-rc-") as tmp:
        for backend in args.samplers.split(","):
            for autocast in args.precisions.split(","):
                for budget in [default_budget, *([args.small_budget] if args.small_budget else [])]:
                    sets = {**probe, "rollout.backend": backend, "model.autocast": autocast,
                            "rloo.micro_batch_tokens": budget}
                    steps, _, seconds = train(args, Path(tmp) / f"p-{backend}-{autocast}-{budget}", sets)
                    cell = {"sampler": backend, "trainer": "float32" if autocast == "none" else "bfloat16 autocast",
                            "micro_batch_tokens": budget, "steps": len(steps), "seconds": seconds,
                            **{k.removeprefix("train/"): mean_of(steps, k, max if k.endswith("max") else statistics.fmean)
                               for k in MISMATCH}}
                    cells.append(cell)
                    print(json.dumps(cell), flush=True)
        runs = {}
        if args.steps:
            for mode in ("none", "token_tis"):
                sets = {"rollout.backend": "vllm", "rloo.steps": args.steps, "rloo.eval_every": args.eval_every,
                        "rloo.select": "last", "rloo.rollout_correction.mode": mode, "rloo.rollout_correction.cap": 2.0}
                steps, metrics, seconds = train(args, Path(tmp) / f"rloo-{mode}", sets)
                runs[mode] = {
                    "steps": len(steps), "seconds": seconds,
                    "evals": metrics.get("evals"), "final_kl": metrics.get("final_kl"),
                    "final_reward_mean": metrics.get("final_reward_mean"),
                    "reward_mean": mean_of(steps, "train/reward_mean"),
                    "sampling_mismatch": metrics.get("sampling_mismatch"),
                    **{k.removeprefix("train/") + "_mean": mean_of(steps, k) for k in MISMATCH},
                    "correction_mean": {k.removeprefix("train/"): mean_of(steps, k)
                                        for k in sorted({k for s in steps for k in s if k.startswith("train/correction")})},
                }
                print(json.dumps({mode: runs[mode]}), flush=True)

    out = {
        **provenance(None if argv is None else command_line(["bench/rollout_correction.py", *argv])),
        "config": args.config, "policy": args.policy, "cap": cfg["rloo"]["rollout_correction"]["cap"],
        "samples_per_step": cfg["rloo"]["prompts_per_step"] * cfg["rloo"]["k"],
        "max_new_tokens": cfg["rloo"]["max_new_tokens"],
        "cells": cells, "runs": runs,
    }
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1) + "\n")
    return out


if __name__ == "__main__":
    main()
