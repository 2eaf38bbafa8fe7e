"""Log-probabilities of target tokens from hidden states through a causal LM's output head, chunk by chunk.

The plain way (`model(...).logits`, then `log_softmax(logits.float())` and a gather) holds a
[rows, T, vocabulary] float32 tensor until the backward pass: ~0.6 GB per 1,000 tokens at Qwen2.5's
151,936 tokens. `head_logprobs` takes only the positions whose log-probability is needed, applies the
head `chunk_tokens` of them at a time, keeps per token only its log-sum-exp, and recomputes each chunk's
logits in the backward pass: the largest temporary is chunk x vocabulary floats.

Values agree with the plain way's: the head's matmul runs in the dtype `lm_head` itself would run in
(the autocast dtype inside `torch.autocast`, else the weight's), its logits are upcast to float32, and
the log-softmax, the entropy and the gradient of the logits are float32, as `token_logprobs` does; the
gradient then goes through the matmul in that same dtype again, as autograd's would.

`logprob_head(model, chunk_tokens)` makes the model's own forward call return these log-probabilities in
place of its logits: the head runs inside the call of the module a data-parallel wrapper runs (FSDP2
unshards the root's parameters, the head and tied embeddings among them, only during that forward;
DDP's reducer needs its forward). `causal_logprobs` is the entry point for a whole sequence (SFT).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F

log = logging.getLogger("rloo")

# Causal LMs whose forward does `logits = self.lm_head(hidden_states[:, slice])` and nothing more to them
# (checked in transformers 5.24). Others (Gemma 2's final_logit_softcapping, Cohere's logit_scale,
# Granite's logits_scaling, ...) change the logits after the head: they take the plain full-logits way.
LINEAR_HEAD_MODEL_TYPES = frozenset({"llama", "qwen2", "qwen3", "mistral"})


# -- the chunked head -------------------------------------------------------------------------------
def _chunk_logits(h: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    return F.linear(h, w, b).float()


class _ChunkedHeadLogprobs(torch.autograd.Function):
    """log softmax(h W^T + b)[target] per row, and (no gradient) the entropy, `chunk` rows at a time.

    `dtype` is the matmul's dtype; autocast is off inside (the casts are explicit, in forward and
    backward alike, since the backward pass runs outside the caller's autocast block)."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, chunk: int, dtype: torch.dtype, entropy: bool):
        n = hidden.shape[0]
        logp = hidden.new_empty(n, dtype=torch.float32)
        lse = hidden.new_empty(n, dtype=torch.float32)
        ent = hidden.new_empty(n, dtype=torch.float32) if entropy else None
        with torch.autocast(hidden.device.type, enabled=False):
            h, w, b = _cast(hidden, weight, bias, dtype)
            for s in range(0, n, chunk):
                rows = slice(s, s + chunk)
                logits = _chunk_logits(h[rows], w, b)
                lse[rows] = torch.logsumexp(logits, dim=-1)
                logp[rows] = logits.gather(1, targets[rows, None]).squeeze(1) - lse[rows]
                if entropy:  # losses.token_entropy's formula, on this chunk's log-softmax
                    lp_all = logits.sub_(lse[rows, None])
                    ent[rows] = -(lp_all.exp() * lp_all).sum(-1)
        ctx.save_for_backward(hidden, weight, bias, targets, lse)
        ctx.chunk, ctx.dtype = chunk, dtype
        if ent is None:
            return logp, None
        ctx.mark_non_differentiable(ent)
        return logp, ent

    @staticmethod
    def backward(ctx, grad_logp, _grad_ent):
        hidden, weight, bias, targets, lse = ctx.saved_tensors
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        grad_h = torch.empty_like(hidden) if need_h else None
        grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_w else None
        grad_b = torch.zeros(bias.shape, dtype=torch.float32, device=bias.device) if need_b else None
        chunk, g = ctx.chunk, grad_logp.float()
        with torch.autocast(hidden.device.type, enabled=False):
            h, w, b = _cast(hidden, weight, bias, ctx.dtype)
            for s in range(0, hidden.shape[0], chunk):
                rows = slice(s, s + chunk)
                # d logp / d logits = onehot(target) - softmax, times the incoming gradient
                grad_logits = _chunk_logits(h[rows], w, b).sub_(lse[rows, None]).exp_().mul_(-g[rows, None])
                grad_logits.scatter_add_(1, targets[rows, None], g[rows, None])
                if need_b:
                    grad_b += grad_logits.sum(0)
                grad_logits = grad_logits.to(ctx.dtype)
                if need_h:
                    grad_h[rows] = grad_logits @ w
                if need_w and ctx.dtype == torch.float32:
                    grad_w.addmm_(grad_logits.T, h[rows])  # no V x H temporary per chunk
                elif need_w:  # summed in float32 (finer than one bf16 product over all rows); the in-place
                    grad_w += grad_logits.T @ h[rows]  # add promotes element by element: no float32 [V, h] copy
        return (grad_h, grad_w.to(weight.dtype) if need_w else None, grad_b.to(bias.dtype) if need_b else None,
                None, None, None, None)


def _cast(hidden, weight, bias, dtype):
    return hidden.to(dtype), weight.to(dtype), None if bias is None else bias.to(dtype)


def matmul_dtype(hidden: torch.Tensor, weight: torch.Tensor) -> torch.dtype:
    """The dtype `F.linear(hidden, weight)` computes in here: autocast's when it is on for this device
    (what makes today's bf16-autocast logits), else the weight's."""
    device = hidden.device.type
    if torch.is_autocast_enabled(device) and weight.is_floating_point():
        return torch.get_autocast_dtype(device)
    return weight.dtype


def head_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    targets: torch.Tensor,
    chunk_tokens: int,
    entropy: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """log softmax(hidden W^T + bias)[targets] ([N], float32, differentiable in hidden, weight, bias) and,
    when `entropy`, the entropy of each row's distribution ([N], float32, no gradient), `chunk_tokens`
    rows at a time. hidden [N, H]: only the positions whose log-probability is wanted."""
    if chunk_tokens <= 0:
        raise ValueError(f"chunk_tokens must be positive, got {chunk_tokens}")
    dtype = matmul_dtype(hidden, weight)
    return _ChunkedHeadLogprobs.apply(hidden, weight, bias, targets, chunk_tokens, dtype, entropy)


# -- the head inside the model's forward ------------------------------------------------------------
def unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """The transformers model inside DDP (`.module`) and peft (`get_base_model()`) wrappers; an FSDP2
    model is sharded in place and is its own."""
    while True:
        if isinstance(model, torch.nn.parallel.DistributedDataParallel):
            inner = model.module
        elif callable(getattr(model, "get_base_model", None)):
            inner = model.get_base_model()
        else:
            return model
        if inner is model:
            return model
        model = inner


def linear_head(model: torch.nn.Module) -> torch.nn.Linear | None:
    """The output head the chunked path may stand in for: a plain `nn.Linear` of a model type whose
    forward uses the head's output as the logits unchanged; None otherwise (take the full-logits way)."""
    inner = unwrap(model)
    model_type = getattr(getattr(inner, "config", None), "model_type", None)
    get = getattr(inner, "get_output_embeddings", None)
    head = get() if callable(get) else None
    # type() is: a peft LoRA layer or a quantised linear computes something else from its weight
    if model_type not in LINEAR_HEAD_MODEL_TYPES or head is None or type(head) is not torch.nn.Linear:
        return None
    return head


@dataclass
class Request:
    """What the head computes in the next forward call: the log-probabilities of `targets` [B, L] at the
    positions where `mask` [B, L] (bool) is set, from `pick(hidden)` [B, L, H] (hidden: what the model
    hands its head)."""

    targets: torch.Tensor
    mask: torch.Tensor
    pick: Callable[[torch.Tensor], torch.Tensor] = lambda hidden: hidden


class LogprobHead:
    """Stands in for the model's head during `logprob_head`: set `request` before each forward call; the
    call's `.logits` are then [B, L] float32 log-probabilities (0 where the mask is not set) and
    `entropy` holds the entropies ([B, L], no gradient) when asked for."""

    def __init__(self, head: torch.nn.Linear, chunk_tokens: int, entropy: bool) -> None:
        self.head, self.chunk_tokens, self.want_entropy = head, chunk_tokens, entropy
        self.request: Request | None = None
        self.entropy: torch.Tensor | None = None

    def __call__(self, hidden: torch.Tensor) -> torch.Tensor:
        req, self.request = self.request, None
        if req is None:
            raise RuntimeError("the output head stands in for log-probabilities: set its request first")
        picked = req.pick(hidden)
        # the weight is read now, inside the forward: FSDP2 has swapped in the unsharded parameter
        logp, ent = head_logprobs(picked[req.mask], self.head.weight, self.head.bias, req.targets[req.mask],
                                  self.chunk_tokens, self.want_entropy)
        zeros = picked.new_zeros(req.mask.shape, dtype=torch.float32)
        self.entropy = zeros.masked_scatter(req.mask, ent) if ent is not None else None
        return zeros.masked_scatter(req.mask, logp)


@contextlib.contextmanager
def logprob_head(model: torch.nn.Module, chunk_tokens: int, entropy: bool = False) -> Iterator[LogprobHead | None]:
    """Within the block the forward calls of `model` (or of the DDP / FSDP / peft wrapper around it) return
    log-probabilities from its head (see `LogprobHead`); yields None, changing nothing, when
    `chunk_tokens` is 0 or the model's head is not a plain linear map (`linear_head`)."""
    head = linear_head(model) if chunk_tokens > 0 else None
    if head is None:
        if chunk_tokens > 0:
            log.debug("logits_chunk_tokens: %s has no plain linear head; full logits", type(unwrap(model)).__name__)
        yield None
        return
    if "forward" in vars(head):  # the restore below would also undo the outer block's stand-in
        raise RuntimeError("logprob_head blocks over the same model do not nest")
    standin = LogprobHead(head, chunk_tokens, entropy)
    # An instance attribute shadows the class's forward: the module tree, the parameters' names and the
    # hooks stay as DDP and FSDP registered them.
    head.forward = standin
    try:
        yield standin
    finally:
        del head.forward


def causal_logprobs(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    position_ids: torch.Tensor | None,
    targets: torch.Tensor,
    target_mask: torch.Tensor,
    chunk_tokens: int,
) -> torch.Tensor:
    """[B, L] float32 log π(targets[b, t] | input_ids[b, ≤ t]) where target_mask is set, 0 elsewhere, in
    one forward call of `model` (DDP / FSDP wrappers included). The head runs only at the masked positions,
    `chunk_tokens` at a time; 0: the plain way, full logits.

    HF's `labels=` loss (SFT) is the mean over label tokens of -log π of the next token; the same number:

        targets = F.pad(labels[:, 1:], (0, 1), value=-100)   # targets[:, t] = labels[:, t + 1]
        mask = targets != -100
        logp = causal_logprobs(model, ids, attention_mask, None, targets, mask, chunk_tokens)
        loss = -(logp * mask).sum() / mask.sum()
    """
    mask = target_mask.bool()
    safe_targets = targets.masked_fill(~mask, 0)  # -100 and other ignored ids must not reach the gather
    kwargs = {"input_ids": input_ids, "attention_mask": attention_mask, "use_cache": False}
    if position_ids is not None:
        kwargs["position_ids"] = position_ids
    with logprob_head(model, chunk_tokens) as head:
        if head is None:
            logits = model(**kwargs).logits
            logp = torch.log_softmax(logits.float(), dim=-1).gather(-1, safe_targets.unsqueeze(-1)).squeeze(-1)
            return logp.masked_fill(~mask, 0.0)
        head.request = Request(safe_targets, mask)
        return model(**kwargs).logits
