"""Worker threads that each run torch on one thread of their own.

Why: torch's thread count is per thread, but each thread that computes in parallel brings its own
team of OpenMP threads, which keep spinning for a while after each parallel region. On a CPU
with few cores, a second thread computing with a team (a query embedded in a request thread
while the engine thread decodes) slows the first far beyond its own work: one-token forwards of
the default model (bf16, 2-core Xeon) took 126-132 ms at the median with a question embedded on
another thread every ~150 ms with 2 torch threads, 88-114 ms with 1, 89 ms alone. And small jobs
(one ~230-token chunk through e5-small) scale poorly over cores anyway: one job per core, each on
one thread, runs more of them per second (see ``rag.embedders``).

A thread's team lives as long as the thread. So work that computes once on a thread that will
stay idle afterwards (loading a model on a server's main thread, whose engine decodes on a
thread of its own) runs in :func:`in_passing_thread`: its team goes when it ends. The server's
one-token forwards measured 107-140 ms with the model loaded on the main thread and 82-98 ms
with it loaded on a passing thread (default model, bf16, 2-core Xeon).

``torch.set_num_threads`` sets the calling thread's count and torch's process-wide default for
threads that have not computed yet. The workers here are started and set to one thread before
this returns, and the default is then put back, so nothing else in the process changes.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

import torch

__all__ = ["LeftRunning", "in_passing_thread", "one_thread_workers"]

_T = TypeVar("_T")


class LeftRunning(KeyboardInterrupt):
    """A Ctrl-C while :func:`in_passing_thread` waited: ``fn`` runs on, on its daemon thread. A
    program leaving now ends with ``os._exit`` (:func:`~rag_lookahead.interrupts.leave_now`):
    Python's own exit, with torch still busy on that thread, aborted (SIGABRT)."""


def in_passing_thread(fn: Callable[..., _T], *args: Any, **kwargs: Any) -> _T:
    """``fn(*args, **kwargs)`` on a new thread that has ended when this returns (or raises its
    exception). A Ctrl-C while it waits raises :class:`LeftRunning` at once: it did wait for
    the thread, and a server's Ctrl-C during the load did nothing until the model had loaded."""
    done: list = []

    def run() -> None:
        try:
            done.append((True, fn(*args, **kwargs)))
        except BaseException as error:  # noqa: BLE001 - raised on the caller's thread
            done.append((False, error))

    thread = threading.Thread(target=run, name="torch-passing", daemon=True)
    thread.start()
    try:
        thread.join()
    except KeyboardInterrupt:
        if not done:  # not ``thread.is_alive()``: Python 3.10-3.12 mark a thread whose join was interrupted as ended
            raise LeftRunning() from None
        raise
    ok, value = done[0]
    if not ok:
        raise value
    return value


def one_thread_workers(count: int, name: str = "torch-1") -> ThreadPoolExecutor:
    """An executor of ``count`` started threads, each running torch on one thread."""
    default = torch.get_num_threads()
    started = threading.Barrier(count + 1)

    def start() -> None:
        torch.get_num_threads()  # torch sets a thread's count from the default on first use: let it, then set ours
        torch.set_num_threads(1)
        started.wait()

    pool = ThreadPoolExecutor(count, thread_name_prefix=name)
    try:
        for _ in range(count):  # each task holds its thread until all are up: ``count`` distinct threads
            pool.submit(start)
        started.wait()
    except BaseException:
        pool.shutdown(wait=False, cancel_futures=True)
        raise
    finally:
        torch.set_num_threads(default)  # the process-wide default again; this thread's count unchanged
    return pool
