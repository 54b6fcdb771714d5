"""Ctrl-C in a command ends it quietly with exit 130, wherever it lands.

torch, transformers and LangChain take a second or two to import, before any command's own
handling of KeyboardInterrupt runs: a Ctrl-C then printed a 20-line traceback through
``import torch``. And a module being imported may swallow the interrupt (transformers then
reported "could not import Qwen2ForCausalLM", and the command told the user to delete the
model's folder). So a command runs within :func:`command_interrupts`, and an error met after a
Ctrl-C (:func:`interrupted`) is the interrupt's doing.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
from collections.abc import Callable, Iterator
from typing import NoReturn

__all__ = ["command_interrupts", "interrupted", "leave_now", "program_imported", "program_importing"]

_SEEN: list[int] = []


def interrupted() -> bool:
    """Whether a Ctrl-C reached the command running (within :func:`command_interrupts`)."""
    return bool(_SEEN)


def _exit_130(signum, frame) -> None:
    _SEEN.append(signum)
    raise SystemExit(130)


def _leave_130(signum, frame) -> None:
    """The program's own imports: nothing of the command's is open yet, so it leaves at once. An
    exception raised here may land in a callback from C++ that cannot pass it on (pybind11, as
    torch imports): the process aborted ("terminate called ... SystemExit: 130", SIGABRT)."""
    _SEEN.append(signum)
    leave_now(130)


def leave_now(code: int) -> NoReturn:
    """End the process at once with ``code`` (``os._exit``, what was printed flushed): where
    Python's own exit would wait for, or finalize under, a thread still busy in torch."""
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):  # closed, or flushing when the signal came
            stream.flush()
    os._exit(code)


def _interrupt(signum, frame) -> None:
    _SEEN.append(signum)
    raise KeyboardInterrupt


_PROGRAM: list[Callable[[], None]] = []  # the running program's ``imported`` (see program_importing)


def program_importing() -> None:
    """A module of ours starts as the program (``python -m rag_lookahead.bench.retrieval``) and
    its own imports (torch) are still to come: as in :func:`command_interrupts` with
    ``own_process``, until :func:`program_imported`. Never left: the program ends within it."""
    if not _PROGRAM:
        scope = command_interrupts(own_process=True)
        _PROGRAM.append(scope.__enter__())
        _PROGRAM.append(scope.__exit__)  # kept: the scope lives as long as the program


def program_imported() -> None:
    """The program's imports are done (see :func:`program_importing`; nothing where it was not called)."""
    if _PROGRAM:
        _PROGRAM[0]()


@contextlib.contextmanager
def command_interrupts(own_process: bool = False) -> Iterator[Callable[[], None]]:
    """Within, a command: until it calls the function this yields (its imports done), SIGINT
    exits 130 without a traceback, also where an import swallowed the exit; after, SIGINT raises
    KeyboardInterrupt as Python's own handler does, and is remembered. On leaving, SIGINT's
    handler and ``sys.excepthook`` (typer's app sets its own for good) are what they were and
    nothing is remembered (``ask.main`` may run in a caller's process). ``own_process``: the
    command is the program (a console script, ``python -m``), so a Ctrl-C during its imports ends
    the process there and then (``os._exit``), and an unexpected error leaving it keeps typer's
    hook, which shows its traceback. SIGINT is left alone off
    the main thread, or where it is not Python's default (ignored in a background job, or a
    handler of the caller's)."""
    hook, failed = sys.excepthook, False
    try:
        with _sigint_scope(_leave_130 if own_process else _exit_130) as imported:
            yield imported
    except Exception:
        failed = own_process  # on its way out of the program: typer's hook (if its app set one) shows it
        raise
    finally:
        if not failed:
            sys.excepthook = hook


@contextlib.contextmanager
def _sigint_scope(importing: Callable) -> Iterator[Callable[[], None]]:
    if threading.current_thread() is not threading.main_thread() or (
        signal.getsignal(signal.SIGINT) is not signal.default_int_handler
    ):
        yield lambda: None
        return

    def imported() -> None:
        signal.signal(signal.SIGINT, _interrupt)
        if _SEEN:
            raise SystemExit(130)

    _SEEN.clear()
    signal.signal(signal.SIGINT, importing)
    try:
        yield imported
        if _SEEN and signal.getsignal(signal.SIGINT) is importing:  # never told: an import swallowed it
            raise SystemExit(130)
    finally:
        signal.signal(signal.SIGINT, signal.default_int_handler)
        _SEEN.clear()
