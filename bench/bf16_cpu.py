"""Seconds of one training pass (forward and backward of the causal-LM loss) in float32 and under bf16
autocast, on this CPU: what `model.autocast: auto` decides between (rloo.runtime.native_bf16).

Two shapes, random weights: the embedded default (config/config.yaml's tiny Llama, its batch of 32
rows) and SmolLM2-135M-Instruct's widths with 4 of its 30 layers (a batch of 4 rows, its vocabulary
of 49,152). Each precision runs the same inputs, one warm-up pass then `--rounds` timed passes,
alternating the precisions round by round, in one process on `--threads` threads.

    python bench/bf16_cpu.py --json docs/figures/bf16_cpu.json
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.record import write  # noqa: E402
from rloo.runtime import autocast, native_bf16, resolve_precision  # noqa: E402

SHAPES = {
    "tiny": dict(hidden_size=192, num_hidden_layers=4, num_attention_heads=6, num_key_value_heads=6,
                 intermediate_size=512, vocab_size=384, rows=32, tokens=160, attn="eager"),
    "smollm2_4_layers": dict(hidden_size=576, num_hidden_layers=4, num_attention_heads=9, num_key_value_heads=3,
                             intermediate_size=1536, vocab_size=49152, rows=4, tokens=200, attn="sdpa"),
}


def one_pass(model: torch.nn.Module, ids: torch.Tensor, mode: str) -> float:
    """Seconds of one forward+backward pass under `model.autocast` = `mode`."""
    start = time.perf_counter()
    with autocast(mode):
        loss = model(ids, labels=ids).loss
    loss.backward()
    model.zero_grad(set_to_none=True)
    return time.perf_counter() - start


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.set_num_threads(args.threads)
    out = {}
    for name, s in SHAPES.items():
        torch.manual_seed(0)
        widths = {k: v for k, v in s.items() if k not in ("rows", "tokens", "attn")}
        model = LlamaForCausalLM(LlamaConfig(**widths, attn_implementation=s["attn"]))
        ids = torch.randint(0, s["vocab_size"], (s["rows"], s["tokens"]))

        seconds = {"none": [], "bfloat16": []}
        for mode in seconds:
            one_pass(model, ids, mode)  # warm-up: kernels chosen, buffers allocated
        for r in range(args.rounds):
            for mode in (("none", "bfloat16") if r % 2 == 0 else ("bfloat16", "none")):
                seconds[mode].append(one_pass(model, ids, mode))
        f32, bf16 = statistics.median(seconds["none"]), statistics.median(seconds["bfloat16"])
        out[name] = {"rows": s["rows"], "tokens": s["tokens"], "parameters": sum(p.numel() for p in model.parameters()),
                     "float32_s": round(f32, 3), "bf16_autocast_s": round(bf16, 3),
                     "bf16_over_float32": round(bf16 / f32, 2), "per_round": seconds}
        print(name, out[name]["float32_s"], out[name]["bf16_autocast_s"], out[name]["bf16_over_float32"], flush=True)
    figures = {"native_bf16": native_bf16("cpu"), "auto_resolves_to": resolve_precision("auto", "cpu") or "none",
               "cpu_capability": torch.backends.cpu.get_cpu_capability(), "threads": args.threads,
               "rounds": args.rounds, "measured": "median seconds of one forward+backward pass", "shapes": out}
    if args.json:
        write(args.json, figures)


if __name__ == "__main__":
    main()
