"""The raylet watch of ``serve --replicas`` (``serve/ray_probes.py``) on real sockets, and its calls
that may never answer: no Ray needed."""

from __future__ import annotations

import contextlib
import os
import resource
import socket
import threading

import pytest

from rag_lookahead.serve.ray_probes import RayCall, RayletWatch, Unanswered


def listening() -> socket.socket:
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen()
    return server


def test_a_raylet_that_takes_connections_is_there_and_a_refused_one_is_gone_at_once():
    with listening() as server:
        port = server.getsockname()[1]
        watch = RayletWatch("127.0.0.1", port, every=0.0)
        assert not watch.gone() and not watch.gone()
    assert watch.gone()  # nothing listens on the port now: refused, which is proof


@contextlib.contextmanager
def no_free_descriptors():
    """Within: opening a socket fails with EMFILE ("Too many open files"), as in a server that
    holds many connections: the limit is set to the lowest free descriptor."""
    probe = os.open(os.devnull, os.O_RDONLY)
    os.close(probe)
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (probe, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_a_connect_error_that_says_nothing_of_the_raylet_does_not_count_as_gone():
    """Any connect error counted as a miss, so two "Too many open files" in a row (~4 s) ended a
    healthy server with "raylet died"; only refusals and timeouts tell of the raylet."""
    with listening() as server:
        watch = RayletWatch("127.0.0.1", server.getsockname()[1], every=0.0)
        with no_free_descriptors():
            with contextlib.suppress(OSError):  # the limit holds: this process can open no socket now
                socket.socket().close()
                raise AssertionError("a socket opened past the descriptor limit")
            seen = [watch.gone() for _ in range(3)]
        assert seen == [False, False, False]
        assert not watch.gone()


def test_a_call_that_has_not_returned_counts_as_unanswered_until_it_does():
    """``serve`` must not ``ray.shutdown()`` under a call still waiting inside Ray (the process died
    by SIGSEGV): a call counts until it returns or raises, even after its caller stopped waiting."""
    answer, fail = threading.Event(), threading.Event()
    before = RayCall.unanswered()  # none, unless a test before this one left a call behind
    waiting = RayCall(lambda: answer.wait(30))
    failing = RayCall(lambda: fail.wait(30) and 1 / 0)
    with pytest.raises(Unanswered):
        waiting.result(0.05)
    assert RayCall.unanswered() == before + 2
    answer.set()
    assert waiting.result(5) is True
    fail.set()
    with pytest.raises(ZeroDivisionError):
        failing.result(5)
    assert RayCall.unanswered() == before
