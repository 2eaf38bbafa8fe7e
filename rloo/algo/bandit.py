"""The single-prompt bandit experiment: what a baseline buys, measured against the exact gradient.

Setup (seed 0 reproduces the reference numbers): ``numpy.random.default_rng(seed)`` draws 32 logits
~ N(0, 1) and then q_a ~ Beta(1, 3) for the 32 responses, in that order. Response a succeeds with
probability q_a and its reward is success + 2 (an uncentred reward, as from a reward model). The
objective is J = sum_a pi_a q_a, whose exact gradient with respect to the logits is pi * (q - J).
With this draw J = 0.304 at the start, |grad J| = 0.052 and the best response has q = 0.693.

Each gradient estimate uses one group of k samples: (1/k) sum_i A_i grad log pi(y_i), with
grad log pi(a) = e_a - pi for a softmax over logits. Reported per (method, k), over n independent
estimates: ``bias`` = |mean estimate - true gradient|, ``variance`` = trace of the estimates' covariance
(squared deviation from their mean, summed over the 32 logits, averaged over estimates), and ``ratio`` =
<mean estimate, true> / |true|^2 (1 for an unbiased estimator, (k-1)/k for a group mean that includes
the sample itself). REINFORCE is averaged over the same k samples as the others, so every row at a
given k spends the same number of samples; the quoted no-baseline variance of 1.297 is this k = 4 row
(the single-sample variance is 5.196, and it falls as 1/k).

The advantages of rloo/grpo/grpo_std/reinforce/moving_average come from ``rloo.algo.estimators``, so the
experiment exercises the package's own estimators; ``oracle`` subtracts the true E[R] = J + 2.

Training end points: runs with a good baseline all land at J = 0.665 after 300 steps. Without a baseline
a fraction of runs (about 14 % over 100 seeds) locks onto the response with q = 0.496, so REINFORCE's
mean and spread over 10 seeds depend on how many of them do (one here; three would give the quoted
0.608 +- 0.088).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from rloo.algo import estimators as est
from rloo.algo import rollout_correction
from rloo.algo.names import GROUP_ESTIMATORS, k_problems

N_ACTIONS = 32
REWARD_OFFSET = 2.0
ESTIMATOR_METHODS: tuple[str, ...] = ("reinforce", "rloo", "grpo", "grpo_std", "oracle")
# (method, k) pairs trained; k is the group size for group baselines and ignored by the others.
TRAIN_METHODS: tuple[tuple[str, int], ...] = (
    ("reinforce", 1),
    ("rloo", 4),
    ("moving_average", 1),
    ("grpo", 4),
    ("oracle", 1),
)
MOVING_AVERAGE_DECAY = 0.9


@dataclass(frozen=True)
class Bandit:
    logits: np.ndarray  # [N_ACTIONS] initial policy logits
    q: np.ndarray  # [N_ACTIONS] success probability of each response


def make_bandit(seed: int = 0, n_actions: int = N_ACTIONS) -> Bandit:
    """Draw the problem: logits ~ N(0, 1) first, then q ~ Beta(1, 3), from default_rng(seed)."""
    rng = np.random.default_rng(seed)
    logits = rng.normal(size=n_actions)
    q = rng.beta(1.0, 3.0, size=n_actions)
    return Bandit(logits=logits, q=q)


def softmax(logits: np.ndarray) -> np.ndarray:
    """Softmax over the last axis."""
    z = logits - logits.max(axis=-1, keepdims=True)
    e = np.exp(z)
    return e / e.sum(axis=-1, keepdims=True)


def expected_success(logits: np.ndarray, q: np.ndarray) -> np.ndarray:
    """J = sum_a pi_a q_a (over the last axis)."""
    return softmax(logits) @ q


def exact_gradient(logits: np.ndarray, q: np.ndarray) -> np.ndarray:
    """dJ/dlogits = pi * (q - J), the gradient every estimator is judged against."""
    pi = softmax(logits)
    return pi * (q - pi @ q)


def sample_actions(pi: np.ndarray, shape: tuple[int, ...], rng: np.random.Generator) -> np.ndarray:
    """Draw actions from the categorical pi by inverting its CDF."""
    cdf = np.cumsum(pi)
    # Clip guards against the last CDF entry rounding to just below a uniform draw.
    return np.minimum(np.searchsorted(cdf, rng.random(shape), side="right"), len(pi) - 1)


def sample_rewards(q: np.ndarray, actions: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """Bernoulli(q_a) success plus the constant offset."""
    return (rng.random(actions.shape) < q[actions]).astype(np.float64) + REWARD_OFFSET


def score_function_gradients(pi: np.ndarray, actions: np.ndarray, adv: np.ndarray) -> np.ndarray:
    """Per group [n, k] -> [n, A]: (1/k) sum_i A_i (e_{a_i} - pi); pi is [A] or one row per group [n, A]."""
    n, k = actions.shape
    n_actions = pi.shape[-1]
    flat = (np.arange(n)[:, None] * n_actions + actions).ravel()
    grads = np.bincount(flat, weights=adv.ravel(), minlength=n * n_actions).reshape(n, n_actions)
    grads -= adv.sum(axis=1, keepdims=True) * pi
    return grads / k


def group_advantages(method: str, rewards: np.ndarray, expected_reward: float | np.ndarray) -> np.ndarray:
    """Advantages [n, k] for the estimator-comparison methods; oracle uses the true expected reward."""
    if method == "oracle":
        return rewards - np.asarray(expected_reward).reshape(-1, 1)
    r = torch.from_numpy(rewards)
    return est.compute_advantages(method, r).advantages.numpy()


def estimator_stats(
    bandit: Bandit, k: int, methods: tuple[str, ...], n_estimates: int, rng: np.random.Generator
) -> list[dict[str, Any]]:
    """Bias, total variance and shrinkage ratio of each method from n independent k-sample estimates."""
    pi = softmax(bandit.logits)
    true = exact_gradient(bandit.logits, bandit.q)
    expected_reward = float(pi @ bandit.q) + REWARD_OFFSET
    # Common random numbers: every method sees the same samples, so the comparison between methods is
    # not blurred by each drawing its own.
    actions = sample_actions(pi, (n_estimates, k), rng)
    rewards = sample_rewards(bandit.q, actions, rng)
    rows = []
    for method in methods:
        if k_problems(method, k):
            continue
        grads = score_function_gradients(pi, actions, group_advantages(method, rewards, expected_reward))
        mean = grads.mean(axis=0)
        rows.append(
            {
                "method": method,
                "k": k,
                "bias": float(np.linalg.norm(mean - true)),
                "variance": float(((grads - mean) ** 2).sum(axis=1).mean()),
                "ratio": float(mean @ true / (true @ true)),
            }
        )
    return rows


def off_policy_estimates(bandit: Bandit, sampler_logits: np.ndarray, k: int, n_estimates: int,
                         rng: np.random.Generator, mode: str = "none", cap: float = 2.0) -> np.ndarray:
    """[n, A] RLOO estimates of grad J at the bandit's policy pi from groups drawn by another sampler mu
    (softmax of `sampler_logits`): (1/k) sum_i w_i A_i (e_{a_i} - pi), w from
    rloo.algo.rollout_correction (one token per response: token and sequence modes coincide), w = 1 under none."""
    pi, mu = softmax(bandit.logits), softmax(sampler_logits)
    actions = sample_actions(mu, (n_estimates, k), rng)
    adv = group_advantages("rloo", sample_rewards(bandit.q, actions, rng), 0.0)
    if mode != "none":
        trainer_lp = torch.from_numpy(np.log(pi)[actions].reshape(-1, 1))
        sampler_lp = torch.from_numpy(np.log(mu)[actions].reshape(-1, 1))
        c = rollout_correction.correction_weights(trainer_lp, sampler_lp, torch.ones_like(trainer_lp), mode, cap)
        adv = adv * c.weights.numpy().reshape(n_estimates, k)
    return score_function_gradients(pi, actions, adv)


def train(
    bandit: Bandit,
    method: str,
    k: int,
    seeds: list[int],
    steps: int,
    batch: int,
    lr: float,
    ma_decay: float = MOVING_AVERAGE_DECAY,
) -> np.ndarray:
    """Plain gradient ascent on the logits, one run per seed; returns J after each step, [seeds, steps+1].

    Each step draws ``batch`` samples; group methods split them into batch // k groups of k. The update
    is lr times the average of A_i grad log pi(y_i) over the whole batch.
    """
    if method in GROUP_ESTIMATORS and batch % k:
        raise ValueError(f"batch {batch} is not a multiple of k={k}")
    n_seeds = len(seeds)
    rngs = [np.random.default_rng(s) for s in seeds]
    logits = np.tile(bandit.logits, (n_seeds, 1))
    baselines: list[float | None] = [None] * n_seeds
    curve = np.empty((n_seeds, steps + 1))
    curve[:, 0] = expected_success(logits, bandit.q)
    for step in range(steps):
        pi = softmax(logits)
        actions = np.stack([sample_actions(pi[s], (batch,), rngs[s]) for s in range(n_seeds)])
        rewards = np.stack([sample_rewards(bandit.q, actions[s], rngs[s]) for s in range(n_seeds)])
        if method == "oracle":
            adv = rewards - (pi @ bandit.q + REWARD_OFFSET)[:, None]
        elif method == "moving_average":
            # One running baseline per run, over that run's whole batch (one prompt = one group).
            adv = np.empty_like(rewards)
            for s in range(n_seeds):
                a, baselines[s] = est.moving_average_advantages(
                    torch.from_numpy(rewards[s : s + 1]), baselines[s], ma_decay
                )
                adv[s] = a.numpy()[0]
        elif method in GROUP_ESTIMATORS:
            grouped = torch.from_numpy(rewards.reshape(-1, k))
            adv = est.compute_advantages(method, grouped).advantages.numpy().reshape(n_seeds, batch)
        elif method == "reinforce":
            adv = est.reinforce_advantages(torch.from_numpy(rewards)).numpy()
        else:
            raise ValueError(f"unknown toy training method {method!r}")
        # Each run's whole batch is one "group" here: the update averages A_i grad log pi(y_i) over it.
        logits = logits + lr * score_function_gradients(pi, actions, adv)
        curve[:, step + 1] = expected_success(logits, bandit.q)
    return curve


def run_toy(
    seed: int = 0,
    n_estimates: int = 20000,
    ks: tuple[int, ...] = (2, 4, 8),
    train_steps: int = 300,
    train_batch: int = 64,
    lr: float = 2.0,
    n_seeds: int = 10,
) -> dict[str, Any]:
    """Run the estimator comparison and the training comparison; returns a JSON-serialisable dict.

    The result is a pure function of the arguments (no timings or paths), so reruns are byte-identical.
    """
    bandit = make_bandit(seed)
    true = exact_gradient(bandit.logits, bandit.q)

    estimator_rows: list[dict[str, Any]] = []
    for k in ks:
        # A separate stream per k keeps each k's numbers independent of which other ks were requested.
        rng = np.random.default_rng([seed, 1, k])
        estimator_rows.extend(estimator_stats(bandit, k, ESTIMATOR_METHODS, n_estimates, rng))

    train_seeds = [int(x) for x in np.random.SeedSequence([seed, 2]).generate_state(n_seeds)]
    training_rows: list[dict[str, Any]] = []
    curves: dict[str, list[float]] = {}
    for method, k in TRAIN_METHODS:
        curve = train(bandit, method, k, train_seeds, train_steps, train_batch, lr)
        final = curve[:, -1]
        label = f"{method} (k={k})" if method in GROUP_ESTIMATORS else method
        training_rows.append(
            {
                "method": method,
                "k": k,
                "final_mean": float(final.mean()),
                # Sample std (ddof=1) across seeds: the seed-to-seed spread of the end point.
                "final_std": float(final.std(ddof=1)) if n_seeds > 1 else 0.0,
                "seeds": [float(x) for x in final],
            }
        )
        # Six decimals is far below seed-to-seed noise and keeps the JSON small.
        curves[label] = [round(float(x), 6) for x in curve.mean(axis=0)]

    return {
        "estimators": estimator_rows,
        "training": training_rows,
        "true_grad_norm": float(np.linalg.norm(true)),
        "start_success": float(expected_success(bandit.logits, bandit.q)),
        "best_q": float(bandit.q.max()),
        "reinforce_single_sample_variance": _reinforce_single_sample_variance(bandit),
        "training_curves": curves,
        "config": {
            "seed": seed,
            "n_actions": N_ACTIONS,
            "reward_offset": REWARD_OFFSET,
            "n_estimates": n_estimates,
            "ks": list(ks),
            "train_steps": train_steps,
            "train_batch": train_batch,
            "lr": lr,
            "n_seeds": n_seeds,
            "moving_average_decay": MOVING_AVERAGE_DECAY,
            "train_seeds": train_seeds,
        },
    }


def _reinforce_single_sample_variance(bandit: Bandit) -> float:
    """Closed form of tr Cov[R (e_a - pi)] for one sample: E[R^2 |e_a - pi|^2] - |grad J|^2."""
    pi = softmax(bandit.logits)
    q = bandit.q
    second_moment = q * (1 + REWARD_OFFSET) ** 2 + (1 - q) * REWARD_OFFSET**2
    sq_norm = 1.0 - 2.0 * pi + pi @ pi
    true = exact_gradient(bandit.logits, q)
    return float(pi @ (second_moment * sq_norm) - true @ true)


def plot_toy(result: dict[str, Any], png_path: str) -> None:
    """Three panels: variance vs k, mean/true ratio vs k, expected success during training."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["estimators"]
    methods = list(dict.fromkeys(r["method"] for r in rows))
    ks = sorted({r["k"] for r in rows})
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))

    ax = axes[0]
    for m in methods:
        pts = sorted((r["k"], r["variance"]) for r in rows if r["method"] == m)
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=m)
    ax.set_xscale("log", base=2)
    ax.set_xticks(ks, [str(k) for k in ks])
    ax.set_yscale("log")
    ax.set_xlabel("k (samples per estimate)")
    ax.set_ylabel("total variance of gradient estimate")
    ax.set_title(f"Variance (|true grad| = {result['true_grad_norm']:.3f})")
    ax.legend()

    ax = axes[1]
    for m in methods:
        pts = sorted((r["k"], r["ratio"]) for r in rows if r["method"] == m)
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=m)
    ax.plot(ks, [(k - 1) / k for k in ks], "k--", lw=1, label="(k-1)/k")
    ax.set_xscale("log", base=2)
    ax.set_xticks(ks, [str(k) for k in ks])
    ax.set_xlabel("k")
    ax.set_ylabel("<mean estimate, true> / |true|^2")
    ax.set_title("Shrinkage of the expected gradient")
    ax.legend()

    ax = axes[2]
    for label, curve in result.get("training_curves", {}).items():
        ax.plot(range(len(curve)), curve, label=label)
    ax.axhline(result["best_q"], color="k", ls=":", lw=1, label=f"best q = {result['best_q']:.3f}")
    ax.set_xlabel("step")
    ax.set_ylabel("expected success (mean over seeds)")
    ax.set_title("Training, lr on logits")
    ax.legend(fontsize=8)

    fig.tight_layout()
    fig.savefig(png_path, dpi=110, format="png")
    plt.close(fig)


def summary_table(result: dict[str, Any]) -> str:
    """Plain-text rendering of the result, for logs and reports."""
    lines = [
        f"true grad norm {result['true_grad_norm']:.4f}  start success {result['start_success']:.3f}  "
        f"best q {result['best_q']:.3f}",
        f"{'method':<10}{'k':>3}{'bias':>10}{'variance':>11}{'ratio':>8}",
    ]
    for r in result["estimators"]:
        lines.append(
            f"{r['method']:<10}{r['k']:>3}{r['bias']:>10.4f}{r['variance']:>11.4f}{r['ratio']:>8.3f}"
        )
    lines.append(f"{'method':<16}{'k':>3}{'final mean':>12}{'std':>8}")
    for r in result["training"]:
        lines.append(f"{r['method']:<16}{r['k']:>3}{r['final_mean']:>12.3f}{r['final_std']:>8.3f}")
    return "\n".join(lines)


__all__ = [
    "ESTIMATOR_METHODS",
    "TRAIN_METHODS",
    "Bandit",
    "estimator_stats",
    "exact_gradient",
    "expected_success",
    "make_bandit",
    "off_policy_estimates",
    "plot_toy",
    "run_toy",
    "score_function_gradients",
    "summary_table",
    "train",
]
