"""One RLOO update exactly as the method writes it, to read and to hold the trainer against
(tests/integration/test_rloo_update.py): no shared prompt passes, duplicate rows, micro-batches, chunked head,
autocast or data parallelism; the full logits of one plain forward pass."""

from __future__ import annotations

import torch


def token_logprobs(model: torch.nn.Module, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor,
                   completions: torch.Tensor, completion_mask: torch.Tensor) -> torch.Tensor:
    """log π(y_t | x, y_<t) of every completion token, [B, T]: left-padded prompts, right-padded completions."""
    ids = torch.cat([prompt_ids, completions], 1)
    attention = torch.cat([prompt_mask, completion_mask.long()], 1)
    position = (attention.cumsum(1) - 1).clamp(min=0)
    logits = model(input_ids=ids, attention_mask=attention, position_ids=position).logits.float()
    p = prompt_ids.shape[1]
    return torch.log_softmax(logits[:, p - 1 : -1], -1).gather(-1, completions.unsqueeze(-1)).squeeze(-1)


def rloo_loss(logp: torch.Tensor, logp_ref: torch.Tensor, mask: torch.Tensor, scores: torch.Tensor, k: int,
              beta: float, *, norm: str = "sequence", kl_in: str = "reward", kl: str = "k1",
              sampler_logp: torch.Tensor | None = None, cap: float = 2.0) -> torch.Tensor:
    """L = -(1/D) Σ_i A_i Σ_t w_it log π(y_it), A_i = R_i - (1/(k-1)) Σ_{j≠i} R_j, R_i = r_i - β·KL_i (detached).

    Rows i*k .. i*k+k-1 are one prompt's samples. D: the responses (`sequence`) or their tokens (`token`).
    `kl_in: loss` moves β·KL from the reward into the loss, aggregated like the policy term. w_it = 1, or
    given the sampler's log-probabilities, token-level truncated importance sampling: min(π/π_sampler, C)."""
    m = mask.float()
    log_ratio = logp - logp_ref
    kl_t = log_ratio if kl == "k1" else torch.exp(-log_ratio) + log_ratio - 1  # k3: e^r - r - 1, r = -log_ratio
    reward = scores - beta * (kl_t * m).sum(1).detach() if kl_in == "reward" else scores
    grouped = reward.view(-1, k)
    advantage = (grouped - (grouped.sum(1, keepdim=True) - grouped) / (k - 1)).view(-1).detach()
    w = 1.0 if sampler_logp is None else torch.exp(logp.detach() - sampler_logp).clamp(max=cap)
    per_token = -advantage[:, None] * w * logp + (beta * kl_t if kl_in == "loss" else 0.0)
    if norm == "sequence":
        return (per_token * m).sum(1).mean()
    return (per_token * m).sum() / m.sum()
