"""What the policy-gradient trainers share: RLOO's `RlooTrainer` (rloo/train/rloo_trainer.py) and PPO's `PPOTrainer`
(rloo/train/ppo.py) each add their advantage and their update (`update(step, got, t0)`) to this.

Shared: the policy (LoRA, grad checkpointing, DDP / FSDP), the frozen reference, the optimizer and its
schedule, the reward; the prompts; each step's scored groups (`collect`, synchronous or off-policy); the
log-probability passes and the micro-batches; the rollout correction; the step's closing metrics and the
alarms; the validation evaluation.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import time
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path

import torch

from rloo.algo.estimators import MovingBaseline
from rloo.algo.schedules import lr_multiplier
from rloo.data.gsm8k import cite
from rloo.data.prompting import PromptFormat
from rloo.errors import InputError
from rloo.eval.evaluation import evaluate_policy, spec_for
from rloo.model import distributed, grad_checkpointing, lora, microbatch, models
from rloo.model.logprobs import SeqBatch, completion_logprobs, completion_logprobs_and_entropy, model_device
from rloo.reward.rewards import RewardSource
from rloo.rollout import Rollout, make_rollout
from rloo.rollout.collect import Collected
from rloo.runtime import autocast
from rloo.settings import Config
from rloo.train import alarms
from rloo.train.batches import StepBatches
from rloo.train.correction import StepCorrection, step_correction
from rloo.train.loop import stop_if_not_finite
from rloo.train.off_policy import LaggedBatches
from rloo.train.preflight import check_settings
from rloo.train.step_metrics import collection_metrics

log = logging.getLogger("rloo.train")


def policy_tokens(ro: Rollout, batch: SeqBatch) -> torch.Tensor:
    """The tokens an update trains on, as `batch`'s completion mask is typed: the policy's own (a tool's
    forced tokens are not: no policy-gradient term, no KL, no entropy, no value target, no importance
    weight, no mismatch), all of the completion without tools."""
    return batch.completion_mask if ro.policy_mask is None else ro.policy_mask.to(batch.completion_mask.dtype)


class PolicyTrainer:
    """Holds the policy, the frozen reference, the optimizer and the reward; `step()` is one step of the
    subclass's `update` on the scored groups of `collect(step)`."""

    def __init__(self, config: Config | Mapping, policy_dir: str | Path, reward: RewardSource, train: list[dict],
                 source: str = "the rows handed in") -> None:
        # (`source` names the prompts `train` in errors: the stage's train.jsonl)
        # the typed config (a validated dict is read once, here)
        self.config = sections = config if isinstance(config, Config) else Config.from_config(config)
        self.rc, self.mc, self.seed = sections.rloo, sections.model, sections.seed
        rc = self.rc
        # Asked before every optimizer step with the step's loss, KL, advantages and gradient norm; the
        # RLOO stage hands in its TrainingLoop's (which may skip a step); alone, any non-finite one stops.
        self.guard: Callable[..., bool] = stop_if_not_finite
        check_settings(sections, len(train), source)
        self.tokenizer = models.load_tokenizer(policy_dir, self.mc.trust_remote_code)
        # With LoRA (`self.adapted`) the policy is the model with adapters injected, only they train.
        self.policy, self.adapted = models.for_training(
            models.load_causal_lm(policy_dir, **models.load_options(self.mc), trainable=True), self.mc)
        # A checkpointed decoder layer drops the KV cache, so the gradient pass runs the plain forward.
        self.checkpointed = grad_checkpointing.on(self.policy)
        # The module the gradient pass runs through: the policy, DDP around it, or the policy sharded
        # in place by FSDP (rloo/model/distributed.py); sampling and evaluation use `self.policy`.
        self.policy_train = distributed.wrap(self.policy)
        # The reference is frozen by running only under no_grad and staying out of the optimizer. Its
        # parameters keep requires_grad like the policy's because CPU kernels are chosen by that flag
        # (a frozen weight takes another matmul path): the same flag gives bit-identical log-probs, so
        # the measured KL before the first update is exactly 0. With LoRA the reference is the policy with
        # its adapters off (`reference_model`): no second copy.
        self.reference = None if self.adapted else models.load_causal_lm(
            policy_dir, **models.load_options(self.mc), trainable=True)
        self.device = model_device(self.policy)
        self.reward = reward
        self.train = train
        self.prompts, self.prompt_ids = self._render_prompts(train)  # texts for the reward, ids to sample from
        self.optimizer = torch.optim.AdamW(lora.trainable(self.policy), lr=rc.lr, weight_decay=rc.weight_decay)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lr_multiplier(rc.warmup_steps, rc.steps, rc.lr_schedule, rc.min_lr_ratio)
        )
        self.baseline = MovingBaseline(None, rc.moving_average_decay)
        self.history: list[dict] = []
        self.evals: list[dict] = []  # validation evaluations, {"step": updates done, "eval/...": ...}
        self._warned: set[str] = set()  # alarms already announced in the log
        self.alarm_cfg = rc.alarms
        off_policy = rc.off_policy_steps > 0
        # `auto` resolved: token_tis off-policy, none synchronous
        self.correction_settings = rc.rollout_correction.resolved(off_policy)
        # rollout backend (issue 8): `rollout.backend` hf | vllm; a vLLM engine is built once, here. Off-policy
        # the configured backend samples in the lagged sampler, and the trainer keeps no engine of its own.
        own = dataclasses.replace(sections, rollout=dataclasses.replace(sections.rollout, backend="hf"))
        self.rollout = make_rollout(own if off_policy else sections, self.seed, policy_dir, self.policy)
        self.batches = StepBatches(sections, self.tokenizer, self.rollout, reward, train, self.prompts,
                                   self.prompt_ids, self.device, gathered=self.policy)
        # Off-policy (rloo.off_policy_steps 1): the batches sampled with the lagged weights (its sampler
        # starts at the first `collect`, or on resume at `start_lagged` with the checkpointed weights).
        self.lagged = LaggedBatches(sections, str(policy_dir), reward, train, self.prompts, self.prompt_ids,
                                    self.device, self.chunk_rows) if off_policy else None
        self.alarm_skip = self.alarms_not_applicable
        if off_policy and not self.correction_settings.mismatch_every:
            self.alarm_skip += ("sampling_mismatch",)
            log.warning("rloo.off_policy_steps 1 without rloo.rollout_correction.mismatch_every: the sampling_mismatch "
                        "alarm is off (the sampler's ratio to the trainer mixes the policy lag with the mismatch); "
                        "mismatch_every N measures the mismatch alone every N steps")

    # Rows per chunk of the forward passes over the samples (rloo.model.logprobs' completion passes).
    chunk_rows = 16

    # Alarms whose premise this estimator does not share (PPO: its critic, not the group, is the baseline).
    alarms_not_applicable: tuple[str, ...] = ()

    def companions(self) -> dict[str, tuple[torch.nn.Module, torch.optim.Optimizer]]:
        """Trained networks besides the policy, checkpointed with it (none here; PPO's critic)."""
        return {}

    @contextlib.contextmanager
    def reference_model(self) -> Iterator[torch.nn.Module]:
        """The frozen reference for no-grad passes within the block: its own copy, or under LoRA the
        policy with its adapters off (data-parallel: its whole parameters gathered, so that ranks may run
        different numbers of forward passes)."""
        if self.adapted is None:
            yield self.reference
            return
        with distributed.gathered(self.policy), self.adapted.adapters_off() as frozen:
            yield frozen

    def networks(self) -> dict[str, int]:
        """{network: parameters} of every network this trainer holds (the method's memory argument)."""
        held = {"policy": self.policy, "reference": self.reference, "reward_model": getattr(self.reward, "model", None)}
        return {name: models.count_parameters(m) for name, m in held.items() if m is not None}

    def _render_prompts(self, rows: list[dict]) -> tuple[list[str], list[list[int]]]:
        """Each row's prompt text and ids (rloo.data.prompting: as SFT, the reward model and the evaluation)."""
        fmt = PromptFormat(self.tokenizer, self.config.prompt)
        limit = self.mc.max_length - self.rc.max_new_tokens
        texts = [fmt.prompt(row["question"]) for row in rows]
        ids = [fmt.encode(p) for p in texts]
        too_long = [i for i, p in enumerate(ids) if len(p) > limit]
        if too_long:
            first = too_long[0]
            raise InputError(
                f"{cite(rows[first], first)}: a training prompt of {len(ids[first])} tokens, longer than "
                f"model.max_length - rloo.max_new_tokens = {limit} ({len(too_long)} of {len(rows)} training prompts "
                "are); raise model.max_length, or shorten or remove those prompts"
            )
        return texts, ids

    # -- one step ---------------------------------------------------------------------------------
    def collect(self, step: int) -> Collected:
        """The groups step `step` trains on (rloo/train/batches.py): k samples for each of its B prompts,
        scored; with `rloo.dynamic_sampling`, only groups whose raw rewards differ, refilled from further
        prompts. Depends on (seed, step) and the sampling weights only, and on no loss: the live policy's,
        or off-policy (`rloo.off_policy_steps` 1) the weights before the previous update
        (rloo/train/off_policy.py), after which this step's weights go to the sampler for step + 1."""
        if self.lagged is None:
            return self.batches.collect(step)
        return self.lagged.collect(step, self.policy)

    def start_lagged(self, step: int, state: dict[str, torch.Tensor] | None) -> None:
        """Off-policy: sample `step` next with the weights `state` (a checkpoint's `lagged_state()`), else the
        policy's (a fresh run). A no-op synchronous."""
        if self.lagged is not None:
            self.lagged.start(step, self.policy, state)

    def lagged_state(self) -> dict[str, torch.Tensor]:
        """Off-policy: the weights that sample the next batch, for the checkpoint ({} synchronous)."""
        return self.lagged.state() if self.lagged is not None else {}

    def close(self) -> None:
        """End the off-policy sampler and free a vLLM engine's memory (and its process)."""
        if self.lagged is not None:
            self.lagged.close()
        self.rollout.close()

    def _logprobs(self, model: torch.nn.Module, batch: SeqBatch, chunk_rows: int,
                  entropy: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Token log-probabilities of `batch`'s completions under `model` (and its entropies)."""
        chunk = self.mc.logits_chunk_tokens  # the head's tokens per chunk: no [rows, T, V] logits
        if entropy:
            return completion_logprobs_and_entropy(model, batch, chunk_rows, logits_chunk_tokens=chunk)
        return completion_logprobs(model, batch, chunk_rows, logits_chunk_tokens=chunk), None

    def _policy_pass(self, distinct: SeqBatch, inverse: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Token log-probabilities under the policy (with gradient) and its entropy at each position, of
        every row: computed once per distinct row and indexed out (the gradient sums over the copies).
        Data-parallel, one forward call through DDP / FSDP (`chunk_rows=0`), the same count on every rank."""
        model, chunk_rows = (self.policy_train, 0) if distributed.enabled() else (self.policy, self.chunk_rows)
        with autocast(self.mc.autocast, self.device), grad_checkpointing.active(self.policy):
            lp, ent = self._logprobs(model, distinct, 0 if self.checkpointed else chunk_rows, entropy=True)
        return lp[inverse], ent[inverse]

    def parts(self, batch: SeqBatch, budget: int | None = None) -> list[microbatch.Part]:
        """`batch`'s rows in micro-batches under `rloo.micro_batch_tokens` (rows x (prompt block + their
        longest completion)), as many on every rank."""
        budget = self.rc.micro_batch_tokens if budget is None else budget
        lengths = batch.prompt_len + batch.completion_mask.sum(1).long()
        return microbatch.even(microbatch.pack(lengths, budget))

    def step(self, step: int) -> dict:
        """One step: the subclass's `update` on the groups of `collect(step)` (the same groups for every
        estimator, dynamic sampling too)."""
        t0 = time.perf_counter()
        return self.update(step, self.collect(step), t0)

    def update(self, step: int, got: Collected, t0: float | None = None) -> dict:
        """The update of step `step` on the scored groups `got`, and the step's metrics: the estimator's."""
        raise NotImplementedError

    def correction(self, ro: Rollout, old_lp: torch.Tensor, mask: torch.Tensor,
                   lagged_lp: torch.Tensor | None = None) -> StepCorrection:
        """The sampler-trainer mismatch of these rows and the weights of `rloo.rollout_correction` (None
        under mode none, what `auto` means synchronous): rloo/train/correction.py. Off-policy the ratio
        also holds the policy lag, which `lagged_lp` (the trainer's log-probabilities under the weights
        that sampled, where measured) separates from the mismatch."""
        return step_correction(ro, old_lp, mask, self.correction_settings, self.config.rollout.backend,
                               off_policy=self.lagged is not None, lagged_lp=lagged_lp)

    def _complete(self, metrics: dict, got: Collected, times: tuple[float, float, float, float]) -> dict:
        """A step's metrics plus what every trainer adds (`step_metrics.collection_metrics`: the
        dynamic-sampling stats, the time of each phase) and the alarms the metrics raise."""
        metrics.update(collection_metrics(got, times))
        metrics.update(self._alarms(metrics))
        return metrics

    def _alarms(self, m: dict) -> dict:
        flags = alarms.step_flags([*self.history, m], self.alarm_cfg, self.alarm_skip)
        for name, on in flags.items():
            if on and name not in self._warned:
                log.warning("alarm/%s fired at step %d (docs/failure-modes.md)", name, m["step"] + 1)
                self._warned.add(name)
        return {f"alarm/{k}": int(v) for k, v in flags.items()}

    # -- evaluation during training: selection and the reward-hacking check ---------------------------
    def evaluate(self, rows: list[dict], n: int, draws: int) -> dict:
        """Validation accuracy (greedy, and sampled as the mean of `draws` draws per problem) and the
        training reward's mean over the sampled completions (the proxy the policy is optimised for).
        Data-parallel, rank 0 evaluates (the whole parameters gathered) and every rank gets its figures."""
        spec = spec_for(self.config, "rloo", self.rc.max_new_tokens, draws, stream=11)
        with distributed.gathered(self.policy):
            report = distributed.on_main(lambda: evaluate_policy(
                self.policy, self.tokenizer, rows[:n], spec, proxy=self.reward, label="validation")[0])
        return {
            "eval/accuracy_sampled": report["accuracy_sampled"],
            "eval/accuracy_greedy": report["accuracy"],
            "eval/proxy_reward": math.nan if report["proxy_reward"] is None else report["proxy_reward"],
        }
