"""Micro-batches: a step's rows packed by length under a token budget, and one gradient pass over them.

Every training stage (sft, reward, rloo, ppo) takes its step the same way:

    parts = pack(lengths, budget)                       # row indices, longest rows first
    parts = even(parts)                                 # data-parallel: the same count on every rank
    loss, _ = accumulate(train_model, parts, loss_of)   # loss_of(rows): that part's share of the step's loss

`loss_of(rows)` returns the part's loss normalised by the WHOLE step's denominator (its rows, tokens
or pairs), so that the parts' gradients add up to the step's gradient, whatever the split. Memory then
follows the budget: one micro-batch's activations are held at a time. Gradients are synchronised once,
on the last part's backward (DDP `no_sync`, FSDP2 `set_requires_gradient_sync`); under FSDP every rank
must run the same number of forward passes (each all-gathers the layers' parameters), which `even`
guarantees, padding with zero-weight parts where a rank has too few rows.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import torch

from rloo.model import distributed
from rloo.model.logprobs import SeqBatch


@dataclass(frozen=True)
class Part:
    rows: torch.Tensor  # indices into the step's rows
    weight: float = 1.0  # 0: a stand-in part that only keeps the ranks' passes in step (FSDP)


def pack(lengths: Sequence[int] | torch.Tensor, budget: int) -> list[torch.Tensor]:
    """Row indices grouped into micro-batches whose rows x longest row stays within `budget` tokens.

    Rows go longest first (stable), each micro-batch taking rows while its padded size fits, so a
    micro-batch's rows have similar lengths (little padding, like verl's dynamic batch size). A row
    longer than the budget is a micro-batch of its own. `budget` 0: every row in one micro-batch, in
    the given order (today's single pass)."""
    lengths = torch.as_tensor(lengths, dtype=torch.long).cpu()
    n = len(lengths)
    if budget <= 0 or n == 0 or int(lengths.max()) * n <= budget:
        return [torch.arange(n)]
    order = torch.argsort(lengths, descending=True, stable=True).tolist()
    parts: list[list[int]] = []
    for i in order:
        # The first row of a micro-batch is its longest: the padded size is rows x that length.
        if parts and (len(parts[-1]) + 1) * int(lengths[parts[-1][0]]) <= budget:
            parts[-1].append(i)
        else:
            parts.append([i])
    return [torch.tensor(p) for p in parts]


def even(parts: list[torch.Tensor]) -> list[Part]:
    """The micro-batches as `Part`s, as many on this rank as on the rank that needs the most.

    A single process: unchanged. Data-parallel: the largest micro-batches are halved until the count
    is reached (smaller passes, same rows); a rank with fewer rows than that count runs its first
    row again with weight 0 (a forward and backward that contributes nothing)."""
    parts = [p for p in parts if len(p)]
    if not distributed.enabled():
        return [Part(p) for p in parts]
    target = int(distributed.all_max(len(parts)))
    while len(parts) < target and max(len(p) for p in parts) > 1:
        i = max(range(len(parts)), key=lambda j: len(parts[j]))
        a, b = parts[i].tensor_split(2)
        parts[i : i + 1] = [a, b]
    out = [Part(p) for p in parts]
    out += [Part(parts[0][:1], 0.0) for _ in range(target - len(parts))]
    return out


@contextlib.contextmanager
def _gradient_sync(train_model: torch.nn.Module, on: bool) -> Iterator[None]:
    """DDP / FSDP2 reduce gradients only in a backward pass made with `on` (the step's last)."""
    if on or not distributed.enabled():
        yield
    elif hasattr(train_model, "no_sync"):  # DDP
        with train_model.no_sync():
            yield
    elif hasattr(train_model, "set_requires_gradient_sync"):  # FSDP2
        train_model.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            train_model.set_requires_gradient_sync(True)
    else:
        yield


def accumulate(train_model: torch.nn.Module, parts: list[Part],
               loss_of: Callable[[torch.Tensor], torch.Tensor | tuple[torch.Tensor, dict[str, float]]],
               ) -> tuple[float, dict[str, float]]:
    """Backward of `loss_of(part.rows) * part.weight` for every part, the gradients accumulating in
    `.grad` and synchronised across ranks on the last part only. Returns this rank's summed loss, and
    the sums over live parts (not stand-ins) of the counts `loss_of` may return beside its loss
    (`(loss, {"clipped_tokens": ...})`: a trainer's per-part statistics)."""
    total, counts = 0.0, {}
    for i, part in enumerate(parts):
        with _gradient_sync(train_model, on=i == len(parts) - 1):
            got = loss_of(part.rows)
            loss, part_counts = got if isinstance(got, tuple) else (got, {})
            (loss * part.weight if part.weight != 1.0 else loss).backward()
        if part.weight:
            total += float(loss.detach())
            for name, value in part_counts.items():
                counts[name] = counts.get(name, 0.0) + value
    return total, counts


def no_grad_map(parts: list[torch.Tensor], fn: Callable[[torch.Tensor], torch.Tensor], n: int,
                shape: tuple[int, ...], like: torch.Tensor) -> torch.Tensor:
    """[n, *shape] from `fn(rows)` computed part by part without gradient (a reference, old log-prob
    or value pass bounded by the same budget as the gradient pass)."""
    out = like.new_zeros((n, *shape))
    with torch.no_grad():
        for rows in parts:
            got = fn(rows)
            out[rows.to(out.device), : got.shape[1]] = got
    return out


def sub_batch(batch: SeqBatch, rows: torch.Tensor) -> SeqBatch:
    """The micro-batch of `rows`, its completion columns cut to its longest completion (the prompt
    block keeps its width: log-probabilities do not depend on left padding)."""
    rows = rows.to(batch.input_ids.device)
    width = batch.prompt_len + max(int(batch.completion_mask[rows].sum(1).max()), 1)
    return SeqBatch(input_ids=batch.input_ids[rows, :width], attention_mask=batch.attention_mask[rows, :width],
                    position_ids=batch.position_ids[rows, :width], prompt_len=batch.prompt_len,
                    completion_mask=batch.completion_mask[rows, : width - batch.prompt_len])


def copies(inverse: torch.Tensor, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(the step's rows that are copies of the distinct `rows`, each one's position within `rows`):
    with deduplicated rows a micro-batch of distinct rows carries the loss of all their copies."""
    rows = rows.to(inverse.device)
    where = torch.full((int(max(int(inverse.max()), int(rows.max()))) + 1,), -1, dtype=torch.long,
                       device=inverse.device)
    where[rows] = torch.arange(len(rows), device=inverse.device)
    at = where[inverse]
    sel = torch.nonzero(at >= 0).squeeze(1)
    return sel, at[sel]
