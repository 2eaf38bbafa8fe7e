"""Batched sampling with the model's own KV cache: plain temperature-1 sampling or greedy decoding."""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch

from rloo.batching import cache_kwarg, kv_cache, left_pad, model_device, positions, unique_rows
from rloo.rollout import decode


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

    def texts(self, tokenizer) -> list[str]:
        """Each completion decoded up to and including its EOS, special tokens dropped."""
        tokens, lengths = self.completions.cpu(), self.lengths.tolist()
        return [tokenizer.decode(tokens[j, :n], skip_special_tokens=True) for j, n in enumerate(lengths)]

    @classmethod
    def from_buffers(cls, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, tokens: torch.Tensor,
                     mask: torch.Tensor, finished: torch.Tensor, steps: int) -> Rollout:
        """The rollout of a decode loop's preallocated buffers, cut to the `steps` it ran."""
        return cls(prompt_ids, prompt_mask, tokens[:, :steps], mask[:, :steps], finished)

    def clone(self) -> Rollout:
        """A copy whose tensors are ordinary ones (usable by autograd even if made under inference mode)."""
        return Rollout(**{f.name: None if (t := getattr(self, f.name)) is None else t.clone() for f in fields(self)})

    def select(self, rows: torch.Tensor) -> Rollout:
        """The rollout of `rows` only: every tensor field indexed by row (the widths stay)."""
        return Rollout(**{f.name: None if (t := getattr(self, f.name)) is None else t[rows] for f in fields(self)})

    def to(self, device: torch.device | str) -> Rollout:
        """The same rollout with every tensor on `device` (a no-op where they already are)."""
        return Rollout(**{f.name: None if (t := getattr(self, f.name)) is None else t.to(device) for f in fields(self)})


def _next_token(
    logits: torch.Tensor,
    greedy: bool,
    temperature: float,
    top_p: float,
    top_k: int,
    gumbel: torch.Tensor | None,
) -> torch.Tensor:
    """Greedy, or a sample by the Gumbel-max trick: argmax(logits / T + g) with g ~ Gumbel(0, 1)."""
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
    return (logits + gumbel).argmax(-1)


def _gumbel(rows: int, vocab: int, generator: torch.Generator | None, device: torch.device | None = None) -> torch.Tensor:
    # Drawn for every row of the batch at every step, finished or not, so a row's sample depends only
    # on its own logits and the generator, never on which other rows are still being decoded.
    u = torch.rand((rows, vocab), generator=generator, device=device).clamp_(min=1e-20)
    return -torch.log(-torch.log(u))


def _noise_generator(generator: torch.Generator | None, device: torch.device) -> torch.Generator | None:
    """A generator on the model's device seeded from `generator` (a CPU one stays as it is): drawing
    the noise where the logits are avoids copying a [rows, vocab] tensor to the GPU every token."""
    if generator is None or generator.device.type == device.type:
        return generator
    g = torch.Generator(device=device)
    g.manual_seed(int(torch.randint(0, 2**62, (1,), generator=generator)))
    return g


@torch.no_grad()
def generate(
    model: torch.nn.Module,
    prompts: list[list[int]],
    *, max_new_tokens: int, eos_id: int, pad_id: int, greedy: bool = False, temperature: float = 1.0,
    top_p: float = 1.0, top_k: int = 0, generator: torch.Generator | None = None,
    compact: bool = True, lean: bool = True, noise_rows: tuple[int, int] | None = None,
) -> Rollout:
    """Complete every prompt once; stops early when all rows have produced EOS.

    Two savings that leave the output unchanged: a prompt repeated k times is prefilled once and its
    KV cache copied, and rows that have finished are dropped from the decode batch (with the cache
    rows), so the step cost follows the sequences still running rather than the longest one.
    `compact=False` turns both off (the tests compare the two paths). Models of a family that
    `rloo.rollout.decode` reproduces run its lean loop instead of HF's forward pass (`lean=False` forces
    HF's; both give the same tokens in float32).

    `noise_rows=(offset, total)`: these prompts are rows offset.. of a batch of `total` rows (one
    process's share of a data-parallel step): each token's noise is drawn for all `total` rows, as one
    process sampling the whole batch draws it, and these rows read theirs, so that the processes
    together sample exactly what one would.
    """
    if lean and decode.supports(model):
        return decode.generate(model, prompts, max_new_tokens=max_new_tokens, eos_id=eos_id, pad_id=pad_id,
                               greedy=greedy, temperature=temperature, top_p=top_p, top_k=top_k,
                               generator=generator, compact=compact, noise_rows=noise_rows)
    device = model_device(model)
    noise = None if greedy else _noise_generator(generator, device)
    prompt_ids, prompt_mask = (t.to(device) for t in left_pad(prompts, pad_id))
    batch = prompt_ids.shape[0]
    offset, drawn = noise_rows or (0, batch)
    everyone = torch.arange(batch, device=device)
    first, inverse = unique_rows(torch.cat([prompt_ids, prompt_mask], 1)) if compact else (everyone, everyone)
    out = model(input_ids=prompt_ids[first], attention_mask=prompt_mask[first],
                position_ids=positions(prompt_mask[first]), use_cache=True, logits_to_keep=1)
    cache, cache_kw = kv_cache(out), cache_kwarg(model)
    compact = compact and hasattr(cache, "batch_select_indices")
    logits = out.logits[:, -1]
    if len(first) < batch:
        if compact:
            cache.batch_select_indices(inverse)
            logits = logits[inverse]
        else:  # a cache type without row selection: prefill every row
            out = model(input_ids=prompt_ids, attention_mask=prompt_mask, position_ids=positions(prompt_mask),
                        use_cache=True, logits_to_keep=1)
            cache, logits = kv_cache(out), out.logits[:, -1]
    attn = prompt_mask
    last_pos = positions(prompt_mask)[:, -1:]
    rows = everyone  # the batch rows still being decoded, in decode-batch order
    tokens = torch.full((batch, max_new_tokens), pad_id, dtype=torch.long, device=device)
    mask = torch.zeros((batch, max_new_tokens), dtype=torch.bool, device=device)
    finished = torch.zeros(batch, dtype=torch.bool, device=device)
    steps = 0
    for t in range(max_new_tokens):
        gumbel = None if greedy else _gumbel(drawn, logits.shape[-1], noise, device)[offset + rows]
        live = ~finished[rows]  # all True when compacting; else finished rows ride along as padding
        nxt = torch.where(live, _next_token(logits, greedy, temperature, top_p, top_k, gumbel), pad_id)
        tokens[rows, t], mask[rows, t] = nxt, live
        steps = t + 1
        finished[rows[live & (nxt == eos_id)]] = True
        if bool(finished.all()):
            break
        if compact and bool(finished[rows].any()):
            keep = (~finished[rows]).nonzero().squeeze(-1)
            cache.batch_select_indices(keep)
            rows, attn, last_pos, nxt = rows[keep], attn[keep], last_pos[keep], nxt[keep]
        attn = torch.cat([attn, torch.ones((len(rows), 1), dtype=attn.dtype, device=device)], dim=1)
        last_pos = last_pos + 1
        out = model(
            input_ids=nxt[:, None], attention_mask=attn, position_ids=last_pos, use_cache=True, **{cache_kw: cache}
        )
        cache, logits = kv_cache(out), out.logits[:, -1]
    return Rollout.from_buffers(prompt_ids, prompt_mask, tokens, mask, finished, steps)
