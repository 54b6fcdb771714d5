"""One lock between processes for the files several runs may write at once: a model folder being
converted, an index folder being built, the stored cost curves.

Every caller wants the same shape: take the lock at once if it is free; otherwise say so once
(a holder that is stopped or stuck must never make a run hang in silence), wait up to a limit,
then fail with an error of the caller's own. The lock is ``filelock``'s: an ``flock`` on POSIX,
which the kernel drops when its holder dies, so no stale lock outlives a crash.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from pathlib import Path

__all__ = ["exclusive"]


@contextlib.contextmanager
def exclusive(
    path: Path,
    timeout: float,
    *,
    on_wait: Callable[[], None] | None = None,
    on_timeout: Callable[[], Exception],
) -> Iterator[bool]:
    """Hold an exclusive lock on ``path`` (created if missing) for the block.

    ``on_wait`` runs once when another process holds it and ``timeout`` gives time to wait (none
    is announced at 0: the refusal alone is said); after ``timeout`` seconds more the exception
    ``on_timeout()`` returns is raised. Yields whether it had to wait, since a caller
    that read files before waiting may need to read them again. A lock path it cannot open (a
    read-only folder, a folder of that name) raises the ``OSError`` at once.
    """
    from filelock import FileLock, Timeout

    lock = FileLock(str(path))
    waited = False
    try:
        lock.acquire(timeout=0)
    except Timeout:
        waited = True
        if timeout <= 0:
            raise on_timeout() from None
        if on_wait is not None:
            on_wait()
        try:
            lock.acquire(timeout=timeout)
        except Timeout:
            raise on_timeout() from None
    try:
        yield waited
    finally:
        lock.release()
