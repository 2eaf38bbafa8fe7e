"""The RLOO stage on the micro config: a real policy, reference, sampler and verifier."""

import dataclasses
import json
import logging
import math
import shutil

import pytest
import torch
from model_helpers import LengthReward
from workflow_helpers import same_weights

from rloo.algo.names import ESTIMATORS
from rloo.data import synthetic
from rloo.errors import InputError
from rloo.io import read_jsonl
from rloo.model import checkpoint, models
from rloo.reward.rewards import VerifierReward
from rloo.rollout.collect import training_prompts
from rloo.settings import RlooConfig
from rloo.train.rloo import check_sampling
from rloo.train.rloo_trainer import RlooTrainer
from rloo_workflow.stages import prepare
from rloo_workflow.stages import rloo as rloo_stage


def _cfg(micro_run, **rloo):
    cfg = json.loads(json.dumps(micro_run["cfg"]))
    cfg["reward"]["source"] = "verifier"
    cfg["rloo"].update(rloo)
    return cfg


def _train_rows(micro_run):
    return [r for _, r in read_jsonl(micro_run["data"] / "train.jsonl")]


def _moved(trainer, sft_dir) -> float:
    """The largest change of any weight from the SFT policy."""
    sft = models.load_causal_lm(sft_dir).state_dict()
    return max(float((p.detach().cpu() - sft[k]).abs().max()) for k, p in trainer.policy.state_dict().items())


@pytest.mark.parametrize("autocast", ["none", "bfloat16"])
def test_kl_is_exactly_zero_before_the_first_update(micro_run, autocast):
    cfg = _cfg(micro_run, k=4, prompts_per_step=4)
    cfg["model"]["autocast"] = autocast
    trainer = RlooTrainer(cfg, micro_run["sft"], LengthReward(), _train_rows(micro_run))
    m = trainer.step(0)
    assert m["train/kl"] == 0.0
    # ...and the update moved the policy away from the reference.
    m1 = trainer.step(1)
    assert m["train/grad_norm"] > 0.0 and m1["train/kl"] != 0.0


@pytest.mark.parametrize("estimator", ESTIMATORS)
def test_every_estimator_trains(micro_run, estimator):
    cfg = _cfg(micro_run, estimator=estimator, k=2, prompts_per_step=4, lr=1e-3)
    trainer = RlooTrainer(cfg, micro_run["sft"], LengthReward(), _train_rows(micro_run))
    for s in range(2):
        m = trainer.step(s)
        assert all(math.isfinite(v) for k, v in m.items() if isinstance(v, float)), m
        assert m["train/grad_norm"] > 0.0
    assert _moved(trainer, micro_run["sft"]) > 1e-4


@pytest.mark.parametrize(
    "options",
    [{"updates_per_batch": 2, "clip_eps": 0.1}, {"kl_in": "loss", "kl_estimator": "k3"}, {"loss_norm": "token"}],
)
def test_loss_variants_train(micro_run, options):
    cfg = _cfg(micro_run, lr=1e-3, **options)
    trainer = RlooTrainer(cfg, micro_run["sft"], LengthReward(), _train_rows(micro_run))
    m = [trainer.step(s) for s in range(2)][-1]
    assert math.isfinite(m["train/loss"]) and 0.0 <= m["train/clip_frac"] <= 1.0
    assert m["train/grad_norm"] > 0.0 and _moved(trainer, micro_run["sft"]) > 1e-4


def test_k_below_two_is_a_clear_error(micro_run):
    with pytest.raises(ValueError, match=r"rloo.k=1: the rloo estimator needs k >= 2"):
        RlooTrainer(_cfg(micro_run, k=1), micro_run["sft"], VerifierReward(), _train_rows(micro_run))


def test_prompts_per_step_larger_than_the_data_is_a_clear_error(micro_run):
    with pytest.raises(ValueError, match=r"^key 'rloo.prompts_per_step': 9999 is more than the 256 training prompts \(the rows handed in\)"):
        RlooTrainer(_cfg(micro_run, prompts_per_step=9999), micro_run["sft"], VerifierReward(), _train_rows(micro_run))


def test_prompts_longer_than_the_context_are_a_clear_error(micro_run):
    cfg = _cfg(micro_run)
    cfg["model"]["max_length"] = 40
    # rows handed in from Python (rloo.api) are cited by their place among them
    with pytest.raises(ValueError, match=r"^prompts\[\d+\]: a training prompt of \d+ tokens, longer than model\.max_length"):
        RlooTrainer(cfg, micro_run["sft"], VerifierReward(), _train_rows(micro_run))


def test_a_prompt_too_long_for_the_stage_is_cited_by_its_file_and_line(micro_run, tmp_path):
    """The second probe's: RLOO with min_solution_steps=0 refused a long prompt as `first: #4`. The stage
    reads the prepared split, so it cites data/gsm8k/train.jsonl's line (issue 61, item 4)."""
    train, test, _ = synthetic.generate(40, 8, seed=5)
    rows = [{"question": r["question"], "answer": r["answer"]} for r in train]
    long_question = " ".join(f"apples{i % 7} and pears" for i in range(300)) + "?"  # ~7,000 characters
    rows.insert(17, {"question": long_question, "answer": "1 + 1 = 2\n#### 2"})
    (tmp_path / "tr.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "te.jsonl").write_text("".join(json.dumps({"question": r["question"], "answer": r["answer"]}) + "\n"
                                              for r in test))
    cfg = _cfg(micro_run, min_solution_steps=0)
    cfg["data"].update(source="jsonl", train_file=str(tmp_path / "tr.jsonl"), test_file=str(tmp_path / "te.jsonl"),
                       val_examples=4)
    prepare.run(cfg, tmp_path / "data")
    line = next(n for n, r in read_jsonl(tmp_path / "data" / "train.jsonl") if r["question"] == long_question)
    with pytest.raises(InputError) as e:
        rloo_stage.run(cfg, tmp_path / "data", micro_run["sft"], tmp_path / "out", tmp_path / "work")
    assert str(e.value).startswith(f"{tmp_path / 'data' / 'train.jsonl'}:{line}: a training prompt of "), str(e.value)
    n_train = sum(1 for _ in read_jsonl(tmp_path / "data" / "train.jsonl"))
    assert "#" not in str(e.value) and f"(1 of {n_train} training prompts are)" in str(e.value)


def test_biased_sampling_settings_warn_loudly(caplog, micro_cfg):
    rc = dataclasses.replace(RlooConfig.from_config(micro_cfg["rloo"]), temperature=0.7, top_p=0.9, top_k=0)
    with caplog.at_level(logging.WARNING):
        problems = check_sampling(rc)
    assert problems == ["rloo.temperature=0.7", "rloo.top_p=0.9"]
    assert "biased" in caplog.text


class _FlakyReward:
    """A reward source that returns NaN for every third sample (like a failing reward model)."""

    name = "flaky"

    def score(self, prompts, completions, golds, finished):
        base = VerifierReward().score(prompts, completions, golds, finished)
        base[::3] = math.nan
        return base


def test_missing_rewards_are_counted_not_propagated(micro_run):
    trainer = RlooTrainer(_cfg(micro_run, k=2), micro_run["sft"], _FlakyReward(), _train_rows(micro_run))
    m = trainer.step(0)
    assert m["train/missing_rewards"] > 0
    assert math.isfinite(m["train/loss"]) and math.isfinite(m["train/adv_std"])


def test_run_writes_policy_and_resumes_bit_identically(micro_run, micro_reward, tmp_path):
    # The micro reward model as the training reward: its scores have spread, so the weights move.
    cfg = _cfg(micro_run, steps=4, checkpoint_every=2, eval_every=2, eval_examples=4, lr=1e-3)
    cfg["reward"]["source"] = "model"

    def run(out, work):
        return rloo_stage.run(cfg, micro_run["data"], micro_run["sft"], tmp_path / out, tmp_path / work, micro_reward)

    summary = run("full", "w_full")
    steps = (tmp_path / "full" / "steps.jsonl").read_text().splitlines()
    assert len(steps) == 4 and summary["reward_source"] == "model"
    sft = models.load_causal_lm(micro_run["sft"]).state_dict()
    full = models.load_causal_lm(tmp_path / "full").state_dict()
    assert max(float((full[k] - sft[k]).abs().max()) for k in sft) > 1e-3  # it trained
    assert "eval/proxy_reward" in json.loads(steps[1])
    # A run that died after its step-2 checkpoint resumes and ends with the same weights.
    ck = checkpoint.latest(tmp_path / "w_full" / "checkpoints")
    assert ck is not None and ck.name == "step_00000002"
    shutil.copytree(ck, tmp_path / "w_dead" / "checkpoints" / ck.name)
    resumed = run("resumed", "w_dead")
    assert resumed["resumed_from_step"] == 2
    assert same_weights(tmp_path / "full", tmp_path / "resumed")
    # the output is a function of the inputs: the resume is a run fact, kept beside the checkpoints
    assert (tmp_path / "resumed" / "metrics.json").read_bytes() == (tmp_path / "full" / "metrics.json").read_bytes()
    facts = json.loads((tmp_path / "w_dead" / "timings.json").read_text())
    assert facts["resumed_from_step"] == 2 and facts["threads"] >= 1
    assert (tmp_path / "resumed" / "steps.jsonl").read_text() .splitlines()[-1].split('"time/')[0] == steps[-1].split('"time/')[0]
    # Extending a finished run (more steps) resumes from its last checkpoint; other settings do not.
    cfg["rloo"]["steps"] = 5
    longer = run("longer", "w_dead")
    assert longer["resumed_from_step"] == 2
    cfg["rloo"]["lr"] *= 2
    with pytest.raises(checkpoint.CheckpointError, match="other settings"):
        run("other", "w_dead")


def test_lr_schedules_decay_to_their_floor():
    from rloo.algo.schedules import lr_multiplier

    cos, lin, const = (lr_multiplier(2, 10, d, floor=0.1) for d in ("cosine", "linear", "constant"))
    assert [cos(0), cos(1), cos(2)] == [0.5, 1.0, 1.0]
    assert cos(6) == pytest.approx(0.55) and lin(6) == pytest.approx(0.55)  # half-way: both at the midpoint
    assert cos(4) > lin(4) and cos(8) < lin(8)  # cosine decays slowly first, then fast
    assert cos(10) == pytest.approx(0.1) and lin(10) == pytest.approx(0.1) and cos(50) == pytest.approx(0.1)
    assert const(1000) == 1.0
    with pytest.raises(ValueError, match="step"):
        lr_multiplier(0, 10, "step")


def test_decaying_schedule_logs_the_lr_used_and_pins_the_step_count(micro_run, tmp_path):
    cfg = _cfg(micro_run, steps=4, warmup_steps=0, lr_schedule="linear", min_lr_ratio=0.25, checkpoint_every=2)
    rloo_stage.run(cfg, micro_run["data"], micro_run["sft"], tmp_path / "out", tmp_path / "w")
    lrs = [json.loads(line)["train/lr"] for line in (tmp_path / "out" / "steps.jsonl").read_text().splitlines()]
    assert lrs == pytest.approx([cfg["rloo"]["lr"] * m for m in (1.0, 0.8125, 0.625, 0.4375)])
    # The decay depends on the step count: a longer run is another schedule, not an extension.
    cfg["rloo"]["steps"] = 6
    with pytest.raises(checkpoint.CheckpointError, match="other settings"):
        rloo_stage.run(cfg, micro_run["data"], micro_run["sft"], tmp_path / "longer", tmp_path / "w")


def test_non_finite_reward_model_scores_become_missing_rewards(micro_run, tmp_path):
    from rloo.reward.rewards import BrokenRewardError, RewardModelReward

    rm = models.load_reward_model(micro_run["sft"], trained=False)
    tok = models.load_tokenizer(micro_run["sft"])
    rm.config.pad_token_id = tok.pad_token_id
    with torch.no_grad():
        weight = rm.score.weight.clone()
        rm.score.weight.fill_(float("inf"))  # a broken reward model: every score is ±inf or NaN
    reward = RewardModelReward(rm, tok, batch_size=4)
    # every score of the batch non-finite: the source is broken, and the run stops rather than train on nothing
    with pytest.raises(BrokenRewardError, match="non-finite scores to all 3 completions"):
        reward.score(["Question: q\nAnswer:"] * 3, [" #### 1", "", " x"], ["#### 1"] * 3, [True] * 3)
    with torch.no_grad():
        rm.score.weight.copy_(weight)
    trainer = RlooTrainer(_cfg(micro_run, k=2), micro_run["sft"], reward, _train_rows(micro_run))
    # some scores non-finite: those rewards are missing, their groups degenerate, the step stays finite
    real = reward.score
    reward.score = lambda *a: torch.where(torch.arange(len(a[0])) < 2, math.nan, real(*a))
    m = trainer.step(0)
    assert m["train/missing_rewards"] == 2 and m["train/degenerate_groups"] >= 1
    assert math.isfinite(m["train/grad_norm"]) and math.isfinite(m["train/loss"])


def test_empty_completions_score_zero_and_train(micro_run):
    reward = VerifierReward()
    assert reward.score(["p", "p"], ["", " #### 3"], ["#### 3", "#### 3"], [True, True]).tolist() == [0.0, 1.0]
    # A policy that answers with EOS at once: empty completions everywhere, still a finite step.
    trainer = RlooTrainer(_cfg(micro_run, k=2), micro_run["sft"], reward, _train_rows(micro_run))
    with torch.no_grad():
        head = trainer.policy.get_output_embeddings()
        bias = torch.full((trainer.policy.config.vocab_size,), -1e4, device=head.weight.device)
        bias[trainer.tokenizer.eos_token_id] = 1e4
        trainer.policy.set_output_embeddings(
            torch.nn.Linear(head.in_features, head.out_features, bias=True, device=head.weight.device)
        )
        trainer.policy.get_output_embeddings().weight.zero_()
        trainer.policy.get_output_embeddings().bias.copy_(bias)
    m = trainer.step(0)
    assert m["train/response_length"] == 1.0 and m["train/reward_mean"] == 0.0
    assert math.isfinite(m["train/loss"])


def test_difficulty_filter_keeps_multi_step_prompts_and_names_the_key():
    from rloo.data.gsm8k import solution_steps

    rows = [{"question": "q1", "answer": "2+3=<<2+3=5>>5\n#### 5"},
            {"question": "q2", "answer": "2+3=<<2+3=5>>5\n5*4=<<5*4=20>>20\n#### 20"},
            {"question": "q3", "answer": "#### 7"}]
    assert [solution_steps(r["answer"]) for r in rows] == [1, 2, 0]
    assert training_prompts(rows, 0) == rows
    assert [r["question"] for r in training_prompts(rows, 2)] == ["q2"]
    with pytest.raises(ValueError, match=r"rloo\.min_solution_steps=3"):
        training_prompts(rows, 3)


def _scripted_evaluations(monkeypatch, script):
    """Validation results in a given order (the selection and stopping rules are under test, not the
    micro policy, which solves nothing), and a training reward with spread so the weights move."""
    calls = iter(script)
    monkeypatch.setattr(rloo_stage, "build_reward", lambda cfg, reward_model_dir=None: LengthReward())

    def evaluate(self, rows, n, draws):
        acc, proxy = next(calls)
        return {"eval/accuracy_sampled": acc, "eval/accuracy_greedy": acc, "eval/proxy_reward": proxy}

    monkeypatch.setattr(RlooTrainer, "evaluate", evaluate)


def _weights(folder):
    from safetensors.torch import load_file

    return load_file(str(folder / "model.safetensors"))


def test_best_checkpoint_is_written_and_named(micro_run, tmp_path, monkeypatch):
    # evaluations at steps 0 (the SFT policy), 2, 4, 6: the best is step 4
    _scripted_evaluations(monkeypatch, [(0.2, 0.2), (0.3, 0.3), (0.5, 0.5), (0.4, 0.4)])
    cfg = _cfg(micro_run, steps=6, eval_every=2, checkpoint_every=2, keep_checkpoints=5, lr=1e-2, select="best")
    out, work = tmp_path / "out", tmp_path / "work"
    summary = rloo_stage.run(cfg, micro_run["data"], micro_run["sft"], out, work)
    assert summary["selected_step"] == 4 and summary["steps_trained"] == 6
    assert summary["selected_val_accuracy_sampled"] == 0.5
    assert [e["step"] for e in summary["evals"]] == [0, 2, 4, 6]
    written = _weights(out)
    at_4 = _weights(work / "checkpoints" / "step_00000004")
    assert all(torch.equal(written[k], at_4[k]) for k in written)
    sft = _weights(micro_run["sft"])
    assert any(not torch.equal(written[k], sft[k]) for k in written)  # trained weights, not SFT's
    assert json.loads((out / "metrics.json").read_text())["selected_step"] == 4


def test_select_last_and_best_at_step_zero(micro_run, tmp_path, monkeypatch):
    # the SFT policy is best: select=best writes it back unchanged; select=last the final weights
    script = [(0.6, 0.0), (0.3, 0.1), (0.4, 0.1)]
    sft = _weights(micro_run["sft"])
    for select in ("best", "last"):
        _scripted_evaluations(monkeypatch, script if select == "best" else script[1:])
        cfg = _cfg(micro_run, steps=4, eval_every=2, lr=1e-2, select=select, stop_on=[])
        summary = rloo_stage.run(cfg, micro_run["data"], micro_run["sft"], tmp_path / select, tmp_path / f"w{select}")
        written = _weights(tmp_path / select)
        same = all(torch.equal(written[k], sft[k]) for k in sft if k in written)
        assert (summary["selected_step"], same) == ((0, True) if select == "best" else (4, False))


def test_reward_hacking_stops_the_run_early(micro_run, tmp_path, monkeypatch, caplog):
    # the training reward climbs while validation accuracy collapses: alarm/reward_hacking at step 4
    _scripted_evaluations(monkeypatch, [(0.7, 0.1), (0.9, 0.2), (0.1, 0.9), (0.1, 1.0)])
    cfg = _cfg(micro_run, steps=8, eval_every=2, lr=1e-2, eval_examples=8, select="best")
    with caplog.at_level(logging.WARNING):
        summary = rloo_stage.run(cfg, micro_run["data"], micro_run["sft"], tmp_path / "out", tmp_path / "work")
    assert summary["stopped_early"] == {"step": 4, "alarm": "reward_hacking"}
    assert summary["steps_trained"] == 4 and summary["selected_step"] == 2
    assert summary["alarms"]["reward_hacking"] == 4
    assert "stopped early after 4 steps: alarm/reward_hacking" in caplog.text
    # without stop_on the run goes on, the alarm is still recorded
    _scripted_evaluations(monkeypatch, [(0.7, 0.1), (0.9, 0.2), (0.1, 0.9), (0.1, 1.0), (0.1, 1.0)])
    summary = rloo_stage.run(_cfg(micro_run, steps=8, eval_every=2, lr=1e-2, eval_examples=8, stop_on=[], select="best"),
                        micro_run["data"], micro_run["sft"], tmp_path / "out2", tmp_path / "work2")
    assert summary["stopped_early"] is None and summary["steps_trained"] == 8
    assert summary["alarms"]["reward_hacking"] == 4


def test_duplicate_samples_are_passed_once_with_the_same_update(micro_run):
    """k samples of a prompt are often the same completion; the forward passes run once per distinct
    row. The step's log-probabilities, advantages and update are those of the plain step."""
    cfg = _cfg(micro_run, k=4, prompts_per_step=4, lr=1e-3, temperature=0.05, max_new_tokens=4)  # many copies
    class EveryRow(RlooTrainer):
        def distinct_rows(self, batch):
            n = len(batch.completion_mask)
            return torch.arange(n), torch.arange(n)

    results = []
    for trainer_class in (RlooTrainer, EveryRow):
        trainer = trainer_class(cfg, micro_run["sft"], LengthReward(), _train_rows(micro_run))
        m = trainer.step(0)
        m1 = trainer.step(1)
        results.append((m, m1, {k: v.detach().clone() for k, v in trainer.policy.state_dict().items()}))
    (m, m1, w), (p, p1, pw) = results
    assert m["train/distinct_frac"] < 1.0 and p["train/distinct_frac"] == 1.0  # copies were there
    for key in ("train/kl", "train/loss", "train/grad_norm", "train/adv_std", "train/entropy"):
        assert m1[key] == pytest.approx(p1[key], rel=1e-4, abs=1e-6), key
    assert all(torch.allclose(w[k], pw[k], atol=1e-6, rtol=1e-5) for k in w)
    assert max(float((w[k] - models.load_causal_lm(micro_run["sft"]).state_dict()[k]).abs().max()) for k in w) > 1e-4


@pytest.mark.slow  # two micro RLOO runs
def test_a_retrained_policy_of_the_same_size_is_never_resumed_from(micro_run, tmp_path):
    """Issue 70: `rloo train` resumed RLOO's checkpoint on an SFT retrained with another sft.lr: the run's
    identity counted the policy's config and its weights' sizes only. A policy folder is known by the
    identity the job that made it recorded (rloo.identity.IDENTITY_FILE), else by its weights' digests."""
    from safetensors.torch import load_file, save_file

    from rloo.identity import IDENTITY_FILE

    sft = tmp_path / "sft"
    shutil.copytree(micro_run["sft"], sft)
    (sft / IDENTITY_FILE).unlink(missing_ok=True)  # a user's own model: known by its content
    cfg = _cfg(micro_run, steps=4, checkpoint_every=2, lr_schedule="constant", eval_every=0)
    rloo_stage.run(cfg, micro_run["data"], sft, tmp_path / "out", tmp_path / "w")
    assert list((tmp_path / "w" / "checkpoints").iterdir())
    weights = sft / "model.safetensors"
    size = weights.stat().st_size
    save_file({k: v * 1.01 for k, v in load_file(weights).items()}, weights, metadata={"format": "pt"})  # retrained
    assert weights.stat().st_size == size
    cfg["rloo"]["steps"] = 6  # under the constant schedule an extension, which the same policy would resume
    with pytest.raises(checkpoint.CheckpointError, match="other settings"):
        rloo_stage.run(cfg, micro_run["data"], sft, tmp_path / "longer", tmp_path / "w")
