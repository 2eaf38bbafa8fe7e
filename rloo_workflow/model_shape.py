"""The policy's shape for `rloo plan` (rloo_workflow/memory_plan.py): a Llama-family decoder's dimensions and the
parameter counts they give (`Shape`), read from the model's config.json (a local folder or the Hugging
Face cache, never the network), else model.shape; the embedded tiny model's from model.tiny."""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from rloo.errors import UserError
from rloo.settings import ModelConfig

LORA_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True)
class Shape:
    """A Llama-family decoder's dimensions (model.shape, or the model's config.json)."""

    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    intermediate_size: int
    vocab_size: int
    tie_word_embeddings: bool = False

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    def linear_shapes(self) -> dict[str, tuple[int, int]]:
        """(in, out) of each linear projection of one decoder layer."""
        h, i, kv = self.hidden_size, self.intermediate_size, self.num_kv_heads * self.head_dim
        return {"q_proj": (h, h), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (h, h),
                "gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h)}

    def layer_linear_params(self) -> int:
        return sum(a * b for a, b in self.linear_shapes().values())

    def layer_params(self) -> int:
        return self.layer_linear_params() + 2 * self.hidden_size  # + the two RMSNorm weights

    def root_params(self) -> int:
        """Embeddings, final norm and head: what FSDP's root module holds."""
        embed = self.vocab_size * self.hidden_size
        return embed * (1 if self.tie_word_embeddings else 2) + self.hidden_size

    def parameters(self) -> int:
        return self.num_layers * self.layer_params() + self.root_params()

    def reward_model_parameters(self) -> int:
        """The sequence-classification model: the backbone and a one-output score head, no lm_head."""
        untied_head = 0 if self.tie_word_embeddings else self.vocab_size * self.hidden_size
        return self.parameters() - untied_head + self.hidden_size

    def lora_parameters(self, r: int, targets: str | Sequence[str]) -> int:
        modules = LORA_MODULES if targets == "all-linear" else [t for t in targets if t in LORA_MODULES]
        shapes = self.linear_shapes()
        return self.num_layers * sum(r * (shapes[m][0] + shapes[m][1]) for m in modules)

    def kv_bytes_per_token(self, weight_bytes: int) -> int:
        return self.num_layers * 2 * self.num_kv_heads * self.head_dim * weight_bytes


def shape_from_config_json(d: dict) -> Shape | None:
    """A Shape from a transformers config.json's keys, or None when they are not all there."""
    d = d.get("text_config", d)
    try:
        return Shape(hidden_size=d["hidden_size"], num_layers=d["num_hidden_layers"],
                     num_heads=d["num_attention_heads"],
                     num_kv_heads=d.get("num_key_value_heads") or d["num_attention_heads"],
                     intermediate_size=d["intermediate_size"], vocab_size=d["vocab_size"],
                     tie_word_embeddings=bool(d.get("tie_word_embeddings", True)))
    except KeyError:
        return None


def _config_json(name: str) -> dict | None:
    """The model's config.json: a local folder's, or the Hugging Face cache's (never the network)."""
    local = Path(name) / "config.json"
    if local.is_file():
        return json.loads(local.read_text())
    if os.path.exists(name):
        return None
    try:
        from huggingface_hub import try_to_load_from_cache
    except ImportError:
        return None
    try:
        found = try_to_load_from_cache(name, "config.json")
    except Exception:  # an id the hub library refuses: no cached config either
        return None
    return json.loads(Path(found).read_text()) if isinstance(found, str) else None


def model_shape(mc: ModelConfig) -> tuple[Shape, str]:
    """(the policy's shape, where it was read): config.json, else model.shape; the embedded tiny model's
    from model.tiny. An error naming model.shape when none is there."""
    if mc.name_or_path is None:
        t = mc.tiny
        return Shape(t.hidden_size, t.num_layers, t.num_heads, t.num_heads, t.intermediate_size, t.vocab_size,
                     True), "model.tiny"
    if (d := _config_json(mc.name_or_path)) and (shape := shape_from_config_json(d)):
        return shape, f"{mc.name_or_path} config.json"
    if mc.shape:
        s = mc.shape
        return Shape(s.hidden_size, s.num_layers, s.num_heads, s.num_kv_heads, s.intermediate_size, s.vocab_size,
                     s.tie_word_embeddings), "model.shape"
    raise UserError(f"model {mc.name_or_path}: no config.json in a local folder or the Hugging Face cache; "
                    "set model.shape (hidden_size, num_layers, num_heads, num_kv_heads, intermediate_size, "
                    "vocab_size, tie_word_embeddings) to plan without it")
