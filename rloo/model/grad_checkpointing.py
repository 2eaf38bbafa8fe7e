"""Gradient checkpointing (`model.gradient_checkpointing`): each decoder layer keeps only its input in
the forward pass and recomputes its activations in the backward pass (transformers' own checkpointing,
non-reentrant `torch.utils.checkpoint`).

transformers checkpoints a layer only while `layer.training` is set (and gradients are on). SFT and the
reward model train in train mode; the RLOO policy stays in eval mode (no dropout: it must start at its
reference's exact log-probabilities), so `active(model)` sets the flag on the decoder layers alone for
the gradient pass: their submodules (attention dropout, LoRA dropout) stay in eval mode. A checkpointed
layer drops any KV cache, so that pass runs the plain (unshared-prompt) forward: `batching` chunk_rows=0.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator

import torch

log = logging.getLogger("rloo")


def enable(model: torch.nn.Module, on: bool) -> None:
    """Turn transformers' gradient checkpointing on for `model`'s decoder layers (when `on`)."""
    if not on:
        return
    if not getattr(model, "supports_gradient_checkpointing", False):
        from rloo.errors import InputError

        raise InputError(f"model.gradient_checkpointing: {type(model).__name__} does not support it")
    kwargs = {"use_reentrant": False}  # reentrant checkpointing would need inputs that require grad
    if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5.2x: the new name
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    log.info("gradient checkpointing: %d decoder layers recompute in the backward pass", len(layers(model)))


def layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The decoder layers transformers checkpoints (empty when checkpointing is off)."""
    from transformers.modeling_layers import GradientCheckpointingLayer

    return [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer) and m.gradient_checkpointing]


def on(model: torch.nn.Module) -> bool:
    return bool(layers(model))


@contextlib.contextmanager
def active(model: torch.nn.Module) -> Iterator[None]:
    """Within the block the checkpointed layers of a model in eval mode recompute in the backward pass:
    their own `training` flag is set, not their submodules' (which keep dropout off)."""
    held = [m for m in layers(model) if not m.training]
    for m in held:
        m.training = True
    try:
        yield
    finally:
        for m in held:
            m.training = False
