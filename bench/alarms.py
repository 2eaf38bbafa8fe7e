"""The alarms' calibration: every recorded trajectory replayed through rloo/train/alarms.py.

Healthy runs (the default chain's seeds, the comparison overlay's estimators, the default sampling with
the trainer's own distribution) must stay silent; failing runs (the learned-reward-model chain, k = 2, a
learning rate ten times the default without the KL term, a sampler at temperature 1.2) must fire the
alarm their failure names. The trajectories are the stages' own steps.jsonl,
trimmed to the metrics the alarms read, under tests/data/trajectories/ (index.json says what each run
was and the command that made it); tests/unit/test_alarms.py replays the same files.

    python bench/alarms.py record seed0 results/models/rloo_rloo --kind healthy --command "..."
    python bench/alarms.py construct-length-climb              # the constructed length_climb run (below)
    python bench/alarms.py --json docs/figures/alarms.json     # the grid of windows and margins, the defaults' table

No measured run of the embedded default climbs in length, so length_climb's failing run is constructed:
a real RLOO run (the micro model, SFT trained 150 steps so that it stops well short of the new-token
budget) whose reward is a verbosity-biased pairwise judge: each completion scores its rank by length
among its prompt's k completions (0 the shortest, 1 the longest, ties shared). That reward's mean is 1/2
at every step whatever the lengths, so the length climbs while the reward cannot.

sampling_mismatch reads train/mismatch_k3_token, which runs recorded before the metric existed lack: it
is checked on the runs that have it, and its threshold (`mismatch_kl`) gets a grid of its own.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict, replace
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.record import provenance  # noqa: E402
from rloo.train import alarms  # noqa: E402

TRAJECTORIES = ROOT / "tests" / "data" / "trajectories"
KEYS = ("step", "train/reward_mean", "train/kl", "train/zero_adv_frac", "train/response_length")
MISMATCH_KEY = "train/mismatch_k3_token"  # recorded where the run logged it (sampling_mismatch)
# An off-policy run's lag (it makes the alarm read sparse measurements) and the whole ratio's level, kept
# to show what the alarm would read without the split (docs/rollout-correction.md).
OFF_POLICY_KEYS = ("train/policy_lag", "train/offpolicy_k3_token", "train/lag_k3_token")
EVAL_KEYS = ("step", "eval/accuracy_sampled", "eval/proxy_reward")


def load(folder: Path = TRAJECTORIES) -> dict[str, dict]:
    """Every recorded run: its index entry plus `history` (the steps, oldest first)."""
    index = json.loads((folder / "index.json").read_text())
    for name, run in index.items():
        run["history"] = [json.loads(line) for line in (folder / f"{name}.jsonl").read_text().splitlines()]
    return index


def fired(run: dict, cfg: alarms.AlarmConfig) -> dict[str, list[int]]:
    """The steps (from 1) at which each alarm holds over the run; reward_hacking at its evaluations."""
    out = alarms.replay(run["history"], cfg, run.get("not_applicable", []))
    out["reward_hacking"] = alarms.hacking_steps(run.get("evals") or [], run["eval_answers"], cfg.hacking_z)
    return out


def _has_mismatch(run: dict) -> bool:
    return any(MISMATCH_KEY in h for h in run["history"])


def _checked(run: dict, alarm: str) -> bool:
    """Whether the run can show the alarm: its evaluations (reward_hacking) or its steps recorded, and
    the alarm applies to its estimator."""
    if alarm == "reward_hacking":
        return bool(run["evals"])
    if alarm == "sampling_mismatch" and not _has_mismatch(run):
        return False
    return bool(run["history"]) and alarm not in run.get("not_applicable", [])


def table(runs: dict[str, dict], cfg: alarms.AlarmConfig) -> dict:
    """Per alarm: the healthy runs it fired on (false positives) and each failing run's first firing step."""
    per_run = {name: fired(run, cfg) for name, run in runs.items()}
    out = {"first_fired": {n: {a: (steps[0] if steps else None) for a, steps in f.items()} for n, f in per_run.items()}}
    for alarm in alarms.ALARMS:
        healthy = {n: per_run[n][alarm] for n, r in runs.items() if r["kind"] == "healthy" and _checked(r, alarm)}
        failing = {n: (per_run[n][alarm][0] if per_run[n][alarm] else None)
                   for n, r in runs.items() if r["kind"] == "failing"}
        out[alarm] = {
            "false_positive_runs": sum(bool(v) for v in healthy.values()),
            "healthy_runs": len(healthy),
            "false_positive_steps": sum(len(v) for v in healthy.values()),
            # the checks made: one per step, or (reward_hacking) one per evaluation after the first
            "healthy_steps": sum(len(runs[n]["evals"]) - 1 if alarm == "reward_hacking" else len(runs[n]["history"])
                                 for n in healthy),
            "first_firing_step": failing,
            "expected_by": sorted(n for n, r in runs.items() if r.get("expect") == alarm),
        }
    return out


def grid(runs: dict[str, dict], windows: list[int], zs: list[float]) -> list[dict]:
    """The same table over a grid of windows and margins: what each choice would cost and catch."""
    rows = []
    for w in windows:
        for z in zs:
            cfg = replace(alarms.DEFAULTS, window=w, z=z)
            t = table(runs, cfg)
            rows.append({"window": w, "z": z,
                         "false_positive_runs": {a: t[a]["false_positive_runs"] for a in alarms.STEP_ALARMS},
                         "caught": {n: t[r["expect"]]["first_firing_step"][n]
                                    for n, r in runs.items() if r.get("expect")}})
    return rows


def miss_margin(run: dict, lo: float = 0.0, hi: float = 10.0) -> float | None:
    """The largest hacking_z (to 0.001) at which reward_hacking fires on `run`'s evaluations: how far
    short of the default's margin a missed run falls. None if it fires at no margin in [lo, hi]."""
    if not alarms.hacking_steps(run["evals"], run["eval_answers"], lo):
        return None
    while hi - lo > 1e-4:
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if alarms.hacking_steps(run["evals"], run["eval_answers"], mid) else (lo, mid)
    return round(lo, 3)


def _window_means(values: list[float], window: int) -> np.ndarray:
    """The mean of each `window` consecutive values; where some are NaN (an off-policy run measures the
    mismatch every few steps only), of the finite ones among them."""
    v = np.asarray(values, dtype=float)
    if len(v) < window:
        return v[:0]
    if np.isfinite(v).all():
        return np.convolve(v, np.ones(window) / window, mode="valid")
    finite = np.isfinite(v)
    sums = np.convolve(np.where(finite, v, 0.0), np.ones(window), mode="valid")
    counts = np.convolve(finite.astype(float), np.ones(window), mode="valid")
    return sums / np.maximum(counts, 1)


def mismatch_grid(runs: dict[str, dict], thresholds: list[float], zs: list[float]) -> dict:
    """sampling_mismatch's threshold: each run's per-token KL level (its mean and the range of its
    window means, at the default window), then what each threshold and margin would cost and catch."""
    w = alarms.DEFAULTS.window
    with_metric = {n: r for n, r in runs.items() if _has_mismatch(r)}
    levels = {}
    for n, r in with_metric.items():
        kl = [h.get(MISMATCH_KEY, float("nan")) for h in r["history"]]
        means = _window_means(kl, w)
        levels[n] = {"kind": r["kind"], "expect": r.get("expect"), "mean": float(np.nanmean(kl)),
                     "window_mean_min": float(means.min()) if len(means) else None,
                     "window_mean_max": float(means.max()) if len(means) else None}
    rows = []
    for t in thresholds:
        for z in zs:
            cfg = replace(alarms.DEFAULTS, mismatch_kl=t, z=z)
            fired_at = {n: alarms.replay(r["history"], cfg, r.get("not_applicable", []))["sampling_mismatch"]
                        for n, r in with_metric.items()}
            rows.append({"mismatch_kl": t, "z": z,
                         "false_positive_runs": sum(bool(fired_at[n]) for n, r in with_metric.items()
                                                    if r["kind"] == "healthy"),
                         "healthy_runs": sum(r["kind"] == "healthy" for r in with_metric.values()),
                         "caught": {n: (fired_at[n][0] if fired_at[n] else None) for n, r in with_metric.items()
                                    if r.get("expect") == "sampling_mismatch"}})
    return {"window": w, "levels": levels, "grid": rows}


def record(name: str, source: Path, kind: str, expect: str | None, command: str, eval_answers: int,
           not_applicable: list[str]) -> None:
    """Trim a stage's steps.jsonl (and its metrics.json's evaluations) into the trajectories folder; or,
    from a results JSON (a run recorded without its steps), its RLOO stage's evaluations alone."""
    if source.is_dir():
        steps = [json.loads(line) for line in (source / "steps.jsonl").read_text().splitlines()]
        metrics = json.loads((source / "metrics.json").read_text())
    else:
        steps, metrics = [], json.loads(source.read_text())["results"]["training"]["rloo"]
    _write_run(name, steps, metrics, kind=kind, expect=expect, command=command, eval_answers=eval_answers,
               not_applicable=not_applicable)


def _write_run(name: str, steps: list[dict], metrics: dict, **entry) -> None:
    TRAJECTORIES.mkdir(parents=True, exist_ok=True)
    (TRAJECTORIES / f"{name}.jsonl").write_text(
        "".join(json.dumps({k: s[k] for k in (*KEYS, MISMATCH_KEY, *OFF_POLICY_KEYS) if k in s}) + "\n" for s in steps))
    index_path = TRAJECTORIES / "index.json"
    index = json.loads(index_path.read_text()) if index_path.exists() else {}
    keep = {k: v for k, v in index.get(name, {}).items() if k == "known_miss"}  # an annotation, kept
    index[name] = {"kind": entry.pop("kind"), "expect": entry.pop("expect"), "command": entry.pop("command"),
                   "steps": len(steps), "evals": [{k: e[k] for k in EVAL_KEYS} for e in metrics.get("evals", [])],
                   "eval_answers": entry.pop("eval_answers"), "not_applicable": entry.pop("not_applicable"),
                   "alarms_when_recorded": metrics.get("alarms"), **entry, **keep}
    index_path.write_text(json.dumps(dict(sorted(index.items())), indent=1) + "\n")


class LongerInGroupJudge:
    """A verbosity-biased pairwise judge as a reward: each completion's rank by length (characters)
    among the completions of its prompt, in [0, 1], ties shared. Its mean over a group is 1/2 whatever
    the lengths, so it pays for growing longer than one's peers and never rises."""

    name = "longer_in_group"

    def score(self, prompts: list[str], completions: list[str], golds: list[str], finished: list[bool]):
        import torch

        out = []
        for p, c in zip(prompts, completions, strict=True):
            peers = [len(x) for q, x in zip(prompts, completions, strict=True) if q == p]
            shorter, same = sum(n < len(c) for n in peers), sum(n == len(c) for n in peers) - 1
            out.append((shorter + same / 2) / max(len(peers) - 1, 1))
        return torch.tensor(out)


LENGTH_CLIMB_SETS = ["tracking.enabled=false", "threads=1", "sft.steps=150", "rloo.k=4", "rloo.prompts_per_step=16",
                     "rloo.steps=120", "rloo.max_new_tokens=64", "rloo.lr=1.0e-4", "rloo.eval_every=0",
                     "rloo.select=last", "reward.source=verifier"]


def construct_length_climb(name: str = "length_climb") -> None:
    """The constructed length_climb run (the module's docstring): micro prepare, base and SFT in a
    temporary folder, then the RLOO trainer's own steps on LongerInGroupJudge, recorded like a stage's."""
    import shutil
    import tempfile

    from rloo.io import read_jsonl
    from rloo.rollout.collect import training_prompts
    from rloo.runtime import setup
    from rloo.train.rloo_trainer import RlooTrainer
    from rloo_workflow.config import load_config, parse_set
    from rloo_workflow.stages import base, prepare, sft

    cfg = load_config(ROOT / "config" / "micro.yaml", parse_set(LENGTH_CLIMB_SETS))
    work = Path(tempfile.mkdtemp(prefix="rloo-length-climb-"))
    try:
        prepare.run(cfg, work / "data")
        base.run(cfg, work / "data", work / "base")
        sft.run(cfg, work / "data", work / "base", work / "sft", work / "sft_work")
        setup(cfg["threads"], cfg["seed"])
        train = training_prompts([r for _, r in read_jsonl(work / "data" / "train.jsonl")],
                                 cfg["rloo"]["min_solution_steps"])
        trainer = RlooTrainer(cfg, work / "sft", LongerInGroupJudge(), train)
        for step in range(cfg["rloo"]["steps"]):
            trainer.history.append(trainer.step(step))  # as the stage's loop keeps it: the alarms read it
    finally:
        shutil.rmtree(work, ignore_errors=True)
    fired = alarms.first_alarms(trainer.history)
    _write_run(name, trainer.history, {"alarms": fired}, kind="failing", expect="length_climb",
               command="python bench/alarms.py construct-length-climb (micro config with " + ", ".join(
                   LENGTH_CLIMB_SETS) + "; reward: bench/alarms.py LongerInGroupJudge)",
               eval_answers=0, not_applicable=[],
               construction="constructed, not measured: a real RLOO run of the micro model (SFT 150 steps) on a "
                            "verbosity-biased pairwise judge, each completion paid its rank by length among its "
                            "prompt's k = 4 completions; that reward's mean is 0.5 at every step, so length climbs "
                            "while the reward cannot rise")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd")
    rec = sub.add_parser("record", help="trim a stage's steps.jsonl into tests/data/trajectories")
    rec.add_argument("name")
    rec.add_argument("source", type=Path, help="a stage's output folder, or a recorded run's JSON (evaluations only)")
    rec.add_argument("--kind", choices=["healthy", "failing"], required=True)
    rec.add_argument("--expect", choices=alarms.ALARMS, help="the alarm a failing run must fire")
    rec.add_argument("--command", required=True, help="what made the run (recorded beside it)")
    rec.add_argument("--not-applicable", action="append", default=[], choices=alarms.STEP_ALARMS,
                     help="an alarm the run's estimator does not check (PPO: zero_signal)")
    rec.add_argument("--eval-answers", type=int, default=500, help="graded answers per validation evaluation")
    sub.add_parser("construct-length-climb", help="record the constructed length_climb run (see above)")
    ap.add_argument("--windows", default="20,30,40,50,60")
    ap.add_argument("--z", default="2.0,2.5,3.0")
    ap.add_argument("--mismatch-kl", default="1e-5,5e-5,1e-4,2e-4,5e-4,1e-3,1e-2", help="sampling_mismatch thresholds to replay")
    ap.add_argument("--json", type=Path, help="write the figures here")
    args = ap.parse_args()
    if args.cmd == "record":
        record(args.name, args.source, args.kind, args.expect, args.command, args.eval_answers, args.not_applicable)
        return
    if args.cmd == "construct-length-climb":
        construct_length_climb()
        return
    runs = load()
    cfg = alarms.DEFAULTS
    rows = grid(runs, [int(w) for w in args.windows.split(",")], [float(z) for z in args.z.split(",")])
    print("window   z   false-positive runs (zero_signal, kl_without_reward, length_climb, sampling_mismatch)"
          "   first firing step of each failing run")
    for r in rows:
        fp = r["false_positive_runs"]
        print(f"{r['window']:6d} {r['z']:4.1f}   {fp['zero_signal']:2d} {fp['kl_without_reward']:2d} {fp['length_climb']:2d}"
              f" {fp['sampling_mismatch']:2d}   {r['caught']}")
    mm = mismatch_grid(runs, [float(t) for t in args.mismatch_kl.split(",")], [float(z) for z in args.z.split(",")])
    print(f"\nsampling_mismatch: per-token KL(sampler || trainer), window {mm['window']}")
    for n, lv in mm["levels"].items():
        print(f"  {n:24s} {lv['kind']:8s} mean {lv['mean']:.3g}, window means {lv['window_mean_min']:.3g} .. "
              f"{lv['window_mean_max']:.3g}")
    for r in mm["grid"]:
        print(f"  mismatch_kl {r['mismatch_kl']:.0e} z {r['z']:3.1f}: false positives {r['false_positive_runs']}/"
              f"{r['healthy_runs']}, caught {r['caught']}")
    chosen = table(runs, cfg)
    print(f"\nthe defaults {asdict(cfg)}:")
    for alarm, t in chosen.items():
        if alarm == "first_fired":
            continue
        print(f"  {alarm:18s} false positives {t['false_positive_runs']}/{t['healthy_runs']} healthy runs "
              f"({t['false_positive_steps']} of {t['healthy_steps']} steps); failing runs' first firing step "
              f"{t['first_firing_step']}")
    if args.json:
        runs_out = {n: {**{k: v for k, v in r.items() if k not in ("history", "evals")}, "evaluations": len(r["evals"]),
                        "mismatch_recorded": _has_mismatch(r)}
                    for n, r in runs.items()}
        for n, r in runs_out.items():  # how far short of the default a known miss falls
            if (miss := r.get("known_miss")) and miss["alarm"] == "reward_hacking":
                miss["fires_below_z"] = miss_margin(runs[n])
        args.json.write_text(json.dumps({**provenance(),
                                         "defaults": asdict(cfg), "runs": runs_out, "table": chosen, "grid": rows,
                                         "mismatch": mm},
                                        indent=1) + "\n")


if __name__ == "__main__":
    main()
