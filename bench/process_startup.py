"""CPU seconds a fresh Python process spends importing what a stage needs, before it does any work.

Every Snakemake job, every `rloo` command and every torchrun worker is a new process that imports
torch and transformers again; on a machine whose cores are busy (the test suite on two cores), those
seconds are taken from the work itself. Each target is one `python -c "import ..."` in a subprocess of
this venv's interpreter; its CPU time (user + system, from the child's rusage) and wall time are
timed over `--rounds` rounds, the targets in turn within each round, and the median is reported.

    python bench/process_startup.py --json docs/figures/process_startup.json
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.record import write  # noqa: E402

# name -> the statement the process runs
TARGETS = {
    "python": "pass",
    "torch": "import torch",
    # PreTrainedModel, not the lazy AutoModelForCausalLM name: its modeling code, what from_pretrained loads
    "transformers (modeling)": "from transformers import PreTrainedModel",
    "rloo stage: prepare": "import rloo_workflow.stages.prepare",
    "rloo stage: sft": "import rloo_workflow.stages.sft",
    "rloo stage: train (RLOO)": "import rloo_workflow.stages.rloo",
    "rloo stage: evaluate": "import rloo_workflow.stages.evaluate",
    "mlflow": "import mlflow",
    "dvc (dvc.repo)": "from dvc.repo import Repo",
    "snakemake (snakemake.api)": "import snakemake.api",
}


def timed(statement: str) -> tuple[float, float]:
    """(CPU seconds, wall seconds) of one fresh interpreter running `statement`."""
    before = os.times()
    start = time.perf_counter()
    subprocess.run([sys.executable, "-c", statement], cwd=ROOT, check=True)
    wall = time.perf_counter() - start
    after = os.times()
    return (after.children_user - before.children_user) + (after.children_system - before.children_system), wall


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json", type=Path, help="write the figures here (docs/figures/process_startup.json)")
    args = ap.parse_args()
    timed("pass")  # the interpreter and the page cache warm, uncounted
    samples: dict[str, list[tuple[float, float]]] = {name: [] for name in TARGETS}
    for _ in range(args.rounds):
        for name, statement in TARGETS.items():
            samples[name].append(timed(statement))
    rows = {name: {"cpu_s": round(statistics.median(c for c, _ in s), 2),
                   "wall_s": round(statistics.median(w for _, w in s), 2), "rounds": len(s)}
            for name, s in samples.items()}
    print(f"{'import':40s} {'CPU s':>7s} {'wall s':>7s}")
    for name, r in rows.items():
        print(f"{name:40s} {r['cpu_s']:7.2f} {r['wall_s']:7.2f}")
    if args.json:
        write(args.json, {"imports": rows, "note": "median of the rounds; wall above CPU is waiting "
                          "(snakemake's Slurm plugin asks the Slurm commands at import)"},
              extra=("snakemake", "mlflow", "dvc"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
