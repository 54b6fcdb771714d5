"""The raylet watch of ``serve --replicas`` (``serve/ray_probes.py``) on real sockets, and its calls
that may never answer: no Ray needed."""

from __future__ import annotations

import contextlib
import os
import resource
import socket
import threading
import time

import pytest

from rag_lookahead.serve import ray_probes
from rag_lookahead.serve.ray_probes import (
    EMPTY_SETTINGS_FRAME,
    HTTP2_PREFACE,
    NotGrpc,
    RayCall,
    RayletWatch,
    Unanswered,
    connect_error,
)


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


def answering(header: bytes, family: int = socket.AF_INET, host: str = "127.0.0.1") -> tuple[socket.socket, int]:
    """A listener whose one connection reads the client's HTTP/2 preface and answers ``header``
    (a frame header, 9 bytes), as a gRPC server's first frame would be; (the listener, its port)."""
    server = socket.socket(family)
    server.bind((host, 0))
    server.listen()

    def answer() -> None:
        with contextlib.suppress(OSError):
            conn, _ = server.accept()
            with conn:
                want, got = len(HTTP2_PREFACE + EMPTY_SETTINGS_FRAME), b""
                while len(got) < want and (chunk := conn.recv(want - len(got))):
                    got += chunk
                conn.sendall(header)
                conn.recv(1)  # held open until the client closes

    threading.Thread(target=answer, daemon=True).start()
    return server, server.getsockname()[1]


def frame_header(kind: int, stream: int) -> bytes:
    return bytes([0, 0, 0, kind, 0]) + stream.to_bytes(4, "big")


@pytest.mark.parametrize(
    ("first_frame", "grpc"),
    [
        (frame_header(0x4, 0), True),  # SETTINGS on stream 0: what every gRPC server sends first
        (frame_header(0x7, 0), False),  # a GOAWAY on stream 0
        (frame_header(0x4, 1), False),  # SETTINGS on a request's stream
        (b"HTTP/1.1 400 Bad Request\r\n", False),  # a web server
    ],
    ids=["settings-stream-0", "goaway-stream-0", "settings-stream-1", "http1"],
)
def test_only_a_settings_frame_on_stream_0_passes_as_grpc(first_frame, grpc):
    """RAY_ADDRESS must name Ray's GCS, a gRPC server: its first frame is SETTINGS on stream 0."""
    server, port = answering(first_frame)
    with server:
        err = connect_error(f"127.0.0.1:{port}", timeout=2.0, grpc=True)
    assert (err is None) if grpc else isinstance(err, NotGrpc), f"first frame {first_frame!r}: {err!r}"


def test_an_ipv6_address_in_brackets_is_connected_to():
    """``[::1]:6379`` is how Ray (and RayletWatch.address) write an IPv6 address: the brackets are not the host's."""
    try:
        server, port = answering(frame_header(0x4, 0), socket.AF_INET6, "::1")
    except OSError:
        pytest.skip("no IPv6 loopback here")
    with server:
        assert connect_error(f"[::1]:{port}", timeout=2.0, grpc=True) is None


def scripted_connects(monkeypatch, results: list) -> list:
    """RayletWatch's connects answer ``results`` in turn (an error, or None: connected); the list
    of the addresses asked grows with each connect. A raylet's connect that times out cannot be
    staged on a real socket reliably, hence the script."""
    asked, left = [], iter(results)

    def connect(address: str, timeout: float, grpc: bool = False):
        asked.append(address)
        return next(left)

    monkeypatch.setattr(ray_probes, "connect_error", connect)
    return asked


@pytest.mark.parametrize(
    ("connects", "gone"),
    [
        ([TimeoutError()], [False]),  # a busy machine can be slow to accept once
        ([TimeoutError(), TimeoutError()], [False, True]),  # twice in a row: gone
        ([TimeoutError(), None, TimeoutError()], [False, False, False]),  # a connect in between resets the count
        ([ConnectionRefusedError()], [True]),  # nothing listens: proof at once
    ],
)
def test_connect_timeouts_count_as_gone_only_twice_in_a_row(monkeypatch, connects, gone):
    scripted_connects(monkeypatch, connects)
    watch = RayletWatch("127.0.0.1", 1, every=0.0, misses=2)
    assert [watch.gone() for _ in connects] == gone


def test_the_raylet_is_asked_at_most_every_so_often(monkeypatch):
    """gone() is called on every loop of the serve command: a connect each time would flood the raylet."""
    asked = scripted_connects(monkeypatch, [None] * 20)
    watch = RayletWatch("127.0.0.1", 1, every=2.0)
    start = time.monotonic()
    assert not any(watch.gone() for _ in range(20))
    assert time.monotonic() - start < 2.0, "the calls took longer than the watch's period: the count says nothing"
    assert len(asked) == 1, f"{len(asked)} connects in 20 calls within 2 s"


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
