"""A hub-style model through the pipeline: a tiny random Qwen2 whose tokenizer has a ChatML chat template
and no BOS (scripts/make_tiny_hub_model.py), and a variant whose tokenizer has no pad token.

The chat template is rendered by one function (rloo.data.prompting) and every stage's prompt ids are checked
against it; pad == EOS is checked in both sampling loops and in the reward head; the no-pad variant
runs every stage function, the chat-template one the whole chain through a real `snakemake`.
"""

from __future__ import annotations

import importlib.util
import json
import math
import subprocess
import sys
from pathlib import Path

import jsonschema
import pytest
import torch
import yaml
from model_helpers import evaluate_and_report, random_lm
from workflow_helpers import JOBS, env_for, job_counts, make_copy, snakemake

from rloo.data.prompting import PromptFormat, align_eos, end_of_turn, render_prompt
from rloo.errors import InputError
from rloo.eval.evaluation import spec_for
from rloo.io import read_jsonl
from rloo.model import models
from rloo.model.logprobs import left_pad, positions, sequence_scores
from rloo.reward.rewards import RewardModelReward, VerifierReward
from rloo.rollout import decode, generate
from rloo.train import reward as reward_run
from rloo.train import sft as sft_run
from rloo.train.rloo_trainer import RlooTrainer
from rloo_workflow.config import load_config
from rloo_workflow.stages import base, prepare, reward, sft
from rloo_workflow.stages import rloo as rloo_stage

ROOT = Path(__file__).resolve().parents[2]
QWEN = ROOT / "config" / "qwen2-tiny.yaml"
SCRIPT = ROOT / "scripts" / "make_tiny_hub_model.py"
RESULTS_SCHEMA = ROOT / "rloo_workflow" / "schemas" / "results.schema.yaml"


def _script():
    spec = importlib.util.spec_from_file_location("make_tiny_hub_model", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def hub():
    return _script()


@pytest.fixture(scope="module")
def qwen_dir(hub, tmp_path_factory) -> Path:
    return hub.build(tmp_path_factory.mktemp("hub") / "qwen2-tiny")


@pytest.fixture(scope="module")
def qwen_nopad_dir(hub, tmp_path_factory) -> Path:
    return hub.build(tmp_path_factory.mktemp("hub") / "qwen2-tiny-nopad", pad=False)


def _cfg(folder: Path, **sections) -> dict:
    return load_config(QWEN, {"tracking": {"enabled": False}, "model": {"name_or_path": str(folder)}, **sections})


@pytest.fixture(scope="module")
def rows(hub) -> list[dict]:
    train_rows, _, _, _ = prepare.load_splits(load_config(QWEN))
    return train_rows[:6]


def test_the_folder_loads_as_a_hub_model(qwen_dir, qwen_nopad_dir):
    tok = models.load_tokenizer(qwen_dir)
    assert tok.bos_token is None and tok.eos_token == "<|im_end|>" and tok.pad_token == "<|endoftext|>"
    assert tok.chat_template and tok.padding_side == "left"
    lm = models.load_causal_lm(qwen_dir)
    assert lm.config.model_type == "qwen2" and lm.model.layers[0].self_attn.q_proj.bias is not None
    assert decode.supports(lm)  # the lean loop covers Qwen2, biases included (tests/integration/test_models.py)
    assert type(models.load_reward_model(qwen_dir, trained=False)).__name__ == "Qwen2ForSequenceClassification"
    nopad = models.load_tokenizer(qwen_nopad_dir)
    assert nopad.pad_token == nopad.eos_token == "<|im_end|>"  # no pad token: pad with the EOS
    assert len(nopad) == len(tok)  # no token added, no embedding row to grow


def test_render_prompt_applies_the_chat_template(qwen_dir):
    tok = models.load_tokenizer(qwen_dir)
    cfg = _cfg(qwen_dir)["prompt"]
    assert render_prompt(tok, cfg, "What is 2+3?") == "<|im_start|>user\nWhat is 2+3?<|im_end|>\n<|im_start|>assistant\n"
    assert render_prompt(tok, {**cfg, "system": "Be brief."}, "Q?").startswith(
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nQ?<|im_end|>")
    assert render_prompt(tok, {**cfg, "chat_template": False}, "Q?") == "Question: Q?\nAnswer:"
    ids = PromptFormat(tok, cfg).prompt_ids("What is 2+3?")
    # special tokens are single ids, nothing is prepended (no BOS)
    assert ids[0] == tok.convert_tokens_to_ids("<|im_start|>") and ids.count(tok.eos_token_id) == 1
    assert end_of_turn(tok, cfg) == "<|im_end|>"


def test_auto_leaves_the_embedded_tokenizer_on_the_bare_template(qwen_dir):
    tok = models.train_tokenizer(["Question: 1+1?\nAnswer: 2\n#### 2"] * 5, vocab_size=300)
    cfg = load_config(None)["prompt"]
    assert cfg["chat_template"] == "auto" and cfg["system"] is None
    fmt = PromptFormat(tok, cfg)
    assert not fmt.chat and fmt.prompt("1+1?") == "Question: 1+1?\nAnswer:"
    assert fmt.solution_ids("2") == tok(" 2")["input_ids"] + [tok.eos_token_id]  # as SFT always tokenized it
    with pytest.raises(InputError, match=r"prompt\.chat_template is true"):
        PromptFormat(tok, {**cfg, "chat_template": True})


def test_sft_trains_on_the_assistant_turn_only(qwen_dir, rows):
    tok = models.load_tokenizer(qwen_dir)
    examples, too_long = sft_run.tokenize(rows, tok, _cfg(qwen_dir)["prompt"], 192)
    assert too_long == 0
    _, _, labels = sft_run.collate(examples, tok.pad_token_id)
    for r, e, lab in zip(rows, examples, labels, strict=True):
        chat = [{"role": "user", "content": r["question"]}, {"role": "assistant", "content": r["answer"]}]
        # the example is the chat template's rendering of the conversation, up to the assistant's end of turn
        assert tok.decode(e.ids) == tok.apply_chat_template(chat, tokenize=False).removesuffix("\n")
        target = lab[lab != -100].tolist()
        assert target == e.ids[e.n_prompt :] and tok.decode(target) == r["answer"] + "<|im_end|>"


def test_an_end_of_turn_other_than_eos_becomes_the_eos(hub):
    tok = hub.tokenizer_for(["1 + 2 = 3"] * 5, vocab_size=300)
    tok.eos_token = "<|endoftext|>"  # a base model shipped with a chat template
    cfg = load_config(None)["prompt"]
    assert align_eos(tok, cfg) == "<|im_end|>" and tok.eos_token == "<|im_end|>"
    assert align_eos(tok, cfg) is None  # already aligned


def test_every_stage_builds_the_same_prompt_ids(qwen_dir, rows, monkeypatch):
    """SFT's examples, the reward model's sampling and scoring, RLOO's prompts and the evaluation's all
    start from `PromptFormat.prompt_ids` of the question: the chat-template rendering."""
    import rloo.eval.evaluation

    cfg = _cfg(qwen_dir, reward={"prompts": len(rows), "max_new_tokens": 4})
    tok = models.load_tokenizer(qwen_dir)
    fmt = PromptFormat(tok, cfg["prompt"])
    expected = [fmt.prompt_ids(r["question"]) for r in rows]
    assert all(tok.decode(e).startswith("<|im_start|>user\n" + r["question"]) for e, r in zip(expected, rows, strict=True))

    examples, _ = sft_run.tokenize(rows, tok, cfg["prompt"], cfg["model"]["max_length"])
    assert [e.ids[: e.n_prompt] for e in examples] == expected

    seen: dict[str, list[list[int]]] = {}

    def recording(module, stage):
        real = module.generate

        def wrapper(model, prompts, **kw):
            seen.setdefault(stage, []).extend(prompts)
            return real(model, prompts, **kw)
        monkeypatch.setattr(module, "generate", wrapper)

    recording(reward_run, "reward")
    pairs, _ = reward_run.sample_pairs(cfg, qwen_dir, rows)
    k = cfg["reward"]["samples_per_prompt"]
    assert seen["reward"] == [e for e in expected for _ in range(k)]
    assert pairs and all(p.prompt == fmt.prompt(rows[p.prompt_id]["question"]) for p in pairs)
    # the reward model scores what SFT trained on: a reference pair's text encodes to SFT's example exactly
    for r, e in zip(rows, examples, strict=True):
        assert fmt.scored_ids(fmt.prompt(r["question"]) + fmt.solution(r["answer"]), 192) == e.ids

    trainer = RlooTrainer(cfg, qwen_dir, VerifierReward(), rows)
    assert trainer.prompt_ids == expected and trainer.prompts == [fmt.prompt(r["question"]) for r in rows]

    recording(rloo.eval.evaluation, "evaluate")
    small = {**cfg, "evaluate": {**cfg["evaluate"], "samples_per_prompt": 1, "max_new_tokens": 2}}
    policy = models.load_causal_lm(qwen_dir)
    rloo.eval.evaluation.evaluate_policy(policy, tok, rows, spec_for(small, "evaluate", 2, 1, stream=21))
    assert seen["evaluate"][: len(rows)] == expected  # greedy pass; the sampled one repeats it
    assert seen["evaluate"][len(rows) :] == expected


def test_pad_equal_to_eos_ends_each_row_at_its_first_eos():
    """With pad == EOS, a padded position is not an EOS and an EOS is not padding: each finished row's
    mask covers its tokens up to and including the first EOS, in the lean loop and in HF's."""
    model = random_lm("qwen2")
    g = torch.Generator().manual_seed(1)
    distinct = [torch.randint(2, 300, (n,), generator=g).tolist() for n in (5, 17, 9)]
    prompts = [distinct[0]] * 4 + [distinct[1]] * 2 + [distinct[2]]
    kw = dict(max_new_tokens=30, greedy=False)
    probe = generate(model, prompts, eos_id=-1, pad_id=0, generator=torch.Generator().manual_seed(3), **kw)
    eos = int(torch.mode(probe.completions.flatten()).values)  # a token the rows do sample: some finish
    lean = generate(model, prompts, eos_id=eos, pad_id=eos, generator=torch.Generator().manual_seed(3), **kw)
    hf = generate(model, prompts, eos_id=eos, pad_id=eos, generator=torch.Generator().manual_seed(3), lean=False, **kw)
    for name in ("completions", "completion_mask", "finished"):
        assert torch.equal(getattr(lean, name), getattr(hf, name)), name
    assert lean.finished.any() and (~lean.completion_mask).any()
    for row, mask, fin in zip(lean.completions, lean.completion_mask, lean.finished, strict=True):
        hits = (row == eos).nonzero()
        if fin:
            first = int(hits[0])
            assert mask[: first + 1].all() and not mask[first + 1 :].any()
            assert (row[first:] == eos).all()  # the padding after it
        else:
            assert mask.all() and len(hits) == 0


def test_reward_head_reads_the_eos_when_pad_is_eos(qwen_nopad_dir, rows):
    tok = models.load_tokenizer(qwen_nopad_dir)
    rm = models.load_reward_model(qwen_nopad_dir, trained=False)
    rm.config.pad_token_id = tok.pad_token_id  # as the reward stage saves it: the EOS
    fmt = PromptFormat(tok, _cfg(qwen_nopad_dir)["prompt"])
    texts = [fmt.prompt(r["question"]) + r["answer"] for r in rows[:3]]
    ids = [fmt.scored_ids(t, 192) for t in texts]
    assert len({len(i) for i in ids}) > 1 and all(i[-1] == tok.eos_token_id for i in ids)
    with torch.no_grad():
        batch = sequence_scores(rm, ids, tok.pad_token_id)
        alone = torch.stack([rm.score(rm.model(input_ids=torch.tensor([i])).last_hidden_state[:, -1])[0, 0] for i in ids])
        torch.testing.assert_close(batch, alone, atol=1e-5, rtol=0)
        # HF's own pooling takes the trailing EOS for padding and reads the token before it
        input_ids, mask = left_pad(ids, tok.pad_token_id)
        naive = rm(input_ids=input_ids, attention_mask=mask, position_ids=positions(mask)).logits[:, 0]
        assert not torch.allclose(naive, batch, atol=1e-4)
        scored = RewardModelReward(rm, tok, prompt_cfg=fmt.config).score(
            [fmt.prompt(r["question"]) for r in rows[:3]], [r["answer"] for r in rows[:3]], [""] * 3, [True] * 3)
    torch.testing.assert_close(scored, batch, atol=1e-5, rtol=0)


def test_the_no_pad_variant_runs_every_stage(qwen_nopad_dir, tmp_path):
    """prepare, sft, reward, rloo (trained on the reward model: pad == EOS in its scores) and evaluate, called
    as `rloo <stage>` calls them, on a tokenizer without a pad token."""
    cfg = _cfg(qwen_nopad_dir, reward={"source": "model"})
    data, sft_dir, rm_dir, policy = tmp_path / "data", tmp_path / "sft", tmp_path / "reward", tmp_path / "rloo"
    prepare.run(cfg, data)
    base.run(cfg, data, tmp_path / "base")
    sft.run(cfg, data, tmp_path / "base", sft_dir, tmp_path / "work" / "sft")
    reward.run(cfg, data, sft_dir, rm_dir)
    metrics = rloo_stage.run(cfg, data, sft_dir, policy, tmp_path / "work" / "rloo", reward_model_dir=rm_dir)
    out = tmp_path / "results" / "gsm8k_rloo.json"
    result = evaluate_and_report(cfg, data, sft_dir, {"base": tmp_path / "base", "sft": sft_dir, "rloo": policy}, out,
                                 rm_dir, tmp_path / "results" / "gsm8k_rloo")
    tok = models.load_tokenizer(sft_dir)
    assert tok.pad_token == tok.eos_token == "<|im_end|>" and tok.chat_template
    assert json.loads((rm_dir / "config.json").read_text())["pad_token_id"] == tok.eos_token_id
    assert metrics["reward_source"] == "model" and metrics["steps_trained"] == cfg["rloo"]["steps"]
    assert math.isfinite(metrics["final_reward_mean"])
    assert set(result["policies"]) == {"sft", "rloo"} and result["policies"]["rloo"]["proxy_reward"] is not None
    jsonschema.validate(json.loads(out.read_text()), yaml.safe_load(RESULTS_SCHEMA.read_text()))
    _check_completions(tmp_path / "results" / "eval")
    # a chat model's prose carries no calculator annotations: the solution checker says n/a, not 0
    for p in result["policies"].values():
        check = p["solution_check"]
        assert (check["work_right"] is None) == (check["work_checked_share"] == 0) == ("reason" in check)


def _check_completions(folder: Path) -> None:
    """The completions the verifier read are plain text: the template's special tokens are skipped (every
    policy's evaluation records: rloo.eval.records)."""
    recs = [rec for path in sorted(folder.glob("*.jsonl")) for _, rec in read_jsonl(path)]
    texts = [c["text"] for rec in recs for c in [rec["greedy"], *rec["draws"]]]
    assert texts and all(isinstance(t, str) for t in texts)
    assert not any("<|im_" in t or "<|endoftext|>" in t for t in texts)


@pytest.mark.slow
def test_snakemake_runs_the_chain_on_the_chat_template_model(tmp_path):
    """The overlay config/qwen2-tiny.yaml used exactly as a hub folder: the script writes the folder,
    `snakemake --configfile config/micro.yaml config/qwen2-tiny.yaml` runs every stage on it."""
    copy = make_copy(tmp_path / "workflow")
    subprocess.run([sys.executable, str(SCRIPT), str(copy / "models" / "qwen2-tiny"), "--config",
                    str(copy / "config" / "micro.yaml")], cwd=copy, env=env_for(copy), check=True, timeout=300)
    res = snakemake(copy, "results/gsm8k_rloo.json", "--cores", "1", "--configfile", "config/micro.yaml",
                    "config/qwen2-tiny.yaml", "config/test.yaml", timeout=1200)
    assert job_counts(res.stdout + res.stderr) == JOBS
    result = json.loads((copy / "results" / "gsm8k_rloo.json").read_text())
    jsonschema.validate(result, yaml.safe_load(RESULTS_SCHEMA.read_text()))
    assert set(result["policies"]) == {"sft", "rloo"} and result["examples"] == 16
    models_dir = copy / "results" / "models"
    for name in ("sft", "rloo_rloo"):
        assert json.loads((models_dir / name / "config.json").read_text())["model_type"] == "qwen2"
    assert json.loads((models_dir / "reward" / "config.json").read_text())["architectures"] == [
        "Qwen2ForSequenceClassification"]
    tok = models.load_tokenizer(models_dir / "sft")
    assert tok.chat_template and tok.bos_token is None and tok.eos_token == "<|im_end|>"
    _check_completions(copy / "results" / "eval")
