"""The memory plan (rloo_workflow/memory_plan.py, `rloo plan`): its predictions against measured peaks, its terms
under each strategy, the CLI on every shipped config, and the Snakefile's refusal of a config that does
not fit."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from workflow_helpers import ROOT, make_copy, snakemake

from rloo.errors import UserError
from rloo.runtime import native_bf16
from rloo.settings import Config
from rloo_workflow import cli
from rloo_workflow.config import load_config, parse_set
from rloo_workflow.memory_plan import GB, micro_batch_tokens, plan, update_bytes
from rloo_workflow.model_shape import Shape, model_shape

CONFIGS = sorted(p.name for p in (ROOT / "config").glob("*.yaml"))
QWEN_05B = Shape(896, 24, 14, 2, 4864, 151936, True)

# Shapes measured (none of them the ones the per-layer terms were derived from): Qwen2 with the real
# vocabulary (its logits dominate) and one or two layers; a deeper Llama with a small vocabulary (its
# activations dominate), with bf16 autocast, chunked logits, gradient checkpointing.
CASES = {
    "qwen2 V=151936 1 layer h=256, full logits": (
        "qwen2", Shape(256, 1, 4, 2, 768, 151936, True), 1, 256, {}),
    # (The chunked head's terms were fitted on other shapes: h 192 and 384, chunks 32 and 96.)
    "qwen2 V=151936 2 layers h=256 untied, bf16 autocast, chunk 64": (
        "qwen2", Shape(256, 2, 4, 2, 640, 151936, False), 2, 160, {"autocast": "bfloat16", "chunk": 64}),
    "llama V=2048 6 layers h=256": (
        "llama", Shape(256, 6, 4, 4, 768, 2048, True), 8, 256, {}),
    "llama V=2048 6 layers h=320, gradient checkpointing": (
        "llama", Shape(320, 6, 5, 5, 896, 2048, True), 8, 256, {"checkpointing": True}),
}


def _predicted(shape: Shape, rows: int, tokens: int, opts: dict) -> int:
    return sum(update_bytes(shape, rows * tokens, opts.get("chunk", 0), autocast=opts.get("autocast", "none"),
                            checkpointing=opts.get("checkpointing", False)))


def _cases(device: str) -> dict[str, tuple]:
    """CASES this device can measure: on a CPU that emulates bf16 (no AVX512-BF16 or AMX) the bf16 case
    is left out, since its pass takes minutes there and runs the emulation's kernels, not the ones the
    plan's bf16 terms describe (docs/tuning.md#precision)."""
    if device == "cpu" and not native_bf16("cpu"):
        return {name: case for name, case in CASES.items() if case[4].get("autocast") != "bfloat16"}
    return CASES


def _measure(device: str) -> dict[str, int]:
    cases = _cases(device)
    specs = [{"family": fam, "shape": vars(s), "rows": rows, "tokens": tokens, "device": device, **opts}
             for fam, s, rows, tokens, opts in cases.values()]
    # glibc maps blocks above 64 KiB on their own and unmaps them when freed: the RSS follows the tensors
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536", "PYTHONPATH": str(ROOT)}
    res = subprocess.run([sys.executable, str(ROOT / "tests" / "helpers" / "plan_measure.py"), json.dumps(specs)],
                         env=env, capture_output=True, text=True, timeout=240)
    assert res.returncode == 0, res.stderr[-3000:]
    return dict(zip(cases, json.loads(res.stdout.strip().splitlines()[-1]), strict=True))


def _compare(measured: dict[str, int]) -> None:
    lines, bad = [], []
    for name, meas in measured.items():
        _, shape, rows, tokens, opts = CASES[name]
        pred = _predicted(shape, rows, tokens, opts)
        err = (pred - meas) / meas
        lines.append(f"{name}: predicted {pred / 1e6:.0f} MB, measured {meas / 1e6:.0f} MB ({err:+.1%})")
        if abs(err) > 0.20:
            bad.append(name)
    print("\n".join(lines))
    assert not bad, "\n".join(lines)


@pytest.mark.slow
def test_prediction_within_20_percent_of_the_measured_cpu_peak():
    """One forward + backward of a micro-batch, peak RSS over the RSS before it (tests/helpers/plan_measure.py)."""
    measured = _measure("cpu")
    assert min(measured.values()) > 80e6  # well above the allocator's noise (a few MB)
    _compare(measured)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA: torch.cuda.max_memory_allocated")
def test_prediction_within_20_percent_of_cuda_max_allocated():
    _compare(_measure("cuda"))


def test_micro_batch_tokens_budget_unit_and_whole_step():
    assert micro_batch_tokens(16384, rows=64, row_tokens=1024) == 16384
    assert micro_batch_tokens(0, rows=64, row_tokens=1024) == 64 * 1024  # 0: the whole step
    assert micro_batch_tokens(1000, rows=64, row_tokens=1024) == 1024  # one row longer than the budget
    assert micro_batch_tokens(1000, rows=8, row_tokens=1024, unit_rows=2) == 2048  # a reward pair stays whole
    assert micro_batch_tokens(65536, rows=4, row_tokens=1024) == 4096  # at most the rank's whole step


def _cfg(*sets: str) -> Config:
    return Config.from_config(load_config(ROOT / "config" / "gpu.yaml", parse_set(list(sets)) if sets else None))


def _phase(sections: Config, stage: str, phase: str = "update"):
    return next(p for sp in plan(sections, QWEN_05B, 80) if sp.stage.startswith(stage) for p in sp.phases if p.name == phase)


def test_model_state_terms_follow_the_code():
    P = QWEN_05B.parameters()
    assert abs(P - 494e6) < 1e6  # Qwen2.5-0.5B's published count
    rm = QWEN_05B.reward_model_parameters()
    fp32 = _cfg("rollout.backend=hf")
    # policy 16 B per parameter, reference and reward model whole in float32
    assert _phase(fp32, "rloo").state == pytest.approx(16 * P + 4 * P + 4 * rm)
    # FSDP x8 shards the policy's weights, gradients and moments, not the reference or the reward model;
    # the root and two layers come gathered during the update
    fsdp = Config.from_config(load_config([ROOT / "config" / "gpu.yaml", ROOT / "config" / "fsdp-1x8.yaml"]))
    gathered = (QWEN_05B.root_params() + 2 * QWEN_05B.layer_params()) * 4 * 7 / 8
    assert _phase(fsdp, "rloo").state == pytest.approx(16 * P / 8 + 4 * P + 4 * rm + gathered)
    # LoRA: no reference copy, the base frozen, AdamW on the adapters alone
    lora = _cfg("rollout.backend=hf", "model.lora.enabled=true", "model.lora.r=16")
    adapters = QWEN_05B.lora_parameters(16, "all-linear")
    assert 0.005 < adapters / P < 0.02
    assert _phase(lora, "rloo").state == pytest.approx(4 * P + 16 * adapters + 4 * rm)
    # PPO's critic: a second trained network
    ppo = _cfg("rollout.backend=hf", "rloo.estimator=ppo")
    assert _phase(ppo, "rloo").state == pytest.approx(_phase(fp32, "rloo").state + 16 * P)
    # evaluate: the SFT reference, one policy and the reward model, frozen
    assert _phase(fp32, "evaluate", "sampling").state == pytest.approx(8 * P + 4 * rm)


def test_transient_terms_follow_their_keys():
    base = _cfg()
    up = _phase(base, "rloo")
    assert up.vllm == pytest.approx(0.3 * 80 * GB)  # rollout.gpu_memory_utilization x the GPU
    half = _phase(_cfg("rloo.micro_batch_tokens=8192"), "rloo")
    assert half.activations < 0.55 * up.activations
    assert _phase(_cfg("model.gradient_checkpointing=true"), "rloo").activations < 0.2 * up.activations
    full = _phase(_cfg("model.logits_chunk_tokens=0"), "rloo")
    assert full.logits == pytest.approx(3 * 16384 * QWEN_05B.vocab_size * 4)
    assert _phase(_cfg("rollout.backend=hf"), "rloo").vllm == 0
    assert _phase(base, "reward").logits == 0  # a score head, no vocabulary


@pytest.mark.parametrize("name", CONFIGS)
def test_plan_runs_on_every_shipped_config(name, capsys):
    """CI: every config plans (those without plan.gpu_memory_gb print the table only)."""
    assert cli.main(["plan", "-c", str(ROOT / "config" / name)]) == 0
    out = capsys.readouterr().out
    for stage in ("sft", "reward", "rloo", "evaluate"):
        assert f"\n{stage}" in out, out


def test_gpu_config_fits_80_gb_not_16(capsys):
    gpu = str(ROOT / "config" / "gpu.yaml")
    assert load_config(gpu)["plan"]["gpu_memory_gb"] == 80
    assert cli.main(["plan", "-c", gpu, "--gpu-memory-gb", "80"]) == 0
    capsys.readouterr()
    assert cli.main(["plan", "-c", gpu, "--gpu-memory-gb", "16"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("rloo plan: sft needs") and "lower sft.micro_batch_tokens" in err[0], err


def test_a_gpu_smaller_than_the_margin_is_refused_in_one_line_naming_the_key(capsys):
    """1 GB less the margin (1 GB + 10 %) is negative: one line naming the key, not "-0.1 GB usable"."""
    gpu = str(ROOT / "config" / "gpu.yaml")
    assert cli.main(["plan", "-c", gpu, "--gpu-memory-gb", "1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "plan.gpu_memory_gb" in err[0] and "-0." not in err[0], err


def test_a_hub_model_without_config_json_or_shape_names_model_shape(tmp_path):
    sections = _cfg("model.name_or_path=nobody/not-cached-anywhere", "model.shape=null")
    with pytest.raises(UserError, match=r"model\.shape"):
        model_shape(sections.model)
    # no config.json anywhere: model.shape, gpu.yaml's Qwen2.5-0.5B
    assert model_shape(_cfg("model.name_or_path=nobody/not-cached-anywhere").model) == (QWEN_05B, "model.shape")
    # a folder's config.json wins over model.shape
    (tmp_path / "config.json").write_text(json.dumps({
        "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "intermediate_size": 128, "vocab_size": 1000, "tie_word_embeddings": False}))
    shape, source = model_shape(_cfg(f"model.name_or_path={tmp_path}").model)
    assert shape == Shape(64, 2, 4, 2, 128, 1000, False) and source == f"{tmp_path} config.json"


@pytest.mark.slow
def test_snakefile_refuses_to_plan_a_config_that_does_not_fit(tmp_path):
    copy = make_copy(tmp_path / "workflow")
    ok = snakemake(copy, "-n", "--quiet", "rules", "--configfile", "config/gpu.yaml", check=False)
    assert ok.returncode == 0, ok.stderr[-3000:]
    res = snakemake(copy, "-n", "--quiet", "rules", "--configfile", "config/gpu.yaml",
                    "--config", "plan={gpu_memory_gb: 16}", check=False)
    assert res.returncode != 0
    lines = [line for line in (res.stdout + res.stderr).splitlines() if line.startswith("memory plan")]
    assert len(lines) == 1 and "sft needs" in lines[0] and "sft.micro_batch_tokens" in lines[0], res.stderr[-3000:]
    assert not Path(copy / "results").exists()
