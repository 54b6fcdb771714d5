"""Progress bars on a stderr that fails: drawing stops, the work goes on; and the stderr swap
around other libraries' bars undoes itself however the blocks of several threads overlap."""

from __future__ import annotations

import errno
import io
import sys
import threading

from rag_lookahead.progress import others_bars_tolerated, progress_bar


class Full:
    """A stderr on a full disk."""

    def __init__(self) -> None:
        self.writes = 0

    def write(self, text: str) -> int:
        self.writes += 1
        raise OSError(errno.ENOSPC, "No space left on device")

    def flush(self) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")


def test_a_bar_on_a_failing_stderr_stops_drawing_and_counts_on(monkeypatch):
    full = Full()
    monkeypatch.setattr(sys, "stderr", full)
    with progress_bar(total=100, mininterval=0) as bar:
        for _ in range(100):
            bar.update(1)
        assert bar.n == 100
    assert full.writes == 1  # the first failed draw silenced it
    monkeypatch.setattr(sys, "stderr", None)  # no stderr at all: no bar, no error
    with progress_bar(total=3) as bar:
        bar.update(3)


def test_overlapping_blocks_on_two_threads_put_the_real_stderr_back(monkeypatch):
    """A enters, B enters, A leaves, B leaves: B put back A's wrapper, for good (every later error
    line went into it, and after one failed write nowhere)."""
    real = Full()
    monkeypatch.setattr(sys, "stderr", real)
    a_in, b_in, a_out = threading.Event(), threading.Event(), threading.Event()

    def a() -> None:
        with others_bars_tolerated():
            a_in.set()
            b_in.wait(10)
        a_out.set()

    def b() -> None:
        a_in.wait(10)
        with others_bars_tolerated():
            b_in.set()
            a_out.wait(10)
            assert sys.stderr is not real  # still wrapped while B's block runs

    threads = [threading.Thread(target=a), threading.Thread(target=b)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(10)
    assert sys.stderr is real
    with others_bars_tolerated():
        sys.stderr.write("lost, quietly")
    assert sys.stderr is real and real.writes == 1


def test_a_stderr_set_inside_the_block_is_kept_when_it_ends(monkeypatch):
    """The block puts back the stderr it replaced only where its own wrapper is still there: a
    caller that redirected stderr inside (``contextlib.redirect_stderr`` around the load, a test
    capturing it) kept its stream, not the one from before."""
    monkeypatch.setattr(sys, "stderr", Full())
    mine = io.StringIO()
    with others_bars_tolerated():
        sys.stderr = mine
    assert sys.stderr is mine
