"""Measure the memory one training micro-batch adds: a helper of tests/e2e/test_memory_plan.py, run in a fresh
process (`python tests/helpers/plan_measure.py '<json list of specs>'`), printing one JSON list of bytes.

A random model of the given shape takes one forward + backward of `rows` x `tokens` tokens the way a
training step's gradient pass does (the targets' log-probs through rloo.model.head, a mean as loss; with
`chunk` > 0 the head runs chunk by chunk, each chunk recomputed in the backward pass). Its gradients
exist beforehand (a small warm-up step, zeroed, not freed), so what is measured is the micro-batch's own
memory: activations and logits. On the CPU: the rise of the peak RSS (VmHWM, reset through
/proc/self/clear_refs) over the RSS before the pass; the parent sets glibc's MALLOC_MMAP_THRESHOLD_ so
that freed tensors leave the process (bench/memory.py). On CUDA: torch.cuda.max_memory_allocated over
memory_allocated before the pass.
"""

from __future__ import annotations

import gc
import json
import sys

import torch
import torch.nn.functional as F


def _status(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(key)


def _model(spec: dict) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config

    s = spec["shape"]
    cls = Qwen2Config if spec["family"] == "qwen2" else LlamaConfig
    config = cls(vocab_size=s["vocab_size"], hidden_size=s["hidden_size"], intermediate_size=s["intermediate_size"],
                 num_hidden_layers=s["num_layers"], num_attention_heads=s["num_heads"],
                 num_key_value_heads=s["num_kv_heads"], tie_word_embeddings=s["tie_word_embeddings"],
                 max_position_embeddings=spec["tokens"])
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, attn_implementation=spec.get("attn", "sdpa"))
    if spec.get("checkpointing"):
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model.train().to(spec["device"])


def _logprobs(model: torch.nn.Module, ids: torch.Tensor, mask: torch.Tensor, chunk: int) -> torch.Tensor:
    """Targets' log-probs [rows, T] (the last position's masked): rloo.model.head, the training stages' own
    path (`chunk` 0: the full logits; else the head over `chunk` tokens at a time, recomputed in backward)."""
    from rloo.model.head import causal_logprobs

    targets = F.pad(ids[:, 1:], (0, 1))  # position t predicts token t + 1
    target_mask = torch.ones_like(ids, dtype=torch.bool)
    target_mask[:, -1] = False
    return causal_logprobs(model, ids, mask, None, targets, target_mask, chunk)


def _step(model: torch.nn.Module, rows: int, tokens: int, spec: dict) -> None:
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, spec["shape"]["vocab_size"], (rows, tokens), generator=g).to(spec["device"])
    mask = torch.ones_like(ids)
    mask[0, : tokens // 4] = 0  # a left-padded row, as in a packed micro-batch: the mask is materialised
    dtype = torch.bfloat16 if spec.get("autocast") == "bfloat16" else None
    with torch.autocast(ids.device.type, dtype=dtype, enabled=dtype is not None):
        loss = -_logprobs(model, ids, mask, spec.get("chunk", 0)).mean()
    loss.backward()


def measure(spec: dict) -> int:
    """Bytes one micro-batch of `spec` adds over the model and its gradients."""
    model = _model(spec)
    _step(model, 1, 8, spec)  # the gradients now exist, as in every step after the first
    model.zero_grad(set_to_none=False)
    gc.collect()
    cuda = spec["device"] == "cuda"
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
    else:
        before = _status("VmRSS")
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # the peak RSS starts again from the current RSS
    _step(model, spec["rows"], spec["tokens"], spec)
    return (torch.cuda.max_memory_allocated() if cuda else _status("VmHWM")) - before


def main() -> None:
    specs = json.loads(sys.argv[1])
    torch.set_num_threads(2)
    out = []
    for spec in specs:  # one after the other: each model freed (and unmapped) before the next
        out.append(measure(spec))
        gc.collect()
    print(json.dumps(out))


if __name__ == "__main__":
    main()
