"""The sampler-trainer mismatch metrics and the rollout correction (rloo/algo/rollout_correction.py,
docs/rollout-correction.md): zero for a sampler that is the trainer, positive for a tempered one, the
corrected estimator closer to the exact gradient on the bandit, a no-op when the two agree, and the HF
sampler's recorded log-probabilities equal to the trainer's recomputation of the same tokens."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
from model_helpers import LengthReward
from test_microbatch import _cfg, _rows

from rloo.algo import bandit, rloo_update
from rloo.algo import rollout_correction as rc
from rloo.algo.losses import policy_loss
from rloo.errors import InputError
from rloo.eval import report
from rloo.model import models
from rloo.rollout import hf
from rloo.train import alarms
from rloo.train.rloo_trainer import RlooTrainer
from rloo_workflow.stages import rloo as rloo_stage

CORRECTIONS = ("token_tis", "sequence_tis", "token_mask", "sequence_mask")


def _tempered(temperature: float, rows: int = 64, width: int = 12, vocab: int = 50, seed: int = 0):
    """Tokens drawn from softmax(logits / temperature), their log-probs under that sampler and under the
    trainer's softmax(logits), and a right-padded completion mask (rows of 1..width tokens)."""
    g = torch.Generator().manual_seed(seed)
    logits = 2.0 * torch.randn(rows, width, vocab, generator=g)
    sampler = torch.log_softmax(logits / temperature, -1)
    tokens = torch.multinomial(sampler.exp().view(-1, vocab), 1, generator=g).view(rows, width)
    lengths = torch.randint(1, width + 1, (rows,), generator=g)
    mask = (torch.arange(width)[None] < lengths[:, None]).float()
    pick = lambda lp: lp.gather(-1, tokens[..., None]).squeeze(-1)  # noqa: E731
    return pick(torch.log_softmax(logits, -1)), pick(sampler), mask, logits


def _metrics(trainer_lp, sampler_lp, mask, cap=2.0) -> dict[str, float]:
    return rc.mismatch_metrics(rc.mismatch_sums(trainer_lp, sampler_lp, mask, cap))


# -- the metrics -----------------------------------------------------------------------------------
def test_the_metrics_are_exactly_zero_for_a_sampler_that_is_the_trainer():
    trainer_lp, _, mask, _ = _tempered(1.0)
    m = _metrics(trainer_lp, trainer_lp.clone(), mask)
    assert m == {"train/mismatch_abs_mean": 0.0, "train/mismatch_abs_max": 0.0, "train/mismatch_k3_token": 0.0,
                 "train/mismatch_k3_seq": 0.0, "train/mismatch_out_of_band": 0.0}


def test_the_metrics_detect_a_tempered_sampler_and_estimate_its_kl():
    trainer_lp, sampler_lp, mask, logits = _tempered(1.2, rows=256)
    m = _metrics(trainer_lp, sampler_lp, mask, cap=1.1)
    assert m["train/mismatch_abs_mean"] > 0.05 and m["train/mismatch_abs_max"] > m["train/mismatch_abs_mean"]
    assert m["train/mismatch_out_of_band"] > 0.1
    # k3 is an unbiased estimate of KL(sampler || trainer): the exact per-position KL, over the same tokens.
    s, t = torch.log_softmax(logits / 1.2, -1), torch.log_softmax(logits, -1)
    exact = ((s.exp() * (s - t)).sum(-1) * mask).sum() / mask.sum()
    assert m["train/mismatch_k3_token"] == pytest.approx(float(exact), rel=0.15)
    per_seq = m["train/mismatch_k3_seq"] / m["train/mismatch_k3_token"]  # a sum over tokens: x mean length
    assert per_seq == pytest.approx(float(mask.sum() / len(mask)))


def test_padding_and_missing_sampler_logprobs_are_left_out():
    trainer_lp, sampler_lp, mask, _ = _tempered(1.2)
    want = _metrics(trainer_lp, sampler_lp, mask)
    garbage = torch.where(mask.bool(), sampler_lp, torch.full_like(sampler_lp, -50.0))
    assert _metrics(torch.where(mask.bool(), trainer_lp, 7.0), garbage, mask) == want
    # vLLM writes NaN where it returned no log-probability: such a token counts nowhere
    nan_row = sampler_lp.clone()
    nan_row[0] = math.nan
    sums = rc.mismatch_sums(trainer_lp, nan_row, mask, 2.0)
    assert sums.tokens == float(mask.sum() - mask[0].sum()) and math.isfinite(sums.k3_sum)


# -- the weights -----------------------------------------------------------------------------------
@pytest.mark.parametrize("mode", CORRECTIONS)
def test_the_correction_is_a_no_op_when_sampler_and_trainer_agree(mode):
    trainer_lp, _, mask, _ = _tempered(1.0)
    c = rc.correction_weights(trainer_lp, trainer_lp.clone(), mask, mode, cap=2.0)
    assert torch.equal(c.weights, torch.ones_like(trainer_lp))
    assert c.truncated_share == 0.0 and c.masked_share == 0.0
    adv = torch.randn(len(mask), generator=torch.Generator().manual_seed(1))
    for old in (None, trainer_lp + 0.1):  # REINFORCE and the ratio-clipped form
        lp = [trainer_lp.clone().requires_grad_() for _ in range(2)]
        plain, _ = policy_loss(lp[0], mask, adv, norm="token", old_token_logp=old)
        weighted, _ = policy_loss(lp[1], mask, adv, norm="token", old_token_logp=old, weights=c.weights)
        plain.backward()
        weighted.backward()
        assert torch.equal(plain, weighted) and torch.equal(lp[0].grad, lp[1].grad)


def test_token_tis_weights_are_capped_constants():
    trainer_lp = torch.tensor([[0.0, -0.5, -3.0, -1.0]], requires_grad=True)
    sampler_lp = torch.tensor([[-2.0, -0.5, -1.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0]])
    c = rc.correction_weights(trainer_lp, sampler_lp, mask, "token_tis", cap=2.0)
    # r = e^2 (truncated to C = 2), 1, e^-2; the padding token keeps weight 1
    torch.testing.assert_close(c.weights, torch.tensor([[2.0, 1.0, math.exp(-2.0), 1.0]]))
    assert c.truncated_share == pytest.approx(1 / 3) and c.masked_share == 0.0
    assert not c.weights.requires_grad  # a constant: the loss's gradient is w_t A_t ∇log π, nothing more
    adv = torch.tensor([1.5])
    loss, _ = policy_loss(trainer_lp, mask, adv, weights=c.weights)
    (grad,) = torch.autograd.grad(loss, trainer_lp)
    torch.testing.assert_close(grad, -adv * c.weights * mask)


def test_sequence_modes_read_the_whole_sequence():
    trainer_lp = torch.tensor([[0.0, 0.0, 0.0], [0.0, 0.0, 0.0]])
    sampler_lp = torch.tensor([[-0.5, -0.5, 0.0], [-0.2, 0.9, -0.1]])  # row 0: Σ Δ = 1 over 2 tokens
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
    tis = rc.correction_weights(trainer_lp, sampler_lp, mask, "sequence_tis", cap=2.0)
    torch.testing.assert_close(tis.weights, torch.tensor([[2.0, 2.0, 1.0], [math.exp(-0.6)] * 3]))  # e^1 > C
    assert tis.truncated_share == pytest.approx(2 / 5)
    # geometric mean: row 0 exp(0.5) = 1.65, row 1 exp(-0.2): both in [1/1.7, 1.7]; a cap of 1.3 drops row 0
    assert rc.correction_weights(trainer_lp, sampler_lp, mask, "sequence_mask", 1.7).masked_share == 0.0
    masked = rc.correction_weights(trainer_lp, sampler_lp, mask, "sequence_mask", cap=1.3)
    torch.testing.assert_close(masked.weights, torch.tensor([[0.0, 0.0, 1.0], [1.0, 1.0, 1.0]]))
    assert masked.masked_share == pytest.approx(2 / 5) and masked.truncated_share == 0.0
    token = rc.correction_weights(trainer_lp, sampler_lp, mask, "token_mask", cap=2.5)
    assert token.masked_share == 0.0  # every token within [1/2.5, 2.5]: |Δ| <= 0.9 < log 2.5
    token = rc.correction_weights(trainer_lp, sampler_lp, mask, "token_mask", cap=1.5)  # |Δ| > 0.405
    torch.testing.assert_close(token.weights, torch.tensor([[0.0, 0.0, 1.0], [1.0, 0.0, 1.0]]))


def test_the_bandits_corrected_gradient_is_closer_to_the_exact_one_under_a_tempered_sampler():
    b = bandit.make_bandit(0)
    true = bandit.exact_gradient(b.logits, b.q)
    bias = {}
    for mode in ("none", "token_tis"):
        # the same draws for both (common random numbers): only the weights differ
        g = bandit.off_policy_estimates(b, b.logits / 1.2, 4, 50_000, np.random.default_rng([0, 3]), mode, cap=2.0)
        bias[mode] = float(np.linalg.norm(g.mean(0) - true))
    assert bias["token_tis"] < 0.5 * bias["none"], bias
    # on-policy the weights are 1: the corrected estimates are the plain ones
    on = [bandit.off_policy_estimates(b, b.logits, 4, 1000, np.random.default_rng(5), m) for m in ("none", "token_tis")]
    np.testing.assert_array_equal(on[0], on[1])


# -- the HF sampler's own log-probabilities, and the trainer --------------------------------------
def _trainer_logprobs(model, ro, temperature: float) -> torch.Tensor:
    """log softmax(logits / T) of the rollout's tokens, from one plain forward pass over prompt + completion."""
    ids = torch.cat([ro.prompt_ids, ro.completions], 1)
    att = torch.cat([ro.prompt_mask, ro.completion_mask.long()], 1)
    with torch.no_grad():
        out = model(input_ids=ids, attention_mask=att, position_ids=(att.cumsum(1) - 1).clamp(min=0)).logits
    logits = out[:, ro.prompt_ids.shape[1] - 1 : -1].float() / temperature
    return torch.log_softmax(logits, -1).gather(-1, ro.completions[..., None]).squeeze(-1)


@pytest.mark.parametrize("lean", [True, False], ids=["lean-loop", "hf-loop"])
def test_the_hf_samplers_logprobs_are_the_trainers_of_the_same_tokens(micro_run, lean):
    tok = models.load_tokenizer(micro_run["sft"])
    model = models.load_causal_lm(micro_run["sft"], dtype="float32")
    prompts = [tok("Question: Ava has 12 apples and eats 3.")["input_ids"], tok("Question: 2 + 5?")["input_ids"]] * 3
    for temperature in (1.0, 1.3):  # at 1.3: the tempered distribution it sampled from, not the model's
        ro = hf.generate(model, prompts, max_new_tokens=8, eos_id=tok.eos_token_id, pad_id=tok.pad_token_id,
                         temperature=temperature, generator=torch.Generator().manual_seed(0), lean=lean)
        m = ro.completion_mask
        assert ro.logprobs is not None and ro.logprobs.shape == m.shape and bool(m.any())
        want = _trainer_logprobs(model, ro, temperature)
        assert float((ro.logprobs - want).abs()[m].max()) < 1e-5, temperature
        assert torch.equal(ro.logprobs[~m], torch.zeros_like(ro.logprobs[~m]))  # padding: 0
    with torch.no_grad():  # the helper at T = 1 is the method's reference pass
        plain = rloo_update.token_logprobs(model, ro.prompt_ids, ro.prompt_mask, ro.completions, m)
    torch.testing.assert_close(_trainer_logprobs(model, ro, 1.0)[m], plain[m])


def test_the_trainer_logs_the_mismatch_and_its_default_applies_nothing(micro_run):
    cfg = _cfg(micro_run, temperature=1.0)
    trainer = RlooTrainer(cfg, micro_run["sft"], LengthReward(), _rows(micro_run))
    got = trainer.collect(0)
    rows = trainer._step_rows(got.rollout)
    trainer._policy_logprobs(rows)
    c = trainer.correction(rows.rollout, rows.old_lp, rows.mask)
    assert c.weights is None  # mode none: the loss is the one without a correction
    assert c.metrics["train/mismatch_abs_max"] < 1e-5 and c.metrics["train/mismatch_out_of_band"] == 0.0
    metrics = trainer.update(0, got)
    assert {"train/mismatch_abs_mean", "train/mismatch_k3_seq"} <= metrics.keys()
    assert "train/correction_truncated_share" not in metrics


def test_a_correction_without_sampler_logprobs_is_an_error(micro_run):
    cfg = _cfg(micro_run, rollout_correction={"mode": "token_tis", "cap": 2.0})
    trainer = RlooTrainer(cfg, micro_run["sft"], LengthReward(), _rows(micro_run))
    got = trainer.collect(0)
    got.rollout.logprobs = None  # a sampler that reports none
    with pytest.raises(InputError, match="rollout_correction"):
        trainer.update(0, got)


@pytest.mark.parametrize("estimator", ["rloo", "ppo"])
def test_a_tools_forced_tokens_are_out_of_the_weights_their_shares_and_the_mismatch(micro_run, estimator):
    """With the calculator, the trainer's rows (RLOO's and PPO's) hand the correction the policy's tokens:
    a forced token's sampler log-probability (0: the sampler sampled none) moves no weight, no truncated or
    masked share and no mismatch figure, synchronous or off-policy (the lag's figures too); a policy
    token's moves them."""
    import dataclasses

    from test_tool_rollout import _first_forced_run, _step_with_a_call, _tools_cfg

    from rloo.train.correction import step_correction
    from rloo.train.ppo import PPOTrainer

    cfg = _tools_cfg(micro_run, estimator=estimator, rollout_correction={"mode": "token_tis", "cap": 2.0})
    if estimator == "ppo":
        trainer = PPOTrainer(cfg, micro_run["sft"], LengthReward(), _rows(micro_run), micro_run["sft"])
    else:
        trainer = RlooTrainer(cfg, micro_run["sft"], LengthReward(), _rows(micro_run))
    step, got = _step_with_a_call(trainer)
    if estimator == "ppo":
        rows = trainer._ppo_rows(step, got.rollout)
    else:
        rows = trainer._step_rows(got.rollout)
        trainer._policy_logprobs(rows)
    ro, old_lp = rows.rollout, rows.old_lp
    row, start, end = _first_forced_run(ro)
    assert bool((ro.logprobs[row, start:end] == 0).all())  # what the sampler reports of a forced token

    def corrections(sampler_lp: torch.Tensor, lagged_lp: torch.Tensor) -> list[tuple[torch.Tensor, dict]]:
        out = []
        changed = dataclasses.replace(ro, logprobs=sampler_lp)
        for mode in CORRECTIONS:
            settings = dataclasses.replace(trainer.correction_settings, mode=mode)
            trainer.correction_settings = settings
            c = trainer.correction(changed, old_lp, rows.mask)
            lag = step_correction(changed, old_lp, rows.mask, settings, "hf", off_policy=True, lagged_lp=lagged_lp)
            out.append((torch.where(ro.loss_mask, c.weights, 0.0), {**c.metrics, **lag.metrics}))
        return out

    lagged = old_lp - 0.3  # an off-policy run's trainer log-probabilities under the weights that sampled
    base = corrections(ro.logprobs, lagged)
    assert "train/lag_abs_mean" in base[0][1] and "train/correction_truncated_share" in base[0][1]

    def perturbed(t: int) -> list[tuple[torch.Tensor, dict]]:
        sampler_lp, lag = ro.logprobs.clone(), lagged.clone()
        sampler_lp[row, t] -= 3.0
        lag[row, t] += 3.0
        return corrections(sampler_lp, lag)

    for (w, m), (w0, m0) in zip(perturbed(end - 1), base, strict=True):  # a forced token
        assert torch.equal(w, w0) and m == m0
    for mode, (w, m), (w0, m0) in zip(CORRECTIONS, perturbed(start - 1), base, strict=True):  # the policy's token
        # (sequence_mask: the sequence's mean log-ratio moves by 3 / its length, inside the band: no weight moves)
        assert torch.equal(w, w0) == (mode == "sequence_mask"), mode
        assert all(m[k] != m0[k] for k in ("train/mismatch_abs_mean", "train/offpolicy_abs_mean", "train/lag_abs_mean"))


# -- the sampling_mismatch alarm (rloo/train/alarms.py), on the whole stage -----------------------
@pytest.mark.parametrize(
    ("temperature", "autocast", "fires"),
    [(1.0, "none", False), (1.0, "bfloat16", False), (1.2, "none", True)],
    ids=["trainers-own-float32", "trainers-own-bf16-autocast", "tempered-1.2"],
)
def test_the_sampling_mismatch_alarm_fires_on_a_tempered_sampler_only(micro_run, tmp_path, temperature, autocast,
                                                                      fires):
    """The real sampler and trainer through the RLOO stage: sampling from the trainer's own distribution
    (float32: |Δ log p| ~ 1e-7; under the default's bf16 autocast: ~ 2e-3, per-token KL ~ 2e-6 on this
    model, the precision the alarm must tolerate) it stays silent; a sampler at T = 1.2 against the trainer's T = 1 fires it at the first step
    its window allows, and `stop_on` ends the run there."""
    window, steps = 6, 9
    cfg = json.loads(json.dumps(micro_run["cfg"]))
    cfg["reward"]["source"] = "verifier"
    cfg["model"]["autocast"] = autocast
    cfg["rloo"].update({"steps": steps, "eval_every": 0, "select": "last", "temperature": temperature,
                        "stop_on": ["sampling_mismatch"], "alarms": {"window": window}})
    summary = rloo_stage.run(cfg, micro_run["data"], micro_run["sft"], tmp_path / "out", tmp_path / "work")
    history = [json.loads(line) for line in (tmp_path / "out" / "steps.jsonl").read_text().splitlines()]
    kl = [h["train/mismatch_k3_token"] for h in history]
    flags = [h["alarm/sampling_mismatch"] for h in history]
    threshold = alarms.AlarmConfig.from_config(cfg["rloo"]["alarms"]).mismatch_kl
    lines = [x for x in report.rloo_lines(summary) if "sampling_mismatch" in x]
    if fires:
        assert min(kl) > 3 * threshold, kl  # the case is far beyond the threshold, not on its edge
        assert summary["alarms"]["sampling_mismatch"] == window and flags == [0] * (window - 1) + [1]
        assert summary["stopped_early"] == {"step": window, "alarm": "sampling_mismatch"}
        assert lines == [f"!! rloo: stopped early after {window} steps: alarm/sampling_mismatch (rloo.stop_on)",
                         f"!! rloo: alarm/sampling_mismatch fired at step {window} (docs/failure-modes.md)"]
    else:
        assert max(kl) < threshold / 10, kl
        assert summary["alarms"]["sampling_mismatch"] is None and flags == [0] * steps
        assert summary["stopped_early"] is None and lines == []
