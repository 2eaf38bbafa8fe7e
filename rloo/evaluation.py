"""Completions for a list of questions, and their accuracy by the verifier."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rloo.data.gsm8k import format_prompt
from rloo.rollout import generate
from rloo.verifier import Mode, is_correct


@dataclass
class Completions:
    texts: list[str]
    lengths: list[int]  # tokens, EOS included
    finished: list[bool]  # ended with EOS within the token budget


def complete(
    model: torch.nn.Module,
    tokenizer,
    questions: list[str],
    *,
    template: str,
    max_new_tokens: int,
    greedy: bool,
    batch_size: int = 128,
    generator: torch.Generator | None = None,
) -> Completions:
    """One completion per question, batched by prompt length to keep padding small."""
    prompt_ids = [tokenizer(format_prompt(q, template))["input_ids"] for q in questions]
    order = sorted(range(len(questions)), key=lambda i: len(prompt_ids[i]))
    texts: list[str] = [""] * len(questions)
    lengths = [0] * len(questions)
    finished = [False] * len(questions)
    for start in range(0, len(order), batch_size):
        idx = order[start : start + batch_size]
        ro = generate(
            model,
            [prompt_ids[i] for i in idx],
            max_new_tokens=max_new_tokens,
            eos_id=tokenizer.eos_token_id,
            pad_id=tokenizer.pad_token_id,
            greedy=greedy,
            generator=generator,
        )
        for i, text, n, done in zip(idx, ro.texts(tokenizer), ro.lengths.tolist(), ro.finished.tolist(), strict=True):
            texts[i], lengths[i], finished[i] = text, n, done
    return Completions(texts, lengths, finished)


def accuracy(texts: list[str], golds: list[str], mode: Mode = "strict") -> float:
    if not texts:
        return 0.0
    return sum(is_correct(t, g, mode) for t, g in zip(texts, golds, strict=True)) / len(texts)
