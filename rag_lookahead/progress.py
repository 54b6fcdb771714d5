"""Progress bars that cannot cost the work they report on.

A bar draws on stderr; a stderr that is closed (``2>&-``), full (``2>/dev/full``) or whose reader
went away (``2>&1 | head``) made tqdm raise from ``update``, and an index build of minutes was
lost for a bar nobody could see (``--no-progress`` ran through). Here a failed draw only stops the
drawing. Bars of other libraries (transformers' "Loading weights") take ``sys.stderr`` as they
start: :func:`others_bars_tolerated` makes it such a stream for a block.
"""

from __future__ import annotations

import contextlib
import io
import sys
import threading
from collections.abc import Iterator
from typing import Any

__all__ = ["others_bars_tolerated", "progress_bar", "status_line"]

_swap_lock = threading.Lock()
_blocks = 0  # others_bars_tolerated blocks open now
_replaced = None  # the stderr they replaced


class _Tolerant:
    """A stream whose first failed write or flush silences it for good (the bar stops drawing)."""

    def __init__(self, stream) -> None:
        self._stream = stream
        self.failed = False

    def write(self, text: str) -> None:
        self._quietly(self._stream.write, text)

    def flush(self) -> None:
        self._quietly(self._stream.flush)

    def _quietly(self, call, *args) -> None:
        if self.failed:
            return
        try:
            call(*args)
        except (OSError, ValueError):  # ENOSPC, EPIPE, EIO; "I/O operation on closed file"
            self.failed = True

    def __getattr__(self, name: str) -> Any:  # isatty, fileno, encoding: as the stream has them
        return getattr(self._stream, name)


def status_line(text: str) -> None:
    """One status line on stderr ("indexing the bundled corpus", "converting the model"), best
    effort: a stderr that is full or whose reader went away made ``ask`` exit 1 with no answer and
    no word; a closed one (``2>&-``: ``sys.stderr`` is None) put the line into the answer on stdout."""
    if sys.stderr is None:
        return
    with contextlib.suppress(OSError, ValueError):
        print(text, file=sys.stderr, flush=True)


def progress_bar(*, disable: bool | None = False, **options: Any):
    """A ``tqdm.auto`` bar on stderr (``options`` as tqdm takes them) that a failing stderr only
    silences; none is drawn without a stderr (``sys.stderr`` is None under ``pythonw`` or ``2>&-``)."""
    from tqdm.auto import tqdm

    stream = sys.stderr
    if stream is None:
        return tqdm(disable=True, **options)
    return tqdm(file=_Tolerant(stream), disable=disable, **options)


@contextlib.contextmanager
def others_bars_tolerated() -> Iterator[None]:
    """``sys.stderr`` as a stream that a failure only silences, for the block: the bars of calls
    that take no stream (``from_pretrained``'s) raised ENOSPC from ``2>/dev/full``, and the load
    said that a sound converted model was unreadable."""
    global _blocks, _replaced
    with _swap_lock:  # blocks on several threads may overlap: the first in swaps, the last out restores
        if _blocks == 0:
            _replaced = sys.stderr
            sys.stderr = _Tolerant(_replaced if _replaced is not None else io.StringIO())
        _blocks += 1
    try:
        yield
    finally:
        with _swap_lock:
            _blocks -= 1
            if _blocks == 0 and isinstance(sys.stderr, _Tolerant):  # unless someone set another since
                sys.stderr = _replaced
