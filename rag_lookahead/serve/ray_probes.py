"""Cheap checks that Ray's processes are there and answer, for ``serve --replicas``
(:mod:`rag_lookahead.serve.ray_deploy`): Ray's own clients wait on a missing or dead process
for minutes, or for good, and do not hear Ctrl-C meanwhile.

- :func:`connect_error`: why nothing takes a TCP connection at a ``host:port`` (Ray's GCS, this
  node's raylet), and with ``grpc`` whether what listens answers the HTTP/2 handshake every gRPC
  server answers (:func:`speaks_grpc`; Ray's GCS is one), so that a RAY_ADDRESS naming some other
  server is refused at once.
- :class:`RayletWatch`: whether this node's raylet still takes connections while we serve.
- :class:`RayCall`: a call to Ray that the caller can stop waiting for (Ray's own calls have no timeout).

None of these imports Ray.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable
from typing import Any, ClassVar

__all__ = ["NotGrpc", "RayCall", "RayletWatch", "Unanswered", "connect_error", "speaks_grpc"]

#: What an HTTP/2 client sends first (RFC 9113 section 3.4): the fixed preface, then a SETTINGS
#: frame, here an empty one: length 0 (3 bytes), type 0x4, no flags, stream 0 (4 bytes).
HTTP2_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
EMPTY_SETTINGS_FRAME = bytes([0, 0, 0, 0x4, 0, 0, 0, 0, 0])
FRAME_HEADER_BYTES = 9
SETTINGS_FRAME_TYPE = 0x4


def speaks_grpc(sock: socket.socket, timeout: float = 2.0) -> bool:
    """Whether the server at the other end of the connected ``sock`` speaks HTTP/2, as every gRPC
    server (Ray's GCS among them) does: its first frame after our client preface must be a
    SETTINGS frame on stream 0 (RFC 9113 section 3.4). An HTTP/1.x answer, a closed connection or
    ``timeout`` seconds of silence is no. Plain-text HTTP/2 only (a Ray with TLS is not asked)."""
    sock.settimeout(timeout)
    deadline = time.monotonic() + timeout
    try:
        sock.sendall(HTTP2_PREFACE + EMPTY_SETTINGS_FRAME)
        header = b""
        while len(header) < FRAME_HEADER_BYTES:
            sock.settimeout(max(0.01, deadline - time.monotonic()))
            chunk = sock.recv(FRAME_HEADER_BYTES - len(header))
            if not chunk:  # closed before a whole frame header
                return False
            header += chunk
    except OSError:  # silence (socket.timeout is an OSError), or reset
        return False
    stream = int.from_bytes(header[5:9], "big") & 0x7FFFFFFF
    return header[3] == SETTINGS_FRAME_TYPE and stream == 0


class NotGrpc(OSError):
    """Something listens at the address but does not answer gRPC (HTTP/2), as Ray's GCS does."""


def connect_error(address: str, timeout: float, grpc: bool = False) -> OSError | None:
    """Why nothing takes a TCP connection at ``host:port`` (``[::1]:6379`` for IPv6); None where
    something listens there, or where the address is not of that form (nothing to judge by). With
    ``grpc``, a listener that does not answer gRPC's HTTP/2 handshake is a :class:`NotGrpc` too."""
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit():
        return None
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=timeout) as sock:
            if grpc and not speaks_grpc(sock):
                return NotGrpc()
    except OSError as err:
        return err
    return None


class RayletWatch:
    """Whether this node's raylet (Ray's per-node process, which runs the proxy and the replicas
    here) still takes TCP connections on its port. Why: when it dies (``kill -9``, the OOM killer)
    Ray's driver is not told: ``serve --replicas`` went on running while its port refused every
    connection, and Ray's calls to the dead node then blocked for good. Asked at most every
    ``every`` seconds. A refused connect is proof (nothing listens there); a connect that times
    out counts only after ``misses`` in a row (a busy machine can be slow to accept); other connect
    errors (too many open files) tell nothing and do not count."""

    def __init__(self, host: str, port: int, every: float = 2.0, misses: int = 2, timeout: float = 2.0) -> None:
        self.host, self.port = host, port
        self.every, self.misses, self.timeout = every, misses, timeout
        self._missed = 0
        self._next = 0.0

    @classmethod
    def of_driver(cls, ray, **options: Any) -> RayletWatch | None:
        """The watch of the raylet this Ray driver is connected to; None where it has none to
        judge by (Ray Client's ``ray://``, or a Ray that is not initialized)."""
        try:
            node = ray._private.worker.global_worker.node
            host, port = node.node_ip_address, int(node.node_manager_port)
        except Exception:  # noqa: BLE001 - Ray internals moved, or no node: nothing to watch
            return None
        return cls(host, port, **options) if host and port else None

    @property
    def address(self) -> str:
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"

    def gone(self) -> bool:
        """Whether the raylet is gone, by a connect made now unless one was made within ``every`` s."""
        now = time.monotonic()
        if now >= self._next:
            self._next = now + self.every
            err = connect_error(self.address, self.timeout)
            if err is None:
                self._missed = 0
            elif isinstance(err, ConnectionRefusedError):
                self._missed = self.misses
            elif isinstance(err, TimeoutError):
                self._missed += 1
            # any other error says nothing of the raylet (too many open files, no route): asked again later
        return self._missed >= self.misses


class Unanswered(Exception):
    """A call to Ray that gave no answer within its time (see :class:`RayCall`)."""


class RayCall:
    """A call to Ray run in a daemon thread, so that the caller can stop waiting for it: Ray's
    own calls have no timeout, and one to a dead node blocked ``serve``'s drain for good (deaf to
    SIGTERM and Ctrl-C). A call that never answers leaves its thread behind, waiting inside Ray's
    core worker: it does not keep the process from exiting, but ``ray.shutdown()`` must not run
    under it (see :meth:`unanswered`)."""

    #: the threads of the calls that have not returned yet
    _waiting: ClassVar[set[threading.Thread]] = set()

    def __init__(self, call: Callable[[], Any]) -> None:
        self.started = time.monotonic()
        self._box: dict[str, Any] = {}
        self._thread = threading.Thread(target=self._run, args=(call,), name="ray-call", daemon=True)
        RayCall._waiting.add(self._thread)
        self._thread.start()

    def _run(self, call: Callable[[], Any]) -> None:
        try:
            self._box["value"] = call()
        except BaseException as err:  # noqa: BLE001 - handed to the waiting thread
            self._box["error"] = err
        finally:
            RayCall._waiting.discard(threading.current_thread())

    @staticmethod
    def unanswered() -> int:
        """How many calls still wait on Ray, each in its thread inside Ray's core worker, which
        wakes every second to check for signals: ``ray.shutdown()`` frees the core worker under
        it (Ray issue #31145), and the process then died at its exit, by SIGSEGV or with Ray's
        "The core worker has already been shutdown" (exit 1), whichever the thread woke to."""
        return len(RayCall._waiting)

    def result(self, seconds: float = 0.0) -> Any:
        """The call's result (its exception is raised here), waiting up to ``seconds``;
        :class:`Unanswered` if it has none by then."""
        deadline = time.monotonic() + seconds
        while self._thread.is_alive():
            left = deadline - time.monotonic()
            if left <= 0:
                raise Unanswered()
            self._thread.join(min(0.1, left))
        if "error" in self._box:
            raise self._box["error"]
        return self._box.get("value")
