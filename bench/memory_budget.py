"""What the RLOO stage holds per GPU, computed (not measured) from how this project trains: which
policies of 0.5B, 1.5B and 7B parameters fit on one 80 GB GPU, on 8 (one node) and on 16 (two nodes).

The accounting follows the code, per GPU, model state only (activations, the sampler's KV cache and the
CUDA context come on top; the "left" column is what remains for them):
- a trained parameter: float32 weight 4 B + float32 gradient 4 B + AdamW's two float32 moments 8 B
  = 16 B; under FSDP each rank holds 1/N of all three;
- the frozen reference: a whole copy in model.dtype (4 B in float32) on every rank, not sharded (its
  forward passes run per rank on its own rows); with LoRA it is the base model with the adapters off,
  so it costs nothing;
- sampling under FSDP gathers the policy's whole weights on every rank (rloo.distributed.gathered): the
  other ranks' (N-1)/N of 4 B come on top while the rollouts run;
- the reward model (reward.source: model, as in config/gpu.yaml; initialised from the SFT policy, so
  of the policy's size): a whole frozen copy, 4 B, on every rank;
- LoRA: the base is frozen (4 B, sharded 1/N under FSDP), the adapters train (16 B each); r=16 on
  every linear projection adds about 0.9 % parameters to a Qwen2.5 model (ADAPTER_SHARE below).

    python bench/memory_budget.py --json docs/figures/memory_budget.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

GPU_GB = 80
# Qwen2.5 sizes (parameters, tied embeddings counted once)
POLICIES = {"0.5B": 0.494e9, "1.5B": 1.54e9, "7B": 7.62e9}
WEIGHT, TRAINED = 4, 16  # bytes per parameter: a float32 weight; a trained one (weight, gradient, 2 moments)
ADAPTER_SHARE = 0.009   # LoRA r=16 on q,k,v,o,gate,up,down of Qwen2.5 (about 0.9 % of the parameters)


def per_gpu_bytes(params: float, gpus: int, strategy: str, lora: bool, reward_model: bool) -> dict[str, float]:
    """Each part of the model state one GPU holds (bytes), by the rules of the module docstring."""
    n = gpus if strategy == "fsdp" else 1  # how many ways the trained state is sharded
    parts: dict[str, float] = {}
    if lora:
        parts["policy base (frozen)"] = WEIGHT * params / n
        parts["adapters (trained)"] = TRAINED * ADAPTER_SHARE * params / n
    else:
        parts["policy (trained)"] = TRAINED * params / n
        parts["reference (frozen copy)"] = WEIGHT * params
    if strategy == "fsdp":
        parts["gathered for sampling"] = WEIGHT * params * (n - 1) / n
    if reward_model:
        parts["reward model"] = WEIGHT * params
    return parts


SETUPS = [  # (label, GPUs, strategy, LoRA)
    ("1 GPU, strategy none", 1, "none", False),
    ("1 node x 8, ddp", 8, "ddp", False),
    ("1 node x 8, fsdp", 8, "fsdp", False),
    ("2 nodes x 8, fsdp", 16, "fsdp", False),
    ("1 GPU, LoRA", 1, "none", True),
    ("1 node x 8, fsdp + LoRA", 8, "fsdp", True),
]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    rows = []
    for label, gpus, strategy, lora in SETUPS:
        for reward_model in (False, True):
            row = {"setup": label, "gpus": gpus, "strategy": strategy, "lora": lora, "reward_model": reward_model,
                   "per_gpu_gb": {}}
            for size, params in POLICIES.items():
                parts = per_gpu_bytes(params, gpus, strategy, lora, reward_model)
                total = sum(parts.values()) / 1e9
                row["per_gpu_gb"][size] = {"total": round(total, 1), "left": round(GPU_GB - total, 1),
                                           "parts": {k: round(v / 1e9, 2) for k, v in parts.items()}}
            rows.append(row)
            print(f"{label:28s} {'+RM' if reward_model else '   '} " + "  ".join(
                f"{s}: {row['per_gpu_gb'][s]['total']:6.1f} GB" for s in POLICIES))
    result = {"command": "python bench/memory_budget.py " + " ".join(sys.argv[1:]), "computed": True,
              "gpu_gb": GPU_GB, "policies": POLICIES, "adapter_share": ADAPTER_SHARE, "rows": rows}
    if a.json:
        Path(a.json).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
