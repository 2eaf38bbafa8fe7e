"""The policy's log-probability pass of an RLOO update, full logits against the chunked head
(`model.logits_chunk_tokens`, rloo/model/head.py), in one process, alternating rounds.

An update-shaped batch on the embedded default model's shape (config/config.yaml `model.tiny`, random
weights, eager attention): 16 prompts x 4 samples, left-padded prompts of ~60 tokens, completions of
30..100 tokens; under bf16 autocast, `completion_logprobs_and_entropy` forward and backward, with the
trainer's row chunks (16: prompt sharing) and with one padded pass (0: under DDP / FSDP or gradient
checkpointing). Prints the median and the least seconds per pass of each variant (on a shared machine
the least is the one other processes disturbed least).

    python bench/logprobs.py --rounds 5
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch


def tiny_model(vocab: int, hidden: int, layers: int, heads: int, intermediate: int) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate,
                         num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=heads,
                         max_position_embeddings=320, tie_word_embeddings=True)
    return AutoModelForCausalLM.from_config(config, attn_implementation="eager").eval()


def update_batch(vocab: int, prompts: int = 16, k: int = 4, prompt_len: int = 60, completion_len: int = 100):
    from rloo.model.logprobs import join

    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (prompts, prompt_len), generator=g)
    plen = torch.randint(prompt_len - 12, prompt_len + 1, (prompts,), generator=g)
    pmask = (torch.arange(prompt_len)[None] >= prompt_len - plen[:, None]).long()
    clen = torch.randint(30, completion_len + 1, (prompts * k,), generator=g)
    cmask = (torch.arange(completion_len)[None] < clen[:, None]).float()
    completions = torch.randint(0, vocab, (prompts * k, completion_len), generator=g)
    return join(ids.repeat_interleave(k, 0), pmask.repeat_interleave(k, 0), completions, cmask)


def one_pass(model: torch.nn.Module, batch, chunk_rows: int, chunk_tokens: int) -> float:
    from rloo.model.logprobs import completion_logprobs_and_entropy

    t = time.perf_counter()
    with torch.autocast("cpu", torch.bfloat16):
        lp, _ = completion_logprobs_and_entropy(model, batch, chunk_rows, logits_chunk_tokens=chunk_tokens)
    ((lp * batch.completion_mask).sum() / batch.completion_mask.sum()).backward()
    model.zero_grad(set_to_none=True)
    return time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--chunk-tokens", type=int, default=4096)
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    model = tiny_model(384, 192, 4, 6, 512)
    batch = update_batch(384)
    variants = [(rows, tokens) for rows in (16, 0) for tokens in (0, args.chunk_tokens)]
    for v in variants:  # warm-up: thread pool, allocator
        one_pass(model, batch, *v)
    times: dict[tuple[int, int], list[float]] = {v: [] for v in variants}
    for r in range(args.rounds):
        for v in variants if r % 2 == 0 else variants[::-1]:
            times[v].append(one_pass(model, batch, *v))
    print(f"{int(batch.completion_mask.sum())} completion tokens in {len(batch.completion_mask)} rows; "
          f"{torch.get_num_threads()} threads; forward + backward under bf16 autocast, {args.rounds} rounds")
    for (rows, tokens), ts in times.items():
        print(f"chunk_rows={rows:<3} logits_chunk_tokens={tokens:<5} median {statistics.median(ts):.3f} s, "
              f"min {min(ts):.3f} s "
              f"(all: {', '.join(f'{t:.3f}' for t in ts)})")


if __name__ == "__main__":
    main()
