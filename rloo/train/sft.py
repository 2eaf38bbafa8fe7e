"""One SFT run from a model folder: supervised fine-tuning on question → solution (the loss on the
solution and its EOS only), on one training loop (resume, the divergence guard, checkpoints), then the
trained policy evaluated on held-out rows and written with its metrics. `rloo sft` runs it on the
pipeline's files (rloo_workflow/stages/sft.py); `rloo.api.train_sft` on a notebook's rows.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from rloo.algo.schedules import lr_multiplier
from rloo.data.prompting import PromptFormat, align_eos
from rloo.errors import InputError, UserError
from rloo.eval.evaluation import evaluate_policy, spec_for
from rloo.model import checkpoint, distributed, lora, microbatch, models
from rloo.model.head import causal_logprobs
from rloo.model.logprobs import model_device
from rloo.runtime import autocast
from rloo.settings import Config, PromptConfig, SftConfig
from rloo.settings.training import refuse_batch_over_data
from rloo.tools import result_tokens, triggers
from rloo.train.loop import TrainingLoop, wrapped_with_optimizer, write_model_output
from rloo.train.run_log import RunLog

log = logging.getLogger("rloo.sft")


class LearnedNothingError(UserError, RuntimeError):
    """An SFT run ended with finite weights but a loss that shows it learned nothing."""


def learned_nothing(history: list[dict], vocab_size: int, min_drop_nats: float) -> str | None:
    """Why the losses of `history` (the logged steps' `sft/loss`) show a run that learned nothing, or None:
    the final loss is not below the first step's (with two steps or more logged), or not below
    ln(vocab_size), a uniform guess's loss, by `min_drop_nats` (0: that check off). A learning rate far too
    high can leave finite weights whose predictions are near uniform, which the divergence guard passes."""
    losses = [(r["step"], r["sft/loss"]) for r in history if "sft/loss" in r]
    if not losses:
        return None
    (first_step, first), (last_step, last) = losses[0], losses[-1]
    if last_step > first_step and not last < first:
        return f"the final training loss {last:.4f} (step {last_step}) is not below the first step's {first:.4f}"
    uniform = math.log(vocab_size)
    if min_drop_nats > 0 and not last < uniform - min_drop_nats:
        return (f"the final training loss {last:.4f} (step {last_step}) is not below ln({vocab_size}) = {uniform:.4f}, "
                f"a uniform guess over the vocabulary, by sft.min_loss_drop_nats={min_drop_nats:g}")
    return None


@dataclass
class Example:
    ids: list[int]
    n_prompt: int
    tool: tuple[int, ...] = ()  # positions of the tokens a tool writes (with tools: the loss skips them)


def tokenize(records: list[dict], tokenizer, prompt_cfg: PromptConfig | dict, max_length: int,
             triggers: list[tuple[str, str, str]] | None = None) -> tuple[list[Example], int]:
    """Prompt + solution + EOS token ids (rloo.data.prompting: the bare template or the chat template, the
    loss on the solution and its EOS only); examples longer than max_length are dropped and counted.
    `triggers` (the enabled tools', rloo.tools.triggers): the annotations' results and closing markers
    (`24>>` of `<<48/2=24>>`) are the tool's tokens, which the loss skips: SFT trains the policy to call."""
    fmt = PromptFormat(tokenizer, prompt_cfg)
    out, too_long = [], 0
    for r in records:
        p = fmt.prompt_ids(r["question"])
        c = fmt.solution_ids(r["answer"])
        if len(p) + len(c) > max_length:
            too_long += 1
            continue
        tool = tuple(len(p) + j for j in result_tokens(tokenizer, c, triggers)) if triggers else ()
        out.append(Example(p + c, len(p), tool))
    return out, too_long


def batch_indices(lengths: np.ndarray, step: int, batch_size: int, seed: int) -> np.ndarray:
    """The examples of `step`: a seeded epoch permutation, sorted by length within chunks of 32 batches.

    Depends only on (seed, step), so a resumed run sees exactly the batches it would have seen.
    """
    per_epoch = max(1, len(lengths) // batch_size)
    epoch, pos = divmod(step, per_epoch)
    perm = np.random.default_rng([seed, epoch]).permutation(len(lengths))[: per_epoch * batch_size]
    chunk = 32 * batch_size
    start = (pos * batch_size) // chunk * chunk
    block = perm[start : start + chunk]
    block = block[np.argsort(lengths[block], kind="stable")]
    batches = block.reshape(-1, batch_size)
    order = np.random.default_rng([seed, epoch, start]).permutation(len(batches))
    return batches[order[(pos * batch_size - start) // batch_size]]


def collate(examples: list[Example], pad_id: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    # Widths rounded up to a multiple of 16: few distinct shapes keep the CPU allocator from fragmenting.
    width = -(-max(len(e.ids) for e in examples) // 16) * 16
    ids = torch.full((len(examples), width), pad_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    labels = torch.full_like(ids, -100)
    for i, e in enumerate(examples):
        n = len(e.ids)
        ids[i, :n] = torch.tensor(e.ids)
        mask[i, :n] = 1
        labels[i, e.n_prompt : n] = ids[i, e.n_prompt : n]
        if e.tool:
            labels[i, list(e.tool)] = -100
    return ids, mask, labels


def step_loss(train_model: torch.nn.Module, batch: list[Example], pad_id: int, budget: int, autocast_mode: str,
              device: torch.device, logits_chunk_tokens: int = 0) -> float:
    """Backward of one step's loss (the mean over the batch's answer tokens), its examples packed by
    length into micro-batches under `sft.micro_batch_tokens`; returns the loss. Each micro-batch's loss
    is its answer tokens' summed NLL over the whole batch's count (HF's `num_items_in_batch`), so the
    gradients add up to the batch's. Data-parallel: weighed by this rank's share of the step's tokens.
    `logits_chunk_tokens` > 0: the log-probabilities through the head in chunks (rloo.model.head), never
    the [rows, T, vocabulary] logits HF's loss upcasts to float32."""
    # The answer tokens the loss averages over: every label position after the first token, a tool's not.
    n_tokens = sum(len(e.ids) - max(e.n_prompt, 1) - len(e.tool) for e in batch)
    scale = distributed.loss_scale(float(n_tokens)) if distributed.enabled() else 1.0
    parts = microbatch.even(microbatch.pack([len(e.ids) for e in batch], budget))
    one_pass = len(parts) == 1

    def loss_of(rows: torch.Tensor) -> torch.Tensor:
        ids, mask, labels = (t.to(device) for t in collate([batch[i] for i in rows.tolist()], pad_id))
        with autocast(autocast_mode, device):
            if logits_chunk_tokens:
                targets = F.pad(labels[:, 1:], (0, 1), value=-100)  # position t predicts token t + 1
                answer = targets != -100
                logp = causal_logprobs(train_model, ids, mask, None, targets, answer, logits_chunk_tokens)
                loss = -(logp * answer).sum() / max(n_tokens, 1)
            else:
                extra = {} if one_pass else {"num_items_in_batch": torch.tensor(max(n_tokens, 1), device=device)}
                loss = train_model(input_ids=ids, attention_mask=mask, labels=labels, use_cache=False, **extra).loss
        return loss * scale if distributed.enabled() else loss

    return microbatch.accumulate(train_model, parts, loss_of)[0]


def run(config: Config, policy_dir: str | Path, rows: list[dict], out_dir: str | Path, work_dir: str | Path,
        fingerprint: str, *, test: list[dict], log_to: RunLog | Callable[[dict, int], None] | None = None,
        facts: dict[str, int] | None = None, source: str = "the training rows") -> dict:
    """Fine-tune the model in `policy_dir` (the base stage's) on the rows `rows` ({question, answer}), evaluate it on the first
    `sft.eval_examples` rows of `test` and write `out_dir` (save_pretrained + metrics.json, history.json);
    return the metrics and the run's facts (times, peak memory, the step it resumed from, `facts`).

    Checkpoints go to `work_dir`; one made for the same `fingerprint` (what a checkpoint must match) is
    resumed. Every logged step's figures go to `log_to` (a RunLog, or a `log(metrics, step)`). `source`
    names the training rows in errors (the stage: its train.jsonl).

    Data-parallel (`distributed.strategy` ddp or fsdp under torchrun, the process group set up beforehand),
    each process trains on its contiguous share of every step's batch, its loss weighted by its share of
    the batch's answer tokens (so the averaged gradient is the single-process one); rank 0 evaluates and
    writes."""
    sc, mc = config.sft, config.model
    out_dir, work_dir, init = Path(out_dir), Path(work_dir), Path(policy_dir)
    train = rows[: sc.max_train_examples] if sc.max_train_examples else rows
    tokenizer = models.load_tokenizer(init, mc.trust_remote_code)
    model, adapted = policy_for_training(init, tokenizer, config)
    device = model_device(model)  # before FSDP shards it
    examples, too_long = training_examples(train, tokenizer, config, source)
    # validation refuses a batch above the split; the cap and the examples dropped as too long can still cut it
    refuse_batch_over_data("sft.batch_size", sc.batch_size, len(examples),
                           f"{source}: {len(train)} rows, {too_long} longer than model.max_length", "training examples")
    train_model, optimizer = wrapped_with_optimizer(model, sc.lr, weight_decay=sc.weight_decay,
                                                    betas=(0.9, sc.adam_beta2))
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_multiplier(sc.warmup_steps, sc.steps, "cosine", floor=0.1))
    loop = TrainingLoop.for_stage("sft", config, work_dir, model, optimizer, scheduler, fingerprint, log=log_to)
    loop.resume()

    t0 = time.perf_counter()
    tokens = train_steps(loop, config, model, train_model, optimizer, scheduler, examples, sc.batch_size,
                         tokenizer.pad_token_id, device)
    train_seconds = time.perf_counter() - t0
    stop_if_learned_nothing(loop, model, sc)
    (tokens,) = distributed.all_sum(tokens) if distributed.enabled() else (tokens,)
    metrics = evaluated(model, tokenizer, test, config)
    metrics.update(
        {
            "steps": sc.steps,
            "train_examples": len(examples),
            "dropped_too_long": too_long,
            "parameters": models.count_parameters(model),
            "final_loss": loop.history[-1]["sft/loss"] if loop.history else None,
        }
    )
    # Tokens of this process's steps (a resumed run counts from its checkpoint).
    timings = loop.record_timings(facts, train_seconds=train_seconds, tokens_per_second=tokens / max(train_seconds, 1e-9))
    loop.run_log.metrics({f"sft/eval_{k}": v for k, v in metrics.items() if isinstance(v, (int, float))}, sc.steps)
    loop.check_weights(sc.steps, "the output")
    write_model_output(out_dir, adapted, model, tokenizer, {"metrics.json": metrics, "history.json": loop.history})
    log.info("sft done: %s", {**{k: metrics[k] for k in ("accuracy", "accuracy_sampled")}, **timings})
    return {**metrics, **timings}


def policy_for_training(init: Path, tokenizer, config: Config) -> tuple[torch.nn.Module, lora.Adapted | None]:
    """(the model to train, its LoRA adapters or None): the causal LM of `init`, with LoRA the adapters
    injected and only they trained; its EOS set to the chat template's end-of-turn token where the
    prompt's template has one."""
    model, adapted = models.for_training(models.load_causal_lm(init, **models.load_options(config.model),
                                                               trainable=True), config.model)
    if eos := align_eos(tokenizer, config.prompt):  # saved with the policy: every later stage stops there
        models.set_generation_ids(model, tokenizer)
        log.info("EOS set to the chat template's end-of-turn token %s", eos)
    return model, adapted


def training_examples(train: list[dict], tokenizer, config: Config, source: str) -> tuple[list[Example], int]:
    """`tokenize`'s examples of `train` and the count dropped as longer than model.max_length; an
    InputError naming `source` where there is none, none fits, or more than sft.max_dropped_share is
    dropped."""
    sc, mc = config.sft, config.model
    examples, too_long = tokenize(train, tokenizer, config.prompt, mc.max_length, triggers(config))
    if not train:
        raise InputError(f"{source}: no training examples")
    if too_long / len(train) > sc.max_dropped_share:
        raise InputError(
            f"{source}: {too_long} of {len(train)} training examples "
            f"({too_long / len(train):.0%}) are longer than model.max_length={mc.max_length} tokens, more than "
            f"sft.max_dropped_share={sc.max_dropped_share}; raise model.max_length (or that share)")
    if not examples:
        raise InputError(f"{source}: no example fits model.max_length={mc.max_length}")
    if too_long:
        log.warning("dropped %d of %d training examples longer than model.max_length", too_long, len(train))
    return examples, too_long


def train_steps(loop: TrainingLoop, config: Config, model: torch.nn.Module, train_model: torch.nn.Module,
                optimizer: torch.optim.Optimizer, scheduler, examples: list[Example], batch_size: int,
                pad_id: int, device: torch.device) -> int:
    """The loop's steps: each the batch of `batch_indices` (its share, data-parallel), its loss's gradient
    clipped to `sft.grad_clip` and applied (unless the guard skips it), its figures logged every
    `sft.log_every` steps and at the last. Returns the tokens this process trained on."""
    sc, mc = config.sft, config.model
    lengths = np.array([len(e.ids) for e in examples])
    tokens = 0
    model.train()
    for step in loop:
        idx = batch_indices(lengths, step, batch_size, config.seed)
        if distributed.enabled():  # this rank's contiguous share of the step's batch
            lo, hi = distributed.shard(len(idx))
            idx = idx[lo:hi]
        batch = [examples[i] for i in idx]
        loss_value = step_loss(train_model, batch, pad_id, sc.micro_batch_tokens, mc.autocast, device,
                               mc.logits_chunk_tokens)
        grad_norm = distributed.clip_grad_norm_(model.parameters(), sc.grad_clip)
        if loop.finite(step, loss=loss_value, grad_norm=float(grad_norm)):
            optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        tokens += sum(len(e.ids) for e in batch)
        if step % sc.log_every == 0 or step == sc.steps - 1:
            value = distributed.mean_over_ranks({"loss": loss_value})["loss"]  # the whole batch's loss
            loop.log({"step": step, "sft/loss": value, "sft/grad_norm": float(grad_norm),
                      "sft/lr": scheduler.get_last_lr()[0]}, step, loss=f"{value:.3f}")
    return tokens


def stop_if_learned_nothing(loop: TrainingLoop, model: torch.nn.Module, sc: SftConfig) -> None:
    """LearnedNothingError (the run tagged, its checkpoints kept, no output) where `learned_nothing` says
    the logged losses show a run that learned nothing."""
    # Every rank holds the same history (the losses are averaged over ranks), so all stop together.
    if why := learned_nothing(loop.history, model.config.vocab_size, sc.min_loss_drop_nats):
        loop.run_log.tags({"rloo.learned_nothing": why})
        last = checkpoint.latest(loop.ckpt_dir)
        kept = f"its last checkpoint, {last}, is kept" if last else "no checkpoint had been written"
        raise LearnedNothingError(
            f"sft: {why}: the run learned nothing; no output written, {kept} (check sft.lr={sc.lr:g} and "
            f"sft.steps={sc.steps}; sft.min_loss_drop_nats=0 turns the second check off)")


def evaluated(model: torch.nn.Module, tokenizer, test: list[dict], config: Config) -> dict:
    """The trained policy's report on the first `sft.eval_examples` rows of `test` (its None figures, a
    reference's and a proxy's, left out): rank 0 evaluates, every rank gets it."""
    sc = config.sft
    model.eval()
    spec = spec_for(config, "sft", sc.eval_max_new_tokens, sc.eval_draws, stream=7)
    with distributed.gathered(model):
        report = distributed.on_main(lambda: evaluate_policy(model, tokenizer, test[: sc.eval_examples], spec,
                                                             label="sft")[0])
    return {k: v for k, v in report.items() if v is not None}
