"""Micro-batches (rloo/model/microbatch.py): a step's gradient is the same whether its rows go through one
pass or through micro-batches under a token budget, in every stage that trains (rloo, ppo, sft, reward).

A step is taken twice from the same weights on the same samples: once with the budget 0 (one pass,
today's path) and once with a budget that splits the step into several micro-batches (groups split
across them, duplicated rows read from one distinct row); the gradients the optimizer receives agree
to float tolerance (the micro-batches are other matrix shapes, hence other roundings).
"""

from __future__ import annotations

import json

import pytest
import torch
from model_helpers import LengthReward

from rloo.io import read_jsonl
from rloo.model import microbatch, models
from rloo.model.logprobs import join
from rloo.settings import ModelConfig
from rloo.train.ppo import PPOTrainer
from rloo.train.rloo_trainer import RlooTrainer

# Float32 (no autocast) gradients of one pass against several: measured max |diff| ~1e-7 on the
# micro policy, against gradient entries of ~1e-2; a wrong weighting (a micro-batch normalised by its
# own rows or tokens, a copy's loss dropped) moves them by 1e-3 or more.
ATOL, RTOL = 2e-6, 1e-4


def test_pack_keeps_every_row_once_under_the_budget():
    lengths = [5, 40, 12, 40, 7, 33, 2, 90]
    parts = microbatch.pack(lengths, 100)
    assert sorted(int(i) for p in parts for i in p) == list(range(len(lengths)))
    for p in parts:
        longest = max(lengths[int(i)] for i in p)
        assert len(p) * longest <= 100 or len(p) == 1  # a row alone may exceed it
    assert len(parts) > 1
    assert [list(p) for p in microbatch.pack(lengths, 0)] == [list(range(len(lengths)))]
    assert len(microbatch.pack(lengths, 10_000)) == 1
    assert [len(p) for p in microbatch.pack([300, 1, 1], 100)] == [1, 2]  # too long: alone


def test_copies_finds_every_copy_of_a_micro_batch_rows():
    inverse = torch.tensor([0, 1, 0, 2, 1, 3])
    sel, at = microbatch.copies(inverse, torch.tensor([1, 3]))
    assert sel.tolist() == [1, 4, 5] and at.tolist() == [0, 0, 1]


def _cfg(micro_run, **rloo) -> dict:
    cfg = json.loads(json.dumps(micro_run["cfg"]))
    cfg["model"]["autocast"] = "none"  # float32: the comparison is about weighting, not bf16 rounding
    cfg["reward"]["source"] = "verifier"
    # k = 4 short completions at a low temperature: some completions of a prompt are the same (dedup
    # reads them once), others differ (LengthReward then gives the group a signal).
    cfg["rloo"].update({"lr": 1e-3, "warmup_steps": 0, "k": 4, "prompts_per_step": 4, "temperature": 0.1,
                        "max_new_tokens": 3, "grad_clip": 1e9, **rloo})  # no clipping: it would hide a scale
    return cfg


def _grads_of_step(trainer, step: int = 0) -> tuple[dict[str, torch.Tensor], dict]:
    """The gradients the optimizer's first step receives, and the step's metrics."""
    got: dict[str, torch.Tensor] = {}
    optimizer_step = trainer.optimizer.step

    def capture(*a, **kw):
        if not got:
            got.update({n: p.grad.detach().clone() for n, p in trainer.policy.named_parameters() if p.grad is not None})
        return optimizer_step(*a, **kw)

    trainer.optimizer.step = capture
    metrics = trainer.step(step)
    return got, metrics


def _rows(micro_run) -> list[dict]:
    return [r for _, r in read_jsonl(micro_run["data"] / "train.jsonl")]


def _assert_same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys() and a
    assert max(float(a[n].abs().max()) for n in a) > 1e-4  # a step that moves something
    for n in a:
        torch.testing.assert_close(b[n], a[n], atol=ATOL, rtol=RTOL, msg=lambda m, n=n: f"{n}: {m}")


def _budget_for_parts(trainer, step: int, parts: int) -> int:
    """A budget that splits step `step`'s distinct rows into about `parts` micro-batches."""
    ro = trainer.collect(step).rollout
    batch = join(ro.prompt_ids, ro.prompt_mask, ro.completions, ro.completion_mask)
    first, _ = batch.distinct_rows
    lengths = batch.prompt_len + batch.completion_mask[first].sum(1)
    return int(lengths.max()) * max(1, len(first) // parts)


@pytest.mark.parametrize("norm", ["sequence", "token"])
def test_micro_batched_rloo_step_with_the_calculator_has_the_one_pass_gradient(micro_run, norm):
    """Forced tokens (rloo/rollout/tools.py) are left out of every micro-batch's loss as of the one pass."""
    cfg = _cfg(micro_run, loss_norm=norm, kl_in="loss", temperature=1.0, max_new_tokens=40, prompts_per_step=2)
    cfg["tools"] = {"enabled": [{"name": "calculator", "fn": "rloo.tools.calculator:calculate", "open": "<<",
                                 "end": "=", "close": ">>"}], "max_calls": 8, "max_result_chars": 32}
    whole = RlooTrainer({**cfg, "rloo": {**cfg["rloo"], "micro_batch_tokens": 0}}, micro_run["sft"],
                        LengthReward(), _rows(micro_run))
    step = next(s for s in range(8) if whole.collect(s).rollout.policy_mask is not None)  # a step with a call
    budget = _budget_for_parts(whole, step, 3)
    split = RlooTrainer({**cfg, "rloo": {**cfg["rloo"], "micro_batch_tokens": budget}}, micro_run["sft"],
                        LengthReward(), _rows(micro_run))
    want, m_whole = _grads_of_step(whole, step)
    got, m_split = _grads_of_step(split, step)
    _assert_same(want, got)
    assert m_whole["tool/calls_per_completion"] > 0
    for key in ("train/kl", "train/loss", "train/entropy"):
        assert m_split[key] == pytest.approx(m_whole[key], rel=1e-4, abs=1e-6), key


@pytest.mark.parametrize(("estimator", "split"), [("rloo", "chunked"), ("ppo", "micro"), ("ppo", "chunked")])
def test_a_step_with_the_calculator_has_the_one_pass_gradient_micro_batched_or_chunked(micro_run, estimator, split):
    """With tools, PPO's micro-batches, and the head's log-probabilities in chunks (model.logits_chunk_tokens)
    in either trainer, leave the forced tokens out as the one pass over the whole head does: the same
    gradients (PPO's critic's too) on a step whose samples called the calculator."""
    from test_tool_rollout import _step_with_a_call, _tools_cfg

    cfg = _tools_cfg(micro_run, estimator=estimator, kl_in="loss", loss_norm="token")
    cfg["rloo"]["ppo"] = {**cfg["rloo"]["ppo"], "epochs": 1, "minibatches": 1}
    critic: dict[str, dict[str, torch.Tensor]] = {}

    def trainer(name: str, budget: int = 0, chunk: int = 0):
        c = {**cfg, "rloo": {**cfg["rloo"], "micro_batch_tokens": budget},
             "model": {**cfg["model"], "logits_chunk_tokens": chunk}}
        if estimator == "rloo":
            return RlooTrainer(c, micro_run["sft"], LengthReward(), _rows(micro_run))
        torch.manual_seed(0)  # the critic's new value head: the same initial weights in both
        t = PPOTrainer(c, micro_run["sft"], LengthReward(), _rows(micro_run), micro_run["sft"])
        step = t.critic_optimizer.step

        def capture(*a, **kw):
            critic.setdefault(name, {n: p.grad.detach().clone() for n, p in t.critic.named_parameters()
                                     if p.grad is not None})
            return step(*a, **kw)

        t.critic_optimizer.step = capture
        return t

    whole = trainer("whole")
    step, got = _step_with_a_call(whole)
    assert bool((got.rollout.completion_mask & ~got.rollout.policy_mask).any())
    other = trainer("split", budget=_budget_for_parts(whole, step, 3)) if split == "micro" else trainer("split", chunk=8)
    if split == "micro":
        assert len(other.parts(join(got.rollout.prompt_ids, got.rollout.prompt_mask, got.rollout.completions,
                                    got.rollout.completion_mask))) >= 3
    want, m_whole = _grads_of_step(whole, step)
    have, m_split = _grads_of_step(other, step)
    _assert_same(want, have)
    if estimator == "ppo":
        _assert_same(critic["whole"], critic["split"])
    for key in ("train/kl", "train/loss", "train/entropy"):
        assert m_split[key] == pytest.approx(m_whole[key], rel=1e-4, abs=1e-6), key


@pytest.mark.parametrize("norm", ["sequence", "token"])
@pytest.mark.parametrize("updates", [1, 2])
@pytest.mark.parametrize("kl_in", ["reward", "loss"])
def test_micro_batched_rloo_step_has_the_one_pass_gradient(micro_run, norm, updates, kl_in):
    cfg = _cfg(micro_run, loss_norm=norm, updates_per_batch=updates, kl_in=kl_in)
    whole = RlooTrainer({**cfg, "rloo": {**cfg["rloo"], "micro_batch_tokens": 0}}, micro_run["sft"],
                          LengthReward(), _rows(micro_run))
    budget = _budget_for_parts(whole, 0, 3)
    split = RlooTrainer({**cfg, "rloo": {**cfg["rloo"], "micro_batch_tokens": budget}}, micro_run["sft"],
                          LengthReward(), _rows(micro_run))
    ro = split.collect(0).rollout
    batch = join(ro.prompt_ids, ro.prompt_mask, ro.completions, ro.completion_mask)
    first, inverse = batch.distinct_rows
    parts = split.parts(batch.select(first))
    assert len(parts) >= 3
    assert len(first) < len(inverse), "no duplicated rows: the dedup path is not exercised"
    part_of = {int(r): i for i, p in enumerate(parts) for r in p.rows}
    groups = inverse.view(-1, cfg["rloo"]["k"])
    assert any(len({part_of[int(d)] for d in g}) > 1 for g in groups), "no group split across micro-batches"

    want, m_whole = _grads_of_step(whole)
    got, m_split = _grads_of_step(split)
    _assert_same(want, got)
    for key in ("train/kl", "train/loss", "train/entropy", "train/adv_mean"):
        assert m_split[key] == pytest.approx(m_whole[key], rel=1e-4, abs=1e-6), key


def test_micro_batched_ppo_minibatch_has_the_one_pass_gradients(micro_run, micro_reward):
    def ppo(budget: int) -> PPOTrainer:
        cfg = _cfg(micro_run, estimator="ppo", micro_batch_tokens=budget)
        torch.manual_seed(0)  # the critic's new value head: the same initial weights in both
        return PPOTrainer(cfg, micro_run["sft"], LengthReward(), _rows(micro_run), micro_run["sft"])

    whole = ppo(0)
    split = ppo(_budget_for_parts(whole, 0, 6))
    critic: dict[str, dict[str, torch.Tensor]] = {}
    for name, t in (("whole", whole), ("split", split)):
        step = t.critic_optimizer.step
        def capture(*a, t=t, name=name, step=step, **kw):
            critic.setdefault(name, {n: p.grad.detach().clone() for n, p in t.critic.named_parameters()
                                     if p.grad is not None})
            return step(*a, **kw)
        t.critic_optimizer.step = capture
    want, _ = _grads_of_step(whole)
    got, _ = _grads_of_step(split)
    _assert_same(want, got)
    _assert_same(critic["whole"], critic["split"])


def test_a_rank_with_too_few_rows_gets_zero_weight_parts(monkeypatch):
    """`even` under data parallelism: halves the largest parts, then pads with weight-0 parts."""
    from rloo.model import distributed

    monkeypatch.setattr(distributed, "enabled", lambda: True)
    monkeypatch.setattr(distributed, "all_max", lambda n: 4.0)
    parts = microbatch.even([torch.tensor([0, 1]), torch.tensor([2])])
    assert [p.rows.tolist() for p in parts] == [[0], [1], [2], [0]]
    assert [p.weight for p in parts] == [1.0, 1.0, 1.0, 0.0]
    assert models  # (imported for the fixtures' models)


def _grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    out = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return out


@pytest.mark.parametrize("logits_chunk", [0, 64])
@pytest.mark.parametrize("tools", [False, True])
def test_micro_batched_sft_step_has_the_one_pass_gradient(micro_run, logits_chunk, tools):
    """SFT's loss, the mean over the batch's answer tokens, from micro-batches (HF's num_items_in_batch;
    or the chunked head's log-probabilities), equals HF's one-pass loss and its gradient; with tools, the
    annotations' results left out of both."""
    from rloo.train import sft

    cfg = micro_run["cfg"]
    tok = models.load_tokenizer(micro_run["sft"])
    model = models.load_causal_lm(micro_run["sft"], trainable=True)
    examples, _ = sft.tokenize(_rows(micro_run)[:12], tok, cfg["prompt"], cfg["model"]["max_length"],
                               [("<<", "=", ">>")] if tools else None)
    assert all(e.tool for e in examples) == tools
    lengths = [len(e.ids) for e in examples]
    assert len(set(lengths)) > 3  # examples of several lengths: micro-batches of unequal token counts
    budget = 3 * max(lengths)
    assert len(microbatch.pack(lengths, budget)) >= 3
    whole = sft.step_loss(model, examples, tok.pad_token_id, 0, "none", torch.device("cpu"))  # HF's labels= loss
    want = _grads(model)
    split = sft.step_loss(model, examples, tok.pad_token_id, budget, "none", torch.device("cpu"), logits_chunk)
    got = _grads(model)
    assert split == pytest.approx(whole, rel=1e-5)
    _assert_same(want, got)


def test_micro_batched_reward_step_has_the_one_pass_gradient(micro_run):
    """Bradley-Terry over pairs kept whole in micro-batches: the sum over a part's pairs / the step's."""
    from rloo.data.prompting import PromptFormat
    from rloo.reward.preferences import Pair
    from rloo.train import reward

    cfg = micro_run["cfg"]
    tok = models.load_tokenizer(micro_run["sft"])
    model = models.load_reward_model(micro_run["sft"], trained=False, trainable=True)
    model.config.pad_token_id = tok.pad_token_id
    fmt = PromptFormat(tok, cfg["prompt"])
    rows = _rows(micro_run)[:10]
    # Chosen: the gold solution; rejected: a truncated one (texts of several lengths).
    pairs = [Pair(i, fmt.prompt(r["question"]), fmt.solution(r["answer"]), fmt.solution(r["answer"])[: 5 + 7 * i])
             for i, r in enumerate(rows)]
    mc = ModelConfig.from_config(cfg["model"])
    whole_loss, _ = reward.step_loss(model, None, fmt, pairs, 0, mc)
    want = _grads(model)
    budget = 2 * 3 * len(fmt.scored_ids(pairs[-1].prompt + pairs[-1].chosen, mc.max_length))
    split_loss, _ = reward.step_loss(model, None, fmt, pairs, budget, mc)
    got = _grads(model)
    assert split_loss == pytest.approx(whole_loss, rel=1e-5)  # (wins: near-ties of an untrained head may flip)
    _assert_same(want, got)
