"""One rank of the data-parallel check in tests/e2e/test_logprobs.py, started by torchrun (2 processes, gloo):

    python -m torch.distributed.run --standalone --nproc-per-node 2 tests/helpers/logprobs_worker.py OUT

Under DDP and then FSDP (one process group, one launch), for a small random Qwen2 with a tied and with
an untied head: one process's gradient of the whole batch
(the plain full-logits way, no wrapper) against this rank's half through the DDP / FSDP wrapper with the
chunked head (loss scaled by the world size, since DDP and FSDP average the ranks' gradients). Rank 0
writes the largest differences (log-probabilities, entropies, each parameter's gradient) to OUT as JSON.
"""

from __future__ import annotations

import copy
import json
import sys
from pathlib import Path

import torch

from rloo.algo.losses import token_entropy
from rloo.model import distributed
from rloo.model.logprobs import completion_logits, completion_logprobs, completion_logprobs_and_entropy, join

ROWS, PROMPT, COMPLETION = 6, 5, 7


def qwen2(tied: bool) -> torch.nn.Module:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen2Config(hidden_size=64, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                      intermediate_size=128, vocab_size=151_936, tie_word_embeddings=tied)
    return Qwen2ForCausalLM(cfg).eval()


def batch_and_weights(vocab: int):
    """Rows with prompts shared in pairs, left padding, completions of different lengths; random weights
    on the completion tokens (the loss is their weighted sum of log-probabilities)."""
    g = torch.Generator().manual_seed(1)
    prompts = torch.randint(0, vocab, (ROWS // 2, PROMPT), generator=g).repeat_interleave(2, 0)
    prompt_mask = torch.ones_like(prompts)
    prompt_mask[:2, :2] = 0
    completions = torch.randint(0, vocab, (ROWS, COMPLETION), generator=g)
    lengths = torch.tensor([7, 3, 5, 1, 6, 2])
    mask = (torch.arange(COMPLETION)[None] < lengths[:, None]).float()
    return join(prompts, prompt_mask, completions, mask), torch.randn(ROWS, COMPLETION, generator=g) * mask


def full_grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    out = {}
    for name, p in model.named_parameters():
        g = p.grad
        if hasattr(g, "full_tensor"):  # an FSDP shard: every rank takes part
            g = g.full_tensor()
        out[name.removeprefix("module.")] = g
    return out


def check(tied: bool) -> dict[str, float]:
    model = qwen2(tied)
    single = copy.deepcopy(model)
    batch, weights = batch_and_weights(model.config.vocab_size)
    mask = batch.completion_mask
    lp_one = completion_logprobs(single, batch, 0)
    (lp_one * weights).sum().backward()
    want = {n: p.grad for n, p in single.named_parameters()}

    lo, hi = distributed.shard(ROWS)
    wrapped = distributed.wrap(model)
    mine = batch.select(torch.arange(lo, hi))
    lp, ent = completion_logprobs_and_entropy(wrapped, mine, 0, logits_chunk_tokens=4)
    (lp * weights[lo:hi] * distributed.world()).sum().backward()
    got = full_grads(wrapped)
    with torch.no_grad():
        ent_one = token_entropy(completion_logits(single, batch, share_prompts=False))
    diffs = {f"grad/{n}": float((got[n] - want[n]).abs().max() / want[n].abs().max()) for n in want}
    diffs["logp"] = float(((lp - lp_one[lo:hi]) * mask[lo:hi]).detach().abs().max())
    diffs["entropy"] = float(((ent - ent_one[lo:hi]) * mask[lo:hi]).abs().max())
    diffs["head_grad_norm"] = float(got["lm_head.weight" if not tied else "model.embed_tokens.weight"].norm())
    return diffs


def main() -> None:
    out, result = Path(sys.argv[1]), {}
    for strategy in ("ddp", "fsdp"):
        # a second init keeps the process group and switches the strategy `wrap` applies
        distributed.init({"distributed": {"strategy": strategy}, "model": {"device": "cpu"}})
        assert distributed.world() == 2
        for tied in (True, False):
            result[f"{strategy} tied={tied}"] = check(tied)
    if distributed.is_main():
        out.write_text(json.dumps(result))
    distributed.shutdown()


if __name__ == "__main__":
    main()
