import pytest
import torch
from model_helpers import random_lm

from rloo.model import models
from rloo.model.logprobs import completion_logits, completion_logprobs, join, token_logprobs
from rloo.rollout import generate
from rloo.settings import TinyConfig


def _tiny(tmp_path):
    texts = ["Question: Ava has 12 apples. How many?\nAnswer: 12+3=<<12+3=15>>15\n#### 15"] * 20
    tok = models.train_tokenizer(texts, vocab_size=300)
    model = models.build_tiny_model(
        tok, TinyConfig(hidden_size=64, num_heads=2, num_layers=2, intermediate_size=128), 128, seed=0
    )
    models.save_pretrained(model, tok, tmp_path)
    return tok, model


def test_save_and_reload_through_from_pretrained(tmp_path):
    tok, model = _tiny(tmp_path)
    assert (tmp_path / "model.safetensors").exists() and (tmp_path / "tokenizer.json").exists()
    tok2 = models.load_tokenizer(tmp_path)
    model2 = models.load_causal_lm(tmp_path)
    text = "Question: 123+45?\n#### 168"
    assert tok2(text)["input_ids"] == tok(text)["input_ids"]
    assert tok2.padding_side == "left" and tok2.eos_token_id == tok.eos_token_id
    assert tok2.decode(tok2(text)["input_ids"]) == text
    # Digits are single tokens: arithmetic stays digit by digit.
    assert tok2.convert_ids_to_tokens(tok2("12345")["input_ids"]) == list("12345")
    ids = torch.tensor([tok(text)["input_ids"]])
    assert torch.equal(model(input_ids=ids).logits, model2(input_ids=ids).logits)
    assert not model2.training and not any(p.requires_grad for p in model2.parameters())
    assert model2.config.hidden_size // model2.config.num_attention_heads >= 32


def test_left_padded_logprobs_match_unpadded(tmp_path):
    tok, _ = _tiny(tmp_path)
    model = models.load_causal_lm(tmp_path)
    prompts = [tok("Question: Ava has 12 apples.")["input_ids"], tok("Q: 1")["input_ids"]]
    ro = generate(model, prompts, max_new_tokens=8, eos_id=tok.eos_token_id, pad_id=tok.pad_token_id,
                  generator=torch.Generator().manual_seed(0))
    batch = join(ro.prompt_ids, ro.prompt_mask, ro.completions, ro.completion_mask)
    lp = completion_logprobs(model, batch)
    for i, p in enumerate(prompts):
        n = int(ro.completion_mask[i].sum())
        alone = join(torch.tensor([p]), torch.ones(1, len(p), dtype=torch.long),
                     ro.completions[i : i + 1, :n], ro.completion_mask[i : i + 1, :n])
        lp_alone = completion_logprobs(model, alone)
        torch.testing.assert_close(lp[i, :n], lp_alone[0], atol=1e-5, rtol=0)


def test_generation_masks_stop_after_first_eos(tmp_path):
    tok, _ = _tiny(tmp_path)
    model = models.load_causal_lm(tmp_path)
    ro = generate(model, [tok("Q")["input_ids"]] * 16, max_new_tokens=12, eos_id=tok.eos_token_id,
                  pad_id=tok.pad_token_id, generator=torch.Generator().manual_seed(1))
    for row, mask, fin in zip(ro.completions, ro.completion_mask, ro.finished, strict=True):
        eos = (row == tok.eos_token_id).nonzero()
        if fin:
            first = int(eos[0])
            assert mask[: first + 1].all() and not mask[first + 1 :].any()
        else:
            assert mask.all() and len(eos) == 0


def test_compacted_decoding_equals_the_plain_loop(micro_run):
    # Shared-prompt prefill and dropping finished rows are pure savings: same tokens, masks, ends.
    tok = models.load_tokenizer(micro_run["sft"])
    model = models.load_causal_lm(micro_run["sft"])
    qs = ["Question: Ava has 12 apples and buys 7 more. How many?\nAnswer:", "Question: 3 boxes of 9?\nAnswer:",
          "Question: Tom had 30 and gave 12 away. How many now?\nAnswer:"]
    prompts = [tok(q)["input_ids"] for q in qs for _ in range(4)]
    for greedy in (True, False):
        kw = dict(max_new_tokens=40, eos_id=tok.eos_token_id, pad_id=tok.pad_token_id, greedy=greedy)
        fast = generate(model, prompts, generator=torch.Generator().manual_seed(3), **kw)
        plain = generate(model, prompts, generator=torch.Generator().manual_seed(3), compact=False, **kw)
        assert torch.equal(fast.completions, plain.completions)
        assert torch.equal(fast.completion_mask, plain.completion_mask)
        assert torch.equal(fast.finished, plain.finished)
        lengths = fast.completion_mask.sum(1)
        if not greedy:  # the micro policy's samples end at different steps: the compaction path ran
            assert lengths.min() < lengths.max() and fast.finished.any()


def test_gumbel_max_sampling_follows_the_softmax():
    from rloo.rollout.sampling import gumbel_noise, sample_token

    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]]).repeat(40000, 1)
    draws, _ = sample_token(logits, False, 1.0, 1.0, 0, gumbel_noise(40000, 4, torch.Generator().manual_seed(0)))
    freq = torch.bincount(draws, minlength=4).float() / 40000
    torch.testing.assert_close(freq, torch.softmax(logits[0], -1), atol=0.01, rtol=0)


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_shared_prompt_pass_equals_the_plain_pass_with_gradients(micro_run, attn):
    # k completions per prompt: the prompt runs once and its KV cache is indexed out to the k rows.
    tok = models.load_tokenizer(micro_run["sft"])
    model = models.load_causal_lm(micro_run["sft"], trainable=True, attn_implementation=attn)
    qs = ["Question: Ava has 12 apples and buys 7 more. How many?\nAnswer:", "Question: 3 boxes of 9?\nAnswer:"]
    ro = generate(model, [tok(q)["input_ids"] for q in qs for _ in range(3)], max_new_tokens=20,
                  eos_id=tok.eos_token_id, pad_id=tok.pad_token_id, generator=torch.Generator().manual_seed(5))
    batch = join(ro.prompt_ids, ro.prompt_mask, ro.completions, ro.completion_mask)
    weights = torch.randn(batch.completion_mask.shape) * batch.completion_mask
    grads, logps = [], []
    for share in (True, False):
        model.zero_grad()
        lp = token_logprobs(completion_logits(model, batch, share_prompts=share), batch.input_ids[:, batch.prompt_len :])
        (lp * weights).sum().backward()
        logps.append(lp.detach() * batch.completion_mask)
        grads.append(torch.cat([p.grad.flatten() for p in model.parameters()]))
    torch.testing.assert_close(logps[0], logps[1], atol=2e-5, rtol=0)
    torch.testing.assert_close(grads[0], grads[1], atol=1e-5, rtol=1e-4)
    assert grads[0].abs().sum() > 0


def test_model_device_placement(tmp_path):
    """`model.device`: auto picks what torch sees; asking for a GPU that is not there is a clear error."""
    from rloo.model.logprobs import model_device
    from rloo.runtime import resolve_device

    _tiny(tmp_path)
    expected = "cuda" if torch.cuda.is_available() else "cpu"
    assert resolve_device("auto").type == expected
    assert model_device(models.load_causal_lm(tmp_path, device="auto")).type == expected
    assert model_device(models.load_reward_model(tmp_path, trained=False, device="cpu")).type == "cpu"
    if not torch.cuda.is_available():
        with pytest.raises(RuntimeError, match=r"model\.device is 'cuda'"):
            models.load_causal_lm(tmp_path, device="cuda")


def test_rollout_moves_whole_and_decodes_to_eos(tmp_path):
    from rloo.rollout.sampling import noise_generator

    tok, model = _tiny(tmp_path)
    prompts = [tok("Question: Ava has 12 apples.")["input_ids"]] * 3
    g = torch.Generator().manual_seed(0)
    assert noise_generator(g, torch.device("cpu")) is g  # CPU sampling draws from the caller's generator
    ro = generate(model, prompts, max_new_tokens=12, eos_id=tok.eos_token_id, pad_id=tok.pad_token_id, generator=g)
    moved = ro.to("cpu")
    assert ro.logprobs is not None  # the sampler's own log-probabilities travel with the rollout
    for name in ("prompt_ids", "prompt_mask", "completions", "completion_mask", "finished", "logprobs"):
        assert torch.equal(getattr(moved, name), getattr(ro, name))
    lengths = ro.lengths.tolist()
    assert ro.texts(tok) == [tok.decode(ro.completions[i, :n], skip_special_tokens=True) for i, n in enumerate(lengths)]


@pytest.mark.parametrize("kind", ["micro", "qwen2", "llama-biases"])
def test_lean_decode_loop_gives_the_hf_loop_tokens(micro_run, kind):
    """rloo.rollout.decode runs the model's equations itself: in float32 it must sample exactly the tokens
    the HF forward pass gives, with prompts shared by groups of different sizes and padding."""
    from rloo.rollout import decode

    if kind == "micro":
        tok = models.load_tokenizer(micro_run["sft"])
        model = models.load_causal_lm(micro_run["sft"])
        eos, pad = tok.eos_token_id, tok.pad_token_id
        qs = ["Question: Ava has 12 apples and buys 7 more. How many?\nAnswer:", "Question: 3 boxes of 9?\nAnswer:",
              "Question: Tom had 30 and gave 12 away. How many now?\nAnswer:"]
        distinct = [tok(q)["input_ids"] for q in qs]
    else:
        model = random_lm("qwen2" if kind == "qwen2" else "llama")
        eos, pad = 0, 1
        g = torch.Generator().manual_seed(1)
        distinct = [torch.randint(2, 300, (n,), generator=g).tolist() for n in (5, 17, 9)]
    assert decode.supports(model)
    prompts = [distinct[0]] * 4 + [distinct[1]] * 2 + [distinct[2]] + [distinct[0]]
    for greedy in (True, False):
        kw = dict(max_new_tokens=30, eos_id=eos, pad_id=pad, greedy=greedy)
        lean = generate(model, prompts, generator=torch.Generator().manual_seed(3), **kw)
        hf = generate(model, prompts, generator=torch.Generator().manual_seed(3), lean=False, **kw)
        for name in ("prompt_ids", "prompt_mask", "completions", "completion_mask", "finished"):
            assert torch.equal(getattr(lean, name), getattr(hf, name)), (name, greedy)
        assert not lean.completions.is_inference()  # usable by the training pass that follows


@pytest.mark.parametrize("chunk_rows", [1, 2, 4, 64])
def test_chunked_completion_pass_equals_the_plain_pass(micro_run, chunk_rows):
    """Rows taken by length in chunks, each padded to its own longest completion: same log-probabilities,
    same gradients, same entropies as one padded pass."""
    from rloo.algo.losses import token_entropy
    from rloo.model.logprobs import completion_logprobs_and_entropy

    tok = models.load_tokenizer(micro_run["sft"])
    model = models.load_causal_lm(micro_run["sft"], trainable=True)
    qs = ["Question: Ava has 12 apples and buys 7 more. How many?\nAnswer:", "Question: 3 boxes of 9?\nAnswer:"]
    ro = generate(model, [tok(q)["input_ids"] for q in qs for _ in range(3)], max_new_tokens=20,
                  eos_id=tok.eos_token_id, pad_id=tok.pad_token_id, generator=torch.Generator().manual_seed(5))
    assert ro.lengths.min() < ro.lengths.max()  # chunks of different widths
    batch = join(ro.prompt_ids, ro.prompt_mask, ro.completions, ro.completion_mask)
    mask = batch.completion_mask
    weights = torch.randn(mask.shape) * mask
    model.zero_grad()
    lp, ent = completion_logprobs_and_entropy(model, batch, chunk_rows=chunk_rows)
    (lp * weights).sum().backward()
    grad = torch.cat([p.grad.flatten() for p in model.parameters()])
    model.zero_grad()
    logits = completion_logits(model, batch, share_prompts=False)
    plain = token_logprobs(logits, batch.input_ids[:, batch.prompt_len :])
    (plain * weights).sum().backward()
    plain_grad = torch.cat([p.grad.flatten() for p in model.parameters()])
    torch.testing.assert_close(lp * mask, plain.detach() * mask, atol=2e-5, rtol=0)
    torch.testing.assert_close(ent * mask, token_entropy(logits.detach()) * mask, atol=2e-5, rtol=0)
    torch.testing.assert_close(grad, plain_grad, atol=1e-5, rtol=1e-4)
    assert grad.abs().sum() > 0


def test_a_trained_reward_model_without_its_head_is_refused(tmp_path):
    """A causal-LM folder passed where a trained reward model is read would score with a random head
    (transformers' warning is hidden): one error names the folder instead; growing one is still allowed."""
    from rloo.errors import InputError

    _tiny(tmp_path)
    with pytest.raises(InputError, match=f"{tmp_path}: not a trained reward model"):
        models.load_reward_model(tmp_path)
    grown = models.load_reward_model(tmp_path, trained=False)
    folder = tmp_path / "rm"
    grown.save_pretrained(folder)
    assert type(models.load_reward_model(folder)).__name__.endswith("ForSequenceClassification")


def _sampler_gap(rollout, model, prompts, eos, pad) -> float:
    """Mean |sampler log-prob − float32 trainer log-prob| over the sampled completion tokens."""
    ro = rollout.generate(prompts, max_new_tokens=24, eos_id=eos, pad_id=pad, generator=torch.Generator().manual_seed(5))
    batch = join(ro.prompt_ids, ro.prompt_mask, ro.completions, ro.completion_mask)
    with torch.no_grad():
        trainer = completion_logprobs(model, batch)
    m = batch.completion_mask.bool()
    return float((ro.logprobs - trainer)[m].abs().mean())


@pytest.mark.parametrize("lean", [True, False])
def test_inference_dtype_decodes_in_bfloat16(micro_run, lean):
    """model.inference_dtype reaches the sampler the config builds (make_rollout): bfloat16 samples with
    log-probs off the float32 trainer's by bf16 rounding, the weights' own dtype (null) matches it."""
    from rloo.rollout import HFRollout, make_rollout
    from rloo.settings import Config
    from rloo_workflow.config.checks import validate

    tok = models.load_tokenizer(micro_run["sft"])
    model = models.load_causal_lm(micro_run["sft"])
    prompts = [tok("Question: Ava has 12 apples and buys 7 more. How many?\nAnswer:")["input_ids"]] * 4
    gaps = {}
    for dtype in (None, "bfloat16"):
        cfg = validate({**micro_run["cfg"], "model": {**micro_run["cfg"]["model"], "inference_dtype": dtype}})
        sampler = make_rollout(Config.from_config(cfg), 0, micro_run["sft"], model)
        sampler.lean = lean
        gaps[dtype] = _sampler_gap(sampler, model, prompts, tok.eos_token_id, tok.pad_token_id)
    assert gaps[None] < 1e-4, gaps
    assert 1e-3 < gaps["bfloat16"] < 0.2, gaps
    assert isinstance(sampler, HFRollout) and sampler.dtype == torch.bfloat16


def test_reward_model_scores_under_inference_dtype(micro_reward, micro_run):
    """A reward model scores in bfloat16 under model.inference_dtype: close to, not equal to, float32."""
    from rloo.reward.rewards import RewardModelReward

    rm, tok = models.load_reward_model(micro_reward), models.load_tokenizer(micro_reward)
    args = (["Question: 3 boxes of 9?\nAnswer:"] * 3, [" 3*9=<<3*9=27>>27\n#### 27", " 12\n#### 12", " 27"],
            ["27"] * 3, [True] * 3)
    full = RewardModelReward(rm, tok).score(*args)
    half = RewardModelReward(rm, tok, inference_dtype="bfloat16").score(*args)
    assert not torch.equal(full, half) and torch.allclose(full, half, atol=0.1), (full, half)
