"""Training checkpoints: weights (safetensors), optimizer and scheduler state, step and extra state.

A checkpoint is a folder `step_{N:08d}` written atomically; `latest` finds the newest complete one,
so a run killed at any moment resumes from the last finished save. checkpoint.json, written last,
records the SHA-256 of every other file: `load` refuses a checkpoint whose files changed since (a
flipped byte, a file replaced by another that still parses) or whose weights are not finite, and
`TrainingLoop.resume` then falls back to the newest one that passes.

Data-parallel (rloo/model/distributed.py), every rank takes part in gathering the whole state (a collective
under FSDP), rank 0 alone writes it, and on resume every rank reads the same folder (a file system all
ranks see) and takes its shard of it.
"""

from __future__ import annotations

import hashlib
import json
import math
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from rloo.errors import UserError
from rloo.io import atomic_dir
from rloo.model import distributed

_DONE = "checkpoint.json"


class CheckpointError(UserError, RuntimeError):
    """A checkpoint that cannot be used; the message names the folder and the problem."""


class DamagedCheckpoint(CheckpointError):
    """A checkpoint whose files are missing, unreadable, changed since they were saved, or not finite:
    an older one may still be good (unlike one written by a run with other settings)."""


def save(
    root: str | Path,
    step: int,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: Any,
    extra: dict | None = None,
    keep: int = 2,
    fingerprint: str | None = None,
    companions: dict[str, tuple[torch.nn.Module, torch.optim.Optimizer]] | None = None,
    tensors: dict[str, dict[str, torch.Tensor]] | None = None,
) -> Path:
    """Write checkpoint `step` under `root`: the model and its optimizer/scheduler, plus each of the
    `companions` ({name: (model, optimizer)}, e.g. PPO's critic) as `<name>.safetensors` + `<name>_optimizer.pt`,
    and each set of named `tensors` ({name: {key: tensor}}, e.g. an off-policy run's lagged weights) as
    `<name>.safetensors`. Then remove the oldest folders under `root` until `keep` are left, this one among
    them (0: keep all)."""
    final = Path(root) / f"step_{step:08d}"
    parts = {"model": (model, optimizer), **(companions or {})}
    states = {name: (_weights(module), distributed.optim_state(module, opt)) for name, (module, opt) in parts.items()}
    tensors = {name: named for name, named in (tensors or {}).items() if named}
    if distributed.is_main():
        # A failed write (a full disk: torch's zip writer then raises "unexpected pos ...") is one
        # WriteError naming this folder; the older checkpoints are only removed after it succeeded.
        with atomic_dir(final, kept=f"; the older checkpoints in {root} are kept") as tmp:
            for name, (weights, opt_state) in states.items():
                save_file(weights, str(tmp / f"{name}.safetensors"))
                if name == "model":
                    torch.save({"optimizer": opt_state, "scheduler": scheduler.state_dict() if scheduler else None},
                               tmp / "optimizer.pt")
                else:
                    torch.save({"optimizer": opt_state}, tmp / f"{name}_optimizer.pt")
            for name, named in tensors.items():
                save_file({k: v.detach().contiguous() for k, v in named.items()}, str(tmp / f"{name}.safetensors"))
            meta = {"step": step, "fingerprint": fingerprint, "extra": extra or {}, "sha256": digests(tmp)}
            if tensors:  # (a checkpoint without them is written as before)
                meta["tensors"] = sorted(tensors)
            (tmp / _DONE).write_text(json.dumps(meta))
        # `keep` in all, this one included (a checkpoint written at a signal counts like any other).
        older = sorted(p for p in Path(root).glob("step_*") if p != final)
        for old in older[: max(0, len(older) - (keep - 1))] if keep else []:
            shutil.rmtree(old, ignore_errors=True)
    distributed.barrier()
    return final


def digests(folder: Path) -> dict[str, str]:
    """{file name: SHA-256} of the files in a checkpoint folder, checkpoint.json aside."""
    return {p.name: _sha256(p) for p in sorted(folder.iterdir()) if p.is_file() and p.name != _DONE}


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def verify(folder: Path, meta: dict) -> None:
    """Raise CheckpointError if a file recorded at save is missing or its content changed since.
    (Checkpoints written before the digests were recorded have none to check.)"""
    for name, want in (meta.get("sha256") or {}).items():
        path = folder / name
        if not path.is_file():
            raise DamagedCheckpoint(f"{folder}: incomplete checkpoint, missing {name}")
        if _sha256(path) != want:
            raise DamagedCheckpoint(f"{folder}: {name} changed since it was saved (SHA-256 differs from checkpoint.json)")


def all_finite(t: torch.Tensor) -> bool:
    """No NaN and no infinity in `t`: its least and greatest values, which a NaN or an infinity becomes, in
    one pass without a temporary (torch.isfinite(t).all() writes a mask as large as `t` first: on one CPU
    thread an order of magnitude slower, seconds per check of a 7 B model's weights)."""
    if t.numel() == 0:
        return True
    lo, hi = torch.aminmax(t.detach())
    return math.isfinite(lo.item()) and math.isfinite(hi.item())


def nonfinite(tensors: dict[str, torch.Tensor]) -> str | None:
    """The name of the first floating-point tensor holding a NaN or an infinity, or None."""
    return next((name for name, t in tensors.items() if t.is_floating_point() and not all_finite(t)), None)


def _weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    # Frozen weights (a LoRA model's base) are left out: they are the stage's input, loaded again on resume.
    # clone(): tied embeddings share storage, which safetensors refuses to save twice.
    frozen = _frozen(model)
    return {k: v.detach().clone().contiguous() for k, v in distributed.model_state(model).items() if k not in frozen}


def _frozen(model: torch.nn.Module) -> set[str]:
    """Names of the parameters that do not train, when some do (a LoRA model's base weights)."""
    params = dict(model.named_parameters(remove_duplicate=False))  # a tied head under its own name too
    if not any(p.requires_grad for p in params.values()):
        return set()  # a model frozen as a whole is saved whole
    return {name for name, p in params.items() if not p.requires_grad}


def save_snapshot(folder: str | Path, model: torch.nn.Module, meta: dict) -> None:
    """Weights alone plus `meta` (e.g. the best evaluation so far), written atomically into `folder`."""
    weights = _weights(model)
    if distributed.is_main():
        with atomic_dir(Path(folder)) as tmp:
            save_file(weights, str(tmp / "model.safetensors"))
            (tmp / _DONE).write_text(json.dumps(meta))
    distributed.barrier()


def read_snapshot(folder: str | Path) -> dict | None:
    """The `meta` of a complete snapshot in `folder`, or None."""
    done = Path(folder) / _DONE
    return json.loads(done.read_text()) if done.is_file() else None


def load_snapshot(folder: str | Path, model: torch.nn.Module) -> None:
    """Put a snapshot's weights into `model` in place."""
    folder = Path(folder)
    try:
        state = load_file(str(folder / "model.safetensors"))
    except Exception as e:
        raise CheckpointError(f"{folder}: corrupt snapshot ({type(e).__name__}: {e})") from None
    _restore(folder, model, state)


def _restore(folder: Path, model: torch.nn.Module, state: dict[str, torch.Tensor]) -> None:
    missing, unexpected = distributed.load_model_state(model, state)
    # Tied weights are saved under both names, frozen ones not at all; anything else missing means a
    # different model.
    frozen = _frozen(model)
    real_missing = [k for k in missing if k not in state and k not in frozen and "lm_head" not in k]
    if real_missing or unexpected:
        raise CheckpointError(
            f"{folder}: weights do not match the model (missing {real_missing}, unexpected {unexpected})"
        )


def latest(root: str | Path) -> Path | None:
    """The newest complete checkpoint folder, or None."""
    done = complete(root)
    return done[-1] if done else None


def complete(root: str | Path) -> list[Path]:
    """The complete checkpoint folders under `root` (checkpoint.json written), oldest first."""
    root = Path(root)
    if not root.is_dir():
        return []
    return sorted(p for p in root.glob("step_*") if (p / _DONE).is_file())


def load(
    folder: str | Path,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: Any,
    fingerprint: str | None = None,
    companions: dict[str, tuple[torch.nn.Module, torch.optim.Optimizer]] | None = None,
) -> tuple[int, dict]:
    """Restore model, optimizer and scheduler (and the `companions` saved with them) in place; return
    (step, extra), and under extra["tensors"] the named tensors saved with it (`save`'s `tensors`), if any.

    A checkpoint written under another `fingerprint` (other settings or data) is refused rather than
    silently continued with the wrong run.
    """
    folder = Path(folder)
    try:
        meta = json.loads((folder / _DONE).read_text())
    except Exception as e:
        raise DamagedCheckpoint(f"{folder}: corrupt checkpoint ({type(e).__name__}: {e})") from None
    verify(folder, meta)
    if fingerprint and meta.get("fingerprint") and meta["fingerprint"] != fingerprint:
        raise CheckpointError(
            f"{folder}: written by a run with other settings or data (fingerprint {meta['fingerprint']} != "
            f"{fingerprint}); delete {folder.parent} or use another --work folder to start afresh"
        )
    parts = {"model": (model, optimizer), **(companions or {})}
    loaded = {}
    try:
        for name in parts:
            loaded[name] = (load_file(str(folder / f"{name}.safetensors")),
                            # map_location cpu: the optimizer casts its state to the parameters on load
                            torch.load(folder / ("optimizer.pt" if name == "model" else f"{name}_optimizer.pt"),
                                       weights_only=True, map_location="cpu"))
    except FileNotFoundError as e:
        raise DamagedCheckpoint(f"{folder}: incomplete checkpoint, missing {Path(e.filename).name}") from None
    except Exception as e:
        raise DamagedCheckpoint(f"{folder}: corrupt checkpoint ({type(e).__name__}: {e})") from None
    try:
        tensors = {name: load_file(str(folder / f"{name}.safetensors")) for name in meta.get("tensors", [])}
    except Exception as e:
        raise DamagedCheckpoint(f"{folder}: corrupt checkpoint ({type(e).__name__}: {e})") from None
    for name, state in [*((n, s) for n, (s, _) in loaded.items()), *tensors.items()]:
        if bad := nonfinite(state):
            raise DamagedCheckpoint(f"{folder}: {name}.safetensors holds non-finite values ({bad})")
    for name, (module, opt) in parts.items():
        state, opt_state = loaded[name]
        _restore(folder, module, state)
        distributed.load_optim_state(module, opt, opt_state["optimizer"])
    sched = loaded["model"][1].get("scheduler")
    if scheduler is not None and sched is not None:
        scheduler.load_state_dict(sched)
    extra = meta.get("extra", {})
    return int(meta["step"]), {**extra, "tensors": tensors} if tensors else extra


class Selection:
    """The best policy so far by validation sampled accuracy, kept as a weights snapshot in `folder`
    (written atomically, so a resumed run still knows its best)."""

    def __init__(self, folder: Path, enabled: bool) -> None:
        self.folder, self.enabled = folder, enabled
        self.best = read_snapshot(folder) if enabled else None

    def offer(self, evaluation: dict, model: torch.nn.Module) -> None:
        if not self.enabled:
            return
        if self.best is None or evaluation["eval/accuracy_sampled"] > self.best["eval/accuracy_sampled"]:
            save_snapshot(self.folder, model, evaluation)
            self.best = dict(evaluation)
