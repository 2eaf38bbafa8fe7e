"""One-step off-policy RLOO against the synchronous step, with the same total thread count, in one run.

For each policy (`--run LABEL=CONFIGS:POLICY:DATA[:REWARD_MODEL]`, CONFIGS a comma-separated overlay list)
and each round r (seed r: other prompts and noise every round, the same for both modes of a round), in
alternating order:

- sync@T:   the synchronous RLOO stage (rloo.off_policy_steps 0) on T = --threads threads;
- off@T:    rloo.off_policy_steps 1, its sampler process on S = --sampler-threads (default T/2) threads
            and the trainer on T - S (rloo/train/off_policy.py), without the lag pass;
- sync@1:   the synchronous stage on 1 thread, for the parts' thread scaling (--no-scaling skips it).

`--trainer-threads N` above T - S runs off@S+N instead of off@T: the trainer keeps N threads beside the
sampler's S, more threads than T (cores), for a trainer whose parts scale with threads and a sampler that
idles part of each step; still against sync@T.

Each runs `--steps` RLOO steps from the SFT policy (no evaluation, no checkpoint in between), after one
untimed 2-step run of each mode (a process's first run pays one-time costs); the figures
are the stage's own: samples/s and seconds a step over its training loop (the sampler's start-up, a
fresh interpreter, is outside it and printed apart), and each part's seconds a step from its per-step
`time/*` metrics: sample (generation + scoring), reference, update. Reported per mode: min / median /
max over rounds; per round, off@T's samples/s over sync@T's.

The parts give the ratio a split of the threads allows at best, if nothing else is shared:
sync@T = sample_T + reference_T + update_T, off = max(sample_S, reference_(T-S) + update_(T-S)), so
ideal = sync@T / off (with T = 2, S = 1: the parts at 1 thread). With the sampler on a device of its own
(a second GPU, no split), the parts at T predict (sample + reference + update) / max(sample, reference +
update), printed beside the peers' published figures (quoted, not measured here).

    python bench/off_policy.py --run tiny=config/config.yaml:results/models/sft:data/gsm8k \\
        --rounds 3 --steps 20 --threads 2 --json docs/figures/off_policy.json

`--paired SYNC OFF SFT` instead compares two evaluations of the same problems (the evaluate stage's
records, results/eval/rloo.jsonl, of a synchronous chain and of an off-policy one, e.g.
config/offpolicy.yaml, and the SFT records both share): each one's RLOO - SFT gain and the paired
difference RLOO(off) - RLOO(sync), with 95 % intervals (rloo/eval/gains.py, as the results JSON's gains).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.record import write

PARTS = {"sample": ("time/generation_s", "time/scoring_s"), "reference": ("time/reference_s",),
         "update": ("time/update_s",)}
# Quoted from the peers' documentation (docs/figures: not measured here; the field notes' sources).
PEERS = {"verl one-step-off (Qwen2.5-Math-7B, 16 GPUs; 23-40 % shorter runs)": [1 / 0.77, 1 / 0.60],
         "NeMo RL 1-step-off (Llama-3.1-8B GRPO, 16 H100; 1,581 -> 2,478 tokens/s/GPU)": [2478 / 1581]}


def run_mode(files: list[str], policy: str, data: str, reward_model: str | None, seed: int, steps: int, threads: int,
             off_policy: bool, sampler_threads: int | None) -> dict:
    """One RLOO stage run of `steps` steps; its samples/s, seconds a step and each part's mean seconds."""
    from rloo.data.gsm8k import read_split
    from rloo.reward.rewards import build_reward
    from rloo.rollout.collect import training_prompts
    from rloo.runtime import setup
    from rloo.settings import Config
    from rloo.train import rloo
    from rloo_workflow.config import load_config

    overrides = {"seed": seed, "threads": threads, "tracking": {"enabled": False},
                 "rloo": {"steps": steps, "eval_every": 0, "select": "last", "checkpoint_every": steps + 1,
                          "off_policy_steps": int(off_policy), "stop_on": []},
                 "rollout": {"sampler_threads": sampler_threads}}
    cfg = load_config(files, overrides)
    setup(threads, seed)
    config = Config.from_config(cfg)
    rows = training_prompts(read_split(data, "train"), config.rloo.min_solution_steps)
    steps_seen: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="rloo-bench-off-policy-") as tmp:
        t0 = time.perf_counter()
        summary = rloo.run(config, policy, rows, Path(tmp) / "out", Path(tmp) / "work", f"bench-{seed}-{off_policy}",
                           val=read_split(data, "val"), reward=build_reward(cfg, reward_model),
                           log_to=lambda m, step: steps_seen.append(m) if "time/step_s" in m else None)
        wall = time.perf_counter() - t0
    out = {"samples_per_s": summary["samples_per_second"], "seconds_per_step": summary["seconds_per_step"],
           "outside_loop_s": wall - summary["train_seconds"]}
    for part, keys in PARTS.items():
        out[part] = float(np.mean([sum(m[k] for k in keys) for m in steps_seen]))
    if off_policy:
        out["wait"] = float(np.mean([m["time/sample_wait_s"] for m in steps_seen]))
    out["final_reward_mean"] = summary["final_reward_mean"]
    return out


def spread(values: list[float]) -> dict[str, float]:
    return {"min": min(values), "median": statistics.median(values), "max": max(values)}


def bench_run(label: str, spec: str, rounds: int, steps: int, threads: int, sampler_threads: int,
              trainer_threads: int, scaling: bool = True) -> dict:
    files, policy, data, *rest = spec.split(":")
    reward_model = rest[0] if rest else None
    # off-policy with more threads than cores (sampler + trainer > threads) is a route of its own: the
    # sampler idles part of each step, and the trainer's extra thread takes the core it leaves
    off_threads = sampler_threads + trainer_threads
    sync, off_name = f"sync@{threads}", (f"off@{threads}" if off_threads == threads
                                         else f"off@{sampler_threads}+{trainer_threads}")
    modes = {sync: (threads, False), off_name: (off_threads, True)}
    if scaling:
        modes["sync@1"] = (1, False)
    for t, off in modes.values():  # untimed: the first run of a process pays one-time costs (allocator, kernels)
        run_mode(files.split(","), policy, data, reward_model, seed=1000, steps=2, threads=t, off_policy=off,
                 sampler_threads=sampler_threads if off else None)
    rounds_out: list[dict] = []
    for r in range(rounds):
        names = list(modes) if r % 2 == 0 else [*reversed(list(modes)[:2]), *list(modes)[2:]]
        got = {}
        for name in names:
            t, off = modes[name]
            got[name] = run_mode(files.split(","), policy, data, reward_model, seed=r, steps=steps, threads=t,
                                 off_policy=off, sampler_threads=sampler_threads if off else None)
            print(f"{label} round {r} {name}: {got[name]['samples_per_s']:.1f} samples/s, "
                  f"{got[name]['seconds_per_step']:.3f} s/step", flush=True)
        got["ratio"] = got[off_name]["samples_per_s"] / got[sync]["samples_per_s"]
        rounds_out.append(got)
    med = {name: {k: statistics.median(x[name][k] for x in rounds_out) for k in rounds_out[0][name]} for name in modes}
    parts_t = {p: med[sync][p] for p in PARTS}
    scaled, ideal = None, None
    if scaling:
        parts_1 = {p: med["sync@1"][p] for p in PARTS}
        scaled = {p: parts_1[p] / parts_t[p] for p in PARTS}
        # the parts are measured at 1 and T threads: the ideal ratio of the split where both sides have one
        if sampler_threads == 1 and trainer_threads == 1 and threads == 2:
            ideal = sum(parts_t.values()) / max(parts_1["sample"], parts_1["reference"] + parts_1["update"])
    device = sum(parts_t.values()) / max(parts_t["sample"], parts_t["reference"] + parts_t["update"])
    return {
        "spec": spec, "threads": threads, "sampler_threads": sampler_threads, "trainer_threads": trainer_threads,
        "steps": steps, "off_mode": off_name,
        "modes": {name: {k: spread([x[name][k] for x in rounds_out]) for k in rounds_out[0][name]} for name in modes},
        "ratio": spread([x["ratio"] for x in rounds_out]),
        "parts_scaling": scaled,
        "ideal_ratio": ideal, "predicted_ratio_own_device": device, "rounds": rounds_out,
    }


def report(label: str, res: dict) -> None:
    t = res["threads"]
    print(f"\n{label}: {res['steps']} steps a run, {len(res['rounds'])} rounds, {t} threads in all "
          f"(off-policy: sampler {res['sampler_threads']}, trainer {res['trainer_threads']})")
    print("| mode | samples/s (min / median / max) | s/step (median) | sample | reference | update | waited | outside the loop |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for name, m in res["modes"].items():
        s = m["samples_per_s"]
        waited = f"{m['wait']['median']:.3f}" if "wait" in m else ""
        print(f"| {name} | {s['min']:.1f} / {s['median']:.1f} / {s['max']:.1f} | {m['seconds_per_step']['median']:.3f} | "
              f"{m['sample']['median']:.3f} | {m['reference']['median']:.3f} | {m['update']['median']:.3f} | {waited} | "
              f"{m['outside_loop_s']['median']:.1f} |")
    r = res["ratio"]
    print(f"off-policy / synchronous samples/s: {r['median']:.2f}x (min {r['min']:.2f}, max {r['max']:.2f}; rounds: "
          + ", ".join(f"{x['ratio']:.2f}" for x in res["rounds"]) + ")")
    if res["parts_scaling"] is not None:
        print("thread scaling, 1 -> " + str(t) + " threads (seconds at 1 / at " + str(t) + "): "
              + ", ".join(f"{p} {v:.2f}x" for p, v in res["parts_scaling"].items()))
    if res["ideal_ratio"] is not None:
        print(f"ideal ratio of this split, from the parts: {res['ideal_ratio']:.2f}x (achieved {r['median']:.2f}x)")
    print(f"predicted with the sampler on a device of its own (parts at {t} threads): "
          f"{res['predicted_ratio_own_device']:.2f}x; quoted: "
          + "; ".join(f"{k}: {'-'.join(f'{v:.2f}x' for v in vs)}" for k, vs in PEERS.items()))


def paired(sync_path: str, off_path: str, sft_path: str, seed: int = 0) -> dict:
    """RLOO - SFT of each run and RLOO(off) - RLOO(sync), from the evaluate stage's records of the same
    problems (results/eval/<policy>.jsonl; rloo.eval.gains: paired bootstrap intervals, sign-flip /
    McNemar p-values). The SFT records are the one evaluation both chains share."""
    from rloo.eval.gains import correctness, gain
    from rloo.eval.records import read

    evaluations = {name: read(name, path) for name, path in (("sync", sync_path), ("off", off_path), ("sft", sft_path))}
    golds = evaluations["sft"].golds
    if any(ev.golds != golds or ev.questions != evaluations["sft"].questions for ev in evaluations.values()):
        raise SystemExit("the three evaluations are not of the same problems in the same order")
    ok = {name: correctness(ev.texts(), golds) for name, ev in evaluations.items()}
    return {"sync_gain_over_sft": gain(ok["sync"], ok["sft"], seed), "off_gain_over_sft": gain(ok["off"], ok["sft"], seed),
            "off_minus_sync": gain(ok["off"], ok["sync"], seed), "problems": len(golds),
            "records": {"sync": sync_path, "off": off_path, "sft": sft_path}}


def _points(g: dict) -> str:
    s = g["sampled"]
    return f"{100 * s['gain']:+.1f} [{100 * s['ci95'][0]:+.1f}, {100 * s['ci95'][1]:+.1f}] (p = {s['p_value']:.3g})"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--run", action="append", metavar="LABEL=CONFIGS:POLICY:DATA[:REWARD_MODEL]")
    ap.add_argument("--paired", nargs=3, metavar=("SYNC_RECORDS", "OFF_RECORDS", "SFT_RECORDS"))
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--sampler-threads", type=int, default=None, help="default: half of --threads")
    ap.add_argument("--trainer-threads", type=int, default=None,
                    help="the off-policy trainer's threads; default: --threads less the sampler's. More than that "
                         "oversubscribes the cores (off@S+T, against sync@THREADS)")
    ap.add_argument("--no-scaling", action="store_true", help="skip sync@1 (the parts' thread scaling)")
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    if a.paired:
        res = paired(*a.paired)
        print(f"{res['problems']} problems, sampled accuracy points (95 % CI): RLOO - SFT synchronous "
              f"{_points(res['sync_gain_over_sft'])}; off-policy {_points(res['off_gain_over_sft'])}; "
              f"off-policy - synchronous {_points(res['off_minus_sync'])}")
        if a.json:
            write(a.json, res)
        return
    if not a.run:
        ap.error("--run or --paired")
    sampler = a.sampler_threads if a.sampler_threads is not None else max(1, a.threads // 2)
    results = {}
    for run in a.run:
        label, _, spec = run.partition("=")
        trainer = a.trainer_threads if a.trainer_threads is not None else max(1, a.threads - sampler)
        results[label] = bench_run(label, spec, a.rounds, a.steps, a.threads, sampler, trainer, not a.no_scaling)
    for label, res in results.items():
        report(label, res)
    if a.json:
        write(a.json, {"runs": results, "peers_quoted": PEERS})
    print(json.dumps({k: v["ratio"] for k, v in results.items()}))


if __name__ == "__main__":
    main()
