"""Break what the tests guard, once each, and show that a test fails.

Each mutation is applied to a copy of the repository (the working tree is never touched); the tests
that guard it run against the copy (PYTHONPATH points at it, so the CLI and the Snakemake rules the
tests start import the mutated package too). A mutation that no test notices is a hole in the suite:
the script then exits 1.

    python tests/helpers/mutation_check.py            # every mutation
    python tests/helpers/mutation_check.py --list     # what they are
    python tests/helpers/mutation_check.py --only no-optimizer-step
    python tests/helpers/mutation_check.py --fast     # against the fast tier only (-m "not slow")
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
GUARDS = ["tests/unit/test_estimators.py", "tests/integration/test_rollout_correction.py",
          "tests/integration/test_train.py", "tests/e2e/test_crash_safety.py"]

# name: (file, the text replaced, its replacement, what the mutation breaks)
MUTATIONS = {
    "zero-advantages": (
        "rloo/algo/estimators.py",
        "    return torch.where(keep, filled - baseline, torch.zeros_like(rewards))",
        "    return torch.zeros_like(rewards)",
        "RLOO advantages are always zero",
    ),
    "group-mean-baseline": (
        "rloo/algo/estimators.py",
        "    baseline = (total - filled) / (count - 1).clamp(min=1)",
        "    baseline = total / count.clamp(min=1)",
        "the leave-one-out baseline is replaced by the group mean (itself included)",
    ),
    "correction-cap-dropped": (
        "rloo/algo/rollout_correction.py",
        "        w = torch.exp(level.clamp(max=log_cap))  # min(r, C), as exp(min(log r, log C))\n",
        "        w = torch.exp(level)  # mutation: no cap\n",
        "the truncated importance weights are not truncated",
    ),
    "correction-weights-differentiated": (
        "rloo/algo/rollout_correction.py",
        "    delta = trainer_logp.detach().float() - torch.where(m, sampler_logp.float(), 0.0)\n",
        "    delta = trainer_logp.float() - torch.where(m, sampler_logp.float(), 0.0)  # mutation\n",
        "the rollout correction's weights carry a gradient (not constants)",
    ),
    "sampling-mismatch-alarm-off": (
        "rloo/train/alarms.py",
        '        "sampling_mismatch": "sampling_mismatch" not in skip and sampling_mismatch(\n',
        '        "sampling_mismatch": False and sampling_mismatch(  # mutation\n',
        "the sampling_mismatch alarm is never raised",
    ),
    "no-optimizer-step": (
        "rloo/train/rloo_trainer.py",
        "            self.optimizer.step()\n",
        "            pass  # mutation: no optimizer step\n",
        "the RLOO stage skips its optimizer step",
    ),
    "no-checkpoint-on-resume": (
        "rloo/model/checkpoint.py",
        '    """The complete checkpoint folders under `root` (checkpoint.json written), oldest first."""\n',
        '    """The complete checkpoint folders under `root` (checkpoint.json written), oldest first."""\n'
        "    return []  # mutation\n",
        "a resumed run finds no checkpoint (starts afresh)",
    ),
    "optimizer-state-not-restored": (
        "rloo/model/checkpoint.py",
        '        distributed.load_optim_state(module, opt, opt_state["optimizer"])\n',
        "        pass  # mutation: optimizer state not restored\n",
        "resuming restores the weights but not Adam's state",
    ),
}


def mutate(copy: Path, name: str) -> None:
    path, old, new, _ = MUTATIONS[name]
    text = (copy / path).read_text()
    if text.count(old) != 1:
        raise SystemExit(f"{name}: the text to replace occurs {text.count(old)} times in {path}; update MUTATIONS")
    (copy / path).write_text(text.replace(old, new))


def run(name: str, workdir: Path, fast: bool = False) -> tuple[bool, str, float]:
    copy = workdir / name
    shutil.copytree(ROOT, copy, ignore=shutil.ignore_patterns(
        ".git", ".venv*", "results", "data", "logs", ".snakemake", "mlflow.db", "__pycache__", "node_modules"))
    mutate(copy, name)
    env = {**os.environ, "PYTHONPATH": str(copy), "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    t0 = time.monotonic()
    tier = ["-m", "not slow"] if fast else []
    res = subprocess.run([sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", *tier, *GUARDS],
                         cwd=copy, env=env, capture_output=True, text=True)
    failed = [line for line in res.stdout.splitlines() if line.startswith("FAILED")]
    return res.returncode != 0, (failed[0] if failed else res.stdout.strip().splitlines()[-1]), time.monotonic() - t0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", action="append", choices=list(MUTATIONS))
    ap.add_argument("--list", action="store_true")
    ap.add_argument("--fast", action="store_true", help="run the guards' fast tier only")
    a = ap.parse_args()
    if a.list:
        for name, (path, *_, what) in MUTATIONS.items():
            print(f"{name:30} {path:24} {what}")
        return 0
    holes = []
    with tempfile.TemporaryDirectory(prefix="rloo-mutants-") as tmp:
        for name in a.only or MUTATIONS:
            caught, detail, seconds = run(name, Path(tmp), a.fast)
            print(f"{name:30} {'caught' if caught else 'NOT CAUGHT'} ({seconds:.0f} s): {detail}", flush=True)
            if not caught:
                holes.append(name)
    if holes:
        print(f"no test fails for: {', '.join(holes)}")
        return 1
    print("every mutation makes a test fail")
    return 0


if __name__ == "__main__":
    sys.exit(main())
