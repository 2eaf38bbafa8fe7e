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

The sampler process (`serve`, a fresh interpreter talking over two pipes) holds its own copy of the
model, built as the trainer's policy, whose trainable parameters are views of flat shared-memory buffers
(`SharedWeights`): after taking batch t the trainer copies its weights in, and the sampler only reads
them while it samples t + 1, by which time the trainer is done writing; no disk, and on a CPU no second
copy. It runs the rollout backend of
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
import math
import os
import pickle
import signal
import subprocess
import sys
import tempfile
import time
import traceback
import uuid
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

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
    """Named tensors laid out in flat buffers, one per dtype, each a file in shared memory (/dev/shm where
    the platform has one, else the temporary folder) that both processes map: what the trainer copies in,
    the sampler reads in place. Once both have mapped them the files are removed (`unlink`): the mappings
    stay, and nothing is left behind however the processes end."""

    def __init__(self, layout: list[tuple[str, int, int, tuple[int, ...]]], files: list[tuple[str, str, int]]) -> None:
        self.layout, self.files = layout, files  # (name, buffer, offset, shape); (path, dtype, elements)
        self.buffers = [torch.from_file(path, shared=True, size=n, dtype=getattr(torch, dtype)) for path, dtype, n in files]

    @classmethod
    def create(cls, named: dict[str, torch.Tensor]) -> SharedWeights:
        """New buffers holding `named`."""
        sizes: dict[torch.dtype, int] = {}
        layout = []
        dtypes = list(dict.fromkeys(t.dtype for t in named.values()))
        for name, t in named.items():
            offset = sizes.get(t.dtype, 0)
            layout.append((name, dtypes.index(t.dtype), offset, tuple(t.shape)))
            sizes[t.dtype] = offset + t.numel()
        folder = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
        stem = os.path.join(folder, f"rloo-weights-{os.getpid()}-{uuid.uuid4().hex[:12]}")
        files = [(f"{stem}-{i}", str(dt).removeprefix("torch."), sizes[dt]) for i, dt in enumerate(dtypes)]
        out = cls(layout, files)
        out.write(named)
        return out

    def views(self) -> dict[str, torch.Tensor]:
        return {name: self.buffers[b][o : o + math.prod(shape)].view(shape) for name, b, o, shape in self.layout}

    @torch.no_grad()
    def write(self, named: dict[str, torch.Tensor]) -> None:
        for name, view in self.views().items():
            view.copy_(named[name])

    def unlink(self) -> None:
        for path, _, _ in self.files:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)


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
    """What the sampler process starts from (its first message)."""

    config: dict  # Config.to_config(): the sections hold mapping proxies, which do not pickle
    policy_dir: str
    data: tuple  # train rows, prompt texts, prompt ids
    threads: int
    layout: list[tuple[str, int, int, tuple[int, ...]]]
    files: list[tuple[str, str, int]]
    chunk_rows: int
    log_level: int


# The sampler process's command: a fresh interpreter (no forked torch thread pools or locks) that imports
# no __main__ of the trainer's (a notebook, a test harness) and reads its orders from two pipes.
_COMMAND = "import sys; from rloo.train.off_policy import serve; sys.exit(serve(int(sys.argv[1]), int(sys.argv[2])))"


def _send(conn: Connection, obj: object) -> None:
    conn.send_bytes(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL))


class _Process:
    """The lagged batches sampled by a process of its own (`serve`), each requested one step ahead."""

    def __init__(self, config: Config, policy_dir: str, reward: bytes, data: tuple,
                 named: dict[str, torch.Tensor], threads: int, chunk_rows: int) -> None:
        """(`reward`: the training reward, pickled.)"""
        self.weights = SharedWeights.create(named)
        from_parent, to_child = os.pipe()
        from_child, to_parent = os.pipe()
        # The child imports what this process imports: the same package, the reward's modules.
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
        self.proc = subprocess.Popen([sys.executable, "-c", _COMMAND, str(from_parent), str(to_parent)],
                                     pass_fds=(from_parent, to_parent), stdin=subprocess.DEVNULL, env=env)
        os.close(from_parent)
        os.close(to_parent)
        self.tx, self.rx = Connection(to_child, readable=False), Connection(from_child, writable=False)
        spec = _Spec(config.to_config(), str(policy_dir), data, threads, self.weights.layout, self.weights.files,
                     chunk_rows, logging.getLogger("rloo").getEffectiveLevel())
        try:
            self._send(spec)
            self._send(reward, pickled=True)
        except BaseException:
            self.close()
            raise
        self.pending: int | None = None
        self.counts: dict[str, int] = {}  # the sampler's reward-server figures (run facts)
        self.version = 0  # of the weights in the buffers; the sampler syncs an engine when it changes
        self.ready: tuple | None = None

    def _send(self, obj: object, pickled: bool = False) -> None:
        try:
            self.tx.send_bytes(obj) if pickled else _send(self.tx, obj)
        except (BrokenPipeError, ConnectionResetError):
            raise RuntimeError(f"the off-policy sampler process ended (exit code {self.proc.wait()}); "
                               "its log lines are above") from None

    def wait_ready(self) -> str | None:
        """None once the sampler has mapped the weights and holds the reward, else why it cannot score
        (it has then ended)."""
        if self.ready is None:
            self.ready = self._receive("ready")
            self.weights.unlink()  # both processes have them mapped
        return self.ready[1]

    def load(self, named: dict[str, torch.Tensor]) -> None:
        self.weights.write(named)
        self.version += 1

    def request(self, step: int) -> None:
        self._send(("sample", step, self.version))
        self.pending = step

    def take(self, step: int) -> Collected:
        _expect(self.pending, step)
        _, got_step, got, self.counts = self._receive("batch")
        self.pending = None
        if got_step != step:
            raise RuntimeError(f"off-policy sampler: sent the batch of step {got_step}, step {step} was asked for")
        return got

    def _receive(self, kind: str) -> tuple:
        ended = "the off-policy sampler process ended (exit code {}) without a word; its log lines are above"
        while not self.rx.poll(1.0):
            if self.proc.poll() is not None:
                raise RuntimeError(ended.format(self.proc.returncode))
        try:
            msg = pickle.loads(self.rx.recv_bytes())
        except EOFError:
            raise RuntimeError(ended.format(self.proc.wait())) from None
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
            _send(self.tx, ("stop",))
        try:
            self.proc.wait(_CLOSE_WAIT_S)
        except subprocess.TimeoutExpired:  # still sampling a batch nobody will take: resampled on resume
            self.proc.kill()
            self.proc.wait()
        self.tx.close()
        self.rx.close()
        self.weights.unlink()


def _die_with_parent() -> None:
    """Linux: end this process when the trainer ends, however it ends (a kill -9 included)."""
    with contextlib.suppress(Exception):
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def serve(fd_in: int, fd_out: int) -> int:
    """The sampler process: a copy of the policy on the shared buffers, its rollout backend and the reward;
    it answers ("sample", step, version) with ("batch", step, Collected) until ("stop",) or until the
    trainer's end of the pipe closes. The trainer's signals are the trainer's to handle: a Ctrl-C or a
    Slurm SIGTERM reaches the whole process group, and the trainer checkpoints and then ends this one."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    _die_with_parent()
    rx, tx = Connection(fd_in, writable=False), Connection(fd_out, readable=False)
    try:
        spec: _Spec = pickle.loads(rx.recv_bytes())
        config, model, shared, on_cpu, rollout = _sampler(spec)
    except Exception as e:
        _report(tx, e)
        return 1
    why = None
    try:
        reward = pickle.loads(rx.recv_bytes())
    except Exception as e:  # it pickled, but does not load here (its module does not import)
        why = f"the training reward does not load in another process ({type(e).__name__}: {e})"
    _send(tx, ("ready", why))
    if why is not None:
        rollout.close()
        return 0
    log.info("off-policy sampler: pid %d, %d threads, %s backend, on %s", os.getpid(), spec.threads, rollout.name,
             model_device(model))
    batches = StepBatches(config, models.load_tokenizer(spec.policy_dir, config.model.trust_remote_code), rollout,
                          reward, *spec.data, model_device(model))
    try:
        return _answer(rx, tx, batches, model, config, None if on_cpu else shared, spec.chunk_rows)
    except (BrokenPipeError, ConnectionResetError):
        return 0
    except Exception as e:
        _report(tx, e)
        return 1
    finally:
        rollout.close()


def _sampler(spec: _Spec) -> tuple[Config, torch.nn.Module, dict[str, torch.Tensor], bool, Any]:
    """The sampler's config, its copy of the policy on the shared buffers (their views), whether it is on
    the CPU, and its rollout backend (rloo.rollout.make_rollout)."""
    from rloo.runtime import setup

    config = Config.from_config(spec.config)
    setup(spec.threads, config.seed)
    logging.getLogger("rloo").setLevel(spec.log_level)
    if torch.cuda.is_available() and torch.cuda.device_count() > 1:
        torch.cuda.set_device(1)  # the trainer holds the first GPU; `rloo plan` plans this one
    model = sampling_model(config, spec.policy_dir)
    shared = SharedWeights(spec.layout, spec.files).views()
    on_cpu = model_device(model).type == "cpu"
    if on_cpu:  # the parameters are the shared buffers themselves: no copy, no second copy
        params = dict(model.named_parameters())
        for name, view in shared.items():
            params[name].data = view
    return config, model, shared, on_cpu, make_rollout(config, config.seed, spec.policy_dir, model)


def _answer(rx: Connection, tx: Connection, batches: StepBatches, model: torch.nn.Module, config: Config,
            copy_from: dict[str, torch.Tensor] | None, chunk_rows: int) -> int:
    """Each ("sample", step, version) answered with its batch, sampled with the weights of `version` (read
    from the shared buffers `copy_from` first, where the model does not sit on them), until ("stop",) or
    the trainer's end of the pipe closes."""
    synced = 0
    while True:
        try:
            msg = pickle.loads(rx.recv_bytes())
        except EOFError:  # the trainer is gone
            return 0
        if msg[0] == "stop":
            return 0
        _, step, version = msg
        if version != synced:
            if copy_from is not None:
                _load_into(model, copy_from)
            batches.rollout.sync_weights(model)  # a vLLM engine takes them in; HF samples from the module
            synced = version
        got = sample_step(batches, model, config, step, chunk_rows)
        _send(tx, ("batch", step, got.to("cpu"), _server_counts(batches.reward)))


def _server_counts(reward: RewardSource) -> dict[str, int]:
    """A reward server's requests, retries and failures so far in this process (run facts), else nothing."""
    client = getattr(reward, "client", None)
    if client is None:
        return {}
    return {"sampler_reward_server_requests": client.requests, "sampler_reward_server_retries": client.retries.count,
            "sampler_reward_server_failed": client.failed}


def _report(conn: Connection, e: Exception) -> None:
    with contextlib.suppress(OSError, ValueError):
        _send(conn, ("error", type(e).__name__, str(e), traceback.format_exc(), isinstance(e, UserError)))


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
        why = None
        if threads:
            try:
                reward = pickle.dumps(self.reward, protocol=pickle.HIGHEST_PROTOCOL)
            except Exception as e:  # a notebook's lambda, an open connection
                why = f"the training reward does not pickle ({type(e).__name__}: {e})"
        if threads and why is None:
            worker = _Process(self.config, self.policy_dir, reward, self.data, named, threads, self.chunk_rows)
            try:
                why = worker.wait_ready()
            except BaseException:  # it failed to start: nothing of it may be left behind
                worker.close()
                raise
            if why is None:
                trainer_threads = max(1, total - threads)
                torch.set_num_threads(trainer_threads)
                self.facts = {"sampler": "process", "sampler_threads": threads, "trainer_threads": trainer_threads}
                log.info("off-policy: a sampler process with %d threads, the trainer with %d", threads, trainer_threads)
                self.worker = worker
            else:
                worker.close()
        if why is not None:
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
        self.facts.update(getattr(self.worker, "counts", {}))
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
