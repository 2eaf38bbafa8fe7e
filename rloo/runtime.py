"""Process set-up shared by every stage: threads, seeds, quiet third-party progress output."""

from __future__ import annotations

import contextlib
import logging
import os
import random

import numpy as np
import torch

from rloo.console import configure_logging
from rloo.errors import UnavailableError

log = logging.getLogger("rloo")


def setup(threads: int | None, seed: int) -> int:
    """Set torch threads (explicit, else the job's CPU allotment), deterministic kernels on CPU and every RNG;
    return the thread count."""
    if threads is None:
        threads = int(os.environ.get("SLURM_CPUS_PER_TASK", 0)) or len(os.sched_getaffinity(0))
    torch.set_num_threads(threads)
    if not torch.cuda.is_available():
        # Indexing's backward accumulates with index_put_, whose parallel CPU kernel adds colliding rows in
        # the order its threads arrive: two float32 RLOO runs on 2 threads parted in the last bits within a
        # few steps. The deterministic kernels make a CPU run the same bytes every time, at a cost within
        # the noise of timed runs (docs/workflow.md#reproducibility); a GPU node's are left as they are.
        torch.use_deterministic_algorithms(True, warn_only=True)
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    # A hub is never contacted for the embedded default; these keep transformers and datasets quiet.
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    import transformers

    transformers.utils.logging.disable_progress_bar()
    # Its warnings are errors here where they matter: a trained reward model without its head is refused
    # by models.load_reward_model rather than announced as "newly initialized" weights.
    transformers.utils.logging.set_verbosity_error()
    configure_logging()
    return threads


def resolve_device(name: str) -> torch.device:
    """`model.device` as a torch device: auto = CUDA when available, else CPU."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise UnavailableError("model.device is 'cuda' but torch sees no GPU (CUDA_VISIBLE_DEVICES, driver, CPU-only torch?)")
    return torch.device(name)


_NATIVE_BF16: dict[str, bool] = {}  # device type -> native, probed once per process


def bf16_in_hardware(kind: str) -> bool:
    """Whether devices of type `kind` multiply in bfloat16 in hardware: a CUDA GPU that supports it, a CPU
    with AVX512-BF16 or AMX. Elsewhere torch emulates bf16, and a training pass is many times slower than
    in float32 (docs/figures/bf16_cpu.json)."""
    if kind == "cuda":
        return torch.cuda.is_bf16_supported()
    return kind == "cpu" and (torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported())


def native_bf16(device: torch.device | str = "cpu") -> bool:
    """`bf16_in_hardware` for `device`, probed once per process; the job's log says what `auto` became."""
    kind = torch.device(device).type
    if kind not in _NATIVE_BF16:
        _NATIVE_BF16[kind] = bf16_in_hardware(kind)
        log.info("bfloat16 on %s: %s; model.autocast / model.inference_dtype `auto` run in %s", kind,
                 "native" if _NATIVE_BF16[kind] else "emulated", "bfloat16" if _NATIVE_BF16[kind] else "float32")
    return _NATIVE_BF16[kind]


def resolve_precision(name: str | None, device: torch.device | str = "cpu") -> str | None:
    """`auto` in model.autocast / model.inference_dtype: bfloat16 where `device` computes it natively,
    else off (none for autocast, null for the decoding dtype); any other value as given."""
    if name != "auto":
        return name
    return "bfloat16" if native_bf16(device) else None


def autocast(mode: str, device: torch.device | str = "cpu") -> contextlib.AbstractContextManager:
    """bfloat16 autocast for forward passes on `device` (`model.autocast`: none, bfloat16 or auto), or nothing."""
    if resolve_precision(mode, device) in ("none", None):
        return contextlib.nullcontext()
    return torch.autocast(torch.device(device).type, dtype=torch.bfloat16)


def inference_dtype(name: str | None, device: torch.device | str = "cpu") -> torch.dtype | None:
    """`model.inference_dtype` on `device` as a torch dtype; None (the weights' own) stays None."""
    name = resolve_precision(name, device)
    return None if name is None else getattr(torch, name)


def decode_dtype(inference: str | None, weights: str, device: torch.device | str = "cpu") -> str:
    """The dtype decoding runs in, by name: `model.inference_dtype` resolved on `device`, else the
    weights' own (`model.dtype`). The vLLM engine is built with it, so it samples where HF would."""
    return resolve_precision(inference, device) or weights


def scoring_precision(name: str | None, device: torch.device | str = "cpu") -> contextlib.AbstractContextManager:
    """Reward-model scoring under `model.inference_dtype`: bfloat16 autocast, or the weights' own dtype."""
    return autocast("none" if resolve_precision(name, device) is None else "bfloat16", device)


def peak_memory_mb(device: torch.device | str = "cpu") -> float:
    """The process's peak memory so far, in MiB: CUDA's max allocated on a GPU, the peak RSS on a CPU
    (everything the process ever held: interpreter, libraries, models, activations)."""
    if torch.device(device).type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def step_generator(seed: int, step: int, stream: int = 0) -> torch.Generator:
    """A generator that depends only on (seed, step, stream): a resumed run draws the same numbers."""
    g = torch.Generator()
    g.manual_seed(int(np.random.SeedSequence([seed, step, stream]).generate_state(1)[0]))
    return g


class Preempted(SystemExit):
    """Raised after a checkpoint was written because the job was asked to stop: exit status 143 for
    SIGTERM (Slurm's warning before a kill or requeue), 130 for SIGINT (Ctrl-C)."""

    def __init__(self, step: int, code: int = 143):
        super().__init__(code)
        self.step = step


class StopFlag:
    """Turns SIGTERM and SIGINT into a flag the training loop polls: it checkpoints after the current
    step and exits. A second Ctrl-C stops at once (KeyboardInterrupt), without that checkpoint."""

    def __init__(self) -> None:
        self.requested = False
        self.exit_code = 143

    def __enter__(self) -> StopFlag:
        import signal

        self._previous = {sig: signal.signal(sig, self._handle) for sig in (signal.SIGTERM, signal.SIGINT)}
        return self

    def _handle(self, signum, frame) -> None:
        import signal

        if signum == signal.SIGINT and self.requested:
            raise KeyboardInterrupt
        name = signal.Signals(signum).name
        log.warning("%s received: will checkpoint and exit after the current step%s", name,
                    " (Ctrl-C again to stop now, without it)" if signum == signal.SIGINT else "")
        self.requested = True
        self.exit_code = 128 + signum

    def __exit__(self, *exc) -> None:
        import signal

        for sig, handler in self._previous.items():
            signal.signal(sig, handler)

