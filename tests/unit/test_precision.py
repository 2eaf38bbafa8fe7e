"""`model.autocast` / `model.inference_dtype` = auto: bfloat16 only where the device has it natively.

Which answer a machine gives is the hardware's; both outcomes are exercised by setting the probe's
recorded answer for the CPU (rloo.runtime._NATIVE_BF16), as a machine with or without AVX512-BF16
would have it."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from rloo import runtime
from rloo.settings import Config
from rloo_workflow.config import load_config, parse_set
from rloo_workflow.memory_plan import plan
from rloo_workflow.model_shape import Shape

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(params=[True, False], ids=["native-bf16", "emulated-bf16"])
def native(request, monkeypatch) -> bool:
    monkeypatch.setitem(runtime._NATIVE_BF16, "cpu", request.param)
    return request.param


def test_the_probe_reads_this_cpus_bf16_instructions():
    runtime._NATIVE_BF16.pop("cpu", None)
    expected = torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()
    assert runtime.native_bf16("cpu") is expected


def test_auto_is_bfloat16_only_where_native(native):
    assert runtime.resolve_precision("auto", "cpu") == ("bfloat16" if native else None)
    assert runtime.inference_dtype("auto", "cpu") == (torch.bfloat16 if native else None)
    assert runtime.decode_dtype("auto", "float32", "cpu") == ("bfloat16" if native else "float32")
    with runtime.autocast("auto", "cpu"):
        assert torch.is_autocast_enabled("cpu") is native
    with runtime.scoring_precision("auto", "cpu"):
        assert torch.is_autocast_enabled("cpu") is native


def test_explicit_values_are_kept_whatever_the_cpu(native):
    assert runtime.resolve_precision("bfloat16", "cpu") == "bfloat16"
    assert runtime.resolve_precision("none", "cpu") == "none" and runtime.resolve_precision(None, "cpu") is None
    with runtime.autocast("bfloat16", "cpu"):
        assert torch.is_autocast_enabled("cpu") and torch.get_autocast_dtype("cpu") == torch.bfloat16
    with runtime.autocast("none", "cpu"):
        assert not torch.is_autocast_enabled("cpu")
    assert runtime.decode_dtype(None, "float32", "cpu") == "float32"
    assert runtime.decode_dtype("bfloat16", "float32", "cpu") == "bfloat16"


@pytest.mark.parametrize("name", ["config.yaml", "smollm2.yaml"])
def test_the_cpu_configs_ask_for_auto(name):
    """The shipped CPU configs never force bf16 on a CPU that would emulate it."""
    m = load_config(ROOT / "config" / name)["model"]
    assert m["autocast"] == "auto", m
    assert m["inference_dtype"] in (None, "auto"), m


def test_the_memory_plan_takes_the_larger_outcome_of_auto():
    """`rloo plan` runs before the job, on another machine: auto plans for whichever precision needs more."""
    shape = Shape(896, 24, 14, 2, 4864, 151936, True)

    def update(autocast: str) -> float:
        sections = Config.from_config(load_config(ROOT / "config" / "gpu.yaml", parse_set([f"model.autocast={autocast}"])))
        return next(p.total for sp in plan(sections, shape, 80) if sp.stage == "sft" for p in sp.phases if p.name == "update")

    assert update("auto") == max(update("none"), update("bfloat16"))
    assert update("none") != update("bfloat16")
