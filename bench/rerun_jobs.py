"""What a rerun cost, job by job: the Snakemake benchmark files (`benchmark:` of each rule, logs/benchmarks/)
of one or more finished runs, side by side, with each run's `Elapsed time` from its Snakemake log.

Issue 63's measurement: the SmolLM2 chain's rerun after an `rloo.lr` change, in a tree with one evaluate
job for all three policies (before) and in one with a job per policy and a report (after). Each `--run`
names a label, the folder of its benchmark files (copied aside after the run: Snakemake rewrites them),
its Snakemake log and the checkout it ran in (its commit is recorded):

    python bench/rerun_jobs.py --json docs/figures/evaluate_per_policy.json \\
        --run before=OUT/before.bench:OUT/before.log:BEFORE_TREE --run after=OUT/after.bench:OUT/after.log:AFTER_TREE

`s` is each job's wall seconds, `cpu_s` its CPU seconds (user + system, all threads), as Snakemake's
benchmark directive measures them; `snakemake_s` the whole command, start to end.
"""

from __future__ import annotations

import argparse
import csv
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.record import write
from rloo_workflow.tracking.provenance import git_output


def jobs(folder: Path) -> dict[str, dict[str, float]]:
    """{job: {"s": wall seconds, "cpu_s": CPU seconds}} from a folder of Snakemake benchmark TSV files."""
    out = {}
    for tsv in sorted(folder.glob("*.tsv")):
        with open(tsv) as f:
            row = next(csv.DictReader(f, delimiter="\t"))
        out[tsv.stem] = {"s": float(row["s"]), "cpu_s": float(row["cpu_time"])}
    return out


def by_rule(per_job: dict[str, dict[str, float]]) -> dict[str, dict[str, float]]:
    """The jobs' seconds summed per rule (a job's benchmark file is `<rule>[_<wildcards>].tsv`)."""
    out: dict[str, dict[str, float]] = {}
    for job, v in per_job.items():
        rule = out.setdefault(job.split("_")[0], {"jobs": 0, "s": 0.0, "cpu_s": 0.0})
        rule["jobs"] += 1
        rule["s"] = round(rule["s"] + v["s"], 2)
        rule["cpu_s"] = round(rule["cpu_s"] + v["cpu_s"], 2)
    return out


def elapsed_s(log: Path) -> float:
    """Snakemake's `Elapsed time: H:MM:SS.ffffff` at the end of its log, in seconds."""
    m = re.findall(r"Elapsed time: (\d+):(\d+):(\d+(?:\.\d+)?)", log.read_text())
    if not m:
        raise SystemExit(f"{log}: no 'Elapsed time' line (did the run finish?)")
    h, mi, s = m[-1]
    return 3600 * int(h) + 60 * int(mi) + float(s)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--run", action="append", required=True, metavar="LABEL=BENCH_DIR:SNAKEMAKE_LOG:TREE")
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    runs = {}
    for spec in a.run:
        label, _, rest = spec.partition("=")
        folder, log, tree = rest.split(":")
        per_job = jobs(Path(folder))
        runs[label] = {"tree_commit": git_output(["rev-parse", "HEAD"], Path(tree)), "jobs": per_job,
                       "by_rule": by_rule(per_job), "snakemake_s": round(elapsed_s(Path(log)), 1)}
    for label, run in runs.items():
        parts = ", ".join(f"{job} {v['s']:.0f} s ({v['cpu_s']:.0f} CPU s)" for job, v in run["jobs"].items())
        rules = ", ".join(f"{rule} x{v['jobs']} {v['s']:.0f} s ({v['cpu_s']:.0f} CPU s)" for rule, v in run["by_rule"].items())
        print(f"{label}: snakemake {run['snakemake_s']:.0f} s; by rule: {rules}; by job: {parts}")
    if a.json:
        write(a.json, {"runs": runs})


if __name__ == "__main__":
    main()
