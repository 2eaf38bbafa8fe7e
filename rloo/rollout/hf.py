"""Batched sampling with the model's own KV cache: plain temperature-1 sampling or greedy decoding."""

from __future__ import annotations

import torch

from rloo.model.logprobs import cache_kwarg, kv_cache, left_pad, model_device, positions, unique_rows
from rloo.rollout.decode import generate as lean_generate
from rloo.rollout.decode import supports as lean_supports
from rloo.rollout.sampling import Rollout, gumbel_noise, noise_generator, sample_token
from rloo.rollout.tools import ToolRunner


@torch.no_grad()
def generate(
    model: torch.nn.Module,
    prompts: list[list[int]],
    *, max_new_tokens: int, eos_id: int, pad_id: int, greedy: bool = False, temperature: float = 1.0,
    top_p: float = 1.0, top_k: int = 0, generator: torch.Generator | None = None,
    compact: bool = True, lean: bool = True, noise_rows: tuple[int, int] | None = None,
    dtype: torch.dtype | None = None, tools: ToolRunner | None = None, records: list[dict] | None = None,
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

    `dtype` (`model.inference_dtype`): the dtype the decoding runs in; None = the weights' own. The lean
    loop casts the weights to it; HF's loop runs its forward passes under autocast to it.

    `tools` (rloo/rollout/tools.py): the tools called inside the completions, with `records` (each prompt's
    data record, what a tool reads besides its call); None samples the policy's tokens alone.
    """
    sampling = dict(max_new_tokens=max_new_tokens, eos_id=eos_id, pad_id=pad_id, greedy=greedy,
                    temperature=temperature, top_p=top_p, top_k=top_k, generator=generator, compact=compact,
                    noise_rows=noise_rows, tools=tools, records=records)
    if lean and lean_supports(model):
        return lean_generate(model, prompts, dtype=dtype, **sampling)
    if dtype is None or dtype == next(model.parameters()).dtype:
        return _generate(model, prompts, **sampling)
    with torch.autocast(model_device(model).type, dtype=dtype):
        return _generate(model, prompts, **sampling)


def _generate(model, prompts, *, max_new_tokens, eos_id, pad_id, greedy, temperature, top_p, top_k, generator,
              compact, noise_rows, tools, records) -> Rollout:
    device = model_device(model)
    noise = None if greedy else noise_generator(generator, device)
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
    logprobs = None if greedy else torch.zeros((batch, max_new_tokens), dtype=torch.float32, device=device)
    finished = torch.zeros(batch, dtype=torch.bool, device=device)
    calls = None if tools is None else tools.start(records, batch, max_new_tokens, logits.shape[-1], device)
    steps = 0
    for t in range(max_new_tokens):
        gumbel = None if greedy else gumbel_noise(drawn, logits.shape[-1], noise, device)[offset + rows]
        live = ~finished[rows]  # all True when compacting; else finished rows ride along as padding
        drawn_token, lp = sample_token(logits, greedy, temperature, top_p, top_k, gumbel)
        nxt = torch.where(live, drawn_token, pad_id)
        if calls is not None:  # a tool's result in place of the sampled tokens, where a call is open
            nxt, forced = calls.override(t, rows, live, nxt, tokens)
            if forced is not None and lp is not None:
                lp = torch.where(forced, 0.0, lp)
        tokens[rows, t], mask[rows, t] = nxt, live
        if lp is not None:  # the sampler's log-prob of its token (0 where a finished row rides along)
            logprobs[rows, t] = torch.where(live, lp, 0.0)
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
    return Rollout.from_buffers(prompt_ids, prompt_mask, tokens, mask, finished, steps, logprobs, calls)
