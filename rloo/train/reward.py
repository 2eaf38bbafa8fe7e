"""One reward-model run from the SFT policy's folder: preference pairs built from its labelled samples
(a right and a wrong completion of one prompt), a Bradley-Terry reward model trained on them on one
training loop (resume, the divergence guard, checkpoints), its pairwise accuracy on held-out prompts, and
the output folder (the model, metrics.json, history.json). `rloo reward` runs it on the pipeline's files
(rloo_workflow/stages/reward.py); `rloo.api.train_reward_model` on a notebook's rows.
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch

from rloo.algo.losses import bradley_terry_loss
from rloo.data.prompting import PromptFormat
from rloo.errors import InputError
from rloo.model import distributed, grad_checkpointing, lora, microbatch, models
from rloo.model.logprobs import model_device, sequence_scores
from rloo.progress import Progress
from rloo.reward.preferences import Pair, build_pairs, split_by_prompt
from rloo.reward.verifier import is_correct
from rloo.rollout import generate
from rloo.runtime import autocast, inference_dtype, step_generator
from rloo.settings import Config, ModelConfig
from rloo.settings.training import refuse_batch_over_data
from rloo.train.loop import TrainingLoop, wrapped_with_optimizer, write_model_output
from rloo.train.run_log import RunLog

log = logging.getLogger("rloo.reward")

def sample_pairs(config: Config | Mapping, policy_dir: Path, train: list[dict]) -> tuple[list[Pair], dict]:
    """Sample `samples_per_prompt` completions per prompt from the SFT policy; label; pair them.

    Data-parallel, each process samples its contiguous share of every batch's prompts, with the noise
    one process sampling the whole batch would give those rows (`noise_rows`); the samples are then
    gathered, so every process pairs exactly what one process pairs. (`config`: the settings, or the
    pipeline's config as a dict.)"""
    config = config if isinstance(config, Config) else Config.from_config(config)
    reward_cfg, mc = config.reward, config.model
    tok = models.load_tokenizer(policy_dir, mc.trust_remote_code)
    policy = models.load_causal_lm(policy_dir, **models.load_options(mc))
    fmt = PromptFormat(tok, config.prompt)
    rows = train[: reward_cfg.prompts]
    k = reward_cfg.samples_per_prompt
    rng = random.Random(config.seed)
    pairs: list[Pair] = []
    n_correct = n_samples = 0
    per_batch = max(1, 128 // k)
    progress = Progress("reward: sampling", len(rows), config.progress_every_s, unit="prompt",
                        enabled=distributed.is_main())
    for start in range(0, len(rows), per_batch):
        chunk = rows[start : start + per_batch]
        prompts = [fmt.prompt(r["question"]) for r in chunk]
        lo, hi = distributed.shard(len(chunk), empty_ok=True)
        ids = [fmt.encode(p) for p in prompts[lo:hi] for _ in range(k)]
        mine: list[tuple[str, bool]] = []
        if ids:  # a share may be empty: a last batch with fewer prompts than processes
            with autocast(mc.autocast, model_device(policy)):
                ro = generate(policy, ids, max_new_tokens=reward_cfg.max_new_tokens, eos_id=tok.eos_token_id,
                              pad_id=tok.pad_token_id, generator=step_generator(config.seed, start, stream=3),
                              dtype=inference_dtype(mc.inference_dtype, model_device(policy)),
                              **({"noise_rows": (lo * k, len(chunk) * k)} if distributed.enabled() else {}))
            mine = list(zip(ro.texts(tok), ro.finished.tolist(), strict=True))
        all_texts, all_finished = (list(x) for x in zip(*distributed.gather_objects(mine), strict=True))
        for i, r in enumerate(chunk):
            texts = all_texts[i * k : (i + 1) * k]
            ok = [f and is_correct(t, r["answer"]) for t, f in zip(texts, all_finished[i * k : (i + 1) * k], strict=True)]
            n_correct += sum(ok)
            n_samples += len(ok)
            pairs += build_pairs(start + i, prompts[i], fmt.solution(r["answer"]), texts, ok, 2 * k, rng)
        progress.update(len(chunk))
    progress.close()
    return pairs, {"samples": n_samples, "sample_accuracy": n_correct / max(1, n_samples)}


def pair_ids(fmt: PromptFormat, pairs: list[Pair], max_length: int) -> list[tuple[list[int], list[int]]]:
    """Each pair's (chosen, rejected) token ids, encoded as the RLOO stage's reward encodes its samples
    (`PromptFormat.scored_ids`)."""
    return [(fmt.scored_ids(p.prompt + p.chosen, max_length), fmt.scored_ids(p.prompt + p.rejected, max_length))
            for p in pairs]


def pair_scores(model, fmt: PromptFormat, pairs: list[Pair] | list[tuple[list[int], list[int]]], max_length: int,
                autocast_mode: str, wrapped=None) -> tuple[torch.Tensor, torch.Tensor]:
    """(chosen, rejected) scores [N] in one forward pass over both halves (`pairs`: Pairs, or their
    `pair_ids`). `wrapped`: the DDP / FSDP module the gradient pass runs through (data-parallel
    training; `batching.sequence_scores`)."""
    encoded = pairs if pairs and not isinstance(pairs[0], Pair) else pair_ids(fmt, pairs, max_length)
    ids = [c for c, _ in encoded] + [r for _, r in encoded]
    with autocast(autocast_mode, model_device(model)):
        s = sequence_scores(model, ids, fmt.tokenizer.pad_token_id, wrapped).float()
    return s[: len(encoded)], s[len(encoded) :]


def step_loss(model, wrapped, fmt: PromptFormat, pairs: list[Pair], budget: int, mc: ModelConfig) -> tuple[float, float]:
    """Backward of one step's Bradley-Terry loss (the mean over its pairs), the pairs packed by length
    into micro-batches under `reward.micro_batch_tokens` (a pair, both its texts, is never split); each
    micro-batch's loss is its pairs' sum over the step's pair count. Data-parallel: weighed by this
    rank's share of the step's pairs. Returns (the loss, the pairs whose chosen text scored higher)."""
    scale = distributed.loss_scale(len(pairs)) if distributed.enabled() else 1.0
    encoded = pair_ids(fmt, pairs, mc.max_length)  # once a step: the lengths and the passes read them
    lengths = [2 * max(len(c), len(r)) for c, r in encoded]  # a pair costs two rows as long as its longer text
    parts = microbatch.even(microbatch.pack(lengths, budget))

    def loss_of(rows: torch.Tensor) -> tuple[torch.Tensor, dict[str, float]]:
        c, r = pair_scores(model, fmt, [encoded[i] for i in rows.tolist()], mc.max_length, mc.autocast, wrapped)
        loss = bradley_terry_loss(c, r, None if len(parts) == 1 else len(pairs))
        return (loss * scale if distributed.enabled() else loss), {"wins": float((c > r).sum())}

    loss, counts = microbatch.accumulate(wrapped if wrapped is not None else model, parts, loss_of)
    return loss, counts.get("wins", 0.0)


def accuracy(model, fmt: PromptFormat, pairs: list[Pair], mc: ModelConfig) -> float:
    """`pairwise_accuracy` of a model that may be data-parallel: rank 0 computes it with the whole
    parameters (FSDP: gathered), every rank gets it."""
    with distributed.gathered(model):
        return distributed.on_main(lambda: pairwise_accuracy(model, fmt, pairs, mc.max_length, mc.autocast))


@torch.no_grad()
def pairwise_accuracy(model, fmt: PromptFormat, pairs: list[Pair], max_length: int, autocast_mode: str,
                      batch: int = 64) -> float:
    if not pairs:
        return float("nan")
    wins = 0
    for i in range(0, len(pairs), batch):
        c, r = pair_scores(model, fmt, pairs[i : i + batch], max_length, autocast_mode)
        wins += int((c > r).sum())
    return wins / len(pairs)


def run(config: Config, policy_dir: str | Path, train: list[dict], out_dir: str | Path, work_dir: str | Path,
        fingerprint: str, *, log_to: RunLog | Callable[[dict, int], None] | None = None,
        facts: dict[str, int] | None = None, source: str = "the training rows") -> dict:
    """Build preference pairs from the samples of the policy in `policy_dir` on the first `reward.prompts`
    rows of `train` ({question, answer}), train the reward model (from `reward.init`, else that policy),
    report its held-out pairwise accuracy and write `out_dir` (save_pretrained + metrics.json,
    history.json); return the metrics and the run's facts (times, peak memory, the step it resumed from,
    `facts`).

    Checkpoints go to `work_dir`; one made for the same `fingerprint` (what a checkpoint must match) is
    resumed. The pairs are sampled again on a resume: they depend only on the seed, like each step's batch.
    Every logged step's figures go to `log_to` (a RunLog, or a `log(metrics, step)`). `source` names the
    training rows in errors (the stage: its train.jsonl).

    Data-parallel (`distributed.strategy` ddp or fsdp, the process group set up beforehand), each process
    scores its contiguous share of every step's pairs, its mean loss weighted by its share of the pairs (so
    the averaged gradient is the single-process one); rank 0 evaluates and writes."""
    rc, mc = config.reward, config.model
    policy_dir, out_dir, work_dir = Path(policy_dir), Path(out_dir), Path(work_dir)
    t0 = time.perf_counter()
    pairs, sample_info = sample_pairs(config, policy_dir, train)
    tr_pairs, val_pairs = split_by_prompt(pairs, rc.val_fraction, config.seed)
    if not tr_pairs:
        raise InputError("reward: no preference pairs could be built (every sample was correct, or none)")
    refuse_batch_over_data("reward.batch_size", rc.batch_size, len(tr_pairs),
                           f"{source}: pairs of {min(rc.prompts, len(train))} rows' samples, less reward.val_fraction's",
                           "training pairs")
    t_pairs = time.perf_counter() - t0

    init = rc.init or policy_dir
    model, adapted, tok = reward_model_for_training(init, policy_dir, mc)
    fmt = PromptFormat(tok, config.prompt)
    train_model, opt = wrapped_with_optimizer(model, rc.lr)
    val_before = accuracy(model, fmt, val_pairs, mc)  # before a resume loads the checkpoint's weights
    loop = TrainingLoop.for_stage("reward", config, work_dir, model, opt, None, fingerprint, log=log_to)
    loop.resume()
    t_train = time.perf_counter()
    train_steps(loop, config, model, train_model, opt, fmt, tr_pairs)
    train_seconds = time.perf_counter() - t_train
    model.requires_grad_(False)
    metrics = {
        "pairs": len(pairs),
        "train_pairs": len(tr_pairs),
        "val_pairs": len(val_pairs),
        "val_prompts": len({p.prompt_id for p in val_pairs}),
        "val_accuracy": accuracy(model, fmt, val_pairs, mc),
        "val_accuracy_before_training": val_before,
        "train_accuracy": accuracy(model, fmt, tr_pairs[:128], mc),
        **sample_info,
        "init": str(init),
    }
    timings = loop.record_timings(facts, pair_seconds=t_pairs, train_seconds=train_seconds)
    loop.run_log.metrics({f"reward/{k}": v for k, v in metrics.items() if isinstance(v, (int, float))}, rc.steps)
    loop.check_weights(rc.steps, "the output")
    write_model_output(out_dir, adapted, model, tok, {"metrics.json": metrics, "history.json": loop.history})
    log.info("reward model: %s", {**metrics, **timings})
    return {**metrics, **timings}


def reward_model_for_training(init: str | Path, policy_dir: Path,
                              mc: ModelConfig) -> tuple[torch.nn.Module, lora.Adapted | None, Any]:
    """(the model to train, its LoRA adapters or None, the policy's tokenizer): a sequence-classification
    model from `init` with a new score head; with LoRA, adapters on the backbone and the head trained whole
    (peft's SEQ_CLS task)."""
    tok = models.load_tokenizer(policy_dir, mc.trust_remote_code)
    model, adapted = models.for_training(
        models.load_reward_model(init, trained=False, **models.load_options(mc), trainable=True), mc, "SEQ_CLS")
    model.config.pad_token_id = tok.pad_token_id
    return model, adapted, tok


def train_steps(loop: TrainingLoop, config: Config, model: torch.nn.Module, train_model: torch.nn.Module,
                opt: torch.optim.Optimizer, fmt: PromptFormat, tr_pairs: list[Pair]) -> None:
    """The loop's steps: each a batch of `reward.batch_size` training pairs drawn by (seed, step), its
    Bradley-Terry loss's gradient clipped to `reward.grad_clip` and applied (unless the guard skips it),
    its figures logged every `reward.log_every` steps and at the last."""
    rc, mc = config.reward, config.model
    for step in loop:
        batch_rng = np.random.default_rng([config.seed, step])  # the batch of step N depends on (seed, N) only
        idx = batch_rng.choice(len(tr_pairs), size=rc.batch_size, replace=False)
        if distributed.enabled():  # this rank's contiguous share of the step's pairs, through DDP / FSDP
            lo, hi = distributed.shard(len(idx))
            idx = idx[lo:hi]
        with grad_checkpointing.active(model):  # the model stays in eval mode (no dropout)
            loss_value, wins = step_loss(model, train_model if distributed.enabled() else None, fmt,
                                         [tr_pairs[i] for i in idx], rc.micro_batch_tokens, mc)
        grad_norm = float(distributed.clip_grad_norm_(model.parameters(), rc.grad_clip))
        if loop.finite(step, loss=loss_value, grad_norm=grad_norm):
            opt.step()
        opt.zero_grad(set_to_none=True)
        if step % rc.log_every == 0 or step == rc.steps - 1:
            # The whole step's figures: the ranks' mean of the weighted losses is the step's mean loss.
            value = distributed.mean_over_ranks({"loss": loss_value})["loss"]
            wins, n = distributed.all_sum(wins, len(idx))
            loop.log({"step": step, "reward/loss": value, "reward/train_accuracy": wins / n}, step, loss=f"{value:.3f}",
                     accuracy=f"{wins / n:.2f}")
