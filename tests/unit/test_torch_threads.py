"""Worker threads that run torch on one thread each, without changing anyone else's count."""

from __future__ import annotations

import threading

import torch

from rag_lookahead.torch_threads import one_thread_workers


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
