"""Sampling completions from a policy. `hf` is the default backend; `vllm` is an optional extra.

`make_rollout(sections, seed, policy_dir, policy)` gives the configured sampler behind one interface:
`generate(prompts, *, max_new_tokens, eos_id, pad_id, greedy, temperature, top_p, top_k, generator, tools,
records) -> Rollout` (both run the tools, rloo/rollout/tools.py) and `sync_weights(model)` (call it
after each optimizer step; a no-op for `hf`, which samples from the live policy).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import torch

from rloo.model.logprobs import model_device
from rloo.rollout.hf import generate
from rloo.rollout.sampling import Rollout
from rloo.runtime import inference_dtype

if TYPE_CHECKING:
    from rloo.settings import Config

__all__ = ["HFRollout", "Rollout", "generate", "logprob_gap", "make_rollout"]


class HFRollout:
    """Sampling from the trainer's own policy module: the lean decode loop for the model families it
    covers, else the KV-cached loop over HF's forward pass (`lean=False` forces that one)."""

    name = "hf"

    def __init__(self, model: torch.nn.Module, lean: bool = True, dtype: torch.dtype | None = None) -> None:
        self.model, self.lean, self.dtype = model, lean, dtype  # dtype: model.inference_dtype

    def generate(self, prompts: list[list[int]], **kwargs) -> Rollout:
        return generate(self.model, prompts, lean=self.lean, dtype=self.dtype, **kwargs)

    def sync_weights(self, model: torch.nn.Module) -> None:
        self.model = model  # already the live weights: nothing to copy

    def close(self) -> None:
        pass


def make_rollout(sections: Config, seed: int, policy_dir: str | Path, policy: torch.nn.Module):
    """The sampler of `rollout.backend`; the vLLM engine is built once here, from `policy_dir`."""
    if sections.rollout.backend == "vllm":
        from rloo.rollout.vllm import VLLMRollout  # imports vllm, an optional dependency

        return VLLMRollout.from_config(sections, seed, policy_dir)
    return HFRollout(policy, dtype=inference_dtype(sections.model.inference_dtype, model_device(policy)))


def logprob_gap(ro: Rollout, token_logp: torch.Tensor, mask: torch.Tensor) -> dict[str, float]:
    """`rollout/logprob_gap`: mean |sampler log-prob − trainer log-prob| over completion tokens.

    Empty when the sampler reports no log-probabilities (the HF backend samples from the trainer's
    own forward pass, so there is nothing to compare).
    """
    if ro.logprobs is None:
        return {}
    m = mask.bool() & torch.isfinite(ro.logprobs)
    gap = (ro.logprobs - token_logp.detach().float()).abs()[m]
    return {"rollout/logprob_gap": float(gap.mean()) if gap.numel() else float("nan")}
