"""Calls a test makes where a bug would have them wait for ever: in a daemon thread, with a deadline."""

from __future__ import annotations

import threading


def finished(call, seconds: float = 60) -> list:
    """``[call()'s result, or the exception it raised]`` from a daemon thread; the test fails, rather
    than hangs, when the call has not returned in ``seconds`` (and a thread blocked for good does not
    hold the process at exit either)."""
    box: list = []

    def work() -> None:
        try:
            box.append(call())
        except BaseException as err:
            box.append(err)

    worker = threading.Thread(target=work, daemon=True)
    worker.start()
    worker.join(seconds)
    assert not worker.is_alive(), "the call hangs"
    return box


def returned(call, seconds: float = 60):
    """``call()``'s result, within ``seconds`` (see :func:`finished`); what it raised is raised here."""
    (outcome,) = finished(call, seconds)
    if isinstance(outcome, BaseException):
        raise outcome
    return outcome
