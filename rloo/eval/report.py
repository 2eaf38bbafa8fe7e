"""What the terminal shows when a stage ends: `rloo summary FILE` (`rloo prepare`, `train` and `report`
print theirs as they end), and the stages' own last log lines. Lines starting with `!!` need a person's
attention."""

from __future__ import annotations

import json
import sys
from pathlib import Path


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
        lines.append(f"report: {name}: accuracy sampled {p['accuracy_sampled']:.3f} / greedy {p['accuracy']:.3f}"
                     f"{gain}{proxy}, KL {p['kl']:.2f}")
        if tr := p.get("training_reward"):
            lines.append(f"report: {name}: {training_reward_line(tr)}")
        for alarm, step in (p.get("alarms") or {}).items():
            lines.append(f"!! evaluate: {name} was trained with alarm/{alarm} firing (from step {step})")
        if name != "sft" and p["accuracy_sampled"] < sft["accuracy_sampled"]:
            lines.append(f"!! evaluate: {name} is less accurate than the SFT policy it started from")
    for name, g in (result.get("gains") or {}).items():
        lines.append(f"report: {gain_line(name, g)}")
    if base := result.get("base"):  # the untrained start: what SFT and RL each added to it
        b = base["policy"]
        lines.append(f"report: base (untrained): accuracy sampled {b['accuracy_sampled']:.3f} / greedy {b['accuracy']:.3f}, "
                     f"{at_k_line('pass', b['pass_at_k'])}, {at_k_line('maj', b['maj_at_k'])}")
        if tr := b.get("training_reward"):
            lines.append(f"report: base (untrained): {training_reward_line(tr)}")
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


def main(paths: list[str]) -> int:
    for path in paths:
        data = json.loads(Path(path).read_text())
        lines = (report_lines(data) if "policies" in data else prepare_lines(data) if "counts" in data
                 else rloo_lines(data))
        print("\n".join(lines), file=sys.stderr if any(x.startswith("!!") for x in lines) else sys.stdout)
    return 0
