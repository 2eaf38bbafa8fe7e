"""Policy loss, PPO clipping, KL estimators and reward shaping."""

from __future__ import annotations

import math

import pytest
import torch

from rloo.algo.losses import (
    kl_k1,
    kl_k3,
    kl_loss_term,
    policy_loss,
    sequence_kl,
    shaped_reward,
    token_entropy,
)

DT = torch.float64


def _batch(seed: int = 0, b: int = 3, t: int = 5, v: int = 7):
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(b, t, v, generator=gen, dtype=DT, requires_grad=True)
    tokens = torch.randint(0, v, (b, t), generator=gen)
    mask = torch.ones(b, t, dtype=DT)
    mask[0, 3:] = 0  # responses of different lengths, padded on the right
    mask[2, 1:] = 0
    adv = torch.randn(b, generator=gen, dtype=DT)
    return logits, tokens, mask, adv


def _token_logp(logits, tokens):
    return torch.log_softmax(logits, dim=-1).gather(-1, tokens.unsqueeze(-1)).squeeze(-1)


def test_sequence_norm_gradient_matches_score_function():
    logits, tokens, mask, adv = _batch()
    loss, _ = policy_loss(_token_logp(logits, tokens), mask, adv, norm="sequence")
    (grad,) = torch.autograd.grad(loss, logits)
    # Independently: d log softmax(z)[y] / dz = onehot(y) - softmax(z), so the gradient of
    # -mean_i A_i sum_t log pi(y_it) is -(1/B) A_i mask_it (onehot - softmax) at every position.
    b, _, v = logits.shape
    onehot = torch.nn.functional.one_hot(tokens, v).to(DT)
    probs = torch.softmax(logits.detach(), dim=-1)
    expected = -(adv[:, None, None] * mask[:, :, None] * (onehot - probs)) / b
    torch.testing.assert_close(grad, expected, atol=1e-12, rtol=0)


def test_token_vs_sequence_normalisation_hand_example():
    logp = torch.tensor([[-1.0, -2.0, -9.0], [-0.5, -9.0, -9.0]], dtype=DT)
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    adv = torch.tensor([1.0, -2.0], dtype=DT)
    seq, _ = policy_loss(logp, mask, adv, norm="sequence")
    tok, _ = policy_loss(logp, mask, adv, norm="token")
    # Response terms: -1 * (-1 - 2) = 3 and -(-2) * (-0.5) = -1; padded -9s must not count.
    assert seq.item() == pytest.approx((3.0 - 1.0) / 2)  # mean over 2 responses
    assert tok.item() == pytest.approx((3.0 - 1.0) / 3)  # over 3 response tokens
    with pytest.raises(ValueError, match="normalisation"):
        policy_loss(logp, mask, adv, norm="batch")


@pytest.mark.parametrize("norm", ["sequence", "token"])
def test_clipped_loss_on_first_step_equals_plain_loss(norm):
    logits, tokens, mask, adv = _batch(seed=3)
    logp = _token_logp(logits, tokens)
    plain, _ = policy_loss(logp, mask, adv, norm=norm)
    (g_plain,) = torch.autograd.grad(plain, logits)

    logp = _token_logp(logits, tokens)
    clipped, stats = policy_loss(logp, mask, adv, norm=norm, old_token_logp=logp.detach(), clip_eps=0.2)
    (g_clip,) = torch.autograd.grad(clipped, logits)

    torch.testing.assert_close(clipped, plain, atol=1e-12, rtol=0)
    torch.testing.assert_close(g_clip, g_plain, atol=1e-12, rtol=0)
    assert stats["clip_frac"].item() == 0.0
    assert stats["ratio_mean"].item() == pytest.approx(1.0)


def test_clipping_zeroes_gradient_outside_trust_region():
    eps = 0.2
    logp = torch.zeros(2, 4, dtype=DT, requires_grad=True)
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 1, 0]], dtype=DT)
    adv = torch.tensor([1.0, -1.0], dtype=DT)
    # ratio = exp(logp - old) = exp(-old); chosen per token:
    #   row 0 (A > 0): 1.5 clipped, 1.1 inside, 0.5 inside (min keeps the lower, unclipped rho A), 1.3 clipped
    #   row 1 (A < 0): 0.5 clipped, 1.5 inside (pessimistic side), 0.7 clipped, padding
    ratios = torch.tensor([[1.5, 1.1, 0.5, 1.3], [0.5, 1.5, 0.7, 1.0]], dtype=DT)
    old = -torch.log(ratios)
    loss, stats = policy_loss(logp, mask, adv, norm="sequence", old_token_logp=old, clip_eps=eps)
    loss.backward()
    clipped = torch.tensor([[True, False, False, True], [True, False, True, False]])
    assert torch.all(logp.grad[clipped] == 0)
    # Unclipped tokens get the importance-weighted gradient -A rho / B.
    expected = -(adv[:, None] * ratios) / 2 * mask
    torch.testing.assert_close(logp.grad[~clipped], expected[~clipped])
    assert stats["clip_frac"].item() == pytest.approx(4 / 7)  # 4 clipped of 7 response tokens


def test_clipped_gradient_equals_textbook_ppo_surrogate():
    # The value shift that makes step one equal the REINFORCE loss must not change any gradient.
    logits, tokens, mask, adv = _batch(seed=5)
    gen = torch.Generator().manual_seed(9)
    old = (_token_logp(logits, tokens) + 0.4 * torch.randn(mask.shape, generator=gen, dtype=DT)).detach()
    eps = 0.2
    ours, _ = policy_loss(
        _token_logp(logits, tokens), mask, adv, norm="sequence", old_token_logp=old, clip_eps=eps
    )
    (g_ours,) = torch.autograd.grad(ours, logits)

    ratio = torch.exp(_token_logp(logits, tokens) - old)
    a = adv[:, None]
    textbook = -(torch.minimum(ratio * a, ratio.clamp(1 - eps, 1 + eps) * a) * mask).sum(1).mean()
    (g_text,) = torch.autograd.grad(textbook, logits)
    torch.testing.assert_close(g_ours, g_text, atol=1e-12, rtol=0)


def test_kl_estimators_zero_at_reference_and_k3_nonnegative():
    gen = torch.Generator().manual_seed(0)
    logp = -torch.rand(1000, generator=gen, dtype=DT) * 10
    assert torch.all(kl_k1(logp, logp) == 0)
    assert torch.all(kl_k3(logp, logp) == 0)
    ref = logp + torch.randn(1000, generator=gen, dtype=DT) * 3
    assert torch.all(kl_k3(logp, ref) >= 0)
    tiny = torch.full((5,), -1.0, dtype=torch.float32)
    assert torch.all(kl_k3(tiny, tiny + torch.tensor([1e-8, -1e-8, 1e-7, -1e-7, 1e-6])) >= 0)
    r = ref - logp
    torch.testing.assert_close(kl_k3(logp, ref), torch.exp(r) - r - 1)


def test_kl_estimators_are_unbiased_for_categorical_kl():
    gen = torch.Generator().manual_seed(1)
    logp = torch.log_softmax(torch.randn(6, generator=gen, dtype=DT), dim=0)
    logq = torch.log_softmax(torch.randn(6, generator=gen, dtype=DT), dim=0)
    p = logp.exp()
    kl = (p * (logp - logq)).sum()
    assert (p * kl_k1(logp, logq)).sum().item() == pytest.approx(kl.item(), rel=1e-12)
    assert (p * kl_k3(logp, logq)).sum().item() == pytest.approx(kl.item(), rel=1e-12)


def test_sequence_kl_and_shaped_reward():
    logp = torch.tensor([[-1.0, -2.0, -3.0], [-1.0, -1.0, -1.0]], dtype=DT, requires_grad=True)
    ref = torch.tensor([[-1.5, -2.0, 0.0], [-2.0, -1.0, -1.0]], dtype=DT)
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]])
    kl = sequence_kl(logp, ref, mask, "k1")
    assert kl.tolist() == [0.5, 1.0]
    kl3 = sequence_kl(logp, ref, mask, "k3")
    assert kl3[0].item() == pytest.approx(math.exp(-0.5) + 0.5 - 1)
    score = torch.tensor([2.0, 1.0], dtype=DT)
    r = shaped_reward(score, kl, beta=0.1)
    assert r.tolist() == pytest.approx([1.95, 0.9])
    assert not r.requires_grad  # the KL enters the reward as a constant
    with pytest.raises(ValueError, match="KL estimator"):
        sequence_kl(logp, ref, mask, "k2")


def test_kl_loss_term_gradient_through_policy_only():
    logp = torch.tensor([[-1.0, -2.0], [-0.5, -0.7]], dtype=DT, requires_grad=True)
    ref = torch.tensor([[-1.2, -1.5], [-0.5, -0.9]], dtype=DT, requires_grad=True)
    mask = torch.tensor([[1, 1], [1, 0]])
    term = kl_loss_term(logp, ref, mask, beta=0.5, estimator="k3", norm="token")
    term.backward()
    r = (ref - logp).detach()
    expected_value = 0.5 * ((torch.exp(r) - r - 1) * mask).sum() / 3
    assert term.item() == pytest.approx(expected_value.item())
    # d/dlogp (e^r - r - 1) with r = ref - logp is 1 - e^r.
    torch.testing.assert_close(logp.grad, 0.5 * (1 - torch.exp(r)) * mask / 3)
    assert ref.grad is None
    zero = kl_loss_term(logp, logp.detach(), mask, beta=1.0)
    assert zero.item() == 0.0


def test_token_entropy():
    logits = torch.zeros(2, 3, 8)
    torch.testing.assert_close(token_entropy(logits), torch.full((2, 3), math.log(8)))
    peaked = torch.tensor([[100.0, 0.0, 0.0]])
    assert token_entropy(peaked).item() == pytest.approx(0.0, abs=1e-6)
