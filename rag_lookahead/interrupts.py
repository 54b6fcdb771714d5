"""Ctrl-C in a command ends it quietly with exit 130, wherever it lands.

torch, transformers and LangChain take a second or two to import, before any command's own
handling of KeyboardInterrupt runs: a Ctrl-C then printed a 20-line traceback through
``import torch``. And a module being imported may swallow the interrupt (transformers then
reported "could not import Qwen2ForCausalLM", and the command told the user to delete the
model's folder). So the commands import within :func:`quiet_while_importing`, and an error
met after a Ctrl-C (:func:`interrupted`) is the interrupt's doing.
"""

from __future__ import annotations

import contextlib
import signal
from collections.abc import Iterator

__all__ = ["interrupted", "quiet_while_importing"]

_SEEN: list[int] = []


def interrupted() -> bool:
    """Whether a Ctrl-C reached this command (since :func:`quiet_while_importing` began)."""
    return bool(_SEEN)


def _exit_130(signum, frame) -> None:
    _SEEN.append(signum)
    raise SystemExit(130)


def _interrupt(signum, frame) -> None:
    _SEEN.append(signum)
    raise KeyboardInterrupt


@contextlib.contextmanager
def quiet_while_importing() -> Iterator[None]:
    """Within: SIGINT exits 130 without a traceback, also where an import swallows the exit.
    After: SIGINT raises KeyboardInterrupt as Python's own handler does, and is remembered.
    Left alone where SIGINT is not Python's default (ignored in a background job, or a
    handler of the caller's)."""
    if signal.getsignal(signal.SIGINT) is not signal.default_int_handler:
        yield
        return
    signal.signal(signal.SIGINT, _exit_130)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, _interrupt)
    if _SEEN:
        raise SystemExit(130)
