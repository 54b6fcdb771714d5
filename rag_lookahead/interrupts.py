"""Ctrl-C in a command ends it quietly with exit 130, wherever it lands.

torch, transformers and LangChain take a second or two to import, before any command's own
handling of KeyboardInterrupt runs: a Ctrl-C then printed a 20-line traceback through
``import torch``. And a module being imported may swallow the interrupt (transformers then
reported "could not import Qwen2ForCausalLM", and the command told the user to delete the
model's folder). So a command runs within :func:`command_interrupts`, and an error met after a
Ctrl-C (:func:`interrupted`) is the interrupt's doing. A command that keeps what it made when
stopped runs within :func:`stop_signals`: SIGTERM and SIGHUP stop it as Ctrl-C does, and a
further signal cannot cut its save short.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import os
import signal
import sys
import threading
from collections.abc import Callable, Iterator
from typing import NoReturn

from rag_lookahead.progress import status_line

__all__ = [
    "Terminated",
    "command_interrupts",
    "flush_output",
    "hold_signals",
    "interrupted",
    "leave_now",
    "program_imported",
    "program_importing",
    "stop_signals",
]

_SEEN: list[int] = []


def interrupted() -> bool:
    """Whether a Ctrl-C reached the command running (within :func:`command_interrupts`), or
    SIGTERM or SIGHUP within :func:`stop_signals`."""
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


def flush_output() -> None:
    """Flush stdout and stderr, for a process about to end without Python's exit."""
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):  # closed, or flushing when the signal came
            stream.flush()


def leave_now(code: int) -> NoReturn:
    """End the process at once with ``code`` (``os._exit``, what was printed flushed): where
    Python's own exit would wait for, or finalize under, a thread still busy in torch."""
    flush_output()
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
    KeyboardInterrupt as Python's own handler does, and is remembered; one that leaves the scope
    (it landed as ``imported`` switched handlers, before typer's handling took over: a traceback
    and death by SIGINT) exits 130 without a word, as typer's would, and one raised where Python
    cannot pass it on (a ``__del__``) is delivered again. On leaving, SIGINT's
    handler and ``sys.excepthook`` (typer's app sets its own for good) are what they were and
    nothing is remembered (``ask.main`` may run in a caller's process). ``own_process``: the
    command is the program (a console script, ``python -m``), so a Ctrl-C during its imports ends
    the process there and then (``os._exit``), and an unexpected error leaving it keeps typer's
    hook, which shows its traceback, and its exit status is the one it chose (see
    :func:`_forget_caught_interrupt`). SIGINT is left alone off
    the main thread, or where it is not Python's default (ignored in a background job, or a
    handler of the caller's)."""
    if own_process:  # once: registered again, it is first taken off
        atexit.unregister(_forget_caught_interrupt)
        atexit.register(_forget_caught_interrupt)
    hook, failed = sys.excepthook, False
    try:
        with _sigint_scope(_leave_130 if own_process else _exit_130) as imported:
            yield imported
    except KeyboardInterrupt:  # one that landed before the command's own handling (typer's) took over
        raise SystemExit(130) from None
    except Exception:
        failed = own_process  # on its way out of the program: typer's hook (if its app set one) shows it
        raise
    finally:
        if not failed:
            sys.excepthook = hook


def _forget_caught_interrupt() -> None:
    """At a program's exit: CPython (3.11, 3.12) notes a KeyboardInterrupt that ends code run from
    source text (``exec``/``eval`` of a string: dataclasses and namedtuple build their methods so
    while modules import) even where it is caught later, and a program started with ``python -m``
    then kills itself by SIGINT after its exit, without a word, whatever status it chose: a
    Ctrl-C while ``ask`` loaded the model ended it -2, not 130. Evaluating source text clears
    that note first; our commands end every KeyboardInterrupt themselves (exit 130)."""
    exec("pass", {})  # noqa: S102 - a constant string: clears CPython's note, runs nothing


@contextlib.contextmanager
def _sigint_scope(importing: Callable) -> Iterator[Callable[[], None]]:
    if threading.current_thread() is not threading.main_thread() or (
        signal.getsignal(signal.SIGINT) is not signal.default_int_handler
    ):
        yield lambda: None
        return

    unraisable = sys.unraisablehook

    def imported() -> None:
        signal.signal(signal.SIGINT, _interrupt)
        sys.unraisablehook = functools.partial(_raised_again, unraisable)
        _AGAIN.open()
        if _SEEN:
            raise SystemExit(130)

    _SEEN.clear()
    signal.signal(signal.SIGINT, importing)
    ended_well = False
    try:
        yield imported
        if _SEEN and signal.getsignal(signal.SIGINT) is importing:  # never told: an import swallowed it
            raise SystemExit(130)
        ended_well = True
    except SystemExit as end:
        ended_well = end.code in (0, None)
        raise
    finally:
        missed = _AGAIN.close()
        signal.signal(signal.SIGINT, signal.default_int_handler)
        sys.unraisablehook = unraisable
        _SEEN.clear()
        if missed is not None and ended_well:  # the command ended before it could be delivered again
            raise SystemExit(128 + missed)


class _Again:
    """A signal our handler raised where Python could not pass it on (see :func:`_raised_again`),
    to deliver again a moment later from a timer thread, to the main thread: made in the hook, it
    ran at once, in the hook, and was lost. ``pthread_kill``, not ``_thread.interrupt_main``: a
    real signal wakes a main thread blocked in a ``join`` or lock (a model loading on a passing
    thread). Only while the command's scope is open: after it, the caller's own code would get it."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._live = False
        self._timer: threading.Timer | None = None  # the delivery on its way; its args hold the signal

    def open(self) -> None:
        with self._lock:
            self._live = True

    def schedule(self, signum: int) -> None:
        with self._lock:
            if not self._live or self._timer is not None:  # one on its way already
                return
            self._timer = timer = threading.Timer(0.01, self._deliver, args=(signum,))
            timer.daemon = True
        timer.start()

    def _deliver(self, signum: int) -> None:
        with self._lock:
            if self._timer is not threading.current_thread():  # cancelled by close() meanwhile
                return
            self._timer = None
            if self._live and callable(signal.getsignal(signum)):
                signal.pthread_kill(threading.main_thread().ident, signum)

    def close(self) -> int | None:
        """No more deliveries; the signal that was still to be delivered, if one was."""
        with self._lock:
            self._live = False
            timer, self._timer = self._timer, None
        if timer is None:
            return None
        timer.cancel()
        return timer.args[0]


_AGAIN = _Again()


def _raised_again(hook: Callable, unraisable) -> None:
    """``sys.unraisablehook`` within a command: a KeyboardInterrupt our handler raised where Python
    cannot pass it on (a ``__del__`` or weakref callback run by the garbage collector, often while
    a model loads) is delivered again, to land in code that can; Python printed "Exception ignored
    in ..." and the command ran on to the end, exit 0."""
    if not (isinstance(unraisable.exc_value, KeyboardInterrupt) and _SEEN):
        hook(unraisable)
        return
    signum = getattr(unraisable.exc_value, "signum", signal.SIGINT)
    while True:
        try:
            _AGAIN.schedule(signum)
            return
        except KeyboardInterrupt as again:  # a delivery landed in this hook: schedule it once more
            signum = getattr(again, "signum", signal.SIGINT)


class Terminated(KeyboardInterrupt):
    """SIGTERM or SIGHUP within :func:`stop_signals`, raised where a Ctrl-C raises KeyboardInterrupt:
    what a command keeps of its work on a Ctrl-C it keeps on these too (``timeout``, ``kill``,
    systemd and ``docker stop`` send SIGTERM; a closed terminal SIGHUP), where they killed it at once."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


_SAID = {signal.SIGINT: "interrupted", signal.SIGTERM: "terminated (SIGTERM)"}  # what a stop by each says
if hasattr(signal, "SIGHUP"):  # not on Windows
    _SAID[signal.SIGHUP] = "hung up (SIGHUP)"


def _stop(signum, frame) -> None:
    """SIGINT, SIGTERM, SIGHUP within :func:`stop_signals`: raised as KeyboardInterrupt (SIGINT) or
    :class:`Terminated`; nothing while an earlier one's is being handled (the command saves its work
    and leaves: a second Ctrl-C landed in the save, at its fsync, and lost every answer made)."""
    _SEEN.append(signum)
    handled = sys.exc_info()[1]
    while handled is not None:  # through what was raised in its handling ("raise SystemExit(130) from None")
        if isinstance(handled, KeyboardInterrupt):
            return
        handled = handled.__context__
    raise KeyboardInterrupt if signum == signal.SIGINT else Terminated(signum)


def _held(signum, frame) -> None:
    _SEEN.append(signum)


@contextlib.contextmanager
def stop_signals(own_process: bool = False) -> Iterator[None]:
    """Within, a command that keeps what it made when stopped (``except BaseException``: save, then
    raise): SIGTERM and SIGHUP raise :class:`Terminated` as SIGINT raises KeyboardInterrupt, and a
    signal that comes while one of these is being handled is noted, not raised; :func:`hold_signals`
    holds them all from there on, also after an error. A command stopped so leaves it with one line
    ("interrupted", "terminated (SIGTERM)", "hung up (SIGHUP)") and exit status 128 + the signal's
    number (130, 143, 129: what a shell gives for a process the signal ended); ``own_process`` (it is
    the program) by :func:`leave_now`, signals still held: a Ctrl-C during Python's own exit printed
    "Exception ignored ... KeyboardInterrupt" tracebacks. Left otherwise, the handlers are what they
    were. A signal ignored (``nohup``'s SIGHUP) or handled by the caller is left so, and all of them
    off the main thread."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    before = {sig: signal.getsignal(sig) for sig in _SAID}
    raising = (_interrupt, signal.default_int_handler)  # SIGINT's after command_interrupts' imports, or Python's
    ours = [
        sig for sig, handler in before.items() if handler in (raising if sig == signal.SIGINT else (signal.SIG_DFL,))
    ]
    for sig in ours:
        signal.signal(sig, _stop)
    try:
        yield
    except KeyboardInterrupt as stop:  # signals are held while it is handled (see _stop)
        signum = getattr(stop, "signum", signal.SIGINT)
        status_line(_SAID[signum])
        if own_process:
            leave_now(128 + signum)
        raise SystemExit(128 + signum) from None
    finally:
        for sig in ours:
            signal.signal(sig, before[sig])


def hold_signals() -> None:
    """Within :func:`stop_signals`, from now until it is left: SIGINT, SIGTERM and SIGHUP are noted,
    not raised (nothing outside it). For a command on its way out, before it saves what it made."""
    if threading.current_thread() is threading.main_thread():
        for sig in _SAID:
            if signal.getsignal(sig) is _stop:
                signal.signal(sig, _held)
