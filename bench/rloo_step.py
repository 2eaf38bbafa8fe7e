"""The RLOO step, today's path against the previous one, on identical work in one invocation.

new: the lean decode loop (rloo.rollout.decode); the forward passes once per distinct sample (a
     completion drawn twice for a prompt is passed once), in chunks of rows of similar completion
     length (rloo.model.logprobs._completion_pass);
old: the KV-cached loop over HF's forward pass and one padded forward pass over all rows.

Both train the same SFT policy with the same config (default: config/config.yaml, the pipeline's
default RLOO settings), the same seed and the same prompts; in float32 the two samplers draw the same
tokens, so the work is the same sample for sample (the mean completion length is printed to show it).
Each round starts both from the SFT weights at a different step of the prompt stream (distinct prompts
and noise per round), in alternating order, so machine drift hits both alike.

    python bench/rloo_step.py --policy results/models/sft --data data/gsm8k --rounds 3 --steps 10
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.record import write

PHASES = ("time/generation_s", "time/scoring_s", "time/reference_s", "time/update_s", "time/step_s")


def previous_path(trainer_class: type) -> type:
    """The trainer as it stepped before the lean path: every row passed forward whole, in one chunk."""

    class PreviousPath(trainer_class):
        chunk_rows = 1 << 30

        def distinct_rows(self, batch):
            n = len(batch.completion_mask)
            return torch.arange(n), torch.arange(n)

    return PreviousPath


def run_variant(cfg: dict, policy: str, train: list[dict], variant: str, first_step: int, steps: int) -> dict:
    from rloo.reward.rewards import build_reward
    from rloo.rollout import HFRollout
    from rloo.train.rloo_trainer import RlooTrainer

    trainer = (previous_path(RlooTrainer) if variant == "old" else RlooTrainer)(cfg, policy, build_reward(cfg), train)
    if variant == "old":
        trainer.rollout = HFRollout(trainer.policy, lean=False)
    trainer.step(first_step)  # warm-up (allocator, thread pool), not timed
    rows = [trainer.step(first_step + 1 + s) for s in range(steps)]
    out = {k: float(np.mean([r[k] for r in rows])) for k in PHASES}
    out["completion_length"] = float(np.mean([r["train/response_length"] for r in rows]))
    out["samples_per_s"] = cfg["rloo"]["prompts_per_step"] * cfg["rloo"]["k"] / out["time/step_s"]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", action="append", default=None, help="config files, overlaid (default: config/config.yaml)")
    ap.add_argument("--policy", default="results/models/sft")
    ap.add_argument("--data", default="data/gsm8k")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=10, help="timed steps per variant and round (after one warm-up)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", default=None, help="also write the figures here")
    a = ap.parse_args()

    from rloo.io import read_jsonl
    from rloo.rollout.collect import training_prompts
    from rloo.runtime import setup
    from rloo_workflow.config import load_config

    cfg = load_config(a.config or ["config/config.yaml"], {"threads": a.threads, "tracking": {"enabled": False}})
    setup(a.threads, cfg["seed"])
    train = training_prompts([r for _, r in read_jsonl(Path(a.data) / "train.jsonl")], cfg["rloo"]["min_solution_steps"])
    results: dict[str, list[dict]] = {"old": [], "new": []}
    for r in range(a.rounds):
        order = ("old", "new") if r % 2 == 0 else ("new", "old")
        for variant in order:
            t0 = time.perf_counter()
            res = run_variant(cfg, a.policy, train, variant, first_step=1000 * (r + 1), steps=a.steps)
            results[variant].append(res)
            print(f"round {r} {variant}: {res['time/step_s']:.3f} s/step, completion length "
                  f"{res['completion_length']:.1f} ({time.perf_counter() - t0:.0f} s)", flush=True)
    r = cfg["rloo"]
    print(f"\nRLOO step, {r['prompts_per_step']} prompts x k={r['k']}, max {r['max_new_tokens']} new tokens, "
          f"reward {cfg['reward']['source']}, {a.threads} threads, {a.rounds} rounds x {a.steps} steps (mean of rounds)")
    print("| path | s/step | generation | scoring | reference | update | samples/s | completion length |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    summary = {}
    for variant in ("old", "new"):
        m = {k: float(np.mean([x[k] for x in results[variant]])) for k in results[variant][0]}
        summary[variant] = m
        print(f"| {variant} | {m['time/step_s']:.3f} | {m['time/generation_s']:.3f} | {m['time/scoring_s']:.3f} | "
              f"{m['time/reference_s']:.3f} | {m['time/update_s']:.3f} | {m['samples_per_s']:.1f} | "
              f"{m['completion_length']:.1f} |")
    ratio = summary["old"]["time/step_s"] / summary["new"]["time/step_s"]
    per_round = [o["time/step_s"] / n["time/step_s"] for o, n in zip(results["old"], results["new"], strict=True)]
    print(f"\nspeed-up (old s/step / new s/step): {ratio:.2f}x (rounds: {', '.join(f'{x:.2f}' for x in per_round)})")
    if a.json:
        write(a.json, {"summary": summary, "rounds": results, "ratio": ratio}, indent=2)


if __name__ == "__main__":
    main()
