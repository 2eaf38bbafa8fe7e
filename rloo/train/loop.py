"""The training-loop skeleton every trainer shares: resume, stop on a signal, progress, metrics, checkpoints.

    loop = TrainingLoop("sft", steps, work_dir / "checkpoints", model, optimizer, scheduler, fingerprint,
                        checkpoint_every=100)
    extra = loop.resume()                 # {} on a fresh start; else the trainer's saved state
    for step in loop:                     # from loop.start; SIGTERM/SIGINT end it after a checkpoint
        loss, grad_norm = backward(step)
        if loop.finite(step, loss=loss, grad_norm=grad_norm):   # else: skipped, or NonFiniteError
            optimizer.step()
        loop.log(metrics, step, loss=...) # kept in loop.history, sent to its RunLog; `loss` on the progress line
    # loop.finish(): called by a trainer that stops early (an alarm), so no checkpoint follows
    loop.record_timings(train_seconds=...)   # run facts (times, resume): the run's log and <work>/timings.json

A diverged run stops (`finite`): a non-finite loss, KL, advantage or gradient norm raises
NonFiniteError before the optimizer applies it (or skips the step, up to `max_nonfinite_steps`), and
the weights are checked before every checkpoint and before the output is written, so a run that
diverged leaves its last good checkpoint and no output.

A checkpoint holds the weights, the optimizer and scheduler state, `loop.history`, whatever
`state()` returns (the trainer's own state: evaluations, a moving baseline) and the named tensors
`tensors()` returns (an off-policy run's lagged weights; `resume` hands them back as extra["tensors"]). The batches of step N
must depend only on (seed, N) (`runtime.step_generator`), so that a resumed run repeats exactly what
an uninterrupted one would have done.
"""

from __future__ import annotations

import json
import logging
import math
import signal
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from rloo.errors import UserError
from rloo.io import atomic_dir, write_json_atomic
from rloo.model import checkpoint, distributed, lora, models
from rloo.progress import Progress
from rloo.runtime import Preempted, StopFlag, peak_memory_mb
from rloo.settings import Config
from rloo.train.run_log import RunLog

log = logging.getLogger("rloo")


class NonFiniteError(UserError, RuntimeError):
    """A training run diverged: a loss, KL, advantage, gradient norm or weight is NaN or infinite."""


def stop_if_not_finite(step: int, **quantities: float) -> bool:
    """The guard of a Trainer used outside a TrainingLoop: stop at the first non-finite quantity."""
    for name, value in quantities.items():
        if not math.isfinite(value):
            raise NonFiniteError(f"rloo: step {step}: {name} is {value} before the optimizer step: the run diverged")
    return True


class TrainingLoop:
    def __init__(
        self,
        name: str,
        steps: int,
        ckpt_dir: str | Path,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        scheduler: Any,
        fingerprint: str,
        checkpoint_every: int,
        keep: int = 2,
        state: Callable[[], dict] = dict,
        companions: dict[str, tuple[torch.nn.Module, torch.optim.Optimizer]] | None = None,
        max_nonfinite_steps: int = 0,
        log: RunLog | Callable[[dict, int], None] | None = None,
        tensors: Callable[[], dict[str, dict[str, torch.Tensor]]] = dict,
        progress_every_s: float = Config.progress_every_s,
    ) -> None:
        self.name, self.steps, self.ckpt_dir = name, steps, Path(ckpt_dir)
        self.model, self.optimizer, self.scheduler = model, optimizer, scheduler
        self.fingerprint, self.checkpoint_every, self.keep, self.state = fingerprint, checkpoint_every, keep, state
        self.companions = companions or {}  # other trained networks, checkpointed with the model (a critic)
        self.tensors = tensors  # named tensors of the trainer's, checkpointed too (an off-policy run's lagged weights)
        self.start = 0
        self.history: list[dict] = []
        self.progress_every_s = progress_every_s  # a line on the terminal and in the log (rloo/progress.py)
        self.progress: Progress | None = None
        self._finished = False
        self.max_nonfinite_steps, self.skipped_steps = max_nonfinite_steps, 0
        self.run_log = RunLog.of(log)  # where the figures go (the stages: MLflow's, rloo_workflow.tracking.STAGE_LOG)

    @classmethod
    def for_stage(cls, name: str, config: Config, work_dir: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                  scheduler: Any, fingerprint: str, *, log: RunLog | Callable[[dict, int], None] | None = None,
                  **options: Any) -> TrainingLoop:
        """The loop of the training stage `name` whose settings section of `config` (sft, reward, rloo) gives
        its `steps`, `checkpoint_every` and `max_nonfinite_steps`; its checkpoints in `work_dir`/checkpoints,
        its progress every `config.progress_every_s`. `options`: the rest of the constructor's keywords."""
        settings = getattr(config, name)
        return cls(name, settings.steps, work_dir / "checkpoints", model, optimizer, scheduler, fingerprint,
                   settings.checkpoint_every, max_nonfinite_steps=settings.max_nonfinite_steps, log=log,
                   progress_every_s=config.progress_every_s, **options)

    def resume(self, replay: Callable[[dict], list[dict]] = lambda extra: []) -> dict:
        """Load the newest complete checkpoint, if any: weights, optimizer, scheduler and history in
        place; return the trainer's saved state. The run's log (the stage's MLflow run) gets the earlier steps' metrics
        again (plus `replay(extra)`: records logged outside the history), so one run holds them all."""
        found = checkpoint.complete(self.ckpt_dir)
        if not found:
            return {}
        damaged = []
        for last in reversed(found):  # newest first; a damaged one is passed over, never deleted
            try:
                self.start, extra = checkpoint.load(last, self.model, self.optimizer, self.scheduler,
                                                    self.fingerprint, self.companions)
                break
            except checkpoint.DamagedCheckpoint as e:
                log.warning("%s: skipped, trying the one before it", e)
                damaged.append(str(e))
        else:
            raise checkpoint.CheckpointError(
                f"no usable checkpoint in {self.ckpt_dir}, newest first: {'; '.join(damaged)}; delete "
                f"{self.ckpt_dir} to start this stage afresh")
        self.history = extra.pop("history", [])
        log.info("resumed from %s (step %d)", last, self.start)
        self.run_log.replay([*self.history, *replay(extra)], self.start)
        return extra

    def finite(self, step: int, **quantities: float) -> bool:
        """Whether step `step` may be applied: its `quantities` (loss, KL, advantages, gradient norm) are
        all finite. A non-finite step is skipped (False: the caller drops its gradient), counted in
        `skipped_steps`, while there have been at most `max_nonfinite_steps`; past them, NonFiniteError.
        Data-parallel, every rank takes the same decision."""
        bad = next(((k, v) for k, v in quantities.items() if not math.isfinite(float(v))), None)
        if not distributed.any_rank(bad is not None):
            return True
        name, value = bad or ("a quantity on another rank", math.nan)
        self.skipped_steps += 1
        if self.skipped_steps <= self.max_nonfinite_steps:
            log.warning("%s: step %d skipped, %s is %s (%d of %s.max_nonfinite_steps=%d)", self.name, step, name,
                        value, self.skipped_steps, self.name, self.max_nonfinite_steps)
            self.run_log.metrics({f"{self.name}/skipped_nonfinite_steps": self.skipped_steps}, step)
            return False
        self.diverged(step, name, value)
        return False  # not reached

    def check_weights(self, step: int, what: str) -> None:
        """Stop before `what` (a checkpoint, the output) is written from weights that are not finite."""
        named = [("model", self.model), *((n, m) for n, (m, _) in self.companions.items())]
        bad = next((f"{part}:{name}" for part, module in named for name, p in module.named_parameters()
                    if not _finite(p)), None)
        if distributed.any_rank(bad is not None):  # FSDP: each rank checks its shards
            self.diverged(step, f"weight {bad or 'on another rank'}", "not finite", before=what)

    def diverged(self, step: int, name: str, value: object, before: str = "the optimizer step") -> None:
        """Record the divergence (the run's log, <work>/diverged.json) and raise NonFiniteError."""
        last = checkpoint.latest(self.ckpt_dir)
        record = {"stage": self.name, "step": step, "quantity": name, "value": str(value),
                  "skipped_steps": self.skipped_steps, "last_good_checkpoint": str(last) if last else None}
        self.run_log.metrics({f"{self.name}/diverged_at_step": step}, step)
        self.run_log.tags({"rloo.diverged": f"step {step}: {name} = {value}"})
        if distributed.is_main():
            write_json_atomic(self.ckpt_dir.parent / "diverged.json", record)
        kept = f"the last good checkpoint, {last}, is kept" if last else "no checkpoint had been written"
        raise NonFiniteError(
            f"{self.name}: step {step}: {name} is {value} before {before}: the run diverged; no output written, "
            f"{kept} (lower the learning rate or the gradient clip, or allow skips with "
            f"{self.name}.max_nonfinite_steps)")

    def log(self, metrics: dict, step: int, **shown: str) -> None:
        """Keep `metrics` in the history (saved with each checkpoint) and send them to the run's log; `shown`
        (`loss="0.412"`) on the next progress line."""
        self.history.append(metrics)
        self.run_log.metrics(metrics, step)
        if self.progress is not None:
            self.progress.show(**shown)

    def record_timings(self, facts: dict[str, int] | None = None, **figures: float) -> dict[str, float | int]:
        """This run's facts: its wall-clock figures (seconds, throughput) and peak memory (the log's metrics
        `time/<name>`), the step it resumed from and `facts` such as the thread count (its tags
        `rloo.<name>`); all of them in `<work>/timings.json` beside the checkpoints, never in the stage's
        outputs, which must be a function of their inputs (a rerun, or a resumed run, writes them byte for
        byte)."""
        # The process's peak memory so far: what this stage needed (CUDA max allocated, or peak RSS).
        figures = {**figures, "peak_memory_mb": peak_memory_mb(next(self.model.parameters()).device)}
        figures = {k: round(float(v), 3) for k, v in figures.items()}
        facts = {"resumed_from_step": self.start, **(facts or {})}
        self.run_log.metrics({f"time/{k}": v for k, v in figures.items()}, self.steps)
        self.run_log.tags({f"rloo.{k}": str(v) for k, v in facts.items()})
        if distributed.is_main():  # data-parallel: rank 0's figures
            write_json_atomic(self.ckpt_dir.parent / "timings.json", {**figures, **facts})
        return {**figures, **facts}

    def finish(self) -> None:
        """End after the current step, without a checkpoint (the trainer decided to stop)."""
        self._finished = True

    def __iter__(self) -> Iterator[int]:
        with StopFlag() as stop, Progress(self.name, self.steps, self.progress_every_s, initial=self.start,
                                          enabled=distributed.is_main()) as progress:
            self.progress = progress
            for step in range(self.start, self.steps):
                yield step
                progress.update(1)
                done = step + 1
                if self._finished:
                    return
                # Data-parallel, a signal may reach the ranks at different steps: all stop at the same one.
                stop.requested = distributed.any_rank(stop.requested)
                if stop.requested or (done % self.checkpoint_every == 0 and done < self.steps):
                    self.check_weights(step, "a checkpoint")
                    saved = checkpoint.save(self.ckpt_dir, done, self.model, self.optimizer, self.scheduler,
                                            {"history": self.history, **self.state()}, keep=self.keep,
                                            fingerprint=self.fingerprint, companions=self.companions,
                                            tensors=self.tensors())
                    if stop.requested:
                        if distributed.is_main():
                            log.warning("%s: stopped by %s: checkpoint of step %d saved at %s (the same command "
                                        "resumes from it)", self.name, signal.Signals(stop.exit_code - 128).name,
                                        done, saved)
                        raise Preempted(done, stop.exit_code)


def _finite(p: torch.Tensor) -> bool:
    t = p.detach()
    t = t.to_local() if hasattr(t, "to_local") else t  # an FSDP shard (DTensor): this rank's part
    return checkpoint.all_finite(t)


def write_model_output(out_dir: Path, adapted: lora.Adapted | None, model: torch.nn.Module, tokenizer,
                       files: dict[str, Any]) -> None:
    """A training stage's output folder, written atomically by rank 0 (every rank calls it): the model
    as `lora.whole` gives it (LoRA: merged; FSDP: gathered), its tokenizer and the `files`: JSON, or
    JSON Lines (one record a line) for a name ending in .jsonl."""
    whole = lora.whole(adapted, model)
    if distributed.is_main():
        with atomic_dir(out_dir) as tmp:
            models.save_pretrained(whole, tokenizer, tmp)
            for name, value in files.items():
                if name.endswith(".jsonl"):
                    (tmp / name).write_text("".join(json.dumps(record) + "\n" for record in value))
                else:
                    write_json_atomic(tmp / name, value)
    distributed.barrier()


def wrapped_with_optimizer(model: torch.nn.Module, lr: float, **adamw: Any) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """(the module the gradient passes run through, the optimizer): DDP around `model`, or `model` sharded in
    place by FSDP (`distributed.wrap`; itself outside data parallelism), and AdamW over its trainable
    parameters (`lora.trainable`: with LoRA the adapters, and a reward model's new head)."""
    train_model = distributed.wrap(model)
    return train_model, torch.optim.AdamW(lora.trainable(model), lr=lr, **adamw)
