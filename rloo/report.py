"""What the terminal shows when a stage ends: `rloo summary FILE` (the Snakemake rules call it), and
the stages' own last log lines. Lines starting with `!!` need a person's attention."""

from __future__ import annotations

import json
import sys
from pathlib import Path


def rloo_lines(metrics: dict) -> list[str]:
    """The RLOO stage's `metrics.json`: the policy it wrote, an early stop, every alarm that fired."""
    acc = metrics.get("selected_val_accuracy_sampled")
    lines = [f"rloo: wrote the policy after {metrics['selected_step']} of {metrics['steps_trained']} steps"
             + (f" (select: {metrics['select']}, validation sampled accuracy {acc:.3f})" if acc is not None else "")]
    if stop := metrics.get("stopped_early"):
        lines.append(f"!! rloo: stopped early after {stop['step']} steps: alarm/{stop['alarm']} (rloo.stop_on)")
    for name, step in (metrics.get("alarms") or {}).items():
        if step is not None:
            lines.append(f"!! rloo: alarm/{name} fired at step {step} (docs/failure-modes.md)")
    return lines


def prepare_lines(manifest: dict) -> list[str]:
    """The data manifest: what was written, and every bad record that was skipped."""
    counts = manifest["counts"]
    lines = [f"prepare: {counts['train']} train / {counts.get('val', 0)} validation / {counts['test']} test "
             f"problems from {manifest['source']}"]
    skipped = manifest.get("skipped") or {}
    if total := sum(skipped.values()):
        reasons = manifest.get("skip_reasons") or []
        lines.append(f"!! prepare: skipped {total} bad records (data.on_bad_record: skip; "
                     + ", ".join(f"{k} {v}" for k, v in skipped.items() if v) + ")"
                     + (f"; first: {reasons[0]}" if reasons else ""))
    return lines


def evaluate_lines(result: dict) -> list[str]:
    """An evaluation result: each policy's held-out accuracy, proxy score and alarms; the win rates."""
    sft = result["policies"]["sft"]
    lines = []
    for name, p in result["policies"].items():
        gain = "" if name == "sft" else (f" ({100 * (p['accuracy_sampled'] - sft['accuracy_sampled']):+.1f} sampled, "
                                          f"{100 * (p['accuracy'] - sft['accuracy']):+.1f} greedy vs SFT)")
        proxy = "" if p.get("proxy_reward") is None else f", reward-model proxy {p['proxy_reward']:.3f}"
        lines.append(f"evaluate: {name}: accuracy sampled {p['accuracy_sampled']:.3f} / greedy {p['accuracy']:.3f}"
                     f"{gain}{proxy}, KL {p['kl']:.2f}")
        for alarm, step in (p.get("alarms") or {}).items():
            lines.append(f"!! evaluate: {name} was trained with alarm/{alarm} firing (from step {step})")
        if name != "sft" and p["accuracy_sampled"] < sft["accuracy_sampled"]:
            lines.append(f"!! evaluate: {name} is less accurate than the SFT policy it started from")
    independent = result.get("judges", {}).get("win_rate", {}).get("independent_of_training_reward")
    for name, wr in result.get("win_rates", {}).items():
        if wr.get("value") is not None:
            lines.append(f"evaluate: {name} vs sft win rate {wr['value']:.3f} ({wr['wins']:.0f} wins, {wr['losses']:.0f} losses, "
                         f"{wr['ties']:.0f} ties; judge {'independent of' if independent else 'the same as'} the training reward)")
    return lines


def main(paths: list[str]) -> int:
    for path in paths:
        data = json.loads(Path(path).read_text())
        lines = (evaluate_lines(data) if "policies" in data else prepare_lines(data) if "counts" in data
                 else rloo_lines(data))
        print("\n".join(lines), file=sys.stderr if any(x.startswith("!!") for x in lines) else sys.stdout)
    return 0
