"""Each phase of a real RLOO step against this machine's measured limit (issue 74).

The machine's limits, measured here, in this run:
- the matrix-multiply peak at the model's own shapes (each linear layer of a decoder layer and the
  lm-head, with M = the tokens of a training pass), in float32 and in bf16. It is the rate of the
  layer's products together (their FLOPs over their summed time): what a pass of the model could reach
  if it did nothing but its matrix products. The best single shape is reported beside it;
- the memory bandwidth: a large copy (bytes read plus bytes written, per second).

The phases, timed by the trainer itself (`time/*` of rloo.train.rloo_trainer.RlooTrainer.step), each
against the bound that applies to it:
- update (the policy's pass with gradient, the backward, the optimizer step): 6·N·T FLOP per update
  pass (rloo.updates_per_batch of them), against the matmul peak of the precision it ran in
  (model.autocast as resolved on this machine);
- reference (the frozen reference's pass): 2·N·T FLOP, against the same peak;
- decoding (time/generation_s): the bytes a decode step cannot avoid reading, against the bandwidth:
  the weights once per step in the decoding dtype, and the KV cache of the rows still running: each
  prompt's keys and values once (its k rows share them), each completion's own so far.

N is the weights every token multiplies by: the decoder layers' linear weights and the lm-head (tied or
not); not the embedding lookup (a gather) nor the norms. T is the tokens of the distinct rows the passes
run on (prompt and completion, no padding: the useful work). Attention's own products (about 4·layers·
context·hidden FLOP per token and pass) are left out of 6N and 2N, as is usual; their share is printed.

`--profile-top N` profiles one more step and lists, per phase, its N costliest ops (torch's profiler,
self CPU time): what holds a phase below its bound.

    python bench/roofline.py --json docs/figures/roofline.json --profile-top 8 \\
        --model quickstart=config/config.yaml:results/models/sft:data/gsm8k \\
        --model smollm2=config/smollm2.yaml:../smollm2/results/models/sft:../smollm2/data/gsm8k
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.record import write


@dataclass(frozen=True)
class Shape:
    """What the accounting needs of a causal LM's config."""

    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int
    vocab: int

    @classmethod
    def of(cls, config) -> Shape:
        return cls(config.hidden_size, config.num_hidden_layers, config.num_attention_heads,
                   getattr(config, "num_key_value_heads", None) or config.num_attention_heads,
                   config.intermediate_size, config.vocab_size)

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    def products(self) -> list[tuple[str, int, int, int]]:
        """(name, K, N, count): the linear layers a token passes, as K×N weights, with their count."""
        kv = self.kv_heads * self.head_dim
        return [("q", self.hidden, self.hidden, self.layers), ("k", self.hidden, kv, self.layers),
                ("v", self.hidden, kv, self.layers), ("o", self.hidden, self.hidden, self.layers),
                ("gate", self.hidden, self.intermediate, self.layers), ("up", self.hidden, self.intermediate, self.layers),
                ("down", self.intermediate, self.hidden, self.layers), ("lm_head", self.hidden, self.vocab, 1)]

    @property
    def matmul_params(self) -> int:
        """N: the weights every token multiplies by (linear layers and the lm-head)."""
        return sum(k * n * c for _, k, n, c in self.products())

    def kv_bytes_per_token(self, itemsize: int) -> int:
        return 2 * self.layers * self.kv_heads * self.head_dim * itemsize


def _best_time(fn, repeats: int) -> float:
    fn()  # warm-up: the allocator, the kernel choice
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def matmul_peak(shape: Shape, tokens: int, dtype: torch.dtype, repeats: int, seed: int) -> dict:
    """FLOP/s of the model's linear layers at M = `tokens`, one product each, in `dtype`."""
    g = torch.Generator().manual_seed(seed)
    per_shape, flops, seconds = {}, 0.0, 0.0
    for name, k, n, count in shape.products():
        a = torch.randn(tokens, k, generator=g).to(dtype)
        w = torch.randn(k, n, generator=g).to(dtype)
        t = _best_time(lambda a=a, w=w: torch.mm(a, w), repeats)
        f = 2.0 * tokens * k * n
        per_shape[name] = f / t
        flops += f * count
        seconds += t * count
    return {"model_shapes_flops": flops / seconds, "best_shape_flops": max(per_shape.values()),
            "per_shape_flops": per_shape, "tokens": tokens}


def bandwidth(mib: int, repeats: int) -> float:
    """Bytes per second of a large copy (read plus write)."""
    src = torch.ones(mib * 2**20 // 4, dtype=torch.float32)
    dst = torch.empty_like(src)
    t = _best_time(lambda: dst.copy_(src), repeats)
    return 2 * src.numel() * 4 / t


class CountingRollout:
    """The trainer's rollout, keeping each sampling call's result for the decoding bytes."""

    def __init__(self, inner) -> None:
        self.inner, self.calls = inner, []

    def generate(self, prompts, **kwargs):
        ro = self.inner.generate(prompts, **kwargs)
        self.calls.append(ro)
        return ro

    def __getattr__(self, name):
        return getattr(self.inner, name)


def decode_bytes(ro, k: int, weight_bytes: int, kv_per_token: int) -> float:
    """The bytes the decode steps of one sampling call must read at least (see the module's docstring)."""
    lengths = ro.completion_mask.sum(-1).tolist()
    prompt_lengths = ro.prompt_mask.sum(-1).tolist()
    total = 0.0
    for t in range(max(lengths, default=0)):
        running = [r for r, n in enumerate(lengths) if n > t]
        prompts = {r // k for r in running}
        total += weight_bytes + kv_per_token * (sum(prompt_lengths[p * k] for p in prompts) + t * len(running))
    return total


def _profiled(phase: str, fn, store: dict[str, Counter]):
    """`fn` run under torch's profiler, each op's self CPU time (µs) added to `store[phase]`."""
    def run(*args, **kwargs):
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            out = fn(*args, **kwargs)
        for e in prof.key_averages():
            store[phase][e.key] += e.self_cpu_time_total
        return out
    return run


def profile_step(trainer, step: int, top: int) -> dict[str, list[dict]]:
    """One more step with each phase's methods under the profiler: per phase, its `top` ops by self CPU
    time and their share of the phase's profiled time (the profiler's own cost inflates the many small
    ops of decoding; the shares, not the seconds, are the figure)."""
    store: dict[str, Counter] = {"decoding": Counter(), "reference": Counter(), "update": Counter()}
    # the sampler's own call (the trainer's batches hold the rollout, not a trainer method)
    trainer.rollout.generate = _profiled("decoding", trainer.rollout.generate, store)
    for name, phase in (("_step_rows", "reference"), ("_policy_logprobs", "update"), ("_policy_gradient", "update")):
        setattr(trainer, name, _profiled(phase, getattr(trainer, name), store))
    trainer.step(step)
    out = {}
    for phase, ops in store.items():
        total = sum(ops.values()) or 1.0
        out[phase] = [{"op": op, "self_s": us / 1e6, "share": us / total} for op, us in ops.most_common(top)]
    return out


def measure_model(label: str, spec: str, steps: int, threads: int, first_step: int, profile_top: int = 0) -> dict:
    """A real RLOO trainer on SPEC = CONFIGS:POLICY:DATA: its phases per step and what they did; with
    `profile_top`, one more step profiled (`profile_step`)."""
    from rloo.io import read_jsonl
    from rloo.reward.rewards import build_reward
    from rloo.rollout.collect import training_prompts
    from rloo.runtime import resolve_precision, setup
    from rloo.train.rloo_trainer import RlooTrainer
    from rloo_workflow.config import load_config

    configs, policy, data = spec.split(":")
    cfg = load_config(configs.split(","), {"threads": threads, "tracking": {"enabled": False}})
    setup(threads, cfg["seed"])
    train = training_prompts([r for _, r in read_jsonl(Path(data) / "train.jsonl")], cfg["rloo"]["min_solution_steps"])
    rc = cfg["rloo"]
    tokens: list[int] = []

    class Counting(RlooTrainer):
        def _step_rows(self, ro):
            rows = super()._step_rows(ro)
            tokens.append(int(rows.distinct.attention_mask.sum()))  # prompt and completion, no padding
            return rows

    trainer = Counting(cfg, policy, build_reward(cfg), train)
    trainer.rollout = CountingRollout(trainer.rollout)
    trainer.batches.rollout = trainer.rollout
    trainer.step(first_step)  # warm-up, not timed
    trainer.rollout.calls.clear()
    tokens.clear()
    rows = [trainer.step(first_step + 1 + s) for s in range(steps)]

    shape = Shape.of(trainer.policy.config)
    train_precision = resolve_precision(cfg["model"]["autocast"]) or "float32"
    decode_precision = resolve_precision(cfg["model"]["inference_dtype"]) or cfg["model"]["dtype"]
    itemsize = torch.finfo(getattr(torch, decode_precision)).bits // 8
    weight_bytes = shape.matmul_params * itemsize
    read = sum(decode_bytes(ro, rc["k"], weight_bytes, shape.kv_bytes_per_token(itemsize)) for ro in trainer.rollout.calls)
    n = shape.matmul_params
    profile = profile_step(trainer, first_step + 1 + steps, profile_top) if profile_top else None
    t_update = sum(r["time/update_s"] for r in rows)
    t_reference = sum(r["time/reference_s"] for r in rows)
    t_decode = sum(r["time/generation_s"] for r in rows)
    # a row's mean context over its positions: half its length (prompt and completion)
    mean_context = statistics.mean(float((ro.prompt_mask.sum(-1) + ro.completion_mask.sum(-1)).float().mean()) / 2
                                   for ro in trainer.rollout.calls)
    return {
        "spec": spec, "steps": steps, "params_matmul": n, "shape": shape.__dict__,
        "train_precision": train_precision, "decode_precision": decode_precision,
        "tokens_per_step": statistics.mean(tokens), "completion_length": statistics.mean(
            r["train/response_length"] for r in rows),
        "attention_share_of_flops": 4 * shape.layers * mean_context * shape.hidden / (2 * n),
        "seconds_per_step": {"update": t_update / steps, "reference": t_reference / steps, "decoding": t_decode / steps,
                             "step": sum(r["time/step_s"] for r in rows) / steps},
        "achieved": {
            "update_flops": 6 * n * sum(tokens) * rc["updates_per_batch"] / t_update,
            "reference_flops": 2 * n * sum(tokens) / t_reference,
            "decoding_bytes_per_s": read / t_decode,
        },
        **({"profile": profile} if profile else {}),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", action="append", required=True, metavar="LABEL=CONFIGS:POLICY:DATA",
                    help="CONFIGS: config files, comma-separated, overlaid; POLICY: the model folder RLOO starts from")
    ap.add_argument("--steps", type=int, default=5, help="timed RLOO steps per model (after one warm-up)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=2048, help="M of the matmul peak's products")
    ap.add_argument("--repeats", type=int, default=5, help="best of this many timings per product and copy")
    ap.add_argument("--copy-mib", type=int, default=1024)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--profile-top", type=int, default=0,
                    help="after the timed steps, profile one more and list each phase's N costliest ops")
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)

    copy = bandwidth(a.copy_mib, a.repeats)
    print(f"bandwidth (a {a.copy_mib} MiB copy, read + write): {copy / 1e9:.1f} GB/s", flush=True)
    models, table = {}, []
    for i, item in enumerate(a.model):
        label, spec = item.split("=", 1)
        res = measure_model(label, spec, a.steps, a.threads, first_step=1000 * (i + 1), profile_top=a.profile_top)
        shape = Shape(**res["shape"])
        res["peaks"] = {p: matmul_peak(shape, a.tokens, getattr(torch, p), a.repeats, a.seed + i)
                        for p in ("float32", "bfloat16")}
        peak = res["peaks"][res["train_precision"]]["model_shapes_flops"]
        got = res["achieved"]
        res["phases"] = [
            {"phase": "update", "achieved": got["update_flops"], "bound": peak, "unit": "FLOP/s",
             "share": got["update_flops"] / peak, "precision": res["train_precision"]},
            {"phase": "reference", "achieved": got["reference_flops"], "bound": peak, "unit": "FLOP/s",
             "share": got["reference_flops"] / peak, "precision": res["train_precision"]},
            {"phase": "decoding", "achieved": got["decoding_bytes_per_s"], "bound": copy, "unit": "B/s",
             "share": got["decoding_bytes_per_s"] / copy, "precision": res["decode_precision"]},
        ]
        models[label] = res
        table += [(label, p) for p in res["phases"]]
        print(f"{label}: N={res['params_matmul'] / 1e6:.1f} M, {res['tokens_per_step']:.0f} tokens/step, "
              f"completion {res['completion_length']:.1f}, attention ≈{res['attention_share_of_flops']:.1%} of 2N", flush=True)

        for phase, ops in res.get("profile", {}).items():
            print(f"{label} {phase}, the costliest ops (self CPU, share of the phase): "
                  + "; ".join(f"{o['op']} {o['share']:.0%}" for o in ops), flush=True)

    print("\n| model | phase | precision | achieved | bound | share |")
    print("| --- | --- | --- | --- | --- | --- |")
    for label, p in table:
        scale, unit = (1e9, "GFLOP/s") if p["unit"] == "FLOP/s" else (1e9, "GB/s")
        print(f"| {label} | {p['phase']} | {p['precision']} | {p['achieved'] / scale:.1f} {unit} | "
              f"{p['bound'] / scale:.1f} {unit} | {p['share']:.0%} |")
    if a.json:
        write(a.json, {"bandwidth_bytes_per_s": copy, "models": models}, indent=2)


if __name__ == "__main__":
    main()
