"""Peak memory and step time of the RLOO stage under each memory / parallelism setting, measured.

One SFT policy (the embedded Llama at a size set here, larger than the micro one so that the model
state is visible above the interpreter's own memory), one data folder, then `rloo train` once per
variant, each in fresh processes: single process, DDP x2, FSDP x2, LoRA, gradient checkpointing
(and the last two under FSDP x2). Every variant trains the same prompts from the same weights for the
same steps, in float32 (no autocast), on this machine; each round uses its own seed and runs the
variants in another order. Peak memory is the stage's own record (<work>/timings.json: peak RSS of
rank 0 on a CPU, CUDA max allocated on a GPU); seconds per step likewise. On a CPU the runs set glibc's
MALLOC_MMAP_THRESHOLD_ (64 KiB): large blocks are then mapped and unmapped one by one, so the peak RSS
counts the tensors a setting holds rather than how fragmented the heap grew (with glibc's default, LoRA's
many short-lived adapter temporaries made its peak RSS exceed full fine-tuning's, while holding less).

    python bench/memory.py --json docs/figures/memory.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
MICRO = str(ROOT / "config" / "micro.yaml")

# name -> (processes, --set overrides)
VARIANTS: dict[str, tuple[int, list[str]]] = {
    "none": (1, []),
    "ddp x2": (2, ["distributed.strategy=ddp"]),
    "fsdp x2": (2, ["distributed.strategy=fsdp"]),
    "lora": (1, ["model.lora.enabled=true"]),
    "gradient checkpointing": (1, ["model.gradient_checkpointing=true"]),
    "fsdp x2 + lora": (2, ["distributed.strategy=fsdp", "model.lora.enabled=true"]),
    "fsdp x2 + gradient checkpointing": (2, ["distributed.strategy=fsdp", "model.gradient_checkpointing=true"]),
}


def _rloo(*args: str, env: dict) -> None:
    cmd = [sys.executable, "-m", "rloo.cli", *args]
    res = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if res.returncode:
        raise SystemExit(f"{' '.join(cmd)} exited {res.returncode}:\n{res.stderr[-3000:]}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--intermediate", type=int, default=1536)
    ap.add_argument("--prompts", type=int, default=4, help="prompts per step (k = 4 samples each)")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--variants", nargs="*", default=list(VARIANTS), help=f"of {list(VARIANTS)}")
    ap.add_argument("--mmap-threshold", type=int, default=65536,
                    help="glibc MALLOC_MMAP_THRESHOLD_ of the runs (bytes; 0: glibc's default): allocations above it "
                         "are mapped and unmapped on their own, so the peak RSS counts the tensors held, not heap fragments")
    ap.add_argument("--json", default=None, help="also write the figures here")
    a = ap.parse_args()

    env = {**os.environ, "MLFLOW_TRACKING_URI": "", "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT)}
    if a.mmap_threshold:
        env["MALLOC_MMAP_THRESHOLD_"] = str(a.mmap_threshold)
    model = [f"model.tiny.hidden_size={a.hidden}", f"model.tiny.num_layers={a.layers}",
             f"model.tiny.num_heads={a.heads}", f"model.tiny.intermediate_size={a.intermediate}",
             f"model.max_length={128 + a.max_new_tokens}", "model.autocast=none", "tracking.enabled=false", "reward.source=verifier"]
    sets = [x for s in model for x in ("--set", s)]
    work = Path(tempfile.mkdtemp(prefix="rloo-memory-"))
    t0 = time.time()
    try:
        _rloo("prepare", "-c", MICRO, "--out", str(work / "data"), env=env)
        _rloo("sft", "-c", MICRO, *sets, "--set", "sft.steps=1", "--set", "sft.eval_examples=1",
              "--data", str(work / "data"), "--out", str(work / "sft"), "--work", str(work / "sft-work"), env=env)
        rloo = ["--set", "rloo.k=4", "--set", f"rloo.prompts_per_step={a.prompts}", "--set", f"rloo.steps={a.steps}",
                "--set", "rloo.eval_every=0", "--set", f"rloo.checkpoint_every={a.steps + 1}",
                "--set", f"rloo.max_new_tokens={a.max_new_tokens}", "--set", "rloo.select=last"]
        figures: dict[str, list[dict]] = {v: [] for v in a.variants}
        for r in range(a.rounds):
            order = a.variants if r % 2 == 0 else a.variants[::-1]
            for name in order:
                nproc, extra = VARIANTS[name]
                out, w = work / f"out-{r}", work / f"work-{r}"
                shutil.rmtree(out, ignore_errors=True)
                shutil.rmtree(w, ignore_errors=True)
                # every variant uses all the machine's cores: one process all of them, two half each
                threads = max(1, len(os.sched_getaffinity(0)) // nproc)
                args = ["train", "-c", MICRO, *sets, *rloo, "--set", f"seed={r}", "--set", f"threads={threads}",
                        *[x for s in extra for x in ("--set", s)],
                        "--data", str(work / "data"), "--policy", str(work / "sft"), "--out", str(out), "--work", str(w)]
                if nproc > 1:
                    args += ["--nproc", str(nproc)]
                _rloo(*args, env=env)
                t = json.loads((w / "timings.json").read_text())
                m = json.loads((out / "metrics.json").read_text())
                figures[name].append({"peak_memory_mb": t["peak_memory_mb"], "seconds_per_step": t["seconds_per_step"],
                                      "parameters": m["networks"]["policy"]})
                print(f"round {r} {name:34s} peak {t['peak_memory_mb']:8.0f} MiB  {t['seconds_per_step']:6.2f} s/step",
                      flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    summary = {name: {"processes": VARIANTS[name][0],
                      "peak_memory_mb": float(np.mean([x["peak_memory_mb"] for x in rows])),
                      "seconds_per_step": float(np.mean([x["seconds_per_step"] for x in rows])),
                      "policy_parameters": rows[0]["parameters"]}
               for name, rows in figures.items()}
    result = {
        "command": "python bench/memory.py " + " ".join(sys.argv[1:]),
        "machine": f"{platform.machine()}, {len(os.sched_getaffinity(0))} cores (CPU, peak RSS of rank 0)",
        "model": {"hidden_size": a.hidden, "num_layers": a.layers, "intermediate_size": a.intermediate},
        "work": {"prompts_per_step": a.prompts, "k": 4, "steps": a.steps, "max_new_tokens": a.max_new_tokens, "dtype": "float32"},
        "rounds": a.rounds, "malloc_mmap_threshold": a.mmap_threshold or None, "wall_seconds": round(time.time() - t0, 1),
        "variants": summary, "per_round": figures,
    }
    print(json.dumps(summary, indent=1))
    if a.json:
        Path(a.json).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
