"""What both sampling loops share (rloo.rollout.hf, rloo.rollout.decode): the rollout they return, the
next-token rule (greedy, or Gumbel-max with temperature, top-k and top-p) and the noise it draws."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from rloo.rollout.tools import ToolCalls


@dataclass
class Rollout:
    prompt_ids: torch.Tensor  # [B, P] left-padded
    prompt_mask: torch.Tensor  # [B, P]
    completions: torch.Tensor  # [B, T] right-padded with pad_id after the first EOS
    completion_mask: torch.Tensor  # [B, T] bool: tokens up to and including the first EOS
    finished: torch.Tensor  # [B] bool: the completion ended with EOS (not truncated)
    logprobs: torch.Tensor | None = None  # [B, T] the sampler's own log-prob of each token (0 on padding and forced tokens; None when greedy)
    # With tools (rloo/rollout/tools.py): [B, T] bool, the completion tokens the policy sampled (a tool's
    # forced tokens are not); None when no token was forced: then every completion token is the policy's.
    policy_mask: torch.Tensor | None = None
    tool_calls: torch.Tensor | None = None  # [B] the tool calls of each completion; None without tools
    tool_errors: torch.Tensor | None = None  # [B] those of its calls whose result erred (rloo.tools.Tool.erred)

    @property
    def lengths(self) -> torch.Tensor:
        """Every completion token counts, forced or not (the response length, truncation)."""
        return self.completion_mask.sum(-1)

    @property
    def loss_mask(self) -> torch.Tensor:
        """[B, T] the tokens a loss trains on: the policy's own (`policy_mask`), else the completion's."""
        return self.completion_mask if self.policy_mask is None else self.policy_mask

    def texts(self, tokenizer) -> list[str]:
        """Each completion decoded up to and including its EOS, special tokens dropped."""
        tokens, lengths = self.completions.cpu(), self.lengths.tolist()
        return [tokenizer.decode(tokens[j, :n], skip_special_tokens=True) for j, n in enumerate(lengths)]

    def token_ids(self) -> list[list[int]]:
        """Each completion's token ids, up to and including its EOS (a reward function's `completion_ids`)."""
        return [row[:n] for row, n in zip(self.completions.cpu().tolist(), self.lengths.tolist(), strict=True)]

    @classmethod
    def from_buffers(cls, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, tokens: torch.Tensor,
                     mask: torch.Tensor, finished: torch.Tensor, steps: int,
                     logprobs: torch.Tensor | None = None, tools: ToolCalls | None = None) -> Rollout:
        """The rollout of a decode loop's preallocated buffers, cut to the `steps` it ran."""
        mask = mask[:, :steps]
        return cls(prompt_ids, prompt_mask, tokens[:, :steps], mask, finished,
                   None if logprobs is None else logprobs[:, :steps],
                   None if tools is None else tools.policy_mask(mask, steps),
                   None if tools is None else tools.call_counts(mask.device),
                   None if tools is None else tools.error_counts(mask.device))

    def clone(self) -> Rollout:
        """A copy whose tensors are ordinary ones (usable by autograd even if made under inference mode)."""
        return Rollout(**{f.name: None if (t := getattr(self, f.name)) is None else t.clone() for f in fields(self)})

    def select(self, rows: torch.Tensor) -> Rollout:
        """The rollout of `rows` only: every tensor field indexed by row (the widths stay)."""
        return Rollout(**{f.name: None if (t := getattr(self, f.name)) is None else t[rows] for f in fields(self)})

    def to(self, device: torch.device | str) -> Rollout:
        """The same rollout with every tensor on `device` (a no-op where they already are)."""
        return Rollout(**{f.name: None if (t := getattr(self, f.name)) is None else t.to(device) for f in fields(self)})


def processed_logits(logits: torch.Tensor, temperature: float, top_p: float, top_k: int) -> torch.Tensor:
    """The logits of the distribution sampled from: divided by the temperature, then top-k and top-p
    (nucleus) filtered (-inf outside), in float32. Its log-softmax is the sampler's log-probability."""
    logits = logits.float()
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
    return logits


def sample_token(
    logits: torch.Tensor,
    greedy: bool,
    temperature: float,
    top_p: float,
    top_k: int,
    gumbel: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Greedy, or a sample by the Gumbel-max trick, argmax(processed logits + g) with g ~ Gumbel(0, 1); and
    the token's log-probability under the processed distribution it was drawn from (log-softmax of
    `processed_logits` at the token; None when greedy: no distribution is sampled)."""
    if greedy:
        return logits.float().argmax(-1), None
    processed = processed_logits(logits, temperature, top_p, top_k)
    token = (processed + gumbel).argmax(-1)
    # The sampler's own log-probability, for the mismatch metrics and the rollout correction: computed
    # from the very logits the token was drawn with, so it is the distribution actually sampled.
    logp = torch.log_softmax(processed, -1).gather(-1, token[:, None]).squeeze(-1)
    return token, logp


def gumbel_noise(rows: int, vocab: int, generator: torch.Generator | None, device: torch.device | None = None) -> torch.Tensor:
    # Drawn for every row of the batch at every step, finished or not, so a row's sample depends only
    # on its own logits and the generator, never on which other rows are still being decoded.
    u = torch.rand((rows, vocab), generator=generator, device=device).clamp_(min=1e-20)
    return -torch.log(-torch.log(u))


def noise_generator(generator: torch.Generator | None, device: torch.device) -> torch.Generator | None:
    """A generator on the model's device seeded from `generator` (a CPU one stays as it is): drawing
    the noise where the logits are avoids copying a [rows, vocab] tensor to the GPU every token."""
    if generator is None or generator.device.type == device.type:
        return generator
    g = torch.Generator(device=device)
    g.manual_seed(int(torch.randint(0, 2**62, (1,), generator=generator)))
    return g
