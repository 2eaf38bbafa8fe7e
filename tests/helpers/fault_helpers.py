"""Faults the tests inject into real components (not mocks): a file-size limit that makes every write
past it fail as a full disk does."""

from __future__ import annotations

import contextlib
import resource
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
