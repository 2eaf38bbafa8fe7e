"""LoRA (`model.lora`, rloo/model/lora.py) and gradient checkpointing (`model.gradient_checkpointing`,
rloo/model/grad_checkpointing.py) on the micro config, single process (2-process FSDP: tests/e2e/test_distributed.py).

LoRA: only the adapters train (the base weights stay bit for bit), the RLOO reference is the base
model (adapters off, no second copy), the merged output loads with `from_pretrained` and computes what
the adapted model computed, the lean sampler applies the adapters, a run killed with SIGKILL resumes bit
for bit from adapter-only checkpoints, and SFT and the reward model train adapters too.
Gradient checkpointing: the layers really recompute in the backward pass (forward calls counted) and
the gradients equal the stored-activation ones.
"""

import copy
import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from model_helpers import LengthReward
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

from rloo.errors import InputError
from rloo.io import read_jsonl
from rloo.model import checkpoint, lora, models
from rloo.model.logprobs import completion_logprobs, join
from rloo.rollout import generate
from rloo.runtime import step_generator
from rloo.settings import ModelConfig
from rloo.train.rloo_trainer import RlooTrainer
from rloo_workflow.stages import reward, sft

ROOT = Path(__file__).resolve().parents[2]
STEPS = 3


def _cfg(micro_run, lora_on: bool = True, gc: bool = False, **rloo) -> dict:
    cfg = json.loads(json.dumps(micro_run["cfg"]))
    cfg["reward"]["source"] = "verifier"  # the trainers below get LengthReward (spread on the micro policy)
    cfg["model"]["lora"]["enabled"] = lora_on
    cfg["model"]["gradient_checkpointing"] = gc
    # A rate at which 3 steps move the adapters well clear of float noise.
    cfg["rloo"].update({"lr": 1e-3, "warmup_steps": 0, "k": 2, "prompts_per_step": 4, **rloo})
    return cfg


def _rows(micro_run) -> list[dict]:
    return [r for _, r in read_jsonl(micro_run["data"] / "train.jsonl")]


def _batch(trainer, step: int = 0):
    ro = trainer.collect(step).rollout
    return join(ro.prompt_ids, ro.prompt_mask, ro.completions, ro.completion_mask)


@pytest.fixture(scope="module")
def lora_run(micro_run):
    """A LoRA trainer after 3 RLOO steps, with its parameters before them and the steps' metrics."""
    trainer = RlooTrainer(_cfg(micro_run), micro_run["sft"], LengthReward(), _rows(micro_run))
    before = {k: v.detach().clone() for k, v in trainer.policy.named_parameters()}
    metrics = [trainer.step(s) for s in range(STEPS)]
    return trainer, before, metrics


def test_lora_trains_only_the_adapters(lora_run, micro_run):
    trainer, before, metrics = lora_run
    params = dict(trainer.policy.named_parameters())
    adapters = {k for k in params if ".lora_" in k}
    held = {id(p) for group in trainer.optimizer.param_groups for p in group["params"]}
    assert adapters and held == {id(params[k]) for k in adapters}  # the optimizer holds the adapters only
    base = {k for k in params if k not in adapters}
    assert all(torch.equal(params[k], before[k]) for k in base)  # the base weights, bit for bit
    sft = models.load_causal_lm(micro_run["sft"]).state_dict()
    assert all(torch.equal(params[k].cpu(), sft[k.replace(".base_layer", "")]) for k in base)
    moved = max(float((params[k].detach() - before[k]).abs().max()) for k in adapters if ".lora_B." in k)
    assert moved > 1e-4, moved
    # No second copy for the reference, and it starts exactly at the policy (B = 0).
    assert trainer.reference is None and "reference" not in trainer.networks()
    assert metrics[0]["train/kl"] == 0.0 and metrics[-1]["train/kl"] != 0.0


def test_the_reference_is_the_base_model(lora_run, micro_run):
    """After the adapters moved, the reference's log-probabilities are the SFT model's (adapters off), and
    the policy's are not."""
    trainer, _, _ = lora_run
    batch = _batch(trainer, STEPS)
    sft_model = models.load_causal_lm(micro_run["sft"], trainable=True, device=str(batch.input_ids.device))
    with torch.no_grad():
        want = completion_logprobs(sft_model, batch)
        with trainer.reference_model() as reference:
            got = completion_logprobs(reference, batch)
        policy = completion_logprobs(trainer.policy, batch)
    mask = batch.completion_mask.bool()
    assert float((got - want)[mask].abs().max()) < 1e-5
    assert float((policy - want)[mask].abs().max()) > 1e-4
    assert all(p.requires_grad for k, p in trainer.policy.named_parameters() if ".lora_" in k)  # back on after


def test_the_merged_output_loads_and_computes_the_adapted_model(lora_run, tmp_path):
    trainer, _, _ = lora_run
    batch = _batch(trainer, STEPS)
    with torch.no_grad():
        adapted = trainer.policy(input_ids=batch.input_ids, attention_mask=batch.attention_mask,
                                 position_ids=batch.position_ids).logits
        adapted_copy = copy.deepcopy(trainer.adapted)  # merging is in place: the fixture's trainer stays adapted
        models.save_pretrained(lora.whole(adapted_copy, adapted_copy.model), trainer.tokenizer, tmp_path)
        loaded = AutoModelForCausalLM.from_pretrained(tmp_path).to(batch.input_ids.device)
        assert not any("lora" in k or "base_layer" in k for k in loaded.state_dict())
        logits = loaded(input_ids=batch.input_ids, attention_mask=batch.attention_mask,
                        position_ids=batch.position_ids).logits
    assert float((logits - adapted).abs().max()) < 1e-4


def test_lean_sampling_applies_the_adapters(micro_run):
    """The lean decode loop reads W + (alpha / r) B A: it samples what HF's loop samples from the
    adapted model, and not what the base model samples."""
    cfg = _cfg(micro_run)
    tok = models.load_tokenizer(micro_run["sft"])
    model, adapted = models.for_training(models.load_causal_lm(micro_run["sft"], trainable=True),
                                         ModelConfig.from_config(cfg["model"]))
    torch.manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".lora_B." in name:
                p.normal_(0, 0.5)  # adapters far from zero
    prompts = [tok(r["question"])["input_ids"][:20] for r in _rows(micro_run)[:4] for _ in range(2)]
    kw = {"max_new_tokens": 16, "eos_id": tok.eos_token_id, "pad_id": tok.pad_token_id}
    lean = generate(model, prompts, generator=step_generator(0, 1), lean=True, **kw)
    hf = generate(model, prompts, generator=step_generator(0, 1), lean=False, **kw)
    assert torch.equal(lean.completions, hf.completions)
    with adapted.adapters_off() as frozen:
        plain = generate(frozen, prompts, generator=step_generator(0, 1), lean=True, **kw)
    assert not torch.equal(plain.completions, lean.completions)


def test_lora_with_vllm_rollouts_is_refused(micro_run):
    cfg = _cfg(micro_run)
    cfg["rollout"]["backend"] = "vllm"
    with pytest.raises(InputError, match=r"model\.lora with rollout\.backend=vllm"):
        RlooTrainer(cfg, micro_run["sft"], LengthReward(), _rows(micro_run))


def test_ppo_with_lora_keeps_a_full_critic_and_the_adapters_off_reference(micro_run):
    """PPO: the policy trains adapters, its reference is the adapters-off policy (KL 0 at step 0, then
    not), its old log-probabilities are the adapted policy's (the first update's ratio is 1), and the
    critic stays a full network."""
    from rloo.train.ppo import PPOTrainer

    cfg = _cfg(micro_run, estimator="ppo")
    cfg["rloo"]["ppo"].update({"epochs": 1, "minibatches": 1})
    trainer = PPOTrainer(cfg, micro_run["sft"], LengthReward(), _rows(micro_run), micro_run["sft"])
    assert all(p.requires_grad for p in trainer.critic.parameters())
    assert not any("lora" in k for k in trainer.critic.state_dict())
    first, second = trainer.step(0), trainer.step(1)
    assert first["train/kl"] == 0.0 and second["train/kl"] != 0.0
    assert second["ppo/approx_kl"] == 0.0 and second["ppo/policy_clip_frac"] == 0.0


# -- gradient checkpointing --------------------------------------------------------------------------
def _forward_calls(model) -> list[int]:
    """A counter of the MLP forward calls of every decoder layer (a recomputed layer runs its MLP again;
    counted in `forward` itself: module hooks do not run in transformers' recompute)."""
    calls = [0]
    for layer in model.model.layers:
        def counted(*args, _forward=layer.mlp.forward, **kwargs):
            calls[0] += 1
            return _forward(*args, **kwargs)

        layer.mlp.forward = counted
    return calls


@pytest.mark.parametrize("lora_on", [False, True])
def test_gradient_checkpointing_recomputes_and_gives_the_same_gradients(micro_run, lora_on):
    """The policy's gradient pass with `model.gradient_checkpointing`: each layer runs forward twice
    (once more in the backward pass) although the policy is in eval mode, and the gradients equal the
    stored-activation ones."""
    grads, calls = {}, {}
    for gc in (False, True):
        torch.manual_seed(0)  # the adapters' A starts random: the same A in both
        trainer = RlooTrainer(_cfg(micro_run, lora_on, gc), micro_run["sft"], LengthReward(), _rows(micro_run))
        batch = _batch(trainer)
        counter = _forward_calls(trainer.policy)
        lp, _ = trainer._policy_pass(batch, torch.arange(len(batch.completion_mask)))
        in_forward = counter[0]
        (-(lp * batch.completion_mask).sum()).backward()
        calls[gc] = counter[0] - in_forward  # layers run again in the backward pass
        grads[gc] = {k: p.grad.clone() for k, p in trainer.policy.named_parameters() if p.grad is not None}
        assert not trainer.policy.training  # eval mode throughout (no dropout)
    assert calls == {False: 0, True: len(trainer.policy.model.layers)}
    assert grads[False].keys() == grads[True].keys() and grads[True]
    scale = max(float(g.abs().max()) for g in grads[False].values())
    assert max(float((grads[True][k] - g).abs().max()) for k, g in grads[False].items()) < 1e-5 * scale


# -- whole stages --------------------------------------------------------------------------------------
def _stage_cfg(micro_run, **model) -> dict:
    cfg = json.loads(json.dumps(micro_run["cfg"]))
    cfg["model"]["lora"]["enabled"] = True
    cfg["model"].update(model)
    return cfg


def _load_exactly(auto_cls, folder: Path) -> dict[str, torch.Tensor]:
    """The weights of a saved model loaded by `from_pretrained`, which must find every weight it expects
    and no other (an unmerged LoRA model would leave `...weight` missing and `base_layer` unexpected)."""
    model, info = auto_cls.from_pretrained(folder, output_loading_info=True)
    assert not any(info.get(k) for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    return model.state_dict()


def test_sft_with_lora_writes_a_merged_model(micro_run, tmp_path):
    """SFT with LoRA (and checkpointing): the output is a plain model whose adapted projections moved
    and whose other weights (embeddings, norms) are the starting model's, bit for bit; peak memory is
    recorded."""
    metrics = sft.run(_stage_cfg(micro_run, gradient_checkpointing=True), micro_run["data"], micro_run["base_model"],
                      tmp_path / "out", tmp_path / "work")
    out = _load_exactly(AutoModelForCausalLM, tmp_path / "out")
    init = models.load_causal_lm(micro_run["base_model"]).state_dict()
    assert out.keys() == init.keys()
    adapted = {k for k in init if k.endswith("proj.weight")}
    assert adapted and all(float((out[k] - init[k]).abs().max()) > 1e-4 for k in adapted)
    assert all(torch.equal(out[k], init[k]) for k in init if k not in adapted)
    assert metrics["peak_memory_mb"] > 0
    # The optimizer held the adapters alone (its saved state names one tensor per adapter matrix).
    ckpt = checkpoint.latest(tmp_path / "work" / "checkpoints")
    held = torch.load(ckpt / "optimizer.pt", weights_only=True)["optimizer"]["param_groups"][0]["params"]
    assert len(held) == 2 * len(adapted)  # A and B of each adapted projection
    assert json.loads((tmp_path / "work" / "timings.json").read_text())["peak_memory_mb"] > 0


def test_reward_model_with_lora_writes_a_merged_model(micro_run, tmp_path):
    """The reward stage with LoRA: adapters on the backbone, the new score head trained whole, merged."""
    reward.run(_stage_cfg(micro_run), micro_run["data"], micro_run["sft"], tmp_path / "out", tmp_path / "work")
    out = _load_exactly(AutoModelForSequenceClassification, tmp_path / "out")
    start = models.load_reward_model(micro_run["sft"], trained=False).state_dict()  # a fresh head: a different init
    sft_weights = models.load_causal_lm(micro_run["sft"]).state_dict()
    assert all(torch.equal(out[k], sft_weights[k]) for k in out if "norm" in k or "embed" in k)
    assert float((out["model.layers.0.self_attn.q_proj.weight"]
                  - sft_weights["model.layers.0.self_attn.q_proj.weight"]).abs().max()) > 1e-4
    assert out["score.weight"].shape == start["score.weight"].shape


def _train_cmd(micro_run, micro_reward, tmp: Path, steps: int = 12) -> list[str]:
    return [sys.executable, "-m", "rloo_workflow.cli", "train", "-c", str(ROOT / "config" / "micro.yaml"),
            "--set", "reward.source=model", "--reward-model", str(micro_reward), "--set", f"rloo.steps={steps}",
            "--set", "rloo.checkpoint_every=2", "--set", "tracking.enabled=false", "--set", "model.lora.enabled=true",
            "--set", "model.gradient_checkpointing=true", "--set", "rloo.lr=1.0e-3",
            "--data", str(micro_run["data"]), "--policy", str(micro_run["sft"]),
            "--out", str(tmp / "out"), "--work", str(tmp / "work")]


@pytest.mark.slow
def test_lora_run_killed_with_sigkill_resumes_bit_for_bit(micro_run, micro_reward, tmp_path_factory):
    """kill -9 after the first (adapter-only) checkpoint, then the rerun: the merged output is the
    uninterrupted run's, bit for bit."""
    whole = tmp_path_factory.mktemp("lora_whole")
    subprocess.run(_train_cmd(micro_run, micro_reward, whole), check=True, capture_output=True)
    uninterrupted = models.load_causal_lm(whole / "out").state_dict()
    assert json.loads((whole / "work" / "timings.json").read_text())["peak_memory_mb"] > 0

    cut = tmp_path_factory.mktemp("lora_cut")
    proc = subprocess.Popen(_train_cmd(micro_run, micro_reward, cut), stderr=subprocess.DEVNULL)
    deadline = time.time() + 120
    while checkpoint.latest(cut / "work" / "checkpoints") is None:
        assert proc.poll() is None and time.time() < deadline, "no checkpoint before the run ended"
        time.sleep(0.02)
    assert proc.poll() is None, "the run finished before the kill: nothing was tested"
    proc.kill()
    proc.wait()
    assert not (cut / "out").exists()
    ckpt = checkpoint.latest(cut / "work" / "checkpoints")
    from safetensors.torch import load_file

    assert all(".lora_" in k for k in load_file(str(ckpt / "model.safetensors")))  # adapters only
    subprocess.run(_train_cmd(micro_run, micro_reward, cut), check=True, capture_output=True)
    assert json.loads((cut / "work" / "timings.json").read_text())["resumed_from_step"] > 0
    resumed = models.load_causal_lm(cut / "out").state_dict()
    assert all(torch.equal(uninterrupted[k], resumed[k]) for k in uninterrupted)
