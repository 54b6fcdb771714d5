"""Worker threads that run torch on one thread each, without changing anyone else's count."""

from __future__ import annotations

import threading

import pytest
import torch

from rag_lookahead.torch_threads import in_passing_thread, one_thread_workers


def test_workers_compute_on_one_thread_and_the_process_default_is_kept():
    before = torch.get_num_threads()
    torch.set_num_threads(3)
    try:
        pool = one_thread_workers(2)
        try:
            assert torch.get_num_threads() == 3  # the calling thread's own count
            barrier = threading.Barrier(2)

            def task():
                barrier.wait(timeout=10)  # two tasks at once: two distinct workers
                return threading.get_ident(), torch.get_num_threads()

            seen = [f.result(timeout=20) for f in [pool.submit(task), pool.submit(task)]]
            assert {count for _, count in seen} == {1} and len({ident for ident, _ in seen}) == 2
            later: list[int] = []
            thread = threading.Thread(target=lambda: later.append(torch.get_num_threads()))
            thread.start()
            thread.join()
            assert later == [3]  # threads started after the workers take the process default again
        finally:
            pool.shutdown()
    finally:
        torch.set_num_threads(before)


def test_a_passing_thread_returns_the_value_or_raises_and_ends():
    seen: list[threading.Thread] = []

    def work(a, b=0):
        seen.append(threading.current_thread())
        if b < 0:
            raise ValueError("negative")
        return a + b

    assert in_passing_thread(work, 2, b=3) == 5
    assert seen[0] is not threading.current_thread() and not seen[0].is_alive()
    with pytest.raises(ValueError, match="negative"):
        in_passing_thread(work, 1, b=-1)
