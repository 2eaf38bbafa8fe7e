"""The verdicts of scripts/gpu_check.sh, from the files its steps write: each check passes, fails, or
was not run, and the script passes only when every check ran and passed.

- memory: the measured peak of one RLOO update (bench/memory.py --gpu-check --json) against the memory
  plan's prediction of it, within ±20 % (the accuracy tests/e2e/test_memory_plan.py holds the plan to).
  On a CPU the peak is the process's RSS, which counts the interpreter and its libraries the plan
  leaves out: not comparable, so the check is not run there;
- results: the report's results file is valid against its schema, and every policy's greedy
  and sampled accuracy equals the verifier's grading of the completions in the policy's records;
- served judge: the GPU chain's results were judged by a judge the job served, with a win rate and
  calls made; a chain that was not run is reported as not run, never as passed.

    python -m rloo_workflow.gpu_check --memory M.json --results R.json --records EVAL_DIR \\
        (--judge J.json | --judge-not-run REASON) [--dry-run]

Exit status 0 when every check passed (with --dry-run: when none failed, those not run named), 1 when
a check failed or was not run, 2 on a missing or malformed file (one line naming it and the key).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import dataclass
from pathlib import Path

import jsonschema
import yaml

from rloo.errors import InputError, UserError

MEMORY_TOLERANCE = 0.20
PASSED, FAILED, NOT_RUN = "passed", "failed", "not run"


@dataclass(frozen=True)
class Verdict:
    check: str
    status: str
    detail: str

    def line(self) -> str:
        return f"{self.check}: {self.status.upper()}: {self.detail}"


def _load_json(path: Path) -> dict:
    try:
        return json.loads(Path(path).read_text())
    except FileNotFoundError as e:
        raise InputError(f"{path}: no such file (the step that writes it did not run or failed)") from e
    except json.JSONDecodeError as e:
        raise InputError(f"{path}: not JSON ({e})") from e


def _number(d: dict, key: str, path: Path) -> float:
    value = d.get(key)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise InputError(f"{path}: `{key}` must be a finite number, got {value!r}")
    return float(value)


def memory_verdict(measured: dict, path: Path = Path("<memory>"), tolerance: float = MEMORY_TOLERANCE) -> Verdict:
    """The measured peak (`peak_mb`) against the plan's (`planned_update_mb`) on `device`."""
    device = measured.get("device")
    if not isinstance(device, str):
        raise InputError(f"{path}: `device` must name the device the update ran on, got {device!r}")
    peak, planned = _number(measured, "peak_mb", path), _number(measured, "planned_update_mb", path)
    figures = f"measured peak {peak / 1024:.2f} GB, planned {planned / 1024:.2f} GB"
    if not device.startswith("cuda"):
        return Verdict("memory", NOT_RUN, f"{figures} on {device}: a CPU's peak RSS counts the whole process, "
                                          "which the plan leaves out, so they are not compared")
    if planned <= 0:
        raise InputError(f"{path}: `planned_update_mb` must be positive, got {planned}")
    err = peak / planned - 1
    status = PASSED if abs(err) <= tolerance else FAILED
    return Verdict("memory", status, f"{figures} on {device}: {100 * err:+.1f} % "
                                     f"({'within' if status == PASSED else 'outside'} ±{100 * tolerance:.0f} %)")


def _accuracies(records_dir: Path, name: str) -> tuple[float, float, int]:
    """Greedy and sampled accuracy of policy `name` regraded by the verifier from its evaluation's records
    (<records_dir>/<name>.jsonl: rloo.eval.records), and how many problems they hold."""
    from rloo.eval.gains import correctness
    from rloo.eval.records import read

    path = records_dir / f"{name}.jsonl"
    if not path.exists():
        raise InputError(f"{path}: no such file (rloo evaluate --policy {name}=... writes it)")
    try:
        ev = read(name, path)
        c = correctness(ev.texts(), ev.golds)
    except (KeyError, TypeError, IndexError) as e:
        raise InputError(f"{path}: a record lacks {e} (answer, greedy.text, draws[].text)") from e
    return float(c["greedy"].mean()), float(c["sampled"].mean()), len(ev.records)


def results_verdict(results_path: Path, records_dir: Path) -> Verdict:
    """The results file against its schema, and each policy's accuracy against its records regraded."""
    result = _load_json(results_path)
    schema = yaml.safe_load((Path(__file__).parent / "schemas" / "results.schema.yaml").read_text())
    try:
        jsonschema.validate(result, schema)
    except jsonschema.ValidationError as e:
        path = "/".join(str(p) for p in e.absolute_path) or "(top level)"
        return Verdict("results", FAILED, f"{results_path}: `{path}` does not match the results schema: {e.message}")
    policies = dict(result["policies"])
    if "base" in result:
        policies["base"] = result["base"]["policy"]
    wrong, shown = [], []
    for name, p in policies.items():
        greedy, sampled, problems = _accuracies(records_dir, name)
        if problems != result["examples"]:
            return Verdict("results", FAILED, f"{records_dir / name}.jsonl: {problems} problems, the results say "
                                              f"{result['examples']}")
        shown.append(f"{name} {sampled:.3f} / {greedy:.3f}")
        for key, regraded in (("accuracy", greedy), ("accuracy_sampled", sampled)):
            if not math.isclose(p[key], regraded, abs_tol=1e-9):
                wrong.append(f"{name}.{key} is {p[key]} where its records grade {regraded}")
    if wrong:
        return Verdict("results", FAILED, f"{results_path}: " + "; ".join(wrong))
    return Verdict("results", PASSED, f"{result['examples']} problems, accuracy sampled / greedy regraded from the "
                                      f"records: {', '.join(shown)}")


def judge_verdict(results_path: Path | None, not_run: str | None = None) -> Verdict:
    """The served-judge chain's results: judged by a served judge, with calls made and a win rate."""
    if results_path is None:
        return Verdict("served judge", NOT_RUN, not_run or "no results given")
    result = _load_json(results_path)
    judge, wr = result.get("judge") or {}, result.get("win_rate") or {}
    problems = []
    if not judge.get("served"):
        problems.append(f"the judge was not served by the job (judge: {judge})")
    if not isinstance(judge.get("calls"), int) or judge["calls"] < 1:
        problems.append(f"no judge calls recorded (calls: {judge.get('calls')!r})")
    if wr.get("value") is None:
        problems.append("no win rate (every verdict failed or went unparsed)")
    if problems:
        return Verdict("served judge", FAILED, f"{results_path}: " + "; ".join(problems))
    return Verdict("served judge", PASSED, f"win rate {wr['value']:.3f} over {judge['calls']} calls")


def verdicts(args: argparse.Namespace) -> list[Verdict]:
    return [memory_verdict(_load_json(args.memory), args.memory),
            results_verdict(args.results, args.records),
            judge_verdict(args.judge, args.judge_not_run)]


def summary(checks: list[Verdict], dry_run: bool = False) -> tuple[str, int]:
    """The final line and exit status: passed only when every check ran and passed."""
    failed = [v.check for v in checks if v.status == FAILED]
    not_run = [v.check for v in checks if v.status == NOT_RUN]
    if failed:
        return f"gpu check FAILED: {', '.join(failed)}" + (f" (not run: {', '.join(not_run)})" if not_run else ""), 1
    if not_run:
        label = "gpu check dry run: no check failed" if dry_run else "gpu check INCOMPLETE"
        return f"{label}; not run: {', '.join(not_run)}", 0 if dry_run else 1
    return f"gpu check passed: {', '.join(v.check for v in checks)}", 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m rloo_workflow.gpu_check", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--memory", type=Path, required=True, help="bench/memory.py --gpu-check --json's file")
    ap.add_argument("--results", type=Path, required=True, help="the report's results JSON (rloo report)")
    ap.add_argument("--records", type=Path, required=True,
                    help="the folder of its policies' evaluation records, <policy>.jsonl (rloo evaluate)")
    judge = ap.add_mutually_exclusive_group(required=True)
    judge.add_argument("--judge", type=Path, help="the served-judge chain's results JSON")
    judge.add_argument("--judge-not-run", metavar="REASON", help="the served-judge chain was not run, and why")
    ap.add_argument("--dry-run", action="store_true", help="DEVICE=cpu: checks not run do not fail it")
    args = ap.parse_args(argv)
    try:
        checks = verdicts(args)
    except UserError as e:
        print(f"gpu check: error: {e}", file=sys.stderr)
        return 2
    for v in checks:
        print(f"  {v.line()}")
    line, status = summary(checks, args.dry_run)
    print(line)
    return status


if __name__ == "__main__":
    sys.exit(main())
