import torch

from rloo import models
from rloo.batching import completion_logprobs, join
from rloo.rollout import generate


def _tiny(tmp_path):
    texts = ["Question: Ava has 12 apples. How many?\nAnswer: 12+3=<<12+3=15>>15\n#### 15"] * 20
    tok = models.train_tokenizer(texts, vocab_size=300)
    model = models.build_tiny_model(
        tok, {"hidden_size": 64, "num_heads": 2, "num_layers": 2, "intermediate_size": 128}, 128, seed=0
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
