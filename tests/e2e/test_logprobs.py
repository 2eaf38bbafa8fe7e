"""Log-probabilities through the output head in token chunks (rloo/model/head.py, `logits_chunk_tokens`).

The chunked head gives the full-logits way's log-probabilities, entropies and gradients (hidden states,
head weight and bias; every parameter of a small Qwen2 at Qwen2.5's vocabulary of 151,936, its head tied
to the embeddings) in float32 and under bf16 autocast, through the prompt-sharing and the plain
completion pass and through `causal_logprobs` (whose masked mean is HF's `labels=` loss); it never makes
a tensor of [tokens, vocabulary] (the full-logits way does), hands the head back after the call, takes
the full-logits way for a head that is more than a linear map, works with LoRA and gradient
checkpointing, and under DDP and FSDP on 2 processes gives one process's gradients.

Broken on purpose (each test run once with the break): the backward's softmax term dropped (only the
one-hot term left) fails the value-and-gradient tests; the head left patched after the call (no
restore) fails `test_the_head_is_handed_back`; the head's matmul in float32 under autocast (not the
autocast dtype) fails the bf16 comparisons; the head weight read when the block starts, not inside the
forward call, fails the 2-process test (FSDP's sharded parameter, not the gathered one).
"""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from rloo.algo.losses import token_entropy
from rloo.model import grad_checkpointing, lora
from rloo.model.head import causal_logprobs, head_logprobs, linear_head, logprob_head
from rloo.model.logprobs import (
    completion_logits,
    completion_logprobs,
    completion_logprobs_and_entropy,
    join,
    token_logprobs,
)
from rloo.settings import LoraConfig

ROOT = Path(__file__).resolve().parents[2]
VOCAB = 151_936
# Per dtype: (log-probability and entropy atol, gradient tolerances as |difference| / |want| in norm: of
# all gradients together, of any one parameter's). Float32: summation order only. Under bf16 autocast the
# full-logits way rounds to bf16 what the chunked one sums in float32 (the head weight's gradient over
# all tokens at once, not chunk by chunk; the first completion token's logit gradients summed over the
# rows sharing a prompt, where the chunked way sums hidden-state gradients): measured 2e-3 of the whole
# gradient, 8.5e-3 of a layer-0 bias's, against ~7e-3 between bf16 and float32 gradients.
TOL = {False: (2e-5, 1e-5, 1e-4), True: (1e-4, 5e-3, 3e-2)}


def _qwen2(tied: bool = True, vocab: int = VOCAB) -> torch.nn.Module:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    return Qwen2ForCausalLM(Qwen2Config(hidden_size=64, num_hidden_layers=2, num_attention_heads=2,
                                        num_key_value_heads=1, intermediate_size=128, vocab_size=vocab,
                                        tie_word_embeddings=tied)).eval()


@pytest.fixture(scope="module")
def qwen2() -> torch.nn.Module:
    return _qwen2()


def _batch(vocab: int, rows: int = 6, prompt: int = 7, completion: int = 9):
    """Prompts shared in pairs (some left-padded), completions of different lengths, and random weights on
    the completion tokens for a loss."""
    g = torch.Generator().manual_seed(3)
    prompts = torch.randint(0, vocab, (rows // 2, prompt), generator=g).repeat_interleave(2, 0)
    prompt_mask = torch.ones_like(prompts)
    prompt_mask[:2, :3] = 0
    lengths = torch.randint(1, completion + 1, (rows,), generator=g)
    lengths[0] = completion
    mask = (torch.arange(completion)[None] < lengths[:, None]).float()
    completions = torch.randint(0, vocab, (rows, completion), generator=g)
    return join(prompts, prompt_mask, completions, mask), torch.randn(rows, completion, generator=g) * mask


def _grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return grads


def _assert_grads_close(got: dict, want: dict, bf16: bool) -> None:
    _, whole, each = TOL[bf16]
    assert got.keys() == want.keys() and want
    names = sorted(want)
    total = float(torch.cat([(got[n] - want[n]).flatten() for n in names]).norm()
                  / torch.cat([want[n].flatten() for n in names]).norm())
    assert total <= whole, f"gradients differ by {total:.3g} of their norm (> {whole:g})"
    for name in names:
        rel = float((got[name] - want[name]).norm() / want[name].norm().clamp(min=1e-30))
        assert rel <= each, f"{name}: gradients differ by {rel:.3g} of their norm (> {each:g})"


# -- the chunked head alone -------------------------------------------------------------------------
@pytest.mark.parametrize("bf16", [False, True])
@pytest.mark.parametrize("bias", [False, True])
def test_chunked_head_equals_log_softmax_of_the_full_logits(bf16, bias):
    g = torch.Generator().manual_seed(0)
    n, h, v = 37, 16, 1000
    hidden = torch.randn(n, h, generator=g, requires_grad=True)
    weight = torch.randn(v, h, generator=g).mul_(0.3).requires_grad_()
    b = torch.randn(v, generator=g).requires_grad_() if bias else None
    targets = torch.randint(0, v, (n,), generator=g)
    upstream = torch.randn(n, generator=g)
    leaves = [hidden, weight] + ([b] if bias else [])
    atol = TOL[bf16][0]

    with torch.autocast("cpu", torch.bfloat16, enabled=bf16):
        logits = F.linear(hidden, weight, b)
    want = token_logprobs(logits, targets)
    want_grads = torch.autograd.grad((want * upstream).sum(), leaves)
    want_ent = token_entropy(logits.detach())
    for chunk in (1, 5, n, 4096):  # 5 does not divide 37
        with torch.autocast("cpu", torch.bfloat16, enabled=bf16):
            got, ent = head_logprobs(hidden, weight, b, targets, chunk, entropy=True)
        got_grads = torch.autograd.grad((got * upstream).sum(), leaves)
        torch.testing.assert_close(got, want, atol=atol, rtol=0)
        torch.testing.assert_close(ent, want_ent, atol=atol, rtol=0)
        _assert_grads_close(dict(enumerate(got_grads)), dict(enumerate(want_grads)), bf16)
        assert not ent.requires_grad


# -- through the model's forward --------------------------------------------------------------------
# Through the model under bf16 autocast: on a CPU that emulates bf16 (no AVX512-BF16 or AMX) each case
# takes 11 to 14 CPU-seconds, over the fast tier's 10 s, so they run in the full tier; the fast tier
# keeps bf16 in test_chunked_head_equals_log_softmax_of_the_full_logits
BF16_SLOW = pytest.param(True, id="bf16-autocast", marks=pytest.mark.slow)


@pytest.mark.parametrize(("chunk_rows", "bf16"), [
    pytest.param(0, False, id="plain-float32"),
    pytest.param(0, True, id="plain-bf16-autocast", marks=pytest.mark.slow),
    pytest.param(2, False, id="prompt-sharing-float32"),
    pytest.param(2, True, id="prompt-sharing-bf16-autocast", marks=pytest.mark.slow),
])
def test_completion_passes_equal_the_full_logits_way(qwen2, chunk_rows, bf16):
    batch, weights = _batch(VOCAB)
    mask = batch.completion_mask
    atol = TOL[bf16][0]

    def run(chunk_tokens: int):
        with torch.autocast("cpu", torch.bfloat16, enabled=bf16):
            lp, ent = completion_logprobs_and_entropy(qwen2, batch, chunk_rows, logits_chunk_tokens=chunk_tokens)
        (lp * weights).sum().backward()
        return lp.detach() * mask, ent * mask, _grads(qwen2)

    want_lp, want_ent, want_grads = run(0)
    assert want_grads["model.embed_tokens.weight"].norm() > 0  # the tied head's gradient
    for chunk_tokens in (3, 7, 4096):  # 7 divides none of the passes' token counts
        lp, ent, grads = run(chunk_tokens)
        torch.testing.assert_close(lp, want_lp, atol=atol, rtol=0)
        torch.testing.assert_close(ent, want_ent, atol=atol, rtol=0)
        _assert_grads_close(grads, want_grads, bf16)
    # only the completion tokens are computed; the rest of the padded block holds 0
    lp_only = completion_logprobs(qwen2, batch, chunk_rows, logits_chunk_tokens=7)
    assert torch.equal(lp_only * (1 - mask), torch.zeros_like(mask))


def _labels(ids: torch.Tensor, prompt: int, lengths: torch.Tensor) -> torch.Tensor:
    """SFT's labels: the answer tokens, -100 on the prompt and the padding."""
    pos = torch.arange(ids.shape[1])[None]
    return ids.masked_fill((pos < prompt) | (pos >= lengths[:, None]), -100)


@pytest.mark.parametrize("bf16", [pytest.param(False, id="float32"), BF16_SLOW])
def test_causal_logprobs_give_hfs_labels_loss(qwen2, bf16):
    g = torch.Generator().manual_seed(4)
    ids = torch.randint(0, VOCAB, (3, 12), generator=g)
    lengths = torch.tensor([12, 9, 6])
    attention = (torch.arange(12)[None] < lengths[:, None]).long()
    labels = _labels(ids, 4, lengths)
    atol = TOL[bf16][0]
    with torch.autocast("cpu", torch.bfloat16, enabled=bf16):
        hf_loss = qwen2(input_ids=ids, attention_mask=attention, labels=labels, use_cache=False).loss
    hf_loss.backward()
    want = _grads(qwen2)

    targets = F.pad(labels[:, 1:], (0, 1), value=-100)  # targets[:, t] = labels[:, t + 1]
    mask = targets != -100
    for chunk in (0, 5, 4096):
        with torch.autocast("cpu", torch.bfloat16, enabled=bf16):
            logp = causal_logprobs(qwen2, ids, attention, None, targets, mask, chunk)
        loss = -(logp * mask).sum() / mask.sum()
        loss.backward()
        torch.testing.assert_close(loss, hf_loss.float(), atol=atol, rtol=0)
        assert torch.equal(logp * ~mask, torch.zeros_like(logp))
        _assert_grads_close(_grads(qwen2), want, bf16)


class _LargestTensor(TorchDispatchMode):
    """The largest number of elements any operation returns, forward and backward."""

    def __init__(self) -> None:
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, tuple | list) else [out]:
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel())
        return out


@pytest.mark.parametrize("chunk_rows", [0, 16], ids=["plain", "prompt-sharing"])
def test_no_tensor_of_tokens_by_vocabulary(qwen2, chunk_rows):
    """The chunked pass's largest tensor is a chunk of logits (or the V x H weight's gradient); the
    full-logits pass makes one of all its completion tokens x V."""
    batch, weights = _batch(VOCAB, rows=8, prompt=5, completion=24)
    tokens = int(batch.completion_mask.sum())
    chunk, hidden = 16, qwen2.config.hidden_size
    largest = {}
    for chunk_tokens in (0, chunk):
        with _LargestTensor() as seen:
            lp, _ = completion_logprobs_and_entropy(qwen2, batch, chunk_rows, logits_chunk_tokens=chunk_tokens)
            (lp * weights).sum().backward()
        largest[chunk_tokens] = seen.largest
        qwen2.zero_grad(set_to_none=True)
    assert tokens > max(chunk, hidden)
    assert largest[chunk] <= max(chunk, hidden) * VOCAB
    assert largest[0] >= tokens * VOCAB  # the check sees the full-logits way's tensor


def test_the_head_is_handed_back(qwen2):
    batch, _ = _batch(VOCAB)
    forward = qwen2.lm_head.forward
    with pytest.raises(RuntimeError, match="boom"), logprob_head(qwen2, 8):
        raise RuntimeError("boom")
    with pytest.raises(RuntimeError, match="do not nest"), logprob_head(qwen2, 8), logprob_head(qwen2, 8):
        pass
    completion_logprobs(qwen2, batch, 2, logits_chunk_tokens=8)
    assert "forward" not in vars(qwen2.lm_head) and qwen2.lm_head.forward == forward
    with torch.no_grad():
        assert qwen2(input_ids=batch.input_ids[:1]).logits.shape[-1] == VOCAB


def test_a_head_that_is_more_than_a_linear_map_takes_the_full_logits_way():
    """Gemma 2 soft-caps its logits after the head: the chunked head would skip that, so it is not used."""
    from transformers import Gemma2Config, Gemma2ForCausalLM

    torch.manual_seed(0)
    model = Gemma2ForCausalLM(Gemma2Config(hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                                           num_key_value_heads=1, head_dim=16, intermediate_size=64,
                                           vocab_size=500, final_logit_softcapping=0.5)).eval()
    assert linear_head(model) is None
    batch, _ = _batch(500)
    lp = completion_logprobs(model, batch, 0, logits_chunk_tokens=8)
    want = token_logprobs(completion_logits(model, batch, share_prompts=False), batch.input_ids[:, batch.prompt_len:])
    torch.testing.assert_close(lp, want, atol=0, rtol=0)


def test_lora_and_gradient_checkpointing_take_the_chunked_head():
    model = _qwen2(vocab=2000)
    adapted = lora.adapt(model, LoraConfig(enabled=True, r=4, alpha=8, dropout=0.0, target_modules="all-linear"))
    for p in adapted.model.parameters():  # B = 0 at the start: a step makes the adapters matter
        if p.requires_grad:
            torch.nn.init.normal_(p, std=0.02)
    grad_checkpointing.enable(adapted.model, True)
    assert linear_head(adapted.peft) is linear_head(adapted.model) is adapted.model.lm_head
    batch, weights = _batch(2000)
    results = {}
    for chunk_tokens in (0, 5):
        with grad_checkpointing.active(adapted.model):
            lp = completion_logprobs(adapted.peft, batch, 0, logits_chunk_tokens=chunk_tokens)
        (lp * weights).sum().backward()
        results[chunk_tokens] = (lp.detach() * batch.completion_mask, _grads(adapted.model))
    torch.testing.assert_close(results[5][0], results[0][0], atol=2e-5, rtol=0)
    assert all(".lora_" in n for n in results[0][1])
    _assert_grads_close(results[5][1], results[0][1], bf16=False)


@pytest.mark.slow
def test_two_processes_give_one_process_gradients(tmp_path):
    """DDP and FSDP (2 gloo processes), tied and untied head: each rank's half of the rows through the
    wrapper with the chunked head gives the whole batch's full-logits gradient of one process."""
    out = tmp_path / "diffs.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
           str(ROOT / "tests" / "helpers" / "logprobs_worker.py"), str(out)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]
    result = json.loads(out.read_text())
    assert sorted(result) == ["ddp tied=False", "ddp tied=True", "fsdp tied=False", "fsdp tied=True"]
    for case, diffs in result.items():
        assert diffs["logp"] <= 2e-5 and diffs["entropy"] <= 2e-5, (case, diffs)
        assert diffs["head_grad_norm"] > 0, case
        worst = max((v, k) for k, v in diffs.items() if k.startswith("grad/"))
        assert worst[0] <= 1e-4, (case, worst)
