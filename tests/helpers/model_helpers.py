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


def evaluate_and_report(cfg: dict, data, sft, policies: dict, out_json, reward_model=None, plots=None,
                        trained: str = "rloo") -> dict:
    """What the workflow's evaluate and report jobs do, in this process: each of `policies` ({name: folder}:
    base, sft and the trained one) evaluated on its own (rloo_workflow.stages.evaluate), its records beside
    `out_json` (eval/<name>.jsonl), then the report of `trained` (rloo_workflow.stages.report). The results."""
    from pathlib import Path

    from rloo.eval.records import read
    from rloo_workflow.stages import evaluate, report

    out = Path(out_json).parent / "eval"
    for name, folder in policies.items():
        evaluate.run(cfg, data, sft, name, folder, out / f"{name}.jsonl", reward_model)
    evaluations = {name: read(name, out / f"{name}.jsonl") for name in policies}
    return report.run(cfg, evaluations, trained, policies[trained], Path(data) / "manifest.json", out_json, plots)
