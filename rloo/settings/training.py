"""The training stages' sections: `sft`, `reward`, `rloo` (with PPO's, the alarms' and the rollout
correction's settings) and `rollout`. A rule that ties a key to others lives in its section's
`problems(config)`, which validation asks before any stage runs."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Literal

from rloo.algo.names import ESTIMATORS, k_problems
from rloo.errors import InputError
from rloo.settings.fields import Section, setting

# The critic-free estimators (rloo/algo/estimators.py ESTIMATOR_TABLE), then PPO (rloo/train/ppo.py).
ESTIMATOR_NAMES: tuple[str, ...] = (*ESTIMATORS, "ppo")
Estimator = Literal[ESTIMATOR_NAMES]  # type: ignore[valid-type]  # the schema's enum
Alarm = Literal["zero_signal", "kl_without_reward", "length_climb", "sampling_mismatch", "reward_hacking"]


# What the training sections' rules read of the rest of the config (rloo/settings/config.py hands it in):
# the training split's size where the config gives it (DataConfig.train_examples), model.max_length.
Examples = tuple[int, str] | None


def completion_room(key: str, new_tokens: int, context: int) -> list[str]:
    """A completion of `new_tokens` needs a prompt beside it within model.max_length (`context`) tokens."""
    if new_tokens < context:
        return []
    return [f"key '{key}': {new_tokens} new tokens leave no room for a prompt within model.max_length={context} "
            f"(prompt + completion); lower {key} below {context}"]


def batch_within_data(key: str, size: int, found: Examples, cap: Examples = None,
                      rows: str = "training problems") -> list[str]:
    """A batch larger than the training data is refused, at validation where the config gives the split's
    size (`found`, bounded by `cap`) and at run time where the rows are counted (`refuse_batch_over_data`):
    every step would take all of it, so `size` would not be what a step trains on. `rows` names what
    is counted."""
    if found is None:
        return []
    have, source = min([found, *([cap] if cap and cap[0] else [])])
    if size <= have:
        return []
    return [f"key '{key}': {size} is more than the {have} {rows} ({source}); lower {key} to at most {have}"]


def refuse_batch_over_data(key: str, size: int, have: int, source: str, rows: str) -> None:
    """`batch_within_data` at run time, on the `have` rows counted where `source` says: an InputError."""
    if problems := batch_within_data(key, size, (have, source), rows=rows):
        raise InputError(problems[0])


@dataclass(frozen=True)
class SftConfig(Section):
    """Supervised fine-tuning of the reference policy (loss on the solution only)."""

    steps: int = setting(500, minimum=1)
    """Optimizer steps."""
    batch_size: int = setting(64, minimum=1)
    """Examples per step."""
    lr: float = setting(2.0e-3, exclusive_minimum=0)
    """Peak learning rate (AdamW), after warm-up, decayed by a cosine to 0 at `steps`."""
    warmup_steps: int = setting(20, minimum=0)
    """Steps of linear warm-up from 0 to `lr`."""
    weight_decay: float = setting(0.0, minimum=0)
    """AdamW's decoupled weight decay."""
    adam_beta2: float = setting(0.95, exclusive_minimum=0, exclusive_maximum=1)
    """AdamW's second-moment decay; 0.95 avoids the loss spikes 0.999 gives at a high learning rate."""
    grad_clip: float = setting(1.0, exclusive_minimum=0)
    """Largest gradient norm an update applies (larger ones are scaled down to it)."""
    max_train_examples: int | None = setting(None, minimum=1)
    """Train on the first this many training problems only (the embedded tokenizer learns the same texts);
    null = all."""
    max_dropped_share: float = setting(0.05, minimum=0, maximum=1)
    """The share of training examples longer than model.max_length that SFT may drop (they are counted in
    metrics.json); a larger share is an error, since it means the model's context is too short for the
    data (raise model.max_length, or raise this bound knowingly)."""
    eval_examples: int = setting(500, minimum=1)
    """Held-out problems of the final evaluation (its accuracy is in metrics.json)."""
    eval_max_new_tokens: int = setting(96, minimum=1)
    """Longest completion of the final evaluation (tokens); a completion cut off there has no final answer
    and counts as wrong."""
    eval_draws: int = setting(1, minimum=1)
    """Sampled draws per held-out problem in the final eval; accuracy_sampled is their mean."""
    eval_batch_size: int = setting(256, minimum=1)
    """Rows per decoding call in the final eval (it decides each row's sampling noise)."""
    checkpoint_every: int = setting(100, minimum=1)
    """Steps between checkpoints (a killed run resumes from the newest)."""
    max_nonfinite_steps: int = setting(0, minimum=0)
    """Steps whose loss, KL, advantages or gradient norm are not finite that are skipped (never applied,
    counted) before the run stops with an error naming the step; 0 stops at the first."""
    log_every: int = setting(10, minimum=1)
    """Steps between the training loss's log lines (every step goes to MLflow)."""
    min_loss_drop_nats: float = setting(0.1, minimum=0)
    """How far (nats) the final training loss must be below ln(vocabulary size), the loss of a uniform guess
    over the vocabulary; a run that ends closer (it learned nothing, or was wrecked by its learning rate
    and ends near uniform) stops with no output. 0 = no such check. A run whose final loss is not below
    its first step's stops too, whatever this is."""
    micro_batch_tokens: int = setting(32768, minimum=0)
    """Token budget of one forward/backward pass of the SFT update (rows x padded length): a step's rows are
    packed by length into micro-batches under it and their gradients accumulated, so the step's gradient
    equals the whole batch's; peak memory follows the budget, not the batch (a row longer than the budget is
    a micro-batch of its own). 0 = the whole batch in one pass."""

    def problems(self, max_length: int, examples: Examples) -> list[str]:
        cap = (self.max_train_examples, "sft.max_train_examples") if self.max_train_examples else None
        return (completion_room("sft.eval_max_new_tokens", self.eval_max_new_tokens, max_length)
                + batch_within_data("sft.batch_size", self.batch_size, examples, cap))


@dataclass(frozen=True)
class RewardFunctionConfig(Section):
    """One reward function of `reward.source: function` (rloo/reward/functions.py)."""

    name: str = setting(pattern="^[A-Za-z0-9_.-]+$")
    """Logged as train/reward/<name> (MLflow, steps.jsonl) and reported by the evaluation."""
    fn: str = setting()
    """module:function (importable, e.g. rloo.reward.verifier:reward) or path/to/file.py:function (a relative
    path is read from the folder the pipeline runs in)."""
    weight: float = 1.0
    """Its weight in the training reward, the weighted sum of the functions."""
    max_failed_share: float = setting(0.0, minimum=0, maximum=1)
    """The share of a batch's completions this function may raise on (each then a missing reward); more stops
    the run. 0 = any exception stops it."""


@dataclass(frozen=True)
class RewardHttpConfig(Section):
    """reward.source http: POST {prompts, completions, rows} as JSON to `url`, read {rewards: [...]} (one
    number or null per completion)."""

    url: str | None = None
    """The reward server's address (http://host:port/path); no credential in it (api_key_env)."""
    timeout_s: float = setting(60, exclusive_minimum=0)
    """Seconds one request may take before it counts as failed (and is retried)."""
    max_retries: int = setting(2, minimum=0)
    """Retries of a failed request, after waits of 0.5 s, 1 s, 2 s ... (5 s at most)."""
    max_failed_share: float = setting(0.0, minimum=0, maximum=1)
    """The share of requests that may still fail after their retries (their completions then have missing
    rewards); more stops the run, its last checkpoint kept. 0 = the first such failure stops it."""
    api_key_env: str | None = None
    """An environment variable whose value is sent as `Authorization: Bearer <value>` (never a key in the
    URL)."""


@dataclass(frozen=True)
class RewardConfig(Section):
    """What scores RLOO's samples (`source`), and the Bradley-Terry reward model the reward stage trains
    on preference pairs built from SFT samples (every other key)."""

    source: Literal["model", "verifier", "judge", "function", "http"] = "model"
    """What scores RLOO's samples. model = the Bradley-Terry reward model of the reward stage; verifier = the
    final answer against the gold one; judge = the evaluation's judge; function = the weighted sum of
    `functions`; http = a reward server at `http.url` (docs/rewards-and-data.md)."""
    functions: tuple[RewardFunctionConfig, ...] = ()
    """reward.source function: Python reward functions called as TRL calls its own (keyword arguments
    prompts, completions, completion_ids, finished and every column of the data record, each a list of one
    item per completion; they return one float or None per completion). The training reward is the weighted
    sum of those that gave a number (None: missing; all None: a missing reward)."""
    http: RewardHttpConfig = field(default_factory=RewardHttpConfig)
    """The reward server of reward.source http."""
    init: str | None = None
    """Hub id or folder to initialise the reward model from; null = the SFT checkpoint."""
    samples_per_prompt: int = setting(4, minimum=2)
    """SFT samples per prompt that the preference pairs are built from (a right and a wrong one make a pair)."""
    prompts: int = setting(2000, minimum=1)
    """Training prompts sampled for pairs (at most the training split)."""
    val_fraction: float = setting(0.1, exclusive_minimum=0, exclusive_maximum=1)
    """The share of prompts whose pairs are held out: the reward model's pairwise accuracy is measured on them."""
    steps: int = setting(300, minimum=1)
    """Optimizer steps."""
    batch_size: int = setting(32, minimum=1)
    """Pairs per step."""
    checkpoint_every: int = setting(25, minimum=1)
    """Steps between checkpoints (a killed run resumes from the newest)."""
    max_nonfinite_steps: int = setting(0, minimum=0)
    """Steps whose loss or gradient norm are not finite that are skipped (never applied, counted) before the
    run stops with an error naming the step; 0 stops at the first."""
    lr: float = setting(1.0e-3, exclusive_minimum=0)
    """Learning rate (AdamW)."""
    grad_clip: float = setting(1.0, exclusive_minimum=0)
    """Largest gradient norm an update applies (larger ones are scaled down to it)."""
    log_every: int = setting(10, minimum=1)
    """Steps between the logged training figures (reward/loss, reward/train_accuracy: MLflow, history.json),
    the last step always logged."""
    max_new_tokens: int = setting(96, minimum=1)
    """Longest SFT sample the pairs are built from (tokens)."""
    batch_size_score: int = setting(64, minimum=1)
    """Completions the reward model scores per call, as RLOO's reward (reward.source model)."""
    micro_batch_tokens: int = setting(32768, minimum=0)
    """Token budget of one forward/backward pass of the reward model's update (pairs stay whole), rows x
    padded length: a step's rows are packed by length into micro-batches under it and their gradients
    accumulated, so the step's gradient equals the whole batch's. 0 = the whole batch in one pass."""

    def problems(self, max_length: int, cfg: Any) -> list[str]:
        """(`cfg`: the whole config, rloo.settings.Config, which the reward functions' check reads.)"""
        out = completion_room("reward.max_new_tokens", self.max_new_tokens, max_length)
        if self.source == "http" and not self.http.url:
            out.append("key 'reward.http.url': reward.source is 'http' but no URL is set (http://host:port/path)")
        if self.source == "function":
            from rloo.reward.functions import config_problems  # imports the user's modules: only for them

            out += config_problems(cfg)
        return out


@dataclass(frozen=True)
class RolloutCorrectionConfig(Section):
    """Correction of the policy-gradient term for the sampler-trainer mismatch (docs/rollout-correction.md,
    rloo/algo/rollout_correction.py), from the sampler's log-probability of each sampled token (the HF
    sampler records it from its sampling pass, vLLM returns it) and the trainer's of the same token before
    the update. Applied to every estimator and to PPO's surrogate; the mismatch metrics (train/mismatch_*)
    are logged whatever the mode."""

    mode: Literal["auto", "none", "token_tis", "sequence_tis", "token_mask", "sequence_mask"] = "auto"
    """auto: token_tis off-policy (rloo.off_policy_steps 1: the sampler's weights lag the trainer's), none
    synchronous. none: no correction (the embedded default samples with its own float32 trainer). token_tis: each
    token's term times w_t = min(pi_trainer / pi_sampler, cap), a constant (TRL's default with vLLM).
    sequence_tis: every token of a sequence times min(prod_t ratio, cap). token_mask: tokens whose ratio
    leaves [1/cap, cap] are dropped. sequence_mask: whole sequences whose geometric-mean ratio leaves
    [1/cap, cap] are dropped. Logged: train/correction_truncated_share, train/correction_masked_share
    (shares of tokens)."""
    cap: float = setting(2.0, exclusive_minimum=1)
    """C: the truncation of the importance weights, and the band [1/C, C] of the masks and of
    train/mismatch_out_of_band."""
    mismatch_every: int = setting(0, minimum=0)
    """Off-policy only (rloo.off_policy_steps 1): every this many steps, one more forward pass of the trainer's,
    under the lagged weights that sampled the batch, splits the sampler-to-trainer ratio into the
    sampler-trainer mismatch (train/mismatch_*, which the sampling_mismatch alarm reads) and the policy lag
    (train/lag_*). 0 = never: the sampling_mismatch alarm is then off. A synchronous run measures the
    mismatch at every step without it."""

    def resolved(self, off_policy: bool) -> RolloutCorrectionConfig:
        """This section with `auto` replaced by the mode it stands for (token_tis off-policy, else none)."""
        if self.mode != "auto":
            return self
        return dataclasses.replace(self, mode="token_tis" if off_policy else "none")

    @property
    def applied(self) -> bool:
        """Whether weights or masks enter the loss (every mode but `none`, which only measures) once
        `resolved`."""
        if self.mode == "auto":
            raise ValueError("rloo.rollout_correction.mode auto: resolve it first (RolloutCorrectionConfig.resolved)")
        return self.mode != "none"


@dataclass(frozen=True)
class PpoConfig(Section):
    """PPO's own settings (rloo.estimator = ppo); the other estimators ignore them."""

    gamma: float = setting(1.0, minimum=0, maximum=1)
    """GAE discount."""
    lam: float = setting(0.95, minimum=0, maximum=1)
    """GAE lambda."""
    epochs: int = setting(2, minimum=1)
    """Passes over each batch."""
    minibatches: int = setting(2, minimum=1)
    """Minibatches per pass (rows split evenly)."""
    whiten_advantages: bool = True
    """Whiten the per-token advantages (zero mean, unit variance over the batch's tokens)."""
    value_clip: float = setting(0.2, exclusive_minimum=0)
    """Clip range of the value update."""
    critic_lr: float = setting(1.0e-4, exclusive_minimum=0)
    """The critic's learning rate (its own AdamW)."""
    critic_init: Literal["policy", "reward_model"] = "policy"
    """The critic's backbone: the SFT policy (a new value head) or the trained reward model (its scalar head
    reused at every position)."""


@dataclass(frozen=True)
class AlarmConfig(Section):
    """Thresholds of the failure-mode alarms (rloo/train/alarms.py). Each per-step alarm tests a window of
    steps, not one batch; the defaults were chosen from measured healthy and failing runs
    (docs/failure-modes.md gives each one's false positives and firing steps)."""

    window: int = setting(50, minimum=1)
    """Steps each per-step alarm reads (the last this many); none fires before this many steps."""
    z: float = setting(3.0, exclusive_minimum=0)
    """One-sided margin, in standard errors, that a level or a change must clear to count."""
    zero_signal_share: float = setting(0.5, minimum=0, maximum=1)
    """zero_signal: the share of groups with k equal rewards that the window's mean must exceed (by z
    standard errors, with the share not falling)."""
    kl_rise: float = setting(0.5, exclusive_minimum=0)
    """kl_without_reward: the rise of the mean sequence KL (nats) from the window's first half to its second
    that counts as a climb, when the reward did not rise by z standard errors (healthy runs of the embedded
    default: at most 0.2)."""
    length_rise: float = setting(0.1, exclusive_minimum=0)
    """length_climb: the relative rise of the mean response length from the window's first quarter to its
    last (rising through all four, by z standard errors, the reward not)."""
    hacking_z: float = setting(2.0, exclusive_minimum=0)
    """reward_hacking: how many standard errors of a difference of two proportions the validation accuracy
    must fall below its best while the proxy reward rises."""
    mismatch_kl: float = setting(2.0e-4, exclusive_minimum=0)
    """sampling_mismatch: the per-token KL(sampler || trainer) in nats (train/mismatch_k3_token,
    docs/rollout-correction.md) that the window's mean must exceed by z standard errors (embedded default,
    50-step window means: at most 5.2e-5 sampling at T = 1 with a float32 sampler against the bf16-autocast
    trainer, at least 5.1e-4 at T = 1.1 and 2.6e-3 at T = 1.2)."""


@dataclass(frozen=True)
class RlooConfig(Section):
    """The RLOO stage: k samples per prompt, the KL-shaped sequence reward, the advantage estimator, the
    update, validation, checkpoints and the alarms."""

    estimator: Estimator = "rloo"
    """The advantage estimator: the critic-free ones on each prompt's k sequence rewards, or ppo (a learned
    critic, per-token KL rewards and GAE; settings under rloo.ppo). Same sampling, reward, evaluation and
    checkpoints for all of them."""
    k: int = setting(4, minimum=1)
    """Samples per prompt: the group whose other members are each sample's baseline (`k_problems`)."""
    prompts_per_step: int = setting(16, minimum=1)
    """Prompts per step (B); a step trains on B x k samples."""
    steps: int = setting(150, minimum=1)
    """Optimizer steps (one batch each, or `updates_per_batch`)."""
    lr: float = setting(5.0e-5, exclusive_minimum=0)
    """Peak learning rate (AdamW)."""
    warmup_steps: int = setting(5, minimum=0)
    """Steps of linear warm-up from 0 to `lr`."""
    lr_schedule: Literal["constant", "linear", "cosine"] = "constant"
    """After warm-up: constant (a finished run can be extended by raising `steps` and resumes exactly), or a
    linear / cosine decay to `min_lr_ratio` of the peak at `steps` (then `steps` is part of the checkpoint
    fingerprint: a longer run starts afresh)."""
    min_lr_ratio: float = setting(0.0, minimum=0, maximum=1)
    """The decaying schedules' final learning rate, as a share of `lr`."""
    weight_decay: float = setting(0.0, minimum=0)
    """AdamW's decoupled weight decay."""
    beta: float = setting(0.05, minimum=0)
    """β: the weight of the KL to the frozen reference in the shaped reward R̃ = r − β KL (or in the loss)."""
    kl_estimator: Literal["k1", "k3"] = "k1"
    """The per-token KL estimate summed over a completion: k1 = log π/π_ref, k3 = (π_ref/π − 1) − log(π_ref/π)."""
    kl_in: Literal["reward", "loss"] = "reward"
    """Where β KL enters: the sequence reward before the baseline (the method's form) or a separate loss term."""
    loss_norm: Literal["sequence", "token"] = "sequence"
    """The loss's normaliser: the step's completions (each completion's summed term counts once) or its tokens."""
    updates_per_batch: int = setting(1, minimum=1)
    """Optimizer steps per batch; above 1 each reuses the batch with PPO's clipped ratio (`clip_eps`)."""
    clip_eps: float = setting(0.2, exclusive_minimum=0)
    """The ratio clip of the reused updates (updates_per_batch > 1) and of PPO's surrogate."""
    max_new_tokens: int = setting(96, minimum=1)
    """Longest sampled completion (tokens); a completion cut off here gets no reward."""
    min_solution_steps: int = setting(0, minimum=0)
    """Train only on prompts whose reference solution has at least this many reasoning lines (a difficulty
    filter: groups on prompts the policy always solves carry no signal); 0 keeps all."""
    dynamic_sampling: bool = False
    """DAPO's dynamic sampling: a group whose task rewards do not differ (fewer than two finite rewards, or
    all equal; the KL shaping is not counted) is dropped and the batch is refilled from further prompts until
    it holds `prompts_per_step` groups with signal (needs k >= 2). Logged: train/dynamic_dropped_frac,
    train/extra_samples, train/dynamic_rounds, train/dynamic_groups."""
    dynamic_sampling_max_rounds: int = setting(4, minimum=1)
    """Extra generation rounds per step at most (each samples at most `prompts_per_step` prompts). Still short
    after them, the step trains on the groups with signal found; with none at all, on the step's first
    `prompts_per_step` groups, as without dynamic sampling."""
    temperature: float = setting(1.0, exclusive_minimum=0)
    """Sampling temperature; other than 1 biases the estimator (a loud warning says so)."""
    top_p: float = setting(1.0, exclusive_minimum=0, maximum=1)
    """Nucleus sampling's mass; below 1 biases the estimator (a loud warning says so)."""
    top_k: int = setting(0, minimum=0)
    """Sample among the k likeliest tokens only; 0 = all. Above 0 biases the estimator (a loud warning)."""
    grad_clip: float = setting(1.0, exclusive_minimum=0)
    """Largest gradient norm an update applies (larger ones are scaled down to it)."""
    moving_average_decay: float = setting(0.9, minimum=0, maximum=1)
    """The moving_average estimator's baseline: b ← decay b + (1 − decay) mean reward."""
    checkpoint_every: int = setting(25, minimum=1)
    """Steps between checkpoints (a killed run resumes from the newest)."""
    max_nonfinite_steps: int = setting(0, minimum=0)
    """Steps whose loss, KL, advantages or gradient norm are not finite that are skipped (never applied,
    counted) before the run stops with an error naming the step; 0 stops at the first."""
    keep_checkpoints: int = setting(2, minimum=1)
    """Checkpoints kept, at most (the newest, the one written at a SIGINT or SIGTERM included; older ones are
    removed once a newer one is complete)."""
    eval_every: int = setting(50, minimum=0)
    """Evaluate on the validation split every this many steps (and after the last); 0 never."""
    eval_examples: int = setting(200, minimum=1)
    """Validation problems of each evaluation (the first this many of val.jsonl; the same ones every time, so
    that two evaluations differ by the policy alone)."""
    eval_draws: int = setting(1, minimum=1)
    """Sampled draws per validation problem; eval/accuracy_sampled is their mean."""
    eval_batch_size: int = setting(256, minimum=1)
    """Rows per decoding call in the validation eval (it decides each row's sampling noise)."""
    micro_batch_tokens: int = setting(32768, minimum=0)
    """Token budget of one forward/backward pass of the policy update, and of the reference and old-log-prob
    passes (PPO's critic too), rows x padded length: a step's rows are packed by length into micro-batches
    under it and their gradients accumulated, so the step's gradient equals the whole batch's; peak memory
    follows the budget, not the batch (a row longer than the budget is a micro-batch of its own). 0 = the
    whole batch in one pass."""
    off_policy_steps: int = setting(0, minimum=0, maximum=1)
    """How many updates the sampling weights lag behind the trained ones. 0 = synchronous: each step samples
    with the weights it then updates. 1 = one-step off-policy: the batch of step t is sampled with the
    weights after step t-2 (steps 0 and 1 both with the starting weights), so that sampling the next batch
    overlaps this step's update (rollout.sampler_threads; docs/method.md). The samples depend only on (seed,
    step, the weights that sampled them), never on timing: a run is the same bytes however the two overlap,
    and resumes to them."""
    rollout_correction: RolloutCorrectionConfig = field(default_factory=RolloutCorrectionConfig)
    """Correction of the policy gradient for the sampler-trainer mismatch and, off-policy, the policy lag
    (docs/rollout-correction.md)."""
    ppo: PpoConfig = field(default_factory=PpoConfig)
    """PPO's own settings (rloo.estimator = ppo)."""
    select: Literal["best", "last"] = "best"
    """The policy the stage writes: best = the evaluation of highest validation sampled accuracy (the starting
    policy, step 0, included; needs eval_every > 0), last = the final weights."""
    alarms: AlarmConfig = field(default_factory=AlarmConfig)
    """Thresholds of the failure-mode alarms (docs/failure-modes.md)."""
    stop_on: tuple[Alarm, ...] = ("reward_hacking",)
    """Alarms that stop training when they fire (reward_hacking: the training reward rose while validation
    accuracy fell beyond noise). The policy written still follows `select`."""

    def problems(self, max_length: int, examples: Examples, strategy: str = "none") -> list[str]:
        """(`strategy`: distributed.strategy.)"""
        out = [f"key 'rloo.k': {p}, got {self.k}" for p in k_problems(self.estimator, self.k, self.dynamic_sampling)]
        if self.select == "best" and not self.eval_every:
            out.append("key 'rloo.select': 'best' picks a checkpoint by validation accuracy and needs "
                       "rloo.eval_every > 0 (or set rloo.select: last)")
        return (out + self.off_policy_problems(strategy)
                + completion_room("rloo.max_new_tokens", self.max_new_tokens, max_length)
                + batch_within_data("rloo.prompts_per_step", self.prompts_per_step, examples))

    def off_policy_problems(self, strategy: str) -> list[str]:
        """The combinations with `off_policy_steps` 1 that are not built."""
        if not self.off_policy_steps:
            return []
        out = []
        if strategy != "none":
            out.append(f"key 'rloo.off_policy_steps': 1 with distributed.strategy={strategy}: the off-policy sampler "
                       "runs beside one training process; set distributed.strategy none or rloo.off_policy_steps 0")
        if self.estimator == "remax":
            out.append("key 'rloo.off_policy_steps': 1 with rloo.estimator=remax: its greedy baseline would be the "
                       "current policy's while the samples are the lagged one's; set rloo.off_policy_steps 0")
        return out


@dataclass(frozen=True)
class RolloutConfig(Section):
    """rollout: which engine samples the RLOO stage's completions (hf or vllm) and vLLM's memory share."""

    backend: Literal["hf", "vllm"] = "hf"
    """hf = the trainer's own model (a lean decode loop for Llama-family models); vllm = a vLLM engine in the
    stage's process, its weights synced in place after every update (docs/vllm.md)."""
    gpu_memory_utilization: float = setting(0.3, exclusive_minimum=0, maximum=1)
    """The share of the GPU's memory vLLM may take (the trainer's networks share the GPU with it)."""
    sampler_threads: int | None = setting(None, minimum=0)
    """Off-policy only (rloo.off_policy_steps 1): torch threads of the sampler process, which holds its own copy
    of the weights and samples (and scores) the next batch while the trainer updates on this one; the trainer
    keeps the rest of `threads`. null = half of `threads` (at least 1). 0 = no sampler process: the trainer
    samples each lagged batch itself before its update (the sequential emulation: the same bytes, no overlap).
    Like `threads`, it changes how fast, never what a run computes: it reruns nothing."""
