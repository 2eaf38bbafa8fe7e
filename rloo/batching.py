"""Padded batches of prompt + completion tokens, and per-token log-probabilities of completions.

Prompts are left-padded and position ids follow the attention mask, so a padded row gives the same
log-probabilities as the same row alone; the policy and the reference see identical batches.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class SeqBatch:
    input_ids: torch.Tensor  # [B, P + T]
    attention_mask: torch.Tensor  # [B, P + T]
    position_ids: torch.Tensor  # [B, P + T]
    prompt_len: int  # P: width of the left-padded prompt block
    completion_mask: torch.Tensor  # [B, T] float, 1 on completion tokens up to and including EOS


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


def completion_logits(model: torch.nn.Module, batch: SeqBatch) -> torch.Tensor:
    """Logits that predict each completion token: [B, T, V]."""
    out = model(
        input_ids=batch.input_ids,
        attention_mask=batch.attention_mask,
        position_ids=batch.position_ids,
        use_cache=False,
    )
    return out.logits[:, batch.prompt_len - 1 : -1]


def token_logprobs(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """log π(target_t | context) per position, gathered in float32 for stable sums."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    return logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1)


def completion_logprobs(model: torch.nn.Module, batch: SeqBatch) -> torch.Tensor:
    """[B, T] log-probabilities of the completion tokens (padding positions hold garbage; mask them)."""
    return token_logprobs(completion_logits(model, batch), batch.input_ids[:, batch.prompt_len :])
