"""Full fine-tuning against LoRA for the SFT stage, one after the other on the same machine: held-out
accuracy (the stage's own evaluation), final loss, training seconds and peak memory.

    python bench/sft_lora.py -c config/smollm2.yaml --data data/gsm8k --base results/models/base \
        --json docs/figures/sft_lora.json
    python bench/sft_lora.py ... --outputs FULL_DIR LORA_DIR --checkout CLONE   # two finished runs, made in CLONE

Each run is the SFT stage itself (`rloo sft`, tracking off). LoRA gets LoRA's customary settings (rank 16,
alpha 32, lr 2e-4, every linear layer) rather than full fine-tuning's lr: the same steps, batch and data.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.record import provenance  # noqa: E402

LORA = {"model.lora.enabled": "true", "model.lora.r": "16", "model.lora.alpha": "32", "sft.lr": "2e-4"}


def command(args, variant: str, out: Path) -> list[str]:
    sets = LORA if variant == "lora" else {}
    return [sys.executable, "-m", "rloo_workflow.cli", "sft", *[x for c in args.config for x in ("-c", c)],
            "--data", args.data, "--base", args.base, "--out", str(out / variant), "--work", str(out / f"{variant}_work"),
            "--set", "tracking.enabled=false", *[x for k, v in sets.items() for x in ("--set", f"{k}={v}")]]


def read(model: Path, work: Path) -> dict:
    m = json.loads((model / "metrics.json").read_text())
    t = json.loads((work / "timings.json").read_text())
    return {"accuracy_greedy": m["accuracy"], "accuracy_sampled": m["accuracy_sampled"], "examples": m["examples"],
            "steps": m["steps"], "final_loss": m["final_loss"], "parameters": m["parameters"],
            "train_seconds": t["train_seconds"], "tokens_per_second": t["tokens_per_second"],
            "peak_memory_mb": t["peak_memory_mb"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-c", "--config", action="append", default=[])
    ap.add_argument("--data", required=True)
    ap.add_argument("--base", required=True, help="the base stage's model folder")
    ap.add_argument("--outputs", nargs=2, metavar=("FULL", "LORA"), default=None,
                    help="two finished `rloo sft` outputs (their --work beside them as <out>_work)")
    ap.add_argument("--checkout", type=Path, default=ROOT,
                    help="with --outputs: the checkout the two runs were made in (its commit is recorded)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    rows = {}
    with tempfile.TemporaryDirectory(prefix="rloo-bench-lora-") as tmp:
        for variant, given in zip(("full", "lora"), args.outputs or (None, None), strict=True):
            if given:
                model = Path(given)
                rows[variant] = read(model, model.with_name(model.name + "_work"))
                continue
            env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1"}
            subprocess.run(command(args, variant, Path(tmp)), env=env, check=True)
            rows[variant] = read(Path(tmp) / variant, Path(tmp) / f"{variant}_work")
            print(json.dumps({variant: rows[variant]}), flush=True)
    out = {**provenance(root=args.checkout if args.outputs else ROOT), "config": args.config, "lora": LORA, "runs": rows,
           "collected_from": args.outputs}
    print(json.dumps(out, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
