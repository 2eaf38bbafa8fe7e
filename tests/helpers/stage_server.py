"""The test suite's stage-process server: one interpreter that has imported torch, transformers, MLflow
and Snakemake forks each `rloo <stage>` process the tests start, so that the process skips their import
(~6.6 CPU-s of the micro stages' 9–12); the tests' Snakemake runs go through it too
(tests/helpers/served_snakemake.py). Test machinery: the package knows nothing of it.

`python -u tests/helpers/stage_server.py SOCKET` serves. tests/conftest.py starts one per pytest process,
names its socket in `RLOO_STAGE_SERVER` and puts tests/helpers/served/ on PYTHONPATH, whose
sitecustomize.py makes every `rloo ...` and `python -m rloo_workflow.cli ...` the tests start (directly, as a
Snakemake job, or as a torchrun worker) a client (`delegate`): it hands its arguments, environment,
working directory, sys.path and standard streams to the server and waits; a forked process runs the
command, and the client exits as it does, with its exit code or by its signal.

What a fresh process would do, the forked one does, or the command does not go to the server:
- Only third-party modules are imported before the fork; `rloo` is imported afresh from the client's
  sys.path (a workflow copy imports its own `rloo`).
- The client's environment must equal the server's in every variable read while importing (IMPORT_ENV:
  caches, offline switches, the interpreter's, the locale), or the client runs the command itself. The
  thread counts and the temporary folder, which Snakemake sets per job, the forked process sets itself.
- Signals the client receives go to the forked process; if the client dies (kill -9), the forked
  process's group is killed. Slurm jobs never use the server: their processes belong to the job.
- Under `-u` the forked processes write their streams unbuffered (a `python -u` client's are; others'
  lose nothing by it).
- The forked process is a child of the server, not of the client: the client's rusage does not count its
  CPU. The server does (`cpu_seconds`), for tests/conftest.py's guard.
"""

from __future__ import annotations

import contextlib
import gc
import importlib
import json
import os
import signal
import socket
import struct
import sys
import time

ENV_VAR = "RLOO_STAGE_SERVER"
# Prefixes of the variables read while the pre-imported modules load (libgomp's and MKL's threads,
# Hugging Face's cache and offline switches, the interpreter's own, the locale): a client whose values
# differ runs its command itself. SET_IN_FORK's need not match: the forked process takes sys.path, the
# bytecode switch, the temporary folder and torch's cache folder under it from the client (and under
# `-u` its streams are unbuffered whatever PYTHONUNBUFFERED says).
IMPORT_ENV = ("PYTHON", "HF_", "HUGGINGFACE", "TRANSFORMERS", "TORCH", "PYTORCH", "OMP_", "MKL_", "KMP_",
              "GOMP_", "OPENBLAS", "CUDA", "NCCL", "LD_", "LANG", "LC_", "XDG_", "HOME", "TMPDIR",
              "TOKENIZERS", "SAFETENSORS", "ACCELERATE", "DATASETS", "KERNELS", "SCIPY", "NUMPY", "MPL")
# Thread counts, which Snakemake sets per job, are read when the libraries load (libgomp, OpenBLAS): the
# forked process sets them as a fresh one would have them (`_match_threads`).
THREAD_ENV = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS", "GOTO_NUM_THREADS")
SET_IN_FORK = frozenset(("PYTHONPATH", "PYTHONDONTWRITEBYTECODE", "PYTHONUNBUFFERED", "TMPDIR",
                         "TORCHINDUCTOR_CACHE_DIR", *THREAD_ENV))
# Read when a process group or torchrun's agent starts, not on import: torchrun's workers are served.
AT_RUN_TIME = ("TORCHELASTIC_", "TORCH_NCCL_")
# What a stage imports before its work, and not from `rloo`; each must not read the environment
# beyond IMPORT_ENV when it loads (MLflow reads its variables when called).
PRELOAD = ("numpy", "yaml", "jsonschema", "safetensors.torch", "torch", "torch.distributed",
           "transformers", "transformers.modeling_utils", "transformers.models.auto.modeling_auto",
           "transformers.models.llama.modeling_llama", "transformers.models.qwen2.modeling_qwen2",
           "tokenizers", "mlflow", "mlflow.entities", "mlflow.tracking",
           # a stage's tracked run opens the SQL store and its migrations, and draws its curves: imported
           # in every forked process otherwise, about 8 CPU-s of a micro chain's 75 (py-spy)
           "mlflow.store.tracking.sqlalchemy_store", "mlflow.store.db.utils", "alembic", "matplotlib.pyplot",
           "threadpoolctl",  # `_match_threads`; it sets KMP_DUPLICATE_LIB_OK on import (see `_refusal`)
           "snakemake.cli")  # `rloo dvc`'s DAG, and the tests' own Snakemake runs (tests/helpers/served_snakemake.py)
FORWARDED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2)
_LEN = struct.Struct("!I")


def _send(sock: socket.socket, obj: dict, fds: list[int] | None = None) -> None:
    data = json.dumps(obj).encode()
    if fds:
        socket.send_fds(sock, [_LEN.pack(len(data)) + data], fds)
    else:
        sock.sendall(_LEN.pack(len(data)) + data)


def _recv(sock: socket.socket, nfds: int = 0) -> tuple[dict | None, list[int]]:
    """One message (None at end of stream) and the descriptors that came with it."""
    head, fds, _, _ = socket.recv_fds(sock, _LEN.size, nfds) if nfds else (sock.recv(_LEN.size), [], 0, None)
    while head and len(head) < _LEN.size:
        more = sock.recv(_LEN.size - len(head))
        if not more:
            break
        head += more
    if len(head) < _LEN.size:
        return None, fds
    (n,) = _LEN.unpack(head)
    body = b""
    while len(body) < n:
        more = sock.recv(n - len(body))
        if not more:
            return None, fds
        body += more
    return json.loads(body), fds


def import_env(env: dict[str, str]) -> dict[str, str]:
    """The variables of `env` that the pre-imported modules may have read while loading and that the
    forked process cannot set for itself."""
    return {k: v for k, v in env.items()
            if k.startswith(IMPORT_ENV) and not k.startswith(AT_RUN_TIME) and k not in SET_IN_FORK}


def _env_threads(env: dict[str, str], names: tuple[str, ...]) -> int | None:
    """The first positive thread count among `names` in `env`, as the libraries read it, or None."""
    for name in names:
        try:
            n = int(env.get(name, ""))
        except ValueError:
            continue
        if n > 0:
            return n
    return None


def _match_threads(server_env: dict[str, str]) -> None:
    """Give torch (libgomp, MKL) and OpenBLAS the thread counts a process started with this environment
    would have read when loading them, where it differs from the server's."""
    torch_vars, blas_vars = ("OMP_NUM_THREADS", "MKL_NUM_THREADS"), ("OPENBLAS_NUM_THREADS", "GOTO_NUM_THREADS",
                                                                      "OMP_NUM_THREADS")
    mine, theirs = _env_threads(os.environ, torch_vars), _env_threads(server_env, torch_vars)
    if mine != theirs and "torch" in sys.modules:
        sys.modules["torch"].set_num_threads(mine or len(os.sched_getaffinity(0)))
    mine, theirs = _env_threads(os.environ, blas_vars), _env_threads(server_env, blas_vars)
    if mine != theirs:
        import threadpoolctl  # preloaded

        threadpoolctl.threadpool_limits(mine or len(os.sched_getaffinity(0)), user_api="blas")


# -- the client ------------------------------------------------------------------------------------------

def delegate(module: str, args: list[str]) -> int | None:
    """Run `module.main(args)` in a process forked by the server: its exit code (or this process
    dies by its signal), or None where there is no server or it declines (the caller runs it itself)."""
    path = os.environ.get(ENV_VAR)
    if not path or "SLURM_JOB_ID" in os.environ:
        return None
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.connect(path)
        request = {"module": module, "args": args, "argv": sys.argv, "env": dict(os.environ), "cwd": os.getcwd(),
                   "path": sys.path, "executable": sys.executable, "prefix": sys.prefix}
        _send(sock, request, [0, 1, 2])
        reply, _ = _recv(sock)
    except OSError:
        sock.close()
        return None
    if not reply or "pid" not in reply:
        sock.close()
        return None
    pid = reply["pid"]

    def forward(signum, _frame):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signum)

    for s in FORWARDED:
        signal.signal(s, forward)
    while True:
        try:
            end, _ = _recv(sock)
            break
        except InterruptedError:
            continue
    if end is None:  # the server died under us: the command's fate is unknown
        print(f"rloo: the stage server ({path}) closed the connection before the command ended", file=sys.stderr)
        return 1
    if "signal" in end:
        for s in FORWARDED:
            signal.signal(s, signal.SIG_DFL)
        signal.signal(end["signal"], signal.SIG_DFL)
        os.kill(os.getpid(), end["signal"])
        return 128 + end["signal"]
    return end["exit"]


def cpu_seconds(path: str) -> float:
    """CPU time of the server's forked processes that have ended (their own children waited for included)."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.connect(path)
        _send(sock, {"stats": True})
        reply, _ = _recv(sock)
    return float(reply["cpu_seconds"]) if reply else 0.0


def wait_listening(path: str, timeout: float, server=None) -> None:
    """Block until the server at `path` answers (it listens once its imports are done); TimeoutError
    after `timeout` seconds, RuntimeError at once if `server` (its Popen) has exited."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            cpu_seconds(path)
            return
        except OSError:
            if server is not None and server.poll() is not None:
                raise RuntimeError(f"the stage server for {path} exited with {server.returncode}") from None
            if time.monotonic() > deadline:
                raise TimeoutError(f"the stage server at {path} did not listen within {timeout:.0f} s") from None
            time.sleep(0.2)


# -- the server ------------------------------------------------------------------------------------------

def _refusal(req: dict, env: dict[str, str], written: dict[str, str]) -> str | None:
    """Why the server will not fork `req`'s command, or None: its interpreter differs, or its import
    environment, once the imports have written theirs, differs from the server's (`env` before its imports,
    `written` what they wrote: a client that has imported threadpoolctl already holds what it writes)."""
    if os.path.realpath(req["executable"]) != os.path.realpath(sys.executable) or req["prefix"] != sys.prefix:
        return f"another interpreter ({req['executable']})"
    # Imports write with setdefault: a fresh process of the client's ends up with {**written, **its env}.
    mine, theirs = import_env({**env, **written}), import_env({**written, **req["env"]})
    if mine != theirs:
        keys = sorted(k for k in mine.keys() | theirs.keys() if mine.get(k) != theirs.get(k))
        return "a different import environment: " + ", ".join(keys)
    return None


def serve(path: str, parent: int, log=sys.stderr) -> dict:
    """Accept commands until process `parent` ends; returns only in a forked process, with its request."""
    import selectors

    env = dict(os.environ)
    for name in PRELOAD:
        with contextlib.suppress(ImportError):  # a venv without it (the vLLM tests' has no MLflow)
            __import__(name)
    # The imported modules' objects out of the collector's reach: a forked process's collections would
    # otherwise walk (and, writing their headers, copy page by page) the whole pre-imported heap.
    gc.collect()
    gc.freeze()
    # What importing wrote into the environment (torch's compile cache folder): a fresh process has it too.
    written = {k: v for k, v in os.environ.items() if env.get(k) != v}
    me = os.getpid()
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(64)
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))  # leave through `main`, which removes the socket
    sel = selectors.DefaultSelector()
    sel.register(listener, selectors.EVENT_READ, "accept")
    sel.register(wake_r, selectors.EVENT_READ, "child")
    running: dict[int, socket.socket] = {}  # forked pid -> its client's connection
    cpu = 0.0
    print(f"stage server {me}: listening on {path}", file=log, flush=True)
    while os.getppid() == parent:
        for key, _ in sel.select(timeout=1.0):
            if key.data == "accept":
                conn, _ = listener.accept()
                req, fds = _recv(conn, nfds=3)
                why = "" if req is None or req.get("stats") else _refusal(req, env, written)
                forked = bool(req) and why is None
                if forked:
                    pid = os.fork()
                    if pid == 0:
                        # the forked process: shed the server, become the client's command
                        sel.close()
                        listener.close()
                        for c in running.values():
                            c.close()
                        conn.close()
                        signal.set_wakeup_fd(-1)
                        os.close(wake_r)
                        os.close(wake_w)
                        return {**req, "fds": fds, "written": written, "server_env": env}
                    with contextlib.suppress(OSError):  # as the child does: whichever runs first
                        os.setpgid(pid, pid)
                    running[pid] = conn
                    sel.register(conn, selectors.EVENT_READ, pid)
                    _send(conn, {"pid": pid})
                for fd in fds:  # the client's streams: held here, a reader of its pipe would never see EOF
                    os.close(fd)
                if req and req.get("stats"):
                    cpu += _reap(running, sel)
                    _send(conn, {"cpu_seconds": cpu, "running": len(running)})
                elif req and why:
                    print(f"stage server: declined `{' '.join(req['argv'][:3])}`: {why}", file=log, flush=True)
                    _send(conn, {"declined": why})
                if not forked:
                    conn.close()
            elif key.data == "child":
                with contextlib.suppress(BlockingIOError):
                    os.read(wake_r, 512)
                cpu += _reap(running, sel)
            else:  # a client's connection became readable: it has gone (it sends nothing more)
                pid = key.data
                try:
                    alive = key.fileobj.recv(1)
                except OSError:
                    alive = b""
                if not alive and pid in running:
                    with contextlib.suppress(ProcessLookupError):
                        os.killpg(pid, signal.SIGKILL)
                    sel.unregister(key.fileobj)
        cpu += _reap(running, sel)
    return {}


def _reap(running: dict[int, socket.socket], sel) -> float:
    """Wait for every ended forked process: tell its client how it ended. Returns their CPU seconds."""
    cpu = 0.0
    while True:
        try:
            pid, status, ru = os.wait4(-1, os.WNOHANG)
        except ChildProcessError:
            return cpu
        if pid == 0:
            return cpu
        cpu += ru.ru_utime + ru.ru_stime
        conn = running.pop(pid, None)
        if conn is None:
            continue
        end = {"signal": os.WTERMSIG(status)} if os.WIFSIGNALED(status) else {"exit": os.waitstatus_to_exitcode(status)}
        with contextlib.suppress(KeyError, ValueError):
            sel.unregister(conn)
        with contextlib.suppress(OSError):
            _send(conn, end)
        conn.close()


def become(req: dict) -> None:
    """Turn the forked process into the client's: streams, directory, environment, sys.path, a fresh `rloo`."""
    import random
    import tempfile
    import types

    for s in (*FORWARDED, signal.SIGCHLD):
        signal.signal(s, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    os.setpgid(0, 0)  # its own process group: killed whole if the client dies
    for target, fd in enumerate(req["fds"]):
        os.dup2(fd, target)
        os.close(fd)
    os.chdir(req["cwd"])
    os.environ.clear()
    os.environ.update(req["env"])
    tempfile.tempdir = None  # from the client's TMPDIR
    for key, value in req["written"].items():  # what loading the modules writes, a fresh process has too
        os.environ.setdefault(key, value)
    cache_dir = sys.modules.get("torch._inductor.runtime.cache_dir_utils")
    if "TORCHINDUCTOR_CACHE_DIR" not in req["env"] and cache_dir:
        os.environ.pop("TORCHINDUCTOR_CACHE_DIR", None)  # torch derives it from the temporary folder on
        cache_dir.cache_dir()  # import: from the client's
    _match_threads(req["server_env"])
    sys.dont_write_bytecode = bool(os.environ.get("PYTHONDONTWRITEBYTECODE"))
    sys.argv = list(req["argv"])
    sys.path[:] = req["path"]
    for name in [m for m in sys.modules if m == "rloo" or m.startswith("rloo.")]:
        del sys.modules[name]
    sys.path_importer_cache.clear()
    importlib.invalidate_caches()
    main = types.ModuleType("__main__")
    main.__file__ = sys.argv[0]
    sys.modules["__main__"] = main
    random.seed()
    if "numpy" in sys.modules:
        sys.modules["numpy"].random.seed()


def main(argv: list[str]) -> int:
    """`python -u tests/helpers/stage_server.py SOCKET`: serve until the parent process ends; in a forked
    process, run the client's command and return its exit code."""
    if len(argv) != 1:
        print("usage: python -u tests/helpers/stage_server.py SOCKET", file=sys.stderr)
        return 2
    server, parent = os.getpid(), os.getppid()
    try:
        request = serve(argv[0], parent)
    finally:
        if os.getpid() == server:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(argv[0])
    if not request:
        return 0
    become(request)
    return importlib.import_module(request["module"]).main(request["args"])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
