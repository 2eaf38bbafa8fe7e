"""One-step off-policy batches (`rloo.off_policy_steps: 1`): the batch of step t is sampled with the
weights after t - 1 updates (steps 0 and 1 both with the starting weights), so that sampling the batch
of step t + 1 overlaps the update of step t.

    lagged = LaggedBatches(config, policy_dir, policy, reward, train, prompts, prompt_ids, device)
    lagged.start(step, state)       # the weights that sample `step`: checkpointed (`state()`) or the policy's
    got = lagged.collect(step, policy)   # step's batch; then the policy's weights sample step + 1

`collect(t)` takes the batch of step t, then hands the sampler the policy's current weights (those after
t updates) and asks it for the batch of step t + 1. The samples depend only on (seed, step, the weights
that sampled them), never on when they were drawn: a run is the same bytes with the sampler in a process
of its own, overlapping the updates, or in the trainer's process before each update (the sequential
emulation, `rollout.sampler_threads: 0`), and on resume, where the checkpoint holds the lagged weights
(`state()`) and the batch in flight is sampled again from them.

The sampler process (`_serve`) holds its own copy of the model, built as the trainer's policy, whose
trainable parameters are views of flat shared-memory buffers (`SharedWeights`): after taking batch t the
trainer copies its weights in, and the sampler only reads them while it samples t + 1, by which time the
trainer is done writing; no file, no second copy on a CPU. It runs the rollout backend of
`rollout.backend` (HF on those weights, or a vLLM engine they are pushed into) and scores with the
training reward when the reward can be handed to it; else (a reward object that does not pickle, or
does not import there) the lagged batches are sampled in the trainer's process, and a warning says so.

With `rloo.rollout_correction.mismatch_every` N, every N steps the sampler also runs the trainer's
forward pass on the batch under the weights that sampled it (`trainer_logprobs`): the trainer then
splits the sampler-to-trainer ratio into the mismatch (same weights, two computations) and the lag.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import time
import traceback
from dataclasses import dataclass

import numpy as np
import torch

from rloo.errors import InputError, UserError
from rloo.model import models
from rloo.model.logprobs import completion_logprobs_and_entropy, join, model_device
from rloo.reward.rewards import RewardSource
from rloo.rollout import Rollout, make_rollout
from rloo.rollout.collect import Collected
from rloo.runtime import autocast
from rloo.settings import Config
from rloo.train.batches import StepBatches

log = logging.getLogger("rloo.train")

# Seconds the trainer waits for a sampler process to end after asking it to, before it kills it.
_CLOSE_WAIT_S = 10.0


def trainable_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The parameters that train (all of them, or under LoRA the adapters), by name, detached: what
    changes between two updates, so all the sampler needs of the weights."""
    return {name: p.detach() for name, p in model.named_parameters() if p.requires_grad}


def sampling_model(config: Config, policy_dir: str) -> torch.nn.Module:
    """A second copy of the policy, built as the trainer builds its own (the same dtype, device, LoRA
    layers and trainable flags: CPU kernels are chosen by requires_grad, so the same flags give the
    same bytes)."""
    mc = config.model
    model, _ = models.for_training(models.load_causal_lm(policy_dir, **models.load_options(mc), trainable=True), mc)
    return model


@torch.no_grad()
def trainer_logprobs(model: torch.nn.Module, ro: Rollout, config: Config, chunk_rows: int) -> torch.Tensor:
    """The trainer's token log-probabilities of `ro`'s completions under `model`'s weights, [rows, T]: the
    forward pass of its update (distinct rows once, autocast, the chunked head), without gradient."""
    mc = config.model
    batch = join(ro.prompt_ids, ro.prompt_mask, ro.completions, ro.completion_mask)
    first, inverse = batch.distinct_rows
    distinct = batch.select(first) if len(first) < len(inverse) else batch
    with autocast(mc.autocast, model_device(model)):
        lp, _ = completion_logprobs_and_entropy(model, distinct, chunk_rows, logits_chunk_tokens=mc.logits_chunk_tokens)
    return lp[inverse]


def measured(config: Config, step: int) -> bool:
    """Whether the lag pass runs at `step` (`rloo.rollout_correction.mismatch_every`)."""
    every = config.rloo.rollout_correction.mismatch_every
    return bool(every) and step % every == 0


def sample_step(batches: StepBatches, model: torch.nn.Module, config: Config, step: int, chunk_rows: int) -> Collected:
    """The batch of `step` from `batches` (whose rollout samples with `model`'s weights), with the lag pass
    where it is due."""
    got = batches.collect(step)
    if measured(config, step):
        t0 = time.perf_counter()
        got.trainer_logprobs = trainer_logprobs(model, got.rollout, config, chunk_rows)
        got.timings["lag_pass_s"] = time.perf_counter() - t0
    return got


class SharedWeights:
    """Named tensors laid out in flat shared-memory buffers, one per dtype: a process that receives the
    buffers (they pickle as shared memory) reads the same bytes the writer copied in."""

    def __init__(self, named: dict[str, torch.Tensor]) -> None:
        sizes: dict[torch.dtype, int] = {}
        self.layout: list[tuple[str, int, int, tuple[int, ...]]] = []  # name, buffer, offset, shape
        dtypes = list(dict.fromkeys(t.dtype for t in named.values()))
        for name, t in named.items():
            offset = sizes.get(t.dtype, 0)
            self.layout.append((name, dtypes.index(t.dtype), offset, tuple(t.shape)))
            sizes[t.dtype] = offset + t.numel()
        self.buffers = [torch.empty(sizes[dt], dtype=dt).share_memory_() for dt in dtypes]
        self.write(named)

    def views(self) -> dict[str, torch.Tensor]:
        return {name: self.buffers[b][o : o + int(np.prod(shape, dtype=np.int64))].view(shape)
                for name, b, o, shape in self.layout}

    @torch.no_grad()
    def write(self, named: dict[str, torch.Tensor]) -> None:
        for name, view in self.views().items():
            view.copy_(named[name])


@torch.no_grad()
def _load_into(model: torch.nn.Module, named: dict[str, torch.Tensor]) -> None:
    params = dict(model.named_parameters())
    for name, t in named.items():
        params[name].copy_(t)


class _Inline:
    """The lagged batches sampled in the trainer's process, each when it is taken (no overlap)."""

    def __init__(self, config: Config, policy_dir: str, reward: RewardSource, data: tuple, device: torch.device,
                 chunk_rows: int) -> None:
        self.config, self.chunk_rows = config, chunk_rows
        self.model = sampling_model(config, policy_dir)
        self.rollout = make_rollout(config, config.seed, policy_dir, self.model)
        self.batches = StepBatches(config, models.load_tokenizer(policy_dir, config.model.trust_remote_code),
                                   self.rollout, reward, *data, device)
        self.pending: int | None = None

    def load(self, named: dict[str, torch.Tensor]) -> None:
        _load_into(self.model, named)
        self.rollout.sync_weights(self.model)  # a vLLM engine takes them in; HF samples from the module

    def request(self, step: int) -> None:
        self.pending = step

    def take(self, step: int) -> Collected:
        _expect(self.pending, step)
        self.pending = None
        return sample_step(self.batches, self.model, self.config, step, self.chunk_rows)

    def state(self) -> dict[str, torch.Tensor]:
        return {k: v.clone() for k, v in trainable_state(self.model).items()}

    def close(self) -> None:
        self.rollout.close()


def _expect(pending: int | None, step: int) -> None:
    if pending != step:
        raise RuntimeError(f"off-policy sampler: step {step} asked for, but the batch requested was {pending}")


@dataclass
class _Spec:
    """What the sampler process starts from (pickled to it)."""

    config: dict  # Config.to_config(): the sections hold mapping proxies, which do not pickle
    policy_dir: str
    data: tuple  # train rows, prompt texts, prompt ids
    threads: int
    layout: list[tuple[str, int, int, tuple[int, ...]]]
    buffers: list[torch.Tensor]
    chunk_rows: int
    log_level: int


class _Process:
    """The lagged batches sampled by a process of its own (`_serve`), each requested one step ahead."""

    def __init__(self, config: Config, policy_dir: str, reward: RewardSource, data: tuple,
                 named: dict[str, torch.Tensor], threads: int, chunk_rows: int) -> None:
        import torch.multiprocessing as mp  # registers torch's shared-memory pickling

        self.weights = SharedWeights(named)
        ctx = mp.get_context("spawn")  # a fresh interpreter: no forked torch thread pools or locks
        self.conn, child = ctx.Pipe()
        spec = _Spec(config.to_config(), str(policy_dir), data, threads, self.weights.layout, self.weights.buffers, chunk_rows,
                     logging.getLogger("rloo").getEffectiveLevel())
        self.proc = ctx.Process(target=_serve, args=(child, spec), name="rloo-sampler", daemon=True)
        self.proc.start()
        child.close()
        try:
            self.conn.send(("reward", reward))
        except Exception as e:  # it does not pickle (a notebook's function, an open connection)
            self.conn.send(("no_reward", f"{type(e).__name__}: {e}"))
        self.pending: int | None = None
        self.version = 0  # of the weights in the buffers; the sampler syncs an engine when it changes
        self.ready: tuple | None = None

    def wait_ready(self) -> str | None:
        """None once the sampler holds the reward, else why it does not (it has then ended)."""
        if self.ready is None:
            self.ready = self._receive("ready")
        return self.ready[1]

    def load(self, named: dict[str, torch.Tensor]) -> None:
        self.weights.write(named)
        self.version += 1

    def request(self, step: int) -> None:
        self.conn.send(("sample", step, self.version))
        self.pending = step

    def take(self, step: int) -> Collected:
        _expect(self.pending, step)
        _, got_step, got = self._receive("batch")
        self.pending = None
        if got_step != step:
            raise RuntimeError(f"off-policy sampler: sent the batch of step {got_step}, step {step} was asked for")
        return got

    def _receive(self, kind: str) -> tuple:
        while not self.conn.poll(1.0):
            if not self.proc.is_alive():
                raise RuntimeError(f"the off-policy sampler process ended (exit code {self.proc.exitcode}) "
                                   "without a word; its log lines are above")
        try:
            msg = self.conn.recv()
        except EOFError:
            self.proc.join(_CLOSE_WAIT_S)
            raise RuntimeError(f"the off-policy sampler process ended (exit code {self.proc.exitcode}) "
                               "without a word; its log lines are above") from None
        if msg[0] == "error":
            _, name, message, trace, user = msg
            if user:  # a person can fix it: the same one line as in the trainer's process
                raise (InputError if name == "InputError" else UserError)(message)
            raise RuntimeError(f"the off-policy sampler process failed: {name}: {message}\n{trace}")
        if msg[0] != kind:
            raise RuntimeError(f"off-policy sampler: expected {kind}, got {msg[0]}")
        return msg

    def state(self) -> dict[str, torch.Tensor]:
        return {k: v.clone() for k, v in self.weights.views().items()}

    def close(self) -> None:
        with contextlib.suppress(OSError, ValueError):
            self.conn.send(("stop",))
        self.proc.join(_CLOSE_WAIT_S)
        if self.proc.is_alive():  # still sampling a batch nobody will take: it is sampled again on resume
            self.proc.kill()
            self.proc.join()
        self.conn.close()


def _serve(conn, spec: _Spec) -> None:
    """The sampler process: a copy of the policy on the shared buffers, its rollout backend and the
    reward; it answers ("sample", step, version) with ("batch", step, Collected) until ("stop",) or until
    the trainer's end of the pipe closes. The trainer's signals are the trainer's to handle: a Ctrl-C or a
    Slurm SIGTERM reaches the whole process group, and the trainer checkpoints and then ends this process."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    from rloo.runtime import setup

    try:
        config = Config.from_config(spec.config)
        setup(spec.threads, config.seed)
        logging.getLogger("rloo").setLevel(spec.log_level)
        if torch.cuda.is_available() and torch.cuda.device_count() > 1:
            torch.cuda.set_device(1)  # the trainer holds the first GPU; `rloo plan` plans this one
        model = sampling_model(config, spec.policy_dir)
        views = SharedWeights.__new__(SharedWeights)
        views.layout, views.buffers = spec.layout, spec.buffers
        shared = views.views()
        on_cpu = model_device(model).type == "cpu"
        if on_cpu:  # the parameters are the shared buffers themselves: no copy, no second copy
            params = dict(model.named_parameters())
            for name, view in shared.items():
                params[name].data = view
        rollout = make_rollout(config, config.seed, spec.policy_dir, model)
    except Exception as e:
        _report(conn, e)
        return
    try:
        kind, reward = conn.recv()
        why = None if kind == "reward" else f"the training reward does not pickle ({reward})"
    except Exception as e:  # it pickled, but does not unpickle here (its module does not import)
        why = f"the training reward does not load in another process ({type(e).__name__}: {e})"
    conn.send(("ready", why))
    if why is not None:
        rollout.close()
        return
    log.info("off-policy sampler: pid %d, %d threads, %s backend, on %s", os.getpid(), spec.threads, rollout.name,
             model_device(model))
    batches = StepBatches(config, models.load_tokenizer(spec.policy_dir, config.model.trust_remote_code), rollout,
                          reward, *spec.data, model_device(model))
    synced = 0
    try:
        while True:
            try:
                msg = conn.recv()
            except EOFError:  # the trainer is gone
                return
            if msg[0] == "stop":
                return
            _, step, version = msg
            if version != synced:
                if not on_cpu:
                    _load_into(model, shared)
                rollout.sync_weights(model)  # a vLLM engine takes them in; HF samples from the module
                synced = version
            got = sample_step(batches, model, config, step, spec.chunk_rows)
            conn.send(("batch", step, got.to("cpu")))
    except (BrokenPipeError, ConnectionResetError):
        return
    except Exception as e:
        _report(conn, e)
    finally:
        rollout.close()


def _report(conn, e: Exception) -> None:
    with contextlib.suppress(OSError, ValueError):
        conn.send(("error", type(e).__name__, str(e), traceback.format_exc(), isinstance(e, UserError)))


class LaggedBatches:
    """The batches of a one-step off-policy run (module docstring), from a sampler process or inline."""

    def __init__(self, config: Config, policy_dir: str, reward: RewardSource, train: list[dict], prompts: list[str],
                 prompt_ids: list[list[int]], device: torch.device, chunk_rows: int) -> None:
        self.config, self.policy_dir, self.reward = config, str(policy_dir), reward
        self.data = (train, prompts, prompt_ids)
        self.device, self.chunk_rows = device, chunk_rows
        self.worker: _Inline | _Process | None = None
        self.facts: dict[str, int | str] = {}  # run facts: where the sampler runs, its threads

    def start(self, step: int, policy: torch.nn.Module, state: dict[str, torch.Tensor] | None = None) -> None:
        """Sample `step` next, with the weights `state` (a checkpoint's `state()`), else `policy`'s (a fresh
        run: the weights before any update sample steps 0 and 1)."""
        named = state if state is not None else trainable_state(policy)
        threads = self.config.rollout.sampler_threads
        total = torch.get_num_threads()
        if threads is None:
            threads = max(1, total // 2)
        if threads:
            worker = _Process(self.config, self.policy_dir, self.reward, self.data, named, threads, self.chunk_rows)
            if (why := worker.wait_ready()) is None:
                trainer_threads = max(1, total - threads)
                torch.set_num_threads(trainer_threads)
                self.facts = {"sampler": "process", "sampler_threads": threads, "trainer_threads": trainer_threads}
                log.info("off-policy: a sampler process with %d threads, the trainer with %d", threads, trainer_threads)
                self.worker = worker
            else:
                worker.close()
                log.warning("!!! off-policy: %s, so the sampler cannot run in a process of its own: the lagged "
                            "batches are sampled in the trainer's process, without overlap (the same results)", why)
        if self.worker is None:
            self.worker = _Inline(self.config, self.policy_dir, self.reward, self.data, self.device, self.chunk_rows)
            self.facts = {"sampler": "inline"}
        self.worker.load(named)
        if step < self.config.rloo.steps:
            self.worker.request(step)

    def collect(self, step: int, policy: torch.nn.Module) -> Collected:
        """The batch of `step` (sampled with the weights after step - 1 updates); then `policy`'s weights,
        those after `step` updates, go to the sampler, which starts on step + 1."""
        if self.worker is None:
            self.start(step, policy)
        t0 = time.perf_counter()
        got = self.worker.take(step).to(self.device)
        got.timings["wait_s"] = time.perf_counter() - t0
        # how many updates the sampling weights are behind: none at step 0
        got.stats["train/policy_lag"] = min(step, self.config.rloo.off_policy_steps)
        self.worker.load(trainable_state(policy))
        if step + 1 < self.config.rloo.steps:
            self.worker.request(step + 1)
        return got

    def state(self) -> dict[str, torch.Tensor]:
        """The weights that sample the next batch (a checkpoint keeps them: `start` on resume)."""
        return self.worker.state() if self.worker is not None else {}

    def close(self) -> None:
        if self.worker is not None:
            self.worker.close()
            self.worker = None
