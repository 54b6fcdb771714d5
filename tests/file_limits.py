"""A disk that takes no more: writes to files past a size fail in the kernel, as on a full disk."""

from __future__ import annotations

import contextlib
import resource
import signal
from collections.abc import Iterator


@contextlib.contextmanager
def files_limited_to(size: int) -> Iterator[None]:
    """Within: this process's writes to a regular file past ``size`` bytes fail with EFBIG ("File
    too large"), raised by the kernel where a full disk raises ENOSPC (``RLIMIT_FSIZE``; the
    SIGXFSZ that would end the process is ignored). Creating an empty file still works, and pipes
    and pytest's in-memory ``capsys`` are no files: a test needs no mount and no root for it."""
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (size, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        signal.signal(signal.SIGXFSZ, handler)
