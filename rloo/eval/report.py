"""What the terminal shows when a stage ends: `rloo summary FILE` (`rloo prepare`, `train` and `report`
print theirs as they end), and the stages' own last log lines. Lines starting with `!!` need a person's
attention. It reads every file the pipeline writes for a person to read (`KINDS`): the data's manifest,
the RLOO stage's metrics.json, a policy's evaluation, the results of one chain, of a sweep, of the seeds
and of the comparison."""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from pathlib import Path

from rloo.errors import InputError


def rloo_lines(metrics: dict) -> list[str]:
    """The RLOO stage's `metrics.json`: the policy it wrote, an early stop, every alarm that fired."""
    acc = metrics.get("selected_val_accuracy_sampled")
    lines = [f"rloo: wrote the policy after {metrics['selected_step']} of {metrics['steps_trained']} steps"
             + (f" (select: {metrics['select']}, validation sampled accuracy {acc:.3f})" if acc is not None else "")]
    if functions := metrics.get("reward_functions"):
        lines.append("rloo: reward functions, mean over the last 10 steps: " + ", ".join(
            f"{name} {_figure(f['final_mean'])} (weight {f['weight']:g})" for name, f in functions.items())
            + f"; their weighted sum, the training reward, {_figure(metrics.get('final_reward_mean'))}")
    if mm := metrics.get("sampling_mismatch"):
        lines.append(mismatch_line(mm))
    if stop := metrics.get("stopped_early"):
        lines.append(f"!! rloo: stopped early after {stop['step']} steps: alarm/{stop['alarm']} (rloo.stop_on)")
    for name, step in (metrics.get("alarms") or {}).items():
        if step is not None:
            lines.append(f"!! rloo: alarm/{name} fired at step {step} (docs/failure-modes.md)")
    return lines


def _figure(value: float | None) -> str:
    return "n/a" if value is None or value != value else f"{value:.3f}"


def mismatch_line(mm: dict) -> str:
    """The sampler-trainer mismatch over the run (means of the per-step train/mismatch_* figures) and
    what rloo.rollout_correction did about it."""
    line = (f"rloo: sampler vs trainer: mean |Δ log p| {mm['mismatch_abs_mean']:.2e} (max {mm['mismatch_abs_max']:.2e}),"
            f" KL k3 {mm['mismatch_k3_token']:.2e}/token {mm['mismatch_k3_seq']:.2e}/sequence,"
            f" {mm['mismatch_out_of_band']:.1%} of tokens outside [1/{mm['cap']:g}, {mm['cap']:g}];"
            f" rloo.rollout_correction {mm['mode']}")
    if mm["mode"] != "none":
        line += (f" (truncated {mm.get('correction_truncated_share', 0.0):.1%},"
                 f" masked {mm.get('correction_masked_share', 0.0):.1%} of tokens)")
    return line


def prepare_lines(manifest: dict) -> list[str]:
    """The data manifest: what was written, and every bad record that was skipped."""
    counts = manifest["counts"]
    lines = [f"prepare: {counts['train']} train / {counts.get('val', 0)} validation / {counts['test']} test "
             f"problems from {manifest['source']}"]
    if (line := overlap_line("prepare", manifest.get("train_test_overlap"))) is not None:
        lines.append(line)
    if (line := ngram_line("prepare", manifest.get("train_test_ngram_overlap"))) is not None:
        lines.append(line)
    skipped = manifest.get("skipped") or {}
    if total := sum(skipped.values()):
        reasons = manifest.get("skip_reasons") or []
        lines.append(f"!! prepare: skipped {total} bad records (data.on_bad_record: skip; "
                     + ", ".join(f"{k} {v}" for k, v in skipped.items() if v) + ")"
                     + (f"; first: {reasons[0]}" if reasons else ""))
    oversized = manifest.get("oversized") or {}
    if total := sum(oversized.values()):
        lines.append(f"!! prepare: dropped {total} records over data.max_record_chars (data.on_oversized: drop; "
                     + ", ".join(f"{k} {v}" for k, v in oversized.items() if v) + ")")
    return lines


def overlap_line(stage: str, overlap: int | None) -> str | None:
    """How many training problems are also test problems (data.allow_train_test_overlap); None when unknown."""
    if overlap is None:
        return None
    if overlap:
        return (f"!! {stage}: {overlap} training problems also occur in the test split (data.allow_train_test_overlap):"
                " the held-out accuracy is measured partly on problems trained on")
    return f"{stage}: no training problem occurs in the test split"


def ngram_line(stage: str, found: dict | None) -> str | None:
    """How many training problems share a run of n normalised words with a test problem; a `!!` line where
    data.on_ngram_overlap asked for a warning; None with the check off or unknown."""
    if not found:
        return None
    line = (f"{stage}: {found['count']} training problems share a run of {found['words']} words with a test problem "
            f"(data.on_ngram_overlap: {found['mode']})")
    return f"!! {line}" if found["count"] and found["mode"] != "count" else line


def report_lines(result: dict) -> list[str]:
    """A results JSON (`rloo report`): each policy's held-out accuracy, proxy score and alarms; the win rates."""
    sft = result["policies"]["sft"]
    lines = [line for line in (overlap_line("report", result.get("train_test_overlap")),
                               ngram_line("report", result.get("train_test_ngram_overlap"))) if line is not None]
    for name, p in result["policies"].items():
        gain = "" if name == "sft" else (f" ({100 * (p['accuracy_sampled'] - sft['accuracy_sampled']):+.1f} sampled, "
                                          f"{100 * (p['accuracy'] - sft['accuracy']):+.1f} greedy vs SFT)")
        proxy = "" if p.get("proxy_reward") is None else f", reward-model proxy {p['proxy_reward']:.3f}"
        lines.append(f"report: {name}: {accuracy_text(p)}{gain}{proxy}, KL {p['kl']:.2f}")
        if tr := p.get("training_reward"):
            lines.append(f"report: {name}: {training_reward_line(tr)}")
        for alarm, step in (p.get("alarms") or {}).items():
            lines.append(f"!! evaluate: {name} was trained with alarm/{alarm} firing (from step {step})")
        if name != "sft" and p["accuracy_sampled"] < sft["accuracy_sampled"]:
            lines.append(f"!! evaluate: {name} is less accurate than the SFT policy it started from")
    for name, p in result["policies"].items():
        lines += [f"report: {name}: {line}" for line in tool_lines(p)]
    for name, g in (result.get("gains") or {}).items():
        lines.append(f"report: {gain_line(name, g)}")
    if base := result.get("base"):  # the untrained start: what SFT and RL each added to it
        b = base["policy"]
        lines.append(f"report: base (untrained): accuracy sampled {b['accuracy_sampled']:.3f} / greedy {b['accuracy']:.3f}, "
                     f"{at_k_line('pass', b['pass_at_k'])}, {at_k_line('maj', b['maj_at_k'])}")
        if tr := b.get("training_reward"):
            lines.append(f"report: base (untrained): {training_reward_line(tr)}")
        lines += [f"report: base (untrained): {line}" for line in tool_lines(b)]
        lines += [f"report: {gain_line(name, g, against='base')}" for name, g in base["gains"].items()]
    for name, p in result["policies"].items():
        if check := p.get("solution_check"):
            lines.append(f"report: {name}: {solution_check_line(check)}")
        if (best := p.get("pass_at_k")) and (vote := p.get("maj_at_k")):
            lines.append(f"report: {name}: {at_k_line('pass', best)}, {at_k_line('maj', vote)}")
    if (judge := result.get("judge") or {}).get("calls") is not None:  # an LLM judge's calls
        lines.append(f"report: LLM judge {judge.get('base_url')}: {judge['calls']} calls, {judge.get('retries', 0)} "
                     f"retries, {judge['failed_calls']} failed after their retries, {judge['unparsed_replies']} "
                     "answered without a verdict")
    independent = result.get("judges", {}).get("win_rate", {}).get("independent_of_training_reward")
    for name, wr in result.get("win_rates", {}).items():
        if wr.get("value") is not None:
            ci = f" [{wr['ci95'][0]:.3f}, {wr['ci95'][1]:.3f}]" if wr.get("ci95") else ""
            lines.append(f"report: {name} vs sft win rate {wr['value']:.3f}{ci} ({wr['wins']:.0f} wins, {wr['losses']:.0f} losses, "
                         f"{wr['ties']:.0f} ties, a tie counting half; "
                         + {True: "judge independent of the training reward", False: "judge the same as the training reward",
                            None: "judge's independence unknown: no training metrics, or a reward function "
                                  "or server of the user's trained it"}[independent] + ")")
        if (agree := wr.get("agreement_with_verifier")) and agree["value"] is not None:
            ci = f" [{agree['ci95'][0]:.3f}, {agree['ci95'][1]:.3f}]" if agree.get("ci95") else ""
            lines.append(f"report: {name} vs sft judge agrees with the verifier on {agree['agree']} of the "
                         f"{agree['judged']} pairs the verifier decides ({agree['value']:.3f}{ci}; "
                         f"{agree['decided_pairs'] - agree['judged']} left invalid)")
    return lines


def training_reward_line(tr: dict) -> str:
    """The training reward over a policy's sampled completions, and each of its parts, with intervals."""
    def part(f: dict) -> str:
        ci = f" [{f['ci95'][0]:.3f}, {f['ci95'][1]:.3f}]" if f.get("ci95") else ""
        return _figure(f["mean"]) + ci

    return (f"training reward {part(tr['weighted_sum'])} = " + " + ".join(
        f"{f['weight']:g} x {name} {part(f)}" for name, f in tr["parts"].items())
        + f" ({tr['completions']} sampled completions, 95 % t interval over problems)")


def gain_line(name: str, g: dict, against: str = "sft") -> str:
    """`RLOO − SFT = +6.6 [+4.1, +9.0] points (p = 0.001) sampled; greedy ...`, for the terminal."""
    def part(m: dict) -> str:
        lo, hi = m["ci95"]
        p = m["p_value"]
        return (f"{100 * m['gain']:+.1f} [{100 * lo:+.1f}, {100 * hi:+.1f}] points "
                f"(p {'< 0.001' if p < 0.001 else f'= {p:.3f}'})")

    return (f"{name.upper()} − {against.upper()} = {part(g['sampled'])} sampled ({g['draws']} draws); "
            f"{part(g['greedy'])} greedy; {g['n_problems']} problems, 95 % paired bootstrap")


def tool_lines(figures: dict) -> list[str]:
    """With tools (rloo.eval.tool_use): the calls per completion, the share that erred, the share of right
    answers taken from a tool's result; with the pass without the tools too, its accuracy and the tool's
    paired gain (`tool_gain`: the same paired figures as a policy's gain over SFT). None without tools."""
    if "tool_calls_sampled" not in figures:
        return []

    def share(value: float | None) -> str:
        return "n/a" if value is None else f"{100 * value:.1f} %"

    lines = [f"tools: {figures['tool_calls_sampled']:.2f} calls per sampled completion ({figures['tool_calls']:.2f} "
             f"greedy), {share(figures.get('tool_error_share_sampled'))} of them erred; "
             f"{share(figures.get('tool_answer_share_sampled'))} of the right sampled answers are a tool's result"]
    if without := figures.get("without_tools"):
        lines.append(f"without tools: {accuracy_text(without)}")
    if g := figures.get("tool_gain"):
        lines.append(f"tool gain: {gain_line('tools', g, against='no tools')}")
    return lines


def at_k_line(kind: str, figure: dict) -> str:
    """pass@k / maj@k with its interval, e.g. `pass@4 0.812 [0.775, 0.844]`."""
    ci = f" [{figure['ci95'][0]:.3f}, {figure['ci95'][1]:.3f}]" if figure.get("ci95") else ""
    return f"{kind}@{figure['k']} {figure['value']:.3f}{ci}"


def solution_check_line(check: dict) -> str:
    """The solution checker's figures of one policy: the work and the answer apart, or why the work has none."""
    answer = "n/a" if check.get("answer_right") is None else f"{check['answer_right']:.3f}"
    if check.get("work_right") is None:
        return f"solution check: answer right {answer} sampled; work n/a ({check.get('reason', 'nothing checked')})"
    wrong_work = check.get("right_answer_wrong_work_share")
    return (f"solution check: work checked in {100 * check['work_checked_share']:.0f} % of sampled completions, "
            f"right in {check['work_right']:.3f} of those; answer right {answer}, answer and checked work right "
            f"{check['answer_and_work_right']:.3f}"
            + (f"; right answers with wrong work {100 * wrong_work:.1f} %" if wrong_work is not None else ""))


def accuracy_text(figures: dict) -> str:
    """`accuracy sampled 0.776 [0.738, 0.810] / greedy 0.830 [...]`: with the intervals where the figures
    have them (the report's and rloo.api.evaluate's; a policy's evaluation file has none)."""
    return (f"accuracy sampled {figures['accuracy_sampled']:.3f}{_interval(figures.get('accuracy_sampled_ci95'))}"
            f" / greedy {figures['accuracy']:.3f}{_interval(figures.get('accuracy_ci95'))}")


def _interval(ci: list[float] | None) -> str:
    return f" [{ci[0]:.3f}, {ci[1]:.3f}]" if ci else ""


def _points(gain: float, ci: list[float] | None) -> str:
    """A gain in points with its interval: `+6.6 [+4.7, +8.5]`."""
    return f"{100 * gain:+.1f}" + (f" [{100 * ci[0]:+.1f}, {100 * ci[1]:+.1f}]" if ci else "")


def evaluate_lines(summary: dict) -> list[str]:
    """One policy's evaluation (`rloo evaluate`: `<results>/eval/<policy>.json`)."""
    f = summary["figures"]
    proxy = "" if f.get("proxy_reward") is None else f", reward-model proxy {f['proxy_reward']:.3f}"
    kl = "" if f.get("kl") is None else f", KL {f['kl']:.2f}"
    lines = [f"evaluate: {summary['policy']}: {accuracy_text(f)} on {summary['examples']} problems "
             f"({f['sampled_draws']} draws each){proxy}{kl}, mean length {f['mean_length']:.1f} tokens"]
    if tr := f.get("training_reward"):
        lines.append(f"evaluate: {summary['policy']}: {training_reward_line(tr)}")
    return lines + [f"evaluate: {summary['policy']}: {line}" for line in tool_lines(f)]


def sweep_lines(tab: dict) -> list[str]:
    """A sweep's table (`rloo sweep`): each point's validation accuracy (what chooses) and its test gain over
    SFT with its paired interval, then what won by validation and by how much, or the tie."""
    name, policy = tab["sweep"], tab["policy"]
    lines = [f"sweep {name}: {sweep_row_line(policy, r)}" for r in tab["rows"]]
    if best := tab.get("best"):
        lines.append(f"sweep {name}: best by validation accuracy (sampled): {best['label']}, {best['val_accuracy_sampled']:.3f}"
                     + (f", {100 * best['margin']:+.1f} points over the runner-up {best['runner_up']['label']} "
                        f"({best['runner_up']['val_accuracy_sampled']:.3f}; one validation figure per point: "
                        "no interval)" if best.get("runner_up") else " (the only point)")
                     + "; the test figures did not choose")
    elif tie := tab.get("tie"):
        lines.append(f"!! sweep {name}: tie: {', '.join(tie['labels'])} share the highest validation accuracy "
                     f"(sampled), {tie['val_accuracy_sampled']:.3f}: no point won (the grid order does not choose; "
                     "more validation problems, rloo.eval_examples, may tell them apart)")
    else:
        lines.append(f"!! sweep {name}: no point has a validation accuracy (rloo.eval_every: 0): nothing chooses a best")
    return lines


def sweep_row_line(policy: str, row: dict) -> str:
    """One point of a sweep (rloo_workflow.sweep_table.point_row): its validation accuracy, what chooses, and
    its test figures, the gain over SFT with its paired interval."""
    t = row["test"]
    val = "n/a" if row["val_accuracy_sampled"] is None else f"{row['val_accuracy_sampled']:.3f}"
    return (f"{row['label']}: validation {val}; test {policy} {t['rloo_sampled']:.3f} sampled, "
            f"{policy.upper()} − SFT {_points(t['gain_sampled'], t['gain_sampled_ci95'])} points sampled, "
            f"{_points(t['gain_greedy'], t['gain_greedy_ci95'])} greedy (95 % paired bootstrap)")


def seeds_lines(table: dict) -> list[str]:
    """The seeds target's table (`rloo seeds`): each seed's gain over SFT with its paired interval, and the
    mean across seeds with its t-interval (the run-to-run spread, which a seed's own interval leaves out)."""
    policy = table["policy"].upper()
    lines = []
    for seed, r in table["seeds"].items():
        lines.append(f"seeds: seed {seed}: {policy} − SFT {_points(r['gain_sampled'], r['gain_sampled_ci95'])} points "
                     f"sampled, {_points(r['gain_greedy'], r['gain_greedy_ci95'])} greedy (95 % paired bootstrap)")
    agg = table["aggregate"]
    s, g = agg["gain_sampled"], agg["gain_greedy"]
    lines.append(f"seeds: mean over {s['n']} seeds: {policy} − SFT {_points(s['mean'], s['ci95'])} points sampled, "
                 f"{_points(g['mean'], g['ci95'])} greedy"
                 + (" (95 % t-interval across seeds)" if s["ci95"] else " (one seed: no spread, no interval)"))
    return lines


def comparison_lines(table: dict) -> list[str]:
    """The comparison (`rloo comparison`): each estimator's accuracy and its gain over SFT with its paired
    interval (the same problems, the same SFT start), then the most accurate by greedy accuracy, or the tie."""
    lines = []
    for name, row in table["estimators"].items():
        g = row.get("gain_vs_sft")
        gain = f", {gain_line(name, g)}" if g else ""
        lines.append(f"comparison: {name}: accuracy sampled {_figure(row.get('accuracy_sampled'))} / greedy "
                     f"{_figure(row.get('accuracy'))}{gain}")
    # the comparison's own verdict (rloo_workflow/stages/comparison.py); a file written before ties were
    # named has only `best_by_accuracy`
    tied, best = table.get("tie_by_accuracy"), table.get("best_by_accuracy")
    if tied:
        top = table["estimators"][tied[0]]["accuracy"]
        lines.append(f"comparison: tie: {', '.join(tied)} share the highest accuracy (greedy), {top:.3f}")
    elif best:
        lines.append(f"comparison: most accurate (greedy): {best}, {table['estimators'][best]['accuracy']:.3f}")
    return lines


# What `rloo summary` reads, by the key only that kind of file has (the first match wins; results files
# of a chain have "policies", as have none of the others).
KINDS: dict[str, tuple[str, Callable[[dict], list[str]]]] = {
    "a sweep (results/sweeps/<name>.json)": ("sweep", sweep_lines),
    "the seeds (results/seeds/gsm8k_<estimator>.json)": ("aggregate", seeds_lines),
    "the comparison (results/comparison.json)": ("estimators", comparison_lines),
    "a chain's results (results/gsm8k_<estimator>.json)": ("policies", report_lines),
    "a policy's evaluation (results/eval/<policy>.json)": ("figures", evaluate_lines),
    "the data's manifest (data/gsm8k/manifest.json)": ("counts", prepare_lines),
    "the RLOO stage's metrics.json": ("selected_step", rloo_lines),
}


def lines_of(data: dict) -> list[str]:
    """The lines of one file the pipeline writes, by its kind (`KINDS`); any other is an InputError."""
    for key, lines in KINDS.values():
        if isinstance(data, dict) and key in data:
            return lines(data)
    raise InputError("not a file rloo summary reads; it reads " + "; ".join(KINDS))


def main(paths: list[str]) -> int:
    """Print each file's lines (those starting with `!!` to standard error); a file it cannot read is one
    line naming it, exit status 2."""
    for path in paths:
        try:
            lines = lines_of(json.loads(Path(path).read_text()))
        except (OSError, ValueError, InputError) as e:
            print(f"rloo summary: error: {path}: {e}", file=sys.stderr)
            return 2
        except KeyError as e:  # a file of a known kind that lacks a figure: written by an older rloo?
            print(f"rloo summary: error: {path}: no {e} in it", file=sys.stderr)
            return 2
        print("\n".join(lines), file=sys.stderr if any(x.startswith("!!") for x in lines) else sys.stdout)
    return 0
