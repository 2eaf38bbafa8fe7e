"""Faults the tests inject into real components (not mocks): a file-size limit that makes every write
past it fail as a full disk does; a server that accepts connections and never answers."""

from __future__ import annotations

import contextlib
import resource
import socket
import threading
from collections.abc import Iterator


@contextlib.contextmanager
def file_size_limit(nbytes: int) -> Iterator[None]:
    """Writes past `nbytes` into any one file fail in this process (RLIMIT_FSIZE: EFBIG; Python ignores
    SIGXFSZ), as on a full disk: an OSError from Python's own writes, torch.save's zip writer its
    RuntimeError ("unexpected pos ..."), safetensors its SafetensorError."""
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (nbytes, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))


@contextlib.contextmanager
def silent_server() -> Iterator[tuple[int, list[socket.socket]]]:
    """A real socket on 127.0.0.1 that accepts every connection and never reads or answers (a hung
    server); yields its port and the connections it has accepted, closed on leaving."""
    listener = socket.create_server(("127.0.0.1", 0))
    held: list[socket.socket] = []

    def accept() -> None:
        while True:
            try:
                held.append(listener.accept()[0])
            except OSError:
                return

    threading.Thread(target=accept, daemon=True).start()
    try:
        yield listener.getsockname()[1], held
    finally:
        listener.close()
        for conn in held:
            conn.close()
