"""Model and tokenizer factory: the embedded tiny Llama with a locally trained tokenizer, and loaders.

Everything downstream loads through `AutoModel*.from_pretrained(path)`, the same path a hub id
such as Qwen/Qwen2.5-0.5B-Instruct takes; the tiny model is only a different folder.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import (
    AutoModelForCausalLM,
    AutoModelForSequenceClassification,
    AutoModelForTokenClassification,
    AutoTokenizer,
    LlamaConfig,
    PreTrainedModel,
    PreTrainedTokenizerBase,
    PreTrainedTokenizerFast,
)

from rloo.errors import InputError
from rloo.runtime import resolve_device

if TYPE_CHECKING:
    from rloo.model.lora import Adapted
    from rloo.settings import ModelConfig, TinyConfig

EOS = "<|endoftext|>"
PAD = "<|pad|>"
log = logging.getLogger("rloo.model.models")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def train_tokenizer(texts: Iterable[str], vocab_size: int = 384) -> PreTrainedTokenizerFast:
    """Byte-level BPE trained on `texts`, every digit its own token (arithmetic stays digit-wise)."""
    return PreTrainedTokenizerFast(
        tokenizer_object=train_bpe(texts, vocab_size, [EOS, PAD]), eos_token=EOS, bos_token=EOS, pad_token=PAD,
        padding_side="left",
    )


def train_bpe(texts: Iterable[str], vocab_size: int, special_tokens: list[str]) -> Tokenizer:
    """The `tokenizers` byte-level BPE of `train_tokenizer`, with `special_tokens` first in its vocabulary."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=special_tokens,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return tok


def build_tiny_model(
    tokenizer: PreTrainedTokenizerBase, tiny: TinyConfig, max_length: int, seed: int,
    attn_implementation: str | None = None
) -> PreTrainedModel:
    """A small Llama-family causal LM of `tiny`'s shape (its vocabulary the tokenizer's); head_dim stays ≥ 32
    so vLLM's CPU kernels can serve it."""
    if tiny.hidden_size % tiny.num_heads:
        raise InputError("model.tiny.hidden_size must be divisible by model.tiny.num_heads")
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=tiny.hidden_size,
        intermediate_size=tiny.intermediate_size,
        num_hidden_layers=tiny.num_layers,
        num_attention_heads=tiny.num_heads,
        num_key_value_heads=tiny.num_heads,
        max_position_embeddings=max_length,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, attn_implementation=attn_implementation)
    set_generation_ids(model, tokenizer)
    return model


def set_generation_ids(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase) -> None:
    """The model's config and generation config name the tokenizer's EOS, pad and BOS ids."""
    for cfg in (model.config, model.generation_config):
        cfg.eos_token_id = tokenizer.eos_token_id
        cfg.pad_token_id = tokenizer.pad_token_id
        cfg.bos_token_id = tokenizer.bos_token_id


def load_tokenizer(path: str | Path, trust_remote_code: bool = False) -> PreTrainedTokenizerBase:
    """A tokenizer that pads on the left. One without a pad token (Llama 3) pads with its EOS: no new
    embedding row, the model stays as it was saved. Nothing reads padding from token ids (masks come from
    lengths, a sampled row ends at its first live EOS, the reward head reads the last position:
    batching.sequence_scores), so pad == EOS is safe."""
    tok = AutoTokenizer.from_pretrained(str(path), trust_remote_code=trust_remote_code)
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    # Saved padding_side does not always survive a reload; generation needs left padding.
    tok.padding_side = "left"
    return tok


def load_options(mc: ModelConfig) -> dict:
    """The `model` config keys every loader takes, as keyword arguments."""
    return {
        "dtype": mc.dtype,
        "trust_remote_code": mc.trust_remote_code,
        "attn_implementation": mc.attn_implementation,
        "device": mc.device,
    }


def _load(auto_cls, path: str | Path, dtype: str, trust_remote_code: bool, trainable: bool,
          attn_implementation: str | None, device: str, **extra) -> PreTrainedModel:
    model = auto_cls.from_pretrained(
        str(path), dtype=DTYPES[dtype], trust_remote_code=trust_remote_code, use_safetensors=True,
        attn_implementation=attn_implementation, **extra,
    )
    return _prepare(model, trainable, device)


def load_causal_lm(
    path: str | Path,
    dtype: str = "float32",
    trust_remote_code: bool = False,
    trainable: bool = False,
    attn_implementation: str | None = None,
    device: str = "cpu",
) -> PreTrainedModel:
    """A causal LM from a folder or hub id, safetensors only; frozen and in eval mode unless trainable."""
    return _load(AutoModelForCausalLM, path, dtype, trust_remote_code, trainable, attn_implementation, device)


def _options(options: dict) -> dict:
    return {"dtype": "float32", "trust_remote_code": False, "trainable": False, "attn_implementation": None,
            "device": "cpu", **options}


def load_critic(path: str | Path, **options) -> PreTrainedModel:
    """PPO's critic: a one-label token classifier (a value at every position) on the backbone of a policy
    or reward-model folder; a folder without that head gets a new one. Takes `load_causal_lm`'s options."""
    return _load(AutoModelForTokenClassification, path, **_options(options), num_labels=1)


def load_reward_model(path: str | Path, trained: bool = True, **options) -> PreTrainedModel:
    """A one-label sequence classifier (Bradley-Terry reward model). Takes `load_causal_lm`'s options.
    A causal LM folder gets a new, random head only where that is the point (`trained=False`: the reward
    stage growing one from SFT); a *trained* reward model without its head is an error, not noise."""
    if trained:
        require_reward_head(path)
    return _load(AutoModelForSequenceClassification, path, **_options(options), num_labels=1)


def require_reward_head(path: str | Path) -> None:
    """`path` is a saved sequence classifier (its config names a *ForSequenceClassification class), or
    one line says it is not. A hub id is transformers' to resolve."""
    config = Path(path) / "config.json"
    if not config.is_file():
        return
    import json

    arch = json.loads(config.read_text()).get("architectures") or []
    if not any(a.endswith("ForSequenceClassification") for a in arch):
        raise InputError(f"{path}: not a trained reward model (config.json architectures {arch}, no "
                         "*ForSequenceClassification head): loading it would score with a random head")


def _prepare(model: PreTrainedModel, trainable: bool, device: str) -> PreTrainedModel:
    # Dropout stays off even while training: the policy and its frozen reference must give identical
    # log-probabilities before the first update, and the tiny models here do not need dropout.
    target = resolve_device(device)
    model.to(target)
    model.eval()
    model.requires_grad_(trainable)
    log.info("%s (%s parameters, %s) on %s, %s", model.name_or_path, f"{count_parameters(model):,}",
             model.dtype, target, "requires_grad" if trainable else "frozen")
    return model


def for_training(model: PreTrainedModel, mc: ModelConfig, task_type: str = "CAUSAL_LM") -> tuple[PreTrainedModel, Adapted | None]:
    """A loaded trainable model as `model.lora` and `model.gradient_checkpointing` make it: (the module
    to train, its `lora.Adapted` or None). With LoRA the module is the model's own class with LoRA layers
    injected, only the adapters requiring gradients."""
    from rloo.model import grad_checkpointing, lora

    adapted = lora.adapt(model, mc.lora, task_type)
    module = adapted.model if adapted is not None else model
    grad_checkpointing.enable(module, mc.gradient_checkpointing)
    return module, adapted


def save_pretrained(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, folder: str | Path) -> None:
    """Weights as safetensors plus the tokenizer, loadable with from_pretrained."""
    model.save_pretrained(str(folder), safe_serialization=True)
    tokenizer.save_pretrained(str(folder))


def count_parameters(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())
