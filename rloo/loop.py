"""The training-loop skeleton every trainer shares: resume, stop on a signal, progress, metrics, checkpoints.

    loop = TrainingLoop("sft", steps, work_dir / "checkpoints", model, optimizer, scheduler, fingerprint,
                        checkpoint_every=100)
    extra = loop.resume()                 # {} on a fresh start; else the trainer's saved state
    for step in loop:                     # from loop.start; SIGTERM/SIGINT end it after a checkpoint
        metrics = train_one_step(step)
        loop.log(metrics, step)           # kept in loop.history, sent to MLflow, shown on the bar
    # loop.finish(): called by a trainer that stops early (an alarm), so no checkpoint follows
    loop.record_timings(train_seconds=...)   # wall-clock figures: MLflow and <work>/timings.json

A checkpoint holds the weights, the optimizer and scheduler state, `loop.history` and whatever
`state()` returns (the trainer's own state: evaluations, a moving baseline). The batches of step N
must depend only on (seed, N) (`runtime.step_generator`), so that a resumed run repeats exactly what
an uninterrupted one would have done.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from rloo import checkpoint, distributed, lora, models, tracking
from rloo.io import atomic_dir, write_json_atomic
from rloo.runtime import Preempted, Progress, StopFlag, peak_memory_mb

log = logging.getLogger("rloo")


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
    ) -> None:
        self.name, self.steps, self.ckpt_dir = name, steps, Path(ckpt_dir)
        self.model, self.optimizer, self.scheduler = model, optimizer, scheduler
        self.fingerprint, self.checkpoint_every, self.keep, self.state = fingerprint, checkpoint_every, keep, state
        self.companions = companions or {}  # other trained networks, checkpointed with the model (a critic)
        self.start = 0
        self.history: list[dict] = []
        self.bar: Progress | None = None
        self._finished = False

    def resume(self, replay: Callable[[dict], list[dict]] = lambda extra: []) -> dict:
        """Load the newest complete checkpoint, if any: weights, optimizer, scheduler and history in
        place; return the trainer's saved state. The stage's MLflow run gets the earlier steps' metrics
        again (plus `replay(extra)`: records logged outside the history), so one run holds them all."""
        last = checkpoint.latest(self.ckpt_dir)
        if last is None:
            return {}
        self.start, extra = checkpoint.load(last, self.model, self.optimizer, self.scheduler, self.fingerprint,
                                            self.companions)
        self.history = extra.pop("history", [])
        log.info("resumed from %s (step %d)", last, self.start)
        tracking.replay_history([*self.history, *replay(extra)], self.start)
        return extra

    def log(self, metrics: dict, step: int, **postfix: str) -> None:
        """Keep `metrics` in the history (saved with each checkpoint) and send them to MLflow."""
        self.history.append(metrics)
        tracking.log_metrics(metrics, step)
        if postfix and self.bar is not None:
            self.bar.set_postfix(**postfix)

    def record_timings(self, **figures: float) -> dict[str, float]:
        """Wall-clock figures of this run (seconds, throughput) and its peak memory: MLflow metrics `time/<name>` and
        `<work>/timings.json` beside the checkpoints, never the stage's outputs, which must be a
        function of their inputs (a rerun writes them byte for byte)."""
        # The process's peak memory so far: what this stage needed (CUDA max allocated, or peak RSS).
        figures = {**figures, "peak_memory_mb": peak_memory_mb(next(self.model.parameters()).device)}
        figures = {k: round(float(v), 3) for k, v in figures.items()}
        tracking.log_metrics({f"time/{k}": v for k, v in figures.items()}, self.steps)
        if distributed.is_main():  # data-parallel: rank 0's figures
            write_json_atomic(self.ckpt_dir.parent / "timings.json", figures)
        return figures

    def finish(self) -> None:
        """End after the current step, without a checkpoint (the trainer decided to stop)."""
        self._finished = True

    def __iter__(self) -> Iterator[int]:
        with StopFlag() as stop, Progress(total=self.steps, initial=self.start, desc=self.name, unit="step",
                                          disable=not distributed.is_main()) as bar:
            self.bar = bar
            for step in range(self.start, self.steps):
                yield step
                bar.update(1)
                done = step + 1
                if self._finished:
                    return
                # Data-parallel, a signal may reach the ranks at different steps: all stop at the same one.
                stop.requested = distributed.any_rank(stop.requested)
                if stop.requested or (done % self.checkpoint_every == 0 and done < self.steps):
                    checkpoint.save(self.ckpt_dir, done, self.model, self.optimizer, self.scheduler,
                                    {"history": self.history, **self.state()}, keep=self.keep,
                                    fingerprint=self.fingerprint, companions=self.companions)
                    if stop.requested:
                        raise Preempted(done, stop.exit_code)


def write_model_output(out_dir: Path, adapted: lora.Adapted | None, model: torch.nn.Module, tokenizer,
                       files: dict[str, Any]) -> None:
    """A training stage's output folder, written atomically by rank 0 (every rank calls it): the model
    as `lora.whole` gives it (LoRA: merged; FSDP: gathered), its tokenizer and the JSON `files`."""
    whole = lora.whole(adapted, model)
    if distributed.is_main():
        with atomic_dir(out_dir) as tmp:
            models.save_pretrained(whole, tokenizer, tmp)
            for name, value in files.items():
                write_json_atomic(tmp / name, value)
    distributed.barrier()
