"""Our RLOO trainer against TRL's RLOOTrainer on identical work, alternating in one invocation.

Both train the same SFT policy on the same prompts with the same k, prompts per step, completion
length, learning rate, β, reward (the verifier) and precision (`--precision`: float32 everywhere, or
bfloat16 autocast for both: ours through `model.autocast`, TRL's through `bf16=True`). Each round runs
one framework in a fresh process, then the other (the order alternates), with the round's own seed
shared by both, so machine drift hits both alike and rounds differ in prompts and samples. Printed per
framework: samples/s, seconds per step split into generation / log-probabilities / the rest (update
and bookkeeping), the mean completion length the steps produced (equal work needs equal lengths), peak
RSS. No accuracy: a few steps at this learning rate do not move held-out accuracy beyond its noise.

    python bench/trl_vs_rloo.py --policy results/models/sft --data data/gsm8k --rounds 4 --steps 8 --precision float32

Needs the `bench` extra (TRL): pip install -e '.[bench]'.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.record import write


def _common(a: argparse.Namespace) -> dict:
    return {"k": a.k, "prompts": a.prompts, "max_new": a.max_new, "lr": a.lr, "beta": a.beta, "steps": a.steps,
            "warmup": a.warmup, "seed": a.seed, "threads": a.threads}


def _attn(a: argparse.Namespace) -> str | None:
    """`model.attn_implementation` of the config: both frameworks run the same attention kernel."""
    from rloo_workflow.config import load_config

    return a.attn or load_config(a.config)["model"]["attn_implementation"]


def run_ours(a: argparse.Namespace) -> dict:
    from rloo.io import read_jsonl
    from rloo.reward.rewards import VerifierReward
    from rloo.runtime import setup
    from rloo.train.rloo_trainer import RlooTrainer
    from rloo_workflow.config import load_config

    cfg = load_config(a.config, {
        "threads": a.threads, "seed": a.seed,
        "reward": {"source": "verifier"},
        "model": {"attn_implementation": _attn(a), "autocast": "bfloat16" if a.precision == "bfloat16" else "none"},
        "rloo": {"k": a.k, "prompts_per_step": a.prompts, "max_new_tokens": a.max_new, "lr": a.lr, "beta": a.beta,
                 "warmup_steps": 0},
    })
    setup(cfg["threads"], cfg["seed"])
    train = [r for _, r in read_jsonl(Path(a.data) / "train.jsonl")]
    trainer = RlooTrainer(cfg, a.policy, VerifierReward(), train)
    times = []
    for step in range(a.warmup + a.steps):
        t0 = time.perf_counter()
        m = trainer.step(step)
        total = time.perf_counter() - t0
        if step >= a.warmup:
            times.append({"generation": m["time/generation_s"],
                          "logprobs": m["time/reference_s"],
                          "rest": total - m["time/generation_s"] - m["time/reference_s"],
                          "total": total,
                          "completion_length": m["train/response_length"]})
    return {"times": times}


def run_trl(a: argparse.Namespace) -> dict:
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import RLOOConfig, RLOOTrainer

    from rloo.io import read_jsonl
    from rloo.reward.verifier import is_correct

    torch.set_num_threads(a.threads)
    tok = AutoTokenizer.from_pretrained(a.policy)
    tok.padding_side = "left"
    # The same attention kernel as ours (the reference model inherits it from the policy).
    model = AutoModelForCausalLM.from_pretrained(a.policy, dtype=torch.float32, attn_implementation=_attn(a))
    rows = [r for _, r in read_jsonl(Path(a.data) / "train.jsonl")]
    ds = Dataset.from_list([{"prompt": f"Question: {r['question']}\nAnswer:", "answer": r["answer"]} for r in rows])

    def verifier(prompts, completions, answer, **_):
        return [float(is_correct(c, g)) for c, g in zip(completions, answer, strict=True)]

    args = RLOOConfig(
        output_dir=str(Path(a.workdir) / "trl"), per_device_train_batch_size=a.prompts * a.k,
        num_generations=a.k, max_completion_length=a.max_new, learning_rate=a.lr, beta=a.beta,
        temperature=1.0, max_steps=a.warmup + a.steps, logging_steps=1, report_to="none", save_strategy="no",
        seed=a.seed, use_cpu=True, bf16=a.precision == "bfloat16", gradient_checkpointing=False,
        lr_scheduler_type="constant",
        warmup_steps=0, dataloader_num_workers=0, disable_tqdm=True,
    )
    trainer = RLOOTrainer(model=model, reward_funcs=verifier, args=args, train_dataset=ds, processing_class=tok)

    # Instrument TRL's own phases by timing the methods it calls (no behaviour is changed).
    phase: dict[str, float] = {"generation": 0.0, "logprobs": 0.0}

    def timed(obj, name, key):
        fn = getattr(obj, name)

        def wrapper(*args, **kwargs):
            t = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                if key != "logprobs" or not torch.is_grad_enabled():
                    phase[key] += time.perf_counter() - t
        setattr(obj, name, wrapper)

    timed(trainer, "_generate", "generation")
    timed(trainer, "_get_per_token_logps_and_entropies", "logprobs")
    times: list[dict] = []
    lengths: list[float] = []

    class StepTimer(TrainerCallback):
        def on_step_begin(self, *args, **kwargs):
            phase.update(generation=0.0, logprobs=0.0)
            self.t0 = time.perf_counter()

        def on_step_end(self, *args, **kwargs):
            total = time.perf_counter() - self.t0
            times.append({"generation": phase["generation"], "logprobs": phase["logprobs"],
                          "rest": total - phase["generation"] - phase["logprobs"], "total": total})

        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "completions/mean_length" in logs:  # TRL logs every step (logging_steps=1)
                lengths.append(float(logs["completions/mean_length"]))

    trainer.add_callback(StepTimer())
    trainer.train()
    for t, n in zip(times, lengths, strict=False):
        t["completion_length"] = n
    return {"times": times[a.warmup:]}


def worker(a: argparse.Namespace) -> None:
    out = run_ours(a) if a.worker == "ours" else run_trl(a)
    out["peak_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    Path(a.result).write_text(json.dumps(out))


def summarise(runs: list[dict], k: int, prompts: int) -> dict:
    steps = [t for r in runs for t in r["times"]]
    mean = {key: float(np.mean([t[key] for t in steps])) for key in ("generation", "logprobs", "rest", "total")}
    lengths = [t["completion_length"] for t in steps if "completion_length" in t]
    return {"samples_per_s": prompts * k / mean["total"], "step_s": mean,
            "completion_length": float(np.mean(lengths)) if lengths else None,
            "peak_rss_mb": max(r["peak_rss_mb"] for r in runs), "steps_measured": len(steps)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--policy", default="results/models/sft")
    p.add_argument("--data", default="data/gsm8k")
    p.add_argument("--config", default="config/config.yaml")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--steps", type=int, default=8, help="measured steps per round")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--k", type=int, default=4)
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--max-new", type=int, default=64)
    p.add_argument("--lr", type=float, default=5e-5)
    p.add_argument("--beta", type=float, default=0.05)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--attn", choices=["eager", "sdpa"], default=None,
                   help="attention kernel for both (default: the config's model.attn_implementation)")
    p.add_argument("--precision", choices=["float32", "bfloat16"], default="float32",
                   help="the same for both: float32, or bfloat16 autocast of the training passes")
    p.add_argument("--seed", type=int, default=0, help="round r runs both frameworks with seed + r")
    p.add_argument("--workdir", default="/tmp/rloo-bench")
    p.add_argument("--only", choices=["ours", "trl"], default=None)
    p.add_argument("--json", default=None, help="also write the summary and every round's steps here")
    p.add_argument("--worker", choices=["ours", "trl"], default=None, help=argparse.SUPPRESS)
    p.add_argument("--result", default=None, help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.worker:
        worker(a)
        return
    Path(a.workdir).mkdir(parents=True, exist_ok=True)
    runs: dict[str, list[dict]] = {"ours": [], "trl": []}
    names = [a.only] if a.only else ["ours", "trl"]
    for rnd in range(a.rounds):
        for name in names if rnd % 2 == 0 else names[::-1]:
            res = Path(a.workdir) / f"{name}_{rnd}.json"
            cmd = [sys.executable, __file__, *sys.argv[1:], "--worker", name, "--result", str(res),
                   "--seed", str(a.seed + rnd)]
            env = {**os.environ, "OMP_NUM_THREADS": str(a.threads), "TOKENIZERS_PARALLELISM": "false"}
            subprocess.run(cmd, check=True, env=env)
            runs[name].append(json.loads(res.read_text()))
            print(f"round {rnd} {name}: {np.mean([t['total'] for t in runs[name][-1]['times']]):.3f} s/step", flush=True)
    summary = {name: summarise(r, a.k, a.prompts) for name, r in runs.items() if r}
    print(f"\nwork: {a.prompts} prompts x k={a.k}, <= {a.max_new} new tokens, lr {a.lr}, beta {a.beta}, "
          f"{a.threads} threads, {a.rounds} rounds x {a.steps} steps (seeds {a.seed}..{a.seed + a.rounds - 1}), "
          f"precision {a.precision} for both, attention {_attn(a) or 'default'} for both")
    print("| | samples/s | s/step | generation | log-probs | rest (update, bookkeeping) | completion length | peak RSS MB |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for name, s in summary.items():
        t = s["step_s"]
        n = f"{s['completion_length']:.1f}" if s["completion_length"] is not None else "n/a"
        print(f"| {name} | {s['samples_per_s']:.1f} | {t['total']:.3f} | {t['generation']:.3f} | {t['logprobs']:.3f} | "
              f"{t['rest']:.3f} | {n} | {s['peak_rss_mb']:.0f} |")
    if len(summary) == 2:
        ratio = summary["ours"]["samples_per_s"] / summary["trl"]["samples_per_s"]
        per_round = [float(np.mean([t["total"] for t in tr["times"]]) / np.mean([t["total"] for t in ou["times"]]))
                     for ou, tr in zip(runs["ours"], runs["trl"], strict=True)]
        print(f"\nspeed ratio (ours / TRL samples/s, {a.precision} both): {ratio:.2f}x "
              f"(per round: {', '.join(f'{x:.2f}' for x in per_round)})")
    print(json.dumps(summary, indent=2))
    if a.json:
        settings = {k: getattr(a, k) for k in ("k", "prompts", "max_new", "lr", "beta", "threads", "rounds", "steps",
                                                "precision", "seed")}
        write(a.json, {"settings": settings, "summary": summary, "runs": runs}, indent=2, extra=("trl", "accelerate"))


if __name__ == "__main__":
    main()
