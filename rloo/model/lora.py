"""LoRA adapters through peft (`model.lora`): W' = W + (alpha / r) B A on the frozen base weight W.

    adapted = lora.adapt(model, sections.model.lora)   # None when model.lora.enabled is false
    policy = adapted.model                      # the model's own class, LoRA layers injected: train this
    with adapted.adapters_off():                # the frozen weights W alone (RLOO's reference)
        ...
    whole = adapted.merged()                    # plain model, B A merged in: what a stage saves

Only the adapters (and a classifier's new head, which peft keeps whole) require gradients, so the
optimizer holds only them (`trainable`) and a checkpoint stores only them (rloo/model/checkpoint.py).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from rloo.model import distributed
from rloo.settings import LoraConfig, ModelConfig

log = logging.getLogger("rloo")


def enabled(mc: ModelConfig) -> bool:
    return bool(mc.lora.enabled)


def lora_config(lc: LoraConfig, task_type: str):
    """peft's LoraConfig of the `model.lora` settings (task_type CAUSAL_LM, or SEQ_CLS for a reward model)."""
    import peft

    # peft makes a set of a list of module names and leaves a tuple as it is: hand it the config's list
    targets = lc.target_modules if isinstance(lc.target_modules, str) else list(lc.target_modules)
    return peft.LoraConfig(r=lc.r, lora_alpha=lc.alpha, lora_dropout=lc.dropout,
                           target_modules=targets, task_type=task_type, bias="none")


@dataclass
class Adapted:
    """A model with LoRA adapters: `peft` (the PeftModel that manages them) and `model` (the model's own
    class with LoRA layers in place of its linear projections; what the stages run and train)."""

    peft: torch.nn.Module

    @property
    def model(self) -> torch.nn.Module:
        return self.peft.get_base_model()

    @contextlib.contextmanager
    def adapters_off(self) -> Iterator[torch.nn.Module]:
        """`model` with its adapters switched off within the block: exactly the frozen weights it started from."""
        with self.peft.disable_adapter():
            yield self.model

    def merged(self) -> torch.nn.Module | None:
        """The adapted model as a plain one of its class, W + (alpha / r) B A in every adapted weight
        (`merge_and_unload`, in place: call it once training is over). Every rank must call it; under
        FSDP rank 0 merges a gathered copy and the other ranks get None."""
        model = self.model
        if not distributed.sharded(model):
            return self.peft.merge_and_unload().eval()
        from peft import get_peft_model

        state = distributed.model_state(model)  # a collective: every rank
        if not distributed.is_main():
            return None
        copy = get_peft_model(distributed.plain_like(model, state), self.peft.peft_config["default"])
        distributed.load_whole(copy.get_base_model(), state)
        return copy.merge_and_unload().eval()


def adapt(model: torch.nn.Module, lc: LoraConfig, task_type: str = "CAUSAL_LM") -> Adapted | None:
    """`model` (a transformers model, already on its device) with LoRA adapters of `model.lora`; None when
    LoRA is off. The base weights are frozen; the adapters start at B = 0, so the adapted model first
    computes exactly what `model` did."""
    if not lc.enabled:
        return None
    from peft import get_peft_model

    peft_model = get_peft_model(model, lora_config(lc, task_type))
    train, total = (sum(p.numel() for p in model.parameters() if p.requires_grad),
                    sum(p.numel() for p in model.parameters()))
    log.info("LoRA r=%d alpha=%s on %s: %s of %s parameters train", lc.r, lc.alpha, lc.target_modules,
             f"{train:,}", f"{total:,}")
    return Adapted(peft_model)


def trainable(model: torch.nn.Module) -> list[torch.nn.Parameter]:
    """The parameters the optimizer holds: those that require gradients (with LoRA, the adapters)."""
    return [p for p in model.parameters() if p.requires_grad]


def adapter_weight(linear: torch.nn.Module) -> torch.Tensor:
    """The weight a linear layer applies: W, or for a LoRA layer with its adapters on W + (alpha / r) B A."""
    weight = linear.weight
    if getattr(linear, "merged", True) or getattr(linear, "disable_adapters", True):
        return weight  # not a LoRA layer, or B A already merged into W, or switched off
    for name in linear.active_adapters:
        if name in linear.lora_A:
            weight = weight + linear.get_delta_weight(name)
    return weight


def whole(adapted: Adapted | None, model: torch.nn.Module) -> torch.nn.Module | None:
    """The model a stage writes (every rank calls it): merged weights under LoRA, else
    `distributed.whole_model` (the model itself, or under FSDP its gathered copy on rank 0)."""
    return adapted.merged() if adapted is not None else distributed.whole_model(model)
