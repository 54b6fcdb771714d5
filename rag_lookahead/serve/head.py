"""A deadline on the bytes a connection sends while no handler is reading them.

uvicorn's h11 protocol has none: it arms no timer when a connection opens, and the keep-alive
timer it arms after a response is cancelled by any byte received and not armed again. A client
that opens connections and sends nothing, or a request head one byte every few seconds, or a body
the server has already answered, held each connection for good (slowloris).

:func:`h11_with_limits` is uvicorn's ``H11Protocol`` with a timer of ``head_timeout``
seconds, armed when a connection opens, when the first byte of a later request head arrives,
and when a response goes out while the client is still sending a body nobody reads; it is
cancelled once the head is in (the body then has ``body_timeout``). On expiry a partly received
head gets 408 and the connection closes; otherwise the connection just closes.

The same protocol caps the connections open at once (``max_connections``): uvicorn's own
``limit_concurrency`` looks only at complete request heads, so connections that send nothing
were never counted; here one past the cap gets 503 and is closed as it opens.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Callable
from http import HTTPStatus

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from rag_lookahead.serve.api_error import ApiError, head_timed_out, too_many_connections

__all__ = ["HeadTimeoutProtocol", "h11_with_limits"]

log = logging.getLogger(__name__)

#: how long a refused connection stays open to read and drop its request (see ``_refuse``)
REFUSED_LINGER_SECONDS = 1.0
#: refused connections lingering at once, at most (beyond: closed at once; each holds a descriptor)
MAX_LINGERING = 256
_lingering = 0


class HeadTimeoutProtocol(H11Protocol):
    """``H11Protocol`` with the deadline of the module docstring; :func:`h11_with_limits`
    gives it its limits."""

    head_timeout: float = 30.0
    max_connections: int | None = None
    #: told the reason ("too_many_connections", "head_timeout") of each connection closed here
    on_closed: Callable[[str], None] | None = None

    _refused = False
    _head_timer: asyncio.TimerHandle | None = None
    _watching: str | None = None  # "head" (a request head is due) or "leftover" (an answered body)

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        if self.max_connections is not None and len(self.connections) > self.max_connections:
            self._refuse(transport)
            return
        self._watch()

    def _refuse(self, transport: asyncio.Transport) -> None:
        """Answer 503 and close gently: clients send their request at once, and a close with it
        unread turns into a TCP reset that loses the 503. So: the 503, end of our side, what the
        client still sends read and dropped, the close after a short linger (uncounted meanwhile;
        past ``MAX_LINGERING`` such connections, closed at once)."""
        global _lingering
        self._refused = True
        self.connections.discard(self)
        self._count("too_many_connections")
        log.debug("refused a connection from %s: max_connections=%d", self.client, self.max_connections)
        self._send_error(too_many_connections(self.max_connections))
        if _lingering >= MAX_LINGERING or not transport.can_write_eof():
            transport.close()
            return
        transport.write_eof()
        _lingering += 1

        def close() -> None:
            global _lingering
            _lingering -= 1
            transport.close()

        self.loop.call_later(REFUSED_LINGER_SECONDS, close)

    def data_received(self, data: bytes) -> None:
        if self._refused:
            return  # a refused connection's request: read and dropped while it lingers
        super().data_received(data)
        self._watch()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._watch()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def _watch(self) -> None:
        """Arm the timer when the client owes bytes no handler waits for, else disarm it."""
        kind = None if self.transport.is_closing() else self._owed()
        if kind != self._watching:
            self._disarm()
            if kind is not None:
                self._head_timer = self.loop.call_later(self.head_timeout, self._expired)
                self._watching = kind

    def _owed(self) -> str | None:
        theirs = self.conn.their_state
        if theirs is h11.IDLE and (self.cycle is None or self.conn.trailing_data[0]):
            return "head"  # a fresh connection, or a later head begun (idle between: keep-alive timer)
        if theirs is h11.SEND_BODY and self.conn.our_state in (h11.DONE, h11.MUST_CLOSE):
            return "leftover"
        return None

    def _disarm(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
        self._head_timer, self._watching = None, None

    def _expired(self) -> None:
        kind = self._watching
        self._head_timer, self._watching = None, None
        if self.transport.is_closing():
            return
        log.debug("closing %s: no complete request within %g s (%s)", self.client, self.head_timeout, kind)
        self._count("head_timeout")
        if kind == "head" and self.conn.our_state is h11.IDLE and self.conn.trailing_data[0]:
            self._send_error(head_timed_out(self.head_timeout))
        try:
            self.conn.send(h11.ConnectionClosed())
        except h11.LocalProtocolError:
            pass
        self.transport.close()

    def _count(self, reason: str) -> None:
        if self.on_closed is not None:
            self.on_closed(reason)

    def _send_error(self, error: ApiError) -> None:
        """Answer ``error`` with no handler, as the connection is about to close."""
        body = json.dumps(error.body()).encode()
        headers = [
            *self.server_state.default_headers,
            (b"content-type", b"application/json"),
            (b"content-length", str(len(body)).encode()),
            (b"connection", b"close"),
            *[(name.lower().encode("latin-1"), value.encode("latin-1")) for name, value in error.headers.items()],
        ]
        try:
            for event in (
                h11.Response(
                    status_code=error.status, headers=headers, reason=HTTPStatus(error.status).phrase.encode()
                ),
                h11.Data(body),
            ):
                self.transport.write(self.conn.send(event))
            self.transport.write(self.conn.send(h11.EndOfMessage()))
        except h11.LocalProtocolError:  # h11 will not answer in its state: just close
            pass


def h11_with_limits(
    head_timeout: float, max_connections: int | None, on_closed: Callable[[str], None] | None = None
) -> type[HeadTimeoutProtocol]:
    """The protocol class for uvicorn's ``http=`` option, with these limits; ``on_closed`` counts
    the connections it closes (the server's ``/metrics``)."""
    limits = {
        "head_timeout": float(head_timeout),
        "max_connections": max_connections,
        "on_closed": staticmethod(on_closed) if on_closed is not None else None,
    }
    return type("H11WithLimits", (HeadTimeoutProtocol,), limits)
