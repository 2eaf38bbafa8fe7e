"""Test doubles shared by test files of more than one tier (tests/unit, tests/integration, tests/e2e):
a reward with spread on the micro policy, and small random models of other shapes than the embedded one."""

from __future__ import annotations

import torch


class LengthReward:
    """A reward with spread on the micro policy (which solves nothing, so the verifier pays 0 to every
    sample and the update would be exactly zero): shorter completions score higher."""

    name = "length"

    def score(self, prompts, completions, golds, finished):
        return torch.tensor([-len(c) / 50.0 for c in completions])


def random_lm(kind: str) -> torch.nn.Module:
    """A random model of another shape than the embedded one: grouped-query attention and biases."""
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config

    common = dict(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=256, eos_token_id=0, pad_token_id=1)
    config = (Qwen2Config(**common) if kind == "qwen2"
              else LlamaConfig(**common, attention_bias=True, mlp_bias=True, rope_theta=500.0))
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager").eval()
    with torch.no_grad():  # biases start at zero: make them count
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(0, 0.5)
    return model
