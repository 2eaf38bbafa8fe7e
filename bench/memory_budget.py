"""What fits on an 80 GB GPU: each GPU stage's peak per device for 0.5B, 1.5B and 7B Qwen2.5 policies,
computed (not measured) by the memory plan (rloo_workflow/memory_plan.py, `rloo plan`) under config/gpu.yaml, its
scale-out overlays config/fsdp-1x8.yaml and fsdp-2x8.yaml, and LoRA / gradient checkpointing on top.

Every term of the plan counts: the model state (weights, gradients and AdamW moments of what trains;
whole frozen copies of the reference and the reward model; FSDP's gathered weights), the activations
of one micro-batch (`<stage>.micro_batch_tokens`), the float32 logits chunk (`model.logits_chunk_tokens`),
the sampler's KV cache, and vLLM's reserved share (`rollout.gpu_memory_utilization` x 80 GB). A stage
fits when its peak is within 80 GB less the plan's margin (1 GB + 10 %: 71 GB).

    python bench/memory_budget.py --json docs/figures/memory_budget.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.record import provenance  # noqa: E402
from rloo.settings import Config  # noqa: E402
from rloo_workflow.config import load_config, parse_set  # noqa: E402
from rloo_workflow.memory_plan import GB, MARGIN_GB, MARGIN_SHARE, Shape, plan, problem, usable_gb  # noqa: E402

GPU_GB = 80
# Qwen2.5 shapes (their config.json): hidden, layers, heads, KV heads, intermediate, vocabulary, tied
POLICIES = {
    "0.5B": Shape(896, 24, 14, 2, 4864, 151936, True),
    "1.5B": Shape(1536, 28, 12, 2, 8960, 151936, True),
    "7B": Shape(3584, 28, 28, 4, 18944, 152064, False),
}
LORA = ["model.lora.enabled=true", "model.lora.r=16", "rollout.backend=hf"]  # vLLM with LoRA is refused
CKPT = ["model.gradient_checkpointing=true"]
SETUPS = [  # (label, config files after gpu.yaml, --set overrides)
    ("1 GPU (gpu.yaml: vLLM rollouts, reward model)", [], []),
    ("1 GPU, gradient checkpointing", [], CKPT),
    ("1 GPU, LoRA r=16 (HF rollouts)", [], LORA),
    ("1 GPU, LoRA r=16 + gradient checkpointing", [], LORA + CKPT),
    ("1 node x 8, fsdp (fsdp-1x8.yaml)", ["fsdp-1x8.yaml"], []),
    ("1 node x 8, fsdp + gradient checkpointing", ["fsdp-1x8.yaml"], CKPT),
    ("2 nodes x 8, fsdp (fsdp-2x8.yaml)", ["fsdp-2x8.yaml"], []),
    ("1 node x 8, fsdp + LoRA r=16", ["fsdp-1x8.yaml"], LORA),
]


def stage_rows(sections: Config, shape: Shape) -> dict:
    """Each stage's peak phase, its terms in GB and whether it fits; the plan's one-line verdict."""
    plans = plan(sections, shape, GPU_GB)
    stages = {}
    for sp in plans:
        p = sp.peak
        stages[sp.stage] = {"strategy": sp.strategy, "phase": p.name, "fits": p.total / GB <= usable_gb(GPU_GB),
                            **{k: round(getattr(p, k) / GB, 1) for k in ("state", "activations", "logits", "vllm", "total")}}
    return {"stages": stages, "problem": problem(plans, GPU_GB)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    rows = []
    for label, overlays, sets in SETUPS:
        sections = Config.from_config(load_config([ROOT / "config" / "gpu.yaml",
                                                   *(ROOT / "config" / o for o in overlays)], parse_set(sets)))
        row = {"setup": label, "configs": ["config/gpu.yaml", *(f"config/{o}" for o in overlays)], "set": sets,
               "per_policy": {size: stage_rows(sections, shape) for size, shape in POLICIES.items()}}
        rows.append(row)
        print(label)
        for size, r in row["per_policy"].items():
            print(f"  {size:5s} " + "  ".join(f"{s} {v['total']:6.1f}" for s, v in r["stages"].items())
                  + (f"  -- {r['problem']}" if r["problem"] else ""))
    result = {**provenance(), "computed": True,
              "gpu_gb": GPU_GB, "usable_gb": usable_gb(GPU_GB), "margin": {"gb": MARGIN_GB, "share": MARGIN_SHARE},
              "policies": {k: {**vars(s), "parameters": s.parameters()} for k, s in POLICIES.items()}, "rows": rows}
    if a.json:
        Path(a.json).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
