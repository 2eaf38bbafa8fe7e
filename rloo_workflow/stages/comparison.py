"""Stage `compare`: the evaluation results of several estimators side by side (JSON + PNG).

Reads the `rloo report` results (`results/gsm8k_<estimator>.json`), one per estimator, each holding
the SFT policy and one trained policy evaluated on the same held-out prompts. Writes one row per
estimator (held-out accuracy, its gain over SFT with a 95 % interval and p-value, the solution
checker's figures, win rate against SFT and against RLOO by the evaluation's judge, KL,
length, seconds per step, samples to a validation accuracy every estimator reached, peak memory, the
networks held and their parameters) and the SFT baseline, and checks that every result was computed
on the same data.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from rloo.errors import InputError
from rloo.io import atomic_path, write_json_atomic
from rloo.settings import Config

# Per-policy metrics copied from the evaluation report, and training summary fields from metrics.json.
POLICY_KEYS = ("accuracy", "accuracy_flexible", "accuracy_sampled", "accuracy_sampled_flexible", "kl",
               "mean_length", "proxy_reward", "solution_check")
TRAINING_KEYS = ("steps", "steps_trained", "selected_step", "train_seconds", "samples_per_second",
                 "seconds_per_step", "peak_memory_mb", "samples_per_step", "networks", "final_reward_mean",
                 "final_kl", "reward_source", "alarms")
# The critic-free reference every estimator's policy is judged against (beside SFT).
BASELINE = "rloo"


def _policy_name(name: str, result: dict) -> str:
    """The trained policy's key in one evaluation result: `name` if present, else the only non-SFT one."""
    policies = [p for p in result.get("policies", {}) if p != "sft"]
    if name in policies:
        return name
    if len(policies) == 1:
        return policies[0]
    raise InputError(f"{name}: expected one trained policy in the result, found {policies or 'none'}")


def compare(results: dict[str, dict]) -> dict[str, Any]:
    """The comparison table of `results` ({estimator: evaluation result})."""
    if not results:
        raise InputError("compare: no result files given")
    rows: dict[str, dict] = {}
    for name, res in results.items():
        policy = _policy_name(name, res)
        report = res["policies"][policy]
        wins = res.get("win_rates", {}).get(policy) or {}
        training = (res.get("training") or {}).get(policy) or {}
        rows[name] = {
            **{k: report.get(k) for k in POLICY_KEYS},
            "win_rate": wins.get("value"),
            "win_rate_detail": wins or None,
            # the evaluation's own paired comparison with SFT: gain, 95 % interval, p-value (rloo.eval.gains)
            "gain_vs_sft": (res.get("gains") or {}).get(policy),
            "training": {k: training.get(k) for k in TRAINING_KEYS if k in training},
        }
    checks = require_fair(results, rows)
    _samples_to_target(rows, results)
    first = next(iter(results.values()))
    sft = {k: first["policies"]["sft"].get(k) for k in POLICY_KEYS}
    manifests = {name: res.get("data_manifest_sha256") for name, res in results.items()}
    # greedy test accuracy alone; several sharing the highest are a tie, not a best (the table's order would
    # otherwise pick one that did no better than the others; a sweep says the same: sweep_table.winner)
    scored = {n: r["accuracy"] for n, r in rows.items() if r["accuracy"] is not None}
    top = [n for n, a in scored.items() if a == max(scored.values())] if scored else []
    return {
        "estimators": rows,
        "sft": sft,
        "best_by_accuracy": top[0] if len(top) == 1 else None,
        "tie_by_accuracy": top if len(top) > 1 else None,
        "judge": first.get("judge"),
        "examples": first.get("examples"),
        "checks": checks,
        "data_manifest_sha256": manifests,
    }


def require_fair(results: dict[str, dict], rows: dict[str, dict]) -> dict[str, bool]:
    """Every estimator saw the same data, problems and SFT start, and trained as many steps on as many
    samples, or one error names what differs; a run with no data manifest cannot show it saw the same data."""
    facts = {
        "same_data": {n: r.get("data_manifest_sha256") for n, r in results.items()},
        "same_examples": {n: r.get("examples") for n, r in results.items()},
        "same_sft_accuracy": {n: (r["policies"]["sft"].get("accuracy"), r["policies"]["sft"].get("accuracy_sampled"))
                              for n, r in results.items()},
        "same_steps": {n: row["training"].get("steps") for n, row in rows.items()},
        "same_samples_per_step": {n: row["training"].get("samples_per_step") for n, row in rows.items()},
    }
    if missing := [n for n, m in facts["same_data"].items() if m is None]:
        raise InputError(f"compare: {', '.join(missing)}: no data manifest in the result, so the same data cannot be shown")
    unequal = {check: values for check, values in facts.items() if len(set(values.values())) > 1}
    if unequal:
        raise InputError("compare: the runs are not comparable: " + "; ".join(
            f"{check.removeprefix('same_').replace('_', ' ')} differs ({', '.join(f'{n}: {v}' for n, v in values.items())})"
            for check, values in unequal.items()))
    return dict.fromkeys(facts, True)


# The method description's accounting: a trained parameter costs 16 bytes (bf16 weights and gradients,
# fp32 Adam moments and master weights), a frozen one 2 (bf16 weights).
TRAINED, BYTES_TRAINED, BYTES_FROZEN = ("policy", "critic"), 16, 2


def model_state_bytes(networks: dict[str, int]) -> int:
    """Model state of the networks held, by the accounting above (computed, not measured)."""
    return sum(n * (BYTES_TRAINED if name in TRAINED else BYTES_FROZEN) for name, n in networks.items())


def _evals(name: str, res: dict) -> list[dict]:
    policy = _policy_name(name, res)
    return (((res.get("training") or {}).get(policy) or {}).get("evals")) or []


def _samples_to_target(rows: dict[str, dict], results: dict[str, dict]) -> None:
    """Samples each estimator drew before its validation sampled accuracy first reached the target:
    the highest accuracy that every estimator's run reached (so each has a figure), step 0 excluded."""
    best = {n: max((e["eval/accuracy_sampled"] for e in _evals(n, r) if e["step"] > 0), default=None)
            for n, r in results.items()}
    if any(b is None for b in best.values()):
        return
    target = min(best.values())
    for name, res in results.items():
        per_step = rows[name]["training"].get("samples_per_step")
        step = next(e["step"] for e in _evals(name, res) if e["step"] > 0 and e["eval/accuracy_sampled"] >= target)
        rows[name]["samples_to_target"] = {"target_val_accuracy_sampled": target, "step": step,
                                           "samples": step * per_step if per_step else None}


def judge_against_baseline(table: dict[str, Any], record_files: dict[str, Path], cfg: dict,
                           judge_log: str | Path | None = None) -> None:
    """Win rate of each estimator's policy against the RLOO estimator's, by the evaluation's judge, on
    their evaluations' records (rloo.eval.records: the same problems, the same decoding mode); a served
    judge is started once for all of them (its output in `judge_log`, default
    <paths.logs>/comparison.judge.log)."""
    from rloo.eval.records import read
    from rloo_workflow.judge_server import open_judge
    from rloo_workflow.stages.judge import judge_pairs

    if BASELINE not in record_files or not all(Path(f).is_file() for f in record_files.values()):
        return
    config = Config.of(cfg)
    mode = config.evaluate.win_rate_decoding
    baseline = read(BASELINE, record_files[BASELINE])
    candidates = {name: read(name, f) for name, f in record_files.items()
                  if name != BASELINE and name in table["estimators"]}
    # The job holds no policy: all its GPUs are the judge's.
    with open_judge(cfg, judge_log or Path(config.paths.logs) / "comparison.judge.log", reserved_gpus=0) as judge:
        for name, detail in judge_pairs(judge, candidates, baseline, mode, config.progress_every_s).items():
            table["estimators"][name][f"win_rate_vs_{BASELINE}"] = detail
        table["judge_vs_baseline"] = {"baseline": BASELINE, "decoding": mode, **judge.check()}


def plot_comparison(table: dict[str, Any], path: str | Path) -> str:
    """Held-out accuracy (greedy, sampled), win rate against SFT, and KL per estimator; SFT as lines."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = table["estimators"]
    names = list(rows)
    x = list(range(len(names)))

    def vals(key: str) -> list[float]:
        return [float("nan") if rows[n][key] is None else rows[n][key] for n in names]

    fig, axes = plt.subplots(1, 3, figsize=(13, 3.8))
    w = 0.38
    axes[0].bar([i - w / 2 for i in x], vals("accuracy"), w, label="greedy")
    axes[0].bar([i + w / 2 for i in x], vals("accuracy_sampled"), w, label="sampled T=1")
    sft = table["sft"]
    if sft.get("accuracy") is not None:
        axes[0].axhline(sft["accuracy"], color="tab:blue", ls="--", lw=1, label="SFT greedy")
    if sft.get("accuracy_sampled") is not None:
        axes[0].axhline(sft["accuracy_sampled"], color="tab:orange", ls=":", lw=1, label="SFT sampled")
    axes[0].set_title("held-out verifier accuracy")
    axes[0].set_ylim(0, 1)
    axes[0].legend(fontsize=7)
    axes[1].bar(x, vals("win_rate"), color="tab:green")
    axes[1].axhline(0.5, color="k", ls="--", lw=1)
    axes[1].set_ylim(0, 1)
    axes[1].set_title("win rate against SFT (judge)")
    axes[2].bar(x, vals("kl"), color="tab:red")
    axes[2].set_title("sequence KL to the reference (nats)")
    for ax in axes:
        ax.set_xticks(x, names, rotation=30, ha="right")
    fig.suptitle(f"estimators on {table.get('examples')} held-out prompts", fontsize=10)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_path(path) as tmp:
        fig.savefig(tmp, format="png", dpi=110, bbox_inches="tight")
    plt.close(fig)
    return str(path)


def run(result_files: dict[str, str | Path], out_json: str | Path, out_png: str | Path,
        timing_files: dict[str, str | Path] | None = None, cfg: dict | None = None,
        judge_log: str | Path | None = None, record_files: dict[str, str | Path] | None = None) -> dict[str, Any]:
    """Compare the evaluation results in `result_files` ({estimator: path}); write JSON and PNG.

    `timing_files` ({estimator: <work>/timings.json}): the RLOO runs' wall-clock figures, kept outside
    their outputs; an estimator whose file is missing (its work folder was removed) has none. With
    `cfg` (its evaluate.judge settings) and `record_files` ({estimator: its evaluation's records,
    <results>/eval/<estimator>.jsonl}), each policy is also judged against RLOO's."""
    results = {name: json.loads(Path(f).read_text()) for name, f in result_files.items()}
    table = compare(results)
    for name, f in (timing_files or {}).items():
        if name in table["estimators"] and Path(f).is_file():
            timings = json.loads(Path(f).read_text())
            table["estimators"][name]["training"].update({k: timings[k] for k in TRAINING_KEYS if k in timings})
    for row in table["estimators"].values():
        nets = row["training"].get("networks")
        row["parameters_held"] = sum(nets.values()) if nets else None
        row["model_state_bytes"] = model_state_bytes(nets) if nets else None
    if cfg is not None and record_files:
        judge_against_baseline(table, {n: Path(f) for n, f in record_files.items()}, cfg, judge_log)
    table["sources"] = {name: str(f) for name, f in result_files.items()}
    # The plot first: the JSON is the stage's completion marker.
    table["plot"] = plot_comparison(table, out_png)
    write_json_atomic(out_json, table)
    return table
