"""Policy-gradient loss, KL estimators and reward shaping for RLOO-style training.

Shapes: ``token_logp``, ``token_logp_ref``, ``old_token_logp`` and ``mask`` are ``[B, T]`` (one row per
sampled response, response tokens only where ``mask`` is 1); ``advantages`` are ``[B]`` (one per
response, RLOO) or ``[B, T]`` (one per token, PPO); per-sequence values are ``[B]``. Stats are returned as detached 0-d tensors so the caller decides when to synchronise a device.
"""

from __future__ import annotations

from typing import Literal

import torch

Norm = Literal["sequence", "token"]
KLEstimator = Literal["k1", "k3"]

# exp() of a log-ratio above ~88 overflows float32; a policy that far from its reference is broken anyway,
# so the k3 log-ratio is clamped instead of letting inf/NaN reach the optimiser.
_MAX_LOG_RATIO = 20.0


def _mask_like(mask: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    if mask.shape != ref.shape:
        raise ValueError(f"mask shape {tuple(mask.shape)} does not match token tensor {tuple(ref.shape)}")
    return mask.to(ref.dtype)


def kl_k1(logp: torch.Tensor, logp_ref: torch.Tensor) -> torch.Tensor:
    """Per-token k1 estimate of KL(pi || ref): log pi - log ref (unbiased, can be negative)."""
    return logp - logp_ref


def kl_k3(logp: torch.Tensor, logp_ref: torch.Tensor) -> torch.Tensor:
    """Per-token k3 estimate of KL(pi || ref): exp(r) - r - 1 with r = log ref - log pi (unbiased, >= 0)."""
    r = (logp_ref - logp).clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO)
    # expm1 keeps precision for small r; the clamp removes the last-ulp negatives rounding can leave.
    return (torch.expm1(r) - r).clamp_min(0.0)


def _pick(table: dict, name: str, what: str):
    if name not in table:
        raise ValueError(f"unknown {what} {name!r}; valid: {', '.join(map(repr, table))}")
    return table[name]


def token_kl(logp: torch.Tensor, logp_ref: torch.Tensor, estimator: KLEstimator) -> torch.Tensor:
    """Per-token KL(pi || ref) by the chosen estimator (k1 or k3), [B, T]."""
    return _pick({"k1": kl_k1, "k3": kl_k3}, estimator, "KL estimator")(logp, logp_ref)


def sequence_kl(
    token_logp: torch.Tensor,
    token_logp_ref: torch.Tensor,
    mask: torch.Tensor,
    estimator: KLEstimator = "k1",
) -> torch.Tensor:
    """Per-sequence KL [B]: the chosen per-token estimate summed over response tokens."""
    m = _mask_like(mask, token_logp)
    return (token_kl(token_logp, token_logp_ref, estimator) * m).sum(dim=1)


def shaped_reward(score: torch.Tensor, seq_kl: torch.Tensor, beta: float) -> torch.Tensor:
    """KL-shaped sequence reward R = score - beta * KL, with the KL treated as a constant (detached)."""
    return score - beta * seq_kl.detach()


# Sequence: sum over a response's tokens (its log-probability), mean over responses: the estimator itself.
# Token: every response token in the batch weighs the same, whatever the length of its response.
_AGGREGATE = {
    "sequence": lambda terms, m: (terms * m).sum(dim=1).mean(),
    "token": lambda terms, m: (terms * m).sum() / m.sum().clamp(min=1.0),
}


def _aggregate(token_terms: torch.Tensor, m: torch.Tensor, norm: Norm, denominator: float | None = None) -> torch.Tensor:
    """The loss over `m`'s rows by `norm`; with `denominator` (the whole step's responses under
    `sequence`, its tokens under `token`) the sum over these rows divided by it instead: a micro-batch's
    share of the step's loss, so that the micro-batches' gradients add up to the step's."""
    if denominator is None:
        return _pick(_AGGREGATE, norm, "loss normalisation")(token_terms, m)
    _pick(_AGGREGATE, norm, "loss normalisation")
    return (token_terms * m).sum() / max(float(denominator), 1.0)


def policy_loss(
    token_logp: torch.Tensor,
    mask: torch.Tensor,
    advantages: torch.Tensor,
    *,
    norm: Norm = "sequence",
    old_token_logp: torch.Tensor | None = None,
    clip_eps: float = 0.2,
    denominator: float | None = None,
    weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """REINFORCE loss -mean_i A_i sum_t log pi(y_it), or its per-token PPO-clipped form given old log-probs.

    Every token of response i gets that response's sequence-level advantage A_i, or its own A_it when
    ``advantages`` is [B, T] (advantages are treated as constants). With ``old_token_logp`` the per-token ratio rho = exp(logp - old_logp) is
    clipped to [1 - eps, 1 + eps] pessimistically, as in PPO. ``denominator``: these rows are a
    micro-batch of a step with that many responses (``sequence``) or tokens (``token``). ``weights``
    [B, T]: the rollout correction's constants w_t (rloo.algo.rollout_correction), each token's term
    becomes w_t A_t (log pi or its clipped ratio); None applies nothing.
    """
    if token_logp.dim() != 2:
        raise ValueError(f"token_logp must be [B, T], got shape {tuple(token_logp.shape)}")
    if advantages.shape not in (token_logp.shape[:1], token_logp.shape):
        raise ValueError(
            f"advantages must be [B]={token_logp.shape[0]} (one per response) or [B, T]={tuple(token_logp.shape)} "
            f"(one per token), got {tuple(advantages.shape)}"
        )
    m = _mask_like(mask, token_logp)
    adv = advantages.detach().to(token_logp.dtype)
    adv = adv.unsqueeze(1) if adv.dim() == 1 else adv
    if weights is not None:  # w_t A_t: the correction scales the term, it is never differentiated
        adv = adv * weights.detach().to(adv.dtype)
    n_tokens = m.sum()

    if old_token_logp is None:
        terms = -adv * token_logp
        loss = _aggregate(terms, m, norm, denominator)
        zero = torch.zeros((), dtype=token_logp.dtype, device=token_logp.device)
        return loss, {"clip_frac": zero, "ratio_mean": zero + 1.0, "n_tokens": n_tokens.detach()}

    if old_token_logp.shape != token_logp.shape:
        raise ValueError(
            f"old_token_logp shape {tuple(old_token_logp.shape)} != token_logp {tuple(token_logp.shape)}"
        )
    old = old_token_logp.detach()
    ratio = torch.exp(token_logp - old)
    unclipped = ratio * adv
    clipped = ratio.clamp(1.0 - clip_eps, 1.0 + clip_eps) * adv
    surrogate = torch.minimum(unclipped, clipped)
    # PPO's surrogate min(rho A, clip(rho) A) equals A on the first step instead of A * logp. Adding the
    # theta-independent term A * (old_logp - 1) changes no gradient but makes the loss value coincide
    # with the plain REINFORCE loss when rho = 1 (and stay close to it, since rho - 1 ~ log rho), so
    # logged losses are comparable between one and several steps per batch.
    terms = -(surrogate + adv * (old - 1.0))
    loss = _aggregate(terms, m, norm, denominator)

    with torch.no_grad():
        # A token is clipped when the min picks the flat branch: the ratio has moved past the trust
        # region in the direction its advantage pushes it.
        was_clipped = ((adv > 0) & (ratio > 1.0 + clip_eps)) | ((adv < 0) & (ratio < 1.0 - clip_eps))
        denom = n_tokens.clamp(min=1.0)
        stats = {
            "clip_frac": (was_clipped.to(m.dtype) * m).sum() / denom,
            "ratio_mean": (ratio * m).sum() / denom,
            "n_tokens": n_tokens.detach(),
        }
    return loss, stats


def kl_loss_term(
    token_logp: torch.Tensor,
    token_logp_ref: torch.Tensor,
    mask: torch.Tensor,
    beta: float,
    estimator: KLEstimator = "k3",
    norm: Norm = "sequence",
    denominator: float | None = None,
) -> torch.Tensor:
    """beta * KL as a loss term (gradient through token_logp), aggregated like policy_loss.

    Use this instead of ``shaped_reward`` to put the penalty in the loss. Prefer k3 here: the gradient of
    the k1 term is the score function, whose expectation under on-policy samples is zero.
    """
    m = _mask_like(mask, token_logp)
    per_token = token_kl(token_logp, token_logp_ref.detach(), estimator)
    return beta * _aggregate(per_token, m, norm, denominator)


def token_rewards(scores: torch.Tensor, kl: torch.Tensor, mask: torch.Tensor, beta: float) -> torch.Tensor:
    """PPO's per-token rewards [B, T]: r_t = -beta * kl_t on every response token, plus the sequence score
    on the last one, so that sum_t r_t = score - beta * KL, the sequence reward RLOO shapes. With tools the
    mask is the policy's tokens (rloo/rollout/tools.py): the score goes to the last of them, which a
    forced run may follow."""
    m = _mask_like(mask, kl)
    rewards = -beta * kl.detach() * m
    last = (((m > 0) * torch.arange(1, m.shape[1] + 1, device=m.device)).amax(1) - 1).clamp(min=0)
    return rewards.scatter_add(1, last[:, None], (scores.to(rewards.dtype) * (m.sum(1) > 0))[:, None])


def value_loss(
    values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor, clip_eps: float,
    denominator: float | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Clipped value loss, mean over response tokens: 0.5 * max((V - R)^2, (V_old + clip(V - V_old, ±eps) - R)^2).

    Stats: the share of tokens where the clipped branch was the larger (the value moved past its trust
    region), and the explained variance 1 - Var(R - V_old) / Var(R) of the values the advantages used.
    """
    m = _mask_like(mask, values)
    old, ret = old_values.detach(), returns.detach()
    clipped = old + (values - old).clamp(-clip_eps, clip_eps)
    err, err_clipped = (values - ret) ** 2, (clipped - ret) ** 2
    n = m.sum().clamp(min=1.0)
    # `denominator`: the tokens of the whole minibatch these rows are a micro-batch of.
    loss = 0.5 * (torch.maximum(err, err_clipped) * m).sum() / (n if denominator is None else max(denominator, 1.0))
    with torch.no_grad():
        stats = {"value_clip_frac": ((err_clipped > err).to(m.dtype) * m).sum() / n,
                 "explained_variance": explained_variance(old, ret, m)}
    return loss, stats


def explained_variance(values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """1 - Var(R - V) / Var(R) over the response tokens: 1 is a perfect critic, 0 no better than a constant."""
    m = _mask_like(mask, values)
    n = m.sum().clamp(min=1.0)

    def var(x: torch.Tensor) -> torch.Tensor:
        mean = (x * m).sum() / n
        return (((x - mean) ** 2) * m).sum() / n

    return 1.0 - var(returns - values) / var(returns).clamp(min=1e-8)


def approx_kl(token_logp: torch.Tensor, old_token_logp: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """k3 estimate of KL(pi_old || pi) over response tokens: how far an update moved the policy."""
    m = _mask_like(mask, token_logp)
    return (kl_k3(old_token_logp.detach(), token_logp.detach()) * m).sum() / m.sum().clamp(min=1.0)


def token_entropy(logits: torch.Tensor) -> torch.Tensor:
    """Entropy of the next-token distribution at every position, [..., V] -> [...], in float32."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    return -(logp.exp() * logp).sum(dim=-1)


def bradley_terry_loss(chosen: torch.Tensor, rejected: torch.Tensor, denominator: float | None = None) -> torch.Tensor:
    """Bradley-Terry: -mean log σ(r_chosen - r_rejected), the reward model's pairwise likelihood
    (with `denominator`: the sum over these pairs divided by the step's pair count)."""
    terms = -torch.nn.functional.logsigmoid(chosen.float() - rejected.float())
    return terms.mean() if denominator is None else terms.sum() / max(float(denominator), 1.0)
