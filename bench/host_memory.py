"""The host-memory estimate of a CPU run (rloo_workflow/host_memory.py, what validation refuses a config by) against
the measured peak RSS of the real `rloo train` stage, each case in a fresh process.

Cases: the micro config's embedded model as it is (the interpreter dominates), and with k = 512 (the
decode loop's mask and attention scores, which grow with k², dominate); a random model of Qwen2.5-0.5B's
widths (hidden 896, the real vocabulary of 151,936, 14 heads over 2 key/value heads, intermediate 4864,
tied embeddings) with 2 decoder layers instead of 24 (the model state dominates: 166 M parameters, the
policy's weights, gradients and AdamW moments plus a frozen reference), at k = 4 and at k = 32 (the
sampler's [rows, vocabulary] temporaries join in). Each `rloo train` runs 2 steps (one evaluation) in
float32 with glibc's default allocator, as a user's run does; its peak is the stage's own record
(<work>/timings.json: peak RSS). The estimate is the rloo stage's largest phase.

    python bench/host_memory.py --json docs/figures/host_memory.json
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.record import provenance  # noqa: E402

MICRO = str(ROOT / "config" / "micro.yaml")
COMMON = ["tracking.enabled=false", "rollout.backend=hf", "reward.source=verifier", "model.autocast=none",
          "rloo.steps=2", "rloo.checkpoint_every=100", "rloo.eval_every=2", "threads=2"]
# name -> (model: micro | qwen, --set overrides)
CASES: dict[str, tuple[str, list[str]]] = {
    "micro, k=2": ("micro", []),
    "micro, k=512": ("micro", ["rloo.k=512"]),
    "Qwen2.5-0.5B widths x 2 layers, k=4": ("qwen", ["rloo.k=4", "rloo.prompts_per_step=2"]),
    "Qwen2.5-0.5B widths x 2 layers, k=32": ("qwen", ["rloo.k=32", "rloo.prompts_per_step=2"]),
}


def _run(*args: str, env: dict) -> None:
    cmd = [sys.executable, "-m", "rloo_workflow.cli", *args]
    res = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if res.returncode:
        raise SystemExit(f"{' '.join(cmd)} exited {res.returncode}:\n{res.stderr[-3000:]}")


def _qwen_folder(folder: Path, layers: int, tokenizer_from: Path) -> None:
    """A random Qwen2 of Qwen2.5-0.5B's widths and `layers` layers, with the micro model's tokenizer (its
    prompts fit the micro config's lengths; sampled ids beyond that vocabulary decode to nothing)."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from bench.memory import QWEN05
    from rloo.model import models

    tok = models.load_tokenizer(tokenizer_from)
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(Qwen2Config(num_hidden_layers=layers, max_position_embeddings=512, **QWEN05))
    models.set_generation_ids(model, tok)
    models.save_pretrained(model, tok, folder)


def estimate(sets: list[str]) -> tuple[float, dict]:
    """The rloo stage's predicted peak (bytes) under the micro config with `sets`, and its terms."""
    from rloo.settings import Config
    from rloo_workflow.config import load_config, parse_set
    from rloo_workflow.host_memory import host_plan
    from rloo_workflow.model_shape import model_shape

    sections = Config.from_config(load_config(MICRO, parse_set(sets)))
    shape, _ = model_shape(sections.model)
    worst = max((p for p in host_plan(sections, shape) if p.stage.startswith("rloo")), key=lambda p: p.total)
    return worst.total, {"phase": worst.name, **{k: round(v / 2**20, 1) for k, v in worst.terms.items()}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    env = {**os.environ, "MLFLOW_TRACKING_URI": "", "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT)}
    env.pop("MALLOC_MMAP_THRESHOLD_", None)  # the default allocator: what a user's run gets
    work = Path(tempfile.mkdtemp(prefix="rloo-host-memory-"))
    t0 = time.time()
    rows = {}
    try:
        _run("prepare", "-c", MICRO, "--set", "tracking.enabled=false", "--out", str(work / "data"), env=env)
        _run("base", "-c", MICRO, "--set", "tracking.enabled=false", "--data", str(work / "data"),
             "--out", str(work / "micro"), env=env)
        # in a process of its own: a child inherits its parent's peak RSS at fork (Linux), and every
        # measurement is a child of this one
        subprocess.run([sys.executable, "-c", f"from pathlib import Path; from bench.host_memory import _qwen_folder; "
                        f"_qwen_folder(Path({str(work / 'qwen')!r}), 2, Path({str(work / 'micro')!r}))"],
                       env=env, check=True, capture_output=True)
        for name, (model, sets) in CASES.items():
            sets = [*COMMON, *sets] + ([f"model.name_or_path={work / 'qwen'}"] if model == "qwen" else [])
            out = work / name.replace(" ", "_").replace(",", "").replace("=", "")
            _run("train", "-c", MICRO, *(x for s in sets for x in ("--set", s)), "--data", str(work / "data"),
                 "--policy", str(work / model), "--out", str(out / "out"), "--work", str(out / "work"), env=env)
            measured = json.loads((out / "work" / "timings.json").read_text())["peak_memory_mb"]
            predicted, terms = estimate(sets)
            rows[name] = {"measured_peak_rss_mib": measured, "estimate_mib": round(predicted / 2**20, 1),
                          "error": round(predicted / 2**20 / measured - 1, 3), "estimate_terms_mib": terms,
                          "sets": sets[len(COMMON):]}
            print(f"{name}: measured {measured:.0f} MiB, estimated {predicted / 2**20:.0f} MiB "
                  f"({rows[name]['error']:+.1%}); {terms}", flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    result = {**provenance(), "measured": "peak RSS of `rloo train` (its timings.json), glibc's default allocator",
              "common_sets": COMMON, "cases": rows, "wall_seconds": round(time.time() - t0, 1)}
    if a.json:
        Path(a.json).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
