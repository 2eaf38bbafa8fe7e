"""What the calculator buys on the quick start (issue 73): each policy of the chain trained and evaluated
with the tool against the same policy of the default chain, on the same problems and the same draws.

Two runs of the quick start in one folder, the second on the first's prepare, base and reward model:

    bash scripts/pipeline.sh                                   # then copy the folder to DEFAULT
    bash scripts/pipeline.sh --configfile config/tools.yaml    # SFT, RLOO and the evaluations rerun: TOOLS
    python bench/tools_gain.py --default DEFAULT --tools TOOLS --json docs/figures/tools_seed0.json

For SFT and RLOO it reads each run's evaluation records (results/eval/<policy>.jsonl: every problem's
greedy answer and sampled draws, graded) and summary, and gives:
- the accuracy of each run's policy (sampled: the mean of the draws; greedy) and the paired gain of the
  tool chain's policy over the default's: both trained their own way, graded on the same problems with
  the same evaluation seeds, so each problem pairs with itself (rloo.eval.gains.gain: a paired bootstrap
  over problems, a sign-flip p-value sampled, McNemar greedy);
- the tool chain's own figures: calls per sampled completion, the share of calls that erred, and its
  policy decoded a second time without the tool (config/tools.yaml's `evaluate_without`) with the tool's
  paired gain on the same weights;
- the wrong sampled answers and how many of them carry a wrong `<<expr=value>>` annotation (value not
  what expr computes): the arithmetic slips a calculator is there to remove.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.record import write
from rloo.eval import records
from rloo.eval.gains import correctness, gain
from rloo.eval.records import PolicyRecords

POLICIES = ("sft", "rloo")
SEED = 0  # the bootstrap's: the same as the report's for seed 0


def graded(run: Path, policy: str) -> PolicyRecords:
    """The evaluation records and figures of `policy` in the run folder `run`."""
    return records.read(policy, run / "results" / "eval" / f"{policy}.jsonl")


def slips(rows: list[dict]) -> dict[str, float | int]:
    """The wrong sampled draws, and those of them with a wrong calculator annotation."""
    wrong = [d for r in rows for d in r["draws"] if not d["correct"]]
    slipped = sum(1 for d in wrong if d.get("wrong_annotations", 0) > 0)
    return {"draws": sum(len(r["draws"]) for r in rows), "wrong": len(wrong), "wrong_with_a_slip": slipped,
            "slip_share": slipped / len(wrong) if wrong else 0.0}


def compare(default: Path, tools: Path, policy: str) -> dict:
    """One policy of the two runs side by side (see the module's docstring)."""
    a_pr, b_pr = graded(default, policy), graded(tools, policy)
    if a_pr.questions != b_pr.questions:
        raise SystemExit(f"{policy}: the two runs graded different problems; run both on the same prepared data")
    a_rec, b_rec, b_fig = a_pr.records, b_pr.records, b_pr.summary["figures"]
    a, b = correctness(a_pr.texts(), a_pr.golds), correctness(b_pr.texts(), b_pr.golds)
    tool_keys = ("tool_calls_sampled", "tool_calls", "tool_error_share_sampled", "tool_answer_share_sampled")
    return {
        "default": {"accuracy_sampled": float(a["sampled"].mean()), "accuracy": float(a["greedy"].mean()),
                    "slips": slips(a_rec)},
        "tools": {"accuracy_sampled": float(b["sampled"].mean()), "accuracy": float(b["greedy"].mean()),
                  "slips": slips(b_rec), **{k: b_fig.get(k) for k in tool_keys},
                  "without_tools": b_fig.get("without_tools"), "tool_gain": b_fig.get("tool_gain")},
        "gain_tools_over_default": gain(b, a, SEED),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--default", type=Path, required=True, help="the folder of the default chain's run")
    ap.add_argument("--tools", type=Path, required=True, help="the folder of the run with config/tools.yaml")
    ap.add_argument("--json", default=None, help="write the figures here (bench/record.py)")
    a = ap.parse_args()
    out = {p: compare(a.default, a.tools, p) for p in POLICIES}
    print("| policy | default sampled / greedy | with the tool sampled / greedy | gain sampled (95 % CI, p) | "
          "gain greedy | calls per completion | calls erred | wrong draws with a slip: default, tool |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for p, r in out.items():
        d, t, g = r["default"], r["tools"], r["gain_tools_over_default"]

        def interval(x: dict) -> str:
            lo, hi = x["ci95"]
            return f"{100 * x['gain']:+.1f} [{100 * lo:+.1f}, {100 * hi:+.1f}] (p = {x['p_value']:.2g})"

        erred = "n/a" if t["tool_error_share_sampled"] is None else f"{100 * t['tool_error_share_sampled']:.1f} %"
        calls = "n/a" if t["tool_calls_sampled"] is None else f"{t['tool_calls_sampled']:.2f}"
        print(f"| {p} | {d['accuracy_sampled']:.3f} / {d['accuracy']:.3f} | {t['accuracy_sampled']:.3f} / {t['accuracy']:.3f} | "
              f"{interval(g['sampled'])} | {interval(g['greedy'])} | {calls} | {erred} | "
              f"{d['slips']['wrong_with_a_slip']}/{d['slips']['wrong']}, {t['slips']['wrong_with_a_slip']}/{t['slips']['wrong']} |")
    if a.json:
        write(a.json, {"default_run": str(a.default), "tools_run": str(a.tools), "policies": out}, indent=2)


if __name__ == "__main__":
    main()
